"""Count the CP predictor's timed shape families over a preset's plans, on the host.

    python experiments/cp_families.py                  # the GPU cp_predict preset's plans
    python experiments/cp_families.py --devices=8 --seqlens=8192 --masks=causal_document

A JAX rank's timed call (experiments/runners/cp_ranks_jax.py) compiles one XLA program per
distinct (step function, argument shapes): a shape family. This lists the families every
(rank, kept step) of every point's plan would compile, from the plans alone: no kernel runs and
no mask arrays are built (the interval count is the executor's own, jax_cp.interval_count), so
the GPU preset's 64-rank plans are counted on a CPU.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Iterator

from absl import app, flags

from experiments.core import presets
from experiments.core.outcomes import PointFailure
from experiments.core.points import DEFAULT_IMPL, Point, expand
from experiments.runners import frameworks
from experiments.runners.cp_ranks import plan_settings
from experiments.runners.cp_ranks_jax import JaxRanks
from shard_strategies import simulate

GPU_IMPL = "pallas"  # the GPU preset's default impl: its tiles set the shapes


@dataclasses.dataclass(frozen=True, order=True)
class Family:
    """What one timed call's program is compiled for: the step function and argument shapes."""

    fn: str  # the jitted step function of JaxRanks.call
    shard_len: int  # query rows (a ring shard)
    key_len: int  # keys of the step's block
    heads_q: int  # query heads a rank computes (Hq / U)
    heads_kv: int  # K/V heads a rank computes (replicated Hkv / U)
    intervals: int  # key intervals per row of the stacked mask arrays
    tiles: tuple[int, int]  # (block_q, block_k) of the mask arrays' tile lists
    dtype: str
    head_dim: int
    batch: int


def call_fn(call: str, step: int, group_start: bool, mode: str) -> str:
    """The jitted step function JaxRanks.call times for a phase's call (cp_ranks_jax._steps)."""
    if call == simulate.ATTEND:
        return "fwd" if step == 0 else "fwd_merge"
    if call == simulate.ATTEND_BWD:
        if step == 0:
            return "first_bwd"
        return "bwd" if group_start else "bwd_accumulate"
    if call == simulate.ATTEND_ONCE:
        return "once" if mode == "fwd" else "once_vjp"
    return "pullback"


def plan_families(plan, mode: str, impl: str, dtype: str, batch: int = 1) -> set[Family]:
    """The shape families of every (ring rank, kept step) call of `plan` in `mode`."""
    import jax_attn
    from attn_masks import from_slices
    from shard_strategies import jax_cp

    jdtype = frameworks.framework_dtype("jax", dtype)
    one_token = from_slices([[0, 1]], [[0, 1]], [0], 1, 1)  # to ask the impl for its tiles
    arrays = jax_attn.mask_arrays_for(impl, one_token, plan.head_dim, jdtype)
    u = plan.ulysses_size
    heads_kv = plan.num_heads_kv * plan.kv_replication // u
    intervals = jax_cp.interval_count(plan)
    sched = simulate.schedule(plan, mode)
    out = set()
    for ph in sched.phases:
        if ph.call is None:
            continue
        fn = call_fn(ph.call, ph.step, ph.group_start, mode)
        for r in range(plan.ring_size):
            out.add(
                Family(
                    fn,
                    plan.shard_len,
                    len(plan.key_positions(r, ph.step)),
                    plan.num_heads_q // u,
                    heads_kv,
                    intervals,
                    (arrays.block_q, arrays.block_k),
                    dtype,
                    plan.head_dim,
                    batch,
                )
            )
    return out


def preset_points(
    devices: Iterable[int], seqlens: Iterable[int] | None = None, masks: Iterable[str] | None = None
) -> list[Point]:
    """The GPU cp_predict preset's points (optionally fewer device counts, lengths, masks)."""
    (grid,) = presets.get_preset("cp_predict", on_gpu=True).cp
    changes = {"seqlens": tuple(seqlens)} if seqlens else {}
    if masks:
        changes["masks"] = tuple(masks)
    grid = grid.replace(**changes)
    points = []
    for n in devices:
        points += expand(
            grid,
            "jax",
            (DEFAULT_IMPL,),
            seed=42,
            num_devices=n,
            ulysses_size=None,
            ulysses_intra_node=True,
        )
    return points


def problem_plans(points: Iterable[Point], impl: str) -> Iterator[tuple[list[Point], int, object]]:
    """(points, mask index, plan) for each mask of each problem the executor can plan, as
    cp_simulate times it (the executor's plan, its shards bucketed: JaxRanks.timed_plan), the
    points being that problem's modes: one plan serves them all, and none is kept past its
    problem (a 64-rank plan of 2M tokens holds gigabytes)."""
    from shard_strategies import jax_cp

    problems: dict[str, list[Point]] = {}
    for point in points:
        problems.setdefault(dataclasses.replace(point, mode="").key, []).append(point)
    for modes in problems.values():
        point = modes[0]
        try:
            masks = frameworks.make_masks(point)
        except PointFailure:
            continue
        dtype = frameworks.framework_dtype("jax", point.dtype)
        for index, mask in enumerate(masks):
            try:
                plan = jax_cp.executor_plan(mask, impl=impl, dtype=dtype, **plan_settings(point))
            except ValueError:
                continue
            yield modes, index, JaxRanks.timed_plan(point, mask, impl, plan)


def count(points: Iterable[Point], impl: str = GPU_IMPL) -> dict[Family, int]:
    """Each shape family of the points' plans and how many (point, mask) plans use it."""
    uses: collections.Counter[Family] = collections.Counter()
    for modes, _, plan in problem_plans(points, impl):
        for point in modes:
            uses.update(plan_families(plan, point.mode, impl, point.dtype, point.batch))
    return dict(uses)


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when it runs (tests import this module beside run.py,
    whose flags share absl's registry)."""
    devices = [str(n) for n in presets.CP_PREDICT_DEVICES]
    flags.DEFINE_list("devices", devices, "Simulated devices.")
    flags.DEFINE_list("seqlens", None, "Tokens per device (default: the preset's).")
    flags.DEFINE_list("masks", None, "Masks (default: the preset's).")
    flags.DEFINE_string("impl", GPU_IMPL, "The local kernel whose tiles set the shapes.")
    flags.DEFINE_bool("verbose", False, "Print every family.")


def main(argv: list[str]) -> None:
    del argv
    start = time.perf_counter()
    seqlens = [int(s) for s in FLAGS.seqlens] if FLAGS.seqlens else None
    points = preset_points([int(n) for n in FLAGS.devices], seqlens, FLAGS.masks)
    uses = count(points, FLAGS.impl)
    print(f"{len(points)} points, impl {FLAGS.impl}: {len(uses)} timed shape families")
    for name in ("fn", "shard_len", "key_len", "intervals"):
        by = collections.Counter(getattr(f, name) for f in uses)
        print(f"  by {name}: " + ", ".join(f"{k}: {n}" for k, n in sorted(by.items())))
    if FLAGS.verbose:
        for family in sorted(uses):
            print(f"  {family} ({uses[family]} plans)")
    print(f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    define_flags()
    app.run(main)
