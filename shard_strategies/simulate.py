"""Predicted time of one context-parallel call on N ranks from per-(rank, step) compute times
(numpy only; docs/context_parallel.md, Predicting N GPUs from one).

`schedule(plan, mode)` lists what an executor runs, in program order: phases (a kernel call
every rank makes at one step, or a collective every rank waits for) and the transfers between
them, each with the bytes a rank sends and the points where it is posted and awaited. The JAX
and PyTorch executors walk the same ring chains and collectives; their global entry points
differ (`entry`: EXCHANGE for JAX, REPLICATED for PyTorch).
`predict(schedule, compute_ms, link)` replays that list: ranks advance in lock step (a phase
starts when the slowest rank finished the previous one), a transfer takes latency + bytes /
bandwidth of the links it crosses, and a rank waits for a transfer only where the executor
needs its data, so a transfer posted before a computation hides behind it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

import numpy as np

from attn_masks import MODES

from .comm import FP32_BYTES
from .exchange import ExchangeRounds, plan_exchange_rounds
from .plan import CPPlan
from .schedules import group_by_outer, inner_perm, outer_perm
from .strategies import ALLGATHER_CORE

STRATEGY, DISPATCH = "strategy", "dispatch"
WAIT, POST, SERIAL = "wait", "post", "serial"
P2P, ALL_TO_ALL, ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = (
    "p2p",
    "all_to_all",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
)
RING_STEPS = {ALL_GATHER: 1, REDUCE_SCATTER: 1, ALL_REDUCE: 2}  # ring passes of n - 1 steps
# The compute of a phase: one ring step forward (merged into the running result) or backward
# (accumulated), or the single attention call of the all-gather and Ulysses cores.
ATTEND, ATTEND_BWD, ATTEND_ONCE, ATTEND_ONCE_BWD = "attend", "attend_bwd", "once", "once_bwd"
# How global arrays reach the layout and come back. EXCHANGE (jax_cp): inputs sharded along the
# sequence move by the exchange's ppermute rounds (gathered when the length does not split).
# REPLICATED (torch_cp): every rank holds the global inputs and slices its shard; the output is
# all-gathered, and the backward all-gathers dq, dk and dv in one collective.
EXCHANGE, REPLICATED = "exchange", "replicated"
ENTRIES = (EXCHANGE, REPLICATED)
Event = tuple[str, int]  # (WAIT | POST | SERIAL, transfer index)


@dataclass(frozen=True)
class LinkModel:
    """Bandwidths (GB/s = 1e9 bytes/s sent per GPU) and per-message latencies of a GPU cluster.

    Intra-node: point-to-point (ppermute), all-to-all and ring collectives (all-gather,
    reduce-scatter, all-reduce: bus bandwidth). Any transfer between nodes runs at
    inter_node_gbps per GPU. The defaults are H200 measurements (docs/context_parallel.md).
    """

    p2p_gbps: float = 275.0
    alltoall_gbps: float = 300.0
    allgather_gbps: float = 312.5
    inter_node_gbps: float = 50.0
    latency_us: float = 10.0
    inter_latency_us: float = 20.0
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "gpus_per_node":
                if not isinstance(value, (int, np.integer)) or not 1 <= value <= 1024:
                    raise ValueError(f"gpus_per_node must be an integer 1..1024, got {value}")
            elif f.name.endswith("_gbps") and not value > 0:
                raise ValueError(f"{f.name} must be > 0 GB/s (inf allowed), got {value}")
            elif f.name.endswith("_us") and not 0 <= value < math.inf:
                raise ValueError(f"{f.name} must be >= 0 and finite, got {value}")

    @classmethod
    def ideal(cls, gpus_per_node: int = 8) -> LinkModel:
        """Infinite bandwidth and no latency: communication costs nothing."""
        inf = math.inf
        return cls(inf, inf, inf, inf, 0.0, 0.0, gpus_per_node)

    def spec(self) -> str:
        """A compact stable text of every parameter (part of a simulated point's key)."""
        return (
            f"g{self.gpus_per_node}-p{self.p2p_gbps:g}-a{self.alltoall_gbps:g}"
            f"-c{self.allgather_gbps:g}-x{self.inter_node_gbps:g}"
            f"-l{self.latency_us:g}-xl{self.inter_latency_us:g}"
        )

    @classmethod
    def from_spec(cls, text: str) -> LinkModel:
        """The inverse of spec()."""
        m = re.fullmatch(r"g(\d+)-p([^-]+)-a([^-]+)-c([^-]+)-x([^-]+)-l([^-]+)-xl([^-]+)", text)
        if not m:
            raise ValueError(f"not a link model spec: {text!r}")
        gpn, *values = m.groups()
        p2p, a2a, coll, inter, lat, inter_lat = (float(v) for v in values)
        return cls(p2p, a2a, coll, inter, lat, inter_lat, int(gpn))

    def _ms(self, nbytes: float, gbps: float) -> float:
        return nbytes / (gbps * 1e6)

    def p2p_ms(self, nbytes: float, src: int, dst: int) -> float:
        """One message from global rank src to dst."""
        if src // self.gpus_per_node == dst // self.gpus_per_node:
            return self.latency_us * 1e-3 + self._ms(nbytes, self.p2p_gbps)
        return self.inter_latency_us * 1e-3 + self._ms(nbytes, self.inter_node_gbps)

    def collective_ms(self, op: str, nbytes: float, members: list[int]) -> float:
        """A collective over `members` in which every rank sends nbytes: all-to-all sends to all
        peers at once (the off-node share over the NIC); ring collectives take n - 1 steps a pass
        at the bandwidth of the slowest link of the ring."""
        n = len(members)
        if n < 2:
            return 0.0
        nodes = np.asarray(members) // self.gpus_per_node
        crosses = len(set(nodes.tolist())) > 1
        latency = (self.inter_latency_us if crosses else self.latency_us) * 1e-3
        if op == ALL_TO_ALL:
            off = max(int((nodes != node).sum()) for node in nodes)
            share = nbytes / (n - 1)
            wire = max(
                self._ms(share * (n - 1 - off), self.alltoall_gbps),
                self._ms(share * off, self.inter_node_gbps),
            )
            return latency + wire
        bw = min(self.allgather_gbps, self.inter_node_gbps) if crosses else self.allgather_gbps
        return RING_STEPS[op] * (n - 1) * latency + self._ms(nbytes, bw)


@dataclass(frozen=True)
class Transfer:
    """One communication: `nbytes` sent by every rank of its groups.

    group: "ring" (each rank's ring group), "ulysses" (its Ulysses group) or "world"; p2p
    transfers move blocks between ring ranks by `pairs` (source, destination) inside each ring
    group, or between global ranks for group "world" (a rank that receives nothing waits for
    nothing). direction: fwd or bwd; part: the strategy's own traffic, or the executor's dispatch of
    global arrays (kept apart: the plan's comm_volume counts the former).
    """

    name: str
    op: str
    nbytes: float
    group: str
    direction: str
    part: str = STRATEGY
    pairs: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Phase:
    """Events before the compute, the compute every rank runs (call kind, kept step), events
    after it. group_start: a ring step that opens an outer step (its dK/dV accumulator starts
    empty)."""

    name: str
    direction: str
    call: str | None = None
    step: int = 0
    group_start: bool = False
    before: tuple[Event, ...] = ()
    after: tuple[Event, ...] = ()
    part: str = STRATEGY


@dataclass(frozen=True)
class Schedule:
    """The executor's program for one plan and mode: phases and transfers in program order."""

    plan: CPPlan
    mode: str
    phases: tuple[Phase, ...]
    transfers: tuple[Transfer, ...]

    def bytes_sent(self, direction: str, part: str = STRATEGY) -> float:
        """Bytes each rank sends in one direction and part."""
        return float(
            sum(t.nbytes for t in self.transfers if t.direction == direction and t.part == part)
        )


@dataclass
class _Draft:
    name: str
    direction: str
    call: str | None
    step: int
    group_start: bool
    part: str
    before: list[Event] = field(default_factory=list)
    after: list[Event] = field(default_factory=list)


class _Builder:
    """Collects phases and transfers in program order."""

    def __init__(self, plan: CPPlan, itemsize: int, batch: int):
        self.plan, self.itemsize, self.batch = plan, itemsize, batch
        self.transfers: list[Transfer] = []
        self.phases: list[_Draft] = []

    def transfer(self, name: str, op: str, elements: float, group: str, direction: str, **kw):
        """Register a transfer of `elements` per rank (in the input dtype unless itemsize=)."""
        itemsize = kw.pop("itemsize", self.itemsize)
        nbytes = float(elements) * itemsize * self.batch
        self.transfers.append(Transfer(name, op, nbytes, group, direction, **kw))
        return len(self.transfers) - 1

    def phase(self, name: str, direction: str, call=None, step=0, group_start=False, part=STRATEGY):
        self.phases.append(_Draft(name, direction, call, step, group_start, part))
        return self.phases[-1]

    def collectives(self, name: str, direction: str, items, op: str, group: str, part=STRATEGY):
        """A phase of serial collectives only: items = [(what, elements per rank)]."""
        ph = self.phase(name, direction, part=part)
        for what, elements in items:
            k = self.transfer(f"{direction} {what}", op, elements, group, direction, part=part)
            ph.before.append((SERIAL, k))

    def build(self, mode: str) -> Schedule:
        phases = tuple(
            Phase(
                d.name,
                d.direction,
                d.call,
                d.step,
                d.group_start,
                tuple(d.before),
                tuple(d.after),
                d.part,
            )
            for d in self.phases
        )
        return Schedule(self.plan, mode, phases, tuple(self.transfers))


def _sizes(plan: CPPlan) -> dict[str, float]:
    """Per-rank element counts of the tensors that move (docs/context_parallel.md)."""
    u, d = plan.ulysses_size, plan.head_dim
    hq, hkv = plan.num_heads_q, plan.num_heads_kv
    hkv_eff = max(hkv, u)
    a2a = (u - 1) / u * plan.local_len * d
    n, s = plan.world_size, plan.seqlen
    return {
        "a2a_q": a2a * hq,
        "a2a_kv": a2a * hkv_eff,
        "block": plan.shard_len * (hkv_eff // u) * d,  # one of K or V of a ring shard
        "global_q": (n - 1) / n * s * hq * d,
        "global_kv": (n - 1) / n * s * hkv * d,
    }


def _ring(b: _Builder, direction: str, sizes: dict[str, float]) -> None:
    """The ring / double ring core as jax_cp's ring walks it: the next inner block posted before the
    current step computes, the next window's block posted when an outer step starts; backward
    also sends the fp32 dK/dV accumulator behind its block and home at the end."""
    plan = b.plan
    ring, windows = plan.ring_size, plan.num_windows
    w = ring // windows
    groups = group_by_outer([(s.outer, s.inner) for s in plan.steps])
    call = ATTEND if direction == "fwd" else ATTEND_BWD
    kv = 2 * sizes["block"]

    def move(what: str, shift: int, outer: bool, grads: bool = False) -> int:
        perm = outer_perm if outer else inner_perm
        name = f"{direction} {what} ({'outer' if outer else 'inner'} {shift:+d})"
        size = {"itemsize": FP32_BYTES} if grads else {}
        pairs = tuple(perm(ring, windows, shift))
        return b.transfer(name, P2P, kv, "ring", direction, pairs=pairs, **size)

    t = 0
    next_outer = crossing = pending = None
    for g, (o, inners) in enumerate(groups):
        before: list[Event] = []
        if g == 0 and o % windows:
            before.append((SERIAL, move("K/V", o, True)))
        elif g > 0:
            before.append((WAIT, next_outer))
        if g + 1 < len(groups):
            next_outer = move("K/V", groups[g + 1][0] - o, True)
            before.append((POST, next_outer))
        if inners[0] % w:
            before.append((SERIAL, move("K/V", inners[0], False)))
        nxt = None
        for j, i in enumerate(inners):
            ph = b.phase(f"{direction} step {t}", direction, call, t, group_start=j == 0)
            ph.before += before if j == 0 else [(WAIT, nxt)]
            if j + 1 < len(inners):
                nxt = move("K/V", inners[j + 1] - i, False)
                ph.before.append((POST, nxt))
            if direction == "bwd":
                if j == 0 and g > 0:
                    crossing = move("dK/dV", o - groups[g - 1][0], True, grads=True)
                    ph.before.append((POST, crossing))
                if j > 0:
                    ph.after.append((WAIT, pending))
                if j + 1 < len(inners):
                    pending = move("dK/dV", inners[j + 1] - i, False, grads=True)
                    ph.after.append((POST, pending))
                else:
                    if inners[-1] % w:
                        ph.after.append((SERIAL, move("dK/dV", -inners[-1], False, grads=True)))
                    if g > 0:
                        ph.after.append((WAIT, crossing))
                    if g + 1 == len(groups) and o % windows:
                        ph.after.append((SERIAL, move("dK/dV", -o, True, grads=True)))
            t += 1


def _core(b: _Builder, direction: str, sizes: dict[str, float]) -> None:
    """The strategy's core after the Ulysses all-to-all: ring, all-gather or local attention."""
    plan = b.plan
    if plan.core == ALLGATHER_CORE and plan.ring_size > 1:
        gathered = (plan.ring_size - 1) * sizes["block"]
        if direction == "fwd":
            ph = b.phase("fwd attention", direction, ATTEND_ONCE)
            for what in ("K", "V"):
                k = b.transfer(f"fwd all-gather {what}", ALL_GATHER, gathered, "ring", direction)
                ph.before.append((SERIAL, k))
        else:
            ph = b.phase("bwd attention", direction, ATTEND_ONCE_BWD)
            for what in ("dK", "dV"):
                k = b.transfer(
                    f"bwd reduce-scatter {what}", REDUCE_SCATTER, gathered, "ring", direction
                )
                ph.after.append((SERIAL, k))
    elif plan.is_ring:
        _ring(b, direction, sizes)
    else:
        call = ATTEND_ONCE if direction == "fwd" else ATTEND_ONCE_BWD
        b.phase(f"{direction} attention", direction, call)


def _exchange_phase(
    b: _Builder, name: str, direction: str, ex: ExchangeRounds, items, reverse: bool = False
) -> None:
    """A phase of the executor's ppermute rounds between the contiguous split and the layout,
    for each (what, elements per token) in items; reverse: the transposed rounds (backward)."""
    ph = b.phase(name, direction, part=DISPATCH)
    for what, per_token in items:
        for r, (pairs, size) in enumerate(zip(ex.rounds, ex.sizes)):
            pairs = tuple((d, s) for s, d in pairs) if reverse else pairs
            k = b.transfer(
                f"{direction} {what} round {r}",
                P2P,
                size * per_token,
                "world",
                direction,
                part=DISPATCH,
                pairs=pairs,
            )
            ph.before.append((SERIAL, k))


def schedule(
    plan: CPPlan,
    mode: str,
    *,
    itemsize: int = 2,
    batch: int = 1,
    dispatch: bool = True,
    entry: str = EXCHANGE,
) -> Schedule:
    """The executor's phases and transfers for `plan` in `mode` (fwd, bwd or fwd_bwd).

    dispatch: include the movement of global arrays into the layout's order and back, as the
    executor's global entry point (`entry`) runs it. EXCHANGE: when the length splits evenly
    over the ranks (the driver's inputs are then sharded along the sequence) the exchange's
    ppermute rounds for q, k, v and out (backward: their transposes for dout, dq, dk, dv);
    otherwise XLA partitions the gathers of global arrays as an all-gather of each input and an
    all-reduce of each output. REPLICATED: an all-gather of the output shards (backward: one of
    the dq, dk, dv shards); taking a shard of replicated inputs moves nothing.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    if entry not in ENTRIES:
        raise ValueError(f"unknown entry {entry!r}; valid: {', '.join(ENTRIES)}")
    if plan.num_heads_q is None or plan.num_heads_kv is None or plan.head_dim is None:
        raise ValueError("schedule needs a plan made with num_heads_q, num_heads_kv, head_dim")
    sizes = _sizes(plan)
    b = _Builder(plan, itemsize, batch)
    u = plan.ulysses_size
    q, kv = sizes["a2a_q"], sizes["a2a_kv"]
    edges = _dispatch_edges if entry == EXCHANGE else _replicated_edges
    edge = edges(b, sizes) if dispatch else lambda name: None
    if mode != "bwd":
        edge("dispatch q, k, v")
        if u > 1:
            items = [("q", q), ("k", kv), ("v", kv)]
            b.collectives("Ulysses q, k, v to heads", "fwd", items, ALL_TO_ALL, "ulysses")
        _core(b, "fwd", sizes)
        if u > 1:
            b.collectives("Ulysses out to tokens", "fwd", [("out", q)], ALL_TO_ALL, "ulysses")
        edge("undispatch out")
    if mode != "fwd":
        edge("dispatch dout")
        if u > 1:
            b.collectives("Ulysses dout to heads", "bwd", [("dout", q)], ALL_TO_ALL, "ulysses")
        _core(b, "bwd", sizes)
        if u > 1:
            items = [("dq", q), ("dk", kv), ("dv", kv)]
            b.collectives("Ulysses dq, dk, dv to tokens", "bwd", items, ALL_TO_ALL, "ulysses")
        edge("undispatch dq, dk, dv")
    return b.build(mode)


def _dispatch_edges(b: _Builder, sizes: dict[str, float]):
    """A function adding the named dispatch step of jax_cp's global entry point: the
    exchange's ppermute rounds when the length splits evenly over the ranks (forward exchange in,
    its transpose out; the backward runs them transposed), else the collectives XLA makes of
    gathering global arrays."""
    plan = b.plan
    exchanges = plan_exchange_rounds(plan)
    tq, tkv = plan.num_heads_q * plan.head_dim, plan.num_heads_kv * plan.head_dim
    gq, gkv = sizes["global_q"], sizes["global_kv"]
    # name: direction, exchange (0 in, 1 out), its items, transposed, then the gather form
    steps = {
        "dispatch q, k, v": (
            "fwd",
            0,
            [("q", tq), ("k", tkv), ("v", tkv)],
            False,
            ALL_GATHER,
            [("q", gq), ("k", gkv), ("v", gkv)],
        ),
        "undispatch out": ("fwd", 1, [("out", tq)], False, ALL_REDUCE, [("out", 2 * gq)]),
        "dispatch dout": ("bwd", 1, [("dout", tq)], True, ALL_REDUCE, [("dout", 2 * gq)]),
        "undispatch dq, dk, dv": (
            "bwd",
            0,
            [("dq", tq), ("dk", tkv), ("dv", tkv)],
            True,
            ALL_REDUCE,
            [("dq", 2 * gq), ("dk", 2 * gkv), ("dv", 2 * gkv)],
        ),
    }

    def edge(name: str) -> None:
        direction, which, items, reverse, op, gathered = steps[name]
        if exchanges is None:
            b.collectives(name, direction, gathered, op, "world", DISPATCH)
        else:
            _exchange_phase(b, name, direction, exchanges[which], items, reverse=reverse)

    return edge


def _replicated_edges(b: _Builder, sizes: dict[str, float]):
    """A function adding the named dispatch step of an entry point on replicated inputs: the
    all-gather of the output shards, and in the backward of the dq, dk, dv shards (padding
    included, as the shards hold it); the inputs and dout are sliced where they lie."""
    plan = b.plan
    shards = (plan.world_size - 1) * plan.local_len * plan.head_dim
    hq, hkv = plan.num_heads_q, plan.num_heads_kv
    gathers = {
        "undispatch out": ("fwd", [("out", shards * hq)]),
        "undispatch dq, dk, dv": ("bwd", [("dq, dk, dv", shards * (hq + 2 * hkv))]),
    }

    def edge(name: str) -> None:
        if name in gathers:
            direction, items = gathers[name]
            b.collectives(name, direction, items, ALL_GATHER, "world", DISPATCH)

    return edge


def global_rank(plan: CPPlan, ring_rank: int, ulysses_rank: int) -> int:
    """The global rank at (ring rank, Ulysses rank): consecutive ranks form the inner axis."""
    if plan.inner_axis == "ulysses":
        return ring_rank * plan.ulysses_size + ulysses_rank
    return ulysses_rank * plan.ring_size + ring_rank


def transfer_ms(sched: Schedule, link: LinkModel) -> np.ndarray:
    """(transfers, N) milliseconds each transfer takes as seen by each rank (a collective: its
    slowest member's time; p2p: the message into that rank). A row depends only on the
    transfer's op, bytes, group and pairs, so transfers that repeat one reuse its row."""
    plan = sched.plan
    n = plan.world_size
    ranks = [(g, plan.ring_rank(g), plan.ulysses_rank(g)) for g in range(n)]
    ring_groups = [
        tuple(global_rank(plan, j, u) for j in range(plan.ring_size))
        for u in range(plan.ulysses_size)
    ]
    ulysses_groups = [
        tuple(global_rank(plan, r, j) for j in range(plan.ulysses_size))
        for r in range(plan.ring_size)
    ]
    members_of = {
        "ring": [ring_groups[u] for _, _, u in ranks],
        "ulysses": [ulysses_groups[r] for _, r, _ in ranks],
    }
    everyone = [tuple(range(n))] * n

    def row(t: Transfer) -> list[float]:
        """Each rank's time for transfer t."""
        if t.op == P2P:
            src_of = {dst: s for s, dst in t.pairs}
            if t.group == "world":
                return [
                    link.p2p_ms(t.nbytes, src_of[g], g) if g in src_of else 0.0 for g in range(n)
                ]
            return [link.p2p_ms(t.nbytes, global_rank(plan, src_of[r], u), g) for g, r, u in ranks]
        groups = members_of.get(t.group, everyone)
        times = {m: link.collective_ms(t.op, t.nbytes, list(m)) for m in dict.fromkeys(groups)}
        return [times[m] for m in groups]

    rows: dict[tuple, list[float]] = {}
    out = np.zeros((len(sched.transfers), n))
    for k, t in enumerate(sched.transfers):
        key = (t.op, t.group, t.nbytes, t.pairs)
        if key not in rows:
            rows[key] = row(t)
        out[k] = rows[key]
    return out


@dataclass(frozen=True)
class Prediction:
    """Per phase: each rank's compute and exposed communication (waiting for transfers, serial
    collectives), and the phase's time (its slowest rank); their sum is the call's time."""

    schedule: Schedule
    compute_ms: np.ndarray  # (P, N)
    exposed_ms: np.ndarray  # (P, N)
    phase_ms: np.ndarray  # (P,)
    transfer_ms: np.ndarray  # (K, N)

    @property
    def total_ms(self) -> float:
        return float(self.phase_ms.sum())

    def part_ms(self, part: str) -> float:
        """Time of the phases of one part (strategy or dispatch)."""
        keep = [p.part == part for p in self.schedule.phases]
        return float(self.phase_ms[keep].sum())

    @property
    def load_imbalance(self) -> float:
        """max / mean over ranks of the compute time (1.0 = balanced)."""
        per_rank = self.compute_ms.sum(axis=0)
        mean = float(per_rank.mean())
        return float(per_rank.max()) / mean if mean > 0 else 1.0


def predict(
    sched: Schedule,
    compute_ms: np.ndarray,
    link: LinkModel,
    *,
    transfers: np.ndarray | None = None,
) -> Prediction:
    """Replay `sched` with compute_ms[phase, rank] (0 where a phase has no compute).

    transfers: transfer_ms(sched, link) computed beforehand, so that replaying one schedule with
    several compute arrays computes it once (`link` is then not consulted).
    """
    n, p = sched.plan.world_size, len(sched.phases)
    compute = np.asarray(compute_ms, np.float64)
    if compute.shape != (p, n):
        raise ValueError(f"compute_ms must have shape {(p, n)}, got {compute.shape}")
    x = transfer_ms(sched, link) if transfers is None else np.asarray(transfers, np.float64)
    if x.shape != (len(sched.transfers), n):
        raise ValueError(f"transfers must have shape {(len(sched.transfers), n)}, got {x.shape}")
    arrive = np.full(x.shape, np.nan)

    def run(events: tuple[Event, ...], clock: np.ndarray) -> np.ndarray:
        for kind, k in events:
            if kind == POST:
                arrive[k] = clock + x[k]
            elif kind == WAIT:
                if np.isnan(arrive[k]).any():
                    raise ValueError(f"transfer {sched.transfers[k].name!r} awaited before posted")
                clock = np.maximum(clock, arrive[k])
            else:
                clock = clock + x[k]
        return clock

    exposed = np.zeros((p, n))
    phase_ms = np.zeros(p)
    now = 0.0
    for i, ph in enumerate(sched.phases):
        ready = run(ph.before, np.full(n, now))
        done = ready + compute[i]
        end = run(ph.after, done)
        exposed[i] = (ready - now) + (end - done)
        phase_ms[i] = float(end.max()) - now
        now = float(end.max())
    return Prediction(sched, compute, exposed, phase_ms, x)
