"""Public entry point: masked flash attention with a custom VJP over the Pallas Triton kernels."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from attn_masks.shapes import check_attention_shapes

from ..flash_vjp import flash_vjp
from ..kernel_inputs import (
    TilePadding,
    key_tile_walk,
    pad_axis,
    padded_intervals,
    query_tile_walk,
    softmax_delta,
)
from ..mask_arrays import MaskArrays
from .backward import backward_dkv, backward_dq
from .config import MAX_HEAD_DIM, MIN_HEAD_DIM, KernelConfig, default_config, padded_head_dim
from .forward import forward
from .fused import backward_fused


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything about a call that is compile-time (hashable, a jit static argument)."""

    scale: float
    config: KernelConfig
    interpret: bool


def _pad_seq_dim(x: jax.Array, seq: int, dim: int) -> jax.Array:
    return pad_axis(pad_axis(x, 1, seq), 3, dim)


def _forward_padded(
    q: jax.Array, k: jax.Array, v: jax.Array, arrays: MaskArrays, static: _Static
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(out (B,Sq,Hq,D), lse (B,Hq,Sq), padded lse for the backward)."""
    pad = TilePadding.of(arrays)
    dim = padded_head_dim(q.shape[3])
    lo, hi = padded_intervals(arrays, pad)
    out, lse = forward(
        _pad_seq_dim(q, pad.padded_q, dim),
        _pad_seq_dim(k, pad.padded_k, dim),
        _pad_seq_dim(v, pad.padded_k, dim),
        lo,
        hi,
        query_tile_walk(arrays, pad),
        scale=static.scale,
        config=static.config,
        mask_block_q=pad.block_q,
        mask_block_k=pad.block_k,
        interpret=static.interpret,
    )
    return out[:, : pad.seq_q, :, : q.shape[3]], lse[:, :, : pad.seq_q], lse


def _backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    arrays: MaskArrays,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    d_lse: jax.Array,
    static: _Static,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv from the residuals; lse is (B,Hq,padded Sq), -inf on the padded rows.

    Only lse and delta = rowsum(dO * O) - dLSE enter the kernels (dS = P (dP - delta) with
    P = exp(S - lse)), so no forward is recomputed.
    """
    pad = TilePadding.of(arrays)
    sq, sk, d = pad.seq_q, pad.seq_k, q.shape[3]
    dim = padded_head_dim(d)
    d_out = d_out.astype(q.dtype)
    delta = pad_axis(softmax_delta(out, d_out, lse[:, :, :sq], d_lse), 2, pad.padded_q)
    qp = _pad_seq_dim(q, pad.padded_q, dim)
    kp = _pad_seq_dim(k, pad.padded_k, dim)
    vp = _pad_seq_dim(v, pad.padded_k, dim)
    dop = _pad_seq_dim(d_out, pad.padded_q, dim)
    lo, hi = padded_intervals(arrays, pad)
    common = dict(
        scale=static.scale,
        config=static.config,
        mask_block_q=pad.block_q,
        mask_block_k=pad.block_k,
        interpret=static.interpret,
    )
    by_key = key_tile_walk(arrays, pad)
    if static.config.fused_bwd:
        dq, dk, dv = backward_fused(qp, kp, vp, dop, lse, delta, lo, hi, by_key, **common)
    else:
        by_query = query_tile_walk(arrays, pad)
        dq = backward_dq(qp, kp, vp, dop, lse, delta, lo, hi, by_query, **common)
        dk, dv = backward_dkv(qp, kp, vp, dop, lse, delta, lo, hi, by_key, **common)
    return dq[:, :sq, :, :d], dk[:, :sk, :, :d], dv[:, :sk, :, :d]


_attention_jit = flash_vjp(_forward_padded, _backward)


@functools.partial(jax.jit, static_argnames=("static",))
def _backward_jit(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    arrays: MaskArrays,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    d_lse: jax.Array,
    static: _Static,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    padded_q = TilePadding.of(arrays).padded_q
    lse_padded = pad_axis(lse.astype(jnp.float32), 2, padded_q, value=-jnp.inf)
    return _backward(q, k, v, arrays, out, lse_padded, d_out, d_lse, static)


def _check(q: jax.Array, k: jax.Array, v: jax.Array, arrays: MaskArrays) -> None:
    check_attention_shapes(q.shape, k.shape, v.shape, arrays)
    d = q.shape[3]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(
            f"head dim {d} is outside the supported range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
        )
    if jnp.ndim(arrays.lo) != 2 or jnp.ndim(arrays.kv.index) != 2:
        raise ValueError("flash_attention takes the MaskArrays of one mask (no stacked axes)")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def _static(
    q: jax.Array,
    arrays: MaskArrays,
    scale: float,
    interpret: bool | None,
    config: KernelConfig | None,
) -> _Static:
    """The compile-time part of a call: interpret None means "on the CPU backend"."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    base = default_config(q.shape[-1], q.dtype) if config is None else config
    return _Static(
        scale=float(scale),
        config=base.resolve(arrays.block_q, arrays.block_k),
        interpret=bool(interpret),
    )


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    arrays: MaskArrays,
    *,
    scale: float,
    return_lse: bool = False,
    interpret: bool | None = None,
    config: KernelConfig | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Masked attention (B,Sq,Hq,D) over MaskArrays, differentiable; optionally with the LSE.

    LSE is (B,Hq,Sq) float32 natural log, -inf where a row sees no key (its output is 0).
    interpret=None runs the kernels in interpret mode when the default backend is the CPU.
    """
    _check(q, k, v, arrays)
    out, lse = _attention_jit(q, k, v, arrays, _static(q, arrays, scale, interpret, config))
    return (out, lse) if return_lse else out


def flash_attention_bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    arrays: MaskArrays,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    dlse: jax.Array | None = None,
    *,
    scale: float,
    interpret: bool | None = None,
    config: KernelConfig | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of flash_attention from its residuals, without recomputing the forward.

    out (B,Sq,Hq,D) and lse (B,Hq,Sq) are what flash_attention(..., return_lse=True) returned;
    dout and dlse (None: zero) are their cotangents. Equals jax.vjp of flash_attention (the same
    code is its custom VJP rule). Only lse and delta = rowsum(dout * out) - dlse enter, with
    P = exp(S - lse): so for the block of keys k/v of a softmax merged over several blocks (ring
    attention), passing the merged out/lse and their cotangents gives that block's share of the
    merged gradients directly (dk/dv of the block, its term of dq).
    """
    _check(q, k, v, arrays)
    b, sq, hq, _ = q.shape
    if out.shape != q.shape or dout.shape != q.shape:
        raise ValueError(
            f"out and dout must have q's shape {q.shape}, got {out.shape} and {dout.shape}"
        )
    for name, x in (("lse", lse), ("dlse", dlse)):
        if x is not None and x.shape != (b, hq, sq):
            raise ValueError(f"{name} must have shape (B, Hq, Sq) = {(b, hq, sq)}, got {x.shape}")
    if dlse is None:
        dlse = jnp.zeros((b, hq, sq), jnp.float32)
    static = _static(q, arrays, scale, interpret, config)
    return _backward_jit(q, k, v, arrays, out, lse, dout, dlse, static)


def kernel_config(arrays: MaskArrays, head_dim: int, dtype: Any) -> KernelConfig:
    """The resolved launch configuration flash_attention uses by default for these arrays."""
    return default_config(head_dim, dtype).resolve(arrays.block_q, arrays.block_k)
