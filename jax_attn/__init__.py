"""JAX attention for every mask: our Pallas kernels plus cuDNN, XLA and JAX-kernel adapters."""

from .adapters import Unsupported
from .api import IMPLS, attention, attention_bwd, has_residual_bwd, mask_arrays_for, supports
from .mask_arrays import MaskArrays, prepare_mask, stack_mask_arrays

__all__ = [
    "IMPLS",
    "MaskArrays",
    "Unsupported",
    "attention",
    "attention_bwd",
    "has_residual_bwd",
    "mask_arrays_for",
    "prepare_mask",
    "stack_mask_arrays",
    "supports",
]
