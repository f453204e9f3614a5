"""The persistent Mosaic forward's deal of (q tile, head) items to 132 CTAs, replayed on the host.
Per mask and shape: the busiest CTA's cost (its items' key tiles plus one each) over the larger
of the mean cost and the costliest item, and the mean number of K/V heads among the items that
run side by side (one per CTA, step by step; fewer share more K/V tiles in L2), for the deal by
cost that each q tile's heads share (the one before) and for the kernel's banded deal
(jax_attn.mosaic_gpu.forward.deal_items)."""

import jax.numpy as jnp
import numpy as np

from attn_masks import make_mask
from jax_attn.mask_arrays import prepare_mask
from jax_attn.mosaic_gpu import api
from jax_attn.mosaic_gpu import forward as fw

CTAS = 132
SHAPES = ((16384, 64, 8), (32768, 64, 8), (32768, 64, 64), (8192, 16, 2))  # seqlen, Hq, Hkv
CONFIG = api.resolve_config(jnp.zeros((1, 1, 1, 128), jnp.bfloat16), None)


def by_cost(count: np.ndarray, heads: int) -> np.ndarray:
    """(2, items) q tile and head of the deal before the bands: q tiles by decreasing count,
    each one's heads together."""
    order = np.argsort(-count, kind="stable")
    return np.stack([np.repeat(order, heads), np.tile(np.arange(heads), len(order))])


def replay(count: np.ndarray, items: np.ndarray, geo: fw.Geometry) -> tuple[float, float]:
    """(busiest CTA's cost over the ideal, mean K/V heads running side by side)."""
    cta = jnp.arange(CTAS, dtype=jnp.int32)
    runs = np.asarray(fw._local_items(geo, cta))
    local = jnp.arange(int(runs.max()), dtype=jnp.int32)
    flat = np.asarray(fw._snake(geo, cta[:, None], local[None, :]))
    valid = np.asarray(local)[None, :] < runs[:, None]
    tile, head = items[:, np.where(valid, flat, 0)]
    load = ((count[tile] + 1) * valid).sum(axis=1)
    ideal = max(load.sum() / CTAS, count.max() + 1)
    kv = head // geo.group
    spans = [len(np.unique(kv[valid[:, s], s])) for s in range(valid.shape[1])]
    return load.max() / ideal, float(np.mean(spans))


for name in (
    "causal",
    "causal_document",
    "causal_blockwise",
    "full",
    "prefix_lm_document",
    "share_question",
):
    row = []
    for seqlen, hq, hkv in SHAPES:
        count = np.asarray(prepare_mask(make_mask(name, seqlen), *CONFIG.tiles).kv.count)
        geo = fw.Geometry(
            batch=1,
            seq_q=seqlen,
            seq_k=seqlen,
            heads_q=hq,
            heads_kv=hkv,
            head_dim=128,
            intervals=1,
            config=CONFIG,
            ctas=CTAS,
        )
        before = replay(count, by_cost(count, hq), geo)
        bands = replay(count, np.asarray(fw.deal_items(geo, jnp.asarray(count)))[:2], geo)
        row.append(
            f"{before[0]:.2f} -> {bands[0]:.2f}, K/V heads {before[1]:.0f} -> {bands[1]:.1f}"
        )
    print(f"{name:20s} " + " | ".join(f"{s}x{q}:{k}: {r}" for (s, q, k), r in zip(SHAPES, row)))
