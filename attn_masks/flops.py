"""FLOP accounting from the exact mask area (docs/masks.md): useful work only, no padding credit."""

from __future__ import annotations

from .mask import Mask

MODE_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
MODES = tuple(MODE_FACTORS)  # what a call differentiates: forward, backward, or both


def attention_flops(
    mask: Mask, num_heads_q: int, head_dim: int, mode: str = "fwd", batch: int = 1
) -> float:
    """FLOPs of one attention call: fwd 4*area*Hq*D*B; bwd 2.5x that; fwd_bwd 3.5x."""
    if mode not in MODE_FACTORS:
        raise ValueError(f"mode must be one of {sorted(MODE_FACTORS)}, got {mode!r}")
    for what, v in (("num_heads_q", num_heads_q), ("head_dim", head_dim), ("batch", batch)):
        if v <= 0:
            raise ValueError(f"{what} must be positive, got {v}")
    return 4.0 * mask.area() * num_heads_q * head_dim * batch * MODE_FACTORS[mode]
