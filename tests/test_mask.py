"""Mask model: slices -> area, dense, per-row intervals, block maps, restriction, validation."""

import time

import numpy as np
import pytest
from cp_cases import brute_dense

from attn_masks import (
    BLOCK_EMPTY,
    BLOCK_FULL,
    BLOCK_PARTIAL,
    MASK_NAMES,
    MaskType,
    from_slices,
    joined_slices,
    make_mask,
    tiles,
    uniform_block_sparse,
    variable_block_sparse,
)


def random_slices(rng, sq, sk, max_cuts=4):
    """Random non-overlapping slices on a grid of q and k cuts, random types."""

    def cuts(n):
        inner = (
            rng.choice(
                np.arange(1, n), size=min(n - 1, int(rng.integers(0, max_cuts))), replace=False
            )
            if n > 1
            else []
        )
        return np.concatenate([[0], np.sort(inner), [n]]).astype(int)

    qb, kb = cuts(sq), cuts(sk)
    qr, kr, ty = [], [], []
    for a in range(len(qb) - 1):
        for b in range(len(kb) - 1):
            if rng.random() < 0.6:
                qr.append((qb[a], qb[a + 1]))
                kr.append((kb[b], kb[b + 1]))
                ty.append(int(rng.integers(0, 4)))
    return np.array(qr, int).reshape(-1, 2), np.array(kr, int).reshape(-1, 2), ty


def brute_block_map(dense, bq, bk):
    """Each tile's visible cells counted on the dense mask, against its real cells."""
    rows, cols = np.arange(0, dense.shape[0], bq), np.arange(0, dense.shape[1], bk)
    seen = np.add.reduceat(np.add.reduceat(dense.astype(np.int64), rows, 0), cols, 1)
    real = np.outer(np.diff(np.r_[rows, dense.shape[0]]), np.diff(np.r_[cols, dense.shape[1]]))
    return np.where(seen == real, BLOCK_FULL, np.where(seen > 0, BLOCK_PARTIAL, BLOCK_EMPTY))


@pytest.mark.parametrize("seed", range(60))
def test_random_slices_dense_area_blocks_restrict(seed):
    rng = np.random.default_rng(seed)
    sq, sk = int(rng.integers(1, 70)), int(rng.integers(1, 70))
    qr, kr, ty = random_slices(rng, sq, sk)
    mask = from_slices(qr, kr, ty, sq, sk)
    dense = brute_dense(qr, kr, ty, sq, sk)
    np.testing.assert_array_equal(mask.dense(), dense)
    assert mask.area() == dense.sum()
    for bq, bk in [(4, 8), (16, 16), (7, 5), (64, 32)]:
        np.testing.assert_array_equal(mask.block_map(bq, bk), brute_block_map(dense, bq, bk))
    qp = rng.permutation(sq)[: int(rng.integers(1, sq + 1))]
    kp = rng.permutation(sk)[: int(rng.integers(1, sk + 1))]
    if seed % 2:
        qp, kp = np.sort(qp), np.sort(kp)
    piece = mask.restrict(qp, kp)
    np.testing.assert_array_equal(piece.dense(), dense[np.ix_(qp, kp)])
    assert piece.area() == dense[np.ix_(qp, kp)].sum()


def _split_full_slices(rng, q_ranges, k_ranges, types):
    """The slices with each FULL one cut at a random row and a random key (where it is wider
    than one), the pieces shuffled with the others."""
    out = []
    for (q0, q1), (k0, k1), t in zip(q_ranges, k_ranges, types):
        if t != MaskType.FULL or q1 - q0 < 2 or k1 - k0 < 2:
            out.append((q0, q1, k0, k1, t))
            continue
        qc, kc = int(rng.integers(q0 + 1, q1)), int(rng.integers(k0 + 1, k1))
        for a, b in ((q0, qc), (qc, q1)):
            out += [(a, b, k0, kc, t), (a, b, kc, k1, t)]
    out = [out[i] for i in rng.permutation(len(out))]
    cols = np.array(out, np.int64).reshape(-1, 5)
    return cols[:, :2], cols[:, 2:4], cols[:, 4].astype(np.asarray(types).dtype)


def _slice_set(q_ranges, k_ranges, types):
    return sorted(
        zip(
            map(tuple, np.asarray(q_ranges).tolist()),
            map(tuple, np.asarray(k_ranges).tolist()),
            np.asarray(types).tolist(),
        )
    )


@pytest.mark.parametrize(
    "name",
    ["full", "full_document", "share_question", "prefix_lm_document", "global_sliding_window"],
)
def test_joined_slices_undo_a_split_and_keep_the_visible_pairs(name):
    """A mask's FULL slices cut in four at random points and shuffled join back into the
    mask's own slices (none of which touch another over a whole side), the dense mask of every
    form equal to the original's; slices with nothing to join come back as given."""
    rng = np.random.default_rng(7)
    mask = make_mask(name, 2048, window=128)
    qr, kr, ty = mask.slices
    same = joined_slices(qr, kr, ty)
    assert all(a is b for a, b in zip(same, (qr, kr, ty)))
    split = _split_full_slices(rng, qr, kr, ty)
    assert len(split[2]) > len(ty)
    joined = joined_slices(*split)
    assert _slice_set(*joined) == _slice_set(qr, kr, ty)
    again = joined_slices(*(a[::-1] for a in split))  # one form whatever the slices' order
    for a, b in zip(again, joined):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    want = brute_dense(qr, kr, ty, mask.seqlen_q, mask.seqlen_k)
    for form in (split, joined):
        np.testing.assert_array_equal(brute_dense(*form, mask.seqlen_q, mask.seqlen_k), want)


def test_joined_slices_join_only_whole_touching_full_sides():
    """FULL slices join where one ends where the other starts over the same range of the other
    axis, in either order; a gap, a different range or another type keeps them apart."""
    full, causal = MaskType.FULL, MaskType.CAUSAL

    def join(*slices):
        q, k, t = zip(*slices)
        return _slice_set(*joined_slices(np.array(q), np.array(k), np.array(t)))

    assert join(((4, 8), (0, 6), full), ((0, 4), (0, 6), full)) == [((0, 8), (0, 6), full)]
    assert join(((0, 4), (3, 6), full), ((0, 4), (0, 3), full)) == [((0, 4), (0, 6), full)]
    quad = [((a, a + 2), (b, b + 2), full) for a in (0, 2) for b in (0, 2)]
    assert join(*quad) == [((0, 4), (0, 4), full)]
    two_rounds = [((0, 2), (0, 3), full), ((0, 2), (3, 6), full), ((2, 4), (0, 6), full)]
    assert join(*two_rounds) == [((0, 4), (0, 6), full)]  # keys first, then the rows
    one_row = [((4, 5), (0, 4), causal), ((0, 4), (0, 4), full)]  # sees its whole rectangle
    assert join(*one_row) == [((0, 5), (0, 4), full)]
    apart = [
        [((0, 4), (0, 6), full), ((5, 8), (0, 6), full)],  # a gap
        [((0, 4), (0, 6), full), ((4, 8), (0, 5), full)],  # another key range
        [((0, 4), (0, 4), causal), ((4, 8), (0, 4), causal)],  # not FULL
        [((0, 4), (0, 4), full), ((4, 8), (0, 4), causal)],
    ]
    for slices in apart:
        assert join(*slices) == _slice_set(*zip(*slices))


@pytest.mark.parametrize("seed", range(4))
def test_joined_slices_of_random_grids_are_final_and_cover_the_same_pairs(seed):
    """Random cells of a random grid, most FULL, some causal, in random order: the joined form
    covers the same pairs (brute force), joins nothing more when joined again (every chain was
    joined in one call), and has no two FULL slices touching over a whole side."""
    rng = np.random.default_rng(300 + seed)
    full = MaskType.FULL
    for _ in range(50):
        qe, ke = (np.unique(np.r_[0, rng.integers(1, 30, rng.integers(1, 7)), 30]) for _ in "qk")
        cells = [
            (q0, q1, k0, k1, rng.choice([full, full, full, MaskType.CAUSAL]))
            for q0, q1 in zip(qe, qe[1:])
            for k0, k1 in zip(ke, ke[1:])
            if rng.random() < 0.8
        ]
        if not cells:
            continue
        a = np.array([cells[i] for i in rng.permutation(len(cells))], np.int64)
        given = (a[:, :2], a[:, 2:4], a[:, 4].astype(np.int8))
        joined = joined_slices(*given)
        again = joined_slices(*joined)
        assert all(x is y for x, y in zip(again, joined))
        np.testing.assert_array_equal(brute_dense(*joined, 30, 30), brute_dense(*given, 30, 30))
        boxes = [(*q, *k) for q, k, t in zip(*map(np.ndarray.tolist, joined)) if t == full]
        for b in boxes:
            for c in boxes:
                assert not (b[2:] == c[2:] and b[1] == c[0]), (b, c)
                assert not (b[:2] == c[:2] and b[3] == c[2]), (b, c)


@pytest.mark.parametrize("seed", range(10))
def test_row_intervals_describe_every_row(seed):
    rng = np.random.default_rng(100 + seed)
    sq, sk = 50, 60
    qr, kr, ty = random_slices(rng, sq, sk)
    mask = from_slices(qr, kr, ty, sq, sk)
    lo, hi = mask.row_intervals()
    dense = brute_dense(qr, kr, ty, sq, sk)
    cols = np.arange(sk)
    rebuilt = ((cols >= lo[..., None]) & (cols < hi[..., None])).any(axis=1)
    np.testing.assert_array_equal(rebuilt, dense)
    used = hi > lo
    # intervals in a row are sorted, disjoint and not touching (merged)
    for r in range(sq):
        iv = list(zip(lo[r][used[r]], hi[r][used[r]]))
        assert all(a[1] < b[0] for a, b in zip(iv, iv[1:]))


def test_block_lists_match_block_map():
    rng = np.random.default_rng(7)
    qr, kr, ty = random_slices(rng, 90, 77, max_cuts=6)
    mask = from_slices(qr, kr, ty, 90, 77)
    bm = mask.block_map(16, 8)
    bl = mask.block_lists(16, 8)
    for qb in range(bm.shape[0]):
        idx = bl.kv.index[qb, : bl.kv.count[qb]]
        np.testing.assert_array_equal(idx, np.nonzero(bm[qb])[0])
        np.testing.assert_array_equal(bl.kv.full[qb, : bl.kv.count[qb]], bm[qb, idx] == BLOCK_FULL)
    for kb in range(bm.shape[1]):
        idx = bl.q.index[kb, : bl.q.count[kb]]
        np.testing.assert_array_equal(idx, np.nonzero(bm[:, kb])[0])


def test_causal_area_closed_form_and_bottom_right_alignment():
    wide = from_slices([[0, 4]], [[0, 10]], [MaskType.CAUSAL], 4, 10)
    assert wide.dense()[0].sum() == 7  # row 0 sees lk - lq + 1 keys
    tall = from_slices([[0, 10]], [[0, 4]], [MaskType.CAUSAL], 10, 4)
    assert not tall.dense()[:6].any() and tall.area() == 10
    n = 1 << 20
    big = from_slices([[0, n]], [[0, n]], [MaskType.CAUSAL], n)
    assert big.area() == n * (n + 1) // 2


def test_large_document_mask_never_goes_dense():
    n = 1 << 20
    rng = np.random.default_rng(0)
    cu = np.concatenate([[0], np.cumsum(rng.integers(1000, 30000, size=100))])
    cu = np.append(cu[cu < n], n)
    ranges = np.stack([cu[:-1], cu[1:]], 1)
    mask = from_slices(ranges, ranges, np.full(len(ranges), MaskType.CAUSAL), n)
    bm = mask.block_map(128, 128)
    lens = np.diff(cu)
    assert mask.area() == int((lens * (lens + 1) // 2).sum())
    # diagonal tiles are partial, a tile strictly below the diagonal inside doc 0 is full
    assert bm[0, 0] == BLOCK_PARTIAL and bm[5, 0] == (BLOCK_FULL if cu[1] >= 6 * 128 else bm[5, 0])
    assert bm[0, -1] == BLOCK_EMPTY


@pytest.mark.parametrize(
    "args, match",
    [
        (([[0, 4], [2, 6]], [[0, 4], [0, 4]], [0, 0], 8), "overlapping"),
        (([[0, 9]], [[0, 4]], [0], 8), r"q_ranges\[0\] = \[0, 9\)"),
        (([[0, 4]], [[3, 2]], [0], 8), r"k_ranges\[0\]"),
        (([[0, 4]], [[0, 4]], [7], 8), "slice type 7"),
        (([[0, 4]], [[0, 4]], [0], 0), "seqlen_q must be a positive integer, got 0"),
        (([[0, 4]], [[0, 4]], [0, 1], 8), "same length"),
    ],
)
def test_bad_slices_raise_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        from_slices(*args)


def test_bad_block_and_positions():
    mask = from_slices([[0, 8]], [[0, 8]], [1], 8)
    with pytest.raises(ValueError, match="block_q must be a positive integer, got 0"):
        mask.block_map(0, 4)
    with pytest.raises(ValueError, match=r"q_positions must lie in \[0, 8\)"):
        mask.restrict([0, 9], [0])
    with pytest.raises(ValueError, match="dense"):
        from_slices([[0, 1 << 20]], [[0, 1 << 20]], [1], 1 << 20).dense()


def test_empty_slices_are_dropped_and_empty_rows_allowed():
    mask = from_slices([[0, 3], [5, 5]], [[0, 3], [0, 4]], [1, 0], 8)
    assert mask.num_slices == 1
    assert not mask.dense()[3:].any()


def test_classify_reads_rows_not_slices():
    from attn_masks import classify

    s = 40
    # causal cut into a CAUSAL top block and FULL | CAUSAL pieces below
    pieces = from_slices(
        [[0, 16], [16, s], [16, s]],
        [[0, 16], [0, 16], [16, s]],
        [MaskType.CAUSAL, MaskType.FULL, MaskType.CAUSAL],
        s,
    )
    rs = classify(pieces)
    assert rs.single and rs.is_causal and not rs.is_full and rs.window == (-1, 0)
    assert rs.documents[1] is True and classify(pieces) is rs  # one causal document
    full = classify(from_slices([[0, s], [0, s]], [[0, 9], [9, s]], [0, 0], s))
    assert full.is_full and full.window == (-1, -1) and full.documents[1] is False
    docs = classify(from_slices([[0, 9], [9, s]], [[0, 9], [9, s]], [1, 1], s))
    assert docs.window is None and docs.documents[1] is True
    np.testing.assert_array_equal(docs.documents[0], [0, 9, s])
    tall = classify(from_slices([[0, 3]], [[0, 1]], [MaskType.CAUSAL], 3, 1))
    assert tall.is_causal and tall.empty_rows == 2 and tall.window is None
    with pytest.raises(ValueError, match="attn_masks.Mask"):
        classify(np.ones((4, 4), bool))


# --- block map from the slices (fragmented masks) ---------------------------------------------

TILES = [(1, 1), (4, 8), (16, 16), (7, 5), (64, 32), (3, 100)]


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("seed", range(40))
def test_block_map_matches_brute(seed, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(tiles, "CHUNK_ENTRIES", chunk)
    rng = np.random.default_rng(500 + seed)
    sq, sk = int(rng.integers(1, 90)), int(rng.integers(1, 90))
    qr, kr, ty = random_slices(rng, sq, sk, max_cuts=8)
    mask = from_slices(qr, kr, ty, sq, sk)
    dense = brute_dense(qr, kr, ty, sq, sk)
    for bq, bk in TILES:
        expected = brute_block_map(dense, bq, bk)
        np.testing.assert_array_equal(tiles.block_map(mask, bq, bk), expected)
        _assert_counts(tiles.tile_counts(mask, bq, bk), expected)


def _assert_counts(counts, kinds, err_msg=""):
    """tile_counts' (FULL, PARTIAL) per row and per column are those of the tile map `kinds`."""
    for axis, (full, partial) in zip((1, 0), counts):
        np.testing.assert_array_equal(full, (kinds == BLOCK_FULL).sum(axis), err_msg=err_msg)
        np.testing.assert_array_equal(partial, (kinds == BLOCK_PARTIAL).sum(axis), err_msg=err_msg)


def _assert_block_maps_brute(mask, tile_shapes, err_msg=""):
    dense = brute_dense(mask.q_ranges, mask.k_ranges, mask.types, mask.seqlen_q, mask.seqlen_k)
    for bq, bk in tile_shapes:
        expected = brute_block_map(dense, bq, bk)
        np.testing.assert_array_equal(tiles.block_map(mask, bq, bk), expected, err_msg=err_msg)
        _assert_counts(mask.tile_counts(bq, bk), expected, err_msg)


@pytest.mark.parametrize("compat", [False, True])
@pytest.mark.parametrize("name", MASK_NAMES)
def test_block_map_matches_brute_on_every_mask(name, compat):
    for n in (1024, 3072):
        params = {"block_size": 64} if name == "block_causal_document" and n % 1024 else {}
        m = make_mask(name, n, seed=n, window=37, reference_compat=compat, **params)
        _assert_block_maps_brute(m, [(128, 128), (64, 128), (128, 32), (100, 70)], name)


@pytest.mark.parametrize(
    "mask",
    [
        uniform_block_sparse(4096, 64, 0.5, seed=1),
        uniform_block_sparse(4000, 48, 0.3, seed=2),
        variable_block_sparse(8192, 256, 0.4, min_block=100, seed=3),
    ],
    ids=["uniform64", "uniform48_ragged", "variable"],
)
def test_block_map_matches_brute_on_block_sparse(mask):
    _assert_block_maps_brute(mask, [(128, 128), (64, 64), (64, 128), (32, 96), (100, 70)])


@pytest.mark.parametrize("seed", range(30))
def test_slice_depth_counts_slices_per_row_and_bounds_intervals(seed):
    rng = np.random.default_rng(900 + seed)
    sq, sk = int(rng.integers(1, 90)), int(rng.integers(1, 90))
    qr, kr, ty = random_slices(rng, sq, sk, max_cuts=8)
    whole = from_slices(qr, kr, ty, sq, sk)
    keep = np.sort(rng.choice(sq, size=int(rng.integers(1, sq + 1)), replace=False))
    for mask in (whole, whole.restrict(rng.permutation(keep), np.arange(sk))):
        per_row = np.zeros(mask.seqlen_q, np.int64)
        for a, b in mask.q_ranges:
            per_row[a:b] += 1
        assert mask.slice_depth() == per_row.max(initial=0)
        assert mask.row_intervals()[0].shape[1] <= max(mask.slice_depth(), 1)


def test_block_map_never_builds_row_intervals():
    for m in (uniform_block_sparse(1024, 16, 0.5), make_mask("causal_document", 4096)):
        m.__dict__.pop("_row_intervals", None)  # from_slices reads them to validate the slices
        bm = m.block_map(32, 32)
        assert "_row_intervals" not in m.__dict__
        dense = brute_dense(m.q_ranges, m.k_ranges, m.types, m.seqlen_q, m.seqlen_k)
        np.testing.assert_array_equal(bm, brute_block_map(dense, 32, 32))


def test_tile_counts_never_build_the_block_map():
    """A 2M-token causal mask's counts (a 268M-tile map if built): no map cached on the mask,
    and the counts a causal mask's tiles have (row t: t FULL and its diagonal PARTIAL)."""
    m = make_mask("causal", 1 << 21)
    (row_full, row_partial), (col_full, col_partial) = m.tile_counts(128, 128)
    assert "_block_map_cache" not in m.__dict__
    n = (1 << 21) // 128
    np.testing.assert_array_equal(row_full, np.arange(n))
    np.testing.assert_array_equal(col_full, n - 1 - np.arange(n))
    assert (row_partial == 1).all() and (col_partial == 1).all()


def test_block_sparse_131k_block_map_is_fast_and_exact():
    m = uniform_block_sparse(131072, 64, 0.5)
    start = time.perf_counter()
    bm = m.block_map(128, 128)
    elapsed = time.perf_counter() - start
    assert "_row_intervals" not in m.__dict__
    n = 131072 // 64
    kept = np.zeros((n, n), bool)
    np.put_along_axis(kept, m.params["kept_blocks"].astype(np.int64), True, axis=1)
    per_tile = kept.reshape(n // 2, 2, n // 2, 2).sum(axis=(1, 3))
    expected = np.where(per_tile == 4, BLOCK_FULL, np.where(per_tile > 0, BLOCK_PARTIAL, 0))
    np.testing.assert_array_equal(bm, expected)
    assert elapsed < 5.0
    _assert_counts(m.tile_counts(128, 128), expected)


def test_random_slices_are_reproducible_and_varied():
    """Same seed, same mask; across seeds rows see zero, one and two key intervals."""
    from attn_masks import random_slices

    a, b = random_slices(3, 200, 170), random_slices(3, 200, 170)
    assert (a.seqlen_q, a.seqlen_k) == (200, 170)
    assert np.array_equal(a.dense(), b.dense())
    seen = set()
    for seed in range(20):
        lo, hi = random_slices(seed, 200, 170).row_intervals()
        seen |= set((hi > lo).sum(axis=1).tolist())
    assert {0, 1, 2} <= seen


@pytest.mark.parametrize("style", ["random", "one_run", "empty", "dense_holes"])
def test_tile_lists_match_a_row_by_row_reference(style):
    """block_lists' lists of random block maps (rows of one run take the fast path, the others
    the general one) equal a row-by-row reference: each row's non-empty tiles in order, padded by
    its last, full flags only on FULL tiles and never on padding, counts and dtypes."""
    from attn_masks.tiles import BLOCK_FULL, block_lists

    rng = np.random.default_rng(len(style))
    for _ in range(40):
        n, m = (int(x) for x in rng.integers(1, 30, 2))
        if style == "random":
            kinds = rng.integers(0, 3, (n, m))
        elif style == "one_run":
            kinds = np.zeros((n, m), int)
            for i in range(n):
                a = int(rng.integers(0, m + 1))
                b = int(rng.integers(a, m + 1))
                kinds[i, a:b] = rng.integers(1, 3, b - a)
        elif style == "empty":
            kinds = np.zeros((n, m), int)
        else:
            kinds = (rng.random((n, m)) < 0.9) * rng.integers(1, 3, (n, m))
        kinds = kinds.astype(np.int8)
        lists = block_lists(kinds, 16, 16)
        for got, k in ((lists.kv, kinds), (lists.q, kinds.T)):
            width = max(int((k > 0).sum(axis=1).max(initial=0)), 1)
            assert got.index.shape == got.full.shape == (len(k), width)
            assert got.index.dtype == np.int32 and got.count.dtype == np.int32
            for row, tiles_row in enumerate(k):
                cols = np.flatnonzero(tiles_row > 0)
                want = np.full(width, cols[-1] if len(cols) else 0)
                want[: len(cols)] = cols
                flags = np.zeros(width, bool)
                flags[: len(cols)] = tiles_row[cols] == BLOCK_FULL
                assert got.count[row] == len(cols)
                np.testing.assert_array_equal(got.index[row], want)
                np.testing.assert_array_equal(got.full[row], flags)


def _random_block_map(rng, n, m, style):
    """An (n, m) int8 block map whose rows are one run each, several runs with holes, or empty."""
    kinds = np.zeros((n, m), np.int8)
    for row in range(n):
        runs = {"one_run": 1, "runs": int(rng.integers(2, 5)), "mixed": int(rng.integers(0, 4))}
        for _ in range(runs[style]):
            a = int(rng.integers(0, m))
            b = int(rng.integers(a + 1, m + 1))
            kinds[row, a:b] = rng.integers(BLOCK_PARTIAL, BLOCK_FULL + 1, b - a)
        if style != "one_run":
            kinds[row, rng.random(m) < 0.1] = BLOCK_EMPTY
    kinds[rng.random(n) < 0.1] = BLOCK_EMPTY
    return kinds


def test_compact_matches_a_list_per_row_reference_on_large_maps():
    """tiles._compact (one-run rows by windows, the others by the general path) equals a plain
    per-row reference on random maps up to 300 x 2000 in both orientations: rows of one run,
    of several runs with holes, empty rows, all-empty and all-full maps, single rows and columns,
    and a last row whose window reaches past the map."""

    def reference(kinds):
        cols = [np.flatnonzero(row > 0) for row in kinds]
        count = np.array([len(c) for c in cols], np.int32)
        width = max(int(count.max(initial=0)), 1)
        index = np.zeros((len(kinds), width), np.int32)
        full = np.zeros((len(kinds), width), bool)
        for row, c in enumerate(cols):
            index[row] = c[-1] if len(c) else 0
            index[row, : len(c)] = c
            full[row, : len(c)] = kinds[row, c] == BLOCK_FULL
        return index, count, full

    rng = np.random.default_rng(7)
    maps = [np.zeros((5, 7), np.int8), np.full((4, 9), BLOCK_FULL, np.int8)]
    maps += [np.array([[0, 1, 2, 0, 2]], np.int8), np.array([[1], [0], [2]], np.int8)]
    last_late = np.zeros((6, 40), np.int8)  # width 40; the last row's run starts at 30
    last_late[0] = BLOCK_FULL
    last_late[-1, 30:] = [1, 2, 2, 1, 2, 2, 2, 1, 2, 2]
    maps.append(last_late)
    for n, m in [(1, 1), (1, 50), (50, 1), (300, 2000), (64, 1500), (200, 300), (17, 3)]:
        for style in ("one_run", "runs", "mixed"):
            maps.append(_random_block_map(rng, n, m, style))
    for kinds in maps:
        for k in (kinds, np.ascontiguousarray(kinds.T)):
            got = tiles._compact(k)
            for name, g, want in zip(("index", "count", "full"), got.arrays, reference(k)):
                assert g.dtype == want.dtype and g.shape == want.shape, (name, k.shape)
                np.testing.assert_array_equal(g, want, err_msg=f"{name} of a {k.shape} map")
