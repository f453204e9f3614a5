"""Process groups of a plan: Ulysses groups, ring groups and, for windows, inner/outer groups.

Group ranks map to (ring rank, Ulysses rank) exactly as `CPPlan.ring_rank / ulysses_rank` say,
so group rank g holds the tokens `plan.positions[g]`.

With the default group (group=None) every subgroup is a real `dist.new_group`, made on first
use by all ranks in one canonical order (so every rank must make that first call, as in any
SPMD program) and cached. With a caller's subgroup, ranks outside it would not take part, so
none are made: the Ulysses all-to-all runs on the caller's group with zero-size chunks for the
ranks outside one's Ulysses group, and window transfers share that group's communicator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from shard_strategies.plan import CPPlan

Group = dist.ProcessGroup


@dataclass(frozen=True)
class Groups:
    """This process's place and groups under one plan.

    ulysses is None when the Ulysses all-to-all runs on `parent` with zero-size chunks outside
    `ulysses_members` (group ranks, in Ulysses order).
    """

    rank: int
    members: tuple[int, ...]
    ring_members: tuple[int, ...]
    ulysses_members: tuple[int, ...]
    parent: Group
    ulysses: Group | None
    ring: Group
    inner: Group
    outer: Group


_CACHE: dict[tuple, Groups] = {}


def group_members(group: Group | None) -> tuple[int, ...]:
    """Global ranks of `group` (None: the default group), by group rank."""
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _partition(plan: CPPlan) -> dict[str, list[tuple[int, ...]]]:
    """Every Ulysses, ring, window and cross-window group as tuples of group ranks."""
    n, w = plan.world_size, plan.ring_size // plan.num_windows
    by_ring: dict[int, list[int]] = {}
    by_uly: dict[int, list[int]] = {}
    for g in range(n):
        by_ring.setdefault(plan.ring_rank(g), []).append(g)
        by_uly.setdefault(plan.ulysses_rank(g), []).append(g)
    uly = [tuple(sorted(m, key=plan.ulysses_rank)) for _, m in sorted(by_ring.items())]
    ring = [tuple(sorted(m, key=plan.ring_rank)) for _, m in sorted(by_uly.items())]
    inner = [r[s : s + w] for r in ring for s in range(0, len(r), w)]
    outer = [r[p::w] for r in ring for p in range(w)]
    return {"ulysses": uly, "ring": ring, "inner": inner, "outer": outer}


def _mine(parts: list[tuple[int, ...]], rank: int) -> tuple[int, ...]:
    return next(p for p in parts if rank in p)


def plan_groups(plan: CPPlan, group: Group | None) -> Groups:
    """The groups of `plan` inside `group` for this process (made on first use, then cached)."""
    members = group_members(group)
    if len(members) != plan.world_size:
        raise ValueError(
            f"the plan is for {plan.world_size} ranks but the process group has {len(members)}"
        )
    rank = members.index(dist.get_rank())
    world = group is None or group is dist.group.WORLD
    parent = dist.group.WORLD if world else group
    key = (parent, plan.ulysses_size, plan.num_windows, plan.inner_axis)
    if key in _CACHE:
        return _CACHE[key]
    parts = _partition(plan)
    mine = {kind: _mine(p, rank) for kind, p in parts.items()}
    subgroups: dict[tuple[int, ...], Group] = {}
    for p in parts.values():
        for ranks in p:
            if world and 1 < len(ranks) < len(members) and ranks not in subgroups:
                subgroups[ranks] = dist.new_group(list(ranks))
    made = {kind: subgroups[m] for kind, m in mine.items() if m in subgroups}
    _CACHE[key] = Groups(
        rank=rank,
        members=members,
        ring_members=tuple(members[g] for g in mine["ring"]),
        ulysses_members=mine["ulysses"],
        parent=parent,
        ulysses=made.get("ulysses", parent if len(mine["ulysses"]) == len(members) else None),
        ring=made.get("ring", parent),
        inner=made.get("inner", parent),
        outer=made.get("outer", parent),
    )
    return _CACHE[key]
