"""Framework-neutral attention masks: slices, the 14 benchmark masks, areas, FLOPs, block maps."""

from .flops import attention_flops
from .mask import (
    BLOCK_EMPTY,
    BLOCK_FULL,
    BLOCK_PARTIAL,
    BlockLists,
    Mask,
    MaskType,
    from_slices,
)
from .reference import ReferenceResult, reference_attention

__all__ = [
    "BLOCK_EMPTY",
    "BLOCK_FULL",
    "BLOCK_PARTIAL",
    "BlockLists",
    "Mask",
    "MaskType",
    "ReferenceResult",
    "attention_flops",
    "from_slices",
    "reference_attention",
]
