"""One progress line per finished point: done/total, percentage, ETA, and the point's outcome."""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import TextIO


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def wall_seconds(record: dict) -> dict[str, float]:
    """Where a predicted point's own seconds went ({part: s}, summed over its masks' wall_s:
    baseline, plan, compile, emulate, reference, calls; older records lack compile, and
    before that had check for emulate and reference); empty for any
    other record."""
    total: Counter[str] = Counter()
    for m in record.get("masks") or []:
        total.update((m.get("simulation") or {}).get("wall_s") or {})
    return dict(total)


def outcome_text(record: dict) -> str:
    """'ok 12.3 TFLOP/s (4.56 ms)' or 'unsupported: reason' for a record; a predicted point
    adds where its seconds went."""
    status = record["status"]
    if status == "ok":
        m = record["metrics"]
        sim = " predicted" if record.get("simulated") else ""
        text = f"ok{sim} {m['tflops']['median']:.4g} TFLOP/s ({m['time_ms']['median']:.4g} ms)"
        wall = wall_seconds(record)
        if wall:
            text += " [" + ", ".join(f"{p} {s:.1f} s" for p, s in wall.items()) + "]"
        return text
    reason = (record.get("reason") or "").splitlines()[0][:160] if record.get("reason") else ""
    return f"{status}: {reason}" if reason else status


class Progress:
    """Counts finished points of a run (some may be done before it started) and prints ETA."""

    def __init__(self, total: int, done: int = 0, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = done
        self.started_with = done
        self.start = time.monotonic()
        self.stream = stream or sys.stdout

    def update(self, label: str, record: dict) -> None:
        """Count one finished point and print its line."""
        self.done += 1
        ran = self.done - self.started_with
        elapsed = time.monotonic() - self.start
        eta = elapsed / ran * (self.total - self.done) if ran else 0.0
        width = len(str(self.total))
        pct = 100.0 * self.done / max(self.total, 1)
        print(
            f"[{self.done:>{width}}/{self.total} {pct:5.1f}% ETA {_hms(eta)}] {label}: "
            f"{outcome_text(record)}",
            file=self.stream,
            flush=True,
        )
