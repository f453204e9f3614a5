"""Framework-neutral launch plans for triton_attn.kernels: tiles, warps, grids and mask tables.

Both front ends (torch_attn.triton, jax_attn.adapters.triton) build the same `Call` for a
kernel (grid, runtime scalars, constexprs, warps, stages) and the same numpy `MaskTables` (one
attn_masks.PassTiles per kernel pass); they differ only in how they hand arrays to the kernel.
The kernels' limits (head dims, dtypes, compute capability) are stated here, and both front ends
ask `check`. Imports numpy and attn_masks only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from attn_masks import Mask, PassTiles, pass_tiles

MIN_HEAD_DIM, MAX_HEAD_DIM = 32, 256
DTYPES = ("bfloat16", "float16", "float32")
MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class KernelConfig:
    """One kernel's tile (block_q query rows x block_k keys), warps and pipeline stages."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class KernelConfigs:
    """The launch configs of the forward and of the backward's dK/dV and dQ programs (dQ takes
    dK/dV's when not given)."""

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig | None = None

    def __post_init__(self) -> None:
        """Give dQ the dK/dV config when it has none of its own; the two share one launch, so
        their warps and stages must agree."""
        if self.dq is None:
            object.__setattr__(self, "dq", self.dkdv)
        mine = (self.dq.num_warps, self.dq.num_stages)
        theirs = (self.dkdv.num_warps, self.dkdv.num_stages)
        if mine != theirs:
            raise ValueError(
                f"dQ and dK/dV run in one launch: dQ's (num_warps, num_stages) {mine} must "
                f"equal dK/dV's {theirs}"
            )


@dataclass(frozen=True)
class Shape:
    """Problem sizes: q (batch, seqlen_q, heads_q, head_dim), k/v (batch, seqlen_k, heads_kv, .)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int


@dataclass(frozen=True)
class MaskTables:
    """Everything the kernels read about a mask for given KernelConfigs.

    lo/hi (Sq, K) int32 key intervals per row; fwd, dq, dkdv: each pass's tiles in its kernel's
    tile sizes, with int32 full flags (1 = unmasked).
    """

    lo: np.ndarray
    hi: np.ndarray
    fwd: PassTiles
    dq: PassTiles
    dkdv: PassTiles
    configs: KernelConfigs

    @property
    def num_intervals(self) -> int:
        return int(self.lo.shape[1])


@dataclass(frozen=True)
class Call:
    """One kernel launch: grid, runtime scalars (after the arrays), constexprs, warps, stages."""

    grid: tuple[int, int]
    scalars: tuple[Any, ...]
    meta: dict[str, Any]
    num_warps: int
    num_stages: int


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def block_d(head_dim: int) -> int:
    """Head dim padded to the power of two the kernels use (at least 32)."""
    return max(32, 1 << (int(head_dim) - 1).bit_length())


def check(head_dim: int | None, dtype: str | None) -> str | None:
    """Why the kernels cannot take this head dim / dtype name, or None (None inputs unchecked)."""
    if dtype is not None and dtype not in DTYPES:
        return f"triton takes bfloat16, float16 or float32, got {dtype}"
    if head_dim is not None and not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return f"triton needs {MIN_HEAD_DIM} <= head_dim <= {MAX_HEAD_DIM}, got {head_dim}"
    return None


# (padded head dim, fp32) -> (forward, dK/dV, dQ) as (block_q, block_k, num_warps, num_stages).
# Half precision D=128: the fastest of each kernel timed on an H200 (experiments/triton_tiles.py,
# triton 3.6; its dK/dV ran 2.2-2.6x the 64x64 w8 s1 config; under triton 3.9 none spills).
# Elsewhere: the largest tiles that ptxas compiles for sm_90 without register spills, or the
# least spilling where none is spill-free (D=256 dK/dV and dQ, fp32 D=64 dK/dV). Data in
# triton_attn/NOTES.md. Register use depends on the compiler: measured with this Triton release.
# dK/dV and dQ share one backward launch, so dQ takes dK/dV's warps and stages.
TUNED_WITH_TRITON = "3.9"
_DEFAULTS: dict[tuple[int, bool], tuple[tuple[int, int, int, int], ...]] = {
    (64, False): ((128, 64, 8, 3), (64, 128, 8, 2), (128, 64, 8, 2)),
    (128, False): ((128, 64, 8, 3), (64, 128, 8, 3), (128, 64, 8, 3)),
    (256, False): ((32, 32, 8, 1), (32, 32, 8, 1), (32, 32, 8, 1)),
    (64, True): ((128, 32, 8, 1), (32, 32, 8, 1), (64, 32, 8, 1)),
    (128, True): ((64, 32, 8, 1), (32, 64, 8, 1), (32, 64, 8, 1)),
    (256, True): ((32, 32, 8, 1), (32, 32, 8, 1), (32, 32, 8, 1)),
}


def default_configs(head_dim: int, itemsize: int) -> KernelConfigs:
    """Per-kernel configs by padded head dim (32 counts as 64) and element size (fp32 or half)."""
    fwd, dkdv, dq = _DEFAULTS[max(64, block_d(head_dim)), itemsize >= 4]
    return KernelConfigs(KernelConfig(*fwd), KernelConfig(*dkdv), KernelConfig(*dq))


def _kernel_tiles(mask: Mask, config: KernelConfig, name: str) -> PassTiles:
    """Pass `name`'s tiles in the config's tile sizes, with the int32 full flags kernels read."""
    tiles = pass_tiles(mask, config.block_q, config.block_k, name)
    return dataclasses.replace(tiles, full=tiles.full.astype(np.int32))


def mask_tables(mask: Mask, configs: KernelConfigs) -> MaskTables:
    """Host-side numpy tables of `mask` for the tiles of `configs` (interval arithmetic only)."""
    lo, hi = mask.row_intervals()
    if lo.shape[1] == 0:
        lo = hi = np.zeros((mask.seqlen_q, 1), np.int32)
    return MaskTables(
        lo=np.ascontiguousarray(lo, np.int32),
        hi=np.ascontiguousarray(hi, np.int32),
        fwd=_kernel_tiles(mask, configs.fwd, "fwd"),
        dq=_kernel_tiles(mask, configs.dq, "dq"),
        dkdv=_kernel_tiles(mask, configs.dkdv, "dkdv"),
        configs=configs,
    )


def _meta(
    shape: Shape, tables: MaskTables, ieee: bool, configs: tuple[KernelConfig, ...]
) -> dict[str, Any]:
    """The constexprs every attention kernel takes (tiles and DIV16 are added per kernel).
    EVEN_Q / EVEN_K: every query / key tile of `configs` (the kernel's) lies inside the sequence,
    so the kernel loads and stores those rows unpredicated."""
    return {
        "GROUP": shape.heads_q // shape.heads_kv,
        "NUM_INTERVALS": tables.num_intervals,
        "BLOCK_D": block_d(shape.head_dim),
        "HEAD_DIM": shape.head_dim,
        "IEEE": bool(ieee),
        "EVEN_Q": all(shape.seqlen_q % c.block_q == 0 for c in configs),
        "EVEN_K": all(shape.seqlen_k % c.block_k == 0 for c in configs),
    }


def div16(scalars: tuple[Any, ...]) -> int:
    """Bit i set when integer scalar i is a multiple of 16: the fact Triton's own launcher attaches
    to such arguments and jax-triton does not, passed to both front ends as the DIV16 constexpr
    so they compile one kernel (triton_attn/NOTES.md, "One kernel from both front ends")."""
    return sum(
        1 << i
        for i, x in enumerate(scalars)
        if isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x % 16 == 0
    )


def fwd_call(shape: Shape, tables: MaskTables, scale: float, ieee: bool) -> Call:
    """attn_fwd_kernel: one program per (q tile, batch x query head)."""
    cfg = tables.configs.fwd
    scalars = (
        shape.seqlen_q,
        shape.seqlen_k,
        shape.heads_q,
        shape.heads_kv,
        tables.fwd.width,
        float(scale),
    )
    meta = {
        **_meta(shape, tables, ieee, (cfg,)),
        "BLOCK_M": cfg.block_q,
        "BLOCK_N": cfg.block_k,
        "DIV16": div16(scalars),
    }
    return Call(
        grid=(cdiv(shape.seqlen_q, cfg.block_q), shape.batch * shape.heads_q),
        scalars=scalars,
        meta=meta,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def bwd_call(
    shape: Shape, tables: MaskTables, scale: float, ieee: bool, dkdv: bool = True, dq: bool = True
) -> Call:
    """attn_bwd_kernel: one program per (k tile, batch x KV head) for dK/dV, then one per
    (q tile, batch x query head) for dQ; `dkdv` / `dq` False leaves that part out (the tile
    sweep times each part alone). Warps and stages are the dK/dV config's (KernelConfigs makes
    dQ's the same)."""
    k_cfg, q_cfg = tables.configs.dkdv, tables.configs.dq
    dkdv_programs = cdiv(shape.seqlen_k, k_cfg.block_k) * shape.batch * shape.heads_kv
    dq_programs = cdiv(shape.seqlen_q, q_cfg.block_q) * shape.batch * shape.heads_q
    dkdv_programs *= dkdv
    scalars = (
        shape.seqlen_q,
        shape.seqlen_k,
        shape.heads_q,
        shape.heads_kv,
        tables.dkdv.width,
        tables.dq.width,
        dkdv_programs,
        float(scale),
    )
    meta = {
        **_meta(shape, tables, ieee, (k_cfg, q_cfg)),
        "DKDV_BLOCK_M": k_cfg.block_q,
        "DKDV_BLOCK_N": k_cfg.block_k,
        "DQ_BLOCK_M": q_cfg.block_q,
        "DQ_BLOCK_N": q_cfg.block_k,
        "DIV16": div16(scalars),
    }
    return Call(
        grid=(dkdv_programs + dq_programs * dq, 1),
        scalars=scalars,
        meta=meta,
        num_warps=k_cfg.num_warps,
        num_stages=k_cfg.num_stages,
    )


DELTA_ROWS, DELTA_WARPS = 64, 4  # attn_bwd_delta_kernel streams out and dout once


def delta_call(shape: Shape) -> Call:
    """attn_bwd_delta_kernel: one program per (DELTA_ROWS query rows, batch x query head)."""
    scalars = (shape.seqlen_q, shape.heads_q)
    return Call(
        grid=(cdiv(shape.seqlen_q, DELTA_ROWS), shape.batch * shape.heads_q),
        scalars=scalars,
        meta={
            "BLOCK_M": DELTA_ROWS,
            "BLOCK_D": block_d(shape.head_dim),
            "HEAD_DIM": shape.head_dim,
            "DIV16": div16(scalars),
        },
        num_warps=DELTA_WARPS,
        num_stages=1,
    )
