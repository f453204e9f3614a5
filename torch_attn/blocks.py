"""FlexAttention BlockMask built straight from the mask's tile lists, never from S x S points.

Tables come from the forward and dK/dV passes' `attn_masks.PassTiles` at 128 x 128 (interval
arithmetic, O(#slices + #blocks), a FULL tile on a ragged edge made PARTIAL, as
`create_block_mask` does, so the kernel never relies on boundary handling inside full tiles):
PARTIAL tiles go to kv_num_blocks/kv_indices (the mask_mod runs there), FULL tiles to
full_kv_num_blocks/full_kv_indices (no mask_mod), and the dK/dV pass's tiles to the q tables.
The mask_mod evaluates the in-tile description: visible(q, k) = any_r lo[q, r] <= k < hi[q, r]
with (lo, hi) from `Mask.row_intervals()` as device tensors (inputs, not constants).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from attn_masks import BLOCK_FULL, BLOCK_PARTIAL, Mask, pass_tiles

from .mask_utils import interval_tensors

try:
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # torch without FlexAttention: flex reports "not installed"
    BlockMask = None

BLOCK = 128
MIN_INTERVALS = 3  # every static mask needs <= 3 intervals per row; padding keeps shapes stable
TABLE_NAMES = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _ordered(selected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: how many columns are selected, and their indices first (ascending), full width."""
    count = selected.sum(axis=1).astype(np.int32)
    index = np.argsort(~selected, axis=1, kind="stable").astype(np.int32)
    return count, index


def flex_block_tables(
    mask: Mask, block_q: int = BLOCK, block_k: int = BLOCK
) -> dict[str, np.ndarray]:
    """The eight BlockMask tables, shaped (1, 1, n, m) (broadcast over batch and heads)."""
    by_q = pass_tiles(mask, block_q, block_k, "fwd").kinds()
    by_k = pass_tiles(mask, block_q, block_k, "dkdv").kinds()
    arrays = (
        *_ordered(by_q == BLOCK_PARTIAL),
        *_ordered(by_q == BLOCK_FULL),
        *_ordered(by_k == BLOCK_PARTIAL),
        *_ordered(by_k == BLOCK_FULL),
    )
    return {name: a[None, None] for name, a in zip(TABLE_NAMES, arrays)}


def interval_mask_mod(lo: torch.Tensor, hi: torch.Tensor) -> Callable:
    """mask_mod(b, h, q, k) = any_r lo[q, r] <= k < hi[q, r] (K unrolled at trace time)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
        visible = (kv_idx >= lo[q_idx, 0]) & (kv_idx < hi[q_idx, 0])
        for r in range(1, lo.shape[1]):
            visible = visible | ((kv_idx >= lo[q_idx, r]) & (kv_idx < hi[q_idx, r]))
        return visible

    return mask_mod


def block_mask_from_tables(
    tables: tuple[torch.Tensor, ...],
    lo: torch.Tensor,
    hi: torch.Tensor,
    seq_lengths: tuple[int, int],
    block: tuple[int, int] = (BLOCK, BLOCK),
):
    """A BlockMask over prebuilt tables (TABLE_NAMES order) and the interval mask_mod."""
    return BlockMask(seq_lengths, *tables, BLOCK_SIZE=block, mask_mod=interval_mask_mod(lo, hi))


def flex_block_mask(mask: Mask, device: torch.device | str, block: int = BLOCK):
    """A ready BlockMask for `mask` on `device`, for direct flex_attention callers."""
    tables = flex_block_tables(mask, block, block)
    tensors = tuple(torch.as_tensor(tables[n]).to(device) for n in TABLE_NAMES)
    lo, hi = interval_tensors(
        mask, device, min_width=MIN_INTERVALS, rows_to=block, dtype=torch.int32
    )
    return block_mask_from_tables(tensors, lo, hi, (mask.seqlen_q, mask.seqlen_k), (block, block))
