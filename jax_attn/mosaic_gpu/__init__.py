"""Pallas Mosaic GPU (Hopper) flash attention: TMA, wgmma, warp specialisation, any mask."""

from .api import flash_attention_mosaic
from .config import MosaicConfig, block_sizes, default_config

__all__ = ["MosaicConfig", "block_sizes", "default_config", "flash_attention_mosaic"]
