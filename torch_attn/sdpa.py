"""torch.nn.functional.scaled_dot_product_attention, one impl per forced backend (plus auto).

Mask mapping: full -> no mask; causal on a square mask -> is_causal (SDPA's is_causal is
top-left aligned, ours bottom-right: they agree only when Sq == Sk); anything else -> the dense
boolean attn_mask built from the mask's intervals, for the backends that accept one. Rows with no
visible key are opened to every key inside the kernel and zeroed afterwards, so no backend ever
produces NaN there (outputs and gradients match the reference: 0). GQA uses enable_gqa except on
the memory-efficient backend, which refuses it: there K/V are repeated (materialised) first.
SDPA returns no LSE: return_lse=True runs the separate masked log-sum-exp pass of `lse.py`.

Backend facts encoded in supports() (torch 2.11-2.13): on CPU only math and flash exist, and the
CPU flash kernel takes a boolean mask, GQA and fp64; on CUDA flash and cuDNN take no attn_mask
and need fp16/bf16, memory-efficient takes fp16/bf16/fp32 and a mask.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attn_masks import Mask, classify

from .common import LOW_PRECISION, Problem, cuda_capability, group_size
from .mask_utils import empty_rows, sdpa_mask

BACKENDS: dict[str, SDPBackend | None] = {
    "sdpa": None,
    "sdpa_math": SDPBackend.MATH,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
}
_NO_MASK_ON_CUDA = {"sdpa_flash", "sdpa_cudnn"}
_CUDA_ONLY = {"sdpa_efficient", "sdpa_cudnn"}
_CUDA_DTYPES = {
    "sdpa_flash": LOW_PRECISION,
    "sdpa_cudnn": LOW_PRECISION,
    "sdpa_efficient": (*LOW_PRECISION, torch.float32),
}
_MAX_HEAD_DIM = {"sdpa_flash": 256, "sdpa_cudnn": 128, "sdpa_efficient": 256}


def supports(impl: str, mask: Mask, problem: Problem) -> bool | str:
    """True, or why `impl` cannot run this mask/problem."""
    pattern = classify(mask)
    if impl in _CUDA_ONLY and not problem.on_cuda:
        return f"{impl} needs CUDA (torch has no {impl[5:]} SDPA backend on {problem.device.type})"
    if not problem.on_cuda or impl not in _CUDA_DTYPES:
        return True
    if problem.dtype is not None and problem.dtype not in _CUDA_DTYPES[impl]:
        names = ", ".join(str(d).removeprefix("torch.") for d in _CUDA_DTYPES[impl])
        return f"{impl} on CUDA needs dtype in ({names}), got {problem.dtype}"
    if problem.head_dim is not None and (
        problem.head_dim % 8 or problem.head_dim > _MAX_HEAD_DIM[impl]
    ):
        return f"{impl} needs head_dim a multiple of 8 and <= {_MAX_HEAD_DIM[impl]}"
    cap = cuda_capability(problem.device)
    if impl in _NO_MASK_ON_CUDA and cap is not None and cap < (8, 0):
        return f"{impl} needs compute capability >= 8.0, got {cap[0]}.{cap[1]}"
    if impl in _NO_MASK_ON_CUDA and not (pattern.kind == "full" or pattern.square_causal):
        return (
            f"mask not expressible: {impl} takes no attn_mask on CUDA, only no mask or is_causal "
            f"(top-left, so causal only when Sq == Sk); this mask is {pattern.kind} "
            f"{pattern.seqlen_q}x{pattern.seqlen_k}"
        )
    return True


def attention(
    impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, *, scale: float
) -> torch.Tensor:
    """out (B,Sq,Hq,D) from SDPA with the impl's backend forced."""
    pattern = classify(mask)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    group = group_size(q, k)
    gqa = group > 1
    if gqa and impl == "sdpa_efficient":
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
        gqa = False
    kwargs = {}
    if pattern.square_causal:
        kwargs["is_causal"] = True
    elif pattern.kind != "full":
        kwargs["attn_mask"] = sdpa_mask(mask, q.device)
    backend = BACKENDS[impl]
    with nullcontext() if backend is None else sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(
            qt, kt, vt, scale=scale, enable_gqa=gqa, **kwargs
        ).transpose(1, 2)
    if pattern.empty_rows:
        out = out.masked_fill(empty_rows(mask, q.device)[None, :, None, None], 0.0)
    return out
