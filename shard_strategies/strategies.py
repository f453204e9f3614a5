"""The CP strategies by name, each with its core: what a device runs between the Ulysses
all-to-alls. One record per strategy, so planners, executors and models dispatch on the core
instead of on names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

RING_CORE, ALLGATHER_CORE, LOCAL_CORE = CORES = ("ring", "allgather", "local")
# how a strategy uses the Ulysses (heads) axis: not at all, as every rank, or beside a ring
NO_ULYSSES, ALL_ULYSSES, HYBRID = ULYSSES_USES = ("none", "all", "hybrid")


def default_usp_ulysses(world_size: int) -> int:
    """Largest divisor U of N with U <= 8 and U < N (the reference's U = min(N, 8) for N > 8,
    and a genuine U x R hybrid with R >= 2 below that)."""
    if world_size == 1:
        return 1
    return max(d for d in range(1, min(8, world_size - 1) + 1) if world_size % d == 0)


def _no_ulysses(world_size: int) -> int:
    return 1


@dataclass(frozen=True)
class Strategy:
    """A strategy's name, its core on a ring axis of more than one rank (a ring of one rank, or
    no ring axis, is local for every strategy but allgather) and what it needs of the mesh: how
    it uses the Ulysses axis (ULYSSES_USES), a hybrid's Ulysses size when none is given (from the
    world size), and whether its ring is split into windows (double ring's two-level ring)."""

    name: str
    core: str
    ulysses: str
    default_ulysses: Callable[[int], int] = _no_ulysses
    windowed: bool = False


STRATEGY = {
    s.name: s
    for s in (
        Strategy("ring", RING_CORE, NO_ULYSSES),
        Strategy("allgather", ALLGATHER_CORE, NO_ULYSSES),
        Strategy("ulysses", LOCAL_CORE, ALL_ULYSSES),
        Strategy("usp", RING_CORE, HYBRID, default_ulysses=default_usp_ulysses),
        Strategy("double_ring", RING_CORE, HYBRID, windowed=True),
    )
}
STRATEGIES = tuple(STRATEGY)
HYBRID_STRATEGIES = tuple(s.name for s in STRATEGY.values() if s.ulysses == HYBRID)


def core(strategy: str, ring_size: int) -> str:
    """The core `strategy` runs with `ring_size` ring ranks."""
    kind = STRATEGY[strategy].core
    return kind if kind == ALLGATHER_CORE or ring_size > 1 else LOCAL_CORE
