"""Scoring the CP predictor's cost model on a run's timed calls (experiments/cp_call_fits.py),
on calls whose times follow known laws."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import cp_call_fits
from experiments.runners import call_model

REPO = Path(__file__).resolve().parents[1]


def _calls(rng, n, law, *, cls="c", kind="k", heads=8) -> list[dict]:
    """n timed calls of one class with random piece layouts, timed by law(call)."""
    calls = []
    for _ in range(n):
        full, partial = (int(v) for v in rng.integers(1, 200, 2))
        c = {
            "id": f"{cls}-{len(calls)}",
            "class": cls,
            "kind": kind,
            "call": "attend",
            "q": 1024,
            "k": 2048 * heads,
            "heads": heads,
            "full": full,
            "partial": partial,
            "rows": int(rng.integers(1, 64)),
            "row_max": int(rng.integers(1, 64)),
            "cols": int(rng.integers(1, 64)),
            "col_max": int(rng.integers(1, 64)),
        }
        # spans that hold the heads (as the kernels' schedule does) and add up like the tiles
        c["row_span"], c["col_span"] = heads * full, heads * partial
        c["median"] = law(c)
        calls.append(c)
    return calls


def test_leave_one_out_within_a_class_sees_what_the_tile_counts_miss():
    """Times that also grow with a piece's longest row: the layout features predict every left
    out call exactly, the tile counts alone do not."""
    rng = np.random.default_rng(0)
    law = lambda c: 1.0 + 0.02 * c["full"] + 0.05 * c["partial"] + 0.3 * c["row_max"]  # noqa: E731
    calls = _calls(rng, 30, law) + _calls(rng, 3, law, cls="too few to leave one out")
    tiles = cp_call_fits.within_class_errors(calls, cp_call_fits.FEATURE_SETS["tiles"])
    layout = cp_call_fits.within_class_errors(calls, cp_call_fits.FEATURE_SETS["tiles+layout"])
    assert len(tiles) == 30 and len(layout) == 30
    assert layout.max() < 1e-6 and np.percentile(tiles, 90) > 5.0


def test_calibrated_as_the_predictor_predicts_a_class_from_its_sample():
    """Times that grow with a piece's longest key-tile column: a class calibrated on the
    predictor's default sample (SIM_TIMED_CALLS calls spanning the work) predicts its other
    calls exactly with the tiles and that column, not with the tile counts alone; a class the
    predictor would time whole is not scored."""
    rng = np.random.default_rng(5)
    law = lambda c: 2.0 + 0.01 * c["full"] + 0.04 * c["partial"] + 0.5 * c["col_max"]  # noqa: E731
    whole = cp_call_fits.SIM_TIMED_CALLS + 4  # call_model.VALIDATION_CALLS: all timed
    calls = _calls(rng, 40, law) + _calls(rng, whole, law, cls="timed whole")
    column = cp_call_fits.calibrated_errors(calls, cp_call_fits.FEATURE_SETS["tiles+column"])
    tiles = cp_call_fits.calibrated_errors(calls, cp_call_fits.FEATURE_SETS["tiles"])
    assert len(column) == len(tiles) == 40 - cp_call_fits.SIM_TIMED_CALLS
    assert column.max() < 1e-6 and np.percentile(tiles, 90) > 5.0


def test_as_the_run_checked_each_held_out_call_sees_only_the_calibration_timed_before_it():
    """Replaying a run's records in order: a held-out call is predicted from its class's
    calibrating calls timed before it (its own point's first ones included), never from
    calls timed after it, nor from other held-out calls or other classes. Here the class's
    first points follow one law and its last another: the held-out calls timed before the
    change are exact, the one after it, with a calibration call of the new law timed just
    before it at its point, is off by what that one call moves the fit."""
    rng = np.random.default_rng(7)
    names = cp_call_fits.FEATURE_SETS["spans"]
    old = lambda c: 1.0 + 0.001 * c["row_span"] + 0.003 * c["col_span"]  # noqa: E731
    new = lambda c: 40.0 + 0.01 * c["row_span"]  # noqa: E731

    def timed(calls, role):
        return [
            {**c, "id": f"{role}-{c['id']}-{rng.integers(1 << 30)}", "role": role} for c in calls
        ]

    def record(*calls):
        return {"masks": [{"simulation": {"timed_calls": [c for group in calls for c in group]}}]}

    first = timed(_calls(rng, 8, old), "calibration")
    held = timed(_calls(rng, 2, old), "held_out")
    wrong = timed(_calls(rng, 1, lambda c: 1e4), "held_out")  # a held-out call joins no fit
    stranger = timed(_calls(rng, 8, new, cls="other"), "all")  # another class's calls
    later = timed(_calls(rng, 1, new), "calibration")
    last = timed(_calls(rng, 1, old), "held_out")
    after = timed(_calls(rng, 20, new), "all")  # timed after every check: never seen by one
    records = [record(first, held), record(wrong, stranger), record(later, last), record(after)]
    errors = cp_call_fits.checked_errors(records, names)
    assert len(errors) == 4
    assert errors[:2].max() < 1e-6  # from the first point's calibration alone
    # the held-out call timed 1e4 ms, predicted by the same fit: the first law's time
    assert errors[2] == pytest.approx(100 * abs(old(wrong[0]) - 1e4) / 1e4, rel=1e-6)
    known = first + later
    coef = call_model.fit(cp_call_fits.design(known, names), [c["median"] for c in known])
    expected = float(cp_call_fits.design(last, names)[0] @ coef)
    assert errors[3] == pytest.approx(100 * abs(expected / last[0]["median"] - 1), rel=1e-3)
    assert errors[3] > 1.0  # the new law's one call moved the fit


def test_equal_layouts_spread_from_their_median():
    """Calls of one class on pieces equal in every feature are each predicted by their median
    (the error relative to the call's time, as a model's); calls alone in their layout, or of
    another class, are not compared."""
    rng = np.random.default_rng(6)
    (base,) = _calls(rng, 1, lambda c: 1.0)
    same = [{**base, "id": f"s{i}", "median": ms} for i, ms in enumerate((1.0, 1.1, 0.8))]
    other_class = {**base, "id": "o", "class": "other", "median": 5.0}
    alone = {**base, "id": "a", "full": base["full"] + 1, "median": 9.0}
    spread = cp_call_fits.equal_layout_spread([*same, other_class, alone])
    assert sorted(spread.tolist()) == pytest.approx([0.0, 100 / 11, 25.0])


def test_across_shapes_features_that_add_up_over_heads_are_scaled_by_them():
    """A call's tile counts, rows and columns add up over its heads; the longest row and column
    do not (heads run side by side)."""
    call = {"heads": 4, "full": 10, "partial": 3, "rows": 5, "row_max": 7, "cols": 6, "col_max": 2}
    names = cp_call_fits.FEATURE_SETS["tiles+layout"]
    x = cp_call_fits.design([call], names, per_head=True)[0]
    assert x.tolist() == [1.0, 40.0, 12.0, 20.0, 7.0, 24.0, 2.0]
    assert cp_call_fits.design([call], names)[0].tolist() == [1.0, 10, 3, 5, 7, 6, 2]


def test_across_shapes_a_class_rate_recovers_what_the_kinds_rate_misses():
    """Two classes of one kind at different head counts, the second 25% slower a tile: each
    predicted from the other at the kind's rate is off by 25% (or 20%), at its own rate (set
    by its median call) exact; a kind with one class gives no across-shape error."""
    rng = np.random.default_rng(1)

    def law(rate, heads):
        return lambda c: rate * (10.0 + heads * (0.2 * c["full"] + 0.5 * c["partial"]))

    calls = (
        _calls(rng, 8, law(1.0, 8), cls="a", heads=8)
        + _calls(rng, 7, law(1.25, 4), cls="b", heads=4)
        + _calls(rng, 9, law(1.0, 8), cls="alone", kind="other")
    )
    for names in cp_call_fits.FEATURE_SETS.values():  # every set, on the same classes
        errors = cp_call_fits.across_shape_errors(calls, names)
        kind = np.sort(errors["kind rate"])
        assert len(kind) == 15 and kind[:7] == pytest.approx([20.0] * 7)
        assert kind[7:] == pytest.approx([25.0] * 8)
        assert len(errors["class rate"]) == 13 and errors["class rate"].max() < 1e-6
    # the same calls 100 times shorter: below LONG_CALL_MS, not predicted across shapes
    short = [{**c, "median": c["median"] / 100} for c in calls]
    errors = cp_call_fits.across_shape_errors(short, cp_call_fits.FEATURE_SETS["tiles"])
    assert len(errors["kind rate"]) == len(errors["class rate"]) == 0


def _record(key: str, simulation: dict) -> dict:
    """A results line of a simulated point with this simulation detail."""
    return {"key": key, "status": "ok", "point": {}, "masks": [{"simulation": simulation}]}


def test_the_command_scores_a_results_file(tmp_path):
    """Two records of calls whose times are exactly linear in their tiles x heads, one call
    timed by both (a resumed run): each call counted once, every error 0."""
    rng = np.random.default_rng(2)
    law = lambda c: 20.0 + c["heads"] * (0.1 * c["full"] + 0.3 * c["partial"])  # noqa: E731
    calls = _calls(rng, 10, law, cls="a") + _calls(rng, 10, law, cls="b", heads=16)
    results = tmp_path / "results.jsonl"
    roles = ("calibration", "held_out")  # the second record's calls checked on the first's
    lines = [
        _record(
            f"p{i}", {"timed_calls": [{**c, "role": roles[i]} for c in calls[i::2] + calls[:1]]}
        )
        for i in (0, 1)
    ]
    results.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    cmd = [sys.executable, "experiments/cp_call_fits.py", f"--results={results}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "20 distinct timed calls (20 with tile layouts)" in out
    header = (
        "| features | within a class | calibrated | as the run checked | across shapes, kind "
        "rate | across shapes, class rate |"
    )
    assert header in out
    assert "pieces of equal tiles and layout" in out
    for features in cp_call_fits.FEATURE_SETS:  # classes of 10 calls: timed whole (no model)
        row = out.split(f"| {features} | ")[1].split("\n")[0]
        assert row.startswith("0.0% / 0.0% (20) | no calls | ")
        assert row.endswith("| 0.0% / 0.0% (20) | 0.0% / 0.0% (18) |")
    # as the run checked: the second record's 10 calls, each class fitted on its 5 of the
    # first (the call in both counted once, as calibration)
    for features in cp_call_fits.FEATURE_SETS:
        assert f"| {features} | 0.0% / 0.0% (20) | no calls | 0.0% / 0.0% (10) |" in out
    # per kind: the one kind, its two classes' shapes, each set's errors
    exact = "0.0% / 0.0% (20) | 0.0% / 0.0% (18)"
    assert f"| attend | 8/16 | 2 | 20 | 1024..1024 | 16384..32768 | {exact} | {exact} |" in out
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps(_record("p", {})) + "\n")
    bad = subprocess.run([*cmd[:2], f"--results={empty}"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode != 0 and "no timed calls listed" in bad.stderr


def test_spans_of_older_records_come_from_their_points_plans():
    """Timed calls recorded without spans (runs from before them) get those of the ring rank
    whose piece at their step has their tiles and layout, from the point's plan rebuilt on the
    host, for the grid's heads (the batch times the rank's heads, as the predictor's); at one
    slot a span is the whole work of the heads, a forward's column span 0
    (call_model.call_features); a call whose layout no rank's piece has, and one carried from
    another point's record, are left without; spans already recorded stay."""
    import dataclasses

    from experiments.cp_families import GPU_IMPL, preset_points, problem_plans
    from experiments.runners import call_model, frameworks
    from experiments.runners.cp_ranks_jax import PlanPieces

    point = next(
        p
        for p in preset_points([8], [8192], ["causal_document"])
        if (p.cp, p.layout, p.mode) == ("ring", "zigzag", "fwd")
    )
    point = dataclasses.replace(point, batch=2)
    ((_, index, plan),) = problem_plans([point], GPU_IMPL)
    pieces = PlanPieces(plan, GPU_IMPL, point.head_dim, frameworks.framework_dtype("jax", "bf16"))
    grid_heads = 2 * point.heads_q, 2 * point.heads_kv  # ring: every head on every rank
    want = pieces.features(*grid_heads, call_model.SLOTS)
    calls = []
    steps = {(0, 0): "attend_bwd", (3, 1): "attend_bwd", (5, 4): "attend", (7, 7): "once"}
    for (r, t), name in steps.items():
        layout = pieces.stats(r, t)
        calls.append(
            {**layout, "call": name, "step": t, "heads": 2 * point.heads_q, "heads_kv": 8, "r": r}
        )
    stray = {**calls[0], "full": calls[0]["full"] + 1}  # no piece has this layout
    carried = {**calls[1], "carried": True}
    masks = [{}] * index + [{"simulation": {"timed_calls": [*calls, stray, carried]}}]
    record = {"key": "p", "status": "ok", "point": dataclasses.asdict(point), "masks": masks}
    assert cp_call_fits.add_spans([record]) == (4, 2)
    for c in calls:
        features = call_model.call_features(c["call"], want[c["r"], c["step"]])
        assert [c["row_span"], c["col_span"]] == pytest.approx(features[1:])
    assert [c["col_span"] > 0 for c in calls] == [True, True, False, False]
    assert "row_span" not in stray and "row_span" not in carried
    assert cp_call_fits.add_spans([record]) == (0, 2)  # the others have theirs
    calls[2]["column_weight"], calls[2]["col_span"] = 2.0, -1.0  # spans of another weight
    assert cp_call_fits.add_spans([record]) == (1, 2)
    assert call_model.recorded_weights(calls[2]) == call_model.span_weights()
    assert calls[2]["col_span"] == pytest.approx(0.0)  # a forward call's, rebuilt
    assert cp_call_fits.add_spans([record], rebuild=True, slots=1) == (4, 2)
    for c in calls:
        work = c["full"] + call_model.PARTIAL_WEIGHT * c["partial"]
        column = c["full"] + call_model.COLUMN_PARTIAL_WEIGHT * c["partial"]
        assert c["row_span"] == pytest.approx(grid_heads[0] * work)
        forward = c["call"] in call_model.FORWARD_CALLS
        assert c["col_span"] == pytest.approx(0.0 if forward else grid_heads[0] * column)


def test_calibrated_calls_plot_one_panel_per_feature_set(tmp_path):
    """The calibrated calls' (predicted, measured) pairs are the ones their errors come from;
    the plot is a PNG, and a run with no class the predictor would calibrate gets none."""
    rng = np.random.default_rng(9)
    law = lambda c: 2.0 + 0.01 * c["full"] + 0.04 * c["partial"] + 0.5 * c["col_max"]  # noqa: E731
    calls = _calls(rng, 40, law)
    names = cp_call_fits.FEATURE_SETS["tiles"]
    predicted, measured = cp_call_fits.calibrated_pairs(calls, names)
    errors = cp_call_fits.calibrated_errors(calls, names)
    assert len(measured) == 40 - cp_call_fits.SIM_TIMED_CALLS and (measured > 0).all()
    np.testing.assert_allclose(errors, 100 * np.abs(predicted - measured) / measured)
    assert np.percentile(errors, 90) > 5.0  # the tiles miss the column: a spread to plot
    path = cp_call_fits.plot_calibrated(calls, str(tmp_path / "fits.png"))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cp_call_fits.plot_calibrated(calls[:10], str(tmp_path / "none.png")) is None
    assert not (tmp_path / "none.png").exists()


def test_a_timed_call_below_zero_is_left_out_and_named(tmp_path):
    """A timing fault (a median at or below zero) is said and left out: the exact calls beside
    it still score 0% (with it, its class's fits would go wrong and its error be unbounded)."""
    rng = np.random.default_rng(3)
    law = lambda c: 20.0 + c["heads"] * (0.1 * c["full"] + 0.3 * c["partial"])  # noqa: E731
    calls = _calls(rng, 10, law, cls="a") + _calls(rng, 10, law, cls="b", heads=16)
    fault = {**_calls(rng, 1, law, cls="a")[0], "id": "a-fault", "median": -0.5}
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(_record("p", {"timed_calls": [*calls, fault]})) + "\n")
    cmd = [sys.executable, "experiments/cp_call_fits.py", f"--results={results}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "left out: 1 timed calls whose median is at or below zero" in out
    assert "attend -0.5 ms" in out and "20 distinct timed calls" in out
    exact = "0.0% / 0.0% (20) | no calls | no calls | 0.0% / 0.0% (20) | 0.0% / 0.0% (18) |"
    assert f"| spans | {exact}" in out
