"""End-to-end tests of experiments/run.py (CPU, tiny sizes) and its reports, presets, checks."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from experiments.core import interrupt, outcomes, presets
from experiments.core.flags import parse_seqlen
from experiments.core.points import CP_STRATEGIES, expand
from experiments.core.results import ResultsStore, read_records
from experiments.reports import report
from experiments.runners import checks, inputs

ROOT = Path(__file__).resolve().parent.parent
RUN = str(ROOT / "experiments" / "run.py")
TINY = [
    "--seqlen=64",
    "--heads_q=2",
    "--heads_kv=1",
    "--head_dim=16",
    "--dtype=fp32",
    "--warmup=0",
    "--iters=2",
    "--report=false",
]
# A JAX sweep of eight tiny points, long enough to be interrupted part-way.
EIGHT_POINTS = [
    "--framework=jax",
    "--impl=reference",
    "--mask=full,causal",
    "--seqlen=32,48,64,80",
    "--mode=fwd",
    *TINY[1:],
]


def _run_in_process(args: list[str]) -> int:
    from experiments import run

    return run.run_cli(args)


def _subprocess(args: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, RUN, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def _records(out_dir: Path) -> list[dict]:
    return read_records(out_dir / "results.jsonl")


def _by_impl(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["point"]["impl"], []).append(r)
    return out


def test_jax_kernels_in_process_ok_and_unsupported(tmp_path):
    """Measured points carry numbers, checks and provenance; cudnn on CPU is 'unsupported'."""
    code = _run_in_process(
        [
            "--framework=jax",
            "--impl=reference,xla,cudnn",
            "--mask=causal",
            "--mode=fwd,bwd",
            f"--out_dir={tmp_path}",
            *TINY,
        ]
    )
    assert code == 0
    recs = _records(tmp_path)
    assert len(recs) == 6 and len({r["key"] for r in recs}) == 6
    impls = _by_impl(recs)
    for r in impls["reference"] + impls["xla"]:
        assert r["status"] == "ok", r["reason"]
        m = r["metrics"]
        assert m["tflops"]["p20"] >= m["tflops"]["median"] >= m["tflops"]["p80"] > 0
        assert m["time_ms"]["p20"] <= m["time_ms"]["median"] <= m["time_ms"]["p80"]
        assert r["check"]["kind"] == "full" and r["check"]["ok"]
        assert set(r["check"]["max_errors"]) == (
            {"out"} if r["point"]["mode"] == "fwd" else {"out", "dq", "dk", "dv"}
        )
        assert r["provenance"]["versions"]["jax"]
        assert "commit" in r["provenance"]["git"]
        assert r["provenance"]["flags"]["impl"] == ["reference", "xla", "cudnn"]
    for r in impls["cudnn"]:
        assert r["status"] == "unsupported" and r["metrics"] is None and r["reason"]


def test_broken_impl_is_wrong_not_a_speed(tmp_path, monkeypatch):
    """An impl returning wrong values is recorded as 'wrong' with its error, never timed."""
    import jax_attn

    real = jax_attn.attention
    monkeypatch.setattr(jax_attn, "attention", lambda *a, **k: real(*a, **k) * 1.01)
    code = _run_in_process(
        [
            "--framework=jax",
            "--impl=reference",
            "--mask=sliding_window",
            "--window=8",
            "--mode=fwd",
            f"--out_dir={tmp_path}",
            *TINY,
        ]
    )
    assert code == 0
    (rec,) = _records(tmp_path)
    assert rec["status"] == "wrong" and rec["metrics"] is None
    assert rec["check"]["errors"]["out"] > rec["check"]["rtol"]["out"]
    assert "rel err" in rec["reason"]


def test_missing_package_is_unsupported_not_a_crash(tmp_path, monkeypatch):
    """A framework package that cannot be imported gives 'unsupported: not available: ...'."""
    from experiments.runners import frameworks

    monkeypatch.setitem(frameworks.KERNEL_PACKAGES, "jax", "jax_attn_not_written_yet")
    code = _run_in_process(
        [
            "--framework=jax",
            "--impl=pallas",
            "--mask=causal",
            "--mode=fwd",
            f"--out_dir={tmp_path}",
            *TINY,
        ]
    )
    assert code == 0
    (rec,) = _records(tmp_path)
    assert rec["status"] == "unsupported" and rec["metrics"] is None
    assert rec["reason"] == "not available: No module named 'jax_attn_not_written_yet'"


def test_jax_cp_in_process_and_resume(tmp_path, capsys):
    """Ring CP on 4 virtual devices: per-device TFLOP/s; a rerun skips every finished point."""
    args = [
        "--framework=jax",
        "--cp=ring,ulysses",
        "--layout=zigzag",
        "--num_devices=4",
        "--mask=causal_document",
        "--mode=fwd,bwd",
        "--seqlen=16",
        f"--out_dir={tmp_path}",
        *TINY[1:],
        "--heads_q=4",
        "--heads_kv=2",
    ]
    assert _run_in_process(args) == 0
    recs = _records(tmp_path)
    assert len(recs) == 4
    for r in recs:
        assert r["masks"][0]["plan"]["world_size"] == 4
        assert r["masks"][0]["comm"]["fwd_bytes"] > 0
        assert r["status"] == "ok", r["reason"]
        p, m = r["point"], r["metrics"]
        assert p["num_devices"] == 4 and p["scaling"] == "weak"
        assert (p["seqlen_total"], p["seqlen_per_device"]) == (64, 16)
        flops = r["masks"][0]["flops"]
        assert m["tflops"]["median"] == pytest.approx(
            flops / 4 / (m["time_ms"]["median"] * 1e-3) / 1e12
        )
    capsys.readouterr()
    assert _run_in_process(args) == 0
    assert "4 already in" in capsys.readouterr().out
    assert len(_records(tmp_path)) == 4


def test_torch_kernels_in_process(tmp_path):
    """PyTorch kernels end to end on CPU, forward and backward, with float64 checks."""
    code = _run_in_process(
        [
            "--framework=torch",
            "--impl=naive,sdpa",
            "--mask=causal_document",
            "--mode=fwd,bwd",
            f"--out_dir={tmp_path}",
            *TINY,
        ]
    )
    assert code == 0
    recs = _records(tmp_path)
    assert len(recs) == 4
    assert all(r["status"] == "ok" for r in recs), [r["reason"] for r in recs]
    assert all(r["provenance"]["versions"]["torch"] for r in recs)


def test_torch_cp_subprocess_gloo(tmp_path):
    """The driver spawns 2 gloo ranks itself and records the slowest rank's time, and the
    dispatch of q, k, v (kept out of that time) apart."""
    res = _subprocess(
        [
            "--framework=torch",
            "--cp=ring",
            "--num_devices=2",
            "--mask=causal",
            "--mode=fwd,bwd",
            "--seqlen=32",
            f"--out_dir={tmp_path}",
            *TINY[1:],
        ]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "embedded CPU default" in res.stdout
    recs = _records(tmp_path)
    assert len(recs) == 2
    for r in recs:
        assert r["status"] == "ok", r["reason"]
        assert r["point"]["num_devices"] == 2 and r["point"]["seqlen_total"] == 64
        assert len(r["masks"][0]["rank_median_ms"]) == 2
        assert r["metrics"]["time_ms"]["median"] >= max(r["masks"][0]["rank_median_ms"]) * 0.999
        assert r["masks"][0]["dispatch_ms"]["n"] == 2 and r["metrics"]["dispatch_ms"]["median"] > 0


def test_both_frameworks_cross_table(tmp_path):
    """--framework=both measures each framework and the report compares them."""
    code = _run_in_process(
        [
            "--framework=both",
            "--impl=reference,naive",
            "--mask=full",
            "--mode=fwd",
            f"--out_dir={tmp_path}",
            "--report=true",
            *TINY[:-1],
        ]
    )
    assert code == 0
    recs = _records(tmp_path)
    assert {(r["point"]["framework"], r["point"]["impl"]) for r in recs} == {
        ("jax", "reference"),
        ("torch", "naive"),
    }
    pids = {r["point"]["framework"]: r["provenance"]["pid"] for r in recs}
    assert len(set(pids.values())) == 2 and os.getpid() not in pids.values(), pids
    cross = (tmp_path / "cross_framework.csv").read_text()
    assert "reference" in cross and "naive" in cross
    assert "JAX vs PyTorch" in (tmp_path / "report.md").read_text()
    assert list((tmp_path / "masks").glob("full_*.png"))


def test_kill_and_resume_loses_and_duplicates_nothing(tmp_path):
    """Kill a sweep after its first records, rerun it: every point exactly once."""
    args = [*EIGHT_POINTS, f"--out_dir={tmp_path}"]
    results = tmp_path / "results.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, RUN, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if results.exists() and len(_records(tmp_path)) >= 2:
                break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = _records(tmp_path)
    assert 2 <= len(before) < 8, "the sweep should have been killed mid-way"
    res = _subprocess(args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{len(before)} already in" in res.stdout
    after = _records(tmp_path)
    keys = [r["key"] for r in after]
    assert len(keys) == 8 and len(set(keys)) == 8
    assert after[: len(before)] == before


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--mask=nope", "unknown mask 'nope'"),
        ("--cp=ringg", "unknown cp 'ringg'"),
        ("--dtype=fp8", "fp8"),
        ("--seqlen=12Q", "bad seqlen '12Q'"),
        ("--heads_q=6 --heads_kv=4", "multiple of heads_kv=4"),
        ("--impl=nonsense", "unknown impl 'nonsense'"),
        ("--workload=bogus", "value should be one of"),
        ("--steps=5 --vocab=64", "--steps, --vocab only apply to --workload=train_step"),
    ],
)
def test_bad_flag_values_fail_clearly(flag, expected, tmp_path):
    """One 'FATAL Flags parsing error' line (and absl's hint), never the flags' help."""
    res = _subprocess([*flag.split(), f"--out_dir={tmp_path}"], timeout=120)
    assert res.returncode != 0
    fatal, hint = res.stderr.strip().splitlines()
    assert fatal.startswith("FATAL Flags parsing error: ") and expected in fatal, res.stderr[-2000:]
    assert hint == "Pass --helpshort or --helpfull to see help on flags."
    if "unknown mask" in expected:
        assert "causal_document_long" in res.stderr
    assert not (tmp_path / "results.jsonl").exists()


def test_name_flags_take_the_library_names():
    """--cp, --layout and --mode list the libraries' strategies, layouts and modes in their
    order (a new one shows in --help), and --framework takes the driver's frameworks."""
    from absl import flags

    import attn_masks
    import shard_strategies
    from experiments.core import flags as run_flags
    from experiments.core import points
    from experiments.runners import frameworks

    run_flags.define_flags()
    fv = flags.FLAGS
    assert f"parallelism: none|{'|'.join(shard_strategies.STRATEGIES)} (" in fv["cp"].help
    assert f"layout: {'|'.join(shard_strategies.LAYOUTS)} (" in fv["layout"].help
    assert f"Directions: {'|'.join(attn_masks.MODES)} (" in fv["mode"].help
    assert fv["framework"].parser.enum_values == [*points.FRAMEWORKS, "both"]
    assert points.FRAMEWORKS == tuple(frameworks.KERNEL_PACKAGES)


def test_unwritable_out_dir_fails_before_any_point(tmp_path, capsys):
    """An output folder that cannot be created is one line naming it, before any point runs."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out_dir = blocker / "results"
    args = ["--framework=jax", "--impl=reference", "--mask=causal", "--mode=fwd", *TINY]
    assert _run_in_process([*args, f"--out_dir={out_dir}"]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == (
        f"FATAL Flags parsing error: --out_dir={str(out_dir)!r}: cannot create this folder "
        "(Not a directory); expected one that can be created"
    ), err
    assert "to run." not in out and not out_dir.exists()


def _interrupt_on_call(monkeypatch, n: int) -> None:
    """Make the n-th JAX point raise KeyboardInterrupt, as a Ctrl-C during it would."""
    from experiments.runners.jax_runner import JaxRunner

    real, calls = JaxRunner.run, []

    def run(self, point):
        calls.append(point.key)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(self, point)

    monkeypatch.setattr(JaxRunner, "run", run)


def test_ctrl_c_is_one_line_and_the_same_command_resumes(tmp_path, capsys, monkeypatch):
    args = [
        "--framework=jax",
        "--impl=reference",
        "--mask=full,causal,causal_document",
        "--mode=fwd",
        f"--out_dir={tmp_path}",
        *TINY,
    ]
    _interrupt_on_call(monkeypatch, 2)
    assert _run_in_process(args) == 130
    assert len(_records(tmp_path)) == 1
    err = capsys.readouterr().err
    assert err == (
        f"Interrupted: 1 point recorded in {tmp_path / 'results.jsonl'}; "
        "rerun the same command to resume.\n"
    )
    monkeypatch.undo()
    assert _run_in_process(args) == 0
    assert "3 points, 1 already in" in capsys.readouterr().out
    assert len({r["key"] for r in _records(tmp_path)}) == len(_records(tmp_path)) == 3


def test_sigint_exits_130_with_one_line(tmp_path):
    """A real SIGINT mid-sweep: exit code 130, the acknowledgement and one line on stderr, no
    traceback."""
    many = ",".join(str(16 * i) for i in range(2, 34))  # 64 points: long past the signal
    args = [*EIGHT_POINTS, f"--seqlen={many}", f"--out_dir={tmp_path}"]
    # Python's own SIGINT handler even where this process inherited SIGINT ignored.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", start, RUN, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not _records(tmp_path):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    recorded = len(_records(tmp_path))
    assert 1 <= recorded < 64, "the sweep should have been interrupted mid-way"
    assert proc.returncode == 130, err[-3000:]
    assert err.splitlines() == [
        interrupt.ACKNOWLEDGED.decode().strip(),
        f"Interrupted: {recorded} point{'' if recorded == 1 else 's'} recorded in "
        f"{tmp_path / 'results.jsonl'}; rerun the same command to resume.",
    ]


def test_time_budget_stops_a_sweep_in_resumable_pieces(tmp_path, capsys):
    many = ",".join(str(16 * i) for i in range(2, 14))  # 24 points: longer than the budget
    args = [*EIGHT_POINTS, f"--seqlen={many}", f"--out_dir={tmp_path}"]
    assert _run_in_process([*args, "--time_budget=1"]) == interrupt.BUDGET_SPENT
    first = read_records(tmp_path / "results.jsonl")
    assert 1 <= len(first) < 24
    assert f"Time budget of 1 s spent: {len(first)} point" in capsys.readouterr().out
    assert _run_in_process(args) == 0  # the same command without a budget finishes the grid
    keys = [r["key"] for r in read_records(tmp_path / "results.jsonl")]
    assert len(keys) == len(set(keys)) == 24
    assert keys[: len(first)] == [r["key"] for r in first]


def test_a_device_fault_stops_the_sweep_once_recorded(tmp_path, capsys, monkeypatch):
    from experiments.runners.jax_runner import JaxRunner

    run_point = JaxRunner.run
    faulted: list[str] = []

    def run(self, point):  # the third point's kernel faults the GPU, as a bad launch would
        if point.seqlen_total == 48 and point.mask == "full":
            faulted.append(point.key)
            raise RuntimeError(
                "INTERNAL: CUDA error: Failed to check stream capturing status: "
                "CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure"
            )
        return run_point(self, point)

    monkeypatch.setattr(JaxRunner, "run", run)
    args = [*EIGHT_POINTS, f"--out_dir={tmp_path}"]
    assert _run_in_process(args) == interrupt.DEVICE_FAULTED
    first = _records(tmp_path)
    assert [r["status"] for r in first] == ["ok", "ok", "error"], "nothing after the fault"
    assert first[-1]["key"] == faulted[0] and "CUDA_ERROR_LAUNCH_FAILED" in first[-1]["reason"]
    err = capsys.readouterr().err
    assert "CUDA_ERROR_LAUNCH_FAILED" in err and "3 points in all" in err
    assert "full S=48" in err and "--retry_errors" in err
    assert _run_in_process(args) == 0  # the same command goes on with the rest ...
    again = _records(tmp_path)
    assert len(again) == 8 and faulted == [first[-1]["key"]]  # ... leaving the faulted one
    monkeypatch.setattr(JaxRunner, "run", run_point)  # the fault was the device's, not the point's
    assert _run_in_process([*args, "--retry_errors"]) == 0
    latest = {r["key"]: r["status"] for r in _records(tmp_path)}
    assert len(latest) == 8 and set(latest.values()) == {"ok"}


class _FaultingRunner:
    """Runs points; the second one's run fails with `message`."""

    def __init__(self, message: str) -> None:
        self.message, self.runs = message, 0

    def run(self, point):
        self.runs += 1
        if self.runs == 2:
            raise RuntimeError(self.message)
        return {"metrics": {}, "check": {"passed": True}}


def _tiny_points() -> list:
    """Three tiny kernel points (16, 32 and 48 tokens)."""
    from experiments.core.points import Grid, expand

    grid = Grid(
        name="tiny", cps=("none",), layouts=("contiguous",), impls=("reference",),
        masks=("full",), seqlens=(16, 32, 48), heads=((2, 1),), head_dim=8, dtype="fp32",
        modes=("fwd",),
    )  # fmt: skip
    return expand(grid, "jax", grid.impls, seed=0, num_devices=1, ulysses_size=None,
                  ulysses_intra_node=True)  # fmt: skip


@pytest.mark.parametrize("stop", [True, False])
def test_a_fault_read_as_out_of_memory_is_a_fault_and_ranks_go_on(tmp_path, stop):
    from experiments.core import sweep

    points = _tiny_points()
    runner = _FaultingRunner(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4096 bytes: "
        "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered"
    )
    store = ResultsStore(tmp_path)
    run = functools.partial(
        sweep.run_points, points, lambda p: runner, store=store, progress=None, provenance={}
    )
    if stop:
        with pytest.raises(interrupt.DeviceFaulted, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            run()
    else:
        run(stop_on_fault=False)  # processes sharing collectives record it and go on
    records = read_records(store.path)
    assert [r["status"] for r in records] == ["ok", "error", "ok"][: 2 if stop else 3]
    assert records[1]["device_fault"] == "CUDA_ERROR_ILLEGAL_ADDRESS"  # not an out-of-memory
    assert "device_fault" not in records[0]
    assert runner.runs == (2 if stop else 3)


def test_a_fault_behind_a_point_failure_is_found_in_its_cause(tmp_path):
    from experiments.core import sweep
    from experiments.core.outcomes import WRONG, PointFailure

    class Runner:
        def run(self, point):
            try:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            except RuntimeError as e:  # a runner's own wording, the fault only in the cause
                raise PointFailure(WRONG, "rank 3 disagreed with the reference") from e

    (point,) = _tiny_points()[:1]
    record = sweep.run_one(point, lambda p: Runner(), {})
    assert record["status"] == "error"
    assert record["device_fault"] == "an illegal memory access was encountered"


def test_multi_process_jax_records_a_fault_and_goes_on(tmp_path, monkeypatch):
    import types

    from experiments import driver
    from experiments.runners.jax_runner import JaxRunner

    for count, alone in ((1, True), (2, False)):
        stub = types.SimpleNamespace(process_count=lambda n=count: n)
        monkeypatch.setitem(sys.modules, "jax", stub)
        assert driver._single_process() is alone
    monkeypatch.delitem(sys.modules, "jax")
    assert driver._single_process()  # no JAX in this process: nothing shared
    monkeypatch.undo()
    run_point = JaxRunner.run

    def run(self, point):
        if point.seqlen_total == 48 and point.mask == "full":
            raise RuntimeError("INTERNAL: CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure")
        return run_point(self, point)

    monkeypatch.setattr(JaxRunner, "run", run)
    monkeypatch.setattr(driver, "_single_process", lambda: False)  # as with a second process
    assert _run_in_process([*EIGHT_POINTS, f"--out_dir={tmp_path}"]) == 0
    statuses = [r["status"] for r in _records(tmp_path)]
    assert len(statuses) == 8 and statuses.count("error") == 1


def test_faults_that_leave_the_context_unusable_are_told_apart():
    from experiments.core.outcomes import device_fault

    torch_text = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors ..."
    assert device_fault(torch_text) == "an illegal memory access was encountered"
    xla_text = "XlaRuntimeError: INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access"
    assert device_fault(xla_text) == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert device_fault("ValueError: rows must be 128 rows") is None
    assert device_fault("RESOURCE_EXHAUSTED: Out of memory while trying to allocate") is None
    assert device_fault(None) is None


def test_paper_preset_is_the_published_grid():
    p = presets.get_preset("paper", on_gpu=True)
    (kernel,), (cp,) = p.kernel, p.cp
    assert presets.select_grids(p, None) == [kernel, cp]
    assert kernel.seqlens == tuple(k * 1024 for k in (1, 2, 4, 8, 16, 24, 32, 40, 48))
    assert kernel.heads == ((64, 8), (64, 64)) and kernel.head_dim == 128
    assert kernel.dtype == "bf16" and kernel.modes == ("fwd", "bwd")
    assert kernel.masks == presets.STATIC_MASKS and len(kernel.masks) == 12
    assert (kernel.window, kernel.num_masks, kernel.warmup, kernel.iters) == (1024, 1, 5, 20)
    assert kernel.reference_compat and kernel.batch == 1 and kernel.cps == ("none",)
    assert cp.cps == ("ring", "allgather", "ulysses", "usp", "double_ring")
    assert cp.masks == ("full", "causal", "full_document_long", "causal_document_long")
    assert cp.seqlens == (8192,) and cp.scaling == "weak" and cp.heads == ((64, 8),)
    assert (cp.head_dim, cp.dtype, cp.num_masks, cp.warmup, cp.iters) == (128, "bf16", 30, 5, 15)
    assert cp.modes == ("fwd", "bwd", "fwd_bwd") and cp.reference_compat
    kw = dict(seed=42, ulysses_size=None, ulysses_intra_node=True)
    kpts = expand(kernel, "jax", ("a", "b"), num_devices=1, **kw)
    assert len(kpts) == 9 * 2 * 12 * 2 * 2
    cpts = expand(cp, "torch", ("default",), num_devices=8, **kw)
    assert len(cpts) == 5 * 4 * 3
    assert {(p.seqlen_total, p.seqlen_per_device) for p in cpts} == {(65536, 8192)}
    assert {p.num_masks for p in cpts} == {30}
    full = presets.get_preset("full", on_gpu=True)
    assert not any(g.reference_compat for g in (*full.kernel, *full.cp))
    balanced = full.cp[1]
    assert balanced.masks == presets.STATIC_MASKS and balanced.layouts == ("balanced",)
    assert presets.select_grids(p, ("none",)) == [kernel]
    assert presets.select_grids(p, ("ring",))[0].cps == ("ring",)


def test_cpu_default_sizes_run_every_cp_strategy():
    """Every CP strategy plans the CPU default's shapes on 8 JAX devices and 4 torch ranks."""
    import shard_strategies
    from attn_masks import make_mask
    from experiments.run import VIRTUAL_CPU_DEVICES
    from experiments.runners.cp_launch import CPU_TORCH_RANKS

    (grid,) = presets.get_preset("smoke", on_gpu=False).cp
    ((hq, hkv),) = grid.heads
    for world in (VIRTUAL_CPU_DEVICES, CPU_TORCH_RANKS):
        for name in grid.masks:
            mask = make_mask(name, grid.seqlens[0] * world, window=grid.window)
            for strategy in CP_STRATEGIES:
                plan = shard_strategies.make_plan(
                    mask,
                    world,
                    strategy,
                    grid.layouts[0],
                    num_heads_q=hq,
                    num_heads_kv=hkv,
                    head_dim=grid.head_dim,
                )
                assert plan.world_size == world


def _fake_record(impl: str, seqlen: int, status: str, framework: str = "jax") -> dict:
    point = dict(
        framework=framework,
        impl=impl,
        cp="none",
        layout="none",
        ulysses_size=None,
        mask="causal",
        seqlen=seqlen,
        total_seqlen=seqlen,
        num_devices=1,
        scaling="none",
        batch=1,
        heads_q=4,
        heads_kv=2,
        head_dim=32,
        dtype="bf16",
        mode="fwd",
        num_masks=1,
        seed=42,
        window=1024,
        reference_compat=False,
        grid="kernel",
    )
    rec = {
        "key": f"{framework}/{impl}/{seqlen}",
        "status": status,
        "point": point,
        "reason": None if status == "ok" else f"{status} happened",
        "metrics": None,
    }
    if status == "ok":
        rec["metrics"] = {
            "tflops": {"median": 10.0, "p20": 11.0, "p80": 9.0},
            "time_ms": {"median": 1.0, "p20": 0.9, "p80": 1.1},
            "tflops_total": 10.0,
            "peak_mem_gib": 0.5,
            "density": 0.5,
        }
    return rec


def test_report_marks_failed_points_and_runs_standalone(tmp_path):
    recs = [
        _fake_record("pallas", 1024, "ok"),
        _fake_record("pallas", 2048, "oom"),
        _fake_record("cudnn", 1024, "unsupported"),
        _fake_record("xla", 1024, "wrong"),
        _fake_record("xla", 2048, "error"),
        _fake_record("sdpa", 1024, "ok", "torch"),
    ]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"torn line')
    paths = report.write_report(results, tmp_path / "rep")
    rows = (tmp_path / "rep" / "results.csv").read_text().splitlines()
    assert len(rows) == 7
    oom_row = next(r for r in rows if ",oom," in r)
    assert ",10.0," not in oom_row
    md = paths["markdown"].read_text()
    for label in ("OOM", "unsup.", "WRONG", "error", "10"):
        assert label in md
    assert paths["plots"] and all(p.stat().st_size > 0 for p in paths["plots"])
    assert paths["grid"].exists() and paths["cross_framework"].exists()
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "report.py"),
            f"--results={results}",
            f"--out_dir={tmp_path / 'cli'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "cli" / "report.md").exists()
    assert (tmp_path / "cli" / "all_plots.png").exists()


def test_csv_and_report_name_total_and_per_device_seqlen(tmp_path):
    """CP rows say seqlen_total and seqlen_per_device, also for records that predate them."""
    from experiments.core.sweep import make_record

    (grid,) = presets.get_preset("smoke", on_gpu=False).cp
    grid = grid.replace(masks=("causal", "full"), modes=("fwd",), seqlens=(16,))
    kw = dict(seed=42, ulysses_size=None, ulysses_intra_node=True)
    points = expand(grid, "jax", ("default",), num_devices=4, **kw)
    metrics = {
        "tflops": {"median": 2.0, "p20": 2.5, "p80": 1.5},
        "time_ms": {"median": 1.0, "p20": 0.8, "p80": 1.2},
    }
    new, old = (make_record(p, "ok", result={"metrics": metrics}) for p in points)
    assert (new["point"]["seqlen_total"], new["point"]["seqlen_per_device"]) == (64, 16)
    for field in ("seqlen_total", "seqlen_per_device"):
        del old["point"][field]
    old["point"].update(seqlen=16, total_seqlen=64)  # how records were written before
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in (new, old)))
    paths = report.write_report(results, tmp_path)
    header, *rows = paths["csv"].read_text().splitlines()
    columns = header.split(",")
    assert "seqlen" not in columns and "total_seqlen" not in columns
    at = columns.index("seqlen_total"), columns.index("seqlen_per_device")
    assert [[row.split(",")[i] for i in at] for row in rows] == [["64", "16"], ["64", "16"]]
    md = paths["markdown"].read_text()
    assert "| mask | seqlen_total | seqlen_per_device | jax/ring/zigzag |" in md
    assert "| causal | 64 | 16 | 2 |" in md and "| full | 64 | 16 | 2 |" in md


def test_row_check_matches_full_reference():
    """The large-size row check is exact: equal to the full float64 reference on those rows."""
    from attn_masks import make_mask, reference_attention

    mask = make_mask("prefix_lm_document", 96, seed=3)
    rng = np.random.default_rng(1)
    shapes = inputs.shapes(2, 96, 4, 2, 8)
    full_in = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    full = reference_attention(full_in["q"], full_in["k"], full_in["v"], mask, dout=full_in["dout"])
    rows = np.array([0, 5, 17, 50, 95])
    cols = np.arange(96)[mask.dense()[rows].any(axis=0)]
    plan = checks.CheckPlan(rows, cols)
    inp = checks.Inputs(
        **{n: x[:, cols] if n in ("k", "v") else x[:, rows] for n, x in full_in.items()}
    )
    part = checks.rows_reference(inp, mask, plan, 1 / np.sqrt(8), grads=True)
    np.testing.assert_allclose(part["out"], full.out[:, rows], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(part["dq"], full.dq[:, rows], rtol=1e-10, atol=1e-12)
    got = {"out": full.out[:, rows] * 1.1, "dq": full.dq[:, rows]}
    res = checks.compare(
        mask, inp, got, plan=plan, grads=True, rtol=1e-4, finite={"dk": True, "dv": False}
    )
    assert not res.ok and res.kind == "rows" and "out" in res.message and "dv" in res.message
    big = make_mask("causal", 4096)
    auto = checks.plan_check(big, 1, 8, seed=0)
    assert auto.kind == "rows" and 0 in auto.rows and 4095 in auto.rows
    assert auto.cols.size == auto.rows.max() + 1


def test_row_reference_on_unmasked_rows_and_rows_without_keys():
    """The row reference's in-place paths: every row seeing every key (no masking pass) and a
    row that sees no key (zeros), each equal to the full float64 reference; the reused
    buffers leave no trace of one head or batch in the next."""
    from attn_masks import from_slices, make_mask, reference_attention

    full = make_mask("full", 80)
    holes = from_slices([[0, 30], [50, 80]], [[0, 40], [20, 80]], [0, 1], 80)  # rows 30-49: none
    rng = np.random.default_rng(7)
    for mask, rows in ((full, np.array([0, 13, 79])), (holes, np.array([0, 31, 49, 60, 79]))):
        shapes = inputs.shapes(2, 80, 6, 3, 8)
        x = {n: rng.standard_normal(sh).astype(np.float32) for n, sh in shapes.items()}
        cols = np.arange(80)[mask.dense()[rows].any(axis=0)]
        inp = checks.Inputs(
            **{n: a[:, cols] if n in ("k", "v") else a[:, rows] for n, a in x.items()}
        )
        part = checks.rows_reference(inp, mask, checks.CheckPlan(rows, cols), 0.3, grads=True)
        want = reference_attention(x["q"], x["k"], x["v"], mask, scale=0.3, dout=x["dout"])
        np.testing.assert_allclose(part["out"], want.out[:, rows], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(part["dq"], want.dq[:, rows], rtol=1e-10, atol=1e-12)
    empty = (rows >= 30) & (rows < 50)
    assert empty.any() and not np.abs(part["out"][:, empty]).any()


def test_row_check_samples_heads_across_kv_groups():
    """Past MAX_HEADS query heads the row check compares a spread of them (first and last
    always, every K/V group of a 64:8 layout), exactly, and fails on a wrong sampled head."""
    from attn_masks import make_mask, reference_attention

    heads = checks.sample_heads(64)
    assert heads.size == checks.MAX_HEADS and heads[0] == 0 and heads[-1] == 63
    assert set((heads // 8).tolist()) == set(range(8))
    assert checks.sample_heads(3).tolist() == [0, 1, 2]
    hq, hkv, s = 16, 4, 64
    mask = make_mask("causal_document", s, seed=5)
    rng = np.random.default_rng(11)
    full_in = {
        n: rng.standard_normal(shape).astype(np.float32)
        for n, shape in inputs.shapes(1, s, hq, hkv, 8).items()
    }
    full = reference_attention(full_in["q"], full_in["k"], full_in["v"], mask, dout=full_in["dout"])
    rows = np.array([0, 9, 40, 63])
    plan = checks.CheckPlan(rows, np.arange(s), checks.sample_heads(hq))
    inp = checks.Inputs(**{n: x[:, rows] if n in ("q", "dout") else x for n, x in full_in.items()})
    part = checks.rows_reference(inp, mask, plan, 1 / np.sqrt(8), grads=True)
    sampled = {n: getattr(full, n)[:, rows][:, :, plan.heads] for n in ("out", "dq")}
    np.testing.assert_allclose(part["out"], sampled["out"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(part["dq"], sampled["dq"], rtol=1e-10, atol=1e-12)
    got = {"out": full.out[:, rows].copy(), "dq": full.dq[:, rows]}
    ok = checks.compare(mask, inp, got, plan=plan, grads=True, rtol=1e-6, finite={})
    assert ok.ok and ok.heads == plan.heads.size
    got["out"][:, :, plan.heads[-1]] *= 1.5
    bad = checks.compare(mask, inp, got, plan=plan, grads=True, rtol=1e-6, finite={})
    assert not bad.ok and "out" in bad.message


@pytest.mark.parametrize("mask_name", ["causal", "share_question", "holes"])
@pytest.mark.parametrize("grads", [True, False])
def test_device_row_reference_is_the_host_reference(mask_name, grads, monkeypatch):
    """The JAX runner's row reference, computed on the device from a point's bf16 inputs (rows
    padded to draw_length, keys gathered in chunks of at most REFERENCE_CHUNK, here 64, so
    several chunks and a padded last one carry the online softmax), equals the host's float64
    rows_reference of the same inputs: grouped K/V heads (8:4), all heads or subsets (the K/V
    heads they read gathered alone), rows seeing one interval, two (a shared question) or
    none."""
    import jax.numpy as jnp
    from cp_cases import named_mask

    from attn_masks import from_slices
    from experiments.runners import device_reference, jax_runner

    monkeypatch.setattr(device_reference, "REFERENCE_CHUNK", 64)
    # the runner sizes its chunks to the keys the rows see (fitted_chunk), not the device's
    monkeypatch.setattr(device_reference, "reference_chunk", lambda *a: pytest.fail("no chunk"))
    s, d = 300, 16
    if mask_name == "holes":  # rows 120-179 see no key
        mask = from_slices([[0, 120], [180, 300]], [[0, 150], [60, 300]], [0, 1], s)
    else:
        mask = named_mask(mask_name, s)
    rng = np.random.default_rng(3)
    args = {
        n: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        for n, shape in inputs.shapes(2, s, 8, 4, d).items()
    }
    rows = np.array([0, 7, 64, 65, 130, 150, 200, 299])
    cols = checks.keys_seen(mask, rows)
    host = checks.Inputs(
        **{n: jax_runner.fetch_rows(x, cols if n in ("k", "v") else rows) for n, x in args.items()}
    )
    reference = jax_runner.row_reference(args, mask)
    for heads in (None, np.array([1, 2]), np.array([4, 7]), np.array([3])):
        plan = checks.CheckPlan(rows, cols, heads)
        got = reference(plan, 0.3, grads)
        want = checks.rows_reference(host, mask, plan, 0.3, grads)
        assert sorted(got) == sorted(want) == (["dq", "out"] if grads else ["out"])
        shape = (2, rows.size, 8 if heads is None else heads.size, d)
        for name in want:
            assert got[name].dtype == np.float64 and got[name].shape == want[name].shape == shape
            assert np.abs(want[name]).max() > 0
            np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12)


def test_jax_row_check_computes_its_reference_on_the_device(tmp_path, monkeypatch):
    """A single-device JAX point whose check takes a row plan (FULL_CHECK_ELEMENTS lowered)
    computes its float64 rows on the device (jax_runner.row_reference) where the runner asks
    for them (on a GPU; here as on one): the host's rows_reference is never called and only
    the compared out and dq rows come to the host, no input; the check passes on a right
    kernel and fails on one 1% off. On a CPU the runner keeps the host's pass."""
    from types import SimpleNamespace

    import jax_attn
    from experiments.runners import device_reference, jax_runner

    gate = jax_runner.JaxRunner._row_reference
    gpu, cpu = SimpleNamespace(on_gpu=True), SimpleNamespace(on_gpu=False)
    single, cp = SimpleNamespace(is_cp=False), SimpleNamespace(is_cp=True)
    assert callable(gate(gpu, single, None, {}))
    assert gate(gpu, cp, None, {}) is None and gate(cpu, single, None, {}) is None
    monkeypatch.setattr(jax_runner.JaxRunner, "_row_reference", lambda self, *a: gate(gpu, *a))

    def host_reference(*args, **kwargs):
        raise AssertionError("the host row reference ran")

    monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 0)
    monkeypatch.setattr(checks, "rows_reference", host_reference)
    fetched, references = [], []
    real_fetch, real_reference = jax_runner.fetch_rows, device_reference.rows_reference
    monkeypatch.setattr(
        jax_runner, "fetch_rows", lambda x, index: fetched.append(index) or real_fetch(x, index)
    )
    monkeypatch.setattr(
        device_reference,
        "rows_reference",
        lambda *a, **k: references.append(a[1]) or real_reference(*a, **k),
    )
    point = [
        "--framework=jax",
        "--impl=reference",
        "--mask=causal_document",
        "--mode=fwd_bwd",
        "--heads_q=4",
        "--heads_kv=2",
        *(a for a in TINY if not a.startswith("--heads")),
    ]
    assert _run_in_process([*point, f"--out_dir={tmp_path / 'right'}"]) == 0
    (rec,) = _records(tmp_path / "right")
    assert rec["status"] == "ok", rec["reason"]
    assert rec["check"]["kind"] == "rows" and set(rec["check"]["max_errors"]) == {"out", "dq"}
    assert len(references) == 1 and references[0].size == 64  # every row of the 64
    assert len(fetched) == 2 and all(np.array_equal(i, references[0]) for i in fetched)
    real = jax_attn.attention
    monkeypatch.setattr(jax_attn, "attention", lambda *a, **k: real(*a, **k) * 1.01)
    assert _run_in_process([*point, f"--out_dir={tmp_path / 'wrong'}"]) == 0
    (rec,) = _records(tmp_path / "wrong")
    assert rec["status"] == "wrong" and rec["check"]["kind"] == "rows"
    assert rec["check"]["errors"]["out"] > rec["check"]["rtol"]["out"]
    assert len(references) == 2


def test_exception_classification_and_seqlen_parsing():
    assert outcomes.classify(MemoryError())[0] == "oom"
    assert outcomes.classify(RuntimeError("RESOURCE_EXHAUSTED: out of HBM"))[0] == "oom"
    assert outcomes.classify(ImportError("no module x"))[1].startswith("not available: ")
    assert outcomes.classify(NotImplementedError("nope"))[0] == "unsupported"
    assert outcomes.classify(ValueError("bad"))[0] == "error"
    import torch

    assert outcomes.classify(torch.OutOfMemoryError("CUDA out of memory"))[0] == "oom"
    assert [parse_seqlen(s) for s in ("8K", "512", "1m", "48k")] == [8192, 512, 1 << 20, 49152]


def test_input_shards_match_the_global_inputs():
    """A shard generated alone equals the same tokens of the whole input (any chunk split)."""
    shape = (2, 10000, 1, 2)
    whole = inputs.block("k", shape, 42, 3)
    assert whole.shape == shape and whole.dtype == np.float32
    for sl in (slice(0, 4096), slice(4000, 9000), slice(9999, 10000), slice(8192, None)):
        np.testing.assert_array_equal(inputs.block("k", shape, 42, 3, sl), whole[:, sl])
    assert not np.array_equal(inputs.block("q", shape, 42, 3), whole)
    assert not np.array_equal(inputs.block("k", shape, 42, 4), whole)


@pytest.mark.parametrize("threads", [1, 3])
def test_inputs_are_their_seeded_chunks_whatever_the_threads(threads, monkeypatch):
    """Each 4096-token chunk is drawn from its own seed, so the threads that draw them change no
    value; batch 2 makes every chunk a strided slice of the result."""
    monkeypatch.setattr(inputs.os, "cpu_count", lambda: threads)
    inputs._cached_block.cache_clear()
    shape = (2, 9000, 3, 4)
    got = inputs.block("v", shape, 7, 1)
    chunks = [
        np.random.default_rng([7, 1, inputs.NAMES.index("v"), c]).standard_normal(
            (2, min(inputs.CHUNK, 9000 - c * inputs.CHUNK), 3, 4), dtype=np.float32
        )
        for c in range(3)
    ]
    np.testing.assert_array_equal(got, np.concatenate(chunks, axis=1))
    np.testing.assert_array_equal(
        inputs.block("v", shape, 7, 1, slice(4000, 8200)), got[:, 4000:8200]
    )
    inputs._cached_block.cache_clear()


@pytest.mark.parametrize("threads", [1, 3])
def test_inputs_cast_on_every_core_as_numpy_casts(threads, monkeypatch):
    """The inputs' cast, 4096 tokens at a time in threads, equals numpy's cast of the whole
    array bit for bit (bfloat16 and float16; a strided slice of a batch-2 block of a length
    that is no multiple of the chunk), and the JAX runner's inputs hold exactly those values."""
    import jax.numpy as jnp

    from experiments.runners.jax_runner import JaxRunner

    monkeypatch.setattr(inputs.os, "cpu_count", lambda: threads)
    x = inputs.block("q", (2, 9000, 3, 4), 5, 0)[:, :, 1:]
    for dtype in (jnp.bfloat16, np.float16):
        got, want = inputs.cast(x, dtype), x.astype(dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    (grid,) = presets.get_preset("smoke", on_gpu=False).kernel
    kw = dict(seed=42, num_devices=1, ulysses_size=None, ulysses_intra_node=True)
    point = dataclasses.replace(expand(grid, "jax", ("reference",), **kw)[0], dtype="bf16")
    made = JaxRunner().inputs(point, 0, None)["dout"]
    want = inputs.block("dout", tuple(made.shape), point.seed, 0).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(made).view(np.uint16), want.view(np.uint16))


def test_device_inputs_build_once_and_drop_the_oldest():
    built: list[str] = []

    def build(key: str, nbytes: int):
        return lambda: built.append(key) or {"x": np.zeros(nbytes, np.uint8)}

    cache = inputs.DeviceInputs(entries=2, max_bytes=100)
    first = cache.get("a", 10, build("a", 10))
    assert cache.get("a", 10, build("a", 10)) is first and built == ["a"]
    cache.get("b", 10, build("b", 10))
    cache.get("c", 10, build("c", 10))  # two entries at most: "a" goes
    cache.get("a", 10, build("a", 10))
    assert built == ["a", "b", "c", "a"]
    cache.get("big", 95, build("big", 95))  # 100 bytes at most: every other entry goes
    assert cache.held_bytes() == 95
    cache.get("c", 10, build("c", 10))
    assert built[-2:] == ["big", "c"] and cache.held_bytes() == 10


def test_torch_inputs_are_shared_storage_but_their_own_grad_flags():
    from experiments.runners.torch_runner import TorchRunner

    (grid,) = presets.get_preset("smoke", on_gpu=False).kernel
    kw = dict(seed=42, num_devices=1, ulysses_size=None, ulysses_intra_node=True)
    point = expand(grid, "torch", ("naive",), **kw)[0]
    runner = TorchRunner()
    a = runner.inputs(point, 0)
    a["q"].requires_grad_(True)
    b = runner.inputs(point, 0)
    assert b["q"].data_ptr() == a["q"].data_ptr() and not b["q"].requires_grad
    want = inputs.block("q", tuple(b["q"].shape), point.seed, 0)
    np.testing.assert_array_equal(b["q"].float().numpy(), want.astype(b["q"].numpy().dtype))


def test_points_of_one_input_shape_run_in_a_row():
    """Shape-major order: the inputs of a shape are generated once per sweep."""
    (grid,) = presets.get_preset("cross", on_gpu=True).kernel
    kw = dict(seed=42, num_devices=1, ulysses_size=None, ulysses_intra_node=True)
    points = expand(grid, "jax", ("a", "b"), **kw)
    shapes = [(p.heads_q, p.heads_kv, p.seqlen_total) for p in points]
    runs = 1 + sum(x != y for x, y in zip(shapes, shapes[1:]))
    assert runs == len(set(shapes)) == len(grid.heads) * len(grid.seqlens)
    assert len(points) == len(set(p.key for p in points)) == 2 * 12 * 3 * 2 * 2


def _flat(framework: str, impl: str, tflops: float | None, *, seqlen: int = 1024, status="ok"):
    """A report row of a kernel point with only the fields the comparison tables read."""
    return {
        "framework": framework,
        "impl": impl,
        "status": status,
        "tflops": tflops if status == "ok" else None,
        "cp": "none",
        "layout": None,
        "mask": "causal",
        "seqlen_total": seqlen,
        "seqlen_per_device": seqlen,
        "mode": "fwd",
        "batch": 1,
        "heads_q": 4,
        "heads_kv": 2,
        "head_dim": 64,
        "dtype": "bfloat16",
        "reference_compat": False,
    }


def test_same_kernel_table_flags_gaps_over_three_percent():
    from experiments.reports.report import control_summary, cross_framework, same_kernel

    rows = [
        _flat("jax", "triton", 100.0),
        _flat("torch", "triton", 95.0),
        _flat("jax", "triton", 100.0, seqlen=2048),
        _flat("torch", "triton", 99.0, seqlen=2048),
        _flat("jax", "triton", None, seqlen=4096, status="oom"),
        _flat("torch", "triton", 50.0, seqlen=4096),
        _flat("torch", "triton", 70.0, seqlen=8192),
        _flat("jax", "cudnn", 120.0),
        _flat("torch", "sdpa_cudnn", 100.0),
    ]
    by_len = {r["seqlen_total"]: r for r in same_kernel(rows)}
    assert sorted(by_len) == [1024, 2048, 4096]  # 8192 ran in one framework only
    assert by_len[1024]["jax_vs_torch"] == f"{100 / 95 - 1:+.1%} (over 3%: profile)"
    assert by_len[2048]["jax_vs_torch"] == f"{100 / 99 - 1:+.1%}"
    assert (by_len[4096]["jax"], by_len[4096]["jax_vs_torch"]) == ("OOM", "-")
    ring = {
        "cp": "ring",
        "layout": "zigzag",
        "seqlen_per_device": 2048,
        "num_devices": 4,
        "scaling": "weak",
    }
    rows += [
        _flat("jax", "cudnn", 101.5, seqlen=2048),
        _flat("torch", "sdpa_cudnn", 100.0, seqlen=2048),
        {**_flat("jax", "cudnn", 97.0, seqlen=8192), **ring},
        {**_flat("torch", "sdpa_cudnn", 100.0, seqlen=8192), **ring},
    ]
    cross = {r["seqlen_total"]: r for r in cross_framework(rows)}
    assert cross[1024]["best_jax"] == "cudnn 120" and cross[1024]["jax_over_torch"] == "1.20x"
    assert cross[4096]["cudnn_jax_vs_torch"] == cross[4096]["cudnn_within_2pct"] == "-"
    # the control: cuDNN from both frameworks within 2% (1.5% apart: yes; 20% or 3%: NO, named
    # with the signed gap, the CP point with its strategy and per-device length)
    gaps = {1024: "+20.0%", 2048: "+1.5%", 8192: "-3.0%"}  # 120, 101.5, 97 against 100
    assert {s: cross[s]["cudnn_jax_vs_torch"] for s in gaps} == gaps
    within = {s: cross[s]["cudnn_within_2pct"] for s in gaps}
    assert within == {1024: "NO", 2048: "yes", 8192: "NO"}
    (line, _) = control_summary(list(cross.values()))
    assert line == (
        "cuDNN control: 1 of 3 points within 2% between the frameworks; outside: "
        f"causal 1024 fwd b1 h4:2 d64 bfloat16 {gaps[1024]}; "
        f"ring/zigzag causal 8192 (2048/device) fwd b1 h4:2 d64 bfloat16 x4 weak {gaps[8192]}."
    )


def test_cudnn_control_is_judged_on_the_median_of_repeat_runs():
    """Repeat runs of the control join the grid's run of the same point: the gap is between the
    frameworks' medians over their ok runs; other points' and other impls' repeats stay out."""
    from experiments.reports.report import cross_framework

    rows = [
        _flat("jax", "cudnn", 120.0),
        _flat("torch", "sdpa_cudnn", 100.0),
        _flat("jax", "mosaic", 130.0),
        _flat("jax", "cudnn", 90.0, seqlen=2048),
        _flat("torch", "sdpa_cudnn", 100.0, seqlen=2048),
    ]
    repeats = [
        _flat("jax", "cudnn", 101.0),
        _flat("jax", "cudnn", 99.0),
        _flat("jax", "cudnn", None, status="error"),
        _flat("torch", "sdpa_cudnn", 102.0),
        _flat("torch", "sdpa_cudnn", 98.0),
        _flat("jax", "mosaic", 500.0),  # not the control: the best stays the grid's
    ]
    alone = {r["seqlen_total"]: r for r in cross_framework(rows)}
    judged = {r["seqlen_total"]: r for r in cross_framework(rows, repeats)}
    assert alone[1024]["cudnn_within_2pct"] == "NO"  # 120 against 100 in one run each
    # medians: JAX of 120, 101, 99 is 101; torch of 100, 102, 98 is 100
    assert judged[1024]["cudnn_jax"] == "101 (median of 3)"
    assert judged[1024]["cudnn_torch"] == "100 (median of 3)"
    assert judged[1024]["cudnn_jax_vs_torch"] == f"{101 / 100 - 1:+.1%}"
    assert judged[1024]["cudnn_within_2pct"] == "yes"
    assert judged[1024]["best_jax"] == "mosaic 130"
    assert judged[2048] == alone[2048]  # no repeat of that point: one run each, -10%
    assert judged[2048]["cudnn_within_2pct"] == "NO"


def test_jax_vs_torch_heatmap_cells(tmp_path):
    """Each cell is best JAX / best torch of its (mask, length); a side without an ok point
    leaves the cell without a ratio (drawn grey, labelled), never a number."""
    from experiments.reports.report import cross_cells, write_cross_plot

    rows = [
        _flat("jax", "mosaic", 300.0),
        _flat("jax", "cudnn", 360.0),
        _flat("torch", "flex", 200.0),
        _flat("torch", "flash4", 400.0),
        _flat("jax", "mosaic", 250.0, seqlen=2048),
        _flat("torch", "flex", None, seqlen=2048, status="unsupported"),
        _flat("jax", "mosaic", 100.0, seqlen=4096),
    ]
    (panel,) = cross_cells(rows).values()
    cells = {c["col"]: c for c in panel}
    assert sorted(cells) == [1024, 2048]  # 4096 ran in one framework only
    assert cells[1024]["ratio"] == pytest.approx(360.0 / 400.0)
    assert cells[1024]["label"] == "0.90x\ncudnn / flash4"
    assert cells[2048]["ratio"] is None and cells[2048]["label"] == "jax only: mosaic"
    path = write_cross_plot(rows, tmp_path)
    assert path.exists() and path.stat().st_size > 0


@pytest.mark.parametrize("framework", ["torch", "both"])
def test_a_framework_that_is_not_installed_is_one_line_with_the_install_command(
    framework, tmp_path, monkeypatch, capsys
):
    """Never records of 'not available' points: one line, the pip command, a failing status."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    args = [f"--framework={framework}", "--mask=causal", "--mode=fwd", *TINY]
    assert _run_in_process([*args, f"--out_dir={tmp_path}"]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == (
        "FATAL Flags parsing error: --framework=torch "
        "needs PyTorch, which is not installed in this Python; install it with: "
        'pip install -e ".[torch]"'
    )
    assert not (tmp_path / "results.jsonl").exists() and "to run." not in out


def test_a_gpu_preset_on_a_cpu_is_refused_unless_asked_for(tmp_path, capsys):
    """--preset=paper on a CPU would run for many hours: one line saying what to run instead;
    --allow_slow (here with --dry_run, which only lists) plans it."""
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("a GPU is present")
    args = ["--preset=paper", "--framework=jax", f"--out_dir={tmp_path}"]
    assert _run_in_process(args) == 1
    out, err = capsys.readouterr()
    line = err.splitlines()[0]
    assert line.startswith("FATAL Flags parsing error: --preset=paper has GPU sizes (up to ")
    assert "--allow_slow" in line and "no --preset" in line
    assert not (tmp_path / "results.jsonl").exists()
    assert _run_in_process([*args, "--allow_slow", "--dry_run"]) == 0
    assert "points" in capsys.readouterr().out


def test_gpu_runs_keep_compiled_programs_in_the_repo_cache():
    """A GPU runner points JAX's persistent compilation cache at the repo's ignored .cache/jax
    unless a folder is configured (JAX_COMPILATION_CACHE_DIR), which it keeps; a CPU runner
    leaves the setting alone."""
    import jax

    from experiments.runners import jax_runner

    before = jax.config.jax_compilation_cache_dir
    root = jax_runner.COMPILATION_CACHE.parents[1]
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        jax_runner.JaxRunner()  # the CPU here
        assert jax.config.jax_compilation_cache_dir is None
        assert jax_runner.use_compilation_cache(jax) == str(root / ".cache" / "jax")
        assert (root / "pyproject.toml").exists() and "/.cache/" in (
            root / ".gitignore"
        ).read_text()
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")
        assert jax_runner.use_compilation_cache(jax) == "/elsewhere"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.parametrize("impls", [None, ("all",)])
def test_simulated_points_cover_every_device_count_at_one_length_first(impls):
    """--simulate_devices lists the grid's first --seqlen at every device count (in the order
    given) before any point of the next length, each (length, count) block in the grid's own
    order, and the same points as expanding each device count alone (with impls 'all' too,
    whose kept impls are chosen per device count over every length)."""
    from collections import Counter
    from types import SimpleNamespace

    from experiments import driver
    from experiments.core import presets

    (grid,) = presets.get_preset("cp_predict", on_gpu=True).cp
    if impls is not None:  # 'all' builds each point's mask: an eighth of the preset's lengths
        grid = grid.replace(
            impls=impls, masks=grid.masks[:2], seqlens=tuple(s // 8 for s in grid.seqlens)
        )
    sizes = (16, 8, 64)
    settings = SimpleNamespace(
        seed=42, ulysses_size=None, ulysses_intra_node=True, workload="attention", link="l"
    )
    points = driver._simulated_points("jax", grid, sizes, settings, [])
    assert len(grid.seqlens) > 1 and all(p.simulated and p.link == "l" for p in points)
    blocks = list(dict.fromkeys((p.seqlen_per_device, p.num_devices) for p in points))
    assert blocks == [(s, n) for s in grid.seqlens for n in sizes]
    alone = [p for n in sizes for p in driver._grid_points("jax", grid, n, settings, [])]
    for s, n in blocks:
        one = [p for p in alone if (p.seqlen_per_device, p.num_devices) == (s, n)]
        block = [p for p in points if (p.seqlen_per_device, p.num_devices) == (s, n)]
        assert [dataclasses.replace(p, simulated=False, link=one[0].link) for p in block] == one
    plain = [dataclasses.replace(p, simulated=False, link=alone[0].link) for p in points]
    assert Counter(plain) == Counter(alone)


def test_check_fetch_gathers_any_rows_as_float32_in_few_programs():
    """jax_runner.fetch_rows (a check's copy to the host) gives exactly x's rows at the given
    positions, in their order, as float32, or all of x; row counts within one draw_length
    bucket share one compiled gather (a check asks ever-different counts)."""
    import jax.numpy as jnp

    from experiments.runners import jax_runner

    rng = np.random.default_rng(11)
    x_host = rng.standard_normal((2, 300, 3, 8)).astype(np.float32)
    x = jnp.asarray(x_host, jnp.bfloat16)
    want_all = np.asarray(x.astype(jnp.float32))
    got = jax_runner.fetch_rows(x, None)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want_all)
    take = jax_runner._take_f32()
    sizes_before = None
    for n in (129, 140, 150, 160, 7):
        index = rng.choice(300, n, replace=False)
        got = jax_runner.fetch_rows(x, index)
        assert got.dtype == np.float32 and got.shape == (2, n, 3, 8)
        np.testing.assert_array_equal(got, want_all[:, index])
        if n == 129:
            sizes_before = take._cache_size()
    assert take._cache_size() == sizes_before + 1  # 140-160 shared 129's, 7 one more
