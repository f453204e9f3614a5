"""Flash-attention backward for Hopper in Pallas Mosaic GPU: a dK/dV kernel and a dQ kernel, or
one fused kernel.

Both walk only the non-empty tiles of the mask's tile lists (partial tiles first, masked in
registers from the per-row key intervals; full tiles unmasked). Operand tiles arrive by TMA into
a `stages`-deep SMEM ring, one step ahead per extra stage; all five matmuls are wgmma with fp32
accumulators; P is recomputed with exp2 from the saved LSE, so no forward pass is repeated.
dK/dV programs own one (key tile, kv head) and loop over the q heads of its GQA group, so the
group's gradients accumulate in registers without atomics. Fused (KernelConfig.fused_bwd), the
dK/dV kernel also computes each step's dQ contribution dS K and adds it to an fp32 dQ in global
memory with a TMA reduce-add, so S and dP are computed once (five matmuls a step instead of
seven across two kernels), at the cost of dQ traffic through L2.
"""

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

from ..kernel_inputs import (
    LOG2E,
    TilePadding,
    TileWalk,
    backward_lse,
    key_tile_walk,
    pad_axis,
    padded_intervals,
    query_tile_walk,
    softmax_delta,
)
from ..mask_arrays import MaskArrays
from .config import DTYPES, HEAD_DIMS, KernelConfig

WGMMA_ROWS = 64  # a wgmma's M granularity: every kernel tile is a multiple of it
DEFAULT_TILE = 64


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """Static description of one backward kernel launch (tiles, walk, numerics, lowering)."""

    block_q: int
    block_k: int
    mask_block_q: int
    mask_block_k: int
    group: int
    stages: int
    scale: float
    hints: bool  # emit layout casts (real lowering); interpret mode has no rule for them
    fused: bool = False  # dK/dV kernel also reduces dQ into fp32 global memory

    @property
    def qk_scale(self) -> float:
        return self.scale * LOG2E


def _swizzle() -> tuple[Any, Any]:
    """SMEM transforms of 2-byte (rows, 64k) operand tiles: 8x64 tiles, 128-byte swizzle."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _tile_smem(shape: tuple[int, ...], dtype: Any) -> Any:
    return plgpu.SMEM(shape, dtype, transforms=_swizzle())


def _cast(x: jax.Array, layout: Any, kern: _Kernel) -> jax.Array:
    """x in `layout` on the GPU (a hint for the load/broadcast that follows)."""
    return plgpu.layout_cast(x, layout) if kern.hints else x


def _row_vector(ref: Any, kern: _Kernel, keys_axis: int) -> jax.Array:
    """A per-query vector from SMEM, laid out to broadcast along the keys axis of a tile."""
    return _cast(ref[...], plgpu.Layout.WGMMA.reduce(keys_axis), kern)


def _broadcast(x: jax.Array, shape: tuple[int, int], keys_axis: int) -> jax.Array:
    return lax.broadcast_in_dim(x, shape, [1 - keys_axis])


def _visible(
    lo_ref: Any, hi_ref: Any, key0: jax.Array, shape: tuple[int, int], keys_axis: int, kern: _Kernel
) -> jax.Array:
    """Tile visibility from (K, rows) interval refs: key j of row i in some [lo, hi)."""
    layout = plgpu.Layout.WGMMA if kern.hints else None
    keys = key0 + plgpu.broadcasted_iota(jnp.int32, shape, keys_axis, layout=layout)
    out = None
    for r in range(lo_ref.shape[0]):
        lo = _broadcast(_row_vector(lo_ref.at[r], kern, keys_axis), shape, keys_axis)
        hi = _broadcast(_row_vector(hi_ref.at[r], kern, keys_axis), shape, keys_axis)
        inside = (keys >= lo) & (keys < hi)
        out = inside if out is None else out | inside
    return out


def _two_matmuls(a0: Any, b0: Any, a1: Any, b1: Any, shape: tuple[int, int]) -> tuple:
    """(a0 @ b0, a1 @ b1) in fresh fp32 accumulators, both wgmmas in flight together."""

    def run(acc0: Any, acc1: Any) -> tuple[jax.Array, jax.Array]:
        plgpu.wgmma(acc0, a0, b0)
        plgpu.wgmma(acc1, a1, b1)
        return acc0[...], acc1[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def _one_matmul(a: Any, b: Any, shape: tuple[int, int]) -> jax.Array:
    """a @ b in a fresh fp32 accumulator (waits for it, and for every wgmma issued before)."""

    def run(acc: Any) -> jax.Array:
        plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _tile_start(
    index_ref: Any, outer: jax.Array, unit: jax.Array, mask_tile: int, tile: int
) -> jax.Array:
    """First row/key of sub-tile `unit` of the listed mask tiles of outer tile `outer`."""
    split = mask_tile // tile
    if split == 1:
        return pl.multiple_of(index_ref[outer, unit] * mask_tile, tile)
    entry = index_ref[outer, lax.div(unit, jnp.int32(split))]
    return pl.multiple_of(entry * mask_tile + lax.rem(unit, jnp.int32(split)) * tile, tile)


def _ring(
    total: jax.Array,
    n_masked: jax.Array,
    stages: int,
    fetch: Callable[[jax.Array, Any], None],
    compute: Callable[[jax.Array, jax.Array, bool], None],
) -> None:
    """compute(n, slot, masked) for steps n < total (the first n_masked masked), the TMA loads
    of step n issued by fetch(n, slot) stages - 1 steps ahead into ring slot n mod stages."""
    for i in range(stages - 1):
        pl.when(i < total)(functools.partial(fetch, jnp.int32(i), i))

    def body(masked: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
        def step(n: jax.Array, carry: jax.Array) -> jax.Array:
            # The slot refilled here was read by step n - 1's (asynchronous) matmuls.
            plgpu.wgmma_wait(0)
            ahead = n + (stages - 1)
            slot = lax.rem(ahead, jnp.int32(stages))
            pl.when(ahead < total)(lambda: fetch(ahead, slot))
            compute(n, lax.rem(n, jnp.int32(stages)), masked)
            return carry

        return step

    lax.fori_loop(jnp.int32(0), n_masked, body(True), jnp.int32(0))
    lax.fori_loop(n_masked, total, body(False), jnp.int32(0))


def _store_tile(smem: Any, value: jax.Array, dst: Any) -> None:
    """value (an fp32 tile) into dst in GMEM through `smem`, in smem's dtype."""
    smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)


def _dkv_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    do_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    lo_ref: Any,
    hi_ref: Any,
    index_ref: Any,
    n_partial_ref: Any,
    count_ref: Any,
    dk_ref: Any,
    dv_ref: Any,
    k_s: Any,
    v_s: Any,
    q_s: Any,
    do_s: Any,
    lse_s: Any,
    delta_s: Any,
    lo_s: Any,
    hi_s: Any,
    kv_bar: Any,
    ring_bar: Any,
    *,
    kern: _Kernel,
    dq: tuple[Any, Any, Any] | None = None,
) -> None:
    """dK, dV of one (key tile, kv head, batch row): tiles are (keys, queries), keys first.
    dq = (fp32 dQ in GMEM, a (block_k, block_q) SMEM tile for dS^T, an fp32 (block_q, D) SMEM
    stage): also add each step's dS K to that dQ."""
    bq, bk = kern.block_q, kern.block_k
    tile, kv_head, batch = (lax.axis_index(n) for n in ("tiles", "heads", "batch"))
    col0 = tile * bk
    outer = lax.div(tile, jnp.int32(kern.mask_block_k // bk))
    keys = pl.ds(pl.multiple_of(col0, bk), bk)
    plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_s, kv_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_s, kv_bar.at[0])
    per_tile = (kern.mask_block_q // bq) * kern.group
    total = count_ref[outer] * per_tile
    n_masked = n_partial_ref[outer] * per_tile

    def where(n: jax.Array) -> tuple[jax.Array, jax.Array]:
        unit = lax.div(n, jnp.int32(kern.group))
        head = kv_head * kern.group + lax.rem(n, jnp.int32(kern.group))
        return _tile_start(index_ref, outer, unit, kern.mask_block_q, bq), head

    def fetch(n: jax.Array, slot: Any) -> None:
        start, head = where(n)
        rows = pl.ds(start, bq)
        bar = ring_bar.at[slot]
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], delta_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(lo_ref.at[:, rows], lo_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(hi_ref.at[:, rows], hi_s.at[slot], bar)

    def reduce_dq(n: jax.Array, ds_t: jax.Array, dq_ref: Any, ds_s: Any, dq_s: Any) -> None:
        """dQ[rows, head] += dS K of step n (scaled later), through the SMEM stage by TMA."""
        ds_s[...] = ds_t
        plgpu.commit_smem()
        part = _one_matmul(plgpu.transpose_ref(ds_s, (1, 0)), k_s, (bq, k_s.shape[-1]))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's add has read the stage
        dq_s[...] = part
        plgpu.commit_smem()
        start, head = where(n)
        plgpu.copy_smem_to_gmem(dq_s, dq_ref.at[batch, pl.ds(start, bq), head], reduction_op="add")

    def accumulate(dk_acc: Any, dv_acc: Any) -> tuple[jax.Array, jax.Array]:
        def compute(n: jax.Array, slot: jax.Array, masked: bool) -> None:
            plgpu.barrier_wait(ring_bar.at[slot])
            q, do = q_s.at[slot], do_s.at[slot]
            shape = (bk, bq)
            s_t, dp_t = _two_matmuls(
                k_s, plgpu.transpose_ref(q, (1, 0)), v_s, plgpu.transpose_ref(do, (1, 0)), shape
            )
            s_t = s_t * kern.qk_scale
            if masked:
                vis = _visible(lo_s.at[slot], hi_s.at[slot], col0, shape, 0, kern)
                s_t = jnp.where(vis, s_t, -jnp.inf)
            lse = _broadcast(_row_vector(lse_s.at[slot], kern, 0), shape, 0)
            delta = _broadcast(_row_vector(delta_s.at[slot], kern, 0), shape, 0)
            p_t = jnp.exp2(s_t - lse)
            ds_t = (p_t * (dp_t - delta)).astype(k_s.dtype)
            # P^T and dS^T (keys x queries, the accumulators' layout) are the register A
            # operands of dV += P^T dO and dK += dS^T Q.
            plgpu.wgmma(dv_acc, p_t.astype(k_s.dtype), do)
            plgpu.wgmma(dk_acc, ds_t, q)
            if dq is not None:
                reduce_dq(n, ds_t, *dq)

        plgpu.barrier_wait(kv_bar.at[0])
        _ring(total, n_masked, kern.stages, fetch, compute)
        return dk_acc[...], dv_acc[...]

    acc = plgpu.ACC((bk, k_s.shape[-1]), jnp.float32)
    dk, dv = pl.run_scoped(accumulate, acc, acc)
    _store_tile(k_s, dk * kern.scale, dk_ref.at[batch, keys, kv_head])
    _store_tile(v_s, dv, dv_ref.at[batch, keys, kv_head])
    plgpu.wait_smem_to_gmem(0)


def _dkv_fused_kernel(*refs: Any, kern: _Kernel) -> None:
    """_dkv_kernel with dQ: refs are its 11 inputs, the dQ ref, dk, dv, its scratch, then the
    dS^T tile and the dQ stage."""
    inputs, (dq_ref, dk_ref, dv_ref), scratch = refs[:11], refs[11:14], refs[14:]
    *scratch, ds_s, dq_s = scratch
    _dkv_kernel(*inputs, dk_ref, dv_ref, *scratch, kern=kern, dq=(dq_ref, ds_s, dq_s))


def _dq_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    do_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    lo_ref: Any,
    hi_ref: Any,
    index_ref: Any,
    n_partial_ref: Any,
    count_ref: Any,
    dq_ref: Any,
    q_s: Any,
    do_s: Any,
    lse_s: Any,
    delta_s: Any,
    lo_s: Any,
    hi_s: Any,
    k_s: Any,
    v_s: Any,
    row_bar: Any,
    ring_bar: Any,
    *,
    kern: _Kernel,
) -> None:
    """dQ of one (query tile, q head, batch row): tiles are (queries, keys)."""
    bq, bk = kern.block_q, kern.block_k
    tile, head, batch = (lax.axis_index(n) for n in ("tiles", "heads", "batch"))
    kv_head = lax.div(head, jnp.int32(kern.group))
    outer = lax.div(tile, jnp.int32(kern.mask_block_q // bq))
    rows = pl.ds(pl.multiple_of(tile * bq, bq), bq)
    bar = row_bar.at[0]
    plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_s, bar)
    plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_s, bar)
    plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_s, bar)
    plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], delta_s, bar)
    plgpu.copy_gmem_to_smem(lo_ref.at[:, rows], lo_s, bar)
    plgpu.copy_gmem_to_smem(hi_ref.at[:, rows], hi_s, bar)
    per_tile = kern.mask_block_k // bk
    total = count_ref[outer] * per_tile
    n_masked = n_partial_ref[outer] * per_tile

    def fetch(n: jax.Array, slot: Any) -> None:
        keys = pl.ds(_tile_start(index_ref, outer, n, kern.mask_block_k, bk), bk)
        plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_s.at[slot], ring_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_s.at[slot], ring_bar.at[slot])

    def accumulate(dq_acc: Any) -> jax.Array:
        shape = (bq, bk)
        # The row vectors below are TMA destinations: read them only once their copies landed.
        plgpu.barrier_wait(bar)
        lse = _broadcast(_row_vector(lse_s, kern, 1), shape, 1)
        delta = _broadcast(_row_vector(delta_s, kern, 1), shape, 1)

        def compute(n: jax.Array, slot: jax.Array, masked: bool) -> None:
            plgpu.barrier_wait(ring_bar.at[slot])
            k, v = k_s.at[slot], v_s.at[slot]
            s, dp = _two_matmuls(
                q_s, plgpu.transpose_ref(k, (1, 0)), do_s, plgpu.transpose_ref(v, (1, 0)), shape
            )
            s = s * kern.qk_scale
            if masked:
                key0 = _tile_start(index_ref, outer, n, kern.mask_block_k, bk)
                s = jnp.where(_visible(lo_s, hi_s, key0, shape, 1, kern), s, -jnp.inf)
            p = jnp.exp2(s - lse)
            plgpu.wgmma(dq_acc, (p * (dp - delta)).astype(k.dtype), k)  # dS: register A operand

        _ring(total, n_masked, kern.stages, fetch, compute)
        return dq_acc[...]

    dq = pl.run_scoped(accumulate, plgpu.ACC((bq, q_s.shape[-1]), jnp.float32))
    _store_tile(q_s, dq * kern.scale, dq_ref.at[batch, rows, head])
    plgpu.wait_smem_to_gmem(0)


def _kernel_tile(tile: int | None, name: str, mask_tile: int) -> int:
    """The kernel tile `name` (None: 64): a multiple of 64 dividing the mask tile."""
    tile = tile or min(DEFAULT_TILE, mask_tile)
    if tile % WGMMA_ROWS or mask_tile % tile:
        raise ValueError(
            f"{name}={tile} must be a multiple of {WGMMA_ROWS} dividing the mask tile {mask_tile}"
        )
    return tile


def _launch(
    body: Callable[..., None],
    kern: _Kernel,
    grid: tuple[int, int, int],
    out_type: Any,
    scratch: list[Any],
    interpret: Any,
    name: str,
) -> Callable[..., Any]:
    """The kernel over (tiles, heads, batch). A fused launch takes a mutable dQ Ref operand,
    which plgpu.kernel's batching wrapper cannot carry, so it goes through pl.kernel (with the
    scratch allocated inside, as plgpu.kernel does it)."""
    common = dict(
        out_type=out_type,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret if interpret else None,
    )
    grid_names = ("tiles", "heads", "batch")
    body = functools.partial(body, kern=kern)
    if not kern.fused:
        return plgpu.kernel(
            body,
            grid=grid,
            grid_names=grid_names,
            kernel_name=name,
            scratch_types=scratch,
            **common,
        )

    def scoped(*refs: Any) -> None:
        pl.run_scoped(functools.partial(body, *refs), *scratch)

    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, kernel_name=name)
    return pl.kernel(scoped, mesh=mesh, name=name, **common)


def _check(q: jax.Array, k: jax.Array, arrays: MaskArrays) -> None:
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        dims = " or ".join(map(str, HEAD_DIMS))
        raise ValueError(f"Mosaic GPU backward needs head_dim {dims}, got {d}")
    if jnp.dtype(q.dtype) not in DTYPES:
        names = " or ".join(t.name for t in DTYPES)
        raise ValueError(f"Mosaic GPU backward needs {names} inputs, got {q.dtype}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
    for tile in (arrays.block_q, arrays.block_k):
        if tile % WGMMA_ROWS:
            raise ValueError(f"mask tiles must be multiples of {WGMMA_ROWS}, got {tile}")


def _kernels(
    q: jax.Array,
    k: jax.Array,
    arrays: MaskArrays,
    *,
    scale: float,
    config: KernelConfig,
    interpret: Any,
) -> tuple[_Kernel, _Kernel]:
    """The static (dK/dV, dQ) kernel descriptions of a call, validated before any launch."""
    mbq, mbk = arrays.block_q, arrays.block_k
    stages = config.num_stages_bwd or config.max_concurrent_steps
    common = dict(
        mask_block_q=mbq,
        mask_block_k=mbk,
        group=q.shape[2] // k.shape[2],
        stages=stages,
        scale=float(scale),
        hints=not interpret,
    )
    return (
        _Kernel(
            block_q=_kernel_tile(config.block_q_dkv, "block_q_dkv", mbq),
            block_k=_kernel_tile(config.block_k_dkv, "block_k_dkv", mbk),
            fused=config.fused_bwd,
            **common,
        ),
        _Kernel(
            block_q=_kernel_tile(config.block_q_dq, "block_q_dq", mbq),
            block_k=_kernel_tile(config.block_k_dq, "block_k_dq", mbk),
            **common,
        ),
    )


def flash_attention_mosaic_bwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    do: jax.Array,
    arrays: MaskArrays,
    *,
    scale: float,
    config: KernelConfig,
    interpret: Any = None,
    dlse: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of masked attention from its residuals (out, natural-log lse), on Hopper.

    Shapes are unpadded (B, S, H, D); lengths are padded to the mask tiles here, padded rows
    and keys contributing nothing. config's backward fields set the kernel sub-tiles and the TMA
    ring depth (KernelConfig), and fused_bwd one kernel for all three gradients. interpret: an
    InterpretGPUParams to run on the CPU (None or False: the GPU). dlse (B, Hq, Sq): the LSE's
    cotangent (None: zero), folded into delta = rowsum(out * do) - dlse.
    """
    _check(q, k, arrays)
    kernels = _kernels(q, k, arrays, scale=scale, config=config, interpret=interpret)
    pad = TilePadding.of(arrays)
    pq, pk = pad.padded_q, pad.padded_k
    delta = pad_axis(softmax_delta(out, do, lse, dlse), 2, pq)
    lse2 = pad_axis(backward_lse(lse.astype(jnp.float32)), 2, pq, jnp.inf)
    qp, dop = pad_axis(q, 1, pq), pad_axis(do.astype(q.dtype), 1, pq)
    kp, vp = pad_axis(k, 1, pk), pad_axis(v, 1, pk)
    lo, hi = padded_intervals(arrays, pad)
    operands = (qp, kp, vp, dop, lse2, delta, lo, hi)
    if kernels[0].fused:
        dk, dv, dq = _dkv_call(operands, key_tile_walk(arrays, pad), kernels[0], interpret)
        dq = (dq * kernels[0].scale).astype(q.dtype)
    else:
        dk, dv = _dkv_call(operands, key_tile_walk(arrays, pad), kernels[0], interpret)
        dq = _dq_call(operands, query_tile_walk(arrays, pad), kernels[1], interpret)
    return dq[:, : pad.seq_q], dk[:, : pad.seq_k], dv[:, : pad.seq_k]


def _dkv_call(operands: tuple, lists: TileWalk, kern: _Kernel, interpret: Any) -> tuple:
    """dK, dV (B, padded Sk, Hkv, D) of padded operands over the per-key-tile q tile lists, and
    when fused the unscaled fp32 dQ (B, padded Sq, Hq, D)."""
    q, k = operands[0], operands[1]
    bq, bk, st, d = kern.block_q, kern.block_k, kern.stages, q.shape[-1]
    intervals = operands[6].shape[0]
    scratch = [
        _tile_smem((bk, d), q.dtype),
        _tile_smem((bk, d), q.dtype),
        _tile_smem((st, bq, d), q.dtype),
        _tile_smem((st, bq, d), q.dtype),
        plgpu.SMEM((st, bq), jnp.float32),
        plgpu.SMEM((st, bq), jnp.float32),
        plgpu.SMEM((st, intervals, bq), jnp.int32),
        plgpu.SMEM((st, intervals, bq), jnp.int32),
        plgpu.Barrier(num_arrivals=2, num_barriers=1),
        plgpu.Barrier(num_arrivals=6, num_barriers=st),
    ]
    grid = (k.shape[1] // bk, k.shape[2], k.shape[0])
    out_type = [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2
    if not kern.fused:
        call = _launch(_dkv_kernel, kern, grid, out_type, scratch, interpret, "mosaic_flash_dkv")
        return tuple(call(*operands, *lists))
    scratch += [_tile_smem((bk, bq), q.dtype), plgpu.SMEM((bq, d), jnp.float32)]
    dq = jax.new_ref(jnp.zeros(q.shape, jnp.float32), memory_space=plgpu.GMEM)
    call = _launch(_dkv_fused_kernel, kern, grid, out_type, scratch, interpret, "mosaic_flash_bwd")
    dk, dv = call(*operands, *lists, dq)
    return dk, dv, dq[...]


def _dq_call(operands: tuple, lists: TileWalk, kern: _Kernel, interpret: Any) -> jax.Array:
    """dQ (B, padded Sq, Hq, D) of padded operands over the per-query-tile key tile lists."""
    q = operands[0]
    bq, bk, st, d = kern.block_q, kern.block_k, kern.stages, q.shape[-1]
    intervals = operands[6].shape[0]
    scratch = [
        _tile_smem((bq, d), q.dtype),
        _tile_smem((bq, d), q.dtype),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.SMEM((intervals, bq), jnp.int32),
        plgpu.SMEM((intervals, bq), jnp.int32),
        _tile_smem((st, bk, d), q.dtype),
        _tile_smem((st, bk, d), q.dtype),
        plgpu.Barrier(num_arrivals=6, num_barriers=1),
        plgpu.Barrier(num_arrivals=2, num_barriers=st),
    ]
    grid = (q.shape[1] // bq, q.shape[2], q.shape[0])
    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    call = _launch(_dq_kernel, kern, grid, out_type, scratch, interpret, "mosaic_flash_dq")
    return call(*operands, *lists)
