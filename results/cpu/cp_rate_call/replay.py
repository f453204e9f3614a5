"""Which call should set a long class's rate across shapes? A replay over recorded timed calls.

For every class (same step function and shapes) with at least 4 timed calls and a median of
20 ms or more (then 100 ms or more: the classes the predictor takes across shapes), its kind's
model is fitted on the kind's other classes' calls of at least call_model.KIND_FIT_MIN_MS (as
the predictor's model across shapes is), one call of the class sets its rate (measured over
modelled time) and the class's other calls are predicted at that rate. The rate call is the
class's median call by the kind's model (the predictor until 2026-12-05), its cheapest call
that the model puts at LONG_CALL_MS or more, or its cheapest call that the model puts at
LONG_CALL_MS and at RATE_CALL_SHARE of its median call or more (the predictor since). Prints
the relative errors and the rate calls' seconds.

    PYTHONPATH=. python results/cpu/cp_rate_call/replay.py     # from the repository root
"""

import collections
import gzip
import json

import numpy as np

from experiments.runners import call_model
from experiments.runners.cp_ranks import LONG_CALL_MS

RUNS = {
    "H200, run 16 (8K half)": ["results/h200/cp_predict/run-16/records-1-610.jsonl.gz"],
    "H100, runs 17 and 18 (32K at 8, 16 and 64 GPUs)": [
        "results/h100/cp_predict/run-17-x16-32k.jsonl.gz",
        "results/h100/cp_predict/run-18-default.jsonl.gz",
        "results/h100/cp_predict/run-18-share1.jsonl.gz",
        "results/h100/cp_predict/run-18-x64.jsonl.gz",
    ],
}


def timed_calls(paths: list[str]) -> dict[str, dict]:
    """Every distinct timed call with its spans (by id), of the whole heads it was timed at."""
    calls = {}
    for path in paths:
        for line in gzip.open(path, "rt"):
            for mask in json.loads(line).get("masks") or []:
                for c in (mask.get("simulation") or {}).get("timed_calls") or []:
                    if "row_span" in c and "heads_divisor" not in c:
                        calls[c["id"]] = c
    return calls


def features(c: dict) -> np.ndarray:
    return np.array([1.0, c["row_span"], c["col_span"]])


def replay(calls: dict[str, dict], min_class_ms: float) -> None:
    kinds = collections.defaultdict(lambda: collections.defaultdict(list))
    for c in calls.values():
        kinds[c["kind"]][c["class"]].append(c)
    errors = {"median": [], "cheapest long": [], "cheapest long, share": []}
    seconds = dict.fromkeys(errors, 0.0)
    classes = 0
    for by_class in kinds.values():
        for cls, members in by_class.items():
            measured = np.array([c["median"] for c in members])
            if len(members) < 4 or np.median(measured) < min_class_ms:
                continue
            others = [
                c
                for other, cs in by_class.items()
                if other != cls
                for c in cs
                if c["median"] >= call_model.KIND_FIT_MIN_MS
            ]
            if len(others) < call_model.MIN_CALIBRATION:
                continue
            coef = call_model.fit(
                np.array([features(c) for c in others]), np.array([c["median"] for c in others])
            )
            guess = np.array([features(c) @ coef for c in members])
            if (guess <= 0).any():
                continue
            classes += 1
            order = np.argsort(guess, kind="stable")
            median = int(order[len(order) // 2])
            share = call_model.RATE_CALL_SHARE * guess[median]
            long = [int(i) for i in order if guess[i] >= LONG_CALL_MS] or [median]
            past = [int(i) for i in order if guess[i] >= max(LONG_CALL_MS, share)] or [median]
            picks = {"median": median, "cheapest long": long[0], "cheapest long, share": past[0]}
            for name, pick in picks.items():
                rate = measured[pick] / guess[pick]
                rest = np.arange(len(members)) != pick
                errors[name] += list(
                    100 * np.abs(rate * guess[rest] - measured[rest]) / measured[rest]
                )
                seconds[name] += measured[pick] / 1000
    if not classes:
        print("  no class")
        return
    for name, e in errors.items():
        print(
            f"  rate from the {name:20s} call: {classes} classes, {len(e)} calls predicted, "
            f"median {np.median(e):.2f}%, p90 {np.percentile(e, 90):.2f}%, "
            f"rate calls {seconds[name]:.1f} s"
        )


if __name__ == "__main__":
    for label, paths in RUNS.items():
        calls = timed_calls(paths)
        for min_class_ms in (20.0, 100.0):
            print(
                f"{label}: classes of {min_class_ms:.0f} ms or more at the median "
                f"({len(calls)} distinct timed calls)"
            )
            replay(calls, min_class_ms)
