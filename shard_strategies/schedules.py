"""Ring visiting orders and their K/V transfer chains (numpy only), shared by every executor.

A ring of R ranks is split into W windows of w = R / W consecutive ranks (W = 1: plain ring).
Ring rank r = window * w + pos. At step (outer o, inner i) rank r holds the K/V block of
rank ((window - o) mod W) * w + (pos - i) mod w: the outer ring moves blocks between windows,
the inner ring within a window. Steps empty on every rank are dropped; the chains below then
jump over them with one transfer of a larger shift, so the volume only shrinks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

StepIndex = tuple[int, int]  # (outer, inner)


def default_num_windows(ring_size: int) -> int:
    """LoongTrain's heuristic (docs/context_parallel.md): the largest divisor W of R, W <= R / W."""
    return max(d for d in range(1, ring_size + 1) if ring_size % d == 0 and d * d <= ring_size)


def visiting_order(ring_size: int, num_windows: int) -> list[StepIndex]:
    """All R steps, outer-major: (0,0), (0,1), ..., (0,w-1), (1,0), ..."""
    if num_windows < 1 or ring_size % num_windows:
        raise ValueError(f"num_windows {num_windows} must divide the ring size {ring_size}")
    w = ring_size // num_windows
    return [(o, i) for o in range(num_windows) for i in range(w)]


def step_sources(ring_size: int, num_windows: int, step: StepIndex) -> np.ndarray:
    """(R,) ring rank whose K/V block each ring rank holds at `step`."""
    w = ring_size // num_windows
    r = np.arange(ring_size)
    o, i = step
    return ((r // w - o) % num_windows) * w + (r % w - i) % w


def inner_perm(ring_size: int, num_windows: int, shift: int) -> list[tuple[int, int]]:
    """(source, destination) pairs moving every block `shift` places along its window."""
    w = ring_size // num_windows
    return [(r, (r // w) * w + (r % w + shift) % w) for r in range(ring_size)]


def outer_perm(ring_size: int, num_windows: int, shift: int) -> list[tuple[int, int]]:
    """(source, destination) pairs moving every block `shift` windows on, same position."""
    w = ring_size // num_windows
    return [(r, ((r // w + shift) % num_windows) * w + r % w) for r in range(ring_size)]


def group_by_outer(steps: Sequence[StepIndex]) -> list[tuple[int, list[int]]]:
    """Kept steps grouped per outer step, in visiting order: [(o, [i, ...]), ...]."""
    groups: list[tuple[int, list[int]]] = []
    for o, i in steps:
        if groups and groups[-1][0] == o:
            groups[-1][1].append(i)
        else:
            groups.append((o, [i]))
    return groups


def transfer_counts(steps: Sequence[StepIndex], ring_size: int, num_windows: int) -> dict[str, int]:
    """Block transfers per rank made by the executors' chains for the kept `steps`.

    Forward: the outer block of each group comes from the previous group's (one inter-window
    transfer, issued when that group starts), each inner block from the previous one. Backward:
    the same K/V chain again, plus dK/dV following its block, returning to the group's outer
    holder, then crossing windows with the outer chain and finally going home.
    """
    w = ring_size // num_windows
    kv = dkv = 0
    prev_o = 0
    groups = group_by_outer(steps)
    for g, (o, inners) in enumerate(groups):
        kv += (o - prev_o) % num_windows != 0
        dkv += g > 0 and (o - prev_o) % num_windows != 0
        kv += inners[0] % w != 0
        kv += len(inners) - 1
        dkv += len(inners) - 1
        dkv += inners[-1] % w != 0
        prev_o = o
    dkv += prev_o % num_windows != 0
    return {"fwd_kv": kv, "bwd_kv": kv, "bwd_dkv": dkv}
