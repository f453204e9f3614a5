"""The float64 oracle: checked against a per-row loop, finite differences and FLOP rules."""

import numpy as np
import pytest

from attn_masks import MaskType, attention_flops, from_slices, reference_attention


def loop_attention(q, k, v, dense, scale):
    """Independent row-by-row softmax attention (GQA by head index arithmetic)."""
    b, sq, hq, d = q.shape
    group = hq // k.shape[2]
    out = np.zeros_like(q)
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            for i in range(sq):
                keys = np.nonzero(dense[i])[0]
                if keys.size == 0:
                    continue
                s = k[bi, keys, h // group] @ q[bi, i, h] * scale
                mx = s.max()
                w = np.exp(s - mx)
                lse[bi, h, i] = mx + np.log(w.sum())
                out[bi, i, h] = (w / w.sum()) @ v[bi, keys, h // group]
    return out, lse


def sample_mask():
    # doc 0 causal, rows 20..27 see nothing, rows 28..40 see a window of doc 0 and themselves
    return from_slices(
        [[0, 20], [28, 40], [28, 40]],
        [[0, 20], [0, 10], [28, 40]],
        [MaskType.CAUSAL, MaskType.FULL, MaskType.CAUSAL],
        40,
        40,
    )


@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2), (4, 1)])
def test_forward_matches_loop(hq, hkv):
    rng = np.random.default_rng(hq * 10 + hkv)
    mask = sample_mask()
    q = rng.standard_normal((2, 40, hq, 8))
    k = rng.standard_normal((2, 40, hkv, 8))
    v = rng.standard_normal((2, 40, hkv, 8))
    res = reference_attention(q, k, v, mask, scale=0.3)
    out, lse = loop_attention(q, k, v, mask.dense(), 0.3)
    np.testing.assert_allclose(res.out, out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(res.lse), np.isinf(lse))
    finite = np.isfinite(lse)
    np.testing.assert_allclose(res.lse[finite], lse[finite], rtol=1e-12)
    assert np.all(res.out[:, 20:28] == 0) and np.all(np.isneginf(res.lse[:, :, 20:28]))


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(3)
    mask = sample_mask()
    q = rng.standard_normal((1, 40, 4, 4))
    k = rng.standard_normal((1, 40, 2, 4))
    v = rng.standard_normal((1, 40, 2, 4))
    do = rng.standard_normal(q.shape)
    res = reference_attention(q, k, v, mask, dout=do)
    assert not any(np.isnan(g).any() for g in (res.dq, res.dk, res.dv))

    def loss(q_, k_, v_):
        return float((reference_attention(q_, k_, v_, mask).out * do).sum())

    eps = 1e-6
    for name, x, grad in (("q", q, res.dq), ("k", k, res.dk), ("v", v, res.dv)):
        for _ in range(6):
            idx = tuple(int(rng.integers(0, n)) for n in x.shape)
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args_p = {"q": (xp, k, v), "k": (q, xp, v), "v": (q, k, xp)}[name]
            args_m = {"q": (xm, k, v), "k": (q, xm, v), "v": (q, k, xm)}[name]
            fd = (loss(*args_p) - loss(*args_m)) / (2 * eps)
            assert abs(fd - grad[idx]) < 1e-6 * max(1.0, abs(fd)), (name, idx, fd, grad[idx])


def test_shape_errors():
    mask = sample_mask()
    q = np.ones((1, 40, 3, 4))
    kv = np.ones((1, 40, 2, 4))
    with pytest.raises(ValueError, match="Hq=3 must be a multiple of Hkv=2"):
        reference_attention(q, kv, kv, mask)
    with pytest.raises(ValueError, match="do not match the mask"):
        reference_attention(np.ones((1, 39, 2, 4)), kv, kv, mask)


def test_flops_rules():
    n = 8192
    causal = from_slices([[0, n]], [[0, n]], [MaskType.CAUSAL], n)
    fwd = attention_flops(causal, 64, 128, "fwd")
    assert fwd == 4 * (n * (n + 1) // 2) * 64 * 128
    assert abs(fwd / 1e12 - 1.0996) < 1e-4  # docs/masks.md, Reference values
    assert attention_flops(causal, 64, 128, "bwd") == 2.5 * fwd
    assert attention_flops(causal, 64, 128, "fwd_bwd", batch=3) == 3 * 3.5 * fwd
    with pytest.raises(ValueError, match="mode must be one of"):
        attention_flops(causal, 64, 128, "backward")
    with pytest.raises(ValueError, match="head_dim must be positive, got 0"):
        attention_flops(causal, 64, 0)
