"""Runtime mask arrays: intervals and tile lists survive stacking/padding unchanged in meaning."""

import jax.numpy as jnp
import numpy as np

from attn_masks import MaskType, from_slices
from jax_attn.mask_arrays import dense_from_intervals, prepare_mask, stack_mask_arrays


def test_stack_pads_without_changing_visibility_or_tiles():
    a = from_slices([[0, 40], [40, 70]], [[0, 40], [40, 70]], [MaskType.CAUSAL] * 2, 70)
    b = from_slices(
        [[0, 70], [0, 70], [30, 70]],
        [[0, 10], [20, 30], [40, 50]],
        [MaskType.FULL, MaskType.FULL, MaskType.INVCAUSAL],
        70,
    )
    stacked = stack_mask_arrays([prepare_mask(a, 16, 16), prepare_mask(b, 16, 16)])
    assert stacked.lo.shape[0] == 2 and stacked.lo.shape[-1] == b.row_intervals()[0].shape[1]
    for i, m in enumerate((a, b)):
        vis = dense_from_intervals(jnp.asarray(stacked.lo[i]), jnp.asarray(stacked.hi[i]), 70)
        np.testing.assert_array_equal(np.asarray(vis), m.dense())
        bm = m.block_map(16, 16)
        for qb in range(bm.shape[0]):
            n = stacked.kv.count[i, qb]
            idx = stacked.kv.index[i, qb]
            np.testing.assert_array_equal(idx[:n], np.nonzero(bm[qb])[0])
            if n:
                assert (idx[n:] == idx[n - 1]).all()  # padding re-touches the last tile
