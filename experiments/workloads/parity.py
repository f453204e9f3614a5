"""Parity bundles: one JAX attention call saved to disk, re-run and checked by PyTorch.

    python experiments/run.py --framework=jax --parity_bundle=/tmp/pb     # save (parity_jax.py)
    python experiments/run.py --framework=torch --parity_bundle=/tmp/pb   # verify here
    python experiments/run.py --framework=both --parity_bundle=/tmp/pb    # both, a worker each

Each side also appends a record in the driver's format (key, status, point, errors) to
<out_dir>/results.jsonl (default results/local/parity).

Orbax needs jax to read its checkpoints, so the bundle also carries `bundle.npz` (every tensor
as float32, exact for bf16/fp16 values, plus the mask's slices) and `meta.json`; the torch side
reads only those and never imports jax. `parity_jax.load_bundle` reads the Orbax copy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from attn_masks import Mask, from_slices
from experiments.core.outcomes import OK, WRONG
from experiments.core.points import SHORT_DTYPES
from experiments.core.results import ResultsStore

from .bundle import BUNDLE_NPZ, MASK_KEYS, META_JSON

OUT_DIR = "results/local/parity"


def read_bundle(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict, Mask]:
    """(float32 tensors, meta, mask) of a bundle, from its .npz and meta.json (no jax)."""
    path = Path(path)
    meta = json.loads((path / META_JSON).read_text())
    with np.load(path / BUNDLE_NPZ) as npz:
        arrays = {n: npz[n] for n in npz.files}
    slices = [arrays.pop(n) for n in MASK_KEYS]
    mask = from_slices(*slices, meta["seqlen_q"], meta["seqlen_k"], name=meta["mask"])
    return arrays, meta, mask


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| in float64 over finite entries; inf if they disagree on which
    entries are finite (LSE is -inf on rows that see no key)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)) or (got[~finite] != want[~finite]).any():
        return float("inf")
    denom = max(float(np.linalg.norm(want[finite])), 1e-30)
    return float(np.linalg.norm(got[finite] - want[finite])) / denom


def verify_with_torch(
    bundle_path: str | os.PathLike,
    *,
    impl: str = "naive",
    rtol: float | None = None,
    device: str | None = None,
) -> dict:
    """Re-run the bundle's attention call with torch_attn on its exact inputs and compare.

    Returns {"ok", "impl", "jax_impl", "jax_cp", "dtype", "device", "rtol", "errors" (relative
    Frobenius error of out, lse, dq, dk, dv), "bundle"}; gradients get twice the output's rtol.
    """
    import torch

    import torch_attn
    from experiments.runners.checks import GRAD_FACTOR, tolerance

    arrays, meta, mask = read_bundle(bundle_path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, meta["dtype"])

    def tensor(name: str, grad: bool = False) -> torch.Tensor:
        t = torch.from_numpy(arrays[name]).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    q, k, v = (tensor(n, grad=True) for n in ("q", "k", "v"))
    out, lse = torch_attn.attention(q, k, v, mask, impl=impl, scale=meta["scale"], return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), tensor("dout"))
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    errors = {n: rel_error(t.detach().float().cpu().numpy(), arrays[n]) for n, t in got.items()}
    short = SHORT_DTYPES[meta["dtype"]]
    base = tolerance(short, on_gpu=device.startswith("cuda"), override=rtol)
    limits = {n: base * (GRAD_FACTOR if n.startswith("d") else 1.0) for n in errors}
    return {
        "ok": all(errors[n] <= limits[n] for n in errors),
        "impl": impl,
        "jax_impl": meta["impl"],
        "jax_cp": meta["cp"],
        "dtype": short,
        "device": device,
        "rtol": base,
        "errors": errors,
        "bundle": str(bundle_path),
    }


def _save_from_flags(flag_values: Any, path: str) -> dict:
    """--framework=jax: one attention call with the configured model's shapes and a packed
    document mask (or --mask), computed by --impl / --cp, saved as a bundle."""
    import jax
    import jax.numpy as jnp

    from attn_masks import make_mask

    from . import data
    from . import flags as wf
    from .parity_jax import random_inputs, save_bundle

    cfg = wf.train_config(flag_values, jax.default_backend() == "gpu")
    backend = cfg.backend()
    cfg = cfg.resolved(backend)
    name = wf.single(flag_values, "mask")
    if name in (None, data.MASK_NAME):
        mask = data.batch_at(cfg.data, 0).mask
    else:
        mask = make_mask(name, cfg.data.seqlen, seed=cfg.data.seed)
    m = cfg.model
    head_dim = wf.shared(flag_values, "head_dim", m.head_dim)
    shape_q = (cfg.data.batch, cfg.data.seqlen, m.heads_q, head_dim)
    inputs = random_inputs(shape_q, m.heads_kv, jnp.dtype(m.dtype), cfg.data.seed)
    return save_bundle(path, mask, inputs, backend)


def record(framework: str, impl: str, meta: dict, status: str, **fields: Any) -> dict:
    """The driver-format record of one side of a parity check of the bundle `meta` describes."""
    cp = meta["cp"] or "none"
    point = {"workload": "parity", "framework": framework, "impl": impl, "jax_impl": meta["impl"],
             "cp": cp, "mask": meta["mask"], "shape_q": meta["shapes"]["q"],
             "dtype": meta["dtype"]}  # fmt: skip
    shape = "x".join(str(n) for n in meta["shapes"]["q"])
    key = "/".join(("parity", framework, impl, meta["impl"], cp, meta["mask"], shape))
    return {"key": f"{key}/{meta['dtype']}", "status": status, "point": point, **fields}


def run_from_flags(flag_values: Any, store: ResultsStore | None = None) -> int:
    """run.py --parity_bundle=PATH in one process: save (framework jax) or verify (torch), each
    appending its record to `store` (None: none); exit code. run.py runs --framework=both as
    one worker per framework."""
    path = flag_values["parity_bundle"].value
    framework = flag_values["framework"].value if "framework" in flag_values else "jax"
    keep = store.append if store is not None else (lambda rec: None)
    if framework == "jax":
        meta = _save_from_flags(flag_values, path)
        print(
            f"Parity bundle saved to {path}: {meta['mask']} {meta['shapes']['q']} "
            f"{meta['dtype']} by jax {meta['impl']} (cp {meta['cp']})",
            flush=True,
        )
        keep(record("jax", meta["impl"], meta, OK, bundle=str(path)))
        return 0
    if not (Path(path) / META_JSON).exists():
        print(f"no parity bundle at {path}: save one with --framework=jax first", flush=True)
        return 2
    impls = flag_values["impl"].value if "impl" in flag_values else None
    impl = impls[0] if impls and impls[0] != "default" else "naive"
    rtol = flag_values["check_rtol"].value if "check_rtol" in flag_values else None
    result = verify_with_torch(path, impl=impl, rtol=rtol)
    errors = ", ".join(f"{n} {e:.2e}" for n, e in result["errors"].items())
    verdict = "ok" if result["ok"] else "MISMATCH"
    print(
        f"Parity ({result['impl']} on {result['device']} vs jax {result['jax_impl']}): "
        f"{verdict}; relative errors {errors} (rtol {result['rtol']:g})",
        flush=True,
    )
    meta = json.loads((Path(path) / META_JSON).read_text())  # the arrays are not needed again
    fields = {k: result[k] for k in ("errors", "rtol", "device", "bundle")}
    keep(record("torch", impl, meta, OK if result["ok"] else WRONG, **fields))
    return 0 if result["ok"] else 1
