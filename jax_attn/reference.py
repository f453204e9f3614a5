"""Plain-jnp attention on a materialised mask: the always-available JAX impl ("reference").

Differentiable by ordinary autodiff; rows that see no key give output 0, LSE -inf and zero
gradients (no NaN), which context parallelism relies on when a step sees nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .mask_arrays import MaskArrays, dense_from_intervals


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    arrays: MaskArrays,
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """(out (B,Sq,Hq,D) in q's dtype, lse (B,Hq,Sq) float32) computed in float32 or wider."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    acc = jnp.promote_types(q.dtype, jnp.float32)
    visible = dense_from_intervals(jnp.asarray(arrays.lo), jnp.asarray(arrays.hi), k.shape[1])
    qg = q.astype(acc).reshape(b, sq, hkv, group, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(acc)) * scale
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.where(visible, jnp.exp(s - m), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    nonempty = denom > 0
    p = e / jnp.where(nonempty, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(acc)).reshape(b, sq, hq, d)
    lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, denom, 1.0)), -jnp.inf)
    lse = lse[..., 0].reshape(b, hq, sq).astype(jnp.float32)
    return out.astype(q.dtype), lse
