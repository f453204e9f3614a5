"""Per-device building blocks of the JAX executors: local attention, its VJP against the global
softmax statistics, and the NaN-free LSE merge."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import jax_attn
from attn_masks import Mask
from jax_attn.mask_arrays import MaskArrays

from ..plan import default_local_impl

REFERENCE = "reference"


def resolve_impl(impl: str | None) -> str:
    """impl None -> our Pallas kernel on a GPU, the jnp reference elsewhere."""
    if impl is not None:
        return impl
    return default_local_impl("jax", jax.default_backend() == "gpu")


def piece_arrays(piece: Mask, impl: str, head_dim: int, dtype: Any) -> MaskArrays:
    """Host MaskArrays of one mask piece in the tiling `impl` wants."""
    return jax_attn.mask_arrays_for(impl, piece, head_dim, dtype)


def local_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, arrays: MaskArrays, impl: str, scale: float
) -> tuple[jax.Array, jax.Array]:
    """One device's attention of q (B,Sq,H,D) on a K/V block: (out in q.dtype, lse (B,H,Sq) f32)."""
    out, lse = jax_attn.attention(q, k, v, arrays, impl=impl, scale=scale, return_lse=True)
    return out, lse.astype(jnp.float32)


def _heads_last(w: jax.Array) -> jax.Array:
    """(B,H,S) -> (B,S,H,1), to scale (B,S,H,D) rows."""
    return jnp.swapaxes(w, 1, 2)[..., None]


def merge(
    out: jax.Array | None, lse: jax.Array | None, out_t: jax.Array, lse_t: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Combine two partial softmaxes in fp32; rows empty in both stay (0, -inf), never NaN."""
    out_t = out_t.astype(jnp.float32)
    if out is None:
        return out_t, lse_t
    m = jnp.maximum(lse, lse_t)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    a = jnp.exp(lse - m)
    b = jnp.exp(lse_t - m)
    total = a + b
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    new_lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
    new_out = out * _heads_last(a / safe) + out_t * _heads_last(b / safe)
    return new_out, new_lse


def share(lse_t: jax.Array, lse: jax.Array) -> jax.Array:
    """exp(lse_t - lse): a partial result's weight in the merged one (0 where it saw nothing)."""
    seen = jnp.isfinite(lse_t)
    return jnp.where(seen, jnp.exp(jnp.where(seen, lse_t - lse, 0.0)), 0.0)


def local_attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    arrays: MaskArrays,
    impl: str,
    scale: float,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    dlse: jax.Array,
    rowdot: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of one block's share of the merged output (out, lse), rowdot = <dout, out>.

    Block t's partial softmax is P_t = exp(S_t - lse_t), with weight w = exp(lse_t - lse) in the
    merged result, so its cotangents are dout_t = w dout and dlse_t = w (rowdot_t - rowdot + dlse),
    rowdot_t = <dout, out_t>. In the flash backward (dS = P (dP - D), D = <dO, O> - dLSE) these
    give P_t w = exp(S_t - lse) and D_t = w (rowdot - dlse): the merged statistics. So an impl
    with a backward from residuals (jax_attn.has_residual_bwd) gets (out, lse, dout, dlse) as is,
    with no forward rerun and nothing saved per block; the others rerun the block's forward under
    jax.vjp for out_t, lse_t and pull back (dout_t, dlse_t).
    """
    if jax_attn.has_residual_bwd(impl):
        return jax_attn.attention_bwd(q, k, v, arrays, out, lse, dout, dlse, impl=impl, scale=scale)

    def f(q_, k_, v_):
        return local_attention(q_, k_, v_, arrays, impl, scale)

    (out_t, lse_t), pullback = jax.vjp(f, q, k, v)
    w = share(lse_t, lse)
    dout32 = dout.astype(jnp.float32)
    rowdot_t = jnp.einsum("bshd,bshd->bhs", dout32, out_t.astype(jnp.float32))
    dlse_t = w * (rowdot_t - rowdot + dlse)
    dout_t = (dout32 * _heads_last(w)).astype(out_t.dtype)
    return pullback((dout_t, dlse_t.astype(lse_t.dtype)))
