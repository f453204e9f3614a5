"""Public entry point: masked flash attention with a custom VJP over the Pallas Triton kernels."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from attn_masks.shapes import check_attention_shapes

from ..mask_arrays import MaskArrays
from ..padding import pad_axis
from .backward import backward_dkv, backward_dq
from .config import KernelConfig, default_config, padded_head_dim
from .forward import forward
from .fused import backward_fused
from .tiles import TileLists, split_partial_full


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything about a call that is compile-time (hashable, a jit static argument)."""

    scale: float
    config: KernelConfig
    interpret: bool


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Padded sizes of one call, derived from the shapes and the mask tiles."""

    seq_q: int
    seq_k: int
    padded_q: int
    padded_k: int
    head_dim: int
    padded_dim: int
    mask_block_q: int
    mask_block_k: int

    @classmethod
    def of(cls, q: jax.Array, k: jax.Array, arrays: MaskArrays) -> _Geometry:
        bq, bk = arrays.block_q, arrays.block_k
        sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
        return cls(sq, sk, -(-sq // bq) * bq, -(-sk // bk) * bk, d, padded_head_dim(d), bq, bk)


def _pad_seq_dim(x: jax.Array, seq: int, dim: int) -> jax.Array:
    return pad_axis(pad_axis(x, 1, seq), 3, dim)


def _intervals(arrays: MaskArrays, geo: _Geometry) -> tuple[jax.Array, jax.Array]:
    """lo/hi as (K, padded Sq) int32; padded rows get the empty interval [0, 0)."""
    lo = pad_axis(jnp.asarray(arrays.lo, jnp.int32).T, 1, geo.padded_q)
    hi = pad_axis(jnp.asarray(arrays.hi, jnp.int32).T, 1, geo.padded_q)
    return lo, hi


def _kv_lists(arrays: MaskArrays, geo: _Geometry) -> TileLists:
    ragged_k = geo.padded_k != geo.seq_k
    return split_partial_full(
        arrays.kv_index,
        arrays.kv_count,
        arrays.kv_full,
        ragged_outer=geo.padded_q != geo.seq_q,
        padded_inner=geo.padded_k // geo.mask_block_k - 1 if ragged_k else None,
    )


def _q_lists(arrays: MaskArrays, geo: _Geometry) -> TileLists:
    ragged_q = geo.padded_q != geo.seq_q
    return split_partial_full(
        arrays.q_index,
        arrays.q_count,
        arrays.q_full,
        ragged_outer=geo.padded_k != geo.seq_k,
        padded_inner=geo.padded_q // geo.mask_block_q - 1 if ragged_q else None,
    )


def _forward_padded(
    q: jax.Array, k: jax.Array, v: jax.Array, arrays: MaskArrays, static: _Static
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(out (B,Sq,Hq,D), lse (B,Hq,Sq), padded lse for the backward)."""
    geo = _Geometry.of(q, k, arrays)
    lo, hi = _intervals(arrays, geo)
    out, lse = forward(
        _pad_seq_dim(q, geo.padded_q, geo.padded_dim),
        _pad_seq_dim(k, geo.padded_k, geo.padded_dim),
        _pad_seq_dim(v, geo.padded_k, geo.padded_dim),
        lo,
        hi,
        _kv_lists(arrays, geo),
        scale=static.scale,
        config=static.config,
        mask_block_q=geo.mask_block_q,
        mask_block_k=geo.mask_block_k,
        interpret=static.interpret,
    )
    return out[:, : geo.seq_q, :, : geo.head_dim], lse[:, :, : geo.seq_q], lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(
    q: jax.Array, k: jax.Array, v: jax.Array, arrays: MaskArrays, static: _Static
) -> tuple[jax.Array, jax.Array]:
    out, lse, _ = _forward_padded(q, k, v, arrays, static)
    return out, lse


def _attention_fwd(
    q: jax.Array, k: jax.Array, v: jax.Array, arrays: MaskArrays, static: _Static
) -> tuple[tuple[jax.Array, jax.Array], tuple]:
    out, lse, lse_padded = _forward_padded(q, k, v, arrays, static)
    return (out, lse), (q, k, v, arrays, out, lse_padded)


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
    geo = _Geometry.of(q, k, arrays)
    d_out = d_out.astype(q.dtype)
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32)
    ) - d_lse.astype(jnp.float32)
    delta = pad_axis(delta, 2, geo.padded_q)
    qp = _pad_seq_dim(q, geo.padded_q, geo.padded_dim)
    kp = _pad_seq_dim(k, geo.padded_k, geo.padded_dim)
    vp = _pad_seq_dim(v, geo.padded_k, geo.padded_dim)
    dop = _pad_seq_dim(d_out, geo.padded_q, geo.padded_dim)
    lo, hi = _intervals(arrays, geo)
    common = dict(
        scale=static.scale,
        config=static.config,
        mask_block_q=geo.mask_block_q,
        mask_block_k=geo.mask_block_k,
        interpret=static.interpret,
    )
    q_lists = _q_lists(arrays, geo)
    if static.config.fused_bwd:
        dq, dk, dv = backward_fused(qp, kp, vp, dop, lse, delta, lo, hi, q_lists, **common)
    else:
        dq = backward_dq(qp, kp, vp, dop, lse, delta, lo, hi, _kv_lists(arrays, geo), **common)
        dk, dv = backward_dkv(qp, kp, vp, dop, lse, delta, lo, hi, q_lists, **common)
    sq, sk, d = geo.seq_q, geo.seq_k, geo.head_dim
    return dq[:, :sq, :, :d], dk[:, :sk, :, :d], dv[:, :sk, :, :d]


def _attention_bwd(static: _Static, res: tuple, cotangents: tuple) -> tuple:
    return (*_backward(*res, *cotangents, static), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.jit, static_argnames=("static",))
def _attention_jit(
    q: jax.Array, k: jax.Array, v: jax.Array, arrays: MaskArrays, static: _Static
) -> tuple[jax.Array, jax.Array]:
    return _attention(q, k, v, arrays, static)


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
    padded_q = _Geometry.of(q, k, arrays).padded_q
    lse_padded = pad_axis(lse.astype(jnp.float32), 2, padded_q, value=-jnp.inf)
    return _backward(q, k, v, arrays, out, lse_padded, d_out, d_lse, static)


def _check(q: jax.Array, k: jax.Array, v: jax.Array, arrays: MaskArrays) -> None:
    check_attention_shapes(q.shape, k.shape, v.shape, arrays)
    d = q.shape[3]
    if not 16 <= d <= 256:
        raise ValueError(f"head dim {d} is outside the supported range [16, 256]")
    if jnp.ndim(arrays.lo) != 2 or jnp.ndim(arrays.kv_index) != 2:
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
