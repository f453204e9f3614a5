"""The JSON-lines results store: one record per finished point, durable as soon as written."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from experiments.core.outcomes import ERROR

RESULTS_FILE = "results.jsonl"


def _jsonable(x: object) -> object:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        return _jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def read_records(path: str | os.PathLike) -> list[dict]:
    """All complete records of a results file (a torn last line from a kill is skipped)."""
    return [rec for rec in read_json_lines(path) if "key" in rec]


def read_json_lines(path: str | os.PathLike) -> list[dict]:
    """Every complete JSON object line of a file (none if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                records.append(rec)
    return records


def latest_by_key(records: list[dict]) -> dict[str, dict]:
    """The last record of each point key (a retried point supersedes its earlier record)."""
    out: dict[str, dict] = {}
    for r in records:
        out[r["key"]] = r
    return out


class ResultsStore:
    """Appends records to <out_dir>/results.jsonl with flush + fsync, and knows finished keys."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / RESULTS_FILE

    def done_keys(self, *, retry_errors: bool = False) -> set[str]:
        """Keys already recorded (errors excluded when they are to be retried)."""
        latest = latest_by_key(read_records(self.path))
        return {k for k, r in latest.items() if not (retry_errors and r.get("status") == ERROR)}

    def append(self, record: dict) -> None:
        """Write one record durably; a torn previous line is closed first so it stays isolated."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        line = json.dumps(_jsonable(record), sort_keys=True, allow_nan=False) + "\n"
        with self.path.open("a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())
