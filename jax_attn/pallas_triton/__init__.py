"""Pallas Triton flash attention for any MaskArrays mask: block-sparse walk, GQA, custom VJP."""

from .api import flash_attention, flash_attention_bwd, kernel_config
from .config import DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM, KernelConfig, block_sizes, default_config

__all__ = [
    "DTYPES",
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "KernelConfig",
    "block_sizes",
    "default_config",
    "flash_attention",
    "flash_attention_bwd",
    "kernel_config",
]
