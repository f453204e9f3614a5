"""Ring and double-ring attention inside shard_map: K/V blocks travel by lax.ppermute, partial
results merge by LSE, and a custom VJP sends dK/dV around the ring behind their K/V blocks.

The kept steps of the plan are unrolled: each transfer for the next block is issued before the
current block is computed, so XLA can overlap it; the double ring prefetches the next window's
block at the start of an outer step, hiding it behind the whole inner ring (LoongTrain).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp

from jax_attn.mask_arrays import MaskArrays

from ..schedules import StepIndex, group_by_outer, inner_perm, outer_perm
from ._local import local_attention, local_attention_vjp, merge

Tree = Any  # a pytree of arrays (a K/V pair, or its dK/dV)


def step_arrays(arrays: MaskArrays, t: int) -> MaskArrays:
    """The MaskArrays of kept step t from a stack with a leading step axis."""
    return jax.tree.map(lambda x: x[t], arrays)


class _Mover:
    """ppermute along the inner (within a window) or outer (across windows) ring."""

    def __init__(self, ring_size: int, num_windows: int, axis: str):
        self.ring_size, self.num_windows, self.axis = ring_size, num_windows, axis
        self.window = ring_size // num_windows

    def inner(self, x: Tree, shift: int) -> Tree:
        if shift % self.window == 0:
            return x
        perm = inner_perm(self.ring_size, self.num_windows, shift)
        return jax.lax.ppermute(x, self.axis, perm)

    def outer(self, x: Tree, shift: int) -> Tree:
        if shift % self.num_windows == 0:
            return x
        perm = outer_perm(self.ring_size, self.num_windows, shift)
        return jax.lax.ppermute(x, self.axis, perm)


def _walk(
    kv: Tree, steps: tuple[StepIndex, ...], mover: _Mover
) -> Iterator[tuple[int, int, int | None, Tree]]:
    """Yield (step index, group index, inner shift to the next block or None, K/V block).

    The next outer block is requested when a group starts and the next inner block before the
    current one is handed out, so transfers are in flight while the caller computes.
    """
    groups = group_by_outer(steps)
    outer = mover.outer(kv, groups[0][0])
    t = 0
    for g, (o, inners) in enumerate(groups):
        next_outer = mover.outer(outer, groups[g + 1][0] - o) if g + 1 < len(groups) else None
        cur = mover.inner(outer, inners[0])
        for j, i in enumerate(inners):
            shift = inners[j + 1] - i if j + 1 < len(inners) else None
            nxt = None if shift is None else mover.inner(cur, shift)
            yield t, g, shift, cur
            t += 1
            cur = nxt
        outer = next_outer


def _add(a: Tree | None, b: Tree) -> Tree:
    return b if a is None else jax.tree.map(jnp.add, a, b)


def forward_step(
    q: jax.Array,
    kb: jax.Array,
    vb: jax.Array,
    arrays: MaskArrays,
    impl: str,
    scale: float,
    out: jax.Array | None,
    lse: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """One kept step: this block's attention merged into the running (out, lse), None at first."""
    out_t, lse_t = local_attention(q, kb, vb, arrays, impl, scale)
    return merge(out, lse, out_t, lse_t)


def backward_start(q: jax.Array, out: jax.Array, dout: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(rowdot = <dout, out> per row, zero fp32 dq): what every backward step shares."""
    rowdot = jnp.einsum("bshd,bshd->bhs", dout.astype(jnp.float32), out.astype(jnp.float32))
    return rowdot, jnp.zeros(q.shape, jnp.float32)


def backward_step(
    q: jax.Array,
    kb: jax.Array,
    vb: jax.Array,
    arrays: MaskArrays,
    impl: str,
    scale: float,
    residuals: tuple[jax.Array, ...],
    dq: jax.Array,
    dkv: Tree | None,
) -> tuple[jax.Array, Tree]:
    """One kept step's gradients: dq accumulated in fp32, this block's dK/dV added to the
    accumulator travelling with it (None: the step opens an outer step).

    residuals = (out, lse, dout, dlse, rowdot) of the merged forward.
    """
    dq_t, dk_t, dv_t = local_attention_vjp(q, kb, vb, arrays, impl, scale, *residuals)
    acc = jnp.promote_types(kb.dtype, jnp.float32)
    return dq + dq_t.astype(jnp.float32), _add(dkv, (dk_t.astype(acc), dv_t.astype(acc)))


@cache
def make_ring(
    steps: tuple[StepIndex, ...],
    ring_size: int,
    num_windows: int,
    impl: str,
    scale: float,
    axis: str,
) -> Callable[[jax.Array, jax.Array, jax.Array, MaskArrays], tuple[jax.Array, jax.Array]]:
    """A differentiable f(q, k, v, arrays) -> (out, lse) over the ring mesh axis `axis`.

    arrays has a leading axis over the kept steps. Forward keeps one K/V block in flight (plus
    the prefetched outer block); backward recomputes the K/V chain and carries dK/dV (fp32) with
    it, so memory does not grow with the ring size. Each step's gradients come from the merged
    (out, lse) alone where the impl has a backward from residuals (pallas), else by rerunning
    that step's forward under jax.vjp (local_attention_vjp).
    """
    mover = _Mover(ring_size, num_windows, axis)
    groups = group_by_outer(steps)

    def forward(q, k, v, arrays):
        out = lse = None
        for t, _, _, (kb, vb) in _walk((k, v), steps, mover):
            out, lse = forward_step(q, kb, vb, step_arrays(arrays, t), impl, scale, out, lse)
        return out.astype(q.dtype), lse

    @jax.custom_vjp
    def ring(q, k, v, arrays):
        return forward(q, k, v, arrays)

    def ring_fwd(q, k, v, arrays):
        out, lse = forward(q, k, v, arrays)
        return (out, lse), (q, k, v, arrays, out, lse)

    def ring_bwd(res, cts):
        q, k, v, arrays, out, lse = res
        dout, dlse = cts
        rowdot, dq = backward_start(q, out, dout)
        residuals = (out, lse, dout, dlse, rowdot)
        dkv = received = total = None
        for t, g, shift, (kb, vb) in _walk((k, v), steps, mover):
            if dkv is None and g > 0:
                # the previous group's dK/dV crosses windows while this group computes
                received = mover.outer(total, groups[g][0] - groups[g - 1][0])
            step = step_arrays(arrays, t)
            dq, dkv = backward_step(q, kb, vb, step, impl, scale, residuals, dq, dkv)
            if shift is not None:
                dkv = mover.inner(dkv, shift)
                continue
            dkv = mover.inner(dkv, -groups[g][1][-1])
            total = _add(received, dkv)
            dkv = received = None
        dk, dv = mover.outer(total, -groups[-1][0])
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None

    ring.defvjp(ring_fwd, ring_bwd)
    return ring
