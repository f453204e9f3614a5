"""Float64 numpy attention with GQA: the oracle every implementation is tested against."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .mask import Mask
from .shapes import check_attention_shapes


@dataclass(frozen=True)
class ReferenceResult:
    """Output (B,Sq,Hq,D), LSE (B,Hq,Sq) in natural log (-inf on empty rows), and gradients."""

    out: np.ndarray
    lse: np.ndarray
    dq: np.ndarray | None = None
    dk: np.ndarray | None = None
    dv: np.ndarray | None = None


def default_scale(head_dim: int) -> float:
    """The softmax scale every impl applies unless given one: 1 / sqrt(head_dim)."""
    return 1.0 / float(np.sqrt(head_dim))


def reference_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: Mask,
    *,
    scale: float | None = None,
    dout: np.ndarray | None = None,
) -> ReferenceResult:
    """Exact attention in float64 on the dense mask; with `dout`, also dq, dk, dv.

    Rows that see no key give output 0 and LSE -inf (and zero gradients), never NaN; a row
    that reads a NaN input is NaN (docs/api.md, Non-finite inputs).
    """
    group = check_attention_shapes(np.shape(q), np.shape(k), np.shape(v), mask)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    kr = np.repeat(k, group, axis=2)
    vr = np.repeat(v, group, axis=2)
    visible = mask.dense()[None, None]
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.where(visible, np.exp(s - m_safe), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    seen = visible.any(axis=-1, keepdims=True)  # from the mask, so a NaN input stays NaN
    p = np.where(seen, e / np.where(seen, denom, 1.0), 0.0)
    lse = np.where(
        seen[..., 0], m_safe[..., 0] + np.log(np.where(seen, denom, 1.0)[..., 0]), -np.inf
    )
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    if dout is None:
        return ReferenceResult(out, lse)
    do = np.asarray(dout, np.float64)
    dvr = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vr)
    delta = np.einsum("bqhd,bqhd->bhq", do, out)[..., None]
    ds = p * (dp - delta)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dkr = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    b, sk, hkv, d = k.shape
    dk = dkr.reshape(b, sk, hkv, group, d).sum(axis=3)
    dv = dvr.reshape(b, sk, hkv, group, d).sum(axis=3)
    return ReferenceResult(out, lse, dq, dk, dv)
