"""Points that cannot fit: predicted from the arrays a point must hold, before it runs.

Every impl holds q, k, v and out (with a backward also dout, dq, dk, dv) and an fp32 LSE; dense
impls (JAX reference and xla, torch naive and sdpa_math) also materialise the B x Hq x Sq x Sk
scores: at least one element of the input dtype per score, twice with a backward (the scores'
probabilities are kept and their gradient formed). When that lower bound exceeds the memory the
point may use (a GPU's own memory; on a CPU the host's available memory, shared by every
virtual device of a CP point) the point is recorded as `oom` with a reason starting
"predicted:", without running, so a sweep neither spends minutes on allocations that must fail
nor drives the host into swap. A point below the bound runs and may still end as a measured oom.
"""

from __future__ import annotations

import os

from experiments.core.outcomes import OOM, PointFailure
from experiments.core.points import ITEMSIZES, Point

DENSE_IMPLS = {"jax": ("reference", "xla"), "torch": ("naive", "sdpa_math")}
GIB = 1 << 30


def score_bytes(point: Point) -> int:
    """Lower bound of a dense impl's score memory at this point (bytes)."""
    scores = point.batch * point.heads_q * point.seqlen_per_device * point.seqlen_per_device
    copies = 1 if point.mode == "fwd" else 2
    return scores * ITEMSIZES[point.dtype] * copies


def array_bytes(point: Point) -> int:
    """Bytes of the inputs and outputs any impl holds on one device (q, k, v, out, LSE; with a
    backward also dout, dq, dk, dv)."""
    rows = point.batch * point.seqlen_per_device
    q_like, kv_like = rows * point.heads_q * point.head_dim, rows * point.heads_kv * point.head_dim
    copies = 2 if point.mode == "fwd" else 4
    return copies * (q_like + kv_like) * ITEMSIZES[point.dtype] + rows * point.heads_q * 4


def need_bytes(point: Point) -> int:
    """Lower bound of one device's memory for this point (bytes)."""
    dense = point.impl in DENSE_IMPLS.get(point.framework, ()) and not point.is_cp
    return array_bytes(point) + (score_bytes(point) if dense else 0)


def require_fits(point: Point, capacity_bytes: int | None, *, host: bool = False) -> None:
    """Raise an oom PointFailure ("predicted: ...") when the point cannot fit in
    `capacity_bytes` (None: capacity unknown, nothing predicted). host: the capacity is the
    host's available memory, which all of a CP point's devices share."""
    if capacity_bytes is None or point.simulated:
        return
    devices = point.num_devices if host and point.is_cp else 1
    need = need_bytes(point) * devices
    if need <= capacity_bytes:
        return
    dense = need_bytes(point) > array_bytes(point)
    what = (
        f"{point.impl} materialises the scores (B x Hq x S x S x {ITEMSIZES[point.dtype]} B"
        f"{'' if point.mode == 'fwd' else ' x 2 with backward'}) besides its inputs"
        if dense
        else ("q, k, v and out" if point.mode == "fwd" else "q, k, v, out and their gradients")
        + (f" on each of {devices} devices" if devices > 1 else "")
    )
    where = "the host's available" if host else "the device's"
    raise PointFailure(
        OOM,
        f"predicted: {what} need at least {need / GIB:.1f} GiB of {where} "
        f"{capacity_bytes / GIB:.1f} GiB; not run (lower --seqlen, --batch or --heads_q)",
    )


def require_training_fits(
    impl: str,
    *,
    depth: int,
    batch: int,
    heads_q: int,
    seqlen: int,
    itemsize: int,
    capacity_bytes: int | None,
) -> None:
    """Raise an oom PointFailure ("predicted: ...") when a dense JAX impl's training step cannot
    keep what its backward needs: every layer's B x Hq x S x S attention probabilities (at least
    `itemsize` bytes each; the LM rematerialises nothing). Flash impls keep no scores."""
    if capacity_bytes is None or impl not in DENSE_IMPLS["jax"]:
        return
    need = depth * batch * heads_q * seqlen * seqlen * itemsize
    if need <= capacity_bytes:
        return
    raise PointFailure(
        OOM,
        f"predicted: {impl} keeps every layer's attention probabilities for the backward "
        f"(depth {depth} x B {batch} x Hq {heads_q} x S {seqlen} x S x {itemsize} B = "
        f"{need / GIB:.1f} GiB) beyond the device's {capacity_bytes / GIB:.1f} GiB; not run "
        "(a flash impl keeps no scores)",
    )


def host_available_bytes() -> int | None:
    """Memory the host can still give without swapping (Linux MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def jax_capacity() -> tuple[int | None, bool]:
    """(memory of JAX's first local device in bytes, whether it is the host's): a GPU's limit,
    the host's available memory for CPU devices, None where neither is known."""
    import jax

    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return host_available_bytes(), True
    stats = device.memory_stats()
    return (int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None), False


def torch_capacity(device) -> tuple[int | None, bool]:
    """(total memory of a CUDA torch device in bytes, False), or the host's available memory
    and True on CPU."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return host_available_bytes(), True
    return int(torch.cuda.get_device_properties(device).total_memory), False
