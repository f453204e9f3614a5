"""Backward kernels: dQ over each query tile's key tiles, dK/dV over each key tile's query tiles.

dK/dV programs own one (key tile, kv head) and loop over the `group` q heads that share it, so
GQA needs neither repeated K/V nor atomics. `delta` is rowsum(dO * O) minus the LSE cotangent.
fused.py has the one-kernel variant (KernelConfig.fused_bwd).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import (
    LOG2E,
    NN,
    NT,
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
    tile = num_q_tiles - 1 - pl.program_id(0)
    row0 = tile * block_q
    outer = lax.div(tile, mask_block_q // block_q)
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
        s = matmul(q, k, NT, precision) * qk_scale
        if masked:
            s = jnp.where(visible(intervals, start, block_k, keys_first=False), s, -jnp.inf)
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


def _dkv_kernel(
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
) -> None:
    block_k = k_ref.shape[0]
    tile = pl.program_id(0)
    col0 = tile * block_k
    outer = lax.div(tile, mask_block_k // block_k)
    head0 = lax.rem(pl.program_id(1), heads_kv) * group
    k = k_ref[...]
    v = v_ref[...]
    precision = precision_for(k.dtype)
    qk_scale = scale * LOG2E

    def step(start: jax.Array, rep: jax.Array, carry: Any, masked: bool) -> Any:
        head = head0 + rep
        rows = pl.ds(start, block_q)
        intervals = load_intervals(lo_ref, hi_ref, start, block_q) if masked else None
        dk, dv, _ = dkv_update(
            k,
            v,
            q_ref[rows, head, :],
            do_ref[rows, head, :],
            backward_lse(lse_ref[head, rows]),
            delta_ref[head, rows],
            visible(intervals, col0, block_k, keys_first=True) if masked else None,
            carry,
            qk_scale=qk_scale,
            precision=precision,
        )
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


def backward_dq(
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
) -> jax.Array:
    """dQ (B,Sq,Hq,D) from padded inputs; lists are the per-q-tile key tile lists."""
    batch, seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    block_q, block_k = config.block_q_dq, config.block_k_dq
    num_q_tiles = seq_q // block_q

    def q_map(i: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_q), num_q_tiles - 1 - i, lax.rem(bh, heads_q), 0

    def kv_map(i: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_q), 0, lax.div(lax.rem(bh, heads_q), group), 0

    def row_map(i: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_q), lax.rem(bh, heads_q), num_q_tiles - 1 - i

    kernel = functools.partial(
        _dq_kernel,
        scale=scale,
        num_q_tiles=num_q_tiles,
        mask_block_q=mask_block_q,
        mask_block_k=mask_block_k,
        block_k=block_k,
    )
    q_spec = pl.BlockSpec((None, block_q, None, dim), q_map)
    kv_spec = pl.BlockSpec((None, seq_k, None, dim), kv_map)
    row_spec = pl.BlockSpec((None, None, block_q), row_map)
    return pl.pallas_call(
        kernel,
        grid=(num_q_tiles, batch * heads_q),
        in_specs=[
            q_spec,
            kv_spec,
            kv_spec,
            q_spec,
            row_spec,
            row_spec,
            whole_spec(lo),
            whole_spec(hi),
            whole_spec(lists.index),
            whole_spec(lists.n_partial),
            whole_spec(lists.count),
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(config.num_warps_bwd, config.num_stages_bwd),
        interpret=interpret,
        name="masked_flash_dq",
    )(q, k, v, do, lse, delta, lo, hi, lists.index, lists.n_partial, lists.count)


def backward_dkv(
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
) -> tuple[jax.Array, jax.Array]:
    """dK, dV (B,Sk,Hkv,D) from padded inputs; lists are the per-k-tile query tile lists."""
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
        _dkv_kernel,
        scale=scale,
        heads_kv=heads_kv,
        group=heads_q // heads_kv,
        mask_block_q=mask_block_q,
        mask_block_k=mask_block_k,
        block_q=block_q,
    )
    kv_spec = pl.BlockSpec((None, block_k, None, dim), kv_map)
    seq_spec = pl.BlockSpec((None, seq_q, heads_q, dim), seq_map)
    row_spec = pl.BlockSpec((None, heads_q, seq_q), row_map)
    return pl.pallas_call(
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
        ],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=triton_params(config.num_warps_bwd, config.num_stages_bwd),
        interpret=interpret,
        name="masked_flash_dkv",
    )(q, k, v, do, lse, delta, lo, hi, lists.index, lists.n_partial, lists.count)
