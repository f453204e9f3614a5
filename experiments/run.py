"""One driver for kernel sweeps, CP sweeps and JAX-vs-PyTorch comparisons.

    python experiments/run.py --framework=jax --cp=ring        # CPU: embedded small default
    python experiments/run.py --framework=both --preset=paper   # the published sweeps

Results go to <out_dir>/results.jsonl (one record per point; a rerun, also after Ctrl-C, resumes),
plus CSV, plots and report.md. See experiments/core/flags.py for every flag.
"""

from __future__ import annotations

import os
import sys

VIRTUAL_CPU_DEVICES = 8


def _want_virtual_cpu_devices() -> bool:
    """Virtual CPU devices for JAX CP unless the environment picks GPUs or sets the count."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return False
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    return not any(p in platforms for p in ("cuda", "gpu", "rocm"))


if _want_virtual_cpu_devices():
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={VIRTUAL_CPU_DEVICES}"
    ).strip()

from absl import app, flags, logging  # noqa: E402

from experiments import driver, workers  # noqa: E402
from experiments.core import flags as run_flags  # noqa: E402
from experiments.core import interrupt  # noqa: E402
from experiments.core.points import FRAMEWORKS  # noqa: E402
from experiments.core.results import OutDirBusy, ResultsStore, locked_out_dir  # noqa: E402
from experiments.workloads import flags as workload_flags  # noqa: E402

run_flags.define_flags()
TRAIN_ONLY = "train_step:"  # how the training step's own flags' help begins
flags.adopt_module_key_flags(run_flags)
workload_flags.define_flags()
flags.adopt_module_key_flags(workload_flags)


def _usage_error(error: app.UsageError) -> int:
    """Report a flag value the driver rejected as absl reports the ones its validators reject."""
    print(f"FATAL Flags parsing error: {error}", file=sys.stderr)
    print("Pass --helpshort or --helpfull to see help on flags.", file=sys.stderr, flush=True)
    return error.exitcode


def _reject_train_flags() -> None:
    """An attention sweep would ignore the training step's flags: name them instead."""
    given = [
        f"--{name}"
        for name in run_flags.FLAGS
        if run_flags.FLAGS[name].present
        and (run_flags.FLAGS[name].help or "").startswith(TRAIN_ONLY)
    ]
    if given:
        raise app.UsageError(
            f"{', '.join(sorted(set(given)))} only apply to --workload=train_step (this is an "
            "attention sweep); add --workload=train_step or drop them"
        )


def _interrupted(out_dir: str) -> int:
    """One line on an interrupted sweep: what is recorded, and that rerunning resumes."""
    store = ResultsStore(out_dir)
    recorded = len(store.done_keys())
    print(
        f"Interrupted: {recorded} point{'' if recorded == 1 else 's'} recorded in {store.path}; "
        "rerun the same command to resume.",
        file=sys.stderr,
        flush=True,
    )
    return workers.INTERRUPTED


def _budget_spent(out_dir: str, budget_s: float) -> int:
    """One line on a sweep stopped by its time budget: what is recorded, how to continue."""
    store = ResultsStore(out_dir)
    recorded = len(store.done_keys())
    print(
        f"Time budget of {budget_s:g} s spent: {recorded} point{'' if recorded == 1 else 's'} "
        f"recorded in {store.path}; rerun the same command to continue.",
        flush=True,
    )
    return interrupt.BUDGET_SPENT


def _device_faulted(out_dir: str, fault: interrupt.DeviceFaulted) -> int:
    """One line on a sweep stopped by a sticky CUDA fault: where, what is recorded, how to go on."""
    store = ResultsStore(out_dir)
    recorded = len(store.done_keys())
    print(
        f"Stopped: the GPU faulted at {fault.point} ({fault.fault}), which leaves this process "
        f"unable to use it; that point is recorded as an error and {recorded} "
        f"point{'' if recorded == 1 else 's'} in all in {store.path}. Rerun the same command to "
        "continue with the rest (add --retry_errors to run the faulted point again).",
        file=sys.stderr,
        flush=True,
    )
    return interrupt.DEVICE_FAULTED


def _sweep() -> int:
    """Run or resume the sweep the flags describe; Ctrl-C, the time budget or a device fault
    ends it with one line."""
    settings = run_flags.settings()
    try:
        with interrupt.stop_between_points(settings.time_budget):
            if driver.runs_in_workers(settings):  # each worker reports its own Ctrl-C
                flags = workers.forwarded_flags(run_flags.FLAGS)
                return driver.execute_in_workers(settings, flags, run_flags.grid_overrides())
            return driver.execute(settings, run_flags.requested_cps(), run_flags.grid_overrides())
    except interrupt.BudgetSpent:
        return _budget_spent(settings.out_dir, settings.time_budget)
    except interrupt.DeviceFaulted as fault:
        return _device_faulted(settings.out_dir, fault)
    except KeyboardInterrupt:
        return _interrupted(settings.out_dir)


def _parity() -> int:
    """--parity_bundle: one framework here; --framework=both as one worker per framework (JAX
    saves, then PyTorch verifies), under one lock of the output folder, as the sweep runs."""
    from experiments.workloads import parity

    fv = run_flags.FLAGS
    out_dir = fv.out_dir or parity.OUT_DIR
    driver.check_out_dir(out_dir)
    try:
        if fv.framework != "both":
            workers.start_as_worker()
            with locked_out_dir(out_dir, workers.inherited_lock_fd()):
                return parity.run_from_flags(fv, ResultsStore(out_dir))
        impls = tuple(fv.impl) if fv["impl"].present else None
        with locked_out_dir(out_dir) as lock_fd:
            flags = workers.forwarded_flags(fv)
            return workers.run_each(FRAMEWORKS, flags, out_dir, 0, impls, lock_fd)
    except OutDirBusy as e:
        print(e, file=sys.stderr, flush=True)
        return e.exit_code


def main(argv: list[str]) -> int:
    """absl entry point: run or resume the sweep (or workload) the flags describe."""
    try:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected positional arguments: {' '.join(argv[1:])}")
        if not run_flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)
        if run_flags.FLAGS.parity_bundle:
            return _parity()
        if run_flags.FLAGS.workload == "train_step":
            from experiments.workloads import train_step

            return train_step.run_from_flags(run_flags.FLAGS)
        _reject_train_flags()
        return _sweep()
    except app.UsageError as e:
        return _usage_error(e)


def run_cli(args: list[str]) -> int:
    """Parse `args` as command-line flags and run main in this process (for tests, notebooks)."""
    flags = run_flags.FLAGS
    flags.unparse_flags()
    argv = flags(["run.py", *args])
    return main(argv)


def _main_process(argv: list[str]) -> int:
    """main for the command line: an interrupted or device-faulted sweep leaves without
    interpreter teardown.

    A Ctrl-C that lands inside a JAX compile can leave XLA's threads in a state where Python's
    teardown crashes (SIGSEGV after the one line), and so can a faulted CUDA context (XLA
    unloading its modules); every record is already closed on disk.
    """
    code = main(argv)
    if code in (workers.INTERRUPTED, interrupt.DEVICE_FAULTED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    app.run(_main_process)
