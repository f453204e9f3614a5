"""The context-parallel section of the report: per-GPU TFLOP/s and efficiency against the same
kernel alone on one GPU at the per-GPU length, JAX vs PyTorch, the issue's targets, a CSV and
efficiency / scaling plots, from the driver's records (--preset=cp_bench runs both halves).

    python experiments/report.py --results=results/local/cp/results.jsonl --out_dir=cp_report/
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from experiments.reports import plots  # noqa: E402
from experiments.reports.report_parts import (  # noqa: E402
    PLACEMENT_FIELDS,
    POINT_FIELDS,
    ResultsPaths,
    failed_points,
    md_table,
    point_seqlens,
    read_results,
    results_paths,
    slug,
    write_csv,
)
from shard_strategies import LAYOUTS, STRATEGIES  # noqa: E402

GIB = 2**30
KEY_FIELDS = (
    "framework",
    "num_gpus",
    "impl",
    "heads_q",
    "heads_kv",
    "head_dim",
    "dtype",
    "mask",
    "tokens_per_gpu",
    "strategy",
    "layout",
    "mode",
)
COLUMNS = (
    "key",
    *KEY_FIELDS,
    "status",
    "device_kind",
    "seqlen_total",
    "ulysses_size",
    "ring_size",
    "num_windows",
    "inner_axis",
    "load_balance",
    "tflops_per_gpu",
    "single_gpu_tflops",
    "efficiency_pct",
    "time_ms",
    "time_ms_p20",
    "time_ms_p80",
    "single_gpu_ms",
    "peak_gib",
    "peak_gib_mean",
    "mem_source",
    "single_gpu_peak_gib",
    "comm_bytes",
    "comm_fwd_bytes",
    "comm_bwd_bytes",
    "err_out",
    "err_dq",
    "single_gpu_status",
    "error",
    "timestamp",
)
STATUS_LABEL = {"oom": "OOM", "unsupported": "unsup.", "wrong": "WRONG", "error": "error"}
MARKERS = {**plots.MARKERS, "no_single": ("no 1-GPU rate", "o", "tab:olive")}
TARGET_MIN_TOKENS = 16384
TARGETS: dict[str, tuple[float, str, Callable[[str, str], bool]]] = {
    "causal": (
        95.0,
        "zigzag ring/allgather/ulysses",
        lambda s, lay: lay == "zigzag" and s in ("ring", "allgather", "ulysses"),
    ),
    "causal_document": (85.0, "balanced layout", lambda s, lay: lay == "balanced"),
    "share_question": (85.0, "balanced layout", lambda s, lay: lay == "balanced"),
}
BYTES_RTOL = 1e-9
# What a CP point and its single-device baseline (a kernel point at the per-device length) share:
# every point field but those that describe the placement over devices.
BASELINE_FIELDS = tuple(f for f in POINT_FIELDS if f not in PLACEMENT_FIELDS)


def is_cp(rec: dict) -> bool:
    """Whether a driver record is of a measured CP point (simulated ones: report_sim.py)."""
    return rec["point"].get("cp", "none") != "none" and not is_simulated(rec)


def is_simulated(rec: dict) -> bool:
    """Whether a driver record is of a CP point predicted on one device (--simulate_devices)."""
    return bool(rec["point"].get("simulated"))


def _baseline_key(point: dict, seqlen: int) -> tuple:
    return (*(point.get(f) for f in BASELINE_FIELDS), seqlen)


def comm_bytes(comm: dict | None, mode: str | None) -> float | None:
    """Plan bytes moved per rank for the mode: forward, backward, or both."""
    if not comm:
        return None
    fwd = comm["fwd_bytes"] if mode != "bwd" else 0.0
    return fwd + (comm["bwd_bytes"] if mode != "fwd" else 0.0)


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def efficiency(row: dict) -> float | None:
    """Per-GPU TFLOP/s over the single-GPU rate, in percent (None without both numbers)."""
    tf, single = row.get("tflops_per_gpu"), row.get("single_gpu_tflops")
    if row.get("status") != "ok" or tf is None or not single:
        return None
    return 100.0 * tf / single


def _device_kind(rec: dict, framework: str) -> str | None:
    devices = ((rec.get("provenance") or {}).get("devices") or {}).get(framework) or {}
    return ", ".join(devices.get("device_kind") or []) or None


def flat_row(rec: dict, baseline: dict | None) -> dict:
    """One CSV row of a CP record, with its single-device baseline record (or None)."""
    p = rec["point"]
    masks = rec.get("masks") or []
    plan = (masks[0].get("plan") if masks else None) or {}
    comms = [m.get("comm") for m in masks]
    check = (rec.get("check") or {}).get("max_errors") or {}
    metrics = rec.get("metrics") or {}
    times = metrics.get("time_ms") or {}
    single = (baseline or {}).get("metrics") or {}
    row = {
        "key": rec["key"],
        "framework": p["framework"],
        "num_gpus": p["num_devices"],
        "impl": p["impl"],
        "heads_q": p["heads_q"],
        "heads_kv": p["heads_kv"],
        "head_dim": p["head_dim"],
        "dtype": p["dtype"],
        "mask": p["mask"],
        "tokens_per_gpu": point_seqlens(p)[1],
        "strategy": p["cp"],
        "layout": p["layout"],
        "mode": p["mode"],
        "status": rec["status"],
        "device_kind": _device_kind(rec, p["framework"]),
        "seqlen_total": point_seqlens(p)[0],
        "tflops_per_gpu": (metrics.get("tflops") or {}).get("median"),
        "single_gpu_tflops": (single.get("tflops") or {}).get("median"),
        "single_gpu_ms": (single.get("time_ms") or {}).get("median"),
        "single_gpu_peak_gib": single.get("peak_mem_gib"),
        "single_gpu_status": baseline["status"] if baseline else None,
        "time_ms": times.get("median"),
        "time_ms_p20": times.get("p20"),
        "time_ms_p80": times.get("p80"),
        "peak_gib": metrics.get("peak_mem_gib"),
        "peak_gib_mean": _mean([m.get("peak_mem_gib_mean") for m in masks]),
        "mem_source": metrics.get("mem_source"),
        "comm_bytes": _mean([comm_bytes(c, p["mode"]) for c in comms]),
        "comm_fwd_bytes": _mean([(c or {}).get("fwd_bytes") for c in comms]),
        "comm_bwd_bytes": _mean([(c or {}).get("bwd_bytes") for c in comms]),
        "err_out": check.get("out"),
        "err_dq": check.get("dq"),
        "error": rec.get("reason"),
        "timestamp": rec.get("timestamp"),
        **{k: plan.get(k) for k in ("ulysses_size", "ring_size", "num_windows", "inner_axis")},
        "load_balance": plan.get("load_balance"),
    }
    row["efficiency_pct"] = efficiency(row)
    return {c: row.get(c) for c in COLUMNS}


def cp_rows(records: list[dict]) -> list[dict]:
    """Rows of the CP records, each with the kernel record of its per-device problem."""
    baselines = {
        _baseline_key(r["point"], point_seqlens(r["point"])[0]): r
        for r in records
        if not is_cp(r) and not is_simulated(r) and not r["point"].get("kernel_config")
    }
    return [
        flat_row(r, baselines.get(_baseline_key(r["point"], point_seqlens(r["point"])[1])))
        for r in records
        if is_cp(r)
    ]


def shape(row: dict) -> str:
    """The problem shape both frameworks must share to be compared: heads, head dim, dtype."""
    return f"h{row['heads_q']}:{row['heads_kv']} d{row['head_dim']} {row['dtype']}"


def series(row: dict) -> str:
    """A line or table column: strategy/layout."""
    return f"{row['strategy']}/{row['layout']}"


def series_order(name: str) -> tuple:
    strategy, layout = name.split("/")
    rank = lambda x, xs: (xs.index(x), x) if x in xs else (len(xs), x)  # noqa: E731
    return rank(strategy, STRATEGIES), rank(layout, LAYOUTS)


def label(row: dict) -> str:
    """A non-ok status as the tables and plots show it."""
    return STATUS_LABEL.get(row["status"], str(row["status"]))


def cell(row: dict) -> str:
    """'per-GPU TFLOP/s (efficiency %)' for an ok point, its status label otherwise."""
    if row["status"] != "ok":
        return label(row)
    eff = row["efficiency_pct"]
    return f"{row['tflops_per_gpu']:.3g} ({f'{eff:.1f}%' if eff is not None else 'eff. n/a'})"


def _key_order(key: tuple) -> tuple:
    return tuple((0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x)) for x in key)


def _group_order(item: tuple) -> tuple:
    return _key_order(item[0])


def _bytes_label(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.0f} B"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _table_group(row: dict) -> tuple:
    return row["framework"], row["num_gpus"], row["mode"], shape(row), row["impl"]


def strategy_tables(rows: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Per (framework, GPUs, mode, shape, impl): rows (mask, tokens/GPU), columns strategy/layout
    (one table each)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_table_group(r)].append(r)
    tables = []
    for (fw, n, mode, shp, impl), members in sorted(groups.items(), key=_group_order):
        cols = sorted({series(r) for r in members}, key=series_order)
        cells: dict[tuple, dict[str, str]] = defaultdict(dict)
        for r in members:
            cells[(r["mask"], r["tokens_per_gpu"])][series(r)] = cell(r)
        body = [[m, t, *(c.get(s, "") for s in cols)] for (m, t), c in sorted(cells.items())]
        title = f"{fw} x{n} GPUs, {mode}: {shp}, impl {impl}"
        tables.append((title, ["mask", "tokens/GPU", *cols], body))
    return tables


def cross_framework(rows: list[dict]) -> list[dict]:
    """Points run in both frameworks (GPUs, shape, mask, tokens, strategy, layout, mode): both
    rates, their ratio, peak memories and the plan's bytes moved per GPU, with a mismatch flag
    (both executors use one shared plan, so the bytes must agree)."""
    by_fw: dict[str, dict[tuple, list[dict]]] = {
        "jax": defaultdict(list),
        "torch": defaultdict(list),
    }
    for r in rows:
        if r["framework"] in by_fw:
            k = (r["num_gpus"], shape(r), r["mask"], r["tokens_per_gpu"], series(r), r["mode"])
            by_fw[r["framework"]][k].append(r)
    out = []
    for k in sorted(set(by_fw["jax"]) & set(by_fw["torch"]), key=_key_order):
        n, shp, mask, tokens, ser, mode = k
        for j in by_fw["jax"][k]:
            for t in by_fw["torch"][k]:
                both_ok = j["status"] == t["status"] == "ok"
                jb, tb = j["comm_bytes"], t["comm_bytes"]
                if jb is None or tb is None:
                    agree = "-"
                elif math.isclose(jb, tb, rel_tol=BYTES_RTOL):
                    agree = "yes"
                else:
                    agree = f"MISMATCH: jax {_bytes_label(jb)} vs torch {_bytes_label(tb)}"
                out.append(
                    {
                        "gpus": n,
                        "shape": shp,
                        "mode": mode,
                        "mask": mask,
                        "tokens/GPU": tokens,
                        "strategy/layout": ser,
                        "impls (jax, torch)": f"{j['impl']}, {t['impl']}",
                        "jax TFLOP/s/GPU": cell(j),
                        "torch TFLOP/s/GPU": cell(t),
                        "jax/torch": (
                            f"{j['tflops_per_gpu'] / t['tflops_per_gpu']:.2f}x" if both_ok else "-"
                        ),
                        "jax peak GiB": _gib(j["peak_gib"]),
                        "jax peak from": j["mem_source"] or "-",
                        "torch peak GiB": _gib(t["peak_gib"]),
                        "bytes moved/GPU": _bytes_label(jb if jb is not None else tb),
                        "plans agree": agree,
                    }
                )
    return out


def targets(rows: list[dict]) -> list[dict]:
    """Per (framework, GPUs, mode, shape, impl, mask, tokens/GPU >= TARGET_MIN_TOKENS): the best
    efficiency among the strategy/layouts the target names, and whether it meets the target."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["mask"] in TARGETS and r["tokens_per_gpu"] >= TARGET_MIN_TOKENS:
            groups[(*_table_group(r), r["mask"], r["tokens_per_gpu"])].append(r)
    out = []
    for (fw, n, mode, shp, impl, mask, tokens), members in sorted(groups.items(), key=_group_order):
        goal, scope, eligible = TARGETS[mask]
        cands = [r for r in members if eligible(r["strategy"], r["layout"])]
        scored = [r for r in cands if r["efficiency_pct"] is not None]
        best = max(scored, key=lambda r: r["efficiency_pct"]) if scored else None
        if best is not None:
            verdict = "met" if best["efficiency_pct"] >= goal else "missed"
        else:
            verdict = "missed" if cands else "no data"
        statuses = ", ".join(sorted({label(r) for r in cands if r["status"] != "ok"}))
        out.append(
            {
                "framework": fw,
                "gpus": n,
                "mode": mode,
                "config": f"{shp}, {impl}",
                "mask": mask,
                "tokens/GPU": tokens,
                "target": f">= {goal:.0f}% ({scope})",
                "best": series(best) if best else (statuses or "-"),
                "efficiency": f"{best['efficiency_pct']:.1f}%" if best else "-",
                "result": verdict,
            }
        )
    return out


def _provenance_lines(rows: list[dict], records: list[dict], paths: Sequence[str]) -> list[str]:
    lines = [f"- results: {', '.join(str(p) for p in paths)}"]
    for fw in sorted({r["framework"] for r in rows}):
        gpus = sorted({r["num_gpus"] for r in rows if r["framework"] == fw})
        kinds = sorted(
            {r["device_kind"] for r in rows if r["framework"] == fw and r["device_kind"]}
        )
        provs = [r.get("provenance") or {} for r in records if r["point"]["framework"] == fw]
        versions = {
            ", ".join(f"{k} {v}" for k, v in (p.get("versions") or {}).items()) for p in provs
        }
        commits = {
            f"git {(p.get('git') or {}).get('commit')}"
            f"{' (dirty)' if (p.get('git') or {}).get('dirty') else ''}"
            for p in provs
        }
        lines += [
            f"- {fw}: devices {', '.join(kinds) or '?'}; GPU counts "
            f"{', '.join(map(str, gpus)) or '?'}; {'; '.join(sorted(commits))}",
            *(f"  - versions: {v}" for v in sorted(versions) if v),
        ]
    return lines


def write_markdown(
    rows: list[dict], records: list[dict], paths: Sequence[str], out_dir: Path, figs: list[Path]
) -> Path:
    """cp_report.md: provenance, strategy tables, JAX vs PyTorch, targets, failures, plots."""
    lines = ["# Context-parallel benchmark report", ""]
    lines += _provenance_lines(rows, records, paths)
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[r["status"]] += 1
    lines += [
        "",
        "Statuses: " + ", ".join(f"{s} {n}" for s, n in sorted(counts.items())),
        "",
        "Cells: median per-GPU TFLOP/s (global mask FLOPs / GPUs / time) and, in brackets, "
        "efficiency = per-GPU TFLOP/s / the same kernel's single-GPU TFLOP/s on the per-GPU "
        "problem (the kernel point of the same impl at the per-GPU length). OOM, unsup. "
        "(unsupported), WRONG (failed the float64 check) and error points carry no number.",
        "",
    ]
    for title, header, body in strategy_tables(rows):
        lines += [f"## {title}", ""] + md_table(header, body) + [""]
    cross = cross_framework(rows)
    if cross:
        lines += [
            "## JAX vs PyTorch",
            "",
            "Same GPUs, shape, mask, tokens, strategy/layout and mode. JAX peak is the device "
            "high-water mark when the point raised it, else XLA's compiled estimate (peak from "
            "says which); torch peak is the max over ranks. Bytes moved are the plan's per GPU; "
            "both executors share one plan, so a mismatch is a bug.",
            "",
        ]
        lines += md_table(list(cross[0]), [list(c.values()) for c in cross]) + [""]
    tgt = targets(rows)
    if tgt:
        lines += [
            "## Targets",
            "",
            f"At tokens/GPU >= {TARGET_MIN_TOKENS}: the best efficiency among the strategy/layouts "
            "each target names (causal >= 95% with zigzag ring/allgather/ulysses; document and "
            "heterogeneous masks >= 85% with the balanced layout). 'no data': none of those ran.",
            "",
        ]
        lines += md_table(list(tgt[0]), [list(t.values()) for t in tgt]) + [""]
    lines += failed_points(rows, "error")
    if figs:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.relative_to(out_dir)})" for p in figs]
    path = out_dir / "cp_report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def line_plot(
    rows: list[dict],
    path: str | Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    reference: dict[str, list[tuple[float, float]]] | None = None,
    hline: float | None = None,
    xtick_label: Callable[[float], str] = str,
) -> Path:
    """Lines of y vs x (log2 x axis), one per series; points without a number are labelled
    markers near the bottom, never zeros, so a failure cannot pass for a slow point.

    rows: dicts with series, x, status and y (a number only for ok points; an ok row with y None
    shows as 'no_single'). reference: dashed black lines by name; hline: a dashed level.
    """
    names = sorted({r["series"] for r in rows}, key=series_order)
    ys = [r["y"] for r in rows if r["y"] is not None]
    ys += [y for pts in (reference or {}).values() for _, y in pts]
    top = max([*ys, hline or 0.0] or [1.0]) or 1.0
    xs_all = sorted({r["x"] for r in rows})
    fig = Figure(figsize=(8.0, 5.0))
    ax = fig.subplots()
    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "viridis"]
    handles: list = []
    used: set[str] = set()
    for si, name in enumerate(names):
        color = cmap(si if len(names) <= 10 else si / (len(names) - 1))
        pts = sorted((r for r in rows if r["series"] == name), key=lambda r: r["x"])
        ax.plot(
            [r["x"] for r in pts],
            [r["y"] if r["y"] is not None else math.nan for r in pts],
            marker="o",
            color=color,
        )
        handles.append(Line2D([], [], marker="o", color=color, label=name))
        shift = 2 ** ((si - (len(names) - 1) / 2) * 0.04)
        for r in pts:
            if r["y"] is not None:
                continue
            status = r["status"] if r["status"] != "ok" else "no_single"
            text, marker, _ = MARKERS.get(status, (status, "o", "black"))
            used.add(status)
            ax.scatter([r["x"] * shift], [0.03 * top], marker=marker, color=color, s=50, zorder=3)
            ax.text(
                r["x"] * shift,
                0.07 * top,
                text,
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=8,
                color=color,
            )
    for name, pts in (reference or {}).items():
        pts = sorted(pts)
        ax.plot([x for x, _ in pts], [y for _, y in pts], "k--", marker=".")
        handles.append(Line2D([], [], color="black", linestyle="--", label=name))
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1)
    for status in sorted(used):
        text, marker, _ = MARKERS.get(status, (status, "o", "black"))
        handles.append(Line2D([], [], marker=marker, color="gray", linestyle="", label=text))
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs_all, [xtick_label(x) for x in xs_all])
    ax.minorticks_off()
    ax.set_xlim(xs_all[0] / 2**0.4, xs_all[-1] * 2**0.4)
    ax.set_ylim(0, 1.15 * top)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def efficiency_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """Per (framework, GPUs, mode, shape, impl, mask): efficiency % vs tokens per GPU."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(*_table_group(r), r["mask"])].append(r)
    paths = []
    for (fw, n, mode, shp, impl, mask), members in sorted(groups.items(), key=_group_order):
        pts = [
            {
                "series": series(r),
                "x": r["tokens_per_gpu"],
                "status": r["status"],
                "y": r["efficiency_pct"],
            }
            for r in members
        ]
        paths.append(
            line_plot(
                pts,
                out_dir / "plots" / f"{slug(f'eff_{fw}_x{n}_{mode}_{mask}_{shp}_{impl}')}.png",
                title=f"{fw} x{n} GPUs, attn-{mode}, {mask} mask\n{shp}, impl {impl}",
                xlabel="tokens per GPU",
                ylabel="efficiency % (per-GPU / single-GPU TFLOP/s)",
                hline=100.0,
                xtick_label=plots.seqlen_label,
            )
        )
    return paths


def scaling_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """Per (framework, mode, shape, impl, mask, tokens/GPU) run on 2+ GPU counts: per-GPU
    TFLOP/s vs GPUs, with the single-GPU rate measured in each run as a dashed reference."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[
            (r["framework"], r["mode"], shape(r), r["impl"], r["mask"], r["tokens_per_gpu"])
        ].append(r)
    paths = []
    for (fw, mode, shp, impl, mask, tokens), members in sorted(groups.items(), key=_group_order):
        if len({r["num_gpus"] for r in members}) < 2:
            continue
        single: dict[int, list[float]] = defaultdict(list)
        for r in members:
            if r["single_gpu_tflops"]:
                single[r["num_gpus"]].append(r["single_gpu_tflops"])
        ref = sorted((n, sorted(v)[len(v) // 2]) for n, v in single.items())
        name = f"scaling_{fw}_{mode}_{mask}_{tokens}_{shp}_{impl}"
        paths.append(
            tflops_vs_gpus(
                members,
                out_dir / "plots" / f"{slug(name)}.png",
                title=f"{fw} attn-{mode}, {mask} mask, {plots.seqlen_label(tokens)} tokens/GPU\n"
                f"{shp}, impl {impl}",
                xlabel="GPUs",
                ylabel="per-GPU TFLOP/s (median)",
                reference={"single GPU, per-GPU problem": ref} if ref else None,
            )
        )
    return paths


def tflops_vs_gpus(
    rows: list[dict],
    path: Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    reference: dict[str, list[tuple[float, float]]] | None,
) -> Path:
    """Per-GPU TFLOP/s vs GPUs, a line per strategy/layout; points without a number labelled."""
    pts = [
        {
            "series": series(r),
            "x": r["num_gpus"],
            "status": r["status"],
            "y": r["tflops_per_gpu"] if r["status"] == "ok" else None,
        }
        for r in rows
    ]
    return line_plot(
        pts,
        path,
        title=title,
        xlabel=xlabel,
        ylabel=ylabel,
        reference=reference,
        xtick_label=lambda x: str(int(x)),
    )


def write_cp_report(records: list[dict], paths: Sequence[str], out_dir: Path) -> dict[str, object]:
    """Every artefact of the CP records into out_dir: cp_report.md, cp_results.csv, plots;
    returns their paths."""
    rows = cp_rows(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(rows, out_dir / "cp_results.csv", COLUMNS)
    eff = efficiency_plots(rows, out_dir)
    scaling = scaling_plots(rows, out_dir)
    md = write_markdown(rows, records, paths, out_dir, eff + scaling)
    return {"markdown": md, "csv": csv_path, "efficiency_plots": eff, "scaling_plots": scaling}


def write_report(results: ResultsPaths, out_dir: str | Path) -> dict[str, object]:
    """The CP report of results files (a missing one raises, naming it)."""
    paths = [str(p) for p in results_paths(results)]
    return write_cp_report(read_results(results), paths, Path(out_dir))
