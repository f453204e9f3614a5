"""PyTorch context parallelism on 4 gloo CPU processes against the float64 oracle.

The workers (tests/torch_cp_worker.py) are launched once, as plain processes with torchrun's
environment variables, and loop over every strategy x layout x mask (MHA and GQA, with and without
the LSE in the loss, a few bf16 cases); each rank checks its global out/lse/dq/dk/dv and compares
the bytes it sent with the plan's comm_volume. This file only launches them and reads the results.
CP_TEST_FILTER=<substring of a case name> runs only the matching cases (for debugging).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
from gloo_ranks import launch

WORLD = 4
TIMEOUT_S = 300
WORKER = Path(__file__).with_name("torch_cp_worker.py")


def _problems(lines: list[dict]) -> list[str]:
    """Every way the workers' records fall short: missing ranks, errors, bytes, jax, messages."""
    from torch_cp_worker import BAD_HEADS, GROUP_SIZE, TOL, cases

    bad = []
    done = [x for x in lines if x.get("done")]
    if len(done) != WORLD or any(x["jax"] for x in done):
        bad.append(f"workers finished: {done} (all {WORLD}, none with jax imported)")
    for heads, phrase in BAD_HEADS:
        errors = [x["error"] for x in lines if x.get("bad_heads") == list(heads)]
        if len(errors) != WORLD or not all(phrase in e for e in errors):
            bad.append(f"heads {heads}: expected {phrase!r} on every rank, got {errors}")
    per_case: dict[str, list[dict]] = {}
    for x in lines:
        if "case" in x:
            per_case.setdefault(x["case"], []).append(x)
    for case in cases():
        if os.environ.get("CP_TEST_FILTER", "") not in case.name:
            continue
        recs = per_case.get(case.name, [])
        if len(recs) != GROUP_SIZE[case.group]:
            bad.append(f"{case.name}: {len(recs)} of {GROUP_SIZE[case.group]} ranks reported")
        for rec in recs:
            if "exception" in rec:
                bad.append(f"{case.name} rank {rec['rank']}: {rec['exception']}")
                continue
            over = {k: e for k, e in rec["errors"].items() if not e <= TOL[case.dtype][k]}
            if over:
                bad.append(f"{case.name} rank {rec['rank']}: errors {over}")
            if rec["sent"] != rec["plan"]:
                bad.append(f"{case.name} rank {rec['rank']}: sent {rec['sent']} plan {rec['plan']}")
    return bad


def test_slurm_variables_become_torchrun_ones():
    from shard_strategies.torch_cp._launch import from_slurm

    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "n1"}
    from_slurm(env)
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "n1" and env["MASTER_PORT"] == "29500"


def test_workers_run_every_layout_of_the_project():
    """The workers take the layouts from shard_strategies, so a new layout is tested too."""
    import torch_cp_worker

    import shard_strategies

    assert torch_cp_worker.LAYOUTS is shard_strategies.LAYOUTS
    assert {case.layout for case in torch_cp_worker.cases()} == set(shard_strategies.LAYOUTS)


def test_workers_leave_out_only_generators_that_build_another_ones_masks():
    """The generators the workers skip build, from the document lengths the workers give, the
    same slices as the generator that runs in their place (only the name differs)."""
    import torch_cp_worker

    from attn_masks import MASK_NAMES

    assert set(torch_cp_worker.GENERATORS) | set(torch_cp_worker.SAME_AS) == set(MASK_NAMES)
    for seed in range(5):
        for skipped, kept in torch_cp_worker.SAME_AS.items():
            a, b = (torch_cp_worker.build_mask(name, seed) for name in (skipped, kept))
            assert a.name == skipped and (a.seqlen_q, a.seqlen_k) == (b.seqlen_q, b.seqlen_k)
            for x, y in zip(a.slices, b.slices):
                np.testing.assert_array_equal(x, y, err_msg=f"{skipped}, seed {seed}")


def test_torch_cp_against_the_oracle_and_the_plan(tmp_path):
    """One launch (so pytest-xdist never starts two process groups) checks every case."""
    seed = random.randrange(1 << 30)
    lines = launch(WORKER, WORLD, tmp_path, {"CP_TEST_SEED": str(seed)}, TIMEOUT_S)
    bad = _problems(lines)
    assert not bad, f"seed {seed}: {len(bad)} failures\n" + "\n".join(bad[:40])
