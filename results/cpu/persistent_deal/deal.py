"""The persistent Mosaic forward's deal of (q tile, head) items to 132 CTAs, replayed on the host:
the busiest CTA's cost (its items' key tiles plus one each) over the larger of the mean cost and
the costliest item, for the cost-ordered deal (jax_attn.mosaic_gpu.forward's own functions) and
for the launch-order deal it replaced (q tile fastest, last tile first, the same snake rows)."""

import jax.numpy as jnp
import numpy as np

from attn_masks import make_mask
from jax_attn.mask_arrays import prepare_mask
from jax_attn.mosaic_gpu import api
from jax_attn.mosaic_gpu import forward as fw

CTAS = 132
SHAPES = ((16384, 64), (32768, 64), (8192, 16), (16384, 8), (32768, 16))  # (seqlen, heads)
CONFIG = api.resolve_config(jnp.zeros((1, 1, 1, 128), jnp.bfloat16), None)


def deal(count: np.ndarray, heads: int, cost_order: bool) -> np.ndarray:
    """(ctas,) summed cost of the items each CTA runs."""
    nq = len(count)
    geo = fw.Geometry(batch=1, seq_q=nq * 128, seq_k=nq * 128, heads_q=heads, heads_kv=1,
                      head_dim=128, intervals=1, config=CONFIG, ctas=CTAS)
    cta = jnp.arange(CTAS, dtype=jnp.int32)
    runs = np.asarray(fw._local_items(geo, cta))
    local = jnp.arange(int(runs.max()), dtype=jnp.int32)
    flat = np.asarray(fw._snake(geo, cta[:, None], local[None, :]))
    valid = np.asarray(local)[None, :] < runs[:, None]
    if cost_order:
        order = jnp.argsort(-jnp.asarray(count), stable=True).astype(jnp.int32)
        tile = np.asarray(fw._item(geo, order, jnp.asarray(flat[valid]))[0])
    else:
        tile = nq - 1 - flat[valid] % nq
    load = np.zeros(CTAS)
    np.add.at(load, np.nonzero(valid)[0], count[tile] + 1)
    return load


for name in ("causal", "causal_document", "causal_blockwise", "full", "prefix_lm_document",
             "share_question"):
    row = []
    for seqlen, heads in SHAPES:
        count = np.asarray(prepare_mask(make_mask(name, seqlen), *CONFIG.tiles).kv.count)
        ideal = lambda load: max(load.sum() / CTAS, count.max() + 1)  # noqa: E731
        launch, cost = (deal(count, heads, c) for c in (False, True))
        row.append(f"{launch.max() / ideal(launch):.2f} -> {cost.max() / ideal(cost):.2f}")
    print(f"{name:20s} " + " | ".join(f"{s}x{h}: {r}" for (s, h), r in zip(SHAPES, row)))
