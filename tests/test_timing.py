"""Timing one call at a time and in chains (experiments/runners/timing.py): what a sample
contains, what is subtracted, and that the driver's --chain_ms reaches both and the record."""

from __future__ import annotations

import time

import numpy as np
import pytest

from experiments.core.results import read_records
from experiments.runners import timing

# Sleeps long against the host's scheduling jitter (a few ms on a loaded 2-core CI machine),
# the flush five calls long, so a sample that held a flush is far outside the bounds.
CALL_S, FLUSH_S = 0.01, 0.05


class SleepyFlush:
    """A stand-in L2 flush that takes FLUSH_S of host time and counts itself."""

    buffers = None

    def __init__(self) -> None:
        self.count = 0

    def enqueue(self) -> None:
        time.sleep(FLUSH_S)
        self.count += 1

    def __call__(self) -> None:
        self.enqueue()


def _sleepy_call(calls: list):
    def fn(*args):
        time.sleep(CALL_S)
        calls.append(1)
        return np.ones(3, np.float32)

    return fn


def test_chain_length_covers_the_chain_time_within_bounds():
    assert timing.chain_length(2.0, 0) == 1  # no chains: one call a sample
    assert timing.chain_length(2.0, 60) == 30
    assert timing.chain_length(2.5, 60) == 24
    assert timing.chain_length(100.0, 60) == 1  # a long call is a chain of its own
    assert timing.chain_length(0.0, 60) == timing.MAX_CHAIN


def test_jax_chains_subtract_the_flushes_and_divide_by_the_chain():
    calls, flush = [], SleepyFlush()
    warmup, iters = 1, 3
    times = timing.jax_time_calls(
        _sleepy_call(calls), (), warmup=warmup, iters=iters, flush=flush, chain_ms=40
    )
    n = (len(calls) - warmup) // iters
    assert n > 1 and len(calls) == warmup + iters * n
    # every chained call had its flush, and FLUSH_SAMPLES chains of flushes alone were timed
    assert flush.count == (iters + timing.FLUSH_SAMPLES) * n
    # a sample is one call's time (10 ms), not call plus flush (60 ms)
    assert len(times) == iters
    assert 0.7 * CALL_S * 1e3 < np.median(times) < (CALL_S + FLUSH_S / 2) * 1e3


class JitteryFlush(SleepyFlush):
    """A flush that is slow when it follows another flush (the chains of flushes alone) while
    `slow_chains` of them are left: host jitter that makes a chain of calls look shorter than
    its flushes."""

    def __init__(self, slow_chains: float) -> None:
        super().__init__()
        self.slow_chains, self.after_flush = slow_chains, False

    def enqueue(self) -> None:
        if self.after_flush and self.slow_chains > 0:
            time.sleep(FLUSH_S)
        self.after_flush = True
        self.count += 1

    def mark_call(self) -> None:
        if self.after_flush is True and self.slow_chains > 0:
            self.slow_chains -= 1  # a chain of calls has begun: one slow measurement is over
        self.after_flush = False


def test_jax_chains_measure_again_when_jitter_makes_a_time_negative():
    """The first measurement's flush chains are slow (times below zero): the call is measured
    again with chains twice as long, and what comes back is the call's time."""
    flush, calls = JitteryFlush(slow_chains=1), []

    def fn(*args):
        flush.mark_call()
        time.sleep(CALL_S)
        calls.append(1)
        return np.ones(3, np.float32)

    times = timing.jax_time_calls(fn, (), warmup=1, iters=2, flush=flush, chain_ms=20)
    n = timing.chain_length(CALL_S * 1e3, 20)
    assert len(calls) in {1 + 2 * n + 2 * 2 * n, 1 + 2 * (n - 1) + 2 * 2 * (n - 1)}
    assert all(0.7 * CALL_S * 1e3 < t < (CALL_S + FLUSH_S / 2) * 1e3 for t in times)


def test_jax_chains_raise_when_every_measurement_stays_negative():
    """Flush chains always slower than the calls' (3 calls a chain, then 6, then 12): after
    CHAIN_TRIES measurements the timing raises instead of returning a time below zero."""
    flush, calls = JitteryFlush(slow_chains=float("inf")), []

    def fn(*args):
        flush.mark_call()
        time.sleep(CALL_S)
        calls.append(1)
        return np.ones(3, np.float32)

    with pytest.raises(RuntimeError, match="took no longer than its flushes alone"):
        timing.jax_time_calls(fn, (), warmup=1, iters=1, flush=flush, chain_ms=25)
    n = timing.chain_length(CALL_S * 1e3, 25)
    assert len(calls) in {1 + n * 7, 1 + (n - 1) * 7}  # chains of n, 2n and 4n calls


def test_jax_one_call_at_a_time_flushes_outside_the_clock():
    calls, flush = [], SleepyFlush()
    times = timing.jax_time_calls(_sleepy_call(calls), (), warmup=2, iters=4, flush=flush)
    assert len(calls) == 6 and flush.count == 4 and len(times) == 4
    assert 0.7 * CALL_S * 1e3 < np.median(times) < (CALL_S + FLUSH_S / 2) * 1e3


def test_torch_chains_on_the_cpu_are_per_call_times():
    torch = pytest.importorskip("torch")
    calls = []
    fn = _sleepy_call(calls)
    times, peak = timing.torch_time_calls(
        fn, warmup=1, iters=3, device=torch.device("cpu"), chain_ms=40
    )
    n = (len(calls) - 1) // 3
    assert n > 1 and len(calls) == 1 + 3 * n and peak is None
    assert 0.7 * CALL_S * 1e3 < np.median(times) < 2 * CALL_S * 1e3


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_call_known_to_fill_a_chain_runs_no_warm_up(framework):
    """With no warm-up asked, a call whose untimed first run (known_ms) took chain_ms or more
    is a chain of one call without running again first; one known shorter, or unknown, runs
    one warm-up call that sets its chain's length."""
    calls = []
    fn = _sleepy_call(calls)
    if framework == "jax":
        run = lambda known: timing.jax_time_calls(  # noqa: E731
            fn, (), warmup=0, iters=2, flush=None, chain_ms=40, known_ms=known
        )
    else:
        torch = pytest.importorskip("torch")
        run = lambda known: timing.torch_time_calls(  # noqa: E731
            fn, warmup=0, iters=2, device=torch.device("cpu"), chain_ms=40, known_ms=known
        )[0]
    times = run(50.0)
    assert len(calls) == 2 and len(times) == 2  # two chains of one call, nothing else
    for known in (1.0, None):
        calls.clear()
        run(known)
        n = (len(calls) - 1) // 2
        assert n > 1 and len(calls) == 1 + 2 * n, known  # the warm-up, then two chains of n


LONG_S = 0.03  # a call past SAMPLE_RUN_MS: its chain is one call


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_long_chain_length_run_is_the_first_sample(monkeypatch, framework):
    """With no warm-up asked, the run that sets a long call's chain length (a chain of one, at
    least SAMPLE_RUN_MS) is flushed like a sample and is the first sample: one call fewer, and
    every sample the call's time without its flush. Not with a warm-up asked, one sample, a
    barrier (ranks must take their chains alike), or a run shorter than SAMPLE_RUN_MS."""
    calls = []

    def fn(*args):
        time.sleep(LONG_S)
        calls.append(1)
        return np.ones(3, np.float32)

    flush = SleepyFlush()

    def run(warmup: int, iters: int, barrier=None) -> list[float]:
        calls.clear()
        flush.count = 0
        if framework == "jax":
            return timing.jax_time_calls(
                fn, (), warmup=warmup, iters=iters, flush=flush, chain_ms=5, barrier=barrier
            )
        torch = pytest.importorskip("torch")
        return timing.torch_time_calls(
            fn, warmup=warmup, iters=iters, device=torch.device("cpu"), chain_ms=5,
            barrier=barrier,
        )[0]  # fmt: skip

    times = run(0, 3)
    assert len(times) == 3 and len(calls) == 3  # the chain-length run and two chains of one
    assert all(0.9 * LONG_S * 1e3 < t < (LONG_S + FLUSH_S / 2) * 1e3 for t in times), times
    if framework == "jax":  # before the first run, then in the flush chains and the chains
        assert flush.count == 1 + timing.FLUSH_SAMPLES + 2
    for warmup, iters, barrier in ((1, 3, None), (0, 1, None), (0, 3, lambda: None)):
        assert len(run(warmup, iters, barrier)) == iters
        assert len(calls) == max(warmup, 1) + iters, (warmup, iters, barrier)
    monkeypatch.setattr(timing, "SAMPLE_RUN_MS", 1e4)
    assert len(run(0, 3)) == 3 and len(calls) == 4


POINT = [
    "--framework=jax",
    "--impl=reference",
    "--mask=causal",
    "--seqlen=32",
    "--heads_q=2",
    "--heads_kv=1",
    "--head_dim=16",
    "--dtype=fp32",
    "--mode=fwd",
    "--warmup=1",
    "--iters=2",
    "--report=false",
]


@pytest.mark.parametrize("chain_ms", [None, 30])
def test_chain_ms_reaches_the_timing_and_the_point_key(tmp_path, monkeypatch, chain_ms):
    """--chain_ms is part of the point (a chained run never resumes a one-call-at-a-time one)
    and is what the runner times with; without it keys stay as they were."""
    from experiments import run

    seen = []
    real = timing.jax_time_calls

    def spy(fn, args, **kw):
        seen.append(kw.get("chain_ms"))
        return real(fn, args, **kw)

    monkeypatch.setattr(timing, "jax_time_calls", spy)
    flag = [] if chain_ms is None else [f"--chain_ms={chain_ms}"]
    assert run.run_cli([*POINT, *flag, f"--out_dir={tmp_path}"]) == 0
    (rec,) = read_records(tmp_path / "results.jsonl")
    assert rec["status"] == "ok"
    assert seen == [chain_ms or 0]
    assert rec["point"]["chain_ms"] == (chain_ms or 0)
    suffix = "/r1:2" + (f"c{chain_ms}" if chain_ms else "")
    assert rec["key"].endswith(suffix)


def test_a_first_run_is_timed_with_its_inputs_ready_and_the_l2_flushed():
    """jax_first_ms waits for the call's inputs and runs the flush before the clock starts:
    a call on inputs still being computed would wait for them inside its time, and a flush
    inside it would add FLUSH_S."""

    class Pending:
        """An input still being computed: CALL_S * 20 until it is ready."""

        ready = False

        def block_until_ready(self):
            time.sleep(CALL_S * 20)
            self.ready = True
            return self

    def fn(x):
        time.sleep(CALL_S if x.ready else CALL_S * 21)
        return np.ones(3, np.float32)

    flush = SleepyFlush()
    ms = timing.jax_first_ms(fn, (Pending(),), flush)
    assert flush.count == 1
    assert CALL_S * 1e3 <= ms < (CALL_S + FLUSH_S) * 1e3 * 0.8, ms


def test_a_compiling_run_is_timed_from_its_queueing_to_its_result():
    """jax_compiling_run_ms flushes before the call and starts the clock when the call returns
    (its compilation done, its run queued), so the time is the run's: neither the compilation
    nor the flush, and it waits for the result, whose outputs it returns."""

    class Queued:
        """A queued run's result: CALL_S * 20 until ready."""

        def block_until_ready(self):
            time.sleep(CALL_S * 20)
            return self

    flush = SleepyFlush()

    def fn(x):
        assert flush.count == 1  # flushed before the call, not racing its queued run
        time.sleep(FLUSH_S * 4)  # compiling
        return Queued()

    out, ms = timing.jax_compiling_run_ms(fn, (np.ones(3),), flush)
    assert isinstance(out, Queued) and flush.count == 1
    assert CALL_S * 20e3 <= ms < (CALL_S * 20 + FLUSH_S) * 1e3, ms


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
@pytest.mark.parametrize(
    "warmup, first_ms, sampled", [(0, 2500.0, False), (0, 250.0, True), (1, 2500.0, True)]
)
def test_a_long_compiling_run_is_a_single_device_points_sample(
    tmp_path, monkeypatch, mode, warmup, first_ms, sampled
):
    """A JAX single-device point asked for no warm-up keeps its compiling run (the one whose
    outputs its check reads) as its one sample where that run takes FIRST_PROGRAM_RUN_MS or
    more, runs no timing loop and says so in its record; a shorter run, or a warm-up asked,
    times with the loop; in every mode."""
    from experiments import run

    loops = []
    real_loop, real_first = timing.jax_time_calls, timing.jax_compiling_run_ms

    def loop(fn, args, **kw):
        loops.append(kw)
        return real_loop(fn, args, **kw)

    def first(fn, args, flush=None):
        return real_first(fn, args, flush)[0], first_ms

    monkeypatch.setattr(timing, "jax_time_calls", loop)
    monkeypatch.setattr(timing, "jax_compiling_run_ms", first)
    args = [a for a in POINT if not a.startswith(("--warmup", "--mode"))]
    flags = [f"--warmup={warmup}", f"--mode={mode}", f"--out_dir={tmp_path}"]
    assert run.run_cli([*args, *flags]) == 0
    (rec,) = read_records(tmp_path / "results.jsonl")
    assert rec["status"] == "ok" and rec["check"]["ok"]
    assert bool(loops) == sampled
    assert (rec["masks"][0].get("sample") == "compiling run") == (not sampled)
    if not sampled:
        assert rec["metrics"]["time_ms"]["median"] == first_ms
        assert rec["masks"][0]["time_ms"]["n"] == 1
