"""--framework=both: each framework's points in a worker process of its own, one results file.

JAX and PyTorch in one process fight over the GPU: XLA's allocator takes most of the memory at
first use, and Triton's cache breaks for torch after jax-triton has run. So the driver runs the
same command once per framework in a fresh process (which resumes from, and appends to, the one
results.jsonl), and writes the joint report afterwards. The CP size is fixed for both workers
so that their CP points compare like with like.

A worker is part of its parent's run: it inherits the parent's lock of the output folder (an
open descriptor, named in its environment) instead of taking one, and dies with the parent.
spawn starts one; run_each runs the driver's one after another, run_side_by_side several at once
with their stdout lines handed to the parent (the acceptance command's shards).
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from experiments.core import interrupt
from experiments.core.results import AppendFailed, leave_skipped_lines_to_parent

RUN_PY = str(Path(__file__).resolve().parent / "run.py")
INTERRUPTED = 130  # 128 + SIGINT: the exit status shells report for a Ctrl-C
_OWN_FLAGS = ("framework", "report", "num_devices", "out_dir", "impl", "time_budget")
PARENT_ENV = "LONGCTX_RUN_PARENT_PID"  # set in a worker: the PID of the run it belongs to
LOCK_FD_ENV = "LONGCTX_RUN_LOCK_FD"  # set in a worker: its inherited descriptor of the lock
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def worker_env(lock_fd: int) -> dict[str, str]:
    """This process's environment plus what makes a child its worker: its PID and lock fd."""
    return {**os.environ, PARENT_ENV: str(os.getpid()), LOCK_FD_ENV: str(lock_fd)}


def _env_int(name: str) -> int | None:
    """An environment variable's integer value (None when unset or not a number)."""
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def parent_run() -> int | None:
    """The PID of the run this process is a worker of (None: not a worker)."""
    return _env_int(PARENT_ENV)


def inherited_lock_fd() -> int | None:
    """The descriptor of the output folder's lock that the parent run passed down, if any."""
    return _env_int(LOCK_FD_ENV) if parent_run() is not None else None


def start_as_worker() -> None:
    """In a worker (else nothing): end with the parent run, leave skipped lines to it."""
    parent = parent_run()
    if parent is None:
        return
    end_with(parent)
    leave_skipped_lines_to_parent()


def end_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere a no-op).

    SIGKILL, because a worker holds nothing to clean up (records are whole on disk) and no
    handler can defer it. The kernel sends it when the parent's spawning thread ends, so
    run_each and run_side_by_side wait for their workers in the thread that spawned them.
    """
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def spawn(
    cmd: list[str], lock_fd: int, env: Mapping[str, str] | None = None, capture: bool = False
) -> subprocess.Popen:
    """Start `cmd` as a worker of this run: it inherits lock_fd, its environment names both
    (worker_env) plus `env`; capture: its stdout is a text pipe for the parent to read."""
    return subprocess.Popen(
        cmd,
        env={**worker_env(lock_fd), **(env or {})},
        pass_fds=(lock_fd,),
        stdout=subprocess.PIPE if capture else None,
        text=capture,
    )


def _pump(name: str, proc: subprocess.Popen, lines: queue.Queue) -> None:
    """Forward a worker's stdout lines as (name, line), then (name, exit status) when it ends."""
    for line in proc.stdout:
        lines.put((name, line.rstrip("\n")))
    lines.put((name, proc.wait()))


def run_side_by_side(
    cmds: Mapping[str, list[str]],
    lock_fd: int,
    on_line: Callable[[str, str], None],
    env: Mapping[str, str] | None = None,
) -> dict[str, int] | int:
    """Run the named commands at once as workers of this run (spawn, with `env`), hand each
    stdout line (no newline) to on_line(name, line) in this thread as it comes, wait for all.

    Returns each one's exit status by name, in the order they ended; INTERRUPTED after a Ctrl-C
    (the workers got the same one: their remaining lines are handed over once they stopped).
    Any other exception (on_line's too) kills and reaps the workers before it propagates, so
    none outlives a failed parent and no pump thread keeps this process alive.
    """
    lines: queue.Queue = queue.Queue()
    procs = {name: spawn(cmd, lock_fd, env, capture=True) for name, cmd in cmds.items()}
    pumps = [
        threading.Thread(target=_pump, args=(n, p, lines), daemon=True) for n, p in procs.items()
    ]
    for pump in pumps:
        pump.start()
    codes: dict[str, int] = {}

    def hand_over(item: tuple[str, str | int]) -> None:
        name, got = item
        if isinstance(got, int):
            codes[name] = got
        else:
            on_line(name, got)

    try:
        while len(codes) < len(pumps):
            hand_over(lines.get())
    except KeyboardInterrupt:  # the workers got the same Ctrl-C: let them record and stop
        for pump in pumps:
            pump.join()
        while not lines.empty():
            hand_over(lines.get_nowait())
        return INTERRUPTED
    except BaseException:
        for proc in procs.values():
            proc.kill()
        for proc in procs.values():
            proc.wait()
        raise
    return codes


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
    lock_fd: int,
) -> int:
    """Run the command once per framework in its own process, all into out_dir under this
    run's lock (lock_fd, inherited), each with the requested impls it knows (none known: no
    worker); the first failing status, or 0 (INTERRUPTED, BUDGET_SPENT or a failed write at once
    if a worker stopped so; the workers share the time budget)."""
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
        worker = spawn(cmd, lock_fd)
        try:
            code = worker.wait()
        except KeyboardInterrupt:  # the worker got the same Ctrl-C: let it record and stop
            worker.wait()
            return INTERRUPTED
        if code in (INTERRUPTED, interrupt.BUDGET_SPENT, AppendFailed.exit_code):
            return code
        status = status or code
    return status
