"""FlexAttention, compiled once per process, with the BlockMask built from the mask's block map.

One `torch.compile(dynamic=False)` of a small core function: it receives q/k/v, the interval
tensors (lo, hi) and the eight block tables as *inputs*, builds the BlockMask and the interval
mask_mod inside the traced region and calls flex_attention (enable_gqa, natural-log LSE: the
public API already converts flex's internal base-2 LSE). Dynamo therefore compiles once per
(shapes, dtype, grad mode, LSE flag) and switching between masks of one shape never recompiles:
intervals are padded to MIN_INTERVALS columns (powers of two beyond) and rows to a multiple of
128, tables are full width. Calls run with a raised dynamo recompile limit (sweeps over many
shapes would otherwise silently fall back to eager after 8) and with donated buffers off, so
benchmarks may call backward(retain_graph=True) repeatedly.

CPU (torch 2.11-2.13): the compiled CPU kernel only does inference in fp32/fp16/bf16 without
LSE; for fp64 inputs or return_lse=True the adapter runs flex_attention uncompiled (torch's
unfused reference implementation of flex, same semantics, materialises the scores); flex has no
backward on CPU at all, so a CPU call that needs gradients is Unsupported. The compiled CPU kernel
returns rows that read a NaN in q or k finite (docs/api.md, "Non-finite inputs"). Should
compiling fail on a CPU (no C++ toolchain), CPU calls fall back to the uncompiled path with a
warning and `cpu_compile_error()` says why.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import ExitStack

import torch

from attn_masks import Mask

from .blocks import BLOCK, MIN_INTERVALS, TABLE_NAMES, block_mask_from_tables, flex_block_tables
from .common import FLOAT_DTYPES, LOW_PRECISION, Problem
from .mask_utils import cached, interval_tensors

RECOMPILE_LIMIT = 256
_CPU_COMPILE_ERROR: list[str] = []
_CPU_COMPILED_DTYPES = (*LOW_PRECISION, torch.float32)
_CUDA_DTYPES = (*LOW_PRECISION, torch.float32)


try:
    from torch.nn.attention.flex_attention import flex_attention
except ImportError:  # torch < 2.5
    flex_attention = None
try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch < 2.9: flex_attention(return_lse=True) instead
    AuxRequest = None


def supports(mask: Mask, problem: Problem) -> bool | str:
    """True, or why flex cannot run this problem (any mask is expressible)."""
    if flex_attention is None:
        return f"not installed: torch {torch.__version__} has no FlexAttention"
    if problem.device.type == "cpu":
        if problem.backward:
            return "FlexAttention has no backward on CPU (torch raises for inputs requiring grad)"
        if problem.dtype is not None and problem.dtype not in FLOAT_DTYPES:
            return f"flex on CPU needs a floating dtype, got {problem.dtype}"
        return True
    if not problem.on_cuda:
        return f"flex is only wired for CUDA and CPU, got {problem.device.type}"
    if problem.dtype is not None and problem.dtype not in _CUDA_DTYPES:
        return f"flex on CUDA needs fp16/bf16/fp32 (Triton kernels), got {problem.dtype}"
    if problem.head_dim is not None and problem.head_dim < 16:
        return f"flex on CUDA needs head_dim >= 16, got {problem.head_dim}"
    return True


def _core(q, k, v, lo, hi, tables, scale, seq_lengths, want_lse):
    block_mask = block_mask_from_tables(tables, lo, hi, seq_lengths)
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=True)
    if not want_lse:
        return flex_attention(q, k, v, **kwargs), None
    if AuxRequest is None:
        return flex_attention(q, k, v, return_lse=True, **kwargs)
    out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
    return out, aux.lse


@functools.cache
def _compiled():
    """The process-wide compiled core (dynamo caches one graph per shape/dtype/grad mode)."""
    return torch.compile(_core, dynamic=False)


def _compile_settings() -> ExitStack:
    stack = ExitStack()
    dynamo = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    stack.enter_context(dynamo.patch(**{name: max(getattr(dynamo, name), RECOMPILE_LIMIT)}))
    functorch = torch._functorch.config
    if hasattr(functorch, "donated_buffer"):
        stack.enter_context(functorch.patch(donated_buffer=False))
    return stack


def cpu_compile_error() -> str | None:
    """Why compiling flex failed on this CPU (then CPU calls run uncompiled), None if it did not."""
    return _CPU_COMPILE_ERROR[0] if _CPU_COMPILE_ERROR else None


def uses_compiled(q: torch.Tensor, return_lse: bool) -> bool:
    """Whether a call runs the compiled kernel (always on CUDA; see the module doc for CPU)."""
    if q.device.type != "cpu":
        return True
    return q.dtype in _CPU_COMPILED_DTYPES and not return_lse and not _CPU_COMPILE_ERROR


def _run_compiled(args: tuple, on_cpu: bool) -> tuple:
    with _compile_settings():
        if not on_cpu:
            return _compiled()(*args)
        try:
            return _compiled()(*args)
        except Exception as err:  # no C++ toolchain or an unsupported CPU: go uncompiled
            _CPU_COMPILE_ERROR.append(f"{type(err).__name__}: {err}")
            warnings.warn(f"flex: compiling on CPU failed, running uncompiled: {err}", stacklevel=3)
    return _run_eager(args)


def _run_eager(args: tuple) -> tuple:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch")
        warnings.filterwarnings("ignore", message="return_lse is deprecated")
        return _core(*args)


def interval_width(mask: Mask) -> int:
    """Interval columns the mask_mod unrolls: MIN_INTERVALS, else the next power of two, so
    unusual masks (many intervals per row) share few compiled variants."""
    width = mask.row_intervals()[0].shape[1]
    return MIN_INTERVALS if width <= MIN_INTERVALS else 1 << (width - 1).bit_length()


def _inputs(mask: Mask, device: torch.device) -> tuple:
    def build() -> tuple:
        tables = flex_block_tables(mask, BLOCK, BLOCK)
        tensors = tuple(torch.as_tensor(tables[n]).to(device) for n in TABLE_NAMES)
        lo, hi = interval_tensors(
            mask, device, min_width=interval_width(mask), rows_to=BLOCK, dtype=torch.int32
        )
        return lo, hi, tensors

    return cached(mask, ("flex", str(device)), build)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    scale: float,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out (B,Sq,Hq,D), lse (B,Hq,Sq) or None)."""
    lo, hi, tables = _inputs(mask, q.device)
    if not torch.is_grad_enabled():  # flex rejects requires_grad inputs on CPU even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    args = (
        *(x.transpose(1, 2) for x in (q, k, v)),
        lo,
        hi,
        tables,
        scale,
        (mask.seqlen_q, mask.seqlen_k),
        return_lse,
    )
    if uses_compiled(q, return_lse):
        out, lse = _run_compiled(args, q.device.type == "cpu")
    else:
        out, lse = _run_eager(args)
    return out.transpose(1, 2), lse
