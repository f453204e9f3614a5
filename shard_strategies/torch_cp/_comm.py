"""Counted torch.distributed communication: P2P batches, gathers, scatters, all-to-alls.

Every helper adds the bytes this rank sends to a per-pass counter, so tests and benchmarks can
compare what the executor really moved with what the plan says it moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PASSES = ("fwd", "bwd", "dispatch", "lse")
_SENT: dict[str, int] = dict.fromkeys(PASSES, 0)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reset_sent_bytes() -> None:
    """Zero the per-pass counters of bytes sent by this rank."""
    for key in _SENT:
        _SENT[key] = 0


def sent_bytes() -> dict[str, int]:
    """Bytes this rank has sent since the last reset, by pass: "fwd" and "bwd" (what plans
    count), "dispatch" (global <-> shards) and "lse" (the Ulysses LSE all-to-all)."""
    return dict(_SENT)


def _count(phase: str, t: torch.Tensor, times: int = 1) -> None:
    _SENT[phase] += t.numel() * t.element_size() * times


class Exchange:
    """One batch of P2P sends and receives in flight; wait() returns the received tensors."""

    def __init__(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        group: dist.ProcessGroup | None,
        phase: str,
    ) -> None:
        ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
        for t, _ in sends:
            _count(phase, t)
        self._keep = [t for t, _ in sends]
        self._recv = [t for t, _ in recvs]
        self._works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> list[torch.Tensor]:
        """Block (or make the current stream wait) until every op of the batch is done."""
        for w in self._works:
            w.wait()
        self._keep = []
        return self._recv


def shift(
    x: torch.Tensor, to: int, frm: int, group: dist.ProcessGroup | None, phase: str
) -> Exchange:
    """Send x to global rank `to` and receive a tensor like x from global rank `frm` (in group)."""
    return Exchange([(x, to)], [(torch.empty_like(x), frm)], group, phase)


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, phase: str) -> torch.Tensor:
    """(n, *x.shape): every member's x stacked in group-rank order."""
    shape = x.shape
    n = dist.get_world_size(group)
    x = x.contiguous().reshape(1, -1)
    out = torch.empty((n, x.shape[1]), dtype=x.dtype, device=x.device)
    _count(phase, x, n - 1)
    _all_gather(out, x, group=group)
    return out.view(n, *shape)


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, phase: str) -> torch.Tensor:
    """Sum x (n, *shape) over the group; member j gets the sum of x[j]."""
    n = dist.get_world_size(group)
    out = torch.empty((1, x[0].numel()), dtype=x.dtype, device=x.device)
    _count(phase, x[0], n - 1)
    _reduce_scatter(out, x.contiguous().reshape(n, -1), group=group)
    return out.view(x.shape[1:])


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    phase: str,
    within: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """x (n, ...): x[j] goes to member j; the result's [i] came from member i.

    With `within` (ascending group ranks, n of them), the exchange runs on the larger `group`
    with zero-size chunks for everyone else: members of other subsets do the same concurrently.
    """
    n = x.shape[0]
    flat = x.contiguous().reshape(n, -1)
    out = torch.empty_like(flat)
    _count(phase, x[0], n - 1)
    if within is None:
        dist.all_to_all_single(out, flat, group=group)
    else:
        splits = [0] * dist.get_world_size(group)
        for g in within:
            splits[g] = 1
        dist.all_to_all_single(out, flat, splits, splits, group=group)
    return out.view(x.shape)
