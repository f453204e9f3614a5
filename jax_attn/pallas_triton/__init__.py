"""Pallas Triton flash attention for any MaskArrays mask: block-sparse walk, GQA, custom VJP."""

from .api import flash_attention, flash_attention_bwd, kernel_config
from .config import KernelConfig, block_sizes, default_config

__all__ = [
    "KernelConfig",
    "block_sizes",
    "default_config",
    "flash_attention",
    "flash_attention_bwd",
    "kernel_config",
]
