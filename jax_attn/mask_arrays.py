"""Masks as runtime arrays for JAX kernels: per-row key intervals plus compacted tile lists.

Kernels take these as inputs (not compile-time constants), so a new document layout of the same
shape reuses the compiled kernel, and context parallelism can stack one per (rank, step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import numpy as np

from attn_masks import Mask

DEFAULT_BLOCK = 64


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["lo", "hi", "kv_index", "kv_count", "kv_full", "q_index", "q_count", "q_full"],
    meta_fields=["seqlen_q", "seqlen_k", "block_q", "block_k"],
)
@dataclasses.dataclass(frozen=True)
class MaskArrays:
    """Arrays describing one mask (or a stack of masks along leading axes).

    lo, hi: (..., Sq, K) int32, row i sees keys j with lo[i, r] <= j < hi[i, r] for some r.
    kv_index/kv_full: (..., nq, W) non-empty k tiles per q tile (padding repeats the last one),
    kv_count: (..., nq). q_index/q_full/q_count: the transpose, per k tile. Tiles are
    block_q x block_k; nq = ceil(Sq / block_q), nk = ceil(Sk / block_k).
    """

    lo: jax.Array | np.ndarray
    hi: jax.Array | np.ndarray
    kv_index: jax.Array | np.ndarray
    kv_count: jax.Array | np.ndarray
    kv_full: jax.Array | np.ndarray
    q_index: jax.Array | np.ndarray
    q_count: jax.Array | np.ndarray
    q_full: jax.Array | np.ndarray
    seqlen_q: int
    seqlen_k: int
    block_q: int
    block_k: int

    @property
    def num_intervals(self) -> int:
        return int(self.lo.shape[-1])


def prepare_mask(
    mask: Mask, block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK
) -> MaskArrays:
    """Host-side: the arrays a kernel needs for `mask` with tiles (block_q, block_k)."""
    lo, hi = mask.row_intervals()
    bl = mask.block_lists(block_q, block_k)
    return MaskArrays(
        lo=lo.astype(np.int32),
        hi=hi.astype(np.int32),
        kv_index=bl.kv_index,
        kv_count=bl.kv_count,
        kv_full=bl.kv_full,
        q_index=bl.q_index,
        q_count=bl.q_count,
        q_full=bl.q_full,
        seqlen_q=mask.seqlen_q,
        seqlen_k=mask.seqlen_k,
        block_q=block_q,
        block_k=block_k,
    )


def _pad_last(x: np.ndarray, width: int, *, repeat_last: bool) -> np.ndarray:
    extra = width - x.shape[-1]
    if extra <= 0:
        return x
    fill = (
        np.repeat(x[..., -1:], extra, axis=-1)
        if repeat_last
        else np.zeros(x.shape[:-1] + (extra,), x.dtype)
    )
    return np.concatenate([x, fill], axis=-1)


def _pad_index(index: np.ndarray, count: np.ndarray, width: int) -> np.ndarray:
    """Pad tile lists to `width`, repeating each row's last valid entry."""
    out = _pad_last(index, width, repeat_last=True)
    last = np.take_along_axis(index, np.maximum(count - 1, 0)[..., None], axis=-1)
    pad = np.arange(width) >= count[..., None]
    return np.where(pad, last, out).astype(np.int32)


def stack_mask_arrays(items: Sequence[MaskArrays]) -> MaskArrays:
    """Stack host MaskArrays of equal (Sq, Sk, tiles) along a new leading axis, padding widths."""
    first = items[0]
    for it in items:
        same = (it.seqlen_q, it.seqlen_k, it.block_q, it.block_k)
        if same != (first.seqlen_q, first.seqlen_k, first.block_q, first.block_k):
            raise ValueError(f"cannot stack masks of different geometry: {same} vs first")
    k = max(it.num_intervals for it in items)
    wkv = max(it.kv_index.shape[-1] for it in items)
    wq = max(it.q_index.shape[-1] for it in items)
    return MaskArrays(
        lo=np.stack([_pad_last(np.asarray(it.lo), k, repeat_last=False) for it in items]),
        hi=np.stack([_pad_last(np.asarray(it.hi), k, repeat_last=False) for it in items]),
        kv_index=np.stack([_pad_index(it.kv_index, it.kv_count, wkv) for it in items]),
        kv_count=np.stack([it.kv_count for it in items]),
        kv_full=np.stack([_pad_last(it.kv_full, wkv, repeat_last=False) for it in items]),
        q_index=np.stack([_pad_index(it.q_index, it.q_count, wq) for it in items]),
        q_count=np.stack([it.q_count for it in items]),
        q_full=np.stack([_pad_last(it.q_full, wq, repeat_last=False) for it in items]),
        seqlen_q=first.seqlen_q,
        seqlen_k=first.seqlen_k,
        block_q=first.block_q,
        block_k=first.block_k,
    )


def empty_mask_arrays(like: MaskArrays, intervals: int) -> MaskArrays:
    """A mask of `like`'s geometry that sees nothing, with `intervals` intervals per row and
    full-width tile lists.

    Stacked with real masks (stack_mask_arrays) it fixes their array shapes per geometry, so one
    compiled program serves every mask of a given length.
    """
    nq = -(-like.seqlen_q // like.block_q)
    nk = -(-like.seqlen_k // like.block_k)
    rows = np.zeros((like.seqlen_q, intervals), np.int32)
    return MaskArrays(
        lo=rows,
        hi=rows,
        kv_index=np.zeros((nq, nk), np.int32),
        kv_count=np.zeros(nq, np.int32),
        kv_full=np.zeros((nq, nk), bool),
        q_index=np.zeros((nk, nq), np.int32),
        q_count=np.zeros(nk, np.int32),
        q_full=np.zeros((nk, nq), bool),
        seqlen_q=like.seqlen_q,
        seqlen_k=like.seqlen_k,
        block_q=like.block_q,
        block_k=like.block_k,
    )


def dense_from_intervals(lo: jax.Array, hi: jax.Array, seqlen_k: int) -> jax.Array:
    """(..., Sq, Sk) bool visibility from per-row intervals (for reference impls, small sizes)."""
    cols = jax.numpy.arange(seqlen_k, dtype=lo.dtype)
    vis = (cols >= lo[..., None]) & (cols < hi[..., None])
    return vis.any(axis=-2)
