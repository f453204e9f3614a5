"""Warp-specialised Hopper forward kernel (Pallas Mosaic GPU) over a block-sparse mask.

One CTA owns 2 x 64 query rows of one (batch, q head). Warpgroup 2 is the producer: it walks
the CTA's compacted list of non-empty key tiles and TMA-loads each K and V tile into a ring of
shared-memory stages. Warpgroups 0 and 1 are consumers, each owning 64 of the rows: per tile,
S = Q K^T by wgmma, in-register masking from the per-row key intervals on partial tiles only,
online softmax in fp32 with exp2 (scale folded in log2 units), then O += P V by wgmma. The two
consumers take turns on the tensor cores (a ping-pong barrier), so one's softmax overlaps the
other's matmuls. Output and LSE go back through shared memory by TMA stores.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..kernel_inputs import LN2, LOG2E
from .config import CONSUMER_WARPGROUPS, PRODUCER, KernelConfig

CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one launch (padded lengths, heads, tiles)."""

    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    intervals: int
    config: KernelConfig
    in_place_pv: bool = False  # O += P V straight into O's registers (GPU lowering only)
    overlap: bool = False  # S(n + 1) issued before the softmax of step n (KernelConfig.fwd_overlap)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def num_q_tiles(self) -> int:
        return self.seq_q // self.config.mask_block_q


def _smem_transforms() -> tuple[Any, ...]:
    """128-byte swizzled (8, 64) tiles: the layout wgmma reads half-precision operands in."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _row_layout(x: jax.Array) -> jax.Array:
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def _tile_layout(x: jax.Array) -> jax.Array:
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def _rows(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """A per-row vector broadcast along the columns of a (rows, cols) tile."""
    return lax.broadcast_in_dim(x, shape, [0])


def _mask_scores(s: jax.Array, bounds: list[tuple[jax.Array, jax.Array]], start: Any) -> jax.Array:
    """s where key start + j lies in one of the row's [lo, hi) intervals, else -inf.

    Built from compares and selects only (no boolean and/or), the cheapest form in registers.
    """
    cols = _tile_layout(lax.broadcasted_iota(jnp.int32, s.shape, 1)) + start
    hidden = jnp.full(s.shape, -jnp.inf, jnp.float32)
    out = hidden
    for lo, hi in bounds:
        inside = jnp.where(cols < _rows(hi, s.shape), s, out)
        out = jnp.where(cols >= _rows(lo, s.shape), inside, out)
    return out


def _kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    bounds_ref: Any,
    index_ref: Any,
    n_partial_ref: Any,
    count_ref: Any,
    out_ref: Any,
    lse_ref: Any,
    *,
    geo: Geometry,
    scale: float,
) -> None:
    cfg = geo.config
    bq, bk, d, stages = cfg.block_q, cfg.block_k, geo.head_dim, cfg.max_concurrent_steps
    dtype = q_ref.dtype

    def body(smem: tuple, ready: tuple, free: tuple, sched: Any) -> None:
        q_smem, k_smem, v_smem, bounds_smem, lse_smem = smem
        k_ready, v_ready, q_ready, bounds_ready = ready
        k_free, v_free = free
        wg = lax.axis_index("wg")
        batch = lax.axis_index("batch")
        head = lax.axis_index("heads")
        tile = geo.num_q_tiles - 1 - lax.axis_index("q")  # longest (last) q tiles first
        count = count_ref[tile]

        def pingpong() -> None:
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < PRODUCER)
        def _consumer() -> None:
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            row0 = tile * cfg.mask_block_q + wg * bq
            plgpu.copy_gmem_to_smem(
                q_ref.at[batch, pl.ds(row0, bq), head], q_smem.at[wg], q_ready.at[wg]
            )
            plgpu.copy_gmem_to_smem(
                bounds_ref.at[tile * CONSUMER_WARPGROUPS + wg],
                bounds_smem.at[wg],
                bounds_ready.at[wg],
            )
            plgpu.barrier_wait(bounds_ready.at[wg])
            bounds = [
                (
                    _row_layout(bounds_smem[wg, 2 * r]),
                    _row_layout(bounds_smem[wg, 2 * r + 1]),
                )
                for r in range(geo.intervals)
            ]
            plgpu.barrier_wait(q_ready.at[wg])
            qk_scale = scale * LOG2E

            def softmax(s: jax.Array, carry: tuple, n: jax.Array, masked: bool) -> tuple:
                """Scaled, masked scores s of step n into (O rescaled, m, l, P in the input
                dtype)."""
                acc, m_prev, l_prev = carry
                s = s * qk_scale
                if masked:
                    s = _mask_scores(s, bounds, index_ref[tile, n] * bk)
                m_next = jnp.maximum(m_prev, s.max(axis=1))
                m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
                alpha = jnp.exp2(m_prev - m_use)
                p = jnp.exp2(s - _rows(m_use, s.shape))
                l_next = l_prev * alpha + p.sum(axis=1)
                acc = acc * _rows(alpha, acc.shape)
                p16 = p.astype(dtype)
                return lax.optimization_barrier((acc, m_next, l_next, p16))

            def pv(acc: jax.Array, p16: jax.Array, slot: jax.Array) -> jax.Array:
                """O + P V, once this warpgroup's turn on the tensor cores and V have come."""
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(sched)
                if geo.in_place_pv:
                    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p16, v_smem.at[slot]))(
                        plgpu.ACC.init(acc)
                    )

                def fresh(acc_ref: Any) -> jax.Array:
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    return acc_ref[...]

                return acc + pl.run_scoped(fresh, plgpu.ACC((bq, d), jnp.float32))

            def issue_qk(acc_ref: Any, slot: jax.Array) -> None:
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.wgmma(acc_ref, q_smem.at[wg], plgpu.transpose_ref(k_smem.at[slot], (1, 0)))

            def step(n: jax.Array, carry: tuple, masked: bool) -> tuple:
                slot = lax.rem(n, stages)

                def qk(acc_ref: Any) -> jax.Array:
                    issue_qk(acc_ref, slot)
                    pingpong()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                acc, m_next, l_next, p16 = softmax(s, carry, n, masked)
                acc = pv(acc, p16, slot)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_next, l_next

            def overlapped_step(n: jax.Array, carry: tuple, masked: bool) -> tuple:
                """step with S(n + 1) = Q K(n + 1)^T issued before the softmax of step n, whose
                scores came in the carry, so the tensor cores work through the softmax."""
                *state, s = carry
                slot, later = lax.rem(n, stages), lax.rem(n + 1, stages)

                def body(acc_ref: Any) -> tuple:
                    pl.when(n + 1 < count)(lambda: issue_qk(acc_ref, later))
                    pingpong()
                    acc, m_next, l_next, p16 = softmax(s, tuple(state), n, masked)
                    acc = pv(acc, p16, slot)  # waits for every wgmma: S(n + 1) is done too
                    return acc, m_next, l_next, acc_ref[...]

                out = pl.run_scoped(body, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                pl.when(n + 1 < count)(lambda: plgpu.barrier_arrive(k_free.at[later]))
                return out

            carry = (
                _tile_layout(jnp.zeros((bq, d), jnp.float32)),
                _row_layout(jnp.full((bq,), -jnp.inf, jnp.float32)),
                _row_layout(jnp.zeros((bq,), jnp.float32)),
            )
            n_partial = n_partial_ref[tile]
            pl.when(wg == 1)(pingpong)
            if geo.overlap:

                def first(acc_ref: Any) -> jax.Array:
                    pl.when(count > 0)(lambda: issue_qk(acc_ref, jnp.int32(0)))
                    return acc_ref[...]

                s0 = pl.run_scoped(first, plgpu.ACC((bq, bk), jnp.float32))
                pl.when(count > 0)(lambda: plgpu.barrier_arrive(k_free.at[0]))
                carry = (*carry, s0)
                walk = overlapped_step
            else:
                walk = step
            carry = lax.fori_loop(0, n_partial, functools.partial(walk, masked=True), carry)
            carry = lax.fori_loop(n_partial, count, functools.partial(walk, masked=False), carry)
            pl.when(wg == 0)(pingpong)
            acc, m, denom = carry[:3]
            empty = denom == 0.0
            denom = jnp.where(empty, 1.0, denom)
            out = acc * _rows(1.0 / denom, acc.shape)
            q_smem[wg] = out.astype(dtype)
            lse_smem[wg] = jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(denom))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], out_ref.at[batch, pl.ds(row0, bq), head])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(row0, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == PRODUCER)
        def _producer() -> None:
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            kv_head = lax.div(head, jnp.int32(geo.group))

            def issue(n: jax.Array, _: Any) -> None:
                slot = lax.rem(n, stages)
                rows = (batch, pl.ds(index_ref[tile, n] * bk, bk), kv_head)

                @pl.when(n >= stages)
                def _() -> None:
                    plgpu.barrier_wait(k_free.at[slot])

                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])

                @pl.when(n >= stages)
                def _() -> None:
                    plgpu.barrier_wait(v_free.at[slot])

                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

            def drain(n: jax.Array, _: Any) -> None:
                slot = lax.rem(n, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            lax.fori_loop(0, count, issue, None)
            # Wait for the consumers to release the last stages, so that every phase of the
            # release barriers is observed before they are freed.
            lax.fori_loop(jnp.maximum(count - stages, 0), count, drain, None)

    transforms = _smem_transforms()
    pl.run_scoped(
        lambda *refs: body(*refs),
        (
            plgpu.SMEM((CONSUMER_WARPGROUPS, bq, d), dtype, transforms=transforms),
            plgpu.SMEM((stages, bk, d), dtype, transforms=transforms),
            plgpu.SMEM((stages, bk, d), dtype, transforms=transforms),
            plgpu.SMEM((CONSUMER_WARPGROUPS, 2 * geo.intervals, bq), jnp.int32),
            plgpu.SMEM((CONSUMER_WARPGROUPS, bq), jnp.float32),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=CONSUMER_WARPGROUPS),
            plgpu.Barrier(num_barriers=CONSUMER_WARPGROUPS),
        ),
        (
            plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS, num_barriers=stages),
        ),
        plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS),
        collective_axes="wg",
    )


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bounds: jax.Array,
    index: jax.Array,
    n_partial: jax.Array,
    count: jax.Array,
    *,
    scale: float,
    config: KernelConfig,
    interpret: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Padded q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) -> out (B,Sq,Hq,D), lse (B,Hq,Sq) float32.

    bounds: (Sq/64, 2K, 64) int32, rows' [lo, hi) key intervals per 64-row slice (lo, hi
    interleaved); index/n_partial/count: the q tiles' key-tile lists, partial tiles first.
    interpret: None for the GPU, or InterpretGPUParams to run on CPU (which runs the
    fresh-accumulator P V whatever config.in_place_pv says: run_state is not interpretable).
    """
    batch, seq_q, heads_q, head_dim = q.shape
    geo = Geometry(
        batch=batch,
        seq_q=seq_q,
        seq_k=k.shape[1],
        heads_q=heads_q,
        heads_kv=k.shape[2],
        head_dim=head_dim,
        intervals=bounds.shape[1] // 2,
        config=config,
        in_place_pv=config.in_place_pv and not interpret,
        overlap=config.fwd_overlap,
    )
    kernel = plgpu.kernel(
        functools.partial(_kernel, geo=geo, scale=float(scale)),
        out_type=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads_q, seq_q), jnp.float32),
        ),
        grid=(geo.num_q_tiles, heads_q, batch),
        grid_names=("q", "heads", "batch"),
        num_threads=CONSUMER_WARPGROUPS + 1,
        thread_name="wg",
        kernel_name="mosaic_flash_fwd",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    return kernel(q, k, v, bounds, index, n_partial, count)
