"""Warp-specialised dK/dV kernel (KernelConfig.bwd_warpgroups=2), FlashAttention-3's layout.

One CTA owns 128 keys of one (kv head, batch row), a whole 128-key mask tile or half of a
256-key one (walking that mask tile's q-tile list): consumer warpgroups 0 and 1 each own 64 of
its keys (their K, V and dK, dV accumulators), and warpgroup 2 is the producer, TMA-loading the
q rows, dO, LSE, delta and row intervals of every step into a ring of SMEM slots that both
consumers read. So the q side is loaded once per 128 keys instead of once per 64, and no
consumer issues a copy. A consumer releases a slot once its matmuls on it are done (waited at
the start of its next step); the producer refills a slot when both released it.
Fused (fused_bwd), the CTA adds its 128 keys' share of each step's dQ once: both consumers write
their dS^T to a shared, double-buffered SMEM tile, meet at a barrier, and each computes
dS K for its slice of the head dim (the whole head dim by consumer 0 when D=64) and adds it to
the fp32 dQ by TMA reduce-add, so each step reduces block_q x D fp32 values into L2 once. The
dQ matmul goes between dV's and dK's; at D=64 dK's runs while consumer 0 stages and adds dQ,
at D=128 dQ is read once dK's is done too (_add_dq_shared says why).
Ping-pong (KernelConfig.bwd_pingpong): the consumers meet at a 2-arrival barrier once their S^T
and dP^T are issued and again before dV is, consumer 1 starting half a step behind, so one's
matmuls run while the other computes its softmax (the forward's and FlashAttention-3's order).
Head split (KernelConfig.dkv_head_split = s): s CTAs per (128 keys, kv head), each walking
group / s of the GQA group's q heads into its own fp32 partial dK, dV (staged through an fp32
SMEM tile), summed after the kernel; so a key tile that every row sees (share_question's
question) is no longer one CTA's walk of group x its q tiles, the grid's critical path.
Paired walks (KernelConfig.dkv_paired_walks): CTA p walks 128-key tile p, its unmasked q tiles
last first, then tile N - 1 - p in order (key_tiles), reloading K and V in between; on causal
masks the resident CTAs then move on two fronts of q rows, one per walk, instead of each at
its own diagonal, so they share q, dO and dQ tiles in L2 as on full.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .bwd_steps import (
    QUERY_COPIES,
    WGMMA_ROWS,
    Kernel,
    QueryTiles,
    accumulate_dkv,
    dkv_step,
    fetch_queries,
    launch_dkv,
    query_ring,
    tile_smem,
)
from .config import CONSUMER_WARPGROUPS, PRODUCER
from .ws_ring import consume, drain, produce, take_turns

INPUTS = 11  # q, k, v, dO, LSE, delta, lo, hi and the three tile-list arrays
DS_BUFFERS = 2  # the fused dQ's shared dS^T tiles: step n writes buffer n mod 2


def _kernel(*refs: Any, kern: Kernel) -> None:
    """refs: the 11 inputs, [the fp32 dQ Ref when fused], dK, dV, then the scratch."""
    inputs, refs = refs[:INPUTS], refs[INPUTS:]
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, lo_ref, hi_ref = inputs[:8]
    tile_lists = inputs[8:]  # the key tiles' q-tile lists: index, n_partial, count
    dq_ref, refs = (refs[0], refs[1:]) if kern.fused else (None, refs)
    dk_ref, dv_ref, k_s, v_s, *ring = refs[:10]
    kv_bar, ready, free = refs[10:13]
    shared_dq = refs[13:] if kern.fused else None
    stage = refs[13] if kern.head_split > 1 else None  # (consumers, keys, D) fp32 partials
    sched = refs[-1] if kern.pingpong else None  # the consumers' 2-arrival ping-pong barrier
    bq, bk, stages = kern.block_q, kern.block_k, kern.stages
    tile, grid_head, batch = (lax.axis_index(n) for n in ("tiles", "heads", "batch"))
    wg = lax.axis_index("wg")
    cta_keys = CONSUMER_WARPGROUPS * bk
    kv_head = lax.div(grid_head, jnp.int32(kern.head_split))  # grid heads: (kv head, share)
    per_mask_tile = jnp.int32(kern.mask_block_k // cta_keys)

    def walk_of(key_tile: jax.Array, descending: bool) -> QueryTiles:
        outer = lax.div(key_tile, per_mask_tile)
        return QueryTiles.of(kern, tile_lists, outer, grid_head, descending)

    walks = [
        (key_tile, walk_of(key_tile, descending), present)
        for key_tile, descending, present in key_tiles(kern, tile, k_ref.shape[1] // cta_keys)
    ]

    def each_walk(run: Callable[[jax.Array, QueryTiles], None]) -> None:
        """run(key tile, walk) for each of the CTA's walks, in order."""
        for key_tile, walk, present in walks:
            body = functools.partial(run, key_tile, walk)
            body() if present is None else pl.when(present)(body)

    def consume_walk(wg: int | jax.Array, key_tile: jax.Array, walk: QueryTiles) -> None:
        """Consumer wg's walk of its keys of 128-key tile key_tile: dK, dV of them."""
        col0 = key_tile * cta_keys + wg * bk
        keys = pl.ds(pl.multiple_of(col0, bk), bk)
        k_own, v_own = k_s.at[wg], v_s.at[wg]
        plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_own, kv_bar.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_own, kv_bar.at[wg])

        def accumulate(dk_acc: Any, dv_acc: Any) -> tuple[jax.Array, jax.Array]:
            def steps(turn: Callable[[], None] | None) -> None:
                def step(n: jax.Array, slot: jax.Array, masked: bool) -> None:
                    refs = tuple(x.at[slot] for x in ring)
                    own = kern.step_index(wg)
                    around_dk = None
                    if kern.fused:
                        start, head = walk.at(n)
                        dst = dq_ref.at[batch, pl.ds(start, bq), head]
                        around_dk = functools.partial(
                            _add_dq_shared, n, wg, kern, k_s, dst, shared_dq
                        )
                    k_step, v_step = k_s.at[own], v_s.at[own]
                    dkv_step(
                        kern, k_step, v_step, refs, col0, masked, dk_acc, dv_acc, around_dk, turn
                    )

                consume(walk.total, walk.masked, stages, ready, free, step)

            plgpu.barrier_wait(kv_bar.at[wg])
            take_turns(sched, wg, steps)
            if kern.fused:  # observe the dS tiles' last release phases: both consumers' dQ
                # matmuls have then read this CTA's K tiles, which the dK store right after
                # overwrites and the next walk reloads
                ds_free, total = shared_dq[3], walk.total
                lax.fori_loop(jnp.maximum(total - DS_BUFFERS, 0), total, drain(ds_free), None)
            return dk_acc[...], dv_acc[...]

        dsts = (x.at[batch, keys, grid_head] for x in (dk_ref, dv_ref))
        own_stage = None if stage is None else stage.at[wg]
        accumulate_dkv(accumulate, kern, k_own, v_own, *dsts, stage=own_stage)

    def consumer(wg: int | jax.Array) -> None:
        """Consumer warpgroup wg's walks (wg a Python int in a per-consumer copy)."""
        plgpu.set_max_registers(kern.registers[0], action="increase")
        each_walk(functools.partial(consume_walk, wg))

    if kern.consumer_copies:
        for w in range(CONSUMER_WARPGROUPS):
            pl.when(wg == w)(functools.partial(consumer, w))
    else:
        pl.when(wg < CONSUMER_WARPGROUPS)(functools.partial(consumer, wg))

    @pl.when(wg == PRODUCER)
    def _producer() -> None:
        plgpu.set_max_registers(kern.registers[1], action="decrease")
        sources = (q_ref, do_ref, lse_ref, delta_ref, lo_ref, hi_ref)

        def produce_walk(key_tile: jax.Array, walk: QueryTiles) -> None:
            def fetch(n: jax.Array, slot: jax.Array) -> None:
                start, head = walk.at(n)
                slots = tuple(x.at[slot] for x in ring)
                fetch_queries(sources, slots, batch, start, head, bq, ready.at[slot])

            produce(walk.total, stages, free, fetch)

        each_walk(produce_walk)


def key_tiles(kern: Kernel, tile: jax.Array, count: int) -> list[tuple[jax.Array, bool, Any]]:
    """(128-key tile, unmasked q tiles walked last first, present: None for always) of each walk
    of CTA `tile` over `count` key tiles: its own, or with kern.paired tile p's last first and
    then count - 1 - p's, which the middle CTA of an odd count does not have."""
    if not kern.paired:
        return [(tile, False, None)]
    mate = jnp.int32(count - 1) - tile
    return [(tile, True, None), (mate, False, mate != tile)]


def dkv_tiles(kern: Kernel, count: int) -> int:
    """CTAs along the key axis for `count` 128-key tiles: one each, or one per pair."""
    return -(-count // 2) if kern.paired else count


def dq_columns(head_dim: int) -> list[slice]:
    """Each consumer's slice of the head dim in the fused dQ share: halves of at least 64
    columns (a 128-byte swizzle atom of the K tile), so at D=64 consumer 0 takes it all."""
    width = max(WGMMA_ROWS, head_dim // CONSUMER_WARPGROUPS)
    return [slice(c, min(c + width, head_dim)) for c in range(0, head_dim, width)]


def _add_dq_shared(
    n: jax.Array, wg: int | jax.Array, kern: Kernel, k_s: Any, dst: Any, shared: tuple,
    ds_t: jax.Array, issue_dk: Callable[[], None],
) -> None:  # fmt: skip
    """Step n's dQ share of the CTA, dst (fp32 GMEM, block_q x D) += dS K over both consumers'
    keys, between this consumer's dV and dK matmuls: its dS^T into buffer n mod 2 (once both
    consumers' reads of step n - 2 released it), a rendezvous, then each consumer's dq_columns
    slice issued before dK (FlashAttention-3's dV, dQ, dK order) and added by one TMA
    reduce-add. At D=64 consumer 0 computes it all and reads it while dK's matmul runs. At D=128
    each consumer's slice is picked by index and read once dK is done too: measured on the H200
    (mosaic_variants 39-*), a branch per consumer with dK in flight across their join made
    ptxas serialise every wgmma of the kernel, and the index with dK in flight was 1.12-1.16x
    slower than waiting for dK (fewer registers live under the store)."""
    ds_s, dq_s, ready, free = shared
    buf = lax.rem(n, jnp.int32(DS_BUFFERS))
    pl.when(n >= DS_BUFFERS)(lambda: plgpu.barrier_wait(free.at[buf]))
    ds_s.at[buf, wg][...] = ds_t
    plgpu.commit_smem()
    plgpu.barrier_arrive(ready.at[buf])
    plgpu.barrier_wait(ready.at[buf])
    columns = dq_columns(k_s.shape[-1])

    def share(cols: Any, stage: Any, wait_n: int) -> None:
        def run(acc: Any) -> jax.Array:
            for j in range(CONSUMER_WARPGROUPS):
                ds_j = plgpu.transpose_ref(ds_s.at[buf, j], (1, 0))
                plgpu.wgmma(acc, ds_j, k_s.at[kern.step_index(j), :, cols])
            issue_dk()
            return plgpu.wgmma_accumulator_load(acc, wait_n=wait_n)  # 1: dK still in flight

        part = pl.run_scoped(run, plgpu.ACC(dq_s.shape[1:], jnp.float32))
        plgpu.barrier_arrive(free.at[buf])  # its wgmmas have read both dS^T halves
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add has read the stage
        stage[...] = part
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(stage, dst.at[:, cols], reduction_op="add")

    if len(columns) == CONSUMER_WARPGROUPS:
        width = columns[0].stop
        own = (
            columns[wg] if isinstance(wg, int) else pl.ds(pl.multiple_of(wg * width, width), width)
        )
        share(own, dq_s.at[wg], wait_n=0)
        return
    pl.when(wg == 0)(lambda: share(columns[0], dq_s.at[0], wait_n=1))

    @pl.when(wg > 0)
    def _no_share() -> None:
        issue_dk()
        plgpu.barrier_arrive(free.at[buf])


def dkv_call(operands: tuple, lists: tuple, kern: Kernel, interpret: Any) -> tuple:
    """dK, dV (B, padded Sk, Hkv, D) [and the unscaled fp32 dQ when fused] of padded operands,
    one CTA per CONSUMER_WARPGROUPS * block_k keys (a 128-key mask tile or part of a larger one;
    two such tiles with kern.paired) and per share of the GQA group's q heads
    (kern.head_split)."""
    q, k = operands[0], operands[1]
    bq, bk, st, d = kern.block_q, kern.block_k, kern.stages, q.shape[-1]
    intervals = operands[6].shape[0]
    scratch = [
        tile_smem((CONSUMER_WARPGROUPS, bk, d), q.dtype),
        tile_smem((CONSUMER_WARPGROUPS, bk, d), q.dtype),
        *query_ring(st, bq, d, q.dtype, intervals),
        plgpu.Barrier(num_arrivals=2, num_barriers=CONSUMER_WARPGROUPS),
        plgpu.Barrier(num_arrivals=QUERY_COPIES, num_barriers=st),
        plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS, num_barriers=st),
    ]
    if kern.fused:  # the shared dS^T buffers, each consumer's fp32 dQ stage, their barriers
        width = dq_columns(d)[0].stop
        scratch += [
            tile_smem((DS_BUFFERS, CONSUMER_WARPGROUPS, bk, bq), q.dtype),
            plgpu.SMEM((CONSUMER_WARPGROUPS, bq, width), jnp.float32),
            plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS, num_barriers=DS_BUFFERS),
            plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS, num_barriers=DS_BUFFERS),
        ]
    if kern.head_split > 1:  # each consumer's fp32 staging tile for its partial dK, dV
        scratch.append(plgpu.SMEM((CONSUMER_WARPGROUPS, bk, d), jnp.float32))
    if kern.pingpong:  # the consumers' turns on the tensor cores
        scratch.append(plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS))
    tiles = dkv_tiles(kern, k.shape[1] // (CONSUMER_WARPGROUPS * bk))
    grid = (tiles, k.shape[2] * kern.head_split, k.shape[0])
    name = "mosaic_flash_dkv_ws"
    return launch_dkv(
        _kernel, kern, grid, scratch, (*operands, *lists), interpret, name, CONSUMER_WARPGROUPS
    )
