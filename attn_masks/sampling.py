"""Document-length tables and the host-side sampler that packs documents into one sequence.

The sampler reproduces the reference benchmark bit for bit (docs/masks.md): Python's
`random.Random`, one `choices` draw for the bucket, one `randint` (inclusive of b) for the length.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping
from functools import cache
from importlib import resources
from itertools import accumulate

Distribution = dict[tuple[int, int], float]

TABLE_NAMES = ("pile", "prolong64k", "prolong512k", "long", "short")
RULES = ("cp", "kernel")

_K = 1024
PILE_MAX = 12 * _K
PROLONG64K_MAX = 64 * _K
PROLONG512K_MAX = 1024 * _K


def parse_bucket(key: object) -> tuple[int, int]:
    """Bucket key -> (a, b): a "[a,b)" string (its two integers) or a pair of numbers."""
    if isinstance(key, str):
        nums = re.findall(r"\d+", key)
        if len(nums) != 2:
            raise ValueError(f"bucket key {key!r} must contain exactly two integers, like '[a,b)'")
        a, b = int(nums[0]), int(nums[1])
    else:
        try:
            a, b = (int(x) for x in key)  # type: ignore[union-attr]
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"bucket key {key!r} must be a pair (a, b) or a string '[a,b)'"
            ) from err
    if a < 0 or b < a:
        raise ValueError(f"bucket {key!r} must satisfy 0 <= a <= b, got a={a}, b={b}")
    return a, b


@cache
def _load_table(name: str) -> tuple[tuple[tuple[int, int], float], ...]:
    text = resources.files("attn_masks").joinpath("distributions", f"{name}.json").read_text()
    return tuple((parse_bucket(k), float(v)) for k, v in json.loads(text).items())


def load_distribution(distribution: str | Mapping) -> Distribution:
    """A length table (bucket -> weight, in table order) from a built-in name or a mapping."""
    if isinstance(distribution, str):
        if distribution not in TABLE_NAMES:
            raise ValueError(
                f"unknown distribution {distribution!r}; valid names: {', '.join(TABLE_NAMES)}"
            )
        return dict(_load_table(distribution))
    if not isinstance(distribution, Mapping):
        raise ValueError(
            f"distribution must be a table name ({', '.join(TABLE_NAMES)}) or a mapping "
            f"bucket -> weight, got {type(distribution).__name__}"
        )
    table: Distribution = {}
    for key, weight in distribution.items():
        w = float(weight)
        if not w >= 0:
            raise ValueError(f"weight of bucket {key!r} must be >= 0, got {weight!r}")
        table[parse_bucket(key)] = w
    if not table or sum(table.values()) <= 0:
        raise ValueError(f"distribution needs at least one positive weight, got {distribution!r}")
    return table


def generate_seqlens(
    distribution: str | Mapping, total_seqlen: int, rng: random.Random
) -> list[int]:
    """Document lengths summing exactly to total_seqlen, drawn as the reference sampler does."""
    if total_seqlen < 0:
        raise ValueError(f"total_seqlen must be >= 0, got {total_seqlen}")
    table = load_distribution(distribution)
    total = sum(table.values())
    buckets = list(table)
    cum_weights = list(accumulate(w / total for w in table.values()))
    seqlens: list[int] = []
    current = 0
    while current < total_seqlen:
        a, b = rng.choices(buckets, cum_weights=cum_weights, k=1)[0]
        length = max(min(rng.randint(a, b), total_seqlen - current), 1)
        seqlens.append(length)
        current += length
    return seqlens


def default_distribution(seqlen: int, rule: str = "cp") -> str:
    """Name of the table the reference drivers use at this length (CP or kernel benchmark rule)."""
    if rule not in RULES:
        raise ValueError(f"unknown table-selection rule {rule!r}; valid rules: {', '.join(RULES)}")
    upper = PROLONG512K_MAX if rule == "cp" else PROLONG64K_MAX
    if not 1 <= seqlen <= upper:
        raise ValueError(
            f"no document-length table for seqlen {seqlen} under the {rule} rule; "
            f"valid range is [1, {upper}] (pass an explicit distribution beyond it)"
        )
    if seqlen <= PILE_MAX:
        return "pile"
    if rule == "kernel":
        return "prolong64k"
    return "prolong64k" if seqlen < PROLONG64K_MAX else "prolong512k"
