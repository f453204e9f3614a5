"""GPU benchmark of JAX context parallelism: every strategy x layout on N local GPUs.

For each (tokens per GPU, mask, strategy, layout, mode) it builds the plan, checks a subset of
query rows (out, lse, and dq for fwd_bwd) against a float32 jnp computation, times the sharded
call on pre-dispatched inputs, and appends one JSON line to --out with per-GPU TFLOP/s (global
mask FLOPs / N / time), the single-GPU rate of the same impl on the per-GPU problem, memory and
the plan's bytes moved. Example (2 GPUs):

  python experiments/bench_cp_jax.py --out cp_jax.jsonl          # 8K and 32K tokens per GPU
  python experiments/bench_cp_jax.py --out cp_jax.jsonl --tokens_per_gpu 8192,16384,32768,65536 \
      --max_minutes 0
  python experiments/bench_cp_jax.py --out prof.jsonl --strategies ring --layouts zigzag \
      --masks causal --modes fwd_bwd --profile_dir /tmp/prof

The device high-water mark only rises, so for clean per-point peaks run one strategy per
invocation; compiled_bytes (XLA's memory analysis of the program) is per point regardless.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.bench_cp_common import (
    Deadline,
    check_rows,
    failed_checks,
    parse,
    parser,
    rel_err,
    sweep,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(
        __doc__.split("\n\n")[0],
        out_help="JSON-lines file to append to",
        check_rows=32,
        max_minutes=8,
    )
    p.add_argument("--num_gpus", type=int, default=0, help="0: all local GPUs")
    p.add_argument("--impl", default="pallas", help="local kernel (falls back to reference)")
    p.add_argument("--profile_dir", default="", help="jax.profiler trace of one ring point")
    p.add_argument("--xla_flags", default="", help="appended to XLA_FLAGS before jax starts")
    return parse(p, argv)


def provenance(jax, impl: str, args: argparse.Namespace, devices) -> dict:
    """Versions, devices and settings recorded with every result line."""
    return {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "device_kind": devices[0].device_kind,
        "num_gpus": len(devices),
        "impl": impl,
        "heads_q": args.heads_q,
        "heads_kv": args.heads_kv,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def choose_impl(requested: str, args: argparse.Namespace) -> str:
    """The requested impl when jax_attn can run it here, else the reference (with a note)."""
    import jax.numpy as jnp

    import jax_attn
    from attn_masks.generators import make_mask

    probe = make_mask("causal", 256)
    ok = jax_attn.supports(
        requested,
        probe,
        dtype=jnp.dtype(args.dtype),
        head_dim=args.head_dim,
        heads_q=args.heads_q,
        heads_kv=args.heads_kv,
        return_lse=True,
    )
    if ok is True:
        return requested
    print(f"impl {requested!r} unavailable ({ok}); falling back to 'reference'", flush=True)
    return "reference"


def rows_reference(jnp, q_rows, k, v, do_rows, visible, scale):
    """float32 out, lse and dq of a few query rows against all keys (GQA), with rows' masks."""
    r, hq, d = q_rows.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q_rows.astype(jnp.float32).reshape(r, hkv, g, d)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    s = jnp.einsum("rhgd,shd->hgrs", qg, k32) * scale
    s = jnp.where(visible[None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(visible[None, None], jnp.exp(s - m), 0.0)
    den = e.sum(-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    out = jnp.einsum("hgrs,shd->rhgd", p, v32)
    lse = jnp.where(
        den[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(den > 0, den, 1.0)[..., 0]), -jnp.inf
    )
    dog = do_rows.astype(jnp.float32).reshape(r, hkv, g, d)
    dp = jnp.einsum("rhgd,shd->hgrs", dog, v32)
    delta = jnp.einsum("rhgd,rhgd->hgr", dog, out)[..., None]
    dq = jnp.einsum("hgrs,shd->rhgd", p * (dp - delta), k32) * scale
    return out.reshape(r, hq, d), lse.reshape(hq, r), dq.reshape(r, hq, d)


class Bench:
    """Shared state of one sweep: devices, jitted callers, single-GPU rates, output file."""

    def __init__(self, args: argparse.Namespace):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import Mesh

        from experiments import timing

        self.jax, self.jnp, self.np, self.timing = jax, jnp, np, timing
        self.args = args
        gpus = jax.devices()
        self.devices = gpus[: args.num_gpus] if args.num_gpus else gpus
        self.n = len(self.devices)
        self.mesh = Mesh(np.array(self.devices), ("cp",))
        self.dtype = jnp.dtype(args.dtype)
        self.impl = choose_impl(args.impl, args)
        self.meta = provenance(jax, self.impl, args, self.devices)
        self.flush = timing.jax_l2_flusher(self.devices[0])
        self.single: dict[tuple, dict] = {}
        self.profiled = not args.profile_dir

        @jax.jit
        def fwd(ex, q, k, v):
            return ex.sharded(q, k, v)

        @jax.jit
        def fwd_bwd(ex, q, k, v, do):
            (out, lse), pull = jax.vjp(ex.sharded, q, k, v)
            return (out, lse, *pull((do, jnp.zeros_like(lse))))

        self.fns = {"fwd": fwd, "fwd_bwd": fwd_bwd}

    def write(self, record: dict) -> None:
        line = json.dumps({**self.meta, **record, "time": time.time()}, default=float)
        with open(self.args.out, "a") as f:
            f.write(line + "\n")
        keys = ("mask", "tokens_per_gpu", "strategy", "layout", "mode", "status")
        brief = {k: record.get(k) for k in keys}
        print(
            brief,
            {k: record[k] for k in ("tflops_per_gpu", "single_gpu_tflops") if k in record},
            flush=True,
        )

    def inputs(self, ex, key):
        """Random q, k, v, do directly in dispatched (rank) order, sharded over the GPUs."""
        jax, a = self.jax, self.args
        s = ex.plan.padded_seqlen
        shapes = (
            (1, s, a.heads_q, a.head_dim),
            (1, s, a.heads_kv, a.head_dim),
            (1, s, a.heads_kv, a.head_dim),
            (1, s, a.heads_q, a.head_dim),
        )
        keys = jax.random.split(key, 4)
        make = jax.jit(
            lambda k, shape: jax.random.normal(k, shape, self.dtype),
            static_argnums=1,
            out_shardings=ex.token_sharding,
        )
        return [make(k, shape) for k, shape in zip(keys, shapes)]

    def check(self, ex, mask, q, k, v, do, outs, mode: str) -> dict:
        """Relative errors of a few random real query rows against a float32 computation."""
        jnp, np = self.jnp, self.np
        rows = check_rows(mask.seqlen_q, self.args.check_rows)
        lo, hi = mask.row_intervals()
        cols = np.arange(mask.seqlen_k)
        visible = ((cols >= lo[rows, :, None]) & (cols < hi[rows, :, None])).any(axis=1)
        glob = [ex.undispatch(x) for x in (q, k, v, do)]
        pick = lambda x: jnp.take(x[0], jnp.asarray(rows), axis=0)  # noqa: E731
        scale = 1.0 / float(np.sqrt(self.args.head_dim))
        want = rows_reference(
            jnp, pick(glob[0]), glob[1][0], glob[2][0], pick(glob[3]), jnp.asarray(visible), scale
        )
        out = pick(ex.undispatch(outs[0]))
        lse = jnp.take(ex.undispatch_lse(outs[1])[0], jnp.asarray(rows), axis=1)
        errs = {"out": rel_err(out, want[0]), "lse": rel_err(lse, want[1])}
        if mode == "fwd_bwd":
            errs["dq"] = rel_err(pick(ex.undispatch(outs[2])), want[2])
        return errs

    def single_gpu(self, name: str, tokens: int, mode: str) -> dict:
        """TFLOP/s of the same impl on one GPU with the per-GPU problem (the mask at T tokens)."""
        key = (name, tokens, mode)
        if key in self.single:
            return self.single[key]
        import jax_attn
        from attn_masks import attention_flops
        from attn_masks.generators import make_mask

        jax, a = self.jax, self.args
        mask = make_mask(name, tokens, seed=a.seed)
        dev = self.devices[0]
        shapes = (
            (1, tokens, a.heads_q, a.head_dim),
            (1, tokens, a.heads_kv, a.head_dim),
            (1, tokens, a.heads_kv, a.head_dim),
            (1, tokens, a.heads_q, a.head_dim),
        )
        keys = jax.random.split(jax.random.PRNGKey(a.seed), 4)
        q, k, v, do = (
            jax.device_put(jax.random.normal(kk, s, self.dtype), dev) for kk, s in zip(keys, shapes)
        )

        def attn(q, k, v):
            return jax_attn.attention(q, k, v, mask, impl=self.impl)

        if mode == "fwd":
            fn, fargs = jax.jit(attn), (q, k, v)
        else:
            fn, fargs = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do)), (q, k, v, do)
        try:
            times = self.timing.jax_time_calls(
                fn, fargs, warmup=a.warmup, iters=a.iters, flush=self.flush
            )
            stats = self.timing.time_stats(times)
            flops = attention_flops(mask, a.heads_q, a.head_dim, mode)
            res = {
                "single_gpu_tflops": self.timing.tflops_stats(flops, stats)["median"],
                "single_gpu_ms": stats["median"],
            }
        except Exception as e:  # recorded next to the CP numbers, never fatal
            res = {"single_gpu_error": f"{type(e).__name__}: {str(e)[:300]}"}
        self.single[key] = res
        return res

    def point(self, name: str, mask, tokens: int, strategy: str, layout: str) -> None:
        """All modes of one (mask, tokens, strategy, layout): build, check, time, record."""
        from attn_masks import attention_flops
        from shard_strategies import jax_cp

        jax, a = self.jax, self.args
        base = {
            "mask": name,
            "tokens_per_gpu": tokens,
            "seqlen": mask.seqlen_q,
            "strategy": strategy,
            "layout": layout,
        }
        t0 = time.perf_counter()
        try:
            ex = jax_cp.build(
                mask,
                mesh=self.mesh,
                strategy=strategy,
                layout=layout,
                impl=self.impl,
                ulysses_size=a.ulysses_size or None,
                inner_axis=a.inner_axis,
                num_heads_q=a.heads_q,
                num_heads_kv=a.heads_kv,
                head_dim=a.head_dim,
                dtype=self.dtype,
                return_lse=True,
            )
        except ValueError as e:
            for mode in a.modes:
                self.write({**base, "mode": mode, "status": "unsupported", "error": str(e)})
            return
        plan_s = time.perf_counter() - t0
        info = {
            "plan": ex.plan.summary(),
            "plan_seconds": plan_s,
            "comm": ex.plan.comm_volume(
                a.heads_q, a.heads_kv, a.head_dim, itemsize=self.dtype.itemsize
            ),
        }
        q, k, v, do = self.inputs(ex, jax.random.PRNGKey(a.seed))
        for mode in a.modes:
            rec = {**base, "mode": mode, **info}
            fn = self.fns[mode]
            fargs = (ex, q, k, v) if mode == "fwd" else (ex, q, k, v, do)
            try:
                t1 = time.perf_counter()
                outs = jax.block_until_ready(fn(*fargs))
                rec["compile_seconds"] = time.perf_counter() - t1
                if a.check_rows:
                    rec["check"] = self.check(ex, mask, q, k, v, do, outs, mode)
                    bad = failed_checks(rec["check"])
                    if bad:
                        self.write({**rec, "status": "wrong", "error": f"errors {bad}"})
                        continue
                del outs
                times = self.timing.jax_time_calls(
                    fn, fargs, warmup=a.warmup, iters=a.iters, flush=self.flush
                )
                stats = self.timing.time_stats(times)
                flops = attention_flops(mask, a.heads_q, a.head_dim, mode)
                rec.update(
                    status="ok",
                    time_ms=stats,
                    tflops_per_gpu=self.timing.tflops_stats(flops / self.n, stats)["median"],
                    peak_bytes_in_use=self.timing.jax_peak_bytes(self.devices),
                    compiled_bytes=self.timing.jax_compiled_bytes(fn, fargs),
                    **self.single_gpu(name, tokens, mode),
                )
                if not self.profiled and strategy == "ring" and mode == "fwd_bwd":
                    self.profile(fn, fargs)
                    rec["profile_dir"] = a.profile_dir
            except Exception as e:
                text = f"{type(e).__name__}: {e}"
                status = (
                    "oom" if "RESOURCE_EXHAUSTED" in text or "out of memory" in text else "error"
                )
                rec.update(status=status, error=text[:2000])
                if status == "error":
                    traceback.print_exc()
            self.write(rec)

    def profile(self, fn, fargs) -> None:
        """An XLA/JAX profiler trace of three calls (open with TensorBoard or Perfetto)."""
        with self.jax.profiler.trace(self.args.profile_dir):
            for _ in range(3):
                self.jax.block_until_ready(fn(*fargs))
        self.profiled = True

    def run(self) -> None:
        a = self.args
        deadline = Deadline(a.max_minutes)
        for tokens, name, mask, strategy, layout in sweep(a, self.n):
            if deadline.passed():
                print(f"stopping: --max_minutes={a.max_minutes} reached", flush=True)
                return
            self.point(name, mask, tokens, strategy, layout)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    Bench(args).run()


if __name__ == "__main__":
    main()
