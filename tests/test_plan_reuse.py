"""The CP plan's host shortcuts give what the straightforward computation gives: key blocks split
into runs once (Mask.restrict_blocks on position_runs), a bucketed plan taking its pieces from
the plan it only pads further (make_plan's like), a mask's pieces kept across its plans,
exchange rounds kept per plan, the JAX predictor's piece digests and spans kept across plans,
key lengths read without positions, and kernel spans scheduled a batch of CTAs at a time."""

from __future__ import annotations

import hashlib
import heapq

import numpy as np
import pytest
from cp_cases import all_masks, brute_dense, named_mask

from attn_masks import from_slices, joined_slices
from attn_masks.mask import PositionRuns, position_runs
from experiments.runners import call_model
from shard_strategies import make_plan
from shard_strategies import plan as plan_module
from shard_strategies.plan import padded_mask
from shard_strategies.strategies import STRATEGIES


def _random_mask(rng, n):
    """Random typed slices on a grid of cuts (no two overlap)."""
    cuts = np.unique(np.r_[0, rng.integers(1, n, int(rng.integers(0, 6))), n])
    q, k, t = [], [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        for c, d in zip(cuts[:-1], cuts[1:]):
            if rng.random() < 0.5:
                q.append([a, b]), k.append([c, d]), t.append(int(rng.integers(0, 4)))
    return from_slices(np.reshape(q, (-1, 2)), np.reshape(k, (-1, 2)), t, n, n)


def _blocks(rng, n):
    """Key blocks of every form: runs, scattered, repeated positions, empty."""
    out = []
    for _ in range(int(rng.integers(1, 7))):
        kind = rng.integers(0, 4)
        if kind == 0:
            a = int(rng.integers(0, n))
            out.append(np.arange(a, int(rng.integers(a, n + 1))))
        elif kind == 1:
            out.append(rng.permutation(n)[: int(rng.integers(1, n + 1))])
        elif kind == 2:
            out.append(rng.integers(0, n, int(rng.integers(1, 2 * n))))
        else:
            out.append(np.zeros(0, np.int64))
    return out


def _assert_same_mask(got, want):
    assert (got.seqlen_q, got.seqlen_k, got.name, got.params) == (
        want.seqlen_q,
        want.seqlen_k,
        want.name,
        want.params,
    )
    for a, b in zip(got.slices, want.slices):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("seed", range(40))
def test_restrict_blocks_on_position_runs_is_restrict_per_block(seed):
    """Blocks given as position_runs (some, or all) restrict to the very slices the per-block
    restrict gives, whose visible pairs are the dense mask's at those positions."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    mask = _random_mask(rng, n)
    dense = brute_dense(*mask.slices, n, n)
    qp = rng.permutation(n)[: int(rng.integers(1, n + 1))]
    blocks = _blocks(rng, n)
    given = [position_runs(b) if rng.random() < 0.6 else b for b in blocks]
    if seed % 3 == 0:
        given = [position_runs(b) for b in blocks]
    got = mask.restrict_blocks(qp, given)
    assert len(got) == len(blocks)
    for piece, kb in zip(got, blocks):
        _assert_same_mask(piece, mask.restrict(qp, kb))
        np.testing.assert_array_equal(piece.dense(), dense[np.ix_(qp, kb)])


def test_position_runs_are_the_runs_and_are_range_checked():
    runs = position_runs([5, 6, 7, 2, 3, 9, 9])
    assert isinstance(runs, PositionRuns) and runs.size == 7
    np.testing.assert_array_equal(runs.start, [5, 2, 9, 9])
    np.testing.assert_array_equal(runs.local, [0, 3, 5, 6])
    np.testing.assert_array_equal(runs.length, [3, 2, 1, 1])
    mask = from_slices([[0, 8]], [[0, 8]], [0], 8, 8)
    for bad in ([3, 8], [-1, 0]):
        with pytest.raises(ValueError, match="k_positions must lie in"):
            mask.restrict_blocks([0], [position_runs(bad)])


def _keys(plan, r, step):
    src = int(step.sources[r])
    return np.arange(plan.seqlen) if src < 0 else plan.layout.positions[src]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plan_pieces_are_the_padded_mask_restricted(strategy):
    """Every piece of a plan (its shards' runs shared by every rank) is the padded mask
    restricted to the rank's positions and the step's keys, one block at a time."""
    for mask in all_masks(96).values():
        for layout in ("contiguous", "zigzag", "balanced"):
            plan = make_plan(mask, 8, strategy, layout, pad_multiple=4)
            full = padded_mask(mask, plan.padded_seqlen)
            for r in range(plan.ring_size):
                for t, step in enumerate(plan.steps):
                    want = full.restrict(plan.layout.positions[r], _keys(plan, r, step))
                    _assert_same_mask(plan.pieces[r][t], want)


def _assert_same_plan(got, want):
    np.testing.assert_array_equal(got.layout.positions, want.layout.positions)
    assert (got.layout.name, got.layout.seqlen) == (want.layout.name, want.layout.seqlen)
    for field in ("strategy", "world_size", "ulysses_size", "num_windows", "inner_axis"):
        assert getattr(got, field) == getattr(want, field)
    assert (got.num_heads_q, got.num_heads_kv, got.head_dim) == (
        want.num_heads_q,
        want.num_heads_kv,
        want.head_dim,
    )
    assert got.mask is want.mask
    for a, b in ((got.steps, want.steps), (got.dropped, want.dropped)):
        assert [(s.outer, s.inner) for s in a] == [(s.outer, s.inner) for s in b]
        for s, u in zip(a, b):
            np.testing.assert_array_equal(s.sources, u.sources)
    assert len(got.pieces) == len(want.pieces)
    for row, want_row in zip(got.pieces, want.pieces):
        assert len(row) == len(want_row)
        for piece, want_piece in zip(row, want_row):
            _assert_same_mask(piece, want_piece)
    assert got.summary() == want.summary()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_plan_made_like_another_is_the_plan_made_afresh(strategy):
    """make_plan(like=plan of another pad multiple) gives the plan made without it: taken
    from like where only the padding differs (per-document zigzag and balanced shards padded
    further at their ends), made afresh where tokens move (a contiguous layout) or like is of
    another mask or strategy."""
    heads = dict(num_heads_q=8, num_heads_kv=4, head_dim=16)
    taken = 0
    for name in ("causal_document", "full_document", "share_question", "causal", "full"):
        mask = named_mask(name, 203)
        other = named_mask(name, 203, seed=1)
        for layout in ("contiguous", "zigzag", "balanced"):
            first = make_plan(mask, 4, strategy, layout, pad_multiple=2, **heads)
            for multiple in (2, 8, 32, 64):
                want = make_plan(mask, 4, strategy, layout, pad_multiple=multiple, **heads)
                got = make_plan(
                    mask, 4, strategy, layout, pad_multiple=multiple, like=first, **heads
                )
                _assert_same_plan(got, want)
                shared = got.pieces[0][0].q_ranges is first.pieces[0][0].q_ranges
                taken += shared
                if (
                    layout == "contiguous"
                    and first.ring_size > 1
                    and got.shard_len != first.shard_len
                ):
                    assert not shared  # its tokens moved: restricted afresh
                for unlike in (
                    make_plan(other, 4, strategy, layout, pad_multiple=2, **heads),
                    make_plan(mask, 4, "ring" if strategy != "ring" else "allgather", layout),
                ):
                    again = make_plan(
                        mask, 4, strategy, layout, pad_multiple=multiple, like=unlike, **heads
                    )
                    assert again.pieces[0][0].q_ranges is not unlike.pieces[0][0].q_ranges
                    _assert_same_plan(again, want)
    assert taken  # the shortcut ran


def test_plan_exchange_rounds_are_worked_out_once_per_plan():
    from shard_strategies.exchange import _both_ways, exchange_rounds, plan_exchange_rounds

    mask = named_mask("causal_document", 256)
    for layout in ("contiguous", "zigzag", "balanced"):
        plan = make_plan(mask, 8, "ring", layout)
        first = plan_exchange_rounds(plan)
        assert plan_exchange_rounds(plan) is first
        for got, want in zip(first, _both_ways(plan, exchange_rounds)):
            assert vars(got) == vars(want)


def _reference_digest(piece, tiles, intervals):
    """PlanPieces.digest as first written: the joined slices' bytes after the lengths."""
    h = hashlib.sha1(repr((piece.seqlen_q, piece.seqlen_k, tiles, intervals)).encode())
    for a in joined_slices(piece.q_ranges, piece.k_ranges, piece.types):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def test_piece_digests_and_spans_kept_across_plans_are_those_worked_out_afresh(monkeypatch):
    """A ring and a double ring of one mask hold the same pieces: the second plan's digests
    and features come from the kept ones and equal those of the straightforward computation
    (every piece's joined slices digested, every piece's spans scheduled)."""
    from collections import OrderedDict

    from experiments.runners import call_model, cp_ranks_jax
    from experiments.runners.cp_ranks_jax import PlanPieces
    from shard_strategies import jax_cp

    for store in ("_layouts_kept", "_digests_kept", "_spans_kept"):
        monkeypatch.setattr(cp_ranks_jax, store, OrderedDict())
    calls = []
    real_spans = call_model.span_features
    monkeypatch.setattr(
        call_model, "span_features", lambda *a, **k: calls.append(a) or real_spans(*a, **k)
    )
    mask = named_mask("full_document", 2048)
    plans = [
        jax_cp.executor_plan(
            mask,
            8,
            strategy,
            "zigzag",
            impl="pallas",
            num_heads_q=4,
            num_heads_kv=2,
            head_dim=64,
            dtype=np.float32,
        )  # fmt: skip
        for strategy in ("ring", "double_ring")
    ]
    spans_of = []
    for plan in plans:
        pieces = PlanPieces(plan, "pallas", 64, np.float32)
        features = pieces.features(4, 2, 7)
        for i, piece in enumerate(pieces.pieces):
            assert pieces.digest(i) == _reference_digest(piece, pieces.tiles, pieces.intervals)
        for r in range(plan.ring_size):
            for t in range(plan.num_steps):
                piece = plan.pieces[r][t]
                work = piece.tile_counts(*pieces.tiles)
                np.testing.assert_array_equal(features[r, t], real_spans(*work, 4, 2, 7))
        spans_of.append(len(calls))
    assert spans_of[0] > 0 and spans_of[1] == spans_of[0]  # the double ring's were kept


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pieces_kept_on_the_mask_are_those_of_a_plan_made_afresh(strategy, monkeypatch):
    """A plan made after others of the same mask (other strategies, layouts, lengths and
    multiples) takes the pieces they restricted where its layout is made alike, and equals
    the plan made on a fresh copy of the mask; with few pieces kept, the oldest go first."""
    heads = dict(num_heads_q=8, num_heads_kv=4, head_dim=16)
    for name in ("causal_document", "full_document", "share_question", "causal"):
        mask = named_mask(name, 203)
        for layout in ("contiguous", "zigzag", "balanced"):
            for before in ("ring", "double_ring", "allgather", "usp"):
                make_plan(mask, 8, before, layout, pad_multiple=4)
            fresh = from_slices(*mask.slices, mask.seqlen_q, name=mask.name, params=mask.params)
            for multiple in (4, 8):
                got = make_plan(mask, 8, strategy, layout, pad_multiple=multiple, **heads)
                want = make_plan(fresh, 8, strategy, layout, pad_multiple=multiple, **heads)
                object.__setattr__(want, "mask", mask)  # _assert_same_plan checks identity
                _assert_same_plan(got, want)
    mask = named_mask("causal_document", 203)
    ring = make_plan(mask, 8, "ring", "zigzag")
    assert make_plan(mask, 8, "double_ring", "zigzag").pieces[3][0] in ring.pieces[3]
    monkeypatch.setattr(plan_module, "PIECES_KEPT", 10)
    make_plan(mask, 8, "ring", "balanced")
    kept = mask.__dict__["_plan_pieces"]
    assert len(kept) == 10 and all(key[0][1] == "balanced" for key in kept)
    again = make_plan(mask, 8, "ring", "zigzag")
    assert again.pieces[0][0] is not ring.pieces[0][0]  # dropped: restricted afresh
    _assert_same_plan(again, ring)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_key_counts_are_the_key_positions_lengths(strategy):
    """CPPlan.key_counts equals len(key_positions) of every ring rank and kept step."""
    for mask in all_masks(96).values():
        for layout in ("contiguous", "zigzag", "balanced"):
            plan = make_plan(mask, 8, strategy, layout, pad_multiple=4)
            want = [
                [len(plan.key_positions(r, t)) for t in range(plan.num_steps)]
                for r in range(plan.ring_size)
            ]
            assert plan.key_counts.tolist() == want


def _heap_span(works, slots):
    """List scheduling CTA by CTA: each CTA (in launch order) on the slot that comes free
    first; CTAs without work end as they start."""
    ends = [0.0] * slots
    for w in np.ravel(np.asarray(works, np.float64)).tolist():
        if w > 0:
            heapq.heapreplace(ends, ends[0] + w)
    return max(ends)


def test_schedule_span_in_batches_is_cta_by_cta_list_scheduling():
    """On random grids of integer, fractional and equal-run works (zero-work CTAs, ties,
    one slot, more slots than CTAs), schedule_span gives the CTA-by-CTA heap's end exactly."""
    rng = np.random.default_rng(17)
    for trial in range(300):
        n, slots = int(rng.integers(0, 400)), int(rng.integers(1, 40))
        kind = trial % 3
        if kind == 0:
            works = rng.integers(0, 12, n).astype(np.float64)
        elif kind == 1:
            works = rng.random(n) * rng.choice([0.1, 1.0, 300.0]) * (rng.random(n) > 0.1)
        else:
            runs = int(rng.integers(1, 9))
            works = np.repeat(rng.integers(0, 6, runs) * 1.5, rng.integers(1, 80, runs))
        assert call_model.schedule_span(works, slots) == _heap_span(works, slots)
    assert call_model.schedule_span(np.zeros(0), 3) == _heap_span([], 3) == 0.0
    assert call_model.schedule_span([5.0, 1.0, 1.0, 1.0], 1) == 8.0
