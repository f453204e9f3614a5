"""Our own impls: the jnp reference (any mask, any device) and the Pallas Triton kernel."""

from __future__ import annotations

import importlib
from typing import Any

import jax

from attn_masks import Mask

from ..mask_arrays import MaskArrays
from ..reference import reference_attention
from .common import Adapter, Request, Unsupported, device_arrays, spoken_list


def _arrays(mask: Mask | MaskArrays, tiles: tuple[int, int] | None) -> MaskArrays:
    return mask if isinstance(mask, MaskArrays) else device_arrays(mask, tiles)


def _check_reference(req: Request) -> str | None:
    if isinstance(req.mask, MaskArrays) and req.mask.lo.ndim != 2:
        return (
            f"reference takes the MaskArrays of one mask (lo of shape (Sq, K)), got lo of shape "
            f"{tuple(req.mask.lo.shape)}; index the stacked arrays first"
        )
    return None


_reference_jit = jax.jit(reference_attention, static_argnames=("scale",))


def _run_reference(q, k, v, mask, *, scale: float, return_lse: bool):
    out, lse = _reference_jit(q, k, v, _arrays(mask, None), scale=scale)
    return out, (lse if return_lse else None)


REFERENCE = Adapter("reference", _check_reference, _run_reference)


def pallas_module() -> tuple[Any, str | None]:
    """(jax_attn.pallas_triton, None), or (None, why it cannot be imported)."""
    try:
        return importlib.import_module("jax_attn.pallas_triton"), None
    except ImportError as err:
        return None, f"pallas needs jax_attn.pallas_triton, which cannot be imported ({err})"


def _pallas_tiles(head_dim: int, dtype: Any) -> tuple[int, int]:
    mod, why = pallas_module()
    if why is not None:
        raise Unsupported(why)
    return tuple(mod.block_sizes(head_dim, dtype))


def _check_pallas(req: Request) -> str | None:
    mod, why = pallas_module()
    if why is not None:
        return why
    if req.backend not in ("gpu", "cpu"):
        return f"pallas runs on a CUDA GPU, or in interpret mode on CPU (backend {req.backend!r})"
    if req.dtype is not None and req.dtype not in mod.DTYPES:
        return f"pallas takes {spoken_list(mod.DTYPES)}, got {req.dtype.name}"
    low, high = mod.MIN_HEAD_DIM, mod.MAX_HEAD_DIM
    if req.head_dim is not None and not low <= req.head_dim <= high:
        return f"pallas needs {low} <= head_dim <= {high}, got {req.head_dim}"
    if isinstance(req.mask, MaskArrays) and req.mask.lo.ndim != 2:
        return (
            f"pallas takes the MaskArrays of one mask (lo of shape (Sq, K)), got lo of shape "
            f"{tuple(req.mask.lo.shape)}; index the stacked arrays first"
        )
    return None


def _run_pallas(q, k, v, mask, *, scale: float, return_lse: bool):
    mod, why = pallas_module()
    if why is not None:
        raise Unsupported(why)
    tiles = None if isinstance(mask, MaskArrays) else _pallas_tiles(q.shape[-1], q.dtype)
    res = mod.flash_attention(q, k, v, _arrays(mask, tiles), scale=scale, return_lse=return_lse)
    return res if return_lse else (res, None)


def _backward_pallas(q, k, v, mask, out, lse, dout, dlse, *, scale: float):
    mod, why = pallas_module()
    if why is not None:
        raise Unsupported(why)
    tiles = None if isinstance(mask, MaskArrays) else _pallas_tiles(q.shape[-1], q.dtype)
    arrays = _arrays(mask, tiles)
    return mod.flash_attention_bwd(q, k, v, arrays, out, lse, dout, dlse, scale=scale)


PALLAS = Adapter(
    "pallas", _check_pallas, _run_pallas, tiles=_pallas_tiles, backward=_backward_pallas
)
