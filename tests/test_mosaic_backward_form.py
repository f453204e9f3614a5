"""The Mosaic backward's form per call (config.backward_form): a fused_bwd given is kept; None
runs the fused kernel with step descriptors and paired walks on masks with few partial tiles
where the config allows it, else the unfused kernels."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from attn_masks.generators import make_mask
from jax_attn.mask_arrays import prepare_mask
from jax_attn.mosaic_gpu import backward as mosaic_bwd
from jax_attn.mosaic_gpu.config import KernelConfig, backward_form, default_config

PER_CALL = KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, block_k_dq=128, fused_bwd=None)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("few", [False, True])
def test_a_given_form_is_kept(fused: bool, few: bool) -> None:
    config = dataclasses.replace(PER_CALL, fused_bwd=fused)
    assert backward_form(config, few_partial_tiles=few) is config


def test_per_call_form_follows_the_partial_tiles() -> None:
    fused = backward_form(PER_CALL, few_partial_tiles=True)
    assert fused == dataclasses.replace(
        PER_CALL, fused_bwd=True, dkv_step_descriptors=True, dkv_paired_walks=True
    )
    unfused = backward_form(PER_CALL, few_partial_tiles=False)
    assert unfused == dataclasses.replace(PER_CALL, fused_bwd=False)


@pytest.mark.parametrize(
    "changes",
    [
        dict(bwd_warpgroups=1, dq_warpgroups=1),
        dict(bwd_pingpong=True),
        dict(block_q_dkv=128),
        dict(dkv_head_split=2),
    ],
    ids=["one_warpgroup", "pingpong", "rows128", "head_split"],
)
def test_configs_the_fused_kernel_refuses_stay_unfused(changes: dict) -> None:
    config = dataclasses.replace(PER_CALL, **changes)
    with pytest.raises(ValueError):  # the fused form refuses each of them
        dataclasses.replace(
            config, fused_bwd=True, dkv_step_descriptors=True, dkv_paired_walks=True
        )
    assert backward_form(config, few_partial_tiles=True) == dataclasses.replace(
        config, fused_bwd=False
    )


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_defaults_backward_per_mask(head_dim: int) -> None:
    """At D=128 the dK/dV kernel the default launches is fused, with step descriptors and
    paired walks, on full, causal and prefix-LM causal (few partial tiles at 16K) and unfused
    on the document, window and share_question masks; at D=64 it is never fused."""
    config = default_config(head_dim, jnp.bfloat16)
    q = jax.ShapeDtypeStruct((1, 16384, 64, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 16384, 8, head_dim), jnp.bfloat16)
    names = ("full", "causal", "prefix_lm_causal", "causal_document", "sliding_window")
    forms = {}
    for name in (*names, "share_question"):
        arrays = prepare_mask(make_mask(name, 16384), *config.tiles)
        dkv, _ = mosaic_bwd._kernels(q, k, arrays, scale=0.1, config=config, interpret=False)
        forms[name] = (dkv.fused, dkv.step_descriptors, dkv.paired)
    fused = head_dim == 128
    few = {"full", "causal", "prefix_lm_causal"}
    assert forms == {n: (fused and n in few,) * 3 for n in forms}
