"""Adapters over jax.nn.dot_product_attention: the XLA reference and cuDNN flash attention."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from attn_masks import MaskPattern, classify

from ..mask_arrays import dense_from_intervals
from ..reference import reference_attention
from .common import (
    HALF,
    Adapter,
    Request,
    describe,
    device_arrays,
    first_reason,
    needs_cuda,
    needs_static_mask,
)


def _xla_plan(st: MaskPattern) -> str:
    """How the XLA impl is told the mask: nothing, is_causal, or a dense boolean matrix."""
    if st.is_full:
        return "none"
    if st.is_causal and st.square:
        return "causal"
    return "dense"


@partial(jax.jit, static_argnames=("scale", "plan", "fix_empty", "return_lse"))
def _xla(q, k, v, arrays, *, scale, plan, fix_empty, return_lse):
    visible = None
    if plan == "dense":
        visible = dense_from_intervals(arrays.lo, arrays.hi, k.shape[1])[None, None]
    out = jax.nn.dot_product_attention(
        q, k, v, mask=visible, scale=scale, is_causal=plan == "causal", implementation="xla"
    )
    if fix_empty:
        # XLA fills masked logits with a large finite negative, so a row that sees no key
        # would average all of V; our contract is output 0 there.
        nonempty = (arrays.hi > arrays.lo).any(axis=-1)
        out = jnp.where(nonempty[None, :, None, None], out, jnp.zeros((), out.dtype))
    # dot_product_attention gives no usable LSE (its residual is rounded to the input dtype and
    # carries no gradient), so the LSE comes from the jnp formula; XLA drops the unused output.
    lse = reference_attention(q, k, v, arrays, scale=scale)[1] if return_lse else None
    return out, lse


def _check_xla(req: Request) -> str | None:
    def cpu_half() -> str | None:
        if req.backend == "cpu" and req.dtype == np.dtype(np.float16):
            return (
                "xla: jax.nn.dot_product_attention asks for F16_F16_F32 dots, which the CPU "
                "backend rejects; use bfloat16 or float32 on CPU"
            )
        return None

    return first_reason(lambda: needs_static_mask(req, "xla"), cpu_half)


def _run_xla(q, k, v, mask, *, scale: float, return_lse: bool):
    st = classify(mask)
    arrays = device_arrays(mask, None)
    return _xla(
        q,
        k,
        v,
        arrays,
        scale=scale,
        plan=_xla_plan(st),
        fix_empty=st.empty_rows > 0,
        return_lse=return_lse,
    )


XLA = Adapter("xla", _check_xla, _run_xla)


def _cudnn_pattern(st: MaskPattern) -> tuple[bool, tuple[int, int] | None] | str:
    """(is_causal, local_window_size) for cuDNN, or the reason the mask is not expressible."""
    if st.is_full:
        return False, None
    if st.is_causal and st.square:
        return True, None
    window = st.square_window
    if window is not None and window[1] == 0:
        return True, (window[0], 0)
    if st.is_causal:
        return (
            f"cudnn's causal mask is top-left aligned; a bottom-right causal mask with "
            f"Sq={st.seqlen_q} != Sk={st.seqlen_k} is not expressible"
        )
    return (
        "cudnn (jax.nn.dot_product_attention) expresses only full, causal (Sq == Sk) and left "
        f"sliding-window masks; this is a {describe(st)}"
    )


def _check_cudnn(req: Request) -> str | None:
    def dtype() -> str | None:
        if req.dtype is not None and req.dtype not in HALF:
            return f"cudnn flash attention takes bfloat16 or float16, got {req.dtype.name}"
        return None

    def device() -> str | None:
        cap = req.gpu.capability if req.gpu is not None else None
        if cap is not None and cap < (8, 0):
            return f"cudnn flash attention needs compute capability >= 8.0, got {cap}"
        return None

    def head_dim() -> str | None:
        cap = req.gpu.capability if req.gpu is not None else None
        limit = 128 if cap is not None and cap < (9, 0) else 256
        d = req.head_dim
        if d is not None and (d > limit or d % 8):
            return f"cudnn needs head_dim <= {limit} and a multiple of 8, got {d}"
        return None

    def lse() -> str | None:
        if req.return_lse:
            return (
                "cudnn via jax.nn.dot_product_attention returns its LSE rounded to the input "
                "dtype and without gradient; return_lse is not supported"
            )
        return None

    def pattern() -> str | None:
        found = _cudnn_pattern(req.pattern)
        return found if isinstance(found, str) else None

    return first_reason(
        lambda: needs_static_mask(req, "cudnn"),
        lambda: needs_cuda(req, "cudnn"),
        device,
        dtype,
        head_dim,
        lse,
        pattern,
    )


@partial(jax.jit, static_argnames=("scale", "causal", "window"))
def _cudnn(q, k, v, *, scale, causal, window):
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=causal,
        local_window_size=window,
        implementation="cudnn",
    )


def _run_cudnn(q, k, v, mask, *, scale: float, return_lse: bool):
    del return_lse
    causal, window = _cudnn_pattern(classify(mask))
    return _cudnn(q, k, v, scale=scale, causal=causal, window=window), None


CUDNN = Adapter("cudnn", _check_cudnn, _run_cudnn)
