"""Every kernel's per-pass tile lists against a brute-force map of the dense mask.

Triton's tables, the Pallas walks and Flex's block mask all take their lists from
attn_masks.PassTiles; on lengths that divide no tile, a tile reaching past a sequence end must be
partial in each of them (the kernels pad to whole tiles, and only the in-tile mask hides the
padding), which the brute force sees as a tile not fully visible once padded.
"""

from __future__ import annotations

import numpy as np
import pytest

from attn_masks import BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, MaskType, from_slices, pass_tiles
from attn_masks.random_slices import random_slices
from triton_attn import launch

CONFIGS = launch.KernelConfigs(
    fwd=launch.KernelConfig(32, 16, 4, 1),
    dkdv=launch.KernelConfig(16, 64, 4, 1),
    dq=launch.KernelConfig(64, 32, 4, 1),
)
TILES = ((32, 16), (16, 64), (64, 32))


def _masks() -> list[list]:
    """Per geometry of odd lengths (no power-of-two tile divides them): a full mask, whose ragged
    tiles are full over the real rows and cols, and random slices."""
    rng = np.random.default_rng(29)
    out = []
    for seed in range(2):
        sq, sk = (int(x) | 1 for x in rng.integers(40, 300, size=2))
        full = from_slices([[0, sq]], [[0, sk]], [MaskType.FULL], sq, sk)
        out.append([full, random_slices(2 * seed, sq, sk), random_slices(2 * seed + 1, sq, sk)])
    return out


GROUPS = _masks()
MASKS = [m for group in GROUPS for m in group]


def _brute(dense: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """(q tiles, k tiles) kinds of the dense mask zero-padded to whole tiles, in float64."""
    sq, sk = dense.shape
    nq, nk = -(-sq // block_q), -(-sk // block_k)
    padded = np.zeros((nq * block_q, nk * block_k), np.float64)
    padded[:sq, :sk] = dense
    seen = padded.reshape(nq, block_q, nk, block_k).mean(axis=(1, 3))
    return np.where(seen == 1.0, BLOCK_FULL, np.where(seen > 0, BLOCK_PARTIAL, BLOCK_EMPTY))


def _kinds(index, count, full, inner: int) -> np.ndarray:
    """(outer, inner) kinds from compacted lists: the first count[t] entries of row t."""
    index, count, full = np.asarray(index), np.asarray(count), np.asarray(full)
    out = np.full((len(count), inner), BLOCK_EMPTY)
    for t, n in enumerate(count.tolist()):
        out[t, index[t, :n]] = np.where(full[t, :n].astype(bool), BLOCK_FULL, BLOCK_PARTIAL)
    return out


def _selected(indices: np.ndarray, counts: np.ndarray, inner: int) -> np.ndarray:
    """(outer, inner) bool of Flex's (1, 1, outer, inner) indices and num_blocks tables."""
    out = np.zeros((counts.shape[-1], inner), bool)
    for t, n in enumerate(counts[0, 0].tolist()):
        out[t, indices[0, 0, t, :n]] = True
    return out


def test_rule_is_exercised():
    """Some tile reaching past the sequence end is full over the real rows and cols, so a
    consumer that dropped the ragged-edge rule would list it full."""
    for bq, bk in TILES:
        assert all(m.seqlen_q % bq and m.seqlen_k % bk for m in MASKS)
        maps = [m.block_map(bq, bk) for m in MASKS]
        assert any((bm[-1] == BLOCK_FULL).any() for bm in maps)
        assert any((bm[:, -1] == BLOCK_FULL).any() for bm in maps)


@pytest.mark.parametrize("name", ["fwd", "dq", "dkdv"])
def test_pass_tiles(name):
    for mask in MASKS:
        for bq, bk in TILES:
            tiles = pass_tiles(mask, bq, bk, name)
            want = _brute(mask.dense(), bq, bk)
            want = want.T if name == "dkdv" else want
            np.testing.assert_array_equal(tiles.kinds(), want)
            np.testing.assert_array_equal(_kinds(*tiles.arrays, want.shape[1]), want)


def test_triton_tables():
    for mask in MASKS:
        tables = launch.mask_tables(mask, CONFIGS)
        for name in ("fwd", "dq", "dkdv"):
            cfg = getattr(CONFIGS, name)
            want = _brute(mask.dense(), cfg.block_q, cfg.block_k)
            want = want.T if name == "dkdv" else want
            got = _kinds(*getattr(tables, name).arrays, want.shape[1])
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_pallas_walks():
    jax = pytest.importorskip("jax")
    from jax_attn.kernel_inputs import TilePadding, key_tile_walk, query_tile_walk
    from jax_attn.mask_arrays import prepare_mask, stack_mask_arrays

    def _walks(arrays):
        pad = TilePadding.of(arrays)
        return query_tile_walk(arrays, pad), key_tile_walk(arrays, pad)

    for group in GROUPS:
        for bq, bk in TILES:
            stacked = stack_mask_arrays([prepare_mask(m, bq, bk) for m in group])
            walks = jax.jit(jax.vmap(_walks))(stacked)
            for i, mask in enumerate(group):
                want = _brute(mask.dense(), bq, bk)
                for walk, kinds in zip(walks, (want, want.T)):
                    index, n_partial, count = (np.asarray(x[i]) for x in walk)
                    full = np.arange(index.shape[1])[None, :] >= n_partial[:, None]
                    got = _kinds(index, count, full, kinds.shape[1])
                    np.testing.assert_array_equal(got, kinds)


def test_partial_first_on_the_host():
    """PassTiles.partial_first in numpy: the pass's tiles, partial ones first, each kind in
    ascending order, padding entries past count untouched as valid indices."""
    for mask in MASKS:
        for bq, bk in TILES:
            for name in ("fwd", "dkdv"):
                tiles = pass_tiles(mask, bq, bk, name)
                index, n_partial, count = tiles.partial_first()
                want = _brute(mask.dense(), bq, bk)
                want = want.T if name == "dkdv" else want
                full = np.arange(index.shape[1])[None, :] >= n_partial[:, None]
                np.testing.assert_array_equal(_kinds(index, count, full, want.shape[1]), want)
                for t, (n, c) in enumerate(zip(n_partial.tolist(), count.tolist())):
                    assert all(np.diff(index[t, :n]) > 0) and all(np.diff(index[t, n:c]) > 0)
                    assert set(index[t, :c].tolist()) == set(tiles.index[t, :c].tolist())
                assert index.min() >= 0 and index.max() < want.shape[1]


def test_flex_tables():
    pytest.importorskip("torch")
    from torch_attn.blocks import flex_block_tables

    for mask in MASKS:
        for bq, bk in TILES:
            t = flex_block_tables(mask, bq, bk)
            want = _brute(mask.dense(), bq, bk)
            for walk, kinds in (("kv", want), ("q", want.T)):
                inner = kinds.shape[1]
                partial = _selected(t[f"{walk}_indices"], t[f"{walk}_num_blocks"], inner)
                full = _selected(t[f"full_{walk}_indices"], t[f"full_{walk}_num_blocks"], inner)
                np.testing.assert_array_equal(partial, kinds == BLOCK_PARTIAL)
                np.testing.assert_array_equal(full, kinds == BLOCK_FULL)
