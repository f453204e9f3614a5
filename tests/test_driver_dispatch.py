"""Measured JAX CP points (4 virtual CPU devices) time attention on inputs already dispatched
into the executor's layout: the dispatch is timed apart (dispatch_ms), the float64 check still
compares global-order results, and a wrong executor result still makes the point wrong."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cp_records import assert_checked_with_dispatch
from hlo_ops import collectives, op_counts, sharded_fwd_bwd_hlo
from jax.sharding import Mesh

from experiments import run
from experiments.core.points import Point
from experiments.core.results import read_records
from experiments.runners import frameworks, timing
from shard_strategies import jax_cp

FAST = {"xla_backend_optimization_level": 0}  # same collectives, compiled about twice as fast
N, S_PER_DEVICE, HQ, HKV, D = 4, 16, 4, 2, 16
ITERS = 2
POINT_FLAGS = [
    "--framework=jax",
    "--impl=reference",
    "--cp=ring",
    "--layout=zigzag",
    f"--num_devices={N}",
    "--mask=causal",
    f"--seqlen={S_PER_DEVICE}",
    f"--heads_q={HQ}",
    f"--heads_kv={HKV}",
    f"--head_dim={D}",
    "--dtype=fp32",
    "--warmup=0",
    f"--iters={ITERS}",
    "--report=false",
]
PER_CALL = ("collective-permute", "all-to-all")  # the strategy's own exchanges


def _run(out_dir, mode: str) -> dict:
    """The one record of the point in `mode`, run in process."""
    assert run.run_cli([*POINT_FLAGS, f"--mode={mode}", f"--out_dir={out_dir}"]) == 0
    (rec,) = read_records(out_dir / "results.jsonl")
    return rec


@pytest.fixture(scope="module")
def timed(tmp_path_factory) -> tuple[dict, list[tuple]]:
    """A fwd_bwd point's record and every (fn, args) the runner timed for it."""
    calls = []
    real = timing.jax_time_calls

    def record(fn, args, **kw):
        calls.append((fn, tuple(args)))
        return real(fn, args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing, "jax_time_calls", record)
        rec = _run(tmp_path_factory.mktemp("cp"), "fwd_bwd")
    return rec, calls


def test_point_checks_global_order_and_records_dispatch(timed):
    rec, calls = timed
    assert_checked_with_dispatch(rec, ITERS)
    assert len(calls) == 2  # the attention, then the dispatch of q, k, v


def test_timed_call_moves_only_what_the_strategy_needs(timed):
    """The timed program's point-to-point rounds and all-to-alls are one attention call's on
    dispatched arrays (no exchange into or out of the layout), and nothing moves a whole
    sequence."""
    rec, calls = timed
    fn, args = calls[0]
    fields = {f.name for f in dataclasses.fields(Point)}
    point = Point(**{k: v for k, v in rec["point"].items() if k in fields})
    (mask,) = frameworks.make_masks(point)
    mesh = Mesh(np.array(jax.devices()[:N]), ("cp",))  # the driver's mesh
    ex = jax_cp.build(
        mask, mesh=mesh, strategy="ring", layout="zigzag", impl="reference", num_heads_q=HQ,
        num_heads_kv=HKV, head_dim=D, dtype=jnp.float32,
    )  # fmt: skip
    seqlen = N * S_PER_DEVICE
    attention = op_counts(sharded_fwd_bwd_hlo(ex, (1, seqlen, HQ, D), (1, seqlen, HKV, D), FAST))
    hlo = fn.lower(*args).compile(FAST).as_text()
    assert attention["collective-permute"], attention
    assert {op: op_counts(hlo)[op] for op in PER_CALL} == {op: attention[op] for op in PER_CALL}
    for op, dims in collectives(hlo):
        assert max(dims, default=0) < seqlen, f"{op} of whole-sequence shape {dims}"


def test_wrong_executor_result_is_wrong_not_a_speed(tmp_path, monkeypatch):
    """Attention on dispatched arrays off by 1%: the point is 'wrong' and nothing is timed."""
    real = jax_cp.CPExecutor.sharded
    monkeypatch.setattr(jax_cp.CPExecutor, "sharded", lambda ex, *qkv: real(ex, *qkv) * 1.01)

    def never(*a, **k):
        raise AssertionError("no call of a wrong point is timed")

    monkeypatch.setattr(timing, "jax_time_calls", never)
    rec = _run(tmp_path, "fwd")
    assert rec["status"] == "wrong" and rec["metrics"] is None
    assert "out" in rec["reason"], rec["reason"]
