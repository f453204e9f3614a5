"""Time each shared Triton kernel (forward, delta, and the backward's dK/dV and dQ programs each
launched alone) over candidate launch configs on one CUDA GPU, beside FlexAttention.

    python experiments/triton_tiles.py --seqlen=32768 --mask=full,causal

Each candidate runs through the torch front end (the JAX front end compiles the same kernel) and
its output is compared with the first candidate's; a time is printed only next to a passing
check. FLOPs count the matmuls each kernel does on the mask's visible area (forward 2, dK/dV 4,
dQ 3 per visible (query, key) pair and head dim), so the kernels' rates are comparable.
"""

from __future__ import annotations

import dataclasses
import json
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("seqlen", 32768, "Query and key length.", lower_bound=128)
flags.DEFINE_string("heads", "64:8", "Query heads:KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.", lower_bound=32, upper_bound=256)
flags.DEFINE_list("mask", ["full", "causal"], "Masks by name.")
flags.DEFINE_list("kernel", ["fwd", "dkdv", "dq"], "Kernels to sweep.")
flags.DEFINE_integer("iters", 5, "Timed calls per config (median reported).", lower_bound=1)
flags.DEFINE_string("out", None, "Append one JSON line per measurement to this file.")

# (block_q, block_k, num_warps, num_stages) candidates per kernel, half precision; every
# candidate's output is compared with the first one's that runs.
CANDIDATES = {
    "fwd": [
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (128, 128, 8, 3),
        (128, 128, 8, 4),
        (64, 64, 4, 3),
        (64, 64, 4, 4),
    ],
    "dkdv": [
        (64, 64, 8, 1),
        (64, 64, 4, 2),
        (64, 128, 8, 2),
        (64, 128, 8, 3),
        (32, 128, 4, 2),
        (32, 128, 4, 3),
        (64, 128, 4, 2),
        (32, 128, 8, 3),
        (64, 64, 4, 3),
    ],
    "dq": [
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (128, 128, 8, 3),
        (64, 64, 4, 4),
        (128, 32, 4, 3),
        (128, 64, 4, 3),
    ],
}
MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3, "delta": 0}
RTOL = 2e-2  # bf16: two configs sum in other orders


def _median_ms(fn, iters: int) -> float:
    """Median milliseconds of fn() over `iters` calls after one warm-up, each after an L2 flush."""
    import torch

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _rel_err(got, want) -> float:
    got, want = got.float(), want.float()
    got, want = got.detach(), want.detach()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def sweep_mask(name: str, emit) -> None:
    """Every candidate of every kernel on one mask, plus Flex forward and forward+backward."""
    import torch

    import torch_attn
    from attn_masks import make_mask
    from torch_attn import triton as front
    from triton_attn import launch

    s, d = FLAGS.seqlen, FLAGS.head_dim
    hq, hkv = (int(x) for x in FLAGS.heads.split(":"))
    mask = make_mask(name, s, seed=42)
    area = float(mask.area())
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k, v, dout = randn(1, s, hq, d), randn(1, s, hkv, d), randn(1, s, hkv, d), randn(1, s, hq, d)
    scale, shape = d**-0.5, launch.Shape(1, s, s, hq, hkv, d)
    default = launch.default_configs(d, 2)

    def tables_for(configs):
        return front._device_tables(mask, q.device, configs)

    base = tables_for(default)
    out, lse = front.forward(q, k, v, base, scale)
    delta = torch.empty_like(lse)
    dlse = torch.zeros_like(lse)
    kern, _ = front.kernels()

    def run(which, cfg):
        """(a callable running kernel `which` at cfg, the outputs it writes)."""
        if which == "fwd":
            tab = tables_for(launch.KernelConfigs(cfg, default.dkdv, default.dq))
            o, l_ = torch.empty_like(q), torch.empty_like(lse)
            call = launch.fwd_call(shape, tab["host"], scale, False)
            arrays = (q, k, v, tab["lo"], tab["hi"], *tab["fwd"])
            return (lambda: front._launch(kern.attn_fwd_kernel, call, arrays, (o, l_))), (o,)
        if which == "delta":
            call = launch.delta_call(shape)
            args = (out, dout, dlse)
            return (lambda: front._launch(kern.attn_bwd_delta_kernel, call, args, (delta,))), ()
        # dK/dV and dQ share the backward launch's warps and stages: a candidate sets both parts'
        warps = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        tab = tables_for(
            launch.KernelConfigs(
                default.fwd,
                cfg if which == "dkdv" else dataclasses.replace(default.dkdv, **warps),
                cfg if which == "dq" else dataclasses.replace(default.dq, **warps),
            )
        )
        lists = (*tab["dkdv"], *tab["dq"])
        arrays = (q, k, v, dout, lse, delta, tab["lo"], tab["hi"], *lists)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        call = launch.bwd_call(shape, tab["host"], scale, False, which == "dkdv", which == "dq")

        def part():
            front._launch(kern.attn_bwd_kernel, call, arrays, (dq, dk, dv))

        return part, ((dk, dv) if which == "dkdv" else (dq,))

    fn, _ = run("delta", None)
    fn()
    ms = _median_ms(fn, FLAGS.iters)
    emit(dict(mask=name, kernel="delta", config="default", ms=ms, check="n/a"))
    for which in FLAGS.kernel:
        want = None
        for cand in CANDIDATES[which]:
            cfg = launch.KernelConfig(*cand)
            label = f"{cfg.block_q}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            try:
                fn, outs = run(which, cfg)
                fn()
                torch.cuda.synchronize()
                if want is None:
                    want = [x.clone() for x in outs]
                err = max(_rel_err(a, b) for a, b in zip(outs, want))
                if not err <= RTOL:
                    emit(dict(mask=name, kernel=which, config=label, check=f"WRONG {err:.1e}"))
                    continue
                ms = _median_ms(fn, FLAGS.iters)
            except Exception as e:  # a config that does not compile or fit is a finding
                emit(dict(mask=name, kernel=which, config=label, check=f"error {type(e).__name__}"))
                torch.cuda.synchronize()
                continue
            tflops = MATMULS[which] * 2 * area * d * hq / (ms * 1e-3) / 1e12
            emit(
                dict(
                    mask=name,
                    kernel=which,
                    config=label,
                    ms=ms,
                    tflops=tflops,
                    check=f"ok {err:.1e}",
                )
            )

    qf, kf, vf = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def flex_fwd():
        return torch_attn.attention(qf, kf, vf, mask, impl="flex", scale=scale)

    def flex_fwd_bwd():
        o = flex_fwd()
        o.backward(dout)

    got = flex_fwd()
    err = _rel_err(got, out)
    ok = "ok" if err <= RTOL else "WRONG"
    fwd_ms = _median_ms(flex_fwd, FLAGS.iters)
    both_ms = _median_ms(flex_fwd_bwd, FLAGS.iters)
    fwd_flops = 2 * 2 * area * d * hq
    emit(
        dict(
            mask=name,
            kernel="flex fwd",
            config="flex",
            ms=fwd_ms,
            tflops=fwd_flops / (fwd_ms * 1e-3) / 1e12,
            check=f"{ok} {err:.1e} vs triton out",
        )
    )
    emit(
        dict(
            mask=name,
            kernel="flex fwd+bwd",
            config="flex",
            ms=both_ms,
            tflops=3.5 * fwd_flops / (both_ms * 1e-3) / 1e12,
            check=f"{ok} (fwd)",
        )
    )


def main(argv: list[str]) -> None:
    del argv
    import torch
    import triton

    if not torch.cuda.is_available():
        raise app.UsageError("needs a CUDA GPU")
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        seqlen=FLAGS.seqlen,
        heads=FLAGS.heads,
        head_dim=FLAGS.head_dim,
        date=time.strftime("%Y-%m-%d"),
    )
    print(json.dumps(meta), flush=True)
    sink = open(FLAGS.out, "a") if FLAGS.out else None

    def emit(row: dict) -> None:
        row = meta | row
        cells = [
            row["mask"],
            row["kernel"],
            row["config"],
            f"{row.get('ms', float('nan')):9.2f} ms",
            f"{row.get('tflops', float('nan')):6.1f} TFLOP/s",
            row["check"],
        ]
        print("  ".join(str(c) for c in cells), flush=True)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    for name in FLAGS.mask:
        sweep_mask(name, emit)


if __name__ == "__main__":
    app.run(main)
