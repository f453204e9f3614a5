"""Ring P2P and double-ring (LoongTrain windows) attention as one torch.autograd.Function.

It walks the plan's kept steps with the transfer chains of `shard_strategies.schedules` (the
ones the JAX executor uses, so both move the same bytes). Forward: each group of steps (one
outer offset) gets its block from the previous group's by one window-crossing transfer, posted
when that previous group starts and so hidden behind its whole inner ring; within a group the
transfer of the next block is posted before the current block is computed. Backward: the same
K/V chain again; a dK/dV accumulator (fp32) follows its block within the group, returns to the
group's outer holder, is added to the accumulator that crossed from the previous group (in
flight while this group computed) and crosses on; after the last group it goes home.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._comm import Exchange, shift
from ._local import LseMerge, acc_dtype
from ._steps import Cotangents, Piece, add_grads, backward_step, forward_step


@dataclass(frozen=True)
class Mover:
    """P2P along the inner ring (within a window) or the outer ring (same place, other window).

    members[j] is the global rank of ring rank j; ring rank = window * `window` + place.
    """

    index: int
    window: int
    windows: int
    members: tuple[int, ...]
    inner_group: dist.ProcessGroup
    outer_group: dist.ProcessGroup

    def _rank(self, win: int, place: int) -> int:
        return self.members[(win % self.windows) * self.window + place % self.window]

    def inner(self, x: torch.Tensor, step: int, phase: str) -> Exchange | None:
        """Move every block `step` places along its window (None when that is no move)."""
        if step % self.window == 0:
            return None
        win, place = divmod(self.index, self.window)
        to, frm = self._rank(win, place + step), self._rank(win, place - step)
        return shift(x, to, frm, self.inner_group, phase)

    def outer(self, x: torch.Tensor, step: int, phase: str) -> Exchange | None:
        """Move every block `step` windows on, same place (None when that is no move)."""
        if step % self.windows == 0:
            return None
        win, place = divmod(self.index, self.window)
        to, frm = self._rank(win + step, place), self._rank(win - step, place)
        return shift(x, to, frm, self.outer_group, phase)


@dataclass(frozen=True)
class Ring:
    """This rank's ring: kept steps grouped per outer offset, its piece per kept step, a mover."""

    groups: tuple[tuple[int, tuple[int, ...]], ...]
    pieces: tuple[Piece | None, ...]
    mover: Mover


def _settle(ex: Exchange | None, default: torch.Tensor | None) -> torch.Tensor | None:
    return default if ex is None else ex.wait()[0]


Visit = tuple[int, int, int, int | None, torch.Tensor]


def _walk(kv: torch.Tensor, ring: Ring, phase: str) -> Iterator[Visit]:
    """Yield (kept step, group, step in group, inner shift to the next block or None, block).

    The next group's block is requested when a group starts and the next inner block before the
    current one is handed out, so both are in flight while the caller computes.
    """
    mv, groups = ring.mover, ring.groups
    outer = _settle(mv.outer(kv, groups[0][0], phase), kv)
    t = 0
    for g, (o, inners) in enumerate(groups):
        later = mv.outer(outer, groups[g + 1][0] - o, phase) if g + 1 < len(groups) else None
        cur = _settle(mv.inner(outer, inners[0], phase), outer)
        for j, i in enumerate(inners):
            step = inners[j + 1] - i if j + 1 < len(inners) else None
            nxt = None if step is None else mv.inner(cur, step, phase)
            yield t, g, j, step, cur
            t += 1
            cur = _settle(nxt, cur)
        outer = _settle(later, outer)


def ring_forward(
    q: torch.Tensor, kv: torch.Tensor, ring: Ring, scale: float, impl: str
) -> LseMerge:
    """Merged (out, lse) of q against every kept block of the ring."""
    merge = LseMerge(q)
    for t, _, _, _, block in _walk(kv, ring, "fwd"):
        forward_step(merge, q, block, ring.pieces[t], scale, impl)
    return merge


def ring_backward(
    q: torch.Tensor, kv: torch.Tensor, ring: Ring, cot: Cotangents, scale: float, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dkv (2,B,L,H,D)) in the accumulation dtype, dK/dV travelling behind their blocks."""
    mv, groups = ring.mover, ring.groups
    dt = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=dt, device=q.device)
    pending: Exchange | None = None
    crossing: Exchange | None = None
    total: torch.Tensor | None = None
    for t, g, j, step, block in _walk(kv, ring, "bwd"):
        if j == 0 and g > 0:
            crossing = mv.outer(total, groups[g][0] - groups[g - 1][0], "bwd")
        grads = backward_step(q, block, ring.pieces[t], cot, scale, impl)
        acc = _settle(pending, None)
        if acc is None:
            acc = torch.zeros(kv.shape, dtype=dt, device=kv.device)
        add_grads(dq, acc, ring.pieces[t], grads)
        if step is not None:
            pending = mv.inner(acc, step, "bwd")
            continue
        pending = None
        acc = _settle(mv.inner(acc, -groups[g][1][-1], "bwd"), acc)
        received = _settle(crossing, None)
        total = acc if received is None else acc + received
        crossing = None
    return dq, _settle(mv.outer(total, -groups[-1][0], "bwd"), total)


class RingAttention(torch.autograd.Function):
    """(out, lse) of local q against the ring's K/V blocks; differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float, impl: str):
        kv = torch.stack([k, v])
        merge = ring_forward(q, kv, ring, scale, impl)
        out = merge.out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, merge.lse)
        ctx.ring, ctx.scale, ctx.impl = ring, scale, impl
        ctx.set_materialize_grads(False)
        return out, merge.lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, kv, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        cot = Cotangents.build(dout, out, lse, dlse)
        dq, dkv = ring_backward(q, kv, ctx.ring, cot, ctx.scale, ctx.impl)
        return dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, None
