"""Pallas Triton flash attention (CPU interpret mode), both backward variants, vs the oracle."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_masks import MaskType, from_slices, random_slices, reference_attention
from attn_masks.generators import MASK_NAMES, make_mask
from jax_attn.mask_arrays import MaskArrays, prepare_mask, stack_mask_arrays
from jax_attn.pallas_triton import (
    KernelConfig,
    block_sizes,
    default_config,
    flash_attention,
    flash_attention_bwd,
)
from jax_attn.reference import reference_attention as jnp_reference

FULL, CAUSAL, INVCAUSAL, BICAUSAL = (int(t) for t in MaskType)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}


def _shared_arrays(masks, block_q: int, block_k: int) -> list[MaskArrays]:
    """MaskArrays padded to common widths, so masks of one geometry share one compilation."""
    stacked = stack_mask_arrays([prepare_mask(m, block_q, block_k) for m in masks])
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(len(masks))]


def _inputs(seed: int, b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype):
    """Fresh normal q, k, v, dout in `dtype` (and their exact float64 values)."""
    rng = np.random.default_rng(seed)
    shapes = [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)]
    xs = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
    return xs, [np.asarray(x.astype(jnp.float32), np.float64) for x in xs]


def _rel_err(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert np.isfinite(got).all(), "non-finite values"
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-6))


def _variants(config: KernelConfig | None, d: int, dtype) -> tuple[KernelConfig, ...]:
    """The config (default if None) with the two-kernel backward and with the fused one."""
    base = default_config(d, dtype) if config is None else config
    return tuple(dataclasses.replace(base, fused_bwd=f) for f in (False, True))


@functools.partial(jax.jit, static_argnames=("configs", "scale"))
def _outputs(q, k, v, do, arrays, *, configs, scale):
    """(out, lse, dq, dk, dv) under each config: one compilation checks every variant."""
    results = []
    for config in configs:

        def run(q, k, v, config=config):
            return flash_attention(q, k, v, arrays, scale=scale, return_lse=True, config=config)

        (out, lse), vjp = jax.vjp(run, q, k, v)
        results.append((out, lse, *vjp((do, jnp.zeros_like(lse)))))
    return results


def _check(mask, arrays, *, b, hq, hkv, d, dtype, seed=0, config=None, configs=None) -> None:
    """Forward (out, lse) and gradients (dq, dk, dv) of both backward variants (or of the
    given configs) vs the oracle."""
    (q, k, v, do), (q64, k64, v64, do64) = _inputs(
        seed, b, mask.seqlen_q, mask.seqlen_k, hq, hkv, d, dtype
    )
    scale = d**-0.5
    ref = reference_attention(q64, k64, v64, mask, scale=scale, dout=do64)
    configs = _variants(config, d, dtype) if configs is None else tuple(configs)
    results = _outputs(q, k, v, do, arrays, configs=configs, scale=scale)
    tol = TOL[dtype]
    seen = np.isfinite(ref.lse)
    for config, (out, lse, dq, dk, dv) in zip(configs, results):
        variant = "fused" if config.fused_bwd else f"two-kernel dkv_split={config.dkv_split}"
        assert out.dtype == q.dtype and out.shape == q.shape
        assert lse.dtype == jnp.float32 and lse.shape == (b, hq, mask.seqlen_q)
        lse = np.asarray(lse)
        assert (np.isneginf(lse) == np.isneginf(ref.lse)).all(), f"{variant}: empty rows differ"
        assert np.abs(lse[seen] - ref.lse[seen]).max(initial=0.0) < 10 * tol
        for name, got, want in (
            ("out", out, ref.out),
            ("dq", dq, ref.dq),
            ("dk", dk, ref.dk),
            ("dv", dv, ref.dv),
        ):
            err = _rel_err(got, want)
            assert err < tol, f"{variant} {name}: relative error {err:.2e} >= {tol:.0e}"


def _doc_mask(seqlens, typ: int, sk_extra: int = 0):
    cu = np.concatenate([[0], np.cumsum(seqlens)])
    qr = np.stack([cu[:-1], cu[1:]], 1)
    return from_slices(qr, qr, [typ] * len(seqlens), int(cu[-1]), int(cu[-1]) + sk_extra)


def _sliding(s: int, w: int):
    """Two-sided window |i - j| <= w as bicausal bands in a grid of w-sized chunks."""
    qs, ks, ts = [], [], []
    for a in range(0, s, w):
        b = min(a + w, s)
        qs.append((a, b))
        ks.append((max(a - w, 0), min(b + w, s)))
        ts.append(BICAUSAL if a - w >= 0 and b + w <= s else FULL)
    return from_slices(qs, ks, ts, s, s)


CASES = {
    "full_mha_b2": dict(
        masks=[from_slices([[0, 128]], [[0, 128]], [FULL], 128, 128)],
        b=2,
        hq=2,
        hkv=2,
        d=64,
        dtype=jnp.float32,
        tiles=(32, 32),
    ),
    "causal_ragged_gqa42_b2": dict(
        masks=[from_slices([[0, 100]], [[0, 100]], [CAUSAL], 100, 100)],
        b=2,
        hq=4,
        hkv=2,
        d=32,
        dtype=jnp.float32,
        tiles=(32, 32),
    ),
    "documents_gqa41_bf16": dict(
        masks=[_doc_mask([40, 7, 60, 23], CAUSAL), _doc_mask([40, 7, 60, 23], FULL)],
        b=1,
        hq=4,
        hkv=1,
        d=64,
        dtype=jnp.bfloat16,
        tiles=(32, 32),
    ),
    "documents_fp32_ragged": dict(
        masks=[_doc_mask([33, 64, 33], CAUSAL), _doc_mask([33, 64, 33], FULL)],
        b=1,
        hq=2,
        hkv=1,
        d=32,
        dtype=jnp.float32,
        tiles=(32, 32),
    ),
    "sliding_window_two_sided": dict(
        masks=[_sliding(160, 24)],
        b=1,
        hq=2,
        hkv=2,
        d=32,
        dtype=jnp.float32,
        tiles=(32, 32),
    ),
    "empty_rows_sq_ne_sk": dict(
        masks=[from_slices([[0, 30], [50, 96]], [[0, 50], [60, 128]], [FULL, CAUSAL], 96, 128)],
        b=1,
        hq=4,
        hkv=2,
        d=32,
        dtype=jnp.float32,
        tiles=(32, 32),
    ),
    "random_slices": dict(
        masks=[random_slices(s, 130, 100) for s in range(3)],
        b=1,
        hq=4,
        hkv=2,
        d=32,
        dtype=jnp.float32,
        tiles=(32, 16),
    ),
    "head_dim_96_fp16": dict(
        masks=[_doc_mask([20, 44], CAUSAL), random_slices(7, 64, 64)],
        b=1,
        hq=2,
        hkv=1,
        d=96,
        dtype=jnp.float16,
        tiles=(32, 32),
    ),
    "head_dim_80_bf16": dict(
        masks=[from_slices([[0, 64]], [[0, 64]], [CAUSAL], 64, 64)],
        b=1,
        hq=2,
        hkv=2,
        d=80,
        dtype=jnp.bfloat16,
        tiles=(32, 32),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_against_oracle(case: str) -> None:
    c = CASES[case]
    arrays = _shared_arrays(c["masks"], *c["tiles"])
    for i, (mask, arr) in enumerate(zip(c["masks"], arrays)):
        _check(mask, arr, b=c["b"], hq=c["hq"], hkv=c["hkv"], d=c["d"], dtype=c["dtype"], seed=i)


def test_all_benchmark_masks() -> None:
    params = dict(window=40, block_size=32, seqlens=[50, 70, 20, 116])
    masks = [make_mask(name, 256, **params) for name in MASK_NAMES]
    for i, (mask, arr) in enumerate(zip(masks, _shared_arrays(masks, 32, 32))):
        _check(mask, arr, b=1, hq=2, hkv=1, d=32, dtype=jnp.float32, seed=i)


def test_kernel_subtiles() -> None:
    """Kernel tiles smaller than the mask tiles walk each listed tile as several sub-tiles.

    The fused variant here adds dQ with relaxed atomics (the other tests: Pallas' atomic_add).
    """
    config = KernelConfig(
        block_q=32,
        block_k=16,
        block_q_dq=16,
        block_k_dq=32,
        block_q_dkv=16,
        block_k_dkv=32,
        num_warps=4,
        num_stages=2,
        relaxed_atomics=True,
    )
    masks = [_doc_mask([30, 50, 40], CAUSAL), random_slices(11, 120, 120)]
    for i, (mask, arr) in enumerate(zip(masks, _shared_arrays(masks, 64, 64))):
        _check(mask, arr, b=1, hq=4, hkv=2, d=32, dtype=jnp.float32, seed=i, config=config)


def _shared_prefix(prefix: int, answers) -> object:
    """share_question-like: a causal shared prefix seen in full by every causal answer."""
    cu = prefix + np.concatenate([[0], np.cumsum(answers)])
    qs, ks, ts = [(0, prefix)], [(0, prefix)], [CAUSAL]
    for a, b in zip(cu[:-1], cu[1:]):
        qs += [(a, b), (a, b)]
        ks += [(0, prefix), (a, b)]
        ts += [FULL, CAUSAL]
    return from_slices(qs, ks, ts, int(cu[-1]), int(cu[-1]))


@pytest.mark.parametrize("b, hq, hkv", [(1, 2, 2), (2, 4, 1)])
def test_dkv_split(b: int, hq: int, hkv: int) -> None:
    """KernelConfig.dkv_split: each key tile's steps shared by several programs (partial dK/dV
    summed in XLA), on masks where a few key tiles are seen by most query tiles; ragged lengths,
    a split that does not divide the step counts, and chunks past the end of short walks."""
    masks = [
        _shared_prefix(20, [30, 9, 41]),
        from_slices([[0, 100]], [[0, 100]], [CAUSAL], 100, 100),
        random_slices(5, 100, 100),
    ]
    base = KernelConfig(block_q_dkv=16, num_warps=4, num_stages=2)
    configs = [dataclasses.replace(base, dkv_split=s) for s in (1, 3, 8)]
    for i, (mask, arr) in enumerate(zip(masks, _shared_arrays(masks, 32, 16))):
        _check(mask, arr, b=b, hq=hq, hkv=hkv, d=16, dtype=jnp.float32, seed=i, configs=configs)


@pytest.mark.parametrize(
    "fused, relaxed, dkv_split",
    [(False, False, 1), (True, False, 1), (True, True, 1), (False, False, 4)],
)
def test_lowers_to_triton(fused: bool, relaxed: bool, dkv_split: int) -> None:
    """Forward and backward lower to Triton kernels for the GPU (no GPU needed to lower)."""
    arr = prepare_mask(from_slices([[0, 96]], [[0, 96]], [CAUSAL], 96, 96), 32, 32)
    q = jax.ShapeDtypeStruct((1, 96, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 96, 2, 64), jnp.bfloat16)
    config = KernelConfig(fused_bwd=fused, relaxed_atomics=relaxed, dkv_split=dkv_split)

    def grads(q, k, v, do, arr):
        def run(q, k, v):
            return flash_attention(
                q, k, v, arr, scale=0.125, return_lse=True, config=config, interpret=False
            )

        (_, lse), vjp = jax.vjp(run, q, k, v)
        return vjp((do, jnp.zeros_like(lse)))

    lowered = jax.jit(grads).trace(q, kv, kv, q, arr).lower(lowering_platforms=("cuda",))
    kernels = ["masked_flash_fused_bwd"] if fused else ["masked_flash_dq", "masked_flash_dkv"]
    text = lowered.as_text()
    assert all(name in text for name in ["masked_flash_forward", *kernels])


def test_new_mask_does_not_retrace() -> None:
    """Masks are runtime inputs: a new layout of the same shapes reuses the compiled kernels."""
    masks = [_doc_mask(lens, CAUSAL) for lens in ([64, 64], [20, 80, 28], [128])]
    arrays = _shared_arrays(masks, 32, 32)
    (q, k, v, do), _ = _inputs(0, 1, 128, 128, 2, 1, 32, jnp.float32)
    traces = []

    @jax.jit
    def loss_and_grads(q, k, v, arr):
        traces.append(1)

        def loss(q, k, v):
            return jnp.sum(flash_attention(q, k, v, arr, scale=0.2) * do)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    for mask, arr in zip(masks, arrays):
        value, (dq, _, _) = loss_and_grads(q, k, v, arr)
        ref = reference_attention(
            *(np.asarray(x, np.float64) for x in (q, k, v)),
            mask,
            scale=0.2,
            dout=np.asarray(do, np.float64),
        )
        assert _rel_err(dq, ref.dq) < TOL[jnp.float32]
    assert len(traces) == 1


def test_eager_calls_reuse_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Un-jitted calls hit flash_attention's own jit cache: one kernel trace for two masks."""
    from jax_attn.pallas_triton import api

    calls = []

    def counting_forward(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    forward = api.forward
    monkeypatch.setattr(api, "forward", counting_forward)
    masks = [_doc_mask([17, 47], CAUSAL), _doc_mask([50, 14], FULL)]
    (q, k, v, _), (q64, k64, v64, _) = _inputs(5, 1, 64, 64, 2, 2, 16, jnp.float32)
    for mask, arr in zip(masks, _shared_arrays(masks, 16, 16)):
        out = flash_attention(q, k, v, arr, scale=0.25)
        ref = reference_attention(q64, k64, v64, mask, scale=0.25)
        assert _rel_err(out, ref.out) < TOL[jnp.float32]
    assert len(calls) <= 1


def test_lse_cotangent() -> None:
    """Gradients flow through the returned LSE too (context parallelism merges with it)."""
    mask = from_slices([[0, 40], [64, 96]], [[0, 64], [0, 96]], [FULL, CAUSAL], 96, 96)
    arr = prepare_mask(mask, 32, 32)
    (q, k, v, do), _ = _inputs(3, 1, 96, 96, 2, 1, 32, jnp.float32)
    w = jnp.asarray(np.random.default_rng(4).standard_normal((1, 2, 96)), jnp.float32)

    def grads(fn):
        def run(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w, 0.0))

        return jax.grad(run, argnums=(0, 1, 2))(q, k, v)

    def kernel(config):
        return lambda q, k, v: flash_attention(
            q, k, v, arr, scale=0.3, return_lse=True, config=config
        )

    with jax.default_matmul_precision("highest"):  # GPU default would be TF32
        want = jax.jit(lambda: grads(lambda q, k, v: jnp_reference(q, k, v, arr, scale=0.3)))()
    for got in jax.jit(lambda: [grads(kernel(c)) for c in _variants(None, 32, jnp.float32)])():
        for g, r in zip(got, want):
            assert _rel_err(g, np.asarray(r, np.float64)) < 1e-4


def test_backward_from_residuals() -> None:
    """flash_attention_bwd is jax.vjp of flash_attention (LSE cotangent included); given the merged
    out/lse of two key blocks and their cotangents, it gives each block's share of the merged
    gradients (the ring's backward), for both backward variants."""
    # rows 0-7 see nothing; Sq = Sk = 80 is ragged on the 32 tiles; GQA 4:2
    mask = from_slices([[8, 40], [40, 80]], [[0, 48], [16, 80]], [CAUSAL, FULL], 80, 80)
    rows, split = np.arange(80), 48
    blocks = [mask.restrict(rows, np.arange(split)), mask.restrict(rows, np.arange(split, 80))]
    arr, *block_arrs = (prepare_mask(m, 32, 32) for m in (mask, *blocks))
    (q, k, v, do), _ = _inputs(6, 1, 80, 80, 4, 2, 32, jnp.float32)
    dl = jnp.asarray(np.random.default_rng(7).standard_normal((1, 4, 80)), jnp.float32)

    @jax.jit
    def run():
        results = []
        for c in _variants(None, 32, jnp.float32):

            def fa(q, k, v, c=c):
                return flash_attention(q, k, v, arr, scale=0.3, return_lse=True, config=c)

            (out, lse), vjp = jax.vjp(fa, q, k, v)
            got = flash_attention_bwd(q, k, v, arr, out, lse, do, dl, scale=0.3, config=c)
            parts = [
                flash_attention_bwd(q, k[:, s], v[:, s], a, out, lse, do, dl, scale=0.3, config=c)
                for s, a in zip((slice(0, split), slice(split, None)), block_arrs)
            ]
            merged = (
                parts[0][0] + parts[1][0],
                jnp.concatenate([parts[0][1], parts[1][1]], axis=1),
                jnp.concatenate([parts[0][2], parts[1][2]], axis=1),
            )
            results.append((vjp((do, dl)), got, merged))
        return results

    for want, got, merged in run():
        for w, g, m in zip(want, got, merged):
            w = np.asarray(w, np.float64)
            assert _rel_err(g, w) < 1e-6
            assert _rel_err(m, w) < 1e-5
    _, lse = flash_attention(q, k, v, arr, scale=0.3, return_lse=True)
    with pytest.raises(ValueError, match="shape"):
        flash_attention_bwd(q, k, v, arr, q, lse[:, :2], do, scale=0.3)


def test_rejects_bad_inputs() -> None:
    mask = from_slices([[0, 64]], [[0, 64]], [CAUSAL], 64, 64)
    arr = prepare_mask(mask, 32, 32)
    (q, k, v, _), _ = _inputs(0, 1, 64, 64, 3, 2, 32, jnp.float32)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(q, k, v, arr, scale=1.0)
    (q, k, v, _), _ = _inputs(0, 1, 64, 64, 2, 2, 32, jnp.float32)
    with pytest.raises(ValueError, match="do not match"):
        flash_attention(q[:, :32], k, v, arr, scale=1.0)
    with pytest.raises(ValueError, match="dividing"):
        flash_attention(q, k, v, arr, scale=1.0, config=KernelConfig(block_k=24))
    with pytest.raises(ValueError, match="dkv_split"):
        flash_attention(q, k, v, arr, scale=1.0, config=KernelConfig(dkv_split=0))
    with pytest.raises(ValueError, match="stacked"):
        flash_attention(q, k, v, stack_mask_arrays([arr, arr]), scale=1.0)


def test_block_sizes() -> None:
    for d in (32, 64, 80, 128, 256):
        for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
            bq, bk = block_sizes(d, dtype)
            assert bq >= 16 and bk >= 16 and not bq & (bq - 1) and not bk & (bk - 1)
