"""Framework-neutral attention masks: slices, the 14 benchmark masks, areas, FLOPs, tile metadata,
classification."""

from .block_sparse import uniform_block_sparse, variable_block_sparse
from .flops import MODES, attention_flops
from .generators import MASK_NAMES, make_mask, make_masks
from .mask import Mask, MaskType, from_slices, joined_slices
from .random_slices import random_slices
from .reference import ReferenceResult, default_scale, reference_attention
from .render import render_mask_png
from .sampling import TABLE_NAMES, default_distribution, generate_seqlens, load_distribution
from .structure import KINDS, MaskPattern, classify
from .tiles import (
    BLOCK_EMPTY,
    BLOCK_FULL,
    BLOCK_PARTIAL,
    BlockLists,
    PartialFirst,
    PassTiles,
    TileList,
    pass_tiles,
)

__all__ = [
    "MASK_NAMES",
    "TABLE_NAMES",
    "default_distribution",
    "generate_seqlens",
    "load_distribution",
    "make_mask",
    "make_masks",
    "render_mask_png",
    "uniform_block_sparse",
    "variable_block_sparse",
    "BLOCK_EMPTY",
    "BLOCK_FULL",
    "BLOCK_PARTIAL",
    "BlockLists",
    "Mask",
    "MaskType",
    "ReferenceResult",
    "attention_flops",
    "from_slices",
    "joined_slices",
    "random_slices",
    "default_scale",
    "reference_attention",
    "KINDS",
    "MODES",
    "MaskPattern",
    "classify",
    "PartialFirst",
    "PassTiles",
    "TileList",
    "pass_tiles",
]
