"""Building blocks shared by the report's parts: reading results, markdown tables, CSV."""

from __future__ import annotations

import csv
import os
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from experiments.core.provenance import portable_argv
from experiments.core.results import latest_by_key, read_json_lines
from experiments.reports import legacy_tune

ResultsPaths = str | os.PathLike | Sequence[str | os.PathLike]

# The fields of a record's point that the reports show and group by.
POINT_FIELDS = (
    "framework",
    "impl",
    "cp",
    "layout",
    "ulysses_size",
    "mask",
    "seqlen_total",
    "seqlen_per_device",
    "num_devices",
    "scaling",
    "batch",
    "heads_q",
    "heads_kv",
    "head_dim",
    "dtype",
    "mode",
    "num_masks",
    "seed",
    "window",
    "reference_compat",
    "grid",
    "kernel_config",
    "simulated",
    "link",
)
# The point fields that place a run over devices (the rest describe the attention call).
PLACEMENT_FIELDS = (
    "cp",
    "layout",
    "ulysses_size",
    "seqlen_total",
    "seqlen_per_device",
    "num_devices",
    "scaling",
    "grid",
    "kernel_config",
    "simulated",
    "link",
)


GPU_BACKENDS = ("gpu", "cuda")  # what provenance records as a framework's backend on a GPU


class DeviceNoun(NamedTuple):
    """How the reports name the devices of a run: many ("x8 GPUs"), one ("tokens/GPU")."""

    many: str
    one: str


GPUS = DeviceNoun("GPUs", "GPU")
VIRTUAL_CPU_DEVICES = DeviceNoun("virtual CPU devices", "device")  # JAX's host-platform devices
GLOO_RANKS = DeviceNoun("gloo ranks", "rank")  # torch CP on a CPU: processes over gloo
CPU_DEVICES = DeviceNoun("CPU devices", "device")
DEVICES = DeviceNoun("devices", "device")  # unknown, or GPUs mixed with CPUs
CPU_NOUNS = {"jax": VIRTUAL_CPU_DEVICES, "torch": GLOO_RANKS}


def run_backend(rec: dict) -> str | None:
    """The backend a record's framework ran on (cpu, gpu, cuda), from its provenance."""
    devices = (rec.get("provenance") or {}).get("devices") or {}
    return (devices.get(rec["point"]["framework"]) or {}).get("backend")


def _record_noun(rec: dict) -> DeviceNoun:
    """The devices of one record; simulated CP models GPUs, so it keeps that name."""
    backend = run_backend(rec)
    if rec["point"].get("simulated") or backend in GPU_BACKENDS:
        return GPUS
    if backend == "cpu":
        return CPU_NOUNS.get(rec["point"]["framework"], CPU_DEVICES)
    return DEVICES


def device_noun(records: Iterable[dict]) -> DeviceNoun:
    """What a group of records ran on, as the reports name it, so that a CPU run never reads
    as GPUs: GPUs only for CUDA devices and simulated CP, CPU devices for a mix of CPU kinds,
    devices when unknown or mixed with GPUs."""
    nouns = {_record_noun(r) for r in records}
    if len(nouns) == 1:
        return nouns.pop()
    if nouns and nouns <= {VIRTUAL_CPU_DEVICES, GLOO_RANKS, CPU_DEVICES}:
        return CPU_DEVICES
    return DEVICES


def recorded_commands(records: Iterable[dict]) -> list[str]:
    """The distinct commands that wrote the records (their provenance argv), first seen first."""
    argvs = (portable_argv((r.get("provenance") or {}).get("argv") or ()) for r in records)
    return list(dict.fromkeys(f"python {shlex.join(argv)}" for argv in argvs if argv))


def command_lines(records: Iterable[dict]) -> list[str]:
    """Markdown list lines naming the command(s) that produced the results."""
    commands = recorded_commands(records)
    if not commands:
        return ["- command: not recorded"]
    if len(commands) == 1:
        return [f"- command: `{commands[0]}`"]
    head = (
        f"- commands ({len(commands)} runs wrote these results; a --framework=both run records "
        "one command per framework):"
    )
    return [head, *(f"  - `{c}`" for c in commands)]


def results_paths(results: ResultsPaths) -> list[Path]:
    """One results path or several, as a list."""
    if isinstance(results, (str, os.PathLike)):
        return [Path(results)]
    return [Path(r) for r in results]


def read_results(results: ResultsPaths, *, missing_ok: bool = False) -> list[dict]:
    """The latest record of each point key over results files, in file order (lines of the
    former tuning script converted); a missing file raises FileNotFoundError naming it, unless
    missing_ok (then it holds no records)."""
    records = []
    for path in results_paths(results):
        if not path.is_file() and not missing_ok:
            raise FileNotFoundError(f"--results: {str(path)!r} does not exist or is not a file")
        for rec in read_json_lines(path):
            legacy = legacy_tune.is_legacy_tune(rec)
            records.append(legacy_tune.as_driver_record(rec) if legacy else rec)
    return list(latest_by_key([r for r in records if "key" in r]).values())


def point_seqlens(point: dict) -> tuple[int, int]:
    """(seqlen_total, seqlen_per_device) of a record's point; older records have only
    total_seqlen (beside a `seqlen` that was per device under weak CP scaling, else total)."""
    if "seqlen_total" in point:
        return point["seqlen_total"], point["seqlen_per_device"]
    total = point["total_seqlen"]
    return total, -(-total // (point.get("num_devices") or 1))


def md_table(header: Sequence[str], body: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table as lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in body]
    return lines


def slug(text: str) -> str:
    """text as a file-name-safe stem."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip("_")


def write_csv(rows: list[dict], path: Path, columns: Sequence[str]) -> Path:
    """rows under a fixed header (missing fields empty)."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        w.writerows(rows)
    return path


def failed_points(rows: list[dict], reason_field: str) -> list[str]:
    """A "Failed points" section (statuses other than ok/unsupported, first line of the
    reason), or nothing when every point passed or was unsupported."""
    problems = [r for r in rows if r["status"] not in ("ok", "unsupported")]
    if not problems:
        return []
    body = [
        [r["key"], r["status"], (r[reason_field] or "").replace("|", "/").splitlines()[0][:200]]
        for r in problems
    ]
    return ["## Failed points", ""] + md_table(["key", "status", reason_field], body) + [""]
