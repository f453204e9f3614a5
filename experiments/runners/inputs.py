"""Benchmark inputs: N(0, 1) q, k, v and the output gradient, identical in both frameworks and
on every rank, generated on the host in independently seeded chunks of tokens so that a process
can produce just the shard it holds (no compile, no full copy per device)."""

from __future__ import annotations

import functools

import numpy as np

NAMES = ("q", "k", "v", "dout")
CHUNK = 4096  # tokens per independently seeded block


def shapes(
    batch: int, seqlen: int, heads_q: int, heads_kv: int, head_dim: int
) -> dict[str, tuple[int, int, int, int]]:
    """Shapes of q, k, v and dout (B, S, H, D)."""
    return {
        "q": (batch, seqlen, heads_q, head_dim),
        "k": (batch, seqlen, heads_kv, head_dim),
        "v": (batch, seqlen, heads_kv, head_dim),
        "dout": (batch, seqlen, heads_q, head_dim),
    }


def block(
    name: str,
    shape: tuple[int, int, int, int],
    seed: int,
    index: int,
    tokens: slice = slice(None),
) -> np.ndarray:
    """Float32 values of input `name` for mask `index` of a point, tokens[tokens] only (a copy)."""
    b, s, h, d = shape
    start, stop, step = tokens.indices(s)
    if step != 1:
        raise ValueError(f"token slices must be contiguous, got step {step}")
    if stop <= start:
        return np.zeros((b, 0, h, d), np.float32)
    return _cached_block(name, tuple(shape), seed, index, start, stop).copy()


@functools.lru_cache(maxsize=8)
def _cached_block(
    name: str, shape: tuple[int, int, int, int], seed: int, index: int, start: int, stop: int
) -> np.ndarray:
    """Generated once per (input, shape, seed, mask, tokens): points that differ only in mask or
    impl reuse it, since drawing billions of normals dominates large points."""
    b, s, h, d = shape
    first, last = start // CHUNK, (stop - 1) // CHUNK
    parts = []
    for c in range(first, last + 1):
        rng = np.random.default_rng([seed, index, NAMES.index(name), c])
        n = min(CHUNK, s - c * CHUNK)
        parts.append(rng.standard_normal((b, n, h, d), dtype=np.float32))
    out = np.concatenate(parts, axis=1)[:, start - first * CHUNK : stop - first * CHUNK]
    out.flags.writeable = False
    return out
