"""The predicted-CP section of the report (--simulate_devices records): per-GPU TFLOP/s and
efficiency against the whole mask on one device, the best strategy/layout per mask and device
count, where the time goes, per-GPU TFLOP/s vs devices plots, and predicted vs measured.

    python experiments/report.py --results=sim/results.jsonl --compare_with=gpus/results.jsonl
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.core.outcomes import SCALED
from experiments.core.progress import wall_seconds
from experiments.reports import plots, published_cp, report_cp
from experiments.reports.report_parts import (
    POINT_FIELDS,
    md_table,
    point_seqlens,
    read_results,
    slug,
    write_csv,
)

HELD_OUT_PLOT = "cost_model_held_out.png"
MODEL_TARGET_PCT = 5.0  # the cost model's target: its held-out error at the 90th percentile
COLUMNS = (
    "key",
    "framework",
    "num_gpus",
    "impl",
    "kernel",
    "heads_q",
    "heads_kv",
    "head_dim",
    "dtype",
    "mask",
    "tokens_per_gpu",
    "strategy",
    "layout",
    "mode",
    "link",
    "status",
    "time_ms",
    "tflops_per_gpu",
    "tflops_per_gpu_strategy",
    "single_gpu_tflops",
    "single_gpu_status",
    "efficiency_pct",
    "compute_ms",
    "exposed_comm_ms",
    "dispatch_ms",
    "load_imbalance",
    "comm_bytes",
    "distinct_calls",
    "calls",
    "modelled_calls",
    "model_error_pct",
    "check_kind",
    "err_out",
    "error",
)
# What a simulated and a measured CP point share to be compared: the point's fields but those
# naming the simulation and the sweep, plus the Ulysses placement.
MATCH_FIELDS = (
    *(f for f in POINT_FIELDS if f not in ("simulated", "link", "grid")),
    "ulysses_intra_node",
)
TOLERANCE_PCT = 10.0


def _simulation(rec: dict) -> dict:
    masks = rec.get("masks") or []
    return (masks[0].get("simulation") if masks else None) or {}


def flat_row(rec: dict) -> dict:
    """One CSV row of a simulated record (numbers of the first mask where per mask)."""
    p = rec["point"]
    s = _simulation(rec)
    m = rec.get("metrics") or {}
    times = s.get("time_ms") or {}
    single = s.get("single_device") or {}
    check = rec.get("check") or {}
    masks = rec.get("masks") or [{}]
    row = {
        "key": rec["key"],
        "framework": p["framework"],
        "num_gpus": p["num_devices"],
        "impl": p["impl"],
        "kernel": s.get("impl"),
        "heads_q": p["heads_q"],
        "heads_kv": p["heads_kv"],
        "head_dim": p["head_dim"],
        "dtype": p["dtype"],
        "mask": p["mask"],
        "tokens_per_gpu": point_seqlens(p)[1],
        "strategy": p["cp"],
        "layout": p["layout"],
        "mode": p["mode"],
        "link": p.get("link"),
        "status": rec["status"],
        "time_ms": (m.get("time_ms") or {}).get("median"),
        "tflops_per_gpu": (m.get("tflops") or {}).get("median"),
        "tflops_per_gpu_strategy": s.get("tflops_per_gpu_strategy"),
        "single_gpu_tflops": single.get("tflops"),
        "single_gpu_status": single.get("status"),
        "efficiency_pct": m.get("efficiency_pct"),
        "compute_ms": times.get("slowest_compute"),
        "exposed_comm_ms": _exposed(times.get("exposed_comm")),
        "dispatch_ms": times.get("dispatch"),
        "load_imbalance": m.get("load_imbalance"),
        "comm_bytes": report_cp.comm_bytes(masks[0].get("comm"), p["mode"]),
        "distinct_calls": (s.get("calls") or {}).get("distinct"),
        "calls": (s.get("calls") or {}).get("total"),
        "modelled_calls": (s.get("calls") or {}).get("modelled"),
        "model_error_pct": ((s.get("calls") or {}).get("model") or {}).get("quantile_error_pct"),
        "check_kind": check.get("kind"),
        "err_out": (check.get("max_errors") or {}).get("out"),
        "error": rec.get("reason"),
    }
    return {c: row.get(c) for c in COLUMNS}


def _exposed(ms: float | None) -> float | None:
    """Exposed communication (strategy time minus the slowest compute, never below it): a
    record's float residue below zero (-4e-12 ms, before the simulator clamped it) reads 0."""
    return None if ms is None else max(ms, 0.0)


def _group(row: dict) -> tuple:
    shape = report_cp.shape(row)
    return row["mode"], shape, row["impl"], row["tokens_per_gpu"], row["link"]


def _cell(row: dict) -> str:
    """Predicted TFLOP/s and efficiency; * marks an efficiency against the mask's rate at the
    baseline cap (the whole problem is longer than one device was asked to run)."""
    if row["status"] != "ok":
        return report_cp.label(row)
    eff = row["efficiency_pct"]
    if eff is None:
        return f"{row['tflops_per_gpu']:.3g} (eff. n/a)"
    scaled = "*" if row["single_gpu_status"] == SCALED else ""
    return f"{row['tflops_per_gpu']:.3g} ({eff:.0f}%{scaled})"


def _runner_up(best: dict, oks: list[dict]) -> str:
    """The best point of another strategy than `best`'s: its strategy/layout, per-GPU TFLOP/s
    and how far behind; `~` first where the gap is under the cost model's target error, which
    the prediction cannot tell apart ("-" where no other strategy ran)."""
    others = [r for r in oks if r["strategy"] != best["strategy"]]
    if not others:
        return "-"
    r = max(others, key=lambda o: o["tflops_per_gpu"])
    behind = 100 * (1 - r["tflops_per_gpu"] / best["tflops_per_gpu"])
    near = "~ " if behind < MODEL_TARGET_PCT else ""
    return f"{near}{report_cp.series(r)} {r['tflops_per_gpu']:.3g} ({behind:.1f}% behind)"


def tables(rows: list[dict]) -> list[str]:
    """Markdown: per (mode, shape, impl, tokens/GPU, link) a table of masks x GPUs by
    strategy/layout, and the best strategy/layout of each (mask, GPUs) with the best of the
    other strategies beside it, marked where the two are closer than the model's error."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_group(r)].append(r)
    lines: list[str] = []
    for (mode, shape, impl, tokens, link), members in sorted(groups.items()):
        cols = sorted({report_cp.series(r) for r in members}, key=report_cp.series_order)
        cells: dict[tuple, dict[str, str]] = defaultdict(dict)
        oks: dict[tuple, list[dict]] = defaultdict(list)
        for r in members:
            at = (r["mask"], r["num_gpus"])
            cells[at][report_cp.series(r)] = _cell(r)
            if r["status"] == "ok":
                oks[at].append(r)
        best = {at: max(rs, key=lambda r: r["tflops_per_gpu"]) for at, rs in oks.items()}
        title = f"{mode}, {shape}, impl {impl}, {plots.seqlen_label(tokens)} tokens/GPU"
        lines += [f"### Predicted: {title}", "", f"Link model {link}.", ""]
        body = [[m, n, *(c.get(s, "") for s in cols)] for (m, n), c in sorted(cells.items())]
        lines += md_table(["mask", "GPUs", *cols], body) + [""]
        body = [
            [
                m,
                n,
                report_cp.series(b),
                f"{b['tflops_per_gpu']:.3g}",
                f"{b['compute_ms']:.3g} / {b['exposed_comm_ms']:.3g} / {b['dispatch_ms']:.3g}",
                f"{b['load_imbalance']:.2f}",
                _runner_up(b, oks[m, n]),
            ]
            for (m, n), b in sorted(best.items())
        ]
        header = ["mask", "GPUs", "best", "TFLOP/s/GPU", "compute / exposed comm / dispatch ms"]
        lines += md_table([*header, "imbalance", "next strategy"], body) + [
            "",
            "next strategy: the best point of another strategy; ~ marks one less than "
            f"{MODEL_TARGET_PCT:g}% behind (the cost model's target error at the 90th percentile), "
            "which the prediction does not tell apart from the best.",
            "",
        ]
    return lines


def scaling_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """Per (mode, shape, impl, tokens/GPU, link, mask): predicted per-GPU TFLOP/s vs GPUs, one
    line per strategy/layout, the whole mask on one GPU and the published study's figures of
    the same setting as black reference lines; points without a number are labelled
    markers."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(*_group(r), r["mask"])].append(r)
    paths = []
    for (mode, shape, impl, tokens, link, mask), members in sorted(groups.items()):
        single = {(r["num_gpus"], r["single_gpu_tflops"]) for r in members}
        ref = sorted((n, t) for n, t in single if t)
        lines = ({"one GPU, whole mask": ref} if ref else {}) | published_cp.reference_lines(
            members[0]
        )
        name = f"predicted_{mode}_{mask}_{tokens}_{shape}_{impl}_{link}"
        paths.append(
            report_cp.tflops_vs_gpus(
                members,
                out_dir / "plots" / f"{slug(name)}.png",
                title=f"predicted attn-{mode}, {mask} mask, {plots.seqlen_label(tokens)} "
                f"tokens/GPU\n{shape}, impl {impl}",
                xlabel="GPUs (simulated)",
                ylabel="predicted per-GPU TFLOP/s",
                reference=lines or None,
            )
        )
    return paths


def _match_key(point: dict) -> tuple:
    return tuple(point.get(f) for f in MATCH_FIELDS)


def _predicted_ms(rec: dict, timed_dispatch: bool) -> float:
    """A simulated point's predicted median time; its strategy part alone (mean over masks)
    when the measured point's time leaves the dispatch out (timed apart as dispatch_ms, as the
    driver records every measured CP point of either framework)."""
    if not timed_dispatch:
        return rec["metrics"]["time_ms"]["median"]
    parts = [m["simulation"]["time_ms"]["strategy"] for m in rec["masks"]]
    return sum(parts) / len(parts)


def compare(simulated: list[dict], measured: list[dict]) -> list[dict]:
    """Predicted vs measured time per simulated point that has a measured CP record of the
    same configuration (every point field but the simulation's and the sweep's)."""
    real = {
        _match_key(r["point"]): r for r in measured if report_cp.is_cp(r) and r["status"] == "ok"
    }
    out = []
    for rec in simulated:
        hit = real.get(_match_key(rec["point"]))
        if hit is None or rec["status"] != "ok":
            continue
        p = rec["point"]
        predicted = _predicted_ms(rec, timed_dispatch="dispatch_ms" in hit["metrics"])
        got = hit["metrics"]["time_ms"]["median"]
        err = 100.0 * (predicted / got - 1.0)
        out.append(
            {
                "GPUs": p["num_devices"],
                "mask": p["mask"],
                "tokens/GPU": point_seqlens(p)[1],
                "strategy/layout": f"{p['cp']}/{p['layout']}",
                "mode": p["mode"],
                "predicted ms": f"{predicted:.4g}",
                "measured ms": f"{got:.4g}",
                "error": f"{err:+.1f}%",
                f"within {TOLERANCE_PCT:.0f}%": "yes" if abs(err) <= TOLERANCE_PCT else "NO",
            }
        )
    return out


def model_error(records: list[dict]) -> list[str]:
    """One paragraph on the per-call cost model: how many calls it predicted and its error on
    the timed calls held out of its fits (every simulated mask of every record)."""
    masks = [m for r in records for m in r.get("masks") or []]
    calls = [(m.get("simulation") or {}).get("calls") or {} for m in masks]
    idle = sum(c.get("idle") or 0 for c in calls)
    modelled = sum(c.get("modelled") or 0 for c in calls) - idle  # from their tiles
    recorded = sum(c.get("recorded") or 0 for c in calls)
    if not modelled:
        return ["Cost model: not used (every distinct call was timed).", ""]
    held = [c["model"] for c in calls if c.get("model")]
    timed = sum(c.get("timed") or 0 for c in calls)
    unchecked = sum(c.get("unchecked") or 0 for c in calls)
    notes = ""  # what the run's sampling flags changed, then the calls neither timed nor modelled
    if unchecked:
        notes += (
            f" {unchecked} of the predicted calls belong to classes whose model was not checked "
            "on held-out calls (--sim_validation_share checks a share of the classes); the "
            "error is that of the checked classes' models."
        )
    if idle:
        notes += (
            f" {idle} more calls hold no tile and took the time of one such call of their class."
        )
    if recorded:
        notes += (
            f" {recorded} calls took the times that earlier processes of the run recorded "
            "(a resumed run)."
        )
    if not held:
        return [
            f"Cost model: {modelled} distinct calls predicted from their tiles, {timed} timed; "
            "no held-out error in these records (no class's model checked on held-out calls "
            "at their points).",
            "",
        ]
    n = sum(h["held_out_calls"] for h in held)
    worst = max(h["quantile_error_pct"] for h in held)
    quantile = held[0]["error_quantile"]
    top = max(h["max_error_pct"] for h in held)
    listing, pairs = held_out_pairs(records)
    if len(pairs):
        pred, meas = pairs.T
        rel = 100.0 * np.abs(pred - meas) / np.maximum(meas, 1e-12)
        pooled_line = (
            f" Pooled over the {listing} masks that list their held-out calls, the "
            f"{len(rel)} distinct ones (each once, however many points state it): "
            f"{np.percentile(rel, quantile):.1f}% at the {quantile}th percentile, "
            f"{np.mean(pred > meas) * 100:.0f}% of them predicted slower than measured "
            f"(plots/{HELD_OUT_PLOT})."
        )
    else:
        pooled_line = ""
    return [
        f"Cost model: {modelled} distinct calls predicted from their tiles (counted in every "
        f"point that makes them), {timed} timed for it or alone; on {n} timed calls held out of "
        f"the fits its error is at most {worst:.1f}% at the {quantile}th "
        f"percentile of a point (largest single error {top:.1f}%).{pooled_line}{notes}",
        "",
    ]


def held_out_pairs(records: list[dict]) -> tuple[int, np.ndarray]:
    """(masks listing them, (n, 2) predicted and measured median ms) of the cost model's
    distinct held-out calls over the records (a check every point of a class states, once)."""
    calls = [
        (m.get("simulation") or {}).get("calls") or {}
        for r in records
        for m in r.get("masks") or []
    ]
    listing = [
        c["model"]["held_out_ms"] for c in calls if (c.get("model") or {}).get("held_out_ms")
    ]
    pooled = sorted({tuple(pair) for pairs in listing for pair in pairs})
    return len(listing), np.array(pooled, np.float64).reshape(-1, 2)


def held_out_plot(records: list[dict], out_dir: Path) -> Path | None:
    """The cost model's held-out calls, predicted over measured against measured time, with
    the 5% band of its target; None where no record lists them."""
    _, pairs = held_out_pairs(records)
    if not len(pairs):
        return None
    pred, meas = pairs.T
    return plots.ratio_scatter(
        list(meas),
        list(pred / np.maximum(meas, 1e-12)),
        out_dir / "plots" / HELD_OUT_PLOT,
        title=f"cost model: {len(pairs)} held-out calls, predicted / measured",
        xlabel="measured median ms (log scale)",
        band=MODEL_TARGET_PCT / 100,
    )


COST_PARTS = ("baseline", "plan", "compile", "emulate", "reference", "calls")  # wall_s's


def predictor_cost(records: list[dict]) -> list[str]:
    """Where the predictor's own seconds went, summed over the records that say (baseline,
    plan, step programs compiled ahead, the rank check's emulation and float64 reference,
    timed calls): one line, then a table per group of points (GPUs and tokens a GPU) with the
    calls each timed and took from earlier processes' records, to see which group costs."""
    walls = [(r, w) for r in records if (w := wall_seconds(r))]
    if not walls:
        return []
    total: Counter[str] = Counter()
    groups: dict[tuple[int, int], Counter[str]] = defaultdict(Counter)
    for record, wall in walls:
        total.update(wall)
        point = record["point"]
        group = groups[point["num_devices"], point["seqlen_per_device"]]
        group.update(wall)
        group["points"] += 1
        group["seconds"] += sum(wall.values())  # older records' parts too (check)
        for mask in record.get("masks") or []:
            calls = (mask.get("simulation") or {}).get("calls") or {}
            group["timed"] += calls.get("timed") or 0
            group["recorded"] += calls.get("recorded") or 0
    spent = ", ".join(f"{part} {secs:.1f} s" for part, secs in total.items())
    points = f"{len(walls)} point{'s' if len(walls) != 1 else ''}"
    header = ["GPUs x tokens a GPU", "points", "seconds", *COST_PARTS]
    body = [
        [
            f"{n} x {plots.seqlen_label(per_device)}",
            g["points"],
            f"{g['seconds']:.1f}",
            *(f"{g[p]:.1f}" for p in COST_PARTS),
            g["timed"],
            g["recorded"],
        ]
        for (n, per_device), g in sorted(groups.items())
    ]
    return [
        f"Predictor cost: {points} took {sum(total.values()):.1f} s ({spent}).",
        "",
        *md_table([*header, "calls timed", "calls from records"], body),
        "",
    ]


def write_sim_report(
    records: list[dict], out_dir: Path, compare_with: Sequence[str] = ()
) -> dict[str, object]:
    """sim_results.csv, the plots and the markdown lines of the simulated records (and of the
    comparison with measured results files)."""
    sims = [r for r in records if report_cp.is_simulated(r)]
    rows = [flat_row(r) for r in sims]
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(rows, out_dir / "sim_results.csv", COLUMNS)
    figs = scaling_plots(rows, out_dir)
    held = held_out_plot(sims, out_dir)
    figs += [held] if held else []
    lines = [
        "## Predicted context parallelism",
        "",
        "Simulated points (--simulate_devices): every rank's local work of every step run and "
        "timed on one device, communication from the plan's bytes and a link model, ranks in "
        "lock step (docs/context_parallel.md). Cells: predicted per-GPU TFLOP/s of the whole "
        "call (with the executor's dispatch of global arrays) and, in brackets, efficiency "
        "against the whole mask on one device (*: against its rate at the shorter length "
        "--sim_baseline_max_seqlen, where the whole problem was not run on one device); "
        "unsup. = the strategy cannot run the point. "
        "Best tables: the slowest rank's compute, the communication it does not hide, and the "
        "dispatch, summed over steps.",
        "",
        *model_error(sims),
        *predictor_cost(sims),
        *tables(rows),
        *published_cp.table(rows, _cell),
    ]
    comparison = compare(sims, read_results(list(compare_with))) if compare_with else []
    if compare_with:
        lines += ["### Predicted vs measured", "", f"Measured: {', '.join(compare_with)}.", ""]
        if comparison:
            lines += md_table(list(comparison[0]), [list(c.values()) for c in comparison])
        else:
            lines += ["No measured CP point matches a simulated one."]
        lines += [""]
    return {"lines": lines, "csv": csv_path, "plots": figs, "comparison": comparison}
