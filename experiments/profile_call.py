"""One forward+backward of an attention impl through one framework, for Nsight Compute: the
shared Triton kernels from either front end, torch's FlexAttention (--impl=flex), or a JAX
kernel (--impl=mosaic|pallas|cudnn with --front_end=jax) to set beside another.

    ncu --profile-from-start off --clock-control none --metrics <list> --csv \
        python experiments/profile_call.py --front_end=jax --impl=mosaic

Two untimed calls compile and warm up; the third runs between cudaProfilerStart and Stop, so ncu
sees exactly that call's kernels. --dkdv overrides the shared Triton kernel's dK/dV launch
config (half precision at the head dim given; dQ takes its warps and stages, as the one backward
launch needs) to compare one kernel's configs from both front ends.
"""

from __future__ import annotations

from absl import app, flags

from experiments.runners import frameworks
from experiments.runners.front_end_calls import FRONT_ENDS

FLAGS = flags.FLAGS
flags.DEFINE_enum("front_end", "torch", list(FRONT_ENDS), "Which front end launches the kernels.")
flags.DEFINE_string("mask", "full", "Mask name.")
flags.DEFINE_integer("seqlen", 16384, "Query and key length.", lower_bound=128)
flags.DEFINE_string("heads", "64:8", "Query heads:KV heads.")
flags.DEFINE_integer("head_dim", 128, "Head dim.", lower_bound=32, upper_bound=256)
flags.DEFINE_list("dkdv", None, "dK/dV launch config block_q,block_k,num_warps,num_stages.")
flags.DEFINE_string("impl", "triton", "The impl to profile: one of the front end's IMPLS.")


def _override_dkdv(config: list[str]) -> None:
    """Make `config` the half-precision dK/dV default at --head_dim (both front ends read it)."""
    from triton_attn import launch

    key = (max(64, launch.block_d(FLAGS.head_dim)), False)
    fwd, _, dq = launch._DEFAULTS[key]
    dkdv = tuple(int(c) for c in config)
    launch._DEFAULTS[key] = (fwd, dkdv, (*dq[:2], *dkdv[2:]))


def has_impl(front_end: str, impl: str) -> bool:
    """Whether the front end's package (jax_attn / torch_attn) imports and lists `impl`."""
    try:
        return impl in frameworks.impl_names(front_end)
    except ImportError:
        return False


def main(argv: list[str]) -> None:
    del argv
    import numpy as np
    import torch

    from attn_masks import make_mask
    from experiments.runners import front_end_calls

    if not has_impl(FLAGS.front_end, FLAGS.impl):
        runs_with = [f for f in FRONT_ENDS if has_impl(f, FLAGS.impl)]
        if not runs_with:
            raise app.UsageError(f"--impl={FLAGS.impl} is no impl of jax_attn or torch_attn")
        raise app.UsageError(
            f"--impl={FLAGS.impl} runs with --front_end={' or '.join(runs_with)}; "
            f"got --front_end={FLAGS.front_end}"
        )
    if FLAGS.dkdv and FLAGS.impl != "triton":
        raise app.UsageError(f"--dkdv sets the triton kernel's config; got --impl={FLAGS.impl}")
    if not torch.cuda.is_available():
        raise app.UsageError("needs a CUDA GPU")
    if FLAGS.dkdv:
        _override_dkdv(FLAGS.dkdv)
    s, d = FLAGS.seqlen, FLAGS.head_dim
    hq, hkv = (int(x) for x in FLAGS.heads.split(":"))
    rng = np.random.default_rng(0)
    shapes = [(1, s, hq, d), (1, s, hkv, d), (1, s, hkv, d), (1, s, hq, d)]
    arrays = [rng.standard_normal(x).astype(np.float32) for x in shapes]
    run = front_end_calls.call(
        FLAGS.front_end, make_mask(FLAGS.mask, s, seed=42), arrays, impl=FLAGS.impl, grads=True
    )
    run()
    run()
    torch.cuda.profiler.start()
    run()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    app.run(main)
