"""Launch-config variants of the Mosaic GPU flash-attention kernel, timed against cuDNN.

    python experiments/mosaic_variants.py --mask=causal --seqlen=32768 --mode=fwd_bwd \
        --variants=default,dkv128:block_k_dkv=128,fused:fused_bwd=1 --out=variants.jsonl

A variant is `name` or `name:key=value+key=value`, the keys being fields of
jax_attn.mosaic_gpu.KernelConfig (ints; 0/1/true/false for bool fields) set on top of the
library's default config for the head dim and dtype (`default` alone is that config). Per point
(mask, seqlen, heads, mode) the baseline (jax_attn.attention with impl=cudnn where it supports the
mask) and then every variant run on the same inputs (the driver's, experiments/runners/inputs.py),
forward or forward+backward (jax.vjp, the kernel's custom VJP); each is checked against float64
attention (experiments/runners/checks.py) and timed only if it passes, like the driver's JAX
runner (L2 flushed, host clock around call and completion). A variant that fails the check or
raises is recorded as "wrong" or "error" with its message and the sweep goes on. TFLOP/s counts
the mask's useful FLOPs (attn_masks.attention_flops, as the driver); time_vs_baseline is the
variant's median time over the baseline's in the same run (below 1: faster than cuDNN).
`--report=FOLDER` writes report.md and speed.png from the records in FOLDER instead.
`--resume` skips the points already recorded in --out, so a command cut short by a time limit
goes on where it stopped when run again.
`--profile` runs each impl once between cudaProfilerStart and Stop instead of timing it, for
`ncu --profile-from-start off --kernel-name regex:mosaic_flash ...` (one variant per run keeps
the kernels apart: they share names).
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from types import SimpleNamespace

from absl import app, flags

FLAGS = flags.FLAGS
SEED = 42
MODES = ("fwd", "fwd_bwd")
BOOLS = {"1": True, "true": True, "0": False, "false": False}
MAX_MESSAGE = 2000  # characters of an error message kept in the record
PROFILED = "checked, then one call between cudaProfilerStart and Stop (--profile)"


def define_flags() -> None:
    """The command's flags (defined only when it runs, so importing the module defines none)."""
    flags.DEFINE_list("mask", ["full", "causal"], "Mask names.")
    flags.DEFINE_list("seqlen", ["16384", "32768"], "Query and key lengths (K/M suffix accepted).")
    flags.DEFINE_list("heads", ["64:8"], "Query heads:KV heads, one or more.")
    flags.DEFINE_integer("head_dim", 128, "Head dim (the kernel takes 64 or 128).")
    flags.DEFINE_enum("dtype", "bf16", ["bf16", "fp16"], "Input dtype.")
    flags.DEFINE_list("mode", list(MODES), "fwd and/or fwd_bwd.")
    flags.DEFINE_list(
        "variants", ["default"], "Variants: name or name:key=value+key=value (KernelConfig fields)."
    )
    flags.DEFINE_enum("baseline", "cudnn", ["cudnn", "none"], "Impl timed on the same inputs.")
    flags.DEFINE_integer("iters", 20, "Timed calls per variant.", lower_bound=1)
    flags.DEFINE_integer("warmup", 3, "Untimed calls before them.", lower_bound=0)
    flags.DEFINE_string("out", None, "Append one JSON line per (point, variant) to this file.")
    flags.DEFINE_bool(
        "resume",
        False,
        "Skip the points whose baseline and variants all have a record in --out already (a "
        "command cut short, run again, goes on where it stopped; records with status error "
        "run again).",
    )
    flags.DEFINE_string(
        "report", None, "Write report.md and speed.png from the *.jsonl in this folder (no GPU)."
    )
    flags.DEFINE_bool(
        "profile",
        False,
        "For Nsight Compute (ncu --profile-from-start off): after the check and the warm-up "
        "calls, run each impl once between cudaProfilerStart and Stop instead of timing it.",
    )


def parse_variant(spec: str, base) -> tuple[str, object]:
    """(name, config) of a variant spec `name` or `name:key=value+key=value`: the keys are fields
    of base's dataclass, the values ints (0/1/true/false for fields annotated bool; `none` for
    fields that admit None), the other fields as in base. ValueError names the bad item and the
    valid keys."""
    name, sep, body = spec.partition(":")
    if not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"bad variant {spec!r}: expected name or name:key=value+key=value")
    keys = [f.name for f in dataclasses.fields(base)]
    hints = typing.get_type_hints(type(base))
    given = {}
    for item in body.split("+") if sep else []:
        key, eq, text = item.partition("=")
        try:
            if not eq or key not in keys:
                raise ValueError(f"unknown key {key!r}" if eq else "expected key=value")
            given[key] = _field_value(key, text, hints[key])
        except ValueError as e:
            raise ValueError(
                f"bad item {item!r} in variant {spec!r}: {e} (valid keys: {', '.join(keys)})"
            ) from None
    try:
        return name, dataclasses.replace(base, **given)
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad variant {spec!r}: {e}") from None


def _field_value(key: str, text: str, hint) -> object:
    """`text` as the value of a field annotated `hint`: 0/1/true/false for bool, else an int;
    `none` where the annotation admits None (the library's choice per call)."""
    kinds = (hint, *typing.get_args(hint))
    optional = type(None) in kinds
    if optional and text.lower() == "none":
        return None
    also = " or none" if optional else ""
    if bool in kinds:
        if text.lower() not in BOOLS:
            raise ValueError(f"{key} takes 0/1/true/false{also}, got {text!r}")
        return BOOLS[text.lower()]
    if not re.fullmatch(r"-?\d+", text):
        raise ValueError(f"{key} takes an integer{also}, got {text!r}")
    return int(text)


def _measure(point, mask, attn, args: dict, flush) -> dict:
    """Status, check and times of one impl on a point: run once, checked against float64, timed
    only if the check passed; an exception is recorded as an error, not raised."""
    from experiments.runners import checks, jax_runner, timing

    check = None
    try:
        fn, call_args, got = jax_runner.build_call(point.mode, attn, args)
        check = checks.check_point(
            point,
            mask,
            0,
            args,
            got,
            fetch=jax_runner.fetch_rows,
            finite=jax_runner.all_finite,
            on_gpu=True,
        ).as_dict()
        del got
        if not check["ok"]:
            return {"status": "wrong", "message": check["message"], "check": check}
        if FLAGS.profile:
            _profiled_call(fn, call_args)
            return {"status": "profiled", "message": PROFILED, "check": check}
        loop = dict(warmup=FLAGS.warmup, iters=FLAGS.iters, flush=flush)
        times = timing.jax_time_calls(fn, call_args, **loop)
    except Exception as e:  # a variant's failure must not end the sweep
        return {
            "status": "error",
            "message": f"{type(e).__name__}: {e}"[:MAX_MESSAGE],
            "check": check,
        }
    return {"status": "ok", "check": check, "time_ms": timing.time_stats(times)}


def _profiled_call(fn, call_args: tuple) -> None:
    """--warmup calls, then one between cudaProfilerStart and Stop (what ncu then profiles)."""
    import jax
    import torch

    for _ in range(FLAGS.warmup):
        jax.block_until_ready(fn(*call_args))
    torch.cuda.profiler.start()
    jax.block_until_ready(fn(*call_args))
    torch.cuda.profiler.stop()


def _impls(mask, heads: tuple[int, int], mode: str, variants: list) -> list[tuple]:
    """(name, spec, config, attn(q, k, v) or the reason it cannot run): baseline, then variants."""
    import jax_attn
    from attn_masks import default_scale
    from experiments.runners import frameworks
    from jax_attn.adapters.common import device_arrays
    from jax_attn.mosaic_gpu import flash_attention_mosaic

    out = []
    if FLAGS.baseline != "none":
        why = jax_attn.supports(
            FLAGS.baseline,
            mask,
            dtype=frameworks.framework_dtype("jax", FLAGS.dtype),
            head_dim=FLAGS.head_dim,
            heads_q=heads[0],
            heads_kv=heads[1],
            mode=mode,
        )
        base = lambda q, k, v: jax_attn.attention(q, k, v, mask, impl=FLAGS.baseline)  # noqa: E731
        out.append((FLAGS.baseline, FLAGS.baseline, None, base if why is True else why))
    for spec, name, config in variants:

        def attn(q, k, v, config=config):
            arrays = device_arrays(mask, config.tiles)
            scale = default_scale(q.shape[-1])
            return flash_attention_mosaic(
                q, k, v, arrays, scale=scale, config=config, interpret=False
            )

        out.append((name, spec, config, attn))
    return out


def _point(mask_name: str, seqlen: int, heads: str, mode: str, variants: list, run: dict) -> None:
    """Records of the baseline and the variants on one point, each written and printed as done."""
    import jax.numpy as jnp

    from attn_masks import attention_flops, make_mask
    from experiments.runners import frameworks, inputs, timing

    hq, hkv = (int(x) for x in heads.split(":"))
    d = FLAGS.head_dim
    mask = make_mask(mask_name, seqlen, seed=SEED)
    dtype = frameworks.framework_dtype("jax", FLAGS.dtype)
    shapes = inputs.shapes(1, seqlen, hq, hkv, d)
    args = {n: jnp.asarray(inputs.block(n, s, SEED, 0), dtype) for n, s in shapes.items()}
    point = SimpleNamespace(batch=1, heads_q=hq, seed=SEED, dtype=FLAGS.dtype, mode=mode)
    flops = attention_flops(mask, hq, d, mode)
    where = f"{mask_name} S={seqlen} {heads} d={d} {FLAGS.dtype} {mode}"
    base = dict(mask=mask_name, seqlen=seqlen, heads=heads, head_dim=d, dtype=FLAGS.dtype)
    baseline_ms = None
    for name, spec, config, attn in _impls(mask, (hq, hkv), mode, variants):
        rec = {**base, "mode": mode, "variant": name, "spec": spec, **run["provenance"]}
        rec.update(flops=flops, config=None if config is None else dataclasses.asdict(config))
        if isinstance(attn, str):
            rec.update(status="unsupported", message=attn)
        else:
            rec.update(_measure(point, mask, attn, args, run["flush"]))
        if rec["status"] == "ok":
            ms = rec["time_ms"]["median"]
            rec["tflops"] = timing.tflops_stats(flops, rec["time_ms"])
            if config is None:
                baseline_ms = ms
            ratio = ms / baseline_ms if baseline_ms else None
            rec["time_vs_baseline"] = ratio
            vs = f", time {ratio:.3f}x {FLAGS.baseline}" if ratio and config else ""
            line = f"{ms:.3f} ms, {rec['tflops']['median']:.1f} TFLOP/s{vs}"
        else:
            line = f"{rec['status'].upper()} {rec['message']}"
        print(f"{where} {name}: {line}", flush=True)
        if FLAGS.out:
            with open(FLAGS.out, "a") as f:
                f.write(json.dumps(rec) + "\n")


RESUME_KEY = ("mask", "seqlen", "heads", "mode", "variant", "spec")  # a point's variant record


def recorded(path: str, head_dim: int, dtype: str) -> set[tuple]:
    """(mask, seqlen, heads, mode, variant, spec) of the records in `path` at this head dim and
    dtype whose status is final (not error): what --resume skips. Empty if the file is absent;
    lines torn by a kill are skipped (and reported) as the driver's results files' are."""
    from experiments.core.results import read_json_lines

    fields = (*RESUME_KEY, "head_dim", "dtype", "status")
    records = read_json_lines(path, keep=lambda r: all(f in r for f in fields))
    return {
        tuple(r[f] for f in RESUME_KEY)
        for r in records
        if r["head_dim"] == head_dim and r["dtype"] == dtype and r["status"] != "error"
    }


def _settings() -> tuple[list[tuple[str, str, object]], list[int]]:
    """(spec, name, config) of each variant and the seqlens; UsageError names a bad value."""
    from attn_masks import MASK_NAMES
    from experiments.core.flags import parse_seqlen
    from experiments.runners import frameworks
    from jax_attn.mosaic_gpu import default_config

    base = default_config(FLAGS.head_dim, frameworks.framework_dtype("jax", FLAGS.dtype))
    try:
        variants = [(spec, *parse_variant(spec, base)) for spec in FLAGS.variants]
        seqlens = [parse_seqlen(s) for s in FLAGS.seqlen]
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    names = [v[1] for v in variants] + ([FLAGS.baseline] if FLAGS.baseline != "none" else [])
    for flag, values, valid in (("mode", FLAGS.mode, MODES), ("mask", FLAGS.mask, MASK_NAMES)):
        for value in values:
            if value not in valid:
                raise app.UsageError(f"bad --{flag} {value!r}: valid values: {', '.join(valid)}")
    for heads in FLAGS.heads:
        hq, _, hkv = heads.partition(":")
        if not (hq.isdigit() and hkv.isdigit() and int(hkv) and int(hq) % int(hkv) == 0):
            raise app.UsageError(f"bad --heads {heads!r}: expected Hq:Hkv with Hkv dividing Hq")
    if len(set(names)) < len(names):
        raise app.UsageError(f"variant names must be unique and differ from --baseline: {names}")
    if FLAGS.resume and (not FLAGS.out or FLAGS.profile):
        raise app.UsageError("--resume needs --out (the records to go on from) and no --profile")
    return variants, seqlens


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.report:
        from experiments.reports.report_variants import write_report

        try:
            print(f"wrote {write_report(FLAGS.report)}")
        except ValueError as e:
            raise app.UsageError(str(e)) from None
        return
    import jax

    from experiments.core import provenance
    from experiments.runners import timing
    from jax_attn.adapters.common import local_gpu

    variants, seqlens = _settings()
    if FLAGS.profile:
        try:
            import torch  # noqa: F401  (its cudaProfilerStart/Stop)
        except ImportError:
            raise app.UsageError("--profile needs torch for cudaProfilerStart/Stop") from None
    gpu = local_gpu()
    if gpu is None or not gpu.cuda:
        raise app.UsageError("needs a CUDA GPU (a Hopper one for the Mosaic kernel's wgmma/TMA)")
    run = {
        "flush": timing.jax_l2_flusher(jax.local_devices()[0]),
        "provenance": {"jax": jax.__version__, "git": provenance.git_state()},
    }
    done = recorded(FLAGS.out, FLAGS.head_dim, FLAGS.dtype) if FLAGS.resume else set()
    impls = [(name, spec) for spec, name, _ in variants]  # (variant, spec) as records have them
    impls += [(FLAGS.baseline, FLAGS.baseline)] if FLAGS.baseline != "none" else []
    for mask_name in FLAGS.mask:
        for seqlen in seqlens:
            for heads in FLAGS.heads:
                for mode in FLAGS.mode:
                    if all((mask_name, seqlen, heads, mode, *i) in done for i in impls):
                        print(f"{mask_name} S={seqlen} {heads} {mode}: recorded, skipped")
                        continue
                    _point(mask_name, seqlen, heads, mode, variants, run)


if __name__ == "__main__":
    define_flags()
    app.run(main)
