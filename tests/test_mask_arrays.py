"""Runtime mask arrays: intervals and tile lists survive stacking/padding unchanged in meaning."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_masks import MaskType, from_slices, make_mask
from jax_attn.adapters.common import intervals_only
from jax_attn.mask_arrays import (
    DEFAULT_BLOCK,
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


def _emptied_elsewhere(piece, rows, build):
    """build() of the piece with every row but `rows` seeing nothing: a taller mask whose
    other rows map to its empty lower half (what scatter_query_tiles stands for)."""
    n, k = piece.seqlen_q, piece.seqlen_k
    taller = from_slices(*piece.slices, 2 * n, k)
    local = np.arange(n)
    return build(taller.restrict(np.where(np.isin(local, rows), local, n + local), np.arange(k)))


@pytest.mark.parametrize("seed", range(6))
def test_query_tiles_placed_as_the_taller_mask_would_build_them(seed):
    """scatter_query_tiles of a piece restricted to some whole query tiles gives, on the device,
    the same arrays (values, dtypes, static fields) as the widened arrays of the piece with
    every other row seeing nothing, for random masks, query orders, lengths that end in a
    ragged tile, interval counts and intervals-only arrays; and the kept rows see what they saw
    in the piece, the others nothing."""
    rng = np.random.default_rng(40 + seed)
    names = ["causal", "full", "causal_document", "share_question", "sliding_window",
             "prefix_lm_document", "full_document"]  # fmt: skip
    for trial in range(6):
        block_q, block_k = (16, 32) if trial % 2 else (32, 16)
        build = partial(prepare_mask, block_q=block_q, block_k=block_k)
        if trial == 5:  # an impl that reads only the intervals (in DEFAULT_BLOCK row tiles)
            build, block_q = intervals_only, DEFAULT_BLOCK
        n = int(rng.integers(1, 4)) * block_q + int(rng.integers(0, 3 * block_q))
        k = int(rng.integers(40, 300))
        base = make_mask(names[int(rng.integers(len(names)))], 512, window=40, seed=seed)
        queries = rng.permutation(512)[:n] if trial % 3 else np.sort(rng.choice(512, n, False))
        piece = base.restrict(queries, np.sort(rng.choice(512, k, replace=False)))
        whole_tiles = n // block_q  # the last, ragged tile is never a check's
        count = int(rng.integers(1, min(whole_tiles, 4) + 1))
        tiles = np.sort(rng.choice(whole_tiles, count, replace=False))
        rows = (tiles[:, None] * block_q + np.arange(block_q)).ravel()
        intervals = int(rng.integers(1, 5))
        kept = piece.restrict(rows, np.arange(k))
        want = widen_mask_arrays(_emptied_elsewhere(piece, rows, build), intervals)
        got = scatter_query_tiles(build(kept), rows, n, intervals)
        assert jax.tree.structure(got) == jax.tree.structure(want)  # the same static fields
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert isinstance(a, jax.Array) and a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), b)
        vis = np.asarray(dense_from_intervals(jnp.asarray(got.lo), jnp.asarray(got.hi), k))
        np.testing.assert_array_equal(vis[rows], piece.dense()[rows])
        assert not np.delete(vis, rows, axis=0).any()


def test_query_tiles_refuse_rows_that_are_not_whole_ascending_tiles():
    piece = from_slices([[0, 64]], [[0, 64]], [MaskType.CAUSAL], 64)
    for rows in (np.arange(8), np.arange(16, 32)[::-1], np.r_[np.arange(16, 32), np.arange(16)]):
        kept = prepare_mask(piece.restrict(rows, np.arange(64)), 16, 16)
        with pytest.raises(ValueError, match="whole, ascending 16-row tiles"):
            scatter_query_tiles(kept, rows, 64, 1)
    kept = prepare_mask(piece.restrict(np.arange(16, 32), np.arange(64)), 16, 16)
    for rows in (np.arange(-16, 0), np.arange(64, 80)):  # outside the taller mask
        with pytest.raises(ValueError, match=r"inside \[0, 64\)"):
            scatter_query_tiles(kept, rows, 64, 1)
