"""Mask classification from the slices alone (never the name), for adapters with fixed masks.

Vendor kernels only know a few patterns (no mask, causal, a left window, segment ids). The
framework-neutral row analysis (attn_masks.structure) reads each query row's visible key interval
and verifies each pattern; this module says it in the terms the JAX adapters use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attn_masks import Mask, row_structure


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


def classify(mask: Mask) -> MaskStructure:
    """The structure of `mask` (built from the cached attn_masks.row_structure)."""
    rs = row_structure(mask)
    window = None
    if rs.square and rs.empty_rows == 0 and rs.band is not None:
        # a square band, with unbounded sides (-1) spelled as the widest offset S - 1
        window = tuple(rs.seqlen_q - 1 if side < 0 else side for side in rs.band)
    if rs.is_full:
        kind = "full"
    elif rs.is_causal:
        kind = "causal"
    elif window is not None:
        kind = "window"
    elif rs.documents is not None:
        kind = "causal_document" if rs.documents[1] else "full_document"
    else:
        kind = "general"
    return MaskStructure(
        kind,
        rs.seqlen_q,
        rs.seqlen_k,
        rs.empty_rows,
        rs.is_full,
        rs.is_causal,
        window,
        rs.documents,
    )


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
