"""What both Pallas kernels (Triton and Mosaic GPU) take besides q, k and v, built from MaskArrays.

Sequences are padded to whole mask tiles; the per-row intervals become (K, padded Sq) with empty
padded rows; each tile list becomes a walk with its partial tiles first, where the tiles over the
padding count as partial; the backward gets delta = rowsum(dout * out) - dlse and the LSE in base
2. All of it runs in jnp inside the jitted wrappers, so MaskArrays stay runtime inputs and a new
mask of the same shape reuses the compiled kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from attn_masks import TileList

from .mask_arrays import MaskArrays

LOG2E = math.log2(math.e)  # the kernels compute exponentials in base 2
LN2 = math.log(2.0)


def pad_axis(x: jax.Array, axis: int, size: int, value: float = 0.0) -> jax.Array:
    """x extended with `value` along `axis` to length `size` (x itself when already that long)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


@dataclass(frozen=True)
class TilePadding:
    """The sequence lengths of a call and the same rounded up to whole mask tiles."""

    seq_q: int
    seq_k: int
    padded_q: int
    padded_k: int
    block_q: int
    block_k: int

    @classmethod
    def of(cls, arrays: MaskArrays) -> TilePadding:
        """The padding of the mask `arrays` describe (block_q x block_k tiles)."""
        bq, bk = arrays.block_q, arrays.block_k
        sq, sk = arrays.seqlen_q, arrays.seqlen_k
        return cls(sq, sk, -(-sq // bq) * bq, -(-sk // bk) * bk, bq, bk)

    @property
    def ragged_q_tile(self) -> int | None:
        """Index of the last query tile when it reaches into the padding, else None."""
        return self.padded_q // self.block_q - 1 if self.padded_q != self.seq_q else None

    @property
    def ragged_k_tile(self) -> int | None:
        """Index of the last key tile when it reaches into the padding, else None."""
        return self.padded_k // self.block_k - 1 if self.padded_k != self.seq_k else None


class TileWalk(NamedTuple):
    """index[t, :count[t]] are the inner tiles outer tile t visits; the first n_partial[t] of them
    need the in-tile mask, the rest are fully visible."""

    index: jax.Array
    n_partial: jax.Array
    count: jax.Array


def _partial_first(
    lists: TileList, *, padded_outer: int | None, padded_inner: int | None
) -> TileWalk:
    """Each outer tile's list reordered partial tiles first; tiles over padding become partial.

    A tile list calls a tile full over the real rows/cols only, so the outer tile `padded_outer`
    and the inner tile `padded_inner` that reach into the padding (None: none does) are masked.
    """
    index = jnp.asarray(lists.index, jnp.int32)
    count = jnp.asarray(lists.count, jnp.int32)
    full = jnp.asarray(lists.full, bool)
    n_outer, width = index.shape
    valid = jnp.arange(width, dtype=jnp.int32)[None, :] < count[:, None]
    full = full & valid
    if padded_inner is not None:
        full = full & (index != padded_inner)
    if padded_outer is not None:
        full = full & (jnp.arange(n_outer)[:, None] != padded_outer)
    partial = valid & ~full
    key = jnp.where(partial, 0, jnp.where(valid, 1, 2)).astype(jnp.int32)
    order = jnp.argsort(key, axis=1, stable=True)
    index = jnp.take_along_axis(index, order, axis=1)
    n_partial = jnp.sum(partial, axis=1, dtype=jnp.int32)
    return TileWalk(index, n_partial, count)


def query_tile_walk(arrays: MaskArrays, padding: TilePadding) -> TileWalk:
    """Per query tile, the key tiles it visits (the forward and dQ walk)."""
    return _partial_first(
        arrays.kv, padded_outer=padding.ragged_q_tile, padded_inner=padding.ragged_k_tile
    )


def key_tile_walk(arrays: MaskArrays, padding: TilePadding) -> TileWalk:
    """Per key tile, the query tiles it visits (the dK/dV walk)."""
    return _partial_first(
        arrays.q, padded_outer=padding.ragged_k_tile, padded_inner=padding.ragged_q_tile
    )


def padded_intervals(arrays: MaskArrays, padding: TilePadding) -> tuple[jax.Array, jax.Array]:
    """lo/hi as (K, padded Sq) int32; padded rows get the empty interval [0, 0)."""
    lo = pad_axis(jnp.asarray(arrays.lo, jnp.int32).T, 1, padding.padded_q)
    hi = pad_axis(jnp.asarray(arrays.hi, jnp.int32).T, 1, padding.padded_q)
    return lo, hi


def softmax_delta(
    out: jax.Array, dout: jax.Array, lse: jax.Array, dlse: jax.Array | None
) -> jax.Array:
    """delta = rowsum(dout * out) - dlse as (B, Hq, Sq) fp32; dlse is ignored on rows that see no
    key (lse -inf), whose gradients are zero whatever it holds."""
    f32 = jnp.float32
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(f32), dout.astype(f32))
    if dlse is None:
        return delta
    return delta - jnp.where(jnp.isneginf(lse), 0.0, dlse.astype(f32))


def backward_lse(lse: jax.Array) -> jax.Array:
    """Natural-log LSE in base 2, +inf for empty rows so that exp2(s - lse) is 0 there."""
    return jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
