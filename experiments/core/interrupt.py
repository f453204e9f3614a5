"""Ctrl-C between points: the first one stops the sweep once the running point is recorded.

A KeyboardInterrupt raised while XLA compiles or runs can surface as a point error or crash the
interpreter, so during a sweep the first SIGINT only sets a flag the point loop checks; a second
one interrupts at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_requested = threading.Event()


def _on_sigint(signum: int, frame: object) -> None:
    """First Ctrl-C: ask the point loop to stop; second: interrupt right now."""
    if _requested.is_set():
        raise KeyboardInterrupt
    _requested.set()


@contextlib.contextmanager
def stop_between_points() -> Iterator[None]:
    """Within this block the first Ctrl-C ends the sweep after the running point."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested.clear()
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _requested.clear()


def raise_if_requested() -> None:
    """Turn a pending Ctrl-C into KeyboardInterrupt at a point boundary."""
    if _requested.is_set():
        raise KeyboardInterrupt
