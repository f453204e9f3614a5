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
        impl="default",
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


def _cells(lines, mask, strategy_layout):
    """The four per-GPU cells of the table row for (mask, strategy/layout)."""
    (line,) = [
        ln for ln in lines if ln.startswith(f"| {mask} | fwd | {strategy_layout} | default |")
    ]
    return [c.strip() for c in line.strip("|").split("|")][5:]


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
    lines = published_cp.table(rows)
    assert lines[0] == "### Beside the published study"
    assert published_cp.SOURCE in lines[2]
    assert _cells(lines, "causal", "ring/zigzag") == ["347 (76%)", "not run", "not run", "202"]
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
    lines = published_cp.table([_row("ring", "zigzag", 8)])
    expected = sum(len(f.masks) * len(f.strategies) for f in published_cp.PUBLISHED)
    assert sum(ln.startswith("| ") and "| default |" in ln for ln in lines) == expected
    assert published_cp.table([_row("ring", "zigzag", 8, dtype="fp32")]) == []
    assert published_cp.table([]) == []


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
