"""The train-step workload on CPU: a tiny LM learns, resumes exactly, matches under CP; RoPE
positions stay global under CP layouts; PyTorch verifies a JAX parity bundle."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import shard_strategies as ss
from attn_masks import make_mask
from experiments.core.results import read_records
from experiments.runners import checks
from experiments.workloads import bundle, data, lm, parity, text_corpus, train_step
from experiments.workloads import flags as flags_module
from experiments.workloads.config import TrainConfig
from experiments.workloads.nnx_attention import Attention, AttentionBackend
from experiments.workloads.placement import cp_mesh
from experiments.workloads.train import OptimConfig

ROOT = Path(__file__).resolve().parent.parent
SEQLEN, BATCH, VOCAB = 128, 4, 64
MODEL = lm.LMConfig(vocab=VOCAB, width=64, depth=2, heads_q=4, heads_kv=2)
# Documents are multiples of 16 = 2 x 8 devices, so the zigzag layout needs no padding. The tiny
# runs use the synthetic task: this model learns it within 40 steps, and at S=128 its layouts hold
# several documents (one stdlib file mostly fills 128 bytes alone). The default data's own tests:
# tests/test_text_data.py and test_cpu_default_learns.
DATA = data.DataConfig(
    seqlen=SEQLEN, batch=BATCH, vocab=VOCAB, seed=0, alphabet=2, doc_multiple=16, source="synthetic"
)
TINY = TrainConfig(model=MODEL, data=DATA, optim=OptimConfig(learning_rate=3e-3), steps=40)
QUIET = io.StringIO()
FP32_CPU_RTOL = checks.tolerance("fp32", on_gpu=False)  # the loss-curve tolerance here


class Interrupted(Exception):
    """Stands in for a kill in the middle of a run."""


def run(cfg: TrainConfig, **kw) -> train_step.TrainResult:
    return train_step.run(cfg, stream=QUIET, **kw)


@pytest.fixture(scope="module")
def baseline() -> dict[int, float]:
    """Losses of an uninterrupted single-device run of TINY."""
    return run(TINY).losses


def test_batches_are_packed_documents_and_deterministic():
    a, b = data.batch_at(DATA, 3), data.batch_at(DATA, 3)
    assert np.array_equal(a.tokens, b.tokens) and a.seqlens == b.seqlens
    assert sum(a.seqlens) == SEQLEN and all(n % 16 == 0 for n in a.seqlens)
    assert a.mask.area() == make_mask("causal_document", SEQLEN, seqlens=list(a.seqlens)).area()
    ends = np.cumsum(a.seqlens) - 1
    assert (a.weights[:, ends] == 0).all() and a.weights.sum() == BATCH * (SEQLEN - len(ends))
    doc_start = 0
    for n in a.seqlens:  # every document uses at most `alphabet` distinct tokens
        assert all(len(set(row[doc_start : doc_start + n])) <= DATA.alphabet for row in a.tokens)
        doc_start += n


def test_loss_goes_down(baseline):
    losses = np.array([baseline[s] for s in sorted(baseline)])
    assert np.isfinite(losses).all()
    assert losses[-5:].mean() < losses[:5].mean() - 0.7, losses.round(2)


def test_checkpoint_resume_reproduces_losses(baseline, tmp_path):
    cfg = dataclasses.replace(TINY, steps=12, checkpoint_every=4, ckpt_dir=str(tmp_path / "ck"))

    def kill_after_step_5(step: int, loss: float) -> None:
        if step == 5:
            raise Interrupted

    with pytest.raises(Interrupted):
        run(cfg, on_step=kill_after_step_5)
    resumed = run(dataclasses.replace(cfg, resume=True))
    assert resumed.start_step == 4  # the last periodic checkpoint: at most 4 steps lost
    assert sorted(resumed.losses) == list(range(4, 12))
    for step, loss in resumed.losses.items():  # bitwise: the same program on the same state
        assert loss == baseline[step], (step, loss, baseline[step])
    done = run(dataclasses.replace(cfg, resume=True))  # the final checkpoint: nothing left
    assert done.start_step == 12 and not done.losses


# Ulysses over 8 ranks needs 8 query heads; K/V heads (2) divide 8.
CP_MODEL = dataclasses.replace(MODEL, heads_q=8, heads_kv=2)
CP_TINY = dataclasses.replace(TINY, model=CP_MODEL, steps=3)


@pytest.fixture(scope="module")
def cp_baseline() -> train_step.Baseline:
    """The single-device curve every CP strategy must follow (fp32 CPU tolerance)."""
    return train_step.Baseline("one device", run(CP_TINY).losses, FP32_CPU_RTOL)


@pytest.mark.parametrize(
    "strategy,layout",
    [
        ("ring", "zigzag"),
        ("allgather", "balanced"),
        ("ulysses", "contiguous"),
        ("usp", "zigzag"),
        ("double_ring", "zigzag"),
    ],
)
def test_cp_loss_curves_follow_single_device(cp_baseline, strategy, layout):
    cfg = dataclasses.replace(CP_TINY, cp=strategy, layout=layout, num_devices=8)
    got = run(cfg, baseline=cp_baseline)
    assert got.record["point"]["num_devices"] == 8 and got.record["point"]["cp"] == strategy
    assert got.record["status"] == "ok", got.record["reason"]
    assert got.record["check"]["steps"] == CP_TINY.steps


KERNEL_TINY = dataclasses.replace(TINY, steps=10)


def _roll_dq(monkeypatch) -> None:
    """Give every attention call a wrong dQ: each query row gets a tenth of its neighbour's
    gradient added, like a kernel that reads another tile's statistics."""
    from experiments.workloads import nnx_attention

    exact = nnx_attention.attention

    @jax.custom_vjp
    def wrong(q, k, v, mask):
        return exact(q, k, v, mask, impl="reference")

    def fwd(q, k, v, mask):
        out, vjp = jax.vjp(lambda q_, k_, v_: exact(q_, k_, v_, mask, impl="reference"), q, k, v)
        return out, (vjp, mask)

    def bwd(res, g):
        vjp, mask = res
        dq, dk, dv = vjp(g)
        zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), mask)
        return dq + 0.1 * jax.numpy.roll(dq, 1, axis=1), dk, dv, zeros

    wrong.defvjp(fwd, bwd)
    monkeypatch.setattr(
        nnx_attention, "attention", lambda q, k, v, mask, impl: wrong(q, k, v, mask)
    )
    fresh = functools.cache(train_step._compiled_steps.__wrapped__)  # no step compiled before
    monkeypatch.setattr(train_step, "_compiled_steps", fresh)


def test_kernel_loss_curves_agree_and_a_wrong_dq_departs(monkeypatch):
    reference = run(KERNEL_TINY).losses
    base = train_step.Baseline("reference", reference, FP32_CPU_RTOL)
    pallas = run(dataclasses.replace(KERNEL_TINY, impl="pallas"), baseline=base)
    assert pallas.record["status"] == "ok", pallas.record["reason"]
    assert pallas.record["check"]["steps"] == KERNEL_TINY.steps
    _roll_dq(monkeypatch)
    broken = run(dataclasses.replace(KERNEL_TINY, steps=6), baseline=base)
    assert broken.record["status"] == "wrong"
    assert broken.record["check"]["first_departure"] <= 5, broken.record["check"]


def test_compile_time_mask_impl_follows_reference_on_a_fixed_layout():
    fixed = dataclasses.replace(KERNEL_TINY, data=dataclasses.replace(DATA, fixed_layout=True))
    layouts = {data.batch_at(fixed.data, s).seqlens for s in range(fixed.steps)}
    assert len(layouts) == 1 and len({data.batch_at(DATA, s).seqlens for s in range(10)}) > 1
    reference = run(fixed).losses
    base = train_step.Baseline("reference", reference, FP32_CPU_RTOL)
    xla = run(dataclasses.replace(fixed, impl="xla"), baseline=base)
    assert xla.record["status"] == "ok", xla.record["reason"]
    with pytest.raises(Exception, match="lm_fixed_layout"):
        run(dataclasses.replace(KERNEL_TINY, impl="xla", steps=1))


def test_cpu_default_learns(tmp_path, capsys):
    """The embedded CPU default (Python source bytes): the 20-step mean loss ends below the
    corpus's unigram entropy, the best loss without context, which the run names in one line."""
    from experiments.run import run_cli

    assert run_cli(["--workload=train_step", f"--out_dir={tmp_path}"]) == 0
    corpus = text_corpus.load()
    lines = capsys.readouterr().out.splitlines()
    assert lines.count(f"data: {corpus.summary()}") == 1, lines[:5]
    (record,) = read_records(tmp_path / "results.jsonl")
    point = record["point"]
    assert (point["data"]["source"], point["model"]["vocab"]) == ("stdlib", 256)
    losses = record["metrics"]["losses"]
    curve = np.array([losses[str(s)] for s in range(len(losses))])
    assert len(curve) == flags_module.CPU_DEFAULTS["steps"]
    assert curve[-20:].mean() < corpus.entropy, (corpus.entropy, curve[-20:].round(2))
    assert curve[-20:].mean() < 0.6 * curve[:20].mean()
    png = tmp_path / "loss_curves.png"
    assert png.stat().st_size > 10_000


def test_curve_check_compares_moving_means_so_batch_noise_passes_and_a_bias_departs():
    """Steps past the 20th that alternate +-5% around the baseline (correct kernels parting
    chaotically) pass a 2% check of the 20-step means; the same noise from step 10 departs
    there; a steady +3% departs at step 0; a NaN departs where it is."""
    from experiments.workloads.curves import compare

    rng = np.random.default_rng(3)
    base = {s: float(x) for s, x in enumerate(rng.uniform(2.0, 4.0, 60))}
    noisy = {s: x * (1.0 if s < 20 else 1.05 if s % 2 else 0.95) for s, x in base.items()}
    check = compare(noisy, base, baseline_name="xla", tol=0.02)
    assert check["passed"] and check["first_departure"] is None
    assert check["max_step_rel_diff"] == pytest.approx(0.05)
    assert check["max_rel_diff"] < 0.02
    early = {s: x * (1.0 if s < 10 else 1.05 if s % 2 else 0.95) for s, x in base.items()}
    assert compare(early, base, baseline_name="xla", tol=0.02)["first_departure"] == 10
    biased = {s: x * 1.03 for s, x in base.items()}
    check = compare(biased, base, baseline_name="xla", tol=0.02)
    assert (check["passed"], check["first_departure"]) == (False, 0)
    assert check["max_rel_diff"] == pytest.approx(0.03)
    broken = {**base, 37: float("nan")}
    assert compare(broken, base, baseline_name="xla", tol=0.02)["first_departure"] == 37
    with pytest.raises(ValueError, match="no step in common"):
        compare({100: 1.0}, base, baseline_name="xla", tol=0.02)


def test_learning_trend_blocks_and_worst_spike_match_a_direct_count():
    """curves.learning against loops written from its definition, on a random falling curve with
    a planted spike and, separately, one block that rises."""
    from experiments.workloads.curves import learning

    rng = np.random.default_rng(7)
    n, w = 130, 20
    losses = list(6.0 * np.exp(-np.arange(n) / 60.0) + rng.uniform(0.0, 0.05, n))
    losses[77] *= 1.8
    got = learning(losses, w)
    blocks = [sum(losses[i : i + w]) / w for i in range(0, n - w + 1, w)]
    assert len(got["block_means"]) == n // w
    np.testing.assert_allclose(got["block_means"], blocks, rtol=1e-12)
    ratios = {
        i: losses[i] / (sum(losses[max(0, i - w) : i]) / len(losses[max(0, i - w) : i]))
        for i in range(1, n)
    }
    worst = max(ratios, key=ratios.get)
    assert got["worst_spike_step"] == worst == 77
    assert got["worst_spike_ratio"] == pytest.approx(ratios[worst], rel=1e-12)
    assert got["blocks_falling"] is True
    assert got["first_mean"] == pytest.approx(np.mean(losses[:w]), rel=1e-12)
    assert got["last_mean"] == pytest.approx(np.mean(losses[-w:]), rel=1e-12)
    assert got["last_over_first"] == pytest.approx(np.mean(losses[-w:]) / np.mean(losses[:w]))
    rising = losses[:]
    rising[60:80] = [x + 1.0 for x in rising[60:80]]
    assert learning(rising, w)["blocks_falling"] is False


def _layer(backend: AttentionBackend | None = None) -> Attention:
    return Attention(64, 4, 2, backend=backend, rngs=nnx.Rngs(0))


def _packed_mask():
    return make_mask("causal_document", SEQLEN, seqlens=[48, 16, 64])


def test_rotary_positions_are_global_token_indices():
    mask = _packed_mask()
    x = jax.random.normal(jax.random.key(1), (2, SEQLEN, 64))
    want = np.asarray(_layer()(x, mask))
    order = ss.make_layout(mask, 4, "zigzag").order()  # the tokens in zigzag (rank) order
    local = mask.restrict(order, order)
    got = np.asarray(_layer()(x[:, order], local, positions=order))
    np.testing.assert_allclose(got, want[:, order], rtol=1e-5, atol=1e-5)
    wrong = np.asarray(_layer()(x[:, order], local))  # local indices as positions: not the same
    assert np.abs(wrong - want[:, order]).max() > 1e-3


@pytest.mark.parametrize("layout", ["zigzag", "balanced"])
def test_cp_attention_module_matches_single_device(layout):
    mask = _packed_mask()
    x = jax.random.normal(jax.random.key(2), (1, SEQLEN, 64))
    backend = AttentionBackend(mesh=cp_mesh(8), strategy="ring", layout=layout)
    want = np.asarray(_layer()(x, mask))
    got = np.asarray(_layer(backend)(x, mask))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _parse_run_flags(args: list[str]):
    """run.py's flags and the workload flags on the global FLAGS, parsed from `args`."""
    from absl import flags

    from experiments.core import flags as run_flags
    from experiments.workloads import flags as workload_flags

    run_flags.define_flags()
    workload_flags.define_flags()
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["run.py", *args])
    return flags.FLAGS


TINY_FLAGS = ["--seqlen=128", "--batch=4", "--depth=2", "--width=64", "--lm_heads_q=4"]
TINY_FLAGS += ["--lm_heads_kv=2", "--vocab=64", "--seed=0", "--lm_data=synthetic"]  # as TINY


def test_run_from_flags_writes_results_and_checkpoints(tmp_path):
    out = tmp_path / "out"
    args = ["--workload=train_step", f"--out_dir={out}", "--steps=3", "--warmup=1", "--iters=2"]
    fv = _parse_run_flags([*args, "--checkpoint_every=2", *TINY_FLAGS])
    try:
        assert train_step.run_from_flags(fv) == 0
    finally:
        fv.unparse_flags()
    (record,) = read_records(out / "results.jsonl")
    m = record["metrics"]
    assert record["status"] == "ok" and record["point"]["workload"] == "train_step"
    assert m["time_ms"]["median"] > 0 and m["tokens_per_s"]["median"] > 0
    assert m["tflops"]["median"] > 0 and 0 < m["attention_flop_share"] < 1
    assert m["attention_time_share"] > 0 and m["timed_steps"] == 2
    assert m["attention_time_steps"] == [1, 2]  # the timed steps, each timed on its own mask
    assert len(read_records(out / "train_log.jsonl")) == 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "3"]


def test_attention_time_share_relates_each_sampled_mask_to_its_own_step():
    """Attention's share of the step time pairs each sampled step's time with the attention call
    timed on that step's mask (documents, and so attention's cost, change every step); a sampled
    step that was not timed (warm-up, compiling) is left out when other steps are timed."""
    from experiments.workloads.records import StepTime, step_metrics

    rng = np.random.default_rng()
    times = rng.uniform(100, 500, 4)
    steps = [
        StepTime(i, 2.0, float(t), {"total": 1e12, "attention": 4e11}, 0.5, i > 0)
        for i, t in enumerate(times)
    ]
    attn = {i: list(rng.uniform(5, 40, 3)) for i in range(4)}
    m = step_metrics(
        steps,
        tokens_per_step=1024,
        num_devices=1,
        depth=8,
        attention_ms=[(steps[i], attn[i]) for i in (0, 1, 3)],
    )
    want = 8 * (np.median(attn[1]) + np.median(attn[3])) / (times[1] + times[3])
    assert m["attention_time_steps"] == [1, 3]
    np.testing.assert_allclose(m["attention_time_share"], want, rtol=1e-12)
    # only a compiling step sampled while others are timed: no share rather than a wrong one
    m = step_metrics(
        steps, tokens_per_step=1024, num_devices=1, depth=8, attention_ms=[(steps[0], attn[0])]
    )
    assert "attention_time_share" not in m


def test_train_step_refuses_an_output_folder_another_run_holds(tmp_path, capsys):
    """Two training runs into one folder would interleave their logs and checkpoints: the
    second stops at once, naming the holder, before it trains anything."""
    from experiments.core.results import OutDirBusy, locked_out_dir

    out = tmp_path / "out"
    out.mkdir()
    fv = _parse_run_flags(["--workload=train_step", f"--out_dir={out}", "--steps=2", *TINY_FLAGS])
    try:
        with locked_out_dir(out):
            assert train_step.run_from_flags(fv) == OutDirBusy.exit_code
    finally:
        fv.unparse_flags()
    assert "in use by another run" in capsys.readouterr().err
    assert not (out / "results.jsonl").exists() and not (out / "checkpoints").exists()


def test_parity_of_both_frameworks_runs_a_worker_each_and_records_both_sides(tmp_path):
    """--framework=both: JAX saves the bundle and PyTorch verifies it, each in a worker process
    of its own (the driver's workers), each side a record in the driver's format."""
    out, path = tmp_path / "out", tmp_path / "bundle"
    args = ["--framework=both", f"--parity_bundle={path}", f"--out_dir={out}", "--impl=xla,naive"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), *args, *TINY_FLAGS],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--- jax points in a worker" in proc.stdout and "Parity (naive" in proc.stdout
    saved, verified = read_records(out / "results.jsonl")
    assert saved["point"]["framework"] == "jax" and saved["point"]["impl"] == "xla"
    assert verified["point"]["framework"] == "torch" and verified["point"]["jax_impl"] == "xla"
    assert saved["status"] == verified["status"] == "ok"
    meta = json.loads((path / bundle.META_JSON).read_text())
    assert verified["point"]["shape_q"] == meta["shapes"]["q"] and meta["impl"] == "xla"
    limit = verified["rtol"] * checks.GRAD_FACTOR
    assert set(verified["errors"]) == {"out", "lse", "dq", "dk", "dv"}
    assert all(e <= limit for e in verified["errors"].values())


def test_torch_verifies_a_jax_cp_parity_bundle(tmp_path):
    from experiments.workloads import parity_jax

    good = tmp_path / "bundle"
    args = ["--framework=jax", f"--parity_bundle={good}", "--cp=ring", "--layout=zigzag"]
    fv = _parse_run_flags([*args, *TINY_FLAGS])
    try:
        assert parity.run_from_flags(fv) == 0
    finally:
        fv.unparse_flags()
    meta = json.loads((good / bundle.META_JSON).read_text())
    assert (meta["cp"], meta["num_devices"], meta["mask"]) == ("ring", 8, "causal_document")
    via_orbax = parity_jax.load_bundle(good)
    via_npz, _, mask = parity.read_bundle(good)
    assert meta["shapes"]["dk"] == [BATCH, SEQLEN, 2, 16] and mask.seqlen_q == SEQLEN
    for name, value in via_npz.items():
        np.testing.assert_array_equal(via_orbax[name], value)
    bad = tmp_path / "tampered"
    bad.mkdir()
    (bad / bundle.META_JSON).write_text((good / bundle.META_JSON).read_text())
    arrays = dict(np.load(good / bundle.BUNDLE_NPZ))
    arrays["dk"] = arrays["dk"] * 1.01
    np.savez(bad / bundle.BUNDLE_NPZ, **arrays)
    # The torch side runs without jax: block its import in a fresh interpreter.
    code = (
        "import json, sys; sys.modules['jax'] = None\n"
        "from experiments.workloads.parity import verify_with_torch\n"
        "print(json.dumps([verify_with_torch(p, impl='naive') for p in sys.argv[1:]]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(good), str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ok, tampered = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ok["ok"] and ok["jax_cp"] == "ring", ok
    # fp32 on both sides: relative errors of a few 1e-5 depend on the CPU's vector units; a
    # 1% change in one gradient (the tampered bundle) is 100x above this bound.
    assert max(ok["errors"].values()) < 1e-4, ok["errors"]
    assert not tampered["ok"] and tampered["errors"]["dk"] > 5e-3


def test_mosaic_reads_the_train_steps_fixed_shape_arrays():
    """The train step pads tile lists to a fixed width; the Mosaic kernels (interpreted) honour
    the padding: the forward matches float64 attention on a packed-document mask."""
    from attn_masks import reference_attention
    from experiments.workloads.masking import RUNTIME_IMPLS, fixed_shape_arrays
    from jax_attn.mosaic_gpu import flash_attention_mosaic

    assert "mosaic" in RUNTIME_IMPLS
    mask = make_mask("causal_document", 256, seqlens=[48, 80, 128])
    arrays = jax.device_put(fixed_shape_arrays(mask, "mosaic", 64, jax.numpy.bfloat16))
    keys = jax.random.split(jax.random.key(3), 3)
    shapes = [(1, 256, 2, 64), (1, 256, 1, 64), (1, 256, 1, 64)]
    q, k, v = (jax.random.normal(key, s, jax.numpy.bfloat16) for key, s in zip(keys, shapes))
    got = np.asarray(flash_attention_mosaic(q, k, v, arrays, scale=0.125, interpret=True))
    want = reference_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), mask, scale=0.125)
    err = np.linalg.norm(got.astype(np.float64) - want.out) / np.linalg.norm(want.out)
    assert np.isfinite(got).all() and err < 2e-2, err


def test_dense_training_that_cannot_fit_is_a_predicted_oom(monkeypatch):
    """A dense impl whose saved attention probabilities (depth x B x Hq x S x S) exceed the
    device is an oom "predicted:" before any model is built; at exactly that capacity, and for
    a flash impl below it, nothing is predicted."""
    from experiments.core.outcomes import OOM, PointFailure
    from experiments.runners import memory

    m, d = TINY.model, TINY.data
    need = m.depth * d.batch * m.heads_q * d.seqlen * d.seqlen * np.dtype(m.dtype).itemsize

    def never_built(cfg):
        raise AssertionError("the model was built for a run predicted not to fit")

    monkeypatch.setattr(train_step, "Trainer", never_built)
    monkeypatch.setattr(memory, "jax_capacity", lambda: (need - 1, False))
    with pytest.raises(PointFailure) as failed:
        train_step.run(dataclasses.replace(TINY, impl="xla"), stream=QUIET)
    assert failed.value.status == OOM and failed.value.reason.startswith("predicted:")
    assert f"S {d.seqlen}" in failed.value.reason
    train_step._require_fits(dataclasses.replace(TINY, impl="pallas"))
    monkeypatch.setattr(memory, "jax_capacity", lambda: (need, False))
    train_step._require_fits(dataclasses.replace(TINY, impl="xla"))


def test_next_impl_is_the_baseline_when_the_baseline_fails(tmp_path, monkeypatch, capsys):
    """A baseline that runs out of memory is recorded as oom, the next impl that finishes
    becomes the baseline and the one after is checked against it (instead of the run ending in
    'no step in common with the baseline curve'); the summary prints smoothed losses."""
    from experiments.core.outcomes import OOM, PointFailure

    real_run = train_step.run

    def run(cfg, **kw):
        if cfg.impl == "xla":
            raise PointFailure(OOM, "predicted: scores do not fit")
        return real_run(cfg, **kw)

    monkeypatch.setattr(train_step, "run", run)
    out = tmp_path / "out"
    args = ["--workload=train_step", f"--out_dir={out}", "--steps=3", "--warmup=1", "--iters=1"]
    fv = _parse_run_flags([*args, "--impl=xla,reference,pallas", "--lm_fixed_layout", *TINY_FLAGS])
    try:
        assert train_step.run_from_flags(fv) == 1  # the oom point makes the exit status 1
    finally:
        fv.unparse_flags()
    by_impl = {r["point"]["impl"]: r for r in read_records(out / "results.jsonl")}
    assert by_impl["xla"]["status"] == OOM
    assert by_impl["reference"]["status"] == "ok" and by_impl["reference"]["check"] is None
    check = by_impl["pallas"]["check"]
    assert by_impl["pallas"]["status"] == "ok" and check["baseline"] == "reference"
    assert check["steps"] == 3 and check["passed"]
    printed = capsys.readouterr().out
    assert "reference's curve is the baseline (xla: oom)" in printed
    assert "loss (3-step means)" in printed
