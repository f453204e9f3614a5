"""Building blocks shared by the kernel report (report.py) and the CP report (report_cp.py)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path


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
