"""In-kernel helpers shared by the forward and backward kernels: matmuls, masks, tile walks."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b
TN = (((0,), (0,)), ((), ()))  # a.T @ b


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


def backward_lse(lse: jax.Array) -> jax.Array:
    """Natural-log LSE in base 2, +inf for empty rows so that exp2(s - lse) is 0 there."""
    return jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)


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

    lse2 is the base-2 LSE of backward_lse; vis (keys, rows) masks a partial tile (None: full).
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
) -> Any:
    """Run step(start, rep, carry, masked) over the listed tiles of `outer` as `tile` sub-tiles.

    Partial tiles come first (masked=True), then full ones; each sub-tile is visited `repeat`
    times in a row (rep = 0..repeat-1, e.g. the q heads sharing one kv head). Trip counts come
    from the count arrays at run time.
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
    carry = lax.fori_loop(0, n_partial, body(True), carry)
    return lax.fori_loop(n_partial, total, body(False), carry)
