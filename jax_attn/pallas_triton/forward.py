"""Forward kernel: online softmax over the non-empty key tiles of each query tile."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attn_masks import PartialFirst

from ..kernel_inputs import LN2, LOG2E
from .common import (
    NN,
    load_intervals,
    mask_specs,
    matmul,
    precision_for,
    query_tile,
    query_tile_launch,
    scores,
    triton_params,
    walk_tiles,
)
from .config import KernelConfig


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
    row0, outer = query_tile(num_q_tiles, block_q, mask_block_q)
    q = q_ref[...]
    precision = precision_for(q.dtype)
    qk_scale = scale * LOG2E
    intervals = load_intervals(lo_ref, hi_ref, row0, block_q)

    def step(start: jax.Array, _rep: jax.Array, carry: Any, masked: bool) -> Any:
        acc, m_prev, l_prev = carry
        k = k_ref[pl.ds(start, block_k), :]
        s = scores(q, k, intervals, start, masked, qk_scale=qk_scale, precision=precision)
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
    lists: PartialFirst,
    *,
    scale: float,
    config: KernelConfig,
    mask_block_q: int,
    mask_block_k: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """Padded q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D), lo/hi (K,Sq) -> out (B,Sq,Hq,D), lse (B,Hq,Sq)."""
    batch, seq_q, heads_q, _ = q.shape
    kernel, grid, (q_spec, kv_spec, lse_spec) = query_tile_launch(
        _forward_kernel,
        q,
        k,
        config.block_q,
        config.block_k,
        scale=scale,
        mask_block_q=mask_block_q,
        mask_block_k=mask_block_k,
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[q_spec, kv_spec, kv_spec, *mask_specs(lo, hi, lists)],
        out_specs=[q_spec, lse_spec],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads_q, seq_q), jnp.float32),
        ],
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="masked_flash_forward",
    )(q, k, v, lo, hi, *lists)
