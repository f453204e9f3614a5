"""Point statuses and the mapping from an exception to a status, shared by every runner."""

from __future__ import annotations

import traceback

OK, OOM, UNSUPPORTED, WRONG, ERROR = "ok", "oom", "unsupported", "wrong", "error"
STATUSES = (OK, OOM, UNSUPPORTED, WRONG, ERROR)
# a simulated point's single-device baseline measured at a capped length, its rate standing for
# the longer problem's (--sim_baseline_max_seqlen)
SCALED = "scaled"
MAX_MESSAGE_CHARS = 2000


class PointFailure(Exception):
    """Raised inside a runner to end a point with a given non-ok status and reason."""

    def __init__(self, status: str, reason: str, details: dict | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.details = details or {}


def not_available(exc: BaseException) -> PointFailure:
    """The status for a package or public name that cannot be imported (yet)."""
    return PointFailure(UNSUPPORTED, f"not available: {exc}")


def _is_oom(exc: BaseException) -> bool:
    name = type(exc).__name__
    text = str(exc)
    if isinstance(exc, MemoryError) or name in ("OutOfMemoryError", "OutOfResources"):
        return True
    if "RESOURCE_EXHAUSTED" in text:
        return True
    lowered = text.lower()
    return name in ("RuntimeError", "XlaRuntimeError", "JaxRuntimeError") and (
        "out of memory" in lowered or "can't allocate memory" in lowered
    )


def _is_unsupported(exc: BaseException) -> bool:
    return any(c.__name__ == "Unsupported" for c in type(exc).__mro__) or isinstance(
        exc, NotImplementedError
    )


def classify(exc: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception raised while running a point."""
    if isinstance(exc, PointFailure):
        return exc.status, exc.reason
    if isinstance(exc, ImportError):
        return UNSUPPORTED, f"not available: {exc}"
    message = f"{type(exc).__name__}: {exc}"[:MAX_MESSAGE_CHARS]
    if _is_oom(exc):
        return OOM, message
    if _is_unsupported(exc):
        return UNSUPPORTED, message
    return ERROR, message


def short_traceback(exc: BaseException, limit: int = 6) -> str:
    """The last frames of an exception's traceback, for the record of an error point."""
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-limit)
    return "".join(lines)[-MAX_MESSAGE_CHARS:]
