"""Time one layer's attention call (forward + backward) alone, with the train step's exact
inputs shapes, mask argument and placement, to report attention's share of the step time."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from experiments.runners import timing
from experiments.workloads.nnx_attention import AttentionBackend

from .masking import InLayout
from .placement import put_global, token_sharding


def time_attention(
    backend: AttentionBackend,
    mask_arg: Any,
    *,
    shape_q: tuple[int, int, int, int],
    heads_kv: int,
    dtype: Any,
    warmup: int,
    iters: int,
    seed: int = 0,
) -> list[float]:
    """Per-call milliseconds of a compiled vjp of the attention call (q shape (B,S,Hq,D)); under
    InLayout on inputs dispatched into the executor's layout, as the step's layers get them."""
    b, s, hq, d = shape_q
    rng = np.random.default_rng(seed)
    sharding = token_sharding(backend, s)
    place = mask_arg.executor.dispatch if isinstance(mask_arg, InLayout) else (lambda x: x)

    def draw(heads: int) -> jax.Array:
        x = rng.standard_normal((b, s, heads, d), np.float32).astype(dtype)
        return place(put_global(x, sharding))

    args = (draw(hq), draw(heads_kv), draw(heads_kv), draw(hq), mask_arg)

    def fwd_bwd(q, k, v, dout, mask):
        _, pullback = jax.vjp(lambda q_, k_, v_: backend(q_, k_, v_, mask), q, k, v)
        return pullback(dout)

    compiled = jax.jit(fwd_bwd).lower(*args).compile()
    return timing.jax_time_calls(compiled, args, warmup=warmup, iters=iters)
