"""The tune_pallas preset's candidate space and the report's tuning table (also on records of
the former tuning script)."""

from __future__ import annotations

import json

import pytest

from experiments.core import tuning
from experiments.reports import report

pytest.importorskip("jax")


def test_fused_head_to_head_times_the_default_variants_only():
    space = (
        "block_q=128 block_k=128 num_warps=4 num_stages=2 fwd_block_k=64 num_warps_bwd=8 "
        "num_stages_bwd=2 bwd_splits=2 fused_bwd=0,1 relaxed_atomics=0,1"
    )
    names = tuning.candidate_names(space, "fwd_bwd", 128, "bfloat16")
    assert names == ("default", "default-fused", "default-fused-relaxed")


def test_names_rebuild_their_configs():
    names = tuning.candidate_names(tuning.DEFAULT_SPACE, "fwd_bwd", 128, "bfloat16")
    assert len(set(names)) == len(names) > 8
    built = {tuning.candidate(n, 128, "bfloat16") for n in names}
    assert len(built) == len(names)
    block_q, block_k, config = tuning.candidate("q64k128w8s3x2", 128, "bfloat16")
    assert (block_q, block_k, config.num_warps, config.num_stages) == (64, 128, 8, 3)
    assert (config.block_q_dkv, config.block_k_dq) == (32, 64)
    fwd = tuning.candidate_names(tuning.DEFAULT_SPACE, "fwd", 128, "bfloat16")
    assert all(n.endswith("x1") for n in fwd[:-1]) and fwd[-1] == "default"


def test_bad_space_is_named():
    with pytest.raises(ValueError, match="block_x"):
        tuning.parse_space("block_x=64")


def test_report_reads_former_tuning_records(tmp_path):
    common = {"mode": "fwd", "mask": "causal", "seqlen": 8192, "batch": 1, "heads_q": 64}
    common.update(heads_kv=8, head_dim=128, dtype="bfloat16", jax="0.11.2", errors={"out": 1e-3})
    lines = [
        {**common, "candidate": "q128k64w4s2x1", "ms": 2.0, "tflops": 400.0, "status": "ok"},
        {**common, "candidate": "default", "ms": 3.0, "tflops": 300.0, "status": "ok"},
        {**common, "candidate": "q64k64w4s2x1", "status": "error", "error": "boom"},
    ]
    path = tmp_path / "tune.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    md = report.write_report(path, tmp_path / "rep")["markdown"].read_text()
    table = md.split("## Pallas tuning", 1)[1].split("\n## ", 1)[0]
    (row,) = [ln for ln in table.splitlines() if ln.startswith("| fwd")]
    assert [c.strip() for c in row.strip("|").split("|")][4:] == [
        "q128k64w4s2x1",
        "400.0",
        "300.0",
        "2/3",
    ]
