"""Assertions on measured CP records shared by the JAX and PyTorch driver tests."""

from __future__ import annotations


def assert_checked_with_dispatch(rec: dict, iters: int) -> None:
    """An ok fwd_bwd CP record: its full float64 check of out, dq, dk, dv (global order) passed,
    and the dispatch of q, k, v was timed apart (`iters` calls) as dispatch_ms."""
    assert rec["status"] == "ok", (rec["reason"], rec["traceback"])
    check = rec["check"]
    assert check["ok"] and check["kind"] == "full"
    assert set(check["max_errors"]) == {"out", "dq", "dk", "dv"}
    dispatch = rec["metrics"]["dispatch_ms"]
    assert 0 < dispatch["p20"] <= dispatch["median"] <= dispatch["p80"]
    assert rec["masks"][0]["dispatch_ms"]["n"] == iters
