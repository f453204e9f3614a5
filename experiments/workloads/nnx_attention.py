"""Flax NNX multi-head GQA self-attention with rotary positions over jax_attn or CP attention.

    from experiments.workloads.nnx_attention import Attention, AttentionBackend
    layer = Attention(width=512, heads_q=8, heads_kv=2, rngs=nnx.Rngs(0))
    y = layer(x, mask)                                       # jax_attn.attention(impl=...)
    cp = AttentionBackend(mesh=mesh, strategy="ring", layout="zigzag")
    y = Attention(512, 8, 2, backend=cp, rngs=nnx.Rngs(0))(x, mask)  # jax_cp.attention

`mask` is an attn_masks.Mask, a jax_attn.MaskArrays (runtime arrays: one compilation for every
mask of a shape) or any callable pytree (q, k, v) -> out: a prepared CP executor
(`shard_strategies.jax_cp.build(...)`), which takes and returns global token order, or the train
step's masking.InLayout, whose activations are already in the executor's layout order. Rotary
positions are global token indices either way: in layout order the caller passes the dispatched
global positions, so rotations never see the local order.
It sits above both libraries it calls (jax_attn and shard_strategies), with the workloads that
use it. Importing this module needs flax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from attn_masks import Mask
from jax_attn import MaskArrays, attention
from shard_strategies import jax_cp

DEFAULT_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class AttentionBackend:
    """How the attention call is made: a single-device impl, or a CP strategy over a mesh."""

    impl: str | None = None
    mesh: Mesh | None = None
    strategy: str | None = None
    layout: str = "zigzag"
    axis: str = "cp"
    ulysses_size: int | None = None

    @property
    def is_cp(self) -> bool:
        """True when attention runs context-parallel over the mesh."""
        return self.mesh is not None and self.strategy is not None

    @property
    def cp_settings(self) -> dict[str, Any]:
        """The placement keywords of shard_strategies.jax_cp.attention / build."""
        return dict(
            mesh=self.mesh,
            strategy=self.strategy,
            layout=self.layout,
            axis=self.axis,
            ulysses_size=self.ulysses_size,
        )

    @property
    def resolved_impl(self) -> str:
        """The impl actually used: the given one, else our Pallas kernel on GPU, else reference."""
        if self.impl is not None:
            return self.impl
        return "pallas" if jax.default_backend() == "gpu" else "reference"

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: Any) -> jax.Array:
        """out (B,S,Hq,D) of q (B,S,Hq,D), k/v (B,S,Hkv,D) under `mask` (see module docstring)."""
        if not isinstance(mask, (Mask, MaskArrays)):
            return mask(q, k, v)
        if self.is_cp:
            return jax_cp.attention(q, k, v, mask, impl=self.resolved_impl, **self.cp_settings)
        return attention(q, k, v, mask, impl=self.resolved_impl)


def rotary(x: jax.Array, positions: jax.Array, base: float = DEFAULT_ROPE_BASE) -> jax.Array:
    """Rotate (B,S,H,D) pairs (i, i + D/2) by angle position * base^(-2i/D) (RoPE, NeoX form)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x.shape[-1])
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, S, D/2)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Self-attention block: q/k/v projections, RoPE on q and k, masked GQA attention, output."""

    def __init__(
        self,
        width: int,
        heads_q: int,
        heads_kv: int,
        *,
        head_dim: int | None = None,
        backend: AttentionBackend | None = None,
        rope_base: float = DEFAULT_ROPE_BASE,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        if heads_q % heads_kv:
            raise ValueError(f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv}")
        head_dim = width // heads_q if head_dim is None else head_dim
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {head_dim}")
        self.heads_q, self.heads_kv, self.head_dim = heads_q, heads_kv, head_dim
        self.backend = backend or AttentionBackend()
        self.rope_base = rope_base

        def proj(n_in: int, n_out: int) -> nnx.Linear:
            return nnx.Linear(
                n_in, n_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )

        self.q_proj = proj(width, heads_q * head_dim)
        self.k_proj = proj(width, heads_kv * head_dim)
        self.v_proj = proj(width, heads_kv * head_dim)
        self.o_proj = proj(heads_q * head_dim, width)

    def __call__(self, x: jax.Array, mask: Any, positions: jax.Array | None = None) -> jax.Array:
        """(B,S,W) -> (B,S,W); positions (B,S) or (S,) global token indices, default arange(S)."""
        b, s, _ = x.shape
        if positions is None:
            positions = jnp.arange(s)
        positions = jnp.broadcast_to(positions, (b, s))
        q = self.q_proj(x).reshape(b, s, self.heads_q, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.heads_kv, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.heads_kv, self.head_dim)
        q = rotary(q, positions, self.rope_base)
        k = rotary(k, positions, self.rope_base)
        out = self.backend(q, k, v, mask)
        return self.o_proj(out.reshape(b, s, self.heads_q * self.head_dim))
