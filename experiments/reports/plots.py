"""Matplotlib (Agg) figures: TFLOP/s bars per series vs sequence length, and an image grid.

Points that did not produce a number are drawn as a labelled marker where their bar would be
(OOM, unsupported, wrong, error), never as a zero bar.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from matplotlib import image as mpimg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

MARKERS = {
    "oom": ("OOM", "x", "tab:red"),
    "unsupported": ("unsup.", "s", "tab:gray"),
    "wrong": ("WRONG", "X", "tab:purple"),
    "error": ("error", "D", "black"),
}


def seqlen_label(s: int) -> str:
    """A length as people write it: 32768 -> 32K."""
    return f"{s // 1024}K" if s % 1024 == 0 and s >= 1024 else str(s)


def bar_plot(
    rows: list[dict], path: str | Path, *, title: str, xlabel: str = "sequence length"
) -> Path:
    """Grouped TFLOP/s bars (median, p20-p80 whiskers) and a peak-memory panel.

    rows: dicts with series, seqlen, status, tflops (median), tflops_at_p20_time (the faster,
    higher rate), tflops_at_p80_time and peak_mem_gib.
    """
    series = sorted({r["series"] for r in rows})
    seqlens = sorted({r["seqlen"] for r in rows})
    fig = Figure(figsize=(max(6.0, 1.2 * len(seqlens) * max(1, len(series)) / 2.5 + 3), 7.0))
    ax, ax_mem = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    width = 0.8 / max(len(series), 1)
    top = max([r["tflops"] for r in rows if r["status"] == "ok"] or [1.0])
    mem_top = max([r["peak_mem_gib"] or 0.0 for r in rows if r["status"] == "ok"] or [1.0])
    cmap = matplotlib.colormaps["viridis"]
    used_markers = set()
    handles: list = []
    for si, name in enumerate(series):
        color = cmap(si / max(len(series) - 1, 1))
        xs, ys, lo, hi, mx, my = [], [], [], [], [], []
        for r in rows:
            if r["series"] != name:
                continue
            x = seqlens.index(r["seqlen"]) + (si - (len(series) - 1) / 2) * width
            if r["status"] == "ok":
                xs.append(x)
                ys.append(r["tflops"])
                lo.append(max(r["tflops"] - r["tflops_at_p80_time"], 0.0))
                hi.append(max(r["tflops_at_p20_time"] - r["tflops"], 0.0))
                if r.get("peak_mem_gib") is not None:
                    mx.append(x)
                    my.append(r["peak_mem_gib"])
                continue
            text, marker, mcolor = MARKERS.get(r["status"], (r["status"], "o", "black"))
            used_markers.add(r["status"])
            ax.scatter([x], [0.03 * top], marker=marker, color=mcolor, s=50, zorder=3)
            ax.text(
                x, 0.07 * top, text, rotation=90, ha="center", va="bottom", fontsize=8, color=mcolor
            )
        handles.append(Patch(color=color, label=name))
        ax.bar(xs, ys, width=width, color=color, yerr=[lo, hi], capsize=2)
        if mx:
            ax_mem.bar(mx, my, width=width, color=color)
    ax.set_ylim(0, 1.15 * top)
    ax.set_ylabel("TFLOP/s (median; whiskers p20-p80 time)")
    ax.set_title(title)
    for status in sorted(used_markers):
        text, marker, mcolor = MARKERS.get(status, (status, "o", "black"))
        handles.append(
            Line2D([], [], marker=marker, color=mcolor, linestyle="", label=f"{text} ({status})")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax_mem.set_ylim(0, 1.15 * (mem_top or 1.0))
    ax_mem.set_ylabel("peak GiB")
    ax_mem.set_xticks(range(len(seqlens)), [seqlen_label(s) for s in seqlens])
    ax_mem.set_xlabel(xlabel)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def image_grid(paths: list[Path], out: str | Path, *, tile_inches: float = 5.0) -> Path | None:
    """All images in a near-square grid, each scaled into its own cell (any sizes mix)."""
    paths = [Path(p) for p in paths]
    if not paths:
        return None
    cols = math.ceil(math.sqrt(len(paths)))
    rows = math.ceil(len(paths) / cols)
    fig = Figure(figsize=(cols * tile_inches, rows * tile_inches * 0.8))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, p in zip(axes.flat, paths):
        ax.imshow(mpimg.imread(str(p)))
        ax.set_title(p.stem, fontsize=8)
    out = Path(out)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    return out


def ratio_heatmap(panels: dict[str, list[dict]], path: str | Path, *, title: str) -> Path:
    """One panel per key: rows x columns of cells (dicts with row, col, ratio or None, label),
    coloured by the ratio on a log scale centred at 1 (red below, blue above) and labelled;
    a cell without a ratio is grey with its label, never coloured as a value. The panels share
    their rows, named once at the left."""
    from matplotlib.colors import LogNorm

    names = list(panels)
    rows = sorted(_axis(panels, "row"))
    fig = Figure(figsize=(5.0 * len(names) + 2.0, 0.55 * max(len(rows), 4) + 2.0))
    axes = fig.subplots(1, len(names), squeeze=False, gridspec_kw={"wspace": 0.05})[0]
    ratios = [c["ratio"] for cells in panels.values() for c in cells if c["ratio"]]
    span = max([abs(math.log(r)) for r in ratios] or [0.1], default=0.1) or 0.1
    norm = LogNorm(math.exp(-span), math.exp(span))
    cmap = matplotlib.colormaps["RdBu"]
    image = None
    for ax, name in zip(axes, names):
        cols = sorted({c["col"] for c in panels[name]})
        grid = [[float("nan")] * len(cols) for _ in rows]
        for c in panels[name]:
            i, j = rows.index(c["row"]), cols.index(c["col"])
            if c["ratio"]:
                grid[i][j] = c["ratio"]
            else:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, color="0.85"))
            dark = c["ratio"] and abs(math.log(c["ratio"])) > 0.6 * span
            ax.text(
                j,
                i,
                c["label"],
                ha="center",
                va="center",
                fontsize=7,
                color="white" if dark else "black",
            )
        image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
        ax.set_xticks(range(len(cols)), [seqlen_label(c) for c in cols])
        ax.set_yticks(range(len(rows)), rows if ax is axes[0] else [])
        ax.set_title(name, fontsize=9)
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes), shrink=0.8, label="ratio (log scale)")
        ticks = [math.exp(span * f) for f in (-1, -0.5, 0, 0.5, 1)]
        bar.ax.yaxis.set_ticks(ticks, [f"{t:.2f}x" for t in ticks])
        bar.ax.yaxis.set_ticks([], minor=True)
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def ratio_scatter(
    x: list[float], ratio: list[float], path: str | Path, *, title: str, xlabel: str, band: float,
    ylim: tuple[float, float] | None = None,
) -> Path:  # fmt: skip
    """Ratios (e.g. predicted over measured) against x on a log axis, with the ratio 1 and a
    band of +-band around it, where a person sees at once which points miss and where (ylim:
    one range for panels meant to be compared)."""
    fig = Figure(figsize=(7.0, 4.5))
    ax = fig.subplots()
    ax.axhspan(1 - band, 1 + band, color="tab:green", alpha=0.15, label=f"within {band:.0%}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.scatter(x, ratio, s=14, color="tab:blue", zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("predicted / measured")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def _axis(panels: dict[str, list[dict]], name: str) -> set:
    return {c[name] for cells in panels.values() for c in cells}
