"""The CP train step runs in its executor's layout (4 virtual CPU devices): the batch is
dispatched once, so the compiled step moves only what its attention strategy needs, and the
padding tokens of a length that does not split evenly carry no loss."""

from __future__ import annotations

import dataclasses
import io

import jax.numpy as jnp
import numpy as np
import pytest
from hlo_ops import collectives, op_counts, sharded_fwd_bwd_hlo

from experiments.runners import checks
from experiments.workloads import data, lm, masking, train_step
from experiments.workloads.config import TrainConfig
from experiments.workloads.train import OptimConfig

# The unoptimised CPU backend compiles about twice as fast, with the same collectives.
FAST = {"xla_backend_optimization_level": 0}
FP32_CPU_RTOL = checks.tolerance("fp32", on_gpu=False)
S_HLO = 512  # above every parameter dimension: a collective with a dim >= S_HLO moves a sequence
HLO_MODEL = lm.LMConfig(vocab=64, width=32, depth=2, heads_q=8, heads_kv=2)
HLO_DATA = data.DataConfig(
    seqlen=S_HLO, batch=1, vocab=64, alphabet=2, doc_multiple=16, source="synthetic"
)
PER_LAYER = ("collective-permute", "all-to-all")  # the strategies' own exchanges


def _step_hlo(cfg: TrainConfig):
    """The compiled train step (forward, backward, update) of step 0's batch, and that batch."""
    trainer = train_step.Trainer(cfg)
    batch, arrays, mask_arg = train_step._step_inputs(trainer.cfg, trainer.backend, 0)
    lowered = trainer.compiled.jitted.lower(trainer.params, trainer.opt_state, *arrays, mask_arg)
    return lowered.compile(FAST).as_text(), batch, trainer.backend


def _attention_hlo(batch: data.PackedBatch, backend, m: lm.LMConfig) -> str:
    """One attention call's forward and backward on dispatched arrays, alone."""
    ex = masking.runtime_mask(
        batch.mask, backend, heads_q=m.heads_q, heads_kv=m.heads_kv, head_dim=m.head_dim,
        dtype=jnp.float32,
    )  # fmt: skip
    shape = (1, S_HLO, m.heads_q, m.head_dim)
    return sharded_fwd_bwd_hlo(ex, shape, (*shape[:2], m.heads_kv, m.head_dim), FAST)


@pytest.mark.parametrize("strategy", ["ring", "usp"])
def test_step_moves_only_what_attention_needs(strategy):
    """Every point-to-point round and all-to-all of the step is its layers' attention's own
    (depth x one call's forward and backward): no layer permutes into or out of the layout, as
    each did when attention took global token order. Nothing else moves a whole sequence; the
    all-reduces are the loss's and the parameter gradients'."""
    cfg = TrainConfig(model=HLO_MODEL, data=HLO_DATA, steps=1, cp=strategy, num_devices=4)
    step_hlo, batch, backend = _step_hlo(cfg)
    step, attention = op_counts(step_hlo), op_counts(_attention_hlo(batch, backend, HLO_MODEL))
    assert any(attention[op] for op in PER_LAYER), attention
    for op in PER_LAYER:
        assert step[op] == HLO_MODEL.depth * attention[op], (op, step, attention)
    for op, dims in collectives(step_hlo):
        assert max(dims, default=0) < S_HLO, f"{op} of whole-sequence shape {dims}"


PAD_MODEL = lm.LMConfig(vocab=64, width=32, depth=1, heads_q=4, heads_kv=2)
PAD_DATA = dataclasses.replace(HLO_DATA, seqlen=102, batch=2, doc_multiple=1, fixed_layout=True)
PAD = TrainConfig(model=PAD_MODEL, data=PAD_DATA, optim=OptimConfig(learning_rate=3e-3), steps=2)


def test_padding_tokens_carry_no_loss():
    """S = 102 does not split over 4 devices and per-document zigzag pads every rank: the CP
    losses (the second one after an update from CP gradients) are one device's up to float32
    rounding (the same per-token terms summed in another order). Timing one layer's attention
    alone runs it on dispatched inputs too."""
    cfg = dataclasses.replace(PAD, cp="ring", num_devices=4, attention_iters=1)
    ex = masking.runtime_mask(
        data.batch_at(PAD_DATA, 0).mask, cfg.backend(), heads_q=4, heads_kv=2, head_dim=8,
        dtype=jnp.float32,
    )  # fmt: skip
    assert ex.padded_seqlen > PAD_DATA.seqlen and not ex.splits_evenly
    want = train_step.run(PAD, stream=io.StringIO()).losses
    got = train_step.run(cfg, stream=io.StringIO())
    assert sorted(got.losses) == sorted(want) == [0, 1]
    np.testing.assert_allclose(
        [got.losses[s] for s in want], list(want.values()), rtol=FP32_CPU_RTOL
    )
    assert got.record["metrics"]["attention_time_share"] > 0
