"""The CP predictor's per-call cost model: one kernel call's time as a linear function of its
mask piece's work, fitted from a few timed calls of the same shapes and applied to the rest.

Calls of one class (same step function, impl, shapes and key length) differ only in their mask
piece, and a block-sparse kernel's time is close to a + b * (full tiles) + c * (partial tiles)
+ d * (longest key-tile column): a fixed launch and edge cost, each tile it visits, and the
column one CTA of the dK/dV pass walks alone while the others have finished (on the H200 a
piece with one 256-tile column ran 30 ms where its tile count gave 6). An impl that reads no
tile lists is modelled on the piece's visible area instead. A small calibration sample that
spans the pieces' work is timed, the coefficients are fitted non-negative, and a held-out
sample of further timed calls measures the model's error, which every simulated record
carries.

Across shapes: a kind of call (the same step function, impl and GQA group at any shapes) keeps
the relative cost of its full and partial tiles once its calls are long enough to fill the
device, but not its absolute rate, which still moves with the block lengths (on the H200 a
ring kind's 32K-token forward+backward calls ran 24% off the rate of its 8K-token calls). So
the calls of a long class (seconds each at 2M tokens) are predicted from the kind's model over
[1, full tiles x heads, partial tiles x heads, longest column] (heads run side by side, so
the longest column is not scaled by them), fitted on its timed calls of at least
KIND_FIT_MIN_MS, times the class's own rate (class_rate) from LONG_RATE_CALLS timed calls of
it, with LONG_VALIDATION_CALLS more of it timed as its held-out check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attn_masks.tiles import BLOCK_FULL as FULL
from attn_masks.tiles import BLOCK_PARTIAL as PARTIAL
from experiments.core.flags import MIN_TIMED_CALLS

VALIDATION_CALLS = 4  # timed calls held out of each fit to measure its error
MIN_CALIBRATION = MIN_TIMED_CALLS  # at least one timed call per feature of the tile model
PER_HEAD = slice(1, 3)  # the work columns that add up over heads (tiles, or the area)
ERROR_QUANTILE = 90  # the error a record states: this percentile of the held-out relative errors
KIND_FIT_MIN_MS = 5.0  # calls this long fit a kind's model across shapes (throughput regime)
LONG_RATE_CALLS = 1  # timed calls that set the rate of a class predicted across shapes
LONG_VALIDATION_CALLS = 1  # further timed calls of such a class, held out
SIGNIFICANT = 4  # significant digits of the held-out times a record lists


def piece_features(kv_lists, area: np.ndarray) -> np.ndarray:
    """(..., F) work features of stacked mask pieces: [1, full tiles, partial tiles, most
    tiles in one key-tile column] from the forward tile lists (TileList of index/full
    (..., n, W), count (..., n)), or [1, visible area] where the impl has no tile lists
    (kv_lists None)."""
    ones = np.ones(np.shape(area))
    if kv_lists is None:
        return np.stack([ones, np.asarray(area, np.float64)], axis=-1)
    count = np.asarray(kv_lists.count)
    full, index = np.asarray(kv_lists.full), np.asarray(kv_lists.index)
    listed = np.arange(full.shape[-1]) < count[..., None]
    tiles = count.sum(axis=-1).astype(np.float64)
    full_tiles = (full.astype(bool) & listed).sum(axis=(-2, -1)).astype(np.float64)
    rows = (-1, *index.shape[-2:])  # one (n, W) list per piece
    col_max = np.array(
        [
            np.bincount(i[m]).max(initial=0)
            for i, m in zip(index.reshape(rows), listed.reshape(rows))
        ],
        np.float64,
    ).reshape(count.shape[:-1])
    return np.stack([ones, full_tiles, tiles - full_tiles, col_max], axis=-1)


def map_features(kinds: np.ndarray) -> np.ndarray:
    """(F,) piece_features of one piece from its tile map (attn_masks block_map: 0 empty,
    1 partial, 2 full), the source of its tile lists, without building them."""
    return stats_features(map_stats(kinds))


def stats_features(stats: dict[str, int]) -> np.ndarray:
    """(F,) piece_features of one piece from its map_stats."""
    return np.array([1.0, stats["full"], stats["partial"], stats["col_max"]], np.float64)


def map_stats(kinds: np.ndarray) -> dict[str, int]:
    """How a piece's work is laid out, from its tile map, beyond the model's tile counts: its
    size in tiles, the query-tile rows and key-tile columns holding any tile and the most tiles
    in one row and in one column (a kernel that gives a row or a column to one CTA waits on its
    longest). Recorded with every timed call, so richer models can be fitted from a run."""
    kinds = np.asarray(kinds)
    visited = kinds != 0
    per_row, per_col = visited.sum(axis=1), visited.sum(axis=0)
    return {
        "q_tiles": int(kinds.shape[0]),
        "k_tiles": int(kinds.shape[1]),
        "full": int((kinds == FULL).sum()),
        "partial": int((kinds == PARTIAL).sum()),
        "rows": int((per_row > 0).sum()),
        "row_max": int(per_row.max(initial=0)),
        "cols": int((per_col > 0).sum()),
        "col_max": int(per_col.max(initial=0)),
    }


def work_features(features: np.ndarray, heads: int) -> np.ndarray:
    """piece_features of calls that each run `heads` (batch x query heads) attention heads,
    with the work columns that add up over heads (PER_HEAD) scaled by them: features of one
    kind of call at any shapes."""
    x = np.array(features, np.float64)
    x[..., PER_HEAD] *= heads
    return x


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
    # a sample on a line (or plane) of feature space cannot resolve every cost: add the row
    # farthest from its span until it spans what all rows span
    while np.linalg.matrix_rank(x[picks]) < np.linalg.matrix_rank(x):
        basis, *_ = np.linalg.lstsq(x[picks].T, x.T, rcond=None)
        residual = np.linalg.norm(x.T - x[picks].T @ basis, axis=0)
        picks.append(int(np.argmax(residual)))
    return np.array(picks)


def class_rate(x: np.ndarray, measured: np.ndarray, coef: np.ndarray) -> float:
    """A class's own rate against its kind's model: its timed calls' measured time over the
    time the model (`coef`) gives their work features `x`, summed (the longest weigh most)."""
    modelled = float(np.sum(np.asarray(x, np.float64) @ coef))
    if modelled <= 0:
        raise ValueError(f"the kind's model gives these calls no time ({modelled} ms)")
    return float(np.sum(measured)) / modelled


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
