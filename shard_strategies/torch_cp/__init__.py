"""PyTorch context-parallel attention: the shared CPPlan run with torch.distributed.

    from shard_strategies import torch_cp
    device = torch_cp.init_distributed()          # torchrun or srun; NCCL on GPUs, gloo on CPU
    out = torch_cp.attention(q, k, v, mask, strategy="usp", layout="zigzag")   # global tensors
    plan = torch_cp.get_plan(mask, world_size, "ring", "zigzag")
    q_local = torch_cp.dispatch(q, plan)          # callers holding shards: shard_attention
    out = torch_cp.undispatch(torch_cp.shard_attention(q_l, k_l, v_l, plan), plan)
    ex = torch_cp.build(mask, strategy="ring", num_heads_q=64, num_heads_kv=8, head_dim=128)
    out_l = ex.sharded(*map(ex.dispatch, (q, k, v)))   # the same as jax_cp.build's executor

Strategies (the plan of `shard_strategies.make_plan`, the same as the JAX executor's, so both
hold the same tokens on the same rank and move the same bytes):
- ring: K/V travel by `dist.batch_isend_irecv`; the next block's transfer is posted before the
  current step's compute (on GPU NCCL runs it on its own stream); backward walks the same chain
  with the K/V again and a fp32 dK/dV accumulator behind each block (autograd.Function; each
  step's forward is recomputed there, as in the JAX executor's VJP).
- double_ring: the ring split into windows (LoongTrain): the next window's block is posted when a
  window pass starts and arrives behind the whole inner ring; with the default group, inner and
  outer transfers use their own process groups so NCCL can run them concurrently.
- allgather: one all-gather of K/V (kept for the backward), one reduce-scatter of dK/dV.
- ulysses: one `all_to_all_single` for q, k, v (sequence -> heads), one back for the output; K/V
  heads are repeated when the group is larger than Hkv; heads that do not split raise early.
- usp: Ulysses groups x ring groups; `inner_axis` says which axis is made of consecutive ranks
  (the intra-node one: "ulysses", the default, or "ring"). double_ring takes ulysses_size too.
Process groups: with group=None the Ulysses/ring/window subgroups are `dist.new_group`s made on
the first call by every rank (SPMD) and cached. With a caller's group no subgroup is made (ranks
outside it would have to join): the Ulysses all-to-all runs on that group with zero-size chunks
outside one's Ulysses group, and all P2P shares that group's communicator.
Layouts: contiguous, zigzag (per-document head/tail chunks), balanced (chunks dealt by area).
Each (rank, step) runs `torch_attn.attention` on the plan's mask piece (trimmed to its non-empty
rows/columns except for flex); steps empty on every rank are skipped; steps merge by LSE in fp32
and rows that see nothing give out 0, lse -inf, never NaN. Default impl: flex on CUDA, naive on
CPU. sent_bytes() counts what this rank sent per pass ("fwd", "bwd"; "dispatch" and "lse" for
the traffic plans leave out), to compare with `plan.comm_volume(...)`.

Gradients of `attention`: the dispatch backward all-gathers the shards' gradients, so after
`out.backward(dout)` every rank holds the full global dq/dk/dv (the same on every rank), given
that every rank back-propagates the same dout.

The per-rank step functions (forward_step, backward_step, add_grads, local_core with Cotangents,
LseMerge and plan_pieces, the executor's split of the plan into trimmed pieces) are exported for
the CP predictor, which runs them rank by rank on one device.

Launch (one process per GPU; `init_distributed` reads the variables either launcher sets):
    torchrun --standalone --nproc-per-node=8 experiments/run.py --framework=torch --preset=cp_bench
    torchrun --nnodes=$NNODES --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=$MASTER_ADDR:29500 experiments/run.py --framework=torch --preset=cp_bench
    srun --nodes=$NNODES --ntasks-per-node=8 --gpus-per-node=8 \\
        python experiments/run.py --framework=torch --preset=cp_bench  # MASTER_ADDR: node 0
"""

from ._api import (
    CPExecutor,
    attention,
    bind,
    build,
    dispatch,
    get_plan,
    local_core,
    plan_pieces,
    shard_attention,
    undispatch,
)
from ._comm import reset_sent_bytes, sent_bytes
from ._launch import init_distributed
from ._local import LseMerge, acc_dtype, default_impl
from ._steps import Cotangents, Piece, add_grads, backward_step, forward_step

__all__ = [
    "CPExecutor",
    "Cotangents",
    "LseMerge",
    "Piece",
    "acc_dtype",
    "add_grads",
    "attention",
    "backward_step",
    "bind",
    "build",
    "default_impl",
    "dispatch",
    "forward_step",
    "get_plan",
    "init_distributed",
    "local_core",
    "plan_pieces",
    "reset_sent_bytes",
    "sent_bytes",
    "shard_attention",
    "undispatch",
]
