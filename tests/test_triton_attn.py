"""triton_attn's Triton kernels through both front ends vs the float64 oracle.

torch front end: on a CUDA GPU natively; on CPU in Triton's interpreter, which needs
TRITON_INTERPRET=1 before triton is first imported (triton's own @jit helpers are decorated
then), so without it test_cpu_interpreter reruns this module in a subprocess that sets it.
JAX front end (jax_triton): GPU only, plus the CPU answer of supports().
"""

from __future__ import annotations

import os
import zlib
from functools import partial

import numpy as np
import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from triton_interpreter import rerun_interpreted  # noqa: E402

import torch_attn  # noqa: E402
from attn_masks import Mask, MaskType, from_slices, make_mask, reference_attention  # noqa: E402
from torch_attn import triton as torch_triton  # noqa: E402
from triton_attn import launch  # noqa: E402

FULL, CAUSAL = int(MaskType.FULL), int(MaskType.CAUSAL)
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
KERNELS_HERE = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
SMALL = launch.KernelConfigs(launch.KernelConfig(32, 16, 4, 1), launch.KernelConfig(16, 32, 4, 1))
kernels_here = pytest.mark.skipif(
    not KERNELS_HERE, reason="CPU without TRITON_INTERPRET=1: run by test_cpu_interpreter"
)


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_cpu_interpreter():
    """Rerun this module with TRITON_INTERPRET=1 (set before triton is imported)."""
    rerun_interpreted(__file__, "-q", timeout=600)


def causal(sq: int, sk: int) -> Mask:
    return from_slices([[0, sq]], [[0, sk]], [CAUSAL], sq, sk, name="t_causal")


def random_slices(sq: int, sk: int, seed: int) -> Mask:
    """Random typed slices on a grid of disjoint rectangles (gaps: empty rows and keys)."""
    rng = np.random.default_rng(seed)
    qc = np.unique(np.concatenate([[0, sq], rng.integers(1, sq, 4)]))
    kc = np.unique(np.concatenate([[0, sk], rng.integers(1, sk, 4)]))
    qr, kr, ty = [], [], []
    for q0, q1 in zip(qc[:-1], qc[1:]):
        for k0, k1 in zip(kc[:-1], kc[1:]):
            if rng.random() < 0.45:
                qr.append([q0, q1])
                kr.append([k0, k1])
                ty.append(int(rng.integers(0, 4)))
    return from_slices(qr, kr, ty, sq, sk, name="t_random")


# (id, mask builder, heads_q, heads_kv, head_dim, configs). full, causal_document and
# share_question are tile-aligned at the default tiles (EVEN_Q/EVEN_K: unpredicated loads).
CASES = [
    ("full", lambda: make_mask("full", 128), 2, 2, 32, None),
    ("causal_ragged", lambda: causal(200, 200), 4, 2, 32, None),
    ("causal_document", lambda: make_mask("causal_document", 256, seed=3), 2, 1, 64, None),
    ("sliding_window", lambda: make_mask("sliding_window", 160, window=24), 2, 2, 32, SMALL),
    ("share_question", lambda: make_mask("share_question", 256, seed=5), 4, 2, 32, None),
    ("causal_96x160", lambda: causal(96, 160), 2, 2, 40, SMALL),
    ("causal_160x96_empty_rows", lambda: causal(160, 96), 2, 1, 32, None),
    ("random_150x230", lambda: random_slices(150, 230, 1), 4, 2, 32, SMALL),
]


def _inputs(mask: Mask, hq: int, hkv: int, d: int, dtype: torch.dtype, batch: int = 1):
    """q, k, v, dout rounded to `dtype` as float64 numpy (for the oracle)."""
    rng = np.random.default_rng(zlib.crc32(repr((mask.name, hq, hkv, d, str(dtype))).encode()))
    shapes = [(batch, mask.seqlen_q, hq, d), (batch, mask.seqlen_k, hkv, d)]
    arrays = [rng.standard_normal(shapes[i]) for i in (0, 1, 1, 0)]
    return [torch.tensor(a).to(dtype).double().numpy() for a in arrays]


def _run(mask: Mask, arrays: list, dtype: torch.dtype, configs: launch.KernelConfigs | None):
    q, k, v = (torch.tensor(a, dtype=dtype, device=DEVICE, requires_grad=True) for a in arrays[:3])
    d = q.shape[-1]
    out, lse = torch_triton.attention(q, k, v, mask, scale=d**-0.5, configs=configs)
    out.backward(torch.tensor(arrays[3], dtype=dtype, device=DEVICE))
    return [x.detach().double().cpu().numpy() for x in (out, lse, q.grad, k.grad, v.grad)]


def _check(got: list, ref, mask: Mask, tol: float) -> None:
    out, lse, dq, dk, dv = got
    for name, g in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.isfinite(g).all(), f"{name}: non-finite values"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref.lse), "LSE -inf rows")
    seen = np.isfinite(ref.lse)
    np.testing.assert_allclose(lse[seen], ref.lse[seen], atol=tol * 10, err_msg="lse")
    for name, g, want in (("out", out, ref.out), ("dq", dq, ref.dq), ("dk", dk, ref.dk)):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(g, want, atol=tol * scale, rtol=tol, err_msg=name)
    np.testing.assert_allclose(dv, ref.dv, atol=tol * max(1.0, np.abs(ref.dv).max()), rtol=tol)
    dense = mask.dense()
    empty_rows, unseen_keys = ~dense.any(axis=1), ~dense.any(axis=0)
    assert (out[:, empty_rows] == 0).all() and (dq[:, empty_rows] == 0).all()
    assert (dk[:, unseen_keys] == 0).all() and (dv[:, unseen_keys] == 0).all()


@kernels_here
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
    _, build, hq, hkv, d, configs = case
    mask = build()
    arrays = _inputs(mask, hq, hkv, d, torch.float32)
    ref = reference_attention(*arrays[:3], mask, dout=arrays[3])
    _check(_run(mask, arrays, torch.float32, configs), ref, mask, TOL[torch.float32])


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    if dtype == torch.bfloat16 and not CUDA:
        pytest.skip("Triton's CPU interpreter computes tl.dot of bfloat16 wrongly (triton 3.9)")
    mask = make_mask("causal_document", 128, seed=7)
    arrays = _inputs(mask, 2, 1, 32, dtype)
    ref = reference_attention(*arrays[:3], mask, dout=arrays[3])
    _check(_run(mask, arrays, dtype, SMALL), ref, mask, TOL[dtype])


@kernels_here
def test_every_element_written(monkeypatch):
    """Outputs and gradients are allocated NaN-filled: every element must be overwritten."""
    mask = random_slices(96, 112, 4)
    for name in ("empty_like", "empty"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, **kw: _real(*a, **kw).fill_(np.nan))
    arrays = _inputs(mask, 2, 1, 32, torch.float32)
    got = _run(mask, arrays, torch.float32, SMALL)
    monkeypatch.undo()
    _check(got, reference_attention(*arrays[:3], mask, dout=arrays[3]), mask, 2e-4)


@kernels_here
def test_lse_gradient_through_public_api():
    """impl="triton" via torch_attn.attention; a loss on the LSE too matches the naive impl."""
    mask = random_slices(80, 100, 6)
    arrays = _inputs(mask, 2, 2, 32, torch.float32)
    grads = {}
    for impl, dtype in (("triton", torch.float32), ("naive", torch.float64)):
        xs = [torch.tensor(a, dtype=dtype, device=DEVICE, requires_grad=True) for a in arrays[:3]]
        out, lse = torch_attn.attention(*xs, mask, impl=impl, return_lse=True)
        finite = torch.isfinite(lse)
        weight = torch.linspace(-1, 1, lse.numel(), device=DEVICE, dtype=dtype).view(lse.shape)
        dout = torch.tensor(arrays[3], dtype=dtype, device=DEVICE)
        loss = (out * dout).sum() + torch.where(finite, lse * weight, 0).sum()
        loss.backward()
        grads[impl] = [x.grad.double().cpu().numpy() for x in xs]
    for got, want in zip(grads["triton"], grads["naive"]):
        np.testing.assert_allclose(got, want, atol=2e-4 * max(1.0, np.abs(want).max()))


@kernels_here
def test_supports_reasons():
    mask = causal(64, 64)
    assert torch_attn.supports("triton", mask, dtype=torch.float32, device=DEVICE) is True
    assert "head_dim" in torch_attn.supports("triton", mask, head_dim=16, device=DEVICE)
    assert "float64" in torch_attn.supports("triton", mask, dtype=torch.float64, device=DEVICE)
    with pytest.raises(torch_attn.Unsupported, match="float64"):
        x = torch.zeros(1, 64, 1, 32, dtype=torch.float64, device=DEVICE)
        torch_attn.attention(x, x, x, mask, impl="triton")
    assert "triton" in torch_attn.describe("triton")


def test_edge_tiles_are_partial():
    """Tiles on a ragged sequence end never run unmasked (their padding must be masked)."""
    mask = make_mask("full", 100)
    tables = launch.mask_tables(
        mask, launch.KernelConfigs(*(launch.KernelConfig(32, 32, 4, 1),) * 2)
    )
    full = tables.fwd.full[:, :4]
    assert full[:3, :3].all() and not full[3].any() and not full[:, 3].any()


def test_backward_launch_runs_every_dkdv_then_every_dq_program():
    """One backward launch: dK/dV programs first (their count is a kernel argument), then dQ;
    each part can be launched alone, and dQ must share dK/dV's warps and stages."""
    dkdv, dq = launch.KernelConfig(64, 128, 8, 3), launch.KernelConfig(128, 64, 8, 3)
    configs = launch.KernelConfigs(dkdv, dkdv, dq)
    tables = launch.mask_tables(make_mask("causal", 1000), configs)
    shape = launch.Shape(2, 1000, 1000, 12, 4, 64)
    dkdv_programs, dq_programs = 8 * 2 * 4, 8 * 2 * 12  # ceil(1000 / 128) tiles of each
    both = launch.bwd_call(shape, tables, 0.1, False)
    assert both.grid == (dkdv_programs + dq_programs, 1) and both.scalars[6] == dkdv_programs
    assert launch.bwd_call(shape, tables, 0.1, False, dq=False).grid == (dkdv_programs, 1)
    alone = launch.bwd_call(shape, tables, 0.1, False, dkdv=False)
    assert alone.grid == (dq_programs, 1) and alone.scalars[6] == 0
    with pytest.raises(ValueError, match=r"\(4, 3\) must equal dK/dV's \(8, 3\)"):
        launch.KernelConfigs(dkdv, dkdv, launch.KernelConfig(128, 64, 4, 3))


# ---------------------------------------------------------------- JAX front end (jax_triton)


def test_jax_supports_says_why_on_cpu():
    jax_attn = pytest.importorskip("jax_attn")
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU backend is present")
    reason = jax_attn.supports("triton", causal(64, 64), head_dim=64)
    assert isinstance(reason, str) and ("jax-triton" in reason or "CUDA" in reason), reason


def _launch_record(kernel, grid, args, num_warps, num_stages, meta) -> tuple:
    """What decides the compiled kernel and its launch: name, grid, the runtime scalars (type
    and value; arrays by dtype and shape), warps, stages and constexprs."""

    def describe(x):
        if hasattr(x, "shape") and not isinstance(x, np.generic):
            return ("array", str(x.dtype).removeprefix("torch."), tuple(x.shape))
        if isinstance(x, (float, np.floating)):  # both launchers pass floats to Triton as fp32
            return ("fp32", float(np.float32(x)))
        return ("int", int(x))

    name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
    return name, tuple(grid), tuple(map(describe, args)), num_warps, num_stages, meta


def _interpreted_triton_call(record, *args, kernel, out_shape, grid, num_warps, num_stages, **meta):
    """jax_triton.triton_call's contract (arrays and scalars, then outputs, then constexprs),
    run by Triton's interpreter on CPU from a host callback, so it works under jit as the real
    call does: the JAX front end's launches through the same kernels."""
    import jax

    is_array = [isinstance(x, jax.Array) for x in args]

    def run(*arrays):
        given = iter(arrays)
        host = [
            torch.from_numpy(np.array(next(given)))
            if array
            else (x.item() if isinstance(x, np.generic) else x)
            for x, array in zip(args, is_array)
        ]
        outs = [
            torch.empty(o.shape, dtype=getattr(torch, np.dtype(o.dtype).name)) for o in out_shape
        ]
        record.append(_launch_record(kernel, grid, (*host, *outs), num_warps, num_stages, meta))
        kernel[grid](*host, *outs, num_warps=num_warps, num_stages=num_stages, **meta)
        return tuple(o.numpy() for o in outs)

    arrays = [x for x, array in zip(args, is_array) if array]
    return jax.pure_callback(run, tuple(out_shape), *arrays)


@pytest.mark.skipif(CUDA or not KERNELS_HERE, reason="the kernels run interpreted on CPU only")
@pytest.mark.parametrize(
    "dtype_name,head_dim,heads", [("float16", 64, (2, 2)), ("float32", 128, (4, 2))]
)
def test_both_front_ends_compute_the_same_bits(monkeypatch, dtype_name, head_dim, heads):
    """The JAX front end (its launches run by the interpreter) and the torch front end give
    bitwise-equal out, LSE and gradients at their default tiles: every value of the backward,
    delta = rowsum(out * dout) - dlse included, comes from the shared kernels, none from a
    framework's own reduction (which sums in another order)."""
    jax = pytest.importorskip("jax")
    import types

    from jax_attn.adapters import triton as jax_front

    mod, _ = torch_triton.kernels()
    launches = {"jax": [], "torch": []}
    fake = types.SimpleNamespace(triton_call=partial(_interpreted_triton_call, launches["jax"]))
    monkeypatch.setattr(jax_front, "modules", lambda: (fake, mod, None))
    torch_launch = torch_triton._launch

    def recorded_torch_launch(kernel, call, arrays, outputs):
        args = (*arrays, *call.scalars, *outputs)
        record = _launch_record(kernel, call.grid, args, call.num_warps, call.num_stages, call.meta)
        launches["torch"].append(record)
        torch_launch(kernel, call, arrays, outputs)

    monkeypatch.setattr(torch_triton, "_launch", recorded_torch_launch)
    mask = make_mask("causal_document", 150, seed=4)
    rng = np.random.default_rng(zlib.crc32(dtype_name.encode()))
    (hq, hkv), s, d = heads, mask.seqlen_q, head_dim
    shapes = {"q": (1, s, hq, d), "k": (1, s, hkv, d), "v": (1, s, hkv, d), "dout": (1, s, hq, d)}
    x = {n: rng.standard_normal(shape).astype(np.float32) for n, shape in shapes.items()}
    dlse = rng.standard_normal((1, hq, s)).astype(np.float32)
    dtype = getattr(torch, dtype_name)
    scale = d**-0.5

    t = {n: torch.tensor(a).to(dtype).requires_grad_(n != "dout") for n, a in x.items()}
    out, lse = torch_triton.attention(t["q"], t["k"], t["v"], mask, scale=scale)
    ((out.float() * t["dout"].float()).sum() + (lse * torch.tensor(dlse)).sum()).backward()
    want = [out, lse, t["q"].grad, t["k"].grad, t["v"].grad]

    j = {n: jax.numpy.asarray(a).astype(dtype_name) for n, a in x.items()}
    (out_j, lse_j), pullback = jax.vjp(
        lambda q, k, v: jax_front._run(q, k, v, mask, scale=scale, return_lse=True),
        j["q"],
        j["k"],
        j["v"],
    )
    got = [out_j, lse_j, *pullback((j["dout"], jax.numpy.asarray(dlse)))]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a.astype(np.float32)), b.detach().float().numpy()
        differ = int((a != b).sum())
        assert differ == 0, f"{name}: {differ} of {a.size} elements differ between front ends"
    assert [r[0] for r in launches["jax"]] == [
        "attn_fwd_kernel",
        "attn_bwd_delta_kernel",
        "attn_bwd_kernel",
    ]
    assert launches["jax"] == launches["torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(
    "build",
    [lambda: causal(300, 300), lambda: make_mask("causal_document", 512, seed=2)],
    ids=["causal_ragged", "causal_document"],
)
def test_jax_matches_reference_gpu(build, dtype_name):
    pytest.importorskip("jax_triton", exc_type=ImportError)
    import jax
    import jax.numpy as jnp

    import jax_attn

    mask = build()
    dtype = jnp.dtype(dtype_name)
    tol = TOL[getattr(torch, dtype_name)]
    rng = np.random.default_rng(0)
    shapes = [(2, mask.seqlen_q, 4, 64), (2, mask.seqlen_k, 2, 64)]
    q, k, v, do = (jnp.asarray(rng.standard_normal(shapes[i]), dtype) for i in (0, 1, 1, 0))
    f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, do)]
    ref = reference_attention(*f64[:3], mask, dout=f64[3])

    def loss(q, k, v):
        out = jax_attn.attention(q, k, v, mask, impl="triton")
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

    out, lse = jax_attn.attention(q, k, v, mask, impl="triton", return_lse=True)
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    got = [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (out, lse, dq, dk, dv)]
    _check(got, ref, mask, tol)
    bwd = jax_attn.attention_bwd(q, k, v, mask, out, lse, do, impl="triton")
    for a, b in zip(bwd, (dq, dk, dv)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol)


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_cpu_without_interpreter_says_why():
    assert "TRITON_INTERPRET" in torch_attn.supports("triton", causal(64, 64), device="cpu")
