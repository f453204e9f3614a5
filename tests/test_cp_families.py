"""The CP predictor's timed shape families (experiments/cp_families.py): all-gather interval
counts are powers of two, so plans of one length share their compiled XLA programs."""

from __future__ import annotations

import numpy as np
import pytest
from tile_lists import list_spans

import shard_strategies as ss
from attn_masks import from_slices
from attn_masks.generators import make_mask
from experiments import cp_families

# 32 GPUs x 8K tokens of the GPU preset's document masks: every strategy and layout, forward
# and backward. Before power-of-two interval counts: 42; before the all-gather's keys in
# global order: 39.
SUBSET_FAMILIES = 30


@pytest.fixture(scope="module")
def subset_families() -> dict:
    masks = ("causal_document", "full_document", "share_question")
    points = cp_families.preset_points((32,), seqlens=(8192,), masks=masks)
    return cp_families.count(points)


def test_preset_subset_compiles_few_shape_families(subset_families):
    assert len(subset_families) <= SUBSET_FAMILIES


def test_document_pieces_need_the_fewest_intervals(subset_families):
    """The all-gather takes its gathered keys in global order, so a document row sees one
    interval at any layout (in layout order it saw up to one per rank: 5 to 128 intervals,
    programs of 16-19 s to compile at 64 ranks): every family at the minimum count."""
    from shard_strategies.jax_cp._api import MIN_INTERVALS

    assert {f.intervals for f in subset_families} == {MIN_INTERVALS}


def test_interval_count_is_the_executors_array_shape():
    """jax_cp.interval_count is the stacked arrays' interval count, a power of two."""
    from shard_strategies import jax_cp

    # every row sees five stripes of keys; a ring step's block of 36 keys holds them all
    stripes = [[4 * i, 4 * i + 2] for i in range(5)]
    mask = from_slices([[0, 72]] * 5, stripes, [0] * 5, 72)
    plan = ss.make_plan(mask, 2, "ring", "contiguous")
    arrays = jax_cp.ring_mask_arrays(plan, "reference", 16, np.float32)
    widest = max(p.row_intervals()[0].shape[1] for row in plan.pieces for p in row)
    assert widest > 4 and widest & (widest - 1)  # a count the executor rounds up
    assert arrays.num_intervals == jax_cp.interval_count(plan) == 1 << widest.bit_length()


@pytest.mark.parametrize("seed", range(12))
def test_interval_count_reads_rows_only_where_needed_and_agrees(seed):
    """interval_count skips pieces whose slice depth cannot raise it; the count is still the
    widest piece's row intervals, rounded up to a power of two, at least MIN_INTERVALS."""
    from shard_strategies import jax_cp
    from shard_strategies.jax_cp._api import MIN_INTERVALS, distinct_pieces

    rng = np.random.default_rng(40 + seed)
    n = 96
    stripes = int(rng.integers(1, 12))  # rows see up to this many stripes of keys
    width = n // stripes
    k0 = np.arange(stripes) * width
    k1 = k0 + rng.integers(1, width + 1, stripes)
    mask = from_slices([[0, n]] * stripes, np.stack([k0, k1], 1), [0] * stripes, n)
    plan = ss.make_plan(
        mask, int(rng.choice([2, 4])), "ring", str(rng.choice(["contiguous", "zigzag"]))
    )
    pieces = distinct_pieces(plan)[0]
    for piece in pieces:  # nothing read yet: restricted pieces are built from slices
        assert "_row_intervals" not in piece.__dict__
    count = jax_cp.interval_count(plan, pieces)
    shallow = [p for p in pieces if p.slice_depth() <= MIN_INTERVALS]
    assert not any("_row_intervals" in p.__dict__ for p in shallow)  # skipped: never read
    widest = max(p.row_intervals()[0].shape[1] for p in pieces)
    assert count == max(MIN_INTERVALS, 1 << (widest - 1).bit_length())


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_families_are_the_programs_the_timed_calls_compile(monkeypatch, strategy, mode):
    """The counter's families of a plan are the distinct (step function, argument structure and
    shapes) that the CP simulator's timed calls run for that plan (reference kernel, 4 ranks):
    as many, with the same step functions, query rows and key lengths."""
    import jax

    from experiments.core.points import Grid, expand
    from experiments.runners import cp_simulate, frameworks
    from experiments.runners.cp_ranks import CallTimes
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner
    from shard_strategies import simulate

    grid = Grid(
        name="t", cps=(strategy,), layouts=("zigzag",), impls=("reference",),
        masks=("causal_document",), seqlens=(64,), heads=((4, 2),), head_dim=16,
        dtype="fp32", modes=(mode,), warmup=0, iters=1,
    )  # fmt: skip
    (point,) = expand(
        grid, "jax", ("reference",), seed=3, num_devices=4, ulysses_size=None,
        ulysses_intra_node=True,
    )  # fmt: skip
    (mask,) = frameworks.make_masks(point)
    runner = JaxRunner()
    plan = JaxRanks.executor_plan(point, mask, "reference")
    ranks = JaxRanks(plan, "reference", point, 0, runner)
    names = {id(fn): name for name, fn in vars(ranks.steps).items()}
    timed = {}  # (fn, argument structure and shapes) -> (fn, query rows, keys)

    def record(self, call, warmup, iters, warm=False):
        fn, args = self.call(*call)
        leaves, tree = jax.tree.flatten(args)
        shapes = tuple(tuple(x.shape) for x in leaves if hasattr(x, "shape"))
        rows = [s[1] for s in shapes if len(s) == 4]  # (B, tokens, heads, D) arrays
        if names[id(fn)] == "pullback":
            query_rows = args[1][0].shape[1]  # the cotangent dout
        else:
            query_rows = args[0].shape[1]
        timed[names[id(fn)], str(tree), shapes] = (names[id(fn)], query_rows, max(rows))
        return CallTimes([1.0] * iters, by_first_run=False)

    monkeypatch.setattr(JaxRanks, "time", record)
    sched = simulate.schedule(plan, mode, itemsize=4, batch=point.batch, entry=simulate.EXCHANGE)
    simulator = cp_simulate.CPSimulator(runner, JaxRanks)
    simulator._time_calls(ranks, sched, point, simulator._call_classes(ranks, sched, point))
    families = cp_families.plan_families(plan, mode, "reference", point.dtype, point.batch)
    step_fn = {"fwd_merge": "fwd", "bwd_accumulate": "bwd"}  # one jitted fn, two argument sets
    counted = {(step_fn.get(f.fn, f.fn), f.shard_len, f.key_len) for f in families}
    assert timed and len(families) == len(timed)
    assert counted == set(timed.values()), (counted, set(timed.values()))


def test_distinct_mask_arrays_index_every_pieces_own_arrays():
    """jax_cp.distinct_mask_arrays holds each distinct piece once, and the (rank, step) index
    picks arrays whose row intervals show exactly that piece's visible keys (dense check)."""
    from shard_strategies import jax_cp

    sizes = [37, 101, 59, 200, 91, 24]
    mask = make_mask("causal_document", sum(sizes), seqlens=sizes)
    plan = ss.make_plan(mask, 6, "ring", "zigzag")
    stacked, index = jax_cp.distinct_mask_arrays(plan, "reference", 16, np.float32)
    assert index.shape == (plan.ring_size, plan.num_steps)
    assert len(np.unique(index)) < index.size  # empty and whole blocks repeat
    assert len(stacked.lo) == index.max() + 2  # the distinct pieces and one empty, widest
    for r in range(plan.ring_size):
        for t in range(plan.num_steps):
            piece = plan.pieces[r][t]
            lo, hi = stacked.lo[index[r, t]], stacked.hi[index[r, t]]
            keys = np.arange(piece.seqlen_k)
            seen = ((keys >= lo[..., None]) & (keys < hi[..., None])).any(axis=1)
            np.testing.assert_array_equal(seen, piece.dense())


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "usp"])
def test_plan_pieces_build_the_stacks_arrays_one_piece_at_a_time(impl, strategy):
    """The predictor's PlanPieces: each distinct piece's arrays, built alone, equal its slice of
    jax_cp.distinct_mask_arrays' stack; the spans read from the tile counts equal those from the
    stack's tile lists (the area times the heads without lists); equal digests only for equal
    arrays."""
    import jax

    from experiments.runners import call_model
    from experiments.runners.cp_ranks_jax import PlanPieces
    from shard_strategies import jax_cp

    sizes = [37, 101, 59, 200, 91, 24, 500]
    mask = make_mask("causal_document", sum(sizes), seqlens=sizes)
    plan = jax_cp.executor_plan(
        mask, 4, strategy, "zigzag", impl=impl, num_heads_q=4, num_heads_kv=2, head_dim=64,
        dtype=np.float32,
    )  # fmt: skip
    stacked, index = jax_cp.distinct_mask_arrays(plan, impl, 64, np.float32)
    pieces = PlanPieces(plan, impl, 64, np.float32)
    np.testing.assert_array_equal(pieces.index, index)
    for i in range(len(pieces.pieces)):
        want_tree = jax.tree.map(lambda a, i=i: a[i], stacked)
        assert jax.tree.structure(pieces.arrays(i)) == jax.tree.structure(want_tree)
        want, got = jax.tree.leaves(want_tree), jax.tree.leaves(pieces.arrays(i))
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    grid = (4, 2, 3)  # (query heads, K/V heads, slots): a schedule of several rounds
    if pieces.tiles is None:
        want = call_model.area_features(plan.piece_area, 4)
    else:
        want = list_spans(stacked.kv, *grid)[index]
    np.testing.assert_array_equal(pieces.features(*grid), want)
    digests = [pieces.digest(i) for i in range(len(pieces.pieces))]
    first: dict[str, int] = {}
    for i, d in enumerate(digests):  # one digest, one call: pieces sharing it build one array
        j = first.setdefault(d, i)
        for a, b in zip(jax.tree.leaves(pieces.arrays(i)), jax.tree.leaves(pieces.arrays(j))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(first) > 1


def test_plans_holding_one_piece_read_its_tile_counts_once(monkeypatch):
    """Pure Ulysses' three layouts are one sequence order, so their plans hold the same piece:
    the run counts its tiles once for all three, builds no tile map for them, and each plan's
    layout (and spans) equal those read afresh."""
    from attn_masks.mask import Mask
    from experiments.runners import cp_ranks_jax
    from experiments.runners.cp_ranks_jax import PlanPieces
    from shard_strategies import jax_cp

    mask = make_mask("causal_document", 4096, seqlens=[1000, 2000, 1096])
    plans = [
        jax_cp.executor_plan(
            mask,
            4,
            "ulysses",
            layout,
            impl="pallas",
            num_heads_q=4,
            num_heads_kv=4,
            head_dim=64,
            dtype=np.float32,
        )  # fmt: skip
        for layout in ("contiguous", "zigzag", "balanced")
    ]
    reads, maps = [], []
    real_counts, real_map = Mask.tile_counts, Mask.block_map
    monkeypatch.setattr(Mask, "tile_counts", lambda m, *t: reads.append(t) or real_counts(m, *t))
    monkeypatch.setattr(Mask, "block_map", lambda m, *t: maps.append(t) or real_map(m, *t))
    monkeypatch.setattr(cp_ranks_jax, "_layouts_kept", type(cp_ranks_jax._layouts_kept)())
    layouts = [PlanPieces(plan, "pallas", 64, np.float32).layouts() for plan in plans]
    assert len(reads) == len(layouts[0]) == 1
    monkeypatch.setattr(cp_ranks_jax, "_layouts_kept", type(cp_ranks_jax._layouts_kept)())
    fresh = PlanPieces(plans[2], "pallas", 64, np.float32)
    for (stats, work), (want_stats, want_work) in zip(layouts[1], fresh.layouts()):
        assert stats == want_stats
        for got, want in zip(np.concatenate(work), np.concatenate(want_work)):
            np.testing.assert_array_equal(got, want)
    assert len(reads) == 2 and not maps


def _preset_problem(strategy: str, layout: str, devices: int = 4):
    """A GPU-preset point (forward, 8K tokens a device, causal_document) and its mask."""
    from experiments.runners import frameworks

    points = cp_families.preset_points((devices,), (8192,), ("causal_document",))
    (point,) = [p for p in points if (p.cp, p.layout, p.mode) == (strategy, layout, "fwd")]
    return point, frameworks.make_masks(point)[0]


def _executor_plan(point, mask, **kw):
    from experiments.runners import frameworks
    from experiments.runners.cp_ranks import plan_settings
    from shard_strategies import jax_cp

    dtype = frameworks.framework_dtype("jax", point.dtype)
    return jax_cp.executor_plan(mask, impl="pallas", dtype=dtype, **plan_settings(point), **kw)


@pytest.mark.parametrize("strategy", ["ring", "usp"])
def test_timed_plan_pads_document_shards_to_a_bucket(strategy):
    """The predictor times per-document zigzag shards at a bucketed length (at most 1/16 more,
    all padding): every rank holds the executor's real tokens in the same order, and every
    piece holds the executor's piece's typed slices, nothing in the padding."""
    from experiments.runners.cp_ranks_jax import JaxRanks
    from shard_strategies import jax_cp

    point, mask = _preset_problem(strategy, "zigzag")
    plan = _executor_plan(point, mask)
    timed = JaxRanks.timed_plan(point, mask, "pallas", plan)
    step = jax_cp.bucket_multiple(plan.shard_len, 128)
    assert plan.shard_len % step  # the executor's own length is off the bucket
    assert timed.shard_len == -(-plan.shard_len // step) * step
    assert timed.shard_len <= plan.shard_len * (1 + 1 / 16)
    s = mask.seqlen_q
    for a, b in zip(plan.layout.positions, timed.layout.positions):
        np.testing.assert_array_equal(a[a < s], b[b < s])
        assert (b[len(a) :] >= s).all()
    assert len(plan.pieces[0]) == len(timed.pieces[0])
    for r in range(plan.ring_size):
        for t in range(len(plan.pieces[r])):
            want, got = plan.pieces[r][t], timed.pieces[r][t]
            assert got.seqlen_q == timed.shard_len and got.seqlen_k >= want.seqlen_k
            # the same typed slices: the padding rows and keys see nothing
            for a, b in zip(want.slices, got.slices):
                np.testing.assert_array_equal(a, b)


def test_timed_plan_keeps_the_executors_plan_when_padding_would_move_tokens():
    """A contiguous layout puts tokens by shard length, so a longer shard would move real
    tokens between ranks: the executor's plan is timed as it is, as it is under the reference
    impl (no tiles, nothing to share)."""
    from experiments.runners.cp_ranks_jax import JaxRanks

    point, _ = _preset_problem("ring", "contiguous", devices=3)
    mask = make_mask("causal_document", 25200, seqlens=[9000, 16200])
    plan = _executor_plan(point, mask)
    assert plan.shard_len == 8448  # 8400 tokens a rank, in 128-token tiles: off the bucket
    assert JaxRanks.timed_plan(point, mask, "pallas", plan) is plan
    assert JaxRanks.timed_plan(point, mask, "reference", plan) is plan


def test_the_schedule_runs_on_the_gpus_streaming_multiprocessors():
    """The JAX ranks' span schedule takes the device's SM count on a GPU (an H100 PCIe has
    114), call_model.SLOTS where the device has none to say (the CPU)."""
    from types import SimpleNamespace

    from experiments.runners import call_model
    from experiments.runners.cp_ranks_jax import JaxRanks

    def ranks_on(device: SimpleNamespace) -> SimpleNamespace:
        return SimpleNamespace(jax=SimpleNamespace(devices=lambda: [device]))

    gpu = SimpleNamespace(platform="gpu", core_count=114)
    assert JaxRanks.slots(ranks_on(gpu)) == 114
    assert JaxRanks.slots(ranks_on(SimpleNamespace(platform="cpu"))) == call_model.SLOTS == 132
