"""Building blocks shared by the report's parts: reading results, markdown tables, CSV."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path

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
