"""A long class's rate from its kind's other classes, replayed on GPU runs' records.

For each class whose timed calls' median is at least LONG_CALL_MS (the classes the predictor
rates across shapes), its kind's model is fitted on the other classes' calls of at least
KIND_FIT_MIN_MS, and the class's calls are predicted at three rates: 1 (the kind's model
alone), the rate of one of its calls timed as the predictor picks its rate call (the cheapest
of at least RATE_CALL_SHARE of the median), and call_model.rate_trend of the other classes.
Prints each rate's relative error over the predicted calls.

    PYTHONPATH=. python results/cpu/cp_rate_trend/replay.py RECORDS.jsonl.gz ...
"""

import collections
import gzip
import json
import sys

import numpy as np

from experiments.cp_call_fits import _medians as medians
from experiments.cp_call_fits import design, timed_calls
from experiments.runners import call_model
from experiments.runners.cp_ranks import LONG_CALL_MS


def features(calls: list[dict]) -> np.ndarray:
    return design(calls, call_model.SPANS)


def main(paths: list[str]) -> None:
    records = [json.loads(line) for path in paths for line in gzip.open(path, "rt")]
    calls = [c for c in timed_calls(records) if "row_span" in c and c.get("median")]
    kinds = collections.defaultdict(list)
    for c in calls:
        if c["median"] >= call_model.KIND_FIT_MIN_MS and c["row_span"] + c["col_span"] > 0:
            kinds[c["kind"]].append(c)
    errors = collections.defaultdict(list)
    paired = collections.defaultdict(list)  # calls with both a rate call's and a trend's rate
    slow = []  # (call, q, k, heads, median ms, the kind's model alone: mean error %)
    classes = 0
    for long in kinds.values():
        by_class = collections.defaultdict(list)
        for c in long:
            by_class[c["class"]].append(c)
        for name, own in by_class.items():
            others = [c for c in long if c["class"] != name]
            if np.median(medians(own)) < LONG_CALL_MS or len(others) < call_model.MIN_CALIBRATION:
                continue
            coef = call_model.fit(features(others), medians(others))
            guess, measured = features(own) @ coef, medians(own)
            rest = collections.defaultdict(list)
            for c in others:
                rest[c["class"]].append(c)
            lengths = [float(np.median(features(m) @ coef)) for m in rest.values()]
            rates = [call_model.class_rate(features(m), medians(m), coef) for m in rest.values()]
            classes += 1
            errors["the kind's model alone"] += list(guess / measured - 1)
            first = own[0]
            slow.append(
                (first["call"], first["q"], first["k"], f"{first['heads']}:{first['heads_kv']}",
                 float(np.median(measured)), 100 * float(np.mean(guess / measured - 1)))
            )  # fmt: skip
            trend = None
            if len(rest) >= call_model.RATE_TREND_CLASSES:
                trend = call_model.rate_trend(np.array(lengths), np.array(rates), np.median(guess))
                errors["rate_trend of the other classes"] += list(trend * guess / measured - 1)
            if len(own) > 1:
                share = call_model.RATE_CALL_SHARE * np.median(guess)
                pick = min(np.flatnonzero(guess >= share), key=lambda i: guess[i])
                keep = np.arange(len(own)) != pick
                rate = measured[pick] / guess[pick]
                errors["one rate call"] += list(rate * guess[keep] / measured[keep] - 1)
                if trend is not None:
                    paired["one rate call"] += list(rate * guess[keep] / measured[keep] - 1)
                    paired["rate_trend"] += list(trend * guess[keep] / measured[keep] - 1)
    print(f"{len(calls)} timed calls, {classes} classes of at least {LONG_CALL_MS:.0f} ms")
    print("classes of at least 1 s: the kind's model alone over the measured time, mean")
    for call, q, k, heads, ms, error in sorted(slow):
        if ms >= 1000:
            print(f"  {call:10s} q={q:<8d} k={k:<8d} heads {heads:5s} {ms:8.0f} ms {error:+.1f}%")
    print("relative error of the predicted medians")
    for label, e in errors.items():
        e = 100 * np.abs(np.array(e))
        print(
            f"{label:32s} {len(e):4d} calls: median {np.median(e):.2f}%, "
            f"p90 {np.percentile(e, 90):.2f}%, max {e.max():.1f}%"
        )
    print("the same calls, where a class has both a rate call and a trend")
    for label, e in paired.items():
        e = 100 * np.abs(np.array(e))
        p90 = np.percentile(e, 90)
        print(f"{label:32s} {len(e):4d} calls: median {np.median(e):.2f}%, p90 {p90:.2f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
