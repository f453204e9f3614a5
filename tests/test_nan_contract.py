"""The NaN contract of docs/api.md ("Non-finite inputs") on the CPU, for every impl of both
frameworks that runs here, check_finite=True of both attention()s, and the acceptance NaN case.

A NaN must reach every output row that reads it and may spread only within its batch and KV
head; every other row must match the float64 oracle on the clean inputs. The rows come from the
mask, not from the oracle, which returns rows that read a NaN in q or k as rows that see no key.
torch's triton impl runs in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, as in
tests/test_triton_attn.py); mosaic in its CPU interpreter, on one case.
"""

from __future__ import annotations

import dataclasses
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import checkify
from triton_interpreter import rerun_interpreted

import jax_attn
import torch_attn
from attn_masks import MaskType, from_slices, reference_attention
from experiments import acceptance
from jax_attn.adapters import ADAPTERS
from jax_attn.mask_arrays import prepare_mask
from jax_attn.mosaic_gpu import KernelConfig, flash_attention_mosaic
from jax_attn.mosaic_gpu import api as mosaic_api

S, HQ, HKV, D = 128, 4, 2, 32
GROUP = HQ // HKV
DOCS = [(0, 48), (56, 100), (100, 128)]  # causal documents; rows and keys 48..55 in none
MASK = from_slices(DOCS, DOCS, [int(MaskType.CAUSAL)] * 3, S, S, name="nan_docs")
# (b, s, h, d) of each NaN. q: row 70 of head 1 sees keys 56..70; row 50 of head 2 sees no key,
# so it must stay 0. k, v: key 60 of KV head 1 is read by rows 60..99 of query heads 2 and 3.
NANS = {"q": [(0, 70, 1, 5), (0, 50, 2, 3)], "k": [(0, 60, 1, 7)], "v": [(0, 60, 1, 7)]}
FP32_TOL = dict(rtol=2e-4, atol=2e-5)
# JAX runs on its default backend: on a GPU, fp32 matmuls may use TF32.
JAX_TOL = FP32_TOL if jax.default_backend() == "cpu" else dict(rtol=5e-3, atol=5e-3)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FLEX_HIDES = pytest.mark.xfail(
    strict=True,
    reason="flex's compiled CPU kernel (fp32 without LSE) returns rows that read a NaN in q or k "
    "finite (docs/api.md, Non-finite inputs)",
)
NON_FINITE_MESSAGE = "check_finite: q holds 1 NaN/inf value, v holds 2 NaN/inf values"


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (tests/conftest.py says why)."""


def clean_inputs(batch: int = 2, head_dim: int = D) -> dict[str, np.ndarray]:
    """Fresh standard-normal float32 q, k, v (never zeros: a NaN must meet real values)."""
    rng = np.random.default_rng(7)
    shapes = {"q": (batch, S, HQ, head_dim), "k": (batch, S, HKV, head_dim)}
    shapes["v"] = shapes["k"]
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def with_nans(x: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """Copies of q, k, v with NANS[where] set to NaN."""
    y = {n: a.copy() for n, a in x.items()}
    for at in NANS[where]:
        y[where][at] = np.nan
    return y


def must_rows(where: str, batch: int) -> np.ndarray:
    """(B, S, Hq) bool: the rows that read a NaN placed in `where` (from the mask)."""
    visible = MASK.dense()
    rows = np.zeros((batch, S, HQ), bool)
    for b, pos, h, _ in NANS[where]:
        if where == "q":
            rows[b, pos, h] = visible[pos].any()
        else:
            rows[b, :, h * GROUP : (h + 1) * GROUP] |= visible[:, pos, None]
    return rows


def may_rows(where: str, batch: int) -> np.ndarray:
    """(B, S, Hq) bool: the rows the contract lets turn NaN (for k and v: every row of the
    NaN's batch and KV head)."""
    rows = must_rows(where, batch)
    if where != "q":
        for b, _, h, _ in NANS[where]:
            rows[b, :, h * GROUP : (h + 1) * GROUP] = True
    return rows


def check_contract(
    where: str, out: np.ndarray, lse: np.ndarray | None, clean: dict, tol: dict
) -> None:
    """Assert the contract on out (B,S,Hq,D) and lse (B,Hq,S) or None for NaNs in `where`,
    against the oracle on the clean inputs."""
    ref = reference_attention(clean["q"], clean["k"], clean["v"], MASK)
    must, may = must_rows(where, out.shape[0]), may_rows(where, out.shape[0])
    nan = np.isnan(out).any(axis=-1)
    hidden, spread = int((must & ~nan).sum()), np.argwhere(nan & ~may)
    assert hidden == 0, f"{hidden} of {must.sum()} rows that read the NaN are finite"
    assert len(spread) == 0, f"{len(spread)} rows that cannot reach the NaN are NaN: {spread[:4]}"
    np.testing.assert_allclose(out[~nan], ref.out[~nan], **tol, err_msg="rows that are not NaN")
    if lse is None:
        return
    lse_rows, ref_rows = lse.transpose(0, 2, 1), ref.lse.transpose(0, 2, 1)
    reads_qk = must if where != "v" else np.zeros_like(must)
    assert not np.isfinite(lse_rows[reads_qk]).any(), "finite LSE on a row that reads a NaN"
    np.testing.assert_allclose(lse_rows[~reads_qk], ref_rows[~reads_qk], **tol, err_msg="LSE")


def run_jax(impl: str, x: dict, return_lse: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """jax_attn.attention on JAX's default backend, as float64 numpy."""
    got = jax_attn.attention(*(x[n] for n in "qkv"), MASK, impl=impl, return_lse=return_lse)
    out, lse = got if return_lse else (got, None)
    return np.asarray(out, np.float64), None if lse is None else np.asarray(lse, np.float64)


def run_torch(impl: str, x: dict, return_lse: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """torch_attn.attention on CPU tensors, as float64 numpy."""
    q, k, v = (torch.from_numpy(x[n]) for n in "qkv")
    with torch.no_grad():
        got = torch_attn.attention(q, k, v, MASK, impl=impl, return_lse=return_lse)
    out, lse = got if return_lse else (got, None)
    return out.double().numpy(), None if lse is None else lse.double().numpy()


def why_not_here(framework: str, impl: str, return_lse: bool) -> str | None:
    """supports()' reason why the impl cannot run this problem here, or None."""
    shape = dict(heads_q=HQ, heads_kv=HKV, head_dim=D)
    if framework == "jax":
        lse = dict(return_lse=return_lse, mode="fwd")
        verdict = jax_attn.supports(impl, MASK, dtype="float32", **shape, **lse)
    else:
        verdict = torch_attn.supports(impl, MASK, dtype=torch.float32, device="cpu", **shape)
    if verdict is True:
        return None
    rerun = (framework, impl) == ("torch", "triton") and not INTERPRETED
    return f"{verdict} (test_torch_triton_in_interpreter runs it)" if rerun else str(verdict)


def contract_cases():
    """(framework, impl, where, return_lse) over every impl; flex's compiled CPU path xfails."""
    impls = [("jax", i) for i in jax_attn.IMPLS] + [("torch", i) for i in torch_attn.IMPLS]
    for framework, impl in impls:
        for where in NANS:
            for return_lse in (False, True):
                hides = (framework, impl, return_lse) == ("torch", "flex", False) and where != "v"
                yield pytest.param(
                    framework,
                    impl,
                    where,
                    return_lse,
                    id=f"{framework}-{impl}-{where}-{'lse' if return_lse else 'out'}",
                    marks=FLEX_HIDES if hides else (),
                )


@pytest.mark.parametrize("framework, impl, where, return_lse", list(contract_cases()))
def test_nan_rows_follow_the_mask(framework: str, impl: str, where: str, return_lse: bool):
    """NaN rows: every row that reads the NaN, none outside its batch and KV head; the other
    rows (and LSEs) match the oracle on the clean inputs."""
    why = why_not_here(framework, impl, return_lse)
    if why is not None:
        pytest.skip(why)
    x = clean_inputs()
    run, tol = (run_jax, JAX_TOL) if framework == "jax" else (run_torch, FP32_TOL)
    out, lse = run(impl, with_nans(x, where), return_lse)
    check_contract(where, out, lse, x, tol)


@pytest.mark.skipif(INTERPRETED, reason="the triton cases run in this process")
def test_torch_triton_in_interpreter():
    """Rerun the torch triton cases with TRITON_INTERPRET=1 (set before triton is imported)."""
    out = rerun_interpreted(__file__, "-rA", "-k", "torch-triton", timeout=300)
    assert out.count("PASSED") == 6, out[-3000:]


@pytest.mark.skipif(
    mosaic_api.cpu_device_count() < mosaic_api.INTERPRET_MIN_CPU_DEVICES,
    reason="the Mosaic GPU interpreter needs >= 4 CPU devices (tests/conftest.py sets 8)",
)
def test_mosaic_interpreted_nan_in_k():
    """mosaic, through its CPU interpreter (jax_attn.supports refuses the CPU): one case, a NaN
    in k, bfloat16 (its dtypes), head dim 64, one batch."""
    config = KernelConfig(block_q=64, block_k=64, max_concurrent_steps=2)
    x = {n: a.astype(jnp.bfloat16) for n, a in clean_inputs(batch=1, head_dim=64).items()}
    y = with_nans(x, "k")
    out, lse = flash_attention_mosaic(
        *(jnp.asarray(y[n]) for n in "qkv"),
        prepare_mask(MASK, *config.tiles),
        scale=64**-0.5,
        return_lse=True,
        config=config,
        interpret=True,
    )
    clean = {n: a.astype(np.float32) for n, a in x.items()}
    out = np.asarray(out.astype(jnp.float32), np.float64)
    check_contract("k", out, np.asarray(lse, np.float64), clean, dict(rtol=2e-2, atol=2e-2))


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_float64_oracle(where: str):
    """The oracle keeps the contract too: a NaN it reads makes its row NaN, never 'empty'."""
    x = clean_inputs()
    ref = reference_attention(*(with_nans(x, where)[n] for n in "qkv"), MASK)
    check_contract(where, ref.out, ref.lse, x, dict(rtol=1e-10, atol=1e-12))


# ------------------------------------------------------------------------------ check_finite


def non_finite_inputs() -> dict[str, np.ndarray]:
    """One NaN in q, an inf and a -inf in v, k finite."""
    x = clean_inputs()
    x["q"][0, 3, 0, 0] = np.nan
    x["v"][1, 5, 1, :2] = [np.inf, -np.inf]
    return x


def _must_not_run(*args, **kwargs):
    raise AssertionError("the kernel ran before check_finite refused the inputs")


def test_jax_check_finite_names_inputs_and_counts_before_running(monkeypatch):
    monkeypatch.setitem(ADAPTERS, "xla", dataclasses.replace(ADAPTERS["xla"], run=_must_not_run))
    x = non_finite_inputs()
    with pytest.raises(ValueError) as err:
        jax_attn.attention(*(x[n] for n in "qkv"), MASK, impl="xla", check_finite=True)
    assert str(err.value) == NON_FINITE_MESSAGE


def test_torch_check_finite_names_inputs_and_counts_before_running(monkeypatch):
    monkeypatch.setattr(torch_attn.naive, "attention", _must_not_run)
    q, k, v = (torch.from_numpy(a) for a in non_finite_inputs().values())
    with pytest.raises(ValueError) as err:
        torch_attn.attention(q, k, v, MASK, impl="naive", check_finite=True)
    assert str(err.value) == NON_FINITE_MESSAGE


def test_check_finite_passes_finite_inputs_unchanged():
    x = clean_inputs()
    q, k, v = (torch.from_numpy(x[n]) for n in "qkv")
    torch_checked = torch_attn.attention(q, k, v, MASK, impl="naive", check_finite=True)
    assert torch.equal(torch_checked, torch_attn.attention(q, k, v, MASK, impl="naive"))
    jax_checked = jax_attn.attention(*x.values(), MASK, impl="xla", check_finite=True)
    np.testing.assert_array_equal(jax_checked, jax_attn.attention(*x.values(), MASK, impl="xla"))


def test_jax_check_finite_under_jit_is_a_checkify_check():
    """Traced inputs cannot raise: checkify.checkify reports the counts, plain jit refuses."""
    f = jax.jit(partial(jax_attn.attention, mask=MASK, impl="xla", check_finite=True))
    bad, good = non_finite_inputs(), clean_inputs()
    err, _ = checkify.checkify(f)(*bad.values())
    assert err.get().startswith("check_finite: NaN/inf values held by q: 1, k: 0, v: 2")
    err, out = checkify.checkify(f)(*good.values())
    assert err.get() is None
    np.testing.assert_array_equal(out, jax_attn.attention(*good.values(), MASK, impl="xla"))
    with pytest.raises(ValueError, match="checkify.checkify"):
        f(*bad.values())


def test_jax_check_finite_under_grad_raises():
    """Eagerly under jax.grad the inputs are tracers too: the check still raises a ValueError."""
    x = non_finite_inputs()

    def loss(q):
        return jax_attn.attention(q, x["k"], x["v"], MASK, impl="xla", check_finite=True).sum()

    with pytest.raises(ValueError, match="held by q: 1, k: 0, v: 2"):
        jax.grad(loss)(jnp.asarray(x["q"]))


# ------------------------------------------------------------- the acceptance command's NaN case


ACCEPTANCE_CASE = acceptance.Case("causal", 96, 96, 4, 2, 32, "float32")


def test_acceptance_nan_case_passes_an_impl_that_keeps_the_contract():
    status, line, _ = acceptance.run_nan_case("torch", "naive", ACCEPTANCE_CASE)
    assert status == "ok" and "keeps the NaN contract" in line, line


@pytest.mark.parametrize(
    "damage, problem",
    [
        (torch.nan_to_num, "rows that read a NaN are finite"),
        (lambda out: out + out.sum(), "rows that cannot reach a NaN are NaN"),
    ],
    ids=["hides", "spreads"],
)
def test_acceptance_nan_case_fails_an_impl_that_breaks_it(monkeypatch, damage, problem):
    right = torch_attn.attention
    monkeypatch.setattr(torch_attn, "attention", lambda *a, **kw: damage(right(*a, **kw)))
    status, line, _ = acceptance.run_nan_case("torch", "naive", ACCEPTANCE_CASE)
    assert status == "FAIL" and "breaks the NaN contract: " in line and problem in line, line


def test_acceptance_nan_case_reports_flex_on_cpu_as_documented():
    status, line, _ = acceptance.run_nan_case("torch", "flex", ACCEPTANCE_CASE)
    assert status == "documented", line
    assert "breaks the NaN contract (documented)" in line and "are finite" in line, line


def test_acceptance_nan_verdict_flags_stale_docs():
    """An impl documented as breaking the contract that keeps it fails: docs/api.md is stale."""
    assert acceptance.nan_verdict([], documented=True)[0] == "FAIL"
    assert acceptance.nan_verdict([], documented=False) == ("ok", "keeps the NaN contract")
