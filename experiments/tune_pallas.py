"""Sweep launch configs of the Pallas Triton flash-attention kernel on one GPU.

For each sequence length, config and mask: build the kernel, check it against a float32 jnp
computation (forward: sampled query rows; fwd+bwd: also dQ on those rows and dK/dV on sampled
key columns), then time it and report TFLOP/s (fwd 4*area*Hq*D, fwd+bwd 3.5x) as a table and
as JSON lines (appended as each point finishes, so an interrupted sweep can --resume).

    PYTHONPATH=. python experiments/tune_pallas.py --out_dir=results/tune_pallas
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from attn_masks import Mask, attention_flops  # noqa: E402
from attn_masks.generators import make_mask  # noqa: E402
from jax_attn.mask_arrays import MaskArrays, prepare_mask, stack_mask_arrays  # noqa: E402
from jax_attn.pallas_triton import (  # noqa: E402
    KernelConfig,
    block_sizes,
    default_config,
    flash_attention,
)

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "results/tune_pallas", "Directory for tune.jsonl.")
flags.DEFINE_list("seqlens", ["8192", "16384", "32768"], "Sequence lengths.")
flags.DEFINE_list("masks", ["full", "causal", "causal_document"], "attn_masks.MASK_NAMES entries.")
flags.DEFINE_list("modes", ["fwd", "fwd_bwd"], "fwd and/or fwd_bwd.")
flags.DEFINE_list("block_q", ["64", "128"], "Mask/kernel query tiles.")
flags.DEFINE_list("block_k", ["64", "128"], "Mask/kernel key tiles.")
flags.DEFINE_list("num_warps", ["4", "8"], "Warps per program (forward and backward).")
flags.DEFINE_list("num_stages", ["2", "3"], "Software-pipelining stages.")
flags.DEFINE_list(
    "bwd_splits",
    ["1", "2"],
    "fwd_bwd only: dK/dV walks block_q/split query rows per step "
    "and dQ block_k/split keys per step.",
)
flags.DEFINE_list(
    "fused_bwd",
    ["0"],
    "fwd_bwd only: 0 = dQ and dK/dV kernels, 1 = one fused kernel adding dQ with atomics "
    "(KernelConfig.fused_bwd). With include_default, 1 also times the default config fused.",
)
flags.DEFINE_list(
    "relaxed_atomics",
    ["0"],
    "Fused candidates only: 0 = Pallas' acq_rel atomic_add, 1 = relaxed-order adds "
    "(KernelConfig.relaxed_atomics).",
)
flags.DEFINE_list(
    "dkv_split",
    ["1"],
    "Two-kernel backward only: programs per (key tile, kv head) of the dK/dV kernel, each "
    "walking 1/S of the tile's steps into fp32 partial sums (KernelConfig.dkv_split). With "
    "include_default, values > 1 also time the default config with that split.",
)
flags.DEFINE_list("num_warps_bwd", [], "fwd_bwd only: backward warps (empty: as num_warps).")
flags.DEFINE_list("num_stages_bwd", [], "fwd_bwd only: backward stages (empty: as num_stages).")
flags.DEFINE_integer("fwd_block_k", 0, "Forward kernel key tile (0: the mask tile block_k).")
flags.DEFINE_integer(
    "top_k",
    4,
    "Sweep every config at the first seqlen only; later seqlens time the top_k "
    "configs (by mean TFLOP/s over the masks there) and the defaults. 0: every config everywhere.",
)
flags.DEFINE_boolean("include_default", True, "Also time the library's default config.")
flags.DEFINE_integer("batch", 1, "Batch size.")
flags.DEFINE_integer("heads_q", 64, "Query heads.")
flags.DEFINE_integer("heads_kv", 8, "Key/value heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16"], "Input dtype.")
flags.DEFINE_integer("warmup", 2, "Untimed calls after compilation.")
flags.DEFINE_integer("iters", 5, "Timed calls (median reported).")
flags.DEFINE_integer("check_rows", 64, "Query rows (and key columns) checked per point.")
flags.DEFINE_float("tolerance", 2e-2, "Max error relative to the largest reference value.")
flags.DEFINE_float("max_minutes", 9.0, "Stop starting new points after this long.")
flags.DEFINE_boolean("resume", True, "Skip points already recorded in tune.jsonl.")
flags.DEFINE_integer("seed", 0, "Seed for inputs, masks and sampled rows.")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One swept configuration: mask tiles plus the kernel launch config."""

    name: str
    block_q: int
    block_k: int
    config: KernelConfig


def _backward_kinds() -> list[tuple[bool, bool, int]]:
    """(fused, relaxed atomics, dkv_split) selected by --fused_bwd, --relaxed_atomics and
    --dkv_split (the split applies to the two-kernel backward only)."""
    splits = [int(x) for x in FLAGS.dkv_split]
    kinds = [(False, False, d) for d in splits] if "0" in FLAGS.fused_bwd else []
    if "1" in FLAGS.fused_bwd:
        kinds += [(True, bool(int(r)), 1) for r in FLAGS.relaxed_atomics]
    return kinds


def _backward_options(w: int, s: int) -> list[tuple[int, int, int, bool, bool, int]]:
    """(split, warps, stages, fused, relaxed, dkv_split) of the backward after a (w warps,
    s stages) forward."""
    warps = [int(x) for x in FLAGS.num_warps_bwd] or [w]
    stages = [int(x) for x in FLAGS.num_stages_bwd] or [s]
    options = itertools.product(map(int, FLAGS.bwd_splits), warps, stages, _backward_kinds())
    return [(split, wb, sb, *kind) for split, wb, sb, kind in options]


def _kind_suffix(fused: bool, relaxed: bool, dkv_split: int = 1) -> str:
    """Candidate-name suffix of a backward kind: "", "-fused", "-fused-relaxed" or "-dkv4"."""
    suffix = ("-fused" if fused else "") + ("-relaxed" if relaxed else "")
    return suffix + (f"-dkv{dkv_split}" if dkv_split > 1 else "")


def _candidate_name(mode: str, bq: int, bk: int, w: int, s: int, backward: tuple) -> str:
    """e.g. q128k128w4s2f64x2-bw8s2-fused: mask tiles, forward, split, backward launch, kind."""
    split, wb, sb, fused, relaxed, dkv_split = backward
    name = f"q{bq}k{bk}w{w}s{s}" + (f"f{FLAGS.fwd_block_k}" if FLAGS.fwd_block_k else "")
    name += f"x{split}"
    if mode == "fwd_bwd" and (FLAGS.num_warps_bwd or FLAGS.num_stages_bwd):
        name += f"-bw{wb}s{sb}"
    return name + _kind_suffix(fused, relaxed, dkv_split)


def _defaults(mode: str) -> list[Candidate]:
    """The library default, plus (fwd_bwd) its fused / dkv_split variants selected by the flags."""
    if not FLAGS.include_default:
        return []
    bq, bk = block_sizes(FLAGS.head_dim, FLAGS.dtype)
    config = default_config(FLAGS.head_dim, FLAGS.dtype)
    out = [Candidate("default", bq, bk, config)]
    kinds = [k for k in _backward_kinds() if k[0] or k[2] > 1] if mode == "fwd_bwd" else []
    for fused, relaxed, dkv_split in kinds:
        variant = dataclasses.replace(
            config, fused_bwd=fused, relaxed_atomics=relaxed, dkv_split=dkv_split
        )
        name = "default" + _kind_suffix(fused, relaxed, dkv_split)
        out.append(Candidate(name, bq, bk, variant))
    return out


def _candidates(mode: str) -> list[Candidate]:
    """Swept configs (those equal to a default dropped), then the defaults."""
    defaults = _defaults(mode)
    seen = {(c.block_q, c.block_k, c.config) for c in defaults}
    out = []
    for bq, bk, w, s in itertools.product(
        *(map(int, FLAGS[f].value) for f in ("block_q", "block_k", "num_warps", "num_stages"))
    ):
        options = _backward_options(w, s) if mode == "fwd_bwd" else [(1, w, s, False, False, 1)]
        for backward in options:
            split, wb, sb, fused, relaxed, dkv_split = backward
            config = KernelConfig(
                block_k=FLAGS.fwd_block_k or None,
                num_warps=w,
                num_stages=s,
                num_warps_bwd=wb,
                num_stages_bwd=sb,
                block_q_dkv=bq // split,
                block_k_dq=bk // split,
                fused_bwd=fused,
                relaxed_atomics=relaxed,
                dkv_split=dkv_split,
            )
            if (bq, bk, config) not in seen:
                seen.add((bq, bk, config))
                name = _candidate_name(mode, bq, bk, w, s, backward)
                out.append(Candidate(name, bq, bk, config))
    return out + defaults


def _inputs(seqlen: int, key: jax.Array) -> tuple[jax.Array, ...]:
    b, hq, hkv, d = FLAGS.batch, FLAGS.heads_q, FLAGS.heads_kv, FLAGS.head_dim
    shapes = [(b, seqlen, hq, d), (b, seqlen, hkv, d), (b, seqlen, hkv, d), (b, seqlen, hq, d)]
    keys = jax.random.split(key, len(shapes))
    return tuple(jax.random.normal(k, s, jnp.dtype(FLAGS.dtype)) for k, s in zip(keys, shapes))


def _visible(arrays: MaskArrays, rows: np.ndarray, cols: np.ndarray | None, sk: int) -> jax.Array:
    """(R, C) visibility of sampled rows against all keys (cols None) or sampled key columns."""
    lo = jnp.asarray(arrays.lo)[rows]
    hi = jnp.asarray(arrays.hi)[rows]
    keys = jnp.arange(sk) if cols is None else jnp.asarray(cols)
    return ((keys[None, None, :] >= lo[..., None]) & (keys[None, None, :] < hi[..., None])).any(1)


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
    """einsum at full float32 precision (GPUs default to TF32 for float32 matmuls)."""
    return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST)


@jax.jit
def _row_reference(q, k, v, do, vis, scale):
    """float32 out, lse, dq for sampled query rows: q/do (B,R,Hq,D), vis (R, Sk)."""
    b, r, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, r, hkv, g, d)
    dog = do.astype(f32).reshape(b, r, hkv, g, d)
    s = _einsum("brhgd,bkhd->bhgrk", qg, k.astype(f32)) * scale
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    den = e.sum(-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    lse = jnp.where(den > 0, m + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)[..., 0]
    out = _einsum("bhgrk,bkhd->brhgd", p, v.astype(f32))
    dp = _einsum("brhgd,bkhd->bhgrk", dog, v.astype(f32))
    delta = _einsum("brhgd,brhgd->bhgr", dog, out)[..., None]
    dq = _einsum("bhgrk,bkhd->brhgd", p * (dp - delta), k.astype(f32)) * scale
    return out.reshape(b, r, hq, d), lse.reshape(b, hq, r), dq.reshape(b, r, hq, d)


@jax.jit
def _column_reference(q, kc, vc, do, out, lse, vis, scale):
    """float32 dk, dv for sampled key columns kc/vc (B,C,Hkv,D) given the checked out and lse."""
    b, sq, hq, d = q.shape
    hkv = kc.shape[2]
    g = hq // hkv
    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, sq, hkv, g, d)
    dog = do.astype(f32).reshape(b, sq, hkv, g, d)
    lse = lse.reshape(b, hkv, g, sq)[..., None]
    s = _einsum("bqhgd,bchd->bhgqc", qg, kc.astype(f32)) * scale
    p = jnp.where(vis & jnp.isfinite(lse), jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0)
    delta = _einsum("bqhgd,bqhgd->bhgq", dog, out.astype(f32).reshape(b, sq, hkv, g, d))
    dv = _einsum("bhgqc,bqhgd->bchd", p, dog)
    dp = _einsum("bqhgd,bchd->bhgqc", dog, vc.astype(f32))
    dk = _einsum("bhgqc,bqhgd->bchd", p * (dp - delta[..., None]), qg) * scale
    return dk, dv


def _rel_err(got: jax.Array, want: jax.Array) -> float:
    got = jnp.asarray(got, jnp.float32)
    want = jnp.asarray(want, jnp.float32)
    fin = jnp.isfinite(want)
    if not bool(jnp.all(jnp.isfinite(got) == fin)):
        return float("inf")
    diff = jnp.where(fin, jnp.abs(got - want), 0.0).max()
    return float(diff / (jnp.where(fin, jnp.abs(want), 0.0).max() + 1e-6))


def _check(mode, result, inputs, arrays, rows, cols, scale) -> dict[str, float]:
    q, k, v, do = inputs
    sk = k.shape[1]
    out, lse = result[0], result[1]
    r_out, r_lse, r_dq = _row_reference(
        q[:, rows], k, v, do[:, rows], _visible(arrays, rows, None, sk)[None, None, None], scale
    )
    errs = {"out": _rel_err(out[:, rows], r_out)}
    lse_err = jnp.where(jnp.isfinite(r_lse), jnp.abs(lse[:, :, rows] - r_lse), 0.0).max()
    errs["lse_abs"] = float(lse_err)
    if mode == "fwd_bwd":
        dq, dk, dv = result[2:]
        errs["dq"] = _rel_err(dq[:, rows], r_dq)
        vis_c = _visible(arrays, np.arange(q.shape[1]), cols, sk)[None, None, None]
        r_dk, r_dv = _column_reference(q, k[:, cols], v[:, cols], do, out, lse, vis_c, scale)
        errs["dk"] = _rel_err(dk[:, cols], r_dk)
        errs["dv"] = _rel_err(dv[:, cols], r_dv)
    return errs


def _limit(error_name: str) -> float:
    """Pass threshold: LSE in absolute natural-log units, the rest relative to the max."""
    return 0.05 if error_name == "lse_abs" else FLAGS.tolerance


def _build(mode: str, config: KernelConfig, scale: float) -> Callable[..., Any]:
    def fwd(q, k, v, do, arrays):
        return flash_attention(q, k, v, arrays, scale=scale, return_lse=True, config=config)

    def fwd_bwd(q, k, v, do, arrays):
        def f(q, k, v):
            return fwd(q, k, v, do, arrays)

        (out, lse), vjp = jax.vjp(f, q, k, v)
        return (out, lse, *vjp((do, jnp.zeros_like(lse))))

    return jax.jit(fwd if mode == "fwd" else fwd_bwd)


def _time(fn: Callable[[], Any]) -> list[float]:
    for _ in range(FLAGS.warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(FLAGS.iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def _point_key(mode: str, mask: str, seqlen: int, cand: str) -> str:
    return f"{mode}|{mask}|{seqlen}|{cand}"


def _load_records(path: str) -> list[dict[str, Any]]:
    """Records of earlier runs into the same file (when resuming)."""
    if not (FLAGS.resume and os.path.exists(path)):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _shortlist(mode: str, cands: list[Candidate], records: list[dict], seqlen: int) -> list:
    """The top_k candidates by mean TFLOP/s over the masks at `seqlen`, plus the defaults."""
    score: dict[str, list[float]] = {}
    for r in records:
        if (r["mode"], r["seqlen"], r["status"]) == (mode, seqlen, "ok"):
            score.setdefault(r["candidate"], []).append(r["tflops"])
    ranked = sorted(score, key=lambda n: -statistics.mean(score[n]))[: FLAGS.top_k]
    return [c for c in cands if c.name in ranked or c.name.startswith("default")]


def _masks(seqlen: int) -> dict[str, Mask]:
    return {name: make_mask(name, seqlen, seed=FLAGS.seed) for name in FLAGS.masks}


def _cell(rec: dict | None) -> str:
    if rec is None:
        return "-"
    return f"{rec['tflops']:.1f}" if rec["status"] == "ok" else rec["status"]


def _print_table(records: list[dict]) -> None:
    for mode in FLAGS.modes:
        recs = [r for r in records if r["mode"] == mode]
        if not recs:
            continue
        cols = sorted({(r["mask"], r["seqlen"]) for r in recs}, key=lambda c: (c[0], c[1]))
        names = list(dict.fromkeys(r["candidate"] for r in recs))
        cell = {(r["candidate"], r["mask"], r["seqlen"]): r for r in recs}
        head = ["config"] + [
            f"{m[:10]} {s // 1024}K" if s >= 1024 else f"{m[:10]} {s}" for m, s in cols
        ]
        print(f"\n== {mode}: TFLOP/s ==")
        print(" | ".join(f"{h:>16}" for h in head))
        for n in names:
            row = [n]
            for m, s in cols:
                row.append(_cell(cell.get((n, m, s))))
            print(" | ".join(f"{c:>16}" for c in row))
        for m, s in cols:
            ok = [r for r in recs if (r["mask"], r["seqlen"]) == (m, s) and r["status"] == "ok"]
            if ok:
                best = max(ok, key=lambda r: r["tflops"])
                print(f"best {mode} {m} {s}: {best['candidate']} {best['tflops']:.1f} TFLOP/s")


@dataclasses.dataclass
class _Length:
    """Everything shared by the points of one sequence length."""

    seqlen: int
    masks: dict[str, Mask]
    inputs: tuple[jax.Array, ...]
    rows: np.ndarray
    cols: np.ndarray

    @classmethod
    def make(cls, seqlen: int, rng: np.random.Generator) -> _Length:
        def sample() -> np.ndarray:
            drawn = rng.integers(0, seqlen, FLAGS.check_rows)
            return np.unique(np.concatenate([[0, seqlen - 1], drawn]))

        inputs = _inputs(seqlen, jax.random.key(FLAGS.seed))
        return cls(seqlen, _masks(seqlen), inputs, sample(), sample())


def _record(mode: str, name: str, length: _Length, cand: Candidate) -> dict[str, Any]:
    return {
        "mode": mode,
        "mask": name,
        "seqlen": length.seqlen,
        "candidate": cand.name,
        "block_q": cand.block_q,
        "block_k": cand.block_k,
        "config": dataclasses.asdict(cand.config),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "batch": FLAGS.batch,
        "heads_q": FLAGS.heads_q,
        "heads_kv": FLAGS.heads_kv,
        "head_dim": FLAGS.head_dim,
        "dtype": FLAGS.dtype,
    }


def _run_point(
    mode: str, name: str, length: _Length, cand: Candidate, fn: Callable[..., Any], arrays
) -> dict[str, Any]:
    """Check, then time one (mode, mask, length, candidate); failures become records too."""
    rec = _record(mode, name, length, cand)
    scale = FLAGS.head_dim**-0.5
    flops = attention_flops(length.masks[name], FLAGS.heads_q, FLAGS.head_dim, mode, FLAGS.batch)
    try:
        t0 = time.perf_counter()
        result = jax.block_until_ready(fn(*length.inputs, arrays))
        rec["first_call_s"] = time.perf_counter() - t0
        errs = _check(mode, result, length.inputs, arrays, length.rows, length.cols, scale)
        del result
        rec["errors"] = errs
        bad = [k for k, e in errs.items() if not e < _limit(k)]
        med = statistics.median(_time(lambda: fn(*length.inputs, arrays)))
        rec.update(ms=med * 1e3, tflops=flops / med / 1e12, status="mismatch" if bad else "ok")
    except Exception as e:  # noqa: BLE001 - a failing config is a data point, not the end
        rec.update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
    return rec


def _sweep_candidate(
    mode: str, length: _Length, cand: Candidate, todo: list[str], path: str, started: float
) -> list[dict[str, Any]]:
    """All pending masks of one candidate; they share one compilation (padded tile lists)."""
    stacked = stack_mask_arrays(
        [prepare_mask(length.masks[m], cand.block_q, cand.block_k) for m in todo]
    )
    fn = _build(mode, cand.config, FLAGS.head_dim**-0.5)
    out = []
    for i, name in enumerate(todo):
        arrays = jax.tree.map(lambda x, i=i: jnp.asarray(x[i]), stacked)
        rec = _run_point(mode, name, length, cand, fn, arrays)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        out.append(rec)
        summary = (
            f"{rec['tflops']:.1f} TFLOP/s ({rec['ms']:.2f} ms)"
            if "tflops" in rec
            else rec.get("error", "")[:200]
        )
        print(
            f"[{time.time() - started:6.0f}s] {mode:7s} {name:16s} {length.seqlen:6d} "
            f"{cand.name:18s} {rec['status']:8s} {summary}",
            flush=True,
        )
    return out


def main(argv: list[str]) -> None:
    del argv
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    path = os.path.join(FLAGS.out_dir, "tune.jsonl")
    records = _load_records(path)
    done = {_point_key(r["mode"], r["mask"], r["seqlen"], r["candidate"]) for r in records}
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__} -> {path}", flush=True)
    started = time.time()
    rng = np.random.default_rng(FLAGS.seed)
    seqlens = [int(s) for s in FLAGS.seqlens]
    for seqlen in seqlens:
        length = _Length.make(seqlen, rng)
        for mode in FLAGS.modes:
            cands = _candidates(mode)
            if seqlen != seqlens[0] and FLAGS.top_k > 0:
                cands = _shortlist(mode, cands, records, seqlens[0])
            for cand in cands:
                todo = [
                    m for m in length.masks if _point_key(mode, m, seqlen, cand.name) not in done
                ]
                if not todo:
                    continue
                if (time.time() - started) / 60 > FLAGS.max_minutes:
                    print("time budget reached; rerun (--resume) to continue", flush=True)
                    _print_table(records)
                    return
                records += _sweep_candidate(mode, length, cand, todo, path, started)
    _print_table(records)


if __name__ == "__main__":
    app.run(main)
