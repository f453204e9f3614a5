"""experiments/report_cp.py on synthetic records in both CP writers' formats (checked against
records the real writers produce on CPU): table cells, status labels, JAX vs PyTorch pairing,
targets, CSV, plots and the missing-file error."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import report_cp

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "--tokens_per_gpu=64",
    "--heads_q=3",
    "--heads_kv=1",
    "--head_dim=16",
    "--masks=causal",
    "--layouts=zigzag",
    "--modes=fwd",
    "--check_rows=4",
    "--warmup=0",
    "--iters=1",
    "--dtype=float32",
]
SHAPE = {"heads_q": 64, "heads_kv": 8, "head_dim": 128, "dtype": "bfloat16"}
COMM = {
    "fwd_formula_elements": 1.0,
    "bwd_formula_elements": 2.0,
    "fwd_formula_bytes": 2.0,
    "bwd_formula_bytes": 4.0,
    "fwd_elements": 1.0,
    "bwd_elements": 2.0,
}
PLAN = {
    "strategy": "ring",
    "layout": "zigzag",
    "world_size": 8,
    "ulysses_size": 1,
    "ring_size": 8,
    "num_windows": 1,
    "inner_axis": "ulysses",
    "seqlen": 1,
    "padded_seqlen": 1,
    "num_steps": 8,
    "dropped_steps": 0,
    "empty_pieces": 0,
    "load_balance": 1.0,
    "critical_area": 1.0,
    "ideal_area": 1.0,
}
TIMES = {"median": 2.0, "p20": 1.9, "p80": 2.1, "min": 1.8, "max": 2.2, "n": 8}


def _point(mask: str, tokens: int, strategy: str, layout: str, mode: str, n: int) -> dict:
    return {
        "mask": mask,
        "tokens_per_gpu": tokens,
        "seqlen": tokens * n,
        "strategy": strategy,
        "layout": layout,
        "mode": mode,
    }


def _info(fwd_bytes: float, n: int) -> dict:
    return {
        "plan": {**PLAN, "world_size": n},
        "plan_seconds": 0.1,
        "comm": {**COMM, "fwd_bytes": fwd_bytes, "bwd_bytes": 2 * fwd_bytes},
    }


def jax_record(
    mask: str = "causal",
    tokens: int = 16384,
    strategy: str = "ring",
    layout: str = "zigzag",
    mode: str = "fwd",
    *,
    n: int = 8,
    status: str = "ok",
    tflops: float = 300.0,
    single: float = 400.0,
    fwd_bytes: float = 1e9,
    time: float = 1.0,
) -> dict:
    """A line as bench_cp_jax.Bench.write writes it (meta, point, plan info, measurements)."""
    meta = {
        "jax": "0.10.2",
        "python": "3.11.7",
        "device_kind": "NVIDIA H200",
        "num_gpus": n,
        "impl": "pallas",
        **SHAPE,
        "xla_flags": "",
    }
    rec = {**meta, **_point(mask, tokens, strategy, layout, mode, n)}
    if status == "unsupported":
        return {**rec, "status": status, "error": "no plan", "time": time}
    rec.update(_info(fwd_bytes, n), compile_seconds=1.0, check={"out": 1e-3, "lse": 1e-3})
    if status != "ok":
        return {**rec, "status": status, "error": f"{status} happened", "time": time}
    return {
        **rec,
        "status": "ok",
        "time_ms": TIMES,
        "tflops_per_gpu": tflops,
        "peak_bytes_in_use": 40 * 2**30,
        "compiled_bytes": 30 * 2**30,
        "single_gpu_tflops": single,
        "single_gpu_ms": 1.0,
        "time": time,
    }


def torch_record(
    mask: str = "causal",
    tokens: int = 16384,
    strategy: str = "ring",
    layout: str = "zigzag",
    mode: str = "fwd",
    *,
    n: int = 8,
    status: str = "ok",
    tflops: float = 250.0,
    single: float = 400.0,
    fwd_bytes: float = 1e9,
    time: float = 1.0,
) -> dict:
    """A line as bench_cp_torch.Bench.write writes it (meta, point, plan info, measurements)."""
    meta = {
        "framework": "torch",
        "world_size": n,
        **SHAPE,
        "inner_axis": "ulysses",
        "versions": {"python": "3.11.7", "torch": "2.13.0"},
        "devices": {"backend": "cuda", "device_kind": ["NVIDIA H200"], "device_count": n},
        "git": {"commit": "abc", "dirty": False},
    }
    point = _point(mask, tokens, strategy, layout, mode, n)
    rec = {**meta, **point, "impl": "flex"}
    if status == "stopped":
        return {**meta, "status": status, "error": "--max_minutes reached", "time": time}
    if status == "unsupported":
        return {**rec, "status": status, "error": "no plan", "time": time}
    rec.update(_info(fwd_bytes, n))
    if status != "ok":
        return {**rec, "status": status, "error": f"{status} happened", "time": time}
    return {
        **rec,
        "first_call_seconds": 1.0,
        "sent_bytes": {"fwd": fwd_bytes, "bwd": 0, "dispatch": 0, "lse": 0},
        "check": {"out": 1e-3, "lse": 1e-3},
        "time_ms": TIMES,
        "peak_gib_max": 50.0,
        "peak_gib_mean": 49.0,
        "status": "ok",
        "tflops_per_gpu": tflops,
        "single_gpu_tflops": single,
        "single_gpu_ms": 1.0,
        "single_gpu_peak_gib": 20.0,
        "time": time,
    }


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _table(md: str, heading: str) -> list[dict]:
    """The rows of the markdown table under `## heading`, as dicts by column name."""
    part = md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in part.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


@pytest.fixture(scope="module")
def real_files(tmp_path_factory) -> dict[str, Path]:
    """One tiny CPU run of each writer (2 virtual devices / 2 gloo ranks), run side by side.

    A gloo rank sometimes aborts at exit after its records are written ('terminate called
    without an active exception'); that teardown failure is tolerated, any other is not.
    """
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("real")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    jax_env = {
        **env,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    runs = {
        "jax": (
            [sys.executable, str(REPO / "experiments/bench_cp_jax.py"), f"--out={out}/jax.jsonl"]
            + TINY
            + ["--strategies=ring,ulysses", "--impl=reference"],
            jax_env,
        ),
        "torch": (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                str(REPO / "experiments/bench_cp_torch.py"),
                f"--out={out}/torch.jsonl",
            ]
            + TINY
            + ["--strategies=ring", "--impls=sdpa_math"],
            env,
        ),
    }
    procs = {
        k: subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for k, (cmd, e) in runs.items()
    }
    for k, p in procs.items():
        log, _ = p.communicate(timeout=300)
        torn_down = "terminate called without an active exception" in log
        wrote = (out / f"{k}.jsonl").is_file()
        assert p.returncode == 0 or (torn_down and wrote), f"{k} writer failed:\n{log[-3000:]}"
    return {k: out / f"{k}.jsonl" for k in runs}


def _lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _shape_of(rec: dict) -> dict:
    """Key sets of a record and of its nested dicts."""
    return {k: sorted(v) if isinstance(v, dict) else None for k, v in rec.items()}


def test_synthetic_records_have_the_writers_keys(real_files):
    jax_recs, torch_recs = _lines(real_files["jax"]), _lines(real_files["torch"])
    by_status = {r["status"]: r for r in jax_recs}
    assert set(by_status) == {"ok", "unsupported"}
    assert _shape_of(jax_record()) == _shape_of(by_status["ok"])
    assert _shape_of(jax_record(strategy="ulysses", status="unsupported")) == _shape_of(
        by_status["unsupported"]
    )
    assert [r["status"] for r in torch_recs] == ["ok"]
    synthetic = _shape_of(torch_record())
    real = _shape_of(torch_recs[0])
    assert synthetic.keys() == real.keys()
    assert {k: v for k, v in synthetic.items() if k not in ("versions", "devices")} == {
        k: v for k, v in real.items() if k not in ("versions", "devices")
    }
    assert [report_cp.framework_of(r) for r in (jax_recs[0], torch_recs[0])] == ["jax", "torch"]


def test_report_on_real_writer_records(real_files, tmp_path):
    paths = report_cp.write_report([real_files["jax"], real_files["torch"]], tmp_path)
    md = paths["markdown"].read_text()
    jax_table = _table(md, "jax x2 GPUs, fwd: h3:1 d16 float32, impl reference")
    assert jax_table[0]["ulysses/zigzag"] == "unsup."
    cross = _table(md, "JAX vs PyTorch")
    assert len(cross) == 1
    assert cross[0]["strategy/layout"] == "ring/zigzag" and cross[0]["plans agree"] == "yes"
    with paths["csv"].open() as f:
        assert len(list(csv.DictReader(f))) == 3


def test_cells_show_rate_and_efficiency_and_labels(tmp_path):
    recs = [
        jax_record("causal", 8192, "ring", "zigzag", tflops=310.0, single=420.0),
        jax_record("causal", 8192, "ulysses", "zigzag", tflops=123.456, single=130.0),
        jax_record("causal", 32768, "ring", "zigzag", status="oom"),
        jax_record("causal", 32768, "ulysses", "zigzag", status="wrong"),
        jax_record("full", 8192, "ring", "zigzag", status="error"),
        jax_record("full", 8192, "ulysses", "zigzag", status="unsupported"),
    ]
    md = report_cp.write_report([_write(tmp_path / "j.jsonl", recs)], tmp_path / "out")[
        "markdown"
    ].read_text()
    rows = _table(md, "jax x8 GPUs, fwd: h64:8 d128 bfloat16, impl pallas")
    cells = {(r["mask"], int(r["tokens/GPU"]), s): r[s] for r in rows for s in r if "/" in s}
    for rec in recs[:2]:
        eff = 100.0 * rec["tflops_per_gpu"] / rec["single_gpu_tflops"]
        want = f"{rec['tflops_per_gpu']:.3g} ({eff:.1f}%)"
        assert cells[("causal", 8192, f"{rec['strategy']}/zigzag")] == want
    labels = {
        ("causal", 32768, "ring/zigzag"): "OOM",
        ("causal", 32768, "ulysses/zigzag"): "WRONG",
        ("full", 8192, "ring/zigzag"): "error",
        ("full", 8192, "ulysses/zigzag"): "unsup.",
    }
    for key, text in labels.items():
        assert cells[key] == text and not re.search(r"\d", cells[key])


def test_cross_framework_pairs_and_flags_bytes_mismatch(tmp_path):
    jax_recs = [
        jax_record("causal", 16384, "ring", "zigzag", tflops=300.0, fwd_bytes=1e9),
        jax_record("causal", 16384, "allgather", "zigzag", fwd_bytes=2e9),
        jax_record("causal", 16384, "ulysses", "zigzag", fwd_bytes=3e9),
    ]
    torch_recs = [
        torch_record("causal", 16384, "ring", "zigzag", tflops=250.0, fwd_bytes=1e9),
        torch_record("causal", 16384, "allgather", "zigzag", status="oom", fwd_bytes=4e9),
        torch_record("causal", 16384, "ulysses", "zigzag", n=4, fwd_bytes=3e9),
        torch_record("causal", 16384, "ring", "zigzag", mode="fwd_bwd"),
    ]
    files = [_write(tmp_path / "j.jsonl", jax_recs), _write(tmp_path / "t.jsonl", torch_recs)]
    md = report_cp.write_report(files, tmp_path / "out")["markdown"].read_text()
    cross = {r["strategy/layout"]: r for r in _table(md, "JAX vs PyTorch")}
    assert set(cross) == {"ring/zigzag", "allgather/zigzag"}
    ring = cross["ring/zigzag"]
    assert ring["jax/torch"] == f"{300.0 / 250.0:.2f}x"
    assert ring["plans agree"] == "yes"
    assert (ring["jax peak GiB"], ring["jax compiled GiB"], ring["torch peak GiB"]) == (
        "40.00",
        "30.00",
        "50.00",
    )
    assert ring["bytes moved/GPU"] == f"{1e9 / 2**20:.3g} MiB"
    ag = cross["allgather/zigzag"]
    assert ag["torch TFLOP/s/GPU"] == "OOM" and ag["jax/torch"] == "-"
    assert ag["plans agree"].startswith("MISMATCH")


def test_targets_met_and_missed(tmp_path):
    def rec(mask, layout, eff, strategy="ring", tokens=16384, mode="fwd"):
        return jax_record(mask, tokens, strategy, layout, mode, tflops=eff * 4.0, single=400.0)

    recs = [
        rec("causal", "zigzag", 96.0),
        rec("causal", "contiguous", 99.0, tokens=32768),
        rec("causal", "zigzag", 90.0, tokens=32768),
        rec("causal", "zigzag", 99.0, tokens=8192),
        rec("causal", "zigzag", 99.0, strategy="usp", tokens=65536),
        rec("causal_document", "balanced", 80.0),
        rec("causal_document", "zigzag", 99.0),
        rec("share_question", "balanced", 86.0, strategy="allgather"),
        rec("share_question", "balanced", 70.0),
        rec("share_question", "contiguous", 99.0, tokens=32768),
        rec("full", "zigzag", 10.0),
    ]
    md = report_cp.write_report([_write(tmp_path / "j.jsonl", recs)], tmp_path / "o")[
        "markdown"
    ].read_text()
    got = {
        (r["mask"], int(r["tokens/GPU"])): (r["best"], r["efficiency"], r["result"])
        for r in _table(md, "Targets")
    }
    assert got == {
        ("causal", 16384): ("ring/zigzag", "96.0%", "met"),
        ("causal", 32768): ("ring/zigzag", "90.0%", "missed"),
        ("causal", 65536): ("-", "-", "no data"),
        ("causal_document", 16384): ("ring/balanced", "80.0%", "missed"),
        ("share_question", 16384): ("allgather/balanced", "86.0%", "met"),
        ("share_question", 32768): ("-", "-", "no data"),
    }


def test_csv_keeps_latest_record_per_key_and_stopped_lines(tmp_path):
    recs = [
        torch_record(tflops=100.0, time=2.0),
        torch_record(tflops=200.0, time=1.0),
        torch_record(tokens=32768, tflops=150.0, time=3.0),
        torch_record(status="stopped", time=4.0),
    ]
    paths = report_cp.write_report([_write(tmp_path / "t.jsonl", recs)], tmp_path / "o")
    with paths["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["tokens_per_gpu"], r["tflops_per_gpu"], r["status"]) for r in rows] == [
        ("16384", "100.0", "ok"),
        ("32768", "150.0", "ok"),
        ("", "", "stopped"),
    ]
    assert rows[0]["framework"] == "torch" and rows[0]["num_gpus"] == "8"
    assert float(rows[0]["efficiency_pct"]) == pytest.approx(100.0 * 100.0 / 400.0)
    md = paths["markdown"].read_text()
    assert "sweep stopped (--max_minutes reached)" in md


def test_efficiency_and_scaling_plots(tmp_path):
    recs = []
    for n in (2, 8):
        for mask in ("causal", "share_question"):
            for tokens in (8192, 16384):
                recs.append(torch_record(mask, tokens, "ring", "zigzag", n=n))
                recs.append(torch_record(mask, tokens, "ulysses", "zigzag", n=n, status="oom"))
    recs.append(torch_record("causal", 8192, "ring", "balanced", n=2, mode="fwd_bwd"))
    paths = report_cp.write_report([_write(tmp_path / "t.jsonl", recs)], tmp_path / "o")
    eff = {p.name for p in paths["efficiency_plots"]}
    assert eff == {
        f"eff_torch_x{n}_{mode}_{mask}_h64_8_d128_bfloat16_flex.png"
        for n, mode, mask in [
            (2, "fwd", "causal"),
            (2, "fwd", "share_question"),
            (8, "fwd", "causal"),
            (8, "fwd", "share_question"),
            (2, "fwd_bwd", "causal"),
        ]
    }
    scaling = {p.name for p in paths["scaling_plots"]}
    assert scaling == {
        f"scaling_torch_fwd_{mask}_{t}_h64_8_d128_bfloat16_flex.png"
        for mask in ("causal", "share_question")
        for t in (8192, 16384)
    }
    for p in paths["efficiency_plots"] + paths["scaling_plots"]:
        assert p.is_file() and p.stat().st_size > 1000


def test_missing_results_path_is_named(tmp_path):
    good = _write(tmp_path / "j.jsonl", [jax_record()])
    missing = tmp_path / "nope" / "cp.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        report_cp.write_report([good, missing], tmp_path / "o")
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "experiments/report_cp.py"),
            f"--results={good},{missing}",
            f"--out_dir={tmp_path / 'o'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0
    assert str(missing) in res.stderr
