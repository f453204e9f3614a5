"""Masks as runtime arrays for JAX kernels: per-row key intervals plus compacted tile lists.

Kernels take these as inputs (not compile-time constants), so a new document layout of the same
shape reuses the compiled kernel, and context parallelism can stack one per (rank, step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from attn_masks import Mask, TileList

DEFAULT_BLOCK = 64
# Walk spread (TileList.walk_spread) above which a mask's walks count as uneven: at 8K-32K in
# 128x128 and 128x256 tiles the benchmark's 12 static masks measure 0.055-0.26 (the document
# masks) or at most 0.026 (full, causal, prefix-LM causal, windows); the two long-document
# masks fall on either side of it with the length and tiles (0.02-0.065).
UNEVEN_WALK_SPREAD = 0.05
# Share of partial tiles (TileList.partial_share) up to which a mask counts as having few. In
# 128x256 tiles at 8K-64K: full and block_causal_document 0; causal and prefix-LM causal
# 0.007-0.061; global_sliding_window 0.016-0.083 (over the bound at 8K); the document, window,
# blockwise and share_question masks 0.09-0.62, except causal_blockwise at 64K (0.034) and
# full_document_long at 32K-64K (0.058-0.067), which fall under it.
FEW_PARTIAL_SHARE = 0.08
# Pair spread (TileList.pair_spread) up to which the dK/dV walks of key tiles p and N - 1 - p
# count as adding up evenly. In 128x128 tiles at 8K-32K: full and causal 0, prefix-LM causal and
# the sliding windows 0.03-0.11, global_sliding_window and the document, blockwise and
# share_question masks 0.14-0.91. Elsewhere the split differs (128x256 tiles at 8K:
# full_document 0.110; at 2K block_causal_document 0, the sliding windows 0.15-0.17).
EVEN_PAIR_SPREAD = 0.12

jax.tree_util.register_dataclass(TileList, data_fields=["index", "count", "full"], meta_fields=[])


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["lo", "hi", "kv", "q"],
    meta_fields=[
        "seqlen_q",
        "seqlen_k",
        "block_q",
        "block_k",
        "uneven_walks",
        "walk_peak",
        "few_partial_tiles",
        "even_pairs",
    ],
)
@dataclasses.dataclass(frozen=True)
class MaskArrays:
    """Arrays describing one mask (or a stack of masks along leading axes).

    lo, hi: (..., Sq, K) int32, row i sees keys j with lo[i, r] <= j < hi[i, r] for some r.
    kv: the k tiles of each q tile, q: the q tiles of each k tile, as attn_masks.TileList
    (index/full (..., n, W), count (..., n)) on the host or the device; None where an impl reads
    only the intervals. Tiles are block_q x block_k. uneven_walks: neighbouring tiles of this one
    mask walk lists of very different lengths (a static fact of the host lists, which a kernel
    may choose its launch order by: at most two programs per shape); False for a stack, whose
    masks share one program whatever their walks. walk_peak: the longest dK/dV walk (q tiles
    of one key tile) over the mean, rounded to a power of sqrt(2) so that masks of one shape
    share few programs (static: a kernel may split its longest walks by it); 0 for a stack or
    no walk. few_partial_tiles: at most FEW_PARTIAL_SHARE of the listed tiles are partial
    (static: a kernel may choose its step shape by it); False for a stack. even_pairs: the
    dK/dV walks of key tiles p and N - 1 - p add up to about the same length for every p
    (TileList.pair_spread at most EVEN_PAIR_SPREAD: full, causal, prefix-LM causal and the
    sliding windows at 8K-32K in 128x128 tiles), so a kernel may give each CTA such a pair
    without lengthening the grid's tail; False for a stack.
    """

    lo: jax.Array | np.ndarray
    hi: jax.Array | np.ndarray
    kv: TileList | None
    q: TileList | None
    seqlen_q: int
    seqlen_k: int
    block_q: int
    block_k: int
    uneven_walks: bool = False
    walk_peak: float = 0.0
    few_partial_tiles: bool = False
    even_pairs: bool = False

    @property
    def num_intervals(self) -> int:
        return int(self.lo.shape[-1])


def prepare_mask(
    mask: Mask, block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK
) -> MaskArrays:
    """Host-side: the arrays a kernel needs for `mask` with tiles (block_q, block_k)."""
    lo, hi = mask.row_intervals()
    lists = mask.block_lists(block_q, block_k)
    spread = max(lists.kv.walk_spread(), lists.q.walk_spread())
    return MaskArrays(
        lo=lo.astype(np.int32),
        hi=hi.astype(np.int32),
        kv=lists.kv,
        q=lists.q,
        seqlen_q=mask.seqlen_q,
        seqlen_k=mask.seqlen_k,
        block_q=block_q,
        block_k=block_k,
        uneven_walks=spread > UNEVEN_WALK_SPREAD,
        walk_peak=lists.q.walk_peak(),
        few_partial_tiles=lists.kv.partial_share() <= FEW_PARTIAL_SHARE,
        even_pairs=lists.q.pair_spread() <= EVEN_PAIR_SPREAD,
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
    """Pad tile lists to `width`, repeating each row's last valid entry (lists already that
    wide come back as they are: their entries past the count repeat it already)."""
    if index.shape[-1] >= width:
        return index.astype(np.int32, copy=False)
    out = _pad_last(index, width, repeat_last=True)
    last = np.take_along_axis(index, np.maximum(count - 1, 0)[..., None], axis=-1)
    pad = np.arange(width) >= count[..., None]
    return np.where(pad, last, out).astype(np.int32)


def _stack_lists(lists: Sequence[TileList]) -> TileList:
    """Host tile lists stacked along a new leading axis, padded to the widest."""
    width = max(tl.width for tl in lists)
    return TileList(
        index=np.stack([_pad_index(tl.index, tl.count, width) for tl in lists]),
        count=np.stack([tl.count for tl in lists]),
        full=np.stack([_pad_last(tl.full, width, repeat_last=False) for tl in lists]),
    )


def stack_mask_arrays(items: Sequence[MaskArrays]) -> MaskArrays:
    """Stack host MaskArrays of equal (Sq, Sk, tiles) along a new leading axis, padding widths."""
    first = items[0]
    for it in items:
        same = (it.seqlen_q, it.seqlen_k, it.block_q, it.block_k)
        if same != (first.seqlen_q, first.seqlen_k, first.block_q, first.block_k):
            raise ValueError(f"cannot stack masks of different geometry: {same} vs first")
    k = max(it.num_intervals for it in items)
    return MaskArrays(
        lo=np.stack([_pad_last(np.asarray(it.lo), k, repeat_last=False) for it in items]),
        hi=np.stack([_pad_last(np.asarray(it.hi), k, repeat_last=False) for it in items]),
        kv=_stack_lists([it.kv for it in items]),
        q=_stack_lists([it.q for it in items]),
        seqlen_q=first.seqlen_q,
        seqlen_k=first.seqlen_k,
        block_q=first.block_q,
        block_k=first.block_k,
    )


def _empty_lists(outer: int, inner: int) -> TileList:
    """Lists of `outer` tiles that see none of their `inner` tiles, at full width."""
    return TileList(
        index=np.zeros((outer, inner), np.int32),
        count=np.zeros(outer, np.int32),
        full=np.zeros((outer, inner), bool),
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
        kv=_empty_lists(nq, nk),
        q=_empty_lists(nk, nq),
        seqlen_q=like.seqlen_q,
        seqlen_k=like.seqlen_k,
        block_q=like.block_q,
        block_k=like.block_k,
    )


def widen_mask_arrays(arrays: MaskArrays, intervals: int) -> MaskArrays:
    """One host mask's arrays in the shapes a stack with empty_mask_arrays(arrays, intervals)
    gives it (`intervals` intervals per row, full-width tile lists, a stack's static flags),
    without the stack's copies of the whole arrays: its slice of such a stack."""
    nq = -(-arrays.seqlen_q // arrays.block_q)
    nk = -(-arrays.seqlen_k // arrays.block_k)

    def widen(lists: TileList | None, width: int) -> TileList | None:
        if lists is None:
            return None
        return TileList(
            index=_pad_index(np.asarray(lists.index), np.asarray(lists.count), width),
            count=np.asarray(lists.count),
            full=_pad_last(np.asarray(lists.full), width, repeat_last=False),
        )

    k = max(arrays.num_intervals, intervals)
    return MaskArrays(
        lo=_pad_last(np.asarray(arrays.lo), k, repeat_last=False),
        hi=_pad_last(np.asarray(arrays.hi), k, repeat_last=False),
        kv=widen(arrays.kv, nk),
        q=widen(arrays.q, nq),
        seqlen_q=arrays.seqlen_q,
        seqlen_k=arrays.seqlen_k,
        block_q=arrays.block_q,
        block_k=arrays.block_k,
    )


def scatter_query_tiles(
    arrays: MaskArrays, rows: np.ndarray, seqlen_q: int, intervals: int
) -> MaskArrays:
    """Host `arrays` of a mask over len(rows) query rows, as the device arrays of a
    seqlen_q-row mask whose rows `rows` (whole query tiles, ascending) are that mask's rows and
    whose other rows see nothing, in the shapes widen_mask_arrays(..., intervals) gives: what
    building that taller mask's arrays on the host and putting them on the device gives, in
    host work proportional to the given tiles (a 2M-token piece checked on four query tiles
    would otherwise build a 268M-tile block map and copy gigabytes of padded lists). ValueError
    unless `rows` are whole, ascending tiles inside seqlen_q."""
    rows = np.asarray(rows, np.int64)
    bq = arrays.block_q
    tiles = rows[::bq] // bq
    whole = (tiles[:, None] * bq + np.arange(bq)).ravel()
    if (
        not len(rows)
        or len(rows) != arrays.seqlen_q
        or len(rows) % bq
        or not np.array_equal(rows, whole)
        or np.any(np.diff(tiles) <= 0)
        or rows[0] < 0
        or rows[-1] >= seqlen_q
    ):
        raise ValueError(
            f"rows must be {arrays.seqlen_q} rows forming one or more whole, ascending {bq}-row "
            f"tiles inside [0, {seqlen_q}), got {len(rows)} rows in [{rows.min(initial=0)}, "
            f"{rows.max(initial=0)}]"
        )
    nq = -(-seqlen_q // bq)
    nk = -(-arrays.seqlen_k // arrays.block_k)
    k = max(arrays.num_intervals, intervals)
    bounds = [
        _pad_last(np.asarray(x, np.int32), k, repeat_last=False) for x in (arrays.lo, arrays.hi)
    ]
    lists = None
    if arrays.kv is not None:
        kv, q = arrays.kv, arrays.q
        q_index = np.where(np.asarray(q.count)[:, None] > 0, tiles[np.asarray(q.index)], 0)
        lists = (
            _pad_index(np.asarray(kv.index), np.asarray(kv.count), nk),
            np.asarray(kv.count, np.int32),
            _pad_last(np.asarray(kv.full), nk, repeat_last=False),
            _pad_index(q_index, np.asarray(q.count), len(tiles)),
            np.asarray(q.count, np.int32),
            _pad_last(np.asarray(q.full), len(tiles), repeat_last=False),
        )
    lo, hi, lists = _placed(rows, tiles, *bounds, lists, seqlen_q=seqlen_q, nq=nq)
    return MaskArrays(
        lo=lo,
        hi=hi,
        kv=None if lists is None else TileList(*lists[:3]),
        q=None if lists is None else TileList(*lists[3:]),
        seqlen_q=seqlen_q,
        seqlen_k=arrays.seqlen_k,
        block_q=bq,
        block_k=arrays.block_k,
    )


@partial(jax.jit, static_argnames=("seqlen_q", "nq"))
def _placed(rows, tiles, lo, hi, lists, *, seqlen_q: int, nq: int):
    """scatter_query_tiles' device part: the rows' intervals and the tiles' lists (already
    padded: K/V lists to full width, Q lists to the kept tiles' count) placed at full size."""

    def rows_of(x):
        return jnp.zeros((seqlen_q, x.shape[1]), x.dtype).at[rows].set(x)

    if lists is None:
        return rows_of(lo), rows_of(hi), None
    kv_index, kv_count, kv_full, q_index, q_count, q_full = lists
    nk, kept = q_index.shape
    widths = (nk, nq - kept)
    q_index = jnp.concatenate([q_index, jnp.broadcast_to(q_index[:, -1:], widths)], axis=1)
    q_full = jnp.concatenate([q_full, jnp.zeros(widths, bool)], axis=1)
    placed = (
        jnp.zeros((nq, nk), jnp.int32).at[tiles].set(kv_index),
        jnp.zeros(nq, jnp.int32).at[tiles].set(kv_count),
        jnp.zeros((nq, nk), bool).at[tiles].set(kv_full),
        q_index.astype(jnp.int32),
        q_count,
        q_full,
    )
    return rows_of(lo), rows_of(hi), placed


def dense_from_intervals(lo: jax.Array, hi: jax.Array, seqlen_k: int) -> jax.Array:
    """(..., Sq, Sk) bool visibility from per-row intervals (for reference impls, small sizes)."""
    cols = jax.numpy.arange(seqlen_k, dtype=lo.dtype)
    vis = (cols >= lo[..., None]) & (cols < hi[..., None])
    return vis.any(axis=-2)
