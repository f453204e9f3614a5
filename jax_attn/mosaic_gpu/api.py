"""Public entry point of the Mosaic GPU kernel: padding, tile lists, GQA, custom VJP."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from attn_masks.shapes import check_attention_shapes

from ..flash_vjp import flash_vjp
from ..kernel_inputs import TilePadding, pad_axis
from ..mask_arrays import MaskArrays
from .backward import flash_attention_mosaic_bwd
from .config import CONSUMER_WARPGROUPS, KernelConfig, default_config, launch_tiles_fastest
from .forward import forward
from .interpret import interpret_params
from .mask_operands import MaskOperands, mask_operands

INTERPRET_MIN_CPU_DEVICES = 4  # the CPU client's thread pool grows with the device count


def cpu_device_count() -> int:
    """JAX's CPU devices, 0 where the CPU backend is not loaded (JAX_PLATFORMS=cuda, say)."""
    try:
        return len(jax.devices("cpu"))
    except RuntimeError:
        return 0


@dataclasses.dataclass(frozen=True)
class _Static:
    """The compile-time part of a call (hashable: a jit static argument)."""

    scale: float
    config: KernelConfig
    interpret: Any  # False (the GPU) or the InterpretGPUParams to run the CPU interpreter with


def _forward_padded(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    inputs: tuple[MaskArrays, MaskOperands],
    static: _Static,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(out (B,Sq,Hq,D), lse (B,Hq,Sq), lse again: the backward takes it unpadded) of the
    kernel on inputs padded to whole tiles; inputs: the mask arrays and their operands."""
    arrays, operands = inputs
    order = launch_tiles_fastest(
        static.config, group=q.shape[2] // k.shape[2], uneven_walks=arrays.uneven_walks
    )
    cfg = dataclasses.replace(static.config, tiles_fastest=order)
    pad = TilePadding.of(arrays)
    out, lse = forward(
        pad_axis(q, 1, pad.padded_q),
        pad_axis(k, 1, pad.padded_k),
        pad_axis(v, 1, pad.padded_k),
        operands.bounds,
        *operands.query_walk,
        scale=static.scale,
        config=cfg,
        interpret=static.interpret or None,
        items=operands.items,
    )
    lse = lse[:, :, : pad.seq_q]
    return out[:, : pad.seq_q], lse, lse


def _backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    inputs: tuple[MaskArrays, MaskOperands],
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    d_lse: jax.Array,
    static: _Static,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients from the residuals by the Mosaic backward kernels (the LSE's cotangent too)."""
    arrays, operands = inputs
    return flash_attention_mosaic_bwd(
        q,
        k,
        v,
        out,
        lse,
        d_out.astype(q.dtype),
        arrays,
        scale=static.scale,
        config=static.config,
        interpret=static.interpret or None,
        dlse=d_lse,
        operands=operands,
    )


_attention_jit = flash_vjp(_forward_padded, _backward)


def check_inputs(
    q: jax.Array, k: jax.Array, v: jax.Array, arrays: MaskArrays, config: KernelConfig
) -> None:
    """ValueError unless the kernel with `config` can run these inputs and mask arrays."""
    check_attention_shapes(q.shape, k.shape, v.shape, arrays)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if jnp.ndim(arrays.lo) != 2 or jnp.ndim(arrays.kv.index) != 2:
        raise ValueError("flash_attention_mosaic takes the MaskArrays of one mask (no stacking)")
    config.check(q.shape[3], q.dtype, int(arrays.lo.shape[-1]))
    if (arrays.block_q, arrays.block_k) != config.tiles:
        raise ValueError(
            f"MaskArrays tiles ({arrays.block_q}, {arrays.block_k}) do not match the kernel's "
            f"{config.tiles} (CONSUMER_WARPGROUPS * block_q = {CONSUMER_WARPGROUPS} * "
            f"{config.block_q}, block_k): build them with prepare_mask(mask, *config.tiles)"
        )


def resolve_config(q: jax.Array, config: KernelConfig | None) -> KernelConfig:
    """`config`, or the default for q's head dim and dtype."""
    return default_config(q.shape[-1], q.dtype) if config is None else config


def flash_attention_mosaic(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    arrays: MaskArrays,
    *,
    scale: float,
    return_lse: bool = False,
    config: KernelConfig | None = None,
    interpret: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Masked attention (B,Sq,Hq,D) on Hopper via Mosaic GPU, differentiable; optionally LSE.

    arrays must be built with this config's tiles (config.tiles). LSE is (B,Hq,Sq) float32
    natural log, -inf where a row sees no key (its output is 0). interpret=None runs the CPU
    interpreter when the default backend is the CPU (slow; for tests); True runs it anyway, and
    an InterpretGPUParams runs it with those parameters (e.g. its race detector).
    """
    config = resolve_config(q, config)
    check_inputs(q, k, v, arrays, config)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret and cpu_device_count() < INTERPRET_MIN_CPU_DEVICES:
        raise ValueError(
            f"the Mosaic GPU interpreter runs the kernel's {CONSUMER_WARPGROUPS + 1} warpgroups "
            "as concurrent CPU executions that block on each other, which deadlocks with fewer "
            f"than {INTERPRET_MIN_CPU_DEVICES} CPU devices (got {cpu_device_count()}); set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax (and keep "
            "cpu in JAX_PLATFORMS)"
        )
    if interpret is True:
        interpret = interpret_params()
    static = _Static(scale=float(scale), config=config, interpret=interpret or False)
    operands = mask_operands(q, k, arrays, config=config)
    out, lse = _attention_jit(q, k, v, (arrays, operands), static)
    return (out, lse) if return_lse else out
