"""What both Pallas kernels (Triton and Mosaic GPU) take besides q, k and v, built from MaskArrays.

Sequences are padded to whole mask tiles; the per-row intervals become (K, padded Sq) with empty
padded rows; each tile list becomes its pass's attn_masks.PassTiles (tiles over the padding
partial) walked partial tiles first (PassTiles.partial_first); the backward gets delta =
rowsum(dout * out) - dlse and the LSE in base 2. All of it is jnp, so traced MaskArrays stay
runtime inputs and a new mask of the same shape reuses the compiled kernels; pallas_triton builds
it inside its jitted program, mosaic_gpu.mask_operands under once_per_mask: once per trace
where the MaskArrays are concrete and small.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from attn_masks import PartialFirst, PassTiles, TileList

from .mask_arrays import MaskArrays

LOG2E = math.log2(math.e)  # the kernels compute exponentials in base 2
LN2 = math.log(2.0)
# Mask arrays larger than this have their kernel inputs built in the caller's program, not as
# its constants: the inputs are about as large again (walks, bounds), and at such lengths
# (causal and full masks in 128x128 tiles from about 320K tokens: 42 MiB at 256K, 93 MiB at
# 384K) their build, which grows with the listed tiles (walks) and the q tiles times the heads
# (a persistent deal), is small beside the kernel's work, which grows with the listed tiles
# times the heads (reasoned from the sizes, not measured there).
CONSTANT_BYTES = 64 * 2**20


def once_per_mask(arrays: MaskArrays) -> contextlib.AbstractContextManager:
    """The context to build a call's inputs from `arrays` in: jax.ensure_compile_time_eval where
    they are concrete and at most CONSTANT_BYTES (a mask closed over by the jitted caller: built
    once, when it is traced, as constants of its program), else none (traced arrays are runtime
    inputs, built in the caller's program, so a new mask of the same shape reuses it)."""
    leaves = jax.tree.leaves(arrays)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return contextlib.nullcontext()
    if sum(x.nbytes for x in leaves) > CONSTANT_BYTES:
        return contextlib.nullcontext()
    return jax.ensure_compile_time_eval()


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


def _walk(lists: TileList, padding: TilePadding, *, by_key: bool) -> PartialFirst:
    """The pass's tiles (PassTiles: tiles over the padding partial) as the kernels walk them,
    partial tiles first."""
    tiles = PassTiles.of(
        lists,
        by_key=by_key,
        seqlen_q=padding.seq_q,
        seqlen_k=padding.seq_k,
        block_q=padding.block_q,
        block_k=padding.block_k,
        xp=jnp,
    )
    return tiles.partial_first(jnp)


def query_tile_walk(arrays: MaskArrays, padding: TilePadding) -> PartialFirst:
    """Per query tile, the key tiles it visits (the forward and dQ walk)."""
    return _walk(arrays.kv, padding, by_key=False)


def key_tile_walk(arrays: MaskArrays, padding: TilePadding) -> PartialFirst:
    """Per key tile, the query tiles it visits (the dK/dV walk)."""
    return _walk(arrays.q, padding, by_key=True)


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
