"""Ulysses all-to-alls inside shard_map: (local tokens, all heads) <-> (whole shard, H/U heads).

Heads are split in contiguous blocks, which keeps GQA groups together; when U > Hkv each K/V
head is repeated U / Hkv times first so every rank gets the one its query heads use. Autodiff
of an all-to-all is the reverse all-to-all, so the backward needs nothing special.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def seq_to_heads(x: jax.Array, axis: str, replicate: int = 1) -> jax.Array:
    """(B, L/U, H, D) -> (B, L, H*replicate/U, D): gather the shard, keep this rank's heads."""
    if replicate > 1:
        x = jnp.repeat(x, replicate, axis=2)
    return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x: jax.Array, axis: str) -> jax.Array:
    """(B, L, H/U, D) -> (B, L/U, H, D): the inverse of seq_to_heads (without replication)."""
    return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def lse_heads_to_seq(lse: jax.Array, axis: str) -> jax.Array:
    """(B, H/U, L) -> (B, H, L/U): the LSE back to this rank's tokens for all heads."""
    return jax.lax.all_to_all(lse, axis, split_axis=2, concat_axis=1, tiled=True)
