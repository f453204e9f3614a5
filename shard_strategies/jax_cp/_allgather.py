"""Ring all-gather attention inside shard_map: gather every K/V shard, put them back in global
token order, attend once.

The gathered shards come in layout order, where a document's keys are spread over every rank
(zigzag, balanced); in global order each query row sees its keys in as few intervals as the
mask has, which the block-sparse kernels test per element. Autodiff of lax.all_gather is
lax.psum_scatter and of the reordering a scatter, so dK/dV are reduce-scattered back to their
owners with no custom rule. Memory is O(sequence) per rank (the gathered K/V).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_attn.mask_arrays import MaskArrays

from ._local import local_attention


def allgather_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    arrays: MaskArrays,
    impl: str,
    scale: float,
    axis: str,
    key_order: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Local queries against the keys of every rank along `axis`, gathered in ring-rank order
    and taken in global order: key_order[p] is the gathered slot of real position p."""
    k_all, v_all = (
        jnp.take(
            jax.lax.all_gather(x, axis, axis=1, tiled=True), key_order, axis=1, unique_indices=True
        )
        for x in (k, v)
    )
    return local_attention(q, k_all, v_all, arrays, impl, scale)
