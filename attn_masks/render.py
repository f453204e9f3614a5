"""Mask pictures: the visible fraction of each pixel cell, computed exactly from the slices.

Each slice is a band lo <= j - i <= hi inside its rectangle, so its pairs inside any pixel cell
have a closed form; the picture costs O(#slices + #cells touched), never Sq x Sk.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .mask import Mask, MaskType

_CHUNK_CELLS = 1 << 22


def _edges(n: int, cells: int) -> np.ndarray:
    return (np.arange(cells + 1, dtype=np.int64) * n) // cells


def _tri(u: np.ndarray, width: np.ndarray) -> np.ndarray:
    """sum over integers t <= u of clip(t, 0, width)."""
    u = np.maximum(u, 0)
    head = np.minimum(u, width)
    return head * (head + 1) // 2 + np.maximum(u - width, 0) * width


def _pairs_below(a, b, c, d, h) -> np.ndarray:
    """#{(i, j): a <= i < b, c <= j < d, j - i <= h} (empty ranges give 0)."""
    h = np.clip(h, c - b - 1, d - a)
    width = np.maximum(d - c, 0)
    return np.where(b > a, _tri(b - 1 + h + 1 - c, width) - _tri(a - 1 + h + 1 - c, width), 0)


def _band_pairs(a, b, c, d, lo, hi) -> np.ndarray:
    """#{(i, j): a <= i < b, c <= j < d, lo <= j - i <= hi}."""
    return _pairs_below(a, b, c, d, hi) - _pairs_below(a, b, c, d, lo - 1)


def coverage(mask: Mask, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) fraction of visible pairs in each cell of an even grid over the mask."""
    rows, cols = min(rows, mask.seqlen_q), min(cols, mask.seqlen_k)
    re_, ce = _edges(mask.seqlen_q, rows), _edges(mask.seqlen_k, cols)
    q_ranges, k_ranges, types = mask.slices
    q0, q1 = q_ranges[:, 0], q_ranges[:, 1]
    k0, k1 = k_ranges[:, 0], k_ranges[:, 1]
    keep = (q1 > q0) & (k1 > k0)
    q0, q1, k0, k1, types = q0[keep], q1[keep], k0[keep], k1[keep], types[keep]
    causal = (types == MaskType.CAUSAL) | (types == MaskType.BICAUSAL)
    inv = (types == MaskType.INVCAUSAL) | (types == MaskType.BICAUSAL)
    hi = np.where(causal, k1 - q1, k1 - q0)
    lo = np.where(inv, k0 - q0, k0 - q1)
    r0 = np.searchsorted(re_, q0, "right") - 1
    r1 = np.searchsorted(re_, q1 - 1, "right")
    c0 = np.searchsorted(ce, k0, "right") - 1
    c1 = np.searchsorted(ce, k1 - 1, "right")
    nr, nc = r1 - r0, c1 - c0
    per_slice = nr * nc
    counts = np.zeros(rows * cols, np.float64)
    bounds = np.searchsorted(np.cumsum(per_slice), np.arange(0, per_slice.sum(), _CHUNK_CELLS))
    for s0, s1 in zip(bounds, [*bounds[1:], len(per_slice)], strict=True):
        n = per_slice[s0:s1]
        sid = np.repeat(np.arange(s0, s1), n)
        local = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
        r = r0[sid] + local // nc[sid]
        c = c0[sid] + local % nc[sid]
        got = _band_pairs(
            np.maximum(q0[sid], re_[r]),
            np.minimum(q1[sid], re_[r + 1]),
            np.maximum(k0[sid], ce[c]),
            np.minimum(k1[sid], ce[c + 1]),
            lo[sid],
            hi[sid],
        )
        counts += np.bincount(r * cols + c, weights=got, minlength=rows * cols)
    cell_area = np.outer(np.diff(re_), np.diff(ce))
    return counts.reshape(rows, cols) / cell_area


def render_mask_png(
    mask: Mask, path: str | Path, *, resolution: int = 512, title: str | None = None
) -> Path:
    """Save a resolution x resolution (at most) picture of the mask; returns the path."""
    from matplotlib.figure import Figure

    if not (isinstance(resolution, int) and resolution > 0):
        raise ValueError(f"resolution must be a positive integer, got {resolution!r}")
    grid = coverage(mask, resolution, resolution)
    if title is None:
        title = f"{mask.name}  {mask.seqlen_q} x {mask.seqlen_k}  density {mask.density():.4f}"
    fig = Figure(figsize=(6, 5.2))
    ax = fig.add_subplot()
    img = ax.imshow(
        grid,
        cmap="Blues",
        vmin=0.0,
        vmax=1.0,
        interpolation="nearest",
        extent=(0, mask.seqlen_k, mask.seqlen_q, 0),
        aspect="auto",
    )
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(title)
    fig.colorbar(img, ax=ax, label="visible fraction")
    path = Path(path)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
