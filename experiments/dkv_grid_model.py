"""A model of the Mosaic dK/dV kernel's grid: how much later its last CTA ends than a perfect
balance would, with each CTA walking one 128-key tile or a pair (p, N - 1 - p).

Each CTA costs its q steps (64 rows of one q head each; a partial mask tile's steps weigh
--partial_step_cost) plus --walk_cost steps per key tile walked (K/V load, dK/dV store). CTAs
start in the launch order the backward picks (config.launch_tiles_fastest), each on the SM that
frees first, one CTA per SM (the warp-specialised kernel's 384 threads take an SM's
registers). The model knows nothing of caches: paired walks' L2 gain on causal masks
(NOTES.md) is outside it. No head split (the fused kernel has none).

Usage: python experiments/dkv_grid_model.py --mask=causal,causal_document --seqlen=16384
"""

from __future__ import annotations

import heapq

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from attn_masks import make_mask
from jax_attn.mask_arrays import MaskArrays, prepare_mask
from jax_attn.mosaic_gpu.config import HOPPER_SMS, default_config, launch_tiles_fastest

FLAGS = flags.FLAGS
CTA_KEYS = 128  # keys of one warp-specialised dK/dV CTA: two consumers of 64
STEP_ROWS = 64  # q rows of one dK/dV step


def cta_costs(
    arrays: MaskArrays, *, group: int, kv_heads: int, paired: bool, tiles_fastest: bool,
    partial_step_cost: float = 1.0, walk_cost: float = 2.0,
) -> list[float]:  # fmt: skip
    """Each dK/dV CTA's cost in steps, in launch order."""
    count = np.asarray(arrays.q.count, np.float64)
    partial = (~np.asarray(arrays.q.full)).sum(axis=-1) - (arrays.q.width - count)
    steps = (count - partial + partial * partial_step_cost) * (arrays.block_q // STEP_ROWS) * group
    walk = np.where(count > 0, steps + walk_cost, 0.0)
    walk = np.repeat(walk, max(1, arrays.block_k // CTA_KEYS))  # CTAs per mask key tile
    n = len(walk)
    per_tile = [walk[p] + walk[n - 1 - p] for p in range(n // 2)] if paired else list(walk)
    if paired and n % 2:
        per_tile.append(walk[n // 2])
    if tiles_fastest:
        return [c for _ in range(kv_heads) for c in per_tile]
    return [c for c in per_tile for _ in range(kv_heads)]


def makespan(costs: list[float], slots: int = HOPPER_SMS) -> tuple[float, float]:
    """(when the last CTA ends, the perfectly balanced end): CTAs start in order, each on the
    slot that frees first."""
    free = [0.0] * slots
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free), sum(costs) / slots


def parse_heads(text: str) -> tuple[int, int]:
    """(q heads, kv heads) from "Q:KV"; ValueError names the text and what is valid."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--heads={text!r}: expected Q:KV with positive integers, e.g. 64:8")
    hq, hkv = int(parts[0]), int(parts[1])
    if hq % hkv:
        raise ValueError(f"--heads={text!r}: q heads must be a multiple of kv heads")
    return hq, hkv


def define_flags() -> None:
    """The command's flags (defined only when it runs, so importing the module defines none)."""
    flags.DEFINE_list(
        "mask",
        ["full", "causal", "prefix_lm_causal", "global_sliding_window", "block_causal_document",
         "full_document_long", "causal_document_long", "causal_document", "full_document",
         "share_question", "causal_blockwise", "prefix_lm_document", "sliding_window"],
        "masks",
    )  # fmt: skip
    flags.DEFINE_list("seqlen", ["16384", "32768"], "sequence lengths")
    flags.DEFINE_string("heads", "64:8", "q heads:kv heads")
    flags.DEFINE_enum("head_dim", "128", ["64", "128"], "head dim (picks the mask tiles)")
    flags.DEFINE_float("partial_step_cost", 1.0, "cost of a partial tile's step")
    flags.DEFINE_float("walk_cost", 2.0, "cost of one key tile's walk beyond its steps")


def main(argv: list[str]) -> None:
    del argv
    try:
        hq, hkv = parse_heads(FLAGS.heads)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    config = default_config(int(FLAGS.head_dim), jnp.bfloat16)
    print("last CTA's end over the balanced end, unpaired and paired walks")
    print(f"{'mask':<22} {'seqlen':>6} {'few partial':>11} {'even pairs':>10} {'order':>6} "
          f"{'unpaired':>8} {'paired':>8}")  # fmt: skip
    for seqlen in (int(s) for s in FLAGS.seqlen):
        for name in FLAGS.mask:
            arrays = prepare_mask(make_mask(name, seqlen), *config.tiles)
            fastest = launch_tiles_fastest(
                config, group=hq // hkv, uneven_walks=arrays.uneven_walks
            )
            ratios = []
            for paired in (False, True):
                costs = cta_costs(
                    arrays, group=hq // hkv, kv_heads=hkv, paired=paired, tiles_fastest=fastest,
                    partial_step_cost=FLAGS.partial_step_cost, walk_cost=FLAGS.walk_cost,
                )  # fmt: skip
                end, balanced = makespan(costs)
                ratios.append(end / balanced)
            flags_text = f"{arrays.few_partial_tiles!s:>11} {arrays.even_pairs!s:>10}"
            order = "tiles" if fastest else "heads"
            print(
                f"{name:<22} {seqlen:>6} {flags_text} {order:>6} "
                f"{ratios[0]:>8.3f} {ratios[1]:>8.3f}"
            )


if __name__ == "__main__":
    define_flags()
    app.run(main)
