"""The report's tile-efficiency section against a dense count of the mask's tiles."""

from __future__ import annotations

import numpy as np
import pytest

from attn_masks import make_mask
from experiments.reports import tile_efficiency


def _dense_bound(name: str, seqlen: int, tile: int) -> float:
    """Useful pairs / pairs in the tiles holding any useful pair, from the dense mask."""
    dense = make_mask(name, seqlen, seed=3, window=100).dense()
    touched = 0
    for i in range(0, seqlen, tile):
        for j in range(0, seqlen, tile):
            block = dense[i : i + tile, j : j + tile]
            touched += block.size if block.any() else 0
    return dense.sum() / touched


@pytest.mark.parametrize("name", ["causal", "causal_document", "sliding_window", "share_question"])
def test_tile_bound_matches_a_dense_count(name):
    # 300 tokens: ragged last tiles, which count only their real rows and keys
    got = tile_efficiency.tile_bound(name, 300, 3, 100, tile=64)
    assert got == pytest.approx(_dense_bound(name, 300, 64), rel=1e-12)
    assert 0 < got <= 1


def _row(impl, mask, tflops, framework="jax", status="ok"):
    return dict(framework=framework, impl=impl, mask=mask, tflops=tflops, status=status,
                cp="none", kernel_config="", mode="fwd", batch=1, heads_q=8, heads_kv=8,
                head_dim=64, dtype="bf16", seqlen_total=512, seed=3, window=100,
                reference_compat=False, num_masks=1)  # fmt: skip


def test_efficiency_is_relative_speed_over_the_bound():
    rng = np.random.default_rng()
    full, masked, flex = rng.uniform(100, 600, size=3)
    rows = [
        _row("mosaic", "full", full),
        _row("mosaic", "causal_document", masked),
        _row("flex", "causal_document", flex, framework="torch"),
        _row("pallas", "causal_document", masked),  # no full-mask point: no row
        _row("mosaic", "causal", None, status="oom"),  # not ok: no row
    ]
    (row,) = tile_efficiency.efficiency_rows(rows)
    bound = tile_efficiency.tile_bound("causal_document", 512, 3, 100)
    assert row[3:6] == ["mosaic", "causal_document", 512]
    assert row[-3:] == [f"{bound:.3f}", f"{masked / full / bound:.2f}", f"{masked / flex:.2f}x"]
    lines = tile_efficiency.section(rows)
    assert lines[0] == "## Tile efficiency"
    assert any("| mosaic | causal_document |" in x for x in lines)
