"""Ring all-gather attention inside shard_map: gather every K/V shard, attend once.

Autodiff of lax.all_gather is lax.psum_scatter, so dK/dV are reduce-scattered back to their
owners with no custom rule. Memory is O(sequence) per rank (the gathered K/V).
"""

from __future__ import annotations

import jax

from jax_attn.mask_arrays import MaskArrays

from ._local import local_attention


def allgather_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, arrays: MaskArrays, impl: str, scale: float, axis: str
) -> tuple[jax.Array, jax.Array]:
    """Local queries against the keys of every rank along `axis`, in ring-rank order."""
    k_all = jax.lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, axis, axis=1, tiled=True)
    return local_attention(q, k_all, v_all, arrays, impl, scale)
