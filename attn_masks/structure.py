"""What a mask is, read from its per-row key intervals (never its name), for fixed-mask kernels.

Vendor kernels only know a few patterns: no mask, causal, a window band, block-diagonal documents.
`classify(mask)` reads each query row's visible key intervals (`Mask.row_intervals()`, themselves
derived from the slices) and verifies every candidate pattern row by row, so a mask is only
called causal or a band when it is exactly that, however its slices happen to be cut. The
adapters of both frameworks turn the pattern into their kernels' arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cache import MaskCache
from .mask import Mask

KINDS = ("full", "causal", "window", "full_document", "causal_document", "general")
_DOCUMENT_KINDS = ("full_document", "causal_document")
_PATTERNS = MaskCache()


@dataclass(frozen=True)
class MaskPattern:
    """What a mask is in the terms fixed-mask kernels understand, every fact verified row by row.

    kind: the most specific of KINDS that a window or document argument expresses. empty_rows:
    rows that see no key. single: no row sees more than one key interval. is_full: every row sees
    every key. is_causal: row i sees exactly j <= i + Sk - Sq (bottom-right aligned; rows with
    i + Sk - Sq < 0 are empty), also where only the last row sees keys and no window can tell.
    window: (left, right) for the full, causal and window kinds, in flash-attn's bottom-right
    convention: row i sees i + d - left <= j <= i + d + right with d = Sk - Sq and -1 = unbounded
    side (full = (-1, -1), causal = (-1, 0)); None otherwise. documents: (cu_seqlens, causal) for
    square masks without empty rows that are block-diagonal all-full or all-causal documents (one
    document is also full or causal), else None.
    """

    kind: str
    seqlen_q: int
    seqlen_k: int
    empty_rows: int
    single: bool
    is_full: bool
    is_causal: bool
    window: tuple[int, int] | None
    documents: tuple[np.ndarray, bool] | None

    @property
    def square(self) -> bool:
        return self.seqlen_q == self.seqlen_k

    @property
    def square_causal(self) -> bool:
        """Causal on a square mask, where top-left and bottom-right alignment agree."""
        return self.is_causal and self.square

    @property
    def square_window(self) -> tuple[int, int] | None:
        """(left, right) of a square band, row i seeing i - left <= j <= i + right, with an
        unbounded side spelled as the widest offset S - 1 (full and causal are bands too)."""
        if self.window is None or not self.square:
            return None
        return tuple(self.seqlen_q - 1 if side < 0 else side for side in self.window)

    @property
    def cu_seqlens(self) -> np.ndarray | None:
        """Document boundaries of the two document kinds, else None."""
        return self.documents[0] if self.kind in _DOCUMENT_KINDS else None


def single_intervals(mask: Mask) -> tuple[np.ndarray, np.ndarray] | None:
    """(lo, hi) per row when no row sees more than one key interval (empty rows: lo == hi)."""
    lo, hi = mask.row_intervals()
    if lo.shape[1] > 1 and (hi[:, 1:] > lo[:, 1:]).any():
        return None
    return lo[:, 0], hi[:, 0]


def is_causal_rows(lo: np.ndarray, hi: np.ndarray, sq: int, sk: int) -> bool:
    """Row i sees exactly [0, i + Sk - Sq + 1) (clipped; such rows may be empty)."""
    rows = np.arange(sq)
    end = np.clip(rows + (sk - sq) + 1, 0, sk)
    return bool(np.array_equal(hi, end) and (lo[end > 0] == 0).all())


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


def _analyse(mask: Mask) -> MaskPattern:
    sq, sk = mask.seqlen_q, mask.seqlen_k
    lo_all, hi_all = mask.row_intervals()
    empty = int((~(hi_all > lo_all).any(axis=1)).sum())
    single = single_intervals(mask)
    if single is None:
        return MaskPattern("general", sq, sk, empty, False, False, False, None, None)
    lo, hi = single
    is_full = empty == 0 and bool((lo == 0).all() and (hi == sk).all())
    is_causal = not is_full and is_causal_rows(lo, hi, sq, sk)
    window = band(lo, hi, sq, sk)
    docs = documents(lo, hi, sq) if sq == sk and empty == 0 else None
    if window == (-1, -1):
        kind = "full"
    elif window == (-1, 0):
        kind = "causal"
    elif window is not None:
        kind = "window"
    elif docs is not None:
        kind = "causal_document" if docs[1] else "full_document"
    else:
        kind = "general"
    return MaskPattern(kind, sq, sk, empty, True, is_full, is_causal, window, docs)


def classify(mask: Mask) -> MaskPattern:
    """The pattern of `mask` (cached per mask object)."""
    if not isinstance(mask, Mask):
        raise ValueError(f"mask classification needs an attn_masks.Mask, got {type(mask).__name__}")
    return _PATTERNS.get(mask, "pattern", lambda: _analyse(mask))
