"""The Mosaic kernels' mask operands for one call shape, built apart from the kernels.

The padded intervals, the forward's row bounds, both tile walks (partial tiles first) and the
persistent forward's dealt items depend on the mask and the call's shapes only. mask_operands
builds them before the kernels' jitted program: from concrete MaskArrays (a mask closed over by
a jitted function, as the driver's calls hold theirs) once, under jax.ensure_compile_time_eval
when that function is traced, so they enter its program as constants, as FlexAttention's
BlockMask or splash attention's MaskInfo are built once per mask; from traced MaskArrays
(runtime inputs, so a new mask of the same shape reuses the compiled program), or concrete ones
above kernel_inputs.CONSTANT_BYTES, inside the caller's program (kernel_inputs.once_per_mask).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from attn_masks import PartialFirst

from ..kernel_inputs import (
    TilePadding,
    key_tile_walk,
    once_per_mask,
    padded_intervals,
    query_tile_walk,
)
from ..mask_arrays import MaskArrays
from .config import KernelConfig
from .forward import dealt_items


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["lo", "hi", "bounds", "query_walk", "key_walk", "items"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class MaskOperands:
    """lo, hi: (K, padded Sq) intervals (backward); bounds: the forward's (padded Sq /
    block_q, 2K, block_q) row bounds; query_walk: each q tile's key tiles (forward, dQ);
    key_walk: each key tile's q tiles (dK/dV); items: the persistent forward's deal
    (forward.dealt_items), None without it or where only the backward was asked for."""

    lo: jax.Array
    hi: jax.Array
    bounds: jax.Array
    query_walk: PartialFirst
    key_walk: PartialFirst
    items: jax.Array | None


def forward_bounds(lo: jax.Array, hi: jax.Array, block_q: int) -> jax.Array:
    """(padded Sq / block_q, 2K, block_q) int32 of the (K, padded Sq) intervals: per block_q-row
    slice the rows' lo, hi of each interval, interleaved."""
    padded_q = lo.shape[1]
    both = jnp.stack([lo.T, hi.T], axis=-1).reshape(padded_q // block_q, block_q, -1)
    return jnp.transpose(both, (0, 2, 1))


@functools.partial(jax.jit, static_argnames=("q_shape", "k_shape", "config", "deal"))
def _build(
    arrays: MaskArrays,
    *,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    config: KernelConfig,
    deal: bool,
) -> MaskOperands:
    """mask_operands' work as one program per call shape and config."""
    pad = TilePadding.of(arrays)
    lo, hi = padded_intervals(arrays, pad)
    query_walk = query_tile_walk(arrays, pad)
    items = None
    if deal:
        padded_q = (q_shape[0], pad.padded_q, *q_shape[2:])
        padded_k = (k_shape[0], pad.padded_k, *k_shape[2:])
        items = dealt_items(padded_q, padded_k, query_walk, intervals=lo.shape[0], config=config)
    return MaskOperands(
        lo=lo,
        hi=hi,
        bounds=forward_bounds(lo, hi, config.block_q),
        query_walk=query_walk,
        key_walk=key_tile_walk(arrays, pad),
        items=items,
    )


def mask_operands(
    q: jax.Array, k: jax.Array, arrays: MaskArrays, *, config: KernelConfig, deal: bool = True
) -> MaskOperands:
    """The kernels' operands of `arrays` for a call on q (B,Sq,Hq,D) and k (B,Sk,Hkv,D) with
    `config`: computed now where the arrays are concrete and small, else traced into the
    caller's program (kernel_inputs.once_per_mask). deal: also deal the persistent forward's
    items (the backward alone reads none, and takes mask tiles other than the forward's)."""
    with once_per_mask(arrays):
        return _build(arrays, q_shape=q.shape, k_shape=k.shape, config=config, deal=deal)
