"""The shape contract of attention inputs, checked the same way by the oracle and adapters."""

from __future__ import annotations

from collections.abc import Sequence

from .mask import Mask


def check_attention_shapes(
    q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], mask: Mask
) -> int:
    """The GQA group Hq // Hkv; ValueError unless q (B,Sq,Hq,D) and k, v (B,Sk,Hkv,D) match each
    other and the mask (Sq x Sk; anything with seqlen_q and seqlen_k, such as a kernel's mask
    arrays) and Hq is a multiple of Hkv."""
    q, k, v = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    if len(q) != 4 or len(k) != 4 or v != k:
        raise ValueError(f"expected q (B,Sq,Hq,D), k and v (B,Sk,Hkv,D); got {q}, {k}, {v}")
    if q[0] != k[0] or q[3] != k[3]:
        raise ValueError(f"q and k must share batch and head dim; got {q} and {k}")
    if q[1] != mask.seqlen_q or k[1] != mask.seqlen_k:
        raise ValueError(
            f"sequence lengths (Sq={q[1]}, Sk={k[1]}) do not match the mask "
            f"({mask.seqlen_q} x {mask.seqlen_k})"
        )
    if q[2] % k[2]:
        raise ValueError(f"Hq={q[2]} must be a multiple of Hkv={k[2]}")
    return q[2] // k[2]
