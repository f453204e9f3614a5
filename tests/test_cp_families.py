"""The CP predictor's timed shape families (experiments/cp_families.py): every plan of one
(length, ring size) shares its zigzag shard length, and all-gather interval counts are powers of
two, so the cp_predict preset compiles few XLA programs."""

from __future__ import annotations

import numpy as np
import pytest

import shard_strategies as ss
from attn_masks.generators import make_mask
from experiments import cp_families

# 32 GPUs x 8K tokens of the GPU preset's document masks: every strategy and layout, forward
# and backward. Before common zigzag padding and power-of-two interval counts: 42.
SUBSET_FAMILIES = 39
TILE = 128  # the Pallas kernel's tile at D=128, bf16: shards are padded to whole tiles


@pytest.fixture(scope="module")
def subset_families() -> dict:
    masks = ("causal_document", "full_document", "share_question")
    points = cp_families.preset_points((32,), seqlens=(8192,), masks=masks)
    return cp_families.count(points)


def test_preset_subset_compiles_few_shape_families(subset_families):
    assert len(subset_families) <= SUBSET_FAMILIES


def test_interval_counts_are_powers_of_two(subset_families):
    counts = {f.intervals for f in subset_families}
    assert max(counts) > 4  # the all-gather's document pieces need more than the minimum
    assert all(k & (k - 1) == 0 for k in counts), sorted(counts)


def test_zigzag_shards_of_a_length_are_one_length(subset_families):
    """Every shard is an even share (a power of two here) or, padded per document, that share
    plus 1/16 of it: one padded length per share whatever the documents."""
    for length in {f.shard_len for f in subset_families}:
        share = 1 << (length.bit_length() - 1)
        assert length in (share, share + share // 16), length


@pytest.mark.parametrize("ring_size, documents", [(8, (3, 17, 250)), (16, (3, 17, 120))])
def test_document_masks_share_the_zigzag_shard_length(ring_size, documents):
    """Masks of 64K tokens with 3 to 250 documents: one padded shard length, padding unseen."""
    seqlen = 8192 * 8
    lengths = set()
    rng = np.random.default_rng(ring_size)
    for docs in documents:
        cuts = np.sort(rng.choice(np.arange(1, seqlen), docs - 1, replace=False))
        sizes = np.diff(np.concatenate([[0], cuts, [seqlen]])).tolist()
        mask = make_mask("causal_document", seqlen, seqlens=sizes)
        plan = ss.make_plan(mask, ring_size, "ring", "zigzag", pad_multiple=TILE)
        lengths.add(plan.shard_len)
        pad = plan.layout.is_padding()
        for r, row in enumerate(plan.pieces):
            for t, piece in enumerate(row):
                lo, hi = piece.row_intervals()
                assert not (hi - lo)[pad[r]].any()  # a padding query sees no key
                padded_keys = np.concatenate([[0], np.cumsum(plan.key_positions(r, t) >= seqlen)])
                assert not (padded_keys[hi] - padded_keys[lo]).any()  # nor is a padding key seen
    assert len(lengths) == 1


def test_interval_count_is_the_executors_array_shape():
    """jax_cp.interval_count is the stacked arrays' interval count, a power of two."""
    from shard_strategies import jax_cp

    sizes = [37, 101, 59, 200, 91, 24]
    mask = make_mask("causal_document", sum(sizes), seqlens=sizes)
    plan = ss.make_plan(mask, 6, "allgather", "zigzag")
    arrays = jax_cp.ring_mask_arrays(plan, "reference", 16, np.float32)
    widest = max(p.row_intervals()[0].shape[1] for row in plan.pieces for p in row)
    assert widest > 4 and widest & (widest - 1)  # a count the executor rounds up
    assert arrays.num_intervals == jax_cp.interval_count(plan) == 1 << widest.bit_length()
