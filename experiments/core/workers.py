"""--framework=both: each framework's points in a worker process of its own, one results file.

JAX and PyTorch in one process fight over the GPU: XLA's allocator takes most of the memory at
first use, and Triton's cache breaks for torch after jax-triton has run. So the driver runs the
same command once per framework in a fresh process (which resumes from, and appends to, the one
results.jsonl), and writes the joint report afterwards. The CP size is fixed for both workers
so that their CP points compare like with like.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from experiments.core import interrupt

RUN_PY = str(Path(__file__).resolve().parent.parent / "run.py")
INTERRUPTED = 130  # 128 + SIGINT: the exit status shells report for a Ctrl-C
_OWN_FLAGS = ("framework", "report", "num_devices", "out_dir", "impl", "time_budget")


def forwarded_flags(flag_values) -> list[str]:
    """The explicitly given flags, serialized, except those each worker gets its own value of."""
    seen, out = set(), []
    for name in flag_values:
        flag = flag_values[name]
        if id(flag) in seen or not flag.present or flag.name in _OWN_FLAGS:
            continue
        seen.add(id(flag))
        out.append(flag.serialize())
    return out


def _jax_device_count() -> int:
    """JAX's device count, asked in a short-lived process so this one never holds the GPU."""
    code = "import jax; print(jax.device_count())"
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        return int(done.stdout.split()[-1])
    except (subprocess.CalledProcessError, ValueError, IndexError):
        return 0


def shared_cp_size(frameworks: Iterable[str], num_devices: int) -> int:
    """--num_devices if given, else the fewest CP devices any of the frameworks has."""
    if num_devices:
        return num_devices
    from experiments.runners import cp_launch

    sizes = []
    for fw in frameworks:
        try:
            sizes.append(_jax_device_count() if fw == "jax" else cp_launch.torch_world_size(0))
        except ImportError:
            continue
    sizes = [s for s in sizes if s > 0]
    return min(sizes) if sizes else 0


def impls_of(framework: str, impls: tuple[str, ...]) -> tuple[str, ...]:
    """The requested impl names this framework knows ('all' and 'default' kept)."""
    from experiments.core.points import ALL, DEFAULT_IMPL
    from experiments.runners import frameworks

    try:
        known = set(frameworks.impl_names(framework))
    except ImportError:
        return impls
    return tuple(i for i in impls if i in known or i in (ALL, DEFAULT_IMPL))


def run_each(
    frameworks: Iterable[str],
    flags: list[str],
    out_dir: str,
    num_devices: int,
    impls: tuple[str, ...] | None,
) -> int:
    """Run the command once per framework in its own process, all into out_dir, each with the
    requested impls it knows (none known: no worker); the first failing status, or 0
    (INTERRUPTED or BUDGET_SPENT at once if a worker stopped so; the workers share the time
    budget)."""
    status = 0
    for fw in frameworks:
        interrupt.raise_if_requested()
        cmd = [sys.executable, RUN_PY, *flags, f"--framework={fw}", f"--out_dir={out_dir}"]
        cmd.append("--report=false")
        left = interrupt.remaining_s()
        if left is not None:  # the workers share the command's budget
            cmd.append(f"--time_budget={max(left, 1e-3):.3f}")
        if impls is not None:
            mine = impls_of(fw, impls)
            if not mine:
                print(f"--- no {fw} points: none of --impl={','.join(impls)} is a {fw} impl")
                continue
            cmd.append(f"--impl={','.join(mine)}")
        if num_devices:
            cmd.append(f"--num_devices={num_devices}")
        print(f"--- {fw} points in a worker process of their own", flush=True)
        worker = subprocess.Popen(cmd)
        try:
            code = worker.wait()
        except KeyboardInterrupt:  # the worker got the same Ctrl-C: let it record and stop
            worker.wait()
            return INTERRUPTED
        if code in (INTERRUPTED, interrupt.BUDGET_SPENT):
            return code
        status = status or code
    return status
