"""Relative L2 error and bias of out/dq/dk/dv per impl at training shapes vs an fp32 XLA reference."""
import sys, time
import jax, jax.numpy as jnp, numpy as np
from attn_masks import make_mask
import jax_attn

S = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
impls = ["xla", "cudnn", "pallas", "mosaic", "triton"]
masks = {"causal": make_mask("causal", S), "doc1": make_mask("causal_document", S, seqlens=[S]),
         "doc3": make_mask("causal_document", S, seqlens=[S // 2, S // 4, S // 4])}
key = jax.random.key(0)
kq, kk, kv, kd = jax.random.split(key, 4)
B, HQ, HK, D = 1, 16, 4, 128
for qscale in (1.0, 4.0):
    q = (qscale * jax.random.normal(kq, (B, S, HQ, D))).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (B, S, HK, D)).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (B, S, HK, D)).astype(jnp.bfloat16)
    do = jax.random.normal(kd, (B, S, HQ, D)).astype(jnp.bfloat16)
    for mname, mask in masks.items():
        def run(impl, dtype):
            f = lambda q, k, v: jax_attn.attention(q, k, v, mask, impl=impl)
            a = [x.astype(dtype) for x in (q, k, v)]
            out, vjp = jax.vjp(f, *a)
            g = vjp(do.astype(dtype))
            return [np.asarray(t, np.float32) for t in (out, *g)]
        with jax.default_matmul_precision("highest"):
            ref = run("xla", jnp.float32)
        for impl in impls:
            try:
                got = run(impl, jnp.bfloat16)
            except Exception as e:
                print(f"q*{qscale} {mname:7s} {impl:7s} error {type(e).__name__}: {str(e)[:100]}"); continue
            cols = []
            for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
                diff = g - r
                rel = np.linalg.norm(diff) / np.linalg.norm(r)
                bias = float((diff * r).sum() / (r * r).sum())
                cols.append(f"{name} rel {rel:.2e} bias {bias:+.1e}")
            print(f"q*{qscale} {mname:7s} {impl:7s} " + "  ".join(cols), flush=True)
