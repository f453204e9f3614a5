"""Lazy access to the framework packages and masks by their public names.

Nothing here imports jax, torch or another package of this project at import time, so a
missing piece turns into an "unsupported: not available: ..." point instead of a crash.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType

from experiments.core.outcomes import UNSUPPORTED, PointFailure, not_available
from experiments.core.points import DEFAULT_IMPL, DTYPE_NAMES, ITEMSIZES, Point

KERNEL_PACKAGES = {"jax": "jax_attn", "torch": "torch_attn"}
CP_MODULES = {"jax": "shard_strategies.jax_cp", "torch": "shard_strategies.torch_cp"}


def kernels(framework: str) -> ModuleType:
    """jax_attn or torch_attn (ImportError if not importable, or lacking the public API)."""
    mod = importlib.import_module(KERNEL_PACKAGES[framework])
    for name in ("attention", "IMPLS", "supports"):
        if not hasattr(mod, name):
            raise ImportError(f"cannot import name {name!r} from {mod.__name__!r}")
    return mod


def cp_module(framework: str) -> ModuleType:
    """shard_strategies.jax_cp or .torch_cp (ImportError if not importable)."""
    mod = importlib.import_module(CP_MODULES[framework])
    if not hasattr(mod, "attention"):
        raise ImportError(f"cannot import name 'attention' from {mod.__name__!r}")
    return mod


def cp_kwargs(attention, point: Point) -> dict:
    """Optional CP keywords the executor accepts: the intra-node axis for the placement flag."""

    try:
        params = inspect.signature(attention).parameters
    except (TypeError, ValueError):
        return {}
    return {"inner_axis": inner_axis(point.ulysses_intra_node)} if "inner_axis" in params else {}


def attention_fn(framework: str, point: Point, mask) -> Callable:
    """(q, k, v) -> out for a kernel point's impl (or its tuned kernel config); CP points run
    through their executor (cp_executor)."""
    if point.kernel_config:
        from experiments.runners import tuned_kernel

        return tuned_kernel.attention_fn(point, mask)
    mod = kernels(framework)
    return lambda q, k, v: mod.attention(q, k, v, mask, impl=point.impl)


def cp_executor(framework: str, point: Point, mask, **placement):
    """The executor the framework's CP attention would build for the point (placement: JAX mesh
    and axis, torch group), built once, so that the driver can dispatch inputs into its layout
    outside the timed calls: dispatch, sharded (attention on the shards), undispatch."""
    cp = cp_module(framework)
    dtype = {"dtype": framework_dtype("jax", point.dtype)} if framework == "jax" else {}
    return cp.build(
        mask,
        **placement,
        strategy=point.cp,
        layout=point.layout,
        ulysses_size=point.ulysses_size,
        impl=None if point.impl == DEFAULT_IMPL else point.impl,
        num_heads_q=point.heads_q,
        num_heads_kv=point.heads_kv,
        head_dim=point.head_dim,
        **dtype,
        **cp_kwargs(cp.build, point),
    )


def inner_axis(ulysses_intra_node: bool | None) -> str:
    """The mesh axis made of consecutive devices (the intra-node one) for the CP executors."""
    return "ring" if ulysses_intra_node is False else "ulysses"


def cp_plan_info(point: Point, mask) -> dict:
    """The strategy's plan for this point (load balance, steps, per-rank bytes moved); a
    configuration the plan rejects (e.g. heads that do not split over Ulysses) is unsupported."""

    try:
        import shard_strategies
    except ImportError as e:
        raise not_available(e) from e
    try:
        plan = shard_strategies.make_plan(
            mask,
            point.num_devices,
            point.cp,
            point.layout,
            point.ulysses_size,
            inner_axis=inner_axis(point.ulysses_intra_node),
            num_heads_q=point.heads_q,
            num_heads_kv=point.heads_kv,
            head_dim=point.head_dim,
        )
    except ValueError as e:
        raise PointFailure(UNSUPPORTED, f"not applicable: {e}") from e
    volume = plan.comm_volume(itemsize=ITEMSIZES[point.dtype], batch=point.batch)
    return {"plan": plan.summary(), "comm": volume}


def default_impl(framework: str) -> str:
    """The impl the framework's attention() uses when none is named."""
    return inspect.signature(kernels(framework).attention).parameters["impl"].default


def impl_names(framework: str) -> tuple[str, ...]:
    """The framework's impl names (ImportError if its package is not available)."""
    return tuple(kernels(framework).IMPLS)


def make_masks(point: Point) -> list:
    """The point's masks: num_masks draws from one Random(point.seed) stream, as MaskIterator."""
    try:
        from attn_masks import make_masks as draw_masks
    except ImportError as e:
        raise not_available(e) from e
    try:
        return draw_masks(
            point.mask,
            point.seqlen_total,
            point.num_masks,
            seed=point.seed,
            window=point.window,
            reference_compat=point.reference_compat,
        )
    except ValueError as e:
        raise PointFailure(UNSUPPORTED, f"mask not defined here: {e}") from e


def framework_dtype(framework: str, name: str):
    """The framework's dtype object for 'bf16' / 'fp16' / 'fp32'."""
    full = DTYPE_NAMES[name]
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.dtype(full)
    import torch

    return getattr(torch, full)


def supports(framework: str, impl: str, mask, point: Point) -> bool | str:
    """True or the reason the impl cannot run this point (both frameworks' `supports` take the
    same keywords)."""
    result = kernels(framework).supports(
        impl,
        mask,
        dtype=framework_dtype(point.framework, point.dtype),
        head_dim=point.head_dim,
        heads_q=point.heads_q,
        heads_kv=point.heads_kv,
        mode=point.mode,
    )
    return True if result is True else str(result)


def require_support(framework: str, impl: str, masks: list, point: Point) -> None:
    """Raise an "unsupported" PointFailure unless the impl supports every mask of the point."""
    for m in masks:
        ok = supports(framework, impl, m, point)
        if ok is not True:
            raise PointFailure(UNSUPPORTED, ok)


def available(framework: str) -> tuple[bool, str]:
    """(True, "") if the framework's kernel package imports, else (False, the ImportError)."""
    try:
        kernels(framework)
    except ImportError as e:
        return False, str(e)
    return True, ""
