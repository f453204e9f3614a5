"""jax_attn public API: every impl against the float64 oracle, supports() honesty, errors."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_attn
from attn_masks import Mask, MaskType, from_slices, structure
from attn_masks import reference_attention as oracle
from jax_attn import Unsupported
from jax_attn.adapters import jax_pallas

FULL, CAUSAL, INVCAUSAL, BICAUSAL = (int(t) for t in MaskType)
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (default backend is not gpu)")
HAS_GENERATORS = importlib.util.find_spec("attn_masks.generators") is not None


def _pallas_missing() -> str | None:
    try:
        importlib.import_module("jax_attn.pallas_triton")
    except ImportError as err:
        return f"jax_attn.pallas_triton is not importable: {err}"
    return None


PALLAS_MISSING = _pallas_missing()
needs_pallas = pytest.mark.skipif(PALLAS_MISSING is not None, reason=str(PALLAS_MISSING))
CPU_IMPLS = ["reference", "xla"]


# ----------------------------------------------------------------------------- masks


def row_mask(sq: int, sk: int, rows: list[tuple[int, int]], name: str = "custom") -> Mask:
    """A mask given per row by one key interval, as one FULL slice per row."""
    q = [(i, i + 1) for i, (a, b) in enumerate(rows) if a < b]
    k = [(a, b) for a, b in rows if a < b]
    return from_slices(q, k, [FULL] * len(q), sq, sk, name=name)


def band(s: int, left: int, right: int, name: str = "custom") -> Mask:
    """i - left <= j <= i + right, cut into one slice per row (a layout no generator uses)."""
    return row_mask(s, s, [(max(0, i - left), min(s, i + right + 1)) for i in range(s)], name)


def documents(cu: list[int], typ: int) -> Mask:
    q = [(a, b) for a, b in zip(cu[:-1], cu[1:])]
    return from_slices(q, q, [typ] * len(q), cu[-1], cu[-1])


def random_slices(sq: int, sk: int, seed: int) -> Mask:
    """Random non-overlapping slices: random row blocks, each with disjoint random key ranges."""
    rng = np.random.default_rng(seed)
    qcuts = np.unique(np.concatenate([[0, sq], rng.integers(1, sq, 4)]))
    qr, kr, ty = [], [], []
    for q0, q1 in zip(qcuts[:-1], qcuts[1:]):
        kcuts = np.unique(np.concatenate([[0, sk], rng.integers(1, sk, 3)]))
        for k0, k1 in zip(kcuts[:-1], kcuts[1:]):
            if rng.random() < 0.6:
                qr.append((q0, q1))
                kr.append((k0, k1))
                ty.append(int(rng.integers(0, 4)))
    return from_slices(qr, kr, ty, sq, sk, name=f"random{seed}")


def masks_under_test() -> dict[str, Mask]:
    s = 64
    return {
        "full": from_slices([(0, s)], [(0, s)], [FULL], s, s),
        "causal": from_slices([(0, s)], [(0, s)], [CAUSAL], s, s),
        "full_documents": documents([0, 10, 37, 64], FULL),
        "causal_documents": documents([0, 10, 37, 64], CAUSAL),
        "window_causal": band(s, 7, 0),
        "window_two_sided": band(s, 5, 3),
        "empty_rows": from_slices(
            [(0, 5), (10, 64), (20, 40)], [(0, 5), (0, 9), (40, 64)], [CAUSAL, FULL, BICAUSAL], s, s
        ),
        "random": random_slices(s, s, 1),
        "causal_rect": from_slices([(0, 48)], [(0, 80)], [CAUSAL], 48, 80),
        "causal_tall": from_slices([(0, 80)], [(0, 48)], [CAUSAL], 80, 48),
        "random_rect": random_slices(48, 80, 2),
    }


MASKS = masks_under_test()


# ----------------------------------------------------------------------------- oracle


def inputs(mask: Mask, heads_q: int, heads_kv: int, d: int = 16, batch: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, mask.seqlen_q, heads_q, d)).astype(np.float32)
    k = rng.standard_normal((batch, mask.seqlen_k, heads_kv, d)).astype(np.float32)
    v = rng.standard_normal((batch, mask.seqlen_k, heads_kv, d)).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dlse = rng.standard_normal((batch, heads_q, mask.seqlen_q)).astype(np.float32)
    return q, k, v, dout, dlse


def oracle_with_lse_grads(q, k, v, mask, scale, dout, dlse):
    """float64 (out, lse, dq, dk, dv) for the loss <out, dout> + <lse, dlse> (finite lse only)."""
    ref = oracle(q, k, v, mask, scale=scale, dout=dout)
    group = q.shape[2] // k.shape[2]
    q64, k64 = q.astype(np.float64), np.repeat(k.astype(np.float64), group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    lse = ref.lse[..., None]
    p = np.where(mask.dense() & np.isfinite(lse), np.exp(s - np.where(np.isfinite(lse), lse, 0)), 0)
    ds = p * dlse.astype(np.float64)[..., None]
    dq = ref.dq + np.einsum("bhqk,bkhd->bqhd", ds, k64) * scale
    dkr = np.einsum("bhqk,bqhd->bkhd", ds, q64) * scale
    b, sk, hkv, d = k.shape
    dk = ref.dk + dkr.reshape(b, sk, hkv, group, d).sum(axis=3)
    return ref.out, ref.lse, dq, dk, ref.dv


def run_with_grads(impl, q, k, v, mask, scale, dout, dlse, *, with_lse=True):
    """(out, lse, dq, dk, dv) of `impl` for the same loss as the oracle."""

    def loss(q, k, v):
        if with_lse:
            out, lse = jax_attn.attention(q, k, v, mask, impl=impl, scale=scale, return_lse=True)
            lse_part = jnp.vdot(jnp.where(jnp.isfinite(lse), lse, 0.0), dlse)
        else:
            out = jax_attn.attention(q, k, v, mask, impl=impl, scale=scale)
            lse, lse_part = None, 0.0
        return jnp.vdot(out.astype(jnp.float32), dout) + lse_part, (out, lse)

    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (out, lse, *grads)


def assert_matches(got, want, *, atol=2e-5, rtol=2e-5, scaled=False):
    """Compare (out, lse, dq, dk, dv) tuples; scaled: atol relative to each array's max."""
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if g is None:
            continue
        g = np.asarray(g, np.float64)
        assert np.isfinite(g).all() or name == "lse", f"{name} has non-finite values"
        tol = atol * max(1.0, float(np.abs(w[np.isfinite(w)]).max(initial=0))) if scaled else atol
        np.testing.assert_allclose(g, w, atol=tol, rtol=rtol, err_msg=name)


def check_against_oracle(impl, mask, heads_q, heads_kv, *, d=16, with_lse=True, seed=0):
    q, k, v, dout, dlse = inputs(mask, heads_q, heads_kv, d=d, seed=seed)
    scale = 0.7 / np.sqrt(d)
    if not with_lse:
        dlse = np.zeros_like(dlse)
    want = oracle_with_lse_grads(q, k, v, mask, scale, dout, dlse)
    got = run_with_grads(impl, q, k, v, mask, scale, dout, dlse, with_lse=with_lse)
    assert got[0].shape == q.shape and got[0].dtype == q.dtype
    if with_lse:
        assert got[1].shape == (q.shape[0], q.shape[2], q.shape[1]) and got[1].dtype == jnp.float32
    assert_matches(got, want)


# ----------------------------------------------------------------------------- correctness


def check_impl_on_mask(impl: str, mask: Mask, heads_q: int = 4, heads_kv: int = 2) -> None:
    """supports() honesty: True means out, lse, dq, dk, dv match the oracle; a reason means
    attention() raises Unsupported (with and without return_lse)."""
    q, k, v, _, _ = inputs(mask, heads_q, heads_kv)
    ask = dict(dtype=q.dtype, head_dim=q.shape[3], heads_q=heads_q, heads_kv=heads_kv)
    for return_lse in (True, False):
        ok = jax_attn.supports(impl, mask, return_lse=return_lse, **ask)
        if ok is True:
            check_against_oracle(impl, mask, heads_q, heads_kv, with_lse=return_lse)
            return
        assert isinstance(ok, str) and ok
        with pytest.raises(Unsupported):
            jax_attn.attention(q, k, v, mask, impl=impl, return_lse=return_lse)


@pytest.mark.parametrize("impl", [i for i in jax_attn.IMPLS if i != "pallas"])
@pytest.mark.parametrize("name", list(MASKS))
def test_impl_matches_float64_oracle_or_is_unsupported(impl, name):
    check_impl_on_mask(impl, MASKS[name])


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("heads", [(3, 3), (4, 1)])
def test_mha_and_mqa(impl, heads):
    check_against_oracle(impl, MASKS["causal_documents"], *heads)


@needs_pallas
@pytest.mark.parametrize("name", ["causal_documents", "empty_rows"])
def test_pallas_matches_float64_oracle_or_is_unsupported(name):
    check_impl_on_mask("pallas", MASKS[name])


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_empty_rows_give_zero_and_no_nan(impl):
    mask = MASKS["empty_rows"]
    empty = ~mask.dense().any(axis=1)
    assert empty.any()
    q, k, v, dout, _ = inputs(mask, 2, 1)
    out, lse = jax_attn.attention(q, k, v, mask, impl=impl, return_lse=True)
    assert (np.asarray(out)[:, empty] == 0).all()
    assert np.isneginf(np.asarray(lse)[:, :, empty]).all()
    grads = jax.grad(
        lambda q, k, v: jnp.vdot(jax_attn.attention(q, k, v, mask, impl=impl), dout),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    assert (np.asarray(grads[0])[:, empty] == 0).all()


def effective_mask(
    impl: str, mask: Mask, *, d: int | None = None, dtype=jnp.float32, heads=(2, 1)
) -> np.ndarray:
    """The mask an impl really applies: with one-hot values v[j, c] = [j == c0 + c] for keys
    c0..c0+d, out[i, c] = P(i sees c0 + c), which is > 0 exactly where i sees that key."""
    sk = mask.seqlen_k
    d = sk if d is None else d
    rng = np.random.default_rng(3)
    q = jnp.asarray(0.1 * rng.standard_normal((1, mask.seqlen_q, heads[0], d)), dtype)
    k = jnp.asarray(0.1 * rng.standard_normal((1, sk, heads[1], d)), dtype)
    seen = []
    for c0 in range(0, sk, d):
        onehot = np.arange(sk)[:, None] == c0 + np.arange(d)[None, :]
        v = jnp.broadcast_to(jnp.asarray(onehot, dtype)[None, :, None, :], (1, sk, heads[1], d))
        out = np.asarray(jax_attn.attention(q, k, v, mask, impl=impl).astype(jnp.float32)) > 0
        assert (out == out[:, :, :1]).all(), "heads disagree on the mask"
        seen.append(out[0, :, 0, : sk - c0])
    return np.concatenate(seen, axis=1)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("name", [n for n in MASKS if MASKS[n].seqlen_k == 64])
def test_effective_mask_is_mask_dense(impl, name):
    mask = MASKS[name]
    np.testing.assert_array_equal(effective_mask(impl, mask), mask.dense())


@needs_pallas
@pytest.mark.parametrize("name", ["random_rect"])
def test_pallas_effective_mask_is_mask_dense(name):
    mask = MASKS[name]
    np.testing.assert_array_equal(effective_mask("pallas", mask), mask.dense())


@pytest.mark.skipif(not HAS_GENERATORS, reason="attn_masks.generators is not written yet")
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_all_named_masks(impl):
    from attn_masks.generators import MASK_NAMES, make_mask

    for name in MASK_NAMES:
        mask = make_mask(name, 64, window=9, distribution={(8, 40): 1.0}, block_size=16)
        np.testing.assert_array_equal(effective_mask(impl, mask), mask.dense(), err_msg=name)
        check_against_oracle(impl, mask, 4, 2, seed=len(name))


def test_pallas_mha_adapter_in_interpret_mode():
    """The attention.mha plumbing (K/V repeat for GQA, segment ids, causal) on CPU."""
    mask = MASKS["causal_documents"]
    causal, cu = jax_pallas._mha_pattern(structure.classify(mask))
    assert causal and list(cu) == [0, 10, 37, 64]
    seg = jnp.asarray(jax_pallas.segment_ids_from_cu(cu))
    q, k, v, dout, _ = inputs(mask, 4, 2, d=32, batch=1)
    scale = 0.3

    def f(q, k, v):
        return jax_pallas.pallas_mha(q, k, v, seg, scale=scale, causal=True, interpret=True)

    out, vjp = jax.vjp(f, q, k, v)
    ref = oracle(q, k, v, mask, scale=scale, dout=dout)
    got = (out, None, *vjp(jnp.asarray(dout)))
    assert_matches(got, (ref.out, ref.lse, ref.dq, ref.dk, ref.dv), atol=5e-5)


# ----------------------------------------------------------------------------- supports honesty


def test_supports_on_cpu():
    mask = MASKS["causal"]
    assert jax_attn.supports("reference", mask) is True
    assert jax_attn.supports("xla", mask, return_lse=True) is True
    if not ON_GPU:
        for impl in ("cudnn", "pallas_mha", "mosaic_mha"):
            reason = jax_attn.supports(impl, mask)
            assert "CUDA GPU" in reason, reason


def test_xla_float16_on_cpu_is_unsupported():
    mask = MASKS["causal"]
    reason = jax_attn.supports("xla", mask, dtype=jnp.float16, backend="cpu")
    assert "F16_F16_F32" in reason
    if not ON_GPU:
        q, k, v, _, _ = inputs(mask, 4, 2)
        with pytest.raises(Unsupported, match="F16_F16_F32"):
            jax_attn.attention(*(x.astype(np.float16) for x in (q, k, v)), mask, impl="xla")


def test_supports_mask_patterns_for_gpu_impls():
    """Pattern reasons are answered for a GPU even from a CPU host (backend='gpu')."""
    s = 256
    full = from_slices([(0, s)], [(0, s)], [FULL], s, s)
    causal = from_slices([(0, s)], [(0, s)], [CAUSAL], s, s)
    left = band(s, 31, 0, name="sliding_window")
    two_sided = band(s, 31, 31, name="sliding_window_causal")
    docs = documents([0, 128, 256], CAUSAL)
    kw = dict(dtype=jnp.bfloat16, head_dim=128, backend="gpu")
    if not ON_GPU:
        assert jax_attn.supports("cudnn", full, **kw) is True
        assert jax_attn.supports("cudnn", left, **kw) is True
        assert jax_attn.supports("pallas_mha", docs, **kw) is True
        assert (
            jax_attn.supports(
                "mosaic_mha", causal, dtype=jnp.float16, head_dim=128, backend="gpu", mode="fwd"
            )
            is True
        )
    assert "sliding window (left=31, right=31)" in jax_attn.supports("cudnn", two_sided, **kw)
    assert "causal_document" in jax_attn.supports("cudnn", docs, **kw)
    assert "return_lse" in jax_attn.supports("cudnn", full, return_lse=True, **kw)
    assert "float16" in jax_attn.supports("cudnn", full, dtype=jnp.float32, backend="gpu")
    assert "head_dim" in jax_attn.supports(
        "cudnn", full, dtype=jnp.bfloat16, head_dim=100, backend="gpu"
    )
    assert "sliding window" in jax_attn.supports("pallas_mha", left, **kw)
    assert "multiple of 128" in jax_attn.supports("pallas_mha", documents([0, 50, 100], FULL), **kw)
    assert "float16 only" in jax_attn.supports("mosaic_mha", causal, **kw)
    assert "no backward" in jax_attn.supports(
        "mosaic_mha", causal, dtype=jnp.float16, head_dim=128, backend="gpu"
    )
    assert "top-left" in jax_attn.supports(
        "cudnn", from_slices([(0, 64)], [(0, 128)], [CAUSAL], 64, 128), **kw
    )
    arrays = jax_attn.prepare_mask(full)
    for impl in ("xla", "cudnn", "pallas_mha", "mosaic_mha"):
        assert "MaskArrays" in jax_attn.supports(impl, arrays, backend="gpu")


# ----------------------------------------------------------------------------- MaskArrays


def test_mask_arrays_inside_jit_and_stacked():
    """Runtime masks (as context parallelism passes them): traced arrays, stacked then indexed."""
    masks = [MASKS["causal_documents"], MASKS["window_causal"]]
    stacked = jax_attn.stack_mask_arrays([jax_attn.prepare_mask(m) for m in masks])
    impls = ["reference"] + ([] if PALLAS_MISSING else ["pallas"])

    @jax.jit
    def f(q, k, v, arrays, i):
        one = jax.tree.map(lambda x: x[i], arrays)
        return jax_attn.attention(q, k, v, one, impl="reference", return_lse=True)

    for i, mask in enumerate(masks):
        q, k, v, _, _ = inputs(mask, 4, 2)
        ref = oracle(q, k, v, mask)
        out, lse = f(q, k, v, stacked, i)
        assert_matches((out, lse), (ref.out, ref.lse))
        for impl in impls:
            arrays = jax_attn.mask_arrays_for(impl, mask, 16, jnp.float32)
            out = jax_attn.attention(q, k, v, arrays, impl=impl)
            assert_matches((out,), (ref.out,))
    with pytest.raises(Unsupported, match="MaskArrays"):
        jax_attn.attention(q, k, v, jax_attn.prepare_mask(masks[-1]), impl="xla")


def test_mask_arrays_for_caches_and_uses_impl_tiles():
    mask = MASKS["random"]
    a = jax_attn.mask_arrays_for("reference", mask, 64, jnp.bfloat16)
    assert a is jax_attn.mask_arrays_for("reference", mask, 64, jnp.bfloat16)
    assert isinstance(a, jax_attn.MaskArrays) and isinstance(a.lo, np.ndarray)
    twin = random_slices(64, 64, 1)
    assert jax_attn.mask_arrays_for("reference", twin, 64, jnp.bfloat16) is not a
    if not PALLAS_MISSING:
        pallas = importlib.import_module("jax_attn.pallas_triton")
        p = jax_attn.mask_arrays_for("pallas", mask, 128, jnp.bfloat16)
        assert (p.block_q, p.block_k) == tuple(pallas.block_sizes(128, jnp.bfloat16))


def test_attention_under_jit_with_static_mask():
    mask = MASKS["causal_documents"]
    q, k, v, _, _ = inputs(mask, 4, 2)
    ref = oracle(q, k, v, mask)
    for impl in CPU_IMPLS:
        out = jax.jit(lambda q, k, v, impl=impl: jax_attn.attention(q, k, v, mask, impl=impl))(
            q, k, v
        )
        assert_matches((out,), (ref.out,))


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("impl", ["reference", pytest.param("pallas", marks=needs_pallas)])
def test_attention_bwd_matches_vjp(impl):
    """attention_bwd (from residuals for pallas, jax.vjp for the others) is the VJP of attention."""
    mask = from_slices([[4, 24], [24, 48]], [[0, 30], [10, 48]], [CAUSAL, FULL], 48, 48)
    rng = np.random.default_rng(2)
    q, do = (jnp.asarray(rng.standard_normal((1, 48, 4, 16)), jnp.float32) for _ in "ab")
    k, v = (jnp.asarray(rng.standard_normal((1, 48, 2, 16)), jnp.float32) for _ in "ab")
    dl = jnp.asarray(rng.standard_normal((1, 4, 48)), jnp.float32)

    def f(q, k, v):
        return jax_attn.attention(q, k, v, mask, impl=impl, scale=0.5, return_lse=True)

    (out, lse), pullback = jax.vjp(f, q, k, v)
    assert jax_attn.has_residual_bwd(impl) == (impl == "pallas")
    for cot in ((do, dl), (do, None)):
        want = pullback((cot[0], jnp.zeros_like(lse) if cot[1] is None else cot[1]))
        got = jax_attn.attention_bwd(q, k, v, mask, out, lse, *cot, impl=impl, scale=0.5)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lse must have shape"):
        jax_attn.attention_bwd(q, k, v, mask, out, lse[:, :1], do, impl=impl)


def test_structure_reads_slices_not_names():
    s = 64
    quads = from_slices(
        [(0, 32), (0, 32), (32, 64), (32, 64)],
        [(0, 32), (32, 64), (0, 32), (32, 64)],
        [FULL] * 4,
        s,
        s,
        name="causal",
    )
    assert structure.classify(quads).kind == "full"
    causal_rows = band(s, s, 0, name="full")
    assert (
        structure.classify(causal_rows).kind == "causal"
        and structure.classify(causal_rows).is_causal
    )
    assert structure.classify(causal_rows).square_window == (s - 1, 0)
    assert structure.classify(band(s, 7, 0)).square_window == (7, 0)
    assert structure.classify(band(s, 5, 3)).square_window == (5, 3)  # not a left window
    rect = MASKS["causal_rect"]
    assert structure.classify(rect).is_causal and structure.classify(rect).square_window is None
    tall = structure.classify(MASKS["causal_tall"])
    assert tall.is_causal and tall.empty_rows == 32


def test_structure_documents():
    cu = [0, 10, 37, 64]
    for typ, causal in ((FULL, False), (CAUSAL, True)):
        found = structure.classify(documents(cu, typ)).documents
        assert found is not None and found[1] is causal
        np.testing.assert_array_equal(found[0], cu)
    mixed = from_slices([(0, 10), (10, 64)], [(0, 10), (10, 64)], [FULL, CAUSAL], 64, 64)
    assert structure.classify(mixed).kind == "general"
    blockwise = from_slices(
        [(0, 10), (10, 37), (37, 64)], [(0, 10), (10, 37), (0, 64)], [CAUSAL] * 3, 64, 64
    )
    assert structure.classify(blockwise).documents is None
    empty = structure.classify(MASKS["empty_rows"])
    assert empty.kind == "general" and empty.empty_rows == 5


@pytest.mark.skipif(not HAS_GENERATORS, reason="attn_masks.generators is not written yet")
def test_structure_of_named_masks():
    from attn_masks.generators import MASK_NAMES, make_mask

    expected = {
        "full": "full",
        "causal": "causal",
        "full_document": "full_document",
        "causal_document": "causal_document",
        "sliding_window_causal": "window",
        "sliding_window": "window",
        "full_document_long": "full_document",
        "causal_document_long": "causal_document",
    }
    for name in MASK_NAMES:
        mask = make_mask(name, 256, window=9, distribution={(8, 40): 1.0}, block_size=16)
        assert structure.classify(mask).kind == expected.get(name, "general"), name
    left = make_mask("sliding_window_causal", 256, window=9)
    assert structure.classify(left).square_window == (9, 0)
    assert structure.classify(make_mask("sliding_window", 256, window=9)).square_window == (9, 9)


# ----------------------------------------------------------------------------- errors


def test_errors_name_bad_values():
    mask = MASKS["causal"]
    q, k, v, _, _ = inputs(mask, 4, 2)
    att = jax_attn.attention
    with pytest.raises(ValueError, match="unknown impl 'flash'.*reference, pallas, mosaic, xla"):
        att(q, k, v, mask, impl="flash")
    with pytest.raises(ValueError, match="unknown impl"):
        jax_attn.supports("flash", mask)
    with pytest.raises(ValueError, match=r"q must have rank 4.*\(64, 4, 16\)"):
        att(q[0], k, v, mask, impl="reference")
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        att(q, k, v[:, :, :1], mask, impl="reference")
    with pytest.raises(ValueError, match="Hq=3 must be a multiple of .* Hkv=2"):
        att(q[:, :, :3], k, v, mask, impl="reference")
    with pytest.raises(ValueError, match="Sq=32, Sk=64 do not match the mask"):
        att(q[:, :32], k, v, mask, impl="reference")
    with pytest.raises(ValueError, match="head dims differ"):
        att(q[..., :8], k, v, mask, impl="reference")
    with pytest.raises(ValueError, match="share a dtype"):
        att(q.astype(np.float16), k, v, mask, impl="reference")
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="scale must be positive"):
            att(q, k, v, mask, impl="reference", scale=bad)
    with pytest.raises(ValueError, match="mask must be an attn_masks.Mask"):
        att(q, k, v, mask.dense(), impl="reference")
    with pytest.raises(ValueError, match="unknown mode"):
        jax_attn.supports("reference", mask, mode="train")
    with pytest.raises(ValueError, match="heads_q=3 must be a multiple of heads_kv=2"):
        jax_attn.supports("reference", mask, heads_q=3, heads_kv=2)
    assert issubclass(Unsupported, ValueError)


def test_unsupported_is_raised_before_work():
    mask = MASKS["window_two_sided"]
    q, k, v, _, _ = inputs(mask, 4, 2)
    with pytest.raises(Unsupported, match="cudnn"):
        jax_attn.attention(q, k, v, mask, impl="cudnn")


# ----------------------------------------------------------------------------- GPU


GPU_TOL = {jnp.bfloat16: 3e-2, jnp.float16: 4e-3}


def gpu_masks(s: int) -> dict[str, Mask]:
    return {
        "full": from_slices([(0, s)], [(0, s)], [FULL], s, s),
        "causal": from_slices([(0, s)], [(0, s)], [CAUSAL], s, s),
        "window_causal": band(s, 40, 0),
        "window_two_sided": band(s, 40, 17),
        "full_documents": documents([0, 77, 128, s], FULL),
        "causal_documents": documents([0, 77, 128, s], CAUSAL),
        "random": random_slices(s, s, 5),
    }


@gpu
@needs_gpu
@pytest.mark.parametrize("impl", jax_attn.IMPLS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_impls_match_oracle(impl, dtype):
    """On the GPU: what supports() accepts matches the oracle (fwd, and bwd when promised)."""
    s, d = 256, 128
    ran = 0
    for name, mask in gpu_masks(s).items():
        fwd = jax_attn.supports(
            impl, mask, dtype=dtype, head_dim=d, heads_q=4, heads_kv=2, mode="fwd"
        )
        if fwd is not True:
            q, k, v, _, _ = inputs(mask, 4, 2, d=d, batch=1)
            with pytest.raises(Unsupported):
                jax_attn.attention(
                    jnp.asarray(q, dtype),
                    jnp.asarray(k, dtype),
                    jnp.asarray(v, dtype),
                    mask,
                    impl=impl,
                )
            continue
        ran += 1
        both = jax_attn.supports(impl, mask, dtype=dtype, head_dim=d, heads_q=4, heads_kv=2)
        q, k, v, dout, dlse = inputs(mask, 4, 2, d=d, batch=1)
        scale = 1 / np.sqrt(d)
        qd, kd, vd = (jnp.asarray(x, dtype) for x in (q, k, v))
        ref = oracle(
            np.asarray(qd, np.float32),
            np.asarray(kd, np.float32),
            np.asarray(vd, np.float32),
            mask,
            scale=scale,
            dout=dout,
        )
        tol = GPU_TOL[dtype]
        if both is True:
            got = run_with_grads(impl, qd, kd, vd, mask, scale, dout, dlse, with_lse=False)
            want = (ref.out, None, ref.dq, ref.dk, ref.dv)
            assert_matches(got, want, atol=tol, rtol=tol, scaled=True)
        else:
            out = jax_attn.attention(qd, kd, vd, mask, impl=impl, scale=scale)
            assert_matches((out,), (ref.out,), atol=tol, rtol=tol, scaled=True)
        np.testing.assert_array_equal(
            effective_mask(impl, mask, d=d, dtype=dtype, heads=(4, 2)),
            mask.dense(),
            err_msg=f"{impl} {name}",
        )
    if impl in ("reference", "xla", "cudnn", "pallas_mha") or (
        impl == "mosaic_mha" and dtype == jnp.float16
    ):
        assert ran, f"{impl} ran nothing on this GPU"


@gpu
@needs_gpu
def test_gpu_mosaic_causal_backward_is_unsupported():
    mask = gpu_masks(256)["causal"]
    ok = jax_attn.supports("mosaic_mha", mask, dtype=jnp.float16, head_dim=128, mode="fwd")
    if ok is not True:
        pytest.skip("mosaic_mha is not available on this GPU")
    q, k, v, _, _ = inputs(mask, 4, 2, d=128, batch=1)
    q, k, v = (jnp.asarray(x, jnp.float16) for x in (q, k, v))
    with pytest.raises(Unsupported, match="no backward"):
        jax.grad(lambda q: jax_attn.attention(q, k, v, mask, impl="mosaic_mha").sum())(q)


@pytest.mark.parametrize("cache_dir", [None, "triton-cache"])
def test_importing_jax_triton_leaves_the_triton_environment_as_it_was(
    monkeypatch, tmp_path, cache_dir
):
    """jax-triton 0.3.x sets TRITON_CACHE_DIR to "" when imported, which breaks every later
    Triton compilation in the process (torch's flex and triton too); our import undoes that."""
    from jax_attn.adapters import triton as adapter

    package = tmp_path / "jax_triton"
    package.mkdir()
    (package / "__init__.py").write_text(
        'import os\nos.environ["TRITON_CACHE_DIR"] = ""\n__version__ = "0.3.1"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    if cache_dir is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / cache_dir))
    try:
        jt, _, why = adapter.modules()
        assert why is None and jt is sys.modules["jax_triton"]
        assert os.environ.get("TRITON_CACHE_DIR") == (
            None if cache_dir is None else str(tmp_path / cache_dir)
        )
    finally:
        sys.modules.pop("jax_triton", None)


def test_triton_names_a_jax_triton_that_cannot_drive_the_installed_triton(monkeypatch):
    """jax-triton 0.4.x on triton 3.6 imports but stubs the NVIDIA backend: supports() says so."""
    import types

    from jax_attn.adapters import triton as adapter

    assert adapter.version_mismatch("0.3.1", "3.6.0") is None
    assert adapter.version_mismatch("0.4.1", "3.7.0") is None
    assert adapter.version_mismatch("0.4.1", None) is None
    why = adapter.version_mismatch("0.4.1", "3.6.0+git1234")
    assert "0.4.1" in why and "3.6.0" in why and "jax-triton==0.3.1" in why

    real_import = adapter.importlib.import_module
    fake = types.SimpleNamespace(__version__="0.4.1")
    monkeypatch.setattr(
        adapter.importlib,
        "import_module",
        lambda name: fake if name == "jax_triton" else real_import(name),
    )
    monkeypatch.setattr(adapter, "_installed_version", lambda dist: "3.6.0")
    mask = from_slices([(0, 256)], [(0, 256)], [int(MaskType.CAUSAL)], 256, 256)
    reason = jax_attn.supports("triton", mask, backend="gpu")
    assert isinstance(reason, str) and "needs triton >= 3.7" in reason
