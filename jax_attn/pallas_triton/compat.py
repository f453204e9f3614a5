"""Version differences of the Pallas Triton API, kept in one place (jax 0.10 CPU, 0.11 GPU)."""

from __future__ import annotations

from typing import Any

from jax.experimental import pallas as _pl
from jax.experimental.pallas import triton as _plgpu


def triton_params(num_warps: int, num_stages: int) -> Any:
    """Triton compiler parameters (CompilerParams; TritonCompilerParams before jax 0.7)."""
    cls = getattr(_plgpu, "CompilerParams", None) or _plgpu.TritonCompilerParams
    return cls(num_warps=num_warps, num_stages=num_stages)


def atomic_add(ref: Any, idx: tuple, value: Any) -> None:
    """ref[idx] += value atomically (pallas.triton.atomic_add; pallas.atomic_add in older jax)."""
    fn = getattr(_plgpu, "atomic_add", None) or _pl.atomic_add
    fn(ref, idx, value)
