"""The report of results.jsonl files: CSV, plots per (mode, mask), report.md, mask pictures, a
JAX-vs-PyTorch table, the best tuning candidates, a grid image of all plots, and (for CP points)
the CP report beside it.

    python experiments/report.py --results=results/local/x/results.jsonl --out_dir=report/
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from experiments.core.points import FRAMEWORKS
from experiments.reports import plots, report_cp, report_sim, tile_efficiency, tuning_table
from experiments.reports.report_parts import (
    POINT_FIELDS,
    ResultsPaths,
    command_lines,
    device_noun,
    failed_points,
    md_table,
    point_seqlens,
    read_results,
    results_paths,
    slug,
    write_csv,
)

METRIC_FIELDS = (
    "tflops",
    "tflops_at_p20_time",
    "tflops_at_p80_time",
    "tflops_total",
    "time_ms",
    "time_ms_p20",
    "time_ms_p80",
    "peak_mem_gib",
    "mem_source",
    "density",
)
CHECK_FIELDS = ("check_kind", "err_out", "err_dq", "err_dk", "err_dv")
COLUMNS = (
    "key",
    "status",
    *POINT_FIELDS,
    *METRIC_FIELDS,
    *CHECK_FIELDS,
    "reason",
    "elapsed_s",
    "timestamp",
)
SEQLEN_COLUMNS = ("seqlen_total", "seqlen_per_device")
STATUS_LABEL = {"oom": "OOM", "unsupported": "unsup.", "wrong": "WRONG", "error": "error"}
CUDNN_CONTROL = {"jax": ("cudnn",), "torch": ("sdpa_cudnn", "cudnn")}
SHARED_KERNEL_IMPLS = ("triton",)
SAME_KERNEL_TOLERANCE = 0.03
KIND_WORDS = {
    "kernel": "one device, no CP",
    "cp": "measured context parallelism",
    "cp_sim": "context parallelism predicted from one device's timed work (modelling GPUs)",
    "tune": "launch-config candidates of a tuned kernel",
}
MODE_WORDS = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward and backward"}
# FLOPs as attn_masks/flops.py counts them; the timing as experiments/runners/*_runner.py does it.
LEGEND = (
    "- kinds: " + "; ".join(f"{kind} = {words}" for kind, words in KIND_WORDS.items()),
    "- scaling: weak = every device holds --seqlen tokens, so the sequence grows with the "
    "devices; strong = --seqlen is the whole sequence, split over the devices",
    "- modes and their FLOPs (area = the mask's visible query-key pairs): fwd = the forward "
    "alone, 4 x area x query heads x head dim x batch; bwd = the backward alone, given the "
    "residuals of a forward run outside the timing, 2.5x the forward's FLOPs; fwd_bwd = forward "
    "and backward in one timed call, 3.5x",
)


def flat_row(rec: dict) -> dict:
    """One CSV row from a record (metrics empty unless status is ok)."""
    p = rec["point"]
    row = {"key": rec["key"], "status": rec["status"], **{f: p.get(f) for f in POINT_FIELDS}}
    row["seqlen_total"], row["seqlen_per_device"] = point_seqlens(p)
    m = rec.get("metrics") or {}
    if m:
        row.update(
            tflops=m["tflops"]["median"],
            tflops_at_p20_time=m["tflops"]["p20"],
            tflops_at_p80_time=m["tflops"]["p80"],
            tflops_total=m.get("tflops_total"),
            time_ms=m["time_ms"]["median"],
            time_ms_p20=m["time_ms"]["p20"],
            time_ms_p80=m["time_ms"]["p80"],
            peak_mem_gib=m.get("peak_mem_gib"),
            mem_source=m.get("mem_source"),
            density=m.get("density"),
        )
    c = rec.get("check") or {}
    errors = c.get("max_errors") or c.get("errors") or {}
    row["check_kind"] = c.get("kind")
    for n in ("out", "dq", "dk", "dv"):
        row[f"err_{n}"] = errors.get(n)
    row.update(
        reason=rec.get("reason"), elapsed_s=rec.get("elapsed_s"), timestamp=rec.get("timestamp")
    )
    return {c: row.get(c) for c in COLUMNS}


def load_rows(results: ResultsPaths) -> tuple[list[dict], list[dict]]:
    """(flat rows, records): the latest record of each point key, in file order."""
    records = read_results(results, missing_ok=True)
    return [flat_row(r) for r in records], records


def _kind(row: dict) -> str:
    if row.get("kernel_config"):
        return "tune"
    if row["cp"] in (None, "none"):
        return "kernel"
    return "cp_sim" if row.get("simulated") else "cp"


def _title(kind: str, mode: str, cfg: str) -> str:
    return f"{kind} {mode}: {cfg}"


def _config(row: dict) -> str:
    cfg = f"b{row['batch']} h{row['heads_q']}:{row['heads_kv']} d{row['head_dim']} {row['dtype']}"
    if _kind(row) in ("cp", "cp_sim"):
        cfg += f" x{row['num_devices']} {row['scaling']}"
    if row["reference_compat"]:
        cfg += " ref-compat"
    return cfg


def _config_words(row: dict, record: dict) -> str:
    """A row's config read out, e.g. 'batch 1, 8 query heads sharing 2 KV heads, ...'."""
    words = [
        f"batch {row['batch']}",
        f"{row['heads_q']} query heads sharing {row['heads_kv']} KV heads",
        f"head dim {row['head_dim']}",
        f"{row['dtype']} inputs",
    ]
    if _kind(row) in ("cp", "cp_sim"):
        words += [f"{row['num_devices']} {device_noun([record]).many}", f"{row['scaling']} scaling"]
    if row["reference_compat"]:
        words.append("the published benchmark's masks")
    return ", ".join(words)


def legend_lines(rows: list[dict], records: list[dict]) -> list[str]:
    """What section titles and modes mean, with the report's first section title read out."""
    if not rows:
        return []
    first = min(rows, key=lambda r: (_kind(r), r["mode"], _config(r)))
    record = next(r for r in records if r["key"] == first["key"])
    title = _title(_kind(first), first["mode"], _config(first))
    words = f"{KIND_WORDS[_kind(first)]}, {MODE_WORDS[first['mode']]}"
    return [
        "Legend:",
        "",
        "- section titles: `<kind> <mode>: b<batch> h<query heads>:<KV heads> d<head dim> "
        "<dtype>`, under CP then `x<devices> <scaling>`, and `ref-compat` for the published "
        f"benchmark's masks; e.g. `{title}` = {words}, {_config_words(first, record)}",
        *LEGEND,
    ]


def series_name(row: dict) -> str:
    """Bar series: framework/impl for kernels, the candidate when tuning,
    framework/strategy/layout[/impl] under CP."""
    if _kind(row) == "tune":
        return row["kernel_config"]
    if _kind(row) == "kernel":
        return f"{row['framework']}/{row['impl']}"
    name = f"{row['framework']}/{row['cp']}/{row['layout']}"
    return name if row["impl"] == "default" else f"{name}/{row['impl']}"


def _cell(row: dict) -> str:
    if row["status"] == "ok":
        return f"{row['tflops']:.3g}"
    return STATUS_LABEL.get(row["status"], row["status"])


def write_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per (kind, mode, mask, config)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(_kind(r), r["mode"], r["mask"], _config(r))].append(r)
    paths = []
    for (kind, mode, mask, cfg), members in sorted(groups.items()):
        plot_rows = [
            {
                "series": series_name(r),
                "seqlen": r["seqlen_total"],
                "status": r["status"],
                "tflops": r["tflops"],
                "tflops_at_p20_time": r["tflops_at_p20_time"],
                "tflops_at_p80_time": r["tflops_at_p80_time"],
                "peak_mem_gib": r["peak_mem_gib"],
            }
            for r in members
        ]
        unit = "per-device " if kind == "cp" else ""
        title = f"{unit}attn-{mode} with {mask} mask\n{kind}: {cfg}"
        path = out_dir / "plots" / f"{slug(f'{kind}_{mode}_{mask}_{cfg}')}.png"
        paths.append(plots.bar_plot(plot_rows, path, title=title, xlabel="total sequence length"))
    return paths


def write_mask_pictures(rows: list[dict], out_dir: Path) -> tuple[list[Path], str]:
    """A picture of each mask used (its smallest length); (paths, note if not possible)."""
    try:
        from attn_masks import make_mask, render_mask_png
    except ImportError as e:
        return [], f"mask pictures not available: {e}"
    smallest: dict[tuple, int] = {}
    for r in rows:
        k = (r["mask"], r["window"], bool(r["reference_compat"]), r["seed"])
        smallest[k] = min(smallest.get(k, r["seqlen_total"]), r["seqlen_total"])
    paths, notes = [], []
    (out_dir / "masks").mkdir(parents=True, exist_ok=True)
    for (mask, window, compat, seed), s in sorted(smallest.items()):
        name = f"{mask}_S{s}_w{window}{'_compat' if compat else ''}.png"
        try:
            m = make_mask(mask, s, seed=seed, window=window, reference_compat=compat)
            paths.append(render_mask_png(m, out_dir / "masks" / name))
        except Exception as e:
            notes.append(f"{mask} at {s}: {type(e).__name__}: {e}")
    return paths, "; ".join(notes)


def _point_key(r: dict) -> tuple:
    """(cp, mask, total and per-device length, mode, config): one point of both frameworks."""
    cp = "none" if _kind(r) == "kernel" else f"{r['cp']}/{r['layout']}"
    return (cp, r["mask"], r["seqlen_total"], r["seqlen_per_device"], r["mode"], _config(r))


def _point_groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows of both frameworks grouped by _point_key."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_point_key(r)].append(r)
    return {k: v for k, v in groups.items() if {r["framework"] for r in v} == {"jax", "torch"}}


def _both_ok(a: dict | None, b: dict | None) -> bool:
    return a is not None and b is not None and a["status"] == b["status"] == "ok"


def _ratio(a: dict | None, b: dict | None) -> str:
    return f"{a['tflops'] / b['tflops']:.2f}x" if _both_ok(a, b) else "-"


CONTROL_TOLERANCE = 0.02  # cuDNN run from JAX and from PyTorch: the same kernel, within 2%
CONTROL_COLUMN = f"cudnn_within_{CONTROL_TOLERANCE * 100:g}pct"  # named after the tolerance


def _control_gap(jax_rate: float | None, torch_rate: float | None) -> float | None:
    """JAX's cuDNN rate over PyTorch's, minus one (None where either has no ok cuDNN run)."""
    if jax_rate is None or torch_rate is None:
        return None
    return jax_rate / torch_rate - 1.0


def _control_cell(runs: list[dict]) -> tuple[str, float | None]:
    """(table cell, rate) of a framework's cuDNN runs of a point: the median of the ok runs,
    with their count where there are several; a status label where none is ok."""
    rates = [r["tflops"] for r in runs if r["status"] == "ok"]
    if not rates:
        return (_cell(runs[0]) if runs else "-"), None
    rate = float(np.median(rates))
    return (f"{rate:.3g}" + (f" (median of {len(rates)})" if len(rates) > 1 else "")), rate


def _within_control(gap: float | None) -> str:
    """ "yes" / "NO" whether the cuDNN gap is within CONTROL_TOLERANCE, "-" where none."""
    if gap is None:
        return "-"
    return "yes" if abs(gap) <= CONTROL_TOLERANCE else "NO"


def _point_name(c: dict) -> str:
    """A cross-framework point in words: its CP strategy and per-device length where it has
    them (a CP point), then mask, total length, mode and config."""
    cp = [] if c["cp"] == "none" else [c["cp"]]
    total, per_device = c["seqlen_total"], c["seqlen_per_device"]
    length = f"{total}" if per_device == total else f"{total} ({per_device}/device)"
    return " ".join([*cp, c["mask"], length, c["mode"], c["config"]])


def control_summary(cross: list[dict]) -> list[str]:
    """One line on the cuDNN control over the cross-framework rows: how many agree within
    CONTROL_TOLERANCE, and the points that do not with their signed gap (worth a rerun)."""
    judged = [c for c in cross if c[CONTROL_COLUMN] != "-"]
    if not judged:
        return []
    off = [c for c in judged if c[CONTROL_COLUMN] == "NO"]
    line = (
        f"cuDNN control: {len(judged) - len(off)} of {len(judged)} points within "
        f"{CONTROL_TOLERANCE:.0%} between the frameworks"
    )
    if off:
        where = "; ".join(f"{_point_name(c)} {c['cudnn_jax_vs_torch']}" for c in off)
        line += f"; outside: {where}"
    return [line + ".", ""]


POINT_COLUMNS = ("cp", "mask", "seqlen_total", "seqlen_per_device", "mode", "config")


def _best(members: list[dict], framework: str) -> dict | None:
    """The fastest ok row of a framework among a point's rows (None: no ok row)."""
    ok = [r for r in members if r["framework"] == framework and r["status"] == "ok"]
    return max(ok, key=lambda r: r["tflops"]) if ok else None


def cross_framework(rows: list[dict], repeats: Sequence[dict] = ()) -> list[dict]:
    """Per (mask, length, mode, config[, strategy]): best JAX vs best torch, and the cuDNN
    control, judged on the median of each framework's cuDNN runs of the point: the grid's and
    those in `repeats` (rows of repeat runs of the control, for the points where one run
    of short kernels spreads by more than the tolerance)."""
    by_point: dict[tuple, list[dict]] = defaultdict(list)
    for r in repeats:
        by_point[(_point_key(r), r["framework"])].append(r)
    out = []
    for point, members in sorted(_point_groups(rows).items()):
        row = dict(zip(POINT_COLUMNS, point))
        best, control = {}, {}
        for fw in FRAMEWORKS:
            best[fw] = b = _best(members, fw)
            row[f"best_{fw}"] = f"{b['impl']} {b['tflops']:.3g}" if b else "-"
            runs = [
                r
                for r in members + by_point[(point, fw)]
                if r["framework"] == fw and r["impl"] in CUDNN_CONTROL[fw]
            ]
            row[f"cudnn_{fw}"], control[fw] = _control_cell(runs)
        row["jax_over_torch"] = _ratio(best["jax"], best["torch"])
        gap = _control_gap(control["jax"], control["torch"])
        row["cudnn_jax_vs_torch"] = "-" if gap is None else f"{gap:+.1%}"
        row[CONTROL_COLUMN] = _within_control(gap)
        out.append(row)
    return out


def cross_cells(rows: list[dict]) -> dict[str, list[dict]]:
    """Per (mode, config) of the single-device points both frameworks ran: a cell per (mask,
    length) with best JAX / best torch (ratio None where a side has no ok point) and a label
    naming the two impls, for ratio_heatmap."""
    panels: dict[str, list[dict]] = defaultdict(list)
    for (cp, mask, total, _, mode, cfg), members in sorted(_point_groups(rows).items()):
        if cp != "none":
            continue
        best = {fw: _best(members, fw) for fw in FRAMEWORKS}
        jax_best, torch_best = best["jax"], best["torch"]
        if jax_best and torch_best:
            ratio = jax_best["tflops"] / torch_best["tflops"]
            label = f"{ratio:.2f}x\n{jax_best['impl']} / {torch_best['impl']}"
        else:
            ratio = None
            only = [f"{fw} only: {b['impl']}" for fw, b in best.items() if b]
            label = only[0] if only else "no ok point"
        cell = {"row": mask, "col": total, "ratio": ratio, "label": label}
        panels[f"{mode}, {cfg}"].append(cell)
    return dict(panels)


def write_cross_plot(rows: list[dict], out_dir: Path) -> Path | None:
    """The JAX-vs-PyTorch heatmap (best of each framework per mask and length), if any."""
    panels = cross_cells(rows)
    if not panels:
        return None
    title = "best JAX impl / best PyTorch impl, TFLOP/s (blue: JAX faster)"
    return plots.ratio_heatmap(panels, out_dir / "jax_vs_torch.png", title=title)


def same_kernel(rows: list[dict]) -> list[dict]:
    """The one kernel launched from both frameworks: per point, both rates and their gap.

    The kernel source is identical, so a gap above SAME_KERNEL_TOLERANCE is framework overhead
    (dispatch, layout copies, synchronisation) and is flagged for a profile.
    """
    out = []
    for point, members in sorted(_point_groups(rows).items()):
        for impl in SHARED_KERNEL_IMPLS:
            pair = {r["framework"]: r for r in members if r["impl"] == impl}
            if set(pair) != {"jax", "torch"}:
                continue
            jax_row, torch_row = pair["jax"], pair["torch"]
            gap = "-"
            if jax_row["status"] == torch_row["status"] == "ok":
                rel = jax_row["tflops"] / torch_row["tflops"] - 1.0
                flag = "" if abs(rel) <= SAME_KERNEL_TOLERANCE else " (over 3%: profile)"
                gap = f"{rel:+.1%}{flag}"
            cells = {"impl": impl, "jax": _cell(jax_row), "torch": _cell(torch_row)}
            out.append({**dict(zip(POINT_COLUMNS, point)), **cells, "jax_vs_torch": gap})
    return out


def _provenance_lines(records: list[dict]) -> list[str]:
    prov = next((r.get("provenance") for r in records if r.get("provenance")), None)
    if not prov:
        return []
    git = prov.get("git") or {}
    devices = prov.get("devices") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (prov.get("versions") or {}).items())
    lines = [
        f"- versions: {versions}",
        f"- git: {git.get('commit')} (dirty: {git.get('dirty')})",
        f"- host: {prov.get('host')}",
    ]
    for fw, d in devices.items():
        if d:
            lines.append(
                f"- {fw} devices: {d.get('device_count')} x "
                f"{', '.join(d.get('device_kind') or [])} ({d.get('backend')})"
            )
    return lines


def write_markdown(
    rows: list[dict],
    records: list[dict],
    out_dir: Path,
    plot_paths: list[Path],
    mask_paths: list[Path],
    cross: list[dict],
    notes: list[str],
    shared: list[dict] | None = None,
    cp_report: Path | None = None,
    predicted: list[str] | None = None,
    cross_plot: Path | None = None,
    repeat_commands: list[str] | None = None,
) -> Path:
    """report.md: the command(s), provenance, legend, status counts, TFLOP/s tables,
    cross-framework table (with the commands of the control's repeat runs), figures."""
    lines = ["# Attention benchmark report", ""]
    lines += command_lines(records)
    lines += _provenance_lines(records)
    lines += ["", *legend_lines(rows, records)]
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[r["status"]] += 1
    lines += [
        "",
        "Statuses: " + ", ".join(f"{s} {n}" for s, n in sorted(counts.items())),
        "",
        "Cells: median TFLOP/s per device (CP: global FLOPs / devices / slowest rank's "
        "time); OOM, unsup. (unsupported), WRONG (failed the float64 check) and error "
        "points carry no number. seqlen_total: tokens of the whole sequence; "
        "seqlen_per_device: tokens each device holds (the same without CP).",
        "",
    ]
    tables: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        tables[(_kind(r), r["mode"], _config(r))].append(r)
    for (kind, mode, cfg), members in sorted(tables.items()):
        series = sorted({series_name(r) for r in members})
        cells: dict[tuple, dict[str, str]] = defaultdict(dict)
        for r in members:
            length = (r["seqlen_total"], r["seqlen_per_device"])
            cells[(r["mask"], *length)][series_name(r)] = _cell(r)
        body = [[*k, *(c.get(n, "") for n in series)] for k, c in sorted(cells.items())]
        lines += [f"## {_title(kind, mode, cfg)}", ""]
        lines += md_table(["mask", *SEQLEN_COLUMNS, *series], body) + [""]
    if cross:
        lines += [
            "## JAX vs PyTorch",
            "",
            "Best impl of each framework per point, with cuDNN in both as a control.",
            "",
        ]
        if repeat_commands:
            lines += [
                "The control's cells are medians of each framework's cuDNN runs: this "
                "report's and those of the repeat runs of",
                *repeat_commands,
                "",
            ]
        if cross_plot is not None:
            lines += [f"![jax_vs_torch]({cross_plot.relative_to(out_dir)})", ""]
        keys = [
            "cp",
            "mask",
            *SEQLEN_COLUMNS,
            "mode",
            "config",
            "best_jax",
            "best_torch",
            "jax_over_torch",
            "cudnn_jax",
            "cudnn_torch",
            "cudnn_jax_vs_torch",
            CONTROL_COLUMN,
        ]
        lines += control_summary(cross)
        lines += md_table(keys, [[c[k] for k in keys] for c in cross]) + [""]
    if shared:
        lines += [
            "## Same kernel, two front ends",
            "",
            "One kernel source launched from JAX and from PyTorch: a gap is framework overhead.",
            "",
        ]
        keys = list(shared[0])
        lines += md_table(keys, [[c[k] for k in keys] for c in shared]) + [""]
    lines += tuning_table.section(rows)
    lines += tile_efficiency.section(rows)
    if cp_report is not None:
        lines += [
            "## Context parallelism",
            "",
            f"Efficiency, targets and scaling of the CP points: [{cp_report.name}]"
            f"({cp_report.relative_to(out_dir)}).",
            "",
        ]
    lines += predicted or []
    lines += failed_points(rows, "reason")
    if plot_paths:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.relative_to(out_dir)})" for p in plot_paths]
    if mask_paths:
        lines += ["", "## Masks", ""] + [
            f"![{p.stem}]({p.relative_to(out_dir)})" for p in mask_paths
        ]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_report(
    results: ResultsPaths,
    out_dir: str | Path,
    compare_with: ResultsPaths = (),
    control_repeats: ResultsPaths = (),
) -> dict[str, Path]:
    """Write every report artefact into out_dir; returns their paths by kind. compare_with:
    results files of measured CP points to set beside the simulated ones; control_repeats:
    results files of repeat runs of the cuDNN control, one run each (cross_framework)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, records = load_rows(results)
    csv_path = write_csv(rows, out_dir / "results.csv", COLUMNS)
    plot_paths = write_plots(rows, out_dir)
    mask_paths, mask_note = write_mask_pictures(rows, out_dir)
    repeat_records = [r for path in results_paths(control_repeats) for r in read_results(path)]
    cross = cross_framework(rows, [flat_row(r) for r in repeat_records])
    cross_plot = write_cross_plot(rows, out_dir)
    cross_path = None
    if cross:
        cross_path = write_csv(cross, out_dir / "cross_framework.csv", list(cross[0]))
    grid = plots.image_grid(plot_paths, out_dir / "all_plots.png")
    notes = [mask_note] if mask_note else []
    shared = same_kernel(rows)
    cp = None
    if any(report_cp.is_cp(r) for r in records):
        paths = [str(p) for p in results_paths(results)]
        cp = report_cp.write_cp_report(records, paths, out_dir)["markdown"]
    sim = {"lines": [], "plots": [], "comparison": []}
    if any(report_cp.is_simulated(r) for r in records):
        measured = [str(p) for p in results_paths(compare_with)] if compare_with else []
        sim = report_sim.write_sim_report(records, out_dir, measured)
    plot_paths = plot_paths + sim["plots"]
    md = write_markdown(
        rows,
        records,
        out_dir,
        plot_paths,
        mask_paths,
        cross,
        notes,
        shared,
        cp,
        sim["lines"],
        cross_plot,
        command_lines(repeat_records) if repeat_records else [],
    )
    return {
        "comparison": sim["comparison"],
        "csv": csv_path,
        "markdown": md,
        "plots": plot_paths,
        "masks": mask_paths,
        "cross_framework": cross_path,
        "cross_plot": cross_plot,
        "grid": grid,
        "cp_report": cp,
    }
