"""The report's table of the published study's CP figures beside the predictor's numbers."""

from __future__ import annotations

from experiments.reports import published_cp, report_sim


def _row(strategy, layout, gpus, *, mask="causal", tflops=300.0, eff=70.0, **over):
    row = dict.fromkeys(report_sim.COLUMNS)
    row.update(
        mask=mask,
        mode="fwd",
        strategy=strategy,
        layout=layout,
        num_gpus=gpus,
        framework="jax",
        impl="default",
        link="g8",
        tokens_per_gpu=8192,
        heads_q=64,
        heads_kv=8,
        head_dim=128,
        dtype="bf16",
        status="ok",
        tflops_per_gpu=tflops,
        efficiency_pct=eff,
    )
    row.update(over)
    return row


def _cells(lines, mask, strategy_layout, link="g8"):
    """The four per-GPU cells of the table row for (mask, strategy/layout)."""
    start = f"| {mask} | fwd | {strategy_layout} | jax | default | {link} |"
    (line,) = [ln for ln in lines if ln.startswith(start)]
    return [c.strip() for c in line.strip("|").split("|")][7:]


def test_ours_in_the_papers_layout_at_each_gpu_count():
    rows = [
        _row("ring", "zigzag", 8, tflops=347.0, eff=76.0),
        _row("ring", "zigzag", 64, tflops=201.5, eff=None),
        _row("ring", "contiguous", 16, tflops=999.0),  # not the paper's layout: left out
        _row("ring", "zigzag", 32, tokens_per_gpu=32768, tflops=888.0),  # another setting
        _row("ring", "zigzag", 16, heads_kv=64, tflops=777.0),  # another shape
        _row("ulysses", "contiguous", 32, status="unsupported", tflops=None),
        _row("ring", "zigzag", 64, mask="causal_document", tflops=12.25, eff=3.0),
    ]
    lines = published_cp.table(rows, report_sim._cell)
    assert lines[0] == "### Beside the published study"
    assert published_cp.SOURCE in lines[2]
    want = ["347 (76%)", "not run", "not run", "202 (eff. n/a)"]
    assert _cells(lines, "causal", "ring/zigzag") == want
    assert _cells(lines, "causal", "ulysses/contiguous") == [
        "not run",
        "not run",
        "unsup.",
        "not run",
    ]
    assert _cells(lines, "causal_document", "ring/zigzag")[3] == "12.2 (3%)"
    (ring,) = [ln for ln in lines if "| causal | fwd | ring/zigzag |" in ln]
    assert "~427-460 at 8,16,32,64 GPUs" in ring
    assert not any(s in "".join(lines) for s in ("999", "888", "777"))


def test_every_published_figure_has_a_row_and_no_table_without_the_setting():
    cell = report_sim._cell
    lines = published_cp.table([_row("ring", "zigzag", 8)], cell)
    expected = sum(len(f.masks) * len(f.strategies) for f in published_cp.PUBLISHED)
    assert sum(ln.startswith("| ") and "| default |" in ln for ln in lines) == expected
    assert published_cp.table([_row("ring", "zigzag", 8, dtype="fp32")], cell) == []
    assert published_cp.table([], cell) == []


def test_each_link_model_and_a_capped_baseline_keep_their_own_cells():
    """Points of two link models stay apart (neither overwrites the other), and an efficiency
    against the capped baseline is marked as in the report's tables."""
    rows = [
        _row("ring", "zigzag", 8, tflops=347.0, eff=76.0),
        _row("ring", "zigzag", 8, tflops=301.0, eff=66.0, link="g4"),
        _row("ring", "zigzag", 32, tflops=250.0, eff=55.0, single_gpu_status="scaled"),
    ]
    lines = published_cp.table(rows, report_sim._cell)
    assert _cells(lines, "causal", "ring/zigzag")[::2] == ["347 (76%)", "250 (55%*)"]
    assert _cells(lines, "causal", "ring/zigzag", link="g4")[0] == "301 (66%)"


def test_plot_lines_at_the_middle_of_each_published_range():
    lines = published_cp.reference_lines(_row("ring", "zigzag", 8))
    assert lines == {
        "published, H100: ulysses/allgather/usp ~580-607 (85-90%) at 8,16,32,64 GPUs": [
            (n, 593.5) for n in (8, 16, 32, 64)
        ],
        "published, H100: ring ~427-460 at 8,16,32,64 GPUs": [(n, 443.5) for n in (8, 16, 32, 64)],
    }
    (doc,) = published_cp.reference_lines(_row("ring", "zigzag", 8, mask="full_document")).values()
    assert doc == [(64, 30.0)]
    assert published_cp.reference_lines(_row("ring", "zigzag", 8, mask="full")) == {}
    assert published_cp.reference_lines(_row("ring", "zigzag", 8, mode="fwd_bwd")) == {}
    assert published_cp.reference_lines(_row("ring", "zigzag", 8, tokens_per_gpu=32768)) == {}
