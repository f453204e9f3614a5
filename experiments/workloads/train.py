"""The training step: model state as pytrees, weighted next-token loss, AdamW, compiled per
argument structure (ahead of time, so timed calls never include a compilation)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.workloads.nnx_attention import AttentionBackend

from .lm import LMConfig, TransformerLM

CLIP_NORM = 1.0
FINAL_LR_FRACTION = 0.1
# Initialisation runs once: on CPU a quick compilation beats a fast program (3x less time).
CPU_INIT_OPTIONS = {"xla_backend_optimization_level": 0}


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping, a linear warm-up, then (decay_steps > 0) cosine decay to
    a tenth of the peak at decay_steps: the schedule most LM recipes use (optax's
    warmup_cosine_decay_schedule); decay_steps 0 keeps the peak after the warm-up."""

    learning_rate: float = 3e-3
    warmup_steps: int = 5
    decay_steps: int = 0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95

    def schedule(self) -> optax.Schedule:
        """Learning rate by step."""
        start = self.learning_rate / max(self.warmup_steps, 1)
        if self.decay_steps <= self.warmup_steps:
            return optax.linear_schedule(start, self.learning_rate, self.warmup_steps)
        return optax.warmup_cosine_decay_schedule(
            start,
            self.learning_rate,
            self.warmup_steps,
            self.decay_steps,
            end_value=FINAL_LR_FRACTION * self.learning_rate,
        )

    def transform(self) -> optax.GradientTransformation:
        """The optax optimizer."""
        schedule = self.schedule()
        return optax.chain(
            optax.clip_by_global_norm(CLIP_NORM),
            optax.adamw(schedule, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay),
        )


def init_state(
    cfg: LMConfig,
    backend: AttentionBackend,
    tx: optax.GradientTransformation,
    seed: int,
    sharding: jax.sharding.Sharding,
) -> tuple[nnx.GraphDef, nnx.State, Any]:
    """(graphdef, params, optimizer state) of a fresh model, initialised by one compiled program
    straight into `sharding` (no host round trip, the same values on any placement)."""

    def create() -> tuple[nnx.State, Any]:
        params = nnx.state(TransformerLM(cfg, backend, rngs=nnx.Rngs(seed)))
        return params, tx.init(params)

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: TransformerLM(cfg, backend, rngs=nnx.Rngs(0))))
    options = CPU_INIT_OPTIONS if jax.default_backend() == "cpu" else None
    params, opt_state = jax.jit(create, out_shardings=sharding).lower().compile(options)()
    return graphdef, params, opt_state


def loss_fn(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    positions: jax.Array | None,
    mask: Any,
) -> jax.Array:
    """Mean next-token cross entropy over the positions with weight 1 (order-invariant, so the
    same on a batch dispatched into a CP layout, whose padding tokens have weight 0)."""
    logits = nnx.merge(graphdef, params)(tokens, mask, positions)
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (xent * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def make_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> Callable:
    """jit of (params, opt_state, tokens, targets, weights, positions, mask) -> (params,
    opt_state, loss); positions None: arange(S)."""

    def step(params, opt_state, tokens, targets, weights, positions, mask):
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(
            graphdef, params, tokens, targets, weights, positions, mask
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


class CompiledSteps:
    """Compiled executables of a jitted function, one per argument structure and shapes.

    Masks of a shape share one executable (their arrays are arguments); a CP plan with another
    schedule is another structure. `get` says whether it compiled, and how long that took.
    """

    def __init__(self, jitted: Callable) -> None:
        self.jitted = jitted
        self._compiled: dict = {}

    def get(self, *args: Any) -> tuple[Callable, float | None]:
        """(executable, compile seconds or None if it was compiled before)."""
        leaves, treedef = jax.tree.flatten(args)
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
        if key in self._compiled:
            return self._compiled[key], None
        t0 = time.perf_counter()
        compiled = self.jitted.lower(*args).compile()
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - t0
