"""triton_attn's kernels compiled ahead of time for Hopper (sm_90) on any machine.

Triton's interpreter (the CPU correctness tests) accepts code that the compiler rejects, so each
kernel is also compiled to a cubin here at its default tiles, and must fit the H100/H200
shared-memory budget per block.
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("kernels are interpreted in this process", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from triton_attn import kernels, launch  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 64)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
TRITON_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
STAT_POINTERS = ("lse_ptr", "delta_ptr")
INDEX_POINTERS = ("lo_ptr", "hi_ptr")


def _signature(fn, dtype: str, meta: dict) -> dict[str, str]:
    """Argument types of a kernel: tensors in `dtype`, statistics fp32, mask tables int32."""
    sig = {}
    for name in fn.arg_names:
        if name in meta:
            sig[name] = "constexpr"
        elif name in STAT_POINTERS:
            sig[name] = "*fp32"
        elif name in INDEX_POINTERS or name.endswith(("_index_ptr", "_count_ptr", "_full_ptr")):
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            sig[name] = "*" + TRITON_DTYPE[dtype]
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


@pytest.mark.parametrize(
    "head_dim,dtype", [(64, "bfloat16"), (128, "bfloat16"), (128, "float16"), (256, "float32")]
)
@pytest.mark.parametrize("which", ["fwd", "dkdv", "dq"])
def test_kernel_compiles_for_hopper_within_shared_memory(which, head_dim, dtype):
    itemsize = 4 if dtype == "float32" else 2
    configs = launch.default_configs(head_dim, itemsize)
    cfg = configs.fwd if which == "fwd" else configs.bwd
    fn = {
        "fwd": kernels.attn_fwd_kernel,
        "dkdv": kernels.attn_bwd_dkdv_kernel,
        "dq": kernels.attn_bwd_dq_kernel,
    }[which]
    meta = {
        "GROUP": 8,
        "NUM_INTERVALS": 2,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_D": launch.block_d(head_dim),
        "IEEE": dtype == "float32",
    }
    constexprs = {(fn.arg_names.index(k),): v for k, v in meta.items()}
    src = ASTSource(fn=fn, signature=_signature(fn, dtype, meta), constexprs=constexprs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    compiled = triton.compile(src, target=HOPPER, options=options)
    assert compiled.asm["cubin"], "no cubin produced"
    assert 0 < compiled.metadata.shared <= SMEM_LIMIT, compiled.metadata.shared
