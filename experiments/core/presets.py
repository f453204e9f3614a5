"""Named sweep presets: smoke (tiny, CPU or GPU sizes), paper (the published sweeps), full,
cp_bench (the CP GPU sweep), tune_pallas (launch configs of the Pallas Triton kernel), cross
(the JAX-vs-PyTorch kernel grid) and cp_predict (CP at 8-64 GPUs predicted from one:
experiments/runners/cp_simulate.py).

paper = the published kernel and CP benchmark sweeps with the reference's masks (reference_compat;
docs/masks.md, docs/context_parallel.md); full = the same grids with the corrected masks, plus
every static mask under every CP strategy with the mask-area-balanced layout. cp_bench = every
strategy x layout at 8K and 32K tokens per GPU, with the same kernel alone on one GPU at the
per-GPU length as the baseline of each point's efficiency; tune_pallas = the tuning space of
--tune (every candidate is checked before it is timed, like any point); cross = every static
mask x 8K/16K/32K x fwd, fwd_bwd x 64:8 and 64:64 heads with every impl of the framework(s) run
(`--framework=both` for the comparison; `--time_budget` splits it into resumable pieces), at
tiny sizes on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from attn_masks import MASK_NAMES
from experiments.core import tuning
from experiments.core.points import ALL, CP_STRATEGIES, DEFAULT_IMPL, Grid
from shard_strategies import LAYOUTS

PRESETS = ("smoke", "paper", "full", "cp_bench", "tune_pallas", "cross", "cp_predict")
K = 1024

# MASK_NAMES is in docs/masks.md order: the 12 masks of the kernel benchmark, then the two
# *_document_long masks, which the paper uses only in its CP benchmark.
STATIC_MASKS = MASK_NAMES[:-2]
ALL_MASKS = MASK_NAMES
CP_PAPER_MASKS = ("full", "causal", "full_document_long", "causal_document_long")
PAPER_KERNEL_SEQLENS = tuple(n * K for n in (1, 2, 4, 8, 16, 24, 32, 40, 48))
CP_BENCH_MASKS = ("full", "causal", "causal_document", "share_question")
CP_BENCH_IMPLS = ("pallas", "flex")  # each framework keeps the one it has
TUNE_MASKS = ("full", "causal", "causal_document")
CP_PREDICT_MASKS = ("full", "causal", "causal_document", "full_document", "share_question")
CP_PREDICT_DEVICES = (8, 16, 32, 64)
CP_PREDICT_CHAIN_MS = 5


@dataclass(frozen=True)
class Preset:
    """Kernel and CP grids of a preset; `default_cp` says whether a run without --cp does CP;
    `baseline` grids run with the CP grids (single-device rates the CP report compares with)."""

    name: str
    kernel: tuple[Grid, ...]
    cp: tuple[Grid, ...]
    default_cp: bool
    baseline: tuple[Grid, ...] = ()
    simulate_devices: tuple[int, ...] = ()  # CP grids predicted for these sizes (cp_simulate)


def _single_device(name: str, **axes) -> Grid:
    """A grid of kernel points: no CP strategy, no layout."""
    return Grid(name=name, cps=("none",), layouts=("none",), **axes)


def _paper_kernel(compat: bool) -> Grid:
    return _single_device(
        "kernel",
        impls=(ALL,),
        masks=STATIC_MASKS,
        seqlens=PAPER_KERNEL_SEQLENS,
        heads=((64, 8), (64, 64)),
        head_dim=128,
        dtype="bf16",
        modes=("fwd", "bwd"),
        batch=1,
        warmup=5,
        iters=20,
        num_masks=1,
        window=1024,
        reference_compat=compat,
    )


def _paper_cp(compat: bool) -> Grid:
    return Grid(
        name="cp",
        cps=CP_STRATEGIES,
        layouts=("zigzag",),
        impls=(DEFAULT_IMPL,),
        masks=CP_PAPER_MASKS,
        seqlens=(8 * K,),
        heads=((64, 8),),
        head_dim=128,
        dtype="bf16",
        modes=("fwd", "bwd", "fwd_bwd"),
        batch=1,
        warmup=5,
        iters=15,
        num_masks=30,
        window=1024,
        reference_compat=compat,
        scaling="weak",
    )


def _smoke(on_gpu: bool) -> Preset:
    if on_gpu:
        sizes = dict(heads=((32, 8),), head_dim=128, dtype="bf16", window=1024)
        kernel_seqlens, cp_seqlens = (8 * K, 16 * K), (8 * K,)
        warmup, iters = 2, 5
    else:
        # 8 query heads: Ulysses splits them over all 8 virtual devices (and 4 torch ranks).
        sizes = dict(heads=((8, 2),), head_dim=32, dtype="fp32", window=64)
        kernel_seqlens, cp_seqlens = (256, 512), (64,)
        warmup, iters = 1, 3
    common = dict(
        masks=("causal", "causal_document", "sliding_window"),
        modes=("fwd", "bwd"),
        warmup=warmup,
        iters=iters,
        num_masks=1,
        **sizes,
    )
    kernel = _single_device("kernel", impls=(ALL,), seqlens=kernel_seqlens, **common)
    cp = Grid(
        name="cp",
        cps=("ring",),
        layouts=("zigzag",),
        impls=(DEFAULT_IMPL,),
        seqlens=cp_seqlens,
        **common,
    )
    return Preset("smoke", (kernel,), (cp,), default_cp=False)


def _cp_bench() -> Preset:
    common = dict(
        impls=CP_BENCH_IMPLS,
        masks=CP_BENCH_MASKS,
        seqlens=(8 * K, 32 * K),
        heads=((64, 8),),
        head_dim=128,
        dtype="bf16",
        modes=("fwd", "fwd_bwd"),
        warmup=2,
        iters=8,
    )
    cp = Grid(name="cp_bench", cps=CP_STRATEGIES, layouts=LAYOUTS, scaling="weak", **common)
    single = _single_device("cp_bench_single_device", **common)
    return Preset("cp_bench", (), (cp,), default_cp=True, baseline=(single,))


def _tune_pallas() -> Preset:
    kernel = _single_device(
        "tune_pallas",
        impls=(tuning.TUNED_IMPL,),
        masks=TUNE_MASKS,
        seqlens=(8 * K, 16 * K, 32 * K),
        heads=((64, 8),),
        head_dim=128,
        dtype="bf16",
        modes=("fwd", "fwd_bwd"),
        warmup=2,
        iters=5,
        tune=tuning.DEFAULT_SPACE,
    )
    return Preset("tune_pallas", (kernel,), (), default_cp=False)


def _cross(on_gpu: bool) -> Preset:
    if on_gpu:
        sizes = dict(seqlens=(8 * K, 16 * K, 32 * K), heads=((64, 8), (64, 64)), head_dim=128)
        sizes.update(dtype="bf16", window=1024, warmup=2, iters=5)
    else:
        sizes = dict(seqlens=(128, 256), heads=((4, 2), (4, 4)), head_dim=32, dtype="fp32")
        sizes.update(window=32, warmup=1, iters=2)
    kernel = _single_device(
        "cross", impls=(ALL,), masks=STATIC_MASKS, modes=("fwd", "fwd_bwd"), num_masks=1, **sizes
    )
    return Preset("cross", (kernel,), (), default_cp=False)


def _cp_predict(on_gpu: bool) -> Preset:
    """Every strategy x layout predicted at 8-64 GPUs from one GPU (CPU: 2-8 tiny devices)."""
    if on_gpu:
        sizes = dict(
            masks=CP_PREDICT_MASKS,
            seqlens=(8 * K, 32 * K),
            heads=((64, 8),),
            head_dim=128,
            dtype="bf16",
            # forward+backward first: a problem's forward points then take their row checks'
            # float64 out values from its forward+backward points' (ReferenceRows)
            modes=("fwd_bwd", "fwd"),
            warmup=0,  # a distinct call's first run is its warm-up, or its time (Ranks.time)
            iters=2,
            # each sample a chain of calls: the device's time a call, as in a CP program, not
            # the host's dispatch and wait, the likely cause (to be confirmed on the H200) of
            # calls of about a millisecond differing by up to 60% on pieces of equal tile
            # layouts in run 12
            chain_ms=CP_PREDICT_CHAIN_MS,
        )
        devices = CP_PREDICT_DEVICES
    else:
        sizes = dict(
            masks=("causal", "causal_document"),
            seqlens=(32,),
            heads=((8, 2),),
            head_dim=16,
            dtype="fp32",
            modes=("fwd",),
            warmup=0,
            iters=2,
            window=16,
        )
        devices = (2, 4, 8)
    cp = Grid(
        name="cp_predict",
        cps=CP_STRATEGIES,
        layouts=LAYOUTS,
        impls=(DEFAULT_IMPL,),
        scaling="weak",
        **sizes,
    )
    return Preset("cp_predict", (), (cp,), default_cp=True, simulate_devices=devices)


def get_preset(name: str, *, on_gpu: bool) -> Preset:
    """The grids of a named preset; smoke, cross and cp_predict pick CPU or GPU sizes, the
    others are fixed."""
    if name == "smoke":
        return _smoke(on_gpu)
    if name == "cross":
        return _cross(on_gpu)
    if name == "cp_bench":
        return _cp_bench()
    if name == "tune_pallas":
        return _tune_pallas()
    if name == "cp_predict":
        return _cp_predict(on_gpu)
    if name == "paper":
        return Preset("paper", (_paper_kernel(True),), (_paper_cp(True),), default_cp=True)
    if name == "full":
        balanced = _paper_cp(False).replace(
            name="cp_all_masks", masks=STATIC_MASKS, layouts=("balanced",)
        )
        return Preset(
            "full", (_paper_kernel(False),), (_paper_cp(False), balanced), default_cp=True
        )
    raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")


def select_grids(preset: Preset, cps: tuple[str, ...] | None) -> list[Grid]:
    """The grids a run uses: --cp=none picks the kernel grids, other --cp values the CP grids
    (with their strategies replaced), a mix both; without --cp the preset decides."""
    if cps is None:
        cp = (*preset.baseline, *preset.cp) if preset.default_cp else ()
        return [*preset.kernel, *cp]
    grids = list(preset.kernel) if "none" in cps else []
    strategies = tuple(c for c in cps if c != "none")
    if strategies:
        grids += [*preset.baseline, *(g.replace(cps=strategies) for g in preset.cp)]
    return grids


def apply_overrides(grids: list[Grid], overrides: dict) -> list[Grid]:
    """Grids with the explicitly given flag values replacing the preset's values."""
    out = []
    for g in grids:
        changes = dict(overrides)
        if not g.is_cp:
            changes.pop("layouts", None)
            changes.pop("scaling", None)
        else:
            changes.pop("tune", None)
        out.append(g.replace(**changes))
    return out
