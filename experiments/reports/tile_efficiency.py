"""The tile-efficiency section of the report: how close each kernel comes, on a mask, to what its
tiles allow, and how it compares with FlexAttention on the same point.

A tiled kernel computes every tile the mask touches, so on a mask its useful TFLOP/s is at best
its full-mask TFLOP/s times the tile bound: the mask's useful area over the area of the
(TILE x TILE) tiles it touches. Efficiency = (TFLOP/s on the mask / TFLOP/s on full, same impl
and shape) / tile bound; 1.0 means partial tiles cost nothing beyond their area.
"""

from __future__ import annotations

import functools

import numpy as np

from experiments.reports.report_parts import md_table

TILE = 128  # the Mosaic kernel's mask tiles (and the block size of Flex's block masks)
FLEX = ("torch", "flex")
HEADER = ("mode", "shape", "framework", "impl", "mask", "seqlen", "TFLOP/s", "full TFLOP/s",
          "tile bound", "efficiency", "vs flex")  # fmt: skip


@functools.cache
def tile_bound(
    mask_name: str, seqlen: int, seed: int, window: int, compat: bool = False, num_masks: int = 1,
    tile: int = TILE,
) -> float:  # fmt: skip
    """Useful area / area of the tiles the masks touch (tiles clipped to the sequence), over
    the point's num_masks draws as the driver makes them."""
    from attn_masks import make_masks

    useful = touched_area = 0.0
    for mask in make_masks(mask_name, seqlen, num_masks, seed=seed, window=window,
                           reference_compat=compat):  # fmt: skip
        touched = mask.block_map(tile, tile) > 0
        rows = np.minimum(tile, mask.seqlen_q - tile * np.arange(touched.shape[0]))
        cols = np.minimum(tile, mask.seqlen_k - tile * np.arange(touched.shape[1]))
        touched_area += float((rows[:, None].astype(np.float64) * cols[None, :])[touched].sum())
        useful += mask.area()
    return useful / touched_area if touched_area else 0.0


def _shape(row: dict) -> str:
    return f"b{row['batch']} h{row['heads_q']}:{row['heads_kv']} d{row['head_dim']} {row['dtype']}"


def _key(row: dict) -> tuple:
    return (row["mode"], _shape(row), row["seqlen_total"])


def efficiency_rows(rows: list[dict]) -> list[list[object]]:
    """One table row per ok kernel point on a mask other than full whose impl also has an ok
    full-mask point of the same mode, shape and length (single device, default configs)."""
    ok = [r for r in rows if r["status"] == "ok" and r["cp"] == "none" and r["tflops"]]
    ok = [r for r in ok if not r["kernel_config"]]  # tuning candidates have their own table
    full = {(r["framework"], r["impl"], *_key(r)): r["tflops"] for r in ok if r["mask"] == "full"}
    flex = {(r["mask"], *_key(r)): r["tflops"] for r in ok if (r["framework"], r["impl"]) == FLEX}
    body = []
    for r in sorted(ok, key=lambda r: (*_key(r), r["framework"], r["impl"], r["mask"])):
        ref = full.get((r["framework"], r["impl"], *_key(r)))
        if r["mask"] == "full" or ref is None:
            continue
        draws = (bool(r["reference_compat"]), int(r["num_masks"] or 1))
        bound = tile_bound(r["mask"], r["seqlen_total"], r["seed"], r["window"], *draws)
        eff = r["tflops"] / ref / bound if bound else float("nan")
        vs = flex.get((r["mask"], *_key(r)))
        mode, shape, seqlen = _key(r)
        body.append([mode, shape, r["framework"], r["impl"], r["mask"], seqlen,
                     f"{r['tflops']:.1f}", f"{ref:.1f}", f"{bound:.3f}", f"{eff:.2f}",
                     f"{r['tflops'] / vs:.2f}x" if vs else "-"])  # fmt: skip
    return body


def section(rows: list[dict]) -> list[str]:
    """The markdown section (nothing when no point has its full-mask reference)."""
    body = efficiency_rows(rows)
    if not body:
        return []
    return [
        "## Tile efficiency",
        "",
        f"Per kernel and mask: TFLOP/s relative to the same kernel on the full mask, divided by "
        f"the {TILE}x{TILE} tile bound (the mask's useful area over the area of the tiles it "
        "touches); 1.0 = partial tiles cost no more than their area. vs flex: TFLOP/s over "
        "torch flex on the same point.",
        "",
        *md_table(HEADER, body),
        "",
    ]
