"""Padding along one axis: kernels pad sequences to whole tiles internally."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pad_axis(x: jax.Array, axis: int, size: int, value: float = 0.0) -> jax.Array:
    """x extended with `value` along `axis` to length `size` (x itself when already that long)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)
