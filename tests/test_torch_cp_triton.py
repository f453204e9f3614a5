"""PyTorch context parallelism with impl "triton" on 2 gloo CPU ranks, against the float64 oracle.

On CPU the Triton kernels run only in Triton's interpreter (TRITON_INTERPRET=1 before triton is
first imported), so the test launches this file itself as 2 worker processes with that variable
set (and torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Each rank runs ring, allgather
and ulysses (zigzag layout, GQA 4:2, fp32 and fp16, some with a loss on the LSE) on a
causal_document mask and on a mask with empty rows, and writes one JSON line per case with
relative Frobenius errors of out/lse/dq/dk/dv; the workers import no jax.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from gloo_ranks import launch, leave_group  # noqa: E402

import torch_attn  # noqa: E402
from attn_masks import Mask, MaskType, from_slices, make_mask, reference_attention  # noqa: E402

WORLD = 2
TIMEOUT_S = 120
SEQLEN = 128
HEAD_DIM = 32
HEADS = (4, 2)
SEED = 1234
DOCS = [37, 1, 2, 40, 25, 23]  # sums to SEQLEN; 1- and 2-token documents too
STRATEGIES = ("ring", "allgather", "ulysses")
MASKS = ("causal_document", "empty_rows")
DTYPES = ("float32", "float16")
TOL = {  # relative Frobenius errors; measured ~3e-7 (fp32) and ~4e-4 (fp16), lse ~5e-8
    "float32": {"out": 1e-5, "lse": 1e-5, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5},
    "float16": {"out": 5e-3, "lse": 1e-4, "dq": 5e-3, "dk": 5e-3, "dv": 5e-3},
}


def cases() -> list[tuple[str, str, str, bool]]:
    """Strategy x mask x dtype, with a loss on the LSE in half (each mask and dtype once)."""
    grid = [(s, m, d) for s in STRATEGIES for m in MASKS for d in DTYPES]
    return [(s, m, d, (m == MASKS[0]) != (d == DTYPES[0])) for s, m, d in grid]


def build_mask(name: str) -> Mask:
    """causal_document, or typed slices whose gaps leave query rows (and keys) unseen."""
    if name == "causal_document":
        return make_mask("causal_document", SEQLEN, seqlens=DOCS)
    return from_slices(
        [[0, 40], [56, 100], [100, 112]],
        [[0, 48], [20, 90], [100, 128]],
        [MaskType.CAUSAL, MaskType.FULL, MaskType.CAUSAL],
        SEQLEN,
        name="empty_rows",
    )


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v, dout, dlse in float64, rounded through `dtype` (identical on every rank)."""
    g = torch.Generator().manual_seed(SEED)
    hq, hkv = HEADS
    shapes = [(1, SEQLEN, h, HEAD_DIM) for h in (hq, hkv, hkv, hq)] + [(1, hq, SEQLEN)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).double() for s in shapes]


def _oracle(mask: Mask, xs: list[torch.Tensor], with_lse: bool) -> dict[str, np.ndarray]:
    """float64 results: attn_masks' oracle, or torch_attn naive in float64 for an LSE loss."""
    q, k, v, dout, dlse = xs
    if not with_lse:
        ref = reference_attention(q.numpy(), k.numpy(), v.numpy(), mask, dout=dout.numpy())
        return {"out": ref.out, "lse": ref.lse, "dq": ref.dq, "dk": ref.dk, "dv": ref.dv}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = torch_attn.attention(*leaves, mask, impl="naive", return_lse=True)
    _loss(out, lse, dout, dlse).backward()
    res = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    return {key: t.detach().numpy() for key, t in res.items()}


def _loss(out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None):
    """<out, dout> (+ <lse, dlse> over the finite LSE entries when dlse is given)."""
    loss = (out.double() * dout).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse.double(), 0.0) * dlse).sum()
    return loss


def _error(got: np.ndarray, ref: np.ndarray) -> float:
    """Relative Frobenius error over finite entries; inf on NaN or a different -inf pattern."""
    finite = np.isfinite(ref)
    if np.isnan(got).any() or not np.array_equal(np.isfinite(got), finite):
        return float("inf")
    diff = np.linalg.norm(got[finite] - ref[finite])
    return float(diff / max(np.linalg.norm(ref[finite]), 1e-30))


def run_case(strategy: str, mask_name: str, dtype_name: str, with_lse: bool) -> dict[str, float]:
    """This rank's errors of the global out/lse/dq/dk/dv against the float64 oracle."""
    from shard_strategies import torch_cp

    mask = build_mask(mask_name)
    xs = _inputs(getattr(torch, dtype_name))
    leaves = [x.to(getattr(torch, dtype_name)).requires_grad_() for x in xs[:3]]
    out, lse = torch_cp.attention(
        *leaves, mask, strategy=strategy, layout="zigzag", impl="triton", return_lse=True
    )
    _loss(out, lse, xs[3], xs[4] if with_lse else None).backward()
    got = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    ref = _oracle(mask, xs, with_lse)
    return {key: _error(t.detach().double().numpy(), ref[key]) for key, t in got.items()}


def worker() -> None:
    """One rank: every case, one flushed JSON line each, then a "done" line, then teardown."""
    import torch.distributed as dist

    from shard_strategies import torch_cp

    torch_cp.init_distributed(timeout_s=TIMEOUT_S)
    rank = dist.get_rank()
    path = Path(os.environ["CP_TEST_OUT"]) / f"rank{rank}.jsonl"
    with open(path, "w") as f:
        for case in cases():
            try:
                rec = {"errors": run_case(*case)}
            except Exception:
                rec = {"exception": traceback.format_exc()}
            f.write(json.dumps({"case": list(case), "rank": rank, **rec}) + "\n")
            f.flush()
        done = {"done": True, "rank": rank, "jax": "jax" in sys.modules}
        f.write(json.dumps({**done, "interpreted": _interpreted()}) + "\n")
    leave_group()


def _interpreted() -> bool:
    """Whether triton_attn's kernels ran in Triton's interpreter."""
    from triton_attn import kernels

    return kernels.interpreted()


def test_torch_cp_with_triton_kernels(tmp_path: Path) -> None:
    """ring/allgather/ulysses x 2 masks x fp32/fp16 with impl "triton" match the oracle."""
    lines = launch(Path(__file__), WORLD, tmp_path, {"TRITON_INTERPRET": "1"}, TIMEOUT_S)
    done = [x for x in lines if x.get("done")]
    assert len(done) == WORLD and all(x["interpreted"] and not x["jax"] for x in done), done
    bad = []
    for case in cases():
        recs = [x for x in lines if x.get("case") == list(case)]
        if len(recs) != WORLD:
            bad.append(f"{case}: {len(recs)} of {WORLD} ranks reported")
        for rec in recs:
            if "exception" in rec:
                bad.append(f"{case} rank {rec['rank']}: {rec['exception']}")
                continue
            tol = TOL[case[2]]
            over = {k: e for k, e in rec["errors"].items() if not e <= tol[k]}
            if over:
                bad.append(f"{case} rank {rec['rank']}: errors {over}")
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    worker()
