"""flash-attn 2 / 3 / 4 when installed (import-guarded): fixed-mask kernels driven by classify().

Expressible masks: full, bottom-right causal and bottom-right sliding windows (window_size), and
square block-diagonal documents that are all full or all causal (varlen with cu_seqlens derived
from the mask's rows, batch folded into the packed sequence). flash4 also takes every other mask
through its block sparsity: the forward's and the dK/dV pass's 128 x 128 tile tables (those of
FlexAttention's BlockMask, `blocks.py`; full tiles skip the mask test) and a CuTe DSL mask_mod
that evaluates the per-row key intervals, passed as aux tensors, on partial tiles. For flash2
and flash3 anything else is Unsupported with the mask's kind in the reason.

flash4 returns its kernel's LSE (natural log, -inf on empty rows, differentiable); flash2/flash3's
LSE outputs differ between versions, so for them return_lse=True runs the separate masked
log-sum-exp pass of `lse.py`. CUDA only; these paths are exercised by the GPU tests and the
acceptance command, not on CPU.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import numpy as np
import torch

from attn_masks import Mask, MaskPattern, classify

from .blocks import BLOCK, flex_block_tables
from .common import LOW_PRECISION, Problem, cuda_capability
from .mask_utils import cached, interval_tensors

IMPLS = ("flash2", "flash3", "flash4")
_MODULES = {
    "flash2": ("flash_attn",),
    "flash3": ("flash_attn_interface", "flash_attn_3.flash_attn_interface"),
    "flash4": ("flash_attn.cute",),
}
_ARCH = {"flash2": ((8, 0), None), "flash3": ((9, 0), (10, 0)), "flash4": ((9, 0), (12, 0))}
_FLASH4_HEAD_DIMS = (64, 96, 128)
EXPRESSIBLE = ("full", "causal", "window", "full_document", "causal_document")


@functools.cache
def load(impl: str) -> ModuleType | str:
    """The module providing flash_attn_func/flash_attn_varlen_func, or why there is none."""
    errors = []
    for name in _MODULES[impl]:
        try:
            module = importlib.import_module(name)
        except Exception as err:  # missing package or a build that fails to load its CUDA libs
            errors.append(f"{name} ({type(err).__name__}: {err})")
            continue
        if hasattr(module, "flash_attn_func") and hasattr(module, "flash_attn_varlen_func"):
            return module
        errors.append(f"{name} (no flash_attn_func / flash_attn_varlen_func)")
    return "not installed: " + "; ".join(errors)


def _check_device(impl: str, problem: Problem) -> str | None:
    if not problem.on_cuda:
        return f"{impl} needs CUDA, got device {problem.device.type}"
    cap = cuda_capability(problem.device)
    low, high = _ARCH[impl]
    if cap is not None and (cap < low or (high is not None and cap >= high)):
        bound = f">= {low[0]}.{low[1]}" + (f" and < {high[0]}.{high[1]}" if high else "")
        return f"{impl} needs compute capability {bound}, got {cap[0]}.{cap[1]}"
    return None


def supports(impl: str, mask: Mask, problem: Problem) -> bool | str:
    """True, or why `impl` cannot run this mask/problem."""
    module = load(impl)
    if isinstance(module, str):
        return module
    bad_device = _check_device(impl, problem)
    if bad_device:
        return bad_device
    if problem.dtype is not None and problem.dtype not in LOW_PRECISION:
        return f"{impl} needs float16 or bfloat16, got {problem.dtype}"
    d = problem.head_dim
    if d is not None and impl == "flash4" and d not in _FLASH4_HEAD_DIMS:
        return f"flash4 supports head_dim in {_FLASH4_HEAD_DIMS}, got {d}"
    if d is not None and (d % 8 or d > 256):
        return f"{impl} needs head_dim a multiple of 8 and <= 256, got {d}"
    pattern = classify(mask)
    if pattern.kind not in EXPRESSIBLE and impl != "flash4":
        return (
            f"mask not expressible: {impl} takes causal, window_size or varlen full/causal "
            f"documents; this mask is {pattern.kind} ({pattern.seqlen_q}x{pattern.seqlen_k})"
        )
    return True


def _first(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def _window_kwargs(impl: str, pattern: MaskPattern) -> dict:
    left, right = pattern.window
    causal = pattern.kind == "causal"
    if impl == "flash4":
        bounded = pattern.kind == "window"
        window = (
            left if bounded and left >= 0 else None,
            right if bounded and right >= 0 else None,
        )
        return {"causal": causal, "window_size": window}
    window = (left, right) if pattern.kind == "window" else (-1, -1)
    return {"causal": causal, "window_size": window}


@functools.cache
def _interval_mask_mod(width: int):
    """flash-attn 4's mask_mod (CuTe DSL) for visible(q, k) = any_r lo[q, r] <= k < hi[q, r],
    r < width unrolled at trace time; lo and hi (rows x width, int32) are its aux tensors."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def interval_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        lo, hi = aux_tensors[0], aux_tensors[1]
        row = q_idx[0]
        start = utils.scalar_to_ssa(lo[row, 0], cutlass.Int32)
        stop = utils.scalar_to_ssa(hi[row, 0], cutlass.Int32)
        visible = (kv_idx >= start) & (kv_idx < stop)
        for r in cutlass.range_constexpr(1, width):
            start = utils.scalar_to_ssa(lo[row, r], cutlass.Int32)
            stop = utils.scalar_to_ssa(hi[row, r], cutlass.Int32)
            visible = visible | ((kv_idx >= start) & (kv_idx < stop))
        return visible

    return interval_mask


def _block_sparse_type():
    """flash-attn 4's container of block-sparse tables (torch tensors)."""
    return importlib.import_module("flash_attn.cute.block_sparsity").BlockSparseTensorsTorch


def _block_sparse_kwargs(mask: Mask, device) -> dict:
    """flash4's arguments for a mask no fixed pattern covers, built once per (mask, device)."""

    def build() -> dict:
        tables = {
            name: torch.as_tensor(a).to(device)
            for name, a in flex_block_tables(mask, BLOCK, BLOCK).items()
        }
        lo, hi = interval_tensors(mask, device, rows_to=BLOCK, dtype=torch.int32)
        sparse = _block_sparse_type()

        def pass_tables(by: str):
            return sparse(
                tables[f"{by}_num_blocks"],
                tables[f"{by}_indices"],
                tables[f"full_{by}_num_blocks"],
                tables[f"full_{by}_indices"],
                block_size=(BLOCK, BLOCK),
            )

        return {
            "mask_mod": _interval_mask_mod(lo.shape[1]),
            "aux_tensors": [lo, hi],
            "block_sparse_tensors": pass_tables("kv"),
            "block_sparse_tensors_bwd": pass_tables("q"),
        }

    return cached(mask, ("flash4_block_sparse", str(device)), build)


def _packed_cu_seqlens(mask: Mask, pattern: MaskPattern, batch: int, device) -> torch.Tensor:
    def build() -> torch.Tensor:
        cu = pattern.cu_seqlens
        starts = (cu[:-1][None, :] + np.arange(batch)[:, None] * mask.seqlen_q).reshape(-1)
        packed = np.append(starts, batch * mask.seqlen_q).astype(np.int32)
        return torch.as_tensor(packed).to(device)

    return cached(mask, ("flash_cu", str(device), batch), build)


def attention(
    impl: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    scale: float,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out (B,Sq,Hq,D), lse (B,Hq,Sq) fp32 or None) from flash-attn; lse only from flash4 and
    only when asked (the kernel then keeps it for the backward of <lse, dlse>)."""
    module = load(impl)
    pattern = classify(mask)
    lse_kwargs = {"return_lse": True} if return_lse and impl == "flash4" else {}
    if pattern.kind in ("full_document", "causal_document"):
        b, s, hq, d = q.shape
        cu = _packed_cu_seqlens(mask, pattern, b, q.device)
        longest = int(np.diff(pattern.cu_seqlens).max())
        result = module.flash_attn_varlen_func(
            q.reshape(b * s, hq, d),
            k.reshape(b * s, k.shape[2], d),
            v.reshape(b * s, v.shape[2], d),
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            softmax_scale=scale,
            causal=pattern.kind == "causal_document",
            **lse_kwargs,
        )
        out = _first(result).reshape(b, s, hq, d)
        lse = result[1].reshape(hq, b, s).transpose(0, 1) if lse_kwargs else None
        return out, lse
    if pattern.kind in EXPRESSIBLE:
        mask_kwargs = _window_kwargs(impl, pattern)
    else:
        mask_kwargs = _block_sparse_kwargs(mask, q.device)
    result = module.flash_attn_func(q, k, v, softmax_scale=scale, **mask_kwargs, **lse_kwargs)
    return _first(result), (result[1] if lse_kwargs else None)
