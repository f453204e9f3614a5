"""Loss curves of several kernels on the same run: agreement with a baseline, and one overlay plot.

Two correct attention kernels differ only by rounding, so with the same seed and data their
training curves agree step by step. The tolerance is the correctness check's per-dtype relative
threshold (experiments/runners/checks.py, the bound a correct kernel's output stays within),
relative to the baseline, and it applies to each of the first MOVING_AVERAGE steps and to the
mean of the last MOVING_AVERAGE steps up to every step (the curve the plots draw bold).
Rounding differences grow chaotically in training: in bf16 at GPU scale, single steps of correct
kernels agree within 1% for the first 20 steps, then part by up to 10% by step 50 with signs that
alternate from batch to batch, while their 20-step means stay within 1.4% (docs/training.md). A
wrong gradient shows in the first steps (a dQ that mixes in a tenth of the neighbouring row's
departs by step 3 on the CPU).
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

    passed is False when a step's loss is not finite, one of the first MOVING_AVERAGE steps
    departs from the baseline's by more than tol relative, or the moving average up to a step
    departs from the baseline's; first_departure is that step (None when it passes).
    max_rel_diff is the largest checked departure, max_step_rel_diff that of any single step.
    """
    steps = sorted(set(losses) & set(baseline))
    if not steps:
        raise ValueError("no step in common with the baseline curve")
    got = np.array([losses[s] for s in steps])
    want = np.array([baseline[s] for s in steps])
    single = _relative(got, want)
    early = np.arange(len(steps)) < MOVING_AVERAGE
    rel = np.maximum(
        _relative(moving_average(got), moving_average(want)), np.where(early, single, 0.0)
    )
    bad = ~np.isfinite(got) | ~(rel <= tol)
    return {
        "kind": "loss_curve",
        "baseline": baseline_name,
        "steps": len(steps),
        "rtol": tol,
        "window": MOVING_AVERAGE,
        "max_rel_diff": _largest(rel),
        "max_step_rel_diff": _largest(single),
        "first_departure": int(np.asarray(steps)[bad][0]) if bad.any() else None,
        "passed": not bool(bad.any()),
    }


def _relative(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got - want) / np.maximum(np.abs(want), 1e-12)


def _largest(rel: np.ndarray) -> float:
    return float(np.nanmax(rel)) if np.isfinite(rel).any() else float("inf")


def moving_average(values: list[float], window: int = MOVING_AVERAGE) -> np.ndarray:
    """Trailing mean over up to `window` values (shorter at the start)."""
    x = np.asarray(values, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(x)])
    n = np.arange(1, len(x) + 1)
    lo = np.maximum(n - window, 0)
    return (c[n] - c[lo]) / (n - lo)


def learning(losses: list[float], window: int = MOVING_AVERAGE) -> dict:
    """Whether a run learns steadily: the means of its first and last `window` steps and their
    ratio, means over consecutive `window`-step blocks and whether each is below the one before,
    and the step that most exceeds the mean of the up to `window` steps before it (a spike; step
    0 has none before it)."""
    x = np.asarray(losses, dtype=np.float64)
    first, last = float(x[:window].mean()), float(x[-window:].mean())
    blocks = [float(x[i : i + window].mean()) for i in range(0, len(x) - window + 1, window)]
    before = moving_average(losses, window)[:-1]  # mean of the steps before each step from 1 on
    spikes = x[1:] / before if len(x) > 1 else np.array([])
    worst = int(np.argmax(spikes)) + 1 if spikes.size else None
    return {
        "window": window,
        "first_mean": first,
        "last_mean": last,
        "block_means": blocks,
        "blocks_falling": len(blocks) > 1 and all(b < a for a, b in zip(blocks, blocks[1:])),
        "last_over_first": last / first,
        "worst_spike_step": worst,
        "worst_spike_ratio": None if worst is None else float(spikes[worst - 1]),
    }


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
