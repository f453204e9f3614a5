"""Impl "triton": triton_attn's block-sparse flash kernels launched from JAX by jax_triton.

The same @triton.jit kernels as torch_attn's impl "triton" (triton_attn.kernels), called with
`jax_triton.triton_call`; the shared flash VJP (jax_attn.flash_vjp) runs the delta
(rowsum(out * dout) - dlse) kernel and the backward kernel (dK/dV and dQ programs in one launch)
from the saved LSE, which is also the residual backward (attention_bwd). Mask tables (tiles from
triton_attn.launch) are built on the host once per (mask, configs) and passed as arrays. CUDA GPUs
only (jax_triton has no CPU path); import-guarded, so without jax-triton supports() says so."""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn_masks import Mask
from attn_masks.cache import MaskCache
from triton_attn import launch

from ..flash_vjp import flash_vjp
from .common import Adapter, Request, Unsupported, first_reason, needs_cuda, needs_static_mask

_LISTS = ("fwd", "dq", "dkdv")


# Process-wide Triton settings that importing jax_triton overwrites (0.3.x sets
# TRITON_CACHE_DIR to "" at import, which leaves every later Triton compilation in the process,
# torch's included, without a cache directory); _import_jax_triton puts them back.
_TRITON_ENV = ("TRITON_CACHE_DIR",)


def _import_jax_triton() -> ModuleType:
    """import jax_triton, leaving the process's Triton environment exactly as it was."""
    before = {name: os.environ.get(name) for name in _TRITON_ENV}
    try:
        return importlib.import_module("jax_triton")
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def modules() -> tuple[ModuleType | None, ModuleType | None, str | None]:
    """(jax_triton, triton_attn.kernels, None), or (None, None, why they cannot be imported)."""
    try:
        jt = _import_jax_triton()
    except ModuleNotFoundError as err:
        if err.name not in ("jax_triton", "triton"):
            return None, None, f"jax-triton cannot be imported ({err})"
        return None, None, f"jax-triton not installed ({err})"
    except ImportError as err:  # e.g. jax without GPU support
        return None, None, f"jax-triton cannot be imported ({err})"
    why = version_mismatch(getattr(jt, "__version__", None), _installed_version("triton"))
    if why is not None:
        return None, None, why
    return jt, importlib.import_module("triton_attn.kernels"), None


# jax-triton releases from this one on need triton >= the paired version: installed beside an
# older triton without its dependencies, they import but stub out the NVIDIA backend.
_JAX_TRITON_NEEDS = ((0, 4), (3, 7))


def _release(version: str | None) -> tuple[int, ...] | None:
    """The leading numeric release of a version string ("3.6.0+git" -> (3, 6, 0))."""
    if not version:
        return None
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_mismatch(jax_triton_version: str | None, triton_version: str | None) -> str | None:
    """Why this jax-triton cannot drive this triton (None: a working pair, or unknown)."""
    jt, tr = _release(jax_triton_version), _release(triton_version)
    (jt_min, tr_min) = _JAX_TRITON_NEEDS
    if jt is None or tr is None or jt < jt_min or tr >= tr_min:
        return None
    return (
        f"jax-triton {jax_triton_version} needs triton >= {'.'.join(map(str, tr_min))}, found "
        f"triton {triton_version} (its NVIDIA backend would be a stub); install "
        f"jax-triton==0.3.1 for triton {triton_version}, or a newer triton"
    )


def _check(req: Request) -> str | None:
    def installed() -> str | None:
        return modules()[2]

    def device() -> str | None:
        cap = req.gpu.capability if req.gpu is not None else None
        if cap is not None and cap < launch.MIN_CAPABILITY:
            need = ".".join(map(str, launch.MIN_CAPABILITY))
            return f"triton kernels need compute capability >= {need}, got {cap}"
        return None

    def inputs() -> str | None:
        dtype = None if req.dtype is None else req.dtype.name
        return launch.check(req.head_dim, dtype)

    return first_reason(
        installed,
        lambda: needs_static_mask(req, "triton"),
        lambda: needs_cuda(req, "triton"),
        device,
        inputs,
    )


@dataclass(frozen=True, eq=False)
class _Tables:
    """Host MaskTables (static, hashed by identity) next to their device arrays."""

    host: launch.MaskTables
    arrays: dict


_TABLES = MaskCache()


def _tables(mask: Mask, configs: launch.KernelConfigs) -> _Tables:
    """Tables of `mask` for `configs`, built and put on the device once per mask object."""

    def build() -> _Tables:
        host = launch.mask_tables(mask, configs)
        with jax.ensure_compile_time_eval():  # concrete device arrays even when called in a trace
            arrays = {"lo": jax.device_put(host.lo), "hi": jax.device_put(host.hi)}
            for name in _LISTS:
                arrays[name] = tuple(jax.device_put(x) for x in getattr(host, name).arrays)
        return _Tables(host, arrays)

    return _TABLES.get(mask, configs, build)


def _configs(head_dim: int, dtype: Any) -> launch.KernelConfigs:
    return launch.default_configs(head_dim, np.dtype(dtype).itemsize)


def _tiles(head_dim: int, dtype: Any) -> tuple[int, int]:
    fwd = _configs(head_dim, dtype).fwd
    return fwd.block_q, fwd.block_k


def _shape(q: jax.Array, k: jax.Array) -> launch.Shape:
    b, sq, hq, d = q.shape
    return launch.Shape(b, sq, k.shape[1], hq, k.shape[2], d)


def _call(kernel, call: launch.Call, arrays: tuple, out_shape: tuple) -> Any:
    jt, _, why = modules()
    if why is not None:
        raise Unsupported(why)
    # A Python float reaches the kernel as fp64 through jax-triton (the torch launcher makes it
    # fp32); the kernels' arithmetic is fp32, so the scalars go as np.float32.
    scalars = tuple(np.float32(x) if isinstance(x, float) else x for x in call.scalars)
    return jt.triton_call(
        *arrays,
        *scalars,
        kernel=kernel,
        out_shape=out_shape,
        grid=call.grid,
        num_warps=call.num_warps,
        num_stages=call.num_stages,
        **call.meta,
    )


def _forward(q, k, v, arrays: dict, static: tuple[_Tables, float]):
    """(out, lse, lse): the forward kernel's output and LSE, which is also the saved residual."""
    tables, scale = static
    _, kernels, _ = modules()
    shape = _shape(q, k)
    call = launch.fwd_call(shape, tables.host, scale, q.dtype == jnp.float32)
    out_shape = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((shape.batch, shape.heads_q, shape.seqlen_q), jnp.float32),
    )
    inputs = (q, k, v, arrays["lo"], arrays["hi"], *arrays["fwd"])
    out, lse = _call(kernels.attn_fwd_kernel, call, inputs, out_shape)
    return out, lse, lse


def _backward(q, k, v, arrays: dict, out, lse, dout, dlse, static: tuple[_Tables, float]):
    """(dq, dk, dv): the delta kernel, then the backward kernel from the saved LSE."""
    tables, scale = static
    _, kernels, _ = modules()
    shape = _shape(q, k)
    ieee = q.dtype == jnp.float32
    dout = dout.astype(q.dtype)
    stat_shape = jax.ShapeDtypeStruct(lse.shape, jnp.float32)
    (delta,) = _call(
        kernels.attn_bwd_delta_kernel,
        launch.delta_call(shape),
        (out.astype(q.dtype), dout, dlse.astype(jnp.float32)),
        (stat_shape,),
    )
    common = (q, k, v, dout, lse, delta, arrays["lo"], arrays["hi"])
    kv_shape = jax.ShapeDtypeStruct(k.shape, k.dtype)
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), kv_shape, kv_shape)
    call = launch.bwd_call(shape, tables.host, scale, ieee)
    lists = (*arrays["dkdv"], *arrays["dq"])
    dq, dk, dv = _call(kernels.attn_bwd_kernel, call, (*common, *lists), out_shape)
    return dq, dk, dv


_attention = flash_vjp(_forward, _backward)


def _run(q, k, v, mask: Mask, *, scale: float, return_lse: bool):
    tables = _tables(mask, _configs(q.shape[-1], q.dtype))
    out, lse = _attention(q, k, v, tables.arrays, (tables, float(scale)))
    return out, (lse if return_lse else None)


def _residual_backward(q, k, v, mask: Mask, out, lse, dout, dlse, *, scale: float):
    tables = _tables(mask, _configs(q.shape[-1], q.dtype))
    return _backward(q, k, v, tables.arrays, out, lse, dout, dlse, (tables, float(scale)))


TRITON = Adapter("triton", _check, _run, tiles=_tiles, backward=_residual_backward)
