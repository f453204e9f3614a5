"""Tile sizes and launch parameters of the Pallas Triton kernels, with per-head-dim defaults."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # padded to a power of two >= 16 for Triton's dot shapes
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch configuration; a tile left as None takes the mask tile of the MaskArrays.

    Kernel tiles must divide the mask tiles (block_q, block_k of the MaskArrays) because the
    kernels walk the mask's tile lists: a mask tile is visited as several kernel sub-tiles.
    Forward and dQ use (block_q, block_k) / (block_q_dq, block_k_dq) tiles over a q tile; dK/dV
    holds a block_k_dkv key tile and steps over block_q_dkv query sub-tiles. fused_bwd replaces
    the two backward kernels by one dK/dV kernel that also adds each tile's dQ into an fp32 buffer
    with atomics (5 matmuls per tile pair instead of 7; the dQ tiles are unused then);
    relaxed_atomics makes those adds relaxed-ordered (atomics.py) instead of Pallas' acq_rel.
    dkv_split = S > 1 (two-kernel backward only) gives every (key tile, kv head) S dK/dV programs,
    each walking an equal contiguous 1/S of that tile's (query sub-tile, q head) steps into fp32
    partial sums that XLA adds: the longest program (a key tile seen by every query, as in
    share_question) runs ~1/S of the steps, at the cost of S x the dK/dV programs and an
    (S, B, Sk, Hkv, D) fp32 buffer per gradient.
    """

    block_q: int | None = None
    block_k: int | None = None
    num_warps: int = 8
    num_stages: int = 3
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    num_warps_bwd: int = 8
    num_stages_bwd: int = 2
    fused_bwd: bool = False
    relaxed_atomics: bool = False
    dkv_split: int = 1

    def resolve(self, mask_block_q: int, mask_block_k: int) -> KernelConfig:
        """This config with every tile set, checked against the mask tiles."""

        def pick(value: int | None, mask_tile: int, what: str) -> int:
            tile = mask_tile if value is None else min(value, mask_tile)
            if tile < 16 or tile & (tile - 1) or mask_tile % tile:
                raise ValueError(
                    f"{what}={tile} must be a power of two >= 16 dividing the mask tile "
                    f"{mask_tile} (prepare_mask with power-of-two tiles >= 16)"
                )
            return tile

        if self.dkv_split < 1:
            raise ValueError(f"dkv_split={self.dkv_split} must be >= 1")
        return dataclasses.replace(
            self,
            block_q=pick(self.block_q, mask_block_q, "block_q"),
            block_k=pick(self.block_k, mask_block_k, "block_k"),
            block_q_dq=pick(self.block_q_dq, mask_block_q, "block_q_dq"),
            block_k_dq=pick(self.block_k_dq, mask_block_k, "block_k_dq"),
            block_q_dkv=pick(self.block_q_dkv, mask_block_q, "block_q_dkv"),
            block_k_dkv=pick(self.block_k_dkv, mask_block_k, "block_k_dkv"),
        )


def padded_head_dim(head_dim: int) -> int:
    """Head dim the kernels run at: the next power of two, at least 16 (Triton dot shapes)."""
    return max(16, 1 << (int(head_dim) - 1).bit_length())


def block_sizes(head_dim: int, dtype: object) -> tuple[int, int]:
    """(block_q, block_k) mask tiles to prepare MaskArrays with for this head dim and dtype."""
    wide = padded_head_dim(head_dim) > 128 or jnp.dtype(dtype).itemsize > 2
    return (64, 64) if wide else (128, 128)


def default_config(head_dim: int, dtype: object) -> KernelConfig:
    """Launch defaults expected to be good on H100/H200 (sweep: run.py --preset=tune_pallas)."""
    d = padded_head_dim(head_dim)
    if jnp.dtype(dtype).itemsize > 2:
        return KernelConfig(num_warps=4, num_stages=2, num_warps_bwd=4, num_stages_bwd=1)
    if d <= 64:
        return KernelConfig(
            block_k=64,
            num_warps=4,
            num_stages=3,
            block_q_dkv=32,
            block_k_dq=32,
            num_warps_bwd=4,
            num_stages_bwd=3,
        )
    if d <= 128:
        # Best of the H200 sweep (results/h200/tune_pallas.jsonl): fwd 128x64 tiles, 4 warps,
        # 2 stages; backward 128-key dK/dV tiles stepping 64 query rows, dQ stepping 64 keys.
        return KernelConfig(
            block_k=64,
            num_warps=4,
            num_stages=2,
            block_q_dkv=64,
            block_k_dq=64,
            num_warps_bwd=8,
            num_stages_bwd=2,
        )
    return KernelConfig(num_warps=8, num_stages=2, num_warps_bwd=8, num_stages_bwd=1)
