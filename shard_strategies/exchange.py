"""Static token exchanges between two placements of one sequence over N ranks (numpy only).

A placement says which global positions every rank holds, in local order: (N, L) positions,
those >= seqlen being padding. Moving a sequence from one placement to another is a fixed
pattern known from the plan alone, so it is compiled as a few point-to-point rounds (each a
partial permutation of ranks: one `ppermute`), every rank sending only the tokens its peer needs,
followed by one local gather. The JAX executor uses it to go between the contiguous sequence
sharding a caller holds and the plan's layout (docs/context_parallel.md, Sequence-sharded
inputs); the simulator charges the same rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .plan import CPPlan


@dataclass(frozen=True, eq=False)
class ExchangeRounds:
    """The shape of an exchange: its rounds' (source rank, destination rank) pairs and the rows
    each sending rank sends a round; what the simulator charges, without the tables."""

    num_ranks: int
    src_len: int
    dst_len: int
    rounds: tuple[tuple[tuple[int, int], ...], ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Exchange(ExchangeRounds):
    """Rounds of point-to-point sends that turn one placement into another.

    rounds[r]: the (source rank, destination rank) pairs of round r (each rank sends at most once
    and receives at most once a round). send[r]: (N, sizes[r]) local source rows each rank sends
    in round r (its row is unused when it sends nothing). gather: (N, dst_len) for every
    destination row, its index in the pool a rank builds as [its own src_len rows, the rows
    received in round 0, ..., round R-1, one zero row]: tokens that stay on a rank are never
    sent, and padding rows of the destination read the zero row.
    """

    send: tuple[np.ndarray, ...]
    gather: np.ndarray

    def apply(self, x: np.ndarray) -> np.ndarray:
        """(N, src_len, ...) -> (N, dst_len, ...) on the host: what the collective rounds do."""
        parts = [x]
        for pairs, send in zip(self.rounds, self.send):
            got = np.zeros((self.num_ranks, send.shape[1]) + x.shape[2:], x.dtype)
            for src, dst in pairs:
                got[dst] = x[src][send[src]]
            parts.append(got)
        parts.append(np.zeros((self.num_ranks, 1) + x.shape[2:], x.dtype))
        pool = np.concatenate(parts, axis=1)
        return np.stack([pool[n][self.gather[n]] for n in range(self.num_ranks)])


def contiguous_positions(seqlen: int, num_ranks: int) -> np.ndarray:
    """(N, S / N) positions of a sequence split evenly in rank order (jax's P(None, axes))."""
    if seqlen % num_ranks:
        raise ValueError(
            f"a contiguous split needs seqlen ({seqlen}) divisible by the ranks ({num_ranks})"
        )
    return np.arange(seqlen, dtype=np.int64).reshape(num_ranks, seqlen // num_ranks)


def _rounds(counts: np.ndarray) -> list[list[tuple[int, int]]]:
    """Edge-colour the transfer graph greedily, largest transfers first: every round is a partial
    permutation (at most 2 * max degree - 1 rounds; the layouts here need their max degree)."""
    src, dst = np.nonzero(counts)
    edges = sorted(zip(src.tolist(), dst.tolist()), key=lambda e: (-counts[e], e))
    rounds: list[list[tuple[int, int]]] = []
    busy: list[tuple[set[int], set[int]]] = []
    for j, i in edges:
        free = (r for r, (out, into) in enumerate(busy) if j not in out and i not in into)
        r = next(free, len(rounds))
        if r == len(rounds):
            rounds.append([])
            busy.append((set(), set()))
        rounds[r].append((j, i))
        busy[r][0].add(j)
        busy[r][1].add(i)
    return rounds


def _shift_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every rank to every other: round s sends rank j's share to rank (j + s) mod N."""
    return [[(j, (j + s) % n) for j in range(n)] for s in range(1, n)]


def _owners(src: np.ndarray, seqlen: int) -> tuple[np.ndarray, np.ndarray]:
    """(rank, row) holding each position < seqlen in placement src, checked to hold each once."""
    at = np.flatnonzero(_holds_once(src, seqlen).ravel())
    owner = np.zeros(seqlen, np.int64)
    row_of = np.zeros(seqlen, np.int64)
    owner[src.ravel()[at]], row_of[src.ravel()[at]] = np.divmod(at, src.shape[1])
    return owner, row_of


def _holds_once(src: np.ndarray, seqlen: int) -> np.ndarray:
    """The real (< seqlen) entries of a source placement, checked to hold each position once."""
    real = src < seqlen
    if np.bincount(src[real], minlength=seqlen).max(initial=1) != 1 or real.sum() != seqlen:
        raise ValueError("the source placement must hold every position < seqlen exactly once")
    return real


def _placements(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    if dst.shape[0] != src.shape[0]:
        raise ValueError(f"placements over {src.shape[0]} and {dst.shape[0]} ranks")
    return src, dst


def _carried(counts: np.ndarray, src_len: int, dst_len: int, uniform: bool) -> ExchangeRounds:
    """The rounds that carry counts[j, i] rows from rank j to rank i."""
    n = counts.shape[0]
    most = int(counts.max(initial=0))
    if uniform:
        rounds = _shift_rounds(n) if most else []
        common = min(1 << (most - 1).bit_length(), src_len, dst_len)
        if most > common:
            raise ValueError(
                f"a rank needs {most} rows from one peer, more than a uniform round carries "
                f"({common}): the destination placement repeats positions"
            )
        sizes = [common] * len(rounds)
    else:
        rounds = _rounds(counts)
        sizes = [max(int(counts[j, i]) for j, i in pairs) for pairs in rounds]
    return ExchangeRounds(
        num_ranks=n,
        src_len=src_len,
        dst_len=dst_len,
        rounds=tuple(tuple(p) for p in rounds),
        sizes=tuple(sizes),
    )


def _pair_counts(from_rank: np.ndarray, dst_rank: np.ndarray, n: int) -> np.ndarray:
    """(N, N) rows going from rank j to rank i != j."""
    moving = from_rank != dst_rank
    pairs = from_rank[moving] * n + dst_rank[moving]
    return np.bincount(pairs, minlength=n * n).reshape(n, n)


def exchange_rounds(
    src: np.ndarray, dst: np.ndarray, seqlen: int, *, uniform: bool = False
) -> ExchangeRounds:
    """make_exchange's rounds and sizes alone, from the (source rank, destination rank) counts
    (its tables are most of its cost: 64 ranks on uniform rounds fill 63 padded tables). When
    one side is the contiguous split (a dispatch or its inverse), a position's rank there is
    its index over the split's length: no owner table."""
    src, dst = _placements(src, dst)
    n = src.shape[0]
    if _is_split(dst, seqlen):
        real = _holds_once(src, seqlen)
        from_rank = np.broadcast_to(np.arange(n)[:, None], src.shape)[real]
        counts = _pair_counts(from_rank, src[real] // dst.shape[1], n)
    else:
        owner = src.ravel() // src.shape[1] if _is_split(src, seqlen) else _owners(src, seqlen)[0]
        real = dst < seqlen
        dst_rank = np.broadcast_to(np.arange(n)[:, None], dst.shape)[real]
        counts = _pair_counts(owner[dst[real]], dst_rank, n)
    return _carried(counts, int(src.shape[1]), int(dst.shape[1]), uniform)


def _is_split(placement: np.ndarray, seqlen: int) -> bool:
    """Whether a placement is the contiguous split of the sequence (contiguous_positions)."""
    n, length = placement.shape
    return n * length == seqlen and bool(
        (placement == np.arange(seqlen, dtype=np.int64).reshape(n, length)).all()
    )


def make_exchange(
    src: np.ndarray, dst: np.ndarray, seqlen: int, *, uniform: bool = False
) -> Exchange:
    """The exchange from placement `src` (N, Ls) to `dst` (N, Ld) of positions 0..seqlen-1.

    Every real position must be held exactly once by `src`; positions of `dst` >= seqlen are
    padding (zeros), and padding of `src` is never sent. uniform: N - 1 cyclic-shift rounds of
    one size, the largest pair's count rounded up to a power of two (at most min(Ls, Ld)), so
    that placements of one family (e.g. per-document layouts of different batches) share the
    rounds and, but for that size, the shapes (a few compilations, not one per mask), at the
    cost of padding; otherwise the fewest rounds the counts need (greedy edge colouring).
    """
    src, dst = _placements(src, dst)
    n = src.shape[0]
    owner, row_of = _owners(src, seqlen)
    pad = dst >= seqlen
    safe = np.where(pad, 0, dst)
    from_rank = np.where(pad, -1, owner[safe])
    from_row = row_of[safe]
    moving = (from_rank >= 0) & (from_rank != np.arange(n)[:, None])
    # every moving destination row: its (source rank, destination rank) pair
    dst_rank, slot = np.nonzero(moving)
    src_rank = from_rank[dst_rank, slot]
    counts = _pair_counts(src_rank, dst_rank, n)
    carried = _carried(counts, int(src.shape[1]), int(dst.shape[1]), uniform)
    round_of = np.full((n, n), -1, np.int64)
    for r, pairs in enumerate(carried.rounds):
        round_of[tuple(np.array(pairs).T)] = r
    # the moving rows grouped by pair in destination order: each one's place in its pair's
    # send table and in the receiving pool
    order = np.lexsort((slot, dst_rank, src_rank))
    dst_rank, slot, src_rank = dst_rank[order], slot[order], src_rank[order]
    pair = src_rank * n + dst_rank
    first = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1]])
    place = np.arange(pair.size) - np.repeat(first, np.diff(np.r_[first, pair.size]))
    column = np.cumsum([0, *carried.sizes])  # each round's first column of the stacked tables
    r = round_of[src_rank, dst_rank]
    tables = np.zeros((n, column[-1]), np.int32)
    tables[src_rank, column[r] + place] = from_row[dst_rank, slot]
    gather = np.where(pad, 0, from_row)  # own rows: their local index
    gather[dst_rank, slot] = carried.src_len + column[r] + place
    gather[pad] = carried.src_len + column[-1]  # the zero row
    return Exchange(
        **vars(carried),
        send=tuple(tables[:, column[k] : column[k + 1]] for k in range(len(carried.rounds))),
        gather=gather.astype(np.int32),
    )


def is_fixed(plan: CPPlan) -> bool:
    """Whether the plan's placement depends on the sequence length and ranks alone (contiguous,
    or zigzag over the whole sequence), not on the mask's documents or areas."""
    name = plan.layout.name
    return name == "contiguous" or (name == "zigzag" and plan.mask.params.get("cu_seqlens") is None)


def _both_ways(plan: CPPlan, build: Callable) -> tuple | None:
    """build(src, dst, seqlen, uniform=...) from the contiguous split of the plan's sequence to
    its layout and back, or None when the length does not split evenly over the ranks.
    Placements that depend on the mask use the uniform form (a few static parts for all masks
    of a length, not one each)."""
    n, s = plan.world_size, plan.seqlen
    if s % n:
        return None
    flat, uniform = contiguous_positions(s, n), not is_fixed(plan)
    return (
        build(flat, plan.positions, s, uniform=uniform),
        build(plan.positions, flat, s, uniform=uniform),
    )


def plan_exchanges(plan: CPPlan) -> tuple[Exchange, Exchange] | None:
    """(dispatch, undispatch) between the contiguous split of the sequence over the plan's ranks
    and its layout, or None when the length does not split evenly (_both_ways)."""
    return _both_ways(plan, make_exchange)


def plan_exchange_rounds(plan: CPPlan) -> tuple[ExchangeRounds, ExchangeRounds] | None:
    """plan_exchanges' rounds and sizes alone, for the simulator: worked out once per plan and
    kept on it (the CP predictor schedules a plan once per mode; at 2M tokens this reads every
    position several times)."""
    kept = plan.__dict__
    if "_exchange_rounds" not in kept:
        kept["_exchange_rounds"] = _both_ways(plan, exchange_rounds)
    return kept["_exchange_rounds"]
