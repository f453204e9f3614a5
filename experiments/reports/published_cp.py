"""The published study's context-parallel figures beside this predictor's numbers.

The published figures are LongCA-bench's (arXiv 2510.17896, its context-parallel section): 8K
tokens a GPU (weak scaling), Hq = 64, Hkv = 8, D = 128, bf16, forward, on 8-64 H100s with
FlashAttention-3 as the local kernel. The paper draws them as plots; the ranges below are read
off those plots, so they are approximate. Ours are per-GPU TFLOP/s predicted from one GPU with
this project's kernel, so the efficiency against one GPU is the comparable number.
"""

from __future__ import annotations

import dataclasses

from experiments.reports import report_cp
from experiments.reports.report_parts import md_table

SOURCE = (
    "LongCA-bench (arXiv 2510.17896), context-parallel figures, 8-64 H100s, FlashAttention-3 "
    "local kernel; ranges read off the plots (approximate)"
)
TOKENS_PER_GPU = 8192
SHAPE = {"heads_q": 64, "heads_kv": 8, "head_dim": 128, "dtype": "bf16"}
GPUS = (8, 16, 32, 64)
# The layout each published strategy runs: the paper's ring, all-gather and USP split the
# sequence zigzag (per document); Ulysses splits heads, so its layout does not matter.
PAPER_LAYOUT = {"ring": "zigzag", "allgather": "zigzag", "usp": "zigzag", "ulysses": "contiguous"}


@dataclasses.dataclass(frozen=True)
class Published:
    """One published figure: a range of per-GPU TFLOP/s (and efficiency against one GPU, where
    the paper gives it) over some strategies, masks and device counts."""

    masks: tuple[str, ...]
    mode: str
    strategies: tuple[str, ...]
    gpus: tuple[int, ...]
    tflops: tuple[float, float]
    efficiency_pct: tuple[float, float] | None = None

    def text(self) -> str:
        lo, hi = self.tflops
        out = f"{lo:.0f}" if lo == hi else f"{lo:.0f}-{hi:.0f}"
        if self.efficiency_pct:
            e_lo, e_hi = self.efficiency_pct
            out += f" ({e_lo:.0f}-{e_hi:.0f}%)"
        return f"~{out} at {','.join(map(str, self.gpus))} GPUs"


PUBLISHED = (
    Published(("causal",), "fwd", ("ulysses", "allgather", "usp"), GPUS, (580, 607), (85, 90)),
    Published(("causal",), "fwd", ("ring",), GPUS, (427, 460)),
    Published(("causal_document", "full_document"), "fwd", ("ring",), (64,), (30, 30)),
)


def _comparable(row: dict) -> bool:
    return row["tokens_per_gpu"] == TOKENS_PER_GPU and all(row[k] == v for k, v in SHAPE.items())


def _ours(row: dict | None) -> str:
    """Our predicted per-GPU TFLOP/s and efficiency, the status label, or 'not run'."""
    if row is None:
        return "not run"
    if row["status"] != "ok":
        return report_cp.label(row)
    eff = row["efficiency_pct"]
    return f"{row['tflops_per_gpu']:.3g}" + (f" ({eff:.0f}%)" if eff is not None else "")


def reference_lines(row: dict) -> dict[str, list[tuple[float, float]]]:
    """Dashed lines for a scaling plot of row's (mask, mode, setting): each matching published
    figure at the middle of its range over its device counts; none for another setting."""
    if not _comparable(row):
        return {}
    return {
        f"published, H100: {'/'.join(f.strategies)} {f.text()}": [
            (n, sum(f.tflops) / 2) for n in f.gpus
        ]
        for f in PUBLISHED
        if row["mask"] in f.masks and row["mode"] == f.mode
    }


def table(rows: list[dict]) -> list[str]:
    """Markdown: per published figure and matching (mask, strategy), the published range and
    our prediction at 8, 16, 32 and 64 GPUs in the paper's layout; empty when no simulated
    point has the published setting."""
    rows = [r for r in rows if _comparable(r)]
    if not rows:
        return []
    by_key = {
        (r["mask"], r["mode"], r["strategy"], r["layout"], r["num_gpus"], r["impl"]): r
        for r in rows
    }
    lines = [
        "### Beside the published study",
        "",
        f"Published: {SOURCE}. Ours: predicted per-GPU TFLOP/s on this machine's GPU with "
        "this project's kernel (efficiency against the whole mask on one GPU in brackets), in "
        "the paper's layout (zigzag; Ulysses contiguous); the efficiencies are the comparable "
        "numbers across the two GPUs and kernels.",
        "",
    ]
    body = []
    for impl in sorted({r["impl"] for r in rows}):
        for fig in PUBLISHED:
            for mask in fig.masks:
                for strategy in fig.strategies:
                    layout = PAPER_LAYOUT[strategy]
                    ours = [
                        _ours(by_key.get((mask, fig.mode, strategy, layout, n, impl))) for n in GPUS
                    ]
                    body.append([mask, fig.mode, f"{strategy}/{layout}", impl, fig.text(), *ours])
    header = ["mask", "mode", "strategy/layout", "impl", "published (H100)"]
    return [*lines, *md_table([*header, *(f"ours, {n} GPUs" for n in GPUS)], body), ""]
