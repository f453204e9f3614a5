"""Host-side mask cost at long lengths: make_mask + block_map time and peak memory.

Usage: python experiments/bench_masks.py [--seqlen=1048576] [--block=128]
"""

from __future__ import annotations

import resource
import time

from absl import app, flags

from attn_masks import make_mask

MASKS = flags.DEFINE_multi_string("mask", ["causal_document", "causal", "sliding_window"], "masks")
SEQLEN = flags.DEFINE_integer("seqlen", 1 << 20, "sequence length")
BLOCK = flags.DEFINE_integer("block", 128, "tile size for the block map")


def main(argv: list[str]) -> None:
    del argv
    print(f"{'mask':<22} {'seqlen':>9} {'make_mask s':>12} {'block_map s':>12} {'tiles':>12}")
    for name in MASKS.value:
        t0 = time.perf_counter()
        mask = make_mask(name, SEQLEN.value)
        t1 = time.perf_counter()
        bm = mask.block_map(BLOCK.value, BLOCK.value)
        t2 = time.perf_counter()
        tiles = int((bm > 0).sum())
        print(f"{name:<22} {SEQLEN.value:>9} {t1 - t0:>12.3f} {t2 - t1:>12.3f} {tiles:>12}")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory: {peak_mib:.0f} MiB")


if __name__ == "__main__":
    app.run(main)
