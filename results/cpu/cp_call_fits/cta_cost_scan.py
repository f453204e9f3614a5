import sys, time, numpy as np
from experiments import cp_call_fits as f
from experiments.runners import call_model
from experiments.reports.report_parts import read_results
base_tile_work = call_model.tile_work
run = sys.argv[1]
for c0 in map(float, sys.argv[2].split(",")):
    for w in map(float, sys.argv[3].split(",")):
        call_model.tile_work = lambda full, partial, weight=2.0, c0=c0: base_tile_work(full, partial, weight) + c0
        recs = read_results(run)
        t=time.time(); f.add_spans(recs, rebuild=True, partial_weight=w)
        calls = [c for c in f.timed_calls(recs) if set(f.ALL_FEATURES) <= c.keys()]
        names = f.FEATURE_SETS["spans"]
        print(f"c0={c0} w={w}", f._cell(f.within_class_errors(calls, names)), f._cell(f.calibrated_errors(calls, names)), {k: f._cell(v) for k,v in f.across_shape_errors(calls, names).items()}, f"{time.time()-t:.0f}s", flush=True)
