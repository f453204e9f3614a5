"""The 14 mask generators of the benchmark (docs/masks.md), built as typed slices in O(#documents).

`reference_compat=True` reproduces the published generator's slices and random draws exactly;
the default uses the corrected definitions (two-sided sliding window, one global+band mask).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .mask import Mask, MaskType, from_slices
from .sampling import default_distribution, generate_seqlens, load_distribution

MASK_NAMES = (
    "full",
    "causal",
    "full_document",
    "causal_document",
    "sliding_window_causal",
    "sliding_window",
    "share_question",
    "causal_blockwise",
    "prefix_lm_causal",
    "prefix_lm_document",
    "global_sliding_window",
    "block_causal_document",
    "full_document_long",
    "causal_document_long",
)
PARAM_NAMES = ("block_size", "prefix_length", "global_size", "seqlens")

DEFAULT_BLOCK_SIZE = 1024
MAX_BLOCKS_PER_DOCUMENT = 8
LONG_SHARE = 0.4
LONG_DOC_BUCKET = (8 * 1024, 30 * 1024)

FULL, CAUSAL, INVCAUSAL, BICAUSAL = (int(t) for t in MaskType)


@dataclass
class _Spec:
    """Validated inputs of one make_mask call plus the random stream it draws from."""

    name: str
    seqlen: int
    seed: int
    window: int
    compat: bool
    distribution: str | Mapping | None
    params: dict
    rng: random.Random
    draw: int | None = None


class _Slices:
    """Accumulates typed slices in order."""

    def __init__(self) -> None:
        self.q: list[np.ndarray] = []
        self.k: list[np.ndarray] = []
        self.t: list[np.ndarray] = []

    def add(self, q0, q1, k0, k1, typ) -> None:
        q0, q1, k0, k1 = np.broadcast_arrays(*(np.asarray(x, np.int64) for x in (q0, q1, k0, k1)))
        self.q.append(np.stack([q0.ravel(), q1.ravel()], 1))
        self.k.append(np.stack([k0.ravel(), k1.ravel()], 1))
        self.t.append(np.broadcast_to(np.asarray(typ, np.int8), q0.shape).ravel())

    def mask(self, spec: _Spec, meta: dict) -> Mask:
        q = np.concatenate(self.q) if self.q else np.zeros((0, 2), np.int64)
        k = np.concatenate(self.k) if self.k else np.zeros((0, 2), np.int64)
        t = np.concatenate(self.t) if self.t else np.zeros(0, np.int8)
        params = {"reference_compat": spec.compat, "seed": spec.seed, **meta}
        if spec.draw is not None:
            params["draw"] = spec.draw
        return from_slices(q, k, t, spec.seqlen, spec.seqlen, name=spec.name, params=params)


def _band_slices(out: _Slices, start: int, length: int, left: int, right: int) -> None:
    """Slices of i - left <= j <= i + right on the square [start, start + length)^2.

    Rows whose window is clipped on the left form a CAUSAL slice, rows clipped on neither side a
    BICAUSAL one, rows clipped on both sides a FULL one and rows clipped on the right an INVCAUSAL
    one; this is the same layout the reference produces. A side of length - 1 or more is unbounded.
    """
    n = length
    a = left if left < n - 1 else n
    b = right if right < n - 1 else n
    top = min(a, n - b)  # rows [0, top) see [0, i + b]
    mid = max(a, n - b)  # rows [top, mid) see the band (or everything)
    s = start
    out.add(s, s + top, s, s + min(n, a + b), CAUSAL)
    out.add(s + top, s + mid, s, s + n, FULL if a > n - b else BICAUSAL)
    out.add(s + mid, s + n, s + max(0, n - a - b), s + n, INVCAUSAL)


def _doc_bounds(seqlens: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(seqlens, np.int64))]).astype(np.int64)


def _table(spec: _Spec, rule: str) -> tuple[str | Mapping, str]:
    """(table, its name for metadata): the given one, else the reference choice for the rule."""
    if spec.distribution is None:
        name = default_distribution(spec.seqlen, rule)
        return name, name
    if isinstance(spec.distribution, str):
        load_distribution(spec.distribution)
        return spec.distribution, spec.distribution
    return load_distribution(spec.distribution), "custom"


def _documents(spec: _Spec) -> tuple[np.ndarray, dict]:
    """Document boundaries (cu_seqlens) from explicit seqlens or sampled from the length table."""
    if spec.params.get("seqlens") is not None:
        cu = _doc_bounds(spec.params["seqlens"])
        return cu, {"cu_seqlens": cu, "distribution": "explicit"}
    rule = "kernel" if spec.compat else "cp"
    table, table_name = _table(spec, rule)
    cu = _doc_bounds(generate_seqlens(table, spec.seqlen, spec.rng))
    return cu, {"cu_seqlens": cu, "distribution": table_name}


def _long_documents(spec: _Spec) -> tuple[np.ndarray, dict]:
    """40% of the tokens from the length table, the rest in 8K-30K documents, shuffled."""
    if spec.params.get("seqlens") is not None:
        return _documents(spec)
    table, table_name = _table(spec, "cp")
    short_total = int(spec.seqlen * LONG_SHARE)
    seqlens = generate_seqlens(table, short_total, spec.rng)
    seqlens += generate_seqlens({LONG_DOC_BUCKET: 1.0}, spec.seqlen - short_total, spec.rng)
    spec.rng.shuffle(seqlens)
    cu = _doc_bounds(seqlens)
    return cu, {"cu_seqlens": cu, "distribution": table_name}


def _full(spec: _Spec) -> Mask:
    out = _Slices()
    out.add(0, spec.seqlen, 0, spec.seqlen, FULL)
    return out.mask(spec, {})


def _causal(spec: _Spec) -> Mask:
    out = _Slices()
    out.add(0, spec.seqlen, 0, spec.seqlen, CAUSAL)
    return out.mask(spec, {})


def _per_document(
    typ: int, documents: Callable[[_Spec], tuple[np.ndarray, dict]]
) -> Callable[[_Spec], Mask]:
    """Builder of one slice of type typ per document."""

    def build(spec: _Spec) -> Mask:
        cu, meta = documents(spec)
        out = _Slices()
        out.add(cu[:-1], cu[1:], cu[:-1], cu[1:], typ)
        return out.mask(spec, meta)

    return build


def _sliding_window_causal(spec: _Spec) -> Mask:
    out = _Slices()
    _band_slices(out, 0, spec.seqlen, spec.window, 0)
    return out.mask(spec, {"window": spec.window})


def _sliding_window(spec: _Spec) -> Mask:
    out = _Slices()
    s, w = spec.seqlen, spec.window
    if spec.compat and w >= s:
        out.add(0, s, 0, s, FULL)
    else:
        _band_slices(out, 0, s, w, 0 if spec.compat else w)
    return out.mask(spec, {"window": w})


def _share_question(spec: _Spec) -> Mask:
    cu, meta = _documents(spec)
    out = _Slices()
    if len(cu) == 2:
        out.add(0, spec.seqlen, 0, spec.seqlen, CAUSAL)
        return out.mask(spec, meta)
    out.add(0, cu[2], 0, cu[2], CAUSAL)
    out.add(cu[2], spec.seqlen, 0, cu[1], FULL)
    out.add(cu[2:-1], cu[3:], cu[2:-1], cu[3:], CAUSAL)
    return out.mask(spec, meta)


def _causal_blockwise(spec: _Spec) -> Mask:
    cu, meta = _documents(spec)
    k0 = cu[:-1].copy()
    k0[-1] = 0
    out = _Slices()
    out.add(cu[:-1], cu[1:], k0, cu[1:], CAUSAL)
    return out.mask(spec, meta)


def _prefix_length(spec: _Spec, high: int) -> int:
    p = spec.params.get("prefix_length")
    return spec.rng.randint(1, high) if p is None else p


def _prefix_lm_causal(spec: _Spec) -> Mask:
    s = spec.seqlen
    p = _prefix_length(spec, s)
    out = _Slices()
    out.add(0, p, 0, p, FULL)
    out.add(p, s, 0, s, CAUSAL)
    return out.mask(spec, {"prefix_length": p})


def _prefix_lm_document(spec: _Spec) -> Mask:
    cu, meta = _documents(spec)
    p = _prefix_length(spec, int(cu[1]))
    starts, ends = cu[:-1], cu[1:]
    cut = np.minimum(starts + p, ends)
    q = np.stack([np.stack([starts, cut], 1), np.stack([cut, ends], 1)], 1).reshape(-1, 2)
    k = np.stack([np.stack([starts, cut], 1), np.stack([starts, ends], 1)], 1).reshape(-1, 2)
    out = _Slices()
    out.add(q[:, 0], q[:, 1], k[:, 0], k[:, 1], np.tile([FULL, CAUSAL], len(starts)))
    return out.mask(spec, {**meta, "prefix_length": p})


def _global_size(spec: _Spec) -> int:
    g = spec.params.get("global_size")
    if g is not None:
        return g
    high = spec.seqlen // 3 - 1
    if high < 1:
        raise ValueError(
            f"global_sliding_window draws global_size from [1, seqlen // 3 - 1], which is empty "
            f"for seqlen {spec.seqlen}; use seqlen >= 6 or pass global_size in [0, seqlen]"
        )
    return max(1, spec.rng.randint(1, high))


def _global_sliding_window(spec: _Spec) -> Mask:
    s = spec.seqlen
    g = _global_size(spec)
    out = _Slices()
    if spec.compat:
        out.add(0, s, 0, g, CAUSAL)
        out.add(0, g, g, s, CAUSAL)
        _band_slices(out, g, s - g, g, g)
        return out.mask(spec, {"global_size": g, "window": g})
    out.add(0, g, 0, s, FULL)
    out.add(g, s, 0, g, FULL)
    _band_slices(out, g, s - g, spec.window, spec.window)
    return out.mask(spec, {"global_size": g, "window": spec.window})


def _block_causal_document(spec: _Spec) -> Mask:
    s = spec.seqlen
    bs = spec.params.get("block_size", DEFAULT_BLOCK_SIZE)
    if s % bs:
        raise ValueError(
            f"block_causal_document needs seqlen to be a multiple of block_size {bs}, got {s}"
        )
    if spec.params.get("seqlens") is not None:
        cu = _doc_bounds(spec.params["seqlens"])
    else:
        remaining, blocks = s // bs, []
        while remaining > 0:
            n = min(spec.rng.randint(1, MAX_BLOCKS_PER_DOCUMENT), remaining)
            blocks.append(n)
            remaining -= n
        cu = _doc_bounds(np.asarray(blocks, np.int64) * bs)
    starts, ends = cu[:-1], cu[1:]
    first, last = starts // bs, (ends - 1) // bs
    counts = last - first + 1
    doc = np.repeat(np.arange(len(starts)), counts)
    block = first[doc] + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    row_end = np.minimum(ends[doc], (block + 1) * bs)
    out = _Slices()
    out.add(np.maximum(starts[doc], block * bs), row_end, starts[doc], row_end, FULL)
    return out.mask(spec, {"cu_seqlens": cu, "block_size": bs})


_BUILDERS: dict[str, Callable[[_Spec], Mask]] = {
    "full": _full,
    "causal": _causal,
    "full_document": _per_document(FULL, _documents),
    "causal_document": _per_document(CAUSAL, _documents),
    "sliding_window_causal": _sliding_window_causal,
    "sliding_window": _sliding_window,
    "share_question": _share_question,
    "causal_blockwise": _causal_blockwise,
    "prefix_lm_causal": _prefix_lm_causal,
    "prefix_lm_document": _prefix_lm_document,
    "global_sliding_window": _global_sliding_window,
    "block_causal_document": _block_causal_document,
    "full_document_long": _per_document(FULL, _long_documents),
    "causal_document_long": _per_document(CAUSAL, _long_documents),
}


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_params(seqlen: int, params: dict) -> dict:
    unknown = sorted(set(params) - set(PARAM_NAMES))
    if unknown:
        raise ValueError(f"unknown mask parameter(s) {unknown}; valid: {', '.join(PARAM_NAMES)}")
    p = params.get("prefix_length")
    if p is not None and not (_is_int(p) and 1 <= p <= seqlen):
        raise ValueError(f"prefix_length must be an integer in [1, {seqlen}], got {p!r}")
    g = params.get("global_size")
    if g is not None and not (_is_int(g) and 0 <= g <= seqlen):
        raise ValueError(f"global_size must be an integer in [0, {seqlen}], got {g!r}")
    b = params.get("block_size")
    if b is not None and not (_is_int(b) and b > 0):
        raise ValueError(f"block_size must be a positive integer, got {b!r}")
    lens = params.get("seqlens")
    if lens is not None:
        arr = np.asarray(lens)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"seqlens must be a non-empty list of integers, got {lens!r}")
        if (arr <= 0).any():
            raise ValueError(f"seqlens must all be positive, got {int(arr.min())} in {lens!r}")
        if int(arr.sum()) != seqlen:
            raise ValueError(f"seqlens must sum to seqlen {seqlen}, got sum {int(arr.sum())}")
    return {k: v for k, v in params.items() if v is not None}


def _checked_spec(
    name: str,
    seqlen: int,
    seed: int,
    window: int,
    reference_compat: bool,
    distribution: str | Mapping | None,
    params: dict,
    rng: random.Random,
) -> _Spec:
    """Validated inputs of a draw from rng (raises ValueError naming the bad argument)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown mask name {name!r}; valid names: {', '.join(MASK_NAMES)}")
    if not (_is_int(seqlen) and seqlen > 0):
        raise ValueError(f"seqlen must be a positive integer, got {seqlen!r}")
    if not (_is_int(window) and window >= 0):
        raise ValueError(f"window must be a non-negative integer, got {window!r}")
    return _Spec(
        name=name,
        seqlen=int(seqlen),
        seed=seed,
        window=int(window),
        compat=bool(reference_compat),
        distribution=distribution,
        params=_check_params(int(seqlen), params),
        rng=rng,
    )


def make_mask(
    name: str,
    seqlen: int,
    *,
    seed: int = 42,
    window: int = 1024,
    reference_compat: bool = False,
    distribution: str | Mapping | None = None,
    **params: object,
) -> Mask:
    """One instance of a named mask over a square seqlen x seqlen packed sequence.

    Random parts (documents, prefix length, global size) come from `random.Random(seed)` in the
    reference's draw order, so an instance is the reference's first mask for that seed.
    params: block_size, prefix_length, global_size, seqlens (explicit document lengths).
    """
    spec = _checked_spec(
        name, seqlen, seed, window, reference_compat, distribution, params, random.Random(seed)
    )
    return _BUILDERS[name](spec)


def make_masks(
    name: str,
    seqlen: int,
    count: int,
    *,
    seed: int = 42,
    window: int = 1024,
    reference_compat: bool = False,
    distribution: str | Mapping | None = None,
    **params: object,
) -> list[Mask]:
    """count instances drawn one after another from one `random.Random(seed)` stream.

    This is the reference's MaskIterator (the CP benchmark's 30 masks per point): the first
    mask equals make_mask(name, seqlen, seed=seed, ...) and mask i continues the stream where
    mask i - 1 stopped. Each mask's params record the stream seed and its "draw" index.
    """
    if not (_is_int(count) and count > 0):
        raise ValueError(f"count must be a positive integer, got {count!r}")
    spec = _checked_spec(
        name, seqlen, seed, window, reference_compat, distribution, params, random.Random(seed)
    )
    return [_BUILDERS[name](replace(spec, draw=i)) for i in range(count)]
