"""Shared pieces of the adapters: the Unsupported error, the question supports() answers, the
device facts it depends on, and the per-mask cache of MaskArrays (host and device copies)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from attn_masks import MODES, Mask, MaskPattern, classify
from attn_masks.cache import MaskCache

from ..mask_arrays import DEFAULT_BLOCK, MaskArrays, prepare_mask

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
    pattern: MaskPattern | None = field(default=None)

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
        pattern=classify(mask) if isinstance(mask, Mask) else None,
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


def spoken_list(items: Any) -> str:
    """'a', 'a or b', 'a, b or c': values listed in a reason."""
    words = [str(getattr(x, "name", x)) for x in items]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def first_reason(*checks: Callable[[], str | None]) -> str | None:
    """The first non-None reason of lazily evaluated checks."""
    for check in checks:
        reason = check()
        if reason is not None:
            return reason
    return None


def describe(p: MaskPattern) -> str:
    """Short human name of a classified mask, for reasons."""
    if p.is_full or p.is_causal:
        return "full mask" if p.is_full else "causal mask"
    if p.square_window is not None:
        left, right = p.square_window
        return f"sliding window (left={left}, right={right})"
    if p.cu_seqlens is not None:
        return f"{p.kind} mask"
    return "general (block-sparse) mask"


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


def _non_finite_per_row(x: jax.Array) -> jax.Array:
    """(B, S) NaN/inf counts of x (B, S, H, D): per row, so int32 cannot overflow on long inputs."""
    return jnp.sum(~jnp.isfinite(x), axis=(2, 3), dtype=jnp.int32)


def _raise_non_finite(rows: list[jax.Array]) -> None:
    """Raise ValueError naming each input whose per-row counts (concrete) hold NaN/inf values."""
    counts = {n: int(np.asarray(r, np.int64).sum()) for n, r in zip("qkv", rows)}
    bad = [f"{name} holds {c} NaN/inf value{'s' * (c != 1)}" for name, c in counts.items() if c]
    if bad:
        raise ValueError(f"check_finite: {', '.join(bad)}")


def _checkify_non_finite(rows: list[jax.Array]) -> None:
    """The same check on traced counts, as a checkify check (a trace cannot raise on values)."""
    all_finite = jnp.stack([jnp.all(r == 0) for r in rows]).all()
    message = "check_finite: NaN/inf values held by q: {}, k: {}, v: {}"
    checkify.check(all_finite, message, *(jnp.sum(r) for r in rows))


def check_finite_inputs(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """Raise ValueError naming each of q, k, v that holds NaN or inf and how many.

    On traced inputs (jax.jit) it is a jax.experimental.checkify check instead, which jit
    refuses to compile unless the caller functionalizes it with checkify.checkify.
    """
    rows = [_non_finite_per_row(x) for x in (q, k, v)]
    if any(isinstance(x, jax.core.Tracer) for x in (q, k, v)):
        _checkify_non_finite(rows)
    else:
        _raise_non_finite(rows)


_ARRAYS = MaskCache(size=32)


def host_arrays(mask: Mask, tiles: tuple[int, int] | None) -> MaskArrays:
    """Host MaskArrays of `mask` with `tiles` (None: intervals_only), cached per mask object."""

    def build() -> MaskArrays:
        return intervals_only(mask) if tiles is None else prepare_mask(mask, *tiles)

    return _ARRAYS.get(mask, ("host", tiles), build)


def device_arrays(mask: Mask, tiles: tuple[int, int] | None) -> MaskArrays:
    """host_arrays(mask, tiles) put on the default device once, even when called in a trace."""

    def build() -> MaskArrays:
        with jax.ensure_compile_time_eval():
            return jax.device_put(host_arrays(mask, tiles))

    return _ARRAYS.get(mask, ("device", tiles), build)


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
