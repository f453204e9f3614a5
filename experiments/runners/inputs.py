"""Benchmark inputs: N(0, 1) q, k, v and the output gradient, identical in both frameworks and
on every rank, generated on the host in independently seeded chunks of tokens so that a process
can produce just the shard it holds (no compile, no full copy per device), the chunks on every
host core at once; and the cache of inputs already on a device that both runners keep."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

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


def cast(x: np.ndarray, dtype) -> np.ndarray:
    """x cast to `dtype` (a new array), CHUNK tokens (axis 1) at a time on every host core:
    numpy's casts to bfloat16 run on one core (about 6 s for a 128K-token, 64-head q) and
    release the GIL, so the chunks cast side by side; the values are numpy's cast's."""
    out = np.empty(x.shape, dtype)

    def fill(c: int) -> None:
        out[:, c * CHUNK : (c + 1) * CHUNK] = x[:, c * CHUNK : (c + 1) * CHUNK]

    _in_threads(fill, range(-(-x.shape[1] // CHUNK)))
    return out


def device_seed(name: str, seed: int, index: int, chunk: int = 0) -> int:
    """A 32-bit seed of input `name` for mask `index` of a point (of one chunk of it, where a
    generator draws in chunks), for generators that draw on a device (the CP predictor's ranks)."""
    return int(np.random.SeedSequence([seed, index, NAMES.index(name), chunk]).generate_state(1)[0])


def _draw(name: str, shape: tuple[int, int, int, int], seed: int, index: int, c: int) -> np.ndarray:
    """Chunk c (tokens c * CHUNK onwards) of input `name`, from its own seed."""
    b, s, h, d = shape
    rng = np.random.default_rng([seed, index, NAMES.index(name), c])
    return rng.standard_normal((b, min(CHUNK, s - c * CHUNK), h, d), dtype=np.float32)


def _in_threads(fill: Callable[[int], None], chunks) -> None:
    """fill(c) for every chunk, on every host core (numpy's generators release the GIL)."""
    chunks = list(chunks)
    with ThreadPoolExecutor(max(1, min(len(chunks), os.cpu_count() or 1))) as pool:
        list(pool.map(fill, chunks))


@functools.lru_cache(maxsize=8)
def _cached_block(
    name: str, shape: tuple[int, int, int, int], seed: int, index: int, start: int, stop: int
) -> np.ndarray:
    """Generated once per (input, shape, seed, mask, tokens): points that differ only in mask or
    impl reuse it, since drawing billions of normals dominates large points. The chunks are drawn
    in threads, each from its own seed, so the values do not depend on how many threads ran."""
    out = rows(name, shape, seed, index, np.arange(start, stop))
    out.flags.writeable = False
    return out


def rows(
    name: str,
    shape: tuple[int, int, int, int],
    seed: int,
    index: int,
    positions: np.ndarray,
    heads: np.ndarray | None = None,
) -> np.ndarray:
    """Float32 values of input `name` at token `positions` (any order; past the end: zeros) and
    `heads` (default all), drawing only the chunks those positions fall in: what one rank of a
    sequence too long for one device holds."""
    b, s, h, d = shape
    positions = np.asarray(positions, np.int64)
    width = h if heads is None else len(heads)
    out = np.zeros((b, positions.size, width, d), np.float32)
    real = np.flatnonzero(positions < s)
    chunk_of = positions[real] // CHUNK

    def fill(c: int) -> None:
        sel = real[chunk_of == c]
        chunk = _draw(name, shape, seed, index, c)[:, positions[sel] - c * CHUNK]
        out[:, sel] = chunk if heads is None else chunk[:, :, np.asarray(heads, np.int64)]

    _in_threads(fill, np.unique(chunk_of).tolist())
    return out


class DeviceInputs:
    """Inputs already on a device, by key, oldest dropped first: at most `entries` sets and
    `max_bytes` held. Host generation and the copy to the device dominate large points, so the
    points that share a shape (every impl and mask of it) build their inputs once."""

    def __init__(self, entries: int = 4, max_bytes: int = 32 << 30) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self._held: dict[Hashable, dict] = {}

    def get(self, key: Hashable, nbytes: int, build: Callable[[], dict]) -> dict:
        """The inputs under `key`, built (after making room for `nbytes`) if not held."""
        if key not in self._held:
            self._make_room(nbytes)
            self._held[key] = build()
        return self._held[key]

    def held_bytes(self) -> int:
        return sum(int(x.nbytes) for inputs in self._held.values() for x in inputs.values())

    def _make_room(self, nbytes: int) -> None:
        while self._held and (
            len(self._held) >= self.entries or self.held_bytes() + nbytes > self.max_bytes
        ):
            self._held.pop(next(iter(self._held)))
