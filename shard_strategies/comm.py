"""Communication volume per rank by the published per-device formulas (docs/context_parallel.md,
Communication volume); what our executors move is counted from the plan (`plan.comm_volume`).

Formula (t tokens, U x R ranks, heads hq/hkv, head dim d; hkv' = hkv repeated up to U):
Ulysses part (U-1)/U^2 * (t/R) * d * (2 hq + 2 hkv) per pass, ring part (R-1)/R * t * 2 hkv'/U * d
forward and twice that backward. U = N gives the Ulysses formula, U = 1 the ring one.
"""

from __future__ import annotations

FP32_BYTES = 4  # gradients of K and V travel in fp32


def formula_elements(
    seqlen: int, ulysses_size: int, ring_size: int, hq: int, hkv: int, d: int
) -> tuple[float, float]:
    """(fwd, bwd) elements per rank by the published per-device formulas, composed for U x R."""
    u, r, t = ulysses_size, ring_size, seqlen
    hkv_eff = max(hkv, u)
    ulysses = (u - 1) / u**2 * (t / r) * d * (2 * hq + 2 * hkv)
    ring = (r - 1) / r * t * 2 * hkv_eff / u * d
    return ulysses + ring, ulysses + 2 * ring
