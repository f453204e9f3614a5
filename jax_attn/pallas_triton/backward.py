"""Backward kernels: dQ over each query tile's key tiles, dK/dV over each key tile's query tiles.

dK/dV programs own one (key tile, kv head) and loop over the `group` q heads that share it, so
GQA needs neither repeated K/V nor atomics. `delta` is rowsum(dO * O) minus the LSE cotangent.
fused.py has the one-kernel variant (KernelConfig.fused_bwd), built on dkv_kernel here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from attn_masks import PartialFirst

from ..kernel_inputs import LOG2E, backward_lse
from .common import (
    NN,
    NT,
    backward_specs,
    chunk_spec,
    dkv_update,
    key_tile,
    key_tile_launch,
    load_intervals,
    matmul,
    precision_for,
    query_tile,
    query_tile_launch,
    scores,
    triton_params,
    visible,
    walk_tiles,
)
from .config import KernelConfig

# on_tile(ds_t, k, rows, head, precision): what a dK/dV step also does with its dS^T tile.
OnTile = Callable[[jax.Array, jax.Array, Any, jax.Array, lax.Precision], None]


def _dq_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    do_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    lo_ref: Any,
    hi_ref: Any,
    index_ref: Any,
    n_partial_ref: Any,
    count_ref: Any,
    dq_ref: Any,
    *,
    scale: float,
    num_q_tiles: int,
    mask_block_q: int,
    mask_block_k: int,
    block_k: int,
) -> None:
    block_q = q_ref.shape[0]
    row0, outer = query_tile(num_q_tiles, block_q, mask_block_q)
    q = q_ref[...]
    do = do_ref[...]
    precision = precision_for(q.dtype)
    qk_scale = scale * LOG2E
    lse = backward_lse(lse_ref[...])
    delta = delta_ref[...]
    intervals = load_intervals(lo_ref, hi_ref, row0, block_q)

    def step(start: jax.Array, _rep: jax.Array, dq: jax.Array, masked: bool) -> jax.Array:
        k = k_ref[pl.ds(start, block_k), :]
        v = v_ref[pl.ds(start, block_k), :]
        s = scores(q, k, intervals, start, masked, qk_scale=qk_scale, precision=precision)
        p = jnp.exp2(s - lse[:, None])
        dp = matmul(do, v, NT, precision)
        ds = p * (dp - delta[:, None])
        return dq + matmul(ds.astype(k.dtype), k, NN, precision)

    dq = walk_tiles(
        index_ref,
        n_partial_ref,
        count_ref,
        outer,
        jnp.zeros(q.shape, jnp.float32),
        step,
        mask_tile=mask_block_k,
        tile=block_k,
    )
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def dkv_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    do_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    lo_ref: Any,
    hi_ref: Any,
    index_ref: Any,
    n_partial_ref: Any,
    count_ref: Any,
    dk_ref: Any,
    dv_ref: Any,
    *,
    scale: float,
    heads_kv: int,
    group: int,
    mask_block_q: int,
    mask_block_k: int,
    block_q: int,
    lse_base2: bool = False,
    stagger_heads: bool = False,
    on_tile: OnTile | None = None,
    chunks: int = 1,
) -> None:
    """dK, dV of one (key tile, kv head): every listed query sub-tile of every q head it serves.

    lse_base2: lse_ref already holds backward_lse(lse) (else each step converts what it loads).
    stagger_heads: key tile t starts at q head (t mod group) of its group. on_tile is called
    after each step (the fused backward adds that sub-tile's dQ there). chunks > 1: this
    program walks only share (program_id(0) mod chunks) of those steps (KernelConfig.dkv_split)
    and dk_ref/dv_ref are that share's partial sums.
    """
    block_k = k_ref.shape[0]
    tile, col0, outer, head0 = key_tile(block_k, mask_block_k, heads_kv, group, chunks)
    k = k_ref[...]
    v = v_ref[...]
    precision = precision_for(k.dtype)
    qk_scale = scale * LOG2E

    def step(start: jax.Array, rep: jax.Array, carry: Any, masked: bool) -> Any:
        # Staggered, neighbouring key tiles start at different heads of the group: programs
        # walking the same query tiles in lockstep then add into different dQ rows (fused
        # backward) at any one time.
        head = head0 + (lax.rem(rep + tile, group) if stagger_heads and group > 1 else rep)
        rows = pl.ds(start, block_q)
        intervals = load_intervals(lo_ref, hi_ref, start, block_q) if masked else None
        q = q_ref[rows, head, :]
        do = do_ref[rows, head, :]
        lse2 = lse_ref[head, rows] if lse_base2 else backward_lse(lse_ref[head, rows])
        dk, dv, ds_t = dkv_update(
            k,
            v,
            q,
            do,
            lse2,
            delta_ref[head, rows],
            visible(intervals, col0, block_k, keys_first=True) if masked else None,
            carry,
            qk_scale=qk_scale,
            precision=precision,
        )
        if on_tile is not None:
            on_tile(ds_t, k, rows, head, precision)
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
        chunks=chunks,
        chunk=lax.rem(pl.program_id(0), chunks) if chunks > 1 else None,
    )
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def backward_dq(
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
) -> jax.Array:
    """dQ (B,Sq,Hq,D) from padded inputs; lists are the per-q-tile key tile lists."""
    kernel, grid, (q_spec, kv_spec, row_spec) = query_tile_launch(
        _dq_kernel,
        q,
        k,
        config.block_q_dq,
        config.block_k_dq,
        scale=scale,
        mask_block_q=mask_block_q,
        mask_block_k=mask_block_k,
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=backward_specs(q_spec, kv_spec, row_spec, lo, hi, lists),
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(config.num_warps_bwd, config.num_stages_bwd),
        interpret=interpret,
        name="masked_flash_dq",
    )(q, k, v, do, lse, delta, lo, hi, *lists)


def backward_dkv(
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
) -> tuple[jax.Array, jax.Array]:
    """dK, dV (B,Sk,Hkv,D) from padded inputs; lists are the per-k-tile query tile lists.

    config.dkv_split = S > 1: S programs per (key tile, kv head), each walking 1/S of its steps
    and writing fp32 partial dK/dV into (S, B, Sk, Hkv, D) buffers that XLA sums (no atomics).
    """
    chunks = config.dkv_split
    kernel, grid, (kv_spec, seq_spec, row_spec) = key_tile_launch(
        dkv_kernel,
        q,
        k,
        config.block_q_dkv,
        config.block_k_dkv,
        scale=scale,
        mask_block_q=mask_block_q,
        mask_block_k=mask_block_k,
        chunks=chunks,
    )
    if chunks > 1:
        out_spec = chunk_spec(k, config.block_k_dkv, chunks)
        out_shape = jax.ShapeDtypeStruct((chunks, *k.shape), jnp.float32)
    else:
        out_spec, out_shape = kv_spec, jax.ShapeDtypeStruct(k.shape, k.dtype)
    dk, dv = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=backward_specs(seq_spec, kv_spec, row_spec, lo, hi, lists),
        out_specs=[out_spec, out_spec],
        out_shape=[out_shape, out_shape],
        compiler_params=triton_params(config.num_warps_bwd, config.num_stages_bwd),
        interpret=interpret,
        name="masked_flash_dkv",
    )(q, k, v, do, lse, delta, lo, hi, *lists)
    if chunks > 1:
        dk, dv = dk.sum(0).astype(k.dtype), dv.sum(0).astype(v.dtype)
    return dk, dv
