"""Launches a test's worker script as plain processes with torchrun's variables (gloo on CPU)
and collects the JSON lines every rank wrote to `CP_TEST_OUT`/rank<r>.jsonl."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def leave_group() -> None:
    """End a worker whose lines are on disk: barrier, destroy the group, exit without interpreter
    teardown, where torch 2.13's gloo can abort ("terminate called without an active
    exception") after every rank finished, turning a finished launch into a failed one."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(
    worker: Path, world: int, out_dir: Path, env: dict[str, str], timeout_s: float
) -> tuple[bool, str]:
    """Start `world` worker processes on a free port and wait: (all exited 0, their log tails)."""
    base = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "CP_TEST_OUT": str(out_dir),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        **env,
    }
    logs = [out_dir / f"log{r}.txt" for r in range(world)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as f:
            rank_env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
            cmd = [sys.executable, str(worker)]
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=f, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
    tails = "\n".join(f"--- rank {r}\n{log.read_text()[-3000:]}" for r, log in enumerate(logs))
    return not any(p.returncode for p in procs), tails


def _wrote(out_dir: Path, world: int) -> bool:
    """Whether any rank wrote a result line."""
    files = [out_dir / f"rank{r}.jsonl" for r in range(world)]
    return any(f.exists() and f.read_text().strip() for f in files)


def launch(
    worker: Path, world: int, out_dir: Path, env: dict[str, str], timeout_s: float
) -> list[dict]:
    """Run the workers and return every JSON line they wrote, rank by rank. A launch whose group
    never formed (its port taken meanwhile, or no rank wrote a line) is tried once more on
    another port; a launch that produced results is never retried."""
    ok, tails = _run_workers(worker, world, out_dir, env, timeout_s)
    if not ok and ("address already in use" in tails.lower() or not _wrote(out_dir, world)):
        ok, tails = _run_workers(worker, world, out_dir, env, timeout_s)
    if not ok:
        pytest.fail(f"CP workers failed or timed out after {timeout_s}s:\n{tails}")
    lines = []
    for r in range(world):
        lines += [json.loads(x) for x in (out_dir / f"rank{r}.jsonl").read_text().splitlines()]
    return lines
