"""The impls behind jax_attn.attention, by name: each says what it supports and runs it."""

from .common import Adapter, Request, Unsupported, make_request
from .dpa import CUDNN, XLA
from .jax_pallas import MOSAIC_MHA, PALLAS_MHA
from .mosaic import MOSAIC
from .native import PALLAS, REFERENCE
from .triton import TRITON

ADAPTERS: dict[str, Adapter] = {
    a.name: a for a in (REFERENCE, PALLAS, MOSAIC, XLA, CUDNN, PALLAS_MHA, MOSAIC_MHA, TRITON)
}

__all__ = ["ADAPTERS", "Adapter", "Request", "Unsupported", "make_request"]
