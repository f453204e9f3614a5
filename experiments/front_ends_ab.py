"""The shared Triton kernel from both front ends in one process, timed alternately on one clock.

    python experiments/front_ends_ab.py --mask=causal_document,full --seqlen=32768 --heads=64:64

The driver times each framework in its own worker process, JAX with the host clock and torch
with CUDA events; on a 2-3 ms kernel the two then differ by a few percent either way although
both launch the same compiled kernel. Here both front ends run on the same inputs in one
process, every call is timed the same way (L2 flush, synchronize, host clock around the call
and its completion), and rounds alternate (torch, JAX, torch, ...) so that a drift in clocks or
temperature reaches both. The host clock includes each front end's launch overhead and the host's
jitter; a last profiled round (CUPTI, through torch.profiler, which sees every kernel of the
process, JAX's included) records the GPU time of the kernels each call launched, which is the
same for one compiled kernel unless a front end adds work on the device. Before any time is
printed, the two outputs must be bitwise equal (one kernel) and torch's must pass the float64 row
check of the driver (experiments/runners/checks.py).
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

from absl import app, flags

# Both frameworks share the GPU: JAX must not take most of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

FLAGS = flags.FLAGS
flags.DEFINE_list("mask", ["causal_document"], "Mask names.")
flags.DEFINE_integer("seqlen", 32768, "Query and key length.", lower_bound=128)
flags.DEFINE_list("heads", ["64:8", "64:64"], "Query heads:KV heads, one or more.")
flags.DEFINE_integer("head_dim", 128, "Head dim.", lower_bound=32, upper_bound=256)
flags.DEFINE_enum("mode", "fwd", ["fwd", "fwd_bwd"], "Forward, or forward+backward.")
flags.DEFINE_integer("rounds", 10, "Alternating rounds per point.", lower_bound=1)
flags.DEFINE_integer("iters", 5, "Timed calls per front end per round.", lower_bound=1)
flags.DEFINE_integer("profiled", 10, "Calls per front end in the profiled round (0: none).", 0)
flags.DEFINE_string("out", None, "Append one JSON line per point to this file.")

SEED = 42
# torch's L2 flush (zero_ of a 256 MB buffer) launches this kernel; it is not the call's work
FLUSH_KERNEL = "FillFunctor"


def _host(x):
    """Float32 numpy copy of a torch tensor or a JAX array."""
    import numpy as np

    if hasattr(x, "detach"):
        x = x.detach().float().cpu()
    return np.asarray(x, np.float32)


def _point(mask_name: str, heads: str) -> dict:
    """Check both front ends on one point, then time them in alternating rounds."""
    import numpy as np
    import torch

    from attn_masks import make_mask
    from experiments.runners import checks, front_end_calls, timing

    s, d = FLAGS.seqlen, FLAGS.head_dim
    hq, hkv = (int(x) for x in heads.split(":"))
    grads = FLAGS.mode == "fwd_bwd"
    mask = make_mask(mask_name, s, seed=SEED)
    rng = np.random.default_rng(SEED)
    shapes = [(1, s, hq, d), (1, s, hkv, d), (1, s, hkv, d), (1, s, hq, d)]
    arrays = [rng.standard_normal(x).astype(np.float32) for x in shapes]
    calls = {
        f: front_end_calls.call(f, mask, arrays, grads=grads) for f in front_end_calls.FRONT_ENDS
    }
    got = {f: {n: _host(x) for n, x in fn().items()} for f, fn in calls.items()}
    differ = {n: int((got["torch"][n] != got["jax"][n]).sum()) for n in got["torch"]}
    rounded = [_host(torch.tensor(a).bfloat16()) for a in arrays]
    check = checks.check_point(
        SimpleNamespace(batch=1, heads_q=hq, seed=SEED, dtype="bf16", mode=FLAGS.mode),
        mask,
        0,
        dict(zip(("q", "k", "v", "dout"), rounded)),
        got["torch"],
        fetch=lambda x, rows: x if rows is None else x[:, rows],
        finite=lambda x: bool(np.isfinite(x).all()),
        on_gpu=True,
    )
    record = {
        "mask": mask_name,
        "seqlen": s,
        "heads": heads,
        "head_dim": d,
        "mode": FLAGS.mode,
        "differing_elements": differ,
        "check": check.as_dict(),
    }
    if any(differ.values()) or not check.ok:
        return {**record, "status": "wrong"}
    flush = timing.torch_flush_buffer("cuda")
    times = {f: [] for f in calls}
    for _ in range(FLAGS.rounds):
        for f, fn in calls.items():
            for _ in range(FLAGS.iters):
                flush.zero_()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                times[f].append((time.perf_counter() - t0) * 1e3)
    stats = {f: timing.time_stats(t) for f, t in times.items()}
    ratio = stats["jax"]["median"] / stats["torch"]["median"] - 1.0
    record = {**record, "status": "ok", "time_ms": stats, "jax_vs_torch": ratio}
    if FLAGS.profiled:
        gpu = {f: _gpu_ms_per_call(fn, flush, FLAGS.profiled) for f, fn in calls.items()}
        record["gpu_ms_per_call"] = gpu
        if all(gpu.values()):
            record["gpu_jax_vs_torch"] = gpu["jax"] / gpu["torch"] - 1.0
    return record


def _gpu_ms_per_call(fn, flush, calls: int) -> float | None:
    """GPU time of the kernels one call launches (mean over `calls` calls, L2 flushed before
    each, flush kernels left out), from a CUPTI trace; None if the trace has no kernel."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            torch.cuda.synchronize()
            fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = [
        e["dur"]
        for e in events
        if e.get("cat") == "kernel" and FLUSH_KERNEL not in e.get("name", "")
    ]
    return sum(kernels) / 1e3 / calls if kernels else None


def main(argv: list[str]) -> None:
    del argv
    import torch

    if not torch.cuda.is_available():
        raise app.UsageError("needs a CUDA GPU (both front ends launch the Triton kernel on it)")
    for mask_name in FLAGS.mask:
        for heads in FLAGS.heads:
            rec = _point(mask_name, heads)
            where = f"{mask_name} S={FLAGS.seqlen} {heads} {FLAGS.mode}"
            if rec["status"] == "ok":
                t = rec["time_ms"]
                gpu = rec.get("gpu_ms_per_call", {})
                on_gpu = (
                    f"; GPU time torch {gpu['torch']:.3f} ms, JAX {gpu['jax']:.3f} ms "
                    f"({100 * rec['gpu_jax_vs_torch']:+.1f}%)"
                    if "gpu_jax_vs_torch" in rec
                    else ""
                )
                print(
                    f"{where}: torch {t['torch']['median']:.3f} ms, JAX {t['jax']['median']:.3f} "
                    f"ms ({100 * rec['jax_vs_torch']:+.1f}%){on_gpu}; bitwise equal, float64 "
                    "check ok",
                    flush=True,
                )
            else:
                print(f"{where}: WRONG {rec['differing_elements']} {rec['check']}", flush=True)
            if FLAGS.out:
                with open(FLAGS.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    app.run(main)
