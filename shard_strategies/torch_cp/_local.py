"""Per-step local attention (through torch_attn) and the LSE merge that combines steps.

The merge and the per-step cotangents are elementwise passes over (B, L, H, D) fp32 tensors; on
CUDA they run as torch.compile'd fused kernels (one read and one write per tensor instead of
one per eager op), which matters at long lengths where each step's attention is only a few ms;
they are compiled with dynamic shapes, once for every length a sweep visits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

import torch_attn
from attn_masks import Mask
from shard_strategies.plan import default_local_impl


def default_impl(device: torch.device) -> str:
    """FlexAttention on CUDA (every mask, block skipping), the naive kernel elsewhere."""
    return default_local_impl("torch", device.type == "cuda")


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    scale: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B,Sq,Hq,D) in q's dtype, lse (B,Hq,Sq), -inf on empty rows); differentiable."""
    out, lse = torch_attn.attention(q, k, v, mask, impl=impl, scale=scale, return_lse=True)
    return out, lse.to(acc_dtype(q.dtype))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Merge and accumulation dtype: fp32 (fp64 for fp64 inputs)."""
    return torch.promote_types(dtype, torch.float32)


def safe_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf replaced by 0, so exp(x - safe_lse) is 0 (not NaN) on empty rows."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _rows(w: torch.Tensor) -> torch.Tensor:
    """(B, H, S) -> (B, S, H, 1), to scale (B, S, H, D) rows."""
    return w.transpose(1, 2).unsqueeze(-1)


def _merge(
    acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    new = torch.logaddexp(acc_lse, lse)
    ref = safe_lse(new)
    merged = acc_out * _rows(torch.exp(acc_lse - ref)) + out.to(acc_out.dtype) * _rows(
        torch.exp(lse - ref)
    )
    return merged, new


def step_cotangents(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    total_lse: torch.Tensor,
    delta: torch.Tensor,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dO * w, w * (rowsum(dO * o) - delta + dLSE)) for one step, w = exp(lse - total_lse)."""
    w = torch.exp(lse - total_lse)
    g_lse = (dout.to(w.dtype) * out.to(w.dtype)).sum(-1).transpose(1, 2) - delta
    if dlse is not None:
        g_lse = g_lse + dlse
    return (dout.to(w.dtype) * _rows(w)).to(out.dtype), w * g_lse


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def fused(fn: Callable, device: torch.device) -> Callable:
    """fn compiled on CUDA, as is elsewhere."""
    return _compiled(fn) if device.type == "cuda" else fn


class LseMerge:
    """Running (out, lse) in fp32 over steps that each cover a row range of the local queries."""

    def __init__(self, q: torch.Tensor) -> None:
        b, sq, hq, d = q.shape
        dt = acc_dtype(q.dtype)
        self.out = torch.zeros(b, sq, hq, d, dtype=dt, device=q.device)
        self.lse = torch.full((b, hq, sq), float("-inf"), dtype=dt, device=q.device)
        self.fresh = True

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold one step's (out, lse) for query rows `rows` into the running result."""
        if self.fresh and out.shape == self.out.shape:
            self.out, self.lse, self.fresh = out.to(self.out.dtype), lse, False
            return
        self.fresh = False
        merged, new = fused(_merge, out.device)(self.out[:, rows], self.lse[:, :, rows], out, lse)
        if merged.shape == self.out.shape:
            self.out, self.lse = merged, new
        else:
            self.out[:, rows] = merged
            self.lse[:, :, rows] = new
