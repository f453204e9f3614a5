"""The CP predictor's per-call cost model: one kernel call's time as a linear function of its
mask piece's work, fitted from a few timed calls of the same shapes and applied to the rest.

Calls of one class (same step function, impl, shapes and key length) differ only in their mask
piece, and a block-sparse kernel's time is close to a + b * (row span) + c * (column span): a
fixed launch and edge cost, and when the last CTA of its query-tile kernels (forward, dQ: one
CTA a query tile and head, each walking its row of tiles) and of its key-tile kernel (dK/dV:
one a key tile and K/V head, walking its column for the group's query heads) ends, with the
CTAs started in the kernels' launch order on the first of SLOTS to come free (schedule_span).
A partial tile counts as PARTIAL_WEIGHT full ones in a query-tile walk and COLUMN_PARTIAL_WEIGHT
in a key-tile walk; a forward call runs no key-tile kernel, so its column span is 0
(call_features). So the model sees both the work and how it is spread: a piece with one
256-tile key column ran 30 ms on the H200 where its tile count gave 6, and the same long column
costs its walk on top of the rest when it starts last and hides under the rest when it starts
first. An impl that reads no tile lists is modelled on the piece's visible area times its heads
instead. A small calibration sample that spans the pieces' work is timed, the coefficients are
fitted non-negative, and a held-out sample of further timed calls measures the model's error,
which every simulated record carries.

Across shapes: a kind of call (the same step function, impl and GQA group at any shapes) keeps
the relative cost of its features once its calls are long enough to fill the device, but not
its absolute rate, which still moves with the block lengths (on the H200 a ring kind's
32K-token forward+backward calls ran 24% off the rate of its 8K-token calls). The spans hold
every head of a call, so calls of other shapes are on one scale. The calls of a long class
(seconds each at 2M tokens) are predicted from the kind's model, fitted on its timed calls of
at least KIND_FIT_MIN_MS, times the class's own rate (class_rate) from LONG_RATE_CALLS timed
calls of it, with LONG_VALIDATION_CALLS more of it timed as its held-out check. Where the kind
has rates of RATE_TREND_CLASSES other classes, a class none of whose calls was timed takes its
rate from their trend in call length instead (rate_trend) and times no rate call: longer calls
of a kind run slower per unit of modelled work (on the H100 the kind's model alone puts
once_bwd at 32K queries 4% short at 262K keys and 7% short at 2M).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from experiments.core.flags import MIN_TIMED_CALLS
from shard_strategies.simulate import ATTEND, ATTEND_ONCE

VALIDATION_CALLS = 4  # timed calls held out of each fit to measure its error
REUSE_VALIDATION_CALLS = 1  # held out at each later point a class's earlier fit serves
MIN_CALIBRATION = MIN_TIMED_CALLS  # a timed call per feature of the tile model, and one more
SLOTS = 132  # CTAs running at once in schedule_span where the device does not say: H100/H200 SMs
PARTIAL_WEIGHT = 2.0  # a partial tile's share of a CTA's walk, in full tiles (H200, below)
COLUMN_PARTIAL_WEIGHT = 2.5  # the same in a dK/dV CTA's walk of its key-tile column (H100, below)
FORWARD_CALLS = (ATTEND, ATTEND_ONCE)  # step functions that run only query-tile kernels
SHORT_BATCH = 8  # CTAs a batch of schedule_span below which it goes CTA by CTA for a while
SPANS = ("row_span", "col_span")  # names of the tile model's work features (timed-call records)
ERROR_QUANTILE = 90  # the error a record states: this percentile of the held-out relative errors
KIND_FIT_MIN_MS = 5.0  # calls this long fit a kind's model across shapes (throughput regime)
LONG_RATE_CALLS = 1  # timed calls that set the rate of a class predicted across shapes
LONG_VALIDATION_CALLS = 1  # further timed calls of such a class, held out
RATE_CALL_SHARE = 0.25  # a class's rate call: its cheapest this share of its median or longer
RATE_TREND_CLASSES = 3  # classes of a kind with rates from which rate_trend predicts another's
SIGNIFICANT = 4  # significant digits of the held-out times a record lists
TileWork = tuple[np.ndarray, np.ndarray]  # (full, partial) tiles per query-tile row or key column
PieceWork = tuple[TileWork, TileWork]  # a piece's rows' and columns' (Mask.tile_counts)

# PARTIAL_WEIGHT and SLOTS: of 1, 1.5, 2, 3 and 4 weights and 66, 132, 198 and 264 slots, 2 and
# 132 predicted the H200's timed calls best (results/h200/cp_predict, runs 12 and 13, scored by
# experiments/cp_call_fits.py): a partial tile computes its scores and then masks them.
# COLUMN_PARTIAL_WEIGHT: of 2 to 5 in a key-tile walk (the query-tile walks at 2), 2.25 to 3
# predicted the held-out calls of H100 runs 27 and 29 (results/h100/cp_predict) best, replayed
# by experiments/cp_call_fits.py --rebuild_spans ("as the run checked"); 2.5, the middle, with
# forward calls' column span 0: 4.1 -> 3.4% and 5.9 -> 4.9% there, and on runs not used to
# choose it, H100 run 25 7.8 -> 7.0% and H200 run 20 5.6 -> 5.2%. Likely (not profiled): a
# dK/dV step builds a partial tile's mask keys first, from each of its query rows' intervals.


def schedule_span(works: np.ndarray, slots: int = SLOTS) -> float:
    """When the last of a grid's CTAs ends, each CTA (its time in `works`, in launch order)
    starting on the first of `slots` to come free: list scheduling, as a GPU's block scheduler
    hands out a grid too large to run at once. CTAs without work end as they start."""
    if slots < 1:
        raise ValueError(f"schedule_span needs at least one slot, got slots={slots}")
    works = np.ravel(np.asarray(works, np.float64))
    works = works[works > 0]
    if len(works) <= slots or works.min() == works.max():  # one round, or equal rounds
        return float(-(-len(works) // slots) * works.max()) if len(works) else 0.0
    return _span_in_batches(np.sort(works[:slots]), works[slots:])


def _span_in_batches(ends: np.ndarray, rest: np.ndarray) -> float:
    """schedule_span of the CTAs `rest` on slots that come free at sorted `ends`, a batch at a
    time: the next CTAs take the earliest ends in turn while no earlier CTA of the batch ends
    before the end it takes (what CTA-by-CTA scheduling gives them; equal ends are equal
    times). A 64-GPU plan's grids go about a hundred CTAs a batch; where batches come out
    shorter than SHORT_BATCH (short CTAs after long uneven ones), the next len(ends) go CTA by
    CTA on a heap, the same float additions, so the span is the same either way."""
    slots, at = len(ends), 0
    while at < len(rest):
        work = rest[at : at + slots]
        done = ends[: len(work)] + work
        late = np.flatnonzero(ends[1 : len(work)] > np.minimum.accumulate(done[:-1]))
        taken = int(late[0]) + 1 if late.size else len(work)
        if taken < SHORT_BATCH:
            heap = ends.tolist()  # a sorted list is a heap
            for w in work.tolist():
                heapq.heapreplace(heap, heap[0] + w)
            ends, taken = np.sort(heap), len(work)
        else:
            ends[:taken] = done[:taken]
            ends.sort()
        at += taken
    return float(ends[-1])


def tile_work(full: np.ndarray, partial: np.ndarray, weight: float = PARTIAL_WEIGHT) -> np.ndarray:
    """Each CTA's walk in full-tile units: its full tiles and `weight` per partial one."""
    return np.asarray(full, np.float64) + weight * np.asarray(partial, np.float64)


def span_features(
    rows: TileWork, cols: TileWork, heads_q: int, heads_kv: int, slots: int = SLOTS,
    partial_weight: float = PARTIAL_WEIGHT, column_weight: float = COLUMN_PARTIAL_WEIGHT,
) -> np.ndarray:  # fmt: skip
    """(3,) [1, row span, column span] of a piece with (full, partial) tiles per query-tile row
    and per key-tile column (a partial tile as partial_weight full ones in a row's walk and
    column_weight in a column's), run for heads_q query heads (times the batch) and heads_kv
    K/V heads: the query-tile kernels launch each head's rows last first
    (jax_attn/pallas_triton/common.py query_tile_specs: the longest causal rows first), the
    key-tile kernel each K/V head's columns in order, each column walked for the group's
    heads_q / heads_kv heads."""
    if heads_q < 1 or heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} must be a positive multiple of heads_kv={heads_kv}")
    row_work = tile_work(*rows, partial_weight)[::-1]
    col_work = tile_work(*cols, column_weight) * (heads_q // heads_kv)
    row_span = schedule_span(np.tile(row_work, heads_q), slots)
    col_span = schedule_span(np.tile(col_work, heads_kv), slots)
    return np.array([1.0, row_span, col_span])


def span_weights(
    partial_weight: float = PARTIAL_WEIGHT, column_weight: float = COLUMN_PARTIAL_WEIGHT
) -> dict[str, float]:
    """The partial-tile weights a timed call's spans are computed with, as its record lists
    them (beside the schedule's slots), so spans made under other weights are not mixed in."""
    return {"partial_weight": float(partial_weight), "column_weight": float(column_weight)}


def recorded_weights(call: dict) -> dict[str, float]:
    """The partial-tile weights of a recorded call's spans: 2 in every walk for records from
    before they were listed."""
    return span_weights(call.get("partial_weight", 2.0), call.get("column_weight", 2.0))


def call_features(call: str, features: np.ndarray) -> np.ndarray:
    """A call's work features from its piece's (span_features; area_features pass as they
    are): a forward (FORWARD_CALLS) runs no key-tile kernel, so its column span is 0 and a
    class's fit cannot lean on it."""
    features = np.array(features, np.float64)
    if call in FORWARD_CALLS and features.shape[-1] == 1 + len(SPANS):
        features[..., 2] = 0.0
    return features


def area_features(area: np.ndarray, heads_q: int) -> np.ndarray:
    """(..., 2) [1, visible area x heads] of pieces run by an impl without tile lists."""
    area = np.asarray(area, np.float64)
    return np.stack([np.ones(area.shape), area * heads_q], axis=-1)


def work_stats(shape: tuple[int, int], work: PieceWork) -> dict[str, int]:
    """How a piece's work is laid out beyond the model's spans, from its tiles per row and column
    (Mask.tile_counts): its size in tiles, its full and partial tiles, the query-tile rows and
    key-tile columns holding any tile and the most tiles in one row and in one column. Recorded
    with every timed call, so other models can be fitted from a run."""
    (row_full, row_partial), (col_full, col_partial) = work
    per_row, per_col = row_full + row_partial, col_full + col_partial
    return {
        "q_tiles": int(shape[0]),
        "k_tiles": int(shape[1]),
        "full": int(row_full.sum()),
        "partial": int(row_partial.sum()),
        "rows": int((per_row > 0).sum()),
        "row_max": int(per_row.max(initial=0)),
        "cols": int((per_col > 0).sum()),
        "col_max": int(per_col.max(initial=0)),
    }


def fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients of y ~ x @ coef minimising the squared relative error (the
    error a record reports): columns whose coefficient goes negative are dropped one at a time
    (the most negative first) and the rest refitted, so a feature the sample cannot resolve
    costs nothing instead of a negative time."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 2 or len(x) != len(y) or not len(y):
        raise ValueError(f"fit needs x (n, F) and y (n,) with n >= 1, got {x.shape}, {y.shape}")
    weight = 1.0 / np.maximum(np.abs(y), 1e-12)
    xw, yw = x * weight[:, None], y * weight
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def calibration_picks(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of about k rows of x whose work spans the rest: each feature's smallest and
    largest (up to k of them), then rows at evenly spaced interior quantiles of the summed,
    scale-free work for the slots left, then (past k) rows until they span all of x's."""
    x = np.asarray(x, np.float64)
    if k < MIN_CALIBRATION:
        raise ValueError(f"calibration needs at least {MIN_CALIBRATION} timed calls, got k={k}")
    if len(x) <= k:
        return np.arange(len(x))
    spread = x.max(axis=0) - x.min(axis=0)
    varying = np.flatnonzero(spread > 0)
    extremes = [int(i) for j in varying for i in (np.argmin(x[:, j]), np.argmax(x[:, j]))]
    picks = list(dict.fromkeys(extremes))[:k]
    work = ((x[:, varying] - x[:, varying].min(axis=0)) / spread[varying]).sum(axis=1)
    order = np.argsort(work, kind="stable")
    slots = k - len(picks)
    for q in np.linspace(0, len(x) - 1, slots + 2)[1:-1]:
        picks.append(int(order[int(round(q))]))
    picks = list(dict.fromkeys(picks))
    return np.array(_spanning(x[:0], x, picks))


def coverage_picks(known: np.ndarray, new: np.ndarray) -> list[int]:
    """Indices of rows of `new` to time so that they and the `known` rows (timed before) span
    every new row's work, so a fit on them interpolates: for each feature where some new rows
    fall outside the known rows' range, the smallest and the largest of them; then, as in
    calibration_picks, rows until they span what all rows span (_spanning).
    Empty where the known rows already span the new ones."""
    known, new = np.asarray(known, np.float64), np.asarray(new, np.float64)
    lo, hi = known.min(axis=0), known.max(axis=0)
    picks: list[int] = []
    for j in range(new.shape[1]):
        if (new[:, j] < lo[j]).any():
            picks.append(int(np.argmin(new[:, j])))
        if (new[:, j] > hi[j]).any():
            picks.append(int(np.argmax(new[:, j])))
    return _spanning(known, new, list(dict.fromkeys(picks)))


def _spanning(known: np.ndarray, rows: np.ndarray, picks: list[int]) -> list[int]:
    """`picks` (indices of `rows`) and then, one at a time, the row farthest from the span of
    the known rows and the picked ones, until they span what all rows span: a sample on a line
    (or plane) of feature space cannot resolve every cost."""
    rank = np.linalg.matrix_rank(np.vstack([known, rows]))
    while np.linalg.matrix_rank(timed := np.vstack([known, rows[picks]])) < rank:
        basis, *_ = np.linalg.lstsq(timed.T, rows.T, rcond=None)
        residual = np.linalg.norm(rows.T - timed.T @ basis, axis=0)
        picks.append(int(np.argmax(residual)))
    return picks


def class_rate(x: np.ndarray, measured: np.ndarray, coef: np.ndarray) -> float:
    """A class's own rate against its kind's model: its timed calls' measured time over the
    time the model (`coef`) gives their work features `x`, summed (the longest weigh most)."""
    modelled = float(np.sum(np.asarray(x, np.float64) @ coef))
    if modelled <= 0:
        raise ValueError(f"the kind's model gives these calls no time ({modelled} ms)")
    return float(np.sum(measured)) / modelled


def rate_trend(lengths: np.ndarray, rates: np.ndarray, length: float) -> float:
    """The rate of a class whose calls the kind's model puts at `length` ms (their median),
    from the rates of the kind's other classes at theirs: log rate linear in log length, least
    squares (their geometric mean where they share one length). Replayed on the records of
    both card kinds with each long class left out (results/cpu/cp_rate_trend): 5.2% (H100) and
    5.0% (H200) at the 90th percentile over the long classes' calls, against 5.6% and 6.7%
    from one timed call of the class."""
    x = np.log(np.asarray(lengths, np.float64))
    y = np.log(np.asarray(rates, np.float64))
    if len(x) == 0 or length <= 0:
        raise ValueError(f"rate_trend needs classes and a positive length, got {len(x)}, {length}")
    if np.ptp(x) == 0:
        return float(np.exp(y.mean()))
    slope, intercept = np.polyfit(x, y, 1)
    return float(np.exp(intercept + slope * np.log(length)))


@dataclass(frozen=True)
class ModelError:
    """Relative errors of a fitted model on held-out timed calls, in percent, and the calls'
    (predicted, measured) median ms, so a report can pool the calls of many points."""

    calls: int
    quantile_pct: float
    max_pct: float
    pairs: tuple[tuple[float, float], ...] = ()

    def as_dict(self) -> dict:
        return {
            "held_out_calls": self.calls,
            "error_quantile": ERROR_QUANTILE,
            "quantile_error_pct": round(self.quantile_pct, 3),
            "max_error_pct": round(self.max_pct, 3),
            "held_out_ms": [[float(f"{v:.{SIGNIFICANT}g}") for v in pair] for pair in self.pairs],
        }


def scaled_quantiles(median_ms: float, ratios: dict[str, float]) -> dict[str, float]:
    """A predicted call's time statistics: the modelled median and the other quantiles at the
    calibration calls' median ratio to their median (so min <= p20 <= median <= p80 <= max)."""
    return {q: median_ms * r for q, r in ratios.items()}


def quantile_ratios(stats: list[dict[str, float]], quantiles: tuple[str, ...]) -> dict[str, float]:
    """Each quantile's median ratio to the median over timed calls' statistics, of the calls
    timed more than once where there are any (a call sampled once has no spread to give)."""
    spread = [s for s in stats if s.get("n", 2) > 1] or stats
    return {
        q: float(np.median([s[q] / max(s["median"], 1e-12) for s in spread])) for q in quantiles
    }


def held_out_error(predicted: np.ndarray, measured: np.ndarray) -> ModelError:
    """The model's error on calls it was not fitted on: |predicted - measured| / measured."""
    predicted, measured = np.asarray(predicted, np.float64), np.asarray(measured, np.float64)
    rel = 100.0 * np.abs(predicted - measured) / np.maximum(measured, 1e-12)
    pairs = tuple(zip(predicted.tolist(), measured.tolist()))
    return ModelError(len(rel), float(np.percentile(rel, ERROR_QUANTILE)), float(rel.max()), pairs)
