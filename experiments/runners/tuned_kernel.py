"""The Pallas Triton kernel under a tuning candidate's launch config (--preset=tune_pallas)."""

from __future__ import annotations

from collections.abc import Callable

from experiments.core import tuning
from experiments.core.points import DTYPE_NAMES, Point


def attention_fn(point: Point, mask) -> Callable:
    """(q, k, v) -> out of the Pallas Triton kernel with the point's candidate config."""
    from jax_attn.mask_arrays import prepare_mask
    from jax_attn.pallas_triton import flash_attention

    block_q, block_k, config = tuning.candidate(
        point.kernel_config, point.head_dim, DTYPE_NAMES[point.dtype]
    )
    arrays = prepare_mask(mask, block_q, block_k)
    scale = point.head_dim**-0.5
    return lambda q, k, v: flash_attention(q, k, v, arrays, scale=scale, config=config)
