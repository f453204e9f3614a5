"""The published study's context-parallel figures beside this predictor's numbers.

The published figures are LongCA-bench's (arXiv 2510.17896, its context-parallel section): 8K
tokens a GPU (weak scaling), Hq = 64, Hkv = 8, D = 128, bf16, forward, on 8-64 H100s with
FlashAttention-3 as the local kernel. The paper draws them as plots; the ranges below are read
off those plots, so they are approximate. Ours are per-GPU TFLOP/s predicted from one GPU with
this project's kernel, so the efficiency against one GPU is the comparable number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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


def reference_lines(row: dict) -> dict[str, list[tuple[float, float]]]:
    """Reference lines for a scaling plot of row's (mask, mode, setting): each matching
    published figure at the middle of its range over its device counts; none for another
    setting."""
    if not _comparable(row):
        return {}
    return {
        f"published, H100: {'/'.join(f.strategies)} {f.text()}": [
            (n, sum(f.tflops) / 2) for n in f.gpus
        ]
        for f in PUBLISHED
        if row["mask"] in f.masks and row["mode"] == f.mode
    }


def table(rows: list[dict], cell: Callable[[dict], str]) -> list[str]:
    """Markdown: per published figure and matching (mask, strategy), the published range and
    our prediction at 8, 16, 32 and 64 GPUs in the paper's layout (`cell` of its row, 'not
    run' without one), per framework, impl and link model; empty when no simulated point has
    the published setting."""
    rows = [r for r in rows if _comparable(r)]
    if not rows:
        return []
    setting = ("framework", "impl", "link")
    by_key = {
        (
            *(r[k] for k in setting),
            r["mask"],
            r["mode"],
            r["strategy"],
            r["layout"],
            r["num_gpus"],
        ): r
        for r in rows
    }
    lines = [
        "### Beside the published study",
        "",
        f"Published: {SOURCE}. Ours: predicted per-GPU TFLOP/s on this machine's GPU with "
        "this project's kernel (efficiency in brackets, as in the tables above), in the "
        "paper's layout (zigzag; Ulysses contiguous); the efficiencies are the comparable "
        "numbers across the two GPUs and kernels.",
        "",
    ]
    body = []
    for fw, impl, link in sorted({tuple(r[k] for k in setting) for r in rows}):
        for fig in PUBLISHED:
            for mask in fig.masks:
                for strategy in fig.strategies:
                    layout = PAPER_LAYOUT[strategy]
                    at = [
                        by_key.get((fw, impl, link, mask, fig.mode, strategy, layout, n))
                        for n in GPUS
                    ]
                    ours = ["not run" if r is None else cell(r) for r in at]
                    body.append(
                        [mask, fig.mode, f"{strategy}/{layout}", fw, impl, link, fig.text(), *ours]
                    )
    header = ["mask", "mode", "strategy/layout", "framework", "impl", "link", "published (H100)"]
    return [*lines, *md_table([*header, *(f"ours, {n} GPUs" for n in GPUS)], body), ""]
