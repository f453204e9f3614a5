"""The Mosaic dK/dV head split per call: the walk peak of the mask arrays, the rule that splits
a GQA group where the longest walk bounds the grid, and the split the backward launches."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from tile_lists import walks

from attn_masks.generators import make_mask
from jax_attn.mask_arrays import prepare_mask, stack_mask_arrays
from jax_attn.mosaic_gpu import backward as mosaic_bwd
from jax_attn.mosaic_gpu.config import (
    DKV_SPLIT_BOUND,
    HOPPER_SMS,
    KernelConfig,
    default_config,
    dkv_head_split,
)


def test_walk_peak_is_the_longest_walk_over_the_mean_in_half_octaves() -> None:
    assert walks([5, 5, 5]).walk_peak() == 1.0  # full
    assert walks([1, 2, 3, 4, 5, 6, 7, 8]).walk_peak() == 2.0  # causal: 8 / 4.5 = 1.78
    assert walks([1, 1, 1, 1, 1, 1, 1, 9]).walk_peak() == 4.0  # 9 / 2 = 4.5: 2 ** (4 / 2)
    assert walks([1, 1, 1, 5]).walk_peak() == pytest.approx(2**1.5)  # 5 / 2 = 2.5
    assert walks([0, 0]).walk_peak() == 0.0
    assert walks([]).walk_peak() == 0.0


@pytest.mark.parametrize("seqlen", [8192, 32768])
def test_prepare_mask_records_the_key_tiles_walk_peak(seqlen: int) -> None:
    """The dK/dV walk (q tiles per key tile): share_question's question is walked by every
    row, so its peak is many times causal's; a stack records none."""
    arrays = {n: prepare_mask(make_mask(n, seqlen), 128, 128) for n in ("full", "causal")}
    arrays["share_question"] = prepare_mask(make_mask("share_question", seqlen), 128, 128)
    count = np.asarray(arrays["share_question"].q.count, np.float64)
    exact = count.max() / count.mean()
    assert arrays["full"].walk_peak == 1.0 and arrays["causal"].walk_peak == 2.0
    assert exact / 2**0.25 <= arrays["share_question"].walk_peak <= exact * 2**0.25
    assert stack_mask_arrays(list(arrays.values())).walk_peak == 0.0


@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_split_rule(group: int) -> None:
    ws = KernelConfig(bwd_warpgroups=2, dkv_head_split=None)
    ctas = 512
    bound = DKV_SPLIT_BOUND * ctas / HOPPER_SMS  # the walk peak from which the split pays
    for peak, want in ((bound * 1.01, 2), (bound * 0.99, 1), (0.0, 1)):
        got = dkv_head_split(ws, group=group, walk_peak=peak, dkv_ctas=ctas)
        assert got == (want if group % 2 == 0 else 1), (peak, group)
    for config in (KernelConfig(dkv_head_split=None), dataclasses.replace(ws, fused_bwd=True)):
        assert dkv_head_split(config, group=group, walk_peak=99.0, dkv_ctas=ctas) == 1
    fixed = dataclasses.replace(ws, dkv_head_split=4)
    assert dkv_head_split(fixed, group=group, walk_peak=0.0, dkv_ctas=ctas) == 4


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen", [8192, 16384, 32768])
def test_only_share_question_is_split_at_64_to_8_heads(seqlen: int, head_dim: int) -> None:
    """The measured wins (share_question) split, the measured losses (causal_blockwise and
    prefix_lm_document at 8K, causal_document at 32K) do not; 64:8 heads, batch 1."""
    config = default_config(head_dim, jnp.bfloat16)
    q = jnp.ones((1, seqlen, 64, head_dim), jnp.bfloat16)
    k = jnp.ones((1, seqlen, 8, head_dim), jnp.bfloat16)
    split = {}
    for name in ("share_question", "causal_blockwise", "prefix_lm_document", "full", "causal"):
        arrays = prepare_mask(make_mask(name, seqlen), *config.tiles)
        kernels = mosaic_bwd._kernels(q, k, arrays, scale=0.1, config=config, interpret=False)
        split[name] = kernels[0].head_split
    assert split == {
        "share_question": 2,
        "causal_blockwise": 1,
        "prefix_lm_document": 1,
        "full": 1,
        "causal": 1,
    }


def test_the_split_grid_walks_each_share_of_the_group() -> None:
    """Two CTAs per (key tile, kv head), each walking half of the group's q tiles x heads."""
    config = default_config(128, jnp.bfloat16)
    arrays = prepare_mask(make_mask("share_question", 8192), *config.tiles)
    q = jnp.ones((1, 8192, 64, 128), jnp.bfloat16)
    k = jnp.ones((1, 8192, 8, 128), jnp.bfloat16)
    dkv, _ = mosaic_bwd._kernels(q, k, arrays, scale=0.1, config=config, interpret=False)
    assert (dkv.group, dkv.head_split, dkv.walk_heads) == (8, 2, 4)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_defaults_choose_the_split_per_call(head_dim: int) -> None:
    assert default_config(head_dim, jnp.bfloat16).dkv_head_split is None
