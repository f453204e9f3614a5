"""Per-call timing and peak memory for JAX and PyTorch (docs/results.md, Timing).

Every timed call is preceded (on GPU) by an L2 flush that is finished before the clock starts.
Quantiles are of per-call times: p20 is the *faster* time (higher TFLOP/s), p80 the slower one.
JAX: compiled function, warmed up, wall time around a call that is synchronised with
`block_until_ready`. Torch: CUDA events per call on GPU, perf_counter on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

L2_FLUSH_BYTES = 256 * 1024 * 1024
GIB = float(1 << 30)


def time_stats(times_ms: Sequence[float]) -> dict[str, float]:
    """Median, 20th and 80th percentile (of time), min, max and count of per-call times."""
    t = np.asarray(times_ms, np.float64)
    return {
        "median": float(np.median(t)),
        "p20": float(np.percentile(t, 20)),
        "p80": float(np.percentile(t, 80)),
        "min": float(t.min()),
        "max": float(t.max()),
        "n": int(t.size),
    }


def tflops_stats(flops_per_device: float, time_ms: dict[str, float]) -> dict[str, float]:
    """TFLOP/s at the median, p20 (faster, higher) and p80 (slower, lower) times."""
    return {q: flops_per_device / (time_ms[q] * 1e-3) / 1e12 for q in ("median", "p20", "p80")}


# ----------------------------------------------------------------------------------------- JAX


def jax_l2_flusher(devices) -> Callable[[], None] | None:
    """A function that overwrites a 256 MB buffer on each GPU of `devices` (one device or a
    sequence) and waits; None without GPUs. The buffers stay allocated for the whole sweep."""
    import jax
    import jax.numpy as jnp

    devices = devices if isinstance(devices, (list, tuple)) else [devices]
    gpus = [d for d in devices if d.platform == "gpu"]
    if not gpus:
        return None
    fill = jax.jit(lambda b: b + 1, donate_argnums=0)
    bufs = [jax.device_put(jnp.zeros(L2_FLUSH_BYTES // 4, jnp.int32), d) for d in gpus]

    def flush() -> None:
        bufs[:] = [fill(b) for b in bufs]
        jax.block_until_ready(bufs)

    return flush


def jax_time_calls(
    fn: Callable,
    args: Sequence,
    *,
    warmup: int,
    iters: int,
    flush: Callable[[], None] | None = None,
    barrier: Callable[[], None] | None = None,
) -> list[float]:
    """Per-call milliseconds of `fn(*args)` after `warmup` untimed calls (fn already compiled)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        if flush is not None:
            flush()
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def jax_peak_bytes(devices: Sequence) -> int | None:
    """Highest `peak_bytes_in_use` over the devices, or None if the backend has no stats."""
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def jax_compiled_bytes(jitted: Callable, args: Sequence) -> int | None:
    """Per-device bytes a compiled call needs (arguments + outputs + temporaries - aliases)."""
    try:
        m = jitted.lower(*args).compile().memory_analysis()
    except Exception:
        return None
    if m is None:
        return None
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return int(total)


def jax_call_peak(
    before: int | None,
    after: int | None,
    jitted: Callable,
    args: Sequence,
    *,
    resident: int = 0,
) -> tuple[float | None, str | None]:
    """(peak GiB of the point's calls, source). The device high-water mark is exact only when
    the point raised it (`resident` bytes, the L2 flush buffer, are not the point's); otherwise
    the compiled memory analysis is used."""
    if before is not None and after is not None and after > before:
        return (after - resident) / GIB, "device_peak_bytes_in_use"
    compiled = jax_compiled_bytes(jitted, args)
    if compiled is not None:
        return compiled / GIB, "compiled_memory_analysis"
    return None, None


# --------------------------------------------------------------------------------------- torch


def torch_time_calls(
    fn: Callable[[], object],
    *,
    warmup: int,
    iters: int,
    device,
    barrier: Callable[[], None] | None = None,
) -> tuple[list[float], float | None]:
    """(per-call milliseconds, peak GiB over the timed calls; None on CPU).

    CUDA: a 256 MB buffer is zeroed before each call (L2 flush, finished before the start
    event), the peak statistics are reset, an event pair brackets fn; the peak leaves the flush
    buffer out. CPU: perf_counter around fn. `barrier` (CP) lines the ranks up before each call.
    """
    import torch

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times, None
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    peak, events = 0, []
    for _ in range(iters):
        if barrier is not None:
            barrier()
        flush.zero_()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        peak = max(peak, torch.cuda.max_memory_allocated(device))
        events.append((start, end))
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in events], (peak - L2_FLUSH_BYTES) / GIB
