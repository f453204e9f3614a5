"""The GPU acceptance command's parts on the CPU: its oracle, its verdicts, its front-end check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from attn_masks import from_slices
from experiments import acceptance
from experiments.acceptance import Case


def _dense_autograd(mask, x: dict, scale: float) -> dict[str, np.ndarray]:
    """out, lse and gradients of <out, dout> + <lse, dlse> by torch autograd in float64."""
    q, k, v = (torch.tensor(x[n], dtype=torch.float64, requires_grad=True) for n in "qkv")
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = s.masked_fill(~torch.tensor(mask.dense()), -torch.inf)
    lse = torch.logsumexp(s, dim=-1)
    seen = torch.isfinite(lse)
    p = torch.where(seen[..., None], torch.exp(s - torch.where(seen, lse, 0.0)[..., None]), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    dlse = torch.where(seen, torch.tensor(x["dlse"], dtype=torch.float64), 0.0)
    loss = (out * torch.tensor(x["dout"], dtype=torch.float64)).sum()
    (loss + (torch.where(seen, lse, 0.0) * dlse).sum()).backward()
    res = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {n: t.detach().numpy() for n, t in res.items()}


def test_oracle_with_lse_matches_autograd():
    """GQA, Sq != Sk, rows that see nothing: the oracle's five arrays equal float64 autograd."""
    mask = from_slices([[0, 20], [30, 48]], [[5, 40], [0, 61]], [0, 1], 48, 61)
    assert not mask.dense().any(axis=1).all(), "the case must have rows that see no key"
    x = acceptance.inputs(Case("custom", 48, 61, 4, 2, 16, "float32"))
    got = acceptance.oracle_with_lse(mask, x, 0.3)
    want = _dense_autograd(mask, x, 0.3)
    for name in acceptance.QUANTITIES:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_inputs_are_fresh_per_case_and_equal_across_calls():
    a, b = Case("full", 32, 32, 2, 1, 16, "float32"), Case("causal", 32, 32, 2, 1, 16, "float32")
    assert np.array_equal(acceptance.inputs(a)["q"], acceptance.inputs(a)["q"])
    assert not np.allclose(acceptance.inputs(a)["q"], acceptance.inputs(b)["q"])


def test_run_case_passes_a_right_impl_and_fails_a_wrong_one(monkeypatch):
    case = Case("causal_document", 40, 40, 2, 1, 16, "float32")
    status, line, _ = acceptance.run_case("torch", "naive", case, None)
    assert status == "ok", line
    assert all(f" {n} " in line for n in ("out", "lse", "dq", "dk", "dv"))

    import torch_attn

    right = torch_attn.attention

    def off_by_a_little(*args, **kwargs):
        out, lse = right(*args, **kwargs)
        return out * 1.01, lse

    monkeypatch.setattr(torch_attn, "attention", off_by_a_little)
    status, line, _ = acceptance.run_case("torch", "naive", case, None)
    assert status == "FAIL" and "out 1.00e-02 > 2e-03" in line, line


def test_run_case_reports_unsupported_with_the_reason():
    status, line, _ = acceptance.run_case(
        "torch", "flash3", Case("full", 40, 40, 2, 1, 16, "float32"), None
    )
    assert status == "unsupported" and line.split("  ")[-1].strip()


def _save(path, dtype, **arrays):
    np.savez(path, **{n: a.astype(np.float32) for n, a in arrays.items()})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("ulps, verdict", [(0, "bitwise"), (1, "out max 1.0 ulp"), (4, " ulp")])
def test_front_end_comparison(tmp_path, ulps, verdict, dtype):
    """The two front ends launch one kernel: ok only when bitwise equal, else FAIL naming the
    quantity, its ulp distance and how many elements differ."""
    import ml_dtypes

    case = Case("full", 8, 8, 1, 1, 16, dtype)
    kind = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    out = np.linspace(1.0, 1.5, 64).astype(kind).astype(np.float32)
    lse = np.random.default_rng(0).standard_normal(8).astype(np.float32)
    eps = float(ml_dtypes.finfo(kind).eps)
    shifted = out.astype(np.float64)
    shifted[::2] *= 1 + ulps * eps
    _save(tmp_path / f"jax_{case.key}.npz", dtype, out=out, lse=lse)
    _save(tmp_path / f"torch_{case.key}.npz", dtype, out=shifted, lse=lse)
    ((status, line, details),) = acceptance.compare_front_ends(str(tmp_path))
    assert status == ("ok" if ulps == 0 else "FAIL") and details["case"] == case.key
    assert verdict in line
    assert line.startswith("ok" if ulps == 0 else "FAIL")
    if ulps:
        assert "(32 of 64 differ)" in line and "lse" not in line


def test_refuses_to_run_without_a_gpu_unless_asked():
    """On a CPU-only machine the command says why it stops, in one line, and exits non-zero."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    script = Path(acceptance.__file__)
    done = subprocess.run(
        [sys.executable, str(script), "--impl=naive"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    lines = [x for x in (done.stdout + done.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and "no CUDA GPU here" in lines[0] and "--allow_cpu" in lines[0]


def _run_command(*args: str, timeout: int = 300):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(acceptance.__file__)
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout
    )


def test_cpu_run_prints_each_case_and_records_it(tmp_path):
    """Through the driver's workers (--allow_cpu, the naive torch impl, two shards): the text
    lines as before, and per case one driver-format record (written by the parent alone) whose
    errors are the printed ones."""
    import json

    done = _run_command("--allow_cpu", "--framework=torch", "--impl=naive", "--torch_workers=2",
                        "--seqlen=48", f"--out_dir={tmp_path}")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert acceptance.RECORD not in done.stdout
    verdicts = ("ok", "FAIL", "ERROR", "unsupported", "documented")
    lines = [x for x in done.stdout.splitlines() if x.startswith(verdicts)]
    want = acceptance.cases("torch", 48, ("naive",)) + acceptance.nan_cases("torch", 48, ("naive",))
    records = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(lines) == len(records) == len(want) > 0
    assert len({r["key"] for r in records}) == len(records)
    assert all(r["status"] == "ok" and r["point"]["impl"] == "naive" for r in records)
    assert all(r["provenance"]["git"]["commit"] for r in records)
    kernels = [r for r in records if r["point"]["section"] == "kernels"]
    assert len(kernels) == len(want) - 1
    for rec in kernels:
        case = Case(*(rec["point"][f.name] for f in dataclasses.fields(Case)))
        (line,) = [x for x in lines if case.label in x and "NaN" not in x]
        for name in acceptance.QUANTITIES:
            assert f" {name} {rec['errors'][name]:.1e} " in line
            assert rec["errors"][name] <= rec["tolerances"][name]


def test_busy_out_dir_is_refused_naming_the_holder(tmp_path):
    from experiments.core.results import locked_out_dir

    with locked_out_dir(tmp_path):
        done = _run_command("--allow_cpu", "--framework=torch", "--impl=naive",
                            f"--out_dir={tmp_path}", timeout=120)  # fmt: skip
    assert done.returncode == 75
    assert "in use by another run" in done.stderr and "PID" in done.stderr
