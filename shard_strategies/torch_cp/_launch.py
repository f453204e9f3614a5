"""Start torch.distributed from torchrun's or SLURM's environment: NCCL on GPUs, gloo on CPU."""

from __future__ import annotations

import os
import subprocess
from collections.abc import MutableMapping
from datetime import timedelta

import torch
import torch.distributed as dist


def from_slurm(env: MutableMapping[str, str]) -> None:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from an `srun` task's variables
    (MASTER_ADDR: the step's first node, via `scontrol show hostnames`, unless already set)."""
    env.setdefault("RANK", env["SLURM_PROCID"])
    env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    env.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", nodes],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        env["MASTER_ADDR"] = hosts[0]


def init_distributed(timeout_s: float = 1800.0) -> torch.device:
    """init_process_group from torchrun (RANK, ...) or srun (SLURM_PROCID, ...) variables and
    return this process's device: cuda:LOCAL_RANK (modulo the visible GPUs, for launchers that
    give each task one GPU) with NCCL when CUDA is available, else the CPU with gloo. Joins no
    group twice: with an existing default group it only picks the device."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        from_slurm(env)
    local = int(env.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return device
