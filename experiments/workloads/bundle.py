"""What a parity bundle holds on disk (file names, the mask's stored form): shared by the side
that saves it (parity_jax, with jax) and the side that checks it (parity, without jax)."""

from __future__ import annotations

import numpy as np

from attn_masks import Mask

BUNDLE_NPZ = "bundle.npz"
META_JSON = "meta.json"
ORBAX_DIR = "orbax"
MASK_KEYS = ("mask_q_ranges", "mask_k_ranges", "mask_types")


def mask_arrays(mask: Mask) -> dict[str, np.ndarray]:
    """The mask's typed slices as arrays (what a bundle stores of it)."""
    return dict(zip(MASK_KEYS, (np.asarray(a, np.int64) for a in mask.slices)))
