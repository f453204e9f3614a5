"""Context parallelism: framework-neutral plans (layouts, schedules, comm volume) and executors.

`import shard_strategies` imports numpy only; the executors `shard_strategies.jax_cp` (JAX) and
`shard_strategies.torch_cp` (PyTorch) load on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .comm import formula_elements
from .layouts import LAYOUTS, Layout, make_layout
from .plan import CPPlan, Step, check_heads, comm_volume, default_local_impl, make_plan
from .schedules import default_num_windows
from .strategies import STRATEGIES, default_usp_ulysses

_LAZY = ("jax_cp", "torch_cp")

__all__ = [
    "LAYOUTS",
    "STRATEGIES",
    "CPPlan",
    "Layout",
    "Step",
    "check_heads",
    "comm_volume",
    "default_local_impl",
    "default_num_windows",
    "default_usp_ulysses",
    "formula_elements",
    "make_layout",
    "make_plan",
]


def __getattr__(name: str) -> ModuleType:
    """Load the framework executors lazily so the plan layer never imports jax or torch."""
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
