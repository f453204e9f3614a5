"""Time one layer's attention call (forward + backward) alone, with the train step's exact
input shapes, placement and the mask arguments of sampled steps, to report attention's share of
those steps' time (the masks' documents, and so attention's cost, change from step to step)."""

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
    mask_args: list[Any],
    *,
    shape_q: tuple[int, int, int, int],
    heads_kv: int,
    dtype: Any,
    warmup: int,
    iters: int,
    seed: int = 0,
) -> list[list[float]]:
    """Per-call milliseconds of the attention call's vjp (q shape (B,S,Hq,D)) on each mask
    argument in turn (one list per mask, one jit for all); under InLayout on inputs dispatched
    into the executor's layout, as the step's layers get them."""
    b, s, hq, d = shape_q
    rng = np.random.default_rng(seed)
    sharding = token_sharding(backend, s)
    heads = (hq, heads_kv, heads_kv, hq)  # q, k, v, and the output's cotangent
    host = [rng.standard_normal((b, s, h, d), np.float32).astype(dtype) for h in heads]

    def fwd_bwd(q, k, v, dout, mask):
        _, pullback = jax.vjp(lambda q_, k_, v_: backend(q_, k_, v_, mask), q, k, v)
        return pullback(dout)

    fn = jax.jit(fwd_bwd)
    times = []
    for mask_arg in mask_args:
        place = mask_arg.executor.dispatch if isinstance(mask_arg, InLayout) else (lambda x: x)
        args = (*(place(put_global(x, sharding)) for x in host), mask_arg)
        times.append(timing.jax_time_calls(fn, args, warmup=max(warmup, 1), iters=iters))
    return times
