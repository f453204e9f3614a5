"""Sweep grids and the points they expand to, each with a stable key used for resuming."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from experiments.core import tuning
from shard_strategies.strategies import HYBRID_STRATEGIES, STRATEGIES

FRAMEWORKS = ("jax", "torch")
CP_STRATEGIES = STRATEGIES
CP_CHOICES = ("none", *CP_STRATEGIES)
# The one dtype table: a point's short name -> the frameworks' (and records') long name.
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPES = tuple(DTYPE_NAMES)
SHORT_DTYPES = {full: short for short, full in DTYPE_NAMES.items()}
ITEMSIZES = {short: int(short[2:]) // 8 for short in DTYPES}  # bytes: the name's bits / 8
SCALINGS = ("weak", "strong")
DEFAULT_IMPL = "default"  # CP: the strategy's local kernel; kernels: the package's default
ALL = "all"


@dataclass(frozen=True)
class Grid:
    """One family of points (a kernel sweep or a CP sweep); every field is a grid axis or knob."""

    name: str
    cps: tuple[str, ...]
    layouts: tuple[str, ...]
    impls: tuple[str, ...]
    masks: tuple[str, ...]
    seqlens: tuple[int, ...]
    heads: tuple[tuple[int, int], ...]
    head_dim: int
    dtype: str
    modes: tuple[str, ...]
    batch: int = 1
    warmup: int = 5
    iters: int = 20
    chain_ms: int = 0  # 0: time one call at a time; else chains of calls (runners/timing.py)
    num_masks: int = 1
    window: int = 1024
    reference_compat: bool = False
    scaling: str = "weak"
    tune: str = ""  # a Pallas tuning space (experiments/core/tuning.py); "" = the library's config

    @property
    def is_cp(self) -> bool:
        return any(c != "none" for c in self.cps)

    def replace(self, **changes: object) -> Grid:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Point:
    """One measured configuration: a result record is written per point."""

    workload: str
    framework: str
    impl: str
    cp: str
    layout: str
    ulysses_size: int | None
    ulysses_intra_node: bool | None
    mask: str
    seqlen_total: int  # tokens of the whole sequence
    seqlen_per_device: int  # tokens each CP device holds (seqlen_total / num_devices, rounded up)
    scaling: str
    num_devices: int
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    mode: str
    num_masks: int
    seed: int
    window: int
    reference_compat: bool
    warmup: int
    iters: int
    grid: str
    chain_ms: int = 0  # timing: one call at a time (0) or chains of this many ms (timing.py)
    kernel_config: str = ""  # a tuning candidate's name (experiments/core/tuning.py); "" = default
    simulated: bool = False  # CP predicted from one device's timed local work (cp_simulate.py)
    link: str = ""  # the link model of a simulated point (shard_strategies.simulate.LinkModel)

    @property
    def is_cp(self) -> bool:
        return self.cp != "none"

    @property
    def key(self) -> str:
        """Stable identity of the point: same flags, same key, across runs and machines."""
        placement = {True: "i", False: "x", None: ""}[self.ulysses_intra_node]
        cp = "kernel"
        if self.is_cp:
            cp = (
                f"{self.cp}-{self.layout}-u{self.ulysses_size or 0}{placement}"
                f"-n{self.num_devices}-{self.scaling}"
            )
            if self.simulated:
                cp += f"-sim-{self.link}"
        compat = "c" if self.reference_compat else ""
        tuned = (f"tune-{self.kernel_config}",) if self.kernel_config else ()
        return "/".join(
            (
                self.workload,
                self.framework,
                self.impl,
                cp,
                self.mask,
                f"S{self.seqlen_total}",
                f"b{self.batch}h{self.heads_q}:{self.heads_kv}d{self.head_dim}",
                self.dtype,
                self.mode,
                f"m{self.num_masks}s{self.seed}w{self.window}{compat}",
                f"r{self.warmup}:{self.iters}" + (f"c{self.chain_ms}" if self.chain_ms else ""),
                *tuned,
            )
        )

    def label(self) -> str:
        """Short human-readable description for progress lines."""
        where, per_device = "", ""
        if self.is_cp:
            sim = " simulated" if self.simulated else ""
            where = f" {self.cp}/{self.layout} x{self.num_devices}{sim}"
            per_device = f" ({self.seqlen_per_device}/device)"
        return (
            f"{self.framework}/{self.impl}{self._tuned()}{where} {self.mask} "
            f"S={self.seqlen_total}{per_device} "
            f"h{self.heads_q}:{self.heads_kv} {self.dtype} {self.mode}"
        )

    def _tuned(self) -> str:
        return f"[{self.kernel_config}]" if self.kernel_config else ""

    def as_dict(self) -> dict:
        """Plain fields for the JSON record."""
        return dataclasses.asdict(self)


def total_seqlen(seqlen: int, scaling: str, num_devices: int, cp: str) -> int:
    """Global tokens of a --seqlen value: per device times devices under weak CP scaling, else
    the value itself."""
    return seqlen * num_devices if cp != "none" and scaling == "weak" else seqlen


def expand(
    grid: Grid,
    framework: str,
    impls: tuple[str, ...],
    *,
    seed: int,
    num_devices: int,
    ulysses_size: int | None,
    ulysses_intra_node: bool,
    workload: str = "attention",
) -> list[Point]:
    """All points of a grid for one framework, in a stable order: shape-major (heads, then
    sequence length), so that every mask, mode and impl of one input shape run in a row and
    their inputs are generated and copied to the device once; then mask-major, so a mask's
    modes run in a row (a simulated CP problem builds its plans once for both)."""
    points = []
    axes = itertools.product(
        grid.heads, grid.seqlens, grid.masks, grid.modes, grid.cps, grid.layouts, impls
    )
    for (hq, hkv), seqlen, mask, mode, cp, layout, impl in axes:
        is_cp = cp != "none"
        n = num_devices if is_cp else 1
        total = total_seqlen(seqlen, grid.scaling, n, cp)
        point = Point(
            workload=workload,
            framework=framework,
            impl=impl,
            cp=cp,
            layout=layout if is_cp else "none",
            ulysses_size=ulysses_size if cp in HYBRID_STRATEGIES else None,
            ulysses_intra_node=ulysses_intra_node if cp in HYBRID_STRATEGIES else None,
            mask=mask,
            seqlen_total=total,
            seqlen_per_device=-(-total // n),
            scaling=grid.scaling if is_cp else "none",
            num_devices=n,
            batch=grid.batch,
            heads_q=hq,
            heads_kv=hkv,
            head_dim=grid.head_dim,
            dtype=grid.dtype,
            mode=mode,
            num_masks=grid.num_masks,
            seed=seed,
            window=grid.window,
            reference_compat=grid.reference_compat,
            warmup=grid.warmup,
            iters=grid.iters,
            grid=grid.name,
            chain_ms=grid.chain_ms,
        )
        configs = _kernel_configs(grid, mode, impl)
        points += [dataclasses.replace(point, kernel_config=c) for c in configs]
    return dedupe(points)


def _kernel_configs(grid: Grid, mode: str, impl: str) -> tuple[str, ...]:
    """The tuning candidates a grid sweeps for an impl in a mode, or its own config alone ("")."""
    if not grid.tune or impl != tuning.TUNED_IMPL:
        return ("",)
    return tuning.candidate_names(grid.tune, mode, grid.head_dim, DTYPE_NAMES[grid.dtype])


def dedupe(points: list[Point]) -> list[Point]:
    """Points in order with repeated keys dropped (grids of a preset may overlap)."""
    seen: set[str] = set()
    out = []
    for p in points:
        if p.key not in seen:
            seen.add(p.key)
            out.append(p)
    return out
