"""Uniform and variable block-sparse masks: exact top-k per query block, determinism, errors."""

import math

import numpy as np
import pytest

from attn_masks.block_sparse import blocks_per_row, uniform_block_sparse, variable_block_sparse


def _block_grid(dense: np.ndarray, q_bounds: np.ndarray, k_bounds: np.ndarray) -> np.ndarray:
    """Visible pairs per (query block, key block)."""
    per_row = np.add.reduceat(dense.astype(np.int64), q_bounds[:-1], axis=0)
    return np.add.reduceat(per_row, k_bounds[:-1], axis=1)


def _check_top_k(mask, q_bounds, k_bounds, k):
    dense = mask.dense()
    assert mask.area() == int(dense.sum())
    grid = _block_grid(dense, q_bounds, k_bounds)
    sizes = np.outer(np.diff(q_bounds), np.diff(k_bounds))
    assert np.all((grid == 0) | (grid == sizes)), "a block is partly kept"
    kept = grid > 0
    assert np.all(kept.sum(axis=1) == k)
    np.testing.assert_array_equal(np.nonzero(kept)[1].reshape(-1, k), mask.params["kept_blocks"])
    return kept


@pytest.mark.parametrize("density", [0.05, 0.1, 0.2, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("seqlen, block", [(1024, 64), (1000, 64), (2048, 128)])
def test_uniform_exact_k(seqlen, block, density):
    m = uniform_block_sparse(seqlen, block, density, seed=3)
    bounds = np.minimum(np.arange(0, seqlen + block, block), seqlen)
    bounds = np.unique(bounds)
    nk = len(bounds) - 1
    k = max(1, math.floor(density * nk))
    assert m.params["blocks_per_row"] == k == blocks_per_row(density, nk)
    kept = _check_top_k(m, bounds, bounds, k)
    scores = np.random.default_rng(3).random((nk, nk))
    expected = np.zeros_like(kept)
    np.put_along_axis(expected, np.argsort(-scores, axis=1)[:, :k], True, axis=1)
    np.testing.assert_array_equal(kept, expected)


def test_uniform_slices_are_merged_runs():
    m = uniform_block_sparse(4096, 64, 0.5, seed=0)
    q, k, t = m.slices
    assert np.all(t == 0)
    same_row = q[1:, 0] == q[:-1, 0]
    assert not np.any(same_row & (k[1:, 0] == k[:-1, 1])), "adjacent kept blocks not merged"
    kept = np.zeros((64, 64), bool)
    for (q0, _), (k0, k1) in zip(q, k, strict=True):
        kept[q0 // 64, k0 // 64 : k1 // 64] = True
    assert kept.sum() == 64 * 32
    assert m.slices[2].shape[0] < kept.sum()


def test_full_density_is_full():
    m = uniform_block_sparse(512, 64, 1.0)
    assert m.area() == 512 * 512 and m.slices[2].shape[0] == 8


def test_same_seed_same_pattern():
    a = uniform_block_sparse(2048, 64, 0.3, seed=9)
    b = uniform_block_sparse(2048, 64, 0.3, seed=9)
    c = uniform_block_sparse(2048, 64, 0.3, seed=10)
    np.testing.assert_array_equal(a.slices[1], b.slices[1])
    assert not np.array_equal(a.params["kept_blocks"], c.params["kept_blocks"])


@pytest.mark.parametrize("density", [0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize(
    "seqlen, avg, min_block", [(2048, 256, 128), (2000, 128, 100), (1024, 512, 128)]
)
def test_variable_exact_k(seqlen, avg, min_block, density):
    m = variable_block_sparse(seqlen, avg, density, min_block=min_block, seed=1)
    n = seqlen // avg
    rows, cols = m.params["row_sizes"], m.params["col_sizes"]
    for sizes in (rows, cols):
        assert len(sizes) == n and sizes.sum() == seqlen and sizes.min() >= min_block
    k = max(1, math.floor(density * n))
    q_bounds = np.concatenate([[0], np.cumsum(rows)])
    k_bounds = np.concatenate([[0], np.cumsum(cols)])
    _check_top_k(m, q_bounds, k_bounds, k)


def test_variable_rows_and_columns_differ():
    m = variable_block_sparse(8192, 256, 0.5, seed=0)
    assert not np.array_equal(m.params["row_sizes"], m.params["col_sizes"])


def test_large_pattern_is_cheap():
    m = uniform_block_sparse(1 << 17, 64, 0.5)
    assert m.params["kept_blocks"].shape == (2048, 1024)
    assert m.area() == (1 << 17) ** 2 // 2


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: uniform_block_sparse(1024, 64, 0.0), r"density .*got 0.0"),
        (lambda: uniform_block_sparse(1024, 64, 1.5), r"density .*got 1.5"),
        (lambda: uniform_block_sparse(1024, 64, -0.2), r"density .*got -0.2"),
        (lambda: uniform_block_sparse(1024, 64, float("nan")), r"density .*got nan"),
        (lambda: uniform_block_sparse(1024, 0, 0.5), r"block_size .*got 0"),
        (lambda: uniform_block_sparse(-1, 64, 0.5), r"seqlen .*got -1"),
        (lambda: variable_block_sparse(1024, 128, 2.0), r"density .*got 2.0"),
        (lambda: variable_block_sparse(1000, 128, 0.5, min_block=200), "min_block 200"),
        (lambda: variable_block_sparse(100, 128, 0.5), "seqlen 100"),
        (lambda: variable_block_sparse(1024, 128, 0.5, min_block=0), r"min_block .*got 0"),
    ],
)
def test_errors(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()
