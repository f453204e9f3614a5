"""The train-step workload: a small LM trained on packed documents, timed per step.

    python experiments/run.py --workload=train_step --steps=50 --cp=ring --layout=zigzag \
        --checkpoint_every=10 [--resume]

Data: the running Python's standard library source as byte tokens, one file per document
(--lm_data=stdlib, the default), or synthetic per-document alphabets (--lm_data=synthetic).
Per step: the host builds the batch and its mask argument (MaskArrays or a CP executor; under CP
the batch is dispatched into the executor's layout, where the model runs), then the compiled
step runs and is synchronised; that wall time is the step time. Steps that compile
and the first `warmup` steps are not timed. Reports step time, tokens/s, model TFLOP/s per device
and attention's share of the step (its FLOPs, and the time of one layer's attention call alone x
depth). Results: <out_dir>/results.jsonl (one record per run) and <out_dir>/train_log.jsonl (one
line per step). Checkpoints (Orbax) every `checkpoint_every` steps and at the end; `resume`
continues from the newest intact one with the same subsequent losses. Failures end the process
with one line: an unusable flag value before anything runs (exit status USAGE_ERROR), a failed
run with its error record (exit status 1).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments.core import provenance
from experiments.core.outcomes import ERROR, OK, WRONG, PointFailure, classify, short_traceback
from experiments.core.points import SHORT_DTYPES
from experiments.core.progress import Progress
from experiments.core.results import OutDirBusy, ResultsStore, locked_out_dir
from experiments.runners import checks, memory, timing
from experiments.workloads.nnx_attention import AttentionBackend

from . import attention_time, curves, data, lm, masking, placement, records, train
from .checkpoint import Checkpointer, DamagedCheckpoint
from .config import TrainConfig, device_count, fingerprint, point_fields, run_key

USAGE_ERROR = 2  # exit status of a flag value train_step cannot use (nothing ran)
ATTENTION_SAMPLES = 4  # steps whose masks attention is timed on alone, for its time share


@dataclass(frozen=True)
class Baseline:
    """The curve a run must follow: another kernel's losses by step, and the relative tolerance."""

    impl: str
    losses: dict[int, float]
    rtol: float


@dataclass
class TrainResult:
    """Losses by step of the steps this run executed, its first step, and its summary record."""

    losses: dict[int, float]
    start_step: int
    record: dict | None


@cache
def _compiled_steps(graphdef: Any, optim: train.OptimConfig) -> train.CompiledSteps:
    """One compile cache per model structure and optimizer (shared by runs in one process)."""
    return train.CompiledSteps(train.make_step(graphdef, optim.transform()))


def _step_inputs(cfg: TrainConfig, backend: AttentionBackend, step: int):
    """(batch, placed (tokens, targets, weights, positions), mask argument) of a step, ready on
    the device(s). Under CP the token arrays and positions are dispatched into the executor's
    layout here, once, and the mask argument is the executor InLayout; else positions is None."""
    batch = data.batch_at(cfg.data, step)
    m = cfg.model
    mask_arg = masking.runtime_mask(
        batch.mask,
        backend,
        heads_q=m.heads_q,
        heads_kv=m.heads_kv,
        head_dim=m.head_dim,
        dtype=jnp.dtype(m.dtype),
        fixed_layout=cfg.data.fixed_layout,
    )
    host = (batch.tokens, batch.targets, batch.weights)
    if backend.is_cp:
        arrays = placement.dispatched(mask_arg, host, backend)
        mask_arg = masking.InLayout(mask_arg)
    else:
        sharding = placement.token_sharding(backend, cfg.data.seqlen)
        arrays = (*(placement.put_global(x, sharding) for x in host), None)
    return batch, jax.block_until_ready(arrays), mask_arg


def _attention_sample_steps(cfg: TrainConfig, start: int) -> set[int]:
    """Up to ATTENTION_SAMPLES steps, evenly spread over the timed ones, whose masks the
    attention call is timed on alone (none when not asked for)."""
    first = min(start + cfg.warmup, cfg.steps - 1)
    if cfg.attention_iters <= 0 or first < start:
        return set()
    return {int(x) for x in np.linspace(first, cfg.steps - 1, ATTENTION_SAMPLES).round()}


def _attention_ms(
    cfg: TrainConfig, backend: AttentionBackend, sampled: list[tuple[records.StepTime, Any]]
) -> list[tuple[records.StepTime, list[float]]]:
    """Each sampled step with the per-call times of one layer's attention fwd+bwd alone on that
    step's mask ([] when none was sampled)."""
    if not sampled:
        return []
    m, d = cfg.model, cfg.data
    times = attention_time.time_attention(
        backend,
        [mask_arg for _, mask_arg in sampled],
        shape_q=(d.batch, d.seqlen, m.heads_q, m.head_dim),
        heads_kv=m.heads_kv,
        dtype=jnp.dtype(m.dtype),
        warmup=1,
        iters=cfg.attention_iters,
        seed=d.seed,
    )
    return [(s, t) for (s, _), t in zip(sampled, times)]


def _departure(check: dict) -> str:
    """The reason of a curve that left its baseline's tolerance band."""
    return (
        f"loss curve departs from {check['baseline']}'s at step {check['first_departure']} "
        f"(max relative difference {check['max_rel_diff']:.3g} > {check['rtol']:g})"
    )


def _progress_record(s: records.StepTime, flops_per_device: float) -> dict:
    """What Progress prints for a step: its model TFLOP/s and time."""
    tflops = flops_per_device / (s.time_ms * 1e-3) / 1e12
    return {
        "status": "ok",
        "metrics": {"tflops": {"median": tflops}, "time_ms": {"median": s.time_ms}},
    }


def _steps(steps: list[int]) -> str:
    """'step 4' or 'steps 6, 4'."""
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


class Trainer:
    """The live state of a run: placed params and optimizer state, compiled steps, checkpoints."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.backend = cfg.backend()
        self.cfg = cfg.resolved(self.backend)
        tx = self.cfg.optim.transform()
        sharding = placement.replicated(self.backend)
        graphdef, self.params, self.opt_state = train.init_state(
            self.cfg.model, self.backend, tx, self.cfg.data.seed, sharding
        )
        self.compiled = _compiled_steps(graphdef, self.cfg.optim)
        self.ckpt = None
        if self.cfg.uses_checkpoints:
            self.ckpt = Checkpointer(self.cfg.ckpt_dir, self.cfg.checkpoint_every)

    def restore(self, say: Callable[[str], None]) -> int:
        """Load the newest intact checkpoint when resuming (it must be of this run) and delete
        the damaged ones after it, which the run writes again; the first step."""
        if not (self.cfg.resume and self.ckpt is not None):
            return 0
        steps = self.ckpt.steps()
        if not steps:
            say(f"--resume: no checkpoint in {self.ckpt.directory}; starting from step 0")
            return 0
        start, damaged = self._load_newest_intact(steps, say)
        for step in damaged:
            self.ckpt.delete(step)
        gone = f" (deleted damaged {_steps(damaged)})" if damaged else ""
        say(f"Resumed from {self.ckpt.directory} at step {start}{gone}")
        return start

    def _load_newest_intact(
        self, steps: list[int], say: Callable[[str], None]
    ) -> tuple[int, list[int]]:
        """Load the newest of `steps` (newest first) that reads back, one line per damaged one
        before it; (its data position, the damaged steps). PointFailure when none reads back."""
        damaged = []
        for older, step in zip([*steps[1:], None], steps):
            try:
                return self._load(step), damaged
            except DamagedCheckpoint as e:
                say(f"--resume: {e}" + ("" if older is None else f"; trying step {older}"))
                damaged.append(step)
        raise PointFailure(
            ERROR,
            f"--resume: no intact checkpoint in {self.ckpt.directory} (damaged: "
            f"{_steps(damaged)}); move or delete that folder to start from step 0",
        )

    def _load(self, step: int) -> int:
        """Load checkpoint `step` (refused if it is of another run); its data position."""
        meta = self.ckpt.meta(step)
        want = fingerprint(self.cfg)
        got = {k: meta.get(k) for k in want}
        if got != want:
            raise ValueError(
                f"checkpoint {self.ckpt.step_dir(step)} is of another run: {got} != {want}"
            )
        self.params, self.opt_state = self.ckpt.restore(step, self.params, self.opt_state)
        return int(meta["data_position"])

    def step(self, step: int) -> tuple[records.StepTime, float | None, Any]:
        """Run training step `step`: (its StepTime, compile seconds or None, mask argument)."""
        cfg = self.cfg
        batch, arrays, mask_arg = _step_inputs(cfg, self.backend, step)
        fn, compile_s = self.compiled.get(self.params, self.opt_state, *arrays, mask_arg)
        t0 = time.perf_counter()
        self.params, self.opt_state, loss = fn(self.params, self.opt_state, *arrays, mask_arg)
        loss = float(jax.block_until_ready(loss))
        s = records.StepTime(
            step=step,
            loss=loss,
            time_ms=(time.perf_counter() - t0) * 1e3,
            flops=lm.step_flops(cfg.model, batch.mask, cfg.data.batch),
            density=batch.mask.density(),
            timed=compile_s is None,
        )
        return s, compile_s, mask_arg

    def checkpoint(self, done: int) -> None:
        """Save after `done` steps when it is a save step (and always after the last step)."""
        if self.ckpt is None or self.cfg.checkpoint_every <= 0:
            return
        meta = {"step": done, "data_position": done, **fingerprint(self.cfg)}
        self.ckpt.save(done, self.params, self.opt_state, meta, force=done == self.cfg.steps)

    def close(self) -> None:
        """Finish pending checkpoint writes."""
        if self.ckpt is not None:
            self.ckpt.close()


def run(
    cfg: TrainConfig,
    *,
    prov: dict | None = None,
    on_step: Callable[[int, float], None] | None = None,
    stream: TextIO | None = None,
    baseline: Baseline | None = None,
) -> TrainResult:
    """Train up to cfg.steps steps (from the newest checkpoint with cfg.resume), log and record.

    on_step(step, loss) is called after every step and its checkpoint (tests interrupt with it).
    With a baseline, the record is `wrong` when the loss curve departs from it (curves.compare).
    """
    t_start = time.monotonic()
    writer = jax.process_index() == 0
    out = stream or sys.stdout
    say = (lambda msg: print(msg, file=out, flush=True)) if writer else (lambda msg: None)
    _require_fits(cfg)
    trainer = Trainer(cfg)
    cfg, backend = trainer.cfg, trainer.backend
    key = run_key(cfg, backend)
    log = records.StepLog(cfg.out_dir) if cfg.out_dir and writer else None
    executed: list[records.StepTime] = []
    sampled: list[tuple[records.StepTime, Any]] = []  # (step, its mask argument)
    try:
        start = trainer.restore(say)
        if log is not None:
            log.drop_steps_from(key, start)  # this run logs them again
        progress = Progress(cfg.steps, start, stream=out) if writer else None
        sample_steps = _attention_sample_steps(cfg, start)
        for step in range(start, cfg.steps):
            s, compile_s, mask_arg = trainer.step(step)
            s.timed = s.timed and step - start >= cfg.warmup
            if step in sample_steps:
                sampled.append((s, mask_arg))
            executed.append(s)
            if log is not None:
                log.append(records.step_record(key, s, compile_s))
            if progress is not None:
                per_device = s.flops["total"] / device_count(backend)
                progress.update(f"step {step} loss {s.loss:.4f}", _progress_record(s, per_device))
            trainer.checkpoint(step + 1)
            if on_step is not None:
                on_step(step, s.loss)
    finally:
        trainer.close()
    result = TrainResult({s.step: s.loss for s in executed}, start, None)
    if not executed:
        say(f"Nothing to do: the checkpoint is already at step {start} of {cfg.steps}")
        return result
    metrics = records.step_metrics(
        executed,
        tokens_per_step=cfg.data.batch * cfg.data.seqlen,
        num_devices=device_count(backend),
        depth=cfg.model.depth,
        attention_ms=_attention_ms(cfg, backend, sampled),
    )
    peak = timing.jax_peak_bytes(jax.local_devices())
    metrics["peak_mem_gib"] = None if peak is None else peak / timing.GIB
    metrics["mem_source"] = None if peak is None else "device_peak_bytes_in_use"
    metrics["start_step"] = start
    check = None
    if baseline is not None:
        check = curves.compare(
            result.losses, baseline.losses, baseline_name=baseline.impl, tol=baseline.rtol
        )
    result.record = records.summary_record(
        key,
        point_fields(cfg, backend),
        metrics,
        time.monotonic() - t_start,
        prov or {},
        status=OK if check is None or check["passed"] else WRONG,
        reason=None if check is None or check["passed"] else _departure(check),
        check=check,
    )
    if cfg.out_dir and writer:
        ResultsStore(cfg.out_dir).append(result.record)
    return result


def _require_fits(cfg: TrainConfig) -> None:
    """A predicted oom, before anything is built, for a dense impl whose saved attention
    probabilities cannot fit on one device (runners.memory.require_training_fits)."""
    backend = cfg.backend()
    if backend.is_cp:
        return
    capacity, _ = memory.jax_capacity()
    memory.require_training_fits(
        backend.resolved_impl,
        depth=cfg.model.depth,
        batch=cfg.data.batch,
        heads_q=cfg.model.heads_q,
        seqlen=cfg.data.seqlen,
        itemsize=jnp.dtype(cfg.model.dtype).itemsize,
        capacity_bytes=capacity,
    )


def run_from_flags(flag_values: Any) -> int:
    """run.py --workload=train_step: run (or resume) the configured training once per --impl
    (the baseline kernel first, every other curve checked against it); exit code."""
    from experiments.runners import cp_launch

    from . import flags as workload_flags

    cp_launch.init_jax_distributed(
        workload_flags.shared(flag_values, "coordinator_address"),
        workload_flags.shared(flag_values, "num_processes"),
        workload_flags.shared(flag_values, "process_id"),
    )
    on_gpu = jax.default_backend() == "gpu"
    cfgs = _usable_configs(flag_values, on_gpu)
    if cfgs is None:
        return USAGE_ERROR
    # The writing process holds the output folder's lock for the whole run, as the sweep does.
    writer = jax.process_index() == 0
    try:
        with locked_out_dir(cfgs[0].out_dir) if writer else contextlib.nullcontext():
            return _train_all(cfgs, flag_values, on_gpu)
    except OutDirBusy as e:
        print(f"train_step: {e}", file=sys.stderr, flush=True)
        return e.exit_code


def _train_all(cfgs: list[TrainConfig], flag_values: Any, on_gpu: bool) -> int:
    """Each config's run, the baseline kernel first (every other curve checked against it),
    then the loss-curve plot; exit code."""
    from . import flags as workload_flags

    if jax.process_index() == 0:
        if not on_gpu:
            print("No GPU: using the embedded CPU default sizes for flags left unset.", flush=True)
        print(cfgs[0].data.describe(), flush=True)
    prov = provenance.collect(workload_flags.flag_dict(flag_values))
    by_impl = {cfg.backend().resolved_impl: cfg for cfg in cfgs}
    first = curves.baseline_impl(list(by_impl)) if len(by_impl) > 1 else None
    order = sorted(by_impl, key=lambda impl: impl != first)
    rtol = checks.tolerance(SHORT_DTYPES[cfgs[0].model.dtype], on_gpu=on_gpu)
    code, logged, baseline, missed = 0, {}, None, []
    for impl in order:
        record = _run_recorded(by_impl[impl], prov, baseline)
        code = code or int(record is None or record["status"] != OK)
        if record is not None:
            logged[impl] = records.logged_losses(by_impl[impl].out_dir, record["key"])
        if first is None or baseline is not None:
            continue
        if record is not None and record["status"] == OK and logged[impl]:
            baseline = Baseline(impl, logged[impl], rtol)
            if missed and jax.process_index() == 0:
                print(
                    f"train_step: {impl}'s curve is the baseline ({'; '.join(missed)})", flush=True
                )
        else:
            missed.append(f"{impl}: {'nothing run' if record is None else record['status']}")
    if logged and jax.process_index() == 0:
        out_dir = cfgs[0].out_dir
        floor, floor_label = cfgs[0].data.floor()
        path = curves.plot(
            logged,
            f"{out_dir}/loss_curves.png",
            title=_curve_title(cfgs[0]),
            floor=floor,
            floor_label=floor_label,
        )
        print(f"Loss curves: {path}", flush=True)
    return code


def _usable_configs(flag_values: Any, on_gpu: bool) -> list[TrainConfig] | None:
    """The flags' configs with their folders made, or None after one line on stderr naming the
    flag value that cannot be used and what is expected."""
    from . import flags as workload_flags

    try:
        cfgs = workload_flags.train_configs(flag_values, on_gpu)
        workload_flags.check_folders(cfgs)
    except flags.ValidationError as e:
        print(f"train_step: {e}", file=sys.stderr, flush=True)
        return None
    return cfgs


def _curve_title(cfg: TrainConfig) -> str:
    """What the loss-curve figure shows: model, data and CP placement."""
    m, d = cfg.model, cfg.data
    where = f", CP {cfg.cp} ({cfg.layout})" if cfg.cp else ""
    return (
        f"train_step: {m.depth}x{m.width} LM, vocab {m.vocab}, {d.source} data, "
        f"S={d.seqlen} x {d.batch}, {m.dtype}{where}"
    )


def _run_recorded(cfg: TrainConfig, prov: dict, baseline: Baseline | None) -> dict | None:
    """Run one configuration; a failure becomes its status record. The record (None when a
    finished checkpoint left nothing to run)."""
    t0 = time.monotonic()
    try:
        result = run(cfg, prov=prov, baseline=baseline)
    except Exception as e:
        status, reason = classify(e)
        backend = cfg.backend()
        cfg = cfg.resolved(backend)
        record = records.summary_record(
            run_key(cfg, backend),
            point_fields(cfg, backend),
            None,
            time.monotonic() - t0,
            prov,
            status=status,
            reason=reason,
            traceback=short_traceback(e),
        )
        if jax.process_index() == 0:
            ResultsStore(cfg.out_dir).append(record)
            print(f"train_step: {status}: {reason}", flush=True)
        return record
    if result.record is not None and jax.process_index() == 0:
        _print_summary(result.record, cfg.out_dir)
    return result.record


def _loss_change(metrics: dict) -> str:
    """The loss from the first to the last steps run, as means over a window (single steps are
    noisy: one batch's documents); older records have single steps only."""
    if "first_mean_loss" not in metrics:
        return f"loss {metrics['first_loss']:.4f} -> {metrics['last_loss']:.4f}"
    n = metrics["mean_window"]
    change = (
        f"loss ({n}-step means) {metrics['first_mean_loss']:.4f} -> {metrics['last_mean_loss']:.4f}"
    )
    trend = metrics.get("learning")
    if trend is None or trend["worst_spike_step"] is None:
        return change
    blocks = len(trend["block_means"])
    falling = "falling" if trend["blocks_falling"] else "NOT falling"
    trend_words = f"{blocks} {n}-step block means {falling}; " if blocks > 1 else ""
    return (
        f"{change} ({trend['last_over_first']:.2f}x; {trend_words}worst step "
        f"{trend['worst_spike_step']} at {trend['worst_spike_ratio']:.2f}x the mean of the "
        f"{n} before)"
    )


def _print_summary(record: dict, out_dir: str | None) -> None:
    """One paragraph: impl, step time, tokens/s, TFLOP/s, attention shares, losses, curve check."""
    m, check = record["metrics"], record["check"]
    share = m.get("attention_time_share")
    time_share = "" if share is None else f", {100 * share:.1f}% of the step time"
    verdict = ""
    if check is not None:
        verdict = (
            f" Curve within {check['rtol']:g} of {check['baseline']}'s (first "
            f"{check['window']} steps and {check['window']}-step means)."
            if check["passed"]
            else f" WRONG: {record['reason']}."
        )
    print(
        f"train_step [{record['point']['impl']}]: {m['time_ms']['median']:.4g} ms/step, "
        f"{m['tokens_per_s']['median']:.4g} tokens/s, "
        f"{m['tflops']['median']:.4g} model TFLOP/s per device; attention "
        f"{100 * m['attention_flop_share']:.1f}% of the FLOPs{time_share}; "
        f"{_loss_change(m)}.{verdict} Results: {out_dir}",
        flush=True,
    )
