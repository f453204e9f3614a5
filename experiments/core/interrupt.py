"""Stopping a sweep between points: on Ctrl-C, when its time budget is spent, or after a point
that left the GPU unusable to this process.

A KeyboardInterrupt raised while XLA compiles or runs can surface as a point error or crash the
interpreter, so during a sweep the first SIGINT only sets a flag the point loop checks; a second
one interrupts at once. A time budget (--time_budget) ends the sweep at the first point boundary
past it, so a long grid runs as resumable pieces that each fit a time slot.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

BUDGET_SPENT = 3  # exit status of a sweep stopped by its time budget (rerun to continue)
DEVICE_FAULTED = 4  # exit status of a sweep stopped by a device fault (rerun to continue)
_requested = threading.Event()
_deadline: list[float] = []  # monotonic time past which the point loop stops; empty: none


class BudgetSpent(BaseException):
    """The sweep's time budget ran out at a point boundary (not an error of any point)."""


class DeviceFaulted(BaseException):
    """A point's error was a sticky CUDA fault (outcomes.DEVICE_FAULTS): every later point of
    this process would fail the same way, so the sweep stops once that point is recorded."""

    def __init__(self, point: str, fault: str) -> None:
        super().__init__(f"{point}: {fault}")
        self.point, self.fault = point, fault


ACKNOWLEDGED = b"stopping after the running point; Ctrl-C again to stop now\n"


def _on_sigint(signum: int, frame: object) -> None:
    """First Ctrl-C: say so at once and ask the point loop to stop; second: interrupt now."""
    if _requested.is_set():
        raise KeyboardInterrupt
    _requested.set()
    os.write(2, ACKNOWLEDGED)  # a point can run for minutes: the user learns it was heard


@contextlib.contextmanager
def stop_between_points(budget_s: float = 0.0) -> Iterator[None]:
    """Within this block the first Ctrl-C ends the sweep after the running point, and so does
    the end of `budget_s` seconds (0: no budget)."""
    if budget_s:
        _deadline[:] = [time.monotonic() + budget_s]
    on_main = threading.current_thread() is threading.main_thread()  # signals: main thread only
    if on_main:
        _requested.clear()
        previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        if on_main:
            signal.signal(signal.SIGINT, previous)
            _requested.clear()
        _deadline.clear()


def stop_requested() -> bool:
    """Whether a Ctrl-C asked the sweep to stop after the running point."""
    return _requested.is_set()


def remaining_s() -> float | None:
    """Seconds left of the time budget (None without one)."""
    return _deadline[0] - time.monotonic() if _deadline else None


def raise_if_requested() -> None:
    """At a point boundary: KeyboardInterrupt for a pending Ctrl-C, BudgetSpent past the
    budget."""
    if _requested.is_set():
        raise KeyboardInterrupt
    left = remaining_s()
    if left is not None and left <= 0:
        raise BudgetSpent
