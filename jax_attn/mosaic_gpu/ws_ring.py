"""The ring protocol of the warp-specialised backward kernels: two consumer warpgroups read each
step's operands from a ring of SMEM slots that a producer warpgroup fills by TMA.

Slot n mod stages holds step n. `ready[slot]` completes when the slot's copies landed; each
consumer releases a slot on `free[slot]` (one arrival per consumer) once the matmuls of its step
on it are done, which it waits at the start of its next step; the producer refills a slot only
after both released it, and at the end observes the release phases it has not waited yet.
The consumers' turns on the tensor cores (take_turns) serve the forward kernel too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

T = TypeVar("T")


def consume(
    total: jax.Array,
    n_masked: jax.Array,
    stages: int,
    ready: Any,
    free: Any,
    step: Callable[[jax.Array, jax.Array, bool], None],
) -> None:
    """A consumer's walk: step(n, slot, masked) for n < total (the first n_masked masked), each
    once its slot is ready, the previous step's slot released once its matmuls are done."""
    period = jnp.int32(stages)

    def body(masked: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
        def run(n: jax.Array, carry: jax.Array) -> jax.Array:
            plgpu.wgmma_wait(0)  # step n - 1's matmuls were the last to read its slot
            previous = lax.rem(n + jnp.int32(stages - 1), period)
            pl.when(n > 0)(lambda: plgpu.barrier_arrive(free.at[previous]))
            slot = lax.rem(n, period)
            plgpu.barrier_wait(ready.at[slot])
            step(n, slot, masked)
            return carry

        return run

    zero = jnp.int32(0)
    lax.fori_loop(zero, n_masked, body(True), zero)
    lax.fori_loop(n_masked, total, body(False), zero)
    plgpu.wgmma_wait(0)
    last = lax.rem(total + jnp.int32(stages - 1), period)
    pl.when(total > 0)(lambda: plgpu.barrier_arrive(free.at[last]))


def take_turn(sched: Any) -> None:
    """Meet the other consumer warpgroup at the 2-arrival barrier `sched` (one turn)."""
    plgpu.barrier_arrive(sched)
    plgpu.barrier_wait(sched)


def take_turns(
    sched: Any | None, wg: int | jax.Array, walk: Callable[[Callable[[], None] | None], T]
) -> T:
    """walk(turn)'s result: with a 2-arrival barrier `sched`, turn() meets the other consumer
    there (the consumers call it twice a step: once their first matmuls are issued, and before
    their last ones), consumer 1 starting one turn behind and consumer 0 making that turn up at
    the end, so one's matmuls run while the other computes (FlashAttention-3's ping-pong) and
    both observe every phase; without it, walk(None). A ring of operands the consumers share
    needs two stages or more: with one, a consumer waiting its turn would hold the slot the
    other needs."""
    if sched is None:
        return walk(None)
    turn = functools.partial(take_turn, sched)
    pl.when(wg == 1)(turn)
    out = walk(turn)
    pl.when(wg == 0)(turn)
    return out


def produce(
    total: jax.Array, stages: int, free: Any, fetch: Callable[[jax.Array, jax.Array], None]
) -> None:
    """The producer's walk: fetch(n, slot) for n < total once both consumers released the
    slot's previous step, then the release phases not yet observed."""

    def issue(n: jax.Array, _: Any) -> None:
        slot = lax.rem(n, jnp.int32(stages))
        pl.when(n >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
        fetch(n, slot)

    lax.fori_loop(jnp.int32(0), total, issue, None)
    # Observe every release phase before the barriers are freed.
    lax.fori_loop(jnp.maximum(total - stages, 0), total, drain(free), None)


def drain(barriers: Any) -> Callable[[jax.Array, Any], None]:
    """fori_loop body waiting barrier n mod len(barriers): observes step n's phase."""

    def wait(n: jax.Array, _: Any) -> None:
        plgpu.barrier_wait(barriers.at[lax.rem(n, jnp.int32(barriers.shape[0]))])

    return wait
