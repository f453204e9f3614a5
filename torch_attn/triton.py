"""Impl "triton": triton_attn's block-sparse flash kernels launched on torch tensors.

The same @triton.jit kernels as jax_attn's impl "triton" (triton_attn.kernels), launched with
`kernel[grid](...)`; the backward is a torch.autograd.Function running the delta
(rowsum(out * dout) - dlse) kernel and the backward kernel (dK/dV and dQ programs in one launch)
from the saved LSE (so a returned LSE is
differentiable too). The mask tables (tiles from triton_attn.launch) are built on the host once
per (mask, device, configs). CUDA GPUs (compute capability >= 8.0); on CPU only when the kernels
were imported under TRITON_INTERPRET=1 (Triton's interpreter, for tests).
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType

import torch

from attn_masks import Mask
from triton_attn import launch

from .common import Problem, cuda_capability
from .mask_utils import cached

_DEVICE_TABLES = ("lo", "hi")
_LISTS = ("fwd", "dq", "dkdv")


def kernels() -> tuple[ModuleType | None, str | None]:
    """(triton_attn.kernels, None), or (None, why it cannot be imported)."""
    try:
        return importlib.import_module("triton_attn.kernels"), None
    except ImportError as err:
        return None, f"triton not installed ({err})"


def supports(mask: Mask, problem: Problem) -> bool | str:
    """True, or why the Triton kernels cannot run this problem (every mask is expressible)."""
    mod, why = kernels()
    if why is not None:
        return why
    device = problem.device
    if device.type == "cpu" and not mod.interpreted():
        return (
            "triton runs on CUDA GPUs; on CPU only in Triton's interpreter (set "
            "TRITON_INTERPRET=1 before triton is first imported)"
        )
    if device.type not in ("cpu", "cuda"):
        return f"triton is only wired for CUDA (and the CPU interpreter), got {device.type}"
    cap = cuda_capability(device)
    if cap is not None and cap < launch.MIN_CAPABILITY:
        need = ".".join(map(str, launch.MIN_CAPABILITY))
        return f"triton kernels need compute capability >= {need}, got {cap}"
    dtype = None if problem.dtype is None else str(problem.dtype).removeprefix("torch.")
    reason = launch.check(problem.head_dim, dtype)
    return True if reason is None else reason


def _device_tables(mask: Mask, device: torch.device, configs: launch.KernelConfigs) -> dict:
    def build() -> dict:
        host = launch.mask_tables(mask, configs)
        out = {"host": host}
        for name in _DEVICE_TABLES:
            out[name] = torch.as_tensor(getattr(host, name)).to(device)
        for name in _LISTS:
            out[name] = tuple(torch.as_tensor(x).to(device) for x in getattr(host, name).arrays)
        return out

    return cached(mask, ("triton", str(device), configs), build)


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _shape(q: torch.Tensor, k: torch.Tensor) -> launch.Shape:
    b, sq, hq, d = q.shape
    return launch.Shape(b, sq, k.shape[1], hq, k.shape[2], d)


def _launch(kernel, call: launch.Call, arrays: tuple, outputs: tuple) -> None:
    kernel[call.grid](
        *arrays,
        *call.scalars,
        *outputs,
        num_warps=call.num_warps,
        num_stages=call.num_stages,
        **call.meta,
    )


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: dict, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B,Sq,Hq,D), lse (B,Hq,Sq) fp32) of contiguous q, k, v, no autograd."""
    mod, _ = kernels()
    shape = _shape(q, k)
    call = launch.fwd_call(shape, tables["host"], scale, q.dtype == torch.float32)
    out = torch.empty_like(q)
    lse = torch.empty((shape.batch, shape.heads_q, shape.seqlen_q), device=q.device)
    with _device_guard(q.device):
        arrays = (q, k, v, tables["lo"], tables["hi"], *tables["fwd"])
        _launch(mod.attn_fwd_kernel, call, arrays, (out, lse))
    return out, lse


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: dict,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the forward's residuals: the delta kernel, then one dK/dV + dQ launch."""
    mod, _ = kernels()
    shape = _shape(q, k)
    ieee = q.dtype == torch.float32
    dout = dout.contiguous().to(q.dtype)
    dlse = torch.zeros_like(lse) if dlse is None else dlse.float().contiguous()
    delta = torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    host = tables["host"]
    common = (q, k, v, dout, lse, delta, tables["lo"], tables["hi"])
    with _device_guard(q.device):
        rows = (out.contiguous(), dout, dlse)
        _launch(mod.attn_bwd_delta_kernel, launch.delta_call(shape), rows, (delta,))
        call = launch.bwd_call(shape, host, scale, ieee)
        lists = (*tables["dkdv"], *tables["dq"])
        _launch(mod.attn_bwd_kernel, call, (*common, *lists), (dq, dk, dv))
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    """Forward kernel; backward by the delta and backward kernels (out and lse differentiable)."""

    @staticmethod
    def forward(ctx, q, k, v, tables, scale):
        q, k, v = (x.contiguous() for x in (q, k, v))
        out, lse = forward(q, k, v, tables, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tables, ctx.scale = tables, scale
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        grads = backward(q, k, v, ctx.tables, out, lse, dout, dlse, ctx.scale)
        return (*grads, None, None)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    scale: float,
    configs: launch.KernelConfigs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B,Sq,Hq,D), lse (B,Hq,Sq) fp32), differentiable; configs default by head dim."""
    if configs is None:
        configs = launch.default_configs(q.shape[-1], q.element_size())
    tables = _device_tables(mask, q.device, configs)
    return _Attention.apply(q, k, v, tables, float(scale))
