"""Helpers shared by the forward and backward kernels: matmuls, masks, tile walks, BlockSpecs.

The in-kernel helpers are plain Python functions called while the kernel body is traced, so
everything they emit is inlined into the one kernel (no calls, nothing changes in the program).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b
TN = (((0,), (0,)), ((), ()))  # a.T @ b
Specs = tuple[pl.BlockSpec, pl.BlockSpec, pl.BlockSpec]
Launch = tuple[Callable[..., None], tuple[int, int], Specs]  # kernel, grid, specs


def triton_params(num_warps: int, num_stages: int) -> Any:
    """Triton compiler parameters (CompilerParams; TritonCompilerParams before jax 0.7)."""
    cls = getattr(pl_triton, "CompilerParams", None) or pl_triton.TritonCompilerParams
    return cls(num_warps=num_warps, num_stages=num_stages)


def precision_for(dtype: Any) -> lax.Precision:
    """fp32 inputs get exact (IEEE) products, half types the tensor-core default."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize > 2 else lax.Precision.DEFAULT


def matmul(a: jax.Array, b: jax.Array, dims: Any, precision: lax.Precision) -> jax.Array:
    """a @ b (dims NN) or a @ b.T (dims NT) with an fp32 accumulator."""
    return lax.dot_general(
        a, b, dims, precision=(precision, precision), preferred_element_type=jnp.float32
    )


def whole_spec(x: jax.Array) -> pl.BlockSpec:
    """The whole array as one block, for every program of a 2-D grid."""
    return pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)


def mask_specs(lo: jax.Array, hi: jax.Array, lists: Sequence[jax.Array]) -> list[pl.BlockSpec]:
    """Whole-array specs of the mask operands: lo, hi, then the PartialFirst walk (index, n_partial,
    count), passed to the kernel in that order as (lo, hi, *lists)."""
    return [whole_spec(x) for x in (lo, hi, *lists)]


def backward_specs(
    q_spec: pl.BlockSpec,
    kv_spec: pl.BlockSpec,
    row_spec: pl.BlockSpec,
    lo: jax.Array,
    hi: jax.Array,
    lists: Sequence[jax.Array],
) -> list[pl.BlockSpec]:
    """in_specs of the backward operands (q, k, v, do, lse, delta, lo, hi, *lists)."""
    return [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *mask_specs(lo, hi, lists)]


def query_tile_specs(q: jax.Array, k: jax.Array, block_q: int) -> Specs:
    """Specs of a (query tile, batch * q head) grid whose query tiles run last first.

    (q-like: block_q rows of one q head; K/V-like: every key of that head's kv head; per-row
    (B, Hq, Sq) arrays such as the LSE: block_q rows of the head.)
    """
    seq_q, heads_q, dim = q.shape[1], q.shape[2], q.shape[3]
    seq_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    num_q_tiles = seq_q // block_q

    def q_map(i: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_q), num_q_tiles - 1 - i, lax.rem(bh, heads_q), 0

    def kv_map(i: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_q), 0, lax.div(lax.rem(bh, heads_q), group), 0

    def row_map(i: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_q), lax.rem(bh, heads_q), num_q_tiles - 1 - i

    return (
        pl.BlockSpec((None, block_q, None, dim), q_map),
        pl.BlockSpec((None, seq_k, None, dim), kv_map),
        pl.BlockSpec((None, None, block_q), row_map),
    )


def key_tile_specs(q: jax.Array, k: jax.Array, block_k: int, chunks: int = 1) -> Specs:
    """Specs of a (key tile * chunks, batch * kv head) grid (program j: key tile j // chunks).

    (K/V-like: block_k keys of one kv head; q-like: the whole (Sq, Hq, D) sequence of the batch
    row, every head, since the program loops over the q heads of its group; per-row (B, Hq, Sq)
    arrays: all heads and rows of the batch row.)
    """
    seq_q, heads_q, dim = q.shape[1], q.shape[2], q.shape[3]
    heads_kv = k.shape[2]

    def kv_map(j: jax.Array, bh: jax.Array) -> tuple:
        tile = lax.div(j, chunks) if chunks > 1 else j
        return lax.div(bh, heads_kv), tile, lax.rem(bh, heads_kv), 0

    def seq_map(j: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_kv), 0, 0, 0

    def row_map(j: jax.Array, bh: jax.Array) -> tuple:
        return lax.div(bh, heads_kv), 0, 0

    return (
        pl.BlockSpec((None, block_k, None, dim), kv_map),
        pl.BlockSpec((None, seq_q, heads_q, dim), seq_map),
        pl.BlockSpec((None, heads_q, seq_q), row_map),
    )


def chunk_spec(k: jax.Array, block_k: int, chunks: int) -> pl.BlockSpec:
    """Spec of a (chunks, B, Sk, Hkv, D) partial-sum output of a key_tile_specs grid: program
    j writes the block_k keys of key tile j // chunks into slot j mod chunks."""
    heads_kv, dim = k.shape[2], k.shape[3]

    def index_map(j: jax.Array, bh: jax.Array) -> tuple:
        return (
            lax.rem(j, chunks),
            lax.div(bh, heads_kv),
            lax.div(j, chunks),
            lax.rem(bh, heads_kv),
            0,
        )

    return pl.BlockSpec((None, None, block_k, None, dim), index_map)


def query_tile_launch(
    kernel: Callable[..., None],
    q: jax.Array,
    k: jax.Array,
    block_q: int,
    block_k: int,
    *,
    scale: float,
    mask_block_q: int,
    mask_block_k: int,
) -> Launch:
    """(kernel with its static arguments, grid, query_tile_specs) of a query-tile kernel."""
    batch, seq_q, heads_q = q.shape[0], q.shape[1], q.shape[2]
    num_q_tiles = seq_q // block_q
    kernel = functools.partial(
        kernel,
        scale=scale,
        num_q_tiles=num_q_tiles,
        mask_block_q=mask_block_q,
        mask_block_k=mask_block_k,
        block_k=block_k,
    )
    return kernel, (num_q_tiles, batch * heads_q), query_tile_specs(q, k, block_q)


def key_tile_launch(
    kernel: Callable[..., None],
    q: jax.Array,
    k: jax.Array,
    block_q: int,
    block_k: int,
    *,
    scale: float,
    mask_block_q: int,
    mask_block_k: int,
    chunks: int = 1,
    **extra: Any,
) -> Launch:
    """(kernel with its static arguments, grid, key_tile_specs) of a key-tile kernel.

    chunks > 1: each key tile gets `chunks` programs (adjacent along grid axis 0), each walking
    one contiguous share of the tile's steps (walk_tiles' chunk).
    """
    batch, heads_q = q.shape[0], q.shape[2]
    seq_k, heads_kv = k.shape[1], k.shape[2]
    kernel = functools.partial(
        kernel,
        scale=scale,
        heads_kv=heads_kv,
        group=heads_q // heads_kv,
        mask_block_q=mask_block_q,
        mask_block_k=mask_block_k,
        block_q=block_q,
        **({"chunks": chunks} if chunks > 1 else {}),
        **extra,
    )
    grid = (seq_k // block_k * chunks, batch * heads_kv)
    return kernel, grid, key_tile_specs(q, k, block_k, chunks)


def query_tile(num_q_tiles: int, block_q: int, mask_block_q: int) -> tuple[jax.Array, jax.Array]:
    """(first row, mask tile) of this program's query tile; tiles run last first (the longest
    rows of causal masks start first), matching query_tile_specs."""
    tile = num_q_tiles - 1 - pl.program_id(0)
    row0 = tile * block_q
    return row0, lax.div(tile, mask_block_q // block_q)


def key_tile(
    block_k: int, mask_block_k: int, heads_kv: int, group: int, chunks: int = 1
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(tile, first key, mask tile, first q head of the group) of this key-tile program
    (key tile program_id(0) // chunks, matching key_tile_specs)."""
    tile = lax.div(pl.program_id(0), chunks) if chunks > 1 else pl.program_id(0)
    col0 = tile * block_k
    outer = lax.div(tile, mask_block_k // block_k)
    head0 = lax.rem(pl.program_id(1), heads_kv) * group
    return tile, col0, outer, head0


def load_intervals(
    lo_ref: Any, hi_ref: Any, start: jax.Array, size: int
) -> list[tuple[jax.Array, jax.Array]]:
    """The K key intervals [lo, hi) of `size` consecutive query rows from (K, Sq) refs."""
    return [
        (lo_ref[r, pl.ds(start, size)], hi_ref[r, pl.ds(start, size)])
        for r in range(lo_ref.shape[0])
    ]


def visible(
    intervals: Sequence[tuple[jax.Array, jax.Array]],
    key_start: jax.Array,
    num_keys: int,
    *,
    keys_first: bool,
) -> jax.Array:
    """Visibility of a tile: (rows, keys), or (keys, rows) when keys_first."""
    cols = key_start + lax.broadcasted_iota(jnp.int32, (num_keys,), 0)
    cols = cols[:, None] if keys_first else cols[None, :]
    out = None
    for lo, hi in intervals:
        lo = lo[None, :] if keys_first else lo[:, None]
        hi = hi[None, :] if keys_first else hi[:, None]
        inside = (cols >= lo) & (cols < hi)
        out = inside if out is None else out | inside
    return out


def scores(
    q: jax.Array,
    k: jax.Array,
    intervals: Sequence[tuple[jax.Array, jax.Array]],
    key_start: jax.Array,
    masked: bool,
    *,
    qk_scale: float,
    precision: lax.Precision,
) -> jax.Array:
    """Base-2 scores q @ k.T * qk_scale of a (rows, keys) tile, -inf where a masked tile hides."""
    s = matmul(q, k, NT, precision) * qk_scale
    if masked:
        s = jnp.where(visible(intervals, key_start, k.shape[0], keys_first=False), s, -jnp.inf)
    return s


def dkv_update(
    k: jax.Array,
    v: jax.Array,
    q: jax.Array,
    do: jax.Array,
    lse2: jax.Array,
    delta: jax.Array,
    vis: jax.Array | None,
    carry: tuple[jax.Array, jax.Array],
    *,
    qk_scale: float,
    precision: lax.Precision,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dK, dV) plus one query sub-tile, keys first; also dS^T (keys, rows) in q's dtype.

    lse2 is the base-2 LSE (kernel_inputs.backward_lse); vis (keys, rows) masks a partial tile
    (None: full).
    """
    dk, dv = carry
    s_t = matmul(k, q, NT, precision) * qk_scale
    if vis is not None:
        s_t = jnp.where(vis, s_t, -jnp.inf)
    p_t = jnp.exp2(s_t - lse2[None, :])
    dv = dv + matmul(p_t.astype(do.dtype), do, NN, precision)
    dp_t = matmul(v, do, NT, precision)
    ds_t = (p_t * (dp_t - delta[None, :])).astype(q.dtype)
    dk = dk + matmul(ds_t, q, NN, precision)
    return dk, dv, ds_t


Step = Callable[[jax.Array, jax.Array, Any, bool], Any]


def walk_tiles(
    index_ref: Any,
    n_partial_ref: Any,
    count_ref: Any,
    outer: jax.Array,
    carry: Any,
    step: Step,
    *,
    mask_tile: int,
    tile: int,
    repeat: int = 1,
    chunks: int = 1,
    chunk: jax.Array | None = None,
) -> Any:
    """Run step(start, rep, carry, masked) over the listed tiles of `outer` as `tile` sub-tiles.

    Partial tiles come first (masked=True), then full ones; each sub-tile is visited `repeat`
    times in a row (rep = 0..repeat-1, e.g. the q heads sharing one kv head). Trip counts come
    from the count arrays at run time. chunks > 1: only steps [chunk * n, (chunk + 1) * n) of
    the walk run, n = ceil(steps / chunks), so `chunks` programs share one walk evenly (a chunk
    past the end runs nothing).
    """
    split = mask_tile // tile
    per_tile = split * repeat

    def start_of(n: jax.Array) -> tuple[jax.Array, jax.Array]:
        rep = lax.rem(n, repeat) if repeat > 1 else jnp.int32(0)
        unit = lax.div(n, repeat) if repeat > 1 else n
        if split == 1:
            return index_ref[outer, unit] * mask_tile, rep
        entry = index_ref[outer, lax.div(unit, split)]
        return entry * mask_tile + lax.rem(unit, split) * tile, rep

    def body(masked: bool) -> Callable[[jax.Array, Any], Any]:
        def run(n: jax.Array, c: Any) -> Any:
            start, rep = start_of(n)
            return step(pl.multiple_of(start, tile), rep, c, masked)

        return run

    n_partial = n_partial_ref[outer] * per_tile
    total = count_ref[outer] * per_tile
    if chunks == 1:
        carry = lax.fori_loop(0, n_partial, body(True), carry)
        return lax.fori_loop(n_partial, total, body(False), carry)
    size = lax.div(total + (chunks - 1), chunks)
    first = jnp.minimum(chunk * size, total)
    last = jnp.minimum(first + size, total)
    carry = lax.fori_loop(first, jnp.minimum(n_partial, last), body(True), carry)
    return lax.fori_loop(jnp.maximum(n_partial, first), last, body(False), carry)
