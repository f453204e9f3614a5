"""Mask classification from the slices alone (never the name), for adapters with fixed masks.

Vendor kernels only know a few patterns (no mask, causal, a left window, segment ids). These
tests read each query row's visible key interval (Mask.row_intervals, derived from the slices)
and say exactly which pattern, if any, the mask is, however its slices happen to be cut.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from attn_masks import Mask

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class MaskStructure:
    """What a mask is, in the terms vendor kernels understand.

    kind: the most specific of "full", "causal", "window", "full_document", "causal_document",
    "general". causal is bottom-right aligned (row i sees j <= i + Sk - Sq). window is
    (left, right): row i sees i - left <= j <= i + right (square masks only; full and causal
    square masks are windows too). documents is (cu_seqlens, causal) for block-diagonal masks of
    all-full or all-causal documents (square only; one document = full or causal).
    """

    kind: str
    seqlen_q: int
    seqlen_k: int
    empty_rows: int
    is_full: bool
    is_causal: bool
    window: tuple[int, int] | None
    documents: tuple[np.ndarray, bool] | None

    @property
    def square(self) -> bool:
        return self.seqlen_q == self.seqlen_k


def _single_intervals(mask: Mask) -> tuple[np.ndarray, np.ndarray] | None:
    """(lo, hi) per row when every row sees at most one key interval (empty rows: lo == hi)."""
    lo, hi = mask.row_intervals()
    if lo.shape[1] > 1 and (hi[:, 1:] > lo[:, 1:]).any():
        return None
    return lo[:, 0], hi[:, 0]


def _is_causal(lo: np.ndarray, hi: np.ndarray, sq: int, sk: int) -> bool:
    rows = np.arange(sq)
    end = np.clip(rows + (sk - sq) + 1, 0, sk)
    return bool(np.array_equal(hi, end) and (lo[end > 0] == 0).all())


def _window(lo: np.ndarray, hi: np.ndarray, s: int) -> tuple[int, int] | None:
    rows = np.arange(s)
    left = int((rows - lo).max())
    right = int((hi - 1 - rows).max())
    if left < 0 or right < 0:
        return None
    if not np.array_equal(lo, np.maximum(0, rows - left)):
        return None
    if not np.array_equal(hi, np.minimum(s, rows + right + 1)):
        return None
    return left, right


def _documents(lo: np.ndarray, hi: np.ndarray, s: int) -> tuple[np.ndarray, bool] | None:
    rows = np.arange(s)
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


def _classify(mask: Mask) -> MaskStructure:
    sq, sk = mask.seqlen_q, mask.seqlen_k
    lo_all, hi_all = mask.row_intervals()
    empty = int((~(hi_all > lo_all).any(axis=1)).sum())
    single = _single_intervals(mask)
    is_full = is_causal = False
    window = documents = None
    if single is not None:
        lo, hi = single
        is_full = empty == 0 and bool((lo == 0).all() and (hi == sk).all())
        is_causal = not is_full and _is_causal(lo, hi, sq, sk)
        if sq == sk and empty == 0:
            window = _window(lo, hi, sq)
            documents = _documents(lo, hi, sq)
    if is_full:
        kind = "full"
    elif is_causal:
        kind = "causal"
    elif window is not None:
        kind = "window"
    elif documents is not None:
        kind = "causal_document" if documents[1] else "full_document"
    else:
        kind = "general"
    return MaskStructure(kind, sq, sk, empty, is_full, is_causal, window, documents)


def classify(mask: Mask) -> MaskStructure:
    """The structure of `mask` (cached per mask object)."""
    if not isinstance(mask, Mask):
        raise ValueError(f"classify() needs an attn_masks.Mask, got {type(mask).__name__}")
    found = _CACHE.get(mask)
    if found is None:
        found = _classify(mask)
        _CACHE[mask] = found
    return found


def is_full(mask: Mask) -> bool:
    """Every query sees every key."""
    return classify(mask).is_full


def is_causal(mask: Mask) -> bool:
    """Bottom-right aligned causal: row i sees keys j <= i + Sk - Sq (and nothing else)."""
    return classify(mask).is_causal


def window_sizes(mask: Mask) -> tuple[int, int] | None:
    """(left, right) if the square mask is the band i - left <= j <= i + right, else None."""
    return classify(mask).window


def causal_window(mask: Mask) -> int | None:
    """w if the square mask is the left window i - w <= j <= i (causal: w = S - 1), else None."""
    w = classify(mask).window
    return w[0] if w is not None and w[1] == 0 else None


def documents(mask: Mask) -> tuple[np.ndarray, bool] | None:
    """(cu_seqlens, causal) if the square mask is block-diagonal full or causal documents."""
    return classify(mask).documents
