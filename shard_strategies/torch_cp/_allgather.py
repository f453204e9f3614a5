"""Ring all-gather attention: gather K/V once, attend, reduce-scatter dK/dV (autograd.Function).

The gathered K/V are kept for the backward (O(sequence) memory per rank, as autodiff of the JAX
all_gather keeps them), so the backward moves only the reduce-scatter, in the input dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._comm import all_gather, reduce_scatter
from ._local import LseMerge, acc_dtype
from ._steps import Cotangents, Piece, add_grads, backward_step, forward_step


class AllGatherAttention(torch.autograd.Function):
    """(out, lse) of local q against every member's K/V, concatenated in group-rank order."""

    @staticmethod
    def forward(ctx, q, k, v, group: dist.ProcessGroup, piece: Piece | None, scale, impl):
        g = all_gather(torch.stack([k, v]), group, "fwd")
        n, two, b, length, h, d = g.shape
        full = g.permute(1, 2, 0, 3, 4, 5).reshape(two, b, n * length, h, d)
        merge = LseMerge(q)
        forward_step(merge, q, full, piece, scale, impl)
        out = merge.out.to(q.dtype)
        ctx.save_for_backward(q, full, out, merge.lse)
        ctx.group, ctx.piece, ctx.scale, ctx.impl = group, piece, scale, impl
        ctx.set_materialize_grads(False)
        return out, merge.lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, full, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        cot = Cotangents.build(dout, out, lse, dlse)
        grads = backward_step(q, full, ctx.piece, cot, ctx.scale, ctx.impl)
        dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        dkv = torch.zeros_like(full)
        add_grads(dq, dkv, ctx.piece, grads)
        n = dist.get_world_size(ctx.group)
        two, b, total, h, d = dkv.shape
        per_member = dkv.reshape(two, b, n, total // n, h, d).permute(2, 0, 1, 3, 4, 5)
        mine = reduce_scatter(per_member, ctx.group, "bwd")
        return dq.to(q.dtype), mine[0], mine[1], None, None, None, None
