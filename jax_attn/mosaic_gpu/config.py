"""Tile sizes and pipeline depth of the Mosaic GPU (Hopper) flash-attention kernel."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

CONSUMER_WARPGROUPS = 2  # warpgroups computing attention; a third one only issues TMA loads
PRODUCER = CONSUMER_WARPGROUPS  # index of the warpgroup that issues the TMA loads
HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_BYTES = 227 * 1024  # dynamic shared memory one Hopper CTA may use
SMEM_ALIGNMENT = 1024  # Pallas Mosaic GPU starts every shared-memory buffer at a multiple of it
MBARRIER_BYTES = 8  # one mbarrier
REDUCTION_SCRATCH_BYTES = 2048  # Pallas Mosaic GPU's default scratch for reductions
MAX_INTERVALS = 8
REGISTER_BUDGET = 504  # 3 x 168: the CTA's launch registers per thread, summed over warpgroups
MIN_CONSUMER_REGISTERS = 168  # 64K registers over the CTA's 384 threads, no setmaxnreg raise
MAX_CONSUMER_REGISTERS = 240  # (504 - 24) / 2: the producer keeps setmaxnreg's minimum, 24
HOPPER_SMS = 132  # H100 / H200 SXM
# The longest dK/dV walk over an SM's share of the grid from which the head split pays: the
# critical path. On the H200 at 64:8 heads (results/h200/mosaic_variants/32-*, 33-*) it won
# 12-22% on share_question (1.08-1.45) and lost 6-9% on causal_document at 32K (0.34) and
# causal_blockwise and prefix_lm_document at 8K (0.81-0.86); within 2% elsewhere measured.
DKV_SPLIT_BOUND = 1.0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch configuration of the Mosaic GPU kernels.

    Forward: each CTA holds CONSUMER_WARPGROUPS * block_q query rows (one block_q slice per
    consumer warpgroup; block_q is the wgmma M dimension, so 64) and streams block_k keys per
    step through a ring of max_concurrent_steps shared-memory stages filled by the producer
    warpgroup. The mask tiles (MaskArrays) are (mask_block_q, block_k).
    Backward: the dK/dV and dQ kernels walk the same mask tiles in sub-tiles of
    block_{q,k}_{dkv,dq} rows/keys (None: 64, except block_q_dkv, chosen per call by
    dkv_block_q; multiples of 64 dividing the mask tile) through a ring of num_stages_bwd
    stages (None: max_concurrent_steps). fused_bwd: one backward kernel, the dK/dV one also
    adding each step's dQ into fp32 global memory (TMA reduce-add, in no fixed order: dQ may
    differ in its last bits from run to run); it needs block_q_dkv 64 or None (at 128 its
    shared memory does not fit). None chooses per call (backward_form).
    bwd_warpgroups: 1, or 2 for the warp-specialised dK/dV kernel (two consumer warpgroups of
    64 keys each and a producer; 128-key mask tiles). dq_warpgroups: the same for the dQ kernel
    (two consumers of 64 rows of a 128-row mask tile sharing one producer's K/V ring).
    in_place_pv: the forward accumulates P V into O's registers (run_state on an initialised
    accumulator) instead of a fresh accumulator added to O; GPU lowering only. fwd_overlap: the
    forward issues the next step's Q K^T before this step's softmax (FlashAttention-3's
    intra-warpgroup overlap; one more fp32 score tile in registers). persistent_fwd: one
    forward CTA per SM walks (q tile, head, batch) items, dealt in snake rows from bands of
    decreasing key-tile count (close to longest-first scheduling), each band's items grouped by
    K/V head (L2 sharing, as tiles_fastest); the K/V ring runs on across items and the
    next item's Q and row bounds load into a second buffer during this one, so a CTA with few
    key tiles no longer pays the pipeline fill and Q load on its own. tiles_fastest: the
    non-persistent grids run the tile axis fastest instead of the head axis (Pallas Mosaic GPU
    launches the last grid axis fastest), so the CTAs resident together share one head's K/V
    (forward, dQ) or q-side operands (dK/dV) in L2, as FlashAttention-3/4 order their grids;
    None chooses per call (launch_tiles_fastest): heads fastest for GQA on a mask with uneven
    walks, which then starts every head's longest walks in the first wave, else tiles fastest.
    bwd_overlap: the backward steps wait for S alone and compute P = exp2(S - LSE) (masked)
    while dP's matmul still runs, instead of waiting for both (FlashAttention-3's order).
    consumer_registers: registers per thread each consumer warpgroup raises itself to
    (setmaxnreg) in every kernel; the producer gets producer_registers of what is left.
    dkv_head_split: the warp-specialised dK/dV kernel's CTAs per (key tile, K/V head), each
    walking that share of the GQA group's q heads into fp32 partial dK, dV summed after the
    kernel (it must divide the group): shorter longest walks for masks with key tiles every
    row sees, at the cost of the partials' traffic. None chooses per call (dkv_head_split).
    deal_by_walk_start: the persistent forward deals runs of up to forward.WALK_RUN
    neighbouring q tiles whose walks start at the same key tile (a document's) together, in the
    band of their longest walk, so the CTAs resident at once share that document's K/V in L2;
    the default bands by each tile's own walk, which spreads a causal document's tiles over
    every band. Measured 5-9% faster on causal_document at 64:64, slower at 64:8 and on
    full_document (NOTES.md).
    bwd_pingpong: the two consumers of the warp-specialised unfused dK/dV kernel (and of the
    dQ kernel with dq_warpgroups=2) take turns on the tensor cores through a 2-arrival
    barrier, as the forward's do (FlashAttention-3's scheduling): one issues its S and dP
    matmuls while the other runs its softmax and issues its last matmuls, where without it
    their phases may coincide and leave the tensor cores idle. Needs a ring of at least two
    stages.
    raw_score_max: the forward's softmax takes each row's max of the raw scores and scales it
    once per row (c max(s) = max(c s) for a scale c > 0), instead of multiplying every score by
    the scale before the max and again inside the exponent; one multiply per score less (SASS:
    64 of about 560 instructions a step at D=128, 128 of about 900 at D=64). A scale <= 0 keeps
    the scaled order. The default since 2026-12-05: 2-4% faster forward at D=128 and 7-14% at
    D=64 on the H200 (results/h200/mosaic_variants/41-*).
    late_q_prefetch: the persistent forward loads the next item's Q and row bounds after this
    item's partial steps (partial tiles come first) instead of at its start. That load first
    waits until the TMA store of the previous item's O and LSE has read the buffer it refills:
    issued just before, the store is still in flight when the next item starts, so every item
    with partial tiles began with that wait (and its ping-pong partner with it); after them it
    has finished. Between the two step loops, so no step pays a branch for it. Short walks
    (document masks) meet it most often. Without persistent_fwd there is no next item: no
    effect (so a default config with persistent_fwd=False stays valid).
    early_scalar_loads: the forward loads a masked step's key-tile start before issuing its
    Q K^T instead of after waiting for it, and the persistent forward reads each item's q tile,
    head, batch, key-tile count and partial count from one table (forward.item_table), one item
    ahead; so no step's mask and no item's walk waits on a global load, or on a chain of two
    (item, then its tile's count), with the tensor cores idle.
    dkv_consumer_copies: the warp-specialised dK/dV kernel (fused or not) compiles its consumer
    code once per consumer warpgroup, each copy knowing its index, instead of once for both
    with the index read at run time; so the addresses of a consumer's K, V, dS^T and dQ tiles
    are constants instead of values computed from the index (whether that frees registers
    ptxas now spills across the step loop, its spill report tells).
    dkv_step_descriptors: the warp-specialised dK/dV kernel's consumers pick their K and V
    tiles (and, fused, the dQ matmul's K tiles) each step by an index passed through an
    optimisation barrier, which LLVM cannot hoist out of the step loop (ptxas sees a register
    copy; its spill report tells whether it hoists them); so the wgmma descriptors of those
    tiles, 8-byte values one per 16-wide slice of the contraction, are computed at the step's
    matmuls instead of once before the loop and kept live (and spilled) across it.
    dkv_paired_walks: each warp-specialised dK/dV CTA walks two 128-key tiles, p and N - 1 - p
    of the N (the middle one alone when N is odd): p's unmasked q tiles last first, then
    N - 1 - p's in order, each after its partial tiles. On causal masks every CTA then walks
    the same number of q tiles and the CTAs resident at once move on two fronts of q rows (one
    per walk) instead of each at its own diagonal spread over the whole sequence, so their q,
    dO and (fused) dQ tiles meet in L2 (NOTES.md, `ncu-69-*`). The argument assumes the grid
    launches tiles fastest (launch_tiles_fastest: heads fastest for GQA on uneven walks), and
    the per-call head split (dkv_head_split) is chosen from the unpaired walks. None chooses
    per call (paired_walks): the fused kernel paired where the pairs' walks add up evenly
    (MaskArrays.even_pairs), as on causal masks; on document masks a pair's walks add up to
    very different lengths, and half as many CTAs, each as long as its pair, leave a longer
    tail after the rest finish.
    """

    block_q: int = 64
    block_k: int = 128
    max_concurrent_steps: int = 2
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    num_stages_bwd: int | None = None
    fused_bwd: bool | None = False
    bwd_warpgroups: int = 1
    dq_warpgroups: int = 1
    in_place_pv: bool = False
    fwd_overlap: bool = False
    persistent_fwd: bool = False
    tiles_fastest: bool | None = False
    bwd_overlap: bool = False
    consumer_registers: int = 232
    dkv_head_split: int | None = 1
    deal_by_walk_start: bool = False
    bwd_pingpong: bool = False
    raw_score_max: bool = True
    late_q_prefetch: bool = False
    early_scalar_loads: bool = False
    dkv_consumer_copies: bool = False
    dkv_step_descriptors: bool = False
    dkv_paired_walks: bool | None = False

    def __post_init__(self) -> None:
        if self.block_q != 64:
            raise ValueError(
                f"block_q={self.block_q} is invalid: each consumer warpgroup owns one 64-row "
                "wgmma tile, so block_q must be 64"
            )
        if self.block_k not in (64, 128, 192, 256):
            raise ValueError(
                f"block_k={self.block_k} is invalid: valid values are 64, 128, 192 and 256 "
                "(a multiple of 64, at most 256)"
            )
        if not 2 <= self.max_concurrent_steps <= 4:
            raise ValueError(
                f"max_concurrent_steps={self.max_concurrent_steps} is invalid: valid range is "
                "[2, 4] shared-memory stages"
            )
        for name in ("block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
            tile = getattr(self, name)
            if tile is not None and (tile <= 0 or tile % 64):
                raise ValueError(
                    f"{name}={tile} is invalid: valid values are None or a positive multiple of 64"
                )
        for name in ("bwd_warpgroups", "dq_warpgroups"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(
                    f"{name}={getattr(self, name)} is invalid: valid values are 1 and 2"
                )
        if (
            self.consumer_registers % 8
            or not MIN_CONSUMER_REGISTERS <= self.consumer_registers <= MAX_CONSUMER_REGISTERS
        ):
            raise ValueError(
                f"consumer_registers={self.consumer_registers} is invalid: valid values are "
                f"multiples of 8 in [{MIN_CONSUMER_REGISTERS}, {MAX_CONSUMER_REGISTERS}]"
            )
        split = self.dkv_head_split or 1
        if self.dkv_head_split is not None and self.dkv_head_split < 1:
            raise ValueError(
                f"dkv_head_split={self.dkv_head_split} is invalid: valid values are positive "
                "divisors of the GQA group (q heads per K/V head)"
            )
        if split > 1 and (self.bwd_warpgroups != 2 or self.fused_bwd):
            raise ValueError(
                f"dkv_head_split={self.dkv_head_split} needs the warp-specialised unfused dK/dV "
                f"kernel (bwd_warpgroups=2, fused_bwd=False), got bwd_warpgroups="
                f"{self.bwd_warpgroups}, fused_bwd={self.fused_bwd}"
            )
        if self.fused_bwd and (self.block_q_dkv or 64) != 64:
            raise ValueError(
                f"fused_bwd with block_q_dkv={self.block_q_dkv}: the fused kernel's dS^T tiles and "
                "fp32 dQ stage at that many rows exceed a CTA's shared memory (233,552 bytes at "
                "D=64); valid: block_q_dkv=64 (or None) with fused_bwd"
            )
        if self.deal_by_walk_start and not self.persistent_fwd:
            raise ValueError(
                "deal_by_walk_start orders the persistent forward's deal: it needs "
                "persistent_fwd=True, got persistent_fwd=False"
            )
        if self.bwd_pingpong and (
            self.bwd_warpgroups != CONSUMER_WARPGROUPS or self.fused_bwd or self.num_stages_bwd == 1
        ):
            raise ValueError(
                "bwd_pingpong needs the warp-specialised unfused dK/dV kernel with a ring of at "
                f"least two stages (bwd_warpgroups=2, fused_bwd=False, num_stages_bwd None or "
                f">= 2), got bwd_warpgroups={self.bwd_warpgroups}, fused_bwd={self.fused_bwd}, "
                f"num_stages_bwd={self.num_stages_bwd}"
            )
        for name in ("dkv_consumer_copies", "dkv_step_descriptors", "dkv_paired_walks"):
            if getattr(self, name) and self.bwd_warpgroups != CONSUMER_WARPGROUPS:
                raise ValueError(
                    f"{name}=True needs the warp-specialised dK/dV kernel (bwd_warpgroups=2), "
                    f"got bwd_warpgroups={self.bwd_warpgroups}"
                )
        if self.num_stages_bwd is not None and not 1 <= self.num_stages_bwd <= 4:
            raise ValueError(
                f"num_stages_bwd={self.num_stages_bwd} is invalid: valid range is [1, 4] (or None)"
            )

    @property
    def producer_registers(self) -> int:
        """The producer warpgroup's registers per thread: at most 40, and what the consumers
        leave of REGISTER_BUDGET (setmaxnreg only moves registers the CTA got at launch)."""
        return min(40, REGISTER_BUDGET - CONSUMER_WARPGROUPS * self.consumer_registers)

    @property
    def mask_block_q(self) -> int:
        """Query rows of one CTA, which is the q tile of the MaskArrays this kernel walks."""
        return CONSUMER_WARPGROUPS * self.block_q

    @property
    def tiles(self) -> tuple[int, int]:
        """(block_q, block_k) to build MaskArrays with (prepare_mask) for this config."""
        return self.mask_block_q, self.block_k

    def smem_bytes(self, head_dim: int, itemsize: int = 2, intervals: int = 1) -> int:
        """Shared memory one forward CTA asks for, counted as Pallas Mosaic GPU counts it: each
        buffer (Q/O tiles, the K and V rings, row bounds, LSE) starts at a multiple of
        SMEM_ALIGNMENT, each barrier takes MBARRIER_BYTES, and the row max and sum reserve
        REDUCTION_SCRATCH_BYTES (Pallas's default reduction_scratch_bytes)."""
        per_item = (2 if self.persistent_fwd else 1) * CONSUMER_WARPGROUPS  # Q/O, rows, LSE
        stages = self.max_concurrent_steps
        buffers = (
            per_item * self.block_q * head_dim * itemsize,
            stages * self.block_k * head_dim * itemsize,
            stages * self.block_k * head_dim * itemsize,
            per_item * 2 * intervals * self.block_q * 4,
            per_item * self.block_q * 4,
        )
        # K, V ready and released; Q and row bounds ready per item; the consumers' ping-pong
        barriers = 4 * stages + 2 * per_item + 1
        aligned = sum(-(-b // SMEM_ALIGNMENT) * SMEM_ALIGNMENT for b in buffers)
        return aligned + barriers * MBARRIER_BYTES + REDUCTION_SCRATCH_BYTES

    def check(self, head_dim: int, dtype: object, intervals: int = 1) -> None:
        """ValueError unless this config can run inputs of `head_dim` and `dtype`."""
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim={head_dim} is unsupported: valid values are 64 and 128")
        if jnp.dtype(dtype) not in DTYPES:
            raise ValueError(
                f"dtype {jnp.dtype(dtype).name} is unsupported: valid dtypes are bfloat16 and "
                "float16"
            )
        if not 1 <= intervals <= MAX_INTERVALS:
            raise ValueError(
                f"{intervals} key intervals per row is unsupported: valid range is "
                f"[1, {MAX_INTERVALS}]"
            )
        need = self.smem_bytes(head_dim, jnp.dtype(dtype).itemsize, intervals)
        if need > SMEM_BYTES:
            raise ValueError(
                f"block_k={self.block_k} with max_concurrent_steps={self.max_concurrent_steps}"
                f"{' and persistent_fwd' if self.persistent_fwd else ''} needs {need} bytes of "
                f"shared memory at head_dim={head_dim}; the valid range is "
                f"at most {SMEM_BYTES} (lower block_k or max_concurrent_steps)"
            )


def grid_axes(
    tiles: tuple[str, int], heads: int, batch: int, *, tiles_fastest: bool | None
) -> dict:
    """grid and grid_names of a non-persistent kernel over (tile axis name and size, heads,
    batch); the last axis launches fastest: batch, then heads, or reversed with tiles_fastest
    (None, the per-call choice not yet made, is refused)."""
    if tiles_fastest is None:
        raise ValueError("tiles_fastest=None: choose the launch order first (launch_tiles_fastest)")
    names, sizes = (tiles[0], "heads", "batch"), (tiles[1], heads, batch)
    if tiles_fastest:
        names, sizes = names[::-1], sizes[::-1]
    return dict(grid=sizes, grid_names=names)


def launch_tiles_fastest(config: KernelConfig, *, group: int, uneven_walks: bool) -> bool:
    """The launch order of config's non-persistent grids for a call with `group` q heads per
    K/V head on a mask whose walks are (MaskArrays.uneven_walks) uneven: config.tiles_fastest,
    or where it is None, heads fastest only for GQA on uneven walks (measured on the H200:
    results/h200/mosaic_variants/29-*; MHA and even masks run faster tiles fastest). Stacked
    mask arrays (context parallelism, training) are never flagged, so they run tiles fastest."""
    if config.tiles_fastest is not None:
        return config.tiles_fastest
    return not (group > 1 and uneven_walks)


def dkv_head_split(config: KernelConfig, *, group: int, walk_peak: float, dkv_ctas: int) -> int:
    """The dK/dV head split of a call: config.dkv_head_split, or where it is None, 2 when the
    longest dK/dV walk is at least DKV_SPLIT_BOUND of an SM's share of the grid (walk_peak
    x HOPPER_SMS over the unsplit grid's dkv_ctas CTAs) and the GQA group is even (the
    warp-specialised unfused kernel only), else 1."""
    if config.dkv_head_split is not None:
        return config.dkv_head_split
    if config.bwd_warpgroups != CONSUMER_WARPGROUPS or config.fused_bwd or group % 2:
        return 1
    return 2 if walk_peak * HOPPER_SMS >= DKV_SPLIT_BOUND * dkv_ctas else 1


def paired_walks(config: KernelConfig, *, even_pairs: bool) -> bool:
    """Whether a call's dK/dV CTAs walk key tiles p and N - 1 - p: config.dkv_paired_walks, or
    where it is None, for the fused warp-specialised kernel on masks whose pairs' walks add up
    evenly (MaskArrays.even_pairs); the unfused kernels, whose dK/dV CTAs add no dQ, measured
    within -2.2% to +1.4% of their time with pairs (NOTES.md), stay unpaired. A model of the
    D=128 grid at 64:8 heads (experiments/dkv_grid_model.py: each CTA's steps dealt in launch
    order to 132 SMs) puts the last CTA's end 13-16% later with pairs than without on
    causal_document, causal_blockwise, prefix_lm_document, block_causal_document and
    full_document_long at 16K (0-8% at 32K), and 0-3% later on full and causal at 16K-32K,
    where pairs gain in L2 (17% earlier on causal at 8K). Not yet timed."""
    if config.dkv_paired_walks is not None:
        return config.dkv_paired_walks
    return even_pairs and bool(config.fused_bwd) and config.bwd_warpgroups == CONSUMER_WARPGROUPS


def backward_form(config: KernelConfig, *, few_partial_tiles: bool) -> KernelConfig:
    """config with fused_bwd decided for one call: as given, or where it is None, the fused
    kernel with step descriptors and paired walks on a mask with few partial tiles
    (MaskArrays.few_partial_tiles), else the two unfused kernels as configured (the fused
    form's walks paired, or chosen per call where config.dkv_paired_walks is None). Measured
    forward+backward at D=128 on an H100 (results/h100/mosaic_variants): with few partial
    tiles the fused form took 5-8% less time on full and causal at 16K and 32K (70-*), 1-5%
    less on prefix_lm_causal, global_sliding_window and block_causal_document at 16K, 1.5% more
    on full_document_long (72-*); with many, the unfused kernels took 22-35% less on the
    document, window, blockwise and share_question masks (71-*, 72-*), 8% more on
    causal_document_long at 16K (72-*). A config that KernelConfig refuses in this fused form
    (block_q_dkv 128, a head split, ping-pong, one dK/dV warpgroup) stays unfused."""
    if config.fused_bwd is not None:
        return config
    unfused = dataclasses.replace(config, fused_bwd=False)
    if not few_partial_tiles:
        return unfused
    try:
        paired = None if config.dkv_paired_walks is None else True
        return dataclasses.replace(
            config, fused_bwd=True, dkv_step_descriptors=True, dkv_paired_walks=paired
        )
    except ValueError:  # KernelConfig's own checks say what the fused form cannot run with
        return unfused


def dkv_block_q(
    config: KernelConfig, *, head_dim: int, mask_block_q: int, few_partial_tiles: bool
) -> int:
    """The dK/dV kernel's q rows a step: config.block_q_dkv, or where it is None, 128 at
    head_dim 64 for the warp-specialised unfused kernel without ping-pong on mask tiles of a
    multiple of 128 rows with few partial ones (MaskArrays.few_partial_tiles), else 64.
    Measured forward+backward on an H100 at 16K and 32K, 64:8 heads
    (results/h100/mosaic_variants): 128 rows 0.6-2.7% faster on full and causal, 0.1-7.4%
    slower on the document, window, blockwise and share_question masks (52-* and 53-*)."""
    if config.block_q_dkv is not None:
        return config.block_q_dkv
    wide = (
        head_dim <= 64
        and mask_block_q % 128 == 0
        and few_partial_tiles
        and config.bwd_warpgroups == CONSUMER_WARPGROUPS
        and not (config.fused_bwd or config.bwd_pingpong)
    )
    return 128 if wide else 64


def default_config(head_dim: int, dtype: object) -> KernelConfig:
    """The fastest config measured (results/h200/mosaic_variants; the D=64 dK/dV step on an
    H100, results/h100/mosaic_variants): the persistent forward, P V accumulated in place, the
    warp-specialised dK/dV and dQ kernels (dQ over 128-key steps), the other grids' launch
    order chosen per call (launch_tiles_fastest), two-stage rings, the dK/dV head split chosen
    per call (dkv_head_split). D=128: FA3-like 128-key steps, consumers at 240 registers, the
    backward's form chosen per call (backward_form: fused with step descriptors and paired
    walks on masks with few partial tiles; at D=64 the fused forms were mixed against the
    unfused one in one run, 70-*).
    D=64: 256-key forward steps (half the softmax steps; the backward's CTAs split each
    256-key tile in two), P computed while dP's matmul runs. The dK/dV kernel's q rows a step
    are chosen per call (dkv_block_q): 128 on masks with few partial tiles at D=64 (S^T and
    dP^T 128 wide; at D=128, 17-18% slower, likely registers), else 64. The persistent
    forward loads the next item's Q after the item's partial steps (late_q_prefetch), and at
    D=64 reads its scalars early (early_scalar_loads): on an H100 about 3-8% faster on
    document and window masks at D=64 and up to 3% at D=128 in three runs of their first form,
    full and causal no slower in a run of the final one (results/h100/mosaic_variants 56-* to
    59-*, NOTES.md).
    """
    del dtype
    common = dict(
        block_q=64,
        max_concurrent_steps=2,
        block_k_dq=128,
        bwd_warpgroups=2,
        dq_warpgroups=2,
        in_place_pv=True,
        persistent_fwd=True,
        tiles_fastest=None,
        dkv_head_split=None,
        late_q_prefetch=True,
    )
    if head_dim > 64:
        return KernelConfig(
            block_k=128,
            consumer_registers=240,
            fused_bwd=None,
            **common,
        )
    return KernelConfig(block_k=256, bwd_overlap=True, early_scalar_loads=True, **common)


def block_sizes(head_dim: int, dtype: object) -> tuple[int, int]:
    """(block_q, block_k) mask tiles to prepare MaskArrays with for the default config."""
    return default_config(head_dim, dtype).tiles
