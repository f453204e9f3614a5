"""A small decoder-only Transformer LM (pre-norm, RoPE GQA attention, GELU MLP) and its FLOPs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attn_masks import Mask, attention_flops
from experiments.workloads.nnx_attention import Attention, AttentionBackend


@dataclass(frozen=True)
class LMConfig:
    """Model shape: depth blocks of width `width`, heads_q:heads_kv heads, vocab, MLP ratio.

    tie_embeddings: the output head is the token embedding (GPT-2, Gemma), so a token the
    attention brings into the residual stream scores itself from the first step on.
    """

    vocab: int = 64
    width: int = 64
    depth: int = 2
    heads_q: int = 4
    heads_kv: int = 2
    mlp_ratio: int = 4
    dtype: str = "float32"
    tie_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.width // self.heads_q

    def validate(self) -> None:
        """Raise ValueError on shapes the model cannot take."""
        for name in ("vocab", "width", "depth", "heads_q", "heads_kv", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads_q:
            raise ValueError(f"width={self.width} must be a multiple of heads_q={self.heads_q}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q={self.heads_q} must be a multiple of heads_kv")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary positions)")


class Block(nnx.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LMConfig, backend: AttentionBackend, *, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(cfg.dtype)
        hidden = cfg.mlp_ratio * cfg.width
        self.attn_norm = nnx.RMSNorm(cfg.width, dtype=dtype, rngs=rngs)
        self.attn = Attention(
            cfg.width, cfg.heads_q, cfg.heads_kv, backend=backend, dtype=dtype, rngs=rngs
        )
        self.mlp_norm = nnx.RMSNorm(cfg.width, dtype=dtype, rngs=rngs)
        self.mlp_in = nnx.Linear(cfg.width, hidden, use_bias=False, dtype=dtype, rngs=rngs)
        self.mlp_out = nnx.Linear(hidden, cfg.width, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, mask: Any, positions: jax.Array | None = None) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), mask, positions)
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class TransformerLM(nnx.Module):
    """Token embedding, `depth` blocks, final norm, output head (the embedding when tied) ->
    float32 logits."""

    def __init__(self, cfg: LMConfig, backend: AttentionBackend, *, rngs: nnx.Rngs) -> None:
        cfg.validate()
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab, cfg.width, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, backend, rngs=rngs) for _ in range(cfg.depth)])
        self.norm = nnx.RMSNorm(cfg.width, dtype=dtype, rngs=rngs)
        self.head = None
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.width, cfg.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(
        self, tokens: jax.Array, mask: Any, positions: jax.Array | None = None
    ) -> jax.Array:
        """tokens (B,S) int -> logits (B,S,vocab) float32; `mask` and the tokens' global
        `positions` (default arange(S)) as Attention takes them."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask, positions)
        x = self.norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return logits.astype(jnp.float32)


def matmul_params(cfg: LMConfig) -> int:
    """Weights that take part in a matmul per token: projections, MLP and the output head."""
    d = cfg.head_dim
    attn = cfg.width * d * (2 * cfg.heads_q + 2 * cfg.heads_kv)
    mlp = 2 * cfg.width * cfg.mlp_ratio * cfg.width
    return cfg.depth * (attn + mlp) + cfg.width * cfg.vocab


def step_flops(cfg: LMConfig, mask: Mask, batch: int) -> dict[str, float]:
    """Forward+backward FLOPs of one training step: dense matmuls (6 per weight per token) and
    attention (attn_masks' exact-area count, fwd_bwd) over all layers."""
    tokens = batch * mask.seqlen_q
    dense = 6.0 * matmul_params(cfg) * tokens
    attn = cfg.depth * attention_flops(mask, cfg.heads_q, cfg.head_dim, "fwd_bwd", batch)
    return {"dense": dense, "attention": attn, "total": dense + attn}
