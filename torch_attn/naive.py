"""The naive kernel: explicit scale * QK^T in fp32 (fp64 for fp64 inputs), dense mask, softmax, PV.

Materialises the (B, Hq, Sq, Sk) scores and repeats K/V for GQA: a correctness baseline and the
"what it costs without a fused kernel" point of the benchmark. Supports every mask and device.
"""

from __future__ import annotations

import torch

from attn_masks import Mask

from .common import Problem, group_size, work_dtype
from .lse import masked_softmax
from .mask_utils import dense_mask


def supports(mask: Mask, problem: Problem) -> bool | str:
    """Every mask, dtype and device."""
    return True


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B,Sq,Hq,D) in q.dtype, lse (B,Hq,Sq))."""
    group = group_size(q, k)
    dtype = work_dtype(q.dtype)
    kr = k.repeat_interleave(group, dim=2).to(dtype)
    vr = v.repeat_interleave(group, dim=2).to(dtype)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), kr) * scale
    probs, lse = masked_softmax(scores, dense_mask(mask, q.device))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vr)
    return out.to(q.dtype), lse
