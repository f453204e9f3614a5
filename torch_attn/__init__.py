"""torch_attn: one interface over PyTorch attention kernels, for every attn_masks.Mask.

    import torch_attn
    out, lse = torch_attn.attention(q, k, v, mask, impl="flex", return_lse=True)
    torch_attn.supports("sdpa_flash", mask, dtype=torch.bfloat16, device="cuda")  # True | reason

Layout: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), Hq a multiple of Hkv (GQA: query head h uses
KV head h // (Hq // Hkv)); scale defaults to 1/sqrt(D). Outputs (B, Sq, Hq, D) in the input
dtype; LSE (B, Hq, Sq) in natural log, fp32 (fp64 for fp64 inputs), -inf on rows that see no
key (their output is 0, their gradients 0, never NaN). Everything is differentiable by autograd.

Impls (`IMPLS`; `describe(impl)` gives the details of each):
- naive: explicit scores + dense mask; every mask, every device; the correctness baseline.
- sdpa, sdpa_math, sdpa_flash, sdpa_efficient, sdpa_cudnn: F.scaled_dot_product_attention with
  torch's choice or one forced backend; full/causal without a mask, else a dense boolean mask
  where the backend accepts one.
- flex: compiled FlexAttention; BlockMask from the mask's block map, in-tile interval mask_mod;
  every mask; compiled once per shape, no recompile when the mask changes.
- flash2, flash3, flash4: flash-attn when installed; full, causal, sliding windows, documents;
  flash4 also any other mask through its block sparsity.

Masks are never trusted by name: `attn_masks.classify` reads what a mask is from its slices.
An impl that cannot compute a mask exactly says why (`supports`) and `attention` raises
`Unsupported` (a ValueError subclass) before doing any work. Nothing here imports jax.
"""

from . import mask_utils
from .api import IMPLS, attention, describe, supports
from .common import Unsupported

__all__ = ["IMPLS", "Unsupported", "attention", "describe", "mask_utils", "supports"]
