import sys, numpy as np
from experiments import cp_call_fits as f
from experiments.reports.report_parts import read_results
recs = read_results(sys.argv[1]); f.add_spans(recs, rebuild=True)
calls = [c for c in f.timed_calls(recs) if set(f.ALL_FEATURES) <= c.keys()]
for c in calls:
    c["span_sum"] = c["row_span"] + c["col_span"]
    c["area_rows"] = c["rows"] * c["row_max"]
sets = {"spans": ("row_span","col_span"), "sum": ("span_sum",), "spans+partial": ("row_span","col_span","partial"),
        "spans+full": ("row_span","col_span","full"), "spans+rows": ("row_span","col_span","rows"),
        "spans+row_max": ("row_span","col_span","row_max"), "spans+area_rows": ("row_span","col_span","area_rows")}
f.MIN_CLASS = 8
for k, names in sets.items():
    print(f"{k:16s}", f._cell(f.within_class_errors(calls, names)), f._cell(f.calibrated_errors(calls, names)))
