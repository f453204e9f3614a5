"""Plans a run (preset + flags -> points), skips finished points, dispatches the rest to the
JAX runner, the torch runner and the torch CP ranks, then writes the report."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from absl import app

from experiments import workers
from experiments.core import presets, provenance, sweep
from experiments.core.flags import Settings
from experiments.core.points import ALL, DEFAULT_IMPL, Grid, Point, dedupe, expand
from experiments.core.progress import Progress
from experiments.core.results import (
    AppendFailed,
    OutDirBusy,
    ResultsStore,
    check_lines,
    folder_problem,
    latest_by_key,
    locked_out_dir,
)
from experiments.runners import cp_launch, frameworks


@dataclass
class Plan:
    """What a run will do: its points, device facts and notes to print."""

    points: list[Point]
    on_gpu: dict[str, bool]
    notes: list[str] = field(default_factory=list)


def _detect_gpu(framework: str) -> tuple[bool, str]:
    """(has GPU, why not) for a framework; an unimportable framework counts as CPU."""
    try:
        if framework == "jax":
            import jax

            return jax.default_backend() == "gpu", ""
        import torch

        return torch.cuda.is_available(), ""
    except ImportError as e:
        return False, f"{framework} not importable: {e}"


def _cp_devices(framework: str, settings: Settings) -> int:
    """Number of CP devices/ranks for a framework's CP points."""
    if framework == "jax":
        import jax

        available = jax.device_count()
        if settings.num_devices > available:
            raise app.UsageError(
                f"--num_devices={settings.num_devices} but JAX sees only {available} devices"
            )
        return settings.num_devices or available
    return cp_launch.torch_world_size(settings.num_devices)


def _supported_anywhere(framework: str, impl: str, points: list[Point]) -> bool:
    """Whether an impl supports at least one point (first mask) of a grid."""
    cache: dict = {}
    for p in points:
        key = (p.mask, p.seqlen_total)
        try:
            if key not in cache:
                cache[key] = frameworks.make_masks(dataclasses.replace(p, num_masks=1))[0]
            if frameworks.supports(framework, impl, cache[key], p) is True:
                return True
        except Exception:
            continue
    return False


def _resolve_impls(framework: str, grid: Grid) -> tuple[str, ...]:
    """Concrete impl names of a grid for a framework: 'all' expanded, names it lacks dropped."""
    if grid.is_cp and grid.impls == (DEFAULT_IMPL,):
        return grid.impls
    try:
        known = frameworks.impl_names(framework)
    except ImportError:
        return grid.impls
    if ALL in grid.impls:
        return known
    keep = [i for i in grid.impls if i in known or i == DEFAULT_IMPL]
    if not grid.is_cp and DEFAULT_IMPL in keep:
        default = frameworks.default_impl(framework)
        keep = [default if i == DEFAULT_IMPL else i for i in keep]
    return tuple(dict.fromkeys(keep))


def _check_impl_names(settings: Settings, impls: Iterable[str]) -> None:
    """Reject impl names that no requested (importable) framework knows."""
    known: dict[str, tuple[str, ...]] = {}
    for fw in settings.frameworks:
        try:
            known[fw] = frameworks.impl_names(fw)
        except ImportError:
            return
    valid = sorted({n for names in known.values() for n in names})
    for impl in impls:
        if impl not in (ALL, DEFAULT_IMPL) and impl not in valid:
            raise app.UsageError(
                f"unknown impl {impl!r} for --framework={'/'.join(settings.frameworks)}; "
                f"valid impls: {', '.join(valid)}, all"
            )


def _grid_points(
    fw: str, grid: Grid, num_devices: int, settings: Settings, notes: list[str]
) -> list[Point]:
    """A grid's points for one framework; 'all' keeps the impls that support some point."""
    impls = _resolve_impls(fw, grid)
    points = expand(
        grid,
        fw,
        impls,
        seed=settings.seed,
        num_devices=num_devices,
        ulysses_size=settings.ulysses_size,
        ulysses_intra_node=settings.ulysses_intra_node,
        workload=settings.workload,
    )
    if ALL not in grid.impls or impls == grid.impls:
        return points
    keep = {i for i in impls if _supported_anywhere(fw, i, [p for p in points if p.impl == i])}
    dropped = sorted(set(impls) - keep)
    if dropped:
        notes.append(
            f"{fw} impls supporting no point of grid {grid.name!r} "
            f"(left out of 'all'): {', '.join(dropped)}"
        )
    return [p for p in points if p.impl in keep]


def plan(settings: Settings, cps: tuple[str, ...] | None, overrides: dict) -> Plan:
    """Expand preset + flags into the run's points (execute has checked the launch)."""
    detected = {fw: _detect_gpu(fw) for fw in settings.frameworks}
    on_gpu = {fw: d[0] for fw, d in detected.items()}
    preset = presets.get_preset(settings.preset, on_gpu=all(on_gpu.values()))
    grids = presets.apply_overrides(presets.select_grids(preset, cps), overrides)
    _check_impl_names(settings, [i for g in grids for i in g.impls])
    simulate = settings.simulate_devices or preset.simulate_devices
    _check_simulation(settings, bool(simulate))
    notes = []
    if simulate and any(g.is_cp for g in grids):
        notes.append(
            f"Simulating CP on {', '.join(map(str, simulate))} devices from this one device's "
            f"timed local work (link model {settings.link})."
        )
    if settings.preset in ("smoke", "cp_predict") and not all(on_gpu.values()):
        cpu = [fw for fw, g in on_gpu.items() if not g]
        where = (
            "simulated CP devices"
            if simulate
            else "JAX CP on virtual CPU devices, torch CP on gloo processes on 127.0.0.1"
        )
        notes.append(
            f"No GPU for {'/'.join(cpu)}: using the embedded CPU default ({settings.preset} "
            f"preset at CPU sizes; {where})."
        )
    if not all(on_gpu.values()):
        _check_cpu_sizes(settings, grids, notes)
    notes += [why for _, why in detected.values() if why]
    # One CP size for every framework, so --framework=both compares like with like.
    cp_size = 1
    if any(g.is_cp for g in grids) and not simulate:
        cp_size = min(_cp_devices(fw, settings) for fw in settings.frameworks)
    points: list[Point] = []
    for fw in settings.frameworks:
        for grid in grids:
            if grid.is_cp and simulate:
                points += _simulated_points(fw, grid, simulate, settings, notes)
                continue
            points += _grid_points(fw, grid, cp_size if grid.is_cp else 1, settings, notes)
    return Plan(dedupe(points), on_gpu, notes)


CPU_PRESETS = ("smoke", "cp_predict", "cross")  # presets with sizes of their own for a CPU
CPU_MAX_SEQLEN = 8192  # tokens per device past which a GPU preset on a CPU runs for hours


def _check_cpu_sizes(settings: Settings, grids: list[Grid], notes: list[str]) -> None:
    """A GPU-sized preset on a CPU: refused in one line (what to run instead) unless asked for
    with --allow_slow or only listed (--dry_run); smaller overrides of its sizes run."""
    if settings.preset in CPU_PRESETS:
        return
    longest = max((s for g in grids for s in g.seqlens), default=0)
    if longest <= CPU_MAX_SEQLEN:
        return
    if settings.allow_slow or settings.dry_run:
        notes.append(f"The {settings.preset} preset has GPU sizes; without a GPU it is very slow.")
        return
    raise app.UsageError(
        f"--preset={settings.preset} has GPU sizes (up to {longest} tokens per device): on this "
        f"CPU it would run for many hours; run the CPU default (no --preset), lower --seqlen to "
        f"at most {CPU_MAX_SEQLEN}, or pass --allow_slow"
    )


def _simulated_points(
    fw: str, grid: Grid, sizes: tuple[int, ...], settings: Settings, notes: list[str]
) -> list[Point]:
    """A CP grid's points at each simulated device count, marked simulated with the link: the
    grid's first --seqlen at every device count, then the next, so a run cut short by its time
    budget (and resumed later) has whole scaling curves first (8K tokens a GPU at 8-64 GPUs,
    the published study's setting, before 32K at any)."""
    own_notes: list[str] = []
    by_count = {
        n: [
            dataclasses.replace(p, simulated=True, link=settings.link)
            for p in _grid_points(fw, grid, n, settings, own_notes)
        ]
        for n in sizes
    }
    notes += [n for n in dict.fromkeys(own_notes) if n not in notes]
    return [p for s in grid.seqlens for n in sizes for p in by_count[n] if _grid_seqlen(p) == s]


def _grid_seqlen(p: Point) -> int:
    """The --seqlen value a CP point came from: tokens per device under weak scaling."""
    return p.seqlen_total // p.num_devices if p.scaling == "weak" else p.seqlen_total


def _check_simulation(settings: Settings, simulate: bool) -> None:
    """Simulated CP runs one framework's executor on this one device, and replaces
    --num_devices."""
    if not simulate:
        return
    if len(settings.frameworks) != 1:
        got = "/".join(settings.frameworks)
        raise app.UsageError(
            "--simulate_devices predicts one framework's executor at a time: use "
            f"--framework=jax or --framework=torch (got --framework={got})"
        )
    if _torch_launched(settings):
        raise app.UsageError(
            "--simulate_devices runs on one device: start it without torchrun/srun"
        )
    if settings.num_devices:
        raise app.UsageError(
            f"--num_devices={settings.num_devices} and --simulate_devices exclude each other"
        )


def _torch_launched(settings: Settings) -> bool:
    """Torch ranks started by torchrun/srun rather than by this driver."""
    return settings.frameworks == ("torch",) and cp_launch.launched_rank() is not None


def _is_writer(settings: Settings) -> bool:
    """Only one process records results: torch rank 0 / JAX process 0 / a plain run."""
    if _torch_launched(settings):
        return cp_launch.launched_rank() == 0
    jax = sys.modules.get("jax")
    return jax is None or jax.process_index() == 0


def _single_process() -> bool:
    """Whether this process runs its JAX points alone (no other JAX process shares their
    collectives): the only case where a device fault may stop its sweep (sweep.run_points)."""
    jax = sys.modules.get("jax")
    return jax is None or jax.process_count() == 1


def _lazy_runner(make, points: list[Point], store: ResultsStore | None = None):
    """A runner_for(point) that builds one runner on first use (imports happen then) and tells
    it the points it will be given (the CP predictor compiles a problem's programs at once) and,
    where a simulated point is among them, the records of `store` (a resumed CP prediction
    takes its single-device baselines from them instead of running them again)."""
    cache: list = []

    def runner_for(point: Point):
        if not cache:
            cache.append(make())
            simulated = store is not None and any(p.simulated for p in points)
            cache[0].expect(points, store.records() if simulated else ())
        return cache[0]

    return runner_for


def _jax_runner(settings: Settings):
    from experiments.runners.jax_runner import JaxRunner

    return JaxRunner(
        rtol_override=settings.check_rtol,
        sim_baseline_max_seqlen=settings.sim_baseline_max_seqlen,
        sim_timed_calls=settings.sim_timed_calls,
        sim_validation_share=settings.sim_validation_share,
        sim_compile_threads=settings.sim_compile_threads,
    )


def _torch_runner(settings: Settings):
    from experiments.runners.torch_runner import TorchRunner

    return TorchRunner(
        rtol_override=settings.check_rtol,
        sim_baseline_max_seqlen=settings.sim_baseline_max_seqlen,
        sim_timed_calls=settings.sim_timed_calls,
        sim_validation_share=settings.sim_validation_share,
        sim_compile_threads=settings.sim_compile_threads,
    )


def _todo(points: list[Point], store: ResultsStore, retry_errors: bool) -> list[Point]:
    """Points not yet recorded, as the writing process sees them (shared with other JAX
    processes, whose view of the results file may differ)."""
    done = store.done_keys(retry_errors=retry_errors)
    flags = np.array([p.key not in done for p in points], bool)
    jax = sys.modules.get("jax")
    if jax is not None and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = np.asarray(multihost_utils.broadcast_one_to_all(flags), bool)
    return [p for p, todo in zip(points, flags) if todo]


INSTALL = {
    "jax": ("JAX", "jax", 'pip install -e ".[jax-core]"'),
    "torch": ("PyTorch", "torch", 'pip install -e ".[torch]"'),
}


def _check_installed(names: Iterable[str]) -> None:
    """A requested framework that is not installed is a usage error naming the install command
    (found without importing it: a --framework=both parent imports neither)."""
    for fw in names:
        name, package, command = INSTALL[fw]
        if importlib.util.find_spec(package) is None:
            raise app.UsageError(
                f"--framework={fw} needs {name}, which is not installed in this Python; "
                f"install it with: {command}"
            )


def _check_launch(settings: Settings) -> None:
    """Reject missing frameworks and framework/launcher combinations that cannot work."""
    _check_installed(settings.frameworks)
    if cp_launch.under_torchrun() and "jax" in settings.frameworks:
        raise app.UsageError(
            "torchrun launches torch ranks; run JAX multi-host with "
            "--coordinator_address/--num_processes/--process_id or SLURM"
        )
    if cp_launch.slurm_multi_task() and len(settings.frameworks) > 1:
        raise app.UsageError("under a multi-task SLURM step run one --framework at a time")


def _run_torch(
    settings: Settings, points: list[Point], store: ResultsStore, progress, prov: dict, total: int
) -> None:
    """Torch kernel and simulated CP points in this process, CP points (all points under
    torchrun) on ranks."""
    launched = _torch_launched(settings)
    here = [p for p in points if not launched and (not p.is_cp or p.simulated)]
    on_ranks = [p for p in points if launched or (p.is_cp and not p.simulated)]
    if here:
        sweep.run_points(
            here,
            _lazy_runner(lambda: _torch_runner(settings), here, store),
            store=store,
            progress=progress,
            provenance=prov,
        )
    if not on_ranks:
        return
    try:
        cp_launch.run_torch_cp(
            on_ranks,
            world=cp_launch.torch_world_size(settings.num_devices),
            out_dir=settings.out_dir,
            provenance=prov,
            rtol=settings.check_rtol,
            offset=progress.done if progress is not None else 0,
            total=total,
        )
    except ImportError as e:
        _record_unavailable(on_ranks, e, store, progress, prov)


def _finish(settings: Settings, points: list[Point], store: ResultsStore) -> None:
    """Print the status counts of this run's points and write the report."""
    latest = latest_by_key(store.records())
    counts = collections.Counter(latest[p.key]["status"] for p in points if p.key in latest)
    print("Statuses: " + ", ".join(f"{s}={n}" for s, n in sorted(counts.items())), flush=True)
    if settings.report:
        _write_report(store.path, settings.out_dir)


def _write_report(results: Path, out_dir: str) -> None:
    """The report of a results file, its tables echoed to the terminal."""
    from experiments.reports import report

    paths = report.write_report(results, out_dir)
    print(_result_tables(Path(paths["markdown"]).read_text()), flush=True)
    print(f"Report: {paths['markdown']}", flush=True)


def _result_tables(markdown: str) -> str:
    """The report's result tables (its sections before the plots), for the terminal."""
    body = markdown.split("\n## Plots", 1)[0]
    start = body.find("\n## ")
    return body[start + 1 :] if start >= 0 else ""


def _record_unavailable(
    points: list[Point], exc: ImportError, store: ResultsStore, progress, prov: dict
) -> None:
    """Record points whose launcher cannot even be imported as unsupported."""

    def runner_for(point: Point):
        raise exc

    sweep.run_points(points, runner_for, store=store, progress=progress, provenance=prov)


def runs_in_workers(settings: Settings) -> bool:
    """Whether a run's frameworks go to worker processes: several, on a single host."""
    multi_host = settings.coordinator_address or (settings.num_processes or 1) > 1
    return len(settings.frameworks) > 1 and not settings.dry_run and not multi_host


def execute_in_workers(settings: Settings, flags: list[str], overrides: dict) -> int:
    """Run each framework's points in a worker process of its own, then the joint report; the
    output folder stays locked for the whole run."""
    _check_launch(settings)
    preset = presets.get_preset(settings.preset, on_gpu=False)
    _check_simulation(settings, bool(settings.simulate_devices or preset.simulate_devices))
    check_out_dir(settings.out_dir)
    impls = overrides.get("impls")
    if impls is not None:
        _check_impl_names(settings, impls)
    try:
        with locked_out_dir(settings.out_dir) as lock_fd:
            return _run_workers(settings, flags, impls, lock_fd)
    except OutDirBusy as e:
        return _stopped(e)


def _run_workers(
    settings: Settings, flags: list[str], impls: tuple[str, ...] | None, lock_fd: int
) -> int:
    """The workers' sweep under this run's lock, then the joint report (none after a failed
    write: the disk is full or read-only)."""
    results = ResultsStore(settings.out_dir).path
    check_lines(results)  # said once, here: the workers leave skipped lines to this process
    cp_size = workers.shared_cp_size(settings.frameworks, settings.num_devices)
    code = workers.run_each(settings.frameworks, flags, settings.out_dir, cp_size, impls, lock_fd)
    stopped = code in (workers.INTERRUPTED, AppendFailed.exit_code)
    if not stopped and settings.report and results.exists():
        _write_report(results, settings.out_dir)
    return code


def _stopped(error: OutDirBusy | AppendFailed) -> int:
    """One line on stderr for a run that cannot go on; its exit status."""
    print(error, file=sys.stderr, flush=True)
    return error.exit_code


def check_out_dir(out_dir: str) -> None:
    """Create the output folder and try a write in it; a UsageError names it if either fails."""
    problem = folder_problem(out_dir)
    if problem:
        raise app.UsageError(f"--out_dir={out_dir!r}: {problem}")


def execute(settings: Settings, cps: tuple[str, ...] | None, overrides: dict) -> int:
    """Run (or resume) a sweep and write its report; returns the process exit code. The
    writing process holds the output folder's lock for the whole run."""
    workers.start_as_worker()
    _check_launch(settings)
    if "jax" in settings.frameworks:
        try:
            cp_launch.init_jax_distributed(
                settings.coordinator_address, settings.num_processes, settings.process_id
            )
        except ImportError:
            pass
    run_plan = plan(settings, cps, overrides)
    writer = _is_writer(settings)
    say = print if writer else (lambda *a, **k: None)
    if settings.dry_run:
        _list_points(run_plan, say)
        return 0
    if writer:
        check_out_dir(settings.out_dir)
    lock = _writer_lock(settings.out_dir) if writer else contextlib.nullcontext()
    try:
        with lock:
            _sweep(settings, run_plan, writer, say)
    except (OutDirBusy, AppendFailed) as e:
        return _stopped(e)
    return 0


def _writer_lock(out_dir: str) -> contextlib.AbstractContextManager[int]:
    """The output folder's lock: this run's own, or its parent run's in a worker."""
    return locked_out_dir(out_dir, workers.inherited_lock_fd())


def _list_points(run_plan: Plan, say) -> None:
    """A dry run: the plan's notes, its point count per grid and every point key."""
    for note in run_plan.notes:
        say(note, flush=True)
    by_grid = collections.Counter((p.framework, p.grid) for p in run_plan.points)
    for (fw, grid), n in sorted(by_grid.items()):
        say(f"{fw} {grid}: {n} points")
    for p in run_plan.points:
        say(p.key)


def _sweep(settings: Settings, run_plan: Plan, writer: bool, say) -> None:
    """Run the plan's points not yet recorded, then (writer) the status counts and report."""
    for note in run_plan.notes:
        say(note, flush=True)
    store = ResultsStore(settings.out_dir)
    todo = _todo(run_plan.points, store, settings.retry_errors)
    total = len(run_plan.points)
    say(f"{total} points, {total - len(todo)} already in {store.path}, {len(todo)} to run.")
    prov = provenance.collect(settings.flag_values)
    progress = Progress(total, total - len(todo)) if writer else None
    jax_points = [p for p in todo if p.framework == "jax"]
    sweep.run_points(
        jax_points,
        _lazy_runner(lambda: _jax_runner(settings), jax_points, store),
        store=store if writer else None,
        progress=progress,
        provenance=prov,
        stop_on_fault=bool(jax_points) and _single_process(),
    )
    _run_torch(settings, [p for p in todo if p.framework == "torch"], store, progress, prov, total)
    if writer:
        _finish(settings, run_plan.points, store)
