"""Masked softmax and log-sum-exp that stay finite on rows with no visible key.

`masked_softmax` is the naive kernel's core. `masked_lse` is the separate LSE pass for kernels
whose API returns no LSE (SDPA, flash-attn): one extra QK^T, chunked over query rows so it never
holds more than about 2^26 scores at once, masked from the per-row intervals, GQA without
repeating K. Both are differentiable; empty rows give probability 0 / LSE -inf and zero
gradients, never NaN.
"""

from __future__ import annotations

import torch

from attn_masks import Mask

from .common import work_dtype
from .mask_utils import interval_tensors, visible_from_intervals

CHUNK_ELEMENTS = 1 << 26


def masked_softmax(
    scores: torch.Tensor, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, lse) of scores (..., Sq, Sk) where `visible` (Sq, Sk) allows a key."""
    neg_inf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    row_max = torch.where(visible, scores, neg_inf).amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(torch.where(visible, scores - row_max, neg_inf))
    denom = e.sum(dim=-1, keepdim=True)
    seen = denom > 0
    safe = torch.where(seen, denom, torch.ones_like(denom))
    lse = torch.where(seen, row_max + torch.log(safe), neg_inf)
    return e / safe, lse[..., 0]


def masked_lse(q: torch.Tensor, k: torch.Tensor, mask: Mask, scale: float) -> torch.Tensor:
    """LSE (B, Hq, Sq) in natural log of scale * q k^T over the mask's visible keys."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    dtype = work_dtype(q.dtype)
    qg = q.to(dtype).reshape(b, sq, hkv, hq // hkv, d)
    kk = k.to(dtype)
    lo, hi = interval_tensors(mask, q.device)
    rows = max(1, CHUNK_ELEMENTS // max(1, b * hq * sk))
    parts = []
    for start in range(0, sq, rows):
        stop = min(sq, start + rows)
        scores = torch.einsum("bqhgd,bkhd->bhgqk", qg[:, start:stop], kk) * scale
        visible = visible_from_intervals(lo[start:stop], hi[start:stop], sk)
        parts.append(masked_softmax(scores, visible)[1])
    return torch.cat(parts, dim=-1).reshape(b, hq, sq)
