"""Mask.restrict_blocks: the pieces of many key blocks at once, identical to one restrict per
block, and make_plan's pieces built with it."""

import numpy as np
import pytest
from cp_cases import named_mask, random_slices_mask

import shard_strategies as ss
from attn_masks import Mask, MaskType, from_slices, variable_block_sparse
from attn_masks.generators import MASK_NAMES

SEQLEN = 96


def _non_square_mask(rng: np.random.Generator, sq: int, sk: int) -> Mask:
    """Random typed slices on a grid of query and key cuts (seqlen_q != seqlen_k)."""
    qc = np.unique(np.concatenate([[0, sq], rng.integers(1, sq, 4)]))
    kc = np.unique(np.concatenate([[0, sk], rng.integers(1, sk, 4)]))
    cells = [(a, b) for a in range(len(qc) - 1) for b in range(len(kc) - 1) if rng.random() < 0.6]
    q = [(qc[a], qc[a + 1]) for a, _ in cells]
    k = [(kc[b], kc[b + 1]) for _, b in cells]
    t = rng.integers(0, 4, len(cells))
    return from_slices(q, k, t, sq, sk, name="non_square")


def _masks(seed: int) -> dict[str, Mask]:
    rng = np.random.default_rng(seed)
    out = {name: named_mask(name, SEQLEN, seed=seed) for name in MASK_NAMES}
    out["random_slices"] = random_slices_mask(SEQLEN, seed)
    out["block_sparse"] = variable_block_sparse(SEQLEN, 12, 0.4, min_block=4, seed=seed)
    out["non_square"] = _non_square_mask(rng, int(rng.integers(20, 70)), int(rng.integers(20, 90)))
    return out


def _query_sets(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    half = np.arange(n // 4)
    return {
        "sorted_runs": np.sort(rng.choice(n, int(rng.integers(1, n)), replace=False)),
        "zigzag": np.concatenate([half + n // 4, n - 1 - half[::-1] - n // 8]),
        "permutation": rng.permutation(n)[: int(rng.integers(1, n + 1))],
        "repeated": rng.integers(0, n, int(rng.integers(1, 40))),
        "empty": np.zeros(0, np.int64),
    }


def _key_blocks(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Empty blocks, contiguous blocks continuing each other, permutations, repeats."""
    cuts = np.sort(rng.choice(np.arange(1, n), 3, replace=False))
    return [
        np.arange(0, cuts[0]),
        np.arange(cuts[0], cuts[1]),  # continues the block before
        np.zeros(0, np.int64),
        np.arange(cuts[1], cuts[2]),  # continues the block before the empty one
        rng.permutation(n)[: int(rng.integers(1, n + 1))],
        np.zeros(0, np.int64),
        rng.integers(0, n, int(rng.integers(1, 30))),
        np.arange(n),
        np.arange(n)[::-1],
        np.arange(cuts[2], n),
    ]


def _assert_same(got: Mask, want: Mask, what: str) -> None:
    assert (got.seqlen_q, got.seqlen_k) == (want.seqlen_q, want.seqlen_k), what
    assert (got.name, got.params) == (want.name, want.params), what
    for g, w in zip(got.slices, want.slices):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        np.testing.assert_array_equal(g, w, err_msg=what)


@pytest.mark.parametrize("seed", range(4))
def test_blocks_equal_one_restrict_per_block_and_the_dense_mask(seed):
    rng = np.random.default_rng(1000 + seed)
    for name, mask in _masks(seed).items():
        dense = mask.dense()
        blocks = _key_blocks(rng, mask.seqlen_k)
        for qname, qp in _query_sets(rng, mask.seqlen_q).items():
            pieces = mask.restrict_blocks(qp, blocks)
            assert len(pieces) == len(blocks)
            for b, (piece, kb) in enumerate(zip(pieces, blocks)):
                what = f"{name} {qname} block {b}"
                _assert_same(piece, mask.restrict(qp, kb), what)
                assert (piece.seqlen_q, piece.seqlen_k) == (len(qp), len(kb)), what
                np.testing.assert_array_equal(piece.dense(), dense[np.ix_(qp, kb)], err_msg=what)
                # no empty or overlapping slices: from_slices keeps and accepts every one
                assert from_slices(*piece.slices, len(qp) or 1, len(kb) or 1).num_slices == (
                    piece.num_slices
                ), what


def test_adjacent_contiguous_blocks_are_split_exactly():
    """Blocks [0, 10), [10, 30), [30, 31) of a causal mask: a split one key off would move a key
    column into the wrong piece and change its shape and its slices."""
    mask = named_mask("causal", SEQLEN)
    bounds = [(0, 10), (10, 30), (30, 31)]
    pieces = mask.restrict_blocks(np.arange(SEQLEN), [np.arange(a, b) for a, b in bounds])
    np.testing.assert_array_equal(np.hstack([p.dense() for p in pieces]), mask.dense()[:, :31])
    for piece, (a, b) in zip(pieces, bounds):
        # rows a..b-1 see a causal corner of the block's keys, the rows below see all of them
        assert piece.seqlen_k == b - a
        np.testing.assert_array_equal(piece.q_ranges, [[a, b], [b, SEQLEN]])
        np.testing.assert_array_equal(piece.k_ranges, [[0, b - a], [0, b - a]])
        np.testing.assert_array_equal(piece.types, [MaskType.CAUSAL, MaskType.FULL])


def test_no_blocks_and_bad_positions():
    mask = named_mask("causal_document", SEQLEN)
    assert mask.restrict_blocks(np.arange(5), []) == []
    with pytest.raises(ValueError, match="k_positions"):
        mask.restrict_blocks(np.arange(5), [np.arange(3), [SEQLEN]])
    with pytest.raises(ValueError, match="q_positions"):
        mask.restrict_blocks([-1], [np.arange(3)])


PLAN_CASES = [  # (strategy, world size, ulysses size, layout)
    ("ring", 8, None, "zigzag"),
    ("ring", 6, None, "contiguous"),
    ("ring", 8, None, "balanced"),
    ("allgather", 4, None, "zigzag"),
    ("ulysses", 4, None, "contiguous"),
    ("usp", 8, 2, "balanced"),
    ("double_ring", 8, None, "zigzag"),
]


@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: f"{c[0]}-N{c[1]}-{c[3]}")
@pytest.mark.parametrize("mask_name", ["causal_document", "full_document", "share_question"])
def test_plan_pieces_equal_one_restrict_per_rank_and_step(case, mask_name):
    strategy, world, ulysses, layout = case
    mask = named_mask(mask_name, 101)
    plan = ss.make_plan(mask, world, strategy, layout, ulysses)
    padded = ss.plan.padded_mask(mask, plan.padded_seqlen)
    for r in range(plan.ring_size):
        for t in range(plan.num_steps):
            want = padded.restrict(plan.layout.positions[r], plan.key_positions(r, t))
            _assert_same(plan.pieces[r][t], want, f"rank {r} step {t}")
