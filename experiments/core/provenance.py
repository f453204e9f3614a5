"""Provenance attached to every result: package versions, devices, git commit, host."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "numpy",
    "jax",
    "jaxlib",
    "torch",
    "triton",
    "jax-triton",
    "flash-attn",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "absl-py",
    "matplotlib",
)


def portable_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """argv with an absolute script path that ends in one of this repository's files (on this
    machine or the one that recorded it) named relative to the repository root, so a recorded
    command reads the same everywhere and names no machine's folders."""
    argv = list(argv)
    script = Path(argv[0]) if argv else None
    if script is not None and script.is_absolute():
        parts = script.parts
        for start in range(1, len(parts)):
            tail = Path(*parts[start:])
            if (REPO_ROOT / tail).is_file():
                argv[0] = str(tail)
                break
    return argv


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that affect the numbers (absent ones omitted)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def git_state() -> dict[str, object]:
    """Commit hash of the working tree (None outside git or before the first commit) and
    whether it has uncommitted changes."""

    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    status = git("status", "--porcelain")
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
    }


def jax_devices() -> dict[str, object]:
    """JAX backend, device kinds and counts (global and local), if jax is imported."""
    jax = sys.modules.get("jax")
    if jax is None:
        return {}
    devs = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": sorted({d.device_kind for d in devs}),
        "device_count": len(devs),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
    }


def torch_devices() -> dict[str, object]:
    """Torch accelerator names and count, if torch is imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return {
            "backend": "cuda",
            "device_kind": sorted({torch.cuda.get_device_name(i) for i in range(n)}),
            "device_count": n,
            "cuda": torch.version.cuda,
        }
    return {
        "backend": "cpu",
        "device_kind": [platform.processor() or platform.machine()],
        "device_count": 1,
        "threads": torch.get_num_threads(),
    }


def collect(flag_values: dict) -> dict[str, object]:
    """Everything needed to reproduce a record, computed once per run."""
    return {
        "versions": package_versions(),
        "git": git_state(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "platform": platform.platform(),
        "argv": portable_argv(sys.argv),
        "flags": flag_values,
        "devices": {"jax": jax_devices(), "torch": torch_devices()},
    }
