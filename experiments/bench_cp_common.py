"""What the two CP GPU benchmarks share (bench_cp_jax.py, bench_cp_torch.py): flags, the sweep
order with its time limit, the row-check helpers. Imports neither jax nor torch."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence

import numpy as np

MASKS = ("full", "causal", "causal_document", "share_question")
MODES = ("fwd", "fwd_bwd")
CHECK_TOL = {"out": 3e-2, "lse": 3e-2, "dq": 6e-2}


def csv_list(text: str) -> list[str]:
    """A comma-separated flag value as a list (empty items dropped)."""
    return [x for x in text.split(",") if x]


def parser(
    description: str, *, out_help: str, check_rows: int, max_minutes: float
) -> argparse.ArgumentParser:
    """The flags both benchmarks take; each adds its own before calling parse()."""
    from shard_strategies import LAYOUTS, STRATEGIES

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--strategies", type=csv_list, default=list(STRATEGIES))
    p.add_argument("--layouts", type=csv_list, default=list(LAYOUTS))
    p.add_argument("--masks", type=csv_list, default=list(MASKS))
    p.add_argument("--modes", type=csv_list, default=list(MODES))
    p.add_argument(
        "--tokens_per_gpu", type=lambda s: [int(x) for x in csv_list(s)], default=[8192, 32768]
    )
    p.add_argument("--heads_q", type=int, default=64)
    p.add_argument("--heads_kv", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ulysses_size", type=int, default=0, help="usp/double_ring U (0: default)")
    p.add_argument("--inner_axis", default="ulysses", choices=("ulysses", "ring"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument(
        "--check_rows", type=int, default=check_rows, help="query rows checked (0: skip)"
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--max_minutes",
        type=float,
        default=max_minutes,
        help="start no point after this many minutes (0: no limit)",
    )
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, rejecting unknown strategies, layouts and modes."""
    from shard_strategies import LAYOUTS, STRATEGIES

    args = p.parse_args(argv)
    for name, valid in (("strategies", STRATEGIES), ("layouts", LAYOUTS), ("modes", MODES)):
        bad = set(getattr(args, name)) - set(valid)
        if bad:
            p.error(f"--{name}: unknown {sorted(bad)}; valid: {', '.join(valid)}")
    return args


class Deadline:
    """--max_minutes from now (0: never)."""

    def __init__(self, minutes: float):
        self.minutes = minutes
        self.start = time.perf_counter()

    def passed(self) -> bool:
        return bool(self.minutes) and time.perf_counter() - self.start > 60 * self.minutes


def sweep(args: argparse.Namespace, world_size: int) -> Iterator[tuple[int, str, object, str, str]]:
    """(tokens per GPU, mask name, global mask, strategy, layout) in sweep order; each mask is
    made once, at tokens x world_size length, when its first point comes up."""
    from attn_masks import make_mask

    for tokens in sorted(args.tokens_per_gpu):
        for name in args.masks:
            mask = make_mask(name, tokens * world_size, seed=args.seed)
            for strategy in args.strategies:
                for layout in args.layouts:
                    yield tokens, name, mask, strategy, layout


def check_rows(seqlen: int, count: int) -> np.ndarray:
    """The sorted global query rows a point checks (the same draw in every run)."""
    return np.sort(np.random.default_rng(0).choice(seqlen, count, replace=False))


def rel_err(got: Sequence, want: Sequence) -> float:
    """max |got - want| / max |want| over finite entries; inf if the -inf pattern differs."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    seen = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), seen):
        return float("inf")
    got, want = np.where(seen, got, 0.0), np.where(seen, want, 0.0)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


def failed_checks(errors: dict[str, float]) -> dict[str, float]:
    """The checked quantities whose relative error is over CHECK_TOL (or NaN)."""
    return {key: e for key, e in errors.items() if not e <= CHECK_TOL[key]}
