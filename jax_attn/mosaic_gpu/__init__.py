"""Pallas Mosaic GPU (Hopper) flash attention: TMA, wgmma, warp specialisation, any mask."""

from .api import flash_attention_mosaic
from .config import DTYPES, HEAD_DIMS, KernelConfig, block_sizes, default_config

__all__ = [
    "DTYPES",
    "HEAD_DIMS",
    "KernelConfig",
    "block_sizes",
    "default_config",
    "flash_attention_mosaic",
]
