"""PyTorch context parallelism on 4 gloo CPU processes against the float64 oracle.

The workers (tests/torch_cp_worker.py) are launched once, as plain processes with torchrun's
environment variables, and loop over every strategy x layout x mask (MHA and GQA, with and without
the LSE in the loss, a few bf16 cases); each rank checks its global out/lse/dq/dk/dv and compares
the bytes it sent with the plan's comm_volume. This file only launches them and reads the results.
CP_TEST_FILTER=<substring of a case name> runs only the matching cases (for debugging).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORLD = 4
TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("torch_cp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(out_dir: Path, seed: int) -> tuple[bool, str]:
    """Start WORLD worker processes on a free port and wait: (all exited 0, their log tails)."""
    base = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(WORLD),
        "CP_TEST_SEED": str(seed),
        "CP_TEST_OUT": str(out_dir),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    logs = [out_dir / f"log{r}.txt" for r in range(WORLD)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as f:
            env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
            cmd = [sys.executable, str(WORKER)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
    tails = "\n".join(f"--- rank {r}\n{log.read_text()[-3000:]}" for r, log in enumerate(logs))
    return not any(p.returncode for p in procs), tails


def launch(out_dir: Path, seed: int) -> list[dict]:
    """Run the workers (again on another port if the first one was taken meanwhile) and return
    every JSON line they wrote."""
    ok, tails = _run_workers(out_dir, seed)
    if not ok and "address already in use" in tails.lower():
        ok, tails = _run_workers(out_dir, seed)
    if not ok:
        pytest.fail(f"CP workers failed or timed out after {TIMEOUT_S}s:\n{tails}")
    lines = []
    for r in range(WORLD):
        lines += [json.loads(x) for x in (out_dir / f"rank{r}.jsonl").read_text().splitlines()]
    return lines


def _problems(lines: list[dict]) -> list[str]:
    """Every way the workers' records fall short: missing ranks, errors, bytes, jax, messages."""
    from torch_cp_worker import BAD_HEADS, GROUP_SIZE, TOL, cases

    bad = []
    done = [x for x in lines if x.get("done")]
    if len(done) != WORLD or any(x["jax"] for x in done):
        bad.append(f"workers finished: {done} (all {WORLD}, none with jax imported)")
    for heads, phrase in BAD_HEADS:
        errors = [x["error"] for x in lines if x.get("bad_heads") == list(heads)]
        if len(errors) != WORLD or not all(phrase in e for e in errors):
            bad.append(f"heads {heads}: expected {phrase!r} on every rank, got {errors}")
    per_case: dict[str, list[dict]] = {}
    for x in lines:
        if "case" in x:
            per_case.setdefault(x["case"], []).append(x)
    for case in cases():
        if os.environ.get("CP_TEST_FILTER", "") not in case.name:
            continue
        recs = per_case.get(case.name, [])
        if len(recs) != GROUP_SIZE[case.group]:
            bad.append(f"{case.name}: {len(recs)} of {GROUP_SIZE[case.group]} ranks reported")
        for rec in recs:
            if "exception" in rec:
                bad.append(f"{case.name} rank {rec['rank']}: {rec['exception']}")
                continue
            over = {k: e for k, e in rec["errors"].items() if not e <= TOL[case.dtype][k]}
            if over:
                bad.append(f"{case.name} rank {rec['rank']}: errors {over}")
            if rec["sent"] != rec["plan"]:
                bad.append(f"{case.name} rank {rec['rank']}: sent {rec['sent']} plan {rec['plan']}")
    return bad


def test_slurm_variables_become_torchrun_ones():
    from shard_strategies.torch_cp._launch import from_slurm

    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "n1"}
    from_slurm(env)
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "n1" and env["MASTER_PORT"] == "29500"


def test_torch_cp_against_the_oracle_and_the_plan(tmp_path):
    """One launch (so pytest-xdist never starts two process groups) checks every case."""
    sys.path.insert(0, str(WORKER.parent))
    seed = random.randrange(1 << 30)
    bad = _problems(launch(tmp_path, seed))
    assert not bad, f"seed {seed}: {len(bad)} failures\n" + "\n".join(bad[:40])
