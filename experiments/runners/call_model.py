"""The CP predictor's per-call cost model: one kernel call's time as a linear function of its
mask piece's work, fitted from a few timed calls of the same shapes and applied to the rest.

Calls of one class (same step function, impl, shapes and key length) differ only in their mask
piece, and a block-sparse kernel's time is close to a + b * (full tiles) + c * (partial tiles):
a fixed launch and edge cost, then each tile it visits. An impl that reads no tile lists is
modelled on the piece's visible area instead. A small calibration sample that spans the pieces'
work is timed, the coefficients are fitted non-negative, and a held-out sample of further timed
calls measures the model's error, which every simulated record carries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VALIDATION_CALLS = 4  # timed calls held out of each fit to measure its error
ERROR_QUANTILE = 90  # the error a record states: this percentile of the held-out relative errors


def piece_features(kv_lists, area: np.ndarray) -> np.ndarray:
    """(..., F) work features of stacked mask pieces: [1, full tiles, partial tiles] from the
    forward tile lists (TileList of index/full (..., n, W), count (..., n)), or [1, visible
    area] where the impl has no tile lists (kv_lists None)."""
    ones = np.ones(np.shape(area))
    if kv_lists is None:
        return np.stack([ones, np.asarray(area, np.float64)], axis=-1)
    count = np.asarray(kv_lists.count)
    full = np.asarray(kv_lists.full)
    listed = np.arange(full.shape[-1]) < count[..., None]
    tiles = count.sum(axis=-1).astype(np.float64)
    full_tiles = (full.astype(bool) & listed).sum(axis=(-2, -1)).astype(np.float64)
    return np.stack([ones, full_tiles, tiles - full_tiles], axis=-1)


def fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least-squares coefficients of y ~ x @ coef: columns whose unconstrained
    coefficient goes negative are dropped one at a time (the most negative first) and the rest
    refitted, so a feature the sample cannot resolve costs nothing instead of a negative time."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 2 or len(x) != len(y) or not len(y):
        raise ValueError(f"fit needs x (n, F) and y (n,) with n >= 1, got {x.shape}, {y.shape}")
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def calibration_picks(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of up to k rows of x whose work spans the rest: each feature's smallest and
    largest, then rows at evenly spaced quantiles of the summed, scale-free work."""
    x = np.asarray(x, np.float64)
    if k < 1:
        raise ValueError(f"calibration needs at least 1 timed call, got k={k}")
    if len(x) <= k:
        return np.arange(len(x))
    spread = x.max(axis=0) - x.min(axis=0)
    varying = np.flatnonzero(spread > 0)
    picks = [int(i) for j in varying for i in (np.argmin(x[:, j]), np.argmax(x[:, j]))]
    work = ((x[:, varying] - x[:, varying].min(axis=0)) / spread[varying]).sum(axis=1)
    order = np.argsort(work, kind="stable")
    for q in np.linspace(0, len(x) - 1, k):
        picks.append(int(order[int(round(q))]))
    return np.array(list(dict.fromkeys(picks))[:k])


@dataclass(frozen=True)
class ModelError:
    """Relative errors of a fitted model on held-out timed calls, in percent."""

    calls: int
    quantile_pct: float
    max_pct: float

    def as_dict(self) -> dict:
        return {
            "held_out_calls": self.calls,
            f"p{ERROR_QUANTILE}_error_pct": round(self.quantile_pct, 3),
            "max_error_pct": round(self.max_pct, 3),
        }


def held_out_error(predicted: np.ndarray, measured: np.ndarray) -> ModelError:
    """The model's error on calls it was not fitted on: |predicted - measured| / measured."""
    predicted, measured = np.asarray(predicted, np.float64), np.asarray(measured, np.float64)
    rel = 100.0 * np.abs(predicted - measured) / np.maximum(measured, 1e-12)
    return ModelError(len(rel), float(np.percentile(rel, ERROR_QUANTILE)), float(rel.max()))
