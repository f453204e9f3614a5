"""The Mosaic backward's longest-first launch (KernelConfig.bwd_longest_first): the order of
the CTA tiles (test_mosaic_gpu_bwd.py: the kernels' gradients with it, and that each kernel
reads it)."""

import jax.numpy as jnp
import numpy as np
import pytest

from attn_masks.generators import make_mask
from jax_attn.mask_arrays import prepare_mask
from jax_attn.mosaic_gpu import KernelConfig
from jax_attn.mosaic_gpu.bwd_steps import longest_first_order


@pytest.mark.parametrize("ctas_per_tile", [1, 2])
def test_order_is_a_permutation_by_decreasing_walk(ctas_per_tile: int) -> None:
    count = np.random.default_rng(0).integers(0, 9, size=13).astype(np.int32)
    order = np.asarray(longest_first_order(jnp.asarray(count), ctas_per_tile))
    assert order.dtype == np.int32
    assert sorted(order) == list(range(13 * ctas_per_tile))
    walks = count[order // ctas_per_tile]
    assert (np.diff(walks) <= 0).all(), "walks must not grow along the launch order"
    for w in np.unique(walks):  # ties keep tile order
        same = order[walks == w]
        assert (np.diff(same) > 0).all()


def test_causal_key_tiles_keep_their_order_and_query_tiles_reverse() -> None:
    """Causal: the first key tile is seen by every row (longest dK/dV walk), the last q tile
    sees every key (longest dQ walk)."""
    arrays = prepare_mask(make_mask("causal", 1024), 128, 128)
    keys = np.asarray(longest_first_order(jnp.asarray(arrays.q.count), 1))
    rows = np.asarray(longest_first_order(jnp.asarray(arrays.kv.count), 1))
    assert list(keys) == list(range(8))
    assert list(rows) == list(range(8))[::-1]


def test_needs_the_warp_specialised_kernels() -> None:
    with pytest.raises(ValueError, match="bwd_longest_first needs .* got bwd_warpgroups=1"):
        KernelConfig(bwd_longest_first=True)
    with pytest.raises(ValueError, match="dq_warpgroups=1"):
        KernelConfig(bwd_warpgroups=2, bwd_longest_first=True)
