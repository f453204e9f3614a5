"""The CP predictor's per-call cost model (experiments/runners/call_model.py): features counted
from tile lists, non-negative fits, calibration samples that span the work, held-out error."""

from __future__ import annotations

import numpy as np
import pytest
from tile_lists import list_spans

from attn_masks import make_mask
from attn_masks.tiles import BLOCK_FULL as FULL
from attn_masks.tiles import BLOCK_PARTIAL as PARTIAL
from attn_masks.tiles import block_map
from experiments.runners import call_model
from jax_attn.mask_arrays import prepare_mask, stack_mask_arrays


def _stepped_span(works: list[int], slots: int) -> int:
    """When the last CTA ends, stepping time one unit at a time: at each step every idle slot
    takes the next CTAs in launch order (those without work end at once)."""
    queue, left, t, end = list(works), [0] * slots, 0, 0
    while queue or any(left):
        for s in range(slots):
            while not left[s] and queue:
                left[s] = queue.pop(0)
        if any(left):
            t += 1
            left = [max(x - 1, 0) for x in left]
            end = t
    return end


def test_schedule_span_is_the_block_schedulers_list_scheduling():
    """Against a unit-step simulation on random grids; and the order matters: one long CTA
    launched last ends after the others, launched first it hides under them."""
    rng = np.random.default_rng(11)
    for _ in range(30):
        works = rng.integers(0, 9, int(rng.integers(1, 60))).tolist()
        slots = int(rng.integers(1, 12))
        assert call_model.schedule_span(works, slots) == _stepped_span(works, slots)
    assert call_model.schedule_span([3] * 10, 4) == _stepped_span([3] * 10, 4) == 9
    assert call_model.schedule_span([1] * 8 + [8], 4) == 10
    assert call_model.schedule_span([8] + [1] * 8, 4) == 8
    assert call_model.schedule_span([], 4) == call_model.schedule_span([0, 0], 4) == 0
    with pytest.raises(ValueError, match="slots=0"):
        call_model.schedule_span([1], 0)


def test_schedule_span_in_batches_and_cta_by_cta_is_list_scheduling(monkeypatch):
    """Grids of long runs of equal CTAs (a plan's key columns, placed a batch at a time) and
    grids of short CTAs after long uneven ones (batches of one or two: those go CTA by CTA on
    a heap) end when the unit-step simulation says."""
    rng = np.random.default_rng(5)
    heap_steps = []
    real = call_model.heapq.heapreplace
    monkeypatch.setattr(
        call_model.heapq, "heapreplace", lambda *a: heap_steps.append(1) or real(*a)
    )
    for _ in range(25):
        runs = int(rng.integers(2, 9))
        lengths = rng.integers(1, 70, runs)
        lengths[rng.integers(0, runs)] = 16 + int(rng.integers(0, 50))
        works = np.repeat(rng.integers(1, 7, runs), lengths).tolist()
        slots = int(rng.integers(2, 12))
        assert call_model.schedule_span(works, slots) == _stepped_span(works, slots)
    runs_alone = len(heap_steps)
    for _ in range(10):
        slots = int(rng.integers(2, 12))
        long = rng.integers(40, 80, slots).tolist()  # every slot busy, each until its own time
        works = long + [1] * int(rng.integers(slots, 6 * slots))
        assert call_model.schedule_span(works, slots) == _stepped_span(works, slots)
    assert len(heap_steps) > runs_alone  # the short CTAs went one by one


def test_features_are_the_spans_of_the_kernels_schedule():
    """Stacked pieces of unequal lists: [1, row span, column span] from the tile lists equal
    those of each mask's block map (the lists' source), counted here tile by tile: the query
    tiles launched last first for each query head, the key tiles in order for each K/V head,
    each walked for the group's heads, a partial tile as PARTIAL_WEIGHT full ones in a row and
    COLUMN_PARTIAL_WEIGHT in a column."""
    masks = [
        make_mask("causal_document", 200, seed=3),
        make_mask("sliding_window", 200, window=40),
        make_mask("full", 200),
        make_mask("share_question", 200, seed=1),
    ]
    arrays = stack_mask_arrays([prepare_mask(m, 32, 16) for m in masks])
    heads_q, heads_kv, slots = 6, 2, 5
    x = list_spans(arrays.kv, heads_q, heads_kv, slots)
    assert x.shape == (4, 3) and call_model.MIN_CALIBRATION > 3  # a timed call per feature
    w, wc = call_model.PARTIAL_WEIGHT, call_model.COLUMN_PARTIAL_WEIGHT
    for m, row in zip(masks, x):
        kinds = block_map(m, 32, 16).tolist()
        cost = [[{FULL: 1.0, PARTIAL: w}.get(k, 0.0) for k in r] for r in kinds]
        col_cost = [[{FULL: 1.0, PARTIAL: wc}.get(k, 0.0) for k in r] for r in kinds]
        rows = [sum(r) for r in cost][::-1] * heads_q
        cols = [heads_q // heads_kv * sum(r[j] for r in col_cost) for j in range(len(kinds[0]))]
        halves = [2 * c for c in cols * heads_kv]  # whole steps: a column's weights in halves
        want = [1.0, _stepped_span(rows, slots), _stepped_span(halves, slots) / 2]
        assert row.tolist() == want, m.name
        work = m.tile_counts(32, 16)
        assert call_model.span_features(*work, heads_q, heads_kv, slots).tolist() == want
    assert len(set(x[:, 2].tolist())) > 2  # the pieces' column spans differ
    area = np.array([m.area() for m in masks], np.float64).reshape(2, 2)
    dense = call_model.area_features(area, heads_q)
    assert dense.shape == (2, 2, 2) and (dense[..., 1] == heads_q * area).all()
    with pytest.raises(ValueError, match="heads_q=6 must be a positive multiple of heads_kv=4"):
        call_model.span_features(*masks[0].tile_counts(32, 16), 6, 4)


def test_a_partial_tile_weighs_more_in_a_column_walk_than_in_a_row_walk():
    """One query-tile row over one key-tile column, its tile partial, on one slot: the row
    span is its walk at PARTIAL_WEIGHT per partial tile for every query head, the column span
    at COLUMN_PARTIAL_WEIGHT (a dK/dV step masks keys first), for the group's heads of every
    K/V head; either weight can be given."""
    one = (np.array([0]), np.array([1]))
    heads_q, heads_kv = 4, 2
    x = call_model.span_features(one, one, heads_q, heads_kv, slots=1)
    assert call_model.COLUMN_PARTIAL_WEIGHT > call_model.PARTIAL_WEIGHT
    assert x.tolist() == [
        1.0,
        heads_q * call_model.PARTIAL_WEIGHT,
        heads_q * call_model.COLUMN_PARTIAL_WEIGHT,
    ]
    x = call_model.span_features(one, one, heads_q, heads_kv, 1, 1.0, 3.0)
    assert x.tolist() == [1.0, heads_q * 1.0, heads_q * 3.0]


def test_a_forward_call_has_no_column_span():
    """A forward step (attend, once) runs no key-tile kernel: its features keep the constant
    and the row span and hold 0 for the column span, stacked pieces too; a backward step keeps
    both spans; an impl's area features pass as they are."""
    x = np.array([[1.0, 30.0, 50.0], [1.0, 4.0, 9.0]])
    for call in ("attend", "once"):
        assert call_model.call_features(call, x).tolist() == [[1.0, 30.0, 0.0], [1.0, 4.0, 0.0]]
        area = call_model.area_features(np.float64(7.0), 2)
        assert call_model.call_features(call, area).tolist() == [1.0, 14.0]
    for call in ("attend_bwd", "once_bwd"):
        assert call_model.call_features(call, x).tolist() == x.tolist()
    assert x[0, 2] == 50.0  # the piece's features are not changed in place


def test_fit_recovers_non_negative_costs_and_drops_a_negative_one():
    """Recovers the costs under 0.2% noise; a cost the data make negative is dropped; the fit
    minimises relative error, so a small call is not sacrificed to large ones."""
    rng = np.random.default_rng(7)
    x = np.column_stack([np.ones(40), rng.integers(0, 500, 40), rng.integers(0, 80, 40)])
    truth = np.array([0.3, 0.011, 0.027])
    y = x @ truth * (1 + 0.002 * rng.standard_normal(40))
    np.testing.assert_allclose(call_model.fit(x, y), truth, rtol=0.05)
    # times that fall with the partial tiles: that cost is dropped (0), not made negative
    y = 1.0 + 0.01 * x[:, 1] - 0.001 * x[:, 2]
    coef = call_model.fit(x, y)
    assert coef[2] == 0 and (coef >= 0).all()
    assert np.abs(x @ coef - y).max() < np.abs(y - y.mean()).max()
    x2 = np.array([[1.0, 1.0], [1.0, 100.0], [1.0, 101.0]])
    y2 = np.array([0.1, 10.0, 10.3])  # not quite linear: the small call's error stays small
    small = abs(x2[0] @ call_model.fit(x2, y2) - 0.1) / 0.1
    assert small < 0.05
    with pytest.raises(ValueError, match="n >= 1"):
        call_model.fit(np.ones((0, 3)), np.ones(0))


def test_calibration_spans_every_feature_and_then_the_work():
    rng = np.random.default_rng(3)
    x = np.column_stack([np.ones(50), rng.permutation(50), rng.permutation(50) % 7])
    picks = call_model.calibration_picks(x, 8)
    assert len(picks) == len(set(picks.tolist())) == 8
    for j in (1, 2):
        assert x[picks, j].min() == x[:, j].min() and x[picks, j].max() == x[:, j].max()
    assert call_model.calibration_picks(x[:5], 8).tolist() == [0, 1, 2, 3, 4]
    # the slots after the extremes go to evenly spaced work quantiles, the top ones included
    work = (x[:, 1] - x[:, 1].min()) / np.ptp(x[:, 1]) + (x[:, 2] - x[:, 2].min()) / np.ptp(x[:, 2])
    rank = np.argsort(np.argsort(work, kind="stable"), kind="stable") / (len(x) - 1)
    interior = sorted(rank[picks][rank[picks] % 1 > 0])
    assert len(interior) >= 2 and interior[-1] > 0.6 and interior[0] < 0.4
    # pieces on a line of (full, partial, longest column) but one: the sample still resolves
    # every cost
    line = np.column_stack([np.ones(30), np.arange(30), 2 * np.arange(30), 3 * np.arange(30)])
    line[17, 2] = 5
    picks = call_model.calibration_picks(line, 4)
    assert 17 in picks.tolist() and np.linalg.matrix_rank(line[picks]) == 3
    with pytest.raises(ValueError, match="at least 4 timed calls, got k=3"):
        call_model.calibration_picks(x, 3)


def test_coverage_picks_time_what_the_known_calls_do_not_span():
    """A later point's pieces inside the known calls' work need no timing; those outside have
    their extremes timed, after which known and picked rows bound every new row and span what
    all rows span (so the fit interpolates)."""
    rng = np.random.default_rng(11)
    known = np.column_stack([np.ones(12), rng.uniform(10, 50, 12), rng.uniform(20, 80, 12)])
    lo, hi = known.min(axis=0), known.max(axis=0)
    inside = np.column_stack(
        [np.ones(30), rng.uniform(lo[1], hi[1], 30), rng.uniform(lo[2], hi[2], 30)]
    )
    assert call_model.coverage_picks(known, inside) == []
    wider = inside.copy()
    wider[4, 1], wider[9, 1], wider[20, 2] = 3.0, 70.0, 95.0  # below, above; above
    wider[21, 2] = 90.0  # above too, but not the largest
    picks = call_model.coverage_picks(known, wider)
    assert sorted(picks) == [4, 9, 20]
    timed = np.vstack([known, wider[picks]])
    assert (timed.min(axis=0) <= wider.min(axis=0)).all()
    assert (timed.max(axis=0) >= wider.max(axis=0)).all()
    # known calls on a line (row span = col span), new ones off it inside their box: the
    # rank rule times the one farthest from the line
    line = np.column_stack([np.ones(10), np.arange(10, 20), np.arange(10, 20)])
    off = np.column_stack([np.ones(6), np.full(6, 15.0), [15, 15, 15, 12, 15, 14]])
    picks = call_model.coverage_picks(line, off)
    assert picks == [3]
    assert np.linalg.matrix_rank(np.vstack([line, off[picks]])) == 3


def test_held_out_error_is_relative_to_the_measured_time():
    err = call_model.held_out_error([1.1, 2.0, 2.7, 4.0], [1.0, 2.0, 3.0, 4.0])
    assert err.calls == 4 and err.max_pct == pytest.approx(10.0)
    record = err.as_dict()
    assert record["error_quantile"] == call_model.ERROR_QUANTILE == 90
    assert record["quantile_error_pct"] == pytest.approx(np.percentile([10, 0, 10, 0], 90))
    assert record["held_out_ms"] == [[1.1, 1.0], [2.0, 2.0], [2.7, 3.0], [4.0, 4.0]]


def test_class_rate_is_measured_over_modelled_time():
    coef = np.array([1.0, 2.0, 0.5])
    x = np.array([[1.0, 10.0, 4.0], [1.0, 30.0, 0.0]])  # modelled 23 and 61 ms
    assert call_model.class_rate(x, [23.0 * 1.3, 61.0 * 1.3], coef) == pytest.approx(1.3)
    assert call_model.class_rate(x, [23.0, 61.0 * 2], coef) == pytest.approx((23 + 122) / 84)
    with pytest.raises(ValueError, match=r"gives these calls no time \(0.0 ms\)"):
        call_model.class_rate(x, [1.0, 1.0], np.zeros(3))


def test_rate_trend_is_log_linear_in_the_call_length():
    lengths = np.array([10.0, 100.0, 1000.0])
    rates = 2.0 * lengths**-0.05  # longer calls slower per modelled ms
    assert call_model.rate_trend(lengths, rates, 10_000.0) == pytest.approx(2.0 * 10_000**-0.05)
    assert call_model.rate_trend(lengths, rates, 100.0) == pytest.approx(rates[1])
    # off the line: a least-squares line through the logs passes through their means, so at
    # the lengths' geometric mean it gives the rates' geometric mean
    noisy = rates * np.array([1.02, 0.97, 1.01])
    at = np.exp(np.mean(np.log(lengths)))
    assert call_model.rate_trend(lengths, noisy, at) == pytest.approx(
        np.exp(np.mean(np.log(noisy)))
    )
    assert call_model.rate_trend(lengths, noisy, at) != pytest.approx(np.mean(noisy), rel=1e-6)
    # one length: the classes' mean log rate
    same = call_model.rate_trend(np.full(3, 50.0), np.array([1.0, 1.1, 1.2]), 9e3)
    assert same == pytest.approx(np.exp(np.mean(np.log([1.0, 1.1, 1.2]))))
    with pytest.raises(ValueError, match="needs classes and a positive length, got 0, 5.0"):
        call_model.rate_trend(np.array([]), np.array([]), 5.0)


def test_other_quantiles_follow_the_median_in_order():
    stats = [
        {"min": 0.9, "p20": 0.95, "median": 1.0, "p80": 1.1, "max": 1.3},
        {"min": 1.7, "p20": 1.9, "median": 2.0, "p80": 2.1, "max": 2.2},
        {"min": 2.4, "p20": 2.85, "median": 3.0, "p80": 3.3, "max": 3.9},
    ]
    ratios = call_model.quantile_ratios(stats, ("min", "p20", "median", "p80", "max"))
    assert ratios["median"] == 1.0 and ratios["min"] == pytest.approx(0.85)
    got = call_model.scaled_quantiles(5.0, ratios)
    assert got["median"] == 5.0 and got["min"] <= got["p20"] <= 5.0 <= got["p80"] <= got["max"]


def test_calls_sampled_once_give_no_spread():
    """A call timed once (all its quantiles its one sample) does not narrow the spread given
    to modelled calls, unless no call of the class was timed more than once."""
    once = {"min": 9.0, "p20": 9.0, "median": 9.0, "p80": 9.0, "max": 9.0, "n": 1}
    twice = {"min": 1.8, "p20": 1.9, "median": 2.0, "p80": 2.2, "max": 2.4, "n": 2}
    names = ("min", "p20", "median", "p80", "max")
    ratios = call_model.quantile_ratios([once, once, twice], names)
    assert ratios["min"] == pytest.approx(0.9) and ratios["max"] == pytest.approx(1.2)
    assert call_model.quantile_ratios([once], names)["max"] == 1.0


def test_map_stats_count_rows_columns_and_their_longest():
    rng = np.random.default_rng(3)
    kinds = rng.choice([0, 0, 1, 2], size=(9, 13))
    kinds[4] = 0  # a row without tiles
    kinds[:, 7] = 0  # a column without tiles
    stats = call_model.work_stats(kinds.shape, _counted(kinds))
    rows = [sum(1 for v in row if v) for row in kinds.tolist()]
    cols = [sum(1 for row in kinds.tolist() if row[j]) for j in range(13)]
    assert stats["q_tiles"] == 9 and stats["k_tiles"] == 13
    assert stats["rows"] == sum(1 for n in rows if n) == 8 and stats["row_max"] == max(rows)
    assert stats["cols"] == sum(1 for n in cols if n) == 12 and stats["col_max"] == max(cols)
    assert stats["full"] == (kinds == FULL).sum() and stats["partial"] == (kinds == PARTIAL).sum()
    nothing = np.zeros((3, 4), np.int8)
    empty = call_model.work_stats(nothing.shape, _counted(nothing))
    assert empty["rows"] == empty["row_max"] == empty["cols"] == empty["col_max"] == 0


def _counted(kinds: np.ndarray) -> call_model.PieceWork:
    """(FULL, PARTIAL) tiles per row and per column of a tile map, counted one by one."""
    rows, cols = kinds.tolist(), kinds.T.tolist()
    return tuple(
        (np.array([v.count(FULL) for v in vs]), np.array([v.count(PARTIAL) for v in vs]))
        for vs in (rows, cols)
    )
