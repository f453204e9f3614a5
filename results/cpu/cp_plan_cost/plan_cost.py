"""Host cost of the predictor's plan phase (_prepare) for GPU-preset points at N devices."""
import sys, time, collections, cProfile, pstats
from experiments.cp_families import preset_points, GPU_IMPL
from experiments.runners.cp_simulate import CPSimulator
from experiments.runners.cp_ranks_jax import JaxRanks
from experiments.runners.jax_runner import JaxRunner
from experiments.core.outcomes import PointFailure

n, seqlen, masks = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
points = [p for p in preset_points([n], [seqlen], masks)]
sim = CPSimulator(JaxRunner(), JaxRanks, compile_threads=0)
t = collections.Counter(); cnt = collections.Counter()
prof = cProfile.Profile() if len(sys.argv) > 4 else None
t0 = time.perf_counter()
for p in points:
    s = time.perf_counter()
    try:
        masks_ = sim._problem_masks(p)
    except PointFailure:
        t["mask undefined"] += 0; cnt["mask undefined"] += 1; continue
    m = time.perf_counter()
    if prof: prof.enable()
    try:
        for i in range(len(masks_)):
            sim._prepare(sim._problem, p, i, GPU_IMPL)
        status = "ok"
    except PointFailure as e:
        status = "unsupported"
    if prof: prof.disable()
    e = time.perf_counter()
    t["masks"] += m - s; t[(p.cp, status)] += e - m; cnt[(p.cp, status)] += 1
print(f"{len(points)} points at {n} devices x {seqlen}: {time.perf_counter()-t0:.1f} s")
for k, v in t.items(): print(k, round(v, 2), cnt.get(k, ""))
if prof: pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
