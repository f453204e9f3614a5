"""Replays, on the host, three choices of the CP predictor's sampling on a GPU run's records.

    PYTHONPATH=. python results/cpu/cp_validation_share/replay.py RECORDS.jsonl.gz [...]

1. --sim_validation_share's rule (CPSimulator._checked: a class drawn by its digest, and a
   kind's first modelled class until one of the kind was checked) on the records' modelled
   classes in their order: the classes and held-out calls kept, their error's 90th percentile.
2. The spans model calibrated on k calls of a class (call_model.calibration_picks), the rest of
   the class's recorded calls predicted: the error by k (--sim_timed_calls).
3. The single-device baselines' TFLOP/s at each recorded length, per mask and mode.
4. At 32K tokens a GPU: the timed calls' medians by role, and the rate calls' by strategy and
   heads (what --sim_rate_one_kv_head, since removed, would have shortened).
"""

from __future__ import annotations

import collections
import sys

import numpy as np

from experiments import cp_call_fits as fits
from experiments.reports.report_parts import read_results
from experiments.runners import call_model

MODELLED = ("calibration", "held_out", "rate", "rate_held_out")


def share_rule(records: list[dict], share: float) -> None:
    kind_of, order, measured_class = {}, [], {}
    pairs = set()
    for r in records:
        for m in r.get("masks") or []:
            sim = m["simulation"]
            for c in sim["timed_calls"]:
                kind_of[c["class"]] = c["kind"]
                if c["role"] in MODELLED and c["class"] not in order:
                    order.append(c["class"])
                if c["role"] in ("held_out", "rate_held_out"):
                    measured_class[c["median"]] = c["class"]
            model = sim["calls"].get("model")
            if model:
                pairs |= {tuple(p) for p in model["held_out_ms"]}
    classes = [(p, m, measured_class[m]) for p, m in pairs]

    def p90(kept: set) -> str:
        e = [abs(p - m) / m * 100 for p, m, c in classes if c in kept]
        return f"{len(kept)} classes, {len(e)} held-out calls, p90 {np.percentile(e, 90):.2f}%"

    drawn = {c for c in order if int(c, 16) < share * 16**12}
    kinds, rule = set(), set()
    for c in order:
        if c in drawn or kind_of[c] not in kinds:
            rule.add(c)
            kinds.add(kind_of[c])
    print(f"{len(order)} modelled classes of {len(set(kind_of[c] for c in order))} kinds")
    print(f"  every class:              {p90(set(order))}")
    print(f"  share {share} and kinds' first: {p90(rule)}")
    print(f"  share {share} alone:        {p90(drawn)}")


def calibration_counts(records: list[dict]) -> None:
    calls = [
        c
        for c in fits.timed_calls(records)
        if c.get("median", 1) > 0 and set(call_model.SPANS) <= c.keys()
    ]
    groups = [g for g in fits._group(calls, "class").values() if len(g) > 12]
    for k in (4, 5, 6, 8):
        pred, meas = [], []
        for members in groups:
            x, y = fits.design(members, call_model.SPANS), fits._medians(members)
            picks = call_model.calibration_picks(x, k)
            rest = np.setdiff1d(np.arange(len(members)), picks)
            pred += list(x[rest] @ call_model.fit(x[picks], y[picks]))
            meas += list(y[rest])
        e = fits._errors(np.array(pred), np.array(meas))
        print(f"  k={k}: {len(groups)} classes, {len(e)} calls, p90 {np.percentile(e, 90):.2f}%")


def baselines(records: list[dict]) -> None:
    rates = collections.defaultdict(dict)
    for r in records:
        for m in r.get("masks") or []:
            base = m["simulation"].get("single_device") or {}
            if base.get("status") == "ok":
                rates[r["point"]["mask"], r["point"]["mode"]][base["seqlen"]] = base["tflops"]
    for (mask, mode), by_len in sorted(rates.items()):
        print(f"  {mask} {mode}: " + ", ".join(f"{n}: {t:.1f}" for n, t in sorted(by_len.items())))


def rate_calls(records: list[dict]) -> None:
    roles, rates = collections.Counter(), collections.Counter()
    for r in records:
        if r["point"]["seqlen_per_device"] != 32768:
            continue
        for m in r.get("masks") or []:
            for c in m["simulation"]["timed_calls"]:
                roles[c["role"]] += c["median"] / 1e3
                if c["role"] == "rate":
                    rates[r["point"]["cp"], c["heads"], c["heads_kv"]] += c["median"] / 1e3
    print("  by role (s): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(roles.items())))
    print("  rate calls (s): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(rates.items())))


if __name__ == "__main__":
    records = read_results(sys.argv[1:])
    print("1. validation share (0.25)")
    share_rule(records, 0.25)
    print("2. calibration calls per class (spans model)")
    calibration_counts(records)
    print("3. single-device baselines, TFLOP/s by length")
    baselines(records)
    print("4. timed medians at 32K tokens a GPU")
    rate_calls(records)
