"""transfer_ms against a per-rank reference on real schedules, and predict with transfers
computed beforehand (simulate's replay of one schedule with several compute arrays)."""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest
from cp_cases import named_mask

import shard_strategies as ss
from shard_strategies import simulate as sim

HQ, HKV, D = 16, 2, 8
CONFIGS = [  # (strategy, world size, ulysses size)
    ("ring", 8, None),
    ("ulysses", 8, None),
    ("usp", 8, None),
    ("allgather", 8, None),
    ("double_ring", 8, None),
    ("ring", 16, None),
    ("ulysses", 16, None),
    ("usp", 16, None),
    ("allgather", 16, None),
    ("double_ring", 16, 2),
]
# Nodes smaller than the world, one of them not dividing it: groups cross node boundaries.
LINKS = [
    sim.LinkModel(
        p2p_gbps=200.0,
        alltoall_gbps=300.0,
        allgather_gbps=250.0,
        inter_node_gbps=25.0,
        latency_us=7.0,
        inter_latency_us=19.0,
        gpus_per_node=4,
    ),
    sim.LinkModel(gpus_per_node=3),
]
# causal_document splits evenly over the ranks (exchange rounds); causal does not (gathers).
MASKS = [("causal_document", 0), ("causal", 3)]


@functools.cache
def _schedule(
    strategy: str,
    n: int,
    u: int | None,
    inner_axis: str,
    mask: str,
    extra: int,
    entry: str,
    mode: str,
) -> sim.Schedule:
    """The schedule of `strategy` on n ranks for `mask` of 16 n + extra tokens (cached)."""
    plan = ss.make_plan(
        named_mask(mask, 16 * n + extra),
        n,
        strategy,
        "zigzag",
        u,
        inner_axis=inner_axis,
        num_heads_q=HQ,
        num_heads_kv=HKV,
        head_dim=D,
    )
    return sim.schedule(plan, mode, entry=entry)


def _reference_transfer_ms(sched: sim.Schedule, link: sim.LinkModel) -> np.ndarray:
    """Each transfer for each rank on its own, straight from the definitions."""
    plan = sched.plan
    n = plan.world_size
    out = np.zeros((len(sched.transfers), n))
    for k, t in enumerate(sched.transfers):
        for g in range(n):
            r, u = plan.ring_rank(g), plan.ulysses_rank(g)
            if t.op == sim.P2P and t.group == "world":
                src = {dst: s for s, dst in t.pairs}.get(g)
                out[k, g] = 0.0 if src is None else link.p2p_ms(t.nbytes, src, g)
            elif t.op == sim.P2P:
                src = {dst: s for s, dst in t.pairs}[r]
                out[k, g] = link.p2p_ms(t.nbytes, sim.global_rank(plan, src, u), g)
            else:
                if t.group == "ring":
                    members = [sim.global_rank(plan, j, u) for j in range(plan.ring_size)]
                elif t.group == "ulysses":
                    members = [sim.global_rank(plan, r, j) for j in range(plan.ulysses_size)]
                else:
                    members = list(range(n))
                out[k, g] = link.collective_ms(t.op, t.nbytes, members)
    return out


@pytest.mark.parametrize("strategy, n, u", CONFIGS)
@pytest.mark.parametrize("inner_axis", ["ulysses", "ring"])
@pytest.mark.parametrize("entry", sim.ENTRIES)
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("mask, extra", MASKS)
def test_transfer_ms_matches_the_per_rank_reference(
    strategy, n, u, inner_axis, entry, mode, mask, extra
):
    """Bit for bit: rows shared between repeated transfers and collectives computed once per
    group change nothing, over p2p in rings and exchanges, all-to-all and ring collectives."""
    sched = _schedule(strategy, n, u, inner_axis, mask, extra, entry, mode)
    for link in LINKS:
        got = sim.transfer_ms(sched, link)
        assert got.dtype == np.float64
        assert np.array_equal(got, _reference_transfer_ms(sched, link))


@pytest.mark.parametrize("inner_axis", ["ulysses", "ring"])
def test_transfer_ms_tells_groups_apart(inner_axis):
    """Transfers alike but for their group (collectives over ring, Ulysses and world groups; p2p
    inside rings or between global ranks) each get their own times."""
    base = _schedule("usp", 16, None, inner_axis, "causal_document", 0, sim.EXCHANGE, "fwd")
    assert (base.plan.ring_size, base.plan.ulysses_size) == (2, 8)
    pairs = ((0, 1), (1, 0))
    extra = tuple(
        sim.Transfer(f"{op} {group}", op, 3e5, group, "fwd", pairs=pairs if op == sim.P2P else ())
        for op in (sim.P2P, sim.ALL_TO_ALL, sim.ALL_GATHER, sim.ALL_REDUCE)
        for group in ("ring", "ulysses", "world")
        if not (op == sim.P2P and group == "ulysses")
    )
    sched = dataclasses.replace(base, transfers=base.transfers + extra)
    for link in LINKS:
        assert np.array_equal(sim.transfer_ms(sched, link), _reference_transfer_ms(sched, link))


@pytest.mark.parametrize("strategy, n, u", CONFIGS)
@pytest.mark.parametrize("entry", sim.ENTRIES)
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_predict_with_precomputed_transfers_is_unchanged(strategy, n, u, entry, mode):
    """Passing transfer_ms(sched, link) gives the same prediction, and the link is not used."""
    sched = _schedule(strategy, n, u, "ulysses", "causal_document", 0, entry, mode)
    link = LINKS[0]
    transfers = sim.transfer_ms(sched, link)
    rng = np.random.default_rng(n)
    for _ in range(3):
        compute = rng.uniform(0.0, 0.05, (len(sched.phases), n))
        want = sim.predict(sched, compute, link)
        for got in (
            sim.predict(sched, compute, link, transfers=transfers),
            sim.predict(sched, compute, sim.LinkModel.ideal(), transfers=transfers),
        ):
            for name in ("compute_ms", "exposed_ms", "phase_ms", "transfer_ms"):
                assert np.array_equal(getattr(got, name), getattr(want, name)), name
            assert got.total_ms == want.total_ms


def test_predict_rejects_transfers_of_the_wrong_shape():
    """A transfers array not (transfers, N) is an error naming both shapes."""
    sched = _schedule("usp", 8, None, "ulysses", "causal_document", 0, sim.EXCHANGE, "fwd_bwd")
    k, n = len(sched.transfers), sched.plan.world_size
    compute = np.zeros((len(sched.phases), n))
    for shape in ((n, k), (k + 1, n), (k, n - 1), (k * n,)):
        message = f"transfers must have shape {(k, n)}, got {shape}"
        with pytest.raises(ValueError, match=re.escape(message)):
            sim.predict(sched, compute, LINKS[0], transfers=np.zeros(shape))
