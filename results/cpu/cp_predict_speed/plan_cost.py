import sys, time
import jax.numpy as jnp
from attn_masks import make_mask
from shard_strategies import jax_cp
per, n, name, strat, layout = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
t=time.time(); m = make_mask(name, per*n, seed=42); t1=time.time()
plan = jax_cp.executor_plan(m, n, strat, layout, None, impl="pallas", num_heads_q=64, num_heads_kv=8, head_dim=128, dtype=jnp.bfloat16)
t2=time.time()
arr = jax_cp.ring_mask_arrays(plan, "pallas", 128, jnp.bfloat16)
t3=time.time()
import numpy as np, jax
nbytes=sum(np.asarray(x).nbytes for x in jax.tree.leaves(arr))
print(f"{name} {per}x{n} {strat}/{layout}: mask {t1-t:.1f}s plan {t2-t1:.1f}s arrays {t3-t2:.1f}s ({nbytes/2**30:.2f} GiB)")
