"""Shared plumbing of the adapters: the Unsupported error, input checks, devices and dtypes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attn_masks import Mask
from attn_masks.shapes import check_attention_shapes

LOW_PRECISION = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Unsupported(ValueError):
    """An (impl, mask, inputs) combination the kernel cannot compute; raised before any work."""


@dataclass(frozen=True)
class Problem:
    """What supports() reasons about: the call's dtype, heads, head dim, device and grad need.

    None for dtype/heads/head_dim means "not known yet": checks that need the value are skipped.
    """

    dtype: torch.dtype | None
    heads_q: int | None
    heads_kv: int | None
    head_dim: int | None
    device: torch.device
    backward: bool

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device a call would run on: the given one, else CUDA when available, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, None when it is not a usable CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> None:
    """Raise ValueError unless q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) match each other and the mask."""
    if not isinstance(mask, Mask):
        raise ValueError(f"mask must be an attn_masks.Mask, got {type(mask).__name__}")
    check_attention_shapes(q.shape, k.shape, v.shape, mask)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def non_finite_message(counts: dict[str, int]) -> str | None:
    """The check_finite error naming each input that holds NaN or inf and how many, else None."""
    bad = [f"{name} holds {n} NaN/inf value{'s' * (n != 1)}" for name, n in counts.items() if n]
    return f"check_finite: {', '.join(bad)}" if bad else None


def check_finite_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError if q, k or v holds NaN or inf (opt-in: one pass and one device sync)."""
    counts = {n: int(torch.isfinite(x).logical_not().sum()) for n, x in zip("qkv", (q, k, v))}
    message = non_finite_message(counts)
    if message:
        raise ValueError(message)


def problem_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Problem:
    """The Problem of an actual call (backward = autograd will need gradients)."""
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    return Problem(q.dtype, q.shape[2], k.shape[2], q.shape[3], q.device, needs_grad)


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    """The softmax scale: the given one, else 1/sqrt(D)."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the explicit paths: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def group_size(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query heads per KV head (GQA group)."""
    return q.shape[2] // k.shape[2]
