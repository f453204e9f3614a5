"""Random typed slice lists: masks with empty, partial and full tiles, for testing kernels."""

from __future__ import annotations

import numpy as np

from .mask import Mask, MaskType, from_slices


def random_slices(seed: int, seqlen_q: int, seqlen_k: int) -> Mask:
    """Up to two key ranges of random type per random query chunk: rows see zero, one or two
    intervals, and tiles come out empty, partial and full."""
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate([[0, seqlen_q], rng.integers(1, seqlen_q, 4)]))
    qs, ks, types = [], [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        c1, c2 = np.sort(rng.integers(0, seqlen_k + 1, 2))
        for k0, k1 in ((0, c1), (c2, seqlen_k)):
            if k1 > k0:
                qs.append((a, b))
                ks.append((k0, k1))
                types.append(int(rng.integers(0, len(MaskType))))
    return from_slices(qs, ks, types, seqlen_q, seqlen_k)
