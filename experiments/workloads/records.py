"""Result records of the train-step workload, in the shape the sweep records and reports use.

results.jsonl gets one summary record per run (key, status, point, metrics, provenance);
train_log.jsonl gets one line per step (loss, time); a run first drops its own lines from the
step it starts at, so a resumed run's steps appear once.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from experiments.core.results import ResultsStore, latest_by_key, read_records
from experiments.runners import timing

from .curves import MOVING_AVERAGE, learning

STEP_LOG_FILE = "train_log.jsonl"


class StepLog(ResultsStore):
    """Durable JSON-lines log of per-step losses and times next to results.jsonl."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        super().__init__(out_dir)
        self.path = self.out_dir / STEP_LOG_FILE

    def drop_steps_from(self, key: str, start: int) -> None:
        """Remove run `key`'s lines of steps >= start (a run resumed at `start` logs them
        again); the file is replaced whole, never left half-rewritten."""
        lines = read_records(self.path)
        kept = [r for r in lines if not _is_step_from(r, key, start)]
        if len(kept) < len(lines):
            _replace_lines(self.path, kept)


def _is_step_from(line: dict, key: str, start: int) -> bool:
    """Whether a step-log line is run `key`'s line of a step >= start."""
    return line["key"].startswith(f"{key}/step") and line.get("step", -1) >= start


def _replace_lines(path: Path, lines: list[dict]) -> None:
    """Make `lines` the content of `path` atomically: a fsynced temporary file renamed over it."""
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        with tmp.open("w") as f:
            f.writelines(json.dumps(line, sort_keys=True) + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@dataclass
class StepTime:
    """One executed step: loss, milliseconds, FLOPs, whether it is timed (warm, compiled)."""

    step: int
    loss: float
    time_ms: float
    flops: dict[str, float]
    density: float
    timed: bool


def now() -> str:
    """UTC timestamp as the sweep records write it."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def step_record(key: str, s: StepTime, compile_s: float | None) -> dict:
    """The train_log.jsonl line of one step."""
    return {
        "key": f"{key}/step{s.step}",
        "step": s.step,
        "loss": s.loss,
        "time_ms": s.time_ms,
        "timed": s.timed,
        "compile_s": compile_s,
        "timestamp": now(),
    }


def logged_losses(out_dir: str | os.PathLike, key: str) -> dict[int, float]:
    """Loss by step of run `key` from its step log (a resumed run's later lines supersede)."""
    lines = latest_by_key(read_records(StepLog(out_dir).path)).values()
    return {r["step"]: r["loss"] for r in lines if r["key"].startswith(f"{key}/step")}


def step_metrics(
    steps: list[StepTime],
    *,
    tokens_per_step: int,
    num_devices: int,
    depth: int,
    attention_ms: list[tuple[StepTime, list[float]]] | None,
) -> dict:
    """Step time, tokens/s, model TFLOP/s per device and attention's FLOP and time shares.

    Timing quantiles use the timed steps (past warm-up, not compiling); if there are none, all
    steps, flagged by `timed_steps` = 0. attention_ms pairs sampled steps with one layer's
    attention call timed alone on that step's mask: the time share is depth x the sum of those
    medians over the sum of the same steps' times (each step's documents set its attention cost).
    """
    timed = [s for s in steps if s.timed] or steps
    trend = learning([s.loss for s in steps])
    t = timing.time_stats([s.time_ms for s in timed])
    flops = float(np.mean([s.flops["total"] for s in timed]))
    attn_flops = float(np.mean([s.flops["attention"] for s in timed]))
    total_s = sum(s.time_ms for s in timed) * 1e-3
    metrics = {
        "time_ms": t,
        "tflops": timing.tflops_stats(flops / num_devices, t),
        "tflops_total": sum(s.flops["total"] for s in timed) / num_devices / total_s / 1e12,
        "tokens_per_s": {q: tokens_per_step / (t[q] * 1e-3) for q in ("median", "p20", "p80")},
        "flops": flops,
        "attention_flops": attn_flops,
        "attention_flop_share": attn_flops / flops,
        "density": float(np.mean([s.density for s in timed])),
        "timed_steps": sum(s.timed for s in steps),
        "losses": {str(s.step): s.loss for s in steps},
        "first_loss": steps[0].loss,
        "last_loss": steps[-1].loss,
        # the means of the first and last MOVING_AVERAGE steps run: what the summary prints
        "first_mean_loss": trend["first_mean"],
        "last_mean_loss": trend["last_mean"],
        "mean_window": min(MOVING_AVERAGE, len(steps)),
        "learning": trend,
    }
    # sampled steps that compiled count only when no step is timed (as the step quantiles above)
    any_timed = any(s.timed for s in steps)
    sampled = [pair for pair in attention_ms or [] if pair[0].timed or not any_timed]
    if sampled:
        medians = [float(np.median(times)) for _, times in sampled]
        metrics["attention_time_ms"] = timing.time_stats(medians)
        metrics["attention_time_steps"] = [s.step for s, _ in sampled]
        metrics["attention_time_share"] = depth * sum(medians) / sum(s.time_ms for s, _ in sampled)
    return metrics


def summary_record(
    key: str,
    point: dict,
    metrics: dict | None,
    elapsed_s: float,
    prov: dict,
    *,
    status: str = "ok",
    reason: str | None = None,
    traceback: str | None = None,
    check: dict | None = None,
) -> dict:
    """The results.jsonl record of a run: ok with metrics, or a failure status and reason;
    `check` is its loss curve's comparison with a baseline kernel's, when there is one."""
    return {
        "key": key,
        "status": status,
        "reason": reason,
        "point": point,
        "metrics": metrics,
        "check": check,
        "masks": None,
        "traceback": traceback,
        "elapsed_s": round(elapsed_s, 3),
        "timestamp": now(),
        "provenance": prov,
    }
