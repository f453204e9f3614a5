"""Tables of run 16 from its logs (every point's line: strategy, layout, devices, mask, mode,
predicted per-GPU TFLOP/s, and where its seconds went) and, for efficiency, the single-GPU
baselines in its records.

    python results/h200/cp_predict/run-16/log_table.py
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARTS = ("baseline", "plan", "compile", "emulate", "reference", "calls")
LINE = re.compile(
    r"\] jax/default (?P<cp>\w+)/(?P<layout>\w+) x(?P<n>\d+) simulated (?P<mask>\w+) "
    r"S=(?P<total>\d+) \((?P<per>\d+)/device\) h64:8 bf16 (?P<mode>fwd_bwd|fwd): ok predicted "
    r"(?P<tflops>[\d.]+) TFLOP/s \([\d.e+]+ ms\) \[(?P<parts>[^\]]*)\]"
)
FULL = 15  # strategy x layout points of a cell
NAMES = {
    "allgather": "all-gather",
    "ulysses": "Ulysses",
    "usp": "USP",
    "double_ring": "double ring",
}


def points() -> list[dict]:
    """Every ok point of the three processes' logs, in run order."""
    found = []
    for name in ("run-a.log", "run-b.log", "run-c.log"):
        for line in (HERE / name).read_text().splitlines():
            m = LINE.search(line)
            if m:
                p = m.groupdict()
                secs = dict(re.findall(r"(\w+) ([\d.]+) s", p.pop("parts")))
                p.update({k: float(secs[k]) for k in PARTS})
                p.update(n=int(p["n"]), per=int(p["per"]), total=int(p["total"]))
                p["tflops"] = float(p["tflops"])
                found.append(p)
    return found


def baselines() -> dict[tuple, tuple[int, float]]:
    """(mask, mode, tokens) -> (tokens it ran at, whole-mask TFLOP/s on one GPU) of the records."""
    out = {}
    with gzip.open(HERE / "records-1-610.jsonl.gz", "rt") as f:
        for line in f:
            rec = json.loads(line)
            p, (m,) = rec["point"], rec["masks"]
            single = m["simulation"]["single_device"]
            out[p["mask"], p["mode"], p["seqlen_total"]] = (single["seqlen"], single["tflops"])
    return out


def main() -> None:
    pts = points()
    groups = collections.defaultdict(collections.Counter)
    for p in pts:
        g = groups[p["n"], p["per"]]
        g["points"] += 1
        g.update({k: p[k] for k in PARTS})
    print("| GPUs x tokens a GPU | points | parts (s) | " + " | ".join(PARTS) + " |")
    print("|---" * (3 + len(PARTS)) + "|")
    for (n, per), g in sorted(groups.items(), key=lambda x: (x[0][1], x[0][0])):
        parts = " | ".join(f"{g[k]:.0f}" for k in PARTS)
        spent = sum(g[k] for k in PARTS)
        print(f"| {n} x {per // 1024}K | {g['points']} | {spent:.0f} | {parts} |")
    total = collections.Counter()
    for g in groups.values():
        total.update(g)
    print(f"all: {total['points']} points, {sum(total[k] for k in PARTS):.0f} s of parts")

    rates = baselines()
    cap_rate = {(m, mode): r for (m, mode, s), r in rates.items() if r[0] == 128 * 1024}
    best: dict[tuple, dict] = {}
    tried = collections.Counter()  # strategies and layouts reached per cell
    for p in pts:
        key = (p["mask"], p["mode"], p["n"], p["per"])
        tried[key] += 1
        if key not in best or p["tflops"] > best[key]["tflops"]:
            best[key] = p
    cols = sorted({(n, per) for _, _, n, per in best}, key=lambda x: (x[1], x[0]))
    print("\n| mask, mode | " + " | ".join(f"{n} x {per // 1024}K" for n, per in cols) + " |")
    print("|---" * (1 + len(cols)) + "|")
    for mode in ("fwd", "fwd_bwd"):
        for mask in ("causal", "full", "causal_document", "full_document", "share_question"):
            cells = []
            for n, per in cols:
                p = best.get((mask, mode, n, per))
                if p is None:
                    cells.append("not reached")
                    continue
                own = rates.get((mask, mode, p["total"]))
                _, rate = own if own is not None else cap_rate[mask, mode]
                name = NAMES.get(p["cp"], p["cp"])
                plain = p["cp"] == "ulysses" or p["layout"] == "contiguous"  # Ulysses: no ring
                layout = "" if plain else f" {p['layout']}"
                cell = f"{name}{layout} {p['tflops']:.0f} ({100 * p['tflops'] / rate:.0f}%)"
                reached = tried[mask, mode, n, per]
                cells.append(cell if reached == FULL else f"{cell}, best of {reached} of {FULL}")
            label = "forward" if mode == "fwd" else "fwd+bwd"
            print(f"| {mask}, {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
