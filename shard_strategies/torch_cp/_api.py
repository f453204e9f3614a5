"""The public entry points: attention on global tensors, shard_attention on local shards."""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

import torch_attn
from attn_masks import Mask
from attn_masks.cache import MaskCache
from attn_masks.shapes import check_attention_shapes
from shard_strategies.plan import CPPlan, check_heads, make_plan
from shard_strategies.strategies import ALLGATHER_CORE, RING_CORE

from ._allgather import AllGatherAttention
from ._dispatch import Dispatch, Undispatch, plan_indices
from ._groups import Groups, group_members, plan_groups
from ._local import default_impl
from ._ring import Mover, Ring, RingAttention
from ._steps import Piece
from ._ulysses import HeadsToSeq, SeqToHeads

_PLANS = MaskCache(size=16)
_BINDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_plan(
    mask: Mask,
    world_size: int,
    strategy: str,
    layout: str = "zigzag",
    ulysses_size: int | None = None,
    **kwargs,
) -> CPPlan:
    """shard_strategies.make_plan, cached per (mask object, settings): host work done once."""
    key = (world_size, strategy, layout, ulysses_size, tuple(sorted(kwargs.items())))
    return _PLANS.get(
        mask, key, lambda: make_plan(mask, world_size, strategy, layout, ulysses_size, **kwargs)
    )


def _piece(mask: Mask, trim: bool) -> Piece | None:
    """The non-empty part of a plan piece (its bounding rows x columns when trimming)."""
    if mask.area() == 0:
        return None
    everything = Piece(slice(0, mask.seqlen_q), slice(0, mask.seqlen_k), mask)
    if not trim:
        return everything
    lo, hi = mask.row_intervals()
    seen = hi > lo
    rows = np.nonzero(seen.any(axis=1))[0]
    r0, r1 = int(rows[0]), int(rows[-1]) + 1
    c0, c1 = int(lo[seen].min()), int(hi[seen].max())
    if (r0, r1, c0, c1) == (0, mask.seqlen_q, 0, mask.seqlen_k):
        return everything
    sub = mask.restrict(np.arange(r0, r1), np.arange(c0, c1))
    return Piece(slice(r0, r1), slice(c0, c1), sub)


@dataclass(frozen=True)
class Binding:
    """A plan bound to this process: its groups, its pieces, the strategy's core."""

    plan: CPPlan
    groups: Groups
    impl: str
    core: str  # CPPlan.core
    ring: Ring | None
    piece: Piece | None
    all_pieces: tuple[Mask, ...]
    checked: set = field(default_factory=set)


def _ring(plan: CPPlan, groups: Groups, pieces: tuple[Piece | None, ...]) -> Ring:
    """This rank's Ring: the plan's kept steps grouped per outer offset, and its mover."""
    steps: OrderedDict[int, list[int]] = OrderedDict()
    for s in plan.steps:
        steps.setdefault(s.outer, []).append(s.inner)
    window = plan.ring_size // plan.num_windows
    mover = Mover(
        plan.ring_rank(groups.rank),
        window,
        plan.num_windows,
        groups.ring_members,
        groups.inner,
        groups.outer,
    )
    return Ring(tuple((o, tuple(i)) for o, i in steps.items()), pieces, mover)


def plan_pieces(plan: CPPlan, impl: str) -> tuple[tuple[Piece | None, ...], ...]:
    """(R, T) the piece every ring rank computes at every kept step (None: the step is empty).

    Pieces are trimmed to the rows/columns that see anything, except for flex, which skips
    empty tiles itself and would otherwise compile one kernel per distinct trimmed shape.
    """
    trim = impl != "flex"
    return tuple(tuple(_piece(m, trim) for m in row) for row in plan.pieces)


def bind(plan: CPPlan, group: dist.ProcessGroup | None, impl: str) -> Binding:
    """Groups and per-step pieces (plan_pieces) of `plan` for this rank (cached per plan, group
    and impl)."""
    per_plan = _BINDINGS.setdefault(plan, {})
    key = (dist.group.WORLD if group is None else group, impl)
    if key not in per_plan:
        groups = plan_groups(plan, group)
        grid = plan_pieces(plan, impl)
        mine = tuple(grid[plan.ring_rank(groups.rank)])
        every = tuple(p.mask for row in grid for p in row if p is not None)
        ring = _ring(plan, groups, mine) if plan.core == RING_CORE else None
        per_plan[key] = Binding(plan, groups, impl, plan.core, ring, mine[0], every)
    return per_plan[key]


def _check_supported(b: Binding, qkv: tuple[torch.Tensor, ...], heads_q: int, heads_kv: int):
    """Raise torch_attn.Unsupported (alike on every rank, before any communication) if the impl
    cannot run some rank's piece for these inputs."""
    q = qkv[0]
    backward = torch.is_grad_enabled() and any(x.requires_grad for x in qkv)
    key = (q.dtype, heads_q, heads_kv, q.shape[3], q.device, backward)
    if key in b.checked:
        return
    for m in b.all_pieces:
        verdict = torch_attn.supports(
            b.impl,
            m,
            dtype=q.dtype,
            heads_q=heads_q,
            heads_kv=heads_kv,
            head_dim=q.shape[3],
            device=q.device,
            mode="fwd_bwd" if backward else "fwd",
        )
        if verdict is not True:
            raise torch_attn.Unsupported(f"{b.impl} cannot run CP piece {m}: {verdict}")
    b.checked.add(key)


def local_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    piece: Piece | None,
    plan: CPPlan,
    scale: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """R = 1 (plain Ulysses): one call on the whole shard, autograd straight through the impl."""
    if piece is None:
        return torch_attn.attention(
            q, k, v, plan.pieces[0][0], impl=impl, scale=scale, return_lse=True
        )
    out, lse = torch_attn.attention(
        q[:, piece.rows],
        k[:, piece.cols],
        v[:, piece.cols],
        piece.mask,
        impl=impl,
        scale=scale,
        return_lse=True,
    )
    before, after = piece.rows.start, q.shape[1] - piece.rows.stop
    out = torch.nn.functional.pad(out, (0, 0, 0, 0, before, after))
    lse = torch.nn.functional.pad(lse, (before, after), value=float("-inf"))
    return out, lse


def shard_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: CPPlan,
    *,
    group: dist.ProcessGroup | None = None,
    impl: str | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """CP attention on this rank's shards (tokens plan.positions[rank], L = plan.local_len):
    q (B,L,Hq,D), k/v (B,L,Hkv,D) -> out (B,L,Hq,D) [, lse (B,Hq,L) fp32]; differentiable."""
    impl = default_impl(q.device) if impl is None else impl
    b = bind(plan, group, impl)
    u, hq, hkv = plan.ulysses_size, q.shape[2], k.shape[2]
    check_heads(u, hq, hkv)
    if q.shape[1] != plan.local_len or k.shape[1] != plan.local_len:
        raise ValueError(
            f"shards must hold plan.local_len={plan.local_len} tokens, got {q.shape[1]} "
            f"and {k.shape[1]}"
        )
    rep = max(1, u // hkv)
    _check_supported(b, (q, k, v), hq // u, hkv * rep // u)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if u > 1:
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = SeqToHeads.apply(b.groups, "", q, k, v)
    if b.core == RING_CORE:
        out, lse = RingAttention.apply(q, k, v, b.ring, scale, impl)
    elif b.core == ALLGATHER_CORE:
        key_order = plan_indices(plan, ("inverse", q.device), plan.inverse)
        out, lse = AllGatherAttention.apply(q, k, v, b.groups.ring, b.piece, scale, impl, key_order)
    else:
        out, lse = local_core(q, k, v, b.piece, plan, scale, impl)
    if u > 1:
        (out,) = HeadsToSeq.apply(b.groups, "", out)
        if return_lse:
            (lse,) = HeadsToSeq.apply(b.groups, "lse", lse.transpose(1, 2)[..., None])
            lse = lse[..., 0].transpose(1, 2)
    return (out, lse) if return_lse else out


def dispatch(
    x: torch.Tensor,
    plan: CPPlan,
    rank: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    dim: int = 1,
) -> torch.Tensor:
    """Global x (tokens along `dim`, global order) -> the shard of group rank `rank` (default:
    this one). Backward all-gathers the shards' gradients: every rank gets the global gradient."""
    rank = dist.get_rank(group) if rank is None else rank
    return Dispatch.apply(plan, rank, group, dim, x)[0]


def undispatch(
    y: torch.Tensor, plan: CPPlan, *, group: dist.ProcessGroup | None = None, dim: int = 1
) -> torch.Tensor:
    """This rank's shard y (tokens along `dim`) -> the global tensor in global token order.
    Backward keeps this rank's slice of the gradient (every rank back-propagates the same one)."""
    return Undispatch.apply(plan, dist.get_rank(group), group, dim, y)[0]


@dataclass(frozen=True)
class CPExecutor:
    """A plan bound to a process group, impl and scale: the data-side pair (dispatch,
    undispatch) and attention on this rank's shards; jax_cp.CPExecutor's counterpart."""

    plan: CPPlan
    group: dist.ProcessGroup | None = None
    impl: str | None = None
    scale: float | None = None

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """Global x (the same on every rank) -> this rank's shard: a local slice, no traffic."""
        return dispatch(x, self.plan, group=self.group)

    def undispatch(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's shard -> the global tensor in token order (an all-gather)."""
        return undispatch(y, self.plan, group=self.group)

    def sharded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool = False):
        """Attention on this rank's shards, collectively over the group; differentiable."""
        return shard_attention(
            q, k, v, self.plan, group=self.group, impl=self.impl, scale=self.scale,
            return_lse=return_lse,
        )  # fmt: skip


def build(
    mask: Mask,
    *,
    group: dist.ProcessGroup | None = None,
    strategy: str,
    layout: str = "zigzag",
    ulysses_size: int | None = None,
    impl: str | None = None,
    scale: float | None = None,
    num_windows: int | None = None,
    inner_axis: str = "ulysses",
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
) -> CPExecutor:
    """Plan `strategy` for `mask` over `group` and bind it (for callers holding shards)."""
    plan = get_plan(
        mask,
        len(group_members(group)),
        strategy,
        layout,
        ulysses_size,
        num_windows=num_windows,
        inner_axis=inner_axis,
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        head_dim=head_dim,
    )
    return CPExecutor(plan, group, impl, scale)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    *,
    group: dist.ProcessGroup | None = None,
    strategy: str,
    layout: str = "zigzag",
    ulysses_size: int | None = None,
    impl: str | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    num_windows: int | None = None,
    inner_axis: str = "ulysses",
):
    """Context-parallel attention of global q (B,S,Hq,D), k/v (B,S,Hkv,D), identical on every
    rank of `group`: the global out (and lse (B,Hq,S)) in global token order.

    Differentiable: each rank's q/k/v gradients are the full global ones (the dispatch backward
    all-gathers the shards' gradients), provided every rank back-propagates the same dout.
    """
    check_attention_shapes(q.shape, k.shape, v.shape, mask)
    ex = build(
        mask,
        group=group,
        strategy=strategy,
        layout=layout,
        ulysses_size=ulysses_size,
        impl=impl,
        scale=scale,
        num_windows=num_windows,
        inner_axis=inner_axis,
        num_heads_q=q.shape[2],
        num_heads_kv=k.shape[2],
        head_dim=q.shape[3],
    )
    plan, rank = ex.plan, dist.get_rank(group)
    res = ex.sharded(*Dispatch.apply(plan, rank, group, 1, q, k, v), return_lse=return_lse)
    if not return_lse:
        return Undispatch.apply(plan, rank, group, 1, res)[0]
    out = Undispatch.apply(plan, rank, group, 1, res[0])[0]
    return out, Undispatch.apply(plan, rank, group, 2, res[1])[0]
