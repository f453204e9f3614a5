"""Dense impls at sizes whose score matrix cannot fit are recorded as predicted OOM, unrun."""

from __future__ import annotations

import os

import pytest

from experiments.core.outcomes import OOM, PointFailure
from experiments.core.points import Grid, expand
from experiments.runners import memory

GIB = 1 << 30


def _point(impl: str, framework: str, seqlen: int, mode: str, heads_q: int = 64):
    grid = Grid(
        name="cross",
        cps=("none",),
        layouts=("none",),
        impls=(impl,),
        masks=("causal",),
        seqlens=(seqlen,),
        heads=((heads_q, 8),),
        head_dim=128,
        dtype="bf16",
        modes=(mode,),
    )
    kw = dict(seed=0, num_devices=1, ulysses_size=None, ulysses_intra_node=True)
    return expand(grid, framework, grid.impls, **kw)[0]


def test_score_bound_counts_every_score_once_per_copy():
    p = _point("xla", "jax", 32 * 1024, "fwd")
    assert memory.score_bytes(p) == 64 * (32 * 1024) ** 2 * 2  # 128 GiB of bf16 scores
    assert memory.score_bytes(_point("xla", "jax", 32 * 1024, "fwd_bwd")) == 256 * GIB


DENSE = [("xla", "jax"), ("reference", "jax"), ("naive", "torch"), ("sdpa_math", "torch")]


@pytest.mark.parametrize("impl,framework", DENSE)
def test_dense_point_past_the_device_is_predicted_oom(impl, framework):
    p = _point(impl, framework, 32 * 1024, "fwd_bwd")
    with pytest.raises(PointFailure) as e:
        memory.require_fits(p, 139 * GIB)
    assert e.value.status == OOM and e.value.reason.startswith("predicted:")
    s, hq, hkv, d = 32 * 1024, 64, 8, 128
    arrays = 4 * 2 * (s * hq * d + s * hkv * d) + s * hq * 4  # q k v out + grads (bf16), LSE
    assert f"{(256 * GIB + arrays) / GIB:.1f} GiB" in e.value.reason
    assert "139.0 GiB" in e.value.reason and "scores" in e.value.reason


def test_points_that_may_fit_or_are_not_dense_still_run():
    memory.require_fits(_point("xla", "jax", 32 * 1024, "fwd"), 139 * GIB)  # 128 GiB: try it
    memory.require_fits(_point("pallas", "jax", 1 << 20, "fwd_bwd"), 139 * GIB)  # tiled kernel
    memory.require_fits(_point("xla", "jax", 1 << 20, "fwd_bwd"), None)  # capacity unknown


def test_tiled_point_whose_arrays_exceed_the_memory_is_predicted_oom():
    """A tiled kernel needs no scores, but its inputs and outputs must still fit."""
    p = _point("pallas", "jax", 4 << 20, "fwd")  # q, k, v, out: 4M x (64 + 8) x 128 x 2 x 2 B
    with pytest.raises(PointFailure) as e:
        memory.require_fits(p, 100 * GIB)
    assert e.value.status == OOM and "q, k, v and out need" in e.value.reason
    assert "--seqlen" in e.value.reason and "gradients" not in e.value.reason
    memory.require_fits(p, 200 * GIB)


def test_cp_devices_on_one_host_share_its_memory():
    """On a CPU every virtual device of a CP point takes from the same host memory."""
    grid = Grid(
        name="cp",
        cps=("ring",),
        layouts=("zigzag",),
        impls=("pallas",),
        masks=("causal",),
        seqlens=(1 << 20,),
        heads=((8, 2),),
        head_dim=64,
        dtype="fp32",
        modes=("fwd_bwd",),
    )
    kw = dict(seed=0, num_devices=8, ulysses_size=None, ulysses_intra_node=True)
    p = expand(grid, "jax", grid.impls, **kw)[0]
    one_device = memory.need_bytes(p)
    memory.require_fits(p, 2 * one_device)  # a GPU's own memory: one device's share
    with pytest.raises(PointFailure, match="on each of 8 devices"):
        memory.require_fits(p, 2 * one_device, host=True)
    memory.require_fits(p, 8 * one_device, host=True)


def test_host_memory_is_known_on_linux():
    available = memory.host_available_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf(
        "SC_PAGE_SIZE"
    )


def test_driver_records_a_point_too_large_for_the_host_without_running_it(tmp_path):
    """On a CPU the host's memory is the limit: the point is recorded as predicted oom, at once
    (no allocation of the 160 TB it would need), and the run ends normally."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    run = Path(__file__).resolve().parents[1] / "experiments" / "run.py"
    flags = "--seqlen=10M --batch=64 --heads_q=64 --heads_kv=64 --head_dim=256 --impl=pallas"
    cmd = [sys.executable, str(run), *flags.split(), "--mask=causal", "--cp=none", "--mode=fwd"]
    done = subprocess.run(
        [*cmd, f"--out_dir={tmp_path}", "--noreport"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert record["status"] == "oom" and record["reason"].startswith("predicted:")
    assert "host's available" in record["reason"] and "--seqlen" in record["reason"]
