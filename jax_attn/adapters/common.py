"""Shared pieces of the adapters: the Unsupported error, the question supports() answers, the
device facts it depends on, and the per-mask cache of MaskArrays (host and device copies)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from attn_masks import Mask

from ..mask_arrays import DEFAULT_BLOCK, MaskArrays, prepare_mask
from ..structure import MaskStructure, classify

MODES = ("fwd", "bwd", "fwd_bwd")
HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


class Unsupported(ValueError):
    """An impl cannot compute this input (mask, dtype, shape, device); raised before any work."""


@dataclass(frozen=True)
class GpuInfo:
    """The local accelerator as far as adapters care: CUDA or not, compute capability."""

    cuda: bool
    capability: tuple[int, int] | None


@cache
def local_gpu() -> GpuInfo | None:
    """Facts about the first local GPU, or None when JAX has no GPU backend."""
    try:
        backend = jax.extend.backend.get_backend("gpu")
    except RuntimeError:
        return None
    cc = getattr(backend.local_devices()[0], "compute_capability", None)
    capability = None
    if isinstance(cc, str) and cc.count(".") == 1 and cc.replace(".", "").isdigit():
        major, minor = cc.split(".")
        capability = (int(major), int(minor))
    return GpuInfo(cuda="cuda" in str(backend.platform_version).lower(), capability=capability)


@dataclass(frozen=True)
class Request:
    """One supports() question: the mask and whatever the caller knows of the inputs."""

    mask: Mask | MaskArrays
    dtype: np.dtype | None
    head_dim: int | None
    backend: str
    return_lse: bool
    mode: str
    structure: MaskStructure | None = field(default=None)

    @property
    def seqlen_q(self) -> int:
        return int(self.mask.seqlen_q)

    @property
    def seqlen_k(self) -> int:
        return int(self.mask.seqlen_k)

    @property
    def static(self) -> bool:
        return isinstance(self.mask, Mask)

    @property
    def grads(self) -> bool:
        return self.mode != "fwd"

    @property
    def gpu(self) -> GpuInfo | None:
        """The local GPU when the question is about the local GPU backend."""
        if self.backend != "gpu" or jax.default_backend() != "gpu":
            return None
        return local_gpu()


def make_request(
    mask: Mask | MaskArrays,
    *,
    dtype: Any,
    head_dim: int | None,
    heads_q: int | None,
    heads_kv: int | None,
    backend: str | None,
    return_lse: bool,
    mode: str,
) -> Request:
    """Normalise and validate supports() arguments into a Request."""
    if not isinstance(mask, (Mask, MaskArrays)):
        raise ValueError(
            f"mask must be an attn_masks.Mask or a jax_attn.MaskArrays, got {type(mask).__name__}"
        )
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    for what, val in (("head_dim", head_dim), ("heads_q", heads_q), ("heads_kv", heads_kv)):
        if val is not None and (not isinstance(val, (int, np.integer)) or val <= 0):
            raise ValueError(f"{what} must be a positive integer, got {val!r}")
    if heads_q is not None and heads_kv is not None and heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv}")
    backend = jax.default_backend() if backend is None else str(backend).lower()
    if backend == "cuda":
        backend = "gpu"
    return Request(
        mask=mask,
        dtype=None if dtype is None else np.dtype(dtype),
        head_dim=None if head_dim is None else int(head_dim),
        backend=backend,
        return_lse=bool(return_lse),
        mode=mode,
        structure=classify(mask) if isinstance(mask, Mask) else None,
    )


def needs_static_mask(req: Request, impl: str) -> str | None:
    """Reason when `impl` is handed runtime MaskArrays it cannot interpret."""
    if req.static:
        return None
    return (
        f"{impl} needs an attn_masks.Mask (its mask pattern is fixed at trace time); runtime "
        "MaskArrays are accepted by 'reference', 'pallas' and 'mosaic' only"
    )


def needs_cuda(req: Request, impl: str) -> str | None:
    """Reason when the question is not about a CUDA GPU."""
    if req.backend != "gpu":
        return f"{impl} needs a CUDA GPU (backend is {req.backend!r})"
    gpu = req.gpu
    if gpu is not None and not gpu.cuda:
        return f"{impl} needs a CUDA GPU (this GPU backend is not CUDA)"
    return None


def first_reason(*checks: Callable[[], str | None]) -> str | None:
    """The first non-None reason of lazily evaluated checks."""
    for check in checks:
        reason = check()
        if reason is not None:
            return reason
    return None


def describe(st: MaskStructure) -> str:
    """Short human name of a classified mask, for reasons."""
    if st.kind == "window":
        return f"sliding window (left={st.window[0]}, right={st.window[1]})"
    return f"{st.kind} mask" if st.kind != "general" else "general (block-sparse) mask"


def intervals_only(mask: Mask) -> MaskArrays:
    """MaskArrays holding only the per-row intervals (no tile lists), for impls that read only
    lo/hi: masks of one geometry and interval count then share one compiled program."""
    lo, hi = mask.row_intervals()
    return MaskArrays(
        lo=lo.astype(np.int32),
        hi=hi.astype(np.int32),
        kv=None,
        q=None,
        seqlen_q=mask.seqlen_q,
        seqlen_k=mask.seqlen_k,
        block_q=DEFAULT_BLOCK,
        block_k=DEFAULT_BLOCK,
    )


class _MaskCache:
    """Small LRU of MaskArrays per (mask object, tiles), host numpy plus a device copy.

    tiles None means intervals_only(mask).
    """

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def _entry(self, mask: Mask, tiles: tuple[int, int] | None) -> dict:
        key = (id(mask), tiles)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry["mask"] is mask:
                self._entries.move_to_end(key)
                return entry
        host = intervals_only(mask) if tiles is None else prepare_mask(mask, *tiles)
        entry = {"mask": mask, "host": host, "device": None}
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return entry

    def host(self, mask: Mask, tiles: tuple[int, int] | None) -> MaskArrays:
        return self._entry(mask, tiles)["host"]

    def device(self, mask: Mask, tiles: tuple[int, int] | None) -> MaskArrays:
        entry = self._entry(mask, tiles)
        if entry["device"] is None:
            with jax.ensure_compile_time_eval():  # a concrete copy even when called in a trace
                entry["device"] = jax.device_put(entry["host"])
        return entry["device"]


MASK_CACHE = _MaskCache()


def default_tiles(head_dim: int, dtype: Any) -> tuple[int, int]:
    """Tiles of impls that do not walk a block map (only the intervals matter to them)."""
    del head_dim, dtype
    return DEFAULT_BLOCK, DEFAULT_BLOCK


@dataclass(frozen=True)
class Adapter:
    """One impl: check(Request) -> reason | None, run(q, k, v, mask, scale, return_lse).

    backward(q, k, v, mask, out, lse, dout, dlse, scale) -> (dq, dk, dv), where the impl has
    one, computes the gradients from the forward's residuals without recomputing the forward;
    it must depend on out, lse, dout, dlse only through lse and rowsum(dout * out) - dlse (the
    flash backward), which is what lets a ring pass the merged softmax statistics.
    """

    name: str
    check: Callable[[Request], str | None]
    run: Callable[..., tuple[jax.Array, jax.Array | None]]
    tiles: Callable[[int, Any], tuple[int, int]] = default_tiles
    backward: Callable[..., tuple[jax.Array, jax.Array, jax.Array]] | None = None
