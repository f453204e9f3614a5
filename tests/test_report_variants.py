"""The mosaic_variants report: speeds from the records' own times, non-ok variants labelled."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.reports.report_variants import write_report


def _record(variant, status, ms, base_ms, config):
    rec = dict(mask="causal", seqlen=32768, heads="64:8", head_dim=128, dtype="bf16",
               mode="fwd_bwd", variant=variant, status=status, config=config)  # fmt: skip
    if status == "ok":
        rec.update(time_ms={"median": ms}, tflops={"median": 1e3 / ms},
                   time_vs_baseline=ms / base_ms)  # fmt: skip
    return rec


def test_report_speeds_match_the_times_and_failures_are_labelled(tmp_path):
    rng = np.random.default_rng()
    base_ms, ws_ms = rng.uniform(50, 200, size=2)
    rows = [
        _record("cudnn", "ok", base_ms, base_ms, None),
        _record("ws", "ok", ws_ms, base_ms, {"block_k": 128, "bwd_warpgroups": 2}),
        _record("fused", "wrong", None, base_ms, {"block_k": 128, "fused_bwd": True}),
    ]
    (tmp_path / "run1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(tmp_path).read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("| run1 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "causal 32K 64:8 d128 fwd_bwd"
    assert cells[2] == f"{1e3 / base_ms:.0f}"
    assert cells[3] == f"{1e3 / ws_ms:.0f} ({base_ms / ws_ms:.2f}x)"
    assert cells[4] == "WRONG"
    assert "| run1 | ws | 128 | bwd_warpgroups=2 |" in text
    assert "| run1 | fused | 128 | fused_bwd=True |" in text
    png = tmp_path / "speed.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_records_of_removed_options_are_reported(tmp_path):
    """Records keep the config they ran with: a field KernelConfig has since lost is named where
    it was set and left out where it was off, and the report still renders."""
    rng = np.random.default_rng()
    base_ms, a_ms, b_ms = rng.uniform(50, 200, size=3)
    rows = [
        _record("cudnn", "ok", base_ms, base_ms, None),
        _record("gone", "ok", a_ms, base_ms, {"block_k": 128, "bwd_gone_knob": True}),
        _record("off", "ok", b_ms, base_ms, {"block_k": 128, "bwd_gone_knob": False}),
    ]
    (tmp_path / "run2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(tmp_path).read_text()
    assert "| run2 | gone | 128 | bwd_gone_knob=True (option since removed) |" in text
    assert "| run2 | off | 128 | as KernelConfig() |" in text


def test_variants_are_described_against_their_runs_default(tmp_path):
    """A variant's config column names what it changes on top of its run's `default` variant
    at the same head dim (the defaults when it ran); the default itself, and a head dim with no
    default in the run, against KernelConfig()."""
    rng = np.random.default_rng()
    base_ms, *ms = rng.uniform(50, 200, size=5)
    default = {"block_k": 128, "bwd_warpgroups": 2, "consumer_registers": 240}
    rows = [
        _record("cudnn", "ok", base_ms, base_ms, None),
        _record("default", "ok", ms[0], base_ms, default),
        _record("fused", "ok", ms[1], base_ms, {**default, "fused_bwd": True}),
        _record("same", "ok", ms[2], base_ms, dict(default)),
        {**_record("fused", "ok", ms[3], base_ms, {**default, "fused_bwd": True}), "head_dim": 64},
    ]
    (tmp_path / "run3.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(tmp_path).read_text()
    assert "| run3 | default | 128 | bwd_warpgroups=2, consumer_registers=240 |" in text
    assert "| run3 | fused | 128 | fused_bwd=True |" in text
    assert "| run3 | same | 128 | as the run's default |" in text
    vs_kernel_config = "bwd_warpgroups=2, consumer_registers=240, fused_bwd=True"
    assert f"| run3 | fused | 64 | {vs_kernel_config} |" in text


def test_empty_folder_names_itself(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        write_report(tmp_path)
