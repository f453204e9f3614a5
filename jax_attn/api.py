"""The public entry points: attention(), supports(), mask_arrays_for() over every impl."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from attn_masks import Mask

from .adapters import ADAPTERS, Unsupported, make_request
from .adapters.common import check_finite_inputs, host_arrays
from .mask_arrays import MaskArrays

IMPLS = tuple(ADAPTERS)  # "reference", "pallas", "mosaic", "xla", "cudnn", ..., "triton"


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid impls: {', '.join(IMPLS)}")


def supports(
    impl: str,
    mask: Mask | MaskArrays,
    *,
    dtype: Any = None,
    head_dim: int | None = None,
    heads_q: int | None = None,
    heads_kv: int | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    mode: str = "fwd_bwd",
) -> bool | str:
    """True if `impl` computes `mask` exactly for such inputs, else the reason it cannot.

    Unknown details (None) are not held against the impl. backend defaults to JAX's default
    backend; device limits (compute capability) are checked only for the local GPU. mode is
    fwd, bwd or fwd_bwd: with the default, True also promises a working backward.
    """
    _check_impl(impl)
    req = make_request(
        mask,
        dtype=dtype,
        head_dim=head_dim,
        heads_q=heads_q,
        heads_kv=heads_kv,
        backend=backend,
        return_lse=return_lse,
        mode=mode,
    )
    reason = ADAPTERS[impl].check(req)
    return True if reason is None else reason


def mask_arrays_for(impl: str, mask: Mask, head_dim: int, dtype: Any) -> MaskArrays:
    """Host-side MaskArrays of `mask` with the tiles `impl` uses (cached per mask and tiles)."""
    _check_impl(impl)
    if not isinstance(mask, Mask):
        raise ValueError(f"mask must be an attn_masks.Mask, got {type(mask).__name__}")
    return host_arrays(mask, ADAPTERS[impl].tiles(int(head_dim), jnp.dtype(dtype)))


def _check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(
            f"scale must be a positive Python number (it is static), got {type(scale).__name__}"
        )
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be positive and finite, got {scale}")
    return float(scale)


def _check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, mask: Any) -> None:
    if not isinstance(mask, (Mask, MaskArrays)):
        raise ValueError(
            f"mask must be an attn_masks.Mask or a jax_attn.MaskArrays, got {type(mask).__name__}"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 (B, S, H, D), got shape {tuple(x.shape)}")
        if 0 in x.shape:
            raise ValueError(f"{name} has an empty dimension: shape {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating array, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k and v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head dims differ: q has {q.shape[3]}, k and v have {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads Hq={q.shape[2]} must be a multiple of key/value heads Hkv={k.shape[2]}"
        )
    if q.shape[1] != mask.seqlen_q or k.shape[1] != mask.seqlen_k:
        raise ValueError(
            f"sequence lengths Sq={q.shape[1]}, Sk={k.shape[1]} do not match the mask "
            f"({mask.seqlen_q} x {mask.seqlen_k})"
        )
    if isinstance(mask, MaskArrays) and mask.lo.shape[-2] != q.shape[1]:
        raise ValueError(
            f"MaskArrays intervals cover {mask.lo.shape[-2]} query rows, but Sq={q.shape[1]}"
        )


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: Mask | MaskArrays,
    *,
    impl: str = "pallas",
    scale: float | None = None,
    return_lse: bool = False,
    check_finite: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Masked attention: q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) -> out (B,Sq,Hq,D) [, lse (B,Hq,Sq)].

    lse is float32 natural log, -inf on rows that see no key (their output is 0). Differentiable.
    Raises Unsupported (a ValueError) before any work when `impl` cannot compute the input.
    NaN inputs give NaN on the rows that read them (docs/api.md, "Non-finite inputs").
    check_finite=True first raises ValueError naming each of q, k, v that holds NaN or inf and
    how many; under jax.jit it is a jax.experimental.checkify check (wrap the jitted function in
    checkify.checkify and call err.throw(); without that, jit refuses to compile it).
    """
    _check_impl(impl)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    _check_inputs(q, k, v, mask)
    scale = _check_scale(scale, q.shape[3])
    reason = supports(
        impl,
        mask,
        dtype=q.dtype,
        head_dim=q.shape[3],
        heads_q=q.shape[2],
        heads_kv=k.shape[2],
        return_lse=bool(return_lse),
        mode="fwd",
    )
    if reason is not True:
        raise Unsupported(reason)
    if check_finite:
        check_finite_inputs(q, k, v)
    out, lse = ADAPTERS[impl].run(q, k, v, mask, scale=scale, return_lse=bool(return_lse))
    return (out, lse) if return_lse else out


def has_residual_bwd(impl: str) -> bool:
    """True if attention_bwd(impl=impl) runs a backward from the residuals (no forward rerun).

    Such a backward depends on (out, lse, dout, dlse) only through lse and
    delta = rowsum(dout * out) - dlse, so it also accepts the merged out/lse of a softmax split
    over key blocks (ring attention) and returns this block's share of the merged gradients.
    """
    _check_impl(impl)
    return ADAPTERS[impl].backward is not None


def _check_residuals(q: jax.Array, out: Any, lse: Any, dout: Any, dlse: Any) -> None:
    b, sq, hq, _ = q.shape
    for name, x, shape in (
        ("out", out, q.shape),
        ("dout", dout, q.shape),
        ("lse", lse, (b, hq, sq)),
        ("dlse", dlse, (b, hq, sq)),
    ):
        if x is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def attention_bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: Mask | MaskArrays,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    dlse: jax.Array | None = None,
    *,
    impl: str = "pallas",
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of attention(q, k, v, mask, impl, scale, return_lse=True) = (out, lse) for the
    cotangents (dout, dlse) (None: zero).

    Impls with has_residual_bwd(impl) compute them from out and lse directly; the others
    recompute the forward under jax.vjp (out and lse are then only shape-checked).
    """
    _check_impl(impl)
    q, k, v, out, lse, dout = (jnp.asarray(x) for x in (q, k, v, out, lse, dout))
    _check_inputs(q, k, v, mask)
    _check_residuals(q, out, lse, dout, dlse)
    scale = _check_scale(scale, q.shape[3])
    reason = supports(
        impl,
        mask,
        dtype=q.dtype,
        head_dim=q.shape[3],
        heads_q=q.shape[2],
        heads_kv=k.shape[2],
        return_lse=True,
        mode="bwd",
    )
    if reason is not True:
        raise Unsupported(reason)
    if dlse is None:
        dlse = jnp.zeros(lse.shape, jnp.float32)
    backward = ADAPTERS[impl].backward
    if backward is not None:
        return backward(q, k, v, mask, out, lse, dout, dlse, scale=scale)

    def f(q_, k_, v_):
        return ADAPTERS[impl].run(q_, k_, v_, mask, scale=scale, return_lse=True)

    (out_, lse_), pullback = jax.vjp(f, q, k, v)
    return pullback((dout.astype(out_.dtype), jnp.asarray(dlse, lse_.dtype)))
