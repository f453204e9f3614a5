"""One rank of tests/test_torch_driver_dispatch.py: measured torch CP points run by the driver's
TorchRunner on a gloo group, one JSON line per point into CP_TEST_OUT/rank<r>.jsonl.

Launched as plain processes with torchrun's variables (never imports jax). For each point the
line holds its record and, per timed function, the bytes one call of it sent (torch_cp's
counters); the last point runs with the executor's sharded attention off by 1% and must be wrong
untimed.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from unittest import mock

import torch.distributed as dist
from gloo_ranks import leave_group

from experiments.core import sweep
from experiments.core.points import Grid, Point, expand
from experiments.runners import timing
from experiments.runners.torch_runner import TorchRunner
from shard_strategies import torch_cp

WORLD = 2
TOKENS_PER_RANK = 128
ITERS = 2


def point(cp: str, mode: str) -> Point:
    """A small measured torch CP point: causal, GQA 2:1, fp32, zigzag."""
    grid = Grid(
        "test", (cp,), ("zigzag",), ("default",), ("causal",), (TOKENS_PER_RANK,), ((2, 1),), 16,
        "fp32", (mode,), warmup=0, iters=ITERS,
    )  # fmt: skip
    kw = dict(seed=0, num_devices=WORLD, ulysses_size=None, ulysses_intra_node=True)
    (p,) = expand(grid, "torch", ("default",), **kw)
    return p


def counting(sent: list[dict]) -> Callable:
    """timing.torch_time_calls that first runs one call of fn alone and keeps what it sent."""
    real = timing.torch_time_calls

    def timed(fn, **kw):
        torch_cp.reset_sent_bytes()
        fn()
        sent.append(torch_cp.sent_bytes())
        return real(fn, **kw)

    return timed


def untimed(*args, **kwargs):
    raise AssertionError("no call of a wrong point is timed")


def main() -> None:
    device = torch_cp.init_distributed(timeout_s=120)
    rank = dist.get_rank()
    runner = TorchRunner(device=device, group=dist.group.WORLD)
    lines = []
    for cp in ("ring", "allgather"):
        sent: list[dict] = []
        with mock.patch.object(timing, "torch_time_calls", counting(sent)):
            rec = sweep.run_one(point(cp, "fwd_bwd"), lambda p: runner, {})
        lines.append({"case": cp, "rank": rank, "record": rec, "sent": sent})
    real = torch_cp.CPExecutor.sharded
    off = lambda *a, **k: real(*a, **k) * 1.01  # noqa: E731
    with (
        mock.patch.object(torch_cp.CPExecutor, "sharded", off),
        mock.patch.object(timing, "torch_time_calls", untimed),
    ):
        rec = sweep.run_one(point("ring", "fwd"), lambda p: runner, {})
    lines.append({"case": "wrong", "rank": rank, "record": rec})
    lines.append({"done": True, "rank": rank, "jax": "jax" in sys.modules})
    with open(os.path.join(os.environ["CP_TEST_OUT"], f"rank{rank}.jsonl"), "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    leave_group()


if __name__ == "__main__":
    main()
