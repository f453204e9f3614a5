"""Warp-specialised dQ kernel (KernelConfig.dq_warpgroups=2), the layout of jax's and tokamax's
Mosaic GPU dQ kernels with our mask walk.

One CTA owns 128 rows of one (q head, batch row), a whole 128-row mask q tile (or a part of a
larger one, walking that mask tile's key-tile list): consumer warpgroups 0 and 1
each own 64 of its rows (their q, dO, LSE, delta, row intervals and dQ accumulator), and
warpgroup 2 is the producer, TMA-loading the K and V tiles of every listed key tile into a ring
of SMEM slots that both consumers read (ws_ring.py). So K and V are loaded once per 128 rows
instead of once per 64, and no consumer issues a copy inside the walk. With
KernelConfig.bwd_pingpong the consumers take turns on the tensor cores (ws_ring.take_turns).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .bwd_steps import (
    Kernel,
    broadcast,
    dq_step,
    launch,
    row_vector,
    store_tile,
    tile_smem,
    tile_start,
)
from .config import CONSUMER_WARPGROUPS, PRODUCER
from .ws_ring import consume, produce, take_turns

ROW_COPIES = 6  # q, dO, LSE, delta, lo, hi of a consumer's rows: its row barrier's arrivals


def _kernel(*refs: Any, kern: Kernel) -> None:
    """refs: q, k, v, dO, LSE, delta, lo, hi, the three tile-list arrays, dQ, then the scratch."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, lo_ref, hi_ref = refs[:8]
    index_ref, n_partial_ref, count_ref, dq_ref = refs[8:12]
    q_s, do_s, lse_s, delta_s, lo_s, hi_s, k_s, v_s, row_bar, ready, free = refs[12:23]
    sched = refs[23] if kern.pingpong else None  # the consumers' 2-arrival ping-pong barrier
    bq, bk, stages = kern.block_q, kern.block_k, kern.stages
    part, head, batch = (lax.axis_index(n) for n in ("tiles", "heads", "batch"))
    wg = lax.axis_index("wg")
    cta_rows = CONSUMER_WARPGROUPS * bq
    # the mask q tile whose key-tile list this CTA walks (its rows may be part of it)
    tile = lax.div(part, jnp.int32(kern.mask_block_q // cta_rows))
    per_tile = kern.mask_block_k // bk
    total = count_ref[tile] * per_tile
    n_masked = n_partial_ref[tile] * per_tile

    @pl.when(wg < CONSUMER_WARPGROUPS)
    def _consumer() -> None:
        plgpu.set_max_registers(kern.registers[0], action="increase")
        rows = pl.ds(pl.multiple_of(part * cta_rows + wg * bq, bq), bq)
        mine = tuple(x.at[wg] for x in (q_s, do_s, lse_s, delta_s, lo_s, hi_s))
        q_own, do_own, lse_own, delta_own, lo_own, hi_own = mine
        bar = row_bar.at[wg]
        for src, dst in zip((q_ref.at[batch, rows, head], do_ref.at[batch, rows, head],
                             lse_ref.at[batch, head, rows], delta_ref.at[batch, head, rows],
                             lo_ref.at[:, rows], hi_ref.at[:, rows]), mine):  # fmt: skip
            plgpu.copy_gmem_to_smem(src, dst, bar)

        def accumulate(dq_acc: Any) -> jax.Array:
            shape = (bq, bk)
            # The row vectors below are TMA destinations: read them only once their copies landed.
            plgpu.barrier_wait(bar)
            lse = broadcast(row_vector(lse_own, kern, 1), shape, 1)
            delta = broadcast(row_vector(delta_own, kern, 1), shape, 1)
            row_refs = (q_own, do_own, lo_own, hi_own, lse, delta)

            def steps(turn: Callable[[], None] | None) -> None:
                def step(n: jax.Array, slot: jax.Array, masked: bool) -> None:
                    key0 = tile_start(index_ref, tile, n, kern.mask_block_k, bk) if masked else None
                    k, v = k_s.at[slot], v_s.at[slot]
                    dq_step(kern, row_refs, k, v, key0, masked, dq_acc, turn)

                consume(total, n_masked, stages, ready, free, step)

            take_turns(sched, wg, steps)
            return dq_acc[...]

        dq = pl.run_scoped(accumulate, plgpu.ACC((bq, q_s.shape[-1]), jnp.float32))
        store_tile(q_own, dq * kern.scale, dq_ref.at[batch, rows, head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == PRODUCER)
    def _producer() -> None:
        plgpu.set_max_registers(kern.registers[1], action="decrease")
        kv_head = lax.div(head, jnp.int32(kern.group))

        def fetch(n: jax.Array, slot: jax.Array) -> None:
            keys = pl.ds(tile_start(index_ref, tile, n, kern.mask_block_k, bk), bk)
            plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_s.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_s.at[slot], ready.at[slot])

        produce(total, stages, free, fetch)


def dq_call(operands: tuple, lists: tuple, kern: Kernel, interpret: Any) -> jax.Array:
    """dQ (B, padded Sq, Hq, D) of padded operands over the per-query-tile key tile lists, one
    CTA per CONSUMER_WARPGROUPS * block_q rows."""
    q = operands[0]
    bq, bk, st, d = kern.block_q, kern.block_k, kern.stages, q.shape[-1]
    intervals = operands[6].shape[0]
    scratch = [
        tile_smem((CONSUMER_WARPGROUPS, bq, d), q.dtype),
        tile_smem((CONSUMER_WARPGROUPS, bq, d), q.dtype),
        plgpu.SMEM((CONSUMER_WARPGROUPS, bq), jnp.float32),
        plgpu.SMEM((CONSUMER_WARPGROUPS, bq), jnp.float32),
        plgpu.SMEM((CONSUMER_WARPGROUPS, intervals, bq), jnp.int32),
        plgpu.SMEM((CONSUMER_WARPGROUPS, intervals, bq), jnp.int32),
        tile_smem((st, bk, d), q.dtype),
        tile_smem((st, bk, d), q.dtype),
        plgpu.Barrier(num_arrivals=ROW_COPIES, num_barriers=CONSUMER_WARPGROUPS),
        plgpu.Barrier(num_arrivals=2, num_barriers=st),
        plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS, num_barriers=st),
    ]
    if kern.pingpong:  # the consumers' turns on the tensor cores
        scratch.append(plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS))
    grid = (q.shape[1] // (CONSUMER_WARPGROUPS * bq), q.shape[2], q.shape[0])
    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    name = "mosaic_flash_dq_ws"
    call = launch(_kernel, kern, grid, out_type, scratch, interpret, name, CONSUMER_WARPGROUPS + 1)
    return call(*operands, *lists)
