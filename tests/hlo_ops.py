"""Collectives in compiled XLA HLO text, for the tests that check what a CP program moves."""

from __future__ import annotations

import re
from collections import Counter

OPS = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
_OP_LINE = rf"^\s*(?:ROOT )?%\S+ = (.*?) ({OPS})(?:-start)?\("


def collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(op, result dims) of every all-gather / all-reduce / all-to-all / collective-permute /
    reduce-scatter (each array of a tuple result separately)."""
    found = []
    for shapes, op in re.findall(_OP_LINE, hlo, re.M):
        for dims in re.findall(r"(?:f32|bf16|f16|s32)\[([\d,]*)\]", shapes):
            found.append((op, tuple(int(x) for x in dims.split(",") if x)))
    return found


def op_counts(hlo: str) -> Counter:
    """How many collectives of each kind the program runs (a tuple result counts once)."""
    return Counter(op for _, op in re.findall(_OP_LINE, hlo, re.M))
