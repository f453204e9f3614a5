"""Mosaic GPU flash-attention backward (dq, dk, dv) vs the float64 oracle's gradients.

On the CPU the kernels run under Mosaic GPU interpret mode, with the interpreter taught what it
lacks by jax_attn.mosaic_gpu.interpret (the kernels are the ones the GPU runs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_masks import MaskType, from_slices, random_slices, reference_attention
from attn_masks.generators import make_mask
from jax_attn.mask_arrays import prepare_mask
from jax_attn.mosaic_gpu import KernelConfig, default_config
from jax_attn.mosaic_gpu.backward import flash_attention_mosaic_bwd
from jax_attn.mosaic_gpu.interpret import interpret_params

FULL, CAUSAL = int(MaskType.FULL), int(MaskType.CAUSAL)
# Relative Frobenius error bounds: P and dS are rounded to the input dtype before their wgmmas
# (fp32 accumulation), so the error is a few ulps of that dtype.
TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


@pytest.fixture(scope="module")
def interpret():
    """InterpretGPUParams with the interpreter taught the constructs the kernels use."""
    return interpret_params()


def _inputs(seed: int, b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype):
    """Fresh normal q, k, v, dout in `dtype` (and their exact float64 values)."""
    rng = np.random.default_rng(seed)
    shapes = [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)]
    xs = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
    return xs, [np.asarray(x.astype(jnp.float32), np.float64) for x in xs]


def _rel_frobenius(got: jax.Array, want: np.ndarray) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert np.isfinite(got).all(), "non-finite values"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def _grads(q, k, v, out, lse, do, arrays, *, scale, config, interpret):
    return flash_attention_mosaic_bwd(
        q, k, v, out, lse, do, arrays, scale=scale, config=config, interpret=interpret
    )


def _check(mask, config, interpret, *, tiles=(64, 64), b=1, hq=2, hkv=1, d=64, dtype=jnp.bfloat16):
    """dq, dk, dv vs the oracle (mask tiles `tiles`); gradients no query/key reaches are 0."""
    sq, sk = mask.seqlen_q, mask.seqlen_k
    (q, k, v, do), (q64, k64, v64, do64) = _inputs(sq + 7 * sk, b, sq, sk, hq, hkv, d, dtype)
    scale = d**-0.5
    ref = reference_attention(q64, k64, v64, mask, scale=scale, dout=do64)
    arrays = prepare_mask(mask, *tiles)
    out = jnp.asarray(ref.out, dtype)
    lse = jnp.asarray(ref.lse, jnp.float32)
    dq, dk, dv = _grads(
        q, k, v, out, lse, do, arrays, scale=scale, config=config, interpret=interpret
    )
    for name, got, want, like in (
        ("dq", dq, ref.dq, q),
        ("dk", dk, ref.dk, k),
        ("dv", dv, ref.dv, v),
    ):
        assert got.shape == like.shape and got.dtype == like.dtype, name
        err = _rel_frobenius(got, want)
        assert err < TOL[dtype], f"{name}: relative error {err:.2e} >= {TOL[dtype]:.0e}"
    dense = np.asarray(mask.dense(), bool)
    assert not np.asarray(dq)[:, ~dense.any(1)].any(), "rows seeing no key must get dq == 0"
    assert not np.asarray(dk)[:, ~dense.any(0)].any(), "keys no row sees must get dk == 0"
    assert not np.asarray(dv)[:, ~dense.any(0)].any(), "keys no row sees must get dv == 0"


def _slices_with_gaps():
    """Sq != Sk, neither a tile multiple, with rows that see nothing and keys nobody sees."""
    return from_slices(
        [[0, 40], [40, 90], [110, 150]],
        [[10, 60], [0, 130], [170, 200]],
        [FULL, CAUSAL, FULL],
        150,
        203,
    )


CASES = {
    "full_mha_bf16": dict(mask=make_mask("full", 128), hq=2, hkv=2, b=2),
    "causal_gqa_ragged_fp16": dict(mask=make_mask("causal", 200), hq=4, hkv=2, dtype=jnp.float16),
    "causal_document_gqa": dict(mask=make_mask("causal_document", 256, seed=3), hq=2, hkv=1),
    "sliding_window": dict(mask=make_mask("sliding_window", 192, window=48), hq=1, hkv=1),
    "share_question_fp16": dict(mask=make_mask("share_question", 256), dtype=jnp.float16),
    "gaps_sq_ne_sk": dict(mask=_slices_with_gaps(), hq=2, hkv=2),
    "random_slices_fp16": dict(mask=random_slices(5, 192, 160), dtype=jnp.float16),
}
# two 256-key tiles, the last one ragged (44 keys: one 128-key CTA of it partly filled, the
# other empty), documents ending inside both (at 134 and 300)
WS_ONLY_CASES = {
    "causal_document_300": dict(mask=make_mask("causal_document", 300, seed=4), hq=2, hkv=1),
    # two 128-key tiles, the last one ragged (64 keys: one consumer warpgroup's half empty)
    "share_question_gqa4": dict(mask=make_mask("share_question", 192), hq=4, hkv=1),
    # three 128-key tiles, the last ragged: paired walks' middle CTA walks one tile alone
    "causal_300": dict(mask=make_mask("causal", 300), hq=2, hkv=1),
    # key tiles whose lists hold several full q tiles: the paired walks' last-first order
    "causal_512": dict(mask=make_mask("causal", 512), hq=2, hkv=1),
    "causal_640_fp16": dict(mask=make_mask("causal", 640), hq=2, hkv=1, dtype=jnp.float16),
    # no partial tile: the D=128 default's backward runs fused (backward_form)
    "full_384_gqa": dict(mask=make_mask("full", 384), hq=4, hkv=2),
    # a 128-key tile no row sees and a 128-row tile that sees no key: CTAs with no step
    "empty_tiles": dict(
        mask=from_slices([[0, 64], [64, 192]], [[0, 100], [256, 320]], [FULL, FULL], 320, 320),
        hq=2,
        hkv=1,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients(name: str, interpret) -> None:
    case = dict(CASES[name])
    _check(case.pop("mask"), KernelConfig(), interpret, **case)


def test_backward_of_a_persistent_config_on_other_tiles(interpret) -> None:
    """The backward walks mask tiles its sub-tiles divide, whatever the forward's: with a
    persistent-forward config (whose forward deals 128-row tiles) 64 x 64 tiles give the
    oracle's gradients, the backward dealing no forward items."""
    case = dict(CASES["causal_document_gqa"])
    _check(case.pop("mask"), KernelConfig(persistent_fwd=True), interpret, **case)


FUSED_CASES = ("causal_gqa_ragged_fp16", "gaps_sq_ne_sk")


@pytest.mark.parametrize("name", FUSED_CASES)
def test_fused_gradients(name: str, interpret) -> None:
    """One kernel for all three gradients: dQ summed over key tiles and GQA heads by the TMA
    reduce-add into fp32 (rows no key reaches stay exactly 0)."""
    case = dict(CASES[name])
    _check(case.pop("mask"), KernelConfig(fused_bwd=True), interpret, **case)


WARP_SPECIALISED = {
    "ws_gaps_3stages": (KernelConfig(bwd_warpgroups=2, num_stages_bwd=3), "gaps_sq_ne_sk"),
    "ws_fused_ragged_fp16": (
        KernelConfig(bwd_warpgroups=2, fused_bwd=True),
        "causal_gqa_ragged_fp16",
    ),
    "ws_fused_d128": (KernelConfig(bwd_warpgroups=2, fused_bwd=True), "causal_document_gqa"),
    # launched tiles fastest: the kernels find their tile, head and batch by axis name
    "ws_both_tiles_fastest": (
        KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, tiles_fastest=True),
        "gaps_sq_ne_sk",
    ),
    # P computed while dP's matmul runs, in the masked and the unmasked steps of both kernels
    "ws_both_overlap": (
        KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, bwd_overlap=True),
        "gaps_sq_ne_sk",
    ),
    # 256-key mask tiles (the D=64 default): each 128-key CTA walks its mask tile's q list
    "ws_both_256_key_tiles": (
        KernelConfig(block_k=256, bwd_warpgroups=2, dq_warpgroups=2, block_k_dq=128),
        "causal_document_300",
    ),
    # the D=64 default on masks with few partial tiles: 128 q rows a dK/dV step (one step a
    # 128-row mask tile; these small masks have many, so the rows are set here)
    "ws_d64_rows128_ragged_fp16": (
        dataclasses.replace(default_config(64, jnp.float16), block_q_dkv=128),
        "causal_gqa_ragged_fp16",
    ),
    "ws_d64_rows128_unsplit": (
        dataclasses.replace(default_config(64, jnp.bfloat16), block_q_dkv=128, dkv_head_split=1),
        "causal_document_300",
    ),
    "ws_d64_rows128_intervals": (
        dataclasses.replace(default_config(64, jnp.bfloat16), block_q_dkv=128),
        "random_slices_fp16",
    ),
    # the D=64 default as it is: 64 rows a dK/dV step on a mask of many partial tiles
    "ws_d64_default_documents": (default_config(64, jnp.bfloat16), "causal_document_300"),
    # each (key tile, kv head) split over two CTAs walking half of the GQA group each, their
    # fp32 partial dK, dV summed after the kernel
    "ws_head_split_ragged_fp16": (
        KernelConfig(bwd_warpgroups=2, dkv_head_split=2),
        "causal_gqa_ragged_fp16",
    ),
    "ws_head_split_4_d128": (
        KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, dkv_head_split=4),
        "share_question_gqa4",
    ),
    # the D=64 default's grid: two 128-key CTAs per 256-key mask tile, each split in two
    "ws_head_split_256_key_tiles": (
        KernelConfig(
            block_k=256, bwd_warpgroups=2, dq_warpgroups=2, block_k_dq=128, dkv_head_split=2
        ),
        "causal_document_300",
    ),
    "fused_overlap_ragged_fp16": (
        KernelConfig(fused_bwd=True, bwd_overlap=True),
        "causal_gqa_ragged_fp16",
    ),
    # the consumers' ping-pong barrier in both kernels, also in CTAs that walk no step
    "ws_pingpong_empty_tiles": (
        KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, bwd_pingpong=True),
        "empty_tiles",
    ),
    "ws_pingpong_3stages": (
        KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, bwd_pingpong=True, num_stages_bwd=3),
        "causal_gqa_ragged_fp16",
    ),
    "ws_pingpong_overlap_split_d128": (
        KernelConfig(
            bwd_warpgroups=2,
            dq_warpgroups=2,
            bwd_pingpong=True,
            bwd_overlap=True,
            dkv_head_split=2,
        ),
        "share_question_gqa4",
    ),  # fmt: skip
    # the consumer code compiled once per consumer warpgroup, its index a constant: fused (D=64:
    # consumer 0 computes the whole dQ share; D=128: each its half), and with the ping-pong
    # turns and a head split (each consumer's fp32 stage picked by the constant)
    "ws_copies_fused_ragged_fp16": (
        KernelConfig(bwd_warpgroups=2, fused_bwd=True, dkv_consumer_copies=True),
        "causal_gqa_ragged_fp16",
    ),
    "ws_copies_fused_d128": (
        KernelConfig(bwd_warpgroups=2, fused_bwd=True, dkv_consumer_copies=True),
        "causal_gqa_ragged_fp16",
    ),
    "ws_copies_pingpong_split": (
        KernelConfig(
            bwd_warpgroups=2,
            dq_warpgroups=2,
            bwd_pingpong=True,
            dkv_head_split=2,
            dkv_consumer_copies=True,
        ),
        "causal_gqa_ragged_fp16",
    ),
    # the K and V tiles (and the fused dQ's K tiles) picked each step through a barrier: fused
    # at D=128 (each consumer's dQ columns chosen by its run-time index), and unfused with the
    # ping-pong turns
    "ws_step_desc_fused_d128": (
        KernelConfig(bwd_warpgroups=2, fused_bwd=True, dkv_step_descriptors=True),
        "causal_gqa_ragged_fp16",
    ),
    "ws_step_desc_pingpong": (
        KernelConfig(
            bwd_warpgroups=2, dq_warpgroups=2, bwd_pingpong=True, dkv_step_descriptors=True
        ),
        "causal_gqa_ragged_fp16",
    ),
    # two key tiles a CTA, p's unmasked q tiles last first, then N - 1 - p's: fused at D=128
    # with step descriptors over an odd count (the middle CTA alone); unfused with the
    # ping-pong turns and a head split over lists of up to three full q tiles; the D=64
    # default's grid (two 128-key CTAs per 256-key mask tile) on documents, whose key tiles
    # walk lists of different lengths, and with 128 q rows a step over up to three full q tiles
    "ws_paired_fused_d128_odd": (
        KernelConfig(
            bwd_warpgroups=2, fused_bwd=True, dkv_step_descriptors=True, dkv_paired_walks=True
        ),
        "causal_300",
    ),
    "ws_paired_pingpong_split": (
        KernelConfig(
            bwd_warpgroups=2,
            dq_warpgroups=2,
            bwd_pingpong=True,
            dkv_head_split=2,
            dkv_paired_walks=True,
        ),
        "causal_512",
    ),
    "ws_paired_d64_default_documents": (
        dataclasses.replace(default_config(64, jnp.bfloat16), dkv_paired_walks=True),
        "causal_document_300",
    ),
    "ws_paired_d64_rows128": (
        dataclasses.replace(
            default_config(64, jnp.float16), block_q_dkv=128, dkv_paired_walks=True
        ),
        "causal_640_fp16",
    ),
    # the D=128 default on a mask without partial tiles: fused with step descriptors and
    # paired walks, three key tiles (a pair and the middle CTA alone)
    "ws_d128_default_full": (default_config(128, jnp.bfloat16), "full_384_gqa"),
}
# D=128: each consumer reduces half of the head dim; the fp32 partials' staging at full width
HEAD_DIMS = {
    "ws_d128_default_full": 128,
    "ws_copies_fused_d128": 128,
    "ws_step_desc_fused_d128": 128,
    "ws_paired_fused_d128_odd": 128,
    "ws_fused_d128": 128,
    "ws_head_split_4_d128": 128,
    "ws_pingpong_overlap_split_d128": 128,
}


# (q heads, kv heads) where the case's point is not its mask case's heads: each CTA is
# interpreted, so fewer heads is less time. The GQA group stays where the config walks it (ring
# wraps, head split, fused dQ), and the default config's per-call choices (head split, launch
# order) come out as with the case's heads. Several kv heads stay covered by ws_both_tiles_fastest
# (axis names) and ws_head_split_ragged_fp16 (kv head of a split grid head).
HEADS = {
    "ws_gaps_3stages": (1, 1),
    "ws_fused_ragged_fp16": (2, 1),
    "ws_both_overlap": (1, 1),
    "ws_both_256_key_tiles": (1, 1),
    "ws_d64_rows128_ragged_fp16": (2, 1),
    "fused_overlap_ragged_fp16": (2, 1),
    "ws_pingpong_empty_tiles": (1, 1),
    "ws_pingpong_3stages": (2, 1),
    "ws_copies_fused_ragged_fp16": (2, 1),
    "ws_copies_fused_d128": (2, 1),
    "ws_step_desc_fused_d128": (2, 1),
    "ws_step_desc_pingpong": (2, 1),
    "ws_copies_pingpong_split": (2, 1),
}


@pytest.mark.parametrize("name", sorted(WARP_SPECIALISED))
def test_warp_specialised_gradients(name: str, interpret) -> None:
    """Two consumer warpgroups (64 keys each of a 128-key mask tile) and a producer filling the
    shared q-side ring: the same gradients, also fused and with a deeper ring."""
    config, case_name = WARP_SPECIALISED[name]
    case = dict({**CASES, **WS_ONLY_CASES}[case_name], d=HEAD_DIMS.get(name, 64))
    if name in HEADS:
        case["hq"], case["hkv"] = HEADS[name]
    _check(case.pop("mask"), config, interpret, tiles=config.tiles, **case)


def test_warp_specialised_needs_two_halves(interpret) -> None:
    mask = make_mask("causal", 128)
    with pytest.raises(ValueError, match="bwd_warpgroups=2 .* block_k a multiple of 2 .*=64"):
        _check(mask, KernelConfig(block_k=64, bwd_warpgroups=2), interpret, tiles=(128, 64))
    with pytest.raises(ValueError, match="valid values are 1 and 2"):
        KernelConfig(bwd_warpgroups=3)
    with pytest.raises(ValueError, match="dq_warpgroups=2 .* a multiple of 2 .* block_q_dq=128"):
        _check(mask, KernelConfig(dq_warpgroups=2, block_q_dq=128), interpret, tiles=(128, 128))
    with pytest.raises(ValueError, match="dq_warpgroups=0 is invalid"):
        KernelConfig(dq_warpgroups=0)


def test_head_split_refusals(interpret) -> None:
    """The head split names the group it must divide and the kernel it needs."""
    mask = make_mask("causal", 128)
    config = KernelConfig(bwd_warpgroups=2, dkv_head_split=4)
    with pytest.raises(ValueError, match="dkv_head_split=4 must divide .* a group of 2"):
        _check(mask, config, interpret, tiles=config.tiles, hq=4, hkv=2)
    with pytest.raises(ValueError, match="dkv_head_split=0 is invalid: valid values are positive"):
        KernelConfig(dkv_head_split=0)
    with pytest.raises(ValueError, match="needs the warp-specialised .* got bwd_warpgroups=1"):
        KernelConfig(dkv_head_split=2)
    with pytest.raises(ValueError, match="fused_bwd=True"):
        KernelConfig(bwd_warpgroups=2, fused_bwd=True, dkv_head_split=2)


@pytest.mark.parametrize("changes", [dict(), dict(fused_bwd=True), dict(num_stages_bwd=1)], ids=str)
def test_pingpong_refusals(changes: dict) -> None:
    """bwd_pingpong names what it needs and what it got: the unfused warp-specialised dK/dV
    kernel and a ring of two stages or more (one stage would deadlock the turns)."""
    warpgroups = 1 if not changes else 2
    with pytest.raises(ValueError, match="bwd_pingpong needs .* at least two stages") as e:
        KernelConfig(bwd_warpgroups=warpgroups, bwd_pingpong=True, **changes)
    got = dict(bwd_warpgroups=warpgroups, fused_bwd=False, num_stages_bwd=None) | changes
    assert all(f"{k}={v}" in str(e.value) for k, v in got.items()), str(e.value)


@pytest.mark.parametrize(
    "name", ["dkv_consumer_copies", "dkv_step_descriptors", "dkv_paired_walks"]
)
def test_consumer_option_refusal(name: str) -> None:
    """Options of the warp-specialised dK/dV kernel's consumers: without that kernel the error
    names the option, what it needs and what it got."""
    with pytest.raises(ValueError, match=f"{name}=True needs .*got bwd_warpgroups=1"):
        KernelConfig(**{name: True})


def test_sub_tiles_and_deep_ring(interpret) -> None:
    """128x128 mask tiles walked as 64-row kernel tiles (and 128-key dQ steps), 3 stages.
    A GQA group of 2 (one kv head: the walks are those of more kv heads, in half the CTAs)."""
    config = KernelConfig(block_k_dq=128, num_stages_bwd=3)
    mask = make_mask("causal_document", 320, seed=1)
    _check(mask, config, interpret, tiles=(128, 128), hq=2, hkv=1)


def test_lse_cotangent(interpret) -> None:
    """dlse enters as delta -= dlse: matches autodiff of a dense fp32 attention returning lse."""
    mask = make_mask("causal", 128)
    (q, k, v, do), _ = _inputs(1, 1, 128, 128, 2, 1, 64, jnp.bfloat16)
    dlse = jnp.asarray(np.random.default_rng(2).standard_normal((1, 2, 128)), jnp.float32)
    vis = jnp.asarray(mask.dense(), bool)

    def dense(q, k, v):
        s = jnp.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) / 8.0
        lse = jax.nn.logsumexp(jnp.where(vis, s, -jnp.inf), axis=-1)
        p = jnp.where(vis, jnp.exp(s - lse[..., None]), 0.0)
        return jnp.einsum("bhqk,bkd->bqhd", p, v[:, :, 0]), lse

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (out, lse), vjp = jax.vjp(dense, *f32)
    want = vjp((do.astype(jnp.float32), dlse))
    arrays = prepare_mask(mask, 64, 64)
    got = flash_attention_mosaic_bwd(
        q,
        k,
        v,
        out.astype(q.dtype),
        lse,
        do,
        arrays,
        scale=0.125,
        config=KernelConfig(),
        interpret=interpret,
        dlse=dlse,
    )
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        err = _rel_frobenius(g, np.asarray(w, np.float64))
        assert err < TOL[jnp.bfloat16], f"{name}: relative error {err:.2e}"


def test_rejects_unsupported(interpret) -> None:
    x = jnp.zeros((1, 64, 1, 32), jnp.bfloat16)
    arrays = prepare_mask(make_mask("full", 64), 64, 64)
    lse = jnp.zeros((1, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attention_mosaic_bwd(
            x, x, x, x, lse, x, arrays, scale=1.0, config=KernelConfig(), interpret=interpret
        )
    with pytest.raises(ValueError, match="block_k_dq"):
        y = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
        flash_attention_mosaic_bwd(
            y,
            y,
            y,
            y,
            lse,
            y,
            arrays,
            scale=1.0,
            config=KernelConfig(block_k_dq=128),
            interpret=None,
        )


@pytest.mark.parametrize("d", [64, 128])
def test_lowers_for_hopper(d: int) -> None:
    """The GPU path (layout hints included, which interpret mode skips) lowers to Mosaic GPU."""
    mask = random_slices(2, 384, 256)
    config = KernelConfig(block_k=128, block_k_dq=128)
    arrays = prepare_mask(mask, *config.tiles)
    assert arrays.num_intervals > 1
    q = jnp.zeros((1, mask.seqlen_q, 4, d), jnp.bfloat16)
    k = jnp.zeros((1, mask.seqlen_k, 2, d), jnp.bfloat16)
    lse = jnp.zeros((1, 4, mask.seqlen_q), jnp.float32)
    traced = _grads.trace(q, k, k, q, lse, q, arrays, scale=0.1, config=config, interpret=None)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_flash_dkv" in text and "mosaic_flash_dq" in text
    assert text.count("custom_call @mosaic_gpu") == 2
    fused = KernelConfig(block_k=128, fused_bwd=True)
    traced = _grads.trace(q, k, k, q, lse, q, arrays, scale=0.1, config=fused, interpret=None)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1, "fused: one backward kernel, no dQ kernel"
    for ws in (
        KernelConfig(bwd_warpgroups=2),
        KernelConfig(bwd_warpgroups=2, fused_bwd=True, tiles_fastest=True),
        KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, block_k_dq=128),
        KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, block_k_dq=128, bwd_overlap=True),
        KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, block_k_dq=128, dkv_head_split=2),
        KernelConfig(bwd_warpgroups=2, dq_warpgroups=2, block_k_dq=128, bwd_pingpong=True),
        KernelConfig(bwd_warpgroups=2, dkv_consumer_copies=True),
        KernelConfig(bwd_warpgroups=2, fused_bwd=True, dkv_consumer_copies=True),
        KernelConfig(bwd_warpgroups=2, fused_bwd=True, dkv_step_descriptors=True),
        KernelConfig(bwd_warpgroups=2, dkv_consumer_copies=True, dkv_step_descriptors=True),
        KernelConfig(
            bwd_warpgroups=2, fused_bwd=True, dkv_consumer_copies=True, dkv_step_descriptors=True
        ),
        KernelConfig(bwd_warpgroups=2, dkv_paired_walks=True),
        KernelConfig(
            bwd_warpgroups=2, fused_bwd=True, dkv_step_descriptors=True, dkv_paired_walks=True
        ),
    ):
        traced = _grads.trace(q, k, k, q, lse, q, arrays, scale=0.1, config=ws, interpret=None)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 2 - ws.fused_bwd
        assert ("mosaic_flash_dq_ws" in text) == (ws.dq_warpgroups == 2)
    # the default (its backward's form chosen per call: the random mask has many partial
    # tiles, the full one none, fused at D=128), with 128 dK/dV rows, and fused on top of it
    # (the fused kernel's rows at 64: at 128 its dS^T tiles and fp32 dQ stage exceed shared
    # memory, which KernelConfig refuses)
    default = default_config(d, jnp.bfloat16)
    wide = dataclasses.replace(default, block_q_dkv=128 if d == 64 else None)
    fused = dataclasses.replace(default, fused_bwd=True)
    sq, sk = mask.seqlen_q, mask.seqlen_k
    full = from_slices([[0, sq]], [[0, sk]], [MaskType.FULL], sq, sk)  # no partial tile
    cases = ((default, mask, False), (wide, mask, False), (fused, mask, True))
    for config, on, fused_form in (*cases, (default, full, d == 128)):
        tiled = prepare_mask(on, *config.tiles)
        traced = _grads.trace(q, k, k, q, lse, q, tiled, scale=0.1, config=config, interpret=None)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 2 - fused_form
    with pytest.raises(ValueError, match="fused_bwd with block_q_dkv=128.*block_q_dkv=64"):
        dataclasses.replace(default_config(64, jnp.bfloat16), fused_bwd=True, block_q_dkv=128)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_lowering_s2048(d: int) -> None:
    """The real Hopper lowering at S=2048: causal documents, GQA, 128x128 mask tiles."""
    config = KernelConfig(block_k=128, num_stages_bwd=2)
    mask = make_mask("causal_document", 2048, seed=0)
    _check(mask, config, None, tiles=config.tiles, b=2, hq=4, hkv=2, d=d)


@pytest.mark.parametrize(
    "config, heads",
    [
        (KernelConfig(block_k=64), (2, 1)),
        # one head: a CTA's barriers and copies are those of every head's (half the CTAs)
        (KernelConfig(block_k=128, num_stages_bwd=3, persistent_fwd=True), (1, 1)),
        (
            KernelConfig(
                block_k=128, persistent_fwd=True, late_q_prefetch=True, early_scalar_loads=True
            ),
            (1, 1),
        ),
        (KernelConfig(block_k=128, bwd_warpgroups=2, dq_warpgroups=2, fwd_overlap=True), (2, 1)),
        (KernelConfig(block_k=128, bwd_warpgroups=2, fused_bwd=True), (2, 1)),
        (
            KernelConfig(block_k=128, bwd_warpgroups=2, fused_bwd=True, dkv_consumer_copies=True),
            (2, 1),
        ),
        (
            KernelConfig(block_k=128, bwd_warpgroups=2, fused_bwd=True, dkv_paired_walks=True),
            (2, 1),
        ),
    ],
    ids=[
        "gqa_2stages",
        "mha_3stages_persistent_fwd",
        "mha_persistent_fwd_late_early",
        "warp_specialised_gqa",
        "warp_specialised_fused",
        "warp_specialised_fused_consumer_copies",
        "warp_specialised_fused_paired_walks",
    ],
)
def test_no_shared_memory_races(config: KernelConfig, heads: tuple[int, int]) -> None:
    """Forward, dK/dV and dQ under the interpreter's race detector: no warpgroup reads shared
    memory before the TMA copy filling it has been waited for.

    The interpreter completes a TMA copy when it is issued, so values read too early are still
    right there; on the GPU they are not (the dQ kernel once read LSE and delta before waiting
    for their copies, which gave dq errors of 1e3 on the H200 and none on the CPU).
    """
    from jax_attn.mosaic_gpu import flash_attention_mosaic
    from jax_attn.mosaic_gpu.interpret import launches_with_races

    mask = make_mask("causal", 200)
    (q, k, v, _), _ = _inputs(5, 1, 200, 200, heads[0], heads[1], 64, jnp.bfloat16)
    arrays = prepare_mask(mask, *config.tiles)
    params = interpret_params(detect_races=True)

    def loss(q, k, v):
        out = flash_attention_mosaic(q, k, v, arrays, scale=0.125, config=config, interpret=params)
        return out.astype(jnp.float32).sum()

    with launches_with_races() as raced:
        jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    launches = 2 if config.fused_bwd else 3  # fused: no dQ kernel
    assert raced == [False] * launches, f"(forward, dK/dV[, dQ]) raced: {raced}"
