"""Mask pictures: exact per-cell coverage from slices, and the PNG writer."""

import numpy as np
import pytest

from attn_masks.block_sparse import variable_block_sparse
from attn_masks.generators import MASK_NAMES, make_mask
from attn_masks.render import coverage, render_mask_png


def _pooled(dense: np.ndarray, rows: int, cols: int) -> np.ndarray:
    re_ = (np.arange(rows + 1) * dense.shape[0]) // rows
    ce = (np.arange(cols + 1) * dense.shape[1]) // cols
    sums = np.add.reduceat(np.add.reduceat(dense.astype(np.int64), re_[:-1], 0), ce[:-1], 1)
    return sums / np.outer(np.diff(re_), np.diff(ce))


@pytest.mark.parametrize("compat", [False, True])
@pytest.mark.parametrize("name", MASK_NAMES)
def test_coverage_matches_dense(name, compat):
    params = {"block_size": 100} if name == "block_causal_document" else {}
    m = make_mask(name, 700, window=41, seed=11, reference_compat=compat, **params)
    dense = m.dense()
    for rows, cols in [(7, 13), (64, 64), (700, 700), (5000, 3)]:
        got = coverage(m, rows, cols)
        np.testing.assert_allclose(got, _pooled(dense, min(rows, 700), min(cols, 700)), atol=1e-12)


def test_coverage_block_sparse():
    m = variable_block_sparse(2048, 256, 0.3)
    np.testing.assert_allclose(coverage(m, 50, 50), _pooled(m.dense(), 50, 50), atol=1e-12)


def test_render_png(tmp_path):
    pytest.importorskip("matplotlib")
    m = make_mask("prefix_lm_document", 1 << 20)
    out = render_mask_png(m, tmp_path / "mask.png", resolution=128, title="prefix")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"resolution .*got 0"):
        render_mask_png(m, tmp_path / "bad.png", resolution=0)
