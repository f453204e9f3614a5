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

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from attn_masks import PartialFirst

from ..kernel_inputs import (
    TilePadding,
    backward_lse,
    pad_axis,
    softmax_delta,
)
from ..mask_arrays import MaskArrays
from . import dkv_specialized, dq_specialized
from .bwd_steps import (
    DEFAULT_TILE,
    QUERY_COPIES,
    WGMMA_ROWS,
    Kernel,
    QueryTiles,
    accumulate_dkv,
    add_dq,
    broadcast,
    dkv_step,
    dq_step,
    fetch_queries,
    launch,
    launch_dkv,
    query_ring,
    row_vector,
    store_tile,
    tile_smem,
    tile_start,
)
from .config import (
    CONSUMER_WARPGROUPS,
    DTYPES,
    HEAD_DIMS,
    KernelConfig,
    backward_form,
    dkv_block_q,
    dkv_head_split,
    launch_tiles_fastest,
    paired_walks,
)
from .mask_operands import MaskOperands, mask_operands


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
    kern: Kernel,
    dq: tuple[Any, Any, Any] | None = None,
) -> None:
    """dK, dV of one (key tile, kv head, batch row): tiles are (keys, queries), keys first.
    dq = (fp32 dQ in GMEM, a (block_k, block_q) SMEM tile for dS^T, an fp32 (block_q, D) SMEM
    stage): also add each step's dS K to that dQ."""
    bq, bk = kern.block_q, kern.block_k
    tile, kv_head, batch = (lax.axis_index(n) for n in ("tiles", "heads", "batch"))
    col0 = tile * bk
    outer = lax.div(tile, jnp.int32(kern.mask_block_k // bk))
    walk = QueryTiles.of(kern, (index_ref, n_partial_ref, count_ref), outer, kv_head)
    keys = pl.ds(pl.multiple_of(col0, bk), bk)
    plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_s, kv_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_s, kv_bar.at[0])
    total, n_masked = walk.total, walk.masked
    sources = (q_ref, do_ref, lse_ref, delta_ref, lo_ref, hi_ref)
    ring = (q_s, do_s, lse_s, delta_s, lo_s, hi_s)

    def fetch(n: jax.Array, slot: Any) -> None:
        start, head = walk.at(n)
        slots = tuple(x.at[slot] for x in ring)
        fetch_queries(sources, slots, batch, start, head, bq, ring_bar.at[slot])

    def accumulate(dk_acc: Any, dv_acc: Any) -> tuple[jax.Array, jax.Array]:
        def compute(n: jax.Array, slot: jax.Array, masked: bool) -> None:
            plgpu.barrier_wait(ring_bar.at[slot])
            refs = tuple(x.at[slot] for x in ring)
            ds_t = dkv_step(kern, k_s, v_s, refs, col0, masked, dk_acc, dv_acc)
            if dq is not None:
                dq_ref, ds_s, dq_s = dq
                start, head = walk.at(n)
                add_dq(ds_t, k_s, ds_s, dq_s, dq_ref.at[batch, pl.ds(start, bq), head])

        plgpu.barrier_wait(kv_bar.at[0])
        _ring(total, n_masked, kern.stages, fetch, compute)
        return dk_acc[...], dv_acc[...]

    accumulate_dkv(
        accumulate, kern, k_s, v_s, *(x.at[batch, keys, kv_head] for x in (dk_ref, dv_ref))
    )


def _dkv_fused_kernel(*refs: Any, kern: Kernel) -> None:
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
    kern: Kernel,
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
        keys = pl.ds(tile_start(index_ref, outer, n, kern.mask_block_k, bk), bk)
        plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_s.at[slot], ring_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_s.at[slot], ring_bar.at[slot])

    def accumulate(dq_acc: Any) -> jax.Array:
        shape = (bq, bk)
        # The row vectors below are TMA destinations: read them only once their copies landed.
        plgpu.barrier_wait(bar)
        lse = broadcast(row_vector(lse_s, kern, 1), shape, 1)
        delta = broadcast(row_vector(delta_s, kern, 1), shape, 1)

        def compute(n: jax.Array, slot: jax.Array, masked: bool) -> None:
            plgpu.barrier_wait(ring_bar.at[slot])
            key0 = tile_start(index_ref, outer, n, kern.mask_block_k, bk) if masked else None
            rows = (q_s, do_s, lo_s, hi_s, lse, delta)
            dq_step(kern, rows, k_s.at[slot], v_s.at[slot], key0, masked, dq_acc)

        _ring(total, n_masked, kern.stages, fetch, compute)
        return dq_acc[...]

    dq = pl.run_scoped(accumulate, plgpu.ACC((bq, q_s.shape[-1]), jnp.float32))
    store_tile(q_s, dq * kern.scale, dq_ref.at[batch, rows, head])
    plgpu.wait_smem_to_gmem(0)


def _check_split(field: str, mask_name: str, mask_tile: int, tile_name: str, tile: int) -> None:
    """ValueError unless the mask tile splits into CTAs of one kernel tile per consumer, as the
    warp-specialised kernel that `field`=2 selects needs."""
    n = CONSUMER_WARPGROUPS
    if mask_tile % (n * tile):
        raise ValueError(
            f"{field}={n} splits each mask tile into CTAs of {n} consumer warpgroups of one "
            f"{tile_name} ({tile_name} None: {WGMMA_ROWS}): it needs {mask_name} a multiple of "
            f"{n} * {tile_name}, got {mask_name}={mask_tile}, {tile_name}={tile}"
        )


def _kernel_tile(tile: int | None, name: str, mask_tile: int) -> int:
    """The kernel tile `name` (None: 64): a multiple of 64 dividing the mask tile."""
    tile = tile or min(DEFAULT_TILE, mask_tile)
    if tile % WGMMA_ROWS or mask_tile % tile:
        raise ValueError(
            f"{name}={tile} must be a multiple of {WGMMA_ROWS} dividing the mask tile {mask_tile}"
        )
    return tile


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
) -> tuple[Kernel, Kernel]:
    """The static (dK/dV, dQ) kernel descriptions of a call, validated before any launch."""
    config = backward_form(config, few_partial_tiles=arrays.few_partial_tiles)
    mbq, mbk = arrays.block_q, arrays.block_k
    stages = config.num_stages_bwd or config.max_concurrent_steps
    group = q.shape[2] // k.shape[2]
    dkv_tile = _kernel_tile(config.block_k_dkv, "block_k_dkv", mbk)
    cta_keys = dkv_tile * config.bwd_warpgroups
    dkv_ctas = -(-k.shape[1] // mbk) * (mbk // cta_keys) * k.shape[2] * k.shape[0]
    split = dkv_head_split(config, group=group, walk_peak=arrays.walk_peak, dkv_ctas=dkv_ctas)
    if group % split:
        raise ValueError(
            f"dkv_head_split={split} must divide the GQA group: {q.shape[2]} q heads over "
            f"{k.shape[2]} K/V heads is a group of {group}"
        )
    common = dict(
        mask_block_q=mbq,
        mask_block_k=mbk,
        group=group,
        stages=stages,
        scale=float(scale),
        hints=not interpret,
        tiles_fastest=launch_tiles_fastest(config, group=group, uneven_walks=arrays.uneven_walks),
        overlap=config.bwd_overlap,
        registers=(config.consumer_registers, config.producer_registers),
    )
    dq_tile = _kernel_tile(config.block_q_dq, "block_q_dq", mbq)
    if config.bwd_warpgroups == CONSUMER_WARPGROUPS:
        _check_split("bwd_warpgroups", "block_k", mbk, "block_k_dkv", dkv_tile)
    if config.dq_warpgroups == CONSUMER_WARPGROUPS:
        _check_split("dq_warpgroups", "the mask's block_q", mbq, "block_q_dq", dq_tile)
    return (
        Kernel(
            block_q=_kernel_tile(
                dkv_block_q(
                    config,
                    head_dim=q.shape[3],
                    mask_block_q=mbq,
                    few_partial_tiles=arrays.few_partial_tiles,
                ),
                "block_q_dkv",
                mbq,
            ),
            block_k=dkv_tile,
            fused=config.fused_bwd,
            head_split=split,
            pingpong=config.bwd_pingpong,
            consumer_copies=config.dkv_consumer_copies,
            step_descriptors=config.dkv_step_descriptors,
            paired=paired_walks(config, even_pairs=arrays.even_pairs),
            **common,
        ),
        Kernel(
            block_q=dq_tile,
            block_k=_kernel_tile(config.block_k_dq, "block_k_dq", mbk),
            pingpong=config.bwd_pingpong and config.dq_warpgroups == CONSUMER_WARPGROUPS,
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
    operands: MaskOperands | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of masked attention from its residuals (out, natural-log lse), on Hopper.

    Shapes are unpadded (B, S, H, D); lengths are padded to the mask tiles here, padded rows
    and keys contributing nothing. config's backward fields set the kernel sub-tiles and the TMA
    ring depth (KernelConfig), fused_bwd one kernel for all three gradients, bwd_warpgroups=2
    the warp-specialised dK/dV kernel (dkv_specialized.py), dq_warpgroups=2 the
    warp-specialised dQ kernel (dq_specialized.py). interpret: an
    InterpretGPUParams to run on the CPU (None or False: the GPU). dlse (B, Hq, Sq): the LSE's
    cotangent (None: zero), folded into delta = rowsum(out * do) - dlse. operands: the
    arrays' mask_operands for this call (None: built here).
    """
    _check(q, k, arrays)
    if operands is None:
        operands = mask_operands(q, k, arrays, config=config, deal=False)
    kernels = _kernels(q, k, arrays, scale=scale, config=config, interpret=interpret)
    pad = TilePadding.of(arrays)
    pq, pk = pad.padded_q, pad.padded_k
    delta = pad_axis(softmax_delta(out, do, lse, dlse), 2, pq)
    lse2 = pad_axis(backward_lse(lse.astype(jnp.float32)), 2, pq, jnp.inf)
    qp, dop = pad_axis(q, 1, pq), pad_axis(do.astype(q.dtype), 1, pq)
    kp, vp = pad_axis(k, 1, pk), pad_axis(v, 1, pk)
    padded = (qp, kp, vp, dop, lse2, delta, operands.lo, operands.hi)
    dkv = dkv_specialized.dkv_call if config.bwd_warpgroups == CONSUMER_WARPGROUPS else _dkv_call
    grads = dkv(padded, operands.key_walk, kernels[0], interpret)
    if kernels[0].fused:
        dk, dv, dq = grads
        dq = (dq * kernels[0].scale).astype(q.dtype)
    else:
        dk, dv = grads
        dq_call = (
            dq_specialized.dq_call if config.dq_warpgroups == CONSUMER_WARPGROUPS else _dq_call
        )
        dq = dq_call(padded, operands.query_walk, kernels[1], interpret)
    return dq[:, : pad.seq_q], dk[:, : pad.seq_k], dv[:, : pad.seq_k]


def _dkv_call(operands: tuple, lists: PartialFirst, kern: Kernel, interpret: Any) -> tuple:
    """dK, dV (B, padded Sk, Hkv, D) of padded operands over the per-key-tile q tile lists, and
    when fused the unscaled fp32 dQ (B, padded Sq, Hq, D)."""
    q, k = operands[0], operands[1]
    bq, bk, st, d = kern.block_q, kern.block_k, kern.stages, q.shape[-1]
    intervals = operands[6].shape[0]
    scratch = [
        tile_smem((bk, d), q.dtype),
        tile_smem((bk, d), q.dtype),
        *query_ring(st, bq, d, q.dtype, intervals),
        plgpu.Barrier(num_arrivals=2, num_barriers=1),
        plgpu.Barrier(num_arrivals=QUERY_COPIES, num_barriers=st),
    ]
    if kern.fused:  # the dS^T tile (read transposed as dQ's A operand) and the fp32 dQ stage
        scratch += [tile_smem((bk, bq), q.dtype), plgpu.SMEM((bq, d), jnp.float32)]
    grid = (k.shape[1] // bk, k.shape[2], k.shape[0])
    body = _dkv_fused_kernel if kern.fused else _dkv_kernel
    return launch_dkv(body, kern, grid, scratch, (*operands, *lists), interpret, "mosaic_flash_dkv")


def _dq_call(operands: tuple, lists: PartialFirst, kern: Kernel, interpret: Any) -> jax.Array:
    """dQ (B, padded Sq, Hq, D) of padded operands over the per-query-tile key tile lists."""
    q = operands[0]
    bq, bk, st, d = kern.block_q, kern.block_k, kern.stages, q.shape[-1]
    intervals = operands[6].shape[0]
    scratch = [
        tile_smem((bq, d), q.dtype),
        tile_smem((bq, d), q.dtype),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.SMEM((intervals, bq), jnp.int32),
        plgpu.SMEM((intervals, bq), jnp.int32),
        tile_smem((st, bk, d), q.dtype),
        tile_smem((st, bk, d), q.dtype),
        plgpu.Barrier(num_arrivals=6, num_barriers=1),
        plgpu.Barrier(num_arrivals=2, num_barriers=st),
    ]
    grid = (q.shape[1] // bq, q.shape[2], q.shape[0])
    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    call = launch(_dq_kernel, kern, grid, out_type, scratch, interpret, "mosaic_flash_dq")
    return call(*operands, *lists)
