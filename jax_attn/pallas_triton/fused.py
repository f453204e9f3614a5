"""Fused backward (FlashAttention-2 style): dK/dV per key tile, dQ accumulated with atomics.

One program owns a (key tile, kv head), walks the query sub-tiles of its key tile for each of
the `group` q heads, keeps dK/dV in registers and adds each sub-tile's dS @ K into an fp32 dQ
buffer with atomic adds: 5 matmuls per tile pair instead of the 7 of the two-kernel backward.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .atomics import atomic_add
from .common import (
    LOG2E,
    TN,
    backward_lse,
    dkv_update,
    load_intervals,
    matmul,
    precision_for,
    visible,
    walk_tiles,
    whole_spec,
)
from .compat import triton_params
from .config import KernelConfig
from .tiles import TileLists


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
    scale: float,
    heads_kv: int,
    group: int,
    mask_block_q: int,
    mask_block_k: int,
    block_q: int,
    relaxed: bool,
) -> None:
    block_k = k_ref.shape[0]
    tile = pl.program_id(0)
    col0 = tile * block_k
    outer = lax.div(tile, mask_block_k // block_k)
    head0 = lax.rem(pl.program_id(1), heads_kv) * group
    k = k_ref[...]
    v = v_ref[...]
    precision = precision_for(k.dtype)

    def step(start: jax.Array, rep: jax.Array, carry: Any, masked: bool) -> Any:
        # Neighbouring key tiles start at different heads of the group: programs walking the
        # same query tiles in lockstep then add into different dQ rows at any one time.
        head = head0 + (lax.rem(rep + tile, group) if group > 1 else rep)
        rows = pl.ds(start, block_q)
        intervals = load_intervals(lo_ref, hi_ref, start, block_q) if masked else None
        dk, dv, ds_t = dkv_update(
            k,
            v,
            q_ref[rows, head, :],
            do_ref[rows, head, :],
            lse2_ref[head, rows],
            delta_ref[head, rows],
            visible(intervals, col0, block_k, keys_first=True) if masked else None,
            carry,
            qk_scale=scale * LOG2E,
            precision=precision,
        )
        dq = matmul(ds_t, k, TN, precision)
        atomic_add(dq_ref, (rows, head, slice(None)), dq, relaxed=relaxed)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = walk_tiles(
        index_ref,
        n_partial_ref,
        count_ref,
        outer,
        (zeros, zeros),
        step,
        mask_tile=mask_block_q,
        tile=block_q,
        repeat=group,
    )
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward_fused(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    lists: TileLists,
    *,
    scale: float,
    config: KernelConfig,
    mask_block_q: int,
    mask_block_k: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dQ, dK, dV from padded inputs in one kernel; lists are the per-k-tile query tile lists."""
    batch, seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    block_q, block_k = config.block_q_dkv, config.block_k_dkv

    def kv_map(j: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_kv), j, lax.rem(bh, heads_kv), 0

    def seq_map(j: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_kv), 0, 0, 0

    def row_map(j: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_kv), 0, 0

    kernel = functools.partial(
        _fused_kernel,
        scale=scale,
        heads_kv=heads_kv,
        group=heads_q // heads_kv,
        mask_block_q=mask_block_q,
        mask_block_k=mask_block_k,
        block_q=block_q,
        relaxed=config.relaxed_atomics,
    )
    kv_spec = pl.BlockSpec((None, block_k, None, dim), kv_map)
    seq_spec = pl.BlockSpec((None, seq_q, heads_q, dim), seq_map)
    row_spec = pl.BlockSpec((None, heads_q, seq_q), row_map)
    dq_zeros = jnp.zeros(q.shape, jnp.float32)
    dq, dk, dv = pl.pallas_call(
        kernel,
        grid=(seq_k // block_k, batch * heads_kv),
        in_specs=[
            seq_spec,
            kv_spec,
            kv_spec,
            seq_spec,
            row_spec,
            row_spec,
            whole_spec(lo),
            whole_spec(hi),
            whole_spec(lists.index),
            whole_spec(lists.n_partial),
            whole_spec(lists.count),
            seq_spec,
        ],
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
    )(
        q,
        k,
        v,
        do,
        backward_lse(lse),
        delta,
        lo,
        hi,
        lists.index,
        lists.n_partial,
        lists.count,
        dq_zeros,
    )
    return (dq * scale).astype(q.dtype), dk, dv
