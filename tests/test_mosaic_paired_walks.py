"""The Mosaic dK/dV kernel's paired walks per call: how evenly the walks of key tiles p and
N - 1 - p add up (TileList.pair_spread), the flag the mask arrays carry, the rule
(config.paired_walks) and the walks the backward launches."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tile_lists import walks

from attn_masks.generators import make_mask
from jax_attn.mask_arrays import prepare_mask, stack_mask_arrays
from jax_attn.mosaic_gpu import backward as mosaic_bwd
from jax_attn.mosaic_gpu.config import (
    KernelConfig,
    backward_form,
    default_config,
    paired_walks,
)


def _dense_pair_spread(name: str, seqlen: int, tile: int) -> float:
    """The pair spread counted on the dense mask: q tiles that see each key tile, summed over
    key tiles p and N - 1 - p, their mean absolute deviation over their mean."""
    dense = np.asarray(make_mask(name, seqlen).dense(), bool)
    n = -(-seqlen // tile)
    padded = np.zeros((n * tile, n * tile), bool)
    padded[:seqlen, :seqlen] = dense
    seen = padded.reshape(n, tile, n, tile).any(axis=(1, 3)).sum(axis=0).astype(np.float64)
    sums = np.array([seen[p] + seen[n - 1 - p] for p in range(n // 2)])
    return float(np.abs(sums - sums.mean()).mean() / sums.mean())


@pytest.mark.parametrize(
    "name", ["full", "causal", "prefix_lm_causal", "causal_document", "global_sliding_window"]
)
def test_pair_spread_matches_the_dense_mask(name: str) -> None:
    lists = make_mask(name, 2048).block_lists(128, 128)
    assert lists.q.pair_spread() == pytest.approx(_dense_pair_spread(name, 2048, 128))


def test_pair_spread_of_smallwalks() -> None:
    assert walks([1, 2, 3, 4]).pair_spread() == 0.0  # causal: every pair walks 5
    assert walks([8, 1, 1, 1]).pair_spread() == pytest.approx(3.5 / 5.5)  # pairs 9 and 2
    assert walks([1, 9, 1]).pair_spread() == 0.0  # the middle tile is left out
    assert walks([3]).pair_spread() == 0.0
    assert walks([0, 0, 0, 0]).pair_spread() == 0.0


def test_the_mask_arrays_flag_even_pairs_at_16k() -> None:
    """Causal-like masks pair evenly; documents and the global window do not; a stack of
    masks (context parallelism, training) is never flagged."""
    even = dict.fromkeys(("full", "causal", "prefix_lm_causal", "sliding_window"), True)
    even |= dict.fromkeys(
        ("causal_document", "block_causal_document", "global_sliding_window"), False
    )
    got = {n: prepare_mask(make_mask(n, 16384), 128, 128).even_pairs for n in even}
    assert got == even
    one = prepare_mask(make_mask("causal", 512), 128, 128)
    assert one.even_pairs and not stack_mask_arrays([one, one]).even_pairs


WS = KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, block_k_dq=128)
FUSED = dataclasses.replace(WS, fused_bwd=True)


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("even", [False, True])
def test_a_given_pairing_is_kept(given: bool, even: bool) -> None:
    config = dataclasses.replace(WS, dkv_paired_walks=given)
    assert paired_walks(config, even_pairs=even) is given


def test_per_call_pairing_follows_the_flag_for_the_fused_kernel_only() -> None:
    per_call = dataclasses.replace(FUSED, dkv_paired_walks=None)
    assert paired_walks(per_call, even_pairs=True) is True
    assert paired_walks(per_call, even_pairs=False) is False
    unfused = dataclasses.replace(WS, dkv_paired_walks=None)
    assert paired_walks(unfused, even_pairs=True) is False
    one = KernelConfig(dkv_paired_walks=None)  # one dK/dV warpgroup: never paired, not refused
    assert paired_walks(one, even_pairs=True) is False


def test_the_fused_form_keeps_the_per_call_pairing() -> None:
    per_call = dataclasses.replace(WS, fused_bwd=None, dkv_paired_walks=None)
    assert backward_form(per_call, few_partial_tiles=True).dkv_paired_walks is None
    fixed = dataclasses.replace(WS, fused_bwd=None)
    assert backward_form(fixed, few_partial_tiles=True).dkv_paired_walks is True


@pytest.mark.parametrize("fused", [None, False])
def test_the_backward_launches_pairs_per_mask(fused: bool | None) -> None:
    """With dkv_paired_walks=None the fused dK/dV kernel the backward launches walks pairs on
    full and causal and single key tiles on block_causal_document (fused at D=128: few partial
    tiles); the unfused kernels walk single key tiles; the default (None form, pairs fixed)
    pairs every fused call."""
    base = dataclasses.replace(default_config(128, jnp.bfloat16), fused_bwd=fused)
    q = jax.ShapeDtypeStruct((1, 16384, 64, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 16384, 8, 128), jnp.bfloat16)
    names = ("full", "causal", "block_causal_document", "causal_document")
    launched = {}
    for config in (base, dataclasses.replace(base, dkv_paired_walks=None)):
        for name in names:
            arrays = prepare_mask(make_mask(name, 16384), *config.tiles)
            dkv, _ = mosaic_bwd._kernels(q, k, arrays, scale=0.1, config=config, interpret=False)
            launched[config.dkv_paired_walks, name] = (dkv.fused, dkv.paired)
    few = {"full", "causal", "block_causal_document"}
    for name in names:
        as_fused = fused is None and name in few
        assert launched[False, name] == (as_fused, as_fused), name
        even = name in {"full", "causal"}
        assert launched[None, name] == (as_fused, as_fused and even), name
