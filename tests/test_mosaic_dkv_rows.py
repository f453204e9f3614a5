"""The Mosaic dK/dV kernel's q rows a step per call: the partial-tile share of a mask's tile
lists, the flag the mask arrays carry, the rule, and the rows the backward launches."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_masks import TileList
from attn_masks.generators import make_mask
from jax_attn.mask_arrays import prepare_mask, stack_mask_arrays
from jax_attn.mosaic_gpu import backward as mosaic_bwd
from jax_attn.mosaic_gpu.config import KernelConfig, default_config, dkv_block_q


def _dense_partial_share(name: str, seqlen: int, block_q: int, block_k: int) -> float:
    """Partial tiles over non-empty tiles, counted on the dense mask."""
    dense = make_mask(name, seqlen).dense()
    nq, nk = -(-seqlen // block_q), -(-seqlen // block_k)
    padded = np.zeros((nq * block_q, nk * block_k), bool)
    padded[:seqlen, :seqlen] = dense
    seen = padded.reshape(nq, block_q, nk, block_k).sum(axis=(1, 3))
    listed = seen > 0
    full = seen == block_q * block_k
    return float((listed & ~full).sum() / listed.sum())


@pytest.mark.parametrize("name", ["full", "causal", "causal_document", "sliding_window"])
def test_partial_share_matches_the_dense_mask(name: str) -> None:
    lists = make_mask(name, 2048).block_lists(128, 256)
    want = _dense_partial_share(name, 2048, 128, 256)
    assert lists.kv.partial_share() == pytest.approx(want)
    assert lists.q.partial_share() == pytest.approx(want)


def test_partial_share_counts_only_listed_entries() -> None:
    # two rows: 3 listed (1 full), 1 listed (full); padding repeats the last index, never full
    lists = TileList(
        index=np.array([[0, 1, 2], [4, 4, 4]], np.int32),
        count=np.array([3, 1], np.int32),
        full=np.array([[True, False, False], [True, False, False]]),
    )
    assert lists.partial_share() == pytest.approx(2 / 4)
    empty = TileList(np.zeros((2, 1), np.int32), np.zeros(2, np.int32), np.zeros((2, 1), bool))
    assert empty.partial_share() == 0.0


@pytest.mark.parametrize("seqlen", [16384, 32768])
def test_prepare_mask_flags_few_partial_tiles(seqlen: int) -> None:
    """Full and causal have few partial tiles in the D=64 default's 128x256 tiles; the masks
    measured faster at 64 rows a step have many; a stack is never flagged."""
    tiles = default_config(64, jnp.bfloat16).tiles
    names = ("full", "causal", "causal_document", "share_question", "sliding_window_causal")
    arrays = {n: prepare_mask(make_mask(n, seqlen), *tiles) for n in names}
    flags = {n: a.few_partial_tiles for n, a in arrays.items()}
    assert flags == {
        "full": True,
        "causal": True,
        "causal_document": False,
        "share_question": False,
        "sliding_window_causal": False,
    }
    assert not stack_mask_arrays([arrays["full"], arrays["causal"]]).few_partial_tiles


def test_rule() -> None:
    ws = KernelConfig(block_k=256, bwd_warpgroups=2, dq_warpgroups=2, block_k_dq=128)
    rows = dict(head_dim=64, mask_block_q=128)
    assert dkv_block_q(ws, **rows, few_partial_tiles=True) == 128
    assert dkv_block_q(ws, **rows, few_partial_tiles=False) == 64
    assert dkv_block_q(ws, head_dim=128, mask_block_q=128, few_partial_tiles=True) == 64
    # mask tiles of 64 rows (built by hand): a step cannot hold 128
    assert dkv_block_q(ws, head_dim=64, mask_block_q=64, few_partial_tiles=True) == 64
    assert dkv_block_q(ws, head_dim=64, mask_block_q=256, few_partial_tiles=True) == 128
    for other in (
        dataclasses.replace(ws, fused_bwd=True),
        dataclasses.replace(ws, bwd_pingpong=True),
        dataclasses.replace(ws, bwd_warpgroups=1),
    ):
        assert dkv_block_q(other, **rows, few_partial_tiles=True) == 64
    for fixed in (64, 128):
        chosen = dataclasses.replace(ws, block_q_dkv=fixed)
        for few in (True, False):
            assert dkv_block_q(chosen, **rows, few_partial_tiles=few) == fixed


def test_hand_built_64_row_tiles_still_step_64_rows() -> None:
    """A warp-specialised config on mask arrays of 64-row tiles (a direct caller's): 64 rows a
    step, as before the per-call rule, not a refusal of rows nobody asked for."""
    config = KernelConfig(bwd_warpgroups=2)
    arrays = prepare_mask(make_mask("full", 1024), 64, 128)
    assert arrays.few_partial_tiles
    q = jax.ShapeDtypeStruct((1, 1024, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
    dkv, _ = mosaic_bwd._kernels(q, k, arrays, scale=0.1, config=config, interpret=False)
    assert dkv.block_q == 64


@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_launches_the_rows_per_mask(head_dim: int) -> None:
    """The defaults' dK/dV kernel: 128 rows a step on full and causal at D=64, 64 on
    causal_document and at D=128; 64:8 heads at 16K."""
    config = default_config(head_dim, jnp.bfloat16)
    assert config.block_q_dkv is None
    q = jax.ShapeDtypeStruct((1, 16384, 64, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 16384, 8, head_dim), jnp.bfloat16)
    rows = {}
    for name in ("full", "causal", "causal_document"):
        arrays = prepare_mask(make_mask(name, 16384), *config.tiles)
        dkv, _ = mosaic_bwd._kernels(q, k, arrays, scale=0.1, config=config, interpret=False)
        rows[name] = dkv.block_q
    wide = 128 if head_dim == 64 else 64
    assert rows == {"full": wide, "causal": wide, "causal_document": 64}
