"""The context-parallel section of the report: per-device TFLOP/s and efficiency against the
same kernel alone on one device at the per-device length, JAX vs PyTorch, the issue's targets, a
CSV and efficiency / scaling plots, from the driver's records (--preset=cp_bench runs both
halves). Devices are named as they were (GPUs, virtual CPU devices, gloo ranks: device_noun).

    python experiments/report.py --results=results/local/cp/results.jsonl --out_dir=cp_report/
"""

from __future__ import annotations

import math
import shlex
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from experiments.core.points import DEFAULT_IMPL  # noqa: E402
from experiments.reports import plots  # noqa: E402
from experiments.reports.report_parts import (  # noqa: E402
    GPU_BACKENDS,
    PLACEMENT_FIELDS,
    POINT_FIELDS,
    DeviceNoun,
    ResultsPaths,
    command_lines,
    device_noun,
    failed_points,
    md_table,
    point_seqlens,
    read_results,
    results_paths,
    run_backend,
    slug,
    write_csv,
)
from shard_strategies import LAYOUTS, STRATEGIES, default_local_impl  # noqa: E402

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
    "dispatch_ms",
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
MARKERS = {**plots.MARKERS, "no_single": ("no single-device rate", "o", "tab:olive")}
NO_BASELINE = "†"  # marks an efficiency n/a because no single-device run is in the results
FAILED_BASELINE = "‡"  # ... because the single-device run recorded no rate (OOM, ...)
REFERENCE_STYLES = ("--", ":", "-.")  # line styles of a plot's reference lines, in order
STRIP_LANE_INCHES = 0.3  # height of a series' lane in a plot's strip of points without a number
# Point fields that run.py takes as one flag each (--mode is a list flag; a table has one mode).
SCALAR_FLAGS = (
    "mode",
    "batch",
    "heads_q",
    "heads_kv",
    "head_dim",
    "dtype",
    "window",
    "num_masks",
    "seed",
    "warmup",
    "iters",
)
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
    """Per-device TFLOP/s over the single-device rate, in percent (None without both numbers)."""
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
        "dispatch_ms": (metrics.get("dispatch_ms") or {}).get("median"),
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


def no_efficiency(row: dict) -> str:
    """'n/a' with the mark of why an ok point has no efficiency (notes under the tables)."""
    return f"n/a{FAILED_BASELINE if row['single_gpu_status'] else NO_BASELINE}"


def cell(row: dict) -> str:
    """'per-device TFLOP/s (efficiency %)' for an ok point, its status label otherwise."""
    if row["status"] != "ok":
        return label(row)
    eff = row["efficiency_pct"]
    shown = f"{eff:.1f}%" if eff is not None else f"eff. {no_efficiency(row)}"
    return f"{row['tflops_per_gpu']:.3g} ({shown})"


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


def by_key(records: Iterable[dict]) -> dict[str, dict]:
    """Records by point key: the record behind each CP row."""
    return {r["key"]: r for r in records}


def _noun(rows: Iterable[dict], keyed: Mapping[str, dict]) -> DeviceNoun:
    """The devices a group of CP rows ran on (device_noun of their records)."""
    return device_noun(keyed[r["key"]] for r in rows)


def table_groups(rows: list[dict]) -> list[tuple[tuple, list[dict]]]:
    """The rows of each strategy table, per (framework, devices, mode, shape, impl), in order."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[_table_group(r)].append(r)
    return sorted(groups.items(), key=_group_order)


def strategy_table(
    group: tuple, members: list[dict], noun: DeviceNoun
) -> tuple[str, list[str], list[list[str]]]:
    """(title, header, body) of a group's table: rows (mask, tokens/device), columns
    strategy/layout."""
    fw, n, mode, shp, impl = group
    cols = sorted({series(r) for r in members}, key=series_order)
    cells: dict[tuple, dict[str, str]] = defaultdict(dict)
    for r in members:
        cells[(r["mask"], r["tokens_per_gpu"])][series(r)] = cell(r)
    body = [[m, t, *(c.get(s, "") for s in cols)] for (m, t), c in sorted(cells.items())]
    title = f"{fw} x{n} {noun.many}, {mode}: {shp}, impl {impl}"
    return title, ["mask", f"tokens/{noun.one}", *cols], body


def _at(rows: list[dict]) -> str:
    """'at 64 tokens (causal, full)': the per-device lengths and the masks of rows."""
    tokens = ", ".join(map(str, sorted({r["tokens_per_gpu"] for r in rows})))
    return f"at {tokens} tokens ({', '.join(sorted({r['mask'] for r in rows}))})"


def cp_default_kernel(rec: dict) -> str | None:
    """The local kernel a CP record's strategy ran for impl "default" on its devices (None when
    the record does not say what its devices were)."""
    backend = run_backend(rec)
    if backend is None:
        return None
    return default_local_impl(rec["point"]["framework"], backend in GPU_BACKENDS)


def _fixed_flags(rec: dict) -> tuple[str, ...] | None:
    """The run.py flags a CP record's baseline run shares over its points: framework, kernel,
    shape, timing and output folder (None without its flags, or its devices for impl default)."""
    flags = (rec.get("provenance") or {}).get("flags")
    kernel = cp_default_kernel(rec)
    p = rec["point"]
    if not flags or (p["impl"] == DEFAULT_IMPL and kernel is None):
        return None
    out = [f"--framework={p['framework']}"]
    if p["impl"] == DEFAULT_IMPL:
        out += [f"--impl={kernel}", f"--num_devices={p['num_devices']}", "--cp_scaling=weak"]
    else:
        out.append(f"--impl={p['impl']}")
    out += [f"--{f}={p[f]}" for f in SCALAR_FLAGS if p.get(f) is not None]
    out += ["--reference_compat"] if p.get("reference_compat") else []
    out += [f"--out_dir={flags['out_dir']}"] if flags.get("out_dir") else []
    return tuple(out)


def _joined(values: Iterable) -> str:
    """Distinct values, sorted, as one comma-list flag value."""
    return ",".join(map(str, sorted(set(values))))


def _command(fixed: tuple[str, ...], points: list[dict]) -> str:
    """run.py with the shared flags and the points' masks and per-device lengths; for impl
    default also their CP strategies and layouts, run again with the kernel named."""
    rerun_cp = points[0]["impl"] == DEFAULT_IMPL
    cps = ["none", *sorted({p["cp"] for p in points})] if rerun_cp else ["none"]
    lists = [f"--cp={','.join(cps)}"]
    lists += [f"--layout={_joined(p['layout'] for p in points)}"] if rerun_cp else []
    lists += [
        f"--mask={_joined(p['mask'] for p in points)}",
        f"--seqlen={_joined(point_seqlens(p)[1] for p in points)}",
    ]
    return shlex.join(["python", "experiments/run.py", fixed[0], *lists, *fixed[1:]])


def baseline_commands(records: list[dict]) -> list[str]:
    """run.py commands that add the single-device points these CP records lack, one per set of
    shared flags (none when the records carry no flags)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for rec in records:
        fixed = _fixed_flags(rec)
        if fixed is not None:
            groups[fixed].append(rec["point"])
    return [_command(fixed, points) for fixed, points in groups.items()]


def missing_baseline_note(rows: list[dict], records: list[dict], noun: DeviceNoun) -> str:
    """The note of ok points whose kernel has no single-device run in the results: what is
    missing, and the command that would run it (from the records' flags) or what it would be."""
    impl, one = rows[0]["impl"], noun.one
    if impl == DEFAULT_IMPL:
        kernel = cp_default_kernel(records[0])
        what = (
            f"impl {impl} {_at(rows)} is each CP strategy's own pick of local kernel"
            f"{f' (here {kernel})' if kernel else ''}, which never runs alone, so no "
            f"single-{one} rate can match it"
        )
        named, alone = (kernel, kernel) if kernel else ("their kernel", "that kernel")
        need = f"CP points that name {named}, beside {alone} alone at the per-{one} length"
    else:
        what = f"no single-{one} run of impl {impl} {_at(rows)} in these results"
        need = (
            f"a kernel point (no CP) of impl {impl} with the same shape, masks and mode at the "
            f"per-{one} length"
        )
    runs = " and ".join(f"`{c}`" for c in baseline_commands(records))
    if runs:
        return f"{NO_BASELINE} n/a: {what}; run {runs} for {need}."
    return f"{NO_BASELINE} n/a: {what}; the efficiency needs {need}."


def failed_baseline_note(status: str, rows: list[dict], noun: DeviceNoun) -> str:
    """The note of ok points whose single-device run is in the results without a rate."""
    impl, shown = rows[0]["impl"], STATUS_LABEL.get(status, status)
    return (
        f"{FAILED_BASELINE} n/a: the single-{noun.one} run of impl {impl} {_at(rows)} is {shown}."
    )


def baseline_notes(members: list[dict], keyed: Mapping[str, dict], noun: DeviceNoun) -> list[str]:
    """Under a table: why its ok points have no efficiency, once per cause (the cells' marks)."""
    lacking = [r for r in members if r["status"] == "ok" and r["efficiency_pct"] is None]
    missing = [r for r in lacking if not r["single_gpu_status"]]
    notes = []
    if missing:
        notes.append(missing_baseline_note(missing, [keyed[r["key"]] for r in missing], noun))
    failed: dict[str, list[dict]] = defaultdict(list)
    for r in lacking:
        if r["single_gpu_status"]:
            failed[r["single_gpu_status"]].append(r)
    return notes + [failed_baseline_note(s, rs, noun) for s, rs in sorted(failed.items())]


def cross_framework(rows: list[dict], keyed: Mapping[str, dict]) -> list[dict]:
    """Points run in both frameworks (devices, shape, mask, tokens, strategy, layout, mode):
    both rates, their ratio, peak memories and the plan's bytes moved per device, with a
    mismatch flag (both executors use one shared plan, so the bytes must agree)."""
    by_fw: dict[str, dict[tuple, list[dict]]] = {
        "jax": defaultdict(list),
        "torch": defaultdict(list),
    }
    for r in rows:
        if r["framework"] in by_fw:
            k = (r["num_gpus"], shape(r), r["mask"], r["tokens_per_gpu"], series(r), r["mode"])
            by_fw[r["framework"]][k].append(r)
    noun = _noun([r for r in rows if r["framework"] in by_fw], keyed)
    one = noun.one
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
                        noun.many: n,
                        "shape": shp,
                        "mode": mode,
                        "mask": mask,
                        f"tokens/{one}": tokens,
                        "strategy/layout": ser,
                        "impls (jax, torch)": f"{j['impl']}, {t['impl']}",
                        f"jax TFLOP/s/{one}": cell(j),
                        f"torch TFLOP/s/{one}": cell(t),
                        "jax/torch": (
                            f"{j['tflops_per_gpu'] / t['tflops_per_gpu']:.2f}x" if both_ok else "-"
                        ),
                        "jax peak GiB": _gib(j["peak_gib"]),
                        "jax peak from": j["mem_source"] or "-",
                        "torch peak GiB": _gib(t["peak_gib"]),
                        f"bytes moved/{one}": _bytes_label(jb if jb is not None else tb),
                        "plans agree": agree,
                    }
                )
    return out


def _verdict(best: dict | None, cands: list[dict], goal: float) -> str:
    """met / missed against the goal; n/a (marked) when an ok candidate has no baseline; no data
    when none of the named strategy/layouts ran."""
    if best is not None:
        return "met" if best["efficiency_pct"] >= goal else "missed"
    unscored = [r for r in cands if r["status"] == "ok"]
    if unscored:
        return no_efficiency(unscored[0])
    return "missed" if cands else "no data"


def targets(rows: list[dict], keyed: Mapping[str, dict]) -> list[dict]:
    """Per (framework, devices, mode, shape, impl, mask, tokens/device >= TARGET_MIN_TOKENS):
    the best efficiency among the strategy/layouts the target names, and whether it meets the
    target."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["mask"] in TARGETS and r["tokens_per_gpu"] >= TARGET_MIN_TOKENS:
            groups[(*_table_group(r), r["mask"], r["tokens_per_gpu"])].append(r)
    out = []
    for (fw, n, mode, shp, impl, mask, tokens), members in sorted(groups.items(), key=_group_order):
        goal, scope, eligible = TARGETS[mask]
        noun = _noun(members, keyed)
        cands = [r for r in members if eligible(r["strategy"], r["layout"])]
        scored = [r for r in cands if r["efficiency_pct"] is not None]
        best = max(scored, key=lambda r: r["efficiency_pct"]) if scored else None
        verdict = _verdict(best, cands, goal)
        statuses = ", ".join(sorted({label(r) for r in cands if r["status"] != "ok"}))
        out.append(
            {
                "framework": fw,
                noun.many: n,
                "mode": mode,
                "config": f"{shp}, {impl}",
                "mask": mask,
                f"tokens/{noun.one}": tokens,
                "target": f">= {goal:.0f}% ({scope})",
                "best": series(best) if best else (statuses or "-"),
                "efficiency": f"{best['efficiency_pct']:.1f}%" if best else "-",
                "result": verdict,
            }
        )
    return out


def _provenance_lines(rows: list[dict], records: list[dict], paths: Sequence[str]) -> list[str]:
    lines = [f"- results: {', '.join(str(p) for p in paths)}", *command_lines(records)]
    for fw in sorted({r["framework"] for r in rows}):
        noun = device_noun(r for r in records if is_cp(r) and r["point"]["framework"] == fw)
        counts = sorted({r["num_gpus"] for r in rows if r["framework"] == fw})
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
            f"- {fw}: {', '.join(map(str, counts)) or '?'} {noun.many} (device kind "
            f"{', '.join(kinds) or '?'}); {'; '.join(sorted(commits))}",
            *(f"  - versions: {v}" for v in sorted(versions) if v),
        ]
    return lines


def _cells_text(noun: DeviceNoun) -> str:
    """What a strategy table's cell says, in the devices' own words."""
    one = noun.one
    return (
        f"Cells: median per-{one} TFLOP/s (global mask FLOPs / {noun.many} / time) and, in "
        f"brackets, efficiency = per-{one} TFLOP/s / the same kernel's single-{one} TFLOP/s on "
        f"the per-{one} problem (the kernel point of the same impl at the per-{one} length). "
        f"eff. n/a{NO_BASELINE}: these results hold no such single-{one} rate; eff. "
        f"n/a{FAILED_BASELINE}: that single-{one} run recorded no rate; the notes under each "
        "table name those runs. OOM, unsup. (unsupported), WRONG (failed the float64 check) and "
        "error points carry no number. Times (JAX and PyTorch alike) start from inputs already "
        "in the executor's layout; dispatching q, k, v into it is timed apart (dispatch_ms in "
        "the CSV)."
    )


def _table_lines(rows: list[dict], keyed: Mapping[str, dict]) -> list[str]:
    """Each strategy table under its title, with its n/a notes below it."""
    lines = []
    for group, members in table_groups(rows):
        noun = _noun(members, keyed)
        title, header, body = strategy_table(group, members, noun)
        lines += [f"## {title}", ""] + md_table(header, body) + [""]
        notes = baseline_notes(members, keyed, noun)
        lines += [*(f"- {n}" for n in notes), ""] if notes else []
    return lines


def write_markdown(
    rows: list[dict], records: list[dict], paths: Sequence[str], out_dir: Path, figs: list[Path]
) -> Path:
    """cp_report.md: provenance, strategy tables, JAX vs PyTorch, targets, failures, plots."""
    keyed = by_key(records)
    noun = _noun(rows, keyed)
    lines = ["# Context-parallel benchmark report", ""]
    lines += _provenance_lines(rows, records, paths)
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[r["status"]] += 1
    lines += [
        "",
        "Statuses: " + ", ".join(f"{s} {n}" for s, n in sorted(counts.items())),
        "",
        _cells_text(noun),
        "",
    ]
    lines += _table_lines(rows, keyed)
    cross = cross_framework(rows, keyed)
    if cross:
        lines += [
            "## JAX vs PyTorch",
            "",
            f"Same {noun.many}, shape, mask, tokens, strategy/layout and mode. JAX peak is the "
            "device high-water mark when the point raised it, else XLA's compiled estimate (peak "
            "from says which); torch peak is the max over ranks. Bytes moved are the plan's per "
            f"{noun.one}; both executors share one plan, so a mismatch is a bug.",
            "",
        ]
        lines += md_table(list(cross[0]), [list(c.values()) for c in cross]) + [""]
    tgt = targets(rows, keyed)
    if tgt:
        lines += [
            "## Targets",
            "",
            f"At tokens/{noun.one} >= {TARGET_MIN_TOKENS}: the best efficiency among the "
            "strategy/layouts each target names (causal >= 95% with zigzag ring/allgather/ulysses; "
            "document and heterogeneous masks >= 85% with the balanced layout). 'no data': none "
            "of those ran.",
            "",
        ]
        lines += md_table(list(tgt[0]), [list(t.values()) for t in tgt]) + [""]
    lines += failed_points(rows, "error")
    if figs:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.relative_to(out_dir)})" for p in figs]
    path = out_dir / "cp_report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _series_colors(names: list[str]) -> dict[str, tuple]:
    """A color per series: tab10 up to 10 series, else spread over viridis."""
    if len(names) <= 10:
        return {n: matplotlib.colormaps["tab10"](i) for i, n in enumerate(names)}
    cmap = matplotlib.colormaps["viridis"]
    return {n: cmap(i / (len(names) - 1)) for i, n in enumerate(names)}


def _line_axes(fig: Figure, lanes: int) -> tuple:
    """(value axes, strip axes below it sharing x, or None when every point has a number)."""
    if not lanes:
        return fig.subplots(), None
    ratios = [5.0, 0.4 + STRIP_LANE_INCHES * lanes]
    return fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": ratios, "hspace": 0.1})


def _draw_lines(ax, rows: list[dict], names: list[str], colors: dict) -> list:
    """A line per series through its numbers (gaps where there is none); their legend handles."""
    handles = []
    for name in names:
        pts = sorted((r for r in rows if r["series"] == name), key=lambda r: r["x"])
        ys = [r["y"] if r["y"] is not None else math.nan for r in pts]
        ax.plot([r["x"] for r in pts], ys, marker="o", color=colors[name])
        handles.append(Line2D([], [], marker="o", color=colors[name], label=name))
    return handles


def _draw_strip(
    strip, rows: list[dict], lanes: list[str], colors: dict, markers: Mapping
) -> set[str]:
    """Points without a number as labelled markers, a lane per series, off the value axis;
    returns the statuses drawn."""
    used: set[str] = set()
    for r in rows:
        status = r["status"] if r["status"] != "ok" else "no_single"
        text, marker, _ = markers.get(status, (status, "o", "black"))
        lane, color = lanes.index(r["series"]), colors[r["series"]]
        strip.scatter([r["x"]], [lane], marker=marker, color=color, s=40, zorder=3)
        strip.annotate(
            text,
            (r["x"], lane),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
            color=color,
        )
        used.add(status)
    strip.set_ylim(len(lanes) - 0.5, -0.5)
    strip.set_yticks(range(len(lanes)), lanes, fontsize=7)
    strip.set_ylabel("no number", fontsize=8)
    return used


def line_figure(
    rows: list[dict],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    reference: dict[str, list[tuple[float, float]]] | None = None,
    hline: float | None = None,
    xtick_label: Callable[[float], str] = str,
    markers: Mapping[str, tuple[str, str, str]] = MARKERS,
) -> Figure:
    """Lines of y vs x (log2 x axis), one per series; points without a number are labelled
    markers in a strip under the value axis, never values on it, so a failure or a missing
    baseline cannot pass for a slow point.

    rows: dicts with series, x, status and y (a number only for ok points; an ok row with y None
    shows as 'no_single'). reference: black lines by name (dashed, dotted, dash-dotted in
    turn); hline: a dashed level;
    markers: status -> (label, marker, color) of the points without a number.
    """
    names = sorted({r["series"] for r in rows}, key=series_order)
    colors = _series_colors(names)
    blank = [r for r in rows if r["y"] is None]
    lanes = [n for n in names if any(r["series"] == n for r in blank)]
    fig = Figure(figsize=(8.0, 5.0 + (0.4 + STRIP_LANE_INCHES * len(lanes) if lanes else 0.0)))
    ax, strip = _line_axes(fig, len(lanes))
    handles = _draw_lines(ax, rows, names, colors)
    used = _draw_strip(strip, blank, lanes, colors, markers) if strip is not None else set()
    ys = [r["y"] for r in rows if r["y"] is not None]
    ys += [y for pts in (reference or {}).values() for _, y in pts]
    top = max([*ys, hline or 0.0] or [1.0]) or 1.0
    for i, (name, pts) in enumerate((reference or {}).items()):
        pts, style = sorted(pts), REFERENCE_STYLES[i % len(REFERENCE_STYLES)]
        ax.plot([x for x, _ in pts], [y for _, y in pts], color="black", ls=style, marker=".")
        handles.append(Line2D([], [], color="black", linestyle=style, label=name))
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1)
    for status in sorted(used):
        text, marker, _ = markers.get(status, (status, "o", "black"))
        handles.append(Line2D([], [], marker=marker, color="gray", linestyle="", label=text))
    xs_all = sorted({r["x"] for r in rows})
    bottom = strip if strip is not None else ax
    ax.set_xscale("log", base=2)
    bottom.set_xticks(xs_all, [xtick_label(x) for x in xs_all])
    bottom.minorticks_off()
    ax.set_xlim(xs_all[0] / 2**0.4, xs_all[-1] * 2**0.4)
    ax.set_ylim(0, 1.15 * top)
    bottom.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return fig


def line_plot(rows: list[dict], path: str | Path, **kwargs: Any) -> Path:
    """line_figure(rows, **kwargs) saved as a PNG at path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line_figure(rows, **kwargs).savefig(path, dpi=100, bbox_inches="tight")
    return path


def efficiency_plots(rows: list[dict], keyed: Mapping[str, dict], out_dir: Path) -> list[Path]:
    """Per (framework, devices, mode, shape, impl, mask): efficiency % vs tokens per device."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(*_table_group(r), r["mask"])].append(r)
    paths = []
    for (fw, n, mode, shp, impl, mask), members in sorted(groups.items(), key=_group_order):
        noun = _noun(members, keyed)
        pts = [
            {
                "series": series(r),
                "x": r["tokens_per_gpu"],
                "status": r["status"],
                "y": r["efficiency_pct"],
            }
            for r in members
        ]
        no_rate = (f"no single-{noun.one} rate", *MARKERS["no_single"][1:])
        paths.append(
            line_plot(
                pts,
                out_dir / "plots" / f"{slug(f'eff_{fw}_x{n}_{mode}_{mask}_{shp}_{impl}')}.png",
                title=f"{fw} x{n} {noun.many}, attn-{mode}, {mask} mask\n{shp}, impl {impl}",
                xlabel=f"tokens per {noun.one}",
                ylabel=f"efficiency % (per-{noun.one} / single-{noun.one} TFLOP/s)",
                hline=100.0,
                xtick_label=plots.seqlen_label,
                markers={**MARKERS, "no_single": no_rate},
            )
        )
    return paths


def scaling_plots(rows: list[dict], keyed: Mapping[str, dict], out_dir: Path) -> list[Path]:
    """Per (framework, mode, shape, impl, mask, tokens/device) run on 2+ device counts:
    per-device TFLOP/s vs devices, with the single-device rate measured in each run as a dashed
    reference."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[
            (r["framework"], r["mode"], shape(r), r["impl"], r["mask"], r["tokens_per_gpu"])
        ].append(r)
    paths = []
    for (fw, mode, shp, impl, mask, tokens), members in sorted(groups.items(), key=_group_order):
        if len({r["num_gpus"] for r in members}) < 2:
            continue
        noun = _noun(members, keyed)
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
                title=f"{fw} attn-{mode}, {mask} mask, {plots.seqlen_label(tokens)} "
                f"tokens/{noun.one}\n{shp}, impl {impl}",
                xlabel=noun.many,
                ylabel=f"per-{noun.one} TFLOP/s (median)",
                reference={f"single {noun.one}, per-{noun.one} problem": ref} if ref else None,
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
    """Per-device TFLOP/s vs devices, a line per strategy/layout; points without a number
    labelled."""
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
    keyed = by_key(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(rows, out_dir / "cp_results.csv", COLUMNS)
    eff = efficiency_plots(rows, keyed, out_dir)
    scaling = scaling_plots(rows, keyed, out_dir)
    md = write_markdown(rows, records, paths, out_dir, eff + scaling)
    return {"markdown": md, "csv": csv_path, "efficiency_plots": eff, "scaling_plots": scaling}


def write_report(results: ResultsPaths, out_dir: str | Path) -> dict[str, object]:
    """The CP report of results files (a missing one raises, naming it)."""
    paths = [str(p) for p in results_paths(results)]
    return write_cp_report(read_results(results), paths, Path(out_dir))
