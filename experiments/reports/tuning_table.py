"""The tuning section of the report: per (mode, shape, mask, length) the fastest candidate of the
Pallas tuning sweep next to the library's default config."""

from __future__ import annotations

from collections import defaultdict

from experiments.core.tuning import DEFAULT
from experiments.reports.report_parts import md_table

HEADER = ("mode", "config", "mask", "seqlen", "best", "TFLOP/s", "default TFLOP/s", "ok of")


def _config(row: dict) -> str:
    return f"b{row['batch']} h{row['heads_q']}:{row['heads_kv']} d{row['head_dim']} {row['dtype']}"


def best_rows(rows: list[dict]) -> list[list[object]]:
    """One table row per tuned point: best candidate by median TFLOP/s, and the default's."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["kernel_config"]:
            groups[(r["mode"], _config(r), r["mask"], r["seqlen_total"])].append(r)
    body = []
    for key, members in sorted(groups.items()):
        ok = [r for r in members if r["status"] == "ok"]
        best = max(ok, key=lambda r: r["tflops"]) if ok else None
        default = next((r for r in ok if r["kernel_config"] == DEFAULT), None)
        body.append(
            [
                *key,
                best["kernel_config"] if best else "-",
                f"{best['tflops']:.1f}" if best else "-",
                f"{default['tflops']:.1f}" if default else "-",
                f"{len(ok)}/{len(members)}",
            ]
        )
    return body


def section(rows: list[dict]) -> list[str]:
    """The markdown section, or nothing without tuned points."""
    body = best_rows(rows)
    if not body:
        return []
    intro = "Fastest launch config of the Pallas kernel per point (every candidate checked first)."
    return ["## Pallas tuning", "", intro, ""] + md_table(HEADER, body) + [""]
