"""The CP report (experiments/reports/report_cp.py) on synthetic driver records (checked against
records the driver's cp_bench preset writes on CPU): table cells, status labels, efficiency
against the single-device baseline, JAX vs PyTorch pairing, targets, CSV, plots and the
missing-file error."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.core.points import Grid, expand
from experiments.core.sweep import make_record
from experiments.reports import report_cp

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "--preset=cp_bench",
    "--seqlen=64",
    "--heads_q=3",
    "--heads_kv=1",
    "--head_dim=16",
    "--mask=causal",
    "--layout=zigzag",
    "--mode=fwd",
    "--warmup=0",
    "--iters=1",
    "--dtype=fp32",
    "--num_devices=2",
    "--report=false",
]
IMPLS = {"jax": "pallas", "torch": "flex"}
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
TIMES = {"median": 2.0, "p20": 1.9, "p80": 2.1}
DISPATCH = {"median": 0.2, "p20": 0.1, "p80": 0.3}  # CP: q, k, v into the layout
PROVENANCE = {
    "versions": {"python": "3.11.7", "jax": "0.10.2", "torch": "2.13.0"},
    "git": {"commit": "abc", "dirty": False},
    "host": "h",
    "pid": 1,
    "platform": "linux",
    "argv": ["run.py"],
    "flags": {},
    "devices": {
        "jax": {"backend": "gpu", "device_kind": ["NVIDIA H200"], "device_count": 8},
        "torch": {"backend": "cuda", "device_kind": ["NVIDIA H200"], "device_count": 8},
    },
}


def _point(fw: str, mask: str, tokens: int, strategy: str, layout: str, mode: str, n: int):
    """The driver's point of a cp_bench configuration (strategy "none": the baseline)."""
    grid = Grid(
        name="cp_bench" if strategy != "none" else "cp_bench_single_device",
        cps=(strategy,),
        layouts=(layout,),
        impls=(IMPLS[fw],),
        masks=(mask,),
        seqlens=(tokens,),
        heads=((64, 8),),
        head_dim=128,
        dtype="bf16",
        modes=(mode,),
        warmup=2,
        iters=8,
    )
    kw = dict(seed=42, ulysses_size=None, ulysses_intra_node=True)
    return expand(grid, fw, grid.impls, num_devices=n, **kw)[0]


def _result(tflops: float, peak_gib: float, extra: dict) -> dict:
    """measure.aggregate's output for one mask with the given rate and peak."""
    rates = {"median": tflops, "p20": tflops * 1.05, "p80": tflops * 0.95}
    mask = {
        "index": 0,
        "seed": 42,
        "area": 1,
        "density": 0.5,
        "flops": 1.0,
        "time_ms": {**TIMES, "min": 1.8, "max": 2.2, "n": 8},
        "tflops": rates,
        "peak_mem_gib": peak_gib,
        "mem_source": "device_peak_bytes_in_use",
        **extra,
    }
    metrics = {
        "time_ms": TIMES,
        **({"dispatch_ms": DISPATCH} if "dispatch_ms" in extra else {}),
        "tflops": rates,
        "tflops_total": tflops,
        "flops": 1.0,
        "density": 0.5,
        "peak_mem_gib": peak_gib,
        "mem_source": "device_peak_bytes_in_use",
    }
    check = {
        "ok": True,
        "kind": "full",
        "rows": None,
        "rtol": {"out": 2e-2},
        "max_errors": {"out": 1e-3},
        "unchecked": [],
    }
    return {"metrics": metrics, "check": check, "masks": [mask]}


def _record(
    fw: str,
    mask: str,
    tokens: int,
    strategy: str,
    layout: str,
    mode: str,
    *,
    n: int,
    status: str,
    tflops: float,
    single: float | None,
    fwd_bytes: float,
    peak_gib: float,
) -> list[dict]:
    """A CP record as the driver writes it, after the record of its single-device baseline."""
    point = _point(fw, mask, tokens, strategy, layout, mode, n)
    out = []
    if single is not None:
        base = _point(fw, mask, tokens, "none", "none", mode, 1)
        out.append(make_record(base, "ok", result=_result(single, 20.0, {}), provenance=PROVENANCE))
    if status != "ok":
        reason = "no plan" if status == "unsupported" else f"{status} happened"
        return [*out, make_record(point, status, reason=reason, provenance=PROVENANCE)]
    extra = {
        "plan": {**PLAN, "world_size": n, "strategy": strategy, "layout": layout},
        "comm": {**COMM, "fwd_bytes": fwd_bytes, "bwd_bytes": 2 * fwd_bytes},
    }
    if fw == "torch":
        extra.update(rank_median_ms=[2.0] * n, peak_mem_gib_mean=peak_gib - 1.0)
    extra.update(dispatch_ms={**DISPATCH, "min": 0.1, "max": 0.3, "n": 8})
    result = _result(tflops, peak_gib, extra)
    return [*out, make_record(point, "ok", result=result, provenance=PROVENANCE)]


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
    single: float | None = 400.0,
    fwd_bytes: float = 1e9,
) -> list[dict]:
    """A JAX CP record (with its baseline) as the driver writes it."""
    return _record(
        "jax", mask, tokens, strategy, layout, mode, n=n, status=status, tflops=tflops,
        single=single, fwd_bytes=fwd_bytes, peak_gib=40.0,
    )  # fmt: skip


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
    single: float | None = 400.0,
    fwd_bytes: float = 1e9,
) -> list[dict]:
    """A torch CP record (with its baseline) as the driver writes it."""
    return _record(
        "torch", mask, tokens, strategy, layout, mode, n=n, status=status, tflops=tflops,
        single=single, fwd_bytes=fwd_bytes, peak_gib=50.0,
    )  # fmt: skip


def _write(path: Path, records: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for group in records for r in group))
    return path


def _table(md: str, heading: str) -> list[dict]:
    """The rows of the markdown table under `## heading`, as dicts by column name."""
    part = md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in part.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


@pytest.fixture(scope="module")
def real_files(tmp_path_factory) -> dict[str, Path]:
    """One tiny CPU cp_bench run of each framework (2 virtual devices / 2 gloo ranks), side by
    side; each writes its baseline kernel point and its CP points."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("real")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    run_py = str(REPO / "experiments/run.py")
    runs = {
        "jax": ["--framework=jax", "--cp=ring,ulysses", "--impl=reference"],
        "torch": ["--framework=torch", "--cp=ring", "--impl=sdpa_math"],
    }
    procs = {
        k: subprocess.Popen(
            [sys.executable, run_py, *TINY, *args, f"--out_dir={out / k}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k, args in runs.items()
    }
    for k, p in procs.items():
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"{k} run failed:\n{log[-3000:]}"
    return {k: out / k / "results.jsonl" for k in runs}


def _lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _shape_of(rec: dict) -> dict:
    """Key sets of a record and of its nested dicts."""
    return {k: sorted(v) if isinstance(v, dict) else None for k, v in rec.items()}


def test_synthetic_records_have_the_writers_keys(real_files):
    jax_recs, torch_recs = _lines(real_files["jax"]), _lines(real_files["torch"])
    jax_cp = {r["status"]: r for r in jax_recs if report_cp.is_cp(r)}
    assert set(jax_cp) == {"ok", "unsupported"}
    baseline, synthetic_ok = jax_record()
    assert _shape_of(synthetic_ok) == _shape_of(jax_cp["ok"])
    assert _shape_of(baseline) == _shape_of(next(r for r in jax_recs if not report_cp.is_cp(r)))
    assert _shape_of(jax_record(strategy="ulysses", status="unsupported")[1]) == _shape_of(
        jax_cp["unsupported"]
    )
    torch_cp = [r for r in torch_recs if report_cp.is_cp(r)]
    assert [r["status"] for r in torch_cp] == ["ok"]
    synthetic = torch_record()[1]
    assert _shape_of(synthetic) == _shape_of(torch_cp[0])
    for name in ("point", "metrics", "check"):
        assert sorted(synthetic[name]) == sorted(torch_cp[0][name])
    assert sorted(synthetic["masks"][0]) == sorted(torch_cp[0]["masks"][0])
    assert [r["point"]["framework"] for r in (jax_cp["ok"], torch_cp[0])] == ["jax", "torch"]


def test_report_on_real_writer_records(real_files, tmp_path):
    paths = report_cp.write_report([real_files["jax"], real_files["torch"]], tmp_path)
    md = paths["markdown"].read_text()
    jax_table = _table(md, "jax x2 virtual CPU devices, fwd: h3:1 d16 fp32, impl reference")
    assert jax_table[0]["ulysses/zigzag"] == "unsup."
    assert re.fullmatch(r"\S+ \(\d+\.\d%\)", jax_table[0]["ring/zigzag"])
    cross = _table(md, "JAX vs PyTorch")
    assert len(cross) == 1
    assert cross[0]["strategy/layout"] == "ring/zigzag" and cross[0]["plans agree"] == "yes"
    with paths["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    dispatch = {(r["framework"], r["strategy"]): r["dispatch_ms"] for r in rows}
    assert float(dispatch["jax", "ring"]) > 0  # CP times leave their dispatch out
    assert float(dispatch["torch", "ring"]) > 0
    assert dispatch["jax", "ulysses"] == ""  # unsupported: nothing timed


def test_cells_show_rate_and_efficiency_and_labels(tmp_path):
    recs = [
        jax_record("causal", 8192, "ring", "zigzag", tflops=310.0, single=420.0),
        jax_record("causal", 8192, "ulysses", "zigzag", tflops=123.456, single=420.0),
        jax_record("causal", 32768, "ring", "zigzag", status="oom"),
        jax_record("causal", 32768, "ulysses", "zigzag", status="wrong"),
        jax_record("full", 8192, "ring", "zigzag", status="error"),
        jax_record("full", 8192, "ulysses", "zigzag", status="unsupported"),
    ]
    md = report_cp.write_report([_write(tmp_path / "j.jsonl", recs)], tmp_path / "out")[
        "markdown"
    ].read_text()
    rows = _table(md, "jax x8 GPUs, fwd: h64:8 d128 bf16, impl pallas")
    cells = {(r["mask"], int(r["tokens/GPU"]), s): r[s] for r in rows for s in r if "/" in s}
    for base, rec in recs[:2]:
        tflops = rec["metrics"]["tflops"]["median"]
        eff = 100.0 * tflops / base["metrics"]["tflops"]["median"]
        want = f"{tflops:.3g} ({eff:.1f}%)"
        assert cells[("causal", 8192, f"{rec['point']['cp']}/zigzag")] == want
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
        jax_record("causal", 16384, "usp", "zigzag", fwd_bytes=5e9),
    ]
    torch_recs = [
        torch_record("causal", 16384, "ring", "zigzag", tflops=250.0, fwd_bytes=1e9),
        torch_record("causal", 16384, "allgather", "zigzag", fwd_bytes=4e9),
        torch_record("causal", 16384, "usp", "zigzag", status="oom"),
        torch_record("causal", 16384, "ulysses", "zigzag", n=4, fwd_bytes=3e9),
        torch_record("causal", 16384, "ring", "zigzag", mode="fwd_bwd"),
    ]
    files = [_write(tmp_path / "j.jsonl", jax_recs), _write(tmp_path / "t.jsonl", torch_recs)]
    md = report_cp.write_report(files, tmp_path / "out")["markdown"].read_text()
    cross = {r["strategy/layout"]: r for r in _table(md, "JAX vs PyTorch")}
    assert set(cross) == {"ring/zigzag", "allgather/zigzag", "usp/zigzag"}
    ring = cross["ring/zigzag"]
    assert ring["jax/torch"] == f"{300.0 / 250.0:.2f}x"
    assert ring["plans agree"] == "yes"
    assert (ring["jax peak GiB"], ring["jax peak from"], ring["torch peak GiB"]) == (
        "40.00",
        "device_peak_bytes_in_use",
        "50.00",
    )
    assert ring["bytes moved/GPU"] == f"{1e9 / 2**20:.3g} MiB"
    usp = cross["usp/zigzag"]
    assert usp["torch TFLOP/s/GPU"] == "OOM" and usp["jax/torch"] == "-"
    assert cross["allgather/zigzag"]["plans agree"].startswith("MISMATCH")


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


def test_csv_keeps_latest_record_per_key(tmp_path):
    recs = [
        torch_record(tflops=200.0),
        torch_record(tflops=100.0),
        torch_record(tokens=32768, tflops=150.0),
    ]
    paths = report_cp.write_report([_write(tmp_path / "t.jsonl", recs)], tmp_path / "o")
    with paths["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["tokens_per_gpu"], r["tflops_per_gpu"], r["status"]) for r in rows] == [
        ("16384", "100.0", "ok"),
        ("32768", "150.0", "ok"),
    ]
    assert rows[0]["framework"] == "torch" and rows[0]["num_gpus"] == "8"
    assert float(rows[0]["efficiency_pct"]) == pytest.approx(100.0 * 100.0 / 400.0)
    assert float(rows[0]["peak_gib_mean"]) == pytest.approx(49.0)


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
        f"eff_torch_x{n}_{mode}_{mask}_h64_8_d128_bf16_flex.png"
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
        f"scaling_torch_fwd_{mask}_{t}_h64_8_d128_bf16_flex.png"
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
            str(REPO / "experiments/report.py"),
            f"--results={good},{missing}",
            f"--out_dir={tmp_path / 'o'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0
    assert str(missing) in res.stderr
