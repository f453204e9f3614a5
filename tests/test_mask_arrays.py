"""Runtime mask arrays: intervals and tile lists survive stacking/padding unchanged in meaning."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_masks import MaskType, from_slices, make_mask
from jax_attn.mask_arrays import (
    dense_from_intervals,
    prepare_mask,
    scatter_query_tiles,
    stack_mask_arrays,
    widen_mask_arrays,
)


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


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize(
    "name", ["causal", "full", "causal_document", "share_question", "sliding_window"]
)
def test_query_tiles_placed_as_the_taller_mask_would_build_them(name, shuffled):
    """scatter_query_tiles of a piece restricted to some whole query tiles gives, on the device,
    the same arrays as building the widened arrays of the piece with every other row seeing
    nothing (a taller mask whose other rows map to empty ones), and the kept rows see what
    they saw in the piece."""
    rng = np.random.default_rng(5)
    block_q, block_k, n, k = 16, 32, 256, 192
    base = make_mask(name, 512, window=40, seed=3)
    queries = rng.permutation(512)[:n] if shuffled else np.arange(n)
    piece = base.restrict(queries, np.sort(rng.choice(512, k, replace=False)))
    for count in (1, 3, 5):
        tiles = np.sort(rng.choice(n // block_q, count, replace=False))
        rows = (tiles[:, None] * block_q + np.arange(block_q)).ravel()
        intervals = 3
        taller = from_slices(*piece.slices, 2 * n, k)
        local = np.arange(n)
        emptied = taller.restrict(np.where(np.isin(local, rows), local, n + local), np.arange(k))
        want = widen_mask_arrays(prepare_mask(emptied, block_q, block_k), intervals)
        kept = prepare_mask(piece.restrict(rows, np.arange(k)), block_q, block_k)
        got = scatter_query_tiles(kept, rows, n, intervals)
        assert jax.tree.structure(got) == jax.tree.structure(want)  # the same static fields
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert isinstance(a, jax.Array) and a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), b)
        assert (got.seqlen_q, got.seqlen_k) == (n, k)
        vis = np.asarray(dense_from_intervals(jnp.asarray(got.lo), jnp.asarray(got.hi), k))
        np.testing.assert_array_equal(vis[rows], piece.dense()[rows])
        assert not np.delete(vis, rows, axis=0).any()


def test_query_tiles_refuse_rows_that_are_not_whole_ascending_tiles():
    piece = from_slices([[0, 64]], [[0, 64]], [MaskType.CAUSAL], 64)
    for rows in (np.arange(8), np.arange(16, 32)[::-1], np.r_[np.arange(16, 32), np.arange(16)]):
        kept = prepare_mask(piece.restrict(rows, np.arange(64)), 16, 16)
        with pytest.raises(ValueError, match="whole, ascending 16-row tiles"):
            scatter_query_tiles(kept, rows, 64, 1)
