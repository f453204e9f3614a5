"""JAX CP under jax.distributed: 2 processes x 4 CPU devices on localhost, gloo collectives."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

WORKER = Path(__file__).with_name("jax_cp_worker.py")
ROOT = WORKER.parent.parent
NUM_PROCESSES = 2
TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(
    not hasattr(jax.config, "jax_cpu_collectives_implementation"),
    reason="this jax has no cross-process CPU collectives (jax_cpu_collectives_implementation)",
)
def test_ring_and_usp_across_processes():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(NUM_PROCESSES), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(NUM_PROCESSES)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert "OK" in out.splitlines()[-1], out[-3000:]
