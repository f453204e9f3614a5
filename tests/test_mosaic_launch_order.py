"""The Mosaic kernels' launch order per call: walk spread, the uneven-walks flag of the mask
arrays, the rule that picks heads or tiles fastest, and that both kernels' launches get it."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from tile_lists import walks

from attn_masks import TileList
from attn_masks.generators import make_mask
from jax_attn.mask_arrays import prepare_mask, stack_mask_arrays
from jax_attn.mosaic_gpu import api as mosaic_api
from jax_attn.mosaic_gpu import backward as mosaic_bwd
from jax_attn.mosaic_gpu.config import (
    KernelConfig,
    default_config,
    grid_axes,
    launch_tiles_fastest,
)
from jax_attn.mosaic_gpu.mask_operands import mask_operands

EVEN = ("full", "causal", "sliding_window", "sliding_window_causal", "prefix_lm_causal")
UNEVEN = ("causal_document", "share_question", "causal_blockwise", "prefix_lm_document")


def test_walk_spread_ignores_constant_steps_and_ragged_diagonals() -> None:
    assert walks([5, 5, 5, 5]).walk_spread() == 0.0  # full or a window
    assert walks([1, 2, 3, 4, 5]).walk_spread() == 0.0  # causal
    assert walks([1, 1, 2, 2, 3, 3]).walk_spread() == 0.0  # causal, key tile twice as wide
    assert walks([0, 0, 0]).walk_spread() == 0.0
    assert walks([7]).walk_spread() == 0.0
    assert walks([]).walk_spread() == 0.0
    stacked = TileList(
        np.zeros((2, 0, 1), np.int32), np.zeros((2, 0), np.int32), np.zeros((2, 0, 1))
    )
    assert stacked.walk_spread() == 0.0


def test_walk_spread_measures_jumps_between_neighbours() -> None:
    # steps -7, +7, -7: median -7, the +7 is 14 off (13 beyond one tile); mean walk 4.5
    assert walks([8, 1, 8, 1]).walk_spread() == pytest.approx(13 / 3 / 4.5)
    documents = walks([4, 4, 4, 4, 1, 1, 6, 6, 6])
    assert documents.walk_spread() > walks([4, 4, 4, 4, 4, 4, 6, 6, 6]).walk_spread()


@pytest.mark.parametrize("tiles", [(128, 128), (128, 256)])
@pytest.mark.parametrize("seqlen", [8192, 32768])
def test_document_masks_have_uneven_walks_and_dense_or_banded_ones_do_not(
    seqlen: int, tiles: tuple[int, int]
) -> None:
    for name in EVEN:
        assert not prepare_mask(make_mask(name, seqlen), *tiles).uneven_walks, name
    for name in UNEVEN:
        assert prepare_mask(make_mask(name, seqlen), *tiles).uneven_walks, name


def test_a_stack_is_never_flagged_so_its_masks_share_one_program() -> None:
    even, uneven = (
        prepare_mask(make_mask(n, 8192), 128, 128) for n in ("causal", "share_question")
    )
    assert uneven.uneven_walks and not even.uneven_walks
    for items in ([even, uneven], [uneven, uneven], [even, even]):
        assert not stack_mask_arrays(items).uneven_walks


@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("group", [1, 8])
def test_launch_rule(group: int, uneven: bool) -> None:
    for fixed in (False, True):
        config = KernelConfig(tiles_fastest=fixed)
        assert launch_tiles_fastest(config, group=group, uneven_walks=uneven) is fixed
    chosen = launch_tiles_fastest(
        KernelConfig(tiles_fastest=None), group=group, uneven_walks=uneven
    )
    assert chosen is (not (group > 1 and uneven))


def test_grid_axes_refuses_an_unresolved_order() -> None:
    with pytest.raises(ValueError, match="launch_tiles_fastest"):
        grid_axes(("tiles", 4), 2, 1, tiles_fastest=None)
    assert grid_axes(("tiles", 4), 2, 1, tiles_fastest=True)["grid_names"][-1] == "tiles"
    assert grid_axes(("tiles", 4), 2, 1, tiles_fastest=False)["grid_names"][-1] == "batch"


def _inputs(mask: str, heads_kv: int) -> tuple:
    config = default_config(128, jnp.bfloat16)
    arrays = prepare_mask(make_mask(mask, 4096), *config.tiles)
    q = jnp.ones((1, 4096, 8, 128), jnp.bfloat16)
    k = jnp.ones((1, 4096, heads_kv, 128), jnp.bfloat16)
    return config, arrays, q, k


@pytest.mark.parametrize(
    ("mask", "heads_kv", "tiles_fastest"),
    [("share_question", 1, False), ("share_question", 8, True), ("causal", 1, True)],
)
def test_both_kernels_launch_in_the_order_the_rule_picks(
    mask: str, heads_kv: int, tiles_fastest: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, arrays, q, k = _inputs(mask, heads_kv)
    assert config.tiles_fastest is None
    kernels = mosaic_bwd._kernels(q, k, arrays, scale=0.1, config=config, interpret=False)
    assert [kern.tiles_fastest for kern in kernels] == [tiles_fastest] * 2

    seen = []

    def forward(*args, config, **kwargs):
        seen.append(config.tiles_fastest)
        raise RuntimeError("stop before the launch")

    monkeypatch.setattr(mosaic_api, "forward", forward)
    static = mosaic_api._Static(scale=0.1, config=config, interpret=False)
    operands = mask_operands(q, k, arrays, config=config)
    with pytest.raises(RuntimeError, match="stop before the launch"):
        mosaic_api._forward_padded(q, k, k, (arrays, operands), static)
    assert seen == [tiles_fastest]


def test_a_fixed_order_is_kept_on_any_mask() -> None:
    config, arrays, q, k = _inputs("share_question", 1)
    for fixed in (False, True):
        fixed_config = dataclasses.replace(config, tiles_fastest=fixed)
        kernels = mosaic_bwd._kernels(q, k, arrays, scale=0.1, config=fixed_config, interpret=False)
        assert [kern.tiles_fastest for kern in kernels] == [fixed] * 2
