"""Host against device float64 row reference of a single-device check at 128K tokens: the time
of each (the host one with its fetch of rows and keys) and their largest relative difference."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from attn_masks import make_mask
from experiments.runners import checks, jax_runner

print(jax.__version__, jax.devices())
for s, hq, hkv, mname in ((131072, 32, 8, "causal"), (131072, 32, 8, "causal_document")):
    mask = make_mask(mname, s, seed=1)
    key = jax.random.key(0)
    args = {
        n: jax.random.normal(
            jax.random.fold_in(key, i), (1, s, hq if n in ("q", "dout") else hkv, 128), jnp.bfloat16
        )
        for i, n in enumerate(("q", "k", "v", "dout"))
    }
    plan = checks.plan_check(mask, 1, hq, 42)
    scale = 1 / np.sqrt(128)
    for rep in range(2):
        t = time.perf_counter()
        inp = checks.Inputs(
            **{
                n: jax_runner.fetch_rows(x, plan.cols if n in ("k", "v") else plan.rows)
                for n, x in args.items()
            }
        )
        t1 = time.perf_counter()
        want = checks.rows_reference(inp, mask, plan, scale, True)
        t2 = time.perf_counter()
        got = jax_runner.row_reference(args, mask)(plan, scale, True)
        t3 = time.perf_counter()
        err = max(float(np.abs(got[n] - want[n]).max() / np.abs(want[n]).max()) for n in want)
        print(
            f"{mname} rep {rep}: rows {plan.rows.size} keys {plan.cols.size} heads {plan.heads.size}: "
            f"host fetch {t1 - t:.3f}s host ref {t2 - t1:.3f}s | device ref {t3 - t2:.3f}s | max rel diff {err:.2e}"
        )
