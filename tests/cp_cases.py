"""Masks for the context-parallel tests (numpy only): every generator plus hand-made edge cases."""

from __future__ import annotations

import numpy as np

from attn_masks import Mask, MaskType, from_slices
from attn_masks.generators import MASK_NAMES, make_mask

DOC_MASKS = {
    "full_document",
    "causal_document",
    "share_question",
    "causal_blockwise",
    "prefix_lm_document",
    "full_document_long",
    "causal_document_long",
}


def doc_lengths(seqlen: int) -> list[int]:
    """Four uneven documents (odd lengths, so per-document zigzag pads)."""
    a, b, c = seqlen * 23 // 100, seqlen * 41 // 100, seqlen * 9 // 100
    return [a, b, c, seqlen - a - b - c]


def named_mask(name: str, seqlen: int, seed: int = 0) -> Mask:
    """make_mask with parameters that give several documents and short windows at small sizes."""
    window = max(2, seqlen // 10)
    if name in DOC_MASKS:
        return make_mask(name, seqlen, seed=seed, window=window, seqlens=doc_lengths(seqlen))
    if name == "block_causal_document":
        block = next(b for b in (16, 10, 8, 5, 4, 2, 1) if seqlen % b == 0)
        return make_mask(name, seqlen, seed=seed, block_size=block)
    if name == "prefix_lm_causal":
        return make_mask(name, seqlen, seed=seed, prefix_length=seqlen // 3)
    return make_mask(name, seqlen, seed=seed, window=window)


def random_slices_mask(seqlen: int, seed: int) -> Mask:
    """Random typed slices over disjoint row ranges, some rows left with no key at all."""
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate([[0, seqlen], rng.integers(1, seqlen, 6)]))
    q, k, t = [], [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if rng.random() < 0.2:
            continue
        k0, k1 = np.sort(rng.integers(0, seqlen + 1, 2))
        if k1 == k0:
            k1 = min(seqlen, k0 + 1)
            k0 = k1 - 1
        q.append([a, b])
        k.append([k0, k1])
        t.append(int(rng.integers(0, 4)))
    return from_slices(q, k, t, seqlen, seqlen, name=f"random{seed}")


def empty_rows_mask(seqlen: int) -> Mask:
    """Causal slices with more rows than keys (bottom-right aligned: top rows empty) + a gap."""
    h = seqlen // 2
    c = int(MaskType.CAUSAL)
    return from_slices(
        [[0, h], [h + 5, seqlen]],
        [[0, h // 3], [h, seqlen - 7]],
        [c, c],
        seqlen,
        seqlen,
        name="empty_rows",
    )


def all_masks(seqlen: int) -> dict[str, Mask]:
    """The 14 named masks plus a random slice list and a mask with empty rows."""
    out = {name: named_mask(name, seqlen) for name in MASK_NAMES}
    out["random_slices"] = random_slices_mask(seqlen, seed=3)
    out["empty_rows"] = empty_rows_mask(seqlen)
    return out


def assert_close(got, want, what: str, *, tol: float) -> None:
    """got has want's shape, is finite, and is within tol of it relative to want's largest
    magnitude (every element checked)."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what} is not finite"
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6)
    assert err < tol, f"{what}: relative error {err:.2e}"


def brute_dense(q_ranges, k_ranges, types, sq, sk):
    """Visible (q, k) pairs built straight from the slice types of docs/masks.md, independent of
    attn_masks' own dense builders: the reference of the mask tests."""
    out = np.zeros((sq, sk), bool)
    for (q0, q1), (k0, k1), t in zip(q_ranges, k_ranges, types):
        lq, lk = q1 - q0, k1 - k0
        r = np.arange(lq)[:, None]
        c = np.arange(lk)[None, :]
        vis = {
            MaskType.FULL: np.ones((lq, lk), bool),
            MaskType.CAUSAL: c <= r + (lk - lq),
            MaskType.INVCAUSAL: c >= r,
            MaskType.BICAUSAL: (c >= r) & (c <= r + (lk - lq)),
        }[MaskType(t)]
        out[q0:q1, k0:k1] |= vis
    return out
