"""Tile lists for tests: lists of given walk lengths, and the CP cost model's spans from a
piece's forward tile lists (what the kernels walk), for tests to hold the predictor's spans from
tile counts (Mask.tile_counts) to."""

from __future__ import annotations

import numpy as np

from attn_masks import TileList
from experiments.runners import call_model


def walks(count: list[int]) -> TileList:
    """Lists of outer tiles walking count[t] inner tiles each (entries all tile 0, none full):
    what the walk statistics read."""
    n = len(count)
    return TileList(np.zeros((n, 1), np.int32), np.asarray(count, np.int32), np.zeros((n, 1), bool))


def list_spans(kv_lists, heads_q: int, heads_kv: int, slots: int = call_model.SLOTS) -> np.ndarray:
    """(..., 3) call_model.span_features of stacked pieces from their tile lists (TileList of
    index/full (..., n, W), count (..., n)), each row's and column's tiles counted from them."""
    count = np.asarray(kv_lists.count)
    full, index = np.asarray(kv_lists.full).astype(bool), np.asarray(kv_lists.index)
    listed = np.arange(full.shape[-1]) < count[..., None]
    out = []
    for c, f, i, m in zip(
        count.reshape(-1, count.shape[-1]),
        full.reshape(-1, *full.shape[-2:]),
        index.reshape(-1, *index.shape[-2:]),
        listed.reshape(-1, *listed.shape[-2:]),
    ):
        row_full = (f & m).sum(axis=-1)
        col_all = np.bincount(i[m], minlength=1)
        col_full = np.bincount(i[f & m], minlength=len(col_all))
        rows, cols = (row_full, c - row_full), (col_full, col_all - col_full)
        out.append(call_model.span_features(rows, cols, heads_q, heads_kv, slots))
    return np.array(out).reshape(*count.shape[:-1], 3)
