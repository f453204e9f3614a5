"""Report of experiments/mosaic_variants.py runs: per point, each variant's TFLOP/s and its speed
against the baseline timed in the same run (baseline time / variant time; above 1: faster), as a
markdown table and a bar chart. A variant that did not pass its float64 check (or raised, or was
unsupported) shows its status instead of a number, and a labelled marker instead of a bar.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from experiments.reports.plots import MARKERS, seqlen_label  # noqa: E402
from experiments.reports.report_parts import md_table  # noqa: E402
from jax_attn.mosaic_gpu import KernelConfig  # noqa: E402

POINT_KEYS = ("mask", "seqlen", "heads", "head_dim", "dtype", "mode")


def read_runs(paths: Iterable[Path]) -> list[dict]:
    """Every record of the given jsonl files, each tagged with its file's stem as `run` (the
    baseline ratio only holds within one run)."""
    rows = []
    for path in sorted(Path(p) for p in paths):
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append({**json.loads(line), "run": path.stem})
    return rows


def point_label(row: dict) -> str:
    """One point as people write it: `causal 32K 64:8 d128 fwd_bwd`."""
    return (
        f"{row['mask']} {seqlen_label(row['seqlen'])} {row['heads']} d{row['head_dim']} "
        f"{row['mode']}"
    )


def speedup(row: dict) -> float | None:
    """Baseline time over the row's time in the same run (None unless both were timed)."""
    ratio = row.get("time_vs_baseline") if row["status"] == "ok" else None
    return 1.0 / ratio if ratio else None


def _cell(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"].upper()
    text = f"{row['tflops']['median']:.0f}"
    ratio = speedup(row)
    return text if row["config"] is None or ratio is None else f"{text} ({ratio:.2f}x)"


def _table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and body: one line per (run, point), one column per variant in first-seen order."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cells: dict[tuple, dict[str, str]] = {}
    for r in rows:
        cells.setdefault((r["run"], point_label(r)), {})[r["variant"]] = _cell(r)
    body = [[run, point, *(v.get(n, "-") for n in variants)] for (run, point), v in cells.items()]
    return ["run", "point", *variants], body


def speed_plot(rows: list[dict], path: Path, *, title: str) -> Path:
    """One panel per run: bars of each variant's speed against the baseline per point; the
    baseline is the line at 1.0; non-ok variants as labelled markers."""
    runs = list(dict.fromkeys(r["run"] for r in rows))
    widest = max(_panel_size(rows, run) for run in runs)
    fig = Figure(figsize=(max(7.0, 0.35 * widest + 3), 3.2 * len(runs)))
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs):
        _speed_panel(ax, [r for r in rows if r["run"] == run], title=f"{title}: {run}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def _panel_size(rows: list[dict], run: str) -> int:
    mine = [r for r in rows if r["run"] == run]
    return len({point_label(r) for r in mine}) * max(1, len({r["variant"] for r in mine}))


def _speed_panel(ax, rows: list[dict], *, title: str) -> None:
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["config"] is not None))
    points = list(dict.fromkeys(point_label(r) for r in rows))
    width = 0.8 / max(len(variants), 1)
    cmap = matplotlib.colormaps["tab10"]
    handles = []
    for vi, name in enumerate(variants):
        xs, ys = [], []
        for r in rows:
            if r["variant"] != name:
                continue
            x = points.index(point_label(r)) + (vi - (len(variants) - 1) / 2) * width
            ratio = speedup(r)
            if ratio is not None:
                xs.append(x)
                ys.append(ratio)
            else:
                text, marker, color = MARKERS.get(r["status"], (r["status"], "o", "black"))
                ax.scatter([x], [0.05], marker=marker, color=color, s=40, zorder=3)
                ax.text(x, 0.1, text, rotation=90, ha="center", va="bottom", fontsize=7)
        ax.bar(xs, ys, width=width, color=cmap(vi % 10))
        handles.append(Patch(color=cmap(vi % 10), label=name))
    baseline = next((r["variant"] for r in rows if r["config"] is None), "baseline")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_ylim(0, 1.2)
    ax.set_ylabel(f"speed vs {baseline}")
    ax.set_xticks(range(len(points)), points, rotation=20, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def write_report(folder: Path) -> Path:
    """report.md and speed.png in `folder` from every *.jsonl there; returns report.md's path.
    ValueError names the folder when it holds no records."""
    folder = Path(folder)
    rows = read_runs(folder.glob("*.jsonl"))
    if not rows:
        raise ValueError(f"no mosaic_variants records (*.jsonl) in {folder}")
    header, body = _table(rows)
    png = speed_plot(rows, folder / "speed.png", title="Mosaic kernel variants vs baseline")
    configs = {r["variant"]: r["config"] for r in rows if r["config"] is not None}
    fields = dataclasses.asdict(KernelConfig())
    run_defaults: dict[tuple, dict] = {}
    for r in rows:
        if r["variant"] == "default" and r["config"]:
            run_defaults.setdefault(_run_key(r), r["config"])
    lines = [
        "# Mosaic kernel variants",
        "",
        "Median useful TFLOP/s per point; in brackets the speed against the baseline timed in the",
        "same run (its time / the variant's time: above 1 is faster). Only variants that passed",
        "the float64 check have numbers; others show their status.",
        "",
        *md_table(header, body),
        "",
        f"![speed vs baseline]({png.name})",
        "",
        "## Variants",
        "",
        "Each variant's fields that differ from its run's `default` variant at the same head dim",
        "and dtype (the defaults when it ran); the `default` variant itself, and the variants of",
        "a run without one, against `KernelConfig()`.",
        "",
        *md_table(
            ["run", "variant", "head dim", "config (fields that differ)"],
            [
                [
                    r["run"],
                    r["variant"],
                    str(r["head_dim"]),
                    _config_text(
                        r["config"],
                        fields,
                        None if r["variant"] == "default" else run_defaults.get(_run_key(r)),
                    ),
                ]
                for r in _first_per(rows, ("run", "variant", "head_dim", "dtype"))
                if r["variant"] in configs
            ],
        ),
    ]
    out = folder / "report.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def _first_per(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    seen: dict[tuple, dict] = {}
    for r in rows:
        seen.setdefault(tuple(r[k] for k in keys), r)
    return list(seen.values())


def _run_key(row: dict) -> tuple:
    """What a variant shares with the `default` it is described against."""
    return row["run"], row["head_dim"], row["dtype"]


def _config_text(config: dict, fields: dict, run_default: dict | None) -> str:
    """The recorded config's fields that differ from run_default (its run's `default` variant at
    the same head dim and dtype) or, without one, from KernelConfig's `fields`. A field
    KernelConfig no longer has (an option since removed) is named where it was set (not False
    or None)."""
    reference = run_default or fields
    parts = []
    for k, v in config.items():
        if k not in fields:
            if v not in (False, None):
                parts.append(f"{k}={v} (option since removed)")
        elif reference.get(k, fields[k]) != v:
            parts.append(f"{k}={v}")
    return ", ".join(parts) or ("as the run's default" if run_default else "as KernelConfig()")
