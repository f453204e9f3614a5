"""Time the shared Triton kernels' fwd+bwd from the JAX front end (and torch, --torch) under the env given."""
import os, sys, time
import numpy as np
S, HQ, HKV, D = 16384, 64, 8, 128
from attn_masks import make_mask
rng = np.random.default_rng(0)
x = [rng.standard_normal(s).astype(np.float32) for s in [(1, S, HQ, D), (1, S, HKV, D), (1, S, HKV, D), (1, S, HQ, D)]]
tag = os.environ.get("TAG", "?")
def timeit(run, n=10):
    run(); run()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))
for name in ["full", "causal"]:
    mask = make_mask(name, S, seed=42)
    if "--torch" in sys.argv:
        import torch, torch_attn
        q, k, v = (torch.tensor(a, device="cuda").to(torch.bfloat16).requires_grad_() for a in x[:3])
        do = torch.tensor(x[3], device="cuda").to(torch.bfloat16)
        def run():
            torch_attn.attention(q, k, v, mask, impl="triton").backward(do); torch.cuda.synchronize()
        print(f"RESULT torch {name} fwd_bwd {timeit(run):.2f} ms", flush=True)
        continue
    import jax, jax.numpy as jnp, jax_attn
    q, k, v, do = (jnp.asarray(a, jnp.bfloat16) for a in x)
    def loss(q, k, v):
        return jnp.sum(jax_attn.attention(q, k, v, mask, impl="triton").astype(jnp.float32) * do.astype(jnp.float32))
    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    g = f(q, k, v)
    print(f"RESULT jax[{tag}] {name} fwd_bwd {timeit(lambda: jax.block_until_ready(f(q, k, v))):.2f} ms", flush=True)
