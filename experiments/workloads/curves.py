"""Loss curves of several kernels on the same run: agreement with a baseline, and one overlay plot.

Two correct attention kernels differ only by rounding, so with the same seed and data their
training curves agree step by step. The tolerance is the correctness check's per-dtype relative
threshold (experiments/runners/checks.py, the bound a correct kernel's output stays within)
applied to the baseline's loss at each step: |loss - baseline| <= rtol(dtype) * baseline. A wrong
gradient (a kernel whose backward is off by a few percent or more) moves the curve by more than
that within a few steps; rounding noise, amplified by training, stays below it over 50 steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MOVING_AVERAGE = 20
BASELINE_IMPLS = ("xla", "reference")  # exact softmax, no tiling: the curve others must follow


def baseline_impl(impls: list[str]) -> str:
    """The impl whose curve the others are checked against: xla or reference if run, else the
    first one."""
    for name in BASELINE_IMPLS:
        if name in impls:
            return name
    return impls[0]


def compare(
    losses: dict[int, float], baseline: dict[int, float], *, baseline_name: str, tol: float
) -> dict:
    """The check of one curve against the baseline over the steps both ran.

    passed is False when a step's loss is not finite or departs by more than tol relative;
    first_departure is that step (None when it passes).
    """
    steps = sorted(set(losses) & set(baseline))
    if not steps:
        raise ValueError("no step in common with the baseline curve")
    got = np.array([losses[s] for s in steps])
    want = np.array([baseline[s] for s in steps])
    diff = np.abs(got - want)
    bad = ~np.isfinite(got) | (diff > tol * np.abs(want))
    rel = diff / np.maximum(np.abs(want), 1e-12)
    return {
        "kind": "loss_curve",
        "baseline": baseline_name,
        "steps": len(steps),
        "rtol": tol,
        "max_rel_diff": float(np.nanmax(rel)) if np.isfinite(rel).any() else float("inf"),
        "first_departure": int(np.asarray(steps)[bad][0]) if bad.any() else None,
        "passed": not bool(bad.any()),
    }


def moving_average(values: list[float], window: int = MOVING_AVERAGE) -> np.ndarray:
    """Trailing mean over up to `window` values (shorter at the start)."""
    x = np.asarray(values, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(x)])
    n = np.arange(1, len(x) + 1)
    lo = np.maximum(n - window, 0)
    return (c[n] - c[lo]) / (n - lo)


def plot(
    curves: dict[str, dict[int, float]],
    path: str | Path,
    *,
    title: str,
    floor: float | None = None,
    floor_label: str = "task floor",
) -> Path:
    """Loss by step per label (raw, thin; 20-step moving average, bold), a reference loss
    (`floor`, legend `floor_label`) as a dashed line, and with several labels a lower panel of
    each curve minus the first."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    several = len(curves) > 1
    fig = Figure(figsize=(9, 6.5 if several else 4.5))
    if several:
        top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    else:
        top, bottom = fig.subplots(1, 1), None
    first = next(iter(curves))
    for label, losses in curves.items():
        steps = sorted(losses)
        values = [losses[s] for s in steps]
        (line,) = top.plot(steps, values, linewidth=0.6, alpha=0.35)
        top.plot(steps, moving_average(values), color=line.get_color(), linewidth=1.8, label=label)
        if bottom is not None and label != first:
            common = [s for s in steps if s in curves[first]]
            diff = [losses[s] - curves[first][s] for s in common]
            bottom.plot(common, diff, color=line.get_color(), linewidth=1.0, label=label)
    if floor is not None:
        top.axhline(floor, color="gray", linestyle="--", linewidth=1.0, label=floor_label)
    top.set_ylabel(f"training loss (nats; bold: {MOVING_AVERAGE}-step mean)")
    top.set_title(title)
    top.grid(alpha=0.3)
    top.legend()
    if bottom is not None:
        bottom.axhline(0.0, color="gray", linewidth=0.8)
        bottom.set_ylabel(f"loss - {first}")
        bottom.grid(alpha=0.3)
    (bottom or top).set_xlabel("step")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
