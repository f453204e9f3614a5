"""A step's mask in the form a jitted train step takes as an argument (so it compiles once).

Single device: the impl's MaskArrays padded to fixed widths (full tile lists, a fixed number of
intervals per row), so every document layout of a shape has the same array shapes. CP: a bound
`shard_strategies.jax_cp` executor (a pytree whose static part is the plan's schedule).
"""

from __future__ import annotations

from typing import Any

import jax

import jax_attn
from attn_masks import Mask
from experiments.workloads.nnx_attention import AttentionBackend
from jax_attn.mask_arrays import empty_mask_arrays, stack_mask_arrays

RUNTIME_IMPLS = ("reference", "pallas", "mosaic")


def fixed_shape_arrays(mask: Mask, impl: str, head_dim: int, dtype: Any, intervals: int = 1):
    """Host MaskArrays of `mask` for `impl`, padded to full-width tile lists and at least
    `intervals` key intervals per row."""
    arrays = jax_attn.mask_arrays_for(impl, mask, head_dim, dtype)
    stacked = stack_mask_arrays([arrays, empty_mask_arrays(arrays, intervals)])
    return jax.tree.map(lambda x: x[0], stacked)


def runtime_mask(
    mask: Mask,
    backend: AttentionBackend,
    *,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: Any,
) -> Any:
    """Device-side mask argument for the train step: MaskArrays, or a CP executor."""
    impl = backend.resolved_impl
    if impl not in RUNTIME_IMPLS:
        raise jax_attn.Unsupported(
            f"the train step passes masks as runtime arrays, which only {RUNTIME_IMPLS} take; "
            f"got impl {impl!r}"
        )
    if backend.is_cp:
        from shard_strategies import jax_cp

        return jax_cp.build(
            mask,
            impl=impl,
            num_heads_q=heads_q,
            num_heads_kv=heads_kv,
            head_dim=head_dim,
            dtype=dtype,
            **backend.cp_settings,
        )
    return jax.device_put(fixed_shape_arrays(mask, impl, head_dim, dtype))
