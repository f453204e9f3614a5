"""Rerun a test module under Triton's CPU interpreter: TRITON_INTERPRET=1 must be set before
triton is first imported, so a module that needs it and finds it unset runs again in a
subprocess that sets it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rerun_interpreted(test_file: str, *pytest_args: str, timeout: float) -> str:
    """pytest `test_file` with TRITON_INTERPRET=1 in a fresh process; its stdout, after
    asserting that it passed (the assertion carries the end of its output)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*cmd, *pytest_args, test_file],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc.stdout
