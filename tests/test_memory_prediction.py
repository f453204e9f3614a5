"""Dense impls at sizes whose score matrix cannot fit are recorded as predicted OOM, unrun."""

from __future__ import annotations

import pytest

from experiments.core.outcomes import OOM, PointFailure
from experiments.core.points import Grid, expand
from experiments.runners import memory

GIB = 1 << 30


def _point(impl: str, framework: str, seqlen: int, mode: str, heads_q: int = 64):
    grid = Grid(
        name="cross",
        cps=("none",),
        layouts=("none",),
        impls=(impl,),
        masks=("causal",),
        seqlens=(seqlen,),
        heads=((heads_q, 8),),
        head_dim=128,
        dtype="bf16",
        modes=(mode,),
    )
    kw = dict(seed=0, num_devices=1, ulysses_size=None, ulysses_intra_node=True)
    return expand(grid, framework, grid.impls, **kw)[0]


def test_score_bound_counts_every_score_once_per_copy():
    p = _point("xla", "jax", 32 * 1024, "fwd")
    assert memory.score_bytes(p) == 64 * (32 * 1024) ** 2 * 2  # 128 GiB of bf16 scores
    assert memory.score_bytes(_point("xla", "jax", 32 * 1024, "fwd_bwd")) == 256 * GIB


DENSE = [("xla", "jax"), ("reference", "jax"), ("naive", "torch"), ("sdpa_math", "torch")]


@pytest.mark.parametrize("impl,framework", DENSE)
def test_dense_point_past_the_device_is_predicted_oom(impl, framework):
    p = _point(impl, framework, 32 * 1024, "fwd_bwd")
    with pytest.raises(PointFailure) as e:
        memory.require_fits(p, 139 * GIB)
    assert e.value.status == OOM and e.value.reason.startswith("predicted:")
    assert "256.0 GiB" in e.value.reason and "139.0 GiB" in e.value.reason


def test_points_that_may_fit_or_are_not_dense_still_run():
    memory.require_fits(_point("xla", "jax", 32 * 1024, "fwd"), 139 * GIB)  # 128 GiB: try it
    memory.require_fits(_point("pallas", "jax", 1 << 20, "fwd_bwd"), 139 * GIB)  # tiled kernel
    memory.require_fits(_point("xla", "jax", 1 << 20, "fwd_bwd"), None)  # capacity unknown
