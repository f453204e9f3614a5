"""The dK/dV grid model (experiments/dkv_grid_model.py): CTAs dealt in launch order to the SM
that frees first, each CTA's cost its steps and walks, paired or not."""

import numpy as np
import pytest

from attn_masks import MaskType, from_slices
from attn_masks.generators import make_mask
from experiments import dkv_grid_model as model
from jax_attn.mask_arrays import prepare_mask


def test_makespan_deals_each_cta_to_the_first_free_slot() -> None:
    # slots end at 3, 1 -> 1 + 2 = 3 -> 3 + 4 (either slot) = 7; balanced 10 / 2
    assert model.makespan([3.0, 1.0, 2.0, 4.0], slots=2) == (7.0, 5.0)
    assert model.makespan([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], slots=2) == (5.0, 5.0)


def _walks_from_dense(name: str, seqlen: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Per 128-key tile: q tiles seeing it, and how many of those only partly."""
    dense = np.asarray(make_mask(name, seqlen).dense(), bool)
    n = seqlen // tile
    seen = dense.reshape(n, tile, n, tile).sum(axis=(1, 3))
    return (seen > 0).sum(axis=0), ((seen > 0) & (seen < tile * tile)).sum(axis=0)


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("tiles_fastest", [False, True])
def test_cta_costs_count_steps_and_walks(paired: bool, tiles_fastest: bool) -> None:
    """causal_document at 1024 tokens, 128x128 tiles, a group of 2 q heads over 3 kv heads:
    each key tile's CTA costs (listed q tiles x 2 sub-tiles x 2 heads, partial steps at 1.5)
    + 2 per walk, paired p with N - 1 - p, repeated per kv head in launch order."""
    arrays = prepare_mask(make_mask("causal_document", 1024), 128, 128)
    count, partial = _walks_from_dense("causal_document", 1024, 128)
    walk = (count - partial + 1.5 * partial) * 2 * 2 + 2.0
    per_tile = [walk[p] + walk[7 - p] for p in range(4)] if paired else list(walk)
    want = [c for _ in range(3) for c in per_tile] if tiles_fastest else np.repeat(per_tile, 3)
    got = model.cta_costs(
        arrays, group=2, kv_heads=3, paired=paired, tiles_fastest=tiles_fastest,
        partial_step_cost=1.5, walk_cost=2.0,
    )  # fmt: skip
    np.testing.assert_allclose(got, want)


def test_an_odd_count_leaves_the_middle_tile_alone() -> None:
    arrays = prepare_mask(make_mask("causal", 640), 128, 128)  # 5 key tiles: walks 5..1
    got = model.cta_costs(
        arrays, group=1, kv_heads=1, paired=True, tiles_fastest=True, walk_cost=0.0
    )
    assert got == [12.0, 12.0, 6.0]  # (5 + 1) x 2, (4 + 2) x 2, 3 x 2 sub-tiles


def test_wide_mask_tiles_launch_two_ctas_each_and_empty_walks_cost_nothing() -> None:
    """256-key mask tiles (the D=64 grid): two 128-key CTAs walk each tile's list; a key tile
    no row sees costs nothing, not even its walk cost."""
    # 256 rows see keys 0-255; keys 256-511 are seen by none
    mask = from_slices([[0, 256]], [[0, 256]], [int(MaskType.FULL)], 256, 512)
    arrays = prepare_mask(mask, 128, 256)
    got = model.cta_costs(arrays, group=1, kv_heads=1, paired=False, tiles_fastest=True)
    assert got == [2 * 2 + 2.0, 2 * 2 + 2.0, 0.0, 0.0]  # 2 q tiles x 2 sub-tiles + 2


@pytest.mark.parametrize("text", ["64", "64:0", "a:8", "6:4", "64:8:1"])
def test_bad_heads_are_named(text: str) -> None:
    with pytest.raises(ValueError, match=f"--heads='{text}'"):
        model.parse_heads(text)
    assert model.parse_heads("64:8") == (64, 8)
