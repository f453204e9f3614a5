"""The public entry points: IMPLS, supports(), attention(), describe()."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from attn_masks import MODES, Mask

from . import flash, flex, naive, sdpa
from . import triton as triton_impl
from .common import (
    Problem,
    Unsupported,
    check_finite_inputs,
    check_inputs,
    default_scale,
    problem_of,
    resolve_device,
    work_dtype,
)
from .lse import masked_lse


@dataclass(frozen=True)
class Adapter:
    """One impl: a line on how it computes masks, GQA and the LSE; supports(mask, Problem) ->
    True | reason; run(q, k, v, mask, scale, return_lse) -> (out, lse or None: then the LSE
    comes from a separate masked pass). The registry mirrors jax_attn.adapters.ADAPTERS."""

    name: str
    note: str
    supports: Callable[[Mask, Problem], bool | str]
    run: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def _naive(q, k, v, mask, scale, return_lse):
    return naive.attention(q, k, v, mask, scale=scale)


def _flex(q, k, v, mask, scale, return_lse):
    return flex.attention(q, k, v, mask, scale=scale, return_lse=return_lse)


def _triton(q, k, v, mask, scale, return_lse):
    return triton_impl.attention(q, k, v, mask, scale=scale)


def _sdpa(impl, q, k, v, mask, scale, return_lse):
    return sdpa.attention(impl, q, k, v, mask, scale=scale), None


def _flash(impl, q, k, v, mask, scale, return_lse):
    return flash.attention(impl, q, k, v, mask, scale=scale, return_lse=return_lse)


def _per_name(module, run, names, notes) -> list[Adapter]:
    """Adapters of a module whose supports() and run take the impl name first."""
    return [
        Adapter(name, notes[name], partial(module.supports, name), partial(run, name))
        for name in names
    ]


_NOTES = {
    "naive": "explicit fp32 scores (fp64 for fp64 inputs), K/V repeated for GQA; LSE from the "
    "same pass; any mask, any device",
    "sdpa": "SDPA with torch's own backend choice; dense bool mask unless full/square causal; "
    "LSE by a separate masked logsumexp pass",
    "sdpa_math": "SDPA math backend; dense bool mask unless full/square causal; LSE by a "
    "separate masked logsumexp pass",
    "sdpa_flash": "SDPA flash backend; CUDA: full or square causal only (no attn_mask), fp16/bf16;"
    " CPU: takes the dense mask; LSE by a separate masked logsumexp pass",
    "sdpa_efficient": "SDPA memory-efficient backend (CUDA only); dense mask; GQA by repeating "
    "K/V (the backend refuses enable_gqa); LSE by a separate masked logsumexp pass",
    "sdpa_cudnn": "SDPA cuDNN backend (CUDA only); full or square causal only; LSE by a separate "
    "masked logsumexp pass",
    "flex": "torch.compile(flex_attention), BlockMask from the mask's block map, interval "
    "mask_mod; LSE from the kernel; CPU: forward only, uncompiled for fp64 or return_lse (the "
    "compiled CPU kernel hides NaN inputs: docs/api.md, Non-finite inputs)",
    "triton": "triton_attn's block-sparse flash kernels (the same Triton source as jax_attn's "
    "triton): tile lists from the block map, interval mask on partial tiles, GQA without "
    "repeating K/V; LSE from the kernel; CUDA, or CPU under TRITON_INTERPRET=1",
    "flash2": "flash-attn 2: causal/window_size/varlen documents; LSE by a separate pass",
    "flash3": "flash-attn 3 (Hopper): causal/window_size/varlen documents; LSE by a separate pass",
    "flash4": "flash-attn 4 (CuTe DSL, Hopper/Blackwell): causal/window/varlen documents, any "
    "other mask by block sparsity (BlockMask tile tables, interval mask_mod); LSE from the kernel",
}


ADAPTERS: dict[str, Adapter] = {
    a.name: a
    for a in (
        Adapter("naive", _NOTES["naive"], naive.supports, _naive),
        *_per_name(sdpa, _sdpa, tuple(sdpa.BACKENDS), _NOTES),
        Adapter("flex", _NOTES["flex"], flex.supports, _flex),
        Adapter("triton", _NOTES["triton"], triton_impl.supports, _triton),
        *_per_name(flash, _flash, flash.IMPLS, _NOTES),
    )
}
IMPLS = tuple(ADAPTERS)


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid impls: {', '.join(IMPLS)}")


def describe(impl: str) -> str:
    """One line on how `impl` computes masks, GQA and the LSE (for reports and provenance)."""
    _check_impl(impl)
    return ADAPTERS[impl].note


def _supports(impl: str, mask: Mask, problem: Problem) -> bool | str:
    hq, hkv = problem.heads_q, problem.heads_kv
    if hq is not None and hkv is not None and (hkv <= 0 or hq % hkv):
        return f"heads_q={hq} must be a positive multiple of heads_kv={hkv}"
    return ADAPTERS[impl].supports(mask, problem)


def supports(
    impl: str,
    mask: Mask,
    *,
    dtype: torch.dtype | None = None,
    heads_q: int | None = None,
    heads_kv: int | None = None,
    head_dim: int | None = None,
    device: str | torch.device | None = None,
    mode: str = "fwd",
    backward: bool | None = None,
) -> bool | str:
    """True if `impl` computes exactly `mask` for such inputs, else a non-empty reason string.

    Unknown (None) dtype/heads/head_dim skip the checks that need them; device None means CUDA
    when available, else CPU. mode is fwd, bwd or fwd_bwd (attn_masks.MODES): the latter two
    also ask for gradients (flex has none on CPU); the default asks for the forward only, since
    attention() itself decides from whether its inputs require grad. backward is the older
    spelling (True: fwd_bwd, False: fwd), still taken from callers that pass it.
    """
    _check_impl(impl)
    if not isinstance(mask, Mask):
        raise ValueError(f"mask must be an attn_masks.Mask, got {type(mask).__name__}")
    if backward is not None:
        mode = "fwd_bwd" if backward else "fwd"
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    problem = Problem(dtype, heads_q, heads_kv, head_dim, resolve_device(device), mode != "fwd")
    return _supports(impl, mask, problem)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    impl: str = "sdpa",
    scale: float | None = None,
    return_lse: bool = False,
    check_finite: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Masked attention: q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) -> out (B,Sq,Hq,D) [, lse (B,Hq,Sq)].

    lse is the natural-log log-sum-exp of the scaled scores over visible keys, fp32 (fp64 for
    fp64 inputs), -inf on rows with no visible key (whose output is 0). Differentiable. Raises
    Unsupported (a ValueError) before any work if `impl` cannot compute `mask` for these inputs.
    NaN inputs give NaN on the rows that read them (docs/api.md, "Non-finite inputs"), except in
    flex's compiled CPU kernel; check_finite=True raises ValueError first, naming each of q, k, v
    that holds NaN or inf and how many (one pass over the inputs and a device sync).
    """
    _check_impl(impl)
    check_inputs(q, k, v, mask)
    verdict = _supports(impl, mask, problem_of(q, k, v))
    if verdict is not True:
        raise Unsupported(f"{impl}: {verdict}")
    if check_finite:
        check_finite_inputs(q, k, v)
    scale = default_scale(q, scale)
    out, lse = ADAPTERS[impl].run(q, k, v, mask, scale, return_lse)
    if not return_lse:
        return out
    if lse is None:
        lse = masked_lse(q, k, mask, scale)
    return out, lse.to(work_dtype(q.dtype))
