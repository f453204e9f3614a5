"""Our Pallas Mosaic GPU kernel (Hopper only): TMA, wgmma, warp specialisation, any mask."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from attn_masks import Mask

from ..mask_arrays import MaskArrays
from .common import Adapter, Request, Unsupported, device_arrays, first_reason, spoken_list


def mosaic_module() -> tuple[Any, str | None]:
    """(jax_attn.mosaic_gpu, None), or (None, why it cannot be imported)."""
    try:
        return importlib.import_module("jax_attn.mosaic_gpu"), None
    except ImportError as err:
        return None, f"mosaic needs jax_attn.mosaic_gpu, which cannot be imported ({err})"


def _tiles(head_dim: int, dtype: Any) -> tuple[int, int]:
    mod, why = mosaic_module()
    if why is not None:
        raise Unsupported(why)
    return tuple(mod.block_sizes(head_dim, dtype))


def _check(req: Request) -> str | None:
    def module() -> str | None:
        return mosaic_module()[1]

    def device() -> str | None:
        if req.backend != "gpu":
            return (
                f"mosaic needs a Hopper GPU (compute capability 9.x; backend is "
                f"{req.backend!r}); on CPU only tests run it, through "
                "jax_attn.mosaic_gpu.flash_attention_mosaic(..., interpret=True)"
            )
        gpu = req.gpu
        if gpu is not None and not gpu.cuda:
            return "mosaic needs a CUDA GPU (this GPU backend is not CUDA)"
        if gpu is not None and gpu.capability is not None and gpu.capability[0] != 9:
            return (
                "mosaic uses Hopper-only instructions (wgmma, TMA): it needs compute "
                f"capability 9.x, got {gpu.capability}"
            )
        return None

    def dtype() -> str | None:
        dtypes = mosaic_module()[0].DTYPES
        if req.dtype is not None and req.dtype not in dtypes:
            return f"mosaic takes {spoken_list(dtypes)}, got {req.dtype.name}"
        return None

    def head_dim() -> str | None:
        head_dims = mosaic_module()[0].HEAD_DIMS
        if req.head_dim is not None and req.head_dim not in head_dims:
            return f"mosaic supports head_dim {spoken_list(head_dims)}, got {req.head_dim}"
        return None

    def arrays() -> str | None:
        if not isinstance(req.mask, MaskArrays):
            return None
        if req.mask.lo.ndim != 2:
            return (
                f"mosaic takes the MaskArrays of one mask (lo of shape (Sq, K)), got lo of shape "
                f"{tuple(req.mask.lo.shape)}; index the stacked arrays first"
            )
        if req.head_dim is not None and req.dtype is not None:
            want = _tiles(req.head_dim, req.dtype)
            got = (req.mask.block_q, req.mask.block_k)
            if got != want:
                return (
                    f"mosaic walks {want} mask tiles; these MaskArrays have {got} "
                    "(build them with jax_attn.mask_arrays_for('mosaic', ...))"
                )
        return None

    return first_reason(module, device, dtype, head_dim, arrays)


def _run(q, k, v, mask: Mask | MaskArrays, *, scale: float, return_lse: bool):
    mod, why = mosaic_module()
    if why is not None:
        raise Unsupported(why)
    if isinstance(mask, MaskArrays):
        arrays = mask
    else:
        arrays = device_arrays(mask, _tiles(q.shape[-1], np.dtype(q.dtype)))
    res = mod.flash_attention_mosaic(
        q, k, v, arrays, scale=scale, return_lse=return_lse, interpret=False
    )
    return res if return_lse else (res, None)


MOSAIC = Adapter("mosaic", _check, _run, tiles=_tiles)
