"""Mosaic GPU (Hopper) flash-attention forward: the real kernel in the CPU interpreter vs the
float64 oracle, plus a GPU-marked run of the real lowering."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_masks import MaskType, from_slices, make_mask, random_slices, reference_attention
from jax_attn import kernel_inputs
from jax_attn.adapters.common import make_request
from jax_attn.adapters.mosaic import MOSAIC
from jax_attn.mask_arrays import MaskArrays, prepare_mask, stack_mask_arrays
from jax_attn.mosaic_gpu import KernelConfig, flash_attention_mosaic
from jax_attn.mosaic_gpu import api as mosaic_api
from jax_attn.mosaic_gpu import forward as mosaic_forward
from jax_attn.mosaic_gpu.mask_operands import mask_operands

FULL, CAUSAL = int(MaskType.FULL), int(MaskType.CAUSAL)
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
SMALL = KernelConfig(block_q=64, block_k=64, max_concurrent_steps=2)

interpreted = pytest.mark.skipif(
    mosaic_api.cpu_device_count() < mosaic_api.INTERPRET_MIN_CPU_DEVICES,
    reason="the Mosaic GPU interpreter needs >= 4 CPU devices (tests/conftest.py sets 8)",
)


def _shared_arrays(masks, tiles: tuple[int, int]) -> list[MaskArrays]:
    """MaskArrays padded to common widths, so masks of one geometry share one compilation."""
    stacked = stack_mask_arrays([prepare_mask(m, *tiles) for m in masks])
    return [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(len(masks))]


def _inputs(seed: int, b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype):
    rng = np.random.default_rng(seed)
    shapes = [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d)]
    xs = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
    return xs, [np.asarray(x.astype(jnp.float32), np.float64) for x in xs]


def _check(
    mask, arrays, *, b, hq, hkv, d, dtype, config, seed=0, interpret=True, scale=None
) -> None:
    """out and lse of the kernel vs the oracle, on every row (empty rows: 0 and -inf), at
    `scale` (default d**-0.5).

    The interpreter fills output buffers with NaN, so a row the kernel never wrote fails the
    finiteness check.
    """
    (q, k, v), (q64, k64, v64) = _inputs(seed, b, mask.seqlen_q, mask.seqlen_k, hq, hkv, d, dtype)
    scale = d**-0.5 if scale is None else scale
    ref = reference_attention(q64, k64, v64, mask, scale=scale)
    out, lse = flash_attention_mosaic(
        q, k, v, arrays, scale=scale, return_lse=True, config=config, interpret=interpret
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (b, hq, mask.seqlen_q)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    lse = np.asarray(lse, np.float64)
    assert np.isfinite(out).all(), "unwritten (NaN) or non-finite output"
    assert not np.isnan(lse).any(), "unwritten (NaN) LSE"
    assert (np.isneginf(lse) == np.isneginf(ref.lse)).all(), "rows seeing no key differ"
    seen = np.isfinite(ref.lse)
    assert np.abs(lse[seen] - ref.lse[seen]).max(initial=0.0) < 1e-3
    empty = ~seen.transpose(0, 2, 1)  # (b, sq, hq)
    assert (out[empty] == 0).all(), "rows seeing no key must output 0"
    tol = TOL[dtype]
    err = np.abs(out - ref.out).max() / (np.abs(ref.out).max() + 1e-6)
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


S = 192
MASKS = {
    "full": make_mask("full", S),
    "causal": make_mask("causal", S),
    "causal_document": make_mask("causal_document", S, seed=3),
    "sliding_window": make_mask("sliding_window", S, window=40),
    "share_question": make_mask("share_question", S, seed=1),
    "block_sparse": random_slices(5, S, S),
}
SHARED = dict(zip(MASKS, _shared_arrays(list(MASKS.values()), SMALL.tiles)))


GQA_KW = dict(b=1, hq=2, hkv=1, d=64, dtype=jnp.bfloat16, config=SMALL)


@pytest.fixture(scope="module")
def full_mask_ran() -> None:
    """The full mask's call, checked, once in this process: its program is compiled."""
    _check(MASKS["full"], SHARED["full"], **GQA_KW)


@interpreted
@pytest.mark.parametrize("name", list(MASKS))
def test_masks_gqa_interpret(name: str, full_mask_ran: None) -> None:
    """Every mask kind, GQA 2:1, through one compiled program (masks are runtime inputs): after
    the full mask's call (full_mask_ran), this mask's call compiles nothing new (whatever this
    process ran before)."""
    programs = mosaic_api._attention_jit._cache_size()
    _check(MASKS[name], SHARED[name], **GQA_KW)
    assert mosaic_api._attention_jit._cache_size() == programs


@interpreted
@pytest.mark.parametrize(
    "scale, raw_score_max", [(-0.125, True), (0.0, True), (8.0, False), (8.0, True)]
)
def test_scales_of_every_sign(scale: float, raw_score_max: bool) -> None:
    """Negative, zero and a sharp positive scale, on masked and unmasked tiles, with the row
    max of scaled scores and of raw ones (raw_score_max: the max scaled once per row, for a
    scale > 0; a scale <= 0 keeps the scaled order, so there raw_score_max=False is the same
    kernel as the default True, which is the one run: a raw max taken by mistake shows). At
    scale 8 an unscaled max would leave exponents past float32's range."""
    kv = SHARED["causal"].kv
    full, count = np.asarray(kv.full).astype(bool), np.asarray(kv.count)
    kinds = full[np.arange(full.shape[-1]) < count[..., None]]
    assert kinds.any() and not kinds.all(), "causal lists full and partial tiles"
    config = dataclasses.replace(SMALL, raw_score_max=raw_score_max)
    kw = dict(b=1, hq=2, hkv=1, d=64, dtype=jnp.bfloat16, config=config, scale=scale)
    _check(MASKS["causal"], SHARED["causal"], **kw)
    _check(MASKS["causal_document"], SHARED["causal_document"], **kw)  # rows empty in a tile


@interpreted
def test_ragged_sq_ne_sk_empty_rows_mha_fp16() -> None:
    """Sq=100 and Sk=136 (neither divides a tile), rows that see nothing, MHA, float16."""
    mask = from_slices([[0, 30], [50, 100]], [[0, 50], [60, 136]], [FULL, CAUSAL], 100, 136)
    arrays = prepare_mask(mask, *SMALL.tiles)
    _check(mask, arrays, b=2, hq=1, hkv=1, d=64, dtype=jnp.float16, config=SMALL, seed=1)


@interpreted
@pytest.mark.parametrize("name", ["causal_document", "ragged_empty_rows"])
def test_overlapped_forward(name: str) -> None:
    """fwd_overlap (Q K^T of step n + 1 issued before the softmax of step n): the same outputs,
    also where a q tile lists no key tile at all (rows seeing nothing); launched with the q tile
    axis fastest (tiles_fastest: the kernel finds its tile, head and batch by axis name); on
    causal_document also with each masked step's key-tile start loaded early
    (early_scalar_loads)."""
    early = name == "causal_document"
    config = dataclasses.replace(
        SMALL, fwd_overlap=True, tiles_fastest=True, early_scalar_loads=early
    )
    if name == "ragged_empty_rows":  # rows 100-300: two whole q tiles that see nothing
        mask = from_slices([[0, 30], [50, 100]], [[0, 50], [60, 136]], [FULL, CAUSAL], 300, 136)
        arrays = prepare_mask(mask, *SMALL.tiles)
        assert (np.asarray(arrays.kv.count) == 0).sum() == 2, "q tiles without keys"
    else:
        mask, arrays = MASKS[name], SHARED[name]
    _check(mask, arrays, b=1, hq=2, hkv=1, d=64, dtype=jnp.bfloat16, config=config)


@interpreted
@pytest.mark.slow
def test_head_dim_128_default_config() -> None:
    """head_dim 128 with the default config (128-key steps), causal documents, GQA 2:1."""
    config = mosaic_api.resolve_config(jnp.zeros((1, 1, 1, 128), jnp.bfloat16), None)
    mask = make_mask("causal_document", 256, seed=2)
    arrays = prepare_mask(mask, *config.tiles)
    _check(mask, arrays, b=1, hq=2, hkv=1, d=128, dtype=jnp.bfloat16, config=config)


@interpreted
@pytest.mark.parametrize("name", ["causal_document", "gapped"])
def test_gradients_through_custom_vjp_gqa(name: str) -> None:
    """jax.grad through flash_attention_mosaic (forward kernel, then the backward kernels)
    matches the float64 oracle's dq, dk, dv; keys that no query sees get exactly zero."""
    if name == "gapped":  # keys 64..127 are seen by no query
        mask = from_slices([[0, 96], [96, 192]], [[0, 64], [128, 192]], [FULL, CAUSAL], 192, 192)
    else:
        mask = make_mask(name, 192, seed=3)
    arrays = prepare_mask(mask, *SMALL.tiles)
    (q, k, v), (q64, k64, v64) = _inputs(7, 1, 192, 192, 4, 2, 64, jnp.bfloat16)
    dout = np.random.default_rng(8).standard_normal(q.shape)
    scale = 64**-0.5
    ref = reference_attention(q64, k64, v64, mask, scale=scale, dout=dout)

    def loss(q, k, v):
        out = flash_attention_mosaic(q, k, v, arrays, scale=scale, config=SMALL, interpret=True)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (ref.dq, ref.dk, ref.dv)):
        got = np.asarray(got.astype(jnp.float32), np.float64)
        assert got.shape == want.shape and np.isfinite(got).all(), name
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < TOL[jnp.bfloat16], f"{name}: relative error {err:.2e}"
    unseen = ~mask.dense().any(axis=0)
    for g in grads[1:]:
        assert (np.asarray(g, np.float32)[:, unseen] == 0).all()


@interpreted
def test_operands_of_a_closed_over_mask_leave_the_program() -> None:
    """A mask closed over by the jitted function (concrete MaskArrays) has its operands (walks,
    the persistent deal) built once, outside the program: no sort left in it; passed as an
    argument (traced) they are built inside it. Both give the oracle's out, dq, dk and dv."""
    config = dataclasses.replace(
        SMALL, persistent_fwd=True, late_q_prefetch=True, early_scalar_loads=True
    )
    mask = make_mask("causal_document", 192, seed=5)  # 3 q tiles x 4 heads: 12 items, 5 CTAs
    arrays = prepare_mask(mask, *config.tiles)
    (q, k, v), (q64, k64, v64) = _inputs(9, 1, 192, 192, 4, 2, 64, jnp.bfloat16)
    dout = np.random.default_rng(10).standard_normal(q.shape)
    scale = 64**-0.5
    ref = reference_attention(q64, k64, v64, mask, scale=scale, dout=dout)

    def out_and_grads(q, k, v, arrays):
        def loss(q, k, v):
            out = flash_attention_mosaic(q, k, v, arrays, scale=scale, config=config)
            return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), out

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    closed = jax.jit(lambda q, k, v: out_and_grads(q, k, v, arrays)).lower(q, k, v)
    passed = jax.jit(out_and_grads).lower(q, k, v, arrays)
    assert "stablehlo.sort" not in closed.as_text()
    assert "stablehlo.sort" in passed.as_text()
    for grads, out in (closed.compile()(q, k, v), passed.compile()(q, k, v, arrays)):
        got = np.asarray(out.astype(jnp.float32), np.float64)
        assert np.isfinite(got).all(), "unwritten (NaN) output"
        err = np.abs(got - ref.out).max() / np.abs(ref.out).max()
        assert err < TOL[jnp.bfloat16], f"out: relative error {err:.2e}"
        for name, g, want in zip(("dq", "dk", "dv"), grads, (ref.dq, ref.dk, ref.dv)):
            g = np.asarray(g.astype(jnp.float32), np.float64)
            assert np.isfinite(g).all(), name
            err = np.linalg.norm(g - want) / np.linalg.norm(want)
            assert err < TOL[jnp.bfloat16], f"{name}: relative error {err:.2e}"


def test_operands_of_large_closed_over_masks_stay_in_the_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mask arrays above kernel_inputs.CONSTANT_BYTES, closed over or not, have their operands
    built in the caller's program (its constants would be as large again): the deal's sort
    stays in the lowered program, and the value is the same as built once."""
    config = dataclasses.replace(SMALL, persistent_fwd=True)
    arrays = prepare_mask(make_mask("causal_document", 320, seed=5), *config.tiles)
    q = jnp.zeros((1, 320, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 320, 2, 64), jnp.bfloat16)
    size = sum(x.nbytes for x in jax.tree.leaves(arrays))

    def build():  # a new function each time: no trace cached from another limit
        return jax.jit(lambda q, k: mask_operands(q, k, arrays, config=config))

    once = mask_operands(q, k, arrays, config=config)
    monkeypatch.setattr(kernel_inputs, "CONSTANT_BYTES", size)
    assert "stablehlo.sort" not in build().lower(q, k).as_text()
    monkeypatch.setattr(kernel_inputs, "CONSTANT_BYTES", size - 1)
    assert "stablehlo.sort" in build().lower(q, k).as_text()
    built = build()(q, k)
    for got, want in zip(jax.tree.leaves(built), jax.tree.leaves(once)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_config_validation_names_value_and_range() -> None:
    with pytest.raises(ValueError, match="block_q=32.*must be 64"):
        KernelConfig(block_q=32)
    with pytest.raises(ValueError, match="block_k=96.*64, 128, 192 and 256"):
        KernelConfig(block_k=96)
    with pytest.raises(ValueError, match=r"max_concurrent_steps=5.*\[2, 4\]"):
        KernelConfig(max_concurrent_steps=5)
    with pytest.raises(ValueError, match="head_dim=96.*64 and 128"):
        KernelConfig().check(96, jnp.bfloat16)
    with pytest.raises(ValueError, match="float32.*bfloat16 and float16"):
        KernelConfig().check(64, jnp.float32)
    with pytest.raises(ValueError, match="shared memory"):
        KernelConfig(block_k=256, max_concurrent_steps=4).check(128, jnp.bfloat16)
    with pytest.raises(ValueError, match="block_k_dq=96.*multiple of 64"):
        KernelConfig(block_k_dq=96)
    with pytest.raises(ValueError, match=r"num_stages_bwd=0.*\[1, 4\]"):
        KernelConfig(num_stages_bwd=0)
    three = KernelConfig(block_k=256, max_concurrent_steps=3)
    three.check(64, jnp.bfloat16)  # fits with one Q buffer, not with the persistent two
    with pytest.raises(ValueError, match="persistent_fwd needs .* shared memory"):
        dataclasses.replace(three, persistent_fwd=True).check(64, jnp.bfloat16)
    # 192-key steps at D=128 with one Q buffer: Mosaic GPU asks 233,576 bytes (measured on
    # the H200) of the 232,448 a CTA may have, and check() says so before Mosaic does
    with pytest.raises(ValueError, match="block_k=192 .* needs 233576 bytes .* at most 232448"):
        KernelConfig(block_k=192, max_concurrent_steps=2).check(128, jnp.bfloat16)


def test_forward_smem_count_is_mosaic_gpus() -> None:
    """KernelConfig.smem_bytes is the shared memory the forward kernel asks Mosaic GPU for
    (read from Mosaic's refusal under a bound of 0 bytes) at every head dim, key step, ring
    depth and Q buffer count, each config with one, two or five key intervals per row (16
    configs each, both Q buffer counts among them), so check() refuses what Mosaic would
    refuse and nothing else."""
    core = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    if not hasattr(core, "artificial_shared_memory_limit"):
        pytest.skip("this jax's Mosaic GPU has no shared-memory bound to lower")
    keys = [(0, 64), (128, 192), (256, 320), (384, 448), (512, 1024)]  # every row: 5 intervals
    masks = [
        make_mask("causal_document", 1024, seed=1),
        make_mask("share_question", 1024, seed=1),
        from_slices([(0, 1024)] * 5, keys, [MaskType.FULL] * 5, 1024),
    ]
    cases = itertools.product((64, 128), (64, 128, 192, 256), (2, 3, 4), (False, True))
    for i, (d, block_k, stages, persistent) in enumerate(cases):
        config = KernelConfig(
            block_k=block_k, max_concurrent_steps=stages, persistent_fwd=persistent
        )
        arrays = prepare_mask(masks[(i // 2) % len(masks)], *config.tiles)
        q = jnp.zeros((1, 1024, 2, d), jnp.bfloat16)
        static = mosaic_api._Static(scale=0.1, config=config, interpret=False)
        # The operands' shapes and dtypes (the program's input types) without computing them:
        # the lowering traces them as inputs, so only their types matter.
        operands = jax.eval_shape(functools.partial(mask_operands, config=config), q, q, arrays)
        forward = jax.jit(mosaic_api._attention_jit, static_argnums=4)
        with core.artificial_shared_memory_limit(0):
            with pytest.raises(ValueError, match="exceeds available shared memory") as refused:
                forward.trace(q, q, q, (arrays, operands), static).lower(
                    lowering_platforms=("cuda",)
                )
        asked = re.search(r"smem_bytes=(\d+)", str(refused.value))
        assert asked, str(refused.value)
        intervals = int(arrays.lo.shape[-1])
        case = (d, block_k, stages, persistent, intervals)
        assert config.smem_bytes(d, 2, intervals) == int(asked.group(1)), case


def test_register_split_fits_the_ctas_launch_registers() -> None:
    """setmaxnreg.inc waits until the CTA's own warps freed enough registers: the consumers'
    raise plus the producer's share must fit what 384 threads got at launch (65536 registers
    over 384 threads in units of 8), or the kernel hangs; setmaxnreg's range is [24, 256]."""
    launch = 65536 // (3 * 128) // 8 * 8
    for regs in range(168, 241, 8):
        config = KernelConfig(consumer_registers=regs)
        assert 24 <= config.producer_registers <= 40
        assert config.producer_registers % 8 == 0
        assert 2 * regs + config.producer_registers <= 3 * launch
    assert KernelConfig().producer_registers == 40  # the measured default split, 232 / 40
    for bad in (236, 248, 160):
        with pytest.raises(ValueError, match=rf"consumer_registers={bad}.*\[168, 240\]"):
            KernelConfig(consumer_registers=bad)


def test_wrong_mask_tiles_rejected() -> None:
    mask = make_mask("causal", 128)
    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"tiles \(64, 64\) do not match"):
        flash_attention_mosaic(q, q, q, prepare_mask(mask, 64, 64), scale=0.125, config=SMALL)


def test_adapter_refuses_cpu_and_bad_inputs() -> None:
    mask = make_mask("causal", 128)

    def reason(**kw):
        args = dict(dtype=jnp.bfloat16, head_dim=64, heads_q=2, heads_kv=1, backend="gpu")
        args.update(kw)
        return MOSAIC.check(make_request(mask, return_lse=True, mode="fwd", **args))

    assert "Hopper" in reason(backend="cpu")
    assert "bfloat16 or float16" in reason(dtype=jnp.float32)
    assert "head_dim 64 or 128" in reason(head_dim=96)
    if jax.default_backend() != "gpu":
        assert reason() is None  # a question about a GPU elsewhere is answered from the specs


@pytest.mark.parametrize(
    "d, in_place_pv, overlap, persistent, deal, raw, late, early",
    [
        (64, False, False, False, False, False, False, False),
        (128, False, False, False, False, False, False, False),
        (128, True, False, False, False, False, False, False),
        (64, True, True, False, False, False, False, False),
        (128, True, True, False, False, False, False, False),
        (128, True, False, True, False, False, False, False),
        (64, True, True, True, False, False, False, False),
        (128, True, False, True, True, False, False, False),
        (64, True, False, True, False, True, False, False),
        (128, True, True, False, False, True, False, False),
        (128, True, False, True, False, True, True, True),
        (64, True, True, True, False, True, True, True),
        (128, True, True, False, False, True, False, True),
    ],
)  # fmt: skip
def test_forward_and_backward_lower_for_hopper(
    d: int,
    in_place_pv: bool,
    overlap: bool,
    persistent: bool,
    deal: bool,
    raw: bool,
    late: bool,
    early: bool,
) -> None:
    """The GPU path (layout hints, no interpreter) of forward and gradient lowers to Mosaic GPU
    for CUDA on any machine: Mosaic's layout, wgmma-shape and shared-memory checks run here.
    in_place_pv (P V into O's registers) exists only on this path."""
    config = mosaic_api.resolve_config(jnp.zeros((1, 1, 1, d), jnp.bfloat16), None)
    config = dataclasses.replace(
        config,
        in_place_pv=in_place_pv,
        fwd_overlap=overlap,
        persistent_fwd=persistent,
        deal_by_walk_start=deal,
        raw_score_max=raw,
        late_q_prefetch=late,
        early_scalar_loads=early,
    )
    mask = make_mask("causal_document", 1024, seed=1)
    arrays = prepare_mask(mask, *config.tiles)
    q = jnp.zeros((1, 1024, 4, d), jnp.bfloat16)
    k = jnp.zeros((1, 1024, 2, d), jnp.bfloat16)
    static = mosaic_api._Static(scale=0.1, config=config, interpret=False)
    # the operands as inputs of their types, not computed: the kernels lower the same
    operands = jax.eval_shape(functools.partial(mask_operands, config=config), q, k, arrays)

    def loss(q, k, v, operands):
        out = mosaic_api._attention_jit(q, k, v, (arrays, operands), static)[0]
        return out.astype(jnp.float32).sum()

    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, operands)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    for kernel in ("mosaic_flash_fwd", "mosaic_flash_dkv", "mosaic_flash_dq"):
        assert kernel in text, kernel


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "causal_document", "share_question"])
def test_real_lowering_s2048(name: str) -> None:
    """The compiled kernel on a Hopper GPU, default config, GQA 4:2, S=2048."""
    if (
        MOSAIC.check(
            make_request(
                make_mask("full", 128),
                dtype=jnp.bfloat16,
                head_dim=128,
                heads_q=4,
                heads_kv=2,
                backend="gpu",
                return_lse=True,
                mode="fwd",
            )
        )
        is not None
    ):
        pytest.skip("needs a Hopper GPU (compute capability 9.x)")
    mask = make_mask(name, 2048)
    config = mosaic_api.resolve_config(jnp.zeros((1, 1, 1, 128), jnp.bfloat16), None)
    arrays = jax.device_put(prepare_mask(mask, *config.tiles))
    _check(
        mask, arrays, b=1, hq=4, hkv=2, d=128, dtype=jnp.bfloat16, config=config, interpret=False
    )


@interpreted
@pytest.mark.parametrize(
    "late, early, overlap",
    [(False, False, False), (True, True, False), (False, True, False), (True, False, True)],
)
def test_persistent_forward(late: bool, early: bool, overlap: bool) -> None:
    """persistent_fwd (5 CTAs walking 18 (q tile, head, batch) items in snake order, so the last,
    partial row goes to 3 of them; the K/V ring running on across items, the next item's Q
    prefetched into the other buffer at the item's start, or after its partial steps with
    late_q_prefetch; with early_scalar_loads each item's walk read from the item table one item
    ahead; with fwd_overlap the next step's Q K^T issued before a step's softmax): the same
    outputs on every row, with partial tiles, ragged lengths and items that list no key tile."""
    config = dataclasses.replace(
        SMALL,
        persistent_fwd=True,
        late_q_prefetch=late,
        early_scalar_loads=early,
        fwd_overlap=overlap,
    )
    mask = from_slices([[0, 30], [50, 100]], [[0, 50], [60, 136]], [FULL, CAUSAL], 300, 136)
    arrays = prepare_mask(mask, *SMALL.tiles)
    assert (np.asarray(arrays.kv.count) == 0).sum() == 2, "q tiles without keys"
    _check(mask, arrays, b=2, hq=3, hkv=1, d=64, dtype=jnp.bfloat16, config=config, seed=4)


@interpreted
def test_persistent_forward_with_item_table_on_full_tiles() -> None:
    """early_scalar_loads with late_q_prefetch on a causal mask where every q tile walks a
    partial (diagonal) tile and the later ones full tiles too: the consumers take each item's
    key-tile count and partial count, the producer its count, from the item table; the same
    outputs on every row (the next item's Q prefetched from the wrong row fails here; a
    producer count short of the walk stalls it)."""
    config = dataclasses.replace(
        SMALL, persistent_fwd=True, late_q_prefetch=True, early_scalar_loads=True
    )
    mask = from_slices([[0, 384]], [[0, 384]], [CAUSAL], 384, 384)
    arrays = prepare_mask(mask, *SMALL.tiles)
    count, full = np.asarray(arrays.kv.count), np.asarray(arrays.kv.full).astype(bool)
    listed = np.arange(full.shape[1]) < count[:, None]
    n_full = (full & listed).sum(axis=1)
    assert (n_full > 0).any() and (count > n_full).all(), "partial tiles everywhere, full ones too"
    _check(mask, arrays, b=1, hq=4, hkv=2, d=64, dtype=jnp.bfloat16, config=config, seed=6)


@interpreted
def test_persistent_forward_dealt_by_walk_start() -> None:
    """deal_by_walk_start: the same outputs on every row, the tiles of four causal documents
    and a ragged last q tile that sees no key dealt by where their walks start."""
    config = dataclasses.replace(SMALL, persistent_fwd=True, deal_by_walk_start=True)
    mask = from_slices(
        [[0, 100], [100, 230], [230, 260], [300, 330]],
        [[0, 100], [100, 230], [230, 260], [300, 330]],
        [CAUSAL, CAUSAL, CAUSAL, CAUSAL],
        460,
        330,
    )
    arrays = prepare_mask(mask, *SMALL.tiles)
    assert (np.asarray(arrays.kv.count) == 0).sum() == 1 and np.asarray(arrays.kv.count).max() > 1
    _check(mask, arrays, b=1, hq=4, hkv=2, d=64, dtype=jnp.bfloat16, config=config, seed=5)


def test_walk_start_deal_needs_the_persistent_forward() -> None:
    with pytest.raises(ValueError, match="deal_by_walk_start .* needs persistent_fwd=True"):
        KernelConfig(deal_by_walk_start=True)


def _deal(name: str, seqlen: int, heads: tuple[int, int], ctas: int, by_walk_start: bool):
    """(host key-tile lists of the mask's q tiles, geometry, the dealt (q tile, head, batch)
    items) of the persistent forward at the default config."""
    config = mosaic_api.resolve_config(jnp.zeros((1, 1, 1, 128), jnp.bfloat16), None)
    lists = prepare_mask(make_mask(name, seqlen), *config.tiles).kv
    index, count = jnp.asarray(lists.index), jnp.asarray(lists.count)
    geo = mosaic_forward.Geometry(
        batch=1, seq_q=seqlen, seq_k=seqlen, heads_q=heads[0], heads_kv=heads[1], head_dim=128,
        intervals=1, config=config, ctas=ctas,
    )  # fmt: skip
    first = mosaic_forward.walk_starts(geo, index, count) if by_walk_start else None
    return lists, geo, np.asarray(mosaic_forward.deal_items(geo, count, first))


def _dealt(
    name: str, seqlen: int, heads: tuple[int, int], ctas: int = 132, by_walk_start: bool = False
) -> tuple:
    """The persistent forward's deal replayed outside the kernel: (key-tile count per q tile,
    the dealt (q tile, head) of every CTA's local steps, which of those steps exist)."""
    lists, geo, items = _deal(name, seqlen, heads, ctas, by_walk_start)
    count = np.asarray(lists.count)
    cta = jnp.arange(ctas, dtype=jnp.int32)
    runs = np.asarray(mosaic_forward._local_items(geo, cta))
    local = jnp.arange(int(runs.max()), dtype=jnp.int32)
    flat = np.asarray(mosaic_forward._snake(geo, cta[:, None], local[None, :]))
    valid = np.asarray(local[None, :] < runs[:, None])
    return count, items[:2, np.where(valid, flat, 0)], valid


@pytest.mark.parametrize(
    "name, heads, bound", [("causal", 16, 1.01), ("causal_document", 16, 1.05), ("full", 16, 1.04)]
)
def test_persistent_deal_covers_every_item_once_and_balances_key_tiles(
    name: str, heads: int, bound: float
) -> None:
    """The persistent forward's deal (bands of decreasing key-tile count, snake rows over 132
    CTAs): each (q tile, head) item goes to exactly one CTA, and the busiest CTA's cost (its
    items' key tiles, plus one for each item's own work) stays within `bound` of the larger of
    the mean cost and the costliest item. At 16 heads the launch order it replaced left causal
    at 1.52 of that."""
    count, (tile, head), valid = _dealt(name, 8192, (heads, heads // 8))
    assert sorted(zip(tile[valid].tolist(), head[valid].tolist())) == sorted(
        (t, h) for t in range(len(count)) for h in range(heads)
    )
    cost = ((count[tile] + 1) * valid).sum(axis=1)
    assert cost.max() <= bound * max(cost.sum() / len(cost), count.max() + 1), cost.max()


def _split_documents(name: str, seqlen: int, heads: tuple[int, int], by_walk_start: bool) -> int:
    """How many runs of items the deal does not list as one block, a run being the q tiles of
    one WALK_RUN-aligned stretch that start their walks at one key tile (a document's) and the
    heads of one K/V head."""
    lists, geo, (tile, head, _) = _deal(name, seqlen, heads, 132, by_walk_start)
    index, count = np.asarray(lists.index), np.asarray(lists.count)
    start = np.where(count > 0, index[:, 0], -1)  # host lists are ascending
    where: dict[tuple, list[int]] = {}
    for at, (t, h) in enumerate(zip(tile, head)):
        run = (start[t], t // mosaic_forward.WALK_RUN, h // geo.group)
        where.setdefault(run, []).append(at)
    return sum(ix[-1] - ix[0] + 1 != len(ix) for ix in where.values())


@pytest.mark.parametrize("name", ["causal_document", "full_document", "causal", "full"])
def test_walk_start_deal_keeps_each_documents_tiles_together(name: str) -> None:
    """deal_by_walk_start at 32K, 64:64 heads: every (q tile, head) item dealt once, each run
    of a document's tiles in one K/V head as one block (the default deal splits causal
    documents over its count bands), and the busiest CTA's cost (key tiles plus one per item)
    within 5% of the larger of the mean and the costliest item."""
    heads = (64, 64)
    count, (tile, head), valid = _dealt(name, 32768, heads, by_walk_start=True)
    assert sorted(zip(tile[valid].tolist(), head[valid].tolist())) == sorted(
        (t, h) for t in range(len(count)) for h in range(heads[0])
    )
    assert _split_documents(name, 32768, heads, by_walk_start=True) == 0
    if name == "causal_document":
        assert _split_documents(name, 32768, heads, by_walk_start=False) > 0
    cost = ((count[tile] + 1) * valid).sum(axis=1)
    assert cost.max() <= 1.05 * max(cost.sum() / len(cost), count.max() + 1), cost.max()


@pytest.mark.parametrize("name", ["full", "causal", "causal_document"])
def test_persistent_deal_keeps_kv_heads_together(name: str) -> None:
    """At 64:64 heads, the items running side by side (one per CTA, step by step) come from few
    K/V heads, so they share K/V tiles in L2: a third of the heads per step on average at most,
    where a deal of each q tile's heads together (the one before) spans all 64 at every step."""
    count, (tile, head), valid = _dealt(name, 32768, (64, 64))
    spans = [len(np.unique(head[valid[:, step], step])) for step in range(valid.shape[1])]
    assert np.mean(spans) <= 64 / 3, spans
