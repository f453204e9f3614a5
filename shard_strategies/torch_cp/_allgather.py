"""Ring all-gather attention: gather K/V once, put them in global token order, attend,
reduce-scatter dK/dV (autograd.Function).

The gathered shards come in layout order, where a document's keys are spread over every rank
(zigzag, balanced); in global order a query row sees its keys in as few intervals as the mask
has. The gathered K/V are kept for the backward (O(sequence) memory per rank, as autodiff of
the JAX all_gather keeps them), so the backward moves only the reduce-scatter, in the input
dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._comm import all_gather, reduce_scatter
from ._local import LseMerge, acc_dtype
from ._steps import Cotangents, Piece, add_grads, backward_step, forward_step


class AllGatherAttention(torch.autograd.Function):
    """(out, lse) of local q against every member's K/V, concatenated in group-rank order and
    taken in global order: key_order[p] is the gathered slot of real position p."""

    @staticmethod
    def forward(
        ctx, q, k, v, group: dist.ProcessGroup, piece: Piece | None, scale, impl, key_order
    ):
        g = all_gather(torch.stack([k, v]), group, "fwd")
        n, two, b, length, h, d = g.shape
        gathered = g.permute(1, 2, 0, 3, 4, 5).reshape(two, b, n * length, h, d)
        full = gathered.index_select(2, key_order)
        merge = LseMerge(q)
        forward_step(merge, q, full, piece, scale, impl)
        out = merge.out.to(q.dtype)
        ctx.save_for_backward(q, full, out, merge.lse)
        ctx.group, ctx.piece, ctx.scale, ctx.impl = group, piece, scale, impl
        ctx.key_order, ctx.gathered_len = key_order, n * length
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
        two, b, _, h, d = dkv.shape
        gathered = dkv.new_zeros(two, b, ctx.gathered_len, h, d).index_copy_(2, ctx.key_order, dkv)
        per_member = gathered.reshape(two, b, n, ctx.gathered_len // n, h, d)
        mine = reduce_scatter(per_member.permute(2, 0, 1, 3, 4, 5), ctx.group, "bwd")
        return dq.to(q.dtype), mine[0], mine[1], None, None, None, None, None
