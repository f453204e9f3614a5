"""Process setup for context parallelism: JAX multi-controller init, the placement knob, and
PyTorch ranks (torchrun/SLURM environment, or gloo/NCCL processes spawned on 127.0.0.1)."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

from experiments.core import sweep
from experiments.core.outcomes import ERROR
from experiments.core.points import Point
from experiments.core.progress import Progress
from experiments.core.results import ResultsStore

CPU_TORCH_RANKS = 4
PG_TIMEOUT = timedelta(minutes=30)


# ------------------------------------------------------------------------------------ JAX


def slurm_multi_task() -> bool:
    """True inside a SLURM step with more than one task (jax.distributed auto-detects it)."""
    return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def init_jax_distributed(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> None:
    """Start JAX multi-controller mode when asked for (flags) or under multi-task SLURM."""
    import jax

    if coordinator_address or num_processes:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
    elif slurm_multi_task():
        jax.distributed.initialize()


# ---------------------------------------------------------------------------------- torch


def under_torchrun() -> bool:
    """True when launched by torchrun (or any launcher setting RANK/WORLD_SIZE/MASTER_ADDR)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def launched_rank() -> int | None:
    """This process's rank when an outside launcher (torchrun, multi-task srun) started the
    ranks, else None (the driver spawns torch ranks itself)."""
    if under_torchrun():
        return int(os.environ["RANK"])
    if slurm_multi_task():
        return int(os.environ.get("SLURM_PROCID", "0"))
    return None


def torch_world_size(num_devices: int) -> int:
    """CP ranks: the launcher's world size, else --num_devices, else all GPUs or 4 CPU ranks."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if slurm_multi_task():
        return int(os.environ["SLURM_NTASKS"])
    if num_devices:
        return num_devices
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else CPU_TORCH_RANKS


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with_parent(parent_pid: int) -> None:
    """A spawned rank ends itself when the driver dies (e.g. the sweep is killed)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def _spawned_device(rank: int, world: int):
    """(device, backend) of a rank the driver spawned on this host."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device()), "nccl"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return torch.device("cpu"), "gloo"


def _join_group(init_method: str | None, rank: int, world: int):
    """Join the default process group; returns this rank's device."""
    import torch.distributed as dist

    if init_method is None:
        from shard_strategies.torch_cp import init_distributed

        return init_distributed(timeout_s=PG_TIMEOUT.total_seconds())
    device, backend = _spawned_device(rank, world)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=PG_TIMEOUT
    )
    return device


def run_torch_ranks(
    points: list[Point],
    *,
    out_dir: str,
    provenance: dict,
    rtol: float | None,
    offset: int,
    total: int,
    init_method: str | None,
    rank: int,
    world: int,
) -> None:
    """Body of one rank: join the process group (from the launcher's environment when
    init_method is None), run every point (kernel points on rank 0 only, CP points
    collectively); rank 0 records and prints progress."""
    import torch.distributed as dist

    from experiments.runners.torch_runner import TorchRunner

    device = _join_group(init_method, rank, world)
    try:
        shared = [(points, offset)]
        dist.broadcast_object_list(shared, src=0)  # rank 0's view of what is left to run
        points, offset = shared[0]
        cp_runner = TorchRunner(device=device, group=dist.group.WORLD, rtol_override=rtol)
        kernel_runner = TorchRunner(device=device, rtol_override=rtol)
        writer = rank == 0
        sweep.run_points(
            [p for p in points if p.is_cp or writer],
            lambda p: cp_runner if p.is_cp else kernel_runner,
            store=ResultsStore(out_dir) if writer else None,
            progress=Progress(total, offset) if writer else None,
            provenance=provenance,
            stop_on_fault=False,  # ranks share collectives: all go on together (sweep.run_points)
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, parent_pid: int, port: int, world: int, kwargs: dict) -> None:
    _exit_with_parent(parent_pid)
    run_torch_ranks(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world=world, **kwargs)


def run_torch_cp(
    points: list[Point],
    *,
    world: int,
    out_dir: str,
    provenance: dict,
    rtol: float | None,
    offset: int,
    total: int,
) -> None:
    """Run torch points on `world` ranks: in place under torchrun/srun, else spawned locally.

    A spawned group that dies records the point it was on as an error and is restarted for
    the rest, so one crashing point cannot end the sweep.
    """
    kwargs = dict(out_dir=out_dir, provenance=provenance, rtol=rtol, total=total)
    rank = launched_rank()
    if rank is not None:
        run_torch_ranks(points, offset=offset, init_method=None, rank=rank, world=world, **kwargs)
        return
    import torch.multiprocessing as mp

    store = ResultsStore(out_dir)
    remaining = list(points)
    while remaining:
        done_before = store.done_keys()
        try:
            mp.spawn(
                _spawned_rank,
                args=(
                    os.getpid(),
                    _free_port(),
                    world,
                    dict(points=remaining, offset=offset, **kwargs),
                ),
                nprocs=world,
                join=True,
            )
            return
        except Exception as e:
            done = store.done_keys() - done_before
            offset += sum(p.key in done for p in remaining)
            remaining = [p for p in remaining if p.key not in done]
            if not remaining:
                return
            crashed = remaining.pop(0)
            record = sweep.make_record(
                crashed, ERROR, reason=f"CP ranks died: {e}"[:2000], provenance=provenance
            )
            store.append(record)
            offset += 1
            Progress(total, offset - 1).update(crashed.label(), record)
