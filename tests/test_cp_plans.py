"""Framework-neutral CP plans: layouts, per-step mask pieces, schedules, balance, comm volume."""

import subprocess
import sys

import numpy as np
import pytest
from cp_cases import all_masks, named_mask

import shard_strategies as ss
from attn_masks import from_slices
from attn_masks.generators import make_mask
from shard_strategies import schedules

SEQLEN = 100
MASKS = all_masks(SEQLEN)
CONFIGS = [  # (strategy, world size, ulysses size, num_windows)
    ("ring", 4, None, None),
    ("ring", 8, None, None),
    ("allgather", 4, None, None),
    ("ulysses", 4, None, None),
    ("usp", 8, 2, None),
    ("usp", 8, 4, None),
    ("double_ring", 8, None, None),
    ("double_ring", 8, 2, 2),
]


def _global_cover(plan: ss.CPPlan) -> np.ndarray:
    """How often each (query, key) pair of the padded square is covered by some piece."""
    s = plan.padded_seqlen
    count = np.zeros((s, s), np.int64)
    for r in range(plan.ring_size):
        q_pos = plan.layout.positions[r]
        for t in range(plan.num_steps):
            count[np.ix_(q_pos, plan.key_positions(r, t))] += plan.pieces[r][t].dense()
    return count


def test_import_is_numpy_only():
    code = "import sys, shard_strategies; print('jax' in sys.modules or 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("layout", ss.LAYOUTS)
@pytest.mark.parametrize("ring_size", [1, 2, 3, 8])
@pytest.mark.parametrize("mask_name", ["causal", "causal_document", "random_slices"])
def test_layout_is_a_permutation(layout, ring_size, mask_name):
    mask = MASKS[mask_name]
    lay = ss.make_layout(mask, ring_size, layout, multiple=2)
    order = lay.order()
    assert lay.shard_len % 2 == 0
    assert np.array_equal(np.sort(order), np.arange(lay.padded_seqlen))
    x = np.random.default_rng(0).standard_normal(SEQLEN)
    padded = np.concatenate([x, np.zeros(lay.padded_seqlen - SEQLEN)])
    assert np.array_equal(padded[order][lay.inverse()], x)
    assert lay.is_padding().sum() == lay.padded_seqlen - SEQLEN


def test_zigzag_whole_sequence_chunks():
    lay = ss.make_layout(make_mask("causal", 64), 4, "zigzag")
    chunks = np.arange(64).reshape(8, 8)
    for r in range(4):
        assert np.array_equal(lay.positions[r], np.concatenate([chunks[r], chunks[7 - r]]))


def test_zigzag_per_document_head_tail():
    mask = make_mask("causal_document", 40, seqlens=[16, 24])
    lay = ss.make_layout(mask, 2, "zigzag")
    # doc 0: 4 chunks of 4; doc 1: 4 chunks of 6; rank r holds chunks r and 3 - r of each
    assert lay.positions[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, *range(16, 22), *range(34, 40)]
    assert lay.positions[1].tolist() == [*range(4, 12), *range(22, 34)]


def test_zigzag_pads_each_document():
    mask = make_mask("causal_document", 10, seqlens=[3, 7])
    lay = ss.make_layout(mask, 2, "zigzag")
    assert lay.padded_seqlen == 4 + 8  # 3 -> 4 and 7 -> 8 tokens
    assert lay.is_padding().sum() == 2


@pytest.mark.parametrize("layout", ss.LAYOUTS)
def test_one_ring_rank_holds_the_sequence_in_order(layout):
    """Pure Ulysses has one ring rank: every layout is the sequence in global order, with no
    per-document padding (zigzag would pad each odd document on two ranks' worth of chunks)."""
    mask = make_mask("causal_document", 10, seqlens=[3, 7])
    plan = ss.make_plan(mask, 4, "ulysses", layout, num_heads_q=4, num_heads_kv=4)
    assert plan.ring_size == 1 and plan.layout.name == layout
    assert plan.layout.positions.tolist() == [list(range(12))]  # padded to U = 4 at the end


def test_zigzag_balances_causal_exactly():
    plan = ss.make_plan(make_mask("causal", 64), 4, "ring", "zigzag")
    assert plan.load_balance == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["causal", "causal_document", "share_question"])
def test_balanced_beats_contiguous(name):
    mask = named_mask(name, 512)
    contiguous = ss.make_plan(mask, 8, "ring", "contiguous")
    balanced = ss.make_plan(mask, 8, "ring", "balanced")
    assert balanced.load_balance < contiguous.load_balance
    assert balanced.load_balance < 1.1
    order = balanced.layout.order()
    assert np.array_equal(np.sort(order[order < 512]), np.arange(512))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-N{c[1]}-U{c[2]}-W{c[3]}")
@pytest.mark.parametrize("layout", ss.LAYOUTS)
def test_pieces_tile_the_mask_exactly_once(config, layout):
    strategy, world, ulysses, windows = config
    for name, mask in MASKS.items():
        plan = ss.make_plan(mask, world, strategy, layout, ulysses, num_windows=windows)
        assert plan.piece_area.sum() == mask.area(), name
        cover = _global_cover(plan)
        expect = np.zeros_like(cover)
        expect[:SEQLEN, :SEQLEN] = mask.dense()
        assert np.array_equal(cover, expect), name
        assert np.array_equal(plan.empty, plan.piece_area == 0)
        for step in plan.dropped:  # a dropped step is empty on every rank
            for r in range(plan.ring_size):
                src = step.sources[r]
                keys = np.arange(plan.seqlen) if src < 0 else plan.layout.positions[src]
                padded = ss.plan.padded_mask(mask, plan.padded_seqlen)
                assert padded.restrict(plan.layout.positions[r], keys).area() == 0


def test_empty_steps_are_flagged_and_dropped():
    mask = make_mask("sliding_window", 128, window=4)
    plan = ss.make_plan(mask, 8, "ring", "contiguous")
    # a narrow two-sided band only reaches the neighbouring shards: shifts 0, 1 and R-1
    assert [(s.outer, s.inner) for s in plan.steps] == [(0, 0), (0, 1), (0, 7)]
    assert len(plan.dropped) == 5
    assert plan.empty[0, 1] and not plan.empty[1, 1]  # rank 0 has no left neighbour
    assert plan.empty[7, 2] and not plan.empty[0, 2]


def test_causal_contiguous_ring_is_triangular():
    plan = ss.make_plan(make_mask("causal", 64), 4, "ring", "contiguous")
    src = np.stack([s.sources for s in plan.steps], axis=1)
    assert np.array_equal(plan.empty, src > np.arange(4)[:, None])
    assert plan.load_balance == pytest.approx(plan.rank_area.max() / plan.rank_area.mean())


def test_all_empty_mask_keeps_one_step():
    mask = from_slices(np.zeros((0, 2)), np.zeros((0, 2)), [], 20, 20)
    plan = ss.make_plan(mask, 4, "ring", "zigzag")
    assert plan.num_steps == 1 and plan.empty.all()


@pytest.mark.parametrize("ring_size,windows", [(2, 1), (4, 2), (8, 2), (12, 3), (16, 4), (7, 1)])
def test_default_windows(ring_size, windows):
    assert schedules.default_num_windows(ring_size) == windows


@pytest.mark.parametrize("ring_size,windows", [(4, 1), (4, 2), (8, 2), (8, 4), (6, 3)])
def test_every_rank_sees_every_block_once(ring_size, windows):
    order = schedules.visiting_order(ring_size, windows)
    sources = np.stack([schedules.step_sources(ring_size, windows, s) for s in order])
    for row in sources:  # each step is a permutation of the blocks
        assert sorted(row) == list(range(ring_size))
    for col in sources.T:  # each rank meets every block exactly once
        assert sorted(col) == list(range(ring_size))
    assert all(sources[0] == np.arange(ring_size))


def test_transfer_counts():
    full8 = schedules.visiting_order(8, 1)
    assert schedules.transfer_counts(full8, 8, 1) == {"fwd_kv": 7, "bwd_kv": 7, "bwd_dkv": 8}
    dr = schedules.visiting_order(4, 2)  # per window: 1 inner move + return; 1 cross; 1 home
    assert schedules.transfer_counts(dr, 4, 2) == {"fwd_kv": 3, "bwd_kv": 3, "bwd_dkv": 6}
    kept = [(0, 0), (0, 1), (0, 7)]  # dropped steps are jumped over in one transfer
    assert schedules.transfer_counts(kept, 8, 1) == {"fwd_kv": 2, "bwd_kv": 2, "bwd_dkv": 3}


def test_device_positions_and_axes():
    mask = make_mask("causal", 64)
    for inner in ("ulysses", "ring"):
        plan = ss.make_plan(mask, 8, "usp", "zigzag", 2, inner_axis=inner)
        assert plan.ring_size == 4 and plan.local_len * 8 == plan.padded_seqlen
        for n in range(8):
            r, u = plan.ring_rank(n), plan.ulysses_rank(n)
            assert (n == r * 2 + u) if inner == "ulysses" else (n == u * 4 + r)
            shard = plan.layout.positions[r]
            assert np.array_equal(plan.positions[n], shard[u * plan.local_len :][: plan.local_len])
        assert np.array_equal(np.sort(plan.order()), np.arange(plan.padded_seqlen))
        assert np.array_equal(plan.order()[plan.inverse()], np.arange(64))


def test_ulysses_heads_checks():
    mask = make_mask("causal", 64)
    with pytest.raises(ValueError, match="num_heads_q"):
        ss.make_plan(mask, 4, "ulysses", num_heads_q=6, num_heads_kv=2)
    with pytest.raises(ValueError, match="num_heads_kv"):
        ss.make_plan(mask, 2, "ulysses", num_heads_q=6, num_heads_kv=3)
    with pytest.raises(ValueError, match="divide world_size"):
        ss.make_plan(mask, 8, "usp", ulysses_size=3)
    with pytest.raises(ValueError, match="no Ulysses axis"):
        ss.make_plan(mask, 8, "ring", ulysses_size=2)
    with pytest.raises(ValueError, match="unknown strategy"):
        ss.make_plan(mask, 8, "tree")
    with pytest.raises(ValueError, match="unknown layout"):
        ss.make_plan(mask, 8, "ring", "spiral")
    plan = ss.make_plan(mask, 8, "ulysses", num_heads_q=8, num_heads_kv=2)
    assert plan.kv_replication == 4 and plan.load_balance == 1.0


def test_default_usp_factorisation():
    assert [ss.default_usp_ulysses(n) for n in (2, 4, 8, 16, 64, 96)] == [1, 2, 4, 8, 8, 8]


def test_comm_formulas():
    mask = make_mask("full", 256)
    hq, hkv, d = 8, 2, 16
    t = 256
    ring = ss.make_plan(mask, 4, "ring", "contiguous").comm_volume(hq, hkv, d)
    assert ring["fwd_formula_elements"] == pytest.approx(3 / 4 * t * 2 * hkv * d)
    assert ring["bwd_formula_elements"] == pytest.approx(2 * ring["fwd_formula_elements"])
    block = 64 * hkv * d * 2
    assert ring["fwd_elements"] == 3 * block  # all 4 steps kept: 3 transfers
    assert ring["bwd_elements"] == 3 * block + 4 * block  # K/V again + dK/dV (home included)
    assert ring["bwd_bytes"] == 3 * block * 2 + 4 * block * 4  # dK/dV travel in fp32
    uly = ss.make_plan(mask, 4, "ulysses").comm_volume(hq, hkv, d)
    assert uly["fwd_formula_elements"] == pytest.approx(3 / 16 * t * d * (2 * hq + 2 * hkv))
    # U = 4 > Hkv = 2: each K/V head is sent twice (replicated), the formula counts it once
    assert uly["fwd_elements"] == pytest.approx(3 / 16 * t * d * (2 * hq + 2 * 4))
    assert uly["bwd_elements"] == pytest.approx(uly["fwd_elements"])
    ag = ss.make_plan(mask, 4, "allgather").comm_volume(hq, hkv, d)
    assert ag["fwd_elements"] == ring["fwd_elements"]
    usp = ss.make_plan(mask, 8, "usp", ulysses_size=2).comm_volume(hq, hkv, d)
    expect = 1 / 4 * (t / 4) * d * (2 * hq + 2 * hkv) + 3 / 4 * t * 2 * (hkv / 2) * d
    assert usp["fwd_formula_elements"] == pytest.approx(expect)
    assert usp["fwd_elements"] == pytest.approx(expect)  # no padding, no dropped steps
    dropped = ss.make_plan(make_mask("sliding_window", 256, window=4), 8, "ring", "contiguous")
    vol = dropped.comm_volume(hq, hkv, d)
    assert vol["fwd_elements"] == 2 * (32 * hkv * d * 2) < vol["fwd_formula_elements"]


def test_summary_is_plain_numbers():
    plan = ss.make_plan(MASKS["share_question"], 4, "double_ring", "balanced")
    summary = plan.summary()
    assert summary["num_windows"] == 2 and summary["padded_seqlen"] >= SEQLEN
    assert summary["critical_area"] >= summary["ideal_area"]


def test_a_new_strategy_record_plans_by_its_fields(monkeypatch):
    """make_plan reads a strategy's record, never its name: a new record with double ring's
    fields plans double ring's steps, and one with usp's default Ulysses size gets usp's U."""
    from shard_strategies import plan, strategies

    records = {
        **strategies.STRATEGY,
        "windowed_copy": strategies.Strategy(
            "windowed_copy", strategies.RING_CORE, strategies.HYBRID, windowed=True
        ),
        "usp_copy": strategies.Strategy(
            "usp_copy",
            strategies.RING_CORE,
            strategies.HYBRID,
            default_ulysses=strategies.default_usp_ulysses,
        ),
    }
    monkeypatch.setattr(strategies, "STRATEGY", records)
    monkeypatch.setattr(plan, "STRATEGY", records)
    monkeypatch.setattr(plan, "STRATEGIES", tuple(records))
    mask = make_mask("causal_document", 512, seed=0)
    for copy, original in (("windowed_copy", "double_ring"), ("usp_copy", "usp")):
        got = ss.make_plan(mask, 16, copy, "zigzag", num_heads_q=8, num_heads_kv=8)
        want = ss.make_plan(mask, 16, original, "zigzag", num_heads_q=8, num_heads_kv=8)
        assert (got.ulysses_size, got.num_windows) == (want.ulysses_size, want.num_windows)
        assert [(s.outer, s.inner, list(s.sources)) for s in got.steps] == [
            (s.outer, s.inner, list(s.sources)) for s in want.steps
        ]
    assert ss.make_plan(mask, 16, "usp_copy", "zigzag").ulysses_size == 8
    with pytest.raises(ValueError, match="double_ring, windowed_copy only"):
        ss.make_plan(mask, 16, "ring", "zigzag", num_windows=2)


def _scattered_placement(rng, n: int, seqlen: int, padding: int) -> np.ndarray:
    """Positions 0..seqlen-1 split over n ranks in random order and uneven shares, each rank's
    row padded (positions >= seqlen) to one length, the padding anywhere in the row."""
    cuts = np.sort(rng.choice(np.arange(1, seqlen), n - 1, replace=False))
    shares = np.split(rng.permutation(seqlen), cuts)
    width = max(map(len, shares)) + padding
    out = np.full((n, width), seqlen, np.int64)
    for rank, share in enumerate(shares):
        out[rank, : len(share)] = share
        out[rank] = rng.permutation(out[rank])
    return out


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 16])
def test_exchange_delivers_every_token_and_its_rounds_alone_agree(n, uniform):
    """make_exchange between random placements (uneven shares, padding anywhere): applied to
    tokens it delivers each destination row its token (padding rows zero), each round's pairs
    form a partial permutation whose sends cover exactly the rows that change rank, and
    exchange_rounds gives the same rounds and sizes without the tables."""
    from shard_strategies.exchange import contiguous_positions, exchange_rounds, make_exchange

    rng = np.random.default_rng(n * 2 + uniform)
    cases = ((n * 11, "random"), (517, "random"), (517, "same"), (n * 8, "in"), (n * 8, "out"))
    for seqlen, case in cases:  # in/out: from/to the contiguous split (dispatch, undispatch)
        src = _scattered_placement(rng, n, seqlen, int(rng.integers(0, 4)))
        dst = (
            src.copy()
            if case == "same"
            else _scattered_placement(rng, n, seqlen, int(rng.integers(0, 4)))
        )
        if case == "in":
            src = contiguous_positions(seqlen, n)
        elif case == "out":
            src, dst = dst, contiguous_positions(seqlen, n)
        ex = make_exchange(src, dst, seqlen, uniform=uniform)
        tokens = np.where(src < seqlen, src + 1, 0).astype(np.float64)
        got = ex.apply(tokens[..., None])[..., 0]
        np.testing.assert_array_equal(got, np.where(dst < seqlen, dst + 1, 0))
        owner = np.full(seqlen + 1, -1)  # the source rank of each position, -1: padding
        owner[src[src < seqlen]] = np.nonzero(src < seqlen)[0]
        from_rank = owner[np.minimum(dst, seqlen)]
        needed = {
            (int(j), i): int((from_rank[i] == j).sum())
            for i in range(n)
            for j in np.unique(from_rank[i])
            if j not in (-1, i)
        }
        carried = [pair for pairs in ex.rounds for pair in pairs]
        assert len(set(carried)) == len(carried) and set(needed) <= set(carried)
        if not uniform:  # the fewest rounds: only pairs that move something
            assert set(carried) == set(needed)
        most = max(needed.values(), default=0)
        assert (len(ex.rounds) == 0) == (most == 0)  # nothing moves: no rounds
        for pairs, size in zip(ex.rounds, ex.sizes):
            senders, receivers = zip(*pairs)
            assert len(set(senders)) == len(senders) and len(set(receivers)) == len(receivers)
            if uniform:  # one size, the largest count rounded up to a power of two
                assert size == min(1 << (most - 1).bit_length(), *src.shape[1:], *dst.shape[1:])
            else:
                assert size == max(needed.get(pair, 0) for pair in pairs)
        shape = exchange_rounds(src, dst, seqlen, uniform=uniform)
        assert (shape.rounds, shape.sizes) == (ex.rounds, ex.sizes)
        assert (shape.num_ranks, shape.src_len, shape.dst_len) == (n, src.shape[1], dst.shape[1])


def test_uniform_exchange_refuses_a_destination_that_repeats_positions():
    """A destination holding one position many times would need more rows from one peer than a
    uniform round carries: refused by name, never written past its round."""
    from shard_strategies.exchange import make_exchange

    src = np.array([[0, 1], [2, 3], [4, 5]])
    dst = np.array([[2, 3, 4, 5], [0, 0, 0, 0], [1, 1, 3, 3]])
    with pytest.raises(ValueError, match="repeats positions"):
        make_exchange(src, dst, 6, uniform=True)
