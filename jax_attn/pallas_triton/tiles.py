"""Tile lists as the kernels walk them: partial tiles first, then full ones, per outer tile.

Runs in jnp inside the jitted wrapper, so MaskArrays stay runtime inputs (no recompile per mask).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TileLists(NamedTuple):
    """index[t, :count[t]] are the inner tiles of outer tile t; the first n_partial need a mask."""

    index: jax.Array
    n_partial: jax.Array
    count: jax.Array


def split_partial_full(
    index: jax.Array,
    count: jax.Array,
    full: jax.Array,
    *,
    ragged_outer: bool,
    padded_inner: int | None,
) -> TileLists:
    """Reorder each row's tiles partial-first; edge tiles over padding become partial.

    Mask.block_map calls a tile FULL over the real rows/cols only, so a padded last outer tile
    (ragged_outer) and the padded inner tile `padded_inner` (None if none) must be masked.
    """
    index = jnp.asarray(index, jnp.int32)
    count = jnp.asarray(count, jnp.int32)
    full = jnp.asarray(full, bool)
    n_outer, width = index.shape
    valid = jnp.arange(width, dtype=jnp.int32)[None, :] < count[:, None]
    full = full & valid
    if padded_inner is not None:
        full = full & (index != padded_inner)
    if ragged_outer:
        full = full & (jnp.arange(n_outer)[:, None] != n_outer - 1)
    partial = valid & ~full
    key = jnp.where(partial, 0, jnp.where(valid, 1, 2)).astype(jnp.int32)
    order = jnp.argsort(key, axis=1, stable=True)
    index = jnp.take_along_axis(index, order, axis=1)
    n_partial = jnp.sum(partial, axis=1, dtype=jnp.int32)
    return TileLists(index, n_partial, count)
