"""Score the CP predictor's per-call cost model on a run's timed calls, on the host.

    python experiments/cp_call_fits.py --results=OUT_DIR/results.jsonl

Every simulated record lists the calls timed for it (simulation.timed_calls: what each was
timed for, its class and kind, tokens, heads, its piece's tiles, their layout and the spans of
its kernels' schedule, median ms), so candidate models can be tried on a GPU run's calls
without a device. A call timed again by a later process (a resumed run) counts once. Records
from before the spans were recorded get them from their points' plans, rebuilt on the host
(each call matched to the ring rank whose piece at its step has its tiles and layout), and so
do all calls with --rebuild_spans, at the --slots, --partial_weight and --column_weight given,
to try other schedules. For each feature set:
- within a class (one kind at one shape; the pieces differ), each call predicted from the
  class's other calls (leave one out), as the class's calibration predicts its untimed calls;
  every set is scored on the same classes (those with enough calls for the largest set);
- as the predictor calibrates a class: the default --sim_timed_calls calls spanning its work
  (call_model.calibration_picks on the set's features), the class's other calls predicted
  (classes with more calls than those and call_model.VALIDATION_CALLS);
- as the run checked: each held-out call the run timed (not the long classes' rate checks),
  predicted from its class's calibration calls timed before it, over every point and mask the
  class served by then: for the spans, the held-out error a run made in one process states
  (a resumed process also fits the earlier process's calls of other roles);
- across shapes, each class of long calls (LONG_CALL_MS or more by its kind's tile model, as
  the predictor decides) predicted from its kind's calls at every other shape the run timed
  (the predictor has only those timed before it), at the kind's rate and at the class's own
  rate set by its median call (experiments/runners/call_model.py), the error over the class's
  other calls; every set on the same classes;
- the floor of those errors: calls of one class on pieces equal in every feature, each
  predicted by their median.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from absl import app, flags

from experiments.core.flags import SIM_TIMED_CALLS
from experiments.reports.report_parts import md_table, read_results
from experiments.runners import call_model
from experiments.runners.cp_ranks import LONG_CALL_MS

# Candidate work features beyond the constant: the tile counts; those and the longest key-tile
# column; all of the piece's layout (a kernel giving a row or a column to one CTA waits on the
# longest); the spans of the kernels' schedule (the predictor's: call_model.span_features).
FEATURE_SETS = {
    "tiles": ("full", "partial"),
    "tiles+column": ("full", "partial", "col_max"),
    "tiles+layout": ("full", "partial", "rows", "row_max", "cols", "col_max"),
    "spans": call_model.SPANS,
}
# Features that add up over heads (scaled by a call's heads across shapes); the longest row and
# column do not (heads run side by side), and the spans hold the heads already.
PER_HEAD = {"full", "partial", "rows", "cols"}
QUANTILE = call_model.ERROR_QUANTILE
ALL_FEATURES = sorted({n for names in FEATURE_SETS.values() for n in names})
MOST_FEATURES = max(map(len, FEATURE_SETS.values()))
MIN_CLASS = MOST_FEATURES + 3  # calls a class needs to leave one out, for every set alike
MIN_KIND_FIT = MOST_FEATURES + 1  # calls of other classes a kind's fit needs, for every set
GATE = FEATURE_SETS["spans"]  # the predictor's model, which decides whose calls are long


def timed_calls(records: list[dict]) -> list[dict]:
    """The timed calls of every simulated mask of the records that list them, each distinct
    call once (its latest timing)."""
    calls = {}
    for rec in records:
        for mask in rec.get("masks") or []:
            for call in (mask.get("simulation") or {}).get("timed_calls") or []:
                calls[call.get("id", len(calls))] = call
    return list(calls.values())


def add_spans(
    records: list[dict], *, rebuild: bool = False, slots: int = call_model.SLOTS,
    partial_weight: float = call_model.PARTIAL_WEIGHT,
    column_weight: float = call_model.COLUMN_PARTIAL_WEIGHT,
) -> tuple[int, int]:  # fmt: skip
    """Give the timed calls of the records' simulated JAX points without spans or with spans of
    other partial-tile weights (all of them where `rebuild`) the spans of their pieces at these
    weights, from each point's plan rebuilt on the host: the
    ring rank whose piece at the call's step has the call's tiles and layout (where several
    do, their spans' mean), as the call's features (call_model.call_features). (calls given
    spans, calls left without: carried from another point, a record this code cannot read,
    or no such piece in today's plan)."""
    from experiments.core.points import DEFAULT_IMPL, Point
    from experiments.cp_families import GPU_IMPL, problem_plans
    from experiments.runners import frameworks
    from experiments.runners.cp_ranks_jax import PlanPieces

    weights = call_model.span_weights(partial_weight, column_weight)

    def stale(call: dict) -> bool:
        return call_model.recorded_weights(call) != weights

    wanted: dict[tuple[str, int], list[dict]] = defaultdict(list)  # (point, mask) -> calls
    points, missed = {}, 0
    for rec in records:
        try:
            point = Point(**rec["point"])
        except (KeyError, TypeError):  # not a point record of this code's fields
            point = None
        planned = point is not None and (point.framework, point.impl) == ("jax", DEFAULT_IMPL)
        for index, mask in enumerate(rec.get("masks") or []):
            calls = [
                c
                for c in (mask.get("simulation") or {}).get("timed_calls") or []
                if "full" in c and (rebuild or not set(call_model.SPANS) <= c.keys() or stale(c))
            ]
            # carried calls were timed for another point's plan
            own = [c for c in calls if planned and not c.get("carried")]
            missed += len(calls) - len(own)
            if own:
                wanted[point.key, index] += own
                points[point.key] = point
    given = 0
    for modes, index, plan in problem_plans(points.values(), GPU_IMPL):
        dtype = frameworks.framework_dtype("jax", modes[0].dtype)
        pieces = PlanPieces(plan, GPU_IMPL, modes[0].head_dim, dtype)
        layouts = pieces.layouts()
        for point in modes:
            for call in wanted.pop((point.key, index), []):
                layout = {k: call[k] for k in layouts[0][0]}
                steps = pieces.index.shape[1]
                at_step = pieces.index[:, call["step"]] if call["step"] < steps else []
                matches = sorted({int(i) for i in at_step if layouts[i][0] == layout})
                if not matches:
                    missed += 1
                    continue
                heads = call["heads"], call["heads_kv"] * point.batch  # as Ranks.grid_heads
                spans = [
                    call_model.span_features(
                        *layouts[i][1], *heads, slots, partial_weight, column_weight
                    )
                    for i in matches
                ]
                features = call_model.call_features(call["call"], np.mean(spans, axis=0))
                call.update(zip(call_model.SPANS, features[1:].tolist()), **weights)
                given += 1
    return given, missed + sum(map(len, wanted.values()))  # and masks no longer planned


def design(calls: list[dict], names: tuple[str, ...], per_head: bool = False) -> np.ndarray:
    """(n, 1 + len(names)) features of the calls: a constant, then the named counts (those in
    PER_HEAD times the call's heads where per_head: one kind's calls at any shapes)."""
    x = np.array([[1.0, *(float(c[n]) for n in names)] for c in calls])
    if per_head:
        heads = np.array([c["heads"] for c in calls], np.float64)
        for j, name in enumerate(names, start=1):
            if name in PER_HEAD:
                x[:, j] *= heads
    return x


def _errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return 100.0 * np.abs(predicted - measured) / np.maximum(measured, 1e-12)


def within_class_errors(calls: list[dict], names: tuple[str, ...]) -> np.ndarray:
    """Relative errors (%) of each call of a class predicted from the class's others (leave
    one out), over every class of at least MIN_CLASS calls."""
    errors = []
    for members in _group(calls, "class").values():
        if len(members) < MIN_CLASS:
            continue
        x, y = design(members, names), _medians(members)
        for i in range(len(members)):
            rest = np.arange(len(members)) != i
            coef = call_model.fit(x[rest], y[rest])
            errors.append(_errors(x[i] @ coef, y[i]))
    return np.array(errors)


def calibrated_errors(calls: list[dict], names: tuple[str, ...]) -> np.ndarray:
    """Relative errors (%) of the calls of each class predicted from SIM_TIMED_CALLS of them
    picked as the predictor picks its calibration sample, over the classes it would model
    (more calls than those and call_model.VALIDATION_CALLS)."""
    return _errors(*calibrated_pairs(calls, names))


def calibrated_pairs(calls: list[dict], names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(predicted, measured) median ms of the calls calibrated_errors scores."""
    predicted, measured = [], []
    for members in _group(calls, "class").values():
        if len(members) <= SIM_TIMED_CALLS + call_model.VALIDATION_CALLS:
            continue
        x, y = design(members, names), _medians(members)
        picks = call_model.calibration_picks(x, SIM_TIMED_CALLS)
        rest = np.setdiff1d(np.arange(len(members)), picks)
        predicted += list(x[rest] @ call_model.fit(x[picks], y[picks]))
        measured += list(y[rest])
    return np.array(predicted), np.array(measured)


CALIBRATING_ROLES = ("calibration", "all")  # timed calls that join their class's fit


def checked_errors(records: Sequence[dict], names: tuple[str, ...]) -> np.ndarray:
    """Relative errors (%) of the run's own held-out calls (role "held_out"), each predicted
    as the predictor checked it: from its class's calibrating calls timed before it, in the
    records' order (those its own point timed first included), however many points and masks
    the class served by then. With the spans this restates that part of a one-process run's
    held-out error (the long classes' rate checks aside); with another feature set, what that
    set would have stated. One results file at a time: read_results keeps one record per
    point key."""
    calibration: dict[str, list[dict]] = defaultdict(list)
    predicted, measured, seen = [], [], set()
    for rec in records:
        for mask in rec.get("masks") or []:
            for call in (mask.get("simulation") or {}).get("timed_calls") or []:
                if not set(names) <= call.keys() or call.get("id") in seen:
                    continue
                if call.get("median", 1.0) <= 0:  # a timing fault, left out as main says
                    continue
                if call.get("id") is not None:
                    seen.add(call["id"])
                known = calibration[call["class"]]
                role = call.get("role")  # records from before roles: none
                carried = call.get("carried")  # timed for a point that failed: no check stated
                if role == "held_out" and known and not carried:
                    coef = call_model.fit(design(known, names), _medians(known))
                    predicted.append(float(design([call], names)[0] @ coef))
                    measured.append(call["median"])
                elif role in CALIBRATING_ROLES and any(call[n] for n in names):
                    known.append(call)
    return _errors(np.array(predicted), np.array(measured))


def plot_calibrated(calls: list[dict], path: str) -> Path | None:
    """One panel per feature set: each calibrated call's predicted over measured time against
    its measured time, the 5% target as a band, side by side in one image at `path`."""
    from tempfile import TemporaryDirectory

    from experiments.reports.plots import image_grid, ratio_scatter

    have = [c for c in calls if set(ALL_FEATURES) <= c.keys()]
    sets = {label: calibrated_pairs(have, names) for label, names in FEATURE_SETS.items()}
    sets = {label: pair for label, pair in sets.items() if len(pair[1])}
    ratios = np.concatenate([p / m for p, m in sets.values()] or [np.ones(1)])
    ylim = (min(0.9, ratios.min()) - 0.05, max(1.1, ratios.max()) + 0.05)  # one scale for all
    with TemporaryDirectory() as tmp:
        panels = []
        for label, (predicted, measured) in sets.items():
            p90 = np.percentile(_errors(predicted, measured), QUANTILE)
            title = f"{label}: p{QUANTILE} {p90:.1f}% ({len(measured)} calls)"
            panels.append(Path(tmp) / f"{label}.png")
            ratio_scatter(
                measured.tolist(), (predicted / measured).tolist(), panels[-1], title=title,
                xlabel="measured median ms", band=0.05, ylim=ylim,
            )  # fmt: skip
        return image_grid(panels, path)


def equal_layout_spread(calls: list[dict]) -> np.ndarray:
    """Relative errors (%) of calls predicted by the median of the calls of their class whose
    pieces have the same tiles and layout (every feature of every set): what no model of these
    features can explain, the floor of their errors (timing noise, or what the layout leaves
    out)."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for c in calls:
        if all(n in c for n in ALL_FEATURES):
            groups[(c["class"], *(c[n] for n in ALL_FEATURES))].append(c["median"])
    spread = []
    for times in groups.values():
        if len(times) > 1:
            spread += list(_errors(np.full(len(times), np.median(times)), np.array(times)))
    return np.array(spread)


def across_shape_errors(calls: list[dict], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Relative errors (%) of each class of long calls (median LONG_CALL_MS or more by the
    predictor's model, GATE) predicted from its kind's calls of other classes (of
    KIND_FIT_MIN_MS or more, at least MIN_KIND_FIT): at the kind's rate (every call of the
    class), and at the class's own rate set by its median call (the class's other calls).
    Every feature set is scored on the same classes."""
    out: dict[str, list] = {"kind rate": [], "class rate": []}
    for members in _group(calls, "kind").values():
        classes = _group(members, "class")
        for cls, own in classes.items():
            others = [c for k, v in classes.items() if k != cls for c in v]
            others = [c for c in others if c["median"] >= call_model.KIND_FIT_MIN_MS]
            if (
                len(others) < MIN_KIND_FIT
                or np.median(_kind_guess(others, own, GATE)) < LONG_CALL_MS
            ):
                continue
            guess, y = _kind_guess(others, own, names), _medians(own)
            if (guess <= 0).any():
                continue
            out["kind rate"] += list(_errors(guess, y))
            if len(own) > 1:
                ref = int(np.argsort(guess)[len(own) // 2])
                rest = np.arange(len(own)) != ref
                out["class rate"] += list(_errors(guess[rest] * y[ref] / guess[ref], y[rest]))
    return {k: np.array(v) for k, v in out.items()}


def _kind_guess(others: list[dict], own: list[dict], names: tuple[str, ...]) -> np.ndarray:
    """The times of `own` calls by the kind's model fitted on `others` (heads-scaled)."""
    coef = call_model.fit(design(others, names, True), _medians(others))
    return design(own, names, True) @ coef


def _group(calls: list[dict], field: str) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for c in calls:
        groups[c[field]].append(c)
    return groups


def _medians(calls: list[dict]) -> np.ndarray:
    return np.array([c["median"] for c in calls], np.float64)


def _cell(errors: np.ndarray) -> str:
    if not len(errors):
        return "no calls"
    return f"{np.percentile(errors, QUANTILE):.1f}% / {errors.max():.1f}% ({len(errors)})"


def score(calls: list[dict], records: Sequence[dict] = ()) -> list[dict]:
    """Per feature set: the within-class, calibrated, across-shapes errors (p90 / max (calls
    scored)), on the calls that have every feature of every set (PyTorch's have no tile
    layout), and of the run's held-out calls as it checked them (checked_errors, from the
    `records` in the run's order)."""
    have = [c for c in calls if set(ALL_FEATURES) <= c.keys()]
    rows = []
    for label, names in FEATURE_SETS.items():
        across = across_shape_errors(have, names)
        rows.append(
            {
                "features": label,
                "within a class": _cell(within_class_errors(have, names)),
                "calibrated": _cell(calibrated_errors(have, names)),
                "as the run checked": _cell(checked_errors(records, names)),
                **{f"across shapes, {k}": _cell(v) for k, v in across.items()},
            }
        )
    return rows


def by_kind(calls: list[dict]) -> list[dict]:
    """Per kind of call (most calls first): what it is, its classes' shapes, and the errors of
    each feature set within its classes and, at the class rate, across its shapes."""
    rows = []
    for members in sorted(_group(calls, "kind").values(), key=len, reverse=True):
        q, k = ({c[n] for c in members} for n in ("q", "k"))
        row = {
            "call": members[0]["call"],
            "heads": "/".join(str(h) for h in sorted({c["heads"] for c in members})),
            "classes": len(_group(members, "class")),
            "calls": len(members),
            "query tokens": f"{min(q)}..{max(q)}",
            "key tokens": f"{min(k)}..{max(k)}",
        }
        for label, names in FEATURE_SETS.items():
            if not all(n in c for c in members for n in names):
                continue
            row[f"within, {label}"] = _cell(within_class_errors(members, names))
            row[f"across, {label}"] = _cell(across_shape_errors(members, names)["class rate"])
        rows.append(row)
    return rows


def _print_table(rows: list[dict]) -> None:
    header = list(dict.fromkeys(k for r in rows for k in r))
    print("\n".join(md_table(header, [[r.get(k, "-") for k in header] for r in rows])))


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when it runs (tests import this module beside run.py,
    whose flags share absl's registry)."""
    flags.DEFINE_list("results", None, "Results files of simulated (--simulate_devices) runs.")
    flags.DEFINE_bool(
        "rebuild_spans",
        False,
        "Compute every call's spans from its point's plan (else only "
        "those of records from before the spans were recorded).",
    )
    flags.DEFINE_integer("slots", call_model.SLOTS, "CTAs at once in rebuilt spans (SMs).")
    flags.DEFINE_string(
        "plot",
        None,
        "Also write the calibrated calls' predicted / measured times per feature "
        "set as one image here (PNG).",
    )
    flags.DEFINE_float(
        "partial_weight", call_model.PARTIAL_WEIGHT, "A partial tile in full ones, rebuilt spans."
    )
    flags.DEFINE_float(
        "column_weight",
        call_model.COLUMN_PARTIAL_WEIGHT,
        "A partial tile in full ones in a key-tile column's walk, rebuilt spans.",
    )


def main(argv: list[str]) -> None:
    del argv
    if not FLAGS.results:
        raise app.UsageError("--results: give the results files of a simulated run")
    if FLAGS.slots < 1 or min(FLAGS.partial_weight, FLAGS.column_weight) < 0:
        raise app.UsageError(
            f"--slots={FLAGS.slots} must be at least 1 and --partial_weight="
            f"{FLAGS.partial_weight} and --column_weight={FLAGS.column_weight} at least 0"
        )
    records = read_results(FLAGS.results)
    given, missed = add_spans(
        records,
        rebuild=FLAGS.rebuild_spans,
        slots=FLAGS.slots,
        partial_weight=FLAGS.partial_weight,
        column_weight=FLAGS.column_weight,
    )
    if given or missed:
        print(
            f"spans from the points' plans rebuilt here ({FLAGS.slots} slots, a partial tile "
            f"{FLAGS.partial_weight:g} full ones in a row, {FLAGS.column_weight:g} in a "
            f"column): {given} calls; {missed} left without (their pieces not in today's plans)"
        )
    calls = timed_calls(records)
    faults = [c for c in calls if c.get("median", 1.0) <= 0]
    if faults:
        calls = [c for c in calls if c.get("median", 1.0) > 0]
        print(
            f"left out: {len(faults)} timed calls whose median is at or below zero (a chained "
            "timing's flushes outlasting its calls, from before that was measured again): "
            + ", ".join(f"{c.get('call')} {c.get('median')} ms" for c in faults[:3])
        )
    if not calls:
        raise app.UsageError(
            f"--results={','.join(FLAGS.results)}: no timed calls listed (records from before "
            "simulation.timed_calls, or no simulated points)"
        )
    scored = sum(1 for c in calls if "full" in c)
    print(
        f"{len(calls)} distinct timed calls ({scored} with tile layouts); relative error, "
        f"{QUANTILE}th percentile / largest (calls scored)"
    )
    _print_table(score(calls, records))
    print(
        "\nCalls of one class on pieces of equal tiles and layout, each predicted by their "
        f"median (the floor of any model of these features): {_cell(equal_layout_spread(calls))}"
    )
    print("\nPer kind of call (within a class: leave one out; across shapes: at the class rate)")
    _print_table(by_kind(calls))
    if FLAGS.plot:
        written = plot_calibrated(calls, FLAGS.plot)
        print(f"\n{written or 'no plot: no class the predictor would calibrate'}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
