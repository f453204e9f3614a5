"""Pieces the Mosaic GPU backward kernels share: the launch description, SMEM tiles, row
vectors and masks in registers, wgmma pairs, tile starts in the tile lists, the dK/dV step and
the fused dQ's reduce-add."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..kernel_inputs import LOG2E
from .config import grid_axes

WGMMA_ROWS = 64  # a wgmma's M granularity: every kernel tile is a multiple of it
DEFAULT_TILE = 64


@dataclasses.dataclass(frozen=True)
class Kernel:
    """Static description of one backward kernel launch (tiles, walk, numerics, lowering)."""

    block_q: int
    block_k: int
    mask_block_q: int
    mask_block_k: int
    group: int
    stages: int
    scale: float
    hints: bool  # emit layout casts (real lowering); interpret mode has no rule for them
    registers: tuple[int, int]  # setmaxnreg of a consumer, of the producer (KernelConfig)
    fused: bool = False  # dK/dV kernel also reduces dQ into fp32 global memory
    tiles_fastest: bool = False  # launch order of the grid (KernelConfig.tiles_fastest)
    overlap: bool = False  # P computed while dP's wgmma runs (KernelConfig.bwd_overlap)
    head_split: int = 1  # dK/dV CTAs per (key tile, kv head) (KernelConfig.dkv_head_split)
    pingpong: bool = False  # consumers take turns on the tensor cores (KernelConfig.bwd_pingpong)
    consumer_copies: bool = False  # consumer code per warpgroup (KernelConfig.dkv_consumer_copies)
    step_descriptors: bool = False  # tiles picked per step (KernelConfig.dkv_step_descriptors)
    paired: bool = False  # two key tiles a dK/dV CTA (KernelConfig.dkv_paired_walks)

    @property
    def qk_scale(self) -> float:
        return self.scale * LOG2E

    def step_index(self, i: int | jax.Array) -> int | jax.Array:
        """Index i of a loop-invariant SMEM tile as a step uses it: through an optimisation
        barrier with step_descriptors, so the tile's wgmma descriptors are computed in the step,
        not hoisted before the loop and kept live across it."""
        return lax.optimization_barrier(jnp.asarray(i, jnp.int32)) if self.step_descriptors else i

    @property
    def walk_heads(self) -> int:
        """q heads one dK/dV CTA walks: its share of the GQA group."""
        return self.group // self.head_split


def swizzle() -> tuple[Any, Any]:
    """SMEM transforms of 2-byte (rows, 64k) operand tiles: 8x64 tiles, 128-byte swizzle."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def tile_smem(shape: tuple[int, ...], dtype: Any) -> Any:
    return plgpu.SMEM(shape, dtype, transforms=swizzle())


def cast(x: jax.Array, layout: Any, kern: Kernel) -> jax.Array:
    """x in `layout` on the GPU (a hint for the load/broadcast that follows)."""
    return plgpu.layout_cast(x, layout) if kern.hints else x


def row_vector(ref: Any, kern: Kernel, keys_axis: int) -> jax.Array:
    """A per-query vector from SMEM, laid out to broadcast along the keys axis of a tile."""
    return cast(ref[...], plgpu.Layout.WGMMA.reduce(keys_axis), kern)


def broadcast(x: jax.Array, shape: tuple[int, int], keys_axis: int) -> jax.Array:
    return lax.broadcast_in_dim(x, shape, [1 - keys_axis])


def visible(
    lo_ref: Any, hi_ref: Any, key0: jax.Array, shape: tuple[int, int], keys_axis: int, kern: Kernel
) -> jax.Array:
    """Tile visibility from (K, rows) interval refs: key j of row i in some [lo, hi)."""
    layout = plgpu.Layout.WGMMA if kern.hints else None
    keys = key0 + plgpu.broadcasted_iota(jnp.int32, shape, keys_axis, layout=layout)
    out = None
    for r in range(lo_ref.shape[0]):
        lo = broadcast(row_vector(lo_ref.at[r], kern, keys_axis), shape, keys_axis)
        hi = broadcast(row_vector(hi_ref.at[r], kern, keys_axis), shape, keys_axis)
        inside = (keys >= lo) & (keys < hi)
        out = inside if out is None else out | inside
    return out


def two_matmuls(
    a0: Any, b0: Any, a1: Any, b1: Any, shape: tuple[int, int], first: Callable, *, early: bool,
    issued: Callable[[], None] | None = None,
) -> tuple:  # fmt: skip
    """(first(a0 @ b0), a1 @ b1) from fresh fp32 accumulators, both wgmmas in flight together.
    early: first runs as soon as a0 @ b0 is done, while a1 @ b1 still runs; else after both.
    issued, when given, runs once both are issued, before either is waited for."""

    def run(acc0: Any, acc1: Any) -> tuple[jax.Array, jax.Array]:
        plgpu.wgmma(acc0, a0, b0)
        plgpu.wgmma(acc1, a1, b1)
        if issued is not None:
            issued()
        if early:
            done = first(plgpu.wgmma_accumulator_load(acc0, wait_n=1))
            return done, acc1[...]
        both = acc0[...], acc1[...]
        return first(both[0]), both[1]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def one_matmul(a: Any, b: Any, shape: tuple[int, int]) -> jax.Array:
    """a @ b in a fresh fp32 accumulator (waits for it, and for every wgmma issued before)."""

    def run(acc: Any) -> jax.Array:
        plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def tile_start(
    index_ref: Any, outer: jax.Array, unit: jax.Array, mask_tile: int, tile: int
) -> jax.Array:
    """First row/key of sub-tile `unit` of the listed mask tiles of outer tile `outer`."""
    split = mask_tile // tile
    if split == 1:
        return pl.multiple_of(index_ref[outer, unit] * mask_tile, tile)
    entry = index_ref[outer, lax.div(unit, jnp.int32(split))]
    return pl.multiple_of(entry * mask_tile + lax.rem(unit, jnp.int32(split)) * tile, tile)


def store_tile(smem: Any, value: jax.Array, dst: Any) -> None:
    """value (an fp32 tile) into dst in GMEM through `smem`, in smem's dtype."""
    smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)


def accumulate_dkv(
    accumulate: Callable[[Any, Any], tuple], kern: Kernel, k_s: Any, v_s: Any, dk: Any, dv: Any,
    stage: Any = None,
) -> None:  # fmt: skip
    """accumulate(dk_acc, dv_acc) over fresh fp32 (keys, D) accumulators, then dK (scaled) and
    dV to their GMEM tiles dk, dv through the K and V tiles' SMEM, or, given an fp32 SMEM
    `stage`, through it in fp32 (a head split's partial sums), waited."""
    acc = plgpu.ACC((k_s.shape[0], k_s.shape[-1]), jnp.float32)
    dk_sum, dv_sum = pl.run_scoped(accumulate, acc, acc)
    if stage is None:
        store_tile(k_s, dk_sum * kern.scale, dk)
        store_tile(v_s, dv_sum, dv)
    else:
        store_tile(stage, dk_sum * kern.scale, dk)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dK's copy has read the stage
        store_tile(stage, dv_sum, dv)
    plgpu.wait_smem_to_gmem(0)


def launch(
    body: Callable[..., None],
    kern: Kernel,
    grid: tuple[int, int, int],
    out_type: Any,
    scratch: list[Any],
    interpret: Any,
    name: str,
    warpgroups: int = 1,
) -> Callable[..., Any]:
    """The kernel over (tiles, heads, batch) in grid_axes' launch order, with `warpgroups`
    warpgroups ("wg") per CTA. A
    fused launch takes a mutable dQ Ref operand, which plgpu.kernel's batching wrapper cannot
    carry, so it goes through pl.kernel, with the scratch allocated inside as plgpu.kernel
    does it (shared by the warpgroups)."""
    common = dict(
        out_type=out_type,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret if interpret else None,
    )
    threads = dict(num_threads=warpgroups, thread_name="wg") if warpgroups > 1 else {}
    order = grid_axes(("tiles", grid[0]), *grid[1:], tiles_fastest=kern.tiles_fastest)
    mesh = dict(**order, kernel_name=name, **threads)
    body = functools.partial(body, kern=kern)
    if not kern.fused:
        return plgpu.kernel(body, scratch_types=scratch, **mesh, **common)

    def scoped(*refs: Any) -> None:
        pl.run_scoped(
            functools.partial(body, *refs), *scratch, collective_axes="wg" if threads else ()
        )

    return pl.kernel(scoped, mesh=plgpu.Mesh(**mesh), name=name, **common)


def launch_dkv(
    body: Callable[..., None],
    kern: Kernel,
    grid: tuple[int, int, int],
    scratch: list[Any],
    operands: tuple,
    interpret: Any,
    name: str,
    consumers: int = 1,
) -> tuple:
    """dK, dV (k's shape) of a dK/dV kernel, and when fused the unscaled fp32 dQ (q's shape):
    then the kernel gets a zeroed fp32 dQ Ref after its inputs, which it adds into by TMA
    reduce-add (the scratch then includes what the kernel stages dQ through). With a head split
    the kernel writes fp32 partial dK, dV per (kv head, share), summed here."""
    q, k = operands[0], operands[1]
    b, sk, hkv, d = k.shape
    split = kern.head_split
    partial = (b, sk, hkv * split, d), jnp.float32 if split > 1 else k.dtype
    out_type = [jax.ShapeDtypeStruct(*partial)] * 2
    warpgroups = consumers + 1 if consumers > 1 else 1  # several consumers come with a producer
    call = launch(body, kern, grid, out_type, scratch, interpret, name, warpgroups)
    if kern.fused:
        dq = jax.new_ref(jnp.zeros(q.shape, jnp.float32), memory_space=plgpu.GMEM)
        dk, dv = call(*operands, dq)
        return dk, dv, dq[...]
    dk, dv = call(*operands)
    if split > 1:
        dk, dv = (x.reshape(b, sk, hkv, split, d).sum(3).astype(k.dtype) for x in (dk, dv))
    return dk, dv


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """The dK/dV kernels' walk of one key tile: its listed mask q tiles, in block_q sub-tiles,
    times the q heads of the CTA's share of the GQA group (step n: sub-tile n // walk_heads,
    head n % walk_heads of the share), the partial mask tiles' steps first; with `descending`
    the unmasked sub-tiles last first. The launch's head axis runs over (kv head, share)."""

    kern: Kernel
    index_ref: Any
    outer: jax.Array  # the mask key tile whose list is walked
    grid_head: jax.Array  # kv head * head_split + share
    total: jax.Array  # steps in all
    masked: jax.Array  # steps over partial mask tiles, which come first
    mirror: jax.Array | None  # descending: unmasked sub-tile u is walked as mirror - u

    @classmethod
    def of(
        cls, kern: Kernel, refs: tuple[Any, Any, Any], outer: jax.Array, grid_head: jax.Array,
        descending: bool = False,
    ) -> QueryTiles:  # fmt: skip
        """The walk of key tile `outer` from the mask's (index, n_partial, count) refs."""
        index_ref, n_partial_ref, count_ref = refs
        per_tile = (kern.mask_block_q // kern.block_q) * kern.walk_heads
        total, masked = count_ref[outer] * per_tile, n_partial_ref[outer] * per_tile
        mirror = None
        if descending:  # sub-tiles [first, last] of the unmasked ones: u -> first + last - u
            mirror = lax.div(total + masked, jnp.int32(kern.walk_heads)) - 1
        return cls(kern, index_ref, outer, grid_head, total, masked, mirror)

    def at(self, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(first q row, q head) of step n."""
        kern, heads = self.kern, jnp.int32(self.kern.walk_heads)
        unit = lax.div(n, heads)
        if self.mirror is not None:
            unit = jnp.where(n < self.masked, unit, self.mirror - unit)
        head = self.grid_head * heads + lax.rem(n, heads)
        return tile_start(self.index_ref, self.outer, unit, kern.mask_block_q, kern.block_q), head


def fetch_queries(
    sources: tuple, slots: tuple, batch: jax.Array, start: jax.Array, head: jax.Array, bq: int,
    barrier: Any,
) -> None:  # fmt: skip
    """TMA-load q, dO (rows x D), LSE, delta (rows) and the rows' key intervals (K x rows) of
    q rows [start, start + bq) of `head` into one ring slot, all completing on `barrier`."""
    q, do, lse, delta, lo, hi = sources
    rows = pl.ds(start, bq)
    for src, dst in zip((q.at[batch, rows, head], do.at[batch, rows, head],
                         lse.at[batch, head, rows], delta.at[batch, head, rows],
                         lo.at[:, rows], hi.at[:, rows]), slots):  # fmt: skip
        plgpu.copy_gmem_to_smem(src, dst, barrier)


QUERY_COPIES = 6  # TMA copies per slot in fetch_queries: its barrier's arrivals


def query_ring(stages: int, bq: int, d: int, dtype: Any, intervals: int) -> list[Any]:
    """The SMEM ring fetch_queries fills: q, dO (stages, bq, D), LSE, delta (stages, bq), lo, hi
    (stages, intervals, bq)."""
    return [
        tile_smem((stages, bq, d), dtype),
        tile_smem((stages, bq, d), dtype),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.SMEM((stages, intervals, bq), jnp.int32),
        plgpu.SMEM((stages, intervals, bq), jnp.int32),
    ]


def dkv_step(
    kern: Kernel, k_s: Any, v_s: Any, slot: tuple, col0: jax.Array, masked: bool,
    dk_acc: Any, dv_acc: Any,
    around_dk: Callable[[jax.Array, Callable[[], None]], None] | None = None,
    turn: Callable[[], None] | None = None,
) -> jax.Array:  # fmt: skip
    """One (keys x queries) step of dK/dV from the slot's (q, dO, LSE, delta, lo, hi): S^T and
    dP^T, the mask on partial tiles, P^T and dS^T, then dV += P^T dO and dK += dS^T Q issued
    with P^T, dS^T as register A operands (the accumulators' layout). Returns dS^T.
    around_dk(dS^T, issue_dk), when given, issues dK itself, so work can go between dV and dK
    (the fused kernel's dQ matmul) or run while dK's matmul is in flight. turn, when given,
    runs once S^T and dP^T are issued and again before dV is: the consumers' ping-pong."""
    q, do, lse_s, delta_s, lo_s, hi_s = slot
    shape = (k_s.shape[0], q.shape[0])

    def probabilities(s_t: jax.Array) -> jax.Array:
        s_t = s_t * kern.qk_scale - broadcast(row_vector(lse_s, kern, 0), shape, 0)
        if masked:  # selects after the LSE, so the scale and the LSE fuse in one FFMA
            s_t = jnp.where(visible(lo_s, hi_s, col0, shape, 0, kern), s_t, -jnp.inf)
        return jnp.exp2(s_t)

    p_t, dp_t = two_matmuls(
        k_s, plgpu.transpose_ref(q, (1, 0)), v_s, plgpu.transpose_ref(do, (1, 0)), shape,
        probabilities, early=kern.overlap, issued=turn,
    )  # fmt: skip
    delta = broadcast(row_vector(delta_s, kern, 0), shape, 0)
    ds_t = (p_t * (dp_t - delta)).astype(k_s.dtype)
    if turn is not None:
        turn()
    plgpu.wgmma(dv_acc, p_t.astype(k_s.dtype), do)
    if around_dk is None:
        plgpu.wgmma(dk_acc, ds_t, q)
    else:
        around_dk(ds_t, lambda: plgpu.wgmma(dk_acc, ds_t, q))
    return ds_t


def dq_step(
    kern: Kernel, rows: tuple, k: Any, v: Any, key0: jax.Array | None, masked: bool, dq_acc: Any,
    turn: Callable[[], None] | None = None,
) -> None:  # fmt: skip
    """One (queries x keys) step of dQ: S and dP of the rows' (q, dO) against the slot's K, V,
    the mask on partial tiles from the rows' intervals, then dQ += dS K issued with dS as the
    register A operand. rows: (q, dO, lo, hi) SMEM refs and the broadcast LSE and delta; key0:
    the first key of the step (read only when masked). turn, when given, runs once S and dP
    are issued and again before dQ's matmul is: the consumers' ping-pong."""
    q, do, lo_s, hi_s, lse, delta = rows
    shape = lse.shape

    def probabilities(s: jax.Array) -> jax.Array:
        s = s * kern.qk_scale - lse
        if masked:  # selects after the LSE, so the scale and the LSE fuse in one FFMA
            s = jnp.where(visible(lo_s, hi_s, key0, shape, 1, kern), s, -jnp.inf)
        return jnp.exp2(s)

    p, dp = two_matmuls(
        q, plgpu.transpose_ref(k, (1, 0)), do, plgpu.transpose_ref(v, (1, 0)), shape,
        probabilities, early=kern.overlap, issued=turn,
    )  # fmt: skip
    ds = (p * (dp - delta)).astype(k.dtype)
    if turn is not None:
        turn()
    plgpu.wgmma(dq_acc, ds, k)


def add_dq(ds_t: jax.Array, k_s: Any, ds_s: Any, dq_s: Any, dst: Any) -> None:
    """dst (fp32 GMEM) += dS K, unscaled, by TMA reduce-add: dS^T goes to SMEM to be read as the
    transposed A operand, the product through the fp32 stage dq_s (waited free first)."""
    ds_s[...] = ds_t
    plgpu.commit_smem()
    part = one_matmul(plgpu.transpose_ref(ds_s, (1, 0)), k_s, (ds_s.shape[1], k_s.shape[-1]))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add has read the stage
    dq_s[...] = part
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_s, dst, reduction_op="add")
