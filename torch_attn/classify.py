"""What a mask is in the terms fixed-mask kernels understand, read from its slices, never its name.

Every answer is derived from `Mask.row_intervals()` (itself computed from the slices) and then
verified row by row, so a mask is only called "causal" or "window" when it is exactly that; any
other way of cutting the same visible set into slices gives the same answer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from attn_masks import Mask

KINDS = ("full", "causal", "window", "full_document", "causal_document", "general")

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class MaskPattern:
    """A mask's kind plus the kernel arguments that express it.

    window: (left, right) for full / causal / window, in flash-attn's bottom-right convention:
    row i sees keys i + d - left <= j <= i + d + right with d = Sk - Sq, -1 = unbounded side
    (full = (-1, -1), causal = (-1, 0)). cu_seqlens: document boundaries for the two document
    kinds (square masks, every document full or every document bottom-right causal).
    """

    kind: str
    seqlen_q: int
    seqlen_k: int
    empty_rows: int
    window: tuple[int, int] | None = None
    cu_seqlens: np.ndarray | None = None

    @property
    def square(self) -> bool:
        return self.seqlen_q == self.seqlen_k

    @property
    def square_causal(self) -> bool:
        """Causal on a square mask, where top-left and bottom-right alignment agree."""
        return self.kind == "causal" and self.square


def _single_interval(mask: Mask) -> tuple[np.ndarray, np.ndarray] | None:
    """(lo, hi) per row when no row sees more than one key interval (empty rows: lo == hi)."""
    lo, hi = mask.row_intervals()
    if lo.shape[1] > 1 and (hi[:, 1:] > lo[:, 1:]).any():
        return None
    return lo[:, 0], hi[:, 0]


def _side(values: np.ndarray) -> int | None:
    """The one offset a side of the band has, None if unconstrained, -2 if inconsistent."""
    found = np.unique(values)
    if found.size == 0:
        return None
    return int(found[0]) if found.size == 1 else -2


def band(lo: np.ndarray, hi: np.ndarray, sq: int, sk: int) -> tuple[int, int] | None:
    """(left, right) if the rows are flash-attn's bottom-right window_size band, else None."""
    rows = np.arange(sq, dtype=np.int64)
    diag = rows + (sk - sq)
    seen = hi > lo
    if not seen.any():
        return None
    left = _side((diag - lo)[seen & (lo > 0)])
    right = _side((hi - 1 - diag)[seen & (hi < sk)])
    if left == -2 or right == -2 or (left is not None and left < 0):
        return None
    if right is not None and right < 0:
        return None
    lo_e = np.zeros(sq, np.int64) if left is None else np.clip(diag - left, 0, sk)
    hi_e = np.full(sq, sk, np.int64) if right is None else np.clip(diag + right + 1, 0, sk)
    seen_e = hi_e > lo_e
    if not np.array_equal(seen, seen_e):
        return None
    if not (np.array_equal(lo[seen], lo_e[seen]) and np.array_equal(hi[seen], hi_e[seen])):
        return None
    return (-1 if left is None else left), (-1 if right is None else right)


def documents(lo: np.ndarray, hi: np.ndarray, s: int) -> tuple[np.ndarray, bool] | None:
    """(cu_seqlens, causal) if the square rows are block-diagonal full or causal documents."""
    rows = np.arange(s, dtype=np.int64)
    cu = np.append(np.unique(lo), s).astype(np.int64)
    if cu[0] != 0:
        return None
    doc = np.searchsorted(cu, rows, side="right") - 1
    if not np.array_equal(lo, cu[doc]):
        return None
    if np.array_equal(hi, cu[doc + 1]):
        return cu, False
    if np.array_equal(hi, rows + 1):
        return cu, True
    return None


def _classify(mask: Mask) -> MaskPattern:
    sq, sk = mask.seqlen_q, mask.seqlen_k
    lo_all, hi_all = mask.row_intervals()
    empty = int((~(hi_all > lo_all).any(axis=1)).sum())
    single = _single_interval(mask)
    if single is None:
        return MaskPattern("general", sq, sk, empty)
    lo, hi = single
    window = band(lo, hi, sq, sk)
    if window == (-1, -1):
        return MaskPattern("full", sq, sk, empty, window)
    if window == (-1, 0):
        return MaskPattern("causal", sq, sk, empty, window)
    if window is not None:
        return MaskPattern("window", sq, sk, empty, window)
    if sq == sk and empty == 0:
        docs = documents(lo, hi, sq)
        if docs is not None:
            kind = "causal_document" if docs[1] else "full_document"
            return MaskPattern(kind, sq, sk, empty, None, docs[0])
    return MaskPattern("general", sq, sk, empty)


def classify(mask: Mask) -> MaskPattern:
    """The pattern of `mask` (cached per mask object)."""
    if not isinstance(mask, Mask):
        raise ValueError(f"classify() needs an attn_masks.Mask, got {type(mask).__name__}")
    found = _CACHE.get(mask)
    if found is None:
        found = _classify(mask)
        _CACHE[mask] = found
    return found
