"""GPU acceptance: every impl of both frameworks against the float64 oracle, in a few minutes.

    python experiments/acceptance.py                     # both frameworks, each in its own process
    python experiments/acceptance.py --framework=jax     # one framework

Small problems (lengths that divide no tile, GQA and MHA, Sq != Sk) on which each impl's out,
LSE, dq, dk and dv (for the loss <out, dout> + <lse, dlse>) are compared with exact float64
attention of the same rounded inputs; one line per case, then a summary. The shared Triton kernel
is also compared between its two front ends on identical inputs. One NaN case per impl checks the
NaN contract of docs/api.md (a NaN in one q row and in k at one key): ok, FAIL, or "documented"
for the impls documented to break it. Exit status 1 if any case fails.

The cases are split into shards, each run by a worker process of this command started side by
side through the driver's worker machinery (experiments/workers.py: a worker holds this
process's lock of the output folder and dies with it). Every case is also a record in the
driver's results format (key, status, point, the errors and tolerances, provenance): the workers
send it over their stdout, and this process alone appends it to <out_dir>/results.jsonl.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import typing
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
from absl import app, flags, logging

from attn_masks import Mask, default_scale, make_mask, random_slices
from attn_masks import reference_attention as oracle
from experiments import workers
from experiments.core import provenance
from experiments.core.outcomes import ERROR, OK, UNSUPPORTED, WRONG
from experiments.core.points import FRAMEWORKS, SHORT_DTYPES
from experiments.core.presets import STATIC_MASKS
from experiments.core.results import OutDirBusy, ResultsStore, locked_out_dir
from experiments.runners.checks import GRAD_FACTOR, tolerance

EVERY_IMPL_MASKS = ("full", "causal", "causal_document", "share_question", "random")
OWN_KERNELS = {"jax": ("pallas", "mosaic", "triton"), "torch": ("triton",)}
# library kernels checked on every static mask: each one they express (a fixed family for cuDNN
# and flash2/3; flash4's block sparsity takes any) is checked, the others are named unsupported
EVERY_STATIC_MASK = {"jax": ("cudnn",), "torch": ("sdpa_cudnn", "flash2", "flash3", "flash4")}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")
SEQLEN = 700  # divides neither 64 nor 128: every kernel sees ragged edge tiles
ALIGNED = 768  # a multiple of every tile: the kernels' unpredicated path (no ragged edge)
ALIGNED_MASKS = ("causal", "causal_document", "share_question")
# GQA at D=64: the Mosaic dK/dV head split (a GQA group shared over CTAs) at the 256-key tiles
GQA_D64_MASKS = ("causal", "share_question")
TWO_FRONT_ENDS = "triton"  # the impl whose one kernel source both frameworks launch
NAN_MASK = "causal"  # rows before the NaN key cannot see it, rows after it must turn NaN
# (framework, impl, device) that docs/api.md documents as breaking the NaN contract
NAN_DOCUMENTED = frozenset({("torch", "flex", "cpu")})
OUT_DIR = "results/local/acceptance"
RECORD = "RECORD "  # a worker's stdout line carrying one case's record (JSON) to the parent
# a verdict's status in the driver's records ("documented": the impl is documented to break it)
STATUS_OF = {"ok": OK, "FAIL": WRONG, "ERROR": ERROR, "unsupported": UNSUPPORTED,
             "documented": UNSUPPORTED}  # fmt: skip

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags (defined only when it runs, so importing the module defines none)."""
    flags.DEFINE_list("framework", list(FRAMEWORKS), "Frameworks to check: jax, torch or both.")
    flags.DEFINE_integer("seqlen", SEQLEN, "Query/key length of the square cases.", lower_bound=16)
    flags.DEFINE_list("impl", [], "Only these impls (default: every impl of each framework).")
    flags.DEFINE_integer("jax_workers", 6, "JAX worker processes (cases split among them).", 1)
    flags.DEFINE_integer("torch_workers", 3, "PyTorch worker processes.", lower_bound=1)
    flags.DEFINE_bool("allow_cpu", False, "Run without a CUDA GPU too (slow; for development).")
    flags.DEFINE_string("out_dir", OUT_DIR, "Where results.jsonl gets one record per case.")
    flags.DEFINE_string("worker", None, "Internal: run one framework's cases in this process.")
    flags.DEFINE_integer("shard", 0, "Internal: which shard of the cases a worker runs.")
    flags.DEFINE_integer("shards", 1, "Internal: how many shards the cases are split into.")
    flags.DEFINE_string("save_dir", None, "Internal: where a worker saves front-end outputs.")


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: a mask by name at (Sq, Sk), heads, head dim and dtype."""

    mask: str
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str

    @property
    def label(self) -> str:
        return (
            f"{self.mask:<22} {self.dtype:<8} D{self.head_dim:<3} "
            f"{self.heads_q}:{self.heads_kv} {self.seqlen_q}x{self.seqlen_k}"
        )

    @property
    def key(self) -> str:
        return "_".join(str(x) for x in dataclasses.astuple(self))


def build_mask(case: Case) -> Mask:
    """The case's mask: a static one at small-scale parameters, or random slices."""
    if case.mask == "random":
        return random_slices(case.seqlen_q + case.seqlen_k, case.seqlen_q, case.seqlen_k)
    block = case.seqlen_q // 5 if case.seqlen_q % 5 == 0 else case.seqlen_q
    params = {"block_size": block} if case.mask == "block_causal_document" else {}
    return make_mask(case.mask, case.seqlen_q, seed=1, window=160, **params)


def cases(framework: str, s: int = SEQLEN, only: tuple[str, ...] = ()) -> list[tuple[str, Case]]:
    """(impl, case) pairs: every impl on five masks (and two in the other half dtype), some
    library kernels on every static mask; the own kernels on every mask, both half
    dtypes, D 64 and 128, MHA and GQA (at both head dims), fp32, random slices with Sq != Sk,
    and four cases at a tile-aligned length. only: these impls."""
    from experiments.runners import frameworks

    main = dict(seqlen_q=s, seqlen_k=s, heads_q=4, heads_kv=2, head_dim=128, dtype="bfloat16")
    other = dict(main, heads_q=2, heads_kv=2, head_dim=64, dtype="float16")
    out: list[tuple[str, Case]] = []
    own = OWN_KERNELS[framework]
    for impl in frameworks.impl_names(framework):
        if impl in own:
            continue
        masks = EVERY_IMPL_MASKS
        if impl in EVERY_STATIC_MASK[framework]:
            masks = tuple(dict.fromkeys(STATIC_MASKS + EVERY_IMPL_MASKS))
        out += [(impl, Case(m, **main)) for m in masks]
        out += [(impl, Case(m, **other)) for m in ("full", "causal_document")]
    for impl in own:
        out += [(impl, Case(m, **main)) for m in (*STATIC_MASKS, "random")]
        out += [(impl, Case(m, **other)) for m in EVERY_IMPL_MASKS]
        out += [(impl, Case(m, **dict(main, head_dim=64))) for m in GQA_D64_MASKS]
        out += [(impl, Case(m, **dict(main, dtype="float32"))) for m in EVERY_IMPL_MASKS]
        out.append((impl, Case("random", **dict(main, seqlen_k=s + s // 5))))
        out.append((impl, Case("random", **dict(other, seqlen_q=s - s // 4))))
        aligned = dict(seqlen_q=ALIGNED, seqlen_k=ALIGNED)
        out += [(impl, Case(m, **dict(main, **aligned))) for m in ALIGNED_MASKS]
        # whole tiles only: where Mosaic's D=64 default steps its dK/dV kernel over 128 q rows
        out.append((impl, Case("full", **dict(main, head_dim=64, **aligned))))
    return [(impl, case) for impl, case in out if not only or impl in only]


def inputs(case: Case) -> dict[str, np.ndarray]:
    """Fresh float32 normal q, k, v, dout, dlse, the same for every impl and framework."""
    rng = np.random.default_rng(zlib.crc32(case.key.encode()))
    b, sq, sk, d = 1, case.seqlen_q, case.seqlen_k, case.head_dim
    hq, hkv = case.heads_q, case.heads_kv
    shapes = {
        "q": (b, sq, hq, d),
        "k": (b, sk, hkv, d),
        "v": (b, sk, hkv, d),
        "dout": (b, sq, hq, d),
        "dlse": (b, hq, sq),
    }
    return {n: rng.standard_normal(shape).astype(np.float32) for n, shape in shapes.items()}


def oracle_with_lse(mask: Mask, x: dict[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    """Exact float64 out, lse and the gradients of <out, dout> + <lse, dlse> (finite lse)."""
    ref = oracle(x["q"], x["k"], x["v"], mask, scale=scale, dout=x["dout"])
    group = x["q"].shape[2] // x["k"].shape[2]
    q = x["q"].astype(np.float64)
    k = np.repeat(x["k"].astype(np.float64), group, axis=2)
    lse = ref.lse[..., None]
    finite = np.isfinite(lse)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    p = np.where(mask.dense() & finite, np.exp(s - np.where(finite, lse, 0.0)), 0.0)
    ds = p * x["dlse"].astype(np.float64)[..., None]
    dq = ref.dq + np.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk_heads = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    b, sk, hkv, d = x["k"].shape
    dk = ref.dk + dk_heads.reshape(b, sk, hkv, group, d).sum(axis=3)
    return {"out": ref.out, "lse": ref.lse, "dq": dq, "dk": dk, "dv": ref.dv}


def relative_error(name: str, got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| (LSE over its finite entries; its -inf pattern must match)."""
    got = np.asarray(got, np.float64)
    if name == "lse":
        if not np.array_equal(np.isneginf(got), np.isneginf(want)):
            return float("inf")
        keep = np.isfinite(want)
        got, want = got[keep], want[keep]
    if not np.isfinite(got).all():
        return float("inf")
    denom = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / denom) if denom > 0 else float(np.abs(got).max())


def _jax_run(impl: str, mask: Mask, x: dict, dtype: str, scale: float, ask: tuple) -> dict:
    import jax
    import jax.numpy as jnp

    import jax_attn

    grads, with_lse = ask
    q, k, v = (jnp.asarray(x[n]).astype(dtype) for n in ("q", "k", "v"))

    def f(q, k, v):
        got = jax_attn.attention(q, k, v, mask, impl=impl, scale=scale, return_lse=with_lse)
        return got if with_lse else (got, None)

    if not grads:
        out, lse = jax.jit(f)(q, k, v)
        res = {"out": out, "lse": lse}
    else:
        (out, lse), pullback = jax.vjp(f, q, k, v)
        dout = jnp.asarray(x["dout"]).astype(out.dtype)
        dlse = None if lse is None else jnp.where(jnp.isfinite(lse), jnp.asarray(x["dlse"]), 0.0)
        dq, dk, dv = pullback((dout, dlse))
        res = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    rounded = {
        n: np.asarray(jnp.asarray(x[n]).astype(dtype).astype(jnp.float32))
        for n in ("q", "k", "v", "dout")
    }
    arrays = {n: np.asarray(jnp.asarray(a, jnp.float32)) for n, a in res.items() if a is not None}
    return arrays | {"inputs": rounded}


def _torch_run(impl: str, mask: Mask, x: dict, dtype: str, scale: float, ask: tuple) -> dict:
    import torch

    import torch_attn

    grads, _ = ask  # every torch impl returns a differentiable LSE

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tdt = getattr(torch, dtype)
    q, k, v = (torch.tensor(x[n], device=dev).to(tdt).requires_grad_(grads) for n in "qkv")
    out, lse = torch_attn.attention(q, k, v, mask, impl=impl, scale=scale, return_lse=True)
    res = {"out": out, "lse": lse}
    if grads:
        dlse = torch.tensor(x["dlse"], device=dev)
        dlse = torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))
        dout = torch.tensor(x["dout"], device=dev).to(tdt)
        loss = (out.float() * dout.float()).sum()
        loss = loss + (torch.where(torch.isfinite(lse), lse.float(), 0.0) * dlse).sum()
        loss.backward()
        res |= {"dq": q.grad, "dk": k.grad, "dv": v.grad}
    rounded = {n: t.detach().float().cpu().numpy() for n, t in zip("qkv", (q, k, v))}
    rounded["dout"] = torch.tensor(x["dout"]).to(tdt).float().numpy()
    return {n: t.detach().float().cpu().numpy() for n, t in res.items()} | {"inputs": rounded}


def _supports(framework: str, impl: str, mask: Mask, case: Case, ask: tuple) -> bool | str:
    """supports() of the framework for (gradients?, LSE?) on this case."""
    grads, with_lse = ask
    if framework == "jax":
        import jax_attn

        return jax_attn.supports(
            impl,
            mask,
            dtype=case.dtype,
            head_dim=case.head_dim,
            heads_q=case.heads_q,
            heads_kv=case.heads_kv,
            return_lse=with_lse,
            mode="fwd_bwd" if grads else "fwd",
        )
    import torch

    import torch_attn

    return torch_attn.supports(
        impl,
        mask,
        dtype=getattr(torch, case.dtype),
        head_dim=case.head_dim,
        heads_q=case.heads_q,
        heads_kv=case.heads_kv,
        mode="fwd_bwd" if grads else "fwd",
    )


ASKS = ((True, True), (True, False), (False, True), (False, False))  # (gradients, LSE)


def most_supported(framework: str, impl: str, mask: Mask, case: Case) -> tuple[tuple, str]:
    """The fullest (gradients, LSE) the impl supports on the case, or ((), why it cannot even
    run the plain forward)."""
    why = ""
    for ask in ASKS:
        verdict = _supports(framework, impl, mask, case, ask)
        if verdict is True:
            return ask, ""
        why = str(verdict)
    return (), why


class Outcome(typing.NamedTuple):
    """A case's verdict (ok, FAIL, unsupported, ERROR or documented), its printed line, and the
    fields its record adds (errors and tolerances per quantity, seconds, message)."""

    status: str
    line: str
    details: dict


def record(section: str, framework: str, impl: str, case: Case, outcome: Outcome) -> dict:
    """The driver-format record of one case of `section` (kernels or nan)."""
    point = {"workload": "acceptance", "section": section, "framework": framework, "impl": impl}
    point.update(dataclasses.asdict(case))
    return {
        "key": "/".join(("acceptance", section, framework, impl, case.key)),
        "status": STATUS_OF[outcome.status],
        "verdict": outcome.status,
        "point": point,
        **outcome.details,
    }


def run_case(framework: str, impl: str, case: Case, save_dir: str | None) -> Outcome:
    """One case: ok, FAIL, unsupported (with the reason) or ERROR."""
    head = f"{framework:<5} {impl:<13} {case.label}"
    try:
        mask = build_mask(case)
        ask, why = most_supported(framework, impl, mask, case)
        if not ask:
            return Outcome("unsupported", f"{'unsupported':<11} {head}  {why}", {"message": why})
        x = inputs(case)
        scale = default_scale(case.head_dim)
        run = _jax_run if framework == "jax" else _torch_run
        t0 = time.monotonic()
        got = run(impl, mask, x, case.dtype, scale, ask)
        took = time.monotonic() - t0
        rounded = got.pop("inputs")
        if "lse" not in got:
            rounded["dlse"] = np.zeros_like(x["dlse"])
        want = oracle_with_lse(mask, dict(x, **rounded), scale)
    except Exception as err:  # a crash is a finding to report, not a reason to stop
        why = f"{type(err).__name__}: {str(err)[:300]}"
        return Outcome("ERROR", f"{'ERROR':<11} {head}  {why}", {"message": why})
    rtol = tolerance(SHORT_DTYPES[case.dtype], on_gpu=True)
    parts, bad, errors, tols = [], [], {}, {}
    for name in QUANTITIES:
        if name not in got:
            parts.append(f"{name} -")
            continue
        err = relative_error(name, got[name], want[name])
        tol = rtol * (GRAD_FACTOR if name.startswith("d") else 1.0)
        errors[name], tols[name] = err, tol
        parts.append(f"{name} {err:.1e}")
        if not err <= tol:
            bad.append(f"{name} {err:.2e} > {tol:.0e}")
    if save_dir and impl == TWO_FRONT_ENDS:
        np.savez(Path(save_dir) / f"{framework}_{case.key}.npz", **got)
    status = "FAIL" if bad else "ok"
    note = f"  [{'; '.join(bad)}]" if bad else ("" if ask[0] else "  (forward only)")
    line = f"{status:<11} {head}  {' '.join(parts)}  {took:.1f}s{note}"
    details = {"errors": errors, "tolerances": tols, "seconds": took, "message": "; ".join(bad)}
    return Outcome(status, line, details)


def nan_cases(
    framework: str, s: int = SEQLEN, only: tuple[str, ...] = ()
) -> list[tuple[str, Case]]:
    """(impl, case) of the NaN section: every impl once, on the main dtype, heads and head dim."""
    from experiments.runners import frameworks

    case = Case(NAN_MASK, s, s, heads_q=4, heads_kv=2, head_dim=128, dtype="bfloat16")
    return [(impl, case) for impl in frameworks.impl_names(framework) if not only or impl in only]


def nan_positions(case: Case) -> dict[str, tuple[int, int, int, int]]:
    """Where the NaN case puts its NaNs: q row Sq/3 of query head 1 (KV head 0) and k key Sk/2
    of KV head 1 (read by query heads 2 and 3 under GQA 4:2)."""
    return {"q": (0, case.seqlen_q // 3, 1, 5), "k": (0, case.seqlen_k // 2, 1, 7)}


def nan_rows(mask: Mask, case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(must, may) (B, Sq, Hq) bool: the rows that read a NaN, and those the contract lets turn
    NaN (those plus every row of the NaN key's batch and KV head)."""
    group = case.heads_q // case.heads_kv
    b, i, h, _ = nan_positions(case)["q"]
    kb, j, g, _ = nan_positions(case)["k"]
    must = np.zeros((1, case.seqlen_q, case.heads_q), bool)
    must[b, i, h] = mask.dense()[i].any()
    kv_heads = slice(g * group, (g + 1) * group)
    must[kb, :, kv_heads] |= mask.dense()[:, j, None]
    may = must.copy()
    may[kb, :, kv_heads] = True
    return must, may


def _nan_out(framework: str, impl: str, mask: Mask, x: dict, dtype: str) -> np.ndarray:
    """The impl's plain forward (no LSE, no gradients: the call most users make) in float32."""
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        import jax_attn

        q, k, v = (jnp.asarray(x[n]).astype(dtype) for n in "qkv")
        out = jax.jit(lambda q, k, v: jax_attn.attention(q, k, v, mask, impl=impl))(q, k, v)
        return np.asarray(out.astype(jnp.float32))
    import torch

    import torch_attn

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.tensor(x[n], device=dev).to(getattr(torch, dtype)) for n in "qkv")
    with torch.no_grad():
        return torch_attn.attention(q, k, v, mask, impl=impl).float().cpu().numpy()


def nan_problems(got: np.ndarray, want: np.ndarray, mask: Mask, case: Case) -> list[str]:
    """How `got` breaks the NaN contract against the oracle `want` of the clean inputs (empty
    list: it keeps it): rows that read a NaN but are finite, NaN rows the contract does not
    allow, finite rows that read no NaN off the oracle."""
    must, may = nan_rows(mask, case)
    nan = np.isnan(got).any(axis=-1)
    problems = []
    if (must & ~nan).any():
        problems.append(f"{(must & ~nan).sum()} of {must.sum()} rows that read a NaN are finite")
    if (nan & ~may).any():
        problems.append(f"{(nan & ~may).sum()} rows that cannot reach a NaN are NaN")
    clean = ~nan & ~must
    err = relative_error("out", got[clean], want[clean]) if clean.any() else 0.0
    if not err <= tolerance(SHORT_DTYPES[case.dtype], on_gpu=True):
        problems.append(f"finite rows: out {err:.2e} off the oracle")
    return problems


def nan_verdict(problems: list[str], documented: bool) -> tuple[str, str]:
    """(status, note): ok, documented (breaks the contract as docs/api.md says) or FAIL (breaks
    it undocumented, or keeps it while documented not to: then the docs are stale)."""
    if problems and documented:
        return "documented", f"breaks the NaN contract (documented): {'; '.join(problems)}"
    if problems:
        return "FAIL", f"breaks the NaN contract: {'; '.join(problems)}"
    if documented:
        return "FAIL", "keeps the NaN contract, documented as breaking it: update docs/api.md"
    return "ok", "keeps the NaN contract"


def run_nan_case(framework: str, impl: str, case: Case) -> Outcome:
    """The NaN case: ok, FAIL, documented, unsupported or ERROR."""
    head = f"{framework:<5} {impl:<13} {case.label}"
    try:
        mask = build_mask(case)
        verdict = _supports(framework, impl, mask, case, (False, False))
        if verdict is not True:
            line = f"{'unsupported':<11} {head}  NaN case: {verdict}"
            return Outcome("unsupported", line, {"message": verdict})
        x = {n: a for n, a in inputs(case).items() if n in "qkv"}
        t0 = time.monotonic()
        got = _nan_out(framework, impl, mask, _with_nans(x, case), case.dtype)
        took = time.monotonic() - t0
        clean = {n: _rounded(a, case.dtype) for n, a in x.items()}
        want = oracle(clean["q"], clean["k"], clean["v"], mask).out
        documented = (framework, impl, _device(framework)) in NAN_DOCUMENTED
        status, note = nan_verdict(nan_problems(got, want, mask, case), documented)
    except Exception as err:  # a crash is a finding to report, not a reason to stop
        why = f"{type(err).__name__}: {str(err)[:300]}"
        return Outcome("ERROR", f"{'ERROR':<11} {head}  NaN case: {why}", {"message": why})
    line = f"{status:<11} {head}  NaN case: {note}  {took:.1f}s"
    return Outcome(status, line, {"seconds": took, "message": note})


def _device(framework: str) -> str:
    """Where the framework's impls run in this process: gpu or cpu."""
    if framework == "jax":
        import jax

        return "gpu" if jax.default_backend() == "gpu" else "cpu"
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def _with_nans(x: dict[str, np.ndarray], case: Case) -> dict[str, np.ndarray]:
    """Copies of q, k, v with the NaN case's NaNs in place."""
    out = {n: a.copy() for n, a in x.items()}
    for name, at in nan_positions(case).items():
        out[name][at] = np.nan
    return out


def _rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """a rounded to `dtype` (to nearest even, as the frameworks convert) and back to float32."""
    import ml_dtypes

    kind = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return a.astype(kind).astype(np.float32)


def worker(
    framework: str,
    save_dir: str | None,
    seqlen: int,
    only: tuple[str, ...],
    shard: int = 0,
    shards: int = 1,
) -> int:
    """Run shard `shard` of `shards` of one framework's cases here, one line each; exit 1 on
    any failure."""
    counts: Counter = Counter()
    runs = [("kernels", impl, case, functools.partial(run_case, save_dir=save_dir))
            for impl, case in cases(framework, seqlen, only)[shard::shards]]  # fmt: skip
    runs += [("nan", impl, case, run_nan_case)
             for impl, case in nan_cases(framework, seqlen, only)[shard::shards]]  # fmt: skip
    for section, impl, case, run in runs:
        outcome = run(framework, impl, case)
        counts[outcome.status] += 1
        print(outcome.line, flush=True)
        print(RECORD + json.dumps(record(section, framework, impl, case, outcome)), flush=True)
    print(f"SUMMARY {framework} " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return 1 if counts["FAIL"] or counts["ERROR"] else 0


def ulps_apart(a: np.ndarray, b: np.ndarray, dtype: str) -> float:
    """Largest |a - b| in units of the last place of `dtype` at the compared values."""
    import ml_dtypes

    eps = float(ml_dtypes.finfo(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype).eps)
    finite = np.isfinite(a) & np.isfinite(b)
    if not np.array_equal(finite, np.isfinite(a)) or not np.array_equal(a[~finite], b[~finite]):
        return float("inf")
    a, b = a[finite].astype(np.float64), b[finite].astype(np.float64)
    if a.size == 0:
        return 0.0
    ulp = eps * np.maximum(np.maximum(np.abs(a), np.abs(b)), np.finfo(np.float32).tiny)
    return float((np.abs(a - b) / ulp).max())


def compare_front_ends(save_dir: str) -> list[Outcome]:
    """One outcome per case both frameworks ran: ok when every quantity is bitwise equal (one
    kernel source, one compiled kernel), else FAIL naming each quantity that differs, its
    largest ulp distance and how many elements differ."""
    outcomes = []
    for jax_file in sorted(Path(save_dir).glob("jax_*.npz")):
        torch_file = jax_file.with_name("torch_" + jax_file.name[4:])
        if not torch_file.exists():
            continue
        a, b = np.load(jax_file), np.load(torch_file)
        dtype = jax_file.stem.split("_")[-1]
        diffs = []
        for n in (n for n in QUANTITIES if n in a and n in b):
            if not np.array_equal(a[n], b[n], equal_nan=True):
                count = int(np.sum(~((a[n] == b[n]) | (np.isnan(a[n]) & np.isnan(b[n])))))
                ulps = ulps_apart(a[n], b[n], dtype)
                diffs.append(f"{n} max {ulps:.1f} ulp ({count} of {a[n].size} differ)")
        status = "FAIL" if diffs else "ok"
        verdict = "; ".join(diffs) or "bitwise"
        line = f"{status:<11} front ends   {jax_file.stem[4:]}  {verdict}"
        outcomes.append(Outcome(status, line, {"case": jax_file.stem[4:], "message": verdict}))
    return outcomes


def front_ends_record(outcome: Outcome) -> dict:
    """The driver-format record of one front-end comparison."""
    case = outcome.details["case"]
    point = {"workload": "acceptance", "section": "front_ends", "impl": TWO_FRONT_ENDS}
    return {
        "key": f"acceptance/front_ends/{TWO_FRONT_ENDS}/{case}",
        "status": STATUS_OF[outcome.status],
        "verdict": outcome.status,
        "point": {**point, "case": case},
        "message": outcome.details["message"],
    }


def _worker_env() -> dict[str, str]:
    """What the workers add to the driver's worker environment: they allocate GPU memory as they
    need it (they run side by side); compilation caches persist in .cache/ (unless the
    environment picks them), so a second run on the same machine compiles nothing."""
    cache = Path(__file__).resolve().parents[1] / ".cache"
    defaults = {
        "JAX_COMPILATION_CACHE_DIR": str(cache / "jax"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "PYTHONUNBUFFERED": "1",
    }
    env = {name: os.environ.get(name, value) for name, value in defaults.items()}
    return env | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # the workers share one GPU


def has_cuda_gpu() -> bool:
    """Whether this machine has a CUDA GPU, asked without holding one (no JAX client here)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        code = "import jax; print(jax.default_backend())"
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        return done.stdout.strip().endswith("gpu")


def _workers(fw: str) -> int:
    return FLAGS.jax_workers if fw == "jax" else FLAGS.torch_workers


def _worker_cmd(fw: str, shard: int, save_dir: str) -> list[str]:
    """The command of one shard's worker: this script with --worker."""
    return [
        sys.executable,
        __file__,
        f"--worker={fw}",
        f"--shard={shard}",
        f"--shards={_workers(fw)}",
        f"--save_dir={save_dir}",
        f"--seqlen={FLAGS.seqlen}",
        f"--impl={','.join(FLAGS.impl)}",
    ]


def run_workers(
    save_dir: str, keep: typing.Callable[[dict], None], lock_fd: int
) -> list[str] | None:
    """Every shard of every requested framework at once (the GPU is shared; compilation, which
    dominates such small problems, runs in parallel); their lines as they come, each record to
    keep(); the failures (None: interrupted by Ctrl-C)."""
    cmds = {
        f"{fw}/{shard}": _worker_cmd(fw, shard, save_dir)
        for fw in FRAMEWORKS
        if fw in FLAGS.framework
        for shard in range(_workers(fw))
    }
    failed: list[str] = []

    def on_line(name: str, line: str) -> None:
        if line.startswith(RECORD):
            keep(json.loads(line[len(RECORD) :]))
            return
        if not line.startswith("SUMMARY"):
            print(line, flush=True)
        if line.startswith(("FAIL", "ERROR")):
            failed.append(line)

    codes = workers.run_side_by_side(cmds, lock_fd, on_line, _worker_env())
    if isinstance(codes, int):  # workers.INTERRUPTED
        return None
    bad = [(name, code) for name, code in codes.items() if code not in (0, 1)]
    return failed + [f"ERROR worker {name} exited with status {code}" for name, code in bad]


def _why_not_run() -> str | None:
    """One line on why the flags or the machine cannot run the command, or None."""
    unknown = sorted(set(FLAGS.framework) - set(FRAMEWORKS))
    if unknown:
        return f"--framework={','.join(unknown)} is unknown: valid values are jax, torch"
    if not FLAGS.allow_cpu and not has_cuda_gpu():
        return (
            "no CUDA GPU here: this command checks the GPU kernels (on the CPU, the interpreted "
            "kernels are checked by `python -m pytest tests`); --allow_cpu runs it anyway"
        )
    return None


def _run(store: ResultsStore, lock_fd: int) -> list[str] | None:
    """The workers, then the front-end comparison; every record into `store` with this run's
    provenance; the failure lines (None: interrupted, no comparison)."""
    prov = {"git": provenance.git_state(), "versions": provenance.package_versions()}

    def keep(rec: dict) -> None:
        store.append({**rec, "provenance": prov})

    with tempfile.TemporaryDirectory() as save_dir:
        failed = run_workers(save_dir, keep, lock_fd)
        if failed is None:
            return None
        for outcome in compare_front_ends(save_dir):
            print(outcome.line, flush=True)
            keep(front_ends_record(outcome))
            if outcome.status == "FAIL":
                failed.append(outcome.line)
    return failed


def main(argv: list[str]) -> int:
    """Run the workers (or be one), then print the failures and a summary."""
    del argv
    logging.set_verbosity(logging.WARNING)
    if FLAGS.worker:
        workers.start_as_worker()
        only = tuple(FLAGS.impl)
        return worker(FLAGS.worker, FLAGS.save_dir, FLAGS.seqlen, only, FLAGS.shard, FLAGS.shards)
    why = _why_not_run()
    if why:
        print(why, file=sys.stderr)
        return 2
    start = time.time()
    Path(FLAGS.out_dir).mkdir(parents=True, exist_ok=True)
    try:
        with locked_out_dir(FLAGS.out_dir) as lock_fd:
            failed = _run(ResultsStore(FLAGS.out_dir), lock_fd)
    except OutDirBusy as e:
        print(e, file=sys.stderr)
        return e.exit_code
    if failed is None:
        print(
            f"Interrupted: the cases so far are in {ResultsStore(FLAGS.out_dir).path}",
            file=sys.stderr,
        )
        return workers.INTERRUPTED
    print(f"records: {ResultsStore(FLAGS.out_dir).path}")
    print(f"\n{len(failed)} failures in {time.time() - start:.0f} s")
    for line in failed:
        print("  " + line)
    return 1 if failed else 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
