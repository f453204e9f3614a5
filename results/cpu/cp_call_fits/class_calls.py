import sys, numpy as np
from experiments import cp_call_fits as f
from experiments.reports.report_parts import read_results
recs = read_results(sys.argv[1]); f.add_spans(recs, rebuild=True)
calls = [c for c in f.timed_calls(recs) if set(f.ALL_FEATURES) <= c.keys()]
g = f._group(calls, "class")
for cls in sys.argv[2].split(","):
    ms = [m for k, m in g.items() if k.startswith(cls)][0]
    seen=set()
    for c in sorted(ms, key=lambda c: c["median"]):
        key=(c["full"],c["partial"],c["median"])
        if key in seen: continue
        seen.add(key)
        print(c["call"], c["q"], c["k"], c["full"], c["partial"], c["rows"], c["row_max"], c["cols"], c["col_max"], c["row_span"], c["col_span"], c["median"], round(c["median"]/max(c["row_span"]+c["col_span"],1)*1e3,3))
