"""The mask model: a list of typed (q_range, k_range) slices over Sq x Sk positions.

Internally every slice is a *band inside a rectangle*: rows [q0, q1), keys [k0, k1), visible iff
lo_off <= j - i <= hi_off. The four public types are special cases of that band, which makes
restriction to sub-rectangles (context parallelism), area, per-row intervals and block maps one
piece of arithmetic instead of four.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Any

import numpy as np

INF = np.int64(1) << np.int64(60)
# block_map works from the slices instead of per-row intervals beyond this many intervals per row.
ROW_ROUTE_INTERVALS_PER_ROW = 4
# (slice, tile) entries the slice route handles at once.
CHUNK_ENTRIES = 1 << 22


class MaskType(IntEnum):
    """Slice types (MagiAttention convention, SPEC.md 1.0)."""

    FULL = 0
    CAUSAL = 1  # bottom-right aligned: c <= r + (lk - lq)
    INVCAUSAL = 2  # top-left aligned: c >= r
    BICAUSAL = 3  # both


BLOCK_EMPTY, BLOCK_PARTIAL, BLOCK_FULL = 0, 1, 2


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
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Re-express bands-in-rectangles as non-empty typed slices (at most 3 per band).

    Rows are first clipped to those that see a key; then split where the row's first visible key
    stops being k0 (lower diagonal takes over) and where its last stops being k1 - 1.
    """
    q0, q1, k0, k1, lo, hi = (np.asarray(a, np.int64) for a in (q0, q1, k0, k1, lo, hi))
    lo_inf, hi_inf = lo <= -INF, hi >= INF
    lo = np.maximum(lo, k0 - q1)  # offsets beyond the rectangle change nothing; keep numbers small
    hi = np.minimum(hi, k1 - 1 - q0)
    r0 = np.maximum(q0, k0 - hi)
    r1 = np.minimum(q1, k1 - lo)
    ok = (r0 < r1) & (lo <= hi) & (k0 < k1)
    q0, q1, k0, k1, lo, hi, r0, r1, lo_inf, hi_inf = (
        a[ok] for a in (q0, q1, k0, k1, lo, hi, r0, r1, lo_inf, hi_inf)
    )
    # rows < p1: first visible key is k0; rows < p2: last visible key is i + hi. A row where both
    # readings agree goes to the diagonal reading, so plain CAUSAL/BICAUSAL slices stay whole.
    p1 = np.where(lo_inf, r1, np.clip(k0 - lo, r0, r1))
    p2 = np.where(hi_inf, r0, np.clip(k1 - hi, r0, r1))
    cuts = np.stack([r0, np.minimum(p1, p2), np.maximum(p1, p2), r1], axis=1)
    out_q, out_k, out_t = [], [], []
    for s in range(3):
        a, b = cuts[:, s], cuts[:, s + 1]
        keep = a < b
        a, b = a[keep], b[keep]
        kk0, kk1, ll, hh = k0[keep], k1[keep], lo[keep], hi[keep]
        lo_const = a < p1[keep]
        hi_var = a < p2[keep]
        start = np.where(lo_const, kk0, a + ll)
        end = np.where(hi_var, b + hh, kk1)
        typ = np.where(
            lo_const,
            np.where(hi_var, MaskType.CAUSAL, MaskType.FULL),
            np.where(hi_var, MaskType.BICAUSAL, MaskType.INVCAUSAL),
        )
        out_q.append(np.stack([a, b], 1))
        out_k.append(np.stack([start, end], 1))
        out_t.append(typ)
    qr = np.concatenate(out_q).reshape(-1, 2)
    kr = np.concatenate(out_k).reshape(-1, 2)
    ty = np.concatenate(out_t).astype(np.int8)
    order = np.lexsort((kr[:, 0], qr[:, 0]))
    return qr[order], kr[order], ty[order]


def typed_area(q_ranges: np.ndarray, k_ranges: np.ndarray, types: np.ndarray) -> np.ndarray:
    """Closed-form visible pairs per slice (SPEC.md 1.0), as Python-int-safe int64."""
    lq = q_ranges[:, 1] - q_ranges[:, 0]
    lk = k_ranges[:, 1] - k_ranges[:, 0]
    h = np.minimum(lq, lk)
    tri = h * (2 * lk - h + 1) // 2
    bi = np.maximum(lk - lq + 1, 0) * lq
    return np.select(
        [types == MaskType.FULL, types == MaskType.BICAUSAL], [lq * lk, bi], default=tri
    ).astype(np.int64)


@dataclass(frozen=True)
class BlockLists:
    """Compacted tile lists for a kernel with tiles (bq, bk).

    kv_index[qb, :kv_count[qb]] are the non-empty k blocks of q block qb (ascending) and
    kv_full[qb, n] says whether that tile is fully visible; q_index/q_count/q_full are the
    transpose (per k block, its non-empty q blocks) for the dK/dV pass.
    """

    block_q: int
    block_k: int
    kv_index: np.ndarray
    kv_count: np.ndarray
    kv_full: np.ndarray
    q_index: np.ndarray
    q_count: np.ndarray
    q_full: np.ndarray


def _compact(bm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    nz = bm > 0
    count = nz.sum(axis=1).astype(np.int32)
    width = max(int(count.max(initial=0)), 1)
    rows, cols = np.nonzero(nz)
    starts = np.concatenate([[0], np.cumsum(count)[:-1]])
    slot = np.arange(rows.size) - np.repeat(starts, count)
    index = np.zeros((bm.shape[0], width), np.int32)
    full = np.zeros((bm.shape[0], width), bool)
    index[rows, slot] = cols
    full[rows, slot] = bm[rows, cols] == BLOCK_FULL
    # Pad each row by repeating its last valid index so padded iterations re-touch a loaded tile.
    last = np.where(count > 0, index[np.arange(bm.shape[0]), np.maximum(count - 1, 0)], 0)
    pad = np.arange(width)[None, :] >= count[:, None]
    index = np.where(pad, last[:, None], index)
    return index, count, full


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
    def _bands(self) -> tuple[np.ndarray, np.ndarray]:
        return bands_from_types(self.q_ranges, self.k_ranges, self.types)

    @cached_property
    def _row_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        lo_off, hi_off = self._bands
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

        Built from per-row intervals, never from an Sq x Sk matrix.
        """
        _check_block(block_q, "block_q")
        _check_block(block_k, "block_k")
        key = (block_q, block_k)
        cache = self.__dict__.setdefault("_block_map_cache", {})
        if key not in cache:
            cache[key] = self._compute_block_map(block_q, block_k)
        return cache[key]

    def _compute_block_map(self, bq: int, bk: int) -> np.ndarray:
        rows = int((self.q_ranges[:, 1] - self.q_ranges[:, 0]).sum(dtype=np.int64))
        if rows > ROW_ROUTE_INTERVALS_PER_ROW * self.seqlen_q:
            return self._block_map_from_slices(bq, bk)
        return self._block_map_from_rows(bq, bk)

    def _block_map_from_rows(self, bq: int, bk: int) -> np.ndarray:
        """Block map from the per-row intervals: cheap when rows hold few intervals."""
        lo, hi = self.row_intervals()
        nq = -(-self.seqlen_q // bq)
        nk = -(-self.seqlen_k // bk)
        out = np.zeros((nq, nk), np.int8)
        valid = hi > lo
        rows = np.broadcast_to(np.arange(self.seqlen_q)[:, None], lo.shape)[valid]
        lo_v, hi_v = lo[valid], hi[valid]
        qb = rows // bq
        # Touched k tiles of a row interval: [lo // bk, ceil(hi / bk)); fully covered ones:
        # [ceil(lo / bk), hi // bk), where reaching seqlen_k covers the (short) last tile.
        # Rows of one q tile mostly share these ranges, so work on the distinct ones only.
        base = np.int64(nk + 1)
        t_key = np.unique((qb * base + lo_v // bk) * base + (-(-hi_v // bk)))
        t_qb, rest = np.divmod(t_key, base * base)
        t0, t1 = np.divmod(rest, base)
        for q, a, b in zip(t_qb.tolist(), t0.tolist(), t1.tolist()):
            out[q, a:b] = BLOCK_PARTIAL
        f0 = -(-lo_v // bk)
        f1 = np.where(hi_v >= self.seqlen_k, nk, hi_v // bk)
        has = f0 < f1
        f_key, f_cnt = np.unique((qb[has] * base + f0[has]) * base + f1[has], return_counts=True)
        f_qb, rest = np.divmod(f_key, base * base)
        f0u, f1u = np.divmod(rest, base)
        rows_per_qb = np.minimum(bq, self.seqlen_q - np.arange(nq) * bq)
        cover = np.zeros(nk + 1, np.int64)
        bounds = np.searchsorted(f_qb, np.arange(nq + 1))
        for q in np.nonzero(np.diff(bounds))[0].tolist():
            cover[:] = 0
            sl = slice(bounds[q], bounds[q + 1])
            np.add.at(cover, f0u[sl], f_cnt[sl])
            np.subtract.at(cover, f1u[sl], f_cnt[sl])
            full = np.cumsum(cover[:nk]) == rows_per_qb[q]
            out[q, full] = BLOCK_FULL
        return out

    def _block_map_from_slices(self, bq: int, bk: int) -> np.ndarray:
        """Block map straight from the band geometry of the slices, in O(touched tiles).

        Per (slice, q tile): the k tiles every tile row sees completely are FULL outright (no
        other slice can touch them); the other touched tiles get the slice's exact area in them,
        and such a tile is FULL iff the areas of all slices in it add up to its real area.
        """
        sq, sk = self.seqlen_q, self.seqlen_k
        nq, nk = -(-sq // bq), -(-sk // bk)
        full = np.zeros((nq, nk + 1), np.int8)
        keys, areas = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for part in _slice_chunks(self, bq, bk, CHUNK_ENTRIES):
            sid, t, a0, a1, f0, f1, pair, kt = _tile_pairs(*part, bq, bk, sq, sk)
            has = f0 < f1
            full[t[has], f0[has]] += 1
            full[t[has], f1[has]] -= 1
            bands = (b[sid[pair]] for b in part[2:])
            key, area = _edge_tile_areas(t[pair], a0[pair], a1[pair], kt, *bands, bk, nk)
            keys.append(key)
            areas.append(area)
        out = (np.cumsum(full, axis=1, dtype=np.int8)[:, :nk] * BLOCK_FULL).astype(np.int8)
        key, area = _sum_by_key(np.concatenate(keys), np.concatenate(areas))
        qt, kt = np.divmod(key, nk)
        real = np.minimum(bq, sq - qt * bq) * np.minimum(bk, sk - kt * bk)
        out[qt, kt] = np.where(area == real, BLOCK_FULL, BLOCK_PARTIAL)
        return out

    def block_lists(self, block_q: int, block_k: int) -> BlockLists:
        """Compacted per-q-block and per-k-block lists of non-empty tiles (see BlockLists)."""
        bm = self.block_map(block_q, block_k)
        kv_index, kv_count, kv_full = _compact(bm)
        q_index, q_count, q_full = _compact(np.ascontiguousarray(bm.T))
        return BlockLists(block_q, block_k, kv_index, kv_count, kv_full, q_index, q_count, q_full)

    def restrict(self, q_positions: Any, k_positions: Any) -> Mask:
        """The mask between the given query and key positions, re-indexed locally.

        Local query t is global position q_positions[t] (any order, e.g. a zigzag shard); the
        result is mask[q_positions][:, k_positions] expressed again as typed slices.
        """
        qp = _positions(q_positions, self.seqlen_q, "q_positions")
        kp = _positions(k_positions, self.seqlen_k, "k_positions")
        q_runs = _runs(qp)
        k_runs = _runs(kp)
        lo_off, hi_off = self._bands
        parts = []
        for qg, ql, qn in zip(*q_runs):
            a0 = np.maximum(self.q_ranges[:, 0], qg)
            a1 = np.minimum(self.q_ranges[:, 1], qg + qn)
            hit = np.nonzero(a0 < a1)[0]
            if hit.size == 0:
                continue
            a0, a1 = a0[hit], a1[hit]
            for kg, kl, kn in zip(*k_runs):
                b0 = np.maximum(self.k_ranges[hit, 0], kg)
                b1 = np.minimum(self.k_ranges[hit, 1], kg + kn)
                h2 = b0 < b1
                if not h2.any():
                    continue
                s = hit[h2]
                dq, dk = qg - ql, kg - kl
                parts.append(
                    (
                        a0[h2] - dq,
                        a1[h2] - dq,
                        b0[h2] - dk,
                        b1[h2] - dk,
                        np.where(lo_off[s] <= -INF, -INF, lo_off[s] - dk + dq),
                        np.where(hi_off[s] >= INF, INF, hi_off[s] - dk + dq),
                    )
                )
        if parts:
            cols = [np.concatenate(c) for c in zip(*parts)]
            qr, kr, ty = bands_to_typed(*cols)
        else:
            qr = kr = np.zeros((0, 2), np.int64)
            ty = np.zeros(0, np.int8)
        return Mask(len(qp), len(kp), qr, kr, ty, name=f"{self.name}[restricted]", params={})


def _slice_chunks(
    mask: Mask, bq: int, bk: int, budget: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Non-empty slices as (r0, r1, k0, k1, lo, hi) bands, rows clipped to those seeing a key,
    in chunks of about `budget` (slice, tile) entries (estimated from above)."""
    lo, hi = mask._bands
    q0, q1 = mask.q_ranges[:, 0], mask.q_ranges[:, 1]
    k0, k1 = mask.k_ranges[:, 0], mask.k_ranges[:, 1]
    lo = np.maximum(lo, k0 - q1)  # offsets beyond the rectangle change nothing; keep them small
    hi = np.minimum(hi, k1 - 1 - q0)
    r0 = np.maximum(q0, k0 - hi)
    r1 = np.minimum(q1, k1 - lo)
    ok = np.nonzero((r0 < r1) & (lo <= hi) & (k0 < k1))[0]
    pairs = (r1[ok] - 1) // bq - r0[ok] // bq + 1
    cost = np.cumsum(pairs * (2 * (bq // bk) + 5) + 2 * ((k1[ok] - k0[ok]) // bk + 2))
    total = int(cost[-1]) if cost.size else 0
    bounds = np.unique(np.searchsorted(cost, np.arange(0, total, budget)))
    for a, b in zip(bounds.tolist(), [*bounds[1:].tolist(), ok.size]):
        s = ok[a:b]
        yield r0[s], r1[s], k0[s], k1[s], lo[s], hi[s]


def _tile_pairs(
    r0: np.ndarray,
    r1: np.ndarray,
    k0: np.ndarray,
    k1: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    bq: int,
    bk: int,
    sq: int,
    sk: int,
) -> tuple[np.ndarray, ...]:
    """Per (slice, q tile) pair: slice, t, rows [a0, a1), FULL k tiles [f0, f1); per edge tile:
    its pair and k tile.

    Start and end of a row's visible keys never decrease with the row, so a pair touches the keys
    from its first row's start to its last row's end, and every row sees those from its last
    row's start to its first row's end (whole tiles count only if the slice holds all the tile's
    real rows). Edge tiles are the touched tiles that are not FULL this way.
    """
    first = r0 // bq
    n = (r1 - 1) // bq - first + 1
    sid = np.repeat(np.arange(r0.size), n)
    t = first[sid] + np.arange(sid.size) - np.repeat(np.cumsum(n) - n, n)
    a0 = np.maximum(r0[sid], t * bq)
    a1 = np.minimum(r1[sid], (t + 1) * bq)
    t0 = np.maximum(k0[sid], a0 + lo[sid]) // bk
    t1 = -(-np.minimum(k1[sid], a1 + hi[sid]) // bk)
    c0 = np.maximum(k0[sid], a1 - 1 + lo[sid])
    c1 = np.minimum(k1[sid], a0 + hi[sid] + 1)
    all_rows = (a0 == t * bq) & (a1 == np.minimum((t + 1) * bq, sq))
    f0 = -(-c0 // bk)
    f1 = np.where(c1 >= sk, -(-sk // bk), c1 // bk)
    has = all_rows & (c0 < c1) & (f0 < f1)
    f0 = np.where(has, f0, t1)
    f1 = np.where(has, f1, t1)
    n_left, n_right = f0 - t0, t1 - f1
    n_edge = n_left + n_right
    pair = np.repeat(np.arange(sid.size), n_edge)
    pos = np.arange(pair.size) - np.repeat(np.cumsum(n_edge) - n_edge, n_edge)
    kt = np.where(pos < n_left[pair], t0[pair] + pos, f1[pair] + pos - n_left[pair])
    return sid, t, a0, a1, f0, f1, pair, kt


def _edge_tile_areas(
    qt: np.ndarray,
    r0: np.ndarray,
    r1: np.ndarray,
    kt: np.ndarray,
    k0: np.ndarray,
    k1: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    bk: int,
    nk: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Visible pairs of each band in its tile (rows [r0, r1), k tile kt), summed per tile key."""
    c0 = np.maximum(k0, kt * bk)
    c1 = np.minimum(k1, (kt + 1) * bk)
    area = _band_area(r0, r1, c0, c1, hi) - _band_area(r0, r1, c0, c1, lo - 1)
    return _sum_by_key(qt * nk + kt, area)


def _band_area(
    r0: np.ndarray, r1: np.ndarray, c0: np.ndarray, c1: np.ndarray, h: np.ndarray
) -> np.ndarray:
    """Pairs (i, j) in [r0, r1) x [c0, c1) with j - i <= h: sum of clip(i + h + 1 - c0, 0, w)."""
    w = c1 - c0
    h = np.clip(h, c0 - r1, c1 - r0)

    def ramp(x: np.ndarray) -> np.ndarray:
        x = np.maximum(x, 0)
        return np.where(x <= w + 1, x * (x - 1) // 2, w * (w + 1) // 2 + (x - w - 1) * w)

    return ramp(r1 + h + 1 - c0) - ramp(r0 + h + 1 - c0)


def _sum_by_key(key: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys (ascending) and the sum of the values of each."""
    if key.size == 0:
        return key, value
    order = np.argsort(key, kind="stable")
    key, value = key[order], value[order]
    starts = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    return key[starts], np.add.reduceat(value, starts)


def _check_block(b: int, what: str) -> None:
    if not isinstance(b, (int, np.integer)) or b <= 0:
        raise ValueError(f"{what} must be a positive integer, got {b!r}")


def _positions(p: Any, n: int, what: str) -> np.ndarray:
    arr = np.asarray(p, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        raise ValueError(f"{what} must lie in [0, {n}), got values in [{arr.min()}, {arr.max()}]")
    return arr


def _runs(p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of consecutive increasing positions: (global start, local start, length)."""
    if p.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    brk = np.nonzero(np.diff(p) != 1)[0] + 1
    local = np.concatenate([[0], brk])
    length = np.diff(np.concatenate([local, [p.size]]))
    return p[local], local, length


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
