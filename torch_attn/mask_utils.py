"""Device tensors derived from a Mask: per-row key intervals, dense boolean masks, empty rows.

Everything is built from `Mask.row_intervals()` with vectorised torch ops on the target device
(never a Python loop over S x S points) and cached per (mask object, device), so repeated calls
with one mask, as in a benchmark loop, pay for it once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from attn_masks import Mask, classify
from attn_masks.cache import MaskCache

_TENSORS = MaskCache()


def cached(mask: Mask, key: tuple, build: Callable[[], Any]) -> Any:
    """build() once per (mask object, key); entries die with the mask."""
    return _TENSORS.get(mask, key, build)


def _intervals_np(mask: Mask, min_width: int, rows_to: int) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = mask.row_intervals()
    rows = -(-mask.seqlen_q // rows_to) * rows_to
    width = max(lo.shape[1], min_width)
    out_lo = np.zeros((rows, width), np.int64)
    out_hi = np.zeros((rows, width), np.int64)
    out_lo[: lo.shape[0], : lo.shape[1]] = lo
    out_hi[: hi.shape[0], : hi.shape[1]] = hi
    return out_lo, out_hi


def interval_tensors(
    mask: Mask,
    device: torch.device | str,
    *,
    min_width: int = 1,
    rows_to: int = 1,
    dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) of shape (R, K): row i sees keys in the union of [lo[i, r], hi[i, r]).

    K is padded to at least `min_width` and R = Sq rounded up to a multiple of `rows_to`, with
    empty intervals (lo = hi = 0), so that masks of one shape give tensors of one shape.
    """
    device = torch.device(device)

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = _intervals_np(mask, min_width, rows_to)
        return (
            torch.as_tensor(lo, dtype=dtype).to(device),
            torch.as_tensor(hi, dtype=dtype).to(device),
        )

    return cached(mask, ("intervals", str(device), min_width, rows_to, dtype), build)


def visible_from_intervals(lo: torch.Tensor, hi: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Boolean (R, num_keys) visibility of the rows described by interval tensors (R, K)."""
    cols = torch.arange(num_keys, device=lo.device)
    out = (cols >= lo[:, :1]) & (cols < hi[:, :1])
    for r in range(1, lo.shape[1]):
        out |= (cols >= lo[:, r : r + 1]) & (cols < hi[:, r : r + 1])
    return out


def dense_mask(mask: Mask, device: torch.device | str) -> torch.Tensor:
    """Boolean (Sq, Sk) on `device`, True = visible. O(Sq*Sk) memory: for dense-mask kernels."""
    device = torch.device(device)

    def build() -> torch.Tensor:
        lo, hi = interval_tensors(mask, device)
        return visible_from_intervals(lo, hi, mask.seqlen_k)

    return cached(mask, ("dense", str(device)), build)


def empty_rows(mask: Mask, device: torch.device | str) -> torch.Tensor:
    """Boolean (Sq,): query rows that see no key (their output is 0 and their LSE -inf)."""
    device = torch.device(device)

    def build() -> torch.Tensor:
        lo, hi = mask.row_intervals()
        return torch.as_tensor(~(hi > lo).any(axis=1)).to(device)

    return cached(mask, ("empty", str(device)), build)


def sdpa_mask(mask: Mask, device: torch.device | str) -> torch.Tensor:
    """Dense mask for SDPA with empty rows opened to every key, so no kernel ever sees a row
    without keys (NaN in some backends); the adapter zeroes those rows' outputs afterwards."""
    device = torch.device(device)

    def build() -> torch.Tensor:
        dense = dense_mask(mask, device)
        if not classify(mask).empty_rows:
            return dense
        return dense | empty_rows(mask, device)[:, None]

    return cached(mask, ("sdpa", str(device)), build)
