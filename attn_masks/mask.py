"""The mask model: a list of typed (q_range, k_range) slices over Sq x Sk positions.

Internally every slice is a *band inside a rectangle*: rows [q0, q1), keys [k0, k1), visible iff
lo_off <= j - i <= hi_off. The four public types are special cases of that band, which makes
restriction to sub-rectangles (context parallelism), area, per-row intervals and block maps one
piece of arithmetic instead of four.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from . import tiles

INF = np.int64(1) << np.int64(60)


class MaskType(IntEnum):
    """Slice types (MagiAttention convention, docs/masks.md)."""

    FULL = 0
    CAUSAL = 1  # bottom-right aligned: c <= r + (lk - lq)
    INVCAUSAL = 2  # top-left aligned: c >= r
    BICAUSAL = 3  # both


def _as_ranges(x: Any, what: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 2), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{what} must have shape (n, 2), got {arr.shape}")
    return arr


def bands_from_types(
    q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Diagonal offsets (lo_off, hi_off) of j - i for each typed slice (global coordinates)."""
    q0, q1 = q_ranges[:, 0], q_ranges[:, 1]
    k0, k1 = k_ranges[:, 0], k_ranges[:, 1]
    causal = (types == MaskType.CAUSAL) | (types == MaskType.BICAUSAL)
    inv = (types == MaskType.INVCAUSAL) | (types == MaskType.BICAUSAL)
    hi = np.where(causal, k1 - q1, INF)
    lo = np.where(inv, k0 - q0, -INF)
    return lo, hi


def bands_to_typed(
    q0: np.ndarray,
    q1: np.ndarray,
    k0: np.ndarray,
    k1: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    group: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Re-express bands-in-rectangles as non-empty typed slices (at most 3 per band).

    Rows are first clipped to those that see a key; then split where the row's first visible key
    stops being k0 (lower diagonal takes over) and where its last stops being k1 - 1. Each band
    belongs to a group (e.g. the key block of a batched restriction): the slices come back with
    their band's group, sorted by group, then query start, then key start.
    """
    q0, q1, k0, k1, lo, hi, group = (
        np.asarray(a, np.int64) for a in (q0, q1, k0, k1, lo, hi, group)
    )
    lo_inf, hi_inf = lo <= -INF, hi >= INF
    lo = np.maximum(lo, k0 - q1)  # offsets beyond the rectangle change nothing; keep numbers small
    hi = np.minimum(hi, k1 - 1 - q0)
    r0 = np.maximum(q0, k0 - hi)
    r1 = np.minimum(q1, k1 - lo)
    ok = (r0 < r1) & (lo <= hi) & (k0 < k1)
    # rows < p1: first visible key is k0; rows < p2: last visible key is i + hi. A row where both
    # readings agree goes to the diagonal reading, so plain CAUSAL/BICAUSAL slices stay whole.
    p1 = np.where(lo_inf, r1, np.clip(k0 - lo, r0, r1))
    p2 = np.where(hi_inf, r0, np.clip(k1 - hi, r0, r1))
    cuts = np.stack([r0, np.minimum(p1, p2), np.maximum(p1, p2), r1], axis=1)
    # the (up to) three non-empty row segments [a, b) of every band that sees a key
    at = np.flatnonzero((cuts[:, :3] < cuts[:, 1:]) & ok[:, None])  # band * 3 + segment
    band = at // 3
    a, b = np.take(cuts, at + band), np.take(cuts, at + band + 1)
    lo_const = a < p1[band]
    hi_var = a < p2[band]
    start = np.where(lo_const, k0[band], a + lo[band])
    end = np.where(hi_var, b + hi[band], k1[band])
    typ = hi_var * MaskType.CAUSAL + ~lo_const * MaskType.INVCAUSAL  # BICAUSAL: both
    group = group[band]
    order = np.lexsort((start, a, group))
    return (
        np.stack([a, b], 1)[order],
        np.stack([start, end], 1)[order],
        typ[order].astype(np.int8),
        group[order],
    )


def typed_area(q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray) -> np.ndarray:
    """Closed-form visible pairs per slice (docs/masks.md), as Python-int-safe int64."""
    lq = q_ranges[:, 1] - q_ranges[:, 0]
    lk = k_ranges[:, 1] - k_ranges[:, 0]
    h = np.minimum(lq, lk)
    tri = h * (2 * lk - h + 1) // 2
    bi = np.maximum(lk - lq + 1, 0) * lq
    return np.select(
        [types == MaskType.FULL, types == MaskType.BICAUSAL], [lq * lk, bi], default=tri
    ).astype(np.int64)


def _joined_along(box: np.ndarray, along: int) -> tuple[np.ndarray, bool]:
    """(boxes, whether any joined) of (n, 4) boxes (q0, q1, k0, k1) with every chain of boxes
    over one range of the other axis, each starting where the last ends along columns
    (along, along + 1), joined into one box (joined_slices' pass along one axis)."""
    across = 2 - along
    b = box[np.lexsort((box[:, along], box[:, across + 1], box[:, across]))]
    same = (b[1:, across] == b[:-1, across]) & (b[1:, across + 1] == b[:-1, across + 1])
    touch = same & (b[1:, along] == b[:-1, along + 1])
    if not touch.any():
        return box, False
    first = np.concatenate([[True], ~touch])
    out = b[first]
    last = np.concatenate([np.flatnonzero(first)[1:] - 1, [len(b) - 1]])
    out[:, along + 1] = b[last, along + 1]
    return out, True


def joined_slices(
    q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same typed slices with every slice that sees its whole rectangle typed FULL (a
    one-row causal slice, say) and FULL ones that touch along one axis over the same range of
    the other joined, until none do, all sorted by their ranges: one form for a region cut
    along whole lines (a layout's query chunks, a document cut at a chunk's end), so that
    pieces of equal visible pairs compare equal. Slices where nothing is retyped or joined
    come back as given (the same arrays)."""
    q_ranges, k_ranges = np.asarray(q_ranges), np.asarray(k_ranges)
    types = np.asarray(types)
    lq, lk = q_ranges[:, 1] - q_ranges[:, 0], k_ranges[:, 1] - k_ranges[:, 0]
    full = (typed_area(q_ranges, k_ranges, types) == lq * lk) & (lq > 0) & (lk > 0)
    box = np.concatenate([q_ranges[full], k_ranges[full]], axis=1).astype(np.int64)
    joined = True
    while joined:  # join query ranges of one key range, then key ranges of one query range
        box, rows = _joined_along(box, 0)
        box, cols = _joined_along(box, 2)
        joined = rows or cols
    if len(box) == int(full.sum()) and (types[full] == MaskType.FULL).all():
        return q_ranges, k_ranges, types
    q = np.concatenate([box[:, :2], q_ranges[~full]]).astype(q_ranges.dtype)
    k = np.concatenate([box[:, 2:], k_ranges[~full]]).astype(k_ranges.dtype)
    t = np.concatenate([np.full(len(box), MaskType.FULL, types.dtype), types[~full]])
    order = np.lexsort((t, k[:, 1], k[:, 0], q[:, 1], q[:, 0]))
    return q[order], k[order], t[order]


@dataclass(frozen=True, eq=False)
class Mask:
    """An attention mask: non-overlapping typed slices over seqlen_q x seqlen_k positions."""

    seqlen_q: int
    seqlen_k: int
    q_ranges: np.ndarray
    k_ranges: np.ndarray
    types: np.ndarray
    name: str = "custom"
    params: dict = field(default_factory=dict)

    @property
    def slices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q_ranges (n,2), k_ranges (n,2), types (n,)) with half-open ranges."""
        return self.q_ranges, self.k_ranges, self.types

    @property
    def num_slices(self) -> int:
        return int(self.types.shape[0])

    def __repr__(self) -> str:
        return (
            f"Mask({self.name!r}, seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}, "
            f"slices={self.num_slices}, density={self.density():.4f})"
        )

    def area(self) -> int:
        """Exact number of visible (query, key) pairs."""
        return int(typed_area(self.q_ranges, self.k_ranges, self.types).sum(dtype=np.int64))

    def density(self) -> float:
        """Visible fraction of the Sq x Sk rectangle."""
        return self.area() / max(self.seqlen_q * self.seqlen_k, 1)

    @cached_property
    def bands(self) -> tuple[np.ndarray, np.ndarray]:
        """Per slice, the diagonal offsets (lo_off, hi_off) bounding j - i (+-INF: unbounded)."""
        return bands_from_types(self.q_ranges, self.k_ranges, self.types)

    @cached_property
    def _row_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        lo_off, hi_off = self.bands
        q0, q1 = self.q_ranges[:, 0], self.q_ranges[:, 1]
        k0, k1 = self.k_ranges[:, 0], self.k_ranges[:, 1]
        n_rows = q1 - q0
        sid = np.repeat(np.arange(self.num_slices), n_rows)
        starts = np.concatenate([[0], np.cumsum(n_rows)[:-1]]) if n_rows.size else n_rows
        rows = np.arange(sid.size, dtype=np.int64) - np.repeat(starts, n_rows) + q0[sid]
        lo = np.maximum(k0[sid], rows + lo_off[sid])
        hi = np.minimum(k1[sid], rows + hi_off[sid] + 1)
        keep = lo < hi
        rows, lo, hi = rows[keep], lo[keep], hi[keep]
        order = np.lexsort((lo, rows))
        rows, lo, hi = rows[order], lo[order], hi[order]
        same_row = rows[1:] == rows[:-1]
        overlap = same_row & (lo[1:] < hi[:-1])
        if overlap.any():
            at = int(np.argmax(overlap))
            raise ValueError(
                f"overlapping slices: query row {int(rows[at])} sees key intervals "
                f"[{int(lo[at])}, {int(hi[at])}) and [{int(lo[at + 1])}, {int(hi[at + 1])}); "
                "slices must not overlap"
            )
        # Merge touching intervals of a row so each row holds as few intervals as possible.
        joined = np.concatenate([np.zeros(min(rows.size, 1), bool), same_row & (lo[1:] == hi[:-1])])
        group = np.cumsum(~joined) - 1
        g_rows = rows[~joined]
        g_lo = lo[~joined]
        g_hi = np.zeros(g_rows.size, np.int64)
        np.maximum.at(g_hi, group, hi)
        counts = np.bincount(g_rows, minlength=self.seqlen_q)
        width = max(int(counts.max(initial=0)), 1)
        row_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
        slot = np.arange(g_rows.size) - row_start[g_rows]
        out_lo = np.zeros((self.seqlen_q, width), np.int64)
        out_hi = np.zeros((self.seqlen_q, width), np.int64)
        out_lo[g_rows, slot] = g_lo
        out_hi[g_rows, slot] = g_hi
        return out_lo, out_hi

    def slice_depth(self) -> int:
        """The most slices any query row lies in, in O(slices + seqlen_q): a bound on the K of
        row_intervals (a row's touching intervals merge) that costs no per-row pass."""
        q0, q1 = self.q_ranges[:, 0], self.q_ranges[:, 1]
        n = self.seqlen_q + 1
        starts = np.bincount(q0, minlength=n) - np.bincount(q1, minlength=n)
        return int(np.cumsum(starts).max(initial=0))

    def row_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """Per query row, K visible key intervals [lo, hi) (sorted, merged; unused slots lo=hi=0).

        This is the in-tile description kernels evaluate on PARTIAL tiles:
        visible(i, j) = any_r lo[i, r] <= j < hi[i, r]. Every static mask needs K <= 3.
        """
        return self._row_intervals

    def dense(self) -> np.ndarray:
        """Dense boolean (Sq, Sk) matrix, True = visible. For tests and small sizes only."""
        if self.seqlen_q * self.seqlen_k > (1 << 28):
            raise ValueError(
                f"dense() of a {self.seqlen_q} x {self.seqlen_k} mask would allocate "
                f"{self.seqlen_q * self.seqlen_k} bytes; use block_map() or row_intervals()"
            )
        lo, hi = self.row_intervals()
        cols = np.arange(self.seqlen_k)
        out = np.zeros((self.seqlen_q, self.seqlen_k), bool)
        for r in range(lo.shape[1]):
            out |= (cols[None, :] >= lo[:, r, None]) & (cols[None, :] < hi[:, r, None])
        return out

    def block_map(self, block_q: int, block_k: int) -> np.ndarray:
        """Per (q tile, k tile): 0 empty, 1 partial, 2 fully visible (over the real rows/cols).

        Built from the slice geometry, never from an Sq x Sk matrix; cached per tile
        shape.
        """
        cache = self.__dict__.setdefault("_block_map_cache", {})
        key = (block_q, block_k)
        if key not in cache:
            cache[key] = tiles.block_map(self, block_q, block_k)
        return cache[key]

    def tile_counts(self, block_q: int, block_k: int) -> tuple[tuple[np.ndarray, ...], ...]:
        """((FULL, PARTIAL) tiles per q-tile row, the same per k-tile column) of block_map,
        without building the map (attn_masks.tiles.tile_counts)."""
        return tiles.tile_counts(self, block_q, block_k)

    def block_lists(self, block_q: int, block_k: int) -> tiles.BlockLists:
        """Per-q-tile and per-k-tile lists of the non-empty tiles (see attn_masks.tiles)."""
        return tiles.block_lists(self.block_map(block_q, block_k), block_q, block_k)

    def restrict(self, q_positions: Any, k_positions: Any) -> Mask:
        """The mask between the given query and key positions, re-indexed locally.

        Local query t is global position q_positions[t] (any order, e.g. a zigzag shard); the
        result is mask[q_positions][:, k_positions] expressed again as typed slices.
        """
        return self.restrict_blocks(q_positions, [k_positions])[0]

    def restrict_blocks(
        self, q_positions: Any, k_blocks: Sequence[Any | PositionRuns]
    ) -> list[Mask]:
        """[self.restrict(q_positions, kb) for kb in k_blocks], in a few vectorised passes instead
        of a small call per block (a CP plan restricts every rank's queries to each step's keys).
        A key block may be given as its position_runs, for blocks that many calls share (a CP
        plan's shards: each rank's call walks every shard's keys)."""
        qp = _positions(q_positions, self.seqlen_q, "q_positions")
        lo_off, hi_off = self.bands
        # every (query run, slice) pair that meets, then every key run each pair meets, in work
        # proportional to the pieces found (a CP plan restricts a long mask thousands of times,
        # each over hundreds to thousands of position runs)
        qg, ql, qn = _runs(qp)
        q_run, s = _run_overlaps(qg, qn, self.q_ranges[:, 0], self.q_ranges[:, 1])
        # key runs break at block starts; block b's runs and its copy of every pair are shifted
        # by b * seqlen_k, so that a pair meets only the key runs of its own block
        if any(isinstance(k, PositionRuns) for k in k_blocks):
            sizes, kg, kl, kn, blk = _block_runs(k_blocks, self.seqlen_k)
        else:
            kps = [np.asarray(k, dtype=np.int64).reshape(-1) for k in k_blocks]
            sizes = np.array([k.size for k in kps], np.int64)
            kp = np.concatenate([np.zeros(0, np.int64), *kps])
            kp = _positions(kp, self.seqlen_k, "k_positions")
            ends = np.cumsum(sizes)
            starts = ends - sizes
            kg, kl, kn = _runs(kp, starts)
            blk = np.searchsorted(ends, kl, side="right")
            kl = kl - starts[blk]
        shift = np.arange(len(sizes), dtype=np.int64)[:, None] * self.seqlen_k
        k_run, item = _run_overlaps(
            kg + shift[blk, 0],
            kn,
            (self.k_ranges[s, 0] + shift).reshape(-1),
            (self.k_ranges[s, 1] + shift).reshape(-1),
        )
        block = blk[k_run]
        pair = item - block * s.size  # item: block * len(s) + pair
        sl, qi = s[pair], q_run[pair]
        dq = (qg - ql)[qi]
        dk = (kg - kl)[k_run]
        qr, kr, ty, piece_block = bands_to_typed(
            np.maximum(self.q_ranges[sl, 0], qg[qi]) - dq,
            np.minimum(self.q_ranges[sl, 1], (qg + qn)[qi]) - dq,
            np.maximum(self.k_ranges[sl, 0], kg[k_run]) - dk,
            np.minimum(self.k_ranges[sl, 1], (kg + kn)[k_run]) - dk,
            np.where(lo_off[sl] <= -INF, -INF, lo_off[sl] - dk + dq),
            np.where(hi_off[sl] >= INF, INF, hi_off[sl] - dk + dq),
            block,
        )
        cut = np.searchsorted(piece_block, np.arange(len(sizes) + 1))
        name = f"{self.name}[restricted]"
        return [
            Mask(len(qp), int(n), qr[a:b], kr[a:b], ty[a:b], name=name, params={})
            for n, a, b in zip(sizes, cut[:-1], cut[1:])
        ]


class PositionRuns(NamedTuple):
    """Positions as their maximal runs of consecutive increasing values (position_runs): each
    run's first position, its index among the positions and its length; and the number of
    positions (size)."""

    start: np.ndarray
    local: np.ndarray
    length: np.ndarray
    size: int


def position_runs(positions: Any) -> PositionRuns:
    """The runs of `positions` (1-D, any order), for Mask.restrict_blocks' key blocks: a block
    that many calls restrict to is split into runs once."""
    p = np.asarray(positions, dtype=np.int64).reshape(-1)
    return PositionRuns(*_runs(p), p.size)


def _block_runs(
    k_blocks: Sequence[Any | PositionRuns], n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sizes, global starts, block-local starts, lengths, blocks) of the key runs of every
    block in turn, the blocks given as positions or position_runs, checked to lie in [0, n):
    what restrict_blocks reads of the blocks' concatenation broken at each block's start."""
    runs = [k if isinstance(k, PositionRuns) else position_runs(k) for k in k_blocks]
    sizes = np.array([r.size for r in runs], np.int64)
    empty = np.zeros(0, np.int64)
    kg, kl, kn = (np.concatenate([empty, *(r[i] for r in runs)]) for i in range(3))
    blk = np.repeat(np.arange(len(runs)), [len(r.start) for r in runs])
    if kg.size:
        low, high = int(kg.min()), int((kg + kn).max()) - 1
        if low < 0 or high >= n:
            raise ValueError(f"k_positions must lie in [0, {n}), got values in [{low}, {high}]")
    return sizes, kg, kl, kn, blk


def _positions(p: Any, n: int, what: str) -> np.ndarray:
    arr = np.asarray(p, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        raise ValueError(f"{what} must lie in [0, {n}), got values in [{arr.min()}, {arr.max()}]")
    return arr


def _run_overlaps(
    start: np.ndarray, length: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(run, item) index pairs where run [start, start + length) meets item [lo, hi). Runs of
    distinct positions are disjoint, so sorted by start the runs an item meets are one
    contiguous stretch: found by two binary searches, in work proportional to the pairs."""
    order = np.argsort(start, kind="stable")
    first_pos, end = start[order], (start + length)[order]
    if np.any(end[:-1] > first_pos[1:]):  # repeated positions: runs overlap, test every pair
        meets = (start[:, None] < hi[None, :]) & ((start + length)[:, None] > lo[None, :])
        return np.nonzero(meets)
    first = np.searchsorted(end, lo, side="right")
    counts = np.where(hi > lo, np.searchsorted(first_pos, hi, side="left") - first, 0)
    counts = np.maximum(counts, 0)
    item = np.repeat(np.arange(len(lo)), counts)
    offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return order[np.repeat(first, counts) + offset], item


def _runs(
    p: np.ndarray, starts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of consecutive increasing positions, also broken before each index in
    `starts` (0..len(p)): (global start, local start, length)."""
    new = np.ones(p.size + 1, bool)
    np.not_equal(np.diff(p), 1, out=new[1:-1])
    if starts is not None:
        new[starts] = True
    edges = np.flatnonzero(new)
    return p[edges[:-1]], edges[:-1], np.diff(edges)


def from_slices(
    q_ranges: Any,
    k_ranges: Any,
    types: Any,
    seqlen_q: int,
    seqlen_k: int | None = None,
    *,
    name: str = "custom",
    params: dict | None = None,
) -> Mask:
    """Build a Mask from typed slices (kept as given); drops empty ones, rejects overlaps."""
    seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
    for what, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    qr = _as_ranges(q_ranges, "q_ranges")
    kr = _as_ranges(k_ranges, "k_ranges")
    ty = np.asarray(types, dtype=np.int64).reshape(-1)
    if not (qr.shape[0] == kr.shape[0] == ty.shape[0]):
        raise ValueError(
            f"q_ranges, k_ranges and types must have the same length, got "
            f"{qr.shape[0]}, {kr.shape[0]}, {ty.shape[0]}"
        )
    bad_t = ~np.isin(ty, [int(t) for t in MaskType])
    if bad_t.any():
        raise ValueError(f"slice type {int(ty[bad_t][0])} is not one of 0..3 (FULL..BICAUSAL)")
    for what, r, n in (("q_ranges", qr, seqlen_q), ("k_ranges", kr, seqlen_k)):
        bad = (r[:, 0] < 0) | (r[:, 1] > n) | (r[:, 0] > r[:, 1])
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{what}[{i}] = [{r[i, 0]}, {r[i, 1]}) is not a range inside [0, {n}]")
    ty = ty.astype(np.int8)
    keep = typed_area(qr, kr, ty) > 0
    qr, kr, ty = qr[keep], kr[keep], ty[keep]
    mask = Mask(int(seqlen_q), int(seqlen_k), qr, kr, ty, name=name, params=dict(params or {}))
    mask.row_intervals()  # validates non-overlap
    return mask
