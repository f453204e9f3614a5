"""Measured torch CP points (2 gloo CPU ranks, the driver's TorchRunner) time shard_attention on
shards dispatched once: the dispatch is timed apart (dispatch_ms), the float64 check still
compares global-order results, the timed call sends only the strategy's bytes, and a wrong
shard result makes the point wrong with nothing timed."""

from __future__ import annotations

from pathlib import Path

import pytest
from cp_records import assert_checked_with_dispatch
from gloo_ranks import launch
from torch_driver_worker import ITERS, WORLD

WORKER = Path(__file__).with_name("torch_driver_worker.py")
TIMEOUT_S = 120
STRATEGIES = ("ring", "allgather")


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> list[dict]:
    """Every JSON line of one launch of the workers (all cases share one process group)."""
    found = launch(WORKER, WORLD, tmp_path_factory.mktemp("ranks"), {}, TIMEOUT_S)
    done = [x for x in found if x.get("done")]
    assert len(done) == WORLD and not any(x["jax"] for x in done), done
    return found


def _case(lines: list[dict], name: str) -> list[dict]:
    """The case's line of every rank, by rank."""
    return sorted((x for x in lines if x.get("case") == name), key=lambda x: x["rank"])


@pytest.mark.parametrize("cp", STRATEGIES)
def test_point_checks_global_order_and_records_dispatch(lines, cp):
    rec = _case(lines, cp)[0]["record"]  # rank 0's: the one the driver writes
    assert_checked_with_dispatch(rec, ITERS)
    assert len(rec["masks"][0]["rank_median_ms"]) == WORLD


@pytest.mark.parametrize("cp", STRATEGIES)
def test_timed_call_sends_only_what_the_strategy_needs(lines, cp):
    """On every rank one timed call sends the plan's forward and backward bytes and nothing into
    or out of the layout (no all-gather of the output or the gradients); the dispatch, a
    slice of replicated inputs, sends nothing."""
    for line in _case(lines, cp):
        attention, *dispatch = line["sent"]  # the attention's timed fn, then the dispatch's
        comm = line["record"]["masks"][0]["comm"]
        assert attention == {
            "fwd": comm["fwd_bytes"],
            "bwd": comm["bwd_bytes"],
            "dispatch": 0,
            "lse": 0,
        }, (line["rank"], comm)
        assert attention["fwd"] > 0 and dispatch == [dict.fromkeys(attention, 0)], dispatch


def test_wrong_shard_result_is_wrong_not_a_speed(lines):
    """shard_attention off by 1%: the point is 'wrong' on every rank and nothing is timed (a
    timed call would have made it an error)."""
    for line in _case(lines, "wrong"):
        rec = line["record"]
        assert rec["status"] == "wrong" and rec["metrics"] is None, rec["reason"]
        assert "out" in rec["reason"] and not rec["check"]["ok"], rec["reason"]
