"""Fused backward (FlashAttention-2 style): dK/dV per key tile, dQ accumulated with atomics.

One program owns a (key tile, kv head), walks the query sub-tiles of its key tile for each of
the `group` q heads, keeps dK/dV in registers and adds each sub-tile's dS @ K into an fp32 dQ
buffer with atomic adds: 5 matmuls per tile pair instead of the 7 of the two-kernel backward.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attn_masks import PartialFirst

from ..kernel_inputs import backward_lse
from .atomics import atomic_add
from .backward import dkv_kernel
from .common import TN, backward_specs, key_tile_launch, matmul, triton_params
from .config import KernelConfig


def _fused_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    do_ref: Any,
    lse2_ref: Any,
    delta_ref: Any,
    lo_ref: Any,
    hi_ref: Any,
    index_ref: Any,
    n_partial_ref: Any,
    count_ref: Any,
    _dq_zeros_ref: Any,
    dq_ref: Any,
    dk_ref: Any,
    dv_ref: Any,
    *,
    relaxed: bool,
    **params: Any,
) -> None:
    """dkv_kernel on the base-2 LSE with staggered heads, adding each step's dQ tile to dq_ref."""

    def add_dq(ds_t: jax.Array, k: jax.Array, rows: Any, head: jax.Array, precision: Any) -> None:
        dq = matmul(ds_t, k, TN, precision)
        atomic_add(dq_ref, (rows, head, slice(None)), dq, relaxed=relaxed)

    dkv_kernel(
        q_ref,
        k_ref,
        v_ref,
        do_ref,
        lse2_ref,
        delta_ref,
        lo_ref,
        hi_ref,
        index_ref,
        n_partial_ref,
        count_ref,
        dk_ref,
        dv_ref,
        lse_base2=True,
        stagger_heads=True,
        on_tile=add_dq,
        **params,
    )


def backward_fused(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    lists: PartialFirst,
    *,
    scale: float,
    config: KernelConfig,
    mask_block_q: int,
    mask_block_k: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dQ, dK, dV from padded inputs in one kernel; lists are the per-k-tile query tile lists."""
    kernel, grid, (kv_spec, seq_spec, row_spec) = key_tile_launch(
        _fused_kernel,
        q,
        k,
        config.block_q_dkv,
        config.block_k_dkv,
        scale=scale,
        mask_block_q=mask_block_q,
        mask_block_k=mask_block_k,
        relaxed=config.relaxed_atomics,
    )
    dq_zeros = jnp.zeros(q.shape, jnp.float32)
    dq, dk, dv = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[*backward_specs(seq_spec, kv_spec, row_spec, lo, hi, lists), seq_spec],
        out_specs=[seq_spec, kv_spec, kv_spec],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, jnp.float32),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        input_output_aliases={11: 0},
        compiler_params=triton_params(config.num_warps_bwd, config.num_stages_bwd),
        interpret=interpret,
        name="masked_flash_fused_bwd",
    )(q, k, v, do, backward_lse(lse), delta, lo, hi, *lists, dq_zeros)
    return (dq * scale).astype(q.dtype), dk, dv
