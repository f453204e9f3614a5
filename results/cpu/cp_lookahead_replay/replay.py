"""What compiling the next problem beside this problem's checks could hide, replayed on a GPU
run's records: per problem (mask, length, GPUs), its compile seconds against the previous
problem's check seconds (emulate + reference, all of its points), which now run at that
problem's first point while the next one compiles; a process's first problem (a run resumed
in a new process: the records' provenance.pid changes) has no checks before it. An upper
bound: the lowering part of the compile seconds stays on the main thread, and the checks slow
where they share the host.

    python results/cpu/cp_lookahead_replay/replay.py results/h100/cp_predict/run-30/preset.jsonl.gz
"""

import collections
import gzip
import json
import sys


def main(path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        records = [json.loads(line) for line in f]
    problems: dict[tuple, collections.Counter] = {}
    first_of_process: set[tuple] = set()
    pid = None
    for rec in records:
        p = rec["point"]
        key = (p["num_devices"], p["seqlen_per_device"], p["mask"])
        if rec["provenance"]["pid"] != pid:
            pid = rec["provenance"]["pid"]
            first_of_process.add(key)
        walls = problems.setdefault(key, collections.Counter())
        for m in rec.get("masks") or []:
            walls.update((m.get("simulation") or {}).get("wall_s") or {})
    groups: dict[tuple, collections.Counter] = {}
    previous = 0.0
    for key, walls in problems.items():
        checks = walls["emulate"] + walls["reference"]
        hidden = 0.0 if key in first_of_process else min(walls["compile"], previous)
        g = groups.setdefault(key[:2], collections.Counter())
        g.update(compile=walls["compile"], hidden=hidden, total=sum(walls.values()))
        previous = checks
    print("| GPUs x tokens a GPU | point seconds | compile | of it beside the previous checks |")
    print("|---|---|---|---|")
    for (n, tokens), g in groups.items():
        print(f"| {n} x {tokens // 1024}K | {g['total']:.1f} | {g['compile']:.1f} | {g['hidden']:.1f} |")
    total = sum(g["total"] for g in groups.values())
    compile_s = sum(g["compile"] for g in groups.values())
    hidden = sum(g["hidden"] for g in groups.values())
    print(f"\nall: {total:.1f} s of point time, compile {compile_s:.1f} s, at most {hidden:.1f} s "
          f"of it beside the previous problem's checks: {total - hidden:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1])
