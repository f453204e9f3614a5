"""torch_attn against the float64 oracle: outputs, LSE, gradients, effective masks, supports()."""

from __future__ import annotations

import zlib
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

import torch_attn
from attn_masks import (
    KINDS,
    Mask,
    MaskPattern,
    MaskType,
    classify,
    from_slices,
    reference_attention,
)
from torch_attn import flex as flex_impl
from torch_attn import mask_utils
from torch_attn.blocks import TABLE_NAMES, flex_block_mask, flex_block_tables

try:
    from attn_masks.generators import MASK_NAMES, make_mask
except ImportError:  # generators not landed yet: those tests skip
    MASK_NAMES, make_mask = (), None

FULL, CAUSAL, INVCAUSAL, BICAUSAL = (int(t) for t in MaskType)
F64, F32 = torch.float64, torch.float32
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (tests/conftest.py says why)."""


# ---------------------------------------------------------------- masks built from slices


def full(sq: int, sk: int | None = None) -> Mask:
    return from_slices([[0, sq]], [[0, sk or sq]], [FULL], sq, sk or sq, name="t_full")


def causal(sq: int, sk: int | None = None) -> Mask:
    return from_slices([[0, sq]], [[0, sk or sq]], [CAUSAL], sq, sk or sq, name="t_causal")


def documents(cu: list[int], typ: int) -> Mask:
    cu = np.asarray(cu)
    ranges = np.stack([cu[:-1], cu[1:]], 1)
    return from_slices(ranges, ranges, [typ] * len(ranges), int(cu[-1]), name="t_docs")


def band(s: int, left: int, right: int) -> Mask:
    """Rows i see [i - left, i + right] on a square, cut into CAUSAL/BICAUSAL/INVCAUSAL/FULL."""
    cuts = sorted({0, s, min(s, left + 1), max(0, s - right - 1)})
    qr, kr, ty = [], [], []
    for r0, r1 in zip(cuts[:-1], cuts[1:]):
        lo_clip, hi_clip = r0 <= left, r0 >= s - right - 1
        k0 = 0 if lo_clip else r0 - left
        k1 = s if hi_clip else r1 + right
        typ = {(1, 1): FULL, (1, 0): CAUSAL, (0, 1): INVCAUSAL, (0, 0): BICAUSAL}
        qr.append([r0, r1])
        kr.append([k0, k1])
        ty.append(typ[(int(lo_clip), int(hi_clip))])
    return from_slices(qr, kr, ty, s, name="t_band")


def prefix_lm(s: int, p: int) -> Mask:
    return from_slices([[0, p], [p, s]], [[0, p], [0, s]], [FULL, CAUSAL], s, name="t_prefix")


def uncovered_rows(s: int) -> Mask:
    """Two documents with a gap of rows (and keys) that no slice covers."""
    q = [[0, s // 3], [s // 2, s]]
    return from_slices(q, q, [FULL, CAUSAL], s, name="t_gap")


def random_slices(sq: int, sk: int, seed: int) -> Mask:
    """Random typed slices on a random grid of disjoint rectangles (so never overlapping)."""
    rng = np.random.default_rng(seed)
    qc = np.unique(np.concatenate([[0, sq], rng.integers(1, sq, 5)]))
    kc = np.unique(np.concatenate([[0, sk], rng.integers(1, sk, 5)]))
    qr, kr, ty = [], [], []
    for q0, q1 in zip(qc[:-1], qc[1:]):
        for k0, k1 in zip(kc[:-1], kc[1:]):
            if rng.random() < 0.45:
                qr.append([q0, q1])
                kr.append([k0, k1])
                ty.append(int(rng.integers(0, 4)))
    return from_slices(qr, kr, ty, sq, sk, name="t_random")


def no_slices(sq: int, sk: int) -> Mask:
    return from_slices(np.zeros((0, 2)), np.zeros((0, 2)), [], sq, sk, name="t_empty")


# (id, mask builder, heads_q, heads_kv, dtype)
CASES = [
    ("full", lambda: full(100), 4, 2, F64),
    ("full_64x130", lambda: full(64, 130), 2, 2, F64),
    ("causal", lambda: causal(130), 4, 2, F64),
    ("causal_130x64_empty_rows", lambda: causal(130, 64), 4, 2, F64),
    ("causal_64x130", lambda: causal(64, 130), 2, 2, F64),
    ("full_document", lambda: documents([0, 30, 31, 80, 100], FULL), 4, 2, F64),
    ("causal_document", lambda: documents([0, 50, 64, 130], CAUSAL), 2, 2, F64),
    ("window_causal", lambda: band(130, 17, 0), 4, 2, F64),
    ("window_two_sided", lambda: band(100, 9, 9), 4, 2, F64),
    ("prefix_lm", lambda: prefix_lm(130, 40), 4, 2, F64),
    ("uncovered_rows", lambda: uncovered_rows(100), 2, 2, F64),
    ("no_slices", lambda: no_slices(64, 100), 2, 2, F64),
    ("random_130x130", lambda: random_slices(130, 130, 1), 4, 2, F64),
    ("random_130x100", lambda: random_slices(130, 100, 2), 4, 2, F64),
    ("random_64x130", lambda: random_slices(64, 130, 3), 2, 2, F64),
    ("causal_f32", lambda: causal(130), 4, 2, F32),
    ("full_document_f32", lambda: documents([0, 30, 31, 80, 100], FULL), 4, 2, F32),
    ("window_f32", lambda: band(64, 5, 5), 2, 2, F32),
    ("random_130x100_f32", lambda: random_slices(130, 100, 2), 4, 2, F32),
]


# ---------------------------------------------------------------- helpers


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def make_inputs(mask: Mask, hq: int, hkv: int, dtype: torch.dtype, *key: object, batch: int = 2):
    """Fresh normal q, k, v, dout rounded to `dtype`, as float64 numpy (for the oracle)."""
    rng = _rng(mask.name, mask.seqlen_q, mask.seqlen_k, hq, hkv, str(dtype), *key)
    shapes = [
        (batch, mask.seqlen_q, hq, 32),
        (batch, mask.seqlen_k, hkv, 32),
        (batch, mask.seqlen_k, hkv, 32),
        (batch, mask.seqlen_q, hq, 32),
    ]
    arrays = [rng.standard_normal(s) for s in shapes]
    return [torch.tensor(a).to(dtype).to(F64).numpy() for a in arrays]


def assert_close(got: torch.Tensor, want: np.ndarray, dtype: torch.dtype, what: str) -> None:
    got = got.detach().to(F64).cpu().numpy()
    assert np.isfinite(got).all() or what == "lse", f"{what}: non-finite values"
    tol = 1e-10 if dtype == F64 else 1e-4
    scale = max(1.0, float(np.abs(want[np.isfinite(want)]).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


def assert_lse(got: torch.Tensor, want: np.ndarray, dtype: torch.dtype) -> None:
    got_np = got.detach().to(F64).cpu().numpy()
    assert got.dtype == (F64 if dtype == F64 else F32)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got_np), np.isneginf(want), "LSE -inf rows")
    seen = np.isfinite(want)
    assert_close(torch.tensor(got_np[seen]), want[seen], dtype, "lse")


def cpu_backward(impl: str) -> bool:
    return impl != "flex"


def run(impl, mask, arrays, dtype, *, grad: bool, return_lse: bool = True):
    q, k, v = (torch.tensor(a, dtype=dtype, requires_grad=grad) for a in arrays[:3])
    result = torch_attn.attention(q, k, v, mask, impl=impl, return_lse=return_lse)
    return (q, k, v), result


# ---------------------------------------------------------------- correctness on CPU


@pytest.mark.parametrize("impl", torch_attn.IMPLS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(impl, case):
    _, build, hq, hkv, dtype = case
    mask = build()
    grad = cpu_backward(impl)
    verdict = torch_attn.supports(
        impl,
        mask,
        dtype=dtype,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=32,
        device="cpu",
        mode="fwd_bwd" if grad else "fwd",
    )
    arrays = make_inputs(mask, hq, hkv, dtype, impl)
    if verdict is not True:
        assert isinstance(verdict, str) and verdict
        with pytest.raises(torch_attn.Unsupported, match=".+"):
            run(impl, mask, arrays, dtype, grad=grad)
        return
    ref = reference_attention(*arrays[:3], mask, dout=arrays[3])
    (q, k, v), (out, lse) = run(impl, mask, arrays, dtype, grad=grad)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref.out, dtype, "out")
    assert_lse(lse, ref.lse, dtype)
    if grad:
        out.backward(torch.tensor(arrays[3], dtype=dtype))
        for x, want, what in ((q, ref.dq, "dq"), (k, ref.dk, "dk"), (v, ref.dv, "dv")):
            assert_close(x.grad, want, dtype, what)


@pytest.mark.parametrize("impl", ["naive", "sdpa_math", "flex"])
def test_out_only_and_scale(impl):
    mask = random_slices(100, 130, 7)
    arrays = make_inputs(mask, 4, 2, F64, "scale")
    ref = reference_attention(*arrays[:3], mask, scale=0.3)
    q, k, v = (torch.tensor(a) for a in arrays[:3])
    out = torch_attn.attention(q, k, v, mask, impl=impl, scale=0.3)
    assert isinstance(out, torch.Tensor)
    assert_close(out, ref.out, F64, "out")


def test_lse_is_differentiable_in_naive_and_lse_pass():
    """LSE carries gradients (context-parallel merges need them): d lse / d q vs the oracle."""
    mask = prefix_lm(64, 20)
    arrays = make_inputs(mask, 2, 2, F64, "dlse")
    for impl in ("naive", "sdpa_math"):
        q = torch.tensor(arrays[0], requires_grad=True)
        k, v = torch.tensor(arrays[1]), torch.tensor(arrays[2])
        _, lse = torch_attn.attention(q, k, v, mask, impl=impl, return_lse=True)
        lse.sum().backward()
        # d sum(lse) / d q_i = scale * sum_j p_ij k_j = scale * attention output with V = K
        want = reference_attention(arrays[0], arrays[1], arrays[1], mask).out / np.sqrt(32)
        assert_close(q.grad, want, F64, f"{impl} dlse/dq")


# ---------------------------------------------------------------- effective masks


def probe_visible(impl: str, mask: Mask, dtype: torch.dtype = F64) -> np.ndarray:
    """Visible (Sq, Sk) recovered from outputs: one-hot values reveal each probability > 0."""
    rng = _rng("probe", impl, mask.name)
    d = 32
    q = torch.tensor(0.1 * rng.standard_normal((1, mask.seqlen_q, 2, d)), dtype=dtype)
    k = torch.tensor(0.1 * rng.standard_normal((1, mask.seqlen_k, 2, d)), dtype=dtype)
    seen = np.zeros((2, mask.seqlen_q, mask.seqlen_k), bool)
    for start in range(0, mask.seqlen_k, d):
        cols = np.arange(start, min(start + d, mask.seqlen_k))
        v = torch.zeros(1, mask.seqlen_k, 2, d, dtype=dtype)
        v[0, cols, :, cols - start] = 1.0
        with torch.no_grad():
            out = torch_attn.attention(q, k, v, mask, impl=impl)
        probs = out[0, :, :, : len(cols)].permute(1, 0, 2).to(F64).numpy()
        seen[:, :, cols] = probs > 0
    return seen


PROBE_MASKS = [
    ("random", lambda: random_slices(130, 100, 11)),
    ("band", lambda: band(100, 7, 3)),
    ("prefix", lambda: prefix_lm(64, 20)),
    ("gap", lambda: uncovered_rows(100)),
    ("causal_wide", lambda: causal(64, 130)),
]


@pytest.mark.parametrize("impl", torch_attn.IMPLS)
@pytest.mark.parametrize("case", PROBE_MASKS, ids=[c[0] for c in PROBE_MASKS])
def test_effective_mask(impl, case):
    mask = case[1]()
    if torch_attn.supports(impl, mask, dtype=F64, device="cpu") is not True:
        pytest.skip("unsupported here (honesty checked by test_matches_reference)")
    seen = probe_visible(impl, mask)
    dense = mask.dense()
    for head in range(seen.shape[0]):
        np.testing.assert_array_equal(seen[head], dense, f"{impl} head {head}")


# ---------------------------------------------------------------- supports() honesty


def test_unknown_impl_lists_valid_ones():
    with pytest.raises(ValueError, match="sdpa_math"):
        torch_attn.attention(*(torch.zeros(1, 4, 1, 8),) * 3, full(4), impl="nope")
    with pytest.raises(ValueError, match="flex"):
        torch_attn.supports("nope", full(4))
    with pytest.raises(ValueError, match="flex"):
        torch_attn.describe("nope")
    assert issubclass(torch_attn.Unsupported, ValueError)


@pytest.mark.parametrize("impl", torch_attn.IMPLS)
def test_supports_answers_true_or_reason(impl):
    for _, build, hq, hkv, dtype in CASES:
        for device in ("cpu", "cuda"):
            answer = torch_attn.supports(
                impl, build(), dtype=dtype, heads_q=hq, heads_kv=hkv, head_dim=32, device=device
            )
            assert answer is True or (isinstance(answer, str) and answer), (impl, answer)
    assert torch_attn.describe(impl)


def test_unsupported_raises_before_work():
    mask = causal(64)
    q, k, v = (torch.randn(1, 64, 2, 32, requires_grad=True) for _ in range(3))
    with pytest.raises(torch_attn.Unsupported, match="needs CUDA"):
        torch_attn.attention(q, k, v, mask, impl="sdpa_efficient")
    with pytest.raises(torch_attn.Unsupported, match="backward on CPU"):
        torch_attn.attention(q, k, v, mask, impl="flex")
    assert q.grad is None and k.grad is None


def test_bad_heads_and_shapes_are_value_errors():
    mask = full(16)
    assert "multiple" in torch_attn.supports("naive", mask, heads_q=3, heads_kv=2)
    with pytest.raises(ValueError, match="multiple"):
        torch_attn.attention(torch.randn(1, 16, 3, 8), *(torch.randn(1, 16, 2, 8),) * 2, mask)
    with pytest.raises(ValueError, match="do not match the mask"):
        torch_attn.attention(*(torch.randn(1, 8, 2, 8),) * 3, mask)


def test_flash_impls_report_not_installed_or_need_cuda():
    mask = causal(64)
    for impl in ("flash2", "flash3", "flash4"):
        answer = torch_attn.supports(impl, mask, dtype=torch.bfloat16, device="cpu")
        assert isinstance(answer, str) and ("not installed" in answer or "CUDA" in answer)


class SparseTables(NamedTuple):
    """Stands in for flash-attn 4's BlockSparseTensorsTorch (same leading fields)."""

    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: torch.Tensor
    full_block_idx: torch.Tensor
    block_size: tuple[int, int]


def _tile_kinds(tables: SparseTables, rows: int, cols: int) -> torch.Tensor:
    """(rows, cols) blocks: 0 unlisted, 1 listed partial (mask_mod), 2 listed full."""
    kinds = torch.zeros(rows, cols, dtype=torch.int8)
    for kind, cnt, idx in ((1, tables.mask_block_cnt, tables.mask_block_idx),
                           (2, tables.full_block_cnt, tables.full_block_idx)):  # fmt: skip
        for r in range(rows):
            listed = idx[0, 0, r, : int(cnt[0, 0, r])].long()
            assert (kinds[r, listed] == 0).all(), "a block listed twice"
            kinds[r, listed] = kind
    return kinds


class Flash4Conventions:
    """flash-attn 4's two entry points computed densely in float64 with its conventions, so that
    the flash4 adapter's translation (mask -> causal/window_size/cu_seqlens or block-sparse
    tables with interval aux tensors, LSE layouts) runs on CPU: bottom-right causal and windows
    with None for an unbounded side; block sparsity: listed full blocks visible, listed partial
    blocks where the mask_mod (here: its interval semantics on the aux tensors) allows, the rest
    not; varlen inputs packed (total, H, D) with LSE (H, total), dense inputs with LSE (B, H, S);
    empty rows out 0, LSE -inf; always (out, lse)."""

    @staticmethod
    def _dense(q, k, v, visible, scale):
        group = q.shape[2] // k.shape[2]
        kr, vr = (x.repeat_interleave(group, dim=2) for x in (k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
        s = s.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        p = torch.where(visible, torch.exp(s - safe[..., None]), torch.zeros_like(s))
        return torch.einsum("bhqk,bkhd->bqhd", p, vr), lse

    @staticmethod
    def _block_sparse(sq, sk, mask_mod, aux_tensors, fwd, bwd):
        lo, hi = aux_tensors
        assert lo.dtype == hi.dtype == torch.int32 and lo.shape[0] % fwd.block_size[0] == 0
        assert mask_mod == ("interval mask_mod", lo.shape[1])
        bq, bk = fwd.block_size
        rows, cols = -(-sq // bq), -(-sk // bk)
        kinds = _tile_kinds(fwd, rows, cols)
        assert bwd.block_size == fwd.block_size
        assert torch.equal(_tile_kinds(bwd, cols, rows).T, kinds), "dK/dV tables differ"
        j = torch.arange(sk)[None, :, None]
        inside = ((j >= lo[:sq, None, :]) & (j < hi[:sq, None, :])).any(dim=-1)
        tile = kinds.repeat_interleave(bq, 0).repeat_interleave(bk, 1)[:sq, :sk]
        return (tile == 2) | ((tile == 1) & inside)

    def flash_attn_func(
        self, q, k, v, *, softmax_scale, causal=False, window_size=(None, None),
        mask_mod=None, aux_tensors=None, block_sparse_tensors=None,
        block_sparse_tensors_bwd=None, return_lse=False,
    ):  # fmt: skip
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq)[:, None] + (sk - sq)
        j = torch.arange(sk)[None, :]
        left, right = window_size
        visible = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            visible &= j <= i
        if left is not None:
            visible &= j >= i - left
        if right is not None:
            visible &= j <= i + right
        if block_sparse_tensors is not None:
            visible &= self._block_sparse(
                sq, sk, mask_mod, aux_tensors, block_sparse_tensors, block_sparse_tensors_bwd
            )
        out, lse = self._dense(q, k, v, visible, softmax_scale)
        return out, (lse if return_lse else None)

    def flash_attn_varlen_func(
        self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, causal, return_lse=False,
    ):  # fmt: skip
        assert torch.equal(cu_seqlens_q, cu_seqlens_k)
        cu = cu_seqlens_q.tolist()
        assert max(b - a for a, b in zip(cu[:-1], cu[1:])) == max_seqlen_q == max_seqlen_k
        outs, lses = [], []
        for a, b in zip(cu[:-1], cu[1:]):
            visible = torch.ones(b - a, b - a, dtype=torch.bool)
            if causal:
                visible = visible.tril()
            out, lse = self._dense(q[None, a:b], k[None, a:b], v[None, a:b], visible, softmax_scale)
            outs.append(out[0])
            lses.append(lse[0])
        return torch.cat(outs), (torch.cat(lses, dim=1) if return_lse else None)


# a general mask large enough for 128 x 128 tiles the block tables list as full
FLASH4_CASES = [*CASES, ("prefix_lm_full_tiles", lambda: prefix_lm(300, 200), 2, 1, F64)]


@pytest.mark.parametrize("case", FLASH4_CASES, ids=[c[0] for c in FLASH4_CASES])
def test_flash4_adapter_translates_masks_and_lse(case, monkeypatch):
    """The flash4 adapter on flash-attn 4's conventions, every mask (fixed patterns and block
    sparsity): out, the kernel's LSE (layouts of both entry points) and gradients of both against
    the float64 oracle (flash4 itself: GPU only)."""
    from torch_attn import api, flash

    monkeypatch.setattr(flash, "load", lambda impl: Flash4Conventions())
    monkeypatch.setattr(flash, "_block_sparse_type", lambda: SparseTables)
    monkeypatch.setattr(flash, "_interval_mask_mod", lambda width: ("interval mask_mod", width))
    adapter = api.ADAPTERS["flash4"]
    monkeypatch.setitem(api.ADAPTERS, "flash4", adapter.__class__(
        adapter.name, adapter.note, lambda mask, problem: True, adapter.run))  # fmt: skip
    _, build, hq, hkv, dtype = case
    mask = build()
    arrays = make_inputs(mask, hq, hkv, dtype, "flash4")
    dlse = _rng("flash4 dlse", case[0]).standard_normal((2, hq, mask.seqlen_q))
    ref = reference_attention(*arrays[:3], mask, dout=arrays[3])
    (q, k, v), (out, lse) = run("flash4", mask, arrays, dtype, grad=True)
    assert_close(out, ref.out, dtype, "out")
    assert_lse(lse, ref.lse, dtype)
    seen = torch.tensor(np.isfinite(ref.lse))
    dout, dlse = torch.tensor(arrays[3], dtype=dtype), torch.tensor(dlse, dtype=dtype)

    def loss(out, lse):  # rows that see no key: LSE -inf, no cotangent
        return (out * dout).sum() + (torch.where(seen, lse.to(dtype), 0.0) * dlse).sum()

    loss(out, lse).backward()
    # gradients of <out, dout> + <lse, dlse>: against the naive impl (itself oracle-checked above)
    (qn, kn, vn), (out_n, lse_n) = run("naive", mask, arrays, dtype, grad=True)
    loss(out_n, lse_n).backward()
    for got, want, what in ((q, qn, "dq"), (k, kn, "dk"), (v, vn, "dv")):
        assert_close(got.grad, want.grad.numpy(), dtype, what)


@pytest.mark.parametrize("impl", ["sdpa_efficient", "sdpa_cudnn"])
def test_cpu_sdpa_rejections_are_real(impl):
    """What supports() refuses on CPU, torch itself refuses."""
    assert isinstance(torch_attn.supports(impl, full(16), device="cpu"), str)
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(RuntimeError), sdpa_kernel(torch_attn.sdpa.BACKENDS[impl]):
        F.scaled_dot_product_attention(q, q, q)


def test_flex_backward_on_cpu_is_unsupported_but_no_grad_works():
    mask = band(64, 5, 0)
    assert "backward" in torch_attn.supports("flex", mask, device="cpu", mode="fwd_bwd")
    assert "backward" in torch_attn.supports("flex", mask, device="cpu", backward=True)
    assert torch_attn.supports("flex", mask, device="cpu") is True
    q, k, v = (torch.randn(1, 64, 2, 32, dtype=F64, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        out = torch_attn.attention(q, k, v, mask, impl="flex")
    ref = reference_attention(*(x.detach().numpy() for x in (q, k, v)), mask)
    assert_close(out, ref.out, F64, "out")


def test_sdpa_uses_mask_free_paths(monkeypatch):
    calls = []

    def record(*args, **kwargs):
        calls.append(kwargs)
        return F.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(torch_attn.sdpa, "F", SimpleNamespace(scaled_dot_product_attention=record))
    q = torch.randn(1, 64, 2, 16)
    for mask in (full(64), causal(64), causal(64, 80), prefix_lm(64, 9)):
        k = torch.randn(1, mask.seqlen_k, 2, 16)
        torch_attn.attention(q, k, k, mask, impl="sdpa_math")
    assert "attn_mask" not in calls[0] and not calls[0].get("is_causal")
    assert calls[1].get("is_causal") and "attn_mask" not in calls[1]
    assert calls[2]["attn_mask"].shape == (64, 80) and not calls[2].get("is_causal")
    assert calls[3]["attn_mask"].dtype == torch.bool


# ---------------------------------------------------------------- classification


def pattern_dense(p: MaskPattern) -> np.ndarray:
    """The visible set a fixed-mask kernel computes for this pattern (flash-attn semantics)."""
    i = np.arange(p.seqlen_q)[:, None]
    j = np.arange(p.seqlen_k)[None, :]
    if p.window is not None:
        left, right = p.window
        diag = i + p.seqlen_k - p.seqlen_q
        ok = np.ones((p.seqlen_q, p.seqlen_k), bool)
        if left >= 0:
            ok &= j >= diag - left
        if right >= 0:
            ok &= j <= diag + right
        return ok
    cu = p.cu_seqlens
    doc_i = np.searchsorted(cu, i, side="right")
    doc_j = np.searchsorted(cu, j, side="right")
    return (doc_i == doc_j) & ((j <= i) if p.kind == "causal_document" else True)


@pytest.mark.parametrize(
    "mask, kind, window",
    [
        (full(64), "full", (-1, -1)),
        (full(64, 100), "full", (-1, -1)),
        (causal(64), "causal", (-1, 0)),
        (causal(100, 64), "causal", (-1, 0)),
        (causal(64, 100), "causal", (-1, 0)),
        (band(100, 9, 0), "window", (9, 0)),
        (band(100, 9, 9), "window", (9, 9)),
        (band(100, 0, 4), "window", (0, 4)),
        (band(100, 200, 0), "causal", (-1, 0)),
        (band(100, 200, 200), "full", (-1, -1)),
        (from_slices([[0, 64]], [[0, 130]], [BICAUSAL], 64, 130), "window", (66, 0)),
        (documents([0, 10, 64], FULL), "full_document", None),
        (documents([0, 10, 11, 64], CAUSAL), "causal_document", None),
        (prefix_lm(64, 10), "general", None),
        (uncovered_rows(64), "general", None),
        (random_slices(100, 100, 5), "general", None),
    ],
)
def test_classify(mask, kind, window):
    p = classify(mask)
    assert p.kind == kind
    assert p.window == window
    if kind != "general":
        np.testing.assert_array_equal(pattern_dense(p), mask.dense())


def test_classify_ignores_how_slices_are_cut():
    halves = from_slices([[0, 64], [0, 64]], [[0, 30], [30, 80]], [FULL, FULL], 64, 80)
    assert classify(halves).kind == "full"
    # causal as 4 row blocks: CAUSAL top block + FULL|CAUSAL splits below
    pieces = from_slices(
        [[0, 16], [16, 64], [16, 64]], [[0, 16], [0, 16], [16, 64]], [CAUSAL, FULL, CAUSAL], 64
    )
    assert classify(pieces).kind == "causal"
    docs = documents([0, 20, 64], FULL)
    split = from_slices([[0, 20], [0, 20], [20, 64]], [[0, 7], [7, 20], [20, 64]], [0, 0, 0], 64)
    assert classify(split).kind == "full_document"
    np.testing.assert_array_equal(classify(split).cu_seqlens, classify(docs).cu_seqlens)


# ---------------------------------------------------------------- mask tensors and BlockMask


def test_dense_and_intervals_match_mask():
    mask = random_slices(130, 100, 4)
    np.testing.assert_array_equal(mask_utils.dense_mask(mask, CPU).numpy(), mask.dense())
    lo, hi = mask_utils.interval_tensors(mask, CPU, min_width=5, rows_to=128)
    assert lo.shape == (256, 5) and (lo[130:] == hi[130:]).all()
    vis = mask_utils.visible_from_intervals(lo, hi, 100)[:130]
    np.testing.assert_array_equal(vis.numpy(), mask.dense())
    np.testing.assert_array_equal(
        mask_utils.empty_rows(mask, CPU).numpy(), ~mask.dense().any(axis=1)
    )
    assert mask_utils.dense_mask(mask, CPU) is mask_utils.dense_mask(mask, CPU)


@pytest.mark.parametrize(
    "mask",
    [random_slices(300, 200, 8), band(300, 40, 40), documents([0, 100, 256, 300], CAUSAL)],
    ids=["random", "band", "docs"],
)
def test_flex_block_tables(mask):
    tables = flex_block_tables(mask)
    bm = mask.block_map(128, 128)
    dense = mask.dense()
    nq, nk = bm.shape
    partial = np.zeros((nq, nk), bool)
    full_t = np.zeros((nq, nk), bool)
    for qb in range(nq):
        partial[qb, tables["kv_indices"][0, 0, qb, : tables["kv_num_blocks"][0, 0, qb]]] = True
        n = tables["full_kv_num_blocks"][0, 0, qb]
        full_t[qb, tables["full_kv_indices"][0, 0, qb, :n]] = True
    assert not (partial & full_t).any()
    np.testing.assert_array_equal(partial | full_t, bm > 0)
    for qb, kb in zip(*np.nonzero(full_t)):
        tile = dense[qb * 128 : (qb + 1) * 128, kb * 128 : (kb + 1) * 128]
        assert tile.shape == (128, 128) and tile.all()  # full tiles are whole and all visible
    for kb in range(nk):
        rows = tables["q_indices"][0, 0, kb, : tables["q_num_blocks"][0, 0, kb]]
        np.testing.assert_array_equal(np.sort(rows), np.nonzero(partial[:, kb])[0])
        rows = tables["full_q_indices"][0, 0, kb, : tables["full_q_num_blocks"][0, 0, kb]]
        np.testing.assert_array_equal(np.sort(rows), np.nonzero(full_t[:, kb])[0])
    block_mask = flex_block_mask(mask, CPU)
    np.testing.assert_array_equal(block_mask.to_dense()[0, 0].numpy() > 0, bm > 0)
    assert set(TABLE_NAMES) == set(tables)


def test_flex_compiled_cpu_matches_and_never_recompiles_on_mask_switch():
    """The compiled CPU kernel (fp32, no LSE) uses the block tables and the interval mask_mod."""
    from torch._dynamo.utils import counters

    s = 300  # 3 x 3 tiles of 128 with ragged edges
    masks = [
        causal(s),
        documents([0, 100, 256, 300], CAUSAL),
        band(s, 40, 40),
        prefix_lm(s, 77),
        uncovered_rows(s),
    ]
    assert all(m.row_intervals()[0].shape[1] <= 3 for m in masks)
    graphs = None
    for i, mask in enumerate([*masks, random_slices(s, s, 9)]):
        arrays = make_inputs(mask, 4, 2, F32, "compiled")
        q, k, v = (torch.tensor(a, dtype=F32) for a in arrays[:3])
        assert flex_impl.uses_compiled(q, return_lse=False)
        out = torch_attn.attention(q, k, v, mask, impl="flex")
        assert_close(out, reference_attention(*arrays[:3], mask).out, F32, mask.name)
        assert flex_impl.cpu_compile_error() is None
        if i == 0:
            graphs = counters["stats"]["unique_graphs"]
        elif i < len(masks):
            assert counters["stats"]["unique_graphs"] == graphs, f"recompiled for {mask.name}"


# ---------------------------------------------------------------- the 14 generator masks


def _generated(name: str, seqlen: int) -> Mask:
    params = {"block_size": 32} if name == "block_causal_document" else {}
    return make_mask(name, seqlen, window=16, **params)


@pytest.mark.skipif(make_mask is None, reason="attn_masks.generators not available")
@pytest.mark.parametrize("name", MASK_NAMES)
def test_generator_masks_classify(name):
    mask = _generated(name, 256)
    p = classify(mask)
    expected = {
        "full": {"full"},
        "causal": {"causal"},
        "sliding_window_causal": {"window"},
        "sliding_window": {"window"},
        "full_document": {"full_document", "full"},
        "causal_document": {"causal_document", "causal"},
    }
    assert p.kind in expected.get(name, set(KINDS))
    if name == "sliding_window":
        assert p.window == (16, 16)
    if name == "sliding_window_causal":
        assert p.window == (16, 0)
    if p.kind != "general":
        np.testing.assert_array_equal(pattern_dense(p), mask.dense())


@pytest.mark.skipif(make_mask is None, reason="attn_masks.generators not available")
@pytest.mark.parametrize("impl", ["naive", "sdpa_math", "sdpa_flash", "flex"])
@pytest.mark.parametrize("name", MASK_NAMES)
def test_generator_masks_match_reference(impl, name):
    mask = _generated(name, 192)
    arrays = make_inputs(mask, 4, 2, F64, impl, batch=1)
    ref = reference_attention(*arrays[:3], mask, dout=arrays[3])
    grad = cpu_backward(impl)
    (q, k, v), (out, lse) = run(impl, mask, arrays, F64, grad=grad)
    assert_close(out, ref.out, F64, "out")
    assert_lse(lse, ref.lse, F64)
    if grad:
        out.backward(torch.tensor(arrays[3]))
        for x, want, what in ((q, ref.dq, "dq"), (k, ref.dk, "dk"), (v, ref.dv, "dv")):
            assert_close(x.grad, want, F64, what)


# ---------------------------------------------------------------- GPU (skipped without CUDA)


GPU_MASKS = [
    ("full", lambda: full(512)),
    ("causal", lambda: causal(512)),
    ("causal_384x512", lambda: causal(384, 512)),
    ("causal_512x384_empty_rows", lambda: causal(512, 384)),
    ("window_causal", lambda: band(512, 100, 0)),
    ("window_two_sided", lambda: band(512, 64, 64)),
    ("full_document", lambda: documents([0, 100, 101, 300, 512], FULL)),
    ("causal_document", lambda: documents([0, 200, 333, 512], CAUSAL)),
    ("prefix_lm", lambda: prefix_lm(512, 130)),
    ("uncovered_rows", lambda: uncovered_rows(512)),
    ("random", lambda: random_slices(512, 384, 21)),
]


def _rel_err(got: torch.Tensor, want: np.ndarray) -> float:
    got = got.detach().to(F64).cpu().numpy()
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))


# Every mask in bf16; the masks that exercise ragged, empty and multi-interval rows in the
# other dtypes (one test per impl and dtype, masks inside: the suite fits a few GPU minutes).
GPU_MASKS_BY_DTYPE = {
    torch.bfloat16: [c[0] for c in GPU_MASKS],
    torch.float16: ["causal_512x384_empty_rows", "window_two_sided", "causal_document", "random"],
    torch.float32: ["causal_384x512", "full_document", "random"],
}


def _check_on_gpu(impl: str, name: str, mask, dtype: torch.dtype) -> list[str]:
    """What differs from the float64 oracle (out, lse, gradients) for one mask; [] if nothing."""
    hq, hkv, d = 8, 2, 64
    verdict = torch_attn.supports(
        impl,
        mask,
        dtype=dtype,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=d,
        device="cuda",
        mode="fwd_bwd",
    )
    rng = _rng("gpu", impl, name, str(dtype))
    shapes = [(2, mask.seqlen_q, hq, d), (2, mask.seqlen_k, hkv, d), (2, mask.seqlen_k, hkv, d)]
    tensors = [torch.tensor(rng.standard_normal(s)).to(dtype).cuda() for s in shapes]
    q, k, v = (t.requires_grad_() for t in tensors)
    if verdict is not True:
        with pytest.raises(torch_attn.Unsupported, match=".+"):
            torch_attn.attention(q, k, v, mask, impl=impl)
        return []
    dout = torch.tensor(rng.standard_normal(q.shape)).to(dtype).cuda()
    arrays = [t.detach().to(F64).cpu().numpy() for t in (q, k, v, dout)]
    ref = reference_attention(*arrays[:3], mask, dout=arrays[3])
    out, lse = torch_attn.attention(q, k, v, mask, impl=impl, return_lse=True)
    out.backward(dout)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    wrong = []
    if not _rel_err(out, ref.out) < tol:
        wrong.append(f"out {_rel_err(out, ref.out):.2e}")
    got_lse = lse.detach().to(F64).cpu().numpy()
    seen = np.isfinite(ref.lse)
    if not np.array_equal(np.isneginf(got_lse), ~seen):
        wrong.append("lse: -inf rows differ")
    elif not np.allclose(got_lse[seen], ref.lse[seen], atol=1e-2, rtol=0):
        wrong.append(f"lse max err {np.abs(got_lse[seen] - ref.lse[seen]).max():.2e}")
    for n, x, want in (("dq", q, ref.dq), ("dk", k, ref.dk), ("dv", v, ref.dv)):
        err = _rel_err(x.grad, want) if torch.isfinite(x.grad).all() else float("inf")
        if not err < 3 * tol:
            wrong.append(f"{n} {err:.2e}")
    return [f"{name}: {', '.join(wrong)}"] if wrong else []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_MASKS_BY_DTYPE))
@pytest.mark.parametrize("impl", torch_attn.IMPLS)
def test_gpu_matches_reference(impl, dtype):
    masks = dict(GPU_MASKS)
    wrong = []
    for name in GPU_MASKS_BY_DTYPE[dtype]:
        wrong += _check_on_gpu(impl, name, masks[name](), dtype)
    assert not wrong, f"{impl} {dtype}: " + "; ".join(wrong)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", torch_attn.IMPLS)
def test_gpu_effective_mask(impl):
    ran = 0
    for name, make in GPU_MASKS:
        ran += _probe_effective_mask_on_gpu(impl, name, make())
    if ran == 0:
        pytest.skip(f"{impl} supports none of the masks on this GPU")


def _probe_effective_mask_on_gpu(impl: str, name: str, mask) -> bool:
    """The keys each row attends to, probed through V, equal the mask (False: unsupported)."""
    dtype = torch.float16
    if torch_attn.supports(impl, mask, dtype=dtype, head_dim=64, device="cuda") is not True:
        return False
    rng = _rng("gpu-probe", impl, name)
    d = 64
    q = (0.1 * torch.tensor(rng.standard_normal((1, mask.seqlen_q, 2, d)))).to(dtype).cuda()
    k = (0.1 * torch.tensor(rng.standard_normal((1, mask.seqlen_k, 2, d)))).to(dtype).cuda()
    seen = np.zeros((2, mask.seqlen_q, mask.seqlen_k), bool)
    for start in range(0, mask.seqlen_k, d):
        cols = np.arange(start, min(start + d, mask.seqlen_k))
        v = torch.zeros(1, mask.seqlen_k, 2, d, dtype=dtype, device="cuda")
        v[0, cols, :, cols - start] = 1.0
        with torch.no_grad():
            out = torch_attn.attention(q, k, v, mask, impl=impl)
        seen[:, :, cols] = out[0, :, :, : len(cols)].permute(1, 0, 2).float().cpu().numpy() > 0
    for head in range(2):
        np.testing.assert_array_equal(seen[head], mask.dense(), f"{impl} {name} head {head}")
    return True


@pytest.mark.gpu
def test_gpu_flex_no_recompile_across_masks_and_grad_modes():
    from torch._dynamo.utils import counters

    masks = [causal(512), band(512, 64, 64), documents([0, 200, 333, 512], CAUSAL)]
    shape = (1, 512, 4, 64)
    for step in range(2):
        for mask in masks:
            for grad in (False, True):
                q, k, v = (
                    torch.randn(shape, dtype=torch.bfloat16, device="cuda", requires_grad=grad)
                    for _ in range(3)
                )
                out = torch_attn.attention(q, k, v, mask, impl="flex")
                if grad:
                    out.sum().backward()
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_each_adapter_answers_and_runs_for_its_own_impl():
    """The registry routes every name to its own backend: the CUDA-only SDPA backends and each
    flash-attn generation give their own reason on CPU, and every SDPA name that runs on CPU
    matches naive on a causal mask."""
    mask = causal(16)
    kw = dict(dtype=torch.float32, heads_q=2, heads_kv=2, head_dim=32, device="cpu")
    for impl in ("sdpa_efficient", "sdpa_cudnn"):
        assert torch_attn.supports(impl, mask, **kw).startswith(f"{impl} needs CUDA")
    flash_reasons = {torch_attn.supports(i, mask, **kw) for i in ("flash2", "flash3", "flash4")}
    assert all(isinstance(r, str) for r in flash_reasons) and len(flash_reasons) == 3
    q, k, v = (
        torch.randn(1, 16, 2, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    want = torch_attn.attention(q.double(), k.double(), v.double(), mask, impl="naive")
    for impl in ("sdpa", "sdpa_math", "sdpa_flash"):
        got = torch_attn.attention(q, k, v, mask, impl=impl)
        assert torch.allclose(got.double(), want, atol=1e-5), impl
