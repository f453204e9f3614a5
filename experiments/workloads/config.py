"""The train-step workload's configuration: model, data, optimizer, CP and checkpointing."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from experiments.core.points import SHORT_DTYPES
from experiments.workloads.nnx_attention import AttentionBackend

from . import placement
from .data import MASK_NAME, DataConfig
from .lm import LMConfig
from .train import OptimConfig

WORKLOAD = "train_step"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on. cp None: one device; doc_multiple 0 in `data`: automatic
    (2 x CP devices under the zigzag layout, so no document needs padding, else 1)."""

    model: LMConfig
    data: DataConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 20
    warmup: int = 2
    attention_iters: int = 0
    impl: str | None = None
    cp: str | None = None
    layout: str = "zigzag"
    num_devices: int = 0
    ulysses_size: int | None = None
    checkpoint_every: int = 0
    ckpt_dir: str | None = None
    resume: bool = False
    out_dir: str | None = None

    @property
    def uses_checkpoints(self) -> bool:
        """Whether the run reads or writes ckpt_dir (it saves, or resumes from, checkpoints)."""
        return bool(self.ckpt_dir) and (self.checkpoint_every > 0 or self.resume)

    def backend(self) -> AttentionBackend:
        """The attention call of every layer."""
        if self.cp is None:
            return AttentionBackend(impl=self.impl)
        return AttentionBackend(
            impl=self.impl,
            mesh=placement.cp_mesh(self.num_devices),
            strategy=self.cp,
            layout=self.layout,
            axis=placement.CP_AXIS,
            ulysses_size=self.ulysses_size,
        )

    def resolved(self, backend: AttentionBackend) -> TrainConfig:
        """The config with the automatic document multiple filled in."""
        if self.data.doc_multiple:
            return self
        zigzag = backend.is_cp and self.layout == "zigzag"
        multiple = 2 * backend.mesh.size if zigzag else 1
        return dataclasses.replace(self, data=dataclasses.replace(self.data, doc_multiple=multiple))


def device_count(backend: AttentionBackend) -> int:
    """Devices the run's attention (and step) is spread over."""
    return backend.mesh.size if backend.is_cp else 1


def run_key(cfg: TrainConfig, backend: AttentionBackend) -> str:
    """Stable identity of a run's configuration (same flags, same key)."""
    m, d = cfg.model, cfg.data
    where = "kernel"
    if backend.is_cp:
        where = f"{cfg.cp}-{cfg.layout}-u{cfg.ulysses_size or 0}-n{device_count(backend)}"
    return "/".join(
        (
            WORKLOAD,
            "jax",
            backend.resolved_impl,
            where,
            MASK_NAME,
            f"S{d.seqlen}",
            f"b{d.batch}h{m.heads_q}:{m.heads_kv}d{m.head_dim}",
            SHORT_DTYPES.get(m.dtype, m.dtype),
            f"L{m.depth}w{m.width}v{m.vocab}",
            f"n{cfg.steps}s{d.seed}{d.table()}m{d.doc_multiple}{'f' if d.fixed_layout else ''}",
        )
    )


def point_fields(cfg: TrainConfig, backend: AttentionBackend) -> dict:
    """The record's `point`: the report's columns plus the model and data settings."""
    m, d = cfg.model, cfg.data
    return {
        "workload": WORKLOAD,
        "framework": "jax",
        "impl": backend.resolved_impl,
        "cp": cfg.cp or "none",
        "layout": cfg.layout if backend.is_cp else "none",
        "ulysses_size": cfg.ulysses_size,
        "mask": MASK_NAME,
        "seqlen_total": d.seqlen,
        "seqlen_per_device": -(-d.seqlen // device_count(backend)),
        "num_devices": device_count(backend),
        "scaling": "strong" if backend.is_cp else "none",
        "batch": d.batch,
        "heads_q": m.heads_q,
        "heads_kv": m.heads_kv,
        "head_dim": m.head_dim,
        "dtype": SHORT_DTYPES.get(m.dtype, m.dtype),
        "mode": WORKLOAD,
        "num_masks": cfg.steps,
        "seed": d.seed,
        "window": 0,
        "reference_compat": False,
        "grid": WORKLOAD,
        "model": dataclasses.asdict(m),
        "data": {**dataclasses.asdict(d), "table": d.table(), "corpus": d.identity()},
        "optim": dataclasses.asdict(cfg.optim),
        "steps": cfg.steps,
        "warmup": cfg.warmup,
    }


def fingerprint(cfg: TrainConfig) -> dict:
    """What a checkpoint must agree with to be resumed (the corpus too: another Python's
    standard library gives other batches)."""
    return {
        "model": dataclasses.asdict(cfg.model),
        "data": dataclasses.asdict(cfg.data),
        "corpus": cfg.data.identity(),
        "optim": dataclasses.asdict(cfg.optim),
    }
