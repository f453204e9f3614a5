"""triton_attn's kernels compiled ahead of time for Hopper (sm_90) on any machine.

Triton's interpreter (the CPU correctness tests) accepts code that the compiler rejects, so each
kernel is also compiled to a cubin here at its default tiles, and must fit the H100/H200
shared-memory budget per block; at the benchmark shapes (half precision, D 64 and 128) ptxas must
also report no register spills. Each compile sees what both front ends' launches give it:
16-byte-aligned arrays and the DIV16 facts of the benchmark shapes. Register use
depends on the compiler, so the spill check runs only under the Triton release the defaults were
tuned with (launch.TUNED_WITH_TRITON) and is skipped, naming both releases, under another.
`python tests/test_triton_compile.py` sweeps candidate tiles and prints registers, spills and
shared memory per config (compile-time data; experiments/triton_tiles.py times them on a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("kernels are interpreted in this process", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from attn_masks import make_mask  # noqa: E402
from triton_attn import kernels, launch  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
TRITON_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
STAT_POINTERS = ("lse_ptr", "delta_ptr", "dlse_ptr")
INDEX_POINTERS = ("lo_ptr", "hi_ptr")
KERNELS = {"fwd": kernels.attn_fwd_kernel, "bwd": kernels.attn_bwd_kernel}
# Triton's own ptxas flags for sm_90 (backends/nvidia/compiler.py), so counts match its cubin.
PTXAS_FLAGS = ("-v", "-lineinfo", "--regAllocOptLevel=2", "--gpu-name=sm_90a")
CASES = [
    (64, "bfloat16"),
    (64, "float16"),
    (128, "bfloat16"),
    (128, "float16"),
    (256, "bfloat16"),
    (256, "float32"),
]
SPILL_CHECKED = {(64, "bfloat16"), (64, "float16"), (128, "bfloat16"), (128, "float16")}
# DIV16 at the benchmark shapes (16K-1M tokens, 64:8 heads, tile lists of 16 or more entries,
# and for the backward 1024 dK/dV programs).
BENCH_DIV16 = {
    "fwd": launch.div16((16384, 16384, 64, 8, 256)),
    "bwd": launch.div16((16384, 16384, 64, 8, 256, 256, 1024)),
}
TRITON_RELEASE = ".".join(triton.__version__.split(".")[:2])  # "3.9.0" -> "3.9"


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


def _tile_meta(which: str, configs: launch.KernelConfigs) -> tuple[dict, launch.KernelConfig]:
    """(tile constexprs, the config giving warps and stages) of kernel `which`."""
    if which == "fwd":
        return {"BLOCK_M": configs.fwd.block_q, "BLOCK_N": configs.fwd.block_k}, configs.fwd
    k, q = configs.dkdv, configs.dq
    tiles = {"DKDV_BLOCK_M": k.block_q, "DKDV_BLOCK_N": k.block_k}
    return {**tiles, "DQ_BLOCK_M": q.block_q, "DQ_BLOCK_N": q.block_k}, k


@functools.cache
def compile_kernel(which: str, head_dim: int, dtype: str, configs: launch.KernelConfigs) -> Any:
    """Kernel `which` ("fwd" or "bwd") compiled for sm_90 at `configs` (GQA group 8, two mask
    intervals), as either front end launches it at a benchmark shape (aligned arrays, DIV16,
    sequence lengths that are multiples of every tile)."""
    fn = KERNELS[which]
    tiles, cfg = _tile_meta(which, configs)
    meta = {
        "GROUP": 8,
        "NUM_INTERVALS": 2,
        **tiles,
        "BLOCK_D": launch.block_d(head_dim),
        "HEAD_DIM": head_dim,
        "IEEE": dtype == "float32",
        "DIV16": BENCH_DIV16[which],
        "EVEN_Q": True,
        "EVEN_K": True,
    }
    constexprs = {(fn.arg_names.index(k),): v for k, v in meta.items()}
    sig = _signature(fn, dtype, meta)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if "*" in sig[n]}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=HOPPER, options=options)


def _ptxas_log(ptx: str) -> str | None:
    """ptxas -v output for `ptx` from the first of Triton's ptxas binaries that accepts it."""
    nvidia = triton.knobs.nvidia
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for tool in (nvidia.ptxas_blackwell, nvidia.ptxas):
            try:
                binary = tool.path
            except Exception:  # a knob whose binary is missing raises on lookup
                continue
            cmd = [binary, *PTXAS_FLAGS, path, "-o", os.path.join(tmp, "kernel.cubin")]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                return done.stderr + done.stdout
    return None


def ptxas_usage(ptx: str) -> tuple[int, int] | None:
    """(registers per thread, spill store bytes) of `ptx` for sm_90a, None if no ptxas takes it."""
    log = _ptxas_log(ptx)
    if log is None:
        return None
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    assert regs and spills, log
    return int(regs.group(1)), int(spills.group(1))


@pytest.mark.parametrize("head_dim,dtype", CASES)
@pytest.mark.parametrize("which", list(KERNELS))
def test_kernel_compiles_for_hopper_within_shared_memory(which, head_dim, dtype):
    configs = launch.default_configs(head_dim, 4 if dtype == "float32" else 2)
    compiled = compile_kernel(which, head_dim, dtype, configs)
    assert compiled.asm["cubin"], "no cubin produced"
    assert 0 < compiled.metadata.shared <= SMEM_LIMIT, compiled.metadata.shared


@pytest.mark.skipif(
    TRITON_RELEASE != launch.TUNED_WITH_TRITON,
    reason=f"default tiles were tuned to spill no registers with Triton "
    f"{launch.TUNED_WITH_TRITON}; Triton {triton.__version__} is installed "
    "(.ci/constraints.txt pins the tuned release)",
)
@pytest.mark.parametrize("head_dim,dtype", sorted(SPILL_CHECKED))
@pytest.mark.parametrize("which", list(KERNELS))
def test_default_config_spills_no_registers(which, head_dim, dtype):
    configs = launch.default_configs(head_dim, 2)
    usage = ptxas_usage(compile_kernel(which, head_dim, dtype, configs).asm["ptx"])
    if usage is None:
        pytest.skip("no ptxas shipped with Triton accepts the PTX it generates")
    regs, spilled = usage
    assert spilled == 0, f"{which} D={head_dim} {dtype} {configs}: {regs} regs, {spilled} B spilled"


# An instruction, after its optional predicate (@%p1 or @!%p1).
MEMORY_OPS = re.compile(r"^\s+(?:@!?%p\d+\s+)?((?:ld|st)\.global[.\w]*|cp\.async[.\w]*)", re.M)


def _launcher_attrs(fn, sig: dict[str, str], values: dict[str, Any], front_end: str) -> dict:
    """The argument attributes a front end's launcher derives from the values it passes.
    Triton's own launcher (torch) marks 16-byte-aligned pointers and every integer that is a
    multiple of 16 with tt.divisibility=16; jax-triton 0.3 marks every array and no scalar."""
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        pointer = sig[name].startswith("*")
        divisible = sig[name] == "i32" and values[name] % 16 == 0
        if pointer or (front_end == "torch" and divisible):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def front_end_ptx(fn, call: launch.Call, dtype: str, front_end: str) -> str:
    """The PTX `front_end` ("torch" or "jax") compiles for sm_90 from one launch description."""
    sig = _signature(fn, dtype, call.meta)
    scalars = [n for n in fn.arg_names if sig[n] in ("i32", "fp32")]
    values = dict(zip(scalars, call.scalars, strict=True))
    assert 1 not in values.values(), "both launchers turn a 1 into a constant; pick other sizes"
    constexprs = {(fn.arg_names.index(k),): v for k, v in call.meta.items()}
    attrs = _launcher_attrs(fn, sig, values, front_end)
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": call.num_warps, "num_stages": call.num_stages}
    return triton.compile(src, target=HOPPER, options=options).asm["ptx"]


def _launches(head_dim: int, dtype: str) -> dict[str, tuple[Any, launch.Call]]:
    """Every kernel's launch at 4096 tokens, 64:8 heads, causal, default tiles."""
    shape = launch.Shape(1, 4096, 4096, 64, 8, head_dim)
    configs = launch.default_configs(head_dim, 4 if dtype == "float32" else 2)
    tables = launch.mask_tables(make_mask("causal", 4096), configs)
    ieee = dtype == "float32"
    return {
        "fwd": (kernels.attn_fwd_kernel, launch.fwd_call(shape, tables, 0.1, ieee)),
        "delta": (kernels.attn_bwd_delta_kernel, launch.delta_call(shape)),
        "bwd": (kernels.attn_bwd_kernel, launch.bwd_call(shape, tables, 0.1, ieee)),
    }


@pytest.mark.parametrize("head_dim,dtype", [(64, "float16"), (128, "float32"), (128, "bfloat16")])
def test_both_front_ends_compile_one_kernel(head_dim, dtype):
    """From one launch description the torch launcher and jax-triton compile the same PTX,
    although only the first tells the compiler which int scalars are multiples of 16: the
    DIV16 constexpr gives every kernel that fact itself. Without it the fp32 LSE/delta loads
    (offset by seqlen_q) vectorised differently and the JAX dK/dV ran 12% slower on the H200."""
    for which, (fn, call) in _launches(head_dim, dtype).items():
        assert call.meta["DIV16"] == launch.div16(call.scalars) != 0, which
        torch_ptx = front_end_ptx(fn, call, dtype, "torch")
        assert torch_ptx == front_end_ptx(fn, call, dtype, "jax"), f"{which}: PTX differs"
    if (head_dim, dtype) == (128, "bfloat16"):  # the facts are what makes the two equal
        fn, call = _launches(head_dim, dtype)["bwd"]
        assert call.meta["EVEN_Q"] and call.meta["EVEN_K"]
        # Lengths off the tiles (predicated loads) but multiples of 16, without DIV16:
        ragged = {"DIV16": 0, "EVEN_Q": False, "EVEN_K": False}
        bare = dataclasses.replace(call, meta={**call.meta, **ragged})
        assert front_end_ptx(fn, bare, dtype, "torch") != front_end_ptx(fn, bare, dtype, "jax")


def test_lengths_on_the_tiles_drop_the_load_predicates():
    """EVEN_Q / EVEN_K hold exactly when every tile of the kernel lies inside its sequence, and
    then the compiled forward guards fewer memory operations (one loop's K/V loads and the Q
    load and output store lose their bounds checks)."""
    configs = launch.default_configs(128, 2)
    mask = make_mask("causal", 4096)
    tables = launch.mask_tables(mask, configs)

    def fwd(sq: int, sk: int) -> launch.Call:
        return launch.fwd_call(launch.Shape(1, sq, sk, 64, 8, 128), tables, 0.1, False)

    assert (fwd(4096, 4096).meta["EVEN_Q"], fwd(4096, 4096).meta["EVEN_K"]) == (True, True)
    assert (fwd(4160, 4096).meta["EVEN_Q"], fwd(4096, 4160).meta["EVEN_K"]) == (False, True)
    bwd = launch.bwd_call(launch.Shape(1, 4096, 4160, 64, 8, 128), tables, 0.1, False)
    assert (bwd.meta["EVEN_Q"], bwd.meta["EVEN_K"]) == (True, False)  # dK/dV tiles: 128 keys

    call = fwd(4096, 4096)
    ragged = dataclasses.replace(call, meta={**call.meta, "EVEN_Q": False, "EVEN_K": False})

    def guarded(c: launch.Call) -> int:
        ptx = front_end_ptx(kernels.attn_fwd_kernel, c, "bfloat16", "torch")
        return len(re.findall(r"^\s*@!?%p\d+\s+(?:ld|st|cp)\.", ptx, re.M))

    assert guarded(call) < guarded(ragged)


def test_div16_marks_exactly_the_integer_multiples_of_16():
    assert launch.div16((4096, 700, 64, 8, 0, 0.5)) == 0b10101
    assert launch.div16((16, 32, 48, 1, 2, 16.0, True)) == 0b111
    assert launch.div16(()) == 0


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", list(TRITON_DTYPE))
def test_delta_kernel_compiles_with_wide_loads(dtype, head_dim):
    """The backward's delta kernel compiles for sm_90 and, with 16-byte-aligned arrays and no
    hints on its int scalars (jax-triton's launch), reads out and dout 16 bytes at a time."""
    fn = kernels.attn_bwd_delta_kernel
    call = launch.delta_call(launch.Shape(1, 4096, 4096, 8, 8, head_dim))
    sig = _signature(fn, dtype, call.meta)
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")
    }
    constexprs = {(fn.arg_names.index(k),): v for k, v in call.meta.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": call.num_warps, "num_stages": call.num_stages}
    compiled = triton.compile(src, target=HOPPER, options=options)
    assert compiled.asm["cubin"] and compiled.metadata.shared <= SMEM_LIMIT
    loads = [op for op in MEMORY_OPS.findall(compiled.asm["ptx"]) if op.startswith("ld.global")]
    assert any(".v4." in op for op in loads), loads


def sweep_one(which: str, head_dim: int, dtype: str, cfg: launch.KernelConfig) -> str:
    """One CSV row: kernel, head dim, dtype, config, registers, spill bytes, shared memory."""
    compiled = compile_kernel(which, head_dim, dtype, launch.KernelConfigs(cfg, cfg, cfg))
    usage = ptxas_usage(compiled.asm["ptx"]) or (-1, -1)
    fields = (which, head_dim, dtype, cfg.block_q, cfg.block_k, cfg.num_warps, cfg.num_stages)
    return ",".join(map(str, (*fields, *usage, compiled.metadata.shared)))


def sweep(head_dims: list[int], dtypes: list[str]) -> None:
    """Print registers, spills and shared memory of every candidate config as CSV."""
    tiles, warps, stages = (32, 64, 128), (4, 8), (1, 2, 3, 4)
    jobs = [
        (which, head_dim, dtype, launch.KernelConfig(bm, bn, w, s))
        for head_dim, dtype, which, bm, bn, w, s in itertools.product(
            head_dims, dtypes, tuple(KERNELS), tiles, tiles, warps, stages
        )
    ]
    print("kernel,head_dim,dtype,block_q,block_k,num_warps,num_stages,regs,spill_bytes,smem")
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        for row in pool.map(sweep_one, *zip(*jobs, strict=True)):
            print(row, flush=True)


if __name__ == "__main__":  # e.g. python tests/test_triton_compile.py 64 128 bfloat16 float32
    args = sys.argv[1:]
    sweep(
        [int(a) for a in args if a.isdigit()] or [64, 128, 256],
        [a for a in args if not a.isdigit()] or list(TRITON_DTYPE),
    )
