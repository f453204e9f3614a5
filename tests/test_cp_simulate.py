"""Simulated context parallelism: the schedule's bytes against the plan, the link model and the
lock-step overlap accounting (numpy), the JAX runner on one CPU device, and the driver flags."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cp_cases import named_mask, random_slices_mask
from tile_lists import list_spans

import shard_strategies as ss
from attn_masks import from_slices
from shard_strategies import simulate as sim
from shard_strategies.exchange import plan_exchanges

ROOT = Path(__file__).resolve().parent.parent
HQ, HKV, D = 4, 2, 16
CONFIGS = [  # (strategy, world size, ulysses size)
    ("ring", 4, None),
    ("allgather", 4, None),
    ("ulysses", 4, None),
    ("usp", 8, 2),
    ("double_ring", 8, None),
    ("double_ring", 8, 2),
]


def _plan(mask, n, strategy, layout="zigzag", u=None, **kw):
    return ss.make_plan(
        mask, n, strategy, layout, u, num_heads_q=HQ, num_heads_kv=HKV, head_dim=D, **kw
    )


def _far_keys_mask(seqlen: int, shards: int):
    """Contiguous shard r sees only shard r+1 (the last nothing): step 0 (own block) is empty on
    every rank and dropped, so the first kept block arrives by a transfer."""
    chunk = seqlen // shards
    q = [[r * chunk, (r + 1) * chunk] for r in range(shards - 1)]
    k = [[(r + 1) * chunk, (r + 2) * chunk] for r in range(shards - 1)]
    return from_slices(q, k, [0] * len(q), seqlen, seqlen)


@pytest.mark.parametrize("strategy, n, u", CONFIGS)
@pytest.mark.parametrize("layout", ss.LAYOUTS)
@pytest.mark.parametrize("mask_name", ["causal", "causal_document", "far_keys"])
def test_schedule_moves_the_plans_bytes(strategy, n, u, layout, mask_name):
    """Per-rank bytes of the strategy's transfers equal plan.comm_volume (counted there from the
    transfer chains); the length splits over the ranks, so dispatch bytes are the exchange's
    rounds for q/k/v/out and their gradients, at least what the busiest rank must receive."""
    seqlen = 16 * n
    mask = _far_keys_mask(seqlen, n) if mask_name == "far_keys" else named_mask(mask_name, seqlen)
    plan = _plan(mask, n, strategy, layout, u)
    vol = plan.comm_volume(itemsize=2, batch=3)
    sched = sim.schedule(plan, "fwd_bwd", itemsize=2, batch=3)
    assert sched.bytes_sent("fwd") == pytest.approx(vol["fwd_bytes"])
    assert sched.bytes_sent("bwd") == pytest.approx(vol["bwd_bytes"])
    into, back = (sum(e.sizes) for e in plan_exchanges(plan))
    per_token_q, per_token_kv = 3 * HQ * D * 2, 3 * HKV * D * 2
    want = (per_token_q + 2 * per_token_kv) * into + per_token_q * back
    assert sched.bytes_sent("fwd", sim.DISPATCH) == pytest.approx(want)
    assert sched.bytes_sent("bwd", sim.DISPATCH) == pytest.approx(want)
    owner = np.arange(seqlen) // (seqlen // n)  # the contiguous split
    real = plan.positions < seqlen
    incoming = [int((owner[p[r]] != g).sum()) for g, (p, r) in enumerate(zip(plan.positions, real))]
    assert max(incoming) <= into <= (n - 1) * plan.local_len
    assert max(incoming) <= back


def test_far_keys_mask_starts_with_a_transfer():
    """Only the step holding the next rank's block is kept; its block arrives before it runs."""
    plan = _plan(_far_keys_mask(64, 4), 4, "ring", "contiguous")
    assert [(s.outer, s.inner) for s in plan.steps] == [(0, 3)]
    sched = sim.schedule(plan, "fwd", dispatch=False)
    (phase,) = sched.phases
    assert [kind for kind, _ in phase.before] == [sim.SERIAL]
    pred = sim.predict(sched, np.zeros((1, 4)), sim.LinkModel(p2p_gbps=1.0, latency_us=0.0))
    assert pred.total_ms == pytest.approx(_block_bytes(plan) / 1e6)


@pytest.mark.parametrize("strategy, n, u", CONFIGS)
@pytest.mark.parametrize("mode", sim.MODES)
def test_ideal_link_step_time_is_the_slowest_ranks_compute(strategy, n, u, mode):
    plan = _plan(named_mask("causal_document", 16 * n), n, strategy, "balanced", u)
    sched = sim.schedule(plan, mode)
    compute = np.random.default_rng(n).random((len(sched.phases), n))
    pred = sim.predict(sched, compute, sim.LinkModel.ideal())
    assert np.allclose(pred.phase_ms, compute.max(axis=1))
    assert np.allclose(pred.exposed_ms, 0.0)
    assert pred.total_ms == pytest.approx(compute.max(axis=1).sum())
    per_rank = compute.sum(axis=0)
    assert pred.load_imbalance == pytest.approx(per_rank.max() / per_rank.mean())


def _block_bytes(plan, itemsize=2) -> float:
    """K and V of one ring shard, counted by hand."""
    return 2 * plan.shard_len * HKV * D * itemsize


def test_ring_transfer_hides_behind_the_previous_steps_compute():
    """Ring on one node: step t+1's block is posted before step t computes, so step t+1 waits
    max(0, transfer - slowest compute of step t); a lock step sums max(compute, transfer)."""
    n = 4
    plan = _plan(named_mask("full", 64 * n), n, "ring")
    link = sim.LinkModel(p2p_gbps=1.0, latency_us=7.0)
    transfer = 7e-3 + _block_bytes(plan) / 1e6  # ms: latency + bytes / (1 GB/s)
    sched = sim.schedule(plan, "fwd", dispatch=False)
    steps = plan.num_steps
    compute = np.random.default_rng(0).uniform(0.5, 1.5, (steps, n)) * transfer
    pred = sim.predict(sched, compute, link)
    slowest = compute.max(axis=1)
    assert np.allclose(pred.exposed_ms[0], 0.0)
    for t in range(1, steps):
        assert np.allclose(pred.exposed_ms[t], max(0.0, transfer - slowest[t - 1]))
    expected = sum(max(c, transfer) for c in slowest[:-1]) + slowest[-1]
    assert pred.total_ms == pytest.approx(expected)


def test_backward_dkv_waits_for_its_accumulator():
    """Backward: dK/dV posted after step t computes must arrive before step t+1 ends."""
    n = 2
    plan = _plan(named_mask("full", 32 * n), n, "ring")
    link = sim.LinkModel(p2p_gbps=math.inf, latency_us=5.0)  # every message 5 us
    sched = sim.schedule(plan, "bwd", dispatch=False)
    compute = np.full((len(sched.phases), n), 1e-3)
    pred = sim.predict(sched, compute, link)
    # step 0: nothing to wait for; step 1: its K/V block, posted at 0, arrives at 5 us (4 us
    # wait); the dK/dV posted when step 0 ended (1 us) arrives at 6 us, just as step 1's compute
    # ends; then the accumulator goes home (serial, 5 us)
    assert np.allclose(pred.exposed_ms[0], 0.0)
    assert np.allclose(pred.exposed_ms[1], 4e-3 + 5e-3)
    assert pred.total_ms == pytest.approx(1e-3 + 4e-3 + 1e-3 + 5e-3)


def test_double_ring_outer_transfer_hides_behind_the_inner_ring():
    """Two windows of two ranks, one node each: the inter-node block of the second window pass
    is posted when the first starts and waited for only when the second starts."""
    plan = _plan(named_mask("full", 128), 4, "double_ring", num_windows=2)
    assert [(s.outer, s.inner) for s in plan.steps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    link = sim.LinkModel(
        p2p_gbps=math.inf, latency_us=0.0, inter_node_gbps=1.0, inter_latency_us=0, gpus_per_node=2
    )
    outer = _block_bytes(plan) / 1e6
    sched = sim.schedule(plan, "fwd", dispatch=False)
    compute = np.random.default_rng(1).uniform(0.1, 0.4, (4, 4)) * outer
    pred = sim.predict(sched, compute, link)
    slowest = compute.max(axis=1)
    expected = [0.0, 0.0, max(0.0, outer - slowest[0] - slowest[1]), 0.0]
    assert np.allclose(pred.exposed_ms.max(axis=1), expected)
    assert expected[2] > 0


def test_ulysses_all_to_alls_are_not_overlapped():
    n = 4
    plan = _plan(named_mask("causal", 32 * n), n, "ulysses")
    link = sim.LinkModel(alltoall_gbps=2.0, latency_us=3.0)
    sched = sim.schedule(plan, "fwd", dispatch=False)
    local = 32  # tokens each rank holds
    sent = {h: (n - 1) / n * local * h * D * 2 for h in (HQ, max(HKV, n))}
    a2a = {h: 3e-3 + b / 2e6 for h, b in sent.items()}  # latency + bytes / (2 GB/s), ms
    compute = np.zeros((len(sched.phases), n))
    attention = [i for i, ph in enumerate(sched.phases) if ph.call][0]
    compute[attention] = [1.0, 2.0, 3.0, 4.0]
    pred = sim.predict(sched, compute, link)
    serial = 2 * a2a[HQ] + 2 * a2a[max(HKV, n)]  # q, k, v in; out back
    assert pred.total_ms == pytest.approx(serial + 4.0)


def test_link_model_node_boundaries_and_spec():
    link = sim.LinkModel(gpus_per_node=8)
    intra, inter = link.p2p_ms(1e9, 0, 7), link.p2p_ms(1e9, 7, 8)
    assert intra == pytest.approx(1e-2 + 1e3 / 275.0)
    assert inter == pytest.approx(2e-2 + 1e3 / 50.0)
    # a 16-rank ring: ranks 0 and 8 receive over the NIC, the others over NVLink
    plan = _plan(named_mask("full", 256), 16, "ring")
    x = sim.transfer_ms(sim.schedule(plan, "fwd", dispatch=False), link)[0]
    slow = np.flatnonzero(x > x.min())
    assert slow.tolist() == [0, 8]
    assert sim.LinkModel.from_spec(link.spec()) == link
    assert sim.LinkModel.from_spec(sim.LinkModel.ideal(4).spec()) == sim.LinkModel.ideal(4)
    for bad in ({"p2p_gbps": 0.0}, {"latency_us": -1.0}, {"gpus_per_node": 0}):
        with pytest.raises(ValueError):
            sim.LinkModel(**bad)


# ------------------------------------------------------------------------------- JAX runner


def _point(
    strategy, n, mode, link, mask="causal_document", layout="zigzag", seqlen=16, framework="jax"
):
    from experiments.core.points import Grid, expand

    grid = Grid(
        name="t",
        cps=(strategy,),
        layouts=(layout,),
        impls=("default",),
        masks=(mask,),
        seqlens=(seqlen,),
        heads=((HQ, HKV),),
        head_dim=D,
        dtype="fp32",
        modes=(mode,),
        warmup=0,
        iters=2,
    )
    (p,) = expand(
        grid,
        framework,
        ("default",),
        seed=0,
        num_devices=n,
        ulysses_size=None,
        ulysses_intra_node=True,
    )
    return dataclasses.replace(p, simulated=True, link=link.spec())


def _no_first_run_timing(monkeypatch) -> None:
    """Every timed call through the (faked) timing loop: a warm call's real first run, slow on
    a loaded host, would otherwise stand for its time."""
    from experiments.runners import timing

    monkeypatch.setattr(timing, "SAMPLE_RUN_MS", math.inf)


def _parts_add_up(runner, monkeypatch) -> None:
    """Every distinct call timed once (constant fake times), every (rank, step) charged: with an
    ideal link the predicted time is steps x that time; the ranks' merged results passed the
    float64 check of the whole problem."""
    from experiments.runners import cp_simulate

    calls = []

    def fake(fn, args, *, warmup, iters, **timing_kw):
        calls.append(iters)
        return [2.0] * iters

    monkeypatch.setattr(cp_simulate.timing, "jax_time_calls", fake)
    _no_first_run_timing(monkeypatch)
    n = 4
    result = runner.run(_point("ring", n, "fwd_bwd", sim.LinkModel.ideal()))
    (mask,) = result["masks"]
    s, plan = mask["simulation"], mask["plan"]
    steps = plan["num_steps"]
    assert result["check"]["ok"] and result["check"]["kind"] == "full"
    assert set(result["check"]["max_errors"]) == {"out", "dq", "dk", "dv"}
    assert s["check_ranks"] == list(range(n))
    assert s["calls"]["total"] == 2 * steps * n
    assert 1 <= s["calls"]["distinct"] == s["calls"]["timed"]
    # short calls: `iters` samples of each distinct call and of the baseline
    assert sum(calls) == (s["calls"]["distinct"] + 1) * 2
    assert s["calls"]["distinct"] <= 2 * steps * n
    assert s["compute_ms"] == pytest.approx(2.0 * 2 * steps * n)
    assert result["metrics"]["time_ms"]["median"] == pytest.approx(2.0 * 2 * steps)
    assert s["time_ms"]["exposed_comm"] == pytest.approx(0.0, abs=1e-9)
    phases = s["phases"]
    assert sum(sum(p["compute_ms"]) for p in phases) == pytest.approx(s["compute_ms"])
    assert s["bytes"]["strategy_fwd"] == pytest.approx(mask["comm"]["fwd_bytes"])
    assert s["bytes"]["strategy_bwd"] == pytest.approx(mask["comm"]["bwd_bytes"])
    assert s["single_device"]["status"] == "ok"
    flops = mask["flops"]
    assert result["metrics"]["tflops"]["median"] == pytest.approx(
        flops / n / (2.0 * 2 * steps * 1e-3) / 1e12
    )


def _real_timing(runner) -> None:
    """Real timings: the record's per-step, per-rank parts sum to its compute and its phase
    times to its predicted time; a point of the same calls reuses their timings; Ulysses with
    heads that do not split is unsupported."""
    from experiments.core.outcomes import PointFailure

    for strategy in ("allgather", "usp"):
        result = runner.run(_point(strategy, 4, "fwd", sim.LinkModel()))
        s = result["masks"][0]["simulation"]
        assert result["check"]["ok"]
        assert sum(sum(p["compute_ms"]) for p in s["phases"]) == pytest.approx(
            s["compute_ms"], rel=1e-3
        )
        assert sum(p["ms"] for p in s["phases"]) == pytest.approx(s["time_ms"]["total"], rel=1e-3)
        t = s["time_ms"]
        assert t["dispatch"] > 0 and t["exposed_comm"] > 0 and s["efficiency_pct"] > 0
        assert t["slowest_compute"] + t["exposed_comm"] == pytest.approx(t["strategy"])
        assert t["strategy"] + t["dispatch"] == pytest.approx(t["total"])
        assert s["calls"]["timed"] == s["calls"]["distinct"] > 0
    again = runner.run(_point("usp", 4, "fwd", sim.LinkModel(p2p_gbps=1.0)))
    calls = again["masks"][0]["simulation"]["calls"]
    assert calls["timed"] == 0 and calls["distinct"] == s["calls"]["distinct"]
    with pytest.raises(PointFailure) as e:
        runner.run(_point("ulysses", 8, "fwd", sim.LinkModel()))
    assert e.value.status == "unsupported" and "divisible by 8" in e.value.reason


def _record_draws(monkeypatch, ranks_type) -> list[tuple[str, int, bool]]:
    """(input, tokens of the sequence, inside a timed call) of every draw of real inputs the
    ranks make."""
    draws, timing_now = [], []
    real_rows, real_time = ranks_type.device_rows, ranks_type.time

    def device_rows(self, name, positions=None, heads=None):
        seqlen = self._shapes[name][1]  # positions past it are padding (Ranks.host)
        tokens = seqlen if positions is None else int((np.asarray(positions) < seqlen).sum())
        draws.append((name, tokens, bool(timing_now)))
        return real_rows(self, name, positions, heads)

    def time(self, *args, **kw):
        timing_now.append(1)
        try:
            return real_time(self, *args, **kw)
        finally:
            timing_now.pop()

    monkeypatch.setattr(ranks_type, "device_rows", device_rows)
    monkeypatch.setattr(ranks_type, "time", time)
    return draws


def _assert_rank_sized(draws, seqlen: int, shards: int) -> None:
    """q and dout (all query heads) drawn a shard at a time, nothing drawn for timed calls."""
    assert draws and not any(timed for _, _, timed in draws)
    assert max(n for name, n, _ in draws if name in ("q", "dout")) <= seqlen // shards


def _row_check(runner, monkeypatch) -> None:
    """Above the whole-check size, the first rank and the busiest ring rank are checked at rows;
    no rank draws more than its own queries, the timed calls draw nothing."""
    from experiments.runners import checks
    from experiments.runners.cp_ranks_jax import JaxRanks

    monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 1)
    draws = _record_draws(monkeypatch, JaxRanks)
    point = _point("ring", 4, "fwd_bwd", sim.LinkModel(), mask="causal", layout="contiguous")
    result = runner.run(point)
    check = result["check"]
    assert check["ok"] and check["kind"] == "rows" and check["unchecked"] == ["dk", "dv"]
    assert result["masks"][0]["simulation"]["check_ranks"] == [0, 3]
    _assert_rank_sized(draws, point.seqlen_total, 4)


def test_row_check_draws_the_keys_once_for_both_ranks(monkeypatch):
    """The two ranks a row check compares (first and busiest, one Ulysses position) share one
    float64 reference: the keys their rows see are drawn once, not once per rank; a wrong
    output on one of them fails the check naming that rank alone, with the error of its own
    rows (as checked alone)."""
    from experiments.runners import checks, cp_ranks, frameworks
    from experiments.runners.cp_rank_checks import _rank_check, check_ranks
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner
    from shard_strategies import jax_cp

    monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 1)
    point = _point("ring", 4, "fwd_bwd", sim.LinkModel(), mask="causal", layout="contiguous")
    mask = named_mask("causal", point.seqlen_total)
    dtype, settings = frameworks.framework_dtype("jax", "fp32"), cp_ranks.plan_settings(point)
    plan = jax_cp.executor_plan(mask, impl="reference", dtype=dtype, **settings)
    ranks = JaxRanks(plan, "reference", point, 0, JaxRunner())
    references = []
    real_reference = JaxRanks.reference_rows
    monkeypatch.setattr(
        JaxRanks,
        "reference_rows",
        lambda self, m, rows_of, *a: (
            references.append(rows_of) or real_reference(self, m, rows_of, *a)
        ),
    )
    check, checked = check_ranks(ranks, point, mask, 0, rtol=1e-4)
    assert check.ok and checked == [0, 3], check.message
    assert len(references) == 1  # both ranks' rows in one reference
    shard = len(plan.layout.positions[0])
    first, last = references[0]
    assert (first < shard).all() and (last >= 3 * shard).all()
    real_emulate = JaxRanks.emulate

    def wrong_last(self, r, u, rows=None):
        res = real_emulate(self, r, u, rows)
        if r == plan.ring_size - 1:
            res["out"] = res["out"] * 1.5
        return res

    monkeypatch.setattr(JaxRanks, "emulate", wrong_last)
    last = plan.ring_size - 1
    alone = _rank_check(ranks, mask, last, 0, grads=True, rtol=1e-4, seed=point.seed)
    # a tolerance the wrong rank misses alone but would meet averaged with the right one's rows
    bad, _ = check_ranks(ranks, point, mask, 0, rtol=0.9 * alone.errors["out"])
    assert not bad.ok and bad.message.startswith("rank 3:") and "rank 0" not in bad.message
    assert bad.errors["out"] == pytest.approx(alone.errors["out"], rel=1e-9)


def test_row_check_reference_runs_beside_the_ranks_emulation(monkeypatch):
    """check_ranks computes the float64 reference of the rows it compares while the ranks are
    emulated (neither needs the other): an emulation that waits for the reference to have
    begun goes on, and the check still passes; both end before check_ranks returns. The x64
    mode the JAX reference enters stays in its thread (else the emulation would trace in
    float64 beside it)."""
    import threading

    import jax

    from experiments.runners import checks
    from experiments.runners.cp_rank_checks import check_ranks
    from experiments.runners.cp_ranks_jax import JaxRanks

    monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 1)
    point = _point("ring", 4, "fwd_bwd", sim.LinkModel(), mask="causal", layout="contiguous")
    mask = named_mask("causal", point.seqlen_total)
    ranks = _jax_ranks(point, mask)
    began, ended, waited = threading.Event(), threading.Event(), []
    real_reference, real_emulate = JaxRanks.reference_rows, JaxRanks.emulate

    def reference(self, *args):
        began.set()
        out = real_reference(self, *args)
        ended.set()
        return out

    def emulate(self, r, u, rows=None):
        waited.append(began.wait(timeout=30))
        return real_emulate(self, r, u, rows)

    monkeypatch.setattr(JaxRanks, "reference_rows", reference)
    monkeypatch.setattr(JaxRanks, "emulate", emulate)
    check, checked = check_ranks(ranks, point, mask, 0, rtol=1e-4)
    assert check.ok and checked == [0, 3], check.message
    assert waited == [True, True] and ended.is_set()
    # the JAX reference computes under jax.enable_x64, which must stay in its own thread
    inside, release = threading.Event(), threading.Event()

    def hold_x64():
        with jax.enable_x64(True):
            inside.set()
            release.wait(timeout=30)

    holder = threading.Thread(target=hold_x64)
    holder.start()
    assert inside.wait(timeout=30)
    try:
        assert jax.numpy.asarray(1.0).dtype == jax.numpy.float32
    finally:
        release.set()
        holder.join()


def _jax_ranks(point, mask):
    from experiments.runners import cp_ranks, frameworks
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner
    from shard_strategies import jax_cp

    dtype, settings = frameworks.framework_dtype("jax", "fp32"), cp_ranks.plan_settings(point)
    plan = jax_cp.executor_plan(mask, impl="reference", dtype=dtype, **settings)
    return JaxRanks(plan, "reference", point, 0, JaxRunner())


@pytest.mark.parametrize(
    "strategy,mask_name,mode",
    [
        ("ring", "causal_document", "fwd_bwd"),
        ("usp", "share_question", "fwd_bwd"),
        ("ring", "causal", "fwd"),
    ],
)
@pytest.mark.parametrize("chunk", [None, 24])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_device_reference_is_the_host_reference(
    strategy, mask_name, mode, chunk, platform, monkeypatch
):
    """The JAX ranks' float64 row reference, computed on the device from its own draws (rows
    and intervals padded, keys in chunks of REFERENCE_CHUNK, here also 24 so that several
    chunks and a padded last one carry the online softmax; as on a GPU, one whole chunk of
    mostly padding), gives the host reference's values (Ranks.reference_rows) for rows of two
    ranks, in a spread of one Ulysses position's heads."""
    from experiments.runners import device_reference
    from experiments.runners.cp_ranks import Ranks

    if chunk is not None:
        monkeypatch.setattr(device_reference, "REFERENCE_CHUNK", chunk)
    chunk_of = device_reference.reference_chunk
    monkeypatch.setattr(
        device_reference, "reference_chunk", lambda keys, _: chunk_of(keys, platform)
    )
    point = _point(strategy, 4, mode, sim.LinkModel(), mask=mask_name, layout="zigzag", seqlen=96)
    mask = named_mask(mask_name, point.seqlen_total)
    ranks = _jax_ranks(point, mask)
    rng = np.random.default_rng(5)
    shard = ranks.plan.layout.positions
    rows_of = [np.sort(rng.choice(p[p < mask.seqlen_q], 5, replace=False)) for p in shard[[0, -1]]]
    u = ranks.plan.ulysses_size - 1
    heads = np.array([0, len(ranks.q_heads[u]) - 1])
    grads = mode != "fwd"
    got = ranks.reference_rows(mask, rows_of, u, heads, grads, 0.3)
    want = Ranks.reference_rows(ranks, mask, rows_of, u, heads, grads, 0.3)
    assert sorted(got) == sorted(want) == (["dq", "out"] if grads else ["out"])
    for name in want:
        assert got[name].shape == want[name].shape == (1, 10, 2, D)
        assert np.abs(want[name]).min() > 0  # every row sees keys: no value left unwritten
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12)


def test_device_reference_compiles_once_for_any_number_of_keys(monkeypatch):
    """Row sets that see different numbers of keys (more than a chunk) run the device
    reference's two passes without compiling them again: one program per rows and heads,
    whatever the keys."""
    from experiments.runners import device_reference

    monkeypatch.setattr(device_reference, "REFERENCE_CHUNK", 32)
    point = _point("ring", 4, "fwd_bwd", sim.LinkModel(), mask="causal", layout="contiguous")
    mask = named_mask("causal", point.seqlen_total)
    ranks = _jax_ranks(point, mask)
    passes = device_reference._passes()
    heads = np.array([0, 1])
    sizes = []
    for last in (40, 55, 63):  # causal rows: the last row sees last + 1 keys
        rows = np.arange(last - 5, last + 1)
        ranks.reference_rows(mask, [rows], 0, heads, True, 0.3)
        sizes.append((passes["out"]._cache_size(), passes["dq"]._cache_size()))
    assert sizes[0] == sizes[1] == sizes[2], sizes


def test_device_reference_on_a_gpu_compiles_once_for_any_keys_and_heads(monkeypatch):
    """On a GPU every pass of the row reference takes one whole chunk and every K/V head, so
    rows seeing fewer keys than a chunk and checks of heads reading one or two K/V heads share
    one program per pass; elsewhere the chunk follows the keys."""
    import jax

    from experiments.runners import device_reference

    chunk_of = device_reference.reference_chunk
    assert chunk_of(10, "gpu") == chunk_of(10**7, "gpu") == device_reference.REFERENCE_CHUNK
    assert (chunk_of(100, "cpu"), chunk_of(129, "cpu")) == (128, 256)
    assert chunk_of(10**7, "cpu") == device_reference.REFERENCE_CHUNK
    monkeypatch.setattr(device_reference, "REFERENCE_CHUNK", 64)
    platforms = []  # the device platform each reference passes

    def as_on_a_gpu(keys, platform):
        platforms.append(platform)
        return chunk_of(keys, "gpu")

    monkeypatch.setattr(device_reference, "reference_chunk", as_on_a_gpu)
    point = _point("ring", 4, "fwd_bwd", sim.LinkModel(), mask="causal", layout="contiguous")
    mask = named_mask("causal", point.seqlen_total)
    ranks = _jax_ranks(point, mask)
    passes = device_reference._passes()
    sizes = []
    for last, heads in ((9, [0, 1]), (20, [0, 3]), (40, [2, 3])):  # 1-2 K/V heads, 10-41 keys
        ranks.reference_rows(mask, [np.arange(last - 5, last + 1)], 0, np.array(heads), True, 0.3)
        sizes.append((passes["out"]._cache_size(), passes["dq"]._cache_size()))
    assert sizes[0] == sizes[1] == sizes[2], sizes
    assert platforms == [jax.devices()[0].platform] * 3


def test_row_references_are_shared_between_a_problems_points(monkeypatch):
    """The float64 values a row check computed serve the next point of the same problem (another
    strategy or layout): it draws only the rows it has not seen, its errors are those of a
    fresh reference, a wrong rank still fails on values taken from the store, and the store
    empties for another problem."""
    from experiments.runners import checks
    from experiments.runners.cp_rank_checks import ReferenceRows, check_ranks
    from experiments.runners.cp_ranks_jax import JaxRanks

    monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 1)
    drawn = []  # (input, rows) of each reference's query draw
    real_reference = JaxRanks.reference_rows

    def reference(self, mask, rows_of, *args):
        drawn.append(("q", sum(map(len, rows_of))))
        return real_reference(self, mask, rows_of, *args)

    monkeypatch.setattr(JaxRanks, "reference_rows", reference)
    store = ReferenceRows()
    problem = ("causal 64", 0)
    points = [
        _point(s, 4, "fwd_bwd", sim.LinkModel(), mask="causal", layout=lay, seqlen=64)
        for s, lay in (("ring", "contiguous"), ("ring", "zigzag"), ("allgather", "zigzag"))
    ]
    mask = named_mask("causal", 64)
    rows_drawn = []
    for point in points:
        ranks = _jax_ranks(point, mask)
        drawn.clear()
        fresh, _ = check_ranks(ranks, point, mask, 0, rtol=1e-4)
        fresh_rows = sum(n for name, n in drawn if name == "q")
        drawn.clear()
        shared, checked = check_ranks(ranks, point, mask, 0, rtol=1e-4, known=store.of(problem))
        rows_drawn.append((fresh_rows, sum(n for name, n in drawn if name == "q")))
        assert fresh.ok and shared.ok, (fresh.message, shared.message)
        for name, err in fresh.errors.items():
            assert shared.errors[name] == pytest.approx(err, rel=1e-6, abs=1e-12), name
    assert rows_drawn[0][1] == rows_drawn[0][0] > 0  # the first point computes every row
    assert all(shared < fresh for fresh, shared in rows_drawn[1:]), rows_drawn
    # the same point again: every value is held, nothing is drawn
    drawn.clear()
    assert check_ranks(ranks, point, mask, 0, rtol=1e-4, known=store.of(problem))[0].ok
    assert drawn == []

    real_emulate = JaxRanks.emulate

    def wrong_first(self, r, u, rows=None):
        res = real_emulate(self, r, u, rows)
        if r == 0:
            res["out"] = res["out"] * 1.5
        return res

    monkeypatch.setattr(JaxRanks, "emulate", wrong_first)
    bad, _ = check_ranks(ranks, point, mask, 0, rtol=1e-4, known=store.of(problem))
    assert not bad.ok and bad.message.startswith("rank 0:") and drawn == []
    assert store.of(("causal 64", 1)) == {} and store.values == {}


def test_row_references_are_shared_between_a_problems_modes(monkeypatch):
    """A forward point takes the out values a forward+backward point of its problem computed
    (it draws nothing, and its errors are a fresh reference's); a forward+backward point after a
    forward computes its rows again (it needs their dq), with a fresh reference's errors; the
    simulator keys both modes' values alike, other masks of the problem apart."""
    from experiments.runners import checks, cp_simulate
    from experiments.runners.cp_rank_checks import ReferenceRows, check_ranks
    from experiments.runners.cp_ranks_jax import JaxRanks

    monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 1)
    drawn = []
    real_reference = JaxRanks.reference_rows

    def reference(self, mask, rows_of, *args):
        drawn.append(sum(map(len, rows_of)))
        return real_reference(self, mask, rows_of, *args)

    monkeypatch.setattr(JaxRanks, "reference_rows", reference)
    mask = named_mask("causal", 64)
    modes = {m: _point("ring", 4, m, sim.LinkModel(), mask="causal", seqlen=64) for m in sim.MODES}
    keys = {m: cp_simulate.reference_problem(p, "reference", 0) for m, p in modes.items()}
    assert (
        keys["fwd"]
        == keys["fwd_bwd"]
        != cp_simulate.reference_problem(modes["fwd"], "reference", 1)
    )
    for order in (("fwd_bwd", "fwd"), ("fwd", "fwd_bwd")):
        store = ReferenceRows()
        for i, mode in enumerate(order):
            ranks = _jax_ranks(modes[mode], mask)
            fresh, _ = check_ranks(ranks, modes[mode], mask, 0, rtol=1e-4)
            drawn.clear()
            shared, _ = check_ranks(ranks, modes[mode], mask, 0, rtol=1e-4, known=store.of("p"))
            assert fresh.ok and shared.ok and set(shared.errors) == set(fresh.errors)
            for name, err in fresh.errors.items():
                assert shared.errors[name] == pytest.approx(err, rel=1e-6, abs=1e-12), name
            assert (drawn == []) == (i == 1 and mode == "fwd"), (order, mode, drawn)


def _span_time(args) -> float:
    """Fake kernel time of a call: 0.5 ms + 0.01 per full-tile unit of its query-tile kernels'
    span + 0.03 per unit of its key-tile kernel's, which only a backward step runs (its
    arguments, 7 or more, hold the forward's residuals) (from the piece's forward tile lists,
    for the heads of its q and K/V arguments; 1 ms without a piece)."""
    from jax_attn.mask_arrays import MaskArrays

    piece = next((a for a in args if isinstance(a, MaskArrays)), None)
    if piece is None:
        return 1.0
    q, k = args[0], args[1]
    heads = q.shape[0] * q.shape[2], k.shape[0] * k.shape[2]
    rows, cols = list_spans(piece.kv, *heads).reshape(-1, 3)[0, 1:]
    return 0.5 + 0.01 * rows + (0.03 * cols if len(args) >= 7 else 0.0)


def _modelled_equals_timed(monkeypatch) -> None:
    """With times linear in the spans of the kernels' schedule, a point whose calls are mostly
    predicted from a few timed ones (--sim_timed_calls) gets the compute of timing every call,
    and says how many it modelled and the held-out error (0 here); each timed call's record
    holds the spans of the heads it ran (the law's, from the call's own arguments)."""
    from experiments.runners import call_model, cp_simulate
    from experiments.runners.jax_runner import JaxRunner

    def fake(fn, args, *, warmup, iters, **timing_kw):
        return [_span_time(args)] * iters

    monkeypatch.setattr(cp_simulate.timing, "jax_time_calls", fake)
    _no_first_run_timing(monkeypatch)
    # random slices: many distinct pieces per class of calls (named masks this small have few)
    monkeypatch.setattr(
        cp_simulate.frameworks, "make_masks", lambda p: [random_slices_mask(p.seqlen_total, 5)]
    )
    point = _point("ring", 8, "fwd_bwd", sim.LinkModel.ideal(), layout="contiguous", seqlen=128)
    sims = {}
    for k in (0, 4, "unchecked"):
        with monkeypatch.context() as m:
            if k == "unchecked":  # no class's model checked (CPSimulator._checked decides it)
                m.setattr(
                    cp_simulate.CPSimulator,
                    "_checked",
                    lambda self, cls, kind, decide=True: self._checks.setdefault(cls, False),
                )
            result = JaxRunner(sim_timed_calls=4 if k == "unchecked" else k).run(point)
        assert result["check"]["ok"]
        sims[k] = result["masks"][0]["simulation"]
    every, model = sims[0]["calls"], sims[4]["calls"]
    # no class checked: the same calibration calls, the held-out ones predicted instead
    unchecked, held = sims["unchecked"]["calls"], model["model"]["held_out_calls"]
    assert unchecked["unchecked"] + unchecked["idle"] == unchecked["modelled"]
    assert unchecked["modelled"] >= model["modelled"] + held
    assert model["unchecked"] == 0 and "model" not in unchecked
    assert unchecked["timed"] <= model["timed"] - held
    assert {c["role"] for c in sims["unchecked"]["timed_calls"]} <= {"calibration", "all", "idle"}
    assert sims["unchecked"]["compute_ms"] == pytest.approx(sims[0]["compute_ms"], rel=1e-9)
    assert every["timed"] == every["distinct"] and every["modelled"] == 0 and "model" not in every
    assert model["distinct"] == every["distinct"]
    assert model["modelled"] > 0 and model["timed"] + model["modelled"] == model["distinct"]
    assert model["model"]["held_out_calls"] >= 4 and model["model"]["max_error_pct"] < 1e-6
    # every call timed is logged once with the piece's tile counts it was timed on
    for k, calls in ((0, every), (4, model)):
        log = sims[k]["timed_calls"]
        assert len(log) == calls["timed"], k
        roles = [c["role"] for c in log]
        modelled = {"calibration", "held_out"}
        everything = modelled | {"all", "idle"}
        assert set(roles) == {"all"} if k == 0 else modelled <= set(roles) <= everything
        for c in log:
            tiles = c["full"] + c["partial"]
            law = 0.5 + 0.01 * c["row_span"] + 0.03 * c["col_span"]
            assert c["median"] == pytest.approx(law), c
            assert c["slots"] == call_model.SLOTS  # a CPU device: the H100/H200's count
            assert call_model.recorded_weights(c) == call_model.span_weights()
            assert c["rows"] <= c["q_tiles"] and c["cols"] <= c["k_tiles"]
            assert c["row_max"] * c["rows"] >= tiles and c["col_max"] * c["cols"] >= tiles
            assert c["q"] == 128 and c["k"] > 0 and c["area"] <= c["q"] * c["k"]
    assert roles.count("held_out") == model["model"]["held_out_calls"]
    assert sims[4]["compute_ms"] == pytest.approx(sims[0]["compute_ms"], rel=1e-9)
    assert sims[4]["time_ms"]["total"] == pytest.approx(sims[0]["time_ms"]["total"], rel=1e-9)


def _long_all_gather_points(monkeypatch) -> tuple:
    """All-gather forward points over 4 and 8 devices (random slices masks) whose calls take
    a law linear in their spans, 150 ms and more, 30% slower a tile at the longer key blocks
    (a rate the shorter calls cannot give)."""
    from experiments.runners import cp_simulate
    from jax_attn.mask_arrays import MaskArrays

    def linear(fn, args, *, warmup, iters, **timing_kw):
        piece = next(a for a in args if isinstance(a, MaskArrays))
        heads = args[0].shape[0] * args[0].shape[2], args[1].shape[0] * args[1].shape[2]
        rows, cols = list_spans(piece.kv, *heads).reshape(-1, 3)[0, 1:]
        rate = 1.3 if args[1].shape[1] > 4 * 32 else 1.0  # keys of more than 4 ranks' shards
        return [rate * (150.0 + 30.0 * rows + 70.0 * cols)] * iters

    monkeypatch.setattr(cp_simulate.timing, "jax_time_calls", linear)
    _no_first_run_timing(monkeypatch)
    monkeypatch.setattr(
        cp_simulate.frameworks, "make_masks", lambda p: [random_slices_mask(p.seqlen_total, 5)]
    )
    small, large = (
        _point("allgather", n, "fwd", sim.LinkModel.ideal(), layout="contiguous", seqlen=32)
        for n in (4, 8)
    )
    return small, large


def _long_calls_modelled_across_shapes(monkeypatch) -> None:
    """Calls of a kind past LONG_CALL_MS, with times linear in their spans at any shape
    but 30% slower a tile at longer key blocks (a rate the shorter calls cannot give): a point
    with longer key blocks than any timed before (all-gather over 8 devices after 4) times
    one call of its class for its rate and one more held out, and predicts the rest from the
    kind's model at that rate; its compute equals that of timing every call, the held-out
    error is 0; a later point of the same class times nothing and states that check again."""
    from experiments.runners.cp_ranks import LONG_CALL_MS
    from experiments.runners.jax_runner import JaxRunner

    small, large = _long_all_gather_points(monkeypatch)
    model = JaxRunner(sim_timed_calls=4)
    first = model.run(small)["masks"][0]["simulation"]["calls"]
    assert first["across_shapes"] == 0 and first["timed"] == first["distinct"]
    result = model.run(large)
    every = JaxRunner(sim_timed_calls=0).run(large)
    assert result["check"]["ok"] and every["check"]["ok"]
    sim_model, sim_every = (r["masks"][0]["simulation"] for r in (result, every))
    calls = sim_model["calls"]
    assert calls["distinct"] > 3 and calls["timed"] == 2
    assert calls["across_shapes"] == calls["modelled"] == calls["distinct"] - 2
    held = calls["model"]
    assert held["held_out_calls"] == 1 and held["max_error_pct"] < 1e-6
    ((predicted, measured),) = held["held_out_ms"]
    assert predicted == pytest.approx(measured, rel=1e-3) and measured > LONG_CALL_MS
    assert sim_model["compute_ms"] == pytest.approx(sim_every["compute_ms"], rel=1e-9)
    assert sorted(c["role"] for c in sim_model["timed_calls"]) == ["rate", "rate_held_out"]
    (checked,) = (c for c in sim_model["timed_calls"] if c["role"] == "rate_held_out")
    assert checked["median"] == pytest.approx(measured, rel=1e-3)
    assert len({c["class"] for c in sim_model["timed_calls"]}) == 1
    assert sim_every["calls"]["across_shapes"] == 0
    # another layout of the same shapes: nothing timed, the class's held-out check stated again
    other = _point("allgather", 8, "fwd", sim.LinkModel.ideal(), layout="balanced", seqlen=32)
    again_sim = model.run(other)["masks"][0]["simulation"]
    again = again_sim["calls"]
    assert again["timed"] == 0 and again["across_shapes"] == again["distinct"] > 2
    assert again_sim["timed_calls"] == []
    assert again["model"]["held_out_ms"] == held["held_out_ms"]


@pytest.mark.parametrize("share", [1.0, 1e-9], ids=["checked", "unchecked"])
def test_a_class_rate_starts_from_its_calls_timed_before(monkeypatch, share):
    """A class two of whose calls an earlier point timed (other pieces than this point's) and
    whose calls the kind's model puts under LONG_CALL_MS but its own rate (1.3 times the kind's
    law, with a per-call wobble) over it: it is predicted across shapes, those calls set its
    rate, only one more is timed (held out, predicted at that rate), the rest are predicted at
    the rate of all three, with the kind's spread of p20 and p80 around their medians. A class
    whose model is not checked (--sim_validation_share) times nothing: every call predicted at
    the rate of the two."""
    from types import SimpleNamespace

    from experiments.runners import timing
    from experiments.runners.cp_ranks import LONG_CALL_MS
    from experiments.runners.cp_simulate import CPSimulator

    law = np.array([10.0, 0.9, 1.6])  # the kind's ms: constant, per full, per partial tile
    wobble = {i: 1.0 + 0.02 * math.sin(3.0 * i) for i in range(30)}
    simulator = CPSimulator(
        SimpleNamespace(on_gpu=False), None, timed_calls=4, validation_share=share
    )
    rng = np.random.default_rng(4)
    features = {("c", i): np.array([1.0, *rng.integers(5, 60, 2)]) for i in range(14)}
    features |= {("other", i): np.array([1.0, *rng.integers(5, 60, 2)]) for i in range(14, 22)}
    timed = []

    def fake_time(ranks, point, key, call, role):
        timed.append((key, role))
        ms = 1.3 * wobble[key[1]] * float(features[key] @ law)
        simulator._timings[key] = stats = timing.time_stats([ms])
        return stats

    monkeypatch.setattr(simulator, "_time", fake_time)
    for key, x in features.items():  # the kind's other shapes: the law, sampled with a spread
        if key[0] == "other":
            simulator._timings[key] = timing.time_stats([0.9 * x @ law, x @ law, 1.2 * x @ law])
    before = [("c", 0), ("c", 1)]  # timed by an earlier point (as _time_calls remembers them)
    for key in before:
        fake_time(None, None, key, None, "calibration")
    simulator._kinds["kind"] = {k: x for k, x in features.items() if k in simulator._timings}
    timed.clear()
    members = {k: (None, x) for k, x in features.items() if k[0] == "c" and k not in before}
    coef = simulator._kind_model("kind")
    guess = {k: float(x @ coef) for k, (_, x) in members.items()}

    def rate(keys):
        measured = sum(simulator._timings[k]["median"] for k in keys)
        return measured / sum(float(features[k] @ coef) for k in keys)

    median = np.median(list(guess.values()))
    assert median < LONG_CALL_MS <= rate(before) * median  # the class's rate decides
    point = SimpleNamespace(seed=0)
    if share < 1:  # another class of the kind was checked: this one is not drawn
        simulator._kinds_checked.add("kind")
    count, predicted, checked = simulator._across_shapes(None, point, ("c",), "kind", members)
    if share < 1:
        assert not simulator._checks[("c",)]
        assert count == 0 and timed == [] and checked == [] and set(predicted) == set(members)
        for key, stats in predicted.items():
            assert stats["median"] == pytest.approx(rate(before) * guess[key], rel=1e-9)
        return
    assert count == 1 and [role for _, role in timed] == ["rate_held_out"]
    ((held, _),) = timed
    ((predicted_held, measured),) = checked
    assert predicted_held == pytest.approx(rate(before) * guess[held], rel=1e-9)
    assert measured == simulator._timings[held]["median"]
    assert set(predicted) == set(members) - {held}
    for key, stats in predicted.items():
        assert stats["median"] == pytest.approx(rate([*before, held]) * guess[key], rel=1e-9)
        assert stats["p20"] == pytest.approx(0.94 * stats["median"], rel=1e-9)  # the kind's


@pytest.mark.parametrize("recorded_third", [False, True], ids=["live", "recorded"])
@pytest.mark.parametrize("share", [1.0, 1e-9], ids=["checked", "unchecked"])
def test_a_new_long_class_takes_its_kinds_rate_trend(monkeypatch, share, recorded_third):
    """A long class none of whose calls was timed, of a kind whose other three classes run at
    rates 2 L^-0.1 of the kind's model (L: their median modelled ms; one of them known only
    from the records, or also recorded under its digest): no rate call is timed; a point with
    one call of it predicts that call at the rate the trend gives at its length and times
    nothing; a later point with more calls times one held out (for a checked class), predicted
    at the trend too; the point after that times nothing and states that check again."""
    from types import SimpleNamespace

    from experiments.runners import timing
    from experiments.runners.cp_ranks import LONG_CALL_MS
    from experiments.runners.cp_simulate import RECORDED, CPSimulator, _digest

    law = np.array([10.0, 0.9, 1.6])  # the kind's model, as fitted (monkeypatched below)
    simulator = CPSimulator(
        SimpleNamespace(on_gpu=False), None, timed_calls=4, validation_share=share
    )
    monkeypatch.setattr(simulator, "_kind_model", lambda kind: law)

    def rate_at(length):
        return 2.0 * length**-0.1

    table = {}
    for c, scale in enumerate((1, 4, 16)):  # each class's calls share one length
        x = np.array([1.0, 20.0 * scale, 30.0 * scale])
        ms = rate_at(float(x @ law)) * float(x @ law)
        keys = [(f"other{c}", i) for i in range(3)]
        if c == 2 and recorded_third:
            keys = [(RECORDED, _digest(("other2",)), f"id{i}") for i in range(3)]
        if c == 1:  # also recorded under its digest: still one class
            keys += [(RECORDED, _digest(("other1",)), "id9")]
        for key in keys:
            table[key] = x
            simulator._timings[key] = timing.time_stats([ms])
    simulator._kinds["kind"] = table
    if share < 1:  # another class of the kind was checked: this one is not drawn
        simulator._kinds_checked.add("kind")
    timed = []
    new = {("new", i): np.array([1.0, 300.0 + 10 * i, 500.0 - 5 * i]) for i in range(10)}

    def fake_time(ranks, point, key, call, role):
        timed.append(role)
        simulator._timings[key] = stats = timing.time_stats([1.05 * float(new[key] @ law)])
        return stats

    monkeypatch.setattr(simulator, "_time", fake_time)

    def across(keys, seed):
        members = {k: (None, new[k]) for k in keys}
        return simulator._across_shapes(None, SimpleNamespace(seed=seed), ("new",), "kind", members)

    guess = {k: float(x @ law) for k, x in new.items()}
    assert min(guess.values()) > LONG_CALL_MS
    # one call: predicted at the trend's rate at its length, nothing timed, no check stated
    count, predicted, checked = across([("new", 0)], 0)
    assert count == 0 and timed == [] and checked == []
    want = rate_at(guess[("new", 0)]) * guess[("new", 0)]
    assert predicted[("new", 0)]["median"] == pytest.approx(want, rel=1e-9)
    # more calls: the trend at their median length; a checked class times one held out
    keys = [("new", i) for i in range(1, 8)]
    count, predicted, checked = across(keys, 1)
    rate = rate_at(float(np.median([guess[k] for k in keys])))
    if share < 1:
        assert count == 0 and timed == [] and checked == [] and set(predicted) == set(keys)
        for key, stats in predicted.items():
            assert stats["median"] == pytest.approx(rate * guess[key], rel=1e-9)
        return
    assert count == 1 and timed == ["rate_held_out"]
    ((guessed, measured),) = checked
    assert guessed == pytest.approx(rate * measured / 1.05, rel=1e-9)
    for key, stats in predicted.items():  # the rest at the held-out call's own rate
        assert stats["median"] == pytest.approx(1.05 * guess[key], rel=1e-9)
    # a later point: nothing more timed, the same check stated
    timed.clear()
    count, predicted, again = across([("new", 8), ("new", 9)], 2)
    assert count == 0 and timed == [] and again == checked and len(predicted) == 2


def test_a_kind_with_two_other_classes_times_a_rate_call(monkeypatch):
    """Two other classes (one live and recorded, one recorded): too few for a trend, so the
    class times its rate call first, as without one."""
    from types import SimpleNamespace

    from experiments.runners import timing
    from experiments.runners.cp_simulate import RECORDED, CPSimulator, _digest

    law = np.array([10.0, 0.9, 1.6])
    simulator = CPSimulator(SimpleNamespace(on_gpu=False), None, timed_calls=4)
    monkeypatch.setattr(simulator, "_kind_model", lambda kind: law)
    table = {}
    for key, x in (
        (("a", 0), np.array([1.0, 40.0, 60.0])),
        ((RECORDED, _digest(("a",)), "id0"), np.array([1.0, 80.0, 60.0])),
        ((RECORDED, _digest(("b",)), "id1"), np.array([1.0, 200.0, 300.0])),
    ):
        table[key] = x
        simulator._timings[key] = timing.time_stats([float(x @ law)])
    simulator._kinds["kind"] = table
    roles = []

    def fake_time(ranks, point, key, call, role):
        roles.append(role)
        simulator._timings[key] = stats = timing.time_stats([float(members[key][1] @ law)])
        return stats

    monkeypatch.setattr(simulator, "_time", fake_time)
    members = {("new", i): (None, np.array([1.0, 300.0 + i, 500.0])) for i in range(6)}
    simulator._across_shapes(None, SimpleNamespace(seed=0), ("new",), "kind", members)
    assert roles[0] == "rate"


def test_row_checks_emulate_whole_real_query_tiles():
    """A row check's rows on every rank are up to CHECK_TILES whole, aligned query tiles holding
    real tokens, its real tiles' first and last among them; the whole shard where it is short
    or no whole tile holds a real token. Over strategies and layouts, with document masks
    (padded zigzag shards), short shards, shards of 130 tokens (not whole tiles) and a length
    that leaves a rank one real tile."""
    from types import SimpleNamespace

    from experiments.runners.cp_ranks import CHECK_TILES, Ranks

    block, seen = 8, set()
    cases = [
        ("causal_document", 160, 1),
        ("causal", 64, 1),
        ("causal", 130, 1),
        ("causal", None, 128),
    ]
    for (strategy, n, u), layout, (mask_name, per_rank, pad) in itertools.product(
        CONFIGS, ss.LAYOUTS, cases
    ):
        seqlen = 777 if per_rank is None else per_rank * n
        mask = named_mask(mask_name, seqlen)
        plan = _plan(mask, n, strategy, layout, u, pad_multiple=pad)
        fake = SimpleNamespace(plan=plan, check_block=lambda: block)
        for r, shard in enumerate(plan.layout.positions):
            rows, count = Ranks.check_rows(fake, r, seqlen), len(shard) // block
            real = np.flatnonzero((shard[: count * block] < seqlen).reshape(count, block).any(1))
            if count < 4 * CHECK_TILES or not len(real):
                assert rows is None
                seen.add("short" if count < 4 * CHECK_TILES else "no real tile")
                continue
            tiles = rows[::block] // block
            np.testing.assert_array_equal(rows, (tiles[:, None] * block + np.arange(block)).ravel())
            assert np.all(np.diff(tiles) > 0) and len(tiles) == min(len(real), CHECK_TILES)
            assert np.isin(tiles, real).all() and tiles[0] == real[0] and tiles[-1] == real[-1]
            seen.update(["partial tile"] * (len(shard) % block > 0))
            seen.update(["few real tiles"] * (len(real) < CHECK_TILES))
    assert seen == {"short", "no real tile", "partial tile", "few real tiles"}


@pytest.mark.parametrize(
    "strategy, layout, mask_name, per_device, pad",
    [
        ("ring", "zigzag", "causal_document", 512, None),
        ("ulysses", "zigzag", "causal_document", 512, None),
        ("ring", "contiguous", "causal", 400, 512),  # the last shard: 1 real tile, 7 of padding
    ],
)
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_row_checks_emulate_whole_query_tiles(
    monkeypatch, strategy, layout, mask_name, per_device, pad, impl
):
    """A row check emulates CHECK_TILES whole query tiles of a shard instead of the shard (fewer
    where fewer hold real tokens), in the shard's shapes: those rows' out and dq equal the whole
    shard's emulation at the same rows, the first and last ranks' checks pass drawing no more
    queries than those tiles, and a restricted piece from the wrong step fails it. pallas
    (interpreted on the CPU) walks the restricted pieces' tile lists, which the reference never
    reads."""
    from experiments.runners import checks, cp_ranks, frameworks
    from experiments.runners.cp_rank_checks import _rank_check, check_ranks
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner
    from shard_strategies import jax_cp

    monkeypatch.setattr(cp_ranks, "CHECK_TILES", 2)
    point = _point(strategy, 4, "fwd_bwd", sim.LinkModel(), mask_name, layout, per_device)
    mask = named_mask(mask_name, point.seqlen_total)
    dtype, settings = frameworks.framework_dtype("jax", "fp32"), cp_ranks.plan_settings(point)
    plan = jax_cp.executor_plan(mask, impl=impl, dtype=dtype, pad_multiple=pad, **settings)
    ranks = JaxRanks(plan, impl, point, 0, JaxRunner())
    block, few = ranks.check_block(), False
    for r in range(plan.ring_size):
        rows, shard = ranks.check_rows(r, mask.seqlen_q), plan.layout.positions[r]
        assert len(rows) <= 2 * block < len(shard)
        few |= len(rows) < 2 * block
        whole, part = ranks.emulate(r, 0), ranks.emulate(r, 0, rows)
        for name in ("out", "dq"):
            np.testing.assert_allclose(part[name], whole[name][:, rows], rtol=1e-5, atol=1e-6)
    assert few == (pad is not None)
    monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 1)
    draws = _record_draws(monkeypatch, JaxRanks)
    for r in {0, plan.ring_size - 1}:  # the last: fewer real tiles where padded
        check = _rank_check(ranks, mask, r, 0, grads=True, rtol=1e-4, seed=0)
        assert check.ok and check.kind == "rows", check.message
    assert max(n for name, n, _ in draws if name in ("q", "dout")) <= 2 * block
    if strategy == "ring":
        real = JaxRanks.row_piece
        last = plan.num_steps - 1
        monkeypatch.setattr(
            JaxRanks, "row_piece", lambda self, r, t, rows: real(self, r, last - t, rows)
        )
        check, _ = check_ranks(ranks, point, mask, 0, rtol=1e-4)
        assert not check.ok and "rank" in check.message


def _ring_ranks(
    mask_name: str = "causal_document", layout: str = "zigzag", impl="reference", per_device=64
):
    """JaxRanks of a 4-rank ring forward+backward point (fp32) and its plan."""
    from experiments.runners import frameworks
    from experiments.runners.cp_ranks import plan_settings
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner
    from shard_strategies import jax_cp

    point = _point("ring", 4, "fwd_bwd", sim.LinkModel(), mask_name, layout, per_device)
    mask = named_mask(mask_name, point.seqlen_total)
    dtype = frameworks.framework_dtype("jax", "fp32")
    plan = jax_cp.executor_plan(mask, impl=impl, dtype=dtype, **plan_settings(point))
    return JaxRanks(plan, impl, point, 0, JaxRunner()), plan


def test_row_pieces_are_built_once_per_distinct_piece_and_rows(monkeypatch):
    """A row check's restricted pieces are built once per (distinct piece, rows) in a point and
    equal a fresh build at every (rank, step) and for two row sets: a cache keyed without the
    piece or without the rows would hand one step another's piece."""
    import jax

    from experiments.runners import cp_ranks
    from experiments.runners.cp_ranks_jax import JaxRanks

    monkeypatch.setattr(cp_ranks, "CHECK_TILES", 2)
    ranks, plan = _ring_ranks("causal_document", "contiguous", "pallas", 512)
    other, _ = _ring_ranks("causal_document", "contiguous", "pallas", 512)  # builds afresh
    built = []
    real = JaxRanks._rows_only
    monkeypatch.setattr(
        JaxRanks, "_rows_only", lambda self, i, rows: built.append(self) or real(self, i, rows)
    )
    first = ranks.check_rows(0, 4 * 512)
    row_sets = (first, first[: len(first) // 2])
    cells = [(r, t) for r in range(plan.ring_size) for t in range(plan.num_steps)]
    for rows in row_sets:
        for r, t in cells:
            got = jax.tree.leaves(ranks.row_piece(r, t, rows))
            fresh = jax.tree.leaves(other._rows_only(int(ranks.pieces.index[r, t]), rows))
            assert len(got) == len(fresh)
            for a, b in zip(got, fresh):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    distinct = len({int(ranks.pieces.index[r, t]) for r, t in cells})
    assert distinct < len(cells)
    assert built.count(ranks) == len(row_sets) * distinct


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])  # contiguous: empty pieces first
def test_timed_calls_share_finite_residuals_once_per_shapes(layout):
    """A later forward step's and a backward step's inputs from earlier steps (out, LSE, the
    row dot) are made once per shapes in a point, every call keeping its own piece: finite,
    the LSE near log(keys) as a softmax's (an empty piece's forward would give -inf and zero
    probabilities to every backward call), no forward step run for them; a new point makes
    them again."""
    from types import SimpleNamespace

    import jax

    ranks, plan = _ring_ranks("causal", layout)
    starts = []
    real_start = ranks.steps.start  # the jitted steps are shared: wrapped on this ranks only
    counted = lambda *a: starts.append(1) or real_start(*a)  # noqa: E731
    ranks.steps = SimpleNamespace(**{**vars(ranks.steps), "start": counted})
    cells = [(r, t) for r in range(plan.ring_size) for t in range(1, plan.num_steps)]
    empty = [plan.piece_area[r, t] == 0 for r, t in cells]
    assert any(empty) == (layout == "contiguous") and not all(empty)
    made = []
    for r, t in cells:
        _, fwd_args = ranks.call(sim.ATTEND, r, t, group_start=False)
        _, bwd_args = ranks.call(sim.ATTEND_BWD, r, t, group_start=False)
        for args in (fwd_args, bwd_args):
            for got, want in zip(jax.tree.leaves(args[3]), jax.tree.leaves(ranks.piece(r, t))):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        (out, lse, _, _, rowdot), dq = bwd_args[4:6]  # the dLSE and dout: synthetic, as before
        made.append((*fwd_args[4:], out, lse, rowdot, dq))
    assert all(x is y for m in made[1:] for x, y in zip(m, made[0]))
    out, lse = (np.asarray(x) for x in made[0][:2])
    keys = len(plan.key_positions(0, 1))
    assert np.isfinite(out).all() and out.std() > 0.5
    assert np.isfinite(lse).all() and abs(lse.mean() - np.log(keys)) < 0.5 and lse.std() > 0.5
    assert len(starts) == 1
    again, _ = _ring_ranks("causal", layout)
    assert again.call(sim.ATTEND, *cells[0], group_start=False)[1][4] is not made[0][0]


def test_made_once_runs_a_step_once_per_argument_shapes():
    ranks, _ = _ring_ranks()
    runs = []

    def step(x):
        runs.append(x.shape)
        return x + 1

    small, large = (np.ones(n, np.float32) for n in (3, 5))
    first = ranks._made_once(step, small)
    assert ranks._made_once(step, np.zeros(3, np.float32)) is first
    ranks._made_once(step, large)
    assert runs == [(3,), (5,)]


def test_lowering_the_calls_runs_no_step_and_keeps_the_timing_inputs(monkeypatch):
    """Precompiling lowers every call from shapes alone: no residual made or step run, and the
    timing inputs (drawn after the check) are as before."""
    from experiments.runners.cp_ranks_jax import JaxRanks

    ranks, plan = _ring_ranks()
    made = []
    monkeypatch.setattr(JaxRanks, "_made_once", lambda self, *a: made.append(a))
    monkeypatch.setattr(JaxRanks, "_residuals", lambda self, *a: made.append(a))
    before = dict(ranks._timing_inputs)
    calls = [(kind, 1, 2, False) for kind in (sim.ATTEND, sim.ATTEND_BWD)]
    programs, lowered = ranks.lower_calls(calls)
    assert len(programs) == 2 and len(lowered) == 2 and not made
    assert ranks._timing_inputs.keys() == before.keys()


def _row_checks_and_constant_timing(monkeypatch) -> None:
    """Row checks on two query tiles at any size, and every timed call 1 ms without running."""
    from experiments.runners import checks, cp_ranks, cp_simulate

    monkeypatch.setattr(cp_ranks, "CHECK_TILES", 2)
    monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 1)
    monkeypatch.setattr(cp_simulate.timing, "jax_time_calls", lambda *a, iters, **kw: [1.0] * iters)
    _no_first_run_timing(monkeypatch)


@pytest.mark.parametrize(
    "strategy, impl", [("ring", "reference"), ("allgather", "reference"), ("ring", "pallas")]
)
def test_row_checks_compile_no_kernel_program_of_their_own(monkeypatch, strategy, impl):
    """A row check restricted to its check rows runs the programs its point's timed calls
    compile (the same shapes and step functions): after the timed calls it compiles no step
    function anew, and it passes."""
    from experiments.runners import cp_simulate, frameworks
    from experiments.runners.cp_rank_checks import check_ranks
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner

    _row_checks_and_constant_timing(monkeypatch)
    point = _point(strategy, 4, "fwd_bwd", sim.LinkModel(), seqlen=512)
    (mask,) = frameworks.make_masks(point)
    runner = JaxRunner()
    plan = JaxRanks.executor_plan(point, mask, impl)
    ranks = JaxRanks(plan, impl, point, 0, runner)
    assert ranks.check_rows(0, mask.seqlen_q) is not None
    sched = sim.schedule(plan, point.mode, itemsize=4, batch=point.batch, entry=sim.EXCHANGE)
    simulator = cp_simulate.CPSimulator(runner, JaxRanks)
    simulator._time_calls(ranks, sched, point, simulator._call_classes(ranks, sched, point))
    programs = {name: fn._cache_size() for name, fn in vars(ranks.steps).items()}
    check, _ = check_ranks(ranks, point, mask, 0, rtol=1e-4)
    assert check.ok and check.kind == "rows" and check.rows > 0, check.message
    assert {name: fn._cache_size() for name, fn in vars(ranks.steps).items()} == programs


@pytest.mark.parametrize(
    "strategy, impl, mode",
    [("ring", "pallas", "fwd_bwd"), ("double_ring", "reference", "fwd_bwd"),
     ("allgather", "reference", "fwd_bwd"), ("ulysses", "reference", "fwd")],
)  # fmt: skip
def test_precompiled_programs_serve_the_check_and_the_timing(
    monkeypatch, caplog, strategy, impl, mode
):
    """The step programs compiled ahead, side by side, are the ones the check's emulation and
    the timed calls run: with them neither compiles a step function anew (without them, at
    other shapes, both do), and the check passes."""
    import logging

    import jax

    from experiments.runners import cp_simulate, frameworks
    from experiments.runners.cp_rank_checks import check_ranks
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner

    _row_checks_and_constant_timing(monkeypatch)
    steps = ("<lambda>", "first_bwd", "once_vjp")  # the jitted step functions' names
    runner = JaxRunner()

    def step_compiles(seqlen: int, ahead: bool) -> tuple[list[str], list[str], int]:
        """(step compilations ahead, after them, the point's classes of calls)"""
        point = _point(strategy, 4, mode, sim.LinkModel(), seqlen=seqlen)
        (mask,) = frameworks.make_masks(point)
        plan = JaxRanks.executor_plan(point, mask, impl)
        ranks = JaxRanks(plan, impl, point, 0, runner)
        sched = sim.schedule(plan, point.mode, itemsize=4, batch=point.batch, entry=sim.EXCHANGE)
        simulator = cp_simulate.CPSimulator(runner, JaxRanks)
        classes = simulator._call_classes(ranks, sched, point)
        caplog.clear()
        if ahead:
            prep = cp_simulate.Prepared(plan, sched, ranks, classes)
            simulator._settle(simulator._compile([prep]), raises=True)
            assert simulator._compiled == set(classes.members)
        before = len(caplog.records)
        check, _ = check_ranks(ranks, point, mask, 0, rtol=1e-4)
        assert check.ok, check.message
        simulator._time_calls(ranks, sched, point, classes)
        messages = [r.getMessage() for r in caplog.records]
        found = [
            [m for m in part if "XLA compilation" in m and any(f"jit({n})" in m for n in steps)]
            for part in (messages[:before], messages[before:])
        ]
        return found[0], found[1], len(classes.members)

    logged = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)  # global: the compiling threads log too
    try:
        with caplog.at_level(logging.WARNING):
            _, without, _ = step_compiles(192, ahead=False)
            ahead, later, classes = step_compiles(256, ahead=True)
    finally:
        jax.config.update("jax_log_compiles", logged)
    assert without, "the check and the timing compile their step programs when none is ready"
    assert 0 < len(ahead) <= classes and not later, (ahead, later)  # classes may share one


def test_a_forward_calls_work_features_hold_no_column_span():
    """The calls of an impl with tile lists take their pieces' spans as work features, a
    forward step's without the column span (call_model.call_features: no key-tile kernel runs
    in it), so a forward class's fit rests on its row span alone."""
    from experiments.runners import call_model, cp_simulate, frameworks
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner

    point = _point("ring", 4, "fwd_bwd", sim.LinkModel(), seqlen=512)
    (mask,) = frameworks.make_masks(point)
    runner = JaxRunner()
    plan = JaxRanks.executor_plan(point, mask, "pallas")
    ranks = JaxRanks(plan, "pallas", point, 0, runner)
    sched = sim.schedule(plan, point.mode, itemsize=4, batch=point.batch, entry=sim.EXCHANGE)
    classes = cp_simulate.CPSimulator(runner, JaxRanks)._call_classes(ranks, sched, point)
    spans = ranks.features()
    forward = set()
    for members in classes.members.values():
        for (name, r, t, _), x in members.values():
            want = spans[r, t].copy()
            if name in call_model.FORWARD_CALLS:
                want[2] = 0.0
            assert x.tolist() == want.tolist(), name
            forward.add(name in call_model.FORWARD_CALLS)
    assert forward == {True, False} and (spans[..., 2] > 0).any()


def _counting_emulations(monkeypatch) -> list[str]:
    """The mode of every JAX rank emulation from now on."""
    from experiments.runners.cp_ranks_jax import JaxRanks

    emulations, real_emulate = [], JaxRanks.emulate

    def emulate(self, r, u, rows=None):
        emulations.append(self.mode)
        return real_emulate(self, r, u, rows)

    monkeypatch.setattr(JaxRanks, "emulate", emulate)
    return emulations


@pytest.mark.parametrize(
    "strategy, n, seqlen, rows, shared",
    [("ring", 4, 512, True, True), ("allgather", 4, 512, True, False),
     ("usp", 8, 128, False, True)],
)  # fmt: skip
def test_a_forward_point_takes_the_outs_of_its_forward_and_backward_point(
    monkeypatch, strategy, n, seqlen, rows, shared
):
    """After a plan's forward+backward point, its forward point (expected next) emulates no
    rank where the forward steps are the same in both modes (a ring core, row checks or a
    whole check of every rank and Ulysses position): it takes the outs that point emulated,
    equal to what its own emulation gives, and judges them (made wrong, the point fails). An
    all-gather core's forward runs other programs: its forward point emulates its own ranks."""
    from experiments.core.outcomes import WRONG, PointFailure
    from experiments.runners import checks, cp_simulate
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner

    _row_checks_and_constant_timing(monkeypatch)
    if not rows:
        monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 1 << 40)
    emulations = _counting_emulations(monkeypatch)
    runner = JaxRunner()
    points = {m: _point(strategy, n, m, sim.LinkModel(), seqlen=seqlen) for m in ("fwd_bwd", "fwd")}

    def after_forward_and_backward() -> tuple[cp_simulate.CPSimulator, dict]:
        # no compile threads: each point checks at its own turn, not at its problem's first
        simulator = cp_simulate.CPSimulator(runner, JaxRanks, compile_threads=0)
        simulator.expect(list(points.values()))
        assert simulator.run(points["fwd_bwd"])["check"]["ok"]
        (store,) = simulator._problem.forwards.values()
        return simulator, store

    simulator, store = after_forward_and_backward()
    checked = emulations.count("fwd_bwd")
    assert checked >= (1 if rows else n) and len(store) == (checked if shared else 0)
    (mask,) = simulator._problem.masks
    impl = JaxRanks.resolve_impl(points["fwd"], runner)
    plan = simulator._plans_of(simulator._problem, points["fwd"], 0, impl)[1]
    own = JaxRanks(plan, impl, points["fwd"], 0, runner)  # no store: its own emulations
    for (r, u, rows_taken), out in store.items():
        taken = None if rows_taken is None else np.frombuffer(rows_taken, np.int64)
        np.testing.assert_array_equal(own.emulated(r, u, taken)["out"], out)
    emulations.clear()
    result = simulator.run(points["fwd"])
    sim_record = result["masks"][0]["simulation"]
    assert result["check"]["ok"] and set(result["check"]["max_errors"]) == {"out"}
    assert sim_record["check_forwards_taken"] == (checked if shared else 0)
    assert len(emulations) == (0 if shared else len(sim_record["check_ranks"]))
    assert not store  # taken, not kept
    if shared:
        simulator, store = after_forward_and_backward()
        for key, out in store.items():
            store[key] = out + 1.0
        with pytest.raises(PointFailure) as e:
            simulator.run(points["fwd"])
        assert e.value.status == WRONG


def test_outs_are_kept_only_for_a_forward_point_of_the_same_plan_and_inputs(monkeypatch):
    """A forward+backward point keeps no emulated out where no forward point of its plan
    follows it, where the one that follows draws other inputs (another batch, same mask and
    plan: that point emulates its own ranks and passes), or where an out is larger than
    FORWARD_KEPT_BYTES."""
    import dataclasses

    from experiments.runners import cp_ranks, cp_simulate
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner

    _row_checks_and_constant_timing(monkeypatch)
    emulations = _counting_emulations(monkeypatch)
    runner = JaxRunner()
    both = _point("ring", 4, "fwd_bwd", sim.LinkModel(), seqlen=512)
    forward = _point("ring", 4, "fwd", sim.LinkModel(), seqlen=512)
    wider = dataclasses.replace(forward, batch=2)
    for expected, kept_bytes in (([both], 1 << 30), ([both, forward], 0), ([both, wider], 1 << 30)):
        monkeypatch.setattr(cp_ranks, "FORWARD_KEPT_BYTES", kept_bytes)
        # no compile threads: each point checks at its own turn, not at its problem's first
        simulator = cp_simulate.CPSimulator(runner, JaxRanks, compile_threads=0)
        simulator.expect(expected)
        emulations.clear()
        assert simulator.run(both)["check"]["ok"] and emulations
        # no out kept (a forward point's own store)
        assert not any(simulator._problem.forwards.values())
    emulations.clear()
    result = simulator.run(wider)
    assert result["check"]["ok"] and emulations
    assert result["masks"][0]["simulation"]["check_forwards_taken"] == 0


# the JAX ranks' jitted step functions' names (cp_ranks_jax._steps)
STEP_FUNCTIONS = ("<lambda>", "first_bwd", "once_vjp", "once", "pullback")


def _step_compiles(caplog) -> list[str]:
    """The XLA compilations of step functions among caplog's records."""
    return [
        m
        for m in (r.getMessage() for r in caplog.records)
        if "XLA compilation" in m and any(f"jit({n})" in m for n in STEP_FUNCTIONS)
    ]


@contextlib.contextmanager
def _compiles_logged(caplog):
    """JAX logs every compilation (a global setting: the compiling threads log too) into
    caplog, until the block ends."""
    import logging

    import jax

    logged = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            yield
    finally:
        jax.config.update("jax_log_compiles", logged)


def test_a_problems_first_point_compiles_the_step_programs_of_its_peers(monkeypatch, caplog):
    """With the points to come expected, a problem's first point compiles the step programs of
    the problem's other points (strategies, layouts) with its own, so they compile none; every
    point still passes its check. Without it (at other shapes) the second point compiles its
    own."""
    from experiments.runners.jax_runner import JaxRunner

    _row_checks_and_constant_timing(monkeypatch)

    def compiles_after_the_first(seqlen: int, expect: bool, threads: int = 2) -> list[str]:
        points = [
            _point(cp, 4, "fwd", sim.LinkModel(), layout=layout, seqlen=seqlen)
            for cp, layout in (("ring", "zigzag"), ("allgather", "balanced"), ("ring", "balanced"))
        ]
        runner = JaxRunner(sim_compile_threads=threads)
        if expect:
            runner.expect(points)
        results = [runner.run(points[0])]
        ahead = expect and threads > 0
        assert len(runner.simulator._problem.ready) == (len(points) - 1 if ahead else 0)
        caplog.clear()
        results += [runner.run(p) for p in points[1:]]
        assert all(r["check"]["ok"] for r in results) and not runner.simulator._problem.ready
        return _step_compiles(caplog)

    with _compiles_logged(caplog):
        alone = compiles_after_the_first(192, expect=False)
        ahead = compiles_after_the_first(256, expect=True)
        off = compiles_after_the_first(320, expect=True, threads=0)  # --sim_compile_threads=0
    assert alone, "without the points to come, each point compiles its own step programs"
    assert off, "with no compile threads, each point compiles its own step programs"
    assert not ahead, ahead


def test_a_peer_that_cannot_compile_fails_at_its_own_turn(monkeypatch):
    """A problem's first point compiles its peers' programs, but a peer whose programs cannot
    be made fails at its own turn, into its own record: the first point is ok."""
    from experiments.runners.cp_ranks_jax import JaxRanks

    _row_checks_and_constant_timing(monkeypatch)
    real = JaxRanks.lower_calls

    def no_allgather(self, calls, skip=()):
        if self.plan.strategy == "allgather":
            raise RuntimeError("cannot lower this one")
        return real(self, calls, skip)

    monkeypatch.setattr(JaxRanks, "lower_calls", no_allgather)
    points = [
        _point(cp, 4, "fwd", sim.LinkModel(), layout="zigzag", seqlen=160)
        for cp in ("ring", "allgather")
    ]
    runner = _expecting(points)
    assert runner.run(points[0])["check"]["ok"]
    with pytest.raises(RuntimeError, match="cannot lower this one"):
        runner.run(points[1])


def _expecting(points: list):
    """A JAX runner told the run's points (expect), so it works ahead of them."""
    from experiments.runners.jax_runner import JaxRunner

    runner = JaxRunner()
    runner.expect(points)
    return runner


def _two_problems(seqlens=(256, 384)) -> list:
    """An all-gather and a ring point of each of two problems (causal_document at two lengths,
    so the second's step programs have other shapes), forward+backward then forward: the ring's
    forward point takes its outs from a peer of the problem's first point."""
    return [
        _point(cp, 4, mode, sim.LinkModel(), layout=layout, seqlen=n)
        for n in seqlens
        for mode in ("fwd_bwd", "fwd")
        for cp, layout in (("allgather", "balanced"), ("ring", "zigzag"))
    ]


def test_the_next_problems_programs_compile_while_this_problems_checks_run(monkeypatch, caplog):
    """At a problem's first point, the next problem's step programs, lowered in the planner
    thread once it has made their points ready (here the checks wait for their submission),
    compile in the compile threads beside this problem's checks (every check of the problem
    runs before any call is timed), and every one of them has compiled before the first call
    is timed: no compile job runs while calls are timed, and the next problem's points compile
    nothing of their own. Without it (no points expected) the next problem's first point
    compiles its own."""
    import threading
    import time

    from experiments.core.outcomes import ERROR
    from experiments.runners import cp_simulate
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner

    _row_checks_and_constant_timing(monkeypatch)
    events: list[tuple] = []
    jobs: list = []
    compiling: list[bool] = []  # at each emulation: whether a compile job was running
    simulator = cp_simulate.CPSimulator
    real_submit, real_emulate = simulator._submit, JaxRanks.emulate
    real_plan_ahead, real_ahead = simulator._plan_ahead, simulator._check_ahead
    checked_ahead = threading.Event()
    next_compiles = threading.Event()  # set while the planner works on the next problem
    next_submitted = threading.Event()  # set once the next problem's jobs are submitted

    class Slow:  # a compile that outlasts the checks beside it, whatever their speed
        def __init__(self, lowered):
            self.lowered = lowered

        def compile(self):
            checked_ahead.wait(timeout=60)
            time.sleep(0.5)
            return self.lowered.compile()

    def submit(self, lowered):
        if next_compiles.is_set():
            lowered = {key: Slow(low) for key, low in lowered.items()}
        out = real_submit(self, lowered)
        jobs.extend(out.values())
        events.append(("submit", len(out), next_compiles.is_set()))
        if next_compiles.is_set():
            next_submitted.set()
        return out

    def plan_ahead(self, point, index, ahead):
        next_compiles.set()
        try:
            return real_plan_ahead(self, point, index, ahead)
        finally:
            next_compiles.clear()
            next_submitted.set()  # also where nothing was lowered: no check waits in vain

    def check_ahead(self, peers, index):
        real_ahead(self, peers, index)
        checked_ahead.set()

    def emulate(self, r, u, rows=None):
        assert next_submitted.wait(timeout=120), "the next problem's programs never submitted"
        events.append(("emulate", self.plan.strategy, self.mode))
        compiling.append(not all(job.done() for job in jobs))
        return real_emulate(self, r, u, rows)

    def timed(*a, iters, **kw):
        events.append(("time", all(job.done() for job in jobs)))
        return [1.0] * iters

    def no_baseline(self, point, impl):  # a kernel point compiles programs of its own
        return {"status": ERROR, "reason": "not run here", "key": point.key, "seqlen": 0}

    monkeypatch.setattr(simulator, "baseline", no_baseline)
    monkeypatch.setattr(simulator, "_submit", submit)
    monkeypatch.setattr(simulator, "_plan_ahead", plan_ahead)
    monkeypatch.setattr(simulator, "_check_ahead", check_ahead)
    monkeypatch.setattr(JaxRanks, "emulate", emulate)
    monkeypatch.setattr(cp_simulate.timing, "jax_time_calls", timed)
    with _compiles_logged(caplog):
        points = _two_problems()
        runner = JaxRunner()
        runner.expect(points)
        first = runner.run(points[0])
        kinds = [e[0] for e in events]
        submitted = [i for i, e in enumerate(events) if e[0] == "submit" and e[1] and not e[2]]
        assert len(submitted) == 2, events  # this point's, its peers'
        following = [i for i, e in enumerate(events) if e[0] == "submit" and e[1] and e[2]]
        assert following, events  # the next problem's (a batch per point)
        checks = [i for i, e in enumerate(events[: kinds.index("time")]) if e[0] == "emulate"]
        # every point of this problem checked before a call is timed (the forward ring point
        # takes its outs from the forward+backward one's, emulating none), some after the next
        # problem's programs were submitted
        assert {events[i][1:] for i in checks} == {
            (cp, m) for cp in ("ring", "allgather") for m in ("fwd_bwd", "fwd")
        } - {("ring", "fwd")}, events
        assert following[0] < checks[-1], events
        assert any(compiling), "no check ran beside the next problem's compilation"
        # the next problem's compile seconds spent here (its slow compiles) are charged to
        # the next problem's first point
        assert runner.simulator._next.ahead_s["compile"] >= 0.5
        results = [first] + [runner.run(p) for p in points[1:4]]
        caplog.clear()
        results += [runner.run(p) for p in points[4:]]
        assert results[4]["masks"][0]["simulation"]["wall_s"]["compile"] >= 0.5
        assert not _step_compiles(caplog), _step_compiles(caplog)
        assert all(r["check"]["ok"] for r in results)
        assert all(e[1] for e in events if e[0] == "time")
        caplog.clear()
        JaxRunner().run(_two_problems((320,))[0])
        assert _step_compiles(caplog), "with no points expected, a point compiles its own"


def test_a_problems_plans_are_made_while_its_first_points_programs_compile(monkeypatch):
    """At a problem's first point, its own step programs compile in the compile threads while
    the host makes the plans of the problem's other points and of the next problem's: the
    first point's compile jobs, held until the next problem's plans are made, do not time out
    waiting, and the point is ok."""
    import threading

    from experiments.runners import cp_simulate

    _row_checks_and_constant_timing(monkeypatch)
    simulator = cp_simulate.CPSimulator
    real_submit, real_made, real_next = (
        simulator._submit, simulator._made_ready, simulator._next_ready
    )  # fmt: skip
    planned = threading.Event()  # set once the next problem's points are made ready
    events: list[tuple] = []

    class Gated:  # a compile of the first point's, ending only once the plans are made
        def __init__(self, lowered):
            self.lowered = lowered

        def compile(self):
            events.append(("released", planned.wait(timeout=120)))
            return self.lowered.compile()

    def submit(self, lowered):
        if not events:  # the first batch: the first point's own programs
            events.append(("own", len(lowered)))
            lowered = {key: Gated(low) for key, low in lowered.items()}
        return real_submit(self, lowered)

    def made_ready(self, problem, points, index):
        made = real_made(self, problem, points, index)
        events.append(("made ready", problem is self._problem, len(made)))
        return made

    def next_ready(self, point, index):
        made = real_next(self, point, index)
        planned.set()
        return made

    monkeypatch.setattr(simulator, "_submit", submit)
    monkeypatch.setattr(simulator, "_made_ready", made_ready)
    monkeypatch.setattr(simulator, "_next_ready", next_ready)
    points = _two_problems()
    runner = _expecting(points)
    assert runner.run(points[0])["check"]["ok"]
    (own,) = [e for e in events if e[0] == "own"]
    assert own[1] > 0, events
    # this problem's three other points, then the next problem's four
    assert [e for e in events if e[0] == "made ready"] == [
        ("made ready", True, 3), ("made ready", False, 4)
    ], events  # fmt: skip
    released = [e[1] for e in events if e[0] == "released"]
    assert len(released) == own[1] and all(released), events


def test_the_next_problems_plans_are_made_while_this_problems_checks_run(monkeypatch):
    """At a problem's first point, the next problem's points are made ready (plans, classes of
    calls) and their programs lowered in the planner thread while this problem's checks run:
    each lookahead, held until a check has begun, does not time out waiting, and every point
    is ok. Lowering there makes no array on the device (a check's inputs beside it could fill
    the device): while a call's inputs are made for lowering, no new array is alive."""
    import threading

    import jax

    from experiments.runners import cp_simulate
    from experiments.runners.cp_ranks_jax import JaxRanks

    _row_checks_and_constant_timing(monkeypatch)
    simulator = cp_simulate.CPSimulator
    real_next, real_emulate = simulator._next_ready, JaxRanks.emulate
    real_lower, real_call = JaxRanks.lower_calls, JaxRanks.call
    checking = threading.Event()  # set once a check runs a rank
    released: list[bool] = []
    lowering: dict[int, list] = {}  # per thread lowering: the arrays alive as it began
    lowered_by: list[str] = []  # the threads that lowered
    new_arrays: list[int] = []  # per call lowered: arrays alive that were not before

    def lower_calls(self, calls, skip=()):
        lowered_by.append(threading.current_thread().name)
        lowering[threading.get_ident()] = jax.live_arrays()  # held: no id reused
        try:
            return real_lower(self, calls, skip=skip)
        finally:
            del lowering[threading.get_ident()]

    def call(self, *args, **kw):
        fn, inputs = real_call(self, *args, **kw)
        before = lowering.get(threading.get_ident())
        if before is not None:
            alive = {id(x) for x in before}
            leaves = jax.tree.leaves(inputs)
            new_arrays.append(sum(isinstance(x, jax.Array) and id(x) not in alive for x in leaves))
        return fn, inputs

    def next_ready(self, point, index):
        released.append(checking.wait(timeout=120))
        return real_next(self, point, index)

    def emulate(self, r, u, rows=None):
        checking.set()
        return real_emulate(self, r, u, rows)

    monkeypatch.setattr(simulator, "_next_ready", next_ready)
    monkeypatch.setattr(JaxRanks, "emulate", emulate)
    monkeypatch.setattr(JaxRanks, "lower_calls", lower_calls)
    monkeypatch.setattr(JaxRanks, "call", call)
    points = _two_problems()
    runner = _expecting(points)
    results = [runner.run(p) for p in points]
    assert released == [True, True], released  # each problem's first point looks ahead
    assert any(name.startswith("planner") for name in lowered_by), lowered_by
    assert new_arrays and not any(new_arrays), new_arrays
    assert all(r["check"]["ok"] for r in results), [r["status"] for r in results]


def test_after_a_stop_request_the_planner_lowers_no_further_point(monkeypatch):
    """A stop request (Ctrl-C) that comes while the planner lowers the next problem's programs
    leaves that problem's later points unlowered (the point's end waits for the planner and
    the jobs in flight), and the point is ok."""
    import threading

    from experiments.core import interrupt
    from experiments.runners.cp_ranks_jax import JaxRanks

    _row_checks_and_constant_timing(monkeypatch)
    real_lower = JaxRanks.lower_calls
    stop = threading.Event()
    by_planner: list[bool] = []  # per lowering: whether the planner thread lowered

    def lower_calls(self, calls, skip=()):
        planner = threading.current_thread().name.startswith("planner")
        by_planner.append(planner)
        if planner:
            stop.set()  # the Ctrl-C, while the planner lowers the next problem's first point
        return real_lower(self, calls, skip=skip)

    monkeypatch.setattr(interrupt, "stop_requested", stop.is_set)
    monkeypatch.setattr(JaxRanks, "lower_calls", lower_calls)
    points = _two_problems()
    runner = _expecting(points)
    assert runner.run(points[0])["check"]["ok"]
    assert len(runner.simulator._next.ready) == 4  # the next problem's points were planned
    assert by_planner.count(True) == 1, by_planner


def test_a_first_points_failed_compile_fails_it_and_no_job_outlives_it(monkeypatch):
    """A problem's first point whose own program fails to compile raises that failure once
    every compile job (its peers' and the next problem's) has ended; the peers' classes count
    as compiled, its own do not (they compile again at a next try)."""
    from experiments.runners import cp_simulate

    _row_checks_and_constant_timing(monkeypatch)
    simulator = cp_simulate.CPSimulator
    real_submit = simulator._submit
    jobs: list = []
    batches: list[int] = []

    class Fails:
        def compile(self):
            raise RuntimeError("cannot compile this one")

    def submit(self, lowered):
        if not batches:  # the first batch: the first point's own programs
            lowered = {key: Fails() for key in lowered}
        batches.append(len(lowered))
        out = real_submit(self, lowered)
        jobs.extend(out.values())
        return out

    monkeypatch.setattr(simulator, "_submit", submit)
    points = _two_problems()
    runner = _expecting(points)
    with pytest.raises(RuntimeError, match="cannot compile this one"):
        runner.run(points[0])
    # own, peers', then one per point of the next problem's four
    assert len(batches) == 6 and all(job.done() for job in jobs), batches
    state = runner.simulator
    compiled = state._compiled
    assert set(state._problem.ready[points[1].key, 0].classes.members) <= compiled
    own = state._prepare(state._problem, points[0], 0, state.ranks.resolve_impl(points[0], runner))
    assert not set(own.classes.members) & compiled


def test_a_point_says_why_its_classes_compiled_at_its_turn(monkeypatch):
    """A class whose compile ahead failed (here every program of the peers' batch at the
    problem's first point) compiles at its point's turn, and that point's record says why,
    per class: the stage, the error's type and first line. Points whose classes compiled
    ahead say nothing."""
    from experiments.runners import cp_simulate

    _row_checks_and_constant_timing(monkeypatch)
    simulator = cp_simulate.CPSimulator
    real_submit = simulator._submit
    batches: list[int] = []

    class Fails:
        def compile(self):
            raise RuntimeError("no room to compile\nthe rest of the message")

    def submit(self, lowered):
        batches.append(len(lowered))
        if len(batches) == 2:  # the peers' batch
            lowered = {key: Fails() for key in lowered}
        return real_submit(self, lowered)

    monkeypatch.setattr(simulator, "_submit", submit)
    points = _two_problems()
    runner = _expecting(points)
    results = [runner.run(points[0])]
    failed = {cp_simulate._digest(cls) for cls in runner.simulator._ahead_failed}
    results += [runner.run(p) for p in points[1:]]
    assert batches[1] > 0 and all(r["check"]["ok"] for r in results), batches
    said = [r["masks"][0]["simulation"].get("compiled_at_turn") or {} for r in results]
    assert not said[0] and not any(said[4:]), said  # compiled ahead: the first, the next's
    reported = [cls for s in said for cls in s]
    assert failed and sorted(reported) == sorted(failed), (failed, said)  # each once
    reasons = {why for s in said for why in s.values()}
    assert reasons == {"compile: RuntimeError: no room to compile"}, reasons
    assert not runner.simulator._ahead_failed


def test_a_point_not_made_ready_ahead_says_why(monkeypatch):
    """A point that could not be made ready ahead (here a peer's plan raises once, at the
    problem's first point) is made ready at its turn, and its record says why it was not
    before; the other points say nothing of it."""
    from experiments.runners import cp_simulate

    _row_checks_and_constant_timing(monkeypatch)
    simulator = cp_simulate.CPSimulator
    real_prepare = simulator._prepare
    points = _two_problems()
    refused: list[str] = []

    def prepare(self, problem, point, index, impl):
        if point.key == points[2].key and not refused:
            refused.append(point.key)
            raise RuntimeError("no memory for the plan\nthe rest")
        return real_prepare(self, problem, point, index, impl)

    monkeypatch.setattr(simulator, "_prepare", prepare)
    runner = _expecting(points)
    results = [runner.run(p) for p in points]
    assert refused and all(r["check"]["ok"] for r in results)
    said = [r["masks"][0]["simulation"].get("compiled_at_turn", {}) for r in results]
    assert said[2].get("point") == "made ready: RuntimeError: no memory for the plan", said
    assert not any("point" in s for i, s in enumerate(said) if i != 2), said


def test_a_problems_checks_run_once_its_programs_compiled(monkeypatch):
    """A problem's first point checks its points (its own and its peers') only once the
    problem's step programs have compiled, however slowly they do: none of their compile
    jobs is running at any emulation of the ranks."""
    import threading
    import time

    from experiments.runners import cp_simulate
    from experiments.runners.cp_ranks_jax import JaxRanks

    _row_checks_and_constant_timing(monkeypatch)
    simulator = cp_simulate.CPSimulator
    real_submit, real_emulate = simulator._submit, JaxRanks.emulate
    this_problem: list = []  # its compile jobs
    running: list[bool] = []  # at each emulation: whether one of them was running

    class Slow:
        def __init__(self, lowered):
            self.lowered = lowered

        def compile(self):
            time.sleep(0.3)
            return self.lowered.compile()

    def submit(self, lowered):
        if threading.current_thread().name.startswith("planner"):  # the next problem's
            return real_submit(self, lowered)
        out = real_submit(self, {key: Slow(low) for key, low in lowered.items()})
        this_problem.extend(out.values())
        return out

    def emulate(self, r, u, rows=None):
        running.append(not all(job.done() for job in this_problem))
        return real_emulate(self, r, u, rows)

    monkeypatch.setattr(simulator, "_submit", submit)
    monkeypatch.setattr(JaxRanks, "emulate", emulate)
    points = _two_problems()
    runner = _expecting(points)
    assert runner.run(points[0])["check"]["ok"]
    assert this_problem and running and not any(running), running


def test_checks_run_ahead_record_what_checks_at_each_turn_record(monkeypatch):
    """Points checked at their problem's first point (compile threads) and points checked at
    their own turn (none) give the same records: checks, predictions, calls, and the forward
    outs taken from the forward+backward points."""
    from experiments.runners.jax_runner import JaxRunner

    _row_checks_and_constant_timing(monkeypatch)
    points = _two_problems((256,))

    def records(threads: int) -> list[dict]:
        runner = JaxRunner(sim_compile_threads=threads)
        runner.expect(points)
        out = []
        for i, p in enumerate(points):
            r = runner.run(p)
            if i == 0:  # with compile threads, the problem's other points checked now
                assert len(runner.simulator._problem.checked) == (3 if threads else 0)
            (m,) = r["masks"]
            s = m["simulation"]
            out.append(
                (r["check"], r["metrics"]["time_ms"], s["check_ranks"],
                 s["check_forwards_taken"], s["calls"], s["rank_compute_ms"])
            )  # fmt: skip
        return out

    ahead, each = records(2), records(0)
    assert all(r[0]["ok"] for r in ahead)
    assert any(r[3] for r in ahead), "a forward point took its forward+backward point's outs"
    assert ahead == each


def test_a_peer_whose_check_fails_ahead_fails_at_its_own_turn(monkeypatch):
    """A peer's check run at its problem's first point that comes out wrong, or raises, fails
    the peer at its own turn, into its own record (a raise: the peers after it check at their
    turns); every point is checked once; the first point and the others are ok. A sticky
    device fault in a check ahead fails the first point at once, naming the peer."""
    import dataclasses

    from experiments.core.outcomes import ERROR, WRONG, PointFailure
    from experiments.runners import cp_simulate

    _row_checks_and_constant_timing(monkeypatch)
    real = cp_simulate.check_ranks
    checked: list[str] = []
    raised = ["cannot check this one"]

    def flawed(ranks, point, mask, index, rtol, known=None):
        checked.append(point.key)
        check, ranks_checked = real(ranks, point, mask, index, rtol, known)
        if point.cp == "ring" and point.mode == "fwd_bwd":
            return dataclasses.replace(check, ok=False, message="made wrong"), ranks_checked
        if point.cp == "allgather" and point.mode == "fwd":
            raise RuntimeError(raised[0])
        return check, ranks_checked

    monkeypatch.setattr(cp_simulate, "check_ranks", flawed)
    points = _two_problems((256,))  # allgather fwd_bwd, ring fwd_bwd, allgather fwd, ring fwd
    runner = _expecting(points)
    assert runner.run(points[0])["check"]["ok"]
    assert set(runner.simulator._problem.checked) == {(p.key, 0) for p in points[1:3]}
    with pytest.raises(PointFailure) as wrong:
        runner.run(points[1])
    assert wrong.value.status == WRONG and "made wrong" in wrong.value.reason
    with pytest.raises(PointFailure) as error:
        runner.run(points[2])
    assert error.value.status == ERROR and "cannot check this one" in error.value.reason
    assert runner.run(points[3])["check"]["ok"]
    assert checked == [p.key for p in points]  # each once, the last at its own turn

    raised[0] = "CUDA_ERROR_ILLEGAL_ADDRESS: the device is gone"
    runner = _expecting(points)
    with pytest.raises(PointFailure) as fault:
        runner.run(points[0])
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in fault.value.reason
    assert points[2].key in fault.value.reason


def test_no_work_ahead_near_the_end_of_the_time_budget(monkeypatch):
    """With less than AHEAD_MIN_S of the time budget left, a problem's first point checks none
    of its peers and prepares nothing of the next problem (work a budget ending before their
    turn would lose); with more, it does both."""
    from experiments.core import interrupt
    from experiments.runners import cp_simulate
    from experiments.runners.jax_runner import JaxRunner

    _row_checks_and_constant_timing(monkeypatch)
    for left, ahead in ((cp_simulate.AHEAD_MIN_S - 1, False), (cp_simulate.AHEAD_MIN_S + 1, True)):
        monkeypatch.setattr(interrupt, "remaining_s", lambda left=left: left)
        points = _two_problems()
        runner = JaxRunner()
        runner.expect(points)
        assert runner.run(points[0])["check"]["ok"]
        assert bool(runner.simulator._problem.checked) == ahead
        assert (runner.simulator._next is not None) == ahead


def test_the_next_problems_seconds_of_every_mask_go_to_its_first_point(monkeypatch):
    """A point of several masks looks ahead once per mask: the seconds it waited for the next
    problem's plans past its checks (here each mask's plans end 0.2 s after its checks) add
    up, and the next problem's first point's record carries them."""
    import dataclasses
    import time

    from experiments.runners import cp_simulate

    _row_checks_and_constant_timing(monkeypatch)
    simulator = cp_simulate.CPSimulator
    real, real_ahead = simulator._next_ready, simulator._check_ahead
    checked = [0]  # masks whose checks ran

    def check_ahead(self, peers, index):
        real_ahead(self, peers, index)
        checked[0] += 1

    def slow_next_ready(self, point, index):
        deadline = time.monotonic() + 120
        while checked[0] <= index and time.monotonic() < deadline:
            time.sleep(0.01)
        assert checked[0] > index, "the next problem's plans were made before the checks"
        time.sleep(0.2)
        return real(self, point, index)

    monkeypatch.setattr(simulator, "_check_ahead", check_ahead)
    monkeypatch.setattr(simulator, "_next_ready", slow_next_ready)
    points = [dataclasses.replace(p, num_masks=2) for p in _two_problems()]
    runner = _expecting(points)
    runner.run(points[0])
    assert 0.4 <= runner.simulator._next.ahead_s["plan"] < 5  # both masks' wait, no more
    for p in points[1:4]:
        runner.run(p)
    walls = [m["simulation"]["wall_s"] for m in runner.run(points[4])["masks"]]
    assert 0.4 <= walls[0]["plan"] < 5 and not runner.simulator._problem.ahead_s  # charged once


def test_a_plan_that_cannot_be_made_is_asked_once_per_problem(monkeypatch):
    """A plan the executor refuses (a ValueError) makes each point of it unsupported, and is
    asked for once per problem, not again at each point or when made ready ahead."""
    from experiments.core.outcomes import UNSUPPORTED, PointFailure
    from experiments.runners.cp_ranks_jax import JaxRanks

    _row_checks_and_constant_timing(monkeypatch)
    real, asked = JaxRanks.executor_plan, []

    def refused(point, mask, impl):
        if point.cp == "ring":
            asked.append(point.key)
            raise ValueError("no ring here")
        return real(point, mask, impl)

    monkeypatch.setattr(JaxRanks, "executor_plan", staticmethod(refused))
    points = _two_problems()
    runner = _expecting(points)
    for p in points:
        if p.cp == "ring":
            with pytest.raises(PointFailure) as e:
                runner.run(p)
            assert e.value.status == UNSUPPORTED and "no ring here" in e.value.reason
        else:
            assert runner.run(p)["check"]["ok"]
    assert len(asked) == 2  # one plan (both modes) of each problem


def test_simulated_points_on_one_cpu_device(monkeypatch):
    """The runner end to end (one test, so its compiled step functions are shared)."""
    from experiments.runners.jax_runner import JaxRunner

    runner = JaxRunner()
    _real_timing(runner)
    with monkeypatch.context() as m:
        _row_check(runner, m)
    _parts_add_up(JaxRunner(), monkeypatch)  # fresh timings: every call faked
    with monkeypatch.context() as m:
        _modelled_equals_timed(m)
    with monkeypatch.context() as m:
        _long_calls_modelled_across_shapes(m)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_full_pieces_call_is_timed_once_at_every_layout(framework):
    """A full mask's all-gather ranks get the same piece at every layout, as one slice
    (contiguous) or one per query chunk (zigzag, balanced): the first point times it, the
    others take its time (at 64 GPUs x 32K tokens such a call is 5 s forward, 18 s backward)."""
    from experiments.runners.jax_runner import JaxRunner
    from experiments.runners.torch_runner import TorchRunner

    runner = (JaxRunner if framework == "jax" else TorchRunner)()
    timed = []
    for layout in ("contiguous", "zigzag", "balanced"):
        point = _point("allgather", 4, "fwd", sim.LinkModel(), "full", layout, 64, framework)
        result = runner.run(point)
        assert result["check"]["ok"]
        sim_ = result["masks"][0]["simulation"]
        timed.append(sim_["calls"]["timed"])
        for call in sim_["timed_calls"]:  # the run before the samples, where one was not
            assert isinstance(call["warm"], bool)
            assert call["first_run"] != (call.get("untimed_ms", 0) > 0), call
    assert timed[0] > 0 and timed[1:] == [0, 0], timed


def test_calls_timed_by_a_failed_point_are_listed_by_the_next_record(monkeypatch):
    """A point of two masks that fails on its second after timing the calls of both (here: the
    second mask's schedule replay raises) leaves them to the next point's record, which lists
    them, marked carried, beside its own, each once."""
    from experiments.runners.jax_runner import JaxRunner
    from shard_strategies import simulate

    first, second = (
        dataclasses.replace(
            _point("ring", 4, "fwd", sim.LinkModel(), "causal_document", layout=lay, seqlen=16),
            num_masks=2,
        )
        for lay in ("contiguous", "zigzag")
    )
    alone = [
        c["id"] for m in JaxRunner().run(first)["masks"] for c in m["simulation"]["timed_calls"]
    ]
    runner = JaxRunner()
    real, replays = simulate.predict, []

    def second_mask_fails(sched, *args, **kwargs):
        replays.append(sched)
        if len({id(s) for s in replays}) > 1:
            raise OSError("replay")
        return real(sched, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(simulate, "predict", second_mask_fails)
        with pytest.raises(OSError, match="replay"):
            runner.run(first)
    masks = runner.run(second)["masks"]
    logged = [c for m in masks for c in m["simulation"]["timed_calls"]]
    carried = [c["id"] for c in masks[0]["simulation"]["timed_calls"] if c.get("carried")]
    assert len(alone) > 2 and sorted(carried) == sorted(alone)
    ids = [c["id"] for c in logged]
    assert len(ids) == len(set(ids)) > len(carried)  # each once, and its own beside them
    assert runner.run(second)["masks"][0]["simulation"]["timed_calls"] == []  # listed already


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_simulated_calls_are_timed_as_the_point_asks(monkeypatch, framework):
    """A point with --chain_ms times its ranks' calls in chains of that length (the device's
    time a call), as its baseline; a point of the same problem timed one call at a time shares
    no timing with it: each times its own calls."""
    from experiments.runners import cp_simulate, timing
    from experiments.runners.jax_runner import JaxRunner
    from experiments.runners.torch_runner import TorchRunner

    name = f"{framework}_time_calls"
    real, chains = getattr(timing, name), []

    def spy(*args, chain_ms=0.0, **kwargs):
        chains.append(chain_ms)
        return real(*args, chain_ms=chain_ms, **kwargs)

    monkeypatch.setattr(cp_simulate.timing, name, spy)
    one = _point("ring", 4, "fwd", sim.LinkModel(), "causal", seqlen=16, framework=framework)
    runner = (JaxRunner if framework == "jax" else TorchRunner)()
    counts = {}
    for chain_ms in (3, 0):
        point = dataclasses.replace(one, chain_ms=chain_ms)
        chains.clear()
        result = runner.run(point)
        assert result["check"]["ok"]
        counts[chain_ms] = result["masks"][0]["simulation"]["calls"]["timed"]
        assert counts[chain_ms] > 0 and set(chains) == {chain_ms}, chains
    assert counts[3] == counts[0]  # the second timed its own calls, none shared


def test_a_failed_points_baseline_seconds_go_to_the_next_point():
    """A point that fails after running its baseline (Ulysses over more devices than heads)
    leaves the baseline's seconds to the next point of the same problem, which reports them;
    a later point sharing the baseline reports none."""
    from experiments.core.outcomes import PointFailure
    from experiments.runners.cp_simulate import kernel_point
    from experiments.runners.jax_runner import JaxRunner

    runner = JaxRunner()
    failing = _point("ulysses", 8, "fwd", sim.LinkModel(), "causal", seqlen=16)
    with pytest.raises(PointFailure) as e:
        runner.run(failing)
    assert e.value.status == "unsupported"
    sims = []
    for cp in ("ring", "allgather"):
        result = runner.run(_point(cp, 4, "fwd", sim.LinkModel(), "causal", seqlen=32))
        sims.append(result["masks"][0]["simulation"])
    base = sims[0]["single_device"]
    assert base["status"] == "ok" and base["key"] == kernel_point(failing, sims[0]["impl"]).key
    assert sims[0]["wall_s"]["baseline"] > 0 and sims[1]["wall_s"]["baseline"] == 0


def test_a_problem_above_the_cap_takes_its_masks_rate_at_the_cap():
    """128 tokens with the cap at 64: no 128-token baseline runs; the record's baseline is the
    whole mask at 64 tokens (status scaled, its length and reason given), the same run the
    64-token problem reports as its own, and efficiency is measured against its TFLOP/s."""
    from experiments.runners.jax_runner import JaxRunner

    runner = JaxRunner(sim_baseline_max_seqlen=64)
    run, single = runner.run, []

    def recording(point):
        single.extend([] if point.simulated else [point.seqlen_total])
        return run(point)

    runner.run = recording
    long = runner.run(_point("ring", 4, "fwd", sim.LinkModel(), "causal", seqlen=32))
    short = runner.run(_point("ring", 2, "fwd", sim.LinkModel(), "causal", seqlen=32))
    assert single == [64], "one baseline, at the cap"
    scaled = long["masks"][0]["simulation"]["single_device"]
    own = short["masks"][0]["simulation"]["single_device"]
    assert (scaled["status"], scaled["seqlen"], own["status"], own["seqlen"]) == (
        "scaled",
        64,
        "ok",
        64,
    )
    assert "128 tokens > --sim_baseline_max_seqlen=64" in scaled["reason"]
    assert scaled["key"] == own["key"] and scaled["tflops"] == own["tflops"] > 0
    assert "time_ms" not in scaled, "no time of the 128-token problem was measured"
    assert long["metrics"]["efficiency_pct"] == pytest.approx(
        100 * long["metrics"]["tflops"]["median"] / scaled["tflops"]
    )
    assert long["metrics"]["single_device_status"] == "scaled"


# ----------------------------------------------------------------------------- torch runner


def _documents(monkeypatch) -> None:
    """Points get their named mask with four uneven documents (the generator's draw at these
    lengths is one document)."""
    from experiments.runners import cp_simulate

    monkeypatch.setattr(
        cp_simulate.frameworks, "make_masks", lambda p: [named_mask(p.mask, p.seqlen_total)]
    )


def _torch_point(strategy, mode, mask, seqlen=64, **kw):
    """A simulated torch point on 4 devices with fresh inputs (seed 3)."""
    p = _point(strategy, 4, mode, sim.LinkModel(), mask, seqlen=seqlen, framework="torch", **kw)
    return dataclasses.replace(p, seed=3)


def _dense_out(q, k, v, mask) -> np.ndarray:
    """Float64 attention output by a dense softmax (GQA: query head h reads K/V head h // g)."""
    g = q.shape[2] // k.shape[2]
    k, v = (np.repeat(x.astype(np.float64), g, axis=2) for x in (k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k) / np.sqrt(q.shape[-1])
    s = np.where(mask.dense()[None, None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    p /= np.maximum(p.sum(axis=-1, keepdims=True), 1e-300)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def test_torch_flex_calls_of_other_interval_widths_are_other_classes():
    """FlexAttention compiles its mask_mod for a piece's interval columns (interval_width), so
    the PyTorch ranks' call shape (a class: one compiled program) holds them: a block-sparse
    mask's untrimmed flex pieces share rows and columns but not widths, and each class holds one
    width."""
    from attn_masks import uniform_block_sparse
    from experiments.runners.cp_ranks_torch import TorchRanks
    from experiments.runners.torch_runner import TorchRunner
    from torch_attn.flex import interval_width

    point = _torch_point("ring", "fwd", "full", layout="contiguous")
    mask = uniform_block_sparse(point.seqlen_total, 8, 0.5, seed=4)
    plan = TorchRanks.executor_plan(point, mask, "flex")
    ranks = TorchRanks(plan, "flex", point, 0, TorchRunner())
    by_span: dict[tuple, set[int]] = {}  # (rows, columns, fresh) -> widths
    by_class: dict[tuple, set[int]] = {}  # call shape -> widths
    for r, row in enumerate(ranks.pieces):
        for t, piece in enumerate(row):
            if piece is not None:
                shape, width = ranks.call_shape(r, t), interval_width(piece.mask)
                by_span.setdefault(shape[:3], set()).add(width)
                by_class.setdefault(shape, set()).add(width)
    assert any(len(widths) > 1 for widths in by_span.values())
    assert all(len(widths) == 1 for widths in by_class.values())


def test_torch_ranks_are_the_torch_executors_work(monkeypatch):
    """Every rank of ring, all-gather, Ulysses and USP on 4 simulated devices, causal and a
    document mask, forward and backward: the record's check of the whole problem against float64
    attention passes, and each rank's output rows equal a dense float64 softmax of its own rows
    and heads; every non-empty piece of every rank is one call per direction, empty ones none."""
    from experiments.runners.cp_ranks_torch import TorchRanks
    from experiments.runners.torch_runner import TorchRunner

    _documents(monkeypatch)
    runner = TorchRunner()
    for strategy in ("ring", "allgather", "ulysses", "usp"):
        for mask_name in ("causal", "causal_document"):
            point = _torch_point(strategy, "fwd_bwd", mask_name)
            result = runner.run(point)
            check, s = result["check"], result["masks"][0]["simulation"]
            assert check["ok"] and check["kind"] == "full", (strategy, mask_name, check)
            assert set(check["max_errors"]) == {"out", "dq", "dk", "dv"}
            assert max(check["max_errors"].values()) < 1e-5
            assert s["check_ranks"] == [0, 1, 2, 3] and s["impl"] == "naive"
            mask = named_mask(mask_name, point.seqlen_total)
            plan = TorchRanks.executor_plan(point, mask, "naive")
            ranks = TorchRanks(plan, "naive", point, 0, runner)
            calls = sum(p is not None for row in ranks.pieces for p in row)
            assert s["calls"]["total"] == 2 * calls * plan.ulysses_size
            # its timed calls are logged at a trimmed piece's rows and columns (or the whole
            # shard's, the local core's)
            spans = {
                (p.rows.stop - p.rows.start, p.cols.stop - p.cols.start)
                for row in ranks.pieces
                for p in row
                if p is not None
            } | {(plan.shard_len, plan.shard_len)}
            logged = s["timed_calls"]
            assert logged and {(c["q"], c["k"]) for c in logged} <= spans
            assert all("full" not in c and c["area"] > 0 for c in logged)  # no tile maps
            for g in range(plan.world_size):
                r, u = plan.ring_rank(g), plan.ulysses_rank(g)
                pos = plan.layout.positions[r]
                real = pos[pos < mask.seqlen_q]
                q, k, v = (ranks.host(n) for n in ("q", "k", "v"))
                want = _dense_out(q, k, v, mask)[:, real][:, :, ranks.q_heads[u]]
                got = ranks.emulate(r, u)["out"][:, pos < mask.seqlen_q]
                assert np.abs(got - want).max() < 1e-5, (strategy, mask_name, g)


def test_torch_forwards_shared_between_modes_are_equal(monkeypatch):
    """Where the PyTorch ranks say their forward is the same in both modes (every core but the
    local one, whose forward+backward runs under autograd), a forward emulation gives the out of
    the forward+backward one, which a forward point then takes (Ranks.emulated)."""
    from experiments.runners.cp_ranks_torch import TorchRanks
    from experiments.runners.torch_runner import TorchRunner

    _documents(monkeypatch)
    runner = TorchRunner()
    mask = named_mask("causal_document", 64)
    for strategy, shared in (("ring", True), ("allgather", True), ("ulysses", False)):
        ranks = {}
        for mode in ("fwd", "fwd_bwd"):
            point = _torch_point(strategy, mode, "causal_document")
            plan = TorchRanks.executor_plan(point, mask, "naive")
            ranks[mode] = TorchRanks(plan, "naive", point, 0, runner)
        assert [r.shares_forward() for r in ranks.values()] == [shared] * 2, strategy
        if shared:
            for g in range(plan.world_size):
                r, u = plan.ring_rank(g), plan.ulysses_rank(g)
                outs = [ranks[m].emulate(r, u)["out"] for m in ranks]
                np.testing.assert_array_equal(*outs)


def test_torch_rows_check_and_empty_pieces(monkeypatch):
    """Above the whole-check size the torch ranks are checked at sampled rows, drawing no more
    than a rank's queries (the timed calls nothing); a mask with empty rows and pieces (some
    steps of some ranks make no call) still passes."""
    from experiments.runners import checks
    from experiments.runners.cp_ranks_torch import TorchRanks
    from experiments.runners.torch_runner import TorchRunner

    monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 1)
    draws = _record_draws(monkeypatch, TorchRanks)
    point = _torch_point("ring", "fwd_bwd", "causal", layout="contiguous")
    result = TorchRunner().run(point)
    assert result["check"]["ok"] and result["check"]["kind"] == "rows"
    assert result["masks"][0]["simulation"]["check_ranks"] == [0, 3]
    _assert_rank_sized(draws, point.seqlen_total, 4)
    monkeypatch.undo()
    from experiments.runners import cp_simulate

    monkeypatch.setattr(
        cp_simulate.frameworks, "make_masks", lambda p: [random_slices_mask(p.seqlen_total, 5)]
    )
    result = TorchRunner().run(_torch_point("ring", "fwd_bwd", "causal", layout="contiguous"))
    sim_ = result["masks"][0]["simulation"]
    assert result["check"]["ok"] and result["check"]["kind"] == "full"
    assert 0 < sim_["calls"]["total"] < 2 * 4 * result["masks"][0]["plan"]["num_steps"]


def test_a_wrong_torch_step_makes_the_point_wrong(monkeypatch):
    """The check checks: a forward step that drops a rank's first piece, or a backward step
    whose dq is off by 1%, makes the simulated point wrong before anything is timed."""
    from experiments.core.outcomes import WRONG, PointFailure
    from experiments.runners.cp_ranks_torch import TorchRanks
    from experiments.runners.torch_runner import TorchRunner
    from shard_strategies import torch_cp

    def untimed(*args):
        raise AssertionError("no call of a wrong point is timed")

    forward, backward = torch_cp.forward_step, torch_cp.backward_step
    seen = []

    def drop_first(merge, q, kv, piece, scale, impl):
        seen.append(piece)
        if len(seen) > 1:
            forward(merge, q, kv, piece, scale, impl)

    def off_dq(*args):
        grads = backward(*args)
        return None if grads is None else (grads[0] * 1.01, grads[1])

    for name, fake, mode, tensor in (
        ("forward_step", drop_first, "fwd", "out"),
        ("backward_step", off_dq, "fwd_bwd", "dq"),
    ):
        with monkeypatch.context() as m:
            m.setattr(torch_cp, name, fake)
            m.setattr(TorchRanks, "time", untimed)
            with pytest.raises(PointFailure) as e:
                TorchRunner().run(_torch_point("ring", mode, "causal"))
        assert e.value.status == WRONG and tensor in e.value.reason, e.value.reason
        assert not e.value.details["check"]["ok"]


def test_torch_and_jax_predict_the_same_strategy_schedule():
    """On a CPU both executors plan without tile padding: for every strategy the torch and JAX
    executors' plans hold the same tokens and pieces, and their schedules the same strategy
    phases (calls per rank and step) and transfers; only the global entry point differs (torch:
    the output, and the gradients in one collective, all-gathered from replicated inputs)."""
    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.cp_ranks_torch import TorchRanks

    n, itemsize, batch = 4, 4, 1
    for strategy in ("ring", "allgather", "ulysses", "usp", "double_ring"):
        point = _point(strategy, n, "fwd_bwd", sim.LinkModel(), seqlen=32, framework="torch")
        mask = named_mask("causal_document", point.seqlen_total)
        jp = JaxRanks.executor_plan(point, mask, "reference")
        tp = TorchRanks.executor_plan(point, mask, "naive")
        assert np.array_equal(jp.positions, tp.positions)
        assert [(s.outer, s.inner) for s in jp.steps] == [(s.outer, s.inner) for s in tp.steps]
        assert np.array_equal(jp.piece_area, tp.piece_area)
        scheds = [
            sim.schedule(p, "fwd_bwd", itemsize=itemsize, entry=e)
            for p, e in ((jp, sim.EXCHANGE), (tp, sim.REPLICATED))
        ]
        own = [
            [
                (ph.name, ph.call, ph.step, ph.group_start)
                + tuple(
                    tuple((kind, sc.transfers[k]) for kind, k in ev) for ev in (ph.before, ph.after)
                )
                for ph in sc.phases
                if ph.part == sim.STRATEGY
            ]
            for sc in scheds
        ]
        assert own[0] == own[1] and own[0]
        moved = [[t for t in sc.transfers if t.part == sim.STRATEGY] for sc in scheds]
        assert moved[0] == moved[1]
        torch_entry = [t for t in scheds[1].transfers if t.part == sim.DISPATCH]
        assert [(t.op, t.group, t.direction) for t in torch_entry] == [
            (sim.ALL_GATHER, "world", "fwd"),
            (sim.ALL_GATHER, "world", "bwd"),
        ]
        shards = (n - 1) * tp.local_len * D * itemsize * batch
        assert torch_entry[0].nbytes == shards * HQ
        assert torch_entry[1].nbytes == shards * (HQ + 2 * HKV)


# ------------------------------------------------------------------------------- driver


def test_driver_writes_simulated_records(tmp_path, capsys):
    from experiments import run
    from experiments.core.results import read_records

    args = [
        "--framework=jax",
        "--cp=ulysses",
        "--layout=zigzag",
        "--mask=causal",
        "--seqlen=16",
        "--heads_q=2",
        "--heads_kv=1",
        "--head_dim=16",
        "--dtype=fp32",
        "--mode=fwd",
        "--warmup=0",
        "--iters=1",
        "--simulate_devices=2,4",
        f"--out_dir={tmp_path}",
    ]
    for fw in ("jax", "torch"):
        out = tmp_path / fw
        assert run.run_cli([*args[1:-1], f"--framework={fw}", f"--out_dir={out}"]) == 0
        recs = {
            (r["point"]["cp"], r["point"]["num_devices"]): r
            for r in read_records(out / "results.jsonl")
        }
        assert set(recs) == {("ulysses", 2), ("ulysses", 4)}
        for (_, n), r in recs.items():
            assert r["simulated"] is True and r["point"]["simulated"] is True
            assert r["point"]["framework"] == fw
            assert r["point"]["seqlen_total"] == 16 * n and "-sim-g8-" in r["key"]
            assert r["status"] == ("unsupported" if n == 4 else "ok"), r["reason"]
            assert r["status"] != "ok" or r["check"]["ok"]
        # where the ok point's seconds went: every part measured, within the point's own time,
        # the baseline (its first point of the mask) included, and said on its progress line
        wall = recs["ulysses", 2]["masks"][0]["simulation"]["wall_s"]
        assert set(wall) == {"baseline", "plan", "compile", "emulate", "reference", "calls"}
        assert all(secs > 0 for p, secs in wall.items() if p != "compile"), wall
        assert wall["compile"] >= 0.0  # PyTorch compiles nothing ahead
        rounding = 0.0005 * (len(wall) + 1)  # each part and the point's time kept to the ms
        assert sum(wall.values()) <= recs["ulysses", 2]["elapsed_s"] + rounding
        printed = capsys.readouterr().out
        assert "ok predicted" in printed and f"[baseline {wall['baseline']:.1f} s, plan" in printed
        report = (out / "report.md").read_text()
        assert "## Predicted context parallelism" in report
        assert "| causal | 4 | unsup. |" in report
        assert "Cost model: not used (every distinct call was timed)." in report
        assert "Predictor cost: 1 point took" in report
    assert run.run_cli([*args[1:-1], "--framework=both", f"--out_dir={tmp_path}"]) != 0
    err = capsys.readouterr().err
    assert "use --framework=jax or --framework=torch (got --framework=jax/torch)" in err


def test_report_states_the_cost_models_error(tmp_path):
    from experiments.reports import report_sim

    model = {
        "held_out_calls": 4,
        "error_quantile": 90,
        "quantile_error_pct": 2.5,
        "max_error_pct": 3.25,
    }
    records = [
        {"masks": [{"simulation": {"calls": {"modelled": 30, "timed": 10, "model": model}}}]},
        {"masks": [{"simulation": {"calls": {"modelled": 0, "timed": 5}}}]},
        {"status": "error", "masks": None},
    ]
    line = report_sim.model_error(records)[0]
    assert "30 distinct calls predicted from their tiles" in line
    assert "15 timed for it or alone; on 4 timed calls held out" in line
    assert "at most 2.5% at the 90th percentile" in line and "(largest single error 3.2%)" in line
    assert "Pooled" not in line  # records from before the held-out times were kept
    assert report_sim.model_error(records[1:])[0].startswith("Cost model: not used")
    # two points stating the same check and one of its own: three calls, each counted once
    pairs = [[[11.0, 10.0], [20.0, 20.0]], [[11.0, 10.0], [20.0, 20.0]], [[27.0, 30.0]]]
    calls = [{"modelled": 5, "model": {**model, "held_out_ms": p}} for p in pairs]
    pooled = [{"masks": [{"simulation": {"calls": c}}]} for c in calls]
    line = report_sim.model_error(pooled)[0]
    expected = np.percentile([10.0, 0.0, 10.0], 90)
    assert "Pooled over the 3 masks that list their held-out calls, the 3 distinct" in line
    assert f"{expected:.1f}% at the 90th percentile, 33% of them predicted slower" in line
    assert line.endswith("than measured (plots/cost_model_held_out.png).")
    listing, pairs = report_sim.held_out_pairs(pooled)
    assert listing == 3 and pairs.tolist() == [[11.0, 10.0], [20.0, 20.0], [27.0, 30.0]]
    plot = report_sim.held_out_plot(pooled, tmp_path)
    assert plot == tmp_path / "plots" / "cost_model_held_out.png" and plot.stat().st_size > 0
    assert report_sim.held_out_plot(records, tmp_path / "none") is None  # no pairs listed
    none_checked = {"modelled": 12, "timed": 8, "unchecked": 12}
    line = report_sim.model_error([{"masks": [{"simulation": {"calls": none_checked}}]}])[0]
    assert line.endswith(
        "no held-out error in these records (no class's model checked on held-out calls at "
        "their points)."
    )
    # calls predicted in classes whose model no held-out call checked are counted apart
    records[0]["masks"][0]["simulation"]["calls"]["unchecked"] = 12
    records[0]["masks"][0]["simulation"]["calls"].update(idle=3, recorded=5)
    line = report_sim.model_error(records)[0]
    assert "27 distinct calls predicted from their tiles" in line  # 30 modelled, 3 idle
    assert line.endswith(
        "(largest single error 3.2%). 12 of the predicted calls belong to classes whose model "
        "was not checked on held-out calls (--sim_validation_share checks a share of the "
        "classes); the error is that of the checked classes' models. 3 more calls hold no tile "
        "and took the time of one such call of their class. 5 calls took the times that "
        "earlier processes of the run recorded (a resumed run)."
    )


def test_bad_simulation_flags_fail_in_one_line(tmp_path):
    from experiments import run

    for bad, expected in [
        (
            "--simulate_devices=1",
            "bad --simulate_devices value '1': expected an integer from 2 to 128",
        ),
        ("--simulate_devices=8,200", "value '200'"),
        ("--simulate_devices=x", "value 'x'"),
        ("--link_p2p_gbps=0", "bad --link_p2p_gbps=0: expected GB/s > 0"),
        ("--link_latency_us=-2", "bad --link_latency_us=-2"),
        ("--gpus_per_node=0", "bad --gpus_per_node=0: expected an integer from 1"),
        ("--sim_timed_calls=-1", "--sim_timed_calls=-1: -1 is not a non-negative integer"),
        ("--sim_timed_calls=3", "bad --sim_timed_calls=3: expected 0 (time every call) or at"),
        ("--sim_timed_calls=3", "or at least 4"),
        ("--sim_compile_threads=-1", "--sim_compile_threads=-1: -1 is not a non-negative"),
        ("--sim_validation_share=0", "bad --sim_validation_share=0.0: expected a share in (0, 1]"),
        ("--sim_validation_share=1.5", "bad --sim_validation_share=1.5: expected a share in"),
    ]:
        with pytest.raises(Exception, match=re.escape(expected)):
            run.run_cli([bad, f"--out_dir={tmp_path}"])
    res = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), "--simulate_devices=129"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    fatal, hint = res.stderr.strip().splitlines()
    assert res.returncode != 0 and "value '129': expected an integer from 2 to 128" in fatal
    assert hint == "Pass --helpshort or --helpfull to see help on flags."


# ------------------------------------------------------------------------------- report


def _record(strategy: str, n: int, ms: float, *, simulated: bool, status: str = "ok") -> dict:
    """A driver record of a CP point (simulated or measured) taking `ms` per call."""
    from experiments.core.points import Grid, expand
    from experiments.core.sweep import make_record

    grid = Grid(
        "g",
        (strategy,),
        ("zigzag",),
        ("default",),
        ("causal",),
        (64,),
        ((4, 2),),
        16,
        "fp32",
        ("fwd",),
    )
    (p,) = expand(
        grid, "jax", ("default",), seed=0, num_devices=n, ulysses_size=None, ulysses_intra_node=True
    )
    if simulated:
        p = dataclasses.replace(p, simulated=True, link=sim.LinkModel().spec(), grid="sim")
    if status != "ok":
        return make_record(p, status, reason="not applicable")
    times = {"median": ms, "p20": ms, "p80": ms}
    detail = {
        "impl": "reference",
        "time_ms": {
            "total": ms,
            "strategy": ms - 1.0,
            "dispatch": 1.0,
            "slowest_compute": ms - 2.0,
            "exposed_comm": 1.0,
        },
        "phases": [
            {
                "name": "fwd step 0",
                "part": "strategy",
                "ms": ms - 1.0,
                "compute_ms": [ms - 2.0] * n,
                "exposed_ms": [1.0] * n,
            }
        ],
        "single_device": {"status": "ok", "tflops": 2.0, "time_ms": 1.0},
        "calls": {"total": n, "distinct": 1},
    }
    result = {
        "metrics": {
            "time_ms": times,
            "tflops": {q: 1.0 / ms for q in times},
            "efficiency_pct": 50.0 / ms,
            "load_imbalance": 1.0,
        },
        "check": {"ok": True, "kind": "full", "max_errors": {"out": 1e-7}},
        "masks": [{"simulation": detail, "comm": {"fwd_bytes": 8.0, "bwd_bytes": 16.0}}],
    }
    return make_record(p, "ok", result=result)


def test_report_predicts_and_compares_with_measured(tmp_path):
    """The report's predicted section (unsupported labelled), its plot, and predicted vs
    measured matched by configuration: a measured point of another layout or size is left out."""
    import json

    from experiments.reports import report, report_sim

    sims = [
        _record("ring", 4, 10.0, simulated=True),
        _record("ring", 8, 12.0, simulated=True),
        _record("ulysses", 8, 0.0, simulated=True, status="unsupported"),
    ]
    measured = [_record("ring", 4, 11.0, simulated=False), _record("ring", 2, 5.0, simulated=False)]
    measured[1]["point"]["layout"] = "balanced"
    for name, recs in (("sim.jsonl", sims), ("gpus.jsonl", measured)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = report.write_report(tmp_path / "sim.jsonl", tmp_path / "rep", tmp_path / "gpus.jsonl")
    (row,) = out["comparison"]
    assert (row["GPUs"], row["predicted ms"], row["measured ms"]) == (4, "10", "11")
    assert row["error"] == f"{100 * (10 / 11 - 1):+.1f}%" and row["within 10%"] == "yes"
    timed_apart = [{**measured[0], "metrics": {**measured[0]["metrics"], "dispatch_ms": {}}}]
    (row,) = report_sim.compare(sims, timed_apart)  # measured without its dispatch: strategy part
    assert (row["predicted ms"], row["measured ms"]) == ("9", "11")
    torch = [
        [{**r, "point": {**r["point"], "framework": "torch"}} for r in recs]
        for recs in (sims, timed_apart)
    ]
    (row,) = report_sim.compare(*torch)  # a torch point (dispatch timed apart) alike
    assert (row["predicted ms"], row["measured ms"]) == ("9", "11")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Predicted context parallelism" in md and "### Predicted vs measured" in md
    assert "| causal | 8 | 0.0833 (4%) | unsup. |" in md
    scaled = report_sim.flat_row(sims[1])
    scaled["single_gpu_status"] = "scaled"
    assert report_sim._cell(scaled) == "0.0833 (4%*)", "an efficiency at the cap is marked"
    assert "| causal | 4 | ring/zigzag | 0.1 | 8 / 1 / 1 | 1.00 |" in md
    assert any("predicted_fwd_causal" in p.name for p in out["plots"])
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "report.py"),
            f"--results={tmp_path / 'sim.jsonl'}",
            f"--compare_with={tmp_path / 'gpus.jsonl'}",
            f"--out_dir={tmp_path / 'rep2'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| 4 | causal | 64 | ring/zigzag | fwd | 10 | 11 | -9.1% | yes |" in res.stdout


def _collectives(hlo: str) -> dict[str, list[int]]:
    """Bytes of every all-gather / all-reduce / collective-permute result in compiled HLO."""
    sizes: dict[str, list[int]] = {}
    pattern = r"= (\(?[^=]*?\)?) (all-gather|all-reduce|collective-permute)(?:-start)?\("
    for shapes, op in re.findall(pattern, hlo):
        total = 0
        for dtype, dims in re.findall(r"(f32|bf16|f16|s32)\[([\d,]*)\]", shapes):
            count = math.prod(int(x) for x in dims.split(",") if x)
            total += count * (2 if dtype in ("bf16", "f16") else 4)
        sizes.setdefault(op, []).append(total)
    return sizes


def test_dispatch_model_matches_the_compiled_executor():
    """The executor's global entry point, compiled for 8 CPU devices on sequence-sharded inputs:
    its collectives are the schedule's (the exchange's ppermute rounds for q, k, v and out, one
    ppermute each of K and V per ring transfer; nothing gathered or reduced whole), so the
    dispatch the simulator charges is what XLA emits."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from shard_strategies import jax_cp

    n, s = 8, 8 * 32
    mask = named_mask("causal", s)
    mesh = Mesh(np.array(jax.devices()[:n]), ("cp",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "cp"))
    q = jax.device_put(jnp.zeros((1, s, HQ, D), jnp.float32), sharding)
    k = jax.device_put(jnp.zeros((1, s, HKV, D), jnp.float32), sharding)
    ex = jax_cp.build(
        mask, mesh=mesh, strategy="ring", num_heads_q=HQ, num_heads_kv=HKV, head_dim=D
    )
    hlo = jax.jit(lambda a, b, c: ex(a, b, c)).lower(q, k, k).compile().as_text()
    found = _collectives(hlo)
    assert set(found) == {"collective-permute"}, found
    sched = sim.schedule(ex.plan, "fwd", itemsize=4)
    moves = [t for t in sched.transfers if t.part == sim.DISPATCH]
    assert {(t.op, t.group) for t in moves} == {(sim.P2P, "world")}
    assert len(moves) == 4 * 2  # zigzag from the contiguous split: two rounds a tensor
    ring = [t for t in sched.transfers if t.part == sim.STRATEGY]
    assert len(found["collective-permute"]) == 2 * len(ring) + len(moves)
    assert sum(found["collective-permute"]) == pytest.approx(
        sum(t.nbytes for t in ring) + sum(t.nbytes for t in moves)
    )


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_device_rows_depend_only_on_the_position_and_head(framework):
    """A value drawn on the device is a function of (input, batch, token, head, dim) alone:
    any subset of positions (in any order, across chunk borders) and heads equals the same
    slice of the whole input, positions past the end are zeros, inputs differ, values are
    N(0, 1)."""
    from experiments.runners import inputs

    if framework == "jax":
        from experiments.runners.cp_ranks_jax import JaxRanks as ranks_type
        from experiments.runners.jax_runner import JaxRunner as runner_type
    else:
        from experiments.runners.cp_ranks_torch import TorchRanks as ranks_type
        from experiments.runners.torch_runner import TorchRunner as runner_type
    per_device = (2 * inputs.CHUNK + 100) // 4  # three chunks where the generator draws in chunks
    point = _point(
        "ring", 4, "fwd", sim.LinkModel(), "causal", seqlen=per_device, framework=framework
    )
    point = dataclasses.replace(point, seed=5)
    seqlen = point.seqlen_total
    mask = named_mask("causal", seqlen)
    runner = runner_type()
    impl = ranks_type.resolve_impl(point, runner)
    ranks = ranks_type(ranks_type.executor_plan(point, mask, impl), impl, point, 0, runner)
    whole = ranks.host("k")
    assert whole.shape == (1, seqlen, HKV, D)
    assert abs(whole.mean()) < 0.05 and abs(whole.std() - 1) < 0.05
    positions = np.array([seqlen + 3, inputs.CHUNK + 1, 0, seqlen - 1, inputs.CHUNK - 1, 7])
    heads = np.array([HKV - 1, 0])
    part = ranks.host("k", positions, heads)
    real = positions < seqlen
    np.testing.assert_array_equal(part[:, real], whole[:, positions[real]][:, :, heads])
    assert not part[:, ~real].any()
    assert not np.array_equal(ranks.host("v", positions, heads), part)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_host_draws_share_a_few_lengths(framework):
    """A host draw of any number of rows equals the device draw of exactly those rows, and the
    JAX draws of 66, 100 and 127 rows (as a check's samples vary) compile at most one program:
    each is padded to the same draw_length with positions past the end."""
    from experiments.runners.cp_ranks import draw_length

    assert [draw_length(n) for n in (1, 127, 128, 129, 161, 9800)] == [
        128,
        128,
        128,
        160,
        192,
        10240,
    ]
    for n in (129, 1000, 9800, 524289):
        assert n <= draw_length(n) <= 1.25 * n
    point = _point("ring", 4, "fwd", sim.LinkModel(), seqlen=512, framework=framework)
    mask = named_mask("causal_document", point.seqlen_total)
    if framework == "jax":
        from experiments.runners.cp_ranks_jax import JaxRanks as ranks_type
        from experiments.runners.cp_ranks_jax import _rows_at
        from experiments.runners.jax_runner import JaxRunner as runner_type
    else:
        from experiments.runners.cp_ranks_torch import TorchRanks as ranks_type
        from experiments.runners.torch_runner import TorchRunner as runner_type
    plan = ranks_type.executor_plan(point, mask, "reference")
    ranks = ranks_type(plan, "reference", point, 0, runner_type())
    rng = np.random.default_rng(3)
    heads = np.array([0, 3])
    samples = [np.sort(rng.choice(point.seqlen_total, n, replace=False)) for n in (66, 100, 127)]
    before = _rows_at()._cache_size() if framework == "jax" else 0
    got = [ranks.host("q", rows, heads) for rows in samples]
    if framework == "jax":
        assert _rows_at()._cache_size() - before <= 1
    for rows, g in zip(samples, got):
        want = ranks.to_host(ranks.device_rows("q", rows, heads))
        assert g.shape == want.shape == (1, len(rows), 2, D)
        np.testing.assert_array_equal(g, want)
        assert np.abs(g).max(axis=(0, 2, 3)).all()  # every row drawn, none left zero


def test_jax_host_draws_convert_inside_the_draw(caplog):
    """A bf16 host draw compiles the draw alone (its float32 conversion inside it, no eager
    conversion program per shape) and equals the device draw converted to float32."""
    import dataclasses
    import logging

    import jax

    from experiments.runners.cp_ranks_jax import JaxRanks
    from experiments.runners.jax_runner import JaxRunner

    point = _point("ring", 4, "fwd", sim.LinkModel(), seqlen=512)
    point = dataclasses.replace(point, dtype="bf16")
    mask = named_mask("causal_document", point.seqlen_total)
    ranks = JaxRanks(
        JaxRanks.executor_plan(point, mask, "reference"), "reference", point, 0, JaxRunner()
    )
    rows, heads = np.arange(3, point.seqlen_total, 13), np.array([1])
    ranks.host("k", rows[:5], heads)  # the key and other per-process programs, another shape
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        got = ranks.host("k", rows, heads)
    compiled = [r.getMessage() for r in caplog.records if "XLA compilation" in r.getMessage()]
    assert compiled and all("rows_at" in m for m in compiled), compiled
    want = ranks.device_rows("k", rows, heads)
    assert want.dtype == jax.numpy.bfloat16 and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.asarray(want.astype(np.float32)))


def test_jax_draws_share_one_program_across_head_counts():
    """Draws of one length for one head, three heads (any order, repeats) and all heads compile
    at most one program per output dtype (every draw takes all heads), and each equals those
    heads of the whole draw, on the device and on the host."""
    from experiments.runners.cp_ranks_jax import _rows_at

    point = _point("ring", 4, "fwd", sim.LinkModel(), seqlen=256)
    ranks = _jax_ranks(point, named_mask("causal_document", point.seqlen_total))
    rows = np.arange(5, ranks.plan.layout.positions[0].size * 4, 7)
    whole = np.asarray(ranks.device_rows("q", rows), np.float32)
    assert whole.shape == (1, len(rows), HQ, D) and np.abs(whole).max(axis=(0, 1, 3)).all()
    before = _rows_at()._cache_size()
    for heads in ([2], [3, 0, 3], [1, 2, 3, 0]):
        got = ranks.device_rows("q", rows, np.array(heads))
        assert got.shape == (1, len(rows), len(heads), D)
        np.testing.assert_array_equal(np.asarray(got, np.float32), whole[:, :, heads])
        on_host = ranks.host("q", rows, np.array(heads))
        np.testing.assert_array_equal(on_host, whole[:, :, heads])
    assert _rows_at()._cache_size() - before <= 1  # the host's float32 draw


def test_jax_draws_of_a_whole_sequence_keep_only_their_heads(monkeypatch):
    """A draw larger than DRAW_ALL_HEADS values over all heads holds only the asked heads (at
    2M tokens a rank's whole sequence of 64 heads would be 32 GiB), with the same values."""
    from experiments.runners import cp_ranks_jax

    point = _point("ring", 4, "fwd", sim.LinkModel(), seqlen=256)
    ranks = _jax_ranks(point, named_mask("causal", point.seqlen_total))
    rows, heads = np.arange(0, point.seqlen_total, 3), np.array([2, 1])
    small = ranks._draw("q", rows, heads, np.float32)[0]
    monkeypatch.setattr(cp_ranks_jax, "DRAW_ALL_HEADS", len(rows) * HQ * D - 1)
    large = ranks._draw("q", rows, heads, np.float32)[0]
    assert small.shape[2] == HQ and large.shape[2] == len(heads)
    np.testing.assert_array_equal(np.asarray(large), np.asarray(small)[:, :, : len(heads)])
    np.testing.assert_array_equal(ranks.host("q", rows, heads), np.asarray(large))


def test_jax_timing_inputs_share_one_random_program(caplog):
    """A timed call's inputs of three shapes compile one random draw between them (each shape
    only a copy); their values are N(0, 1), none zero, and inputs of one shape differ."""
    import logging

    import jax

    point = _point("ring", 4, "fwd", sim.LinkModel(), seqlen=256)
    ranks = _jax_ranks(point, named_mask("causal", point.seqlen_total))
    shapes = [(1, 300, 2, D), (1, 5000, 4, D), (2, 70000, 2, D)]
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        drawn = [
            np.asarray(ranks.normal(shape, seed), np.float64) for seed, shape in enumerate(shapes)
        ]
    compiled = [r.getMessage() for r in caplog.records if "XLA compilation" in r.getMessage()]
    assert sum("_normal" in m for m in compiled) <= 1, compiled
    for x, shape in zip(drawn, shapes):
        assert x.shape == shape and np.all(x != 0)
        assert abs(x.mean()) < 0.05 and abs(x.std() - 1) < 0.05
    other = np.asarray(ranks.normal(shapes[0], 7), np.float64)
    assert np.mean(other == drawn[0]) < 0.01


def test_jax_draws_share_one_program_across_sequence_lengths_and_seeds():
    """The same positions drawn for two sequence lengths and two seeds compile one program (both
    traced): values agree below the shorter length, zeros at and past it; each token's values
    are the normals of the seed's key folded with its position, another seed's differ."""
    import jax

    from experiments.runners.cp_ranks_jax import _rows_at

    seed = np.uint32(3_000_000_011)  # past int32: the device seeds are any 32-bit value
    positions = np.array([5, 299, 300, 301, 777, 1500], np.int32)
    heads = np.array([1, 2], np.int32)
    draw = _rows_at()
    before = draw._cache_size()
    short, long = (
        np.asarray(draw(seed, positions, heads, np.int32(s), 1, 4, D, np.float32, np.float32))
        for s in (300, 1200)
    )
    other = np.asarray(
        draw(np.uint32(12), positions, heads, np.int32(1200), 1, 4, D, np.float32, np.float32)
    )
    assert draw._cache_size() - before <= 1
    token = jax.random.fold_in(jax.random.key(int(seed)), 777)
    expected = np.asarray(jax.random.normal(token, (1, 4, D), np.float32))[:, heads]
    np.testing.assert_array_equal(long[:, 4], expected)
    assert np.mean(other[:, 4] == long[:, 4]) < 0.01
    seen = positions < 300
    np.testing.assert_array_equal(short[:, seen], long[:, seen])
    assert not short[:, ~seen].any() and np.abs(short[:, seen]).max(axis=(0, 2, 3)).all()
    assert not long[:, positions >= 1200].any() and np.abs(long[:, 3:5]).max(axis=(0, 2, 3)).all()


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_row_check_judges_dkv_on_the_device(monkeypatch, framework):
    """A row check passes on the ranks' real dK/dV and fails on a NaN in one step's dK, while
    copying none of the dK/dV parts to the host (all_finite decides on the device)."""
    from experiments.runners import checks
    from experiments.runners.cp_rank_checks import _rank_check

    point = _point("ring", 4, "fwd_bwd", sim.LinkModel(), seqlen=64, framework=framework)
    mask = named_mask("causal_document", point.seqlen_total)
    if framework == "jax":
        from experiments.runners.cp_ranks_jax import JaxRanks as ranks_type
        from experiments.runners.jax_runner import JaxRunner as runner_type
    else:
        from experiments.runners.cp_ranks_torch import TorchRanks as ranks_type
        from experiments.runners.torch_runner import TorchRunner as runner_type
    impl = "reference" if framework == "jax" else "naive"
    plan = ranks_type.executor_plan(point, mask, impl)
    ranks = ranks_type(plan, impl, point, 0, runner_type())
    parts = ranks.emulate(1, 0)["dkv"]
    assert len(parts) > 1 and all(ranks.all_finite(g) for _, *kv in parts for g in kv)
    copied = []
    real_to_host = ranks_type.to_host
    monkeypatch.setattr(
        ranks_type, "to_host", lambda self, x: copied.append(x.shape) or real_to_host(self, x)
    )
    monkeypatch.setattr(checks, "FULL_CHECK_ELEMENTS", 1)
    clean = _rank_check(ranks, mask, 1, 0, grads=True, rtol=1e-4, seed=0)
    assert clean.ok, clean.message
    assert not {tuple(g.shape) for _, *kv in parts for g in kv} & set(map(tuple, copied))
    real_emulate = ranks_type.emulate

    def poisoned(self, r, u, rows=None):
        res = real_emulate(self, r, u, rows)
        t, dk, dv = res["dkv"][-1]
        res["dkv"][-1] = (t, dk * float("nan"), dv)
        return res

    monkeypatch.setattr(ranks_type, "emulate", poisoned)
    bad = _rank_check(ranks, mask, 1, 0, grads=True, rtol=1e-4, seed=0)
    assert not bad.ok and "dk" in bad.message, bad.message


@pytest.mark.parametrize(
    "runs, warm, warmup, samples, by_first_run",
    [((250.0,), False, 2, 1, False), ((3.0,), False, 2, 3, False), ((30.0,), True, 0, 1, True),
     ((30.0,), True, 2, 3, False), ((3.0,), True, 0, 3, False), ((250.0,), True, 0, 1, True),
     ((None, 30.0), False, 0, 1, True), ((None, 250.0), False, 0, 1, True),
     ((None, 3.0), False, 0, 3, False), ((None,), False, 2, 3, False),
     ((None, None), False, 0, 3, False), ((30.0,), False, 0, 3, False),
     ((2500.0,), False, 0, 1, True), ((2500.0,), False, 2, 1, False),
     ((250.0,), False, 0, 1, False)],
)  # fmt: skip
def test_a_long_call_is_sampled_once(runs, warm, warmup, samples, by_first_run):
    """Ranks.time takes one sample of a call whose first timed run is at least LONG_CALL_MS
    long, and `iters` of a shorter one, each after one run of the call; a warm call (its
    program ran before) asked for no warm-up is timed by that first run where it takes
    SAMPLE_RUN_MS or more, and samples nothing more, and so is a call whose program never ran
    where that run compiled nothing and takes FIRST_PROGRAM_RUN_MS or more. A call whose first
    run compiled (None) is run once more where no warm-up is asked, and that run counts as a
    warm call's first; the timing loop's chains learn the last measured run's length."""
    from types import SimpleNamespace

    from experiments.runners.cp_ranks import LONG_CALL_MS, CallTimer, Ranks
    from experiments.runners.timing import FIRST_PROGRAM_RUN_MS, SAMPLE_RUN_MS

    measured = [ms for ms in runs if ms is not None]
    ms = measured[-1] if measured else 3.0  # the call's length, as the timing loop finds it
    for t in (LONG_CALL_MS, SAMPLE_RUN_MS, FIRST_PROGRAM_RUN_MS):
        assert ms >= t or ms * 3 < t
    made, asked, left = [], [], list(runs)

    def timer(call):
        made.append(call)
        return CallTimer(
            lambda: left.pop(0),
            lambda w, iters, known: asked.append((w, iters, known)) or [ms] * iters,
        )

    times = Ranks.time(SimpleNamespace(timer=timer), ("call",), warmup, 3, warm=warm)
    assert times.ms == [ms] * samples and times.by_first_run == by_first_run
    assert times.untimed_ms == (None if by_first_run else runs[-1])  # the run before samples
    assert made == [("call",)] and not left  # made ready once, run as often as `runs` says
    if by_first_run:
        assert asked == []
    else:
        assert sum(n for _, n, _ in asked) == samples and asked[0] == (warmup, 1, runs[-1])
        assert {known for _, _, known in asked} == {runs[-1]}


def test_a_call_timed_by_its_first_run_compiles_nothing_in_it(monkeypatch, caplog):
    """Where every call may be timed by its first run that compiles nothing (SAMPLE_RUN_MS 0),
    the first call of each class runs twice, its first run tracing and compiling its program
    and the second, its time, compiling nothing; every later call of the class is timed by its
    first run, which compiles nothing (one program a class); the records say so. Nothing runs
    the step programs before the timing (no check, nothing compiled ahead), so a class that
    spanned two programs would compile in a later call's first run."""
    import logging

    import jax

    from experiments.runners import checks, cp_ranks_jax, cp_simulate, timing
    from experiments.runners.jax_runner import JaxRunner

    def unchecked(ranks, point, mask, index, rtol, known=None):
        return checks.CheckResult(ok=True, kind="rows", errors={}, rtol={}), [0]

    monkeypatch.setattr(cp_simulate, "check_ranks", unchecked)
    monkeypatch.setattr(timing, "SAMPLE_RUN_MS", 0.0)
    real_first, runs = cp_ranks_jax.timing.jax_first_ms, []

    def first_ms(fn, args, flush=None):
        before = len(caplog.records)
        ms = real_first(fn, args, flush)
        logged = [r.getMessage() for r in caplog.records[before:]]
        runs.append([m for m in logged if "compil" in m.lower() or "trac" in m.lower()])
        return ms

    monkeypatch.setattr(cp_ranks_jax.timing, "jax_first_ms", first_ms)
    point = _point("ring", 4, "fwd_bwd", sim.LinkModel(), seqlen=64)
    logged = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.DEBUG):
            jax.jit(lambda x: x * 3)(np.ones(3))  # the instrument hears a compile
            assert any("compil" in r.getMessage().lower() for r in caplog.records)
            caplog.clear()
            result = JaxRunner(sim_compile_threads=0).run(point)
    finally:
        jax.config.update("jax_log_compiles", logged)
    calls = result["masks"][0]["simulation"]["timed_calls"]
    classes = {c["class"] for c in calls}
    assert len(runs) == len(calls) + len(classes) and len(calls) > len(classes)
    measured, seen = iter(runs), set()
    for call in calls:
        assert call["warm"] == (call["class"] in seen) and "untimed_ms" not in call
        if call["class"] not in seen:
            assert next(measured), "a class's first run traces and compiles its program"
            seen.add(call["class"])
        logged = next(measured)
        assert call["first_run"] and call["n"] == 1 and not logged, (call, logged)


def test_a_resumed_prediction_takes_its_baselines_from_the_records(tmp_path, monkeypatch):
    """A run resumed in the same folder states the single-device baseline its records hold
    (same key and TFLOP/s, no seconds charged) instead of running the kernel point again."""
    from experiments import run
    from experiments.core.results import read_records
    from experiments.runners.jax_runner import JaxRunner

    kernel_runs = []
    real = JaxRunner.run

    def recording(self, point):
        kernel_runs.extend([] if point.simulated else [point.key])
        return real(self, point)

    monkeypatch.setattr(JaxRunner, "run", recording)
    args = [
        "--framework=jax", "--cp=ring", "--mask=causal", "--seqlen=16", "--heads_q=2",
        "--heads_kv=1", "--head_dim=16", "--dtype=fp32", "--mode=fwd", "--warmup=0",
        "--iters=1", "--simulate_devices=2", f"--out_dir={tmp_path}", "--report=false",
    ]  # fmt: skip
    assert run.run_cli([*args, "--layout=contiguous"]) == 0
    assert len(kernel_runs) == 1
    assert run.run_cli([*args, "--layout=contiguous,zigzag"]) == 0
    assert len(kernel_runs) == 1, "the resumed run ran no baseline"
    recs = {r["point"]["layout"]: r for r in read_records(tmp_path / "results.jsonl")}
    first, resumed = (recs[lay]["masks"][0]["simulation"] for lay in ("contiguous", "zigzag"))
    assert resumed["single_device"] == first["single_device"]
    assert first["single_device"]["status"] == "ok" and resumed["wall_s"]["baseline"] == 0
    assert recs["zigzag"]["metrics"]["efficiency_pct"] == pytest.approx(
        100 * recs["zigzag"]["metrics"]["tflops"]["median"] / first["single_device"]["tflops"]
    )


def test_recorded_baselines_keep_what_records_state_in_full():
    from experiments.runners.cp_simulate import recorded_baselines

    def rec(*singles):
        return {"masks": [{"index": i, "simulation": {"single_device": s}} for i, s in singles]}

    ok = {"key": "k1", "status": "ok", "reason": None, "seqlen": 64}
    two = rec(
        (1, {**ok, "time_ms": 2.0, "tflops": 5.0}), (0, {**ok, "time_ms": 1.0, "tflops": 4.0})
    )
    oom = rec((0, {"key": "k2", "status": "oom", "reason": "too big", "seqlen": 99}))
    scaled = rec(
        (0, {"key": "k3", "status": "scaled", "reason": "cap", "seqlen": 64, "tflops": 3.0})
    )
    error = rec((0, {"key": "k4", "status": "error", "reason": "crash", "seqlen": 64}))
    partial = rec((0, {"key": "k5", "status": "ok", "reason": None, "seqlen": 64, "tflops": 1.0}))
    got = recorded_baselines([two, oom, scaled, error, partial, {"masks": []}, {}])
    assert set(got) == {"k1", "k2"}
    assert got["k1"]["result"]["masks"] == [
        {"time_ms": {"median": 1.0}, "tflops": {"median": 4.0}},
        {"time_ms": {"median": 2.0}, "tflops": {"median": 5.0}},
    ]
    assert got["k2"] == {"key": "k2", "status": "oom", "reason": "too big", "seqlen": 99}


_CHECKED_CLASSES = """
import sys
from types import SimpleNamespace
from experiments.runners.cp_simulate import CPSimulator
sim = CPSimulator(SimpleNamespace(on_gpu=False), None, validation_share=float(sys.argv[1]))
sim._kinds_checked.add("kind")
classes = [("attend", "default", n, 128 * (n % 7), n % 2 == 0) for n in range(4000)]
print(sum(1 << i for i, c in enumerate(classes) if sim._checked(c, "kind")))
"""


def test_a_share_of_the_classes_is_checked_the_same_in_every_process():
    """--sim_validation_share: the classes checked on held-out calls (of a kind already
    checked) are drawn by the class's name, so processes with other hash seeds (a resumed
    run's) pick the same ones, about the share of them; a larger share keeps the classes of a
    smaller one, and a share of 1 checks all."""

    def checked(share: float, seed: str = "1") -> set[int]:
        env = {**os.environ, "PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run(
            [sys.executable, "-c", _CHECKED_CLASSES, str(share)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        mask = int(out.stdout.strip().splitlines()[-1])
        return {i for i in range(4000) if mask >> i & 1}

    quarter = checked(0.25)
    assert quarter == checked(0.25, seed="2")
    assert abs(len(quarter) / 4000 - 0.25) < 0.03
    assert checked(0.1) < quarter < checked(0.5)
    assert checked(1.0) == set(range(4000))


def test_every_kind_has_a_checked_class():
    """A kind's first class to be modelled is checked whatever the share, until a class of
    the kind held calls out; then its classes are drawn by the share, each decided once."""
    from types import SimpleNamespace

    from experiments.runners.cp_simulate import CPSimulator

    sim = CPSimulator(SimpleNamespace(on_gpu=False), None, validation_share=1e-12)
    assert sim._checked(("a", 1), "kind")
    assert sim._checked(("a", 2), "kind")  # no class of the kind held calls out yet
    sim._kinds_checked.add("kind")  # as _class_stats and _across_shapes do once they do
    assert not sim._checked(("a", 3), "kind") and sim._checked(("a", 1), "kind")
    assert sim._checked(("b", 1), "other kind")


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_the_run_settings_reach_the_simulator(framework):
    """--sim_timed_calls and --sim_validation_share, as Settings carry them, are the
    simulator's (experiments/driver.py builds the runners)."""
    from types import SimpleNamespace

    from experiments import driver

    settings = SimpleNamespace(
        check_rtol=None,
        sim_baseline_max_seqlen=None,
        sim_timed_calls=6,
        sim_validation_share=0.375,
        sim_compile_threads=0,
    )
    make = driver._jax_runner if framework == "jax" else driver._torch_runner
    simulator = make(settings).simulator
    assert (simulator.timed_calls, simulator.validation_share) == (6, 0.375)


def test_held_out_calls_are_predicted_by_the_calibration_fit_alone():
    """A checked class's held-out calls, at its second point too, are predicted by the fit of
    its calibration calls only (what an unchecked class predicts with), not by one that
    already holds the first point's held-out calls; its other calls by the fit of both. The
    second point, which its first point's fit serves, holds out REUSE_VALIDATION_CALLS."""
    from types import SimpleNamespace

    from experiments.runners import call_model, timing
    from experiments.runners.cp_simulate import CPSimulator

    simulator = CPSimulator(SimpleNamespace(on_gpu=False), None, timed_calls=4)
    rng = np.random.default_rng(7)
    features = {("c", i): np.array([1.0, *rng.integers(5, 80, 2)]) for i in range(40)}
    noise = {key: 1.0 + 0.2 * rng.standard_normal() for key in features}  # no law fits all
    roles = {}

    def fake_time(ranks, point, key, call, role):
        roles[key] = role
        ms = noise[key] * float(features[key] @ np.array([5.0, 0.7, 1.9]))
        simulator._timings[key] = stats = timing.time_stats([ms])
        return stats

    simulator._time = fake_time
    point = SimpleNamespace(seed=3)
    for n in (20, 40):  # the second point serves more pieces of the class
        members = {key: (None, features[key]) for key in list(features)[:n]}
        timed, predicted, errors = simulator._class_stats(None, point, ("c",), "kind", members)
        held = [key for key, role in roles.items() if role == "held_out" and key in members]
        calibrated = [key for key, role in roles.items() if role == "calibration"]
        wanted = call_model.VALIDATION_CALLS if n == 20 else call_model.REUSE_VALIDATION_CALLS
        assert len(errors) == wanted and timed > 0
        coef = call_model.fit(
            np.array([features[k] for k in calibrated]),
            np.array([simulator._timings[k]["median"] for k in calibrated]),
        )
        fresh = held[-wanted:]
        assert [p for p, _ in errors] == pytest.approx([float(features[k] @ coef) for k in fresh])
        both = calibrated + held
        coef = call_model.fit(
            np.array([features[k] for k in both]),
            np.array([simulator._timings[k]["median"] for k in both]),
        )
        for key, stats in predicted.items():
            assert stats["median"] == pytest.approx(float(features[key] @ coef), rel=1e-9)


def _one_class(simulator, cls: tuple, xs: dict[int, np.ndarray]) -> tuple[dict, dict]:
    """CPSimulator._time_calls of one class of calls ((*cls, i) for i in xs; a call's
    arguments are its work features), one rank, a phase a call, of kind "kind": each call's
    median compute and the counts."""
    from types import SimpleNamespace

    from experiments.runners.cp_simulate import CallClasses

    members = {(*cls, i): (x, x) for i, x in xs.items()}
    classes = CallClasses(
        uses=[(p, 0, key) for p, key in enumerate(members)],
        members={cls: members},
        kinds={cls: "kind"},
    )
    sched = SimpleNamespace(
        plan=SimpleNamespace(world_size=1, ring_rank=lambda g: 0), phases=list(members)
    )
    compute, counts = simulator._time_calls(None, sched, SimpleNamespace(seed=0), classes)
    return {key: compute["median"][p, 0] for p, key in enumerate(members)}, counts


def _law_timer(simulator, law: np.ndarray, idle_ms: dict, roles: dict):
    """A fake CPSimulator._time: a call's time is law @ its features, or idle_ms of its class
    where it has no work; its role noted in `roles`."""
    from experiments.runners import timing

    def fake_time(ranks, point, key, call, role):
        roles[key] = role
        x = np.asarray(call, np.float64)
        ms = float(x @ law) if x[1:].any() else idle_ms[key[:-1]]
        simulator._timings[key] = stats = timing.time_stats([ms])
        return stats

    return fake_time


@pytest.mark.parametrize("long_calls", [False, True], ids=["class_model", "across_shapes"])
def test_calls_without_tiles_take_their_classs_one_timed_call(long_calls):
    """Calls whose pieces hold no tile (every work feature 0) cost what the kernels do outside
    their walks (here a few ms, which the law of the working calls, 0 at no work, cannot give):
    one of them is timed for its class and the others take its time; none is a calibration,
    rate or held-out call, so the models fit the working calls alone (held-out error 0), by
    the class's own calibration or (long calls, a kind's model from another shape) across
    shapes. A later point's idle calls of the class time nothing; another class's idle calls
    take their own time; a class whose idle call is known times none."""
    from types import SimpleNamespace

    from experiments.runners import timing
    from experiments.runners.cp_simulate import CPSimulator

    law = np.array([0.0, 30.0, 70.0]) if long_calls else np.array([0.0, 0.7, 1.9])
    # long calls: past KIND_FIT_MIN_MS, yet in no kind's fit
    idle_ms = {("c",): 6.0 if long_calls else 2.6, ("d",): 4.4, ("e",): 3.3}
    simulator = CPSimulator(SimpleNamespace(on_gpu=False), None, timed_calls=4)
    rng = np.random.default_rng(5)
    roles = {}
    simulator._time = _law_timer(simulator, law, idle_ms, roles)

    def features(n: int) -> list[np.ndarray]:
        return [np.array([1.0, *rng.integers(5, 60, 2)]) for _ in range(n)]

    if long_calls:  # the kind's model, from calls of another shape timed whole
        _one_class(simulator, ("other",), dict(enumerate(features(8))))
        roles.clear()
    none = np.array([1.0, 0.0, 0.0])
    xs = features(30)
    xs[3:3] = [none] * 3
    xs += [none] * 2
    compute, counts = _one_class(simulator, ("c",), dict(enumerate(xs)))
    idle = [("c", i) for i, x in enumerate(xs) if not x[1:].any()]
    assert [key for key, role in roles.items() if key in idle] == [idle[0]]
    assert roles[idle[0]] == "idle"
    assert {roles[key] for key in roles if key not in idle} == (
        {"rate", "rate_held_out"} if long_calls else {"calibration", "held_out"}
    )
    for i, x in enumerate(xs):
        expected = idle_ms[("c",)] if not x[1:].any() else float(x @ law)
        assert compute[("c", i)] == pytest.approx(expected, rel=1e-9), i
    assert counts["idle"] == len(idle) - 1
    assert counts["timed"] + counts["modelled"] == counts["distinct"] == len(xs)
    assert counts["model"]["held_out_calls"] > 0 and counts["model"]["max_error_pct"] < 1e-6
    roles.clear()
    more = [none, *features(3), none]
    compute, counts = _one_class(simulator, ("c",), dict(enumerate([*xs, *more])))
    assert ("c", len(xs)) not in roles and ("c", len(xs) + 4) not in roles
    for i, x in enumerate(more, len(xs)):
        expected = idle_ms[("c",)] if not x[1:].any() else float(x @ law)
        assert compute[("c", i)] == pytest.approx(expected, rel=1e-9), i
    # another class: its own idle time; a class whose idle call is known: none timed
    compute, _ = _one_class(simulator, ("d",), {0: none, 1: none})
    assert list(compute.values()) == pytest.approx([4.4, 4.4])
    simulator._timings[("e", 1)] = timing.time_stats([3.3])  # as an earlier process timed it
    roles.clear()
    compute, counts = _one_class(simulator, ("e",), {0: none, 1: none, 2: none})
    assert roles == {} and counts["timed"] == 0 and counts["idle"] == 2
    assert list(compute.values()) == pytest.approx([3.3] * 3)


@pytest.mark.parametrize("checked", [False, True])
def test_a_later_point_goes_on_from_its_classs_fit(checked):
    """A class calibrated at one point serves the next from its fit: calls whose work the timed
    calls span are predicted without a timing (a checked class holds out
    REUSE_VALIDATION_CALLS of them, and states that check); calls past that work have their
    extremes timed as calibration first. Every prediction is the calls' law."""
    from types import SimpleNamespace

    from experiments.runners import call_model
    from experiments.runners.cp_simulate import CPSimulator

    law = np.array([0.4, 0.7, 1.9])
    simulator = CPSimulator(
        SimpleNamespace(on_gpu=False), None, timed_calls=8, validation_share=float(checked)
    )
    if not checked:
        simulator._kinds_checked.add("kind")  # and no class drawn: nothing held out
    roles = {}
    simulator._time = _law_timer(simulator, law, {}, roles)
    rng = np.random.default_rng(21)

    def features(n: int, lo: float, hi: float) -> list[np.ndarray]:
        return [np.array([1.0, *rng.uniform(lo, hi, 2)]) for _ in range(n)]

    first = features(30, 5, 60)
    compute, counts = _one_class(simulator, ("c",), dict(enumerate(first)))
    assert counts["timed"] >= 8
    roles.clear()
    lo, hi = np.min(first, axis=0), np.max(first, axis=0)  # its extremes were timed
    inside = [np.array([1.0, *rng.uniform(lo[1:], hi[1:])]) for _ in range(25)]
    xs = dict(enumerate([*first, *inside]))
    compute, counts = _one_class(simulator, ("c",), xs)
    held = call_model.REUSE_VALIDATION_CALLS if checked else 0
    assert sorted(roles.values()) == ["held_out"] * held
    assert counts["timed"] == held and counts["modelled"] == len(xs) - len(simulator._timings)
    if checked:
        assert counts["model"]["held_out_calls"] == held
    else:
        assert "model" not in counts and counts["unchecked"] == counts["modelled"]
    for key, ms in compute.items():
        assert ms == pytest.approx(float(xs[key[-1]] @ law), rel=1e-9)
    roles.clear()
    past = [np.array([1.0, *rng.uniform(lo[1:], hi[1:])]) for _ in range(20)]
    past[3][1], past[7][2], past[8][2] = 80.0, 2.0, 3.0  # beyond: a row span; a column span
    xs = dict(enumerate([*first, *inside, *past]))
    compute, _ = _one_class(simulator, ("c",), xs)
    extended = [k for k, r in roles.items() if r == "calibration"]
    assert sorted(k[-1] - len(first) - len(inside) for k in extended) == [3, 7]
    assert set(extended) <= set(simulator._calibrated[("c",)])  # the fit holds them now
    assert sorted(roles.values()).count("held_out") == held
    for key, ms in compute.items():
        assert ms == pytest.approx(float(xs[key[-1]] @ law), rel=1e-9)


def test_a_resumed_prediction_goes_on_from_its_classs_recorded_calls():
    """An earlier process's timed calls of a class are its calibration in the next one: a
    point whose pieces they span times nothing, and a recorded call the point makes joins
    the fit once, under its key."""
    from types import SimpleNamespace

    from experiments.runners import timing
    from experiments.runners.cp_simulate import RECORDED, CPSimulator, RecordedCall, _digest

    law = np.array([0.4, 0.7, 1.9])
    simulator = CPSimulator(
        SimpleNamespace(on_gpu=False), None, timed_calls=4, validation_share=0.0
    )
    simulator._kinds_checked.add("kind")
    roles = {}
    simulator._time = _law_timer(simulator, law, {}, roles)
    rng = np.random.default_rng(8)
    xs = {i: np.array([1.0, *rng.uniform(10, 50, 2)]) for i in range(30)}
    for i in (*range(6), 99):  # six working calls and one idle one of the class recorded
        x = xs[i] if i != 99 else np.array([1.0, 0.0, 0.0])
        ms = float(x @ law) if i != 99 else 3.0
        call = RecordedCall(_digest(("c",)), _digest("kind"), timing.time_stats([ms]), x)
        simulator._take_recorded({_digest(("c", i)): call})
    lo = np.min([xs[i] for i in range(6)], axis=0)
    hi = np.max([xs[i] for i in range(6)], axis=0)
    inside = {i: x for i, x in xs.items() if ((x >= lo) & (x <= hi)).all()}
    assert len(inside) > 10
    compute, counts = _one_class(simulator, ("c",), inside)
    assert roles == {} and counts["recorded"] == 6 and counts["timed"] == 0
    for key, ms in compute.items():
        assert ms == pytest.approx(float(inside[key[-1]] @ law), rel=1e-9)
    calibrated = simulator._calibrated[("c",)]
    assert len(calibrated) == 6 and not any(key[0] == RECORDED for key in calibrated)
    assert not any(key[0] == RECORDED for key in simulator._timings)


@pytest.mark.parametrize("resumed", [False, True])
def test_a_kinds_later_classes_are_checked_only_if_drawn(resumed):
    """With no class drawn, a kind's first modelled class is its check and its later classes
    are not checked, also where they first come to their fit at a later point (timed whole
    before, or from an earlier process's records): only the first holds calls out."""
    from types import SimpleNamespace

    from experiments.runners import timing
    from experiments.runners.cp_simulate import CPSimulator, RecordedCall, _digest

    law = np.array([0.4, 0.7, 1.9])
    simulator = CPSimulator(
        SimpleNamespace(on_gpu=False), None, timed_calls=4, validation_share=0.0
    )
    roles = {}
    simulator._time = _law_timer(simulator, law, {}, roles)
    rng = np.random.default_rng(4)
    xs = {c: [np.array([1.0, *rng.uniform(10, 50, 2)]) for _ in range(40)] for c in "abc"}
    if resumed:  # every class's first 12 calls timed by an earlier process
        for c, rows in xs.items():
            for i, x in enumerate(rows[:12]):
                stats = timing.time_stats([float(x @ law)])
                call = RecordedCall(_digest((c,)), _digest("kind"), stats, x)
                simulator._take_recorded({_digest((c, i)): call})
    else:  # every class's first point times its few calls whole
        for c, rows in xs.items():
            _one_class(simulator, (c,), dict(enumerate(rows[:6])))
        assert set(roles.values()) == {"all"}
    roles.clear()
    for c, rows in xs.items():
        compute, _ = _one_class(simulator, (c,), dict(enumerate(rows)))
        for key, ms in compute.items():
            assert ms == pytest.approx(float(xs[c][key[-1]] @ law), rel=1e-9)
    held = {key[0] for key, role in roles.items() if role == "held_out"}
    assert held == {"a"}


def test_restored_calls_join_each_fit_once():
    """The calls the records hold join their kind's fit and their class's rate once: not when
    they did no work (an idle call of 6 ms would give the kind's model a constant the long
    calls do not have), and under one key after a point makes them (no second copy under the
    RECORDED key, in the fit, the rate or the timings); the predictions are the law's."""
    from types import SimpleNamespace

    from experiments.runners import timing
    from experiments.runners.cp_simulate import RECORDED, CPSimulator, RecordedCall, _digest

    law = np.array([0.0, 30.0, 70.0])
    simulator = CPSimulator(
        SimpleNamespace(on_gpu=False), None, timed_calls=4, validation_share=0.0
    )
    simulator._kinds_checked.add("kind")  # and no class drawn: nothing held out
    roles = {}
    simulator._time = _law_timer(simulator, law, {("c",): 6.0}, roles)
    rng = np.random.default_rng(9)
    xs = {("other", i): np.array([1.0, *rng.integers(5, 60, 2)]) for i in range(10)}
    xs |= {("c", i): np.array([1.0, *rng.integers(5, 60, 2)]) for i in range(24)}
    xs[("c", 99)] = np.array([1.0, 0.0, 0.0])
    recorded = [("other", i) for i in range(10)] + [("c", i) for i in range(8)] + [("c", 99)]
    for key in recorded:
        ms = float(xs[key] @ law) if key[1] != 99 else 6.0
        call = RecordedCall(_digest(key[:-1]), _digest("kind"), timing.time_stats([ms]), xs[key])
        simulator._take_recorded({_digest(key): call})

    def check(compute: dict) -> None:
        for key, ms in compute.items():
            assert ms == pytest.approx(float(xs[key] @ law), rel=1e-9), key
        table, rated = simulator._kinds["kind"], simulator._rated[("c",)]
        assert _digest(("c", 99)) not in {key[-1] for key in table}
        for keys in (table, rated, simulator._timings):
            copies = {key[-1] for key in keys if key[0] == RECORDED}
            assert not copies & {_digest(key) for key in keys if key[0] != RECORDED}

    # the class's rate from its recorded calls: nothing timed
    compute, counts = _one_class(simulator, ("c",), {i: xs["c", i] for i in range(8, 20)})
    assert roles == {} and counts["across_shapes"] == 12
    check(compute)
    # four of the recorded calls made by this point: each once, under its key
    later = {i: xs["c", i] for i in (*range(4), *range(20, 24))}
    compute, counts = _one_class(simulator, ("c",), later)
    assert roles == {} and counts["recorded"] == 4
    check(compute)


def test_a_resumed_prediction_times_no_call_its_records_list(monkeypatch):
    """A process resuming a run takes the times of the calls its records list as timed on the
    same kind of device (expect), so it times none of them again, and its kinds' models start
    from them: a point of longer key blocks than any recorded (all-gather over 8 devices after
    4) is predicted across shapes at once, timing what the first process would have (its rate
    call and one held out), with the same compute. Records of another device kind,
    framework, installed versions or (on a CPU) host give nothing."""
    from experiments.runners import cp_simulate
    from experiments.runners.jax_runner import JaxRunner

    small, large = _long_all_gather_points(monkeypatch)
    here = cp_simulate.this_process("jax")
    devices = here["devices"]["jax"]

    def record(result: dict, ran_on: dict = devices, framework: str = "jax", **prov) -> dict:
        return {
            "point": {"framework": framework},
            "provenance": {**here, "devices": {"jax": ran_on}, **prov},
            "masks": result["masks"],
        }

    first = JaxRunner(sim_timed_calls=4)
    done = first.run(small)
    sim_done = done["masks"][0]["simulation"]
    logged = sim_done["timed_calls"]
    assert logged and all(c["min"] <= c["median"] <= c["max"] for c in logged)
    longer = first.run(large)
    after = longer["masks"][0]["simulation"]
    # the longer point first: its kind's model from the records alone
    resumed = JaxRunner(sim_timed_calls=4)
    resumed.expect([large, small], [record(done)])
    later = resumed.run(large)["masks"][0]["simulation"]
    assert later["calls"]["across_shapes"] == later["calls"]["modelled"] > 0
    assert later["calls"]["timed"] == after["calls"]["timed"] == 2
    assert later["compute_ms"] == pytest.approx(after["compute_ms"], rel=1e-3)
    again = resumed.run(small)["masks"][0]["simulation"]
    assert again["timed_calls"] == [] and again["calls"]["timed"] == 0
    assert again["calls"]["recorded"] == sim_done["calls"]["timed"]
    assert again["compute_ms"] == pytest.approx(sim_done["compute_ms"], rel=1e-3)
    for table in resumed.simulator._kinds.values():  # a recorded call once in its kind's fit
        recorded = {key[2] for key in table if key[0] == cp_simulate.RECORDED}
        assert not recorded & {cp_simulate._digest(key) for key in table}
    # another layout of the long class's shapes: its rate from the calls the records hold,
    # and (a process knows no check it did not make) one call held out to check it
    other = _point("allgather", 8, "fwd", sim.LinkModel.ideal(), layout="balanced", seqlen=32)
    third = JaxRunner(sim_timed_calls=4)
    third.expect([other], [record(done), record(longer)])
    sim_other = third.run(other)["masks"][0]["simulation"]
    assert [c["role"] for c in sim_other["timed_calls"]] == ["rate_held_out"]
    others = (
        record(done, {**devices, "device_kind": ["another"]}),
        record(done, devices, "torch"),
        record(done, versions={**here["versions"], "jax": "0.0.1"}),
        record(done, host="another"),  # a CPU's timings: this host's only
    )
    for other in others:
        elsewhere = JaxRunner(sim_timed_calls=4)
        elsewhere.expect([small], [other])
        calls = elsewhere.run(small)["masks"][0]["simulation"]["calls"]
        assert calls["recorded"] == 0 and calls["timed"] == sim_done["calls"]["timed"]


def test_recorded_calls_read_the_records_features_and_times():
    """A recorded call's work features are its spans where its record states them (impls
    with tile lists; a forward's without its column span, call_model.call_features), else its
    area times its heads (call_model.area_features); its min and
    max where listed, else (records from before they were) its p20 and p80. Passed over: calls
    missing a field the restore needs, of a tile layout without spans (older records) or with
    spans of other partial-tile weights (none listed: 2 and 2), timed with fewer heads than
    their own; records of another backend, device, version or (on a CPU) host."""
    from experiments.runners import call_model
    from experiments.runners.cp_simulate import RECORD_FIELDS, recorded_calls

    weights = call_model.span_weights()
    spans = {"row_span": 12.5, "col_span": 40.0, "min": 1.0, "max": 9.0, **weights}
    unweighted = {k: v for k, v in spans.items() if k not in weights}
    assert call_model.recorded_weights(unweighted) != weights  # the column weight moved
    common = {"class": "c", "kind": "k", "area": 300.0, "heads": 4}
    times = {"median": 5.0, "p20": 4.0, "p80": 6.0, "n": 3}
    calls = [
        {"id": "a", **common, **times, **spans},
        {"id": "b", **common, **times},
        {"id": "no spans", **common, **times, "full": 10, "partial": 2},
        {"id": "fewer heads", **common, **times, **spans, "heads_divisor": 8},
        {"id": "forward", **common, **times, **spans, "call": "attend"},
        {"id": "old weights", **common, **times, **unweighted, "full": 10, "partial": 2},
        *({"id": f"no {f}", **common, **times, **spans} for f in RECORD_FIELDS if f != "id"),
    ]
    for c in calls[6:]:
        del c[c["id"][3:]]
    here = {
        "devices": {"jax": {"backend": "gpu", "device_kind": ["X"]}},
        "versions": {"jax": "1"},
        "host": "h",
    }

    def record(**prov) -> dict:
        return {
            "point": {"framework": "jax"},
            "provenance": {**here, **prov},
            "masks": [{"simulation": {"timed_calls": calls}}],
        }

    found = recorded_calls([record()], "jax", here)
    assert set(found) == {"a", "b", "forward"}
    assert found["a"].features.tolist() == [1.0, 12.5, 40.0]
    assert found["forward"].features.tolist() == [1.0, 12.5, 0.0]
    assert found["a"].stats == {**times, "min": 1.0, "max": 9.0}
    area = call_model.area_features(np.float64(300.0), 4)
    assert found["b"].features.tolist() == area.tolist() == [1.0, 1200.0]
    assert found["b"].stats == {**times, "min": 4.0, "max": 6.0}
    assert (found["b"].cls, found["b"].kind) == ("c", "k")
    kept = {"a", "b", "forward"}
    assert set(recorded_calls([record(host="elsewhere")], "jax", here)) == kept  # a GPU
    cpu = {"jax": {"backend": "cpu", "device_kind": ["cpu"]}}
    on_cpu = {**here, "devices": cpu}
    assert set(recorded_calls([record(devices=cpu)], "jax", on_cpu)) == kept
    for other, mine in (
        (record(devices=cpu, host="elsewhere"), on_cpu),
        (record(devices={"jax": {"backend": "cpu", "device_kind": ["X"]}}), here),
        (record(devices={"jax": {"device_kind": ["X"]}}), {**here, "devices": {"jax": {}}}),
        (record(versions={"jax": "2"}), here),
    ):
        assert recorded_calls([other], "jax", mine) == {}


@pytest.mark.parametrize("top", [120, 1200], ids=["floor", "share"])
def test_a_long_class_is_rated_by_its_cheapest_call_of_a_long_calls_length(monkeypatch, top):
    """A class predicted across shapes with no call timed before is rated by the cheapest of
    its calls that the kind's model puts at LONG_CALL_MS and at RATE_CALL_SHARE of its median
    call or more: a rate in the throughput regime for a fraction of the median call's time
    (classes of calls from a few ms up: the LONG_CALL_MS floor decides; of calls of seconds:
    the share does)."""
    from types import SimpleNamespace

    from experiments.runners import call_model, timing
    from experiments.runners.cp_ranks import LONG_CALL_MS
    from experiments.runners.cp_simulate import CPSimulator

    law = np.array([10.0, 0.9, 1.6])
    simulator = CPSimulator(SimpleNamespace(on_gpu=False), None, timed_calls=4)
    rng = np.random.default_rng(11)
    features = {("other", i): np.array([1.0, *rng.integers(5, 60, 2)]) for i in range(10)}
    features |= {("c", i): np.array([1.0, *rng.integers(1, top, 2)]) for i in range(40)}
    timed = {}

    def fake_time(ranks, point, key, call, role):
        timed[key] = role
        simulator._timings[key] = stats = timing.time_stats([float(features[key] @ law)])
        return stats

    monkeypatch.setattr(simulator, "_time", fake_time)
    for key, x in features.items():
        if key[0] == "other":
            simulator._timings[key] = timing.time_stats([float(x @ law)])
    simulator._kinds["kind"] = {k: x for k, x in features.items() if k[0] == "other"}
    simulator._kinds_checked.add("kind")  # and the class not drawn: no held-out call
    simulator.validation_share = 0.0
    members = {k: (None, x) for k, x in features.items() if k[0] == "c"}
    guess = {k: float(x @ law) for k, (_, x) in members.items()}
    floor = max(LONG_CALL_MS, call_model.RATE_CALL_SHARE * np.median(list(guess.values())))
    expected = min((k for k in guess if guess[k] >= floor), key=guess.__getitem__)
    count, predicted, _ = simulator._across_shapes(
        None, SimpleNamespace(seed=0), ("c",), "kind", members
    )
    assert count == 1 and timed == {expected: "rate"}
    below = [k for k in guess if guess[k] < guess[expected]]
    assert below and max(guess[k] for k in below) < floor  # cheaper calls exist, all too short
    assert floor == (
        LONG_CALL_MS if top == 120 else pytest.approx(0.25 * np.median(list(guess.values())))
    )
    for key, stats in predicted.items():
        assert stats["median"] == pytest.approx(guess[key], rel=1e-9)


def test_report_says_where_each_groups_seconds_went():
    """The predictor's cost: one line over every point, then a row per group of points (GPUs x
    tokens a GPU) with its points, seconds by part (each summed over its points' masks) and
    the calls it timed and took from earlier processes' records; records of other kinds of
    points count nowhere."""
    from experiments.reports import report_sim

    def record(n: int, per_device: int, masks: list[tuple[dict, dict]]) -> dict:
        point = {"num_devices": n, "seqlen_per_device": per_device}
        sims = [{"simulation": {"wall_s": wall, "calls": calls}} for wall, calls in masks]
        return {"point": point, "masks": sims}

    parts = dict.fromkeys(report_sim.COST_PARTS, 0.0)
    records = [
        record(8, 8192, [({**parts, "plan": 1.5, "calls": 2.0}, {"timed": 3, "recorded": 1})]),
        record(
            8,
            8192,
            [
                ({**parts, "calls": 4.25, "emulate": 0.5}, {"timed": 2}),
                ({**parts, "calls": 1.0}, {"timed": 5, "recorded": 4}),
            ],
        ),
        record(64, 32768, [({**parts, "baseline": 7.0, "compile": 3.0}, {"timed": 9})]),
        {"point": {"num_devices": 1, "seqlen_per_device": 8192}, "masks": [{"time_ms": 1.0}]},
    ]
    lines = report_sim.predictor_cost(records)
    assert lines[0] == (
        "Predictor cost: 3 points took 19.2 s (baseline 7.0 s, plan 1.5 s, compile 3.0 s, "
        "emulate 0.5 s, reference 0.0 s, calls 7.2 s)."
    )
    assert lines[2].startswith("| GPUs x tokens a GPU | points | seconds | baseline | plan |")
    assert lines[4:6] == [
        "| 8 x 8K | 2 | 9.2 | 0.0 | 1.5 | 0.0 | 0.5 | 0.0 | 7.2 | 10 | 5 |",
        "| 64 x 32K | 1 | 10.0 | 7.0 | 0.0 | 3.0 | 0.0 | 0.0 | 0.0 | 9 | 0 |",
    ]
    assert report_sim.predictor_cost(records[3:]) == []


def test_zero_accumulators_are_made_once_per_shape():
    """A point's backward steps take their empty dK/dV and LSE from a few kept zero arrays,
    one per shape and dtype (the oldest dropped past ZEROS_KEPT), instead of one dispatch a
    step; each is all zeros of the asked shape and fp32 at least."""
    import jax.numpy as jnp

    from experiments.runners.cp_ranks_jax import ZEROS_KEPT, JaxRanks

    ranks = JaxRanks.__new__(JaxRanks)  # only the zero arrays' state
    ranks.jnp, ranks._zero_arrays = jnp, {}
    k = jnp.ones((1, 24, 2, 8), jnp.bfloat16)
    dk, dv = ranks._zero_dkv(k, k)
    assert dk.shape == k.shape and dk.dtype == jnp.float32 and not np.asarray(dk).any()
    again = ranks._zero_dkv(k, k)
    assert again[0] is dk and again[1] is dv
    lse = ranks._zero_lse(jnp.ones((1, 24, 4, 8), jnp.bfloat16))
    assert lse.shape == (1, 4, 24) and lse.dtype == jnp.float32 and not np.asarray(lse).any()
    for n in range(ZEROS_KEPT - 2):
        ranks._zeros((n + 1, 3), jnp.float32)
    assert ranks._zero_dkv(k, k)[0] is dk  # kept, and now the last asked
    ranks._zeros((99, 3), jnp.float32)  # past ZEROS_KEPT: the LSE, least recently asked, goes
    assert len(ranks._zero_arrays) == ZEROS_KEPT and ranks._zero_dkv(k, k)[0] is dk
    assert ranks._zero_lse(jnp.ones((1, 24, 4, 8), jnp.bfloat16)) is not lse


def test_report_names_the_next_strategy_and_marks_the_near_ones():
    """Beside each best strategy/layout the best point of another strategy and how far behind,
    marked ~ where the gap is under the cost model's target error; a layout of the best's own
    strategy is not its runner-up."""
    from experiments.reports import report_sim

    records = [
        _record("ring", 8, 10.0, simulated=True),
        _record("allgather", 8, 10.3, simulated=True),  # 2.9% behind: within the model's error
        _record("ulysses", 8, 12.5, simulated=True),
        _record("ring", 4, 10.0, simulated=True),
        _record("ulysses", 4, 12.0, simulated=True),  # 16.7% behind
        _record("allgather", 4, 0.0, simulated=True, status="unsupported"),
    ]
    balanced = _record("ring", 4, 11.0, simulated=True)
    balanced["point"]["layout"] = "balanced"  # the best's own strategy: never its runner-up
    rows = [report_sim.flat_row(r) for r in [*records, balanced]]
    best_rows = {
        line.split("|")[2].strip(): line for line in report_sim.tables(rows) if "| causal |" in line
    }
    behind_8 = 100 * (1 - 10.0 / 10.3)
    assert (
        best_rows["8"].rstrip().endswith(f"| ~ allgather/zigzag 0.0971 ({behind_8:.1f}% behind) |")
    )
    assert best_rows["4"].rstrip().endswith("| ulysses/zigzag 0.0833 (16.7% behind) |")
    residue = _record("ring", 2, 10.0, simulated=True)
    residue["masks"][0]["simulation"]["time_ms"]["exposed_comm"] = -4e-12  # an older record's
    alone = report_sim.flat_row(residue)
    assert alone["exposed_comm_ms"] == 0.0, "strategy time minus compute never reads below 0"
    (line,) = [x for x in report_sim.tables([alone]) if x.startswith("| causal | 2 | ring")]
    assert line.rstrip().endswith("| - |"), "no other strategy ran: no runner-up"


def test_planner_failure_is_kept_beside_the_main_threads_error():
    """The planner thread's failure raises at the join; where the main thread is already
    raising, it joins that error's notes instead of replacing it, and the jobs the planner was
    started beside are what is left to settle. The wait is charged either way."""
    from concurrent.futures import Future

    from experiments.runners import cp_simulate

    def failed_ahead() -> cp_simulate.Lookahead:
        planning = Future()
        planning.set_exception(RuntimeError("lowering failed in the planner"))
        beside = cp_simulate.Compiling([], {"program": "job"})
        return cp_simulate.Lookahead(beside, planning, planned_at=0.0)

    ahead = failed_ahead()
    with pytest.raises(RuntimeError, match="lowering failed in the planner"):
        cp_simulate.join_ahead(ahead)
    assert ahead.seconds["compile"] >= 0 and "plan" in ahead.seconds
    main = ValueError("the point's check failed")
    ahead = failed_ahead()
    assert cp_simulate.join_ahead(ahead, main) is ahead.beside
    assert any("lowering failed in the planner" in note for note in main.__notes__)
    done = Future()
    done.set_result(cp_simulate.Compiling([], {}))
    ok = cp_simulate.Lookahead(ahead.beside, done)
    assert cp_simulate.join_ahead(ok, main) is done.result()
