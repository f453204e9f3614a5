"""Masks shared by the kernel tests (numpy only)."""

from __future__ import annotations

import numpy as np

from attn_masks import Mask, from_slices


def random_slices(seed: int, sq: int, sk: int) -> Mask:
    """Random non-overlapping slices: up to two key ranges of random type per query chunk, so
    tiles come out empty, partial and full, and rows may see one or two intervals."""
    rng = np.random.default_rng(seed)
    cuts = np.unique(np.concatenate([[0, sq], rng.integers(1, sq, 4)]))
    qs, ks, ts = [], [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        c1, c2 = np.sort(rng.integers(0, sk + 1, 2))
        for k0, k1 in ((0, c1), (c2, sk)):
            if k1 > k0:
                qs.append((a, b))
                ks.append((k0, k1))
                ts.append(int(rng.integers(0, 4)))
    return from_slices(qs, ks, ts, sq, sk)
