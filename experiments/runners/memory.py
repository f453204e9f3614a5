"""Points that cannot fit: dense impls whose score matrix alone exceeds the device's memory.

Dense impls (JAX reference and xla, torch naive and sdpa_math) materialise the B x Hq x Sq x Sk
scores: at least one element of the input dtype per score, twice with a backward (the scores'
probabilities are kept and their gradient formed). When that lower bound exceeds the device's
memory the point is recorded as `oom` with a reason starting "predicted:", without running, so
a long sweep does not spend minutes on allocations that must fail. A point below the bound runs
and may still end as a measured oom.
"""

from __future__ import annotations

from experiments.core.outcomes import OOM, PointFailure
from experiments.core.points import Point
from experiments.runners.frameworks import ITEMSIZE

DENSE_IMPLS = {"jax": ("reference", "xla"), "torch": ("naive", "sdpa_math")}
GIB = 1 << 30


def score_bytes(point: Point) -> int:
    """Lower bound of a dense impl's score memory at this point (bytes)."""
    scores = point.batch * point.heads_q * point.seqlen_per_device * point.seqlen_per_device
    copies = 1 if point.mode == "fwd" else 2
    return scores * ITEMSIZE[point.dtype] * copies


def require_fits(point: Point, capacity_bytes: int | None) -> None:
    """Raise an oom PointFailure ("predicted: ...") when a dense single-device point cannot fit
    in `capacity_bytes` (None: capacity unknown, nothing predicted)."""
    if capacity_bytes is None or point.is_cp:
        return
    if point.impl not in DENSE_IMPLS.get(point.framework, ()):
        return
    need = score_bytes(point)
    if need > capacity_bytes:
        raise PointFailure(
            OOM,
            f"predicted: {point.impl} materialises the scores, at least {need / GIB:.1f} GiB "
            f"(B x Hq x S x S x {ITEMSIZE[point.dtype]} B"
            f"{'' if point.mode == 'fwd' else ' x 2 with backward'}) of the device's "
            f"{capacity_bytes / GIB:.1f} GiB; not run",
        )


def jax_capacity() -> int | None:
    """Memory of JAX's first local device in bytes (None where the backend reports none)."""
    import jax

    stats = jax.local_devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def torch_capacity(device) -> int | None:
    """Total memory of a CUDA torch device in bytes (None on CPU)."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)
