"""Dynamic block-sparse masks (docs/masks.md): top-k key blocks per query block on random scores.

One pattern is shared by every head and drawn from a seeded numpy Generator, so every kernel at
a given seed sees the same mask. Kept blocks become FULL slices; horizontally adjacent kept blocks
of one query block are merged into one slice.
"""

from __future__ import annotations

import math

import numpy as np

from .mask import Mask, MaskType

_SCORE_CHUNK_ELEMS = 1 << 22


def _check_density(density: float) -> float:
    if not (isinstance(density, (int, float, np.floating)) and 0 < density <= 1):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def _check_positive(value: int, what: str) -> int:
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def blocks_per_row(density: float, num_k_blocks: int) -> int:
    """Kept key blocks per query block: max(1, floor(density * Nk))."""
    return max(1, math.floor(density * num_k_blocks))


def _top_k(
    rng: np.random.Generator, nq: int, nk: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sorted kept key blocks per query block (nq, k) and the runs of adjacent kept blocks.

    Runs are (query block, first key block, end key block). Scores are drawn in row chunks,
    which yields the same numbers as one (nq, nk) draw.
    """
    kept, rows, starts, ends = [], [], [], []
    chunk = max(1, _SCORE_CHUNK_ELEMS // nk)
    for r0 in range(0, nq, chunk):
        scores = rng.random((min(chunk, nq - r0), nk))
        top = np.sort(np.argpartition(-scores, k - 1, axis=1)[:, :k], axis=1)
        keep = np.zeros(scores.shape, np.int8)
        np.put_along_axis(keep, top, 1, axis=1)
        edges = np.diff(np.pad(keep, ((0, 0), (1, 1))), axis=1)
        r_on, c_on = np.nonzero(edges == 1)
        _, c_off = np.nonzero(edges == -1)
        kept.append(top.astype(np.int32))
        rows.append(r_on + r0)
        starts.append(c_on)
        ends.append(c_off)
    return np.concatenate(kept), np.concatenate(rows), np.concatenate(starts), np.concatenate(ends)


def _build(
    name: str,
    seqlen: int,
    q_bounds: np.ndarray,
    k_bounds: np.ndarray,
    rng: np.random.Generator,
    k: int,
    params: dict,
) -> Mask:
    """Mask of the kept blocks, built directly: its slices are disjoint by construction.

    from_slices' per-row overlap check costs O(rows x runs per row), which is slow for fine
    random patterns and proves nothing here.
    """
    kept, rows, c0, c1 = _top_k(rng, len(q_bounds) - 1, len(k_bounds) - 1, k)
    return Mask(
        seqlen_q=seqlen,
        seqlen_k=seqlen,
        q_ranges=np.stack([q_bounds[rows], q_bounds[rows + 1]], 1).astype(np.int64),
        k_ranges=np.stack([k_bounds[c0], k_bounds[c1]], 1).astype(np.int64),
        types=np.full(len(rows), int(MaskType.FULL), np.int8),
        name=name,
        params={**params, "blocks_per_row": k, "kept_blocks": kept},
    )


def uniform_block_sparse(seqlen: int, block_size: int, density: float, *, seed: int = 42) -> Mask:
    """Square blocks of block_size tokens (the last may be shorter); top-k kept per row."""
    seqlen = _check_positive(seqlen, "seqlen")
    block_size = _check_positive(block_size, "block_size")
    density = _check_density(density)
    bounds = np.minimum(np.arange(0, seqlen + block_size, block_size, dtype=np.int64), seqlen)
    bounds = np.unique(bounds)
    k = blocks_per_row(density, len(bounds) - 1)
    params = {"block_size": block_size, "density": density, "seed": seed}
    rng = np.random.default_rng(seed)
    return _build("uniform_block_sparse", seqlen, bounds, bounds, rng, k, params)


def _random_composition(
    rng: np.random.Generator, total: int, parts: int, minimum: int
) -> np.ndarray:
    """`parts` sizes >= minimum summing to total: the excess cut at sorted uniform points."""
    excess = total - parts * minimum
    cuts = np.sort(rng.integers(0, excess + 1, size=parts - 1))
    return minimum + np.diff(np.concatenate([[0], cuts, [excess]])).astype(np.int64)


def variable_block_sparse(
    seqlen: int,
    avg_block_size: int,
    density: float,
    *,
    min_block: int = 128,
    seed: int = 42,
) -> Mask:
    """N = seqlen // avg_block_size blocks of random sizes >= min_block; top-k kept per row."""
    seqlen = _check_positive(seqlen, "seqlen")
    avg_block_size = _check_positive(avg_block_size, "avg_block_size")
    min_block = _check_positive(min_block, "min_block")
    density = _check_density(density)
    n = seqlen // avg_block_size
    if n < 1 or n * min_block > seqlen:
        raise ValueError(
            f"seqlen {seqlen} cannot hold seqlen // avg_block_size = {n} blocks of at least "
            f"min_block {min_block} tokens; need 1 <= seqlen // avg_block_size and "
            f"(seqlen // avg_block_size) * min_block <= seqlen"
        )
    rng = np.random.default_rng(seed)
    row_sizes = _random_composition(rng, seqlen, n, min_block)
    col_sizes = _random_composition(rng, seqlen, n, min_block)
    q_bounds = np.concatenate([[0], np.cumsum(row_sizes)])
    k_bounds = np.concatenate([[0], np.cumsum(col_sizes)])
    k = blocks_per_row(density, n)
    params = {
        "avg_block_size": avg_block_size,
        "min_block": min_block,
        "density": density,
        "seed": seed,
        "row_sizes": row_sizes,
        "col_sizes": col_sizes,
    }
    return _build("variable_block_sparse", seqlen, q_bounds, k_bounds, rng, k, params)
