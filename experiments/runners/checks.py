"""Correctness check of every point against exact float64 attention, before it is timed.

Small problems (B*Hq*Sq*Sk <= FULL_CHECK_ELEMENTS) are compared whole with
`attn_masks.reference_attention`: out, and dq, dk, dv in backward modes. Larger ones compare a
random subset of query rows (always the first and last row too) in a spread of at most MAX_HEADS
query heads (the first and last always, the rest evenly between them, so that with grouped K/V
heads the sample spans the groups), every batch: the output rows and, for backward modes, the dq
rows are exact functions of those rows alone (dq_i = scale * sum_j P_ij (dP_ij - dO_i.O_i) K_j),
so they are computed exactly in float64 over just the keys those rows see: on the host from
those rows of q/dout and those keys of k/v alone, or on the device where a runner passes
check_point a `reference` (the JAX runner on a GPU: device_reference.py), so that no input
leaves it.
dk/dv need every query row that sees a key (O(S^2) work), so at large sizes they are only
checked to be finite.

Metric: relative Frobenius error ||got - ref|| / ||ref|| per tensor, against a per-dtype
threshold (bf16 2e-2, fp16 1e-2, fp32 1e-4 on CPU / 2e-3 on GPU where fp32 matmuls may use TF32);
gradients get twice the output's threshold. Any NaN or inf fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from attn_masks import default_scale, reference_attention

FULL_CHECK_ELEMENTS = 1 << 24
ROW_CHECK_BUDGET = 1 << 22  # rows * keys per (batch, head) in the row check
MAX_ROWS, MIN_ROWS = 64, 8
MAX_HEADS = 8  # query heads a row check compares: its float64 work grows with each one
RTOL = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-4}
RTOL_FP32_GPU = 2e-3
GRAD_FACTOR = 2.0
GRADS = ("dq", "dk", "dv")


@dataclass(frozen=True)
class CheckPlan:
    """What to compare: everything (rows None) or the given query rows over the keys `cols`, in
    the query `heads` (None: all)."""

    rows: np.ndarray | None = None
    cols: np.ndarray | None = None
    heads: np.ndarray | None = None

    @property
    def kind(self) -> str:
        return "full" if self.rows is None else "rows"


def plan_check(mask, batch: int, heads_q: int, seed: int) -> CheckPlan:
    """A whole comparison for small problems, else sampled query rows and the keys they see."""
    sq, sk = mask.seqlen_q, mask.seqlen_k
    if batch * heads_q * sq * sk <= FULL_CHECK_ELEMENTS:
        return CheckPlan()
    return sample_rows(mask, np.arange(sq), seed, heads_q)


def sample_heads(heads_q: int) -> np.ndarray:
    """At most MAX_HEADS of heads_q query heads: the first, the last and an even spread."""
    return np.unique(np.linspace(0, heads_q - 1, min(heads_q, MAX_HEADS)).round().astype(np.int64))


def sample_rows(mask, candidates: np.ndarray, seed: int, heads_q: int) -> CheckPlan:
    """A row plan over some of `candidates` (query rows; the first and last always), the keys
    those rows see and a spread of the heads_q query heads (sample_heads)."""
    n = int(np.clip(ROW_CHECK_BUDGET // max(mask.seqlen_k, 1), MIN_ROWS, MAX_ROWS))
    rng = np.random.default_rng(seed + 7919)
    picked = rng.choice(candidates, size=min(n, candidates.size), replace=False)
    ends = [candidates.min(), candidates.max()]
    rows = np.unique(np.concatenate([ends, picked])).astype(np.int64)
    return CheckPlan(rows, keys_seen(mask, rows), sample_heads(heads_q))


def keys_seen(mask, rows: np.ndarray) -> np.ndarray:
    """The keys any of the query rows sees, ascending: what a row reference needs of k and v
    (from the rows' intervals in one pass over the keys, not a rows x keys table)."""
    lo, hi = (x[rows].ravel() for x in mask.row_intervals())
    edges = np.zeros(mask.seqlen_k + 1, np.int64)
    np.add.at(edges, lo[lo < hi], 1)
    np.add.at(edges, hi[lo < hi], -1)
    return np.flatnonzero(np.cumsum(edges[:-1]) > 0)


def _visible(mask, rows: np.ndarray) -> np.ndarray:
    """(len(rows), Sk) bool: which keys each of the rows sees, from the per-row intervals."""
    lo, hi = (x[rows] for x in mask.row_intervals())
    keys = np.arange(mask.seqlen_k)
    return ((keys >= lo[:, :, None]) & (keys < hi[:, :, None])).any(axis=1)


@dataclass(frozen=True)
class Inputs:
    """The inputs a framework ran on, rounded to its dtype and held exactly in float32. Under a
    row plan q/dout hold only the plan's rows and k/v only its keys."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray


@dataclass
class CheckResult:
    """Outcome of one comparison: relative errors per tensor and the threshold used."""

    ok: bool
    kind: str
    errors: dict[str, float]
    rtol: dict[str, float]
    rows: int | None = None
    unchecked: list[str] = field(default_factory=list)
    message: str = ""
    heads: int | None = None  # query heads a row check compared (None: all)

    def as_dict(self) -> dict:
        """JSON-friendly form for the record."""
        return {
            "ok": self.ok,
            "kind": self.kind,
            "errors": self.errors,
            "rtol": self.rtol,
            "rows": self.rows,
            "unchecked": self.unchecked,
            "message": self.message,
            "heads": self.heads,
        }


def tolerance(dtype: str, *, on_gpu: bool, override: float | None = None) -> float:
    """Relative error threshold for the output in a dtype."""
    if override is not None:
        return override
    if dtype == "fp32" and on_gpu:
        return RTOL_FP32_GPU
    return RTOL[dtype]


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"shape {got.shape} does not match the reference {ref.shape}")
    if not np.isfinite(got).all():
        return float("inf")
    denom = np.linalg.norm(ref)
    diff = np.linalg.norm(got - ref)
    return float(diff / denom) if denom > 0 else float(diff)


def rows_reference(
    inp: Inputs, mask, plan: CheckPlan, scale: float, grads: bool
) -> dict[str, np.ndarray]:
    """Exact float64 out (and dq) for the plan's query rows and heads, per (batch, head); each
    K/V head is converted once for the query heads that share it, into buffers reused across
    heads, and the row-by-key arrays are worked on in place: at 64K keys fresh float64
    temporaries (page faults) and extra element-wise passes cost more than the matmuls."""
    hidden = ~_visible(mask, plan.rows)[:, plan.cols]
    masked = bool(hidden.any())  # no pass over the scores where every row sees every key
    b, nrows, hq, d = inp.q.shape
    group = hq // inp.k.shape[2]
    heads = np.arange(hq) if plan.heads is None else np.asarray(plan.heads)
    out = np.zeros((b, nrows, heads.size, d))
    dq = np.zeros_like(out)
    k = np.empty((inp.k.shape[1], d))
    v = np.empty_like(k)
    s = np.empty((nrows, k.shape[0]))
    dp = np.empty_like(s) if grads else None
    for bi in range(b):
        for kv in np.unique(heads // group):
            np.copyto(k, inp.k[bi, :, kv])
            np.copyto(v, inp.v[bi, :, kv])
            for j in np.flatnonzero(heads // group == kv):
                q = inp.q[bi, :, heads[j]].astype(np.float64)
                np.matmul(q, k.T, out=s)
                s *= scale
                if masked:
                    s[hidden] = -np.inf
                m = s.max(axis=1, keepdims=True, initial=-np.inf)
                s -= np.where(np.isfinite(m), m, 0.0)
                p = np.exp(s, out=s)  # hidden keys: exp(-inf) = 0
                den = p.sum(axis=1, keepdims=True)
                p /= np.where(den > 0, den, 1.0)
                o = p @ v
                out[bi, :, j] = o
                if grads:
                    do = inp.dout[bi, :, heads[j]].astype(np.float64)
                    np.matmul(do, v.T, out=dp)
                    dp -= (do * o).sum(axis=1, keepdims=True)
                    dp *= p
                    dq[bi, :, j] = dp @ k * scale
    return {"out": out, "dq": dq} if grads else {"out": out}


def compare(
    mask,
    inp: Inputs | None,
    got: dict[str, np.ndarray],
    *,
    plan: CheckPlan,
    grads: bool,
    rtol: float,
    finite: dict[str, bool] | None = None,
    scale: float | None = None,
    refs: dict[str, np.ndarray] | None = None,
) -> CheckResult:
    """Compare an impl's results with exact float64 attention (`refs`: that reference computed
    already, e.g. once for several ranks' rows; then `inp` serves only the default scale, and
    may be None when `scale` is given).

    `got` holds 'out' (and 'dq', 'dk', 'dv' when grads): whole arrays under a full plan,
    otherwise 'out' and 'dq' at the plan's rows; `finite` says whether the tensors a row plan
    cannot compare (dk, dv) are free of NaN/inf.
    """
    scale = default_scale(inp.q.shape[-1]) if scale is None else scale
    names = ("out", *GRADS) if grads else ("out",)
    tol = {n: rtol * (GRAD_FACTOR if n in GRADS else 1.0) for n in names}
    if refs is None and plan.rows is None:
        dout = inp.dout if grads else None
        ref = reference_attention(inp.q, inp.k, inp.v, mask, scale=scale, dout=dout)
        refs = {n: getattr(ref, n) for n in names}
    elif refs is None:
        refs = rows_reference(inp, mask, plan, scale, grads)
    unchecked = [n for n in names if n not in refs]
    compared = {n: got[n] if plan.heads is None else got[n][:, :, plan.heads] for n in refs}
    errors = {n: _rel(compared[n], refs[n]) for n in refs}
    bad = [n for n, e in errors.items() if not e <= tol[n]]
    for n in unchecked:
        if not (finite or {}).get(n, True):
            errors[n] = float("inf")
            bad.append(n)
    message = "; ".join(f"{n}: rel err {errors[n]:.3g} > {tol[n]:.3g}" for n in bad)
    return CheckResult(
        ok=not bad,
        kind=plan.kind,
        errors=errors,
        rtol=tol,
        rows=None if plan.rows is None else int(plan.rows.size),
        unchecked=unchecked,
        message=message,
        heads=None if plan.heads is None else int(plan.heads.size),
    )


def check_point(
    point,
    mask,
    index: int,
    args: dict,
    got: dict,
    *,
    fetch: Callable[[object, np.ndarray | None], np.ndarray],
    finite: Callable[[object], bool],
    on_gpu: bool,
    rtol_override: float | None = None,
    reference: Callable[[CheckPlan, float, bool], dict[str, np.ndarray]] | None = None,
) -> CheckResult:
    """Check mask `index` of a point: plan the comparison, bring only what it needs to the host
    (fetch(x, positions along the sequence axis, None = all) -> float32 numpy) and compare;
    results a row plan cannot compare are only checked with finite(x). reference(plan, scale,
    grads), where given, computes a row plan's float64 rows (rows_reference's values) where the
    inputs lie, so none of them is fetched."""
    plan = plan_check(mask, point.batch, point.heads_q, point.seed + index)
    grads = point.mode != "fwd"
    compared = got if plan.rows is None else {n: got[n] for n in ("out", "dq") if n in got}
    if reference is None or plan.rows is None:
        inputs = Inputs(
            **{n: fetch(x, plan.cols if n in ("k", "v") else plan.rows) for n, x in args.items()}
        )
        scale = refs = None
    else:
        inputs, scale = None, default_scale(args["q"].shape[-1])
        refs = reference(plan, scale, grads)
    rtol = tolerance(point.dtype, on_gpu=on_gpu, override=rtol_override)
    return compare(
        mask,
        inputs,
        {n: fetch(x, plan.rows) for n, x in compared.items()},
        plan=plan,
        grads=grads,
        rtol=rtol,
        finite={n: finite(x) for n, x in got.items() if n not in compared},
        scale=scale,
        refs=refs,
    )
