"""Where the two front ends of the shared Triton kernels part: forward, delta, backward, PTX."""
import difflib, glob, json, os, re, sys, tarfile, time
OUT = os.environ["OUT"]
DUMP = "/tmp/jtdump"
os.environ["JAX_TRITON_DUMP_DIR"] = DUMP
os.makedirs(DUMP, exist_ok=True)
import numpy as np, jax, jax.numpy as jnp, torch, triton  # noqa
from attn_masks import make_mask
from jax_attn.adapters import triton as ja
from torch_attn import triton as ta
from triton_attn import launch, kernels

before = os.environ.get("TRITON_CACHE_DIR")
jt, _, why = ja.modules()
assert why is None, why
print("TRITON_CACHE_DIR before/after import:", repr(before), repr(os.environ.get("TRITON_CACHE_DIR")))
print("triton", triton.__version__, "jax", jax.__version__, "torch", torch.__version__)
KERN = {"fwd": kernels.attn_fwd_kernel, "dkdv": kernels.attn_bwd_dkdv_kernel, "dq": kernels.attn_bwd_dq_kernel}
summary = {}
tar = tarfile.open(f"{OUT}/frontends.tar.gz", "w:gz")

def add_text(name, text):
    import io
    data = text.encode()
    info = tarfile.TarInfo(name); info.size = len(data)
    tar.addfile(info, io.BytesIO(data))

def cmp(a, b):
    a = np.asarray(a, np.float32); b = np.asarray(b, np.float32)
    eq = (a == b) | (np.isnan(a) & np.isnan(b))
    return {"bitwise": bool(eq.all()), "ndiff": int((~eq).sum()), "n": int(a.size),
            "maxabs": float(np.nanmax(np.abs(a.astype(np.float64) - b))) if a.size else 0.0}

def strip(txt):
    return [l for l in txt.splitlines() if not re.match(r"\s*(\.loc|#loc|loc\(|\.file|//)", l) and "loc(" not in l]

def new_dirs(seen):
    now = set(glob.glob(DUMP + "/*"))
    fresh = sorted(now - seen)
    seen |= now
    return fresh

seen = set()
CASES = [("full", 2, 2, 64, "float16"), ("causal_document", 2, 2, 64, "float16"),
         ("full", 4, 2, 128, "float32"), ("full", 4, 2, 128, "bfloat16")]
for (mname, hq, hkv, d, dt) in CASES:
    key = f"{mname}_{dt}_D{d}"
    S = 700
    mask = make_mask(mname, S, seed=1, window=160)
    rng = np.random.default_rng(0)
    x = {n: rng.standard_normal(s).astype(np.float32) for n, s in
         [("q", (1, S, hq, d)), ("k", (1, S, hkv, d)), ("v", (1, S, hkv, d)), ("dout", (1, S, hq, d)), ("dlse", (1, hq, S))]}
    scale = 1.0 / np.sqrt(d)
    jdt = jnp.dtype(dt); tdt = getattr(torch, dt)
    J = {n: jnp.asarray(x[n]).astype(jdt) for n in ("q", "k", "v", "dout")}
    T = {n: torch.tensor(x[n], device="cuda").to(tdt) for n in ("q", "k", "v", "dout")}
    dlse_np = x["dlse"]
    configs = launch.default_configs(d, jdt.itemsize)
    jtab = ja._tables(mask, configs)
    ttab = ta._device_tables(mask, torch.device("cuda"), configs)
    res = {}
    # forward through both adapters
    out_j, lse_j = ja._forward(jtab, float(scale), J["q"], J["k"], J["v"], jtab.arrays)
    out_t, lse_t = ta.forward(T["q"], T["k"], T["v"], ttab, float(scale))
    res["fwd_out"] = cmp(jnp.asarray(out_j, jnp.float32), out_t.float().cpu())
    res["fwd_lse"] = cmp(lse_j, lse_t.cpu())
    # delta, each front end's expression, from identical (torch) out and dout
    out_same = jnp.asarray(out_t.float().cpu().numpy()).astype(jdt)
    dj = jnp.sum(out_same.astype(jnp.float32) * J["dout"].astype(jnp.float32), axis=-1)
    dj = jnp.swapaxes(dj, 1, 2) - jnp.asarray(dlse_np)
    dtorch = (out_t.float() * T["dout"].float()).sum(-1).transpose(1, 2) - torch.tensor(dlse_np, device="cuda")
    res["delta"] = cmp(dj, dtorch.cpu())
    # backward kernels from identical out/lse/delta (torch's), launched by each front end
    lse_same = jnp.asarray(lse_t.cpu().numpy())
    delta_np = dtorch.contiguous().cpu().numpy()
    ieee = dt == "float32"
    shape = launch.Shape(1, S, S, hq, hkv, d)
    cj = (J["q"], J["k"], J["v"], J["dout"], lse_same, jnp.asarray(delta_np), jtab.arrays["lo"], jtab.arrays["hi"])
    ct = (T["q"], T["k"], T["v"], T["dout"], lse_t, torch.tensor(delta_np, device="cuda"), ttab["lo"], ttab["hi"])
    kv = jax.ShapeDtypeStruct(J["k"].shape, jdt)
    call = launch.dkdv_call(shape, jtab.host, float(scale), ieee)
    dk_j, dv_j = ja._call(kernels.attn_bwd_dkdv_kernel, call, (*cj, *jtab.arrays["dkdv"]), (kv, kv))
    dk_t, dv_t = torch.empty_like(T["k"]), torch.empty_like(T["v"])
    ck_dkdv = kernels.attn_bwd_dkdv_kernel[call.grid](*ct, *ttab["dkdv"], *call.scalars, dk_t, dv_t,
                                                      num_warps=call.num_warps, num_stages=call.num_stages, **call.meta)
    call = launch.dq_call(shape, jtab.host, float(scale), ieee)
    (dq_j,) = ja._call(kernels.attn_bwd_dq_kernel, call, (*cj, *jtab.arrays["dq"]), (jax.ShapeDtypeStruct(J["q"].shape, jdt),))
    dq_t = torch.empty_like(T["q"])
    ck_dq = kernels.attn_bwd_dq_kernel[call.grid](*ct, *ttab["dq"], *call.scalars, dq_t,
                                                  num_warps=call.num_warps, num_stages=call.num_stages, **call.meta)
    for n, a, b in (("dk", dk_j, dk_t), ("dv", dv_j, dv_t), ("dq", dq_j, dq_t)):
        res["bwd_same_delta_" + n] = cmp(jnp.asarray(a, jnp.float32), b.float().cpu())
    # forward launched directly by torch (to get its compiled kernel), then fp fusion off in both
    call = launch.fwd_call(shape, jtab.host, float(scale), ieee)
    fo, fl = torch.empty_like(T["q"]), torch.empty((1, hq, S), device="cuda")
    tfa = (T["q"], T["k"], T["v"], ttab["lo"], ttab["hi"], *ttab["fwd"])
    ck_fwd = kernels.attn_fwd_kernel[call.grid](*tfa, *call.scalars, fo, fl,
                                                num_warps=call.num_warps, num_stages=call.num_stages, **call.meta)
    jdirs = new_dirs(seen)
    fo2, fl2 = torch.empty_like(T["q"]), torch.empty((1, hq, S), device="cuda")
    kernels.attn_fwd_kernel[call.grid](*tfa, *call.scalars, fo2, fl2, num_warps=call.num_warps,
                                       num_stages=call.num_stages, enable_fp_fusion=False, **call.meta)
    scal = tuple(np.float32(v) if isinstance(v, float) else v for v in call.scalars)
    oj2, lj2 = jt.triton_call(J["q"], J["k"], J["v"], jtab.arrays["lo"], jtab.arrays["hi"], *jtab.arrays["fwd"], *scal,
                              kernel=kernels.attn_fwd_kernel, out_shape=(jax.ShapeDtypeStruct(J["q"].shape, jdt), jax.ShapeDtypeStruct((1, hq, S), jnp.float32)),
                              grid=call.grid, num_warps=call.num_warps, num_stages=call.num_stages, enable_fp_fusion=False, **call.meta)
    new_dirs(seen)
    res["fwd_nofusion_out"] = cmp(jnp.asarray(oj2, jnp.float32), fo2.float().cpu())
    res["fwd_nofusion_lse"] = cmp(lj2, fl2.cpu())
    res["fwd_fusion_vs_nofusion_torch"] = cmp(fo.float().cpu(), fo2.float().cpu())
    # compiled artefacts: torch's asm vs jax-triton's dump
    for name, ck in (("fwd", ck_fwd), ("dkdv", ck_dkdv), ("dq", ck_dq)):
        for kind in ("ttir", "ptx"):
            add_text(f"{key}/torch_{name}.{kind}", ck.asm[kind])
        md = {k: getattr(ck.metadata, k) for k in ("num_warps", "num_stages", "enable_fp_fusion", "ptx_version", "arch", "shared") if hasattr(ck.metadata, k)}
        res[f"torch_meta_{name}"] = {k: str(v) for k, v in md.items()}
        jfiles = [f for dd in jdirs for f in glob.glob(dd + "/*") if os.path.basename(f).startswith(KERN[name].fn.__name__ if hasattr(KERN[name], 'fn') else KERN[name].__name__)]
        for f in glob.glob("/dev/null"):
            pass
        for dd in jdirs:
            for f in glob.glob(dd + "/*"):
                add_text(f"{key}/jax/{os.path.basename(dd)}/{os.path.basename(f)}", open(f).read())
        for kind in ("ttir", "ptx"):
            jf = [f for f in jfiles if f.endswith("." + kind)]
            if not jf:
                res[f"{kind}_{name}"] = "no jax dump"
                continue
            a, b = strip(open(jf[0]).read()), strip(ck.asm[kind])
            diff = list(difflib.unified_diff(a, b, "jax", "torch", n=0, lineterm=""))
            res[f"{kind}_{name}"] = "same" if not diff else f"{len(diff)} diff lines"
            if diff:
                add_text(f"{key}/{name}.{kind}.diff", "\n".join(diff))
                print(f"--- {key} {name} {kind} diff (first 30 lines)")
                print("\n".join(diff[:30]))
    summary[key] = res
    print(key, json.dumps(res, indent=None)[:3000], flush=True)
tar.close()
json.dump(summary, open(f"{OUT}/frontends.json", "w"), indent=1)
# ptxas versions: triton's own vs what else is on the machine
for tool in ("ptxas_blackwell", "ptxas"):
    try:
        print(tool, getattr(triton.knobs.nvidia, tool).path)
    except Exception as e:
        print(tool, "n/a", e)
