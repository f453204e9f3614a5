"""The JAX side of a parity bundle: run one attention call (forward and vjp), save it with Orbax.

A bundle folder holds `orbax/` (an Orbax PyTree checkpoint of every tensor, in its own dtype),
`bundle.npz` (the same tensors as float32, the exact values for bf16/fp16 too, plus the mask
slices) and `meta.json` (impl, CP strategy, scale, dtype, shapes, versions). The PyTorch side
reads the .npz and meta.json, so it needs neither jax nor orbax (see parity.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from attn_masks import Mask, default_scale
from experiments.workloads.nnx_attention import AttentionBackend
from jax_attn import attention

from .bundle import BUNDLE_NPZ, META_JSON, ORBAX_DIR, mask_arrays

TENSORS = ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv")


def _attention_fn(backend: AttentionBackend, mask: Mask):
    """(q, k, v) -> (out, lse) through the backend's single-device impl or CP strategy."""
    if not backend.is_cp:
        impl = backend.resolved_impl
        return lambda q, k, v: attention(q, k, v, mask, impl=impl, return_lse=True)
    from shard_strategies import jax_cp

    return lambda q, k, v: jax_cp.attention(
        q, k, v, mask, impl=backend.resolved_impl, return_lse=True, **backend.cp_settings
    )


def compute(backend: AttentionBackend, mask: Mask, q, k, v, dout) -> dict[str, jax.Array]:
    """out, lse and the gradients of <out, dout> w.r.t. q, k, v (lse gets a zero cotangent)."""
    (out, lse), pullback = jax.vjp(_attention_fn(backend, mask), q, k, v)
    dq, dk, dv = pullback((dout, jnp.zeros_like(lse)))
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def random_inputs(
    shape_q: tuple[int, int, int, int], heads_kv: int, dtype: Any, seed: int
) -> dict[str, np.ndarray]:
    """Standard-normal q, k, v, dout (host arrays in `dtype`)."""
    b, s, hq, d = shape_q
    rng = np.random.default_rng(seed)
    shapes = {"q": hq, "k": heads_kv, "v": heads_kv, "dout": hq}
    return {
        n: rng.standard_normal((b, s, h, d), np.float32).astype(dtype) for n, h in shapes.items()
    }


def save_bundle(
    path: str | os.PathLike,
    mask: Mask,
    inputs: dict[str, np.ndarray],
    backend: AttentionBackend,
) -> dict:
    """Compute one attention call on `inputs` and write the bundle folder; returns meta."""
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    x = {n: jnp.asarray(inputs[n]) for n in ("q", "k", "v", "dout")}
    results = compute(backend, mask, x["q"], x["k"], x["v"], x["dout"])
    tensors = {n: np.asarray(a) for n, a in {**x, **results}.items()}
    tree = {**tensors, **mask_arrays(mask)}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / ORBAX_DIR, tree, force=True)
    np.savez(
        path / BUNDLE_NPZ,
        **{n: np.asarray(a, np.float32) for n, a in tensors.items()},
        **mask_arrays(mask),
    )
    meta = {
        "impl": backend.resolved_impl,
        "cp": backend.strategy if backend.is_cp else None,
        "layout": backend.layout if backend.is_cp else None,
        "num_devices": backend.mesh.size if backend.is_cp else 1,
        "scale": default_scale(x["q"].shape[-1]),
        "dtype": str(x["q"].dtype),
        "mask": mask.name,
        "seqlen_q": mask.seqlen_q,
        "seqlen_k": mask.seqlen_k,
        "shapes": {n: list(a.shape) for n, a in tensors.items()},
        "versions": {"jax": jax.__version__, "orbax": ocp.__version__},
    }
    (path / META_JSON).write_text(json.dumps(meta, indent=1, sort_keys=True))
    return meta


def load_bundle(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor and mask array of a bundle, read back through Orbax (host numpy arrays)."""
    with ocp.StandardCheckpointer() as ckpt:
        tree = ckpt.restore(Path(path).absolute() / ORBAX_DIR)
    return {n: np.asarray(a) for n, a in tree.items()}
