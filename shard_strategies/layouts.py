"""Token layouts: which global positions each ring rank holds, in its local order (numpy only).

Positions >= the mask's seqlen are padding: they see nothing and are seen by nothing (the plan
extends the mask to the padded length), so any sequence length works under any layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from attn_masks import Mask

LAYOUTS = ("contiguous", "zigzag", "balanced")
DEFAULT_CHUNKS_PER_RANK = 4


def inverse_order(order: np.ndarray, seqlen: int) -> np.ndarray:
    """For each real position p < seqlen, its index in `order` (a permutation of the padded
    positions 0..len(order)-1): the gather that undoes a dispatch."""
    inv = np.empty(order.size, np.int64)
    inv[order] = np.arange(order.size)
    return inv[:seqlen]


@dataclass(frozen=True, eq=False)
class Layout:
    """positions[r] = the global positions ring rank r holds, in local order (R, L)."""

    name: str
    seqlen: int
    positions: np.ndarray

    @property
    def ring_size(self) -> int:
        return int(self.positions.shape[0])

    @property
    def shard_len(self) -> int:
        return int(self.positions.shape[1])

    @property
    def padded_seqlen(self) -> int:
        return int(self.positions.size)

    def order(self) -> np.ndarray:
        """Flat rank-major order: element n of the sharded sequence is global position order[n]."""
        return self.positions.reshape(-1)

    def inverse(self) -> np.ndarray:
        """For each real global position p < seqlen, its index in order() (undispatch gather)."""
        return inverse_order(self.order(), self.seqlen)

    def is_padding(self) -> np.ndarray:
        """(R, L) True where a slot holds a padding position."""
        return self.positions >= self.seqlen


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _finish(name: str, seqlen: int, per_rank: list[np.ndarray], multiple: int) -> Layout:
    """Pad every rank's list to one length (a multiple of `multiple`) and number the padding.

    Entries < 0 or >= seqlen are padding; they get the ids [seqlen, padded) in row-major order.
    """
    length = _round_up(max(max(len(p) for p in per_rank), 1), multiple)
    positions = np.full((len(per_rank), length), -1, np.int64)
    for r, p in enumerate(per_rank):
        positions[r, : len(p)] = p
    pad = (positions < 0) | (positions >= seqlen)
    positions[pad] = seqlen + np.arange(int(pad.sum()))
    return Layout(name, seqlen, positions)


def contiguous_layout(seqlen: int, ring_size: int, multiple: int = 1) -> Layout:
    """Rank r holds the r-th contiguous piece (the sequence is padded at its end)."""
    length = _round_up(-(-seqlen // ring_size), multiple)
    positions = np.arange(ring_size * length, dtype=np.int64).reshape(ring_size, length)
    return Layout("contiguous", seqlen, positions)


def _zigzag_segment(start: int, n: int, ring_size: int) -> list[np.ndarray]:
    """Per rank, head chunk r and tail chunk 2R-1-r of [start, start+n) padded to 2R chunks (-1)."""
    chunk = -(-n // (2 * ring_size))
    ids = np.arange(start, start + 2 * ring_size * chunk)
    ids[ids >= start + n] = -1
    chunks = ids.reshape(2 * ring_size, chunk)
    return [np.concatenate([chunks[r], chunks[2 * ring_size - 1 - r]]) for r in range(ring_size)]


def zigzag_layout(mask: Mask, ring_size: int, multiple: int = 1) -> Layout:
    """Head/tail chunks per document (docs/context_parallel.md, Layouts) given cu_seqlens, else of
    the whole sequence."""
    seqlen = mask.seqlen_q
    cu = mask.params.get("cu_seqlens")
    bounds = np.asarray(cu, np.int64) if cu is not None else np.array([0, seqlen], np.int64)
    if bounds[0] != 0 or bounds[-1] != seqlen or (np.diff(bounds) < 0).any():
        raise ValueError(f"cu_seqlens must rise from 0 to seqlen {seqlen}, got {bounds.tolist()}")
    per_rank: list[list[np.ndarray]] = [[] for _ in range(ring_size)]
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if end == start:
            continue
        parts = _zigzag_segment(start, end - start, ring_size)
        for r in range(ring_size):
            per_rank[r].append(parts[r])
    rows = [np.concatenate(p) if p else np.zeros(0, np.int64) for p in per_rank]
    return _finish("zigzag", seqlen, rows, multiple)


def row_area(mask: Mask) -> np.ndarray:
    """Visible keys per query row (int64, length seqlen_q)."""
    lo, hi = mask.row_intervals()
    return (hi - lo).sum(axis=1)


def balanced_layout(
    mask: Mask, ring_size: int, multiple: int = 1, chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK
) -> Layout:
    """Equal-size chunks dealt to ranks by greedy LPT on chunk mask area, k chunks per rank.

    Every rank gets the same number of tokens; the biggest remaining chunk goes to the rank with
    the least area that still has a free slot. A rank keeps its chunks in ascending order.
    """
    seqlen = mask.seqlen_q
    n_chunks = ring_size * chunks_per_rank
    chunk = -(-seqlen // n_chunks)
    areas = np.zeros(n_chunks * chunk, np.int64)
    areas[:seqlen] = row_area(mask)
    chunk_area = areas.reshape(n_chunks, chunk).sum(axis=1)
    load = np.zeros(ring_size, np.int64)
    slots = np.full(ring_size, chunks_per_rank)
    owned: list[list[int]] = [[] for _ in range(ring_size)]
    for c in np.argsort(-chunk_area, kind="stable").tolist():
        free = np.nonzero(slots > 0)[0]
        r = int(free[np.argmin(load[free])])
        owned[r].append(c)
        load[r] += chunk_area[c]
        slots[r] -= 1
    ids = np.arange(n_chunks * chunk, dtype=np.int64).reshape(n_chunks, chunk)
    rows = [np.concatenate([ids[c] for c in sorted(owned[r])]) for r in range(ring_size)]
    return _finish("balanced", seqlen, rows, multiple)


def make_layout(
    mask: Mask,
    ring_size: int,
    layout: str,
    multiple: int = 1,
    chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK,
) -> Layout:
    """The named layout of `mask`'s positions over `ring_size` ranks (shards a multiple long)."""
    if mask.seqlen_q != mask.seqlen_k:
        raise ValueError(
            f"context parallelism needs a square self-attention mask, got "
            f"{mask.seqlen_q} x {mask.seqlen_k}"
        )
    if ring_size < 1 or multiple < 1:
        raise ValueError(f"ring_size and multiple must be >= 1, got {ring_size}, {multiple}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    if ring_size == 1:  # one rank holds every position: any layout is the sequence in order
        return dataclasses.replace(contiguous_layout(mask.seqlen_q, 1, multiple), name=layout)
    if layout == "contiguous":
        return contiguous_layout(mask.seqlen_q, ring_size, multiple)
    if layout == "zigzag":
        return zigzag_layout(mask, ring_size, multiple)
    return balanced_layout(mask, ring_size, multiple, chunks_per_rank)
