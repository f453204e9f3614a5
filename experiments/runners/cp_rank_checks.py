"""The CP predictor's correctness check: emulated ranks put back together and compared with
float64 attention before any of their calls is timed (any framework's Ranks)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from experiments.core.points import Point
from experiments.runners import checks
from experiments.runners.cp_ranks import Ranks


def _merge_checks(results: list[tuple[int, checks.CheckResult]]) -> checks.CheckResult:
    """One result of several ranks' row checks: the worst error per tensor."""
    errors: dict[str, float] = {}
    for _, c in results:
        for n, e in c.errors.items():
            errors[n] = max(errors.get(n, 0.0), e)
    bad = [f"rank {g}: {c.message}" for g, c in results if not c.ok]
    return checks.CheckResult(
        ok=not bad,
        kind="rows",
        errors=errors,
        rtol=results[0][1].rtol,
        rows=sum(c.rows or 0 for _, c in results),
        unchecked=sorted({n for _, c in results for n in c.unchecked}),
        message="; ".join(bad),
        heads=results[0][1].heads,
    )


def _full_check(ranks: Ranks, mask, grads: bool, rtol: float) -> checks.CheckResult:
    """Every rank emulated, its output rows (and dq rows, dK/dV of every block it saw) put back
    in global order, and the whole compared with float64 attention."""
    plan, s = ranks.plan, mask.seqlen_q
    host = {n: ranks.host(n) for n in ("q", "k", "v", "dout")}
    got = {n: np.zeros(host["q"].shape) for n in ("out", "dq")}
    got.update({n: np.zeros(host["k"].shape) for n in ("dk", "dv")})
    for g in range(plan.world_size):
        r, u = plan.ring_rank(g), plan.ulysses_rank(g)
        res = ranks.emulated(r, u)
        pos = plan.layout.positions[r]
        real = pos < s
        for n in ("out", "dq") if grads else ("out",):
            got[n][:, pos[real][:, None], ranks.q_heads[u][None, :]] = res[n][:, real]
        for t, *grads_kv in res.get("dkv", []):
            dk, dv = (ranks.to_host(g) for g in grads_kv)
            keys = plan.key_positions(r, t)
            seen = keys < s
            for j, h in enumerate(ranks.kv_heads[u]):
                got["dk"][:, keys[seen], h] += dk[:, seen, j]
                got["dv"][:, keys[seen], h] += dv[:, seen, j]
    inputs = checks.Inputs(**host)
    return checks.compare(mask, inputs, got, plan=checks.CheckPlan(), grads=grads, rtol=rtol)


@dataclass
class _RankRows:
    """What a row check compares of one emulated rank: its sampled rows (global positions) and
    the keys they see, its out (and dq) at those rows, whether its dK/dV parts are finite."""

    plan: checks.CheckPlan
    got: dict[str, np.ndarray]
    finite: dict[str, bool]


class _RowPlan(NamedTuple):
    """Which rows of rank (r, u) a row check emulates (Ranks.check_rows; None: all) and
    compares (plan: global rows, the keys they see, heads), and where those sit in its
    emulated rows (local): all known before the rank runs."""

    rows: np.ndarray | None
    plan: checks.CheckPlan
    local: np.ndarray


def _row_plan(ranks: Ranks, mask, r: int, u: int, seed: int) -> _RowPlan:
    """Rank (r, u)'s rows to emulate (whole query tiles of its shard where the framework can:
    Ranks.check_rows) and its sampled rows among those tokens, in its heads."""
    rows = ranks.check_rows(r, mask.seqlen_q)
    pos = ranks.plan.layout.positions[r]
    pos = pos if rows is None else pos[rows]
    rows_plan = checks.sample_rows(mask, pos[pos < mask.seqlen_q], seed, len(ranks.q_heads[u]))
    order = np.argsort(pos)
    return _RowPlan(rows, rows_plan, order[np.searchsorted(pos[order], rows_plan.rows)])


def _rank_rows(ranks: Ranks, r: int, u: int, planned: _RowPlan) -> _RankRows:
    """Rank (r, u) emulated on its planned rows, its results kept at the sampled rows and its
    heads (its blocks' dK/dV: finite only, as a row check of the whole problem would)."""
    res = ranks.emulated(r, u, planned.rows)
    parts = res.get("dkv", [])
    finite = {n: all(ranks.all_finite(p[i]) for p in parts) for i, n in ((1, "dk"), (2, "dv"))}
    got = {n: res[n][:, planned.local] for n in ("out", "dq") if n in res}
    return _RankRows(planned.plan, got, finite)


Known = dict[tuple[int, int], dict[str, np.ndarray]]  # (global row, global q head) -> values


@dataclass
class ReferenceRows:
    """Float64 reference values kept between the points that draw the same inputs (one mask
    instance with its shapes and seed: a problem's strategies, layouts and modes, which a sweep
    runs one after another), per (global query row, global query head), so a row an earlier
    point compared is neither drawn nor computed again (a forward's out is a forward+backward's
    too; a forward+backward computes dq for rows a forward compared). Holds one problem at a
    time."""

    problem: object = None
    values: Known = field(default_factory=dict)

    def of(self, problem: object) -> Known:
        """The values of `problem`, emptied first when another problem's are held."""
        if problem != self.problem:
            self.problem, self.values = problem, {}
        return self.values


def _add_references(
    ranks: Ranks, mask, u: int, plans: list[checks.CheckPlan], grads: bool, known: Known
) -> None:
    """Float64 values of every (row, head) the ranks of one Ulysses position compare that
    `known` lacks (an earlier point of the same problem computed the others), from one
    reference over all their missing rows (the keys those rows see drawn and converted once,
    not once per rank: at 64 devices half a million keys of every K/V head), added to it."""
    heads = plans[0].heads
    global_heads = [int(h) for h in ranks.q_heads[u][heads]]
    wanted = {"out", "dq"} if grads else {"out"}
    missing = [
        np.array(
            [
                r
                for r in p.rows
                if any(not wanted <= known.get((int(r), h), {}).keys() for h in global_heads)
            ]
        )
        for p in plans
    ]
    if any(rows.size for rows in missing):
        for at, values in _reference_rows(ranks, mask, u, missing, heads, grads).items():
            known[at] = {**known.get(at, {}), **values}


def _compare_rows(
    ranks: Ranks,
    mask,
    u: int,
    members: list[_RankRows],
    grads: bool,
    rtol: float,
    known: Known | None = None,
) -> list[checks.CheckResult]:
    """Each of the ranks of one Ulysses position compared with float64 attention at its rows,
    from the reference values of every (row, head) they compare (_add_references: those
    `known` lacks computed and added to it)."""
    known = {} if known is None else known
    _add_references(ranks, mask, u, [m.plan for m in members], grads, known)
    global_heads = [int(h) for h in ranks.q_heads[u][members[0].plan.heads]]
    names = ("out", "dq") if grads else ("out",)
    return [
        checks.compare(
            mask,
            None,
            m.got,
            plan=m.plan,
            grads=grads,
            rtol=rtol,
            finite=m.finite,
            scale=ranks.scale,
            refs={n: _gathered(known, m.plan.rows, global_heads, n) for n in names},
        )
        for m in members
    ]


def _gathered(known: Known, rows: np.ndarray, heads: list[int], name: str) -> np.ndarray:
    """(B, rows, heads, D) of tensor `name` from the values held per (global row, global head)."""
    return np.stack([np.stack([known[(int(r), h)][name] for h in heads], 1) for r in rows], 1)


def _reference_rows(
    ranks: Ranks,
    mask,
    u: int,
    rows_of: list[np.ndarray],
    heads: np.ndarray,
    grads: bool,
) -> Known:
    """Float64 out (and dq) of the ranks' rows `rows_of` in the sampled local `heads` of
    Ulysses position u, keyed by (global row, global q head)."""
    drawn = [rows for rows in rows_of if rows.size]
    rows = np.concatenate(drawn)
    refs = ranks.reference_rows(mask, drawn, u, heads, grads, ranks.scale)
    global_heads = ranks.q_heads[u][heads]
    return {
        (int(r), int(h)): {n: ref[:, i, j] for n, ref in refs.items()}
        for i, r in enumerate(rows)
        for j, h in enumerate(global_heads)
    }


def _rank_check(
    ranks: Ranks, mask, r: int, u: int, grads: bool, rtol: float, seed: int
) -> checks.CheckResult:
    """Rank (r, u) alone: emulated, and compared with float64 attention at sampled rows."""
    planned = _row_plan(ranks, mask, r, u, seed)
    return _compare_rows(ranks, mask, u, [_rank_rows(ranks, r, u, planned)], grads, rtol)[0]


def check_ranks(
    ranks: Ranks, point: Point, mask, index: int, rtol: float, known: Known | None = None
) -> tuple[checks.CheckResult, list[int]]:
    """(check, global ranks checked): every rank against float64 attention of the whole problem
    when it is small (checks.FULL_CHECK_ELEMENTS), else the first rank and the first rank of
    the busiest ring rank, each judged at its own sampled rows, the ranks of one Ulysses
    position from one reference (known: the problem's reference values so far,
    ReferenceRows.of; read and added to)."""
    from shard_strategies.simulate import global_rank

    plan, s = ranks.plan, mask.seqlen_q
    grads = point.mode != "fwd"
    if point.batch * point.heads_q * s * s <= checks.FULL_CHECK_ELEMENTS:
        return _full_check(ranks, mask, grads, rtol), list(range(plan.world_size))
    busiest = int(np.argmax(plan.piece_area.sum(axis=1)))
    members = sorted({(plan.ring_rank(0), plan.ulysses_rank(0)), (busiest, 0)})
    seed = point.seed + index
    known = {} if known is None else known
    results = []
    for u in sorted({u for _, u in members}):
        ring = [r for r, v in members if v == u]
        planned = [_row_plan(ranks, mask, r, u, seed) for r in ring]
        # the float64 reference (host work and input draws) beside the ranks' emulation (device
        # work): neither depends on the other, and both end before any call is timed
        with ThreadPoolExecutor(1) as pool:
            refs = pool.submit(
                _add_references, ranks, mask, u, [p.plan for p in planned], grads, known
            )
            rows = [_rank_rows(ranks, r, u, p) for r, p in zip(ring, planned)]
            refs.result()
        checked = _compare_rows(ranks, mask, u, rows, grads, rtol, known)
        results += [(global_rank(plan, r, u), c) for r, c in zip(ring, checked)]
    return _merge_checks(results), [g for g, _ in results]
