"""Forward kernel: online softmax over the non-empty key tiles of each query tile."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import LN2, LOG2E, NN, NT, load_intervals, matmul, precision_for, visible, walk_tiles
from .compat import triton_params
from .config import KernelConfig
from .tiles import TileLists


def _forward_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    lo_ref: Any,
    hi_ref: Any,
    index_ref: Any,
    n_partial_ref: Any,
    count_ref: Any,
    o_ref: Any,
    lse_ref: Any,
    *,
    scale: float,
    num_q_tiles: int,
    mask_block_q: int,
    mask_block_k: int,
    block_k: int,
) -> None:
    block_q = q_ref.shape[0]
    tile = num_q_tiles - 1 - pl.program_id(0)  # longest rows of causal masks first
    row0 = tile * block_q
    outer = lax.div(tile, mask_block_q // block_q)
    q = q_ref[...]
    precision = precision_for(q.dtype)
    qk_scale = scale * LOG2E
    intervals = load_intervals(lo_ref, hi_ref, row0, block_q)

    def step(start: jax.Array, _rep: jax.Array, carry: Any, masked: bool) -> Any:
        acc, m_prev, l_prev = carry
        k = k_ref[pl.ds(start, block_k), :]
        s = matmul(q, k, NT, precision) * qk_scale
        if masked:
            s = jnp.where(visible(intervals, start, block_k, keys_first=False), s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
        alpha = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        v = v_ref[pl.ds(start, block_k), :]
        acc = acc * alpha[:, None] + matmul(p.astype(v.dtype), v, NN, precision)
        return acc, m_next, l_next

    carry = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, m, denom = walk_tiles(
        index_ref,
        n_partial_ref,
        count_ref,
        outer,
        carry,
        step,
        mask_tile=mask_block_k,
        tile=block_k,
    )
    empty = denom == 0.0
    denom = jnp.where(empty, 1.0, denom)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(denom)) * LN2)


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
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
    """Padded q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D), lo/hi (K,Sq) -> out (B,Sq,Hq,D), lse (B,Hq,Sq)."""
    batch, seq_q, heads_q, dim = q.shape
    seq_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    block_q, block_k = config.block_q, config.block_k
    num_q_tiles = seq_q // block_q

    def q_map(i: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_q), num_q_tiles - 1 - i, lax.rem(bh, heads_q), 0

    def kv_map(i: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_q), 0, lax.div(lax.rem(bh, heads_q), group), 0

    def lse_map(i: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_q), lax.rem(bh, heads_q), num_q_tiles - 1 - i

    def whole(x: jax.Array) -> pl.BlockSpec:
        return pl.BlockSpec(x.shape, lambda i, bh: (0,) * x.ndim)

    kernel = functools.partial(
        _forward_kernel,
        scale=scale,
        num_q_tiles=num_q_tiles,
        mask_block_q=mask_block_q,
        mask_block_k=mask_block_k,
        block_k=block_k,
    )
    return pl.pallas_call(
        kernel,
        grid=(num_q_tiles, batch * heads_q),
        in_specs=[
            pl.BlockSpec((None, block_q, None, dim), q_map),
            pl.BlockSpec((None, seq_k, None, dim), kv_map),
            pl.BlockSpec((None, seq_k, None, dim), kv_map),
            whole(lo),
            whole(hi),
            whole(lists.index),
            whole(lists.n_partial),
            whole(lists.count),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, None, dim), q_map),
            pl.BlockSpec((None, None, block_q), lse_map),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads_q, seq_q), jnp.float32),
        ],
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="masked_flash_forward",
    )(q, k, v, lo, hi, lists.index, lists.n_partial, lists.count)
