"""A step's mask in the form a jitted train step takes as an argument (so it compiles once).

Single device: the impl's MaskArrays padded to fixed widths (full tile lists, a fixed number of
intervals per row), so every document layout of a shape has the same array shapes. Impls that
take a mask only at compile time (xla, cudnn, triton) get a StaticMask: the mask is part of the
step's structure, so a run compiles once per document layout, which --lm_fixed_layout keeps to
one. CP: a bound `shard_strategies.jax_cp` executor (a pytree whose static part is the plan's
schedule); the train step dispatches its batch into the executor's layout once and hands the
model the executor as an InLayout, so every layer's attention runs on dispatched arrays.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import tree_util

import jax_attn
from attn_masks import Mask
from experiments.workloads.nnx_attention import AttentionBackend
from jax_attn.mask_arrays import empty_mask_arrays, stack_mask_arrays

RUNTIME_IMPLS = ("reference", "pallas", "mosaic")


@tree_util.register_pytree_node_class
class StaticMask:
    """A mask an impl needs at compile time, carried as a pytree without leaves: the compiled
    step is keyed on it (masks compare by identity), and calling it runs the attention."""

    def __init__(self, mask: Mask, impl: str) -> None:
        self.mask, self.impl = mask, impl

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax_attn.attention(q, k, v, self.mask, impl=self.impl)

    def tree_flatten(self) -> tuple[tuple, tuple[Mask, str]]:
        return (), (self.mask, self.impl)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Mask, str], children: tuple) -> StaticMask:
        return cls(*aux)


@tree_util.register_pytree_node_class
class InLayout:
    """A CP executor as the mask of a model that runs in the executor's layout order (its
    inputs dispatched once per batch): attention takes and returns dispatched arrays, so no layer
    pays the permutation into and out of the layout."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return self.executor.sharded(q, k, v)

    def tree_flatten(self) -> tuple[tuple, None]:
        return (self.executor,), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple) -> InLayout:
        return cls(*children)


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
    fixed_layout: bool = False,
) -> Any:
    """Device-side mask argument for the train step: MaskArrays, a StaticMask (when the impl
    takes masks only at compile time and every step has the same document layout), or a CP
    executor."""
    impl = backend.resolved_impl
    if impl not in RUNTIME_IMPLS:
        if backend.is_cp or not fixed_layout:
            raise jax_attn.Unsupported(
                f"impl {impl!r} takes a mask only at compile time; the train step runs it on "
                f"one device with --lm_fixed_layout (one document layout for every step, one "
                f"compilation); runtime masks: {', '.join(RUNTIME_IMPLS)}"
            )
        reason = jax_attn.supports(
            impl, mask, dtype=dtype, head_dim=head_dim, heads_q=heads_q, heads_kv=heads_kv
        )
        if reason is not True:
            raise jax_attn.Unsupported(reason)
        return StaticMask(mask, impl)
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
