"""JAX attention for every mask: our Pallas kernels plus cuDNN, XLA and JAX-kernel adapters."""

from .adapters import Unsupported
from .api import IMPLS, attention, attention_bwd, has_residual_bwd, mask_arrays_for, supports
from .mask_arrays import MaskArrays, prepare_mask, stack_mask_arrays
from .structure import MaskStructure, classify

__all__ = [
    "IMPLS",
    "MaskArrays",
    "MaskStructure",
    "Unsupported",
    "attention",
    "attention_bwd",
    "classify",
    "has_residual_bwd",
    "mask_arrays_for",
    "prepare_mask",
    "stack_mask_arrays",
    "supports",
]
