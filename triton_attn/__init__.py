"""triton_attn: one flash-attention forward and backward in the Triton language, for both
frameworks.

`kernels` holds the @triton.jit kernels (importing it imports triton; with TRITON_INTERPRET=1
set beforehand they run in Triton's CPU interpreter); `launch` the framework-neutral plans:
tiles, warps, grids, and the numpy mask tables built from attn_masks. The front ends are
torch_attn's and jax_attn's impl "triton"; this package imports neither framework.
"""

from .launch import (
    Call,
    KernelConfig,
    KernelConfigs,
    MaskTables,
    Shape,
    default_configs,
    mask_tables,
)

__all__ = [
    "Call",
    "KernelConfig",
    "KernelConfigs",
    "MaskTables",
    "Shape",
    "default_configs",
    "mask_tables",
]
