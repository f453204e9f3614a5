"""The point loop: run each point, turn any failure into a status, append its record."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone

from experiments.core import interrupt
from experiments.core.outcomes import (
    ERROR,
    OK,
    PointFailure,
    chain_text,
    classify,
    device_fault,
    short_traceback,
)
from experiments.core.points import Point
from experiments.core.progress import Progress
from experiments.core.results import ResultsStore


def make_record(
    point: Point,
    status: str,
    *,
    reason: str | None = None,
    result: dict | None = None,
    details: dict | None = None,
    elapsed_s: float = 0.0,
    provenance: dict | None = None,
) -> dict:
    """The JSON record of a finished point."""
    result = result or {}
    details = details or {}
    return {
        "key": point.key,
        "status": status,
        "reason": reason,
        "simulated": point.simulated,
        "point": point.as_dict(),
        "metrics": result.get("metrics"),
        "check": result.get("check") or details.get("check"),
        "masks": result.get("masks"),
        "traceback": details.get("traceback"),
        **({"device_fault": details["device_fault"]} if "device_fault" in details else {}),
        "elapsed_s": round(elapsed_s, 3),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "provenance": provenance,
    }


def run_one(point: Point, runner_for: Callable[[Point], object], provenance: dict) -> dict:
    """Run a point and return its record; every exception becomes a status, never escapes."""
    t0 = time.monotonic()
    try:
        result = runner_for(point).run(point)
    except Exception as e:
        status, reason = classify(e)
        details = dict(e.details) if isinstance(e, PointFailure) else {}
        fault = device_fault(chain_text(e))
        if fault:  # whatever else the message says (out of memory, a wrong check), the GPU faulted
            status, details["device_fault"] = ERROR, fault
        if status == ERROR and "traceback" not in details:
            details["traceback"] = short_traceback(e)
        return make_record(
            point,
            status,
            reason=reason,
            details=details,
            elapsed_s=time.monotonic() - t0,
            provenance=provenance,
        )
    return make_record(
        point, OK, result=result, elapsed_s=time.monotonic() - t0, provenance=provenance
    )


def run_points(
    points: Iterable[Point],
    runner_for: Callable[[Point], object],
    *,
    store: ResultsStore | None,
    progress: Progress | None,
    provenance: dict,
    stop_on_fault: bool = True,
) -> None:
    """Run points in order; the writer (store given) appends each record as soon as it exists.
    A point that hit a sticky CUDA fault (its record's device_fault) ends the loop once
    recorded (DeviceFaulted, unless stop_on_fault is False): the points after it would only
    record the same error. Processes that share collectives keep going instead (one that
    stopped would leave the others waiting in them)."""
    for point in points:
        interrupt.raise_if_requested()
        record = run_one(point, runner_for, provenance)
        if store is not None:
            store.append(record)
        if progress is not None:
            progress.update(point.label(), record)
        fault = record.get("device_fault")
        if fault and stop_on_fault:
            raise interrupt.DeviceFaulted(point.label(), fault)
        interrupt.raise_if_requested()
