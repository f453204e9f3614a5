"""Turns per-call times of each mask into a point's metrics (TFLOP/s from the exact mask area).

Per mask: FLOPs = attention_flops(mask, Hq, D, mode, batch); per-device TFLOP/s = FLOPs / N /
time (N = 1 without CP; under CP the time is the slowest rank's). Over the masks of a point the
rates are averaged (the reference's mean of rates, docs/results.md); `tflops_total` is the ratio of
summed FLOPs to summed median times. Measured CP points (JAX and PyTorch) also carry
`dispatch_ms`, the time of putting q, k and v into the executor's layout, which their `time_ms`
leaves out.
"""

from __future__ import annotations

import numpy as np

from experiments.core.points import Point
from experiments.runners import timing

QUANTILES = ("median", "p20", "p80")


def mask_result(
    point: Point,
    mask,
    index: int,
    times_ms: list[float],
    peak_gib: float | None,
    mem_source: str | None,
    check: dict,
    extra: dict | None = None,
    dispatch_times_ms: list[float] | None = None,
) -> dict:
    """Metrics of one mask of a point; a measured CP point passes the per-call times of its
    data-side dispatch too, recorded apart from the attention's as `dispatch_ms`."""
    t = timing.time_stats(times_ms)
    if dispatch_times_ms is not None:
        extra = {**(extra or {}), "dispatch_ms": timing.time_stats(dispatch_times_ms)}
    return mask_metrics(point, mask, index, t, peak_gib, mem_source, check, extra)


def mask_metrics(
    point: Point,
    mask,
    index: int,
    t: dict[str, float],
    peak_gib: float | None,
    mem_source: str | None,
    check: dict,
    extra: dict | None = None,
) -> dict:
    """Metrics of one mask from its time statistics (timing.time_stats keys)."""
    from attn_masks import attention_flops

    flops = attention_flops(mask, point.heads_q, point.head_dim, point.mode, point.batch)
    return {
        "index": index,
        "seed": point.seed,
        "area": mask.area(),
        "density": mask.density(),
        "flops": flops,
        "time_ms": t,
        "tflops": timing.tflops_stats(flops / point.num_devices, t),
        "peak_mem_gib": peak_gib,
        "mem_source": mem_source,
        "check": check,
        **(extra or {}),
    }


def summarize_checks(checks: list[dict]) -> dict:
    """Worst relative error per tensor over the masks of a point, with the check kind."""
    errors: dict[str, float] = {}
    for c in checks:
        for n, e in c["errors"].items():
            errors[n] = max(errors.get(n, 0.0), e)
    first = checks[0]
    unchecked = sorted({n for c in checks for n in c["unchecked"]})
    return {
        "ok": all(c["ok"] for c in checks),
        "kind": first["kind"],
        "rows": first["rows"],
        "rtol": first["rtol"],
        "max_errors": errors,
        "unchecked": unchecked,
    }


def aggregate(point: Point, per_mask: list[dict]) -> dict:
    """{'metrics', 'check', 'masks'} of a point from its per-mask results."""
    mean = lambda key, q: float(np.mean([m[key][q] for m in per_mask]))  # noqa: E731
    peaks = [m["peak_mem_gib"] for m in per_mask if m["peak_mem_gib"] is not None]
    total_s = sum(m["time_ms"]["median"] for m in per_mask) * 1e-3
    total_flops = sum(m["flops"] for m in per_mask)
    metrics = {
        "time_ms": {q: mean("time_ms", q) for q in QUANTILES},
        "tflops": {q: mean("tflops", q) for q in QUANTILES},
        "tflops_total": total_flops / point.num_devices / total_s / 1e12,
        "flops": total_flops / len(per_mask),
        "density": float(np.mean([m["density"] for m in per_mask])),
        "peak_mem_gib": max(peaks) if peaks else None,
        "mem_source": per_mask[0]["mem_source"],
    }
    if "dispatch_ms" in per_mask[0]:  # measured CP: the data-side dispatch, timed apart
        metrics["dispatch_ms"] = {q: mean("dispatch_ms", q) for q in QUANTILES}
    checks = [m.pop("check") for m in per_mask]
    return {"metrics": metrics, "check": summarize_checks(checks), "masks": per_mask}
