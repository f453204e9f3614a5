"""The custom VJP every flash kernel of jax_attn shares: a forward that returns what its
backward needs, and a backward from those residuals, so no kernel recomputes its forward and the
mask arrays and compile-time settings get no gradient."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

# forward(q, k, v, arrays, static) -> (out, lse, the lse the backward takes)
Forward = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
# backward(q, k, v, arrays, out, saved_lse, d_out, d_lse, static) -> (dq, dk, dv)
Backward = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def flash_vjp(forward: Forward, backward: Backward) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """jit((q, k, v, arrays, static) -> (out, lse)), differentiable in q, k and v through
    `backward`; `static` (hashable) is a static argument, passed through untouched."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def attention(q, k, v, arrays, static: Any):
        out, lse, _ = forward(q, k, v, arrays, static)
        return out, lse

    def attention_fwd(q, k, v, arrays, static: Any):
        out, lse, saved_lse = forward(q, k, v, arrays, static)
        return (out, lse), (q, k, v, arrays, out, saved_lse)

    def attention_bwd(static: Any, residuals: tuple, cotangents: tuple) -> tuple:
        d_out, d_lse = cotangents
        return (*backward(*residuals, d_out, d_lse, static), None)

    attention.defvjp(attention_fwd, attention_bwd)

    @functools.partial(jax.jit, static_argnames=("static",))
    def jitted(q, k, v, arrays, static: Any) -> tuple[jax.Array, jax.Array]:
        return attention(q, k, v, arrays, static)

    return jitted
