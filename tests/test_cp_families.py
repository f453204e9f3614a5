"""The CP predictor's timed shape families (experiments/cp_families.py): all-gather interval
counts are powers of two, so plans of one length share their compiled XLA programs."""

from __future__ import annotations

import numpy as np
import pytest

import shard_strategies as ss
from attn_masks.generators import make_mask
from experiments import cp_families

# 32 GPUs x 8K tokens of the GPU preset's document masks: every strategy and layout, forward
# and backward. Before power-of-two interval counts: 42.
SUBSET_FAMILIES = 39


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
