"""What the reports say, on records built in-process: devices named as they ran (GPUs only for
CUDA devices and simulated CP), an efficiency n/a explained once with the run that would give it,
report.md's recorded command(s) and legend, and plots that keep points without a number off the
value axis."""

from __future__ import annotations

import dataclasses
import math

from matplotlib.figure import Figure
from test_report_cp import _table, _write

from attn_masks.flops import MODE_FACTORS
from experiments.core.points import Grid, expand
from experiments.core.provenance import portable_argv
from experiments.core.sweep import make_record
from experiments.reports import report, report_cp, report_parts

OUT_DIR = "/tmp/r1"
ARGV = ["experiments/run.py", "--framework=jax", "--cp=ring", f"--out_dir={OUT_DIR}"]
DEVICES = {
    "cpu": {
        "jax": {"backend": "cpu", "device_kind": ["cpu"], "device_count": 8},
        "torch": {"backend": "cpu", "device_kind": ["x86_64"], "device_count": 1},
    },
    "gpu": {
        "jax": {"backend": "gpu", "device_kind": ["NVIDIA H200"], "device_count": 8},
        "torch": {"backend": "cuda", "device_kind": ["NVIDIA H200"], "device_count": 8},
    },
}


def provenance(where: str, argv: list[str] = ARGV, flags: bool = True) -> dict:
    """A run's provenance on CPU or GPU devices, with its command and (optionally) its flags."""
    return {
        "versions": {"python": "3.11.7"},
        "git": {"commit": "abc", "dirty": False},
        "host": "h",
        "argv": argv,
        "flags": {"out_dir": OUT_DIR} if flags else {},
        "devices": DEVICES[where],
    }


def point(fw: str, cp: str, impl: str, tokens: int = 64, *, n: int = 8, mode: str = "fwd"):
    """The driver's point of a tiny CPU-sized configuration (cp "none": a kernel point)."""
    grid = Grid(
        name="cp" if cp != "none" else "kernel",
        cps=(cp,),
        layouts=("zigzag",),
        impls=(impl,),
        masks=("causal",),
        seqlens=(tokens,),
        heads=((8, 2),),
        head_dim=32,
        dtype="fp32",
        modes=(mode,),
        warmup=1,
        iters=3,
        window=64,
    )
    kw = dict(seed=42, ulysses_size=None, ulysses_intra_node=True)
    return expand(grid, fw, (impl,), num_devices=n, **kw)[0]


def record(p, where: str, *, status: str = "ok", tflops: float = 1.0, **prov) -> dict:
    """A record of a point as the driver writes it (ok: with a rate; else with a reason)."""
    if status != "ok":
        return make_record(p, status, reason=f"{status} here", provenance=provenance(where, **prov))
    rates = {"median": tflops, "p20": tflops * 1.05, "p80": tflops * 0.95}
    metrics = {"tflops": rates, "time_ms": {"median": 2.0, "p20": 1.9, "p80": 2.1}}
    result = {"metrics": metrics, "masks": [{}]}
    return make_record(p, status, result=result, provenance=provenance(where, **prov))


def cp_md(tmp_path, records: list[dict], name: str = "r") -> str:
    """cp_report.md of the records."""
    results = _write(tmp_path / f"{name}.jsonl", [records])
    return report_cp.write_report([results], tmp_path / name)["markdown"].read_text()


def test_devices_are_named_as_they_ran(tmp_path):
    cpu = [
        record(point("jax", "ring", "pallas", n=4), "cpu"),
        record(point("torch", "ring", "flex", n=4), "cpu"),
    ]
    md = cp_md(tmp_path, cpu, "cpu")
    assert "## jax x4 virtual CPU devices, fwd: h8:2 d32 fp32, impl pallas" in md
    assert "## torch x4 gloo ranks, fwd: h8:2 d32 fp32, impl flex" in md
    assert "| mask | tokens/device | ring/zigzag |" in md
    assert "| mask | tokens/rank | ring/zigzag |" in md
    assert _table(md, "JAX vs PyTorch")[0]["CPU devices"] == "4"
    assert "GPU" not in md
    gpu = cp_md(tmp_path, [record(point("jax", "ring", "pallas"), "gpu")], "gpu")
    assert "## jax x8 GPUs, fwd: h8:2 d32 fp32, impl pallas" in gpu
    assert "| mask | tokens/GPU | ring/zigzag |" in gpu
    simulated = dataclasses.replace(point("jax", "ring", "pallas"), simulated=True)
    assert report_parts.device_noun([record(simulated, "cpu")]).many == "GPUs"


def test_missing_baseline_is_explained_once_with_the_run_that_gives_it(tmp_path):
    recs = [
        record(point("jax", "ring", "pallas", 64), "cpu"),
        record(point("jax", "ring", "pallas", 128), "cpu"),
        record(point("jax", "ring", "default", 64), "cpu"),
        record(point("jax", "none", "xla", 64, n=1), "cpu", status="oom"),
        record(point("jax", "ring", "xla", 64), "cpu"),
    ]
    md = cp_md(tmp_path, recs)
    shared = (
        "--mode=fwd --batch=1 --heads_q=8 --heads_kv=2 --head_dim=32 --dtype=fp32 --window=64 "
        f"--num_masks=1 --seed=42 --warmup=1 --iters=3 --out_dir={OUT_DIR}"
    )
    assert (
        "- \u2020 n/a: no single-device run of impl pallas at 64, 128 tokens (causal) in these "
        "results; run `python experiments/run.py --framework=jax --cp=none --mask=causal "
        f"--seqlen=64,128 --impl=pallas {shared}` for a kernel point" in md
    )
    assert (
        "- \u2020 n/a: impl default at 64 tokens (causal) is each CP strategy's own pick of local "
        "kernel (here reference), which never runs alone, so no single-device rate can match "
        "it; run `python experiments/run.py --framework=jax --cp=none,ring --layout=zigzag "
        f"--mask=causal --seqlen=64 --impl=reference --num_devices=8 --cp_scaling=weak {shared}`"
        in md
    )
    assert "- \u2021 n/a: the single-device run of impl xla at 64 tokens (causal) is OOM." in md
    assert md.count("n/a: ") == 3
    pallas = _table(md, "jax x8 virtual CPU devices, fwd: h8:2 d32 fp32, impl pallas")
    assert [r["ring/zigzag"] for r in pallas] == ["1 (eff. n/a\u2020)"] * 2
    xla = _table(md, "jax x8 virtual CPU devices, fwd: h8:2 d32 fp32, impl xla")
    assert xla[0]["ring/zigzag"] == "1 (eff. n/a\u2021)"


def test_missing_baseline_without_flags_is_described(tmp_path):
    md = cp_md(tmp_path, [record(point("jax", "ring", "pallas"), "gpu", flags=False)])
    assert (
        "- \u2020 n/a: no single-GPU run of impl pallas at 64 tokens (causal) in these results; "
        "the efficiency needs a kernel point (no CP) of impl pallas with the same shape, masks "
        "and mode at the per-GPU length." in md
    )


def test_target_without_baseline_is_not_missed(tmp_path):
    md = cp_md(tmp_path, [record(point("jax", "ring", "pallas", 16384), "gpu")])
    (row,) = _table(md, "Targets")
    assert (row["efficiency"], row["result"]) == ("-", "n/a\u2020")


def test_report_md_records_its_commands_and_legend(tmp_path):
    torch_argv = [*ARGV[:1], "--framework=torch", *ARGV[2:]]
    recs = [
        record(point("jax", "ring", "default", n=4), "cpu"),
        record(point("jax", "ring", "default", n=4, mode="bwd"), "cpu"),
        record(point("torch", "ring", "default", n=4), "cpu", argv=torch_argv),
    ]
    md = report.write_report(_write(tmp_path / "r.jsonl", [recs]), tmp_path / "o")["markdown"]
    top = md.read_text().split("\n## ", 1)[0]
    assert "- commands (2 runs wrote these results" in top
    for argv in (ARGV, torch_argv):
        assert top.count(f"  - `python {' '.join(argv)}`\n") == 1
    assert (
        "e.g. `cp bwd: b1 h8:2 d32 fp32 x4 weak` = measured context parallelism, backward, batch "
        "1, 8 query heads sharing 2 KV heads, head dim 32, fp32 inputs, 4 virtual CPU devices, "
        "weak scaling" in top
    )
    assert "weak = every device holds --seqlen tokens" in top
    assert "fwd = the forward alone, 4 x area x query heads x head dim x batch" in top
    assert (
        "bwd = the backward alone, given the residuals of a forward run outside the timing, "
        f"{MODE_FACTORS['bwd']:g}x the forward's FLOPs" in top
    )
    assert f"fwd_bwd = forward and backward in one timed call, {MODE_FACTORS['fwd_bwd']:g}x" in top
    one_run = report.write_report(_write(tmp_path / "j.jsonl", [recs[:1]]), tmp_path / "j")
    assert f"- command: `python {' '.join(ARGV)}`" in one_run["markdown"].read_text()


def _value_points(ax) -> list[tuple[float, float]]:
    """Every finite (x, y) an axes draws in data coordinates: line vertices, scatter points
    and text anchors (an axhline, in axes coordinates along x, is left out)."""
    pts = [tuple(xy) for ln in ax.get_lines() if ln.get_transform() is ax.transData
           for xy in ln.get_xydata()]  # fmt: skip
    pts += [tuple(xy) for c in ax.collections for xy in c.get_offsets()]
    pts += [t.get_position() for t in ax.texts]
    return [(float(x), float(y)) for x, y in pts if math.isfinite(y)]


def test_efficiency_plot_keeps_points_without_a_number_off_the_value_axis(tmp_path, monkeypatch):
    figures: list[Figure] = []

    class Spy(Figure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            figures.append(self)

    monkeypatch.setattr(report_cp, "Figure", Spy)
    recs = [
        record(point("jax", "none", "pallas", 64, n=1), "cpu", tflops=2.0),
        record(point("jax", "ring", "pallas", 64), "cpu", tflops=1.0),
        record(point("jax", "ring", "pallas", 128), "cpu"),
        record(point("jax", "ulysses", "pallas", 64), "cpu", status="oom"),
    ]
    cp_md(tmp_path, recs)
    (fig,) = figures
    value_ax = next(ax for ax in fig.axes if ax.get_ylabel().startswith("efficiency"))
    assert _value_points(value_ax) == [(64.0, 50.0)]
    assert "virtual CPU devices" in value_ax.get_title()
    others = [ax for ax in fig.axes if ax is not value_ax]
    drawn = sorted(float(x) for ax in others for c in ax.collections for x, _ in c.get_offsets())
    labels = {t.get_text() for ax in others for t in ax.texts}
    assert drawn == [64.0, 128.0] and labels == {"no single-device rate", "OOM"}


def test_recorded_command_names_no_machine_folder(tmp_path):
    """A run started as /some/checkout/experiments/run.py reads `python experiments/run.py` in
    the report, whichever machine recorded it; a script outside the repository keeps its path."""
    elsewhere = ["/srv/ci/checkout-7/experiments/run.py", *ARGV[1:]]
    md = report.write_report(
        _write(
            tmp_path / "r.jsonl",
            [[record(point("jax", "ring", "default", n=4), "cpu", argv=elsewhere)]],
        ),
        tmp_path / "o",
    )["markdown"]
    assert f"- command: `python {' '.join(ARGV)}`" in md.read_text()
    assert "/srv/ci" not in md.read_text()
    outside = ["/opt/tools/bench.py", "--x=1"]
    assert portable_argv(outside) == outside
