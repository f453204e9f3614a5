"""Collectives in compiled XLA HLO text, for the tests that check what a CP program moves, and
the program of one CP attention call on dispatched arrays they compare against."""

from __future__ import annotations

import re
from collections import Counter

OPS = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
_OP_LINE = rf"^\s*(?:ROOT )?%\S+ = (.*?) ({OPS})(?:-start)?\("


def collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(op, result dims) of every all-gather / all-reduce / all-to-all / collective-permute /
    reduce-scatter (each array of a tuple result separately)."""
    found = []
    for shapes, op in re.findall(_OP_LINE, hlo, re.M):
        for dims in re.findall(r"(?:f32|bf16|f16|s32)\[([\d,]*)\]", shapes):
            found.append((op, tuple(int(x) for x in dims.split(",") if x)))
    return found


def op_counts(hlo: str) -> Counter:
    """How many collectives of each kind the program runs (a tuple result counts once)."""
    return Counter(op for _, op in re.findall(_OP_LINE, hlo, re.M))


def sharded_fwd_bwd_hlo(ex, shape_q: tuple, shape_kv: tuple, options: dict | None = None) -> str:
    """Compiled HLO of one forward and backward of a CP executor's attention on dispatched
    arrays, alone (shapes: global (B, S, H, D); inputs distinct, so XLA cannot share their
    collectives)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)

    def draw(shape: tuple) -> jax.Array:
        return ex.dispatch(jnp.asarray(rng.standard_normal(shape, np.float32)))

    def fwd_bwd(q, k, v, dout):
        out, pullback = jax.vjp(ex.sharded, q, k, v)
        return out, *pullback(dout)

    args = (draw(shape_q), draw(shape_kv), draw(shape_kv), draw(shape_q))
    return jax.jit(fwd_bwd).lower(*args).compile(options).as_text()
