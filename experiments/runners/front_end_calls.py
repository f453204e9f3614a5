"""One bf16 attention call through either framework's front end, as a no-argument function that
returns the results (out, and dq, dk, dv with grads) once the GPU has finished them (JAX:
block_until_ready; torch: synchronize), for the tools that profile or time the shared Triton
kernel from both front ends (experiments/profile_call.py, experiments/front_ends_ab.py).
CUDA only."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

FRONT_ENDS = ("torch", "jax")


def call(
    front_end: str, mask, arrays: list[np.ndarray], *, impl: str = "triton", grads: bool
) -> Callable[[], dict]:
    """`front_end`'s call of `impl` on q, k, v (and dout when grads) given as float32 numpy:
    the forward, or forward+backward with dout as the output's cotangent."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end must be one of {FRONT_ENDS}, got {front_end!r}")
    return (_jax if front_end == "jax" else _torch)(mask, arrays, impl, grads)


def _jax(mask, arrays: list[np.ndarray], impl: str, grads: bool) -> Callable[[], dict]:
    import jax
    import jax.numpy as jnp

    import jax_attn

    q, k, v, dout = (jnp.asarray(a, jnp.bfloat16) for a in arrays)

    def attend(q, k, v):
        return jax_attn.attention(q, k, v, mask, impl=impl)

    if not grads:
        forward = jax.jit(attend)
        return lambda: {"out": jax.block_until_ready(forward(q, k, v))}

    @jax.jit
    def forward_backward(q, k, v, dout):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(dout)

    def run() -> dict:
        out, (dq, dk, dv) = jax.block_until_ready(forward_backward(q, k, v, dout))
        return {"out": out, "dq": dq, "dk": dk, "dv": dv}

    return run


def _torch(mask, arrays: list[np.ndarray], impl: str, grads: bool) -> Callable[[], dict]:
    import torch

    import torch_attn

    q, k, v, dout = (torch.tensor(a, device="cuda").bfloat16() for a in arrays)
    if grads:
        for x in (q, k, v):
            x.requires_grad_(True)

    def run() -> dict:
        out = torch_attn.attention(q, k, v, mask, impl=impl)
        got = {"out": out}
        if grads:
            got.update(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout)))
        torch.cuda.synchronize()
        return got

    return run
