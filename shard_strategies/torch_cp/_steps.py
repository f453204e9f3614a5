"""What one rank computes: per step, the query rows and K/V columns a mask piece touches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_masks import Mask

from ._local import LseMerge, fused, local_attention, safe_lse, step_cotangents


@dataclass(frozen=True)
class Piece:
    """Local query rows x buffer key columns that see anything, and the mask between them.

    Trimming to the rows and columns that see anything saves the dense kernels the empty part
    (e.g. the half blocks of a zigzag causal ring); FlexAttention skips it by itself.
    """

    rows: slice
    cols: slice
    mask: Mask


def forward_step(
    merge: LseMerge,
    q: torch.Tensor,
    kv: torch.Tensor,
    piece: Piece | None,
    scale: float,
    impl: str,
) -> None:
    """Attend q's piece rows to the piece columns of kv (2,B,L,H,D) and fold into `merge`."""
    if piece is None:
        return
    out, lse = local_attention(
        q[:, piece.rows],
        kv[0][:, piece.cols],
        kv[1][:, piece.cols],
        piece.mask,
        scale=scale,
        impl=impl,
    )
    merge.add(piece.rows, out, lse)


@dataclass
class Cotangents:
    """Global-row quantities every step's backward needs: dO, LSE (finite), delta, dLSE."""

    dout: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    dlse: torch.Tensor | None

    @classmethod
    def build(
        cls, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None
    ) -> Cotangents:
        """delta = rowsum(dO * O) per (B, H, Sq), as the flash-attention backward defines it."""
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(1, 2)
        return cls(dout, safe_lse(lse), delta, dlse)


def backward_step(
    q: torch.Tensor,
    kv: torch.Tensor,
    piece: Piece | None,
    cot: Cotangents,
    scale: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(dq rows, dkv (2,B,cols,H,D)) of one step, or None for an empty step.

    The merged output is sum_s w_s o_s with w_s = exp(lse_s - lse), so step s receives dO * w_s
    on its output and w_s * (rowsum(dO * o_s) - delta + dLSE) on its own LSE; autograd of the
    local impl turns these into exact global gradients (FA's dS = P (dP - delta)).
    """
    if piece is None:
        return None
    rows, cols = piece.rows, piece.cols
    with torch.enable_grad():
        qs = q[:, rows].detach().requires_grad_()
        ks = kv[0][:, cols].detach().requires_grad_()
        vs = kv[1][:, cols].detach().requires_grad_()
        out, lse = local_attention(qs, ks, vs, piece.mask, scale=scale, impl=impl)
        dlse = None if cot.dlse is None else cot.dlse[:, :, rows]
        g_out, g_lse = fused(step_cotangents, q.device)(
            cot.dout[:, rows],
            out.detach(),
            lse.detach(),
            cot.lse[:, :, rows],
            cot.delta[:, :, rows],
            dlse,
        )
        dq, dk, dv = torch.autograd.grad((out, lse), (qs, ks, vs), (g_out, g_lse))
    return dq, torch.stack([dk, dv])


def add_grads(
    dq: torch.Tensor,
    dkv: torch.Tensor,
    piece: Piece | None,
    grads: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Add one step's gradients into the accumulators: dq (B,L,H,D) at the piece's rows, dkv
    (2,B,L,H,D) at its columns (nothing for an empty step)."""
    if grads is None:
        return
    dq[:, piece.rows] += grads[0].to(dq.dtype)
    dkv[:, :, piece.cols] += grads[1].to(dkv.dtype)
