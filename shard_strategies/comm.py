"""Communication volume per rank: the published per-device formulas next to what our executors
move (docs/context_parallel.md, Communication volume).

Formula (t tokens, U x R ranks, heads hq/hkv, head dim d; hkv' = hkv repeated up to U):
Ulysses part (U-1)/U^2 * (t/R) * d * (2 hq + 2 hkv) per pass, ring part (R-1)/R * t * 2 hkv'/U * d
forward and twice that backward. U = N gives the Ulysses formula, U = 1 the ring one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .schedules import transfer_counts
from .strategies import ALLGATHER_CORE

if TYPE_CHECKING:
    from .plan import CPPlan

FP32_BYTES = 4


def formula_elements(
    seqlen: int, ulysses_size: int, ring_size: int, hq: int, hkv: int, d: int
) -> tuple[float, float]:
    """(fwd, bwd) elements per rank by the published per-device formulas, composed for U x R."""
    u, r, t = ulysses_size, ring_size, seqlen
    hkv_eff = max(hkv, u)
    ulysses = (u - 1) / u**2 * (t / r) * d * (2 * hq + 2 * hkv)
    ring = (r - 1) / r * t * 2 * hkv_eff / u * d
    return ulysses + ring, ulysses + 2 * ring


def comm_volume(
    plan: CPPlan, hq: int, hkv: int, d: int, *, itemsize: int = 2, batch: int = 1
) -> dict[str, float]:
    """Per-rank fwd/bwd volume: formula elements/bytes and the executor's actual ones.

    Actual: Ulysses all-to-alls of q, k, v, out (fwd) and dout, dq, dk, dv (bwd) with padded
    lengths and replicated K/V heads; ring K/V transfers of the kept steps (dK/dV travel in fp32);
    all-gather of K/V and reduce-scatter of dK/dV. The LSE all-to-all (return_lse) is left out.
    """
    u, r = plan.ulysses_size, plan.ring_size
    hkv_eff = max(hkv, u)
    lu, length = plan.local_len, plan.shard_len
    f_fwd, f_bwd = formula_elements(plan.seqlen, u, r, hq, hkv, d)
    fwd = bwd = 0.0
    dkv_elems = 0.0
    if u > 1:
        per_pass = (u - 1) / u * lu * d * (2 * hq + 2 * hkv_eff)
        fwd += per_pass
        bwd += per_pass
    block = length * (hkv_eff // u) * d * 2
    if plan.core == ALLGATHER_CORE:
        fwd += (r - 1) * block
        bwd += (r - 1) * block
    elif plan.is_ring:
        counts = transfer_counts([(s.outer, s.inner) for s in plan.steps], r, plan.num_windows)
        fwd += counts["fwd_kv"] * block
        bwd += counts["bwd_kv"] * block
        dkv_elems = counts["bwd_dkv"] * block
    return {
        "fwd_formula_elements": f_fwd * batch,
        "bwd_formula_elements": f_bwd * batch,
        "fwd_formula_bytes": f_fwd * batch * itemsize,
        "bwd_formula_bytes": f_bwd * batch * itemsize,
        "fwd_elements": fwd * batch,
        "bwd_elements": (bwd + dkv_elems) * batch,
        "fwd_bytes": fwd * batch * itemsize,
        "bwd_bytes": (bwd * itemsize + dkv_elems * FP32_BYTES) * batch,
    }
