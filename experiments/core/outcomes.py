"""Point statuses and the mapping from an exception to a status, shared by every runner."""

from __future__ import annotations

import traceback

OK, OOM, UNSUPPORTED, WRONG, ERROR = "ok", "oom", "unsupported", "wrong", "error"
STATUSES = (OK, OOM, UNSUPPORTED, WRONG, ERROR)
# a simulated point's single-device baseline measured at a capped length, its rate standing for
# the longer problem's (--sim_baseline_max_seqlen)
SCALED = "scaled"
MAX_MESSAGE_CHARS = 2000
# Errors after which a process's CUDA context is unusable (sticky: every later launch fails),
# as JAX/XLA (CUDA driver names) and PyTorch (runtime messages) word them.
DEVICE_FAULTS = (
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
    "CUDA_ERROR_CONTEXT_IS_DESTROYED",
    "unspecified launch failure",
    "an illegal memory access was encountered",
    "an illegal instruction was encountered",
    "misaligned address",
    "device-side assert triggered",
    "uncorrectable ECC error encountered",
)


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


def chain_text(exc: BaseException, most: int = 8) -> str:
    """The messages of `exc` and the exceptions it was raised from or during (a runner may
    re-raise a fault as a PointFailure whose reason is cut short)."""
    texts: list[str] = []
    while exc is not None and len(texts) < most:
        texts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(texts)


def device_fault(text: str | None) -> str | None:
    """The sticky CUDA error `text` (an exception's message) names (DEVICE_FAULTS), or None."""
    return next((f for f in DEVICE_FAULTS if text and f in text), None)


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
