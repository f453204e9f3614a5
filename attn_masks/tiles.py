"""Tile metadata of a mask: which (q tile, k tile) pairs it touches, and the kernels' tile lists.

A block map classifies every tile of a (block_q, block_k) grid as EMPTY, PARTIAL or FULL; tile
lists compact it into what a block-sparse kernel walks: per outer tile, its non-empty inner tiles.
Both are computed with interval arithmetic from the slices (never from an Sq x Sk matrix), so they
stay cheap at a million tokens. PassTiles are one kernel pass's lists (forward, dQ or dK/dV) as
every kernel walks them: the Triton tables, both Pallas kernels and Flex's block mask. See
docs/architecture.md ("Tile metadata").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np


class SlicedMask(Protocol):
    """What tile metadata reads of a mask (attn_masks.Mask is one): its lengths, typed slices
    (q/k ranges and diagonal bands) and cached block map. Named here so tiles.py need not import
    mask.py, which builds on it."""

    seqlen_q: int
    seqlen_k: int
    q_ranges: np.ndarray
    k_ranges: np.ndarray
    bands: tuple[np.ndarray, np.ndarray]

    def block_map(self, block_q: int, block_k: int) -> np.ndarray: ...


BLOCK_EMPTY, BLOCK_PARTIAL, BLOCK_FULL = 0, 1, 2
# (slice, tile) entries _tile_geometry (block_map, tile_counts) handles at once.
CHUNK_ENTRIES = 1 << 22


@dataclass(frozen=True)
class TileList:
    """For each outer tile t, its non-empty inner tiles: index[t, :count[t]] in ascending order.

    full[t, n] says whether tile index[t, n] is fully visible. Entries beyond count[t] repeat the
    last valid index (a padded step re-touches a loaded tile) and are never full.
    """

    index: np.ndarray
    count: np.ndarray
    full: np.ndarray

    @property
    def width(self) -> int:
        """Entries per outer tile (the longest list)."""
        return int(self.index.shape[-1])

    @property
    def arrays(self) -> tuple[Any, Any, Any]:
        """(index, count, full): the order the kernels take them in."""
        return self.index, self.count, self.full

    def _walk_rows(self) -> np.ndarray | None:
        """The walk lengths (count) as float64 rows of outer tiles, one row per stacked list;
        None for fewer than two outer tiles, where no walk statistic has a neighbour or pair."""
        count = np.asarray(self.count, np.float64)
        if count.size == 0 or count.shape[-1] < 2:
            return None
        return count.reshape(-1, count.shape[-1])

    def walk_spread(self) -> float:
        """How unevenly neighbouring outer tiles walk (host lists): the mean distance, beyond
        one tile, of the step in walk length (count) from one tile to the next from the median
        step, over the mean walk length. 0 where the step is constant up to a ragged diagonal's
        one tile (full, causal, windows); about 0.05-0.3 where documents start and end every few
        tiles; 0 for fewer than two tiles or no walk."""
        count = self._walk_rows()
        if count is None:
            return 0.0
        mean = count.mean()
        if mean == 0:
            return 0.0
        step = np.diff(count, axis=-1)
        off = np.abs(step - np.median(step, axis=-1, keepdims=True))
        return float(np.maximum(off - 1, 0).mean() / mean)

    def partial_share(self) -> float:
        """The share of the listed tiles that are partial (not fully visible): 0 for full,
        about one tile per row of tiles for causal, 0.1-0.6 for most document masks at
        8K-32K tokens in 128x256 tiles; 0 where nothing is listed."""
        listed = int(np.asarray(self.count).sum())
        if listed == 0:
            return 0.0
        return 1.0 - int(np.asarray(self.full).sum()) / listed  # padding is never full

    def pair_spread(self) -> float:
        """How unevenly the walks of outer tiles p and N - 1 - p add up over the pairs p < N / 2
        (the middle tile of an odd N left out): the pair sums' mean absolute deviation over
        their mean. At 8K-32K tokens in 128x128 tiles: 0 for full and causal (every pair walks
        as far), 0.03-0.11 for prefix-LM causal and the sliding windows, 0.14-0.91 for
        global_sliding_window and the document, blockwise and share_question masks. 0 for
        fewer than two tiles or no walk."""
        count = self._walk_rows()
        if count is None:
            return 0.0
        half = count.shape[-1] // 2
        sums = count[:, :half] + count[:, ::-1][:, :half]
        mean = sums.mean()
        if mean == 0:
            return 0.0
        return float(np.abs(sums - sums.mean(axis=-1, keepdims=True)).mean() / mean)

    def walk_peak(self) -> float:
        """The longest walk (count) over the mean walk, rounded to a power of sqrt(2) (a
        coarse, hashable fact for a kernel's static choices): 1 where all walks are equal
        (full), 2 for causal, up to the outer tile count where one tile is walked by all
        (share_question's question); 0 where nothing is walked."""
        count = np.asarray(self.count, np.float64)
        mean = count.mean() if count.size else 0.0
        if mean == 0:
            return 0.0
        half_octaves = max(0, round(2 * float(np.log2(count.max() / mean))))
        return float(2 ** (half_octaves / 2))


@dataclass(frozen=True)
class BlockLists:
    """Both tile lists of one (block_q, block_k) grid: kv holds the k tiles of each q tile (the
    forward and dQ walk), q the q tiles of each k tile (the dK/dV walk)."""

    block_q: int
    block_k: int
    kv: TileList
    q: TileList


PASSES = ("fwd", "dq", "dkdv")
# (index, n_partial, count) of PassTiles.partial_first: how the Pallas kernels take a pass's tiles
PartialFirst = tuple[Any, Any, Any]


@dataclass(frozen=True)
class PassTiles(TileList):
    """One kernel pass's tile lists, as a kernel that pads the sequences to whole tiles walks them.

    The forward and dQ passes list the k tiles of each q tile, the dK/dV pass (by_key) the q tiles
    of each k tile. A tile reaching past the end of either sequence is never full, so the in-tile
    mask hides its padding. index and count are int32, full bool (Triton's tables: int32); numpy
    on the host, jax arrays when built inside a trace (PassTiles.of).
    """

    by_key: bool
    seqlen_q: int
    seqlen_k: int
    block_q: int
    block_k: int

    @classmethod
    def of(
        cls,
        lists: TileList,
        *,
        by_key: bool,
        seqlen_q: int,
        seqlen_k: int,
        block_q: int,
        block_k: int,
        xp: ModuleType = np,
    ) -> PassTiles:
        """A pass's tiles from a mask's lists in its walk direction, whose full flags hold over
        the real rows and cols: the ragged-edge rule, in numpy or (xp=jax.numpy) in a trace."""
        index = xp.asarray(lists.index, xp.int32)
        count = xp.asarray(lists.count, xp.int32)
        n_outer, width = index.shape
        full = xp.asarray(lists.full, bool) & (xp.arange(width)[None, :] < count[:, None])
        q_edge, k_edge = _ragged_tile(seqlen_q, block_q), _ragged_tile(seqlen_k, block_k)
        outer_edge, inner_edge = (k_edge, q_edge) if by_key else (q_edge, k_edge)
        if outer_edge is not None:
            full = full & (xp.arange(n_outer)[:, None] != outer_edge)
        if inner_edge is not None:
            full = full & (index != inner_edge)
        return cls(index, count, full, by_key, seqlen_q, seqlen_k, block_q, block_k)

    def partial_first(self, xp: ModuleType = np) -> PartialFirst:
        """(index, n_partial, count): each outer tile's listed tiles reordered partial ones first
        (ascending within each kind), so a kernel masks the first n_partial[t] tiles and walks
        the rest of its count[t] unmasked; in numpy or (xp=jax.numpy) in a trace."""
        slot = xp.arange(self.width)[None, :]
        listed = slot < self.count[:, None]
        partial = listed & ~self.full
        kind = xp.where(partial, 0, xp.where(listed, 1, 2))
        order = xp.argsort(kind * self.width + slot, axis=1)  # unique keys: a stable order
        index = xp.take_along_axis(self.index, order, axis=1)
        return index, xp.sum(partial, axis=1, dtype=xp.int32), self.count

    def kinds(self) -> np.ndarray:
        """The (outer tiles, inner tiles) int8 block map of host lists: EMPTY, PARTIAL, FULL."""
        seqlen, block = (
            (self.seqlen_q, self.block_q) if self.by_key else (self.seqlen_k, self.block_k)
        )
        listed = np.arange(self.width)[None, :] < self.count[:, None]
        out = np.zeros((self.index.shape[0], -(-seqlen // block)), np.int8)
        kind = np.where(self.full[listed], BLOCK_FULL, BLOCK_PARTIAL)
        out[np.nonzero(listed)[0], self.index[listed]] = kind
        return out


def block_lists(tile_kinds: np.ndarray, block_q: int, block_k: int) -> BlockLists:
    """The tile lists of a (block_q, block_k) block map, in both walk directions."""
    by_k = np.ascontiguousarray(tile_kinds.T)
    return BlockLists(block_q, block_k, _compact(tile_kinds), _compact(by_k))


def _compact(tile_kinds: np.ndarray) -> TileList:
    """The tile lists of a block map's rows, copied from the map as one window per row from its
    first non-empty tile (most rows are one run); rows of more runs go through _gather_lists."""
    n, m = tile_kinds.shape
    nz = tile_kinds > 0
    count = nz.sum(axis=1, dtype=np.int32)
    width = max(int(count.max(initial=0)), 1)
    first = np.argmax(nz, axis=1)  # 0 for an empty row
    index = _ramps((first + np.maximum(count - 1, 0)).astype(np.int32), count, width)
    flat = tile_kinds.ravel() if n else np.zeros(width, tile_kinds.dtype)  # >= width values
    # A window reaching past the map (only the last row's can) ends with the map instead: it then
    # starts on an empty tile before the row's first, so that row takes the general path.
    kinds = _windows(flat, np.minimum(np.arange(0, n * m, m) + first, flat.size - width), width)
    listed = _listed(count, width)
    full = kinds == BLOCK_FULL
    full &= listed
    empty = np.less_equal(kinds, 0, out=listed)  # listed is spent: its memory is reused
    gap = np.argmax(empty, axis=1)  # each window's first empty slot (0 where none)
    runs = np.flatnonzero((gap < count) & empty[np.arange(n), gap])
    if runs.size:
        index[runs], full[runs] = _gather_lists(tile_kinds[runs], count[runs], width)
    return TileList(index, count, full)


def _windows(values: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """values[s : s + width] for each start s, as a new (starts, width) array of row copies."""
    return np.lib.stride_tricks.sliding_window_view(values, width)[starts]


def _ramps(last: np.ndarray, count: np.ndarray, width: int) -> np.ndarray:
    """(rows, width) of last's dtype: row r steps up by one to last[r] at slot count[r] - 1 and
    stays there (a row of count 0 is last[r] throughout)."""
    down = np.maximum(np.arange(width - 1, -width, -1, dtype=last.dtype), 0)
    ramps = _windows(down, width - np.maximum(count, 1), width)
    np.subtract(last[:, None], ramps, out=ramps)
    return ramps


def _listed(count: np.ndarray, width: int) -> np.ndarray:
    """(rows, width) flags of each row's slots below its count."""
    return _windows(np.arange(2 * width) < width, width - count, width)


def _gather_lists(
    tile_kinds: np.ndarray, count: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """(index, full) lists of `width` entries of rows with any non-empty tiles, read from the flat
    list of all their non-empty tiles (each row's padded with its last tile, never full)."""
    n, m = tile_kinds.shape
    at = np.flatnonzero(tile_kinds > 0)  # row by row, ascending
    starts = np.cumsum(count) - count
    flags = np.concatenate([tile_kinds.ravel()[at] == BLOCK_FULL, np.zeros(width, bool)])
    full = _windows(flags, starts, width)
    full &= _listed(count, width)
    cols = (at - np.repeat(np.arange(0, n * m, m), count)).astype(np.int32)
    return cols[_ramps(starts + count - 1, count, width)], full


def pass_tiles(mask: SlicedMask, block_q: int, block_k: int, name: str) -> PassTiles:
    """Host tile lists of pass `name` (one of PASSES) over `mask` in (block_q, block_k) tiles."""
    if name not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {name!r}")
    by_key = name == "dkdv"
    kinds = mask.block_map(block_q, block_k)
    lists = _compact(np.ascontiguousarray(kinds.T) if by_key else kinds)
    return PassTiles.of(
        lists,
        by_key=by_key,
        seqlen_q=mask.seqlen_q,
        seqlen_k=mask.seqlen_k,
        block_q=block_q,
        block_k=block_k,
    )


def _ragged_tile(seqlen: int, block: int) -> int | None:
    """Index of the last tile when it reaches past the sequence end, else None."""
    return seqlen // block if seqlen % block else None


def block_map(mask: SlicedMask, bq: int, bk: int) -> np.ndarray:
    """Per (q tile, k tile): 0 empty, 1 partial, 2 fully visible (over the real rows/cols),
    straight from the band geometry of the slices, in O(touched tiles) (_tile_geometry).
    (Reading per-row intervals instead was 8-11x slower on whole masks and 1.1-9x on the CP
    predictor's pieces, counting the intervals' own build.)"""
    nq, nk = _tile_grid(mask, bq, bk)
    t, f0, f1, qt, kt, whole = _tile_geometry(mask, bq, bk)
    full = np.zeros((nq, nk + 1), np.int8)
    full[t, f0] += 1  # a q tile's runs of FULL tiles are disjoint: no index repeats
    full[t, f1] -= 1
    out = (np.cumsum(full, axis=1, dtype=np.int8)[:, :nk] * BLOCK_FULL).astype(np.int8)
    out[qt, kt] = np.where(whole, BLOCK_FULL, BLOCK_PARTIAL)
    return out


def tile_counts(mask: SlicedMask, bq: int, bk: int) -> tuple[tuple[np.ndarray, ...], ...]:
    """((FULL, PARTIAL) tiles per q-tile row, the same per k-tile column) of block_map(mask,
    bq, bk), from the same geometry without the (q tiles, k tiles) map: a 2M-token piece's map
    holds 268M tiles, its counts 2 x 16K numbers."""
    nq, nk = _tile_grid(mask, bq, bk)
    t, f0, f1, qt, kt, whole = _tile_geometry(mask, bq, bk)
    row_full = np.bincount(t, weights=f1 - f0, minlength=nq).astype(np.int64)
    starts = np.bincount(f0, minlength=nk + 1) - np.bincount(f1, minlength=nk + 1)
    col_full = np.cumsum(starts)[:nk]
    rows = (row_full + np.bincount(qt[whole], minlength=nq), np.bincount(qt[~whole], minlength=nq))
    cols = (col_full + np.bincount(kt[whole], minlength=nk), np.bincount(kt[~whole], minlength=nk))
    return rows, cols


def _tile_grid(mask: SlicedMask, bq: int, bk: int) -> tuple[int, int]:
    """(q tiles, k tiles) of the mask in bq x bk tiles, the last of each possibly ragged."""
    _check_block(bq, "block_q")
    _check_block(bk, "block_k")
    return -(-mask.seqlen_q // bq), -(-mask.seqlen_k // bk)


def _tile_geometry(mask: SlicedMask, bq: int, bk: int) -> tuple[np.ndarray, ...]:
    """(t, f0, f1, qt, kt, whole): the FULL k tiles [f0, f1) of q tile t that a (slice, q tile)
    pair sees completely (no other slice can touch them), and the edge tiles (qt, kt), each
    once, whole where the areas its slices see in it add up to its real area (else PARTIAL)."""
    sq, sk = mask.seqlen_q, mask.seqlen_k
    nk = -(-sk // bk)
    runs, keys, areas = [], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for part in _slice_chunks(mask, bq, bk, CHUNK_ENTRIES):
        sid, t, a0, a1, f0, f1, pair, kt = _tile_pairs(*part, bq, bk, sq, sk)
        has = f0 < f1
        runs.append((t[has], f0[has], f1[has]))
        bands = (b[sid[pair]] for b in part[2:])
        key, area = _edge_tile_areas(t[pair], a0[pair], a1[pair], kt, *bands, bk, nk)
        keys.append(key)
        areas.append(area)
    t, f0, f1 = (np.concatenate([keys[0], *(run[i] for run in runs)]) for i in range(3))
    key, area = _sum_by_key(np.concatenate(keys), np.concatenate(areas))
    qt, kt = np.divmod(key, nk)
    real = np.minimum(bq, sq - qt * bq) * np.minimum(bk, sk - kt * bk)
    return t, f0, f1, qt, kt, area == real


def _slice_chunks(
    mask: SlicedMask, bq: int, bk: int, budget: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Non-empty slices as (r0, r1, k0, k1, lo, hi) bands, rows clipped to those seeing a key,
    in chunks of about `budget` (slice, tile) entries (estimated from above)."""
    lo, hi = mask.bands
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
