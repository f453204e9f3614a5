"""Global tensors <-> this rank's shard in the plan's layout, differentiable both ways.

dispatch keeps the rank's positions (padding slots are zeros); its backward all-gathers the
shards' gradients, so every rank ends with the full global gradient. undispatch all-gathers the
shards into global order; its backward keeps the rank's slice of the incoming gradient, which is
right when every rank back-propagates the same global gradient (the SPMD case: each rank computes
the same loss from the same global output).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.distributed as dist

from shard_strategies.plan import CPPlan

from ._comm import all_gather

_INDEX: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_indices(plan: CPPlan, key: tuple, build) -> torch.Tensor:
    """Index tensors of a plan, built once per (plan, key) on the key's device."""
    per_plan = _INDEX.setdefault(plan, {})
    if key not in per_plan:
        per_plan[key] = torch.from_numpy(np.ascontiguousarray(build())).to(key[-1])
    return per_plan[key]


def to_local(x: torch.Tensor, plan: CPPlan, rank: int, dim: int) -> torch.Tensor:
    """Rank `rank`'s shard of global x along `dim` (padding slots zero)."""
    pos = plan.positions[rank]
    src = plan_indices(plan, ("src", rank, x.device), lambda: pos[pos < plan.seqlen])
    dst = plan_indices(plan, ("dst", rank, x.device), lambda: np.nonzero(pos < plan.seqlen)[0])
    shape = list(x.shape)
    shape[dim] = pos.size
    return x.new_zeros(shape).index_copy(dim, dst, x.index_select(dim, src))


def to_global(gathered: torch.Tensor, plan: CPPlan, dim: int) -> torch.Tensor:
    """(N, *local shape) shards, stacked by group rank -> the global tensor along `dim`."""
    flat = gathered.movedim(0, dim).flatten(dim, dim + 1)
    return flat.index_select(dim, plan_indices(plan, ("inverse", gathered.device), plan.inverse))


def _gather_many(
    xs: list[torch.Tensor], plan: CPPlan, group: dist.ProcessGroup | None, dim: int
) -> list[torch.Tensor]:
    """All-gather several same-dtype shards in one collective and put each in global order."""
    flat = torch.cat([x.reshape(-1) for x in xs])
    got = all_gather(flat, group, "dispatch")
    parts = torch.split(got, [x.numel() for x in xs], dim=1)
    return [to_global(p.reshape(-1, *x.shape), plan, dim) for p, x in zip(parts, xs)]


class Dispatch(torch.autograd.Function):
    """Global tensors -> this rank's shards; backward all-gathers the gradients (one call)."""

    @staticmethod
    def forward(ctx, plan: CPPlan, rank: int, group, dim: int, *xs):
        ctx.plan, ctx.group, ctx.dim = plan, group, dim
        return tuple(to_local(x, plan, rank, dim) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        return (None, None, None, None, *_gather_many(list(gs), ctx.plan, ctx.group, ctx.dim))


class Undispatch(torch.autograd.Function):
    """This rank's shards -> global tensors (one all-gather); backward keeps the rank's slice."""

    @staticmethod
    def forward(ctx, plan: CPPlan, rank: int, group, dim: int, *ys):
        ctx.plan, ctx.rank, ctx.dim = plan, rank, dim
        return tuple(_gather_many(list(ys), plan, group, dim))

    @staticmethod
    def backward(ctx, *gs):
        return (None, None, None, None, *(to_local(g, ctx.plan, ctx.rank, ctx.dim) for g in gs))
