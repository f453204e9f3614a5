"""Ulysses all-to-all: sequence-sharded, all heads <-> whole (ring) shard, a slice of heads."""

from __future__ import annotations

import torch

from ._comm import all_to_all
from ._groups import Groups


def _to_heads(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, L, H, D) -> (size, B, L, H/size, D): head group j is addressed to member j."""
    b, length, h, d = x.shape
    return x.reshape(b, length, size, h // size, d).permute(2, 0, 1, 3, 4)


def _from_members(y: torch.Tensor) -> torch.Tensor:
    """(size, B, L, h, D) from each member -> (B, size*L, h, D) in member order."""
    size, b, length, h, d = y.shape
    return y.permute(1, 0, 2, 3, 4).reshape(b, size * length, h, d)


def _exchange(x: torch.Tensor, groups: Groups, phase: str) -> torch.Tensor:
    if groups.ulysses is not None:
        return all_to_all(x, groups.ulysses, phase)
    return all_to_all(x, groups.parent, phase, groups.ulysses_members)


def _seq_to_heads(xs: list[torch.Tensor], groups: Groups, phase: str) -> list[torch.Tensor]:
    size = len(groups.ulysses_members)
    packed = torch.cat([_to_heads(x, size) for x in xs], dim=3)
    got = _from_members(_exchange(packed, groups, phase))
    return list(torch.split(got, [x.shape[2] // size for x in xs], dim=2))


def _heads_to_seq(ys: list[torch.Tensor], groups: Groups, phase: str) -> list[torch.Tensor]:
    size = len(groups.ulysses_members)
    b, total, _, d = ys[0].shape
    length = total // size
    packed = torch.cat([y.reshape(b, size, length, y.shape[2], d) for y in ys], dim=3)
    got = _exchange(packed.permute(1, 0, 2, 3, 4), groups, phase)
    parts = torch.split(got, [y.shape[2] for y in ys], dim=3)
    return [p.permute(1, 2, 0, 3, 4).reshape(b, length, size * p.shape[3], d) for p in parts]


def _phases(tag: str) -> tuple[str, str]:
    """Byte-counter passes: ("fwd", "bwd"), or `tag` for both (traffic the plan leaves out)."""
    return (tag, tag) if tag else ("fwd", "bwd")


class SeqToHeads(torch.autograd.Function):
    """Same-dtype tensors (B, L, H_i, D) -> (B, size*L, H_i/size, D) in one all-to-all."""

    @staticmethod
    def forward(ctx, groups: Groups, tag: str, *xs):
        ctx.groups, ctx.tag = groups, tag
        return tuple(_seq_to_heads(list(xs), groups, _phases(tag)[0]))

    @staticmethod
    def backward(ctx, *gs):
        return (None, None, *_heads_to_seq(list(gs), ctx.groups, _phases(ctx.tag)[1]))


class HeadsToSeq(torch.autograd.Function):
    """Inverse of SeqToHeads: (B, size*L, h_i, D) -> (B, L, size*h_i, D) in one all-to-all."""

    @staticmethod
    def forward(ctx, groups: Groups, tag: str, *ys):
        ctx.groups, ctx.tag = groups, tag
        return tuple(_heads_to_seq(list(ys), groups, _phases(tag)[0]))

    @staticmethod
    def backward(ctx, *gs):
        return (None, None, *_seq_to_heads(list(gs), ctx.groups, _phases(ctx.tag)[1]))
