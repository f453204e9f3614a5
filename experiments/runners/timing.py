"""Per-call timing and peak memory for JAX and PyTorch (docs/results.md, Timing).

Every timed call is preceded (on GPU) by an L2 flush. Quantiles are of per-call times: p20 is
the *faster* time (higher TFLOP/s), p80 the slower one. Two ways to time, the same in both
frameworks' terms:
- one call at a time (chain_ms 0): JAX, wall time around a call synchronised with
  `block_until_ready`, the flush finished before the clock starts; torch, CUDA events around
  each call on GPU, perf_counter on CPU. A short call's JAX time includes the host's dispatch and
  the wait for the result, which events leave out.
- chains (chain_ms > 0): each sample queues n (flush, call) pairs back to back and waits once,
  n enough calls for chain_ms by the warm-up's time; the flushes alone, chained the same way, are
  subtracted and the rest divided by n. The host's launch and synchronisation are paid once a
  chain, so both frameworks measure the device's time per call. A sample that comes out at
  or below zero (host jitter longer than the call: once in 3630 timed calls of a CP predictor
  run) has the call measured again with chains twice as long (past MAX_CHAIN), CHAIN_TRIES
  measurements in all, then raises. Runs whose ranks share a barrier measure once and keep what
  they measure: a rank that measured again, or raised, alone would leave the others waiting.
  With no warm-up asked, the run that sets the chain length is flushed like a sample and, where
  it is a chain of one call of at least SAMPLE_RUN_MS, is the first sample (not where ranks
  share a barrier, nor for a single sample).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

L2_FLUSH_BYTES = 256 * 1024 * 1024
GIB = float(1 << 30)
MAX_CHAIN = 64  # calls in a chain of short calls at most (a measurement again doubles it)
FLUSH_SAMPLES = 3  # chains of flushes alone, whose median is subtracted
CHAIN_TRIES = 3  # measurements of a call, each chain twice as long, until its times are > 0
# a single run at least this long counts as a sample (the host's share of so long a call is
# under half a percent): with no warm-up asked, the run that sets a chain's length
# (_warm_chain_length), and a CP predictor call's first warm run (cp_ranks.Ranks.time)
SAMPLE_RUN_MS = 20.0
# a program's first run at least this long counts as a sample: a CP predictor call's first run
# of a program compiled ahead (cp_ranks.Ranks.time; on the H200 such runs of 64 x 32K CP calls
# took 5,193 and 19,060 ms against samples of 5,200 and 19,160 ms: results/h200/cp_predict,
# run 19), and a single-device point's compiling run (jax_compiling_run_ms,
# jax_runner.JaxRunner._compiling_run_is_the_sample)
FIRST_PROGRAM_RUN_MS = 1000.0


def chain_length(call_ms: float, chain_ms: float) -> int:
    """Calls per chain: enough for chain_ms at call_ms each, at least 1 and at most MAX_CHAIN."""
    if chain_ms <= 0:
        return 1
    return int(min(max(math.ceil(chain_ms / max(call_ms, 1e-3)), 1), MAX_CHAIN))


def wall_ms(call: Callable[[], object]) -> float:
    """Milliseconds of one synchronised call (`call` waits for its result)."""
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


def jax_first_ms(fn: Callable, args: Sequence, flush: Callable[[], None] | None = None) -> float:
    """Milliseconds of a run of fn(*args) measured as one sample of the loop is: its inputs
    ready and the L2 flushed before the clock starts, stopped at its result."""
    import jax

    _ready_and_flushed(args, flush)
    return wall_ms(lambda: jax.block_until_ready(fn(*args)))


def _ready_and_flushed(args: Sequence, flush: Callable[[], None] | None) -> None:
    """Wait for a call's inputs, then flush the L2 (and wait for it), before a run's clock."""
    import jax

    jax.block_until_ready(args)
    if flush is not None:
        flush()


def jax_compiling_run_ms(
    fn: Callable, args: Sequence, flush: Callable[[], None] | None = None
) -> tuple[object, float]:
    """(outputs, ms) of fn(*args) where that call compiles or loads its program: the inputs
    ready and the L2 flushed first, the clock started when the call returns (JAX dispatches
    asynchronously: compiled, and its run queued) and stopped at its result. The run's own
    time up to the microseconds between queueing and the clock's start, so only a long run's
    (FIRST_PROGRAM_RUN_MS) is worth keeping as a sample."""
    import jax

    _ready_and_flushed(args, flush)
    out = fn(*args)
    t0 = time.perf_counter()
    jax.block_until_ready(out)
    return out, (time.perf_counter() - t0) * 1e3


def _warm_chain_length(
    call: Callable[[], None],
    warmup: int,
    chain_ms: float,
    known_ms: float | None = None,
    flush: Callable[[], None] | None = None,
) -> tuple[int, float | None]:
    """(chain length, a first sample or None). Runs `warmup` (at least one) synchronised calls;
    the chain length is for the fastest. With no warm-up asked of a call already known to take
    chain_ms or more (known_ms: its untimed first run), none: its chain is that one call
    (seconds a call at 2M tokens). With no warm-up asked, the one run is flushed first like a
    sample and, where it takes SAMPLE_RUN_MS and chain_ms or more (a chain of one call), is the
    first sample."""
    if warmup == 0 and known_ms is not None and known_ms >= chain_ms:
        return 1, None
    if warmup > 0:
        return chain_length(min(wall_ms(call) for _ in range(warmup)), chain_ms), None
    if flush is not None:
        flush()
    ms = wall_ms(call)
    return chain_length(ms, chain_ms), (ms if ms >= max(SAMPLE_RUN_MS, chain_ms) else None)


def _kept_first(first: float | None, iters: int, barrier) -> float | None:
    """The chain-length run as a first sample (_warm_chain_length) only where a chained sample
    follows it (which measures the peak memory too) and no barrier lines ranks up: a rank that
    kept its run would take one chain fewer than a rank whose run was a little shorter."""
    return first if iters > 1 and barrier is None else None


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


class JaxL2Flush:
    """Overwrites a 256 MB buffer on each of some GPUs: `enqueue` queues the writes, a call
    queues them and waits. The buffers stay allocated for the whole sweep."""

    def __init__(self, gpus: Sequence) -> None:
        import jax
        import jax.numpy as jnp

        self._fill = jax.jit(lambda b: b + 1, donate_argnums=0)
        self.buffers = [jax.device_put(jnp.zeros(L2_FLUSH_BYTES // 4, jnp.int32), d) for d in gpus]

    def enqueue(self) -> None:
        self.buffers[:] = [self._fill(b) for b in self.buffers]

    def __call__(self) -> None:
        import jax

        self.enqueue()
        jax.block_until_ready(self.buffers)


def jax_l2_flusher(devices) -> JaxL2Flush | None:
    """The L2 flush of the GPUs among `devices` (one device or a sequence); None without GPUs."""
    devices = devices if isinstance(devices, (list, tuple)) else [devices]
    gpus = [d for d in devices if d.platform == "gpu"]
    return JaxL2Flush(gpus) if gpus else None


def jax_time_calls(
    fn: Callable,
    args: Sequence,
    *,
    warmup: int,
    iters: int,
    flush: JaxL2Flush | Callable[[], None] | None = None,
    barrier: Callable[[], None] | None = None,
    chain_ms: float = 0.0,
    known_ms: float | None = None,
) -> list[float]:
    """Per-call milliseconds of `fn(*args)` after `warmup` untimed calls (fn already compiled):
    `iters` samples, one call each, or chains of calls when chain_ms > 0 (module docstring;
    known_ms: _warm_chain_length)."""
    import jax

    if chain_ms > 0:
        return _jax_chains(fn, args, warmup, iters, chain_ms, flush, barrier, known_ms)
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


def _jax_chains(
    fn, args, warmup: int, iters: int, chain_ms: float, flush, barrier, known_ms=None
) -> list[float]:
    """Per-call ms from `iters` chains of n (flush, call) pairs, less the flushes' own time (or
    the chain-length run and iters - 1 chains: _warm_chain_length, _kept_first)."""
    import jax

    n, first = _warm_chain_length(
        lambda: jax.block_until_ready(fn(*args)), warmup, chain_ms, known_ms, flush
    )
    first = _kept_first(first, iters, barrier)
    enqueue = getattr(flush, "enqueue", flush)

    def chain(n: int, call: bool) -> float:
        if barrier is not None:
            barrier()
        out = None
        t0 = time.perf_counter()
        for _ in range(n):
            if enqueue is not None:
                enqueue()
            if call:
                out = fn(*args)
        jax.block_until_ready((out, getattr(flush, "buffers", None)))
        return (time.perf_counter() - t0) * 1e3

    def measure(n: int) -> tuple[list[float], None]:
        flushes = [chain(n, False) for _ in range(FLUSH_SAMPLES)] if flush else [0.0]
        flush_ms = float(np.median(flushes))
        return [(chain(n, True) - flush_ms) / n for _ in range(left)], None

    left = iters if first is None else iters - 1
    times = _positive_times(measure, n, tries=1 if barrier else CHAIN_TRIES)[0]
    return times if first is None else [first, *times]


def _positive_times(measure: Callable[[int], tuple], n: int, tries: int) -> tuple:
    """measure(n) -> (per-call ms, extra), measured again with chains twice as long while a
    time is not positive (the flushes' own chains took longer than the calls': host jitter),
    at most `tries` times in all; with tries > 1, raises when the last measurement still has
    one (tries == 1: a barrier's ranks, which must all measure alike, keep it)."""
    for _ in range(tries - 1):
        times, extra = measure(n)
        if min(times, default=1.0) > 0:
            return times, extra
        n *= 2
    times, extra = measure(n)
    if min(times, default=1.0) <= 0 and tries > 1:
        raise RuntimeError(
            f"chained timing: a chain of {n} calls took no longer than its flushes alone "
            f"(per-call times {[round(t, 4) for t in times]} ms) after {tries} measurements "
            "with ever longer chains: the host's jitter exceeds the calls' time"
        )
    return times, extra


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
    chain_ms: float = 0.0,
    known_ms: float | None = None,
) -> tuple[list[float], float | None]:
    """(per-call milliseconds, peak GiB over the timed calls; None on CPU).

    CUDA: a 256 MB buffer is zeroed before each call (L2 flush, finished before the start
    event), the peak statistics are reset, an event pair brackets fn; the peak leaves the flush
    buffer out. CPU: perf_counter around fn. `barrier` (CP) lines the ranks up before each call.
    chain_ms > 0: chains of calls instead (module docstring; known_ms: _warm_chain_length).
    """
    import torch

    if chain_ms > 0:
        return _torch_chains(fn, warmup, iters, device, barrier, chain_ms, known_ms)

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
    flush = torch_flush_buffer(device)
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


def torch_flush_buffer(device):
    """The L2 flush of a CUDA device: an L2_FLUSH_BYTES tensor, zeroed before a timed call."""
    import torch

    return torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)


def torch_first_ms(fn: Callable[[], object], device) -> float:
    """Milliseconds of a run of fn, measured as jax_first_ms measures one: the device idle and
    its L2 flushed (CUDA) before the clock starts, stopped when the device has finished fn."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch_flush_buffer(device).zero_()
        torch.cuda.synchronize(device)
    return wall_ms(torch_synchronised(fn, device))


def torch_synchronised(fn: Callable[[], object], device) -> Callable[[], None]:
    """fn, then a wait for the device to finish it (CUDA; on a CPU fn is synchronous)."""
    import torch

    def once() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return once


def _torch_chains(
    fn: Callable[[], object], warmup: int, iters: int, device, barrier, chain_ms: float,
    known_ms: float | None = None,
) -> tuple[list[float], float | None]:  # fmt: skip
    """torch_time_calls in chains: per sample, n (L2 flush, fn) pairs between one event pair
    (on CPU, n calls of fn under perf_counter), less the median of FLUSH_SAMPLES chains of
    flushes alone."""
    import torch

    cuda = device.type == "cuda"
    flush = torch_flush_buffer(device) if cuda else None
    flushed = (lambda: (flush.zero_(), torch.cuda.synchronize(device))) if cuda else None
    n, first = _warm_chain_length(
        torch_synchronised(fn, device), warmup, chain_ms, known_ms, flushed
    )
    first = _kept_first(first, iters, barrier)
    left, before = (iters, []) if first is None else (iters - 1, [first])
    if not cuda:
        times = []
        for _ in range(left):
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / n)
        return before + times, None

    def chain(n: int, call: bool) -> tuple:
        if barrier is not None:
            barrier()
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            flush.zero_()
            if call:
                fn()
        end.record()
        return start, end

    def measure(n: int) -> tuple[list[float], float]:
        flushes = [chain(n, False) for _ in range(FLUSH_SAMPLES)]
        peak, events = 0, []
        for _ in range(left):
            torch.cuda.reset_peak_memory_stats(device)
            events.append(chain(n, True))
            peak = max(peak, torch.cuda.max_memory_allocated(device))
        torch.cuda.synchronize(device)
        flush_ms = float(np.median([s.elapsed_time(e) for s, e in flushes]))
        times = [(s.elapsed_time(e) - flush_ms) / n for s, e in events]
        return times, (peak - L2_FLUSH_BYTES) / GIB

    times, peak = _positive_times(measure, n, tries=1 if barrier else CHAIN_TRIES)
    return before + times, peak
