"""What a mask is in the terms fixed-mask kernels understand, read from its slices, never its name.

Every answer is derived from `Mask.row_intervals()` (itself computed from the slices) and then
verified row by row, so a mask is only called "causal" or "window" when it is exactly that; any
other way of cutting the same visible set into slices gives the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attn_masks import Mask, row_structure
from attn_masks.structure import band, documents

__all__ = ["KINDS", "MaskPattern", "band", "classify", "documents"]

KINDS = ("full", "causal", "window", "full_document", "causal_document", "general")


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


def classify(mask: Mask) -> MaskPattern:
    """The pattern of `mask` (built from the cached attn_masks.row_structure)."""
    rs = row_structure(mask)
    sq, sk, empty = rs.seqlen_q, rs.seqlen_k, rs.empty_rows
    if rs.band == (-1, -1):
        return MaskPattern("full", sq, sk, empty, rs.band)
    if rs.band == (-1, 0):
        return MaskPattern("causal", sq, sk, empty, rs.band)
    if rs.band is not None:
        return MaskPattern("window", sq, sk, empty, rs.band)
    if rs.documents is not None:
        kind = "causal_document" if rs.documents[1] else "full_document"
        return MaskPattern(kind, sq, sk, empty, None, rs.documents[0])
    return MaskPattern("general", sq, sk, empty)
