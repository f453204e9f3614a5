"""Framework-neutral CP plans: who holds which tokens, which key block each step sees, the mask
piece of every (rank, step), load balance and communication volume (numpy only).

The world of N ranks is factored as U (Ulysses, heads) x R (ring, sequence). A ring rank holds a
shard of the (padded, permuted) sequence; the U ranks of a Ulysses group split that shard into U
contiguous pieces and, after the all-to-all, each computes the whole shard for H/U heads.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from attn_masks import Mask, from_slices
from attn_masks.mask import PositionRuns, position_runs

from . import schedules
from .comm import FP32_BYTES, formula_elements
from .layouts import DEFAULT_CHUNKS_PER_RANK, Layout, inverse_order, make_layout
from .strategies import (
    ALL_ULYSSES,
    ALLGATHER_CORE,
    NO_ULYSSES,
    RING_CORE,
    STRATEGIES,
    STRATEGY,
)
from .strategies import core as strategy_core

INNER_AXES = ("ulysses", "ring")
PIECES_KEPT = 16384  # restricted pieces a mask keeps for its next plans (_restricted_grid)


DEFAULT_LOCAL_IMPLS = {
    ("jax", True): "pallas",
    ("jax", False): "reference",
    ("torch", True): "flex",
    ("torch", False): "naive",
}


def default_local_impl(framework: str, on_gpu: bool) -> str:
    """The kernel a CP strategy runs on each device for impl "default": our Pallas kernel
    (JAX) or FlexAttention (torch) on a GPU, the dense reference kernels elsewhere."""
    return DEFAULT_LOCAL_IMPLS[framework, on_gpu]


@dataclass(frozen=True)
class Step:
    """One step of the schedule: (outer, inner) ring offsets and each ring rank's K/V source.

    sources[r] is the ring rank whose K/V block ring rank r sees; -1 means all blocks at once
    (all-gather: the gathered keys, put back in global order, real positions only).
    """

    outer: int
    inner: int
    sources: np.ndarray


@dataclass(frozen=True, eq=False)
class CPPlan:
    """Everything an executor needs to run `mask` under one strategy on `world_size` ranks."""

    mask: Mask
    strategy: str
    layout: Layout
    world_size: int
    ulysses_size: int
    num_windows: int
    inner_axis: str
    steps: tuple[Step, ...]
    dropped: tuple[Step, ...]
    pieces: tuple[tuple[Mask, ...], ...]
    num_heads_q: int | None = None
    num_heads_kv: int | None = None
    head_dim: int | None = None

    @property
    def ring_size(self) -> int:
        return self.layout.ring_size

    @property
    def seqlen(self) -> int:
        return self.layout.seqlen

    @property
    def padded_seqlen(self) -> int:
        return self.layout.padded_seqlen

    @property
    def shard_len(self) -> int:
        """Tokens of one ring shard (what one rank computes after the Ulysses all-to-all)."""
        return self.layout.shard_len

    @property
    def local_len(self) -> int:
        """Tokens each rank holds before and after attention (shard_len / U)."""
        return self.layout.shard_len // self.ulysses_size

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def is_ring(self) -> bool:
        """True when K/V blocks travel between ring ranks step by step (ring, usp, double_ring)."""
        return self.core == RING_CORE

    @property
    def core(self) -> str:
        """What each device runs between the Ulysses all-to-alls (strategies.CORES): K/V
        gathered over the ring axis (allgather), passed around it step by step (ring), or
        nothing to fetch (local: Ulysses alone, or a ring of one rank)."""
        return strategy_core(self.strategy, self.ring_size)

    def ring_rank(self, rank: int) -> int:
        """Ring rank of global rank `rank` (consecutive ranks form the `inner_axis` groups)."""
        if self.inner_axis == "ulysses":
            return rank // self.ulysses_size
        return rank % self.ring_size

    def ulysses_rank(self, rank: int) -> int:
        """Position of global rank `rank` inside its Ulysses group."""
        if self.inner_axis == "ulysses":
            return rank % self.ulysses_size
        return rank // self.ring_size

    @cached_property
    def positions(self) -> np.ndarray:
        """(N, local_len) global positions each rank holds, in local order (>= seqlen: padding)."""
        n = self.local_len
        rows = [
            self.layout.positions[self.ring_rank(g), self.ulysses_rank(g) * n :][:n]
            for g in range(self.world_size)
        ]
        return np.stack(rows)

    def order(self) -> np.ndarray:
        """Flat rank-major order of the sharded sequence: slot n holds position order()[n]."""
        return self.positions.reshape(-1)

    def inverse(self) -> np.ndarray:
        """For each real position p < seqlen, its slot in order() (the undispatch gather)."""
        return inverse_order(self.order(), self.seqlen)

    def key_positions(self, ring_rank: int, step: int) -> np.ndarray:
        """Global positions of the keys ring rank `ring_rank` sees at kept step `step` (an
        all-gather's: every real position in global order, as the executors put the gathered
        K/V back, so a document's keys form one interval)."""
        src = int(self.steps[step].sources[ring_rank])
        if src < 0:
            return np.arange(self.seqlen)
        return self.layout.positions[src]

    @cached_property
    def key_counts(self) -> np.ndarray:
        """(R, T) len(key_positions(r, t)) of each ring rank and kept step, without building
        an all-gather's positions (the CP predictor reads it for every call it keys)."""
        sources = (
            np.array([s.sources for s in self.steps], np.int64)
            .reshape(self.num_steps, self.ring_size)
            .T
        )
        counts = np.where(sources < 0, self.seqlen, self.shard_len)
        counts.flags.writeable = False  # one array for every caller
        return counts

    def piece(self, rank: int, step: int) -> Mask:
        """Mask piece (local queries x that step's keys) of global rank `rank` at kept `step`."""
        return self.pieces[self.ring_rank(rank)][step]

    @cached_property
    def piece_area(self) -> np.ndarray:
        """(R, T) visible pairs of each ring rank's piece at each kept step."""
        return np.array([[p.area() for p in row] for row in self.pieces], np.int64).reshape(
            self.ring_size, self.num_steps
        )

    @property
    def empty(self) -> np.ndarray:
        """(R, T) True where a ring rank has no work at a kept step (skipped: zero tiles)."""
        return self.piece_area == 0

    @cached_property
    def rank_area(self) -> np.ndarray:
        """(N,) mask pairs each rank computes, per query head (its ring shard's area / U)."""
        per_ring = self.piece_area.sum(axis=1) / self.ulysses_size
        return np.array([per_ring[self.ring_rank(g)] for g in range(self.world_size)])

    @property
    def load_balance(self) -> float:
        """max / mean of rank_area (1.0 = perfect)."""
        mean = float(self.rank_area.mean())
        return float(self.rank_area.max()) / mean if mean > 0 else 1.0

    @property
    def critical_area(self) -> float:
        """Sum over steps of the slowest ring rank's area / U: what a lock-step ring waits for."""
        return float(self.piece_area.max(axis=0).sum()) / self.ulysses_size

    @property
    def kv_replication(self) -> int:
        """How many times each K/V head is repeated before the Ulysses all-to-all (U > Hkv)."""
        if self.num_heads_kv is None or self.ulysses_size <= self.num_heads_kv:
            return 1
        return self.ulysses_size // self.num_heads_kv

    def comm_volume(
        self,
        num_heads_q: int | None = None,
        num_heads_kv: int | None = None,
        head_dim: int | None = None,
        *,
        itemsize: int = 2,
        batch: int = 1,
    ) -> dict[str, float]:
        """Per-rank elements/bytes moved, fwd and bwd: published formulas and this executor's."""
        hq = num_heads_q if num_heads_q is not None else self.num_heads_q
        hkv = num_heads_kv if num_heads_kv is not None else self.num_heads_kv
        d = head_dim if head_dim is not None else self.head_dim
        if hq is None or hkv is None or d is None:
            raise ValueError("comm_volume needs num_heads_q, num_heads_kv and head_dim")
        return comm_volume(self, hq, hkv, d, itemsize=itemsize, batch=batch)

    def summary(self) -> dict:
        """Plain-number description for logs and result files."""
        return {
            "strategy": self.strategy,
            "layout": self.layout.name,
            "world_size": self.world_size,
            "ulysses_size": self.ulysses_size,
            "ring_size": self.ring_size,
            "num_windows": self.num_windows,
            "inner_axis": self.inner_axis,
            "seqlen": self.seqlen,
            "padded_seqlen": self.padded_seqlen,
            "num_steps": self.num_steps,
            "dropped_steps": len(self.dropped),
            "empty_pieces": int(self.empty.sum()),
            "load_balance": self.load_balance,
            "critical_area": self.critical_area,
            "ideal_area": self.mask.area() / self.world_size,
        }


def comm_volume(
    plan: CPPlan, hq: int, hkv: int, d: int, *, itemsize: int = 2, batch: int = 1
) -> dict[str, float]:
    """Per-rank fwd/bwd volume: formula elements/bytes and the executor's actual ones.

    Actual: Ulysses all-to-alls of q, k, v, out (fwd) and dout, dq, dk, dv (bwd) with padded
    lengths and replicated K/V heads; ring K/V transfers of the kept steps (dK/dV travel in fp32);
    all-gather of K/V and reduce-scatter of dK/dV. The LSE all-to-all (return_lse) is left out.
    """
    u, r = plan.ulysses_size, plan.ring_size
    hkv_eff = max(hkv, u)
    lu, length = plan.local_len, plan.shard_len
    f_fwd, f_bwd = formula_elements(plan.seqlen, u, r, hq, hkv, d)
    fwd = bwd = 0.0
    dkv_elems = 0.0
    if u > 1:
        per_pass = (u - 1) / u * lu * d * (2 * hq + 2 * hkv_eff)
        fwd += per_pass
        bwd += per_pass
    block = length * (hkv_eff // u) * d * 2
    if plan.core == ALLGATHER_CORE:
        fwd += (r - 1) * block
        bwd += (r - 1) * block
    elif plan.is_ring:
        counts = schedules.transfer_counts(
            [(s.outer, s.inner) for s in plan.steps], r, plan.num_windows
        )
        fwd += counts["fwd_kv"] * block
        bwd += counts["bwd_kv"] * block
        dkv_elems = counts["bwd_dkv"] * block
    return {
        "fwd_formula_elements": f_fwd * batch,
        "bwd_formula_elements": f_bwd * batch,
        "fwd_formula_bytes": f_fwd * batch * itemsize,
        "bwd_formula_bytes": f_bwd * batch * itemsize,
        "fwd_elements": fwd * batch,
        "bwd_elements": (bwd + dkv_elems) * batch,
        "fwd_bytes": fwd * batch * itemsize,
        "bwd_bytes": (bwd * itemsize + dkv_elems * FP32_BYTES) * batch,
    }


def _factor(strategy: str, world_size: int, ulysses_size: int | None) -> int:
    """The Ulysses size U of `strategy` on `world_size` ranks (R = N / U)."""
    record = STRATEGY[strategy]
    uses = record.ulysses
    if uses == NO_ULYSSES:
        if ulysses_size not in (None, 1):
            raise ValueError(
                f"strategy {strategy!r} has no Ulysses axis; got ulysses_size={ulysses_size}"
            )
        return 1
    if uses == ALL_ULYSSES:
        if ulysses_size not in (None, world_size):
            raise ValueError(
                f"strategy {strategy!r} uses all {world_size} ranks; got "
                f"ulysses_size={ulysses_size} (use 'usp' for a U x R hybrid)"
            )
        return world_size
    if ulysses_size is None:
        return record.default_ulysses(world_size)
    if ulysses_size < 1 or world_size % ulysses_size:
        raise ValueError(f"ulysses_size {ulysses_size} must divide world_size {world_size}")
    return ulysses_size


def check_heads(ulysses_size: int, num_heads_q: int | None, num_heads_kv: int | None) -> None:
    """Raise ValueError when the heads cannot be split over a Ulysses group of `ulysses_size`."""
    if num_heads_q is None or num_heads_kv is None:
        return
    if num_heads_kv < 1 or num_heads_q % num_heads_kv:
        raise ValueError(
            f"num_heads_q {num_heads_q} must be a multiple of num_heads_kv {num_heads_kv}"
        )
    u = ulysses_size
    if num_heads_q % u:
        raise ValueError(
            f"Ulysses over {u} ranks needs num_heads_q ({num_heads_q}) divisible by {u}"
        )
    if num_heads_kv % u and u % num_heads_kv:
        raise ValueError(
            f"Ulysses over {u} ranks needs num_heads_kv ({num_heads_kv}) to divide or be divisible "
            f"by {u} (K/V heads are replicated when {u} > {num_heads_kv})"
        )


def padded_mask(mask: Mask, padded_seqlen: int) -> Mask:
    """The same slices over a larger square: positions >= seqlen see and are seen by nothing."""
    if padded_seqlen == mask.seqlen_q:
        return mask
    return from_slices(
        mask.q_ranges, mask.k_ranges, mask.types, padded_seqlen, padded_seqlen, name=mask.name
    )


def make_plan(
    mask: Mask,
    world_size: int,
    strategy: str,
    layout: str = "zigzag",
    ulysses_size: int | None = None,
    *,
    num_windows: int | None = None,
    inner_axis: str = "ulysses",
    num_heads_q: int | None = None,
    num_heads_kv: int | None = None,
    head_dim: int | None = None,
    pad_multiple: int = 1,
    chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK,
    like: CPPlan | None = None,
) -> CPPlan:
    """Plan `strategy` for `mask` on `world_size` ranks with token `layout`.

    ulysses_size: U for usp/double_ring (default: usp largest divisor <= 8 leaving R >= 2,
    double_ring 1). num_windows: double_ring windows (default: LoongTrain's heuristic). inner_axis:
    which axis is made of consecutive ranks ("ulysses" or "ring"). Heads, when given, are checked
    against U. pad_multiple: every ring shard length is a multiple of it (e.g. a kernel tile).
    like: a plan of the same mask and settings under another pad_multiple; where this plan's
    layout holds every real token at like's local index (only the padding differs: more at the
    shards' ends), its steps and its pieces' slices are like's (_repadded), the mask not
    restricted again (a 64-rank plan of a document mask restricts it for about a second).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if inner_axis not in INNER_AXES:
        raise ValueError(f"inner_axis must be one of {INNER_AXES}, got {inner_axis!r}")
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    u = _factor(strategy, world_size, ulysses_size)
    check_heads(u, num_heads_q, num_heads_kv)
    ring = world_size // u
    windowed = [s.name for s in STRATEGY.values() if s.windowed]
    if STRATEGY[strategy].windowed:
        windows = schedules.default_num_windows(ring) if num_windows is None else num_windows
    elif num_windows not in (None, 1):
        raise ValueError(f"num_windows applies to {', '.join(windowed)} only, not {strategy!r}")
    else:
        windows = 1
    lay = make_layout(mask, ring, layout, math.lcm(u, pad_multiple), chunks_per_rank)
    made_with = (mask, strategy, int(world_size), u, windows, inner_axis)
    if like is not None and _same_settings(like, made_with) and _pads_like(lay, like.layout):
        return _repadded(like, lay, num_heads_q, num_heads_kv, head_dim)
    ring_core = strategy_core(strategy, ring)
    if ring_core != RING_CORE:  # one step: every key (all-gather) or the rank's own (local)
        all_steps = [Step(0, 0, np.full(ring, -1 if ring_core == ALLGATHER_CORE else 0))]
    else:
        all_steps = [
            Step(o, i, schedules.step_sources(ring, windows, (o, i)))
            for o, i in schedules.visiting_order(ring, windows)
        ]
    made_as = (ring, layout, math.lcm(u, pad_multiple), chunks_per_rank)  # make_layout's
    grid = _restricted_grid(mask, lay, made_as, all_steps)
    nonempty = [
        any(grid[r][t].num_slices and grid[r][t].area() > 0 for r in range(ring))
        for t in range(len(all_steps))
    ]
    if not any(nonempty):
        nonempty[0] = True
    keep = [t for t, ok in enumerate(nonempty) if ok]
    return CPPlan(
        mask=mask,
        strategy=strategy,
        layout=lay,
        world_size=int(world_size),
        ulysses_size=u,
        num_windows=windows,
        inner_axis=inner_axis,
        steps=tuple(all_steps[t] for t in keep),
        dropped=tuple(s for s, ok in zip(all_steps, nonempty) if not ok),
        pieces=tuple(tuple(grid[r][t] for t in keep) for r in range(ring)),
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        head_dim=head_dim,
    )


def _restricted_grid(
    mask: Mask, lay: Layout, made_as: tuple, steps: list[Step]
) -> list[list[Mask]]:
    """Per ring rank, the mask padded to the layout restricted to its queries and each step's
    keys (its source's shard, or every key for source -1). Each piece is kept on `mask` for
    its next plans by how its layout was made (`made_as`: make_layout's arguments) and its
    (rank, source): a double ring's pieces are its ring's, restricted once (a second each at
    64 ranks). The mask keeps its last PIECES_KEPT pieces."""
    kept = mask.__dict__.setdefault("_plan_pieces", OrderedDict())
    shard_runs: dict[int, PositionRuns] = {}  # every rank restricts to the same shards

    def keys(src: int) -> PositionRuns:
        if src not in shard_runs:
            at = np.arange(lay.seqlen) if src < 0 else lay.positions[src]
            shard_runs[src] = position_runs(at)
        return shard_runs[src]

    full = None
    grid = []
    for r in range(lay.ring_size):
        sources = [int(s.sources[r]) for s in steps]
        new = list(dict.fromkeys(src for src in sources if (made_as, r, src) not in kept))
        if new:
            if full is None:
                full = padded_mask(mask, lay.padded_seqlen)
            pieces = full.restrict_blocks(lay.positions[r], [keys(src) for src in new])
            kept.update(((made_as, r, src), piece) for src, piece in zip(new, pieces))
        for src in sources:
            kept.move_to_end((made_as, r, src))
        grid.append([kept[made_as, r, src] for src in sources])
    while len(kept) > PIECES_KEPT:
        kept.popitem(last=False)
    return grid


def _same_settings(plan: CPPlan, made_with: tuple) -> bool:
    """Whether `plan` was made of the same mask (object) with the same (strategy, world size,
    Ulysses size, windows, inner axis)."""
    mask, strategy, world_size, u, windows, inner_axis = made_with
    return (
        plan.mask is mask
        and (plan.strategy, plan.world_size, plan.ulysses_size) == (strategy, world_size, u)
        and (plan.num_windows, plan.inner_axis) == (windows, inner_axis)
    )


def _pads_like(new: Layout, old: Layout) -> bool:
    """Whether `new` holds every real token of `old` at the same (ring rank, local index), with
    padding everywhere else (old's padding slots and any slots past old's shard length)."""
    if (new.seqlen, new.ring_size) != (old.seqlen, old.ring_size) or new.shard_len < old.shard_len:
        return False
    n, length = new.seqlen, old.shard_len
    head, real = new.positions[:, :length], old.positions < n
    return bool(
        np.array_equal(np.where(real, old.positions, n), np.where(head < n, head, n))
        and (new.positions[:, length:] >= n).all()
    )


def _repadded(like: CPPlan, lay: Layout, num_heads_q, num_heads_kv, head_dim) -> CPPlan:
    """`like` over layout `lay` (which _pads_like like's): the same steps, and each piece the
    same typed slices over the new shard and key lengths. A piece restricted from the padded
    mask is the same whatever the padding: its slices lie in the real tokens, which sit at the
    same local indices, and padding sees and is seen by nothing."""

    def key_len(r: int, step: Step) -> int:
        return lay.seqlen if int(step.sources[r]) < 0 else lay.shard_len

    pieces = tuple(
        tuple(
            Mask(lay.shard_len, key_len(r, s), p.q_ranges, p.k_ranges, p.types, name=p.name)
            for p, s in zip(row, like.steps)
        )
        for r, row in enumerate(like.pieces)
    )
    return dataclasses.replace(
        like,
        layout=lay,
        pieces=pieces,
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        head_dim=head_dim,
    )
