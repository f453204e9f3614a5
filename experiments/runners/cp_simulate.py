"""Simulated CP points (--simulate_devices): every rank of an N-device plan, run on one device.

The runner builds the plan the point's executor builds for N devices (JAX or PyTorch) and runs
each rank's local work of every step with that executor's own step functions on that rank's real
inputs (its query shard and heads, the step's key block, the mask piece as the executor splits
it): the framework's part is a Ranks (cp_ranks.py). Each distinct call is timed with the timing
loop; calls of equal shapes and equal mask pieces share one timing. The executor's schedule is
then replayed with a link model (shard_strategies.simulate). Before any timing, ranks are
emulated end to end and checked against float64 attention (cp_rank_checks.py; a forward
point takes the outs its forward+backward point emulated where both run the same forward
programs, Ranks.shares_forward); the whole mask on this one device is the efficiency baseline
(an ordinary kernel point, checked and timed).
Each mask's record says where the point's own seconds went (wall_s: baseline, plan, compiling
the point's new step programs side by side before anything runs them, the check's emulation of
the ranks and its float64 reference with the input draws it needs, timed calls), so a slow
preset shows its cost without a profiler.
Host work overlaps the device's untimed work, never a timed call: a problem's first point
prepares its problem's other points (plans: its plan seconds) and the next problem's, compiles
its problem's new programs, then checks every point of its problem (each check charged to its
own point) while the next problem's programs compile in the compile threads, and waits for them
before its first call is timed (the next problem's plan and compile seconds charged to that
problem's first point).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import socket
import threading
import time
from collections import ChainMap
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from experiments.core import interrupt, provenance
from experiments.core.flags import COMPILE_THREADS
from experiments.core.outcomes import (
    ERROR,
    SCALED,
    UNSUPPORTED,
    WRONG,
    PointFailure,
    chain_text,
    classify,
    device_fault,
)
from experiments.core.points import ITEMSIZES, Point
from experiments.runners import call_model, checks, frameworks, measure, timing
from experiments.runners.cp_rank_checks import ReferenceRows, check_ranks
from experiments.runners.cp_ranks import LONG_CALL_MS, Ranks, plan_settings
from shard_strategies.simulate import ATTEND_ONCE, ATTEND_ONCE_BWD, EXCHANGE, REPLICATED

QUANTILES = ("median", "p20", "p80", "min", "max")
# Longest whole mask timed on one device as the efficiency baseline, unless given; a longer
# problem's baseline is the rate of its mask at this length (SCALED). On a GPU a forward+backward
# call of 512K tokens takes about a minute, one of 128K a few seconds; on a CPU the dense
# reference impl takes a minute per call at 8K tokens, seconds at 2K.
BASELINE_MAX_SEQLEN = {"gpu": 128 * 1024, "cpu": 2 * 1024}
# How each framework's executor takes global arrays (shard_strategies.simulate entries).
ENTRY = {"jax": EXCHANGE, "torch": REPLICATED}
DIGITS = 4  # significant digits of the per-step, per-rank times in a record
# Time budget left (--time_budget) below which a problem's first point does no work ahead (its
# peers' checks, the next problem's plans and programs): work its peers would lose if the
# budget ends before their turn, to be done again by the run that resumes it.
AHEAD_MIN_S = 60.0
RECORDED = "recorded"  # first item of the key of a call known only from the records


def kernel_point(point: Point, impl: str, seqlen: int | None = None) -> Point:
    """The single-device point of the same total work: the whole mask on one device (at
    `seqlen` tokens instead of the point's, for a baseline measured at a capped length)."""
    seqlen = point.seqlen_total if seqlen is None else seqlen
    return dataclasses.replace(
        point,
        impl=impl,
        cp="none",
        layout="none",
        ulysses_size=None,
        ulysses_intra_node=None,
        seqlen_total=seqlen,
        seqlen_per_device=seqlen,
        scaling="none",
        num_devices=1,
        simulated=False,
        link="",
        grid=f"{point.grid}_single_device",
    )


def reference_problem(point: Point, impl: str, index: int) -> tuple:
    """What the row checks' float64 values of mask `index` depend on: the problem's inputs and
    mask, in either mode (ReferenceRows shares them between a problem's points)."""
    return (kernel_point(dataclasses.replace(point, mode="fwd_bwd"), impl).key, index)


def recorded_baselines(records: Iterable[dict]) -> dict[str, dict]:
    """The single-device baselines that simulated records state in full, by kernel point key,
    as CPSimulator.baseline gives them: those run at their own length ("ok", with each mask's
    time and TFLOP/s; a checked run, or the record would not say ok) and those that could not
    run (status and reason; an error is tried again). Records of a baseline scaled from a cap
    leave no time of the cap's run; the record of a point at the cap's length states it."""
    found: dict[str, dict] = {}
    for rec in records:
        singles = [(m.get("index", 0), (m.get("simulation") or {}).get("single_device"))
                   for m in rec.get("masks") or []]  # fmt: skip
        if not singles or any(not s or "key" not in s for _, s in singles):
            continue
        first = singles[0][1]
        entry = {k: first.get(k) for k in ("key", "status", "reason", "seqlen")}
        if first["status"] == "ok":
            by_index = dict(singles)
            if sorted(by_index) != list(range(len(by_index))) or any(
                "time_ms" not in s or "tflops" not in s for s in by_index.values()
            ):
                continue
            entry["result"] = {
                "masks": [
                    {"time_ms": {"median": s["time_ms"]}, "tflops": {"median": s["tflops"]}}
                    for _, s in sorted(by_index.items())
                ]
            }
        elif first["status"] in (SCALED, ERROR):
            continue
        found[first["key"]] = entry
    return found


class RecordedCall(NamedTuple):
    """A call an earlier process of the run timed, as its record lists it: its class's and
    kind's names (_digest), time statistics and the cost model's work features."""

    cls: str
    kind: str
    stats: dict[str, float]
    features: np.ndarray


RECORD_FIELDS = ("id", "class", "kind", "median", "p20", "p80", "n", "area", "heads")


def this_process(framework: str) -> dict:
    """What a record's provenance must match for its timed calls to stand for this process's
    (recorded_calls): the framework's devices, the installed versions and the host."""
    devices = {"jax": provenance.jax_devices, "torch": provenance.torch_devices}[framework]
    return {
        "devices": {framework: devices()},
        "versions": provenance.package_versions(),
        "host": socket.gethostname(),
    }


def recorded_calls(records: Iterable[dict], framework: str, here: dict) -> dict[str, RecordedCall]:
    """The calls the records list as timed (simulation.timed_calls) by `framework` where their
    provenance matches `here` (this_process): the same backend and device kind, the same
    installed versions, and on a CPU the same host. By id: a resumed CP prediction times none
    of them again, and its kinds' models start from them. Calls a record lists without what
    that needs are passed over: those missing RECORD_FIELDS, those of a tile layout without
    its spans (runs before the spans were recorded) or with spans of other partial-tile
    weights (call_model.recorded_weights), and those timed with fewer heads than
    their own (a removed option's rate calls). Records from before 9fce7a0 list no min and
    max: p20 and p80 stand for them."""
    mine = here["devices"][framework]
    found: dict[str, RecordedCall] = {}
    for rec in records:
        prov = rec.get("provenance") or {}
        ran_on = (prov.get("devices") or {}).get(framework) or {}
        alike = ran_on.get("backend") and all(
            ran_on.get(k) == mine.get(k) for k in ("backend", "device_kind")
        )
        if ran_on.get("backend") == "cpu":
            alike = alike and prov.get("host") == here["host"]
        if not alike or prov.get("versions") != here["versions"]:
            continue
        if (rec.get("point") or {}).get("framework") != framework:
            continue
        for mask in rec.get("masks") or []:
            for c in (mask.get("simulation") or {}).get("timed_calls") or []:
                spans = all(s in c for s in call_model.SPANS)
                if any(f not in c for f in RECORD_FIELDS) or "heads_divisor" in c:
                    continue
                if "full" in c and not spans:  # a tile layout, its spans not recorded
                    continue
                if spans and call_model.recorded_weights(c) != call_model.span_weights():
                    continue  # spans of other partial-tile weights
                stats = {q: c[q] for q in ("median", "p20", "p80", "n")}
                stats |= {"min": c.get("min", c["p20"]), "max": c.get("max", c["p80"])}
                if spans:
                    spanned = np.array([1.0, *(c[s] for s in call_model.SPANS)])
                    features = call_model.call_features(c.get("call", ""), spanned)
                else:
                    features = call_model.area_features(np.float64(c["area"]), c["heads"])
                found[c["id"]] = RecordedCall(c["class"], c["kind"], stats, features)
    return found


def _why(stage: str, error: BaseException) -> str:
    """One line on work ahead that failed (made ready, lowering, compile): the stage, the
    error's type and first line (simulation.compiled_at_turn)."""
    first = str(error).strip().split("\n", 1)[0][:200]
    return f"{stage}: {type(error).__name__}: {first}"


def _digest(x: tuple) -> str:
    """A short, stable name of a class or kind of calls, to group a run's timed calls by."""
    return hashlib.sha1(repr(x).encode()).hexdigest()[:12]


def _sig(v: float) -> float:
    """v at DIGITS significant digits, for compact records."""
    return float(f"{v:.{DIGITS}g}")


def _round(x: np.ndarray) -> list:
    """Values at DIGITS significant digits, for compact records."""
    return [_sig(v) for v in np.asarray(x, np.float64).ravel()]


@dataclasses.dataclass
class CallClasses:
    """A point's calls: (phase, ring rank, call key) of each, and per class (kind and shapes)
    its distinct calls {key: (call args, features)} and its kind (the cost model's scope)."""

    uses: list[tuple[int, int, tuple]]
    members: dict[tuple, dict[tuple, tuple]]
    kinds: dict[tuple, tuple]


class Prepared(NamedTuple):
    """A point's mask made ready to run: the executor's plan, its schedule, the ranks (on the
    timed plan) and their classes of calls."""

    plan: object
    sched: object
    ranks: Ranks
    classes: CallClasses


class Compiling(NamedTuple):
    """Step programs compiling in the compile threads (CPSimulator._compile): per point that
    lowered, its fresh classes of calls and the compile job of each one's program; and by
    program every job of this batch and of the batches it was made beside, so settling it
    waits for them all."""

    per_point: list[tuple[list, list]]
    jobs: dict


@dataclasses.dataclass
class Lookahead:
    """The next problem worked on at a problem's first point (CPSimulator._ahead): in the
    planner thread, its points made ready (`upcoming`, from `planned_at`) and their new
    programs lowered and left compiling beside `beside`'s jobs (`planning`, whose result holds
    every job in flight); the seconds the main thread then waited for it, charged to that
    problem's first point."""

    beside: Compiling
    planning: Future | None = None
    upcoming: list[Prepared] | None = None
    planned_at: float = math.inf  # perf_counter() once the points were made ready
    seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def join_ahead(ahead: Lookahead, raising: BaseException | None = None) -> Compiling:
    """The planner's jobs in flight, once it is done; the main thread's wait charged to the next
    problem's plans until the planner made its points ready, to its compiles after. Where the
    main thread is already raising `raising`, a planner failure is added to its notes instead
    of replacing it, and the jobs the planner was started beside are returned."""
    start = time.perf_counter()
    try:
        return ahead.planning.result()
    except Exception as failure:
        if raising is None:
            raise
        raising.add_note(f"the planner thread failed as well: {failure!r}")
        return ahead.beside
    finally:
        end = time.perf_counter()
        planned = min(max(ahead.planned_at, start), end)
        ahead.seconds["plan"] += planned - start
        ahead.seconds["compile"] += end - planned


class Checked(NamedTuple):
    """A mask's check of a point (check_ranks): its result, the global ranks checked and its
    seconds in the ranks' emulation and in the rest (the float64 reference, the comparison)."""

    check: checks.CheckResult
    ranks: list[int]
    emulate_s: float
    reference_s: float


@dataclasses.dataclass
class Problem:
    """One problem's masks (_problem_of: mask, length, draws) and what its points share: the
    executor's plans of both modes (or why there is none), the forward outs its forward points
    take (_forward_store), and by (point key, mask index) the points made ready ahead and the
    checks run ahead (each a Checked or, where it raised, the failure, for the point's turn)."""

    key: tuple
    masks: list
    plans: dict[tuple, tuple | PointFailure] = dataclasses.field(default_factory=dict)
    forwards: dict[tuple, dict] = dataclasses.field(default_factory=dict)
    ready: dict[tuple, Prepared] = dataclasses.field(default_factory=dict)
    unready: dict[tuple, str] = dataclasses.field(default_factory=dict)  # why not made ready
    checked: dict[tuple, Checked | PointFailure] = dataclasses.field(default_factory=dict)
    started: set[int] = dataclasses.field(default_factory=set)  # mask indices begun
    # the seconds the previous problem's first point waited for this one past its checks: for
    # its plans, then for its programs' lowering and compiles (both in the planner thread and
    # the compile threads); charged to this problem's first point
    ahead_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class CPSimulator:
    """Runs simulated points for a framework's runner (its device, inputs and kernel points)
    with that framework's Ranks."""

    def __init__(
        self,
        runner,
        ranks: type[Ranks],
        *,
        baseline_max_seqlen: int | None = None,
        timed_calls: int = 0,
        validation_share: float = 1.0,
        compile_threads: int = COMPILE_THREADS,
    ) -> None:
        self.runner, self.ranks = runner, ranks
        # threads compiling step programs ahead (_compile); 0: each compiles on first use
        self.compile_threads = compile_threads
        if baseline_max_seqlen is None:
            baseline_max_seqlen = BASELINE_MAX_SEQLEN["gpu" if runner.on_gpu else "cpu"]
        self.baseline_max_seqlen = baseline_max_seqlen
        self.timed_calls = timed_calls  # calibration calls per class of calls; 0: time them all
        self.validation_share = validation_share  # of the classes whose model is checked
        self._baselines: dict[str, dict] = {}
        self._baseline_s: dict[str, float] = {}  # per baseline: its seconds, until charged
        self._timings: dict[tuple, dict] = {}  # per distinct call: its time statistics
        self._compiled: set[tuple] = set()  # classes of calls compiled ahead (_compile)
        # per class whose last lowering or compile ahead failed (a peer's or the next
        # problem's): why, until a point compiles it at its turn and records that
        # (simulation.compiled_at_turn) or a later try compiles it
        self._ahead_failed: dict[tuple, str] = {}
        self._pool: ThreadPoolExecutor | None = None  # the compile threads, made on first use
        self._pool_made = threading.Lock()  # the planner thread submits compile jobs too
        self._planner: ThreadPoolExecutor | None = None  # makes the next problem ready (_ahead)
        self._ran: set[tuple] = set()  # classes of calls timed, so their programs have run
        self._expected: list[Point] = []  # the points of the run, in order (expect)
        self._position: dict[str, int] = {}  # a point's index in _expected
        self._calibrated: dict[tuple, dict] = {}  # per class: features of its calibration calls
        self._held_out: dict[tuple, dict] = {}  # per class: features of its held-out calls
        self._idle_stats: dict[tuple, dict] = {}  # per class: its calls without tiles' (_idle)
        self._recorded: dict[str, RecordedCall] = {}  # by id: calls earlier processes timed
        self._recorded_kinds: dict[str, dict[str, RecordedCall]] = {}  # the same, by kind name
        self._kinds_restored: set[tuple] = set()  # kinds whose recorded calls joined _kinds
        self._recorded_classes: dict[str, dict[str, RecordedCall]] = {}  # by class name
        self._checks: dict[tuple, bool] = {}  # per class: whether its model is checked
        self._kinds_checked: set[tuple] = set()  # kinds with a class whose model is checked
        # per kind of call (any shapes): work features of its timed calls; per class predicted
        # across shapes: the calls timed for its rate and those held out to check it
        self._kinds: dict[tuple, dict[tuple, np.ndarray]] = {}
        self._rated: dict[tuple, dict[tuple, np.ndarray]] = {}  # its calls setting its rate
        self._validated: dict[tuple, list[tuple[float, float]]] = {}  # its held-out calls
        # calls timed (_time) since a record last listed them: a failed point's go to the next
        self._timed_log: list[dict] = []
        self._class_kinds: dict[tuple, tuple] = {}  # the current mask's kind of each class
        self._references = ReferenceRows()  # the row checks' float64 values of one problem
        self._problem: Problem | None = None  # the current problem
        self._next: Problem | None = None  # the next one, made ready ahead (_ahead)

    def expect(
        self, points: list[Point], recorded: Iterable[dict] = (), framework: str = ""
    ) -> None:
        """The points this simulator will be given, in order: a problem's first point then
        compiles the new step programs of the points right after it of the same problem (its
        other strategies, layouts and modes) side by side with its own, runs their checks, and
        meanwhile compiles the next problem's (_run_mask). `recorded`: the run's
        records so far, whose single-device baselines a resumed run takes instead of running
        them again (recorded_baselines), and whose calls `framework` timed in a process like
        this one (recorded_calls) it times no more (_restore)."""
        self._expected = [p for p in points if p.simulated]
        self._position = {p.key: i for i, p in enumerate(self._expected)}
        recorded = list(recorded)
        self._baselines.update(recorded_baselines(recorded))
        if framework:
            self._take_recorded(recorded_calls(recorded, framework, this_process(framework)))

    def _take_recorded(self, calls: dict[str, RecordedCall]) -> None:
        """Keep recorded calls (by id) for _restore, by id and by kind name."""
        self._recorded.update(calls)
        for call_id, call in calls.items():
            self._recorded_kinds.setdefault(call.kind, {})[call_id] = call
            self._recorded_classes.setdefault(call.cls, {})[call_id] = call

    def baseline(self, point: Point, impl: str) -> dict:
        """The kernel point of the whole mask on this device ({status, reason, result, key,
        seqlen}), run once per key and shared by every strategy and layout of the same problem.
        A problem longer than the cap gets the whole mask's run at the cap (status SCALED): its
        TFLOP/s stand for the long problem's, which is not run (one call of a 512K-token
        forward+backward takes about a minute)."""
        cap = self.baseline_max_seqlen
        if cap is None or point.seqlen_total <= cap:
            return self._run_baseline(kernel_point(point, impl))
        out = dict(self._run_baseline(kernel_point(point, impl, seqlen=cap)))
        if out["status"] == "ok":
            out["status"] = SCALED
            out["reason"] = (
                f"{point.seqlen_total} tokens > --sim_baseline_max_seqlen={cap}: the rate of "
                f"the whole mask at {cap} tokens"
            )
        return out

    def _run_baseline(self, kp: Point) -> dict:
        """The kernel point `kp` run (or its earlier outcome) as a baseline."""
        if kp.key in self._baselines:
            return self._baselines[kp.key]
        start = time.perf_counter()
        try:
            out = {"status": "ok", "reason": None, "result": self.runner.run(kp)}
        except PointFailure as e:
            out = {"status": e.status, "reason": e.reason}
        except Exception as e:
            from experiments.core.outcomes import classify

            status, reason = classify(e)
            out = {"status": status, "reason": reason}
        out.update(key=kp.key, seqlen=kp.seqlen_total)
        self._baselines[kp.key] = out
        self._baseline_s[kp.key] = time.perf_counter() - start
        return out

    def run(self, point: Point) -> dict:
        """Metrics (predicted), check and per-mask detail of a simulated point. A baseline's
        seconds are charged to the first point that needs it and succeeds (its first mask's
        wall_s): a point failing after running it leaves them to the next, not to nothing, and
        so are the calls it timed to the next record's timed_calls (marked carried)."""
        impl = self.ranks.resolve_impl(point, self.runner)
        masks = self._problem_masks(point)
        base = self.baseline(point, impl)
        left = len(self._timed_log)  # calls timed by points that failed since the last record
        per_mask = [self._run_mask(point, m, i, impl, base) for i, m in enumerate(masks)]
        carried = [{**c, "carried": True} for c in self._timed_log[:left]]
        per_mask[0]["simulation"]["timed_calls"][:0] = carried
        baseline_s = self._baseline_s.pop(base["key"], 0.0)
        per_mask[0]["simulation"]["wall_s"]["baseline"] = round(baseline_s, 3)
        result = measure.aggregate(point, per_mask)
        sims = [m["simulation"] for m in per_mask]
        eff = [s["efficiency_pct"] for s in sims]
        result["metrics"].update(
            efficiency_pct=float(np.mean(eff)) if None not in eff else None,
            load_imbalance=float(np.mean([s["load_imbalance"] for s in sims])),
            single_device_status=base["status"],
        )
        self._timed_log = []  # listed by this record
        return result

    @staticmethod
    def _problem_of(point: Point) -> tuple:
        """What a point's masks are drawn from: mask, length, draws."""
        return (
            point.mask, point.seqlen_total, point.num_masks, point.seed, point.window,
            point.reference_compat,
        )  # fmt: skip

    def _problem_masks(self, point: Point) -> list:
        """The point's masks, drawn once per problem (mask, length, draws), so the points of
        every strategy, layout and mode of one problem share their plans (Problem.plans); the
        problem made ready ahead where it is the next one (_ahead)."""
        key = self._problem_of(point)
        if self._problem is None or key != self._problem.key:
            ahead = self._next if self._next is not None and self._next.key == key else None
            self._problem = ahead or Problem(key, frameworks.make_masks(point))
            self._next = None
        return self._problem.masks

    @staticmethod
    def _plan_key(point: Point, index: int, impl: str) -> tuple:
        """What the plans of mask `index` of the current problem depend on (not the mode)."""
        return (index, impl, point.dtype, *sorted(plan_settings(point).items()))

    def _plans_of(self, problem: Problem, point: Point, index: int, impl: str) -> tuple:
        """(the executor's plan, the plan its ranks are timed with) of mask `index` of the
        problem: built once for both modes (a 64-device plan takes seconds)."""
        settings = self._plan_key(point, index, impl)
        if settings not in problem.plans:
            mask = problem.masks[index]
            try:
                plan = self.ranks.executor_plan(point, mask, impl)
            except ValueError as e:  # kept, so the problem's other points ask no plan again
                problem.plans[settings] = PointFailure(UNSUPPORTED, f"not applicable: {e}")
            else:
                problem.plans[settings] = (plan, self.ranks.timed_plan(point, mask, impl, plan))
        plans = problem.plans[settings]
        if isinstance(plans, PointFailure):
            raise PointFailure(plans.status, plans.reason)
        return plans

    def _call_classes(self, ranks: Ranks, sched, point: Point) -> CallClasses:
        """Every (phase, ring rank) call of the schedule, keyed, and grouped in classes (kind
        and shapes; only the mask piece differs, so one compiled program a class)."""
        plan = sched.plan
        features = ranks.features()
        hq, hkv = len(ranks.q_heads[0]), len(ranks.kv_heads[0])
        shapes = (point.batch, ranks.plan.shard_len, hq, hkv)
        timed_as = (point.warmup, point.iters, point.chain_ms)  # calls timed alike share times
        common = (ranks.impl, point.dtype, point.head_dim, *shapes, *timed_as)
        kind_of = (ranks.impl, point.dtype, point.head_dim, hq // hkv, *timed_as)
        out = CallClasses(uses=[], members={}, kinds={})
        for p, ph in enumerate(sched.phases):
            if ph.call is None:
                continue
            once = ph.call in (ATTEND_ONCE, ATTEND_ONCE_BWD)
            for r in range(plan.ring_size):
                shape = ranks.call_shape(r, ph.step)
                if shape is None:  # the executor calls nothing there: no compute
                    continue
                call = (ph.call, point.mode if once else "", ph.step == 0, ph.group_start)
                cls = (*common, *call, *shape)
                out.kinds[cls] = (*kind_of, *call, *ranks.call_kind(r, ph.step))
                key = (*cls, ranks.fingerprint(r, ph.step))
                out.members.setdefault(cls, {})[key] = (
                    (ph.call, r, ph.step, ph.group_start),
                    call_model.call_features(ph.call, features[r, ph.step]),
                )
                out.uses.append((p, r, key))
        return out

    def _prepare(self, problem: Problem, point: Point, index: int, impl: str) -> Prepared:
        """The point's plan for mask `index` of its problem, its schedule, ranks and classes
        of calls."""
        from shard_strategies import simulate

        plan, timed_plan = self._plans_of(problem, point, index, impl)
        sched = simulate.schedule(
            plan,
            point.mode,
            itemsize=ITEMSIZES[point.dtype],
            batch=point.batch,
            entry=ENTRY[point.framework],
        )
        ranks = self.ranks(timed_plan, impl, point, index, self.runner)
        ranks.forwards = self._forward_store(problem, point, index, impl)
        return Prepared(plan, sched, ranks, self._call_classes(ranks, sched, point))

    def _forward_store(self, problem: Problem, point: Point, index: int, impl: str) -> dict | None:
        """Ranks.forwards of the point's plan and inputs: for a forward point, and for another
        mode only where an expected forward point of the same plan and inputs follows it in
        this problem, so nothing is kept that no point takes."""
        key = self._store_key(point, index, impl)
        if point.mode != "fwd" and not any(
            q.mode == "fwd"
            and self._store_key(q, index, self.ranks.resolve_impl(q, self.runner)) == key
            for q in self._problem_after(point)
        ):
            return None
        return problem.forwards.setdefault(key, {})

    def _store_key(self, point: Point, index: int, impl: str) -> tuple:
        """What an emulation's out depends on besides the rank and rows: the inputs (shapes,
        seed, mask: reference_problem) and the plan."""
        return reference_problem(point, impl, index), self._plan_key(point, index, impl)

    def _problem_after(self, point: Point) -> list[Point]:
        """The expected points right after `point` of its problem (none where not expected)."""
        start = self._position.get(point.key)
        return self._same_problem(start + 1) if start is not None else []

    def _next_problem(self, point: Point) -> list[Point]:
        """The expected points of the problem after `point`'s (none where not expected)."""
        start = self._position.get(point.key)
        if start is None:
            return []
        return self._same_problem(start + 1 + len(self._problem_after(point)))

    def _same_problem(self, start: int) -> list[Point]:
        """The expected points from position `start` on while they share its problem."""
        after = []
        for q in self._expected[start:]:
            if after and self._problem_of(q) != self._problem_of(after[0]):
                break
            after.append(q)
        return after

    def _compiles_ahead(self) -> bool:
        """Whether step programs compile before they run, in the compile threads."""
        return self.ranks.COMPILES_AHEAD and self.compile_threads > 0

    def _begins_problem(self, index: int) -> bool:
        """Whether this point is the first of its problem to run mask `index` and does the work
        ahead: where step programs compile ahead (else each point compiles and checks its own),
        no stop was asked and the time budget has AHEAD_MIN_S left."""
        first = self._compiles_ahead() and index not in self._problem.started
        self._problem.started.add(index)
        left = interrupt.remaining_s()
        return first and not interrupt.stop_requested() and (left is None or left >= AHEAD_MIN_S)

    def _made_ready(
        self, problem: Problem, points: list[Point], index: int
    ) -> list[tuple[Point, Prepared]]:
        """The points with mask `index` of `problem` made ready (Problem.ready: made ahead,
        or now and kept there), but those that cannot be (their turn raises)."""
        made = []
        for q in points:
            key = (q.key, index)
            if key not in problem.ready:
                try:
                    impl = self.ranks.resolve_impl(q, self.runner)
                    problem.ready[key] = self._prepare(problem, q, index, impl)
                except Exception as e:  # noqa: BLE001 - it is made again at its turn
                    problem.unready[key] = _why("made ready", e)
                    continue
                problem.unready.pop(key, None)  # a later try made it ready
            made.append((q, problem.ready[key]))
        return made

    def _lower(
        self, preps: list[Prepared], *, first_raises: bool = True, skip: Mapping | None = None
    ) -> tuple[dict, list[tuple[list, list]]]:
        """({program: lowered} to compile, [(classes, programs)] of each point that lowered) for
        the classes of the points' calls not compiled yet: each lowered in turn
        (Ranks.lower_calls; classes that share a program, or a program in `skip`, once). The
        first point's failure raises (unless first_raises is False); another's leaves its
        classes to compile at its turn."""
        lowered: dict = {}
        owners: list[tuple[list, list]] = []
        for i, prep in enumerate(preps):
            members = prep.classes.members
            fresh = [cls for cls in members if cls not in self._compiled]
            calls = [next(iter(members[cls].values()))[0] for cls in fresh]
            try:
                programs, new = prep.ranks.lower_calls(calls, skip=ChainMap(lowered, skip or {}))
            except Exception as e:  # noqa: BLE001 - a peer's error is its own, at its turn
                if i == 0 and first_raises:
                    raise
                self._ahead_failed.update(dict.fromkeys(fresh, _why("lowering", e)))
                continue
            lowered.update(new)
            owners.append((fresh, programs))
        return lowered, owners

    def _submit(self, lowered: dict) -> dict:
        """{program: future} of each lowered program compiling in the compile threads (XLA
        compiles outside the GIL, so they run side by side, beside the host's plans and the
        device's work)."""
        if not lowered:
            return {}
        with self._pool_made:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.compile_threads, "compile")
        return {key: self._pool.submit(low.compile) for key, low in lowered.items()}

    def _compile(
        self,
        preps: list[Prepared],
        *,
        first_raises: bool = True,
        beside: Compiling | None = None,
    ) -> Compiling:
        """The classes of the points' calls that this process has not compiled yet, lowered
        now in turn (_lower: the first point's failure raises unless first_raises is False)
        and left compiling in the compile threads; a program that `beside` compiles already
        is not lowered again. Nothing waits: the result holds `beside`'s jobs too, so settling
        it (_settle) waits for every job in flight."""
        pending = beside.jobs if beside is not None else {}
        if not self._compiles_ahead() or not preps:
            return Compiling([], dict(pending))
        lowered, owners = self._lower(preps, first_raises=first_raises, skip=pending)
        jobs = {**pending, **self._submit(lowered)}
        return Compiling([(fresh, [jobs[k] for k in keys]) for fresh, keys in owners], jobs)

    def _settle(self, compiling: Compiling, *, raises: bool = False) -> None:
        """Wait for every compile job of `compiling`; the classes whose programs compiled count
        as compiled, the others compile at their turn. With `raises`, the first point's first
        failed program raises (once every job has ended)."""
        for job in compiling.jobs.values():
            job.exception()  # waits
        failed = None
        for i, (fresh, jobs) in enumerate(compiling.per_point):
            for cls, job in zip(fresh, jobs):
                if job.exception() is None:
                    self._compiled.add(cls)
                    self._ahead_failed.pop(cls, None)  # a later try compiled it
                elif raises and i == 0:
                    failed = failed or job.exception()
                else:
                    self._ahead_failed[cls] = _why("compile", job.exception())
        if failed is not None:
            raise failed

    def _next_ready(self, point: Point, index: int) -> list[Prepared]:
        """The next problem's points (_next_problem) with their mask `index` made ready, kept
        in self._next for their turn; none where there is no next problem or it cannot be
        drawn (its first point draws it again, and raises)."""
        points = self._next_problem(point)
        if not points:
            return []
        key = self._problem_of(points[0])
        if self._next is None or self._next.key != key:
            try:
                self._next = Problem(key, frameworks.make_masks(points[0]))
            except Exception:  # noqa: BLE001 - its first point's own error, at its turn
                return []
        if index >= len(self._next.masks):
            return []
        return [prep for _, prep in self._made_ready(self._next, points, index)]

    def _ahead(self, point: Point, index: int, beside: Compiling) -> Lookahead:
        """The next problem worked on in the planner thread while this problem's checks run
        (_plan_ahead): host work (plans, classes of calls, tracing) beside the checks' device
        work, whose runs wait on the device outside the GIL."""
        if self._planner is None:
            self._planner = ThreadPoolExecutor(1, "planner")
        ahead = Lookahead(beside)
        ahead.planning = self._planner.submit(self._plan_ahead, point, index, ahead)
        return ahead

    def _plan_ahead(self, point: Point, index: int, ahead: Lookahead) -> Compiling:
        """The next problem's points made ready (_next_ready), then their new programs lowered
        point by point and left compiling in the compile threads (a failure is left to the
        point's turn): lowering makes no array on the device (Ranks.lower_calls), so it adds
        nothing to the memory of the check beside it. After a stop request (Ctrl-C) no further
        point is lowered: the point's end waits for the planner and the jobs in flight."""
        ahead.upcoming = self._next_ready(point, index)
        ahead.planned_at = time.perf_counter()
        compiling = Compiling([], ahead.beside.jobs)
        for prep in ahead.upcoming:
            if interrupt.stop_requested():
                break
            batch = self._compile([prep], first_raises=False, beside=compiling)
            compiling = Compiling(compiling.per_point + batch.per_point, batch.jobs)
        return compiling

    def _check(self, point: Point, mask, index: int, impl: str, ranks: Ranks) -> Checked:
        """The point's check of mask `index` (check_ranks), run now or taken from the check
        run ahead at its problem's first point (an error it raised there raises now)."""
        ahead = self._problem.checked.pop((point.key, index), None)
        if isinstance(ahead, PointFailure):
            raise ahead
        if ahead is not None:
            return ahead
        rtol = checks.tolerance(
            point.dtype, on_gpu=self.runner.on_gpu, override=self.runner.rtol_override
        )
        start = time.perf_counter()
        known = self._references.of(reference_problem(point, impl, index))
        check, checked = check_ranks(ranks, point, mask, index, rtol, known)
        # the rest of the check: the float64 reference (draws, host work) where it outlasts the
        # ranks' runs beside which it is computed, and the comparison
        rest = time.perf_counter() - start - ranks.emulate_seconds
        return Checked(check, checked, ranks.emulate_seconds, rest)

    def _check_ahead(self, peers: list[tuple[Point, Prepared]], index: int) -> None:
        """The peers' checks of mask `index`, each kept for its turn (Problem.checked) with
        its ranks' device arrays dropped (Ranks.drop_arrays): untimed device work, while the
        next problem is planned and its programs compile (_run_mask)."""
        problem = self._problem
        for q, prep in peers:
            impl = self.ranks.resolve_impl(q, self.runner)
            try:
                problem.checked[q.key, index] = self._check(
                    q, problem.masks[index], index, impl, prep.ranks
                )
            except Exception as e:  # noqa: BLE001 - raised at the peer's turn, into its record
                status, reason = classify(e)
                if device_fault(chain_text(e)):  # the device is unusable: stop, naming the peer
                    raise PointFailure(
                        ERROR,
                        f"the check of {q.key} (run ahead at its problem's first point; "
                        f"--sim_compile_threads=0 checks each point at its own turn): {reason}",
                    ) from None
                # no traceback kept (its frames would hold the check's device arrays); the
                # peers after it check at their own turns
                problem.checked[q.key, index] = PointFailure(status, reason)
                return
            finally:
                prep.ranks.drop_arrays()

    def _time_calls(
        self, ranks: Ranks, sched, point: Point, classes: CallClasses
    ) -> tuple[dict, dict]:
        """({quantile: (P, N) compute ms}, counts): every (rank, step) call's time statistics.

        A distinct call (kind, shapes, mask arrays) is timed once, here or by an earlier point.
        With --sim_timed_calls=k > 0, a class of calls (kind and shapes; only the mask piece
        differs) with more untimed calls than k + call_model.VALIDATION_CALLS is timed on a
        calibration sample spanning its pieces' work and the rest predicted by the class's
        cost model (experiments/runners/call_model.py), whose error on further timed,
        held-out calls the counts report (for the validation_share of classes _checked picks;
        "unchecked" counts the calls predicted in classes that state no check); at later
        points the class's fit predicts the calls its timed ones span and times the rest
        (_covered). A class whose
        calls the model of their kind (any shapes) puts past LONG_CALL_MS is predicted from
        that model at the class's own rate instead, from a call or two of it timed, or at the
        rate its kind's other classes give it (_across_shapes). With k > 0, calls whose pieces
        hold no tile take one timed call of their class's (_idle) and join neither model; calls
        the records hold take their recorded times (_restore)."""
        plan = sched.plan
        ring_of = np.array([plan.ring_rank(g) for g in range(plan.world_size)])
        self._class_kinds = classes.kinds
        stats: dict[tuple, dict] = {}
        counts = {"distinct": sum(map(len, classes.members.values())), "timed": 0, "modelled": 0}
        counts["across_shapes"] = 0  # of the modelled: by their kind's model (_across_shapes)
        counts["unchecked"] = 0  # of the modelled: in classes stating no held-out check
        counts["idle"] = 0  # of the modelled: pieces without tiles, at their class's one (_idle)
        counts["recorded"] = 0  # not timed: times an earlier process recorded (_restore)
        held_out: list[tuple[float, float]] = []  # (predicted, measured) median ms
        for cls, members in classes.members.items():
            kind = classes.kinds[cls]
            counts["recorded"] += self._restore(cls, kind, members)
            working = members  # with --sim_timed_calls=0 every call is timed, idle ones too
            if self.timed_calls:
                working = {key: m for key, m in members.items() if m[1][1:].any()}
            idle = [key for key in members if key not in working]
            timed, shared = self._idle(ranks, point, cls, idle, members)
            counts["timed"] += timed
            counts["idle"] += len(shared)
            counts["modelled"] += len(shared)
            stats.update(shared)
            timed, predicted, errors = self._across_shapes(ranks, point, cls, kind, working)
            counts["across_shapes"] += len(predicted)
            if timed is None:
                timed, predicted, errors = self._class_stats(ranks, point, cls, kind, working)
            counts["timed"] += timed
            counts["modelled"] += len(predicted)
            counts["unchecked"] += 0 if errors else len(predicted)  # no check stated for them
            if predicted:  # the check of a class that predicts calls at this point
                held_out += errors
            stats.update(predicted)
            stats.update({key: self._timings[key] for key in members if key in self._timings})
            self._remember(kind, working)
        if held_out:
            pred, meas = zip(*held_out)
            counts["model"] = call_model.held_out_error(pred, meas).as_dict()
        compute = {q: np.zeros((len(sched.phases), plan.world_size)) for q in QUANTILES}
        for p, r, key in classes.uses:
            for q in QUANTILES:
                compute[q][p, ring_of == r] = stats[key][q]
        return compute, counts

    def _time(self, ranks: Ranks, point: Point, key: tuple, call: tuple, role: str) -> dict:
        """Time one distinct call (Ranks.time; warm where a call of its class ran before) into
        self._timings, log it (self._timed_log, the record's timed_calls) with what it was
        timed for (`role`) and return its statistics."""
        warm = key[:-1] in self._ran
        times = ranks.time(call, point.warmup, point.iters, warm=warm)
        self._ran.add(key[:-1])
        stats = self._timings[key] = timing.time_stats(times.ms)
        name, r, t, group_start = call
        q, k = ranks.call_tokens(r, t)
        layout = ranks.piece_stats(r, t)  # where the kernels take tile lists: spans too
        spans = {}
        if layout:
            features = call_model.call_features(name, ranks.features()[r, t])
            spans = dict(zip(call_model.SPANS, features[1:].tolist()))
            spans["slots"] = ranks.slots()  # the schedule's, so a run says what it assumed
            spans |= call_model.span_weights()
        self._timed_log.append(
            {
                "role": role,
                "id": _digest(key),
                "class": _digest(key[:-1]),
                "kind": _digest(self._class_kinds[key[:-1]]),
                "call": name,
                "step": int(t),
                "group_start": bool(group_start),
                "q": q,
                "k": k,
                "heads": ranks.grid_heads()[0],
                "heads_kv": ranks.grid_heads()[1] // point.batch,
                "area": float(ranks.plan.piece_area[r, t]),
                **(layout or {}),
                **spans,
                **{s: _sig(stats[s]) for s in QUANTILES},
                "n": int(stats["n"]),
                "first_run": times.by_first_run,
                "after_compile": times.after_compile,
                "warm": warm,
                **({} if times.untimed_ms is None else {"untimed_ms": _sig(times.untimed_ms)}),
            }
        )
        return stats

    def _restore(self, cls: tuple, kind: tuple, members: dict[tuple, tuple]) -> int:
        """How many of the class's calls take their times from the records (expect) instead of
        a timing: those an earlier process of the run timed. The first time a kind is seen, its
        recorded calls of at least call_model.KIND_FIT_MIN_MS that did work (no _idle call)
        join its model across shapes (_remember's table), and the first time a class is seen,
        its recorded calls that did work join its calibration (_class_stats goes on from their
        fit), under RECORDED keys until a point's call is one of them, then under its key with
        the features this process gives it."""
        if not self._recorded or not members:
            return 0
        table = self._kinds.setdefault(kind, {})
        width = len(next(iter(members.values()))[1])

        def working(call: RecordedCall) -> bool:
            return len(call.features) == width and bool(call.features[1:].any())

        if kind not in self._kinds_restored:
            self._kinds_restored.add(kind)
            for call_id, call in self._recorded_kinds.get(_digest(kind), {}).items():
                if working(call) and call.stats["median"] >= call_model.KIND_FIT_MIN_MS:
                    key = (RECORDED, call.cls, call_id)
                    self._timings[key], table[key] = call.stats, call.features
        if cls not in self._calibrated:
            calibrated = self._calibrated[cls] = {}
            for call_id, call in self._recorded_classes.get(_digest(cls), {}).items():
                if working(call):
                    key = (RECORDED, call.cls, call_id)
                    self._timings[key], calibrated[key] = call.stats, call.features
        restored = 0
        for key, (_, x) in members.items():
            if key in self._timings:  # timed or restored before: no digest to take
                continue
            call_id = _digest(key)
            call = self._recorded.get(call_id)
            if call is None:
                continue
            self._timings[key], restored = call.stats, restored + 1
            old = (RECORDED, call.cls, call_id)
            # the same call: once in the kind's fit, the class's rate and its calibration
            for fit in (table, self._rated.get(cls, {}), self._calibrated[cls]):
                if fit.pop(old, None) is not None:
                    fit[key] = x
            self._timings.pop(old, None)
        return restored

    def _idle(
        self, ranks: Ranks, point: Point, cls: tuple, idle: list[tuple], members: dict[tuple, tuple]
    ) -> tuple[int, dict[tuple, dict]]:
        """(calls timed now, {key: stats} of those not timed) of a class's calls whose pieces
        hold no tile (every work feature 0): the same program on the same shapes walking
        nothing, so each takes the time of the class's first one timed (timed here where none
        was). Their cost is what the kernels do outside their walks (a backward's dO.O row sums
        and zeroed dK/dV: 2.6 ms at 8 GPUs x 32K on the H100), which a kind's model fitted on
        long calls puts at 0; so they join no fit and are never held out."""
        if not idle:
            return 0, {}
        untimed = [key for key in idle if key not in self._timings]
        timed = 0
        if cls not in self._idle_stats:
            known = next((key for key in idle if key in self._timings), None)
            if known is None:
                known, timed = untimed.pop(0), 1
                self._time(ranks, point, known, members[known][0], "idle")
            self._idle_stats[cls] = self._timings[known]
        return timed, {key: self._idle_stats[cls] for key in untimed}

    def _class_stats(
        self, ranks: Ranks, point: Point, cls: tuple, kind: tuple, members: dict[tuple, tuple]
    ) -> tuple[int, dict[tuple, dict], list[tuple[float, float]]]:
        """(calls timed now, {key: predicted stats}, held-out (predicted, measured) medians) of
        one class of calls: all timed, or a calibration sample timed and the rest modelled.
        A _checked class also times call_model.VALIDATION_CALLS of the rest, held out: each
        predicted by the fit of the class's calibration calls alone (the fit an unchecked
        class predicts with), then fitted on too. A class calibrated at earlier points (its
        timed calls, or an earlier process's, of at least k distinct pieces' work) goes on
        from its fit (_covered). Whether a class is checked is decided once it is modelled,
        not while its calls are all timed."""
        keys = list(members)
        untimed = [k for k in keys if k not in self._timings]
        k = self.timed_calls
        calibrated = self._calibrated.setdefault(cls, {})
        distinct = len(np.unique(np.array(list(calibrated.values())), axis=0)) if calibrated else 0
        if k and distinct >= k and untimed:
            return self._covered(ranks, point, cls, kind, members, untimed)
        checked = k > 0 and self._checked(cls, kind, decide=False)
        if k == 0 or len(untimed) <= k + (call_model.VALIDATION_CALLS if checked else 0):
            for key in untimed:
                self._time(ranks, point, key, members[key][0], "all")
            if k:  # the class's calibration at its later points
                calibrated.update({key: members[key][1] for key in untimed})
            return len(untimed), {}, []
        checked = self._checked(cls, kind)
        x = np.array([members[key][1] for key in keys])
        calibrate = [keys[i] for i in call_model.calibration_picks(x, k)]
        rest = [key for key in untimed if key not in set(calibrate)]
        held = []
        if checked:
            held = self._draw(point, rest, call_model.VALIDATION_CALLS)
            self._kinds_checked.add(kind)
        fresh = [key for key in calibrate if key not in self._timings] + held
        for key in fresh:
            role = "held_out" if key in held else "calibration"
            self._time(ranks, point, key, members[key][0], role)
        calibrated.update({key: members[key][1] for key in calibrate})
        predicted, errors = self._predict_class(cls, members, rest, held)
        return len(fresh), predicted, errors

    def _covered(
        self,
        ranks: Ranks,
        point: Point,
        cls: tuple,
        kind: tuple,
        members: dict[tuple, tuple],
        untimed: list[tuple],
    ) -> tuple[int, dict[tuple, dict], list[tuple[float, float]]]:
        """_class_stats of a class calibrated at earlier points: a piece's time depends on its
        work alone, whichever mask, layout or GPU count made the piece, so the class's fit
        serves every later point. Its calls whose work lies outside what its timed calls span
        are timed first as calibration (call_model.coverage_picks), so the fit interpolates;
        a _checked class then times call_model.REUSE_VALIDATION_CALLS of the rest, held out,
        so each point it serves with calls left to predict after them states a check of the
        fit it predicts with."""
        calibrated = self._calibrated[cls]
        known = np.array(list(calibrated.values()))
        x = np.array([members[key][1] for key in untimed])
        extend = [untimed[i] for i in call_model.coverage_picks(known, x)]
        for key in extend:
            self._time(ranks, point, key, members[key][0], "calibration")
        calibrated.update({key: members[key][1] for key in extend})
        rest = [key for key in untimed if key not in set(extend)]
        held = []
        checked = self._checked(cls, kind)
        if checked:
            self._kinds_checked.add(kind)
        if checked and len(rest) > call_model.REUSE_VALIDATION_CALLS:
            held = self._draw(point, rest, call_model.REUSE_VALIDATION_CALLS)
            for key in held:
                self._time(ranks, point, key, members[key][0], "held_out")
        predicted, errors = self._predict_class(cls, members, rest, held)
        return len(extend) + len(held), predicted, errors

    def _draw(self, point: Point, keys: list[tuple], n: int) -> list[tuple]:
        """n of `keys` drawn at random (seeded by the point and the calls timed so far)."""
        rng = np.random.default_rng(point.seed + len(self._timings))
        return [keys[i] for i in rng.choice(len(keys), n, replace=False)]

    def _predict_class(
        self, cls: tuple, members: dict[tuple, tuple], rest: list[tuple], held: list[tuple]
    ) -> tuple[dict[tuple, dict], list[tuple[float, float]]]:
        """({key: predicted stats} of the class's calls in `rest` not timed, the held-out
        (predicted, measured) medians of `held`): the held-out calls predicted by the fit of
        the class's calibration calls alone, then fitted on too for the rest."""
        calibrated = self._calibrated[cls]
        coef = self._fit(calibrated)
        errors = [(float(members[key][1] @ coef), self._timings[key]["median"]) for key in held]
        held_out = self._held_out.setdefault(cls, {})
        held_out.update({key: members[key][1] for key in held})
        known = {**calibrated, **held_out}  # the held-out calls then fitted on too
        if held_out:
            coef = self._fit(known)
        ratios = call_model.quantile_ratios([self._timings[key] for key in known], QUANTILES)
        predicted = {
            key: call_model.scaled_quantiles(float(members[key][1] @ coef), ratios)
            for key in rest
            if key not in self._timings
        }
        return predicted, errors

    def _remember(self, kind: tuple, members: dict[tuple, tuple]) -> None:
        """Add the class's timed calls of at least call_model.KIND_FIT_MIN_MS to its kind's."""
        table = self._kinds.setdefault(kind, {})
        for key, (_, x) in members.items():
            if self._timings.get(key, {}).get("median", 0.0) >= call_model.KIND_FIT_MIN_MS:
                table[key] = x

    def _kind_model(self, kind: tuple) -> np.ndarray | None:
        """Coefficients of the kind's model across shapes, or None while fewer than
        call_model.MIN_CALIBRATION long calls of it were timed."""
        table = self._kinds.get(kind, {})
        if len(table) < call_model.MIN_CALIBRATION:
            return None
        return self._fit(table)

    def _across_shapes(
        self, ranks: Ranks, point: Point, cls: tuple, kind: tuple, members: dict[tuple, tuple]
    ) -> tuple[int | None, dict[tuple, dict], list[tuple[float, float]]]:
        """(calls timed now, {key: predicted stats}, held-out (predicted, measured) medians) of
        a class whose untimed calls the model of its kind, at the class's rate where it has one,
        puts at LONG_CALL_MS or more at their median: each is predicted as the kind's model
        times the class's own rate at its shapes (call_model.class_rate) over its calls timed
        so far (those any earlier point timed, else call_model.LONG_RATE_CALLS timed now: its
        cheapest call that the kind's model puts at LONG_CALL_MS and at RATE_CALL_SHARE of its
        median untimed call or more, a rate in the throughput regime for a fraction of the
        median call's seconds; none where none was timed and _rate_trend gives the rate from
        the kind's other classes, which also decides whether the calls count as long); then,
        for a _checked class (a class on the trend only where calls are left to predict after
        the check), call_model.LONG_VALIDATION_CALLS more, drawn at random, are predicted at
        that rate and timed as the held-out check every point the class serves states, and
        join the rate the rest are predicted at.
        Seconds a call at 2M tokens, where the class's own calibration would time a dozen.
        (None, {}, []) where that model does not apply: no model of the kind yet, or calls
        shorter than that."""
        untimed = [key for key in members if key not in self._timings]
        coef = self._kind_model(kind) if self.timed_calls and untimed else None
        if coef is None:
            return None, {}, []
        x = {key: members[key][1] for key in members}
        guess = {key: float(x[key] @ coef) for key in untimed}
        # the class's calls timed so far, by any point (its kind's table holds them)
        rated = self._rated.setdefault(cls, {})
        mine = {cls, (RECORDED, _digest(cls))}  # its calls and those only the records hold
        rated.update({k: v for k, v in self._kinds[kind].items() if k[:-1] in mine})
        rated.update({k: x[k] for k in members if k in self._timings})
        median = float(np.median(list(guess.values())))
        trend = None if rated else self._rate_trend(kind, cls, coef, median)
        scale = self._class_rate(rated, coef) if rated else trend or 1.0
        if scale * median < LONG_CALL_MS:
            return None, {}, []
        checked = self._validated.setdefault(cls, [])
        timed = 0
        while trend is None and len(rated) < call_model.LONG_RATE_CALLS and untimed:
            # the cheapest call past LONG_CALL_MS and RATE_CALL_SHARE of the median one
            middle = call_model.RATE_CALL_SHARE * float(np.median([guess[k] for k in untimed]))
            long = [k for k in untimed if guess[k] >= max(LONG_CALL_MS / scale, middle)]
            key = min(long, key=guess.__getitem__) if long else max(untimed, key=guess.get)
            self._time(ranks, point, key, members[key][0], "rate")
            rated[key], timed = x[key], timed + 1
            untimed.remove(key)
        rng = np.random.default_rng(point.seed + len(self._timings))
        wanted = call_model.LONG_VALIDATION_CALLS if self._checked(cls, kind) else 0
        if trend is not None and len(untimed) <= wanted:  # the check would be every call left:
            wanted = 0  # predicted at the trend, the check left to a point with more of them
        while len(checked) < wanted and untimed:
            self._kinds_checked.add(kind)
            key = untimed.pop(int(rng.integers(len(untimed))))
            rate = self._class_rate(rated, coef) if rated else trend
            ms = self._time(ranks, point, key, members[key][0], "rate_held_out")["median"]
            checked.append((rate * guess[key], ms))
            rated[key], timed = x[key], timed + 1
        rate = self._class_rate(rated, coef) if rated else trend
        ratios = call_model.quantile_ratios(
            [self._timings[key] for key in self._kinds[kind]], QUANTILES
        )
        predicted = {key: call_model.scaled_quantiles(rate * guess[key], ratios) for key in untimed}
        return timed, predicted, list(checked)  # every point it serves states its check

    def _rate_trend(self, kind: tuple, cls: tuple, coef: np.ndarray, length: float) -> float | None:
        """call_model.rate_trend at `length` ms of the kind's other classes than `cls` with
        calls in its model's table (timed here or recorded, one class either way) that the
        model gives time, or None while fewer than call_model.RATE_TREND_CLASSES classes have
        them or `length` is not positive."""
        by_class: dict[str, list[tuple]] = {}
        for key in self._kinds.get(kind, {}):
            name = key[1] if key[0] == RECORDED else _digest(key[:-1])
            if name != _digest(cls):
                by_class.setdefault(name, []).append(key)
        table = self._kinds.get(kind, {})
        lengths, rates = [], []
        for keys in by_class.values():
            modelled = np.array([table[key] for key in keys]) @ coef
            if np.median(modelled) > 0:
                lengths.append(float(np.median(modelled)))
                rates.append(self._class_rate({key: table[key] for key in keys}, coef))
        if len(lengths) < call_model.RATE_TREND_CLASSES or length <= 0:
            return None
        return call_model.rate_trend(np.array(lengths), np.array(rates), length)

    def _checked(self, cls: tuple, kind: tuple, *, decide: bool = True) -> bool:
        """Whether the model of class `cls` (of `kind`) is checked on held-out timed calls,
        decided once (with decide=False: what it would be, not yet decided): a share of
        validation_share of the classes, drawn by the class's name (_digest) so that every
        process of a resumed run draws the same ones, all of them at a share of 1; and a
        kind's first class to be modelled where no class of the kind was checked yet, so
        every kind's model has a check (a process resuming a run may check a few more) where
        its classes have calls left to predict after one: a class on its kind's rate trend
        times its check only then (_across_shapes), and its points state none before."""
        if cls in self._checks:
            return self._checks[cls]
        drawn = int(_digest(cls), 16) < self.validation_share * 16 ** len(_digest(cls))
        checked = drawn or kind not in self._kinds_checked
        if decide:
            self._checks[cls] = checked
        return checked

    def _class_rate(self, rated: dict[tuple, np.ndarray], coef: np.ndarray) -> float:
        """call_model.class_rate of a class's calls timed for it (work features by key)."""
        keys = list(rated)
        measured = [self._timings[key]["median"] for key in keys]
        return call_model.class_rate(np.array([rated[key] for key in keys]), measured, coef)

    def _fit(self, known: dict[tuple, np.ndarray]) -> np.ndarray:
        """The tile model's coefficients of the median times of the calls in `known`."""
        keys = list(known)
        x = np.array([known[key] for key in keys])
        return call_model.fit(x, [self._timings[key]["median"] for key in keys])

    def _run_mask(self, point: Point, mask, index: int, impl: str, base: dict) -> dict:
        from shard_strategies import simulate

        wall = {"baseline": 0.0}  # where this point's seconds went (the baseline: run() says)
        start = time.perf_counter()
        ready = self._problem.ready.pop((point.key, index), None)
        unready = self._problem.unready.pop((point.key, index), None)
        if ready is None:
            ready = self._prepare(self._problem, point, index, impl)
        # at a problem's first point: the points after it of the problem made ready (their
        # plans: this point's plan seconds), and below those of the next problem (charged to
        # that problem's first point: Problem.ahead_s)
        first = self._begins_problem(index)
        plan_s = time.perf_counter() - start
        start = time.perf_counter()
        # compiling while the plans below are made; every job in flight is waited for before
        # any call is timed (each batch holds the jobs of those it was made beside)
        in_flight = own_jobs = self._compile([ready])
        compile_s = time.perf_counter() - start
        at_turn = {  # its classes compiled now after a failed try ahead: why it failed
            _digest(cls): self._ahead_failed.pop(cls)
            for fresh, _ in own_jobs.per_point
            for cls in fresh
            if cls in self._ahead_failed
        }
        ahead: Lookahead | None = None
        raising: BaseException | None = None
        try:
            start = time.perf_counter()
            peers = (
                self._made_ready(self._problem, self._problem_after(point), index) if first else []
            )
            wall["plan"] = plan_s + time.perf_counter() - start
            start = time.perf_counter()
            in_flight = peer_jobs = self._compile(
                [p for _, p in peers], first_raises=False, beside=own_jobs
            )
            compile_s += time.perf_counter() - start
            # the next problem made ready, lowered and compiling in the planner thread while
            # this one's checks run
            ahead = self._ahead(point, index, peer_jobs) if first else None
            start = time.perf_counter()
            self._settle(peer_jobs)  # this problem's programs compiled before its checks
            self._settle(own_jobs, raises=True)
            wall["compile"] = compile_s + time.perf_counter() - start
            done = self._check(point, mask, index, impl, ready.ranks)
            if done.check.ok and peers:
                ready.ranks.drop_arrays()  # its check's arrays, before its peers' checks
                self._check_ahead(peers, index)
        except BaseException as error:
            raising = error
            raise
        finally:
            try:
                if ahead is not None:
                    in_flight = join_ahead(ahead, raising)
            finally:
                start = time.perf_counter()
                self._settle(in_flight)  # none while timed
            if ahead is not None and ahead.upcoming:  # per mask of the point: summed
                ahead.seconds["compile"] += time.perf_counter() - start
                self._next.ahead_s.update(ahead.seconds)
        plan, sched, ranks, classes = ready
        itemsize = ITEMSIZES[point.dtype]
        wall["emulate"] = done.emulate_s  # the check's runs of the ranks
        wall["reference"] = done.reference_s
        check, checked = done.check, done.ranks
        if not check.ok:
            raise PointFailure(WRONG, f"mask {index}: {check.message}", {"check": check.as_dict()})
        start = time.perf_counter()
        logged = len(self._timed_log)
        compute, counts = self._time_calls(ranks, sched, point, classes)
        wall["calls"] = time.perf_counter() - start
        link = simulate.LinkModel.from_spec(point.link)
        transfers = simulate.transfer_ms(sched, link)  # the same for every quantile's replay
        preds = {
            q: simulate.predict(sched, compute[q], link, transfers=transfers) for q in QUANTILES
        }
        t = {q: preds[q].total_ms for q in QUANTILES} | {"n": point.iters}
        med = preds["median"]
        comm = plan.comm_volume(itemsize=itemsize, batch=point.batch)
        sim = self._summary(point, mask, index, sched, med, link, impl, base)
        sim["calls"] = {"total": int((compute["median"] > 0).sum()), **counts}
        sim["check_ranks"] = checked
        if unready:
            at_turn["point"] = unready  # its whole point: its classes were not lowered ahead
        if at_turn:
            sim["compiled_at_turn"] = at_turn
        sim["check_forwards_taken"] = ranks.forwards_taken  # ranks' outs from forward+backward
        sim["timed_calls"] = self._timed_log[logged:]  # run() adds a failed point's
        for part, secs in self._problem.ahead_s.items():  # spent on this problem before it
            wall[part] += secs
        self._problem.ahead_s.clear()  # charged to this point, the problem's first to succeed
        sim["wall_s"] = {part: round(secs, 3) for part, secs in wall.items()}
        extra = {"plan": plan.summary(), "comm": comm, "simulation": sim}
        return measure.mask_metrics(point, mask, index, t, None, None, check.as_dict(), extra)

    def _summary(self, point, mask, index, sched, pred, link, impl, base) -> dict:
        """The record's simulation detail of one mask: per phase and rank, parts, baseline."""
        from attn_masks import attention_flops
        from shard_strategies import simulate

        flops = attention_flops(mask, point.heads_q, point.head_dim, point.mode, point.batch)
        per_gpu = flops / point.num_devices / (pred.total_ms * 1e-3) / 1e12
        strategy_ms = pred.part_ms(simulate.STRATEGY)
        own = [ph.part == simulate.STRATEGY for ph in sched.phases]
        slowest = float(pred.compute_ms[own].max(axis=1).sum())
        single = None
        if base["status"] == "ok":
            m = base["result"]["masks"][index]
            single = {"time_ms": m["time_ms"]["median"], "tflops": m["tflops"]["median"]}
        elif base["status"] == SCALED:  # the rate at the cap: no time of this problem's length
            single = {"tflops": base["result"]["masks"][index]["tflops"]["median"]}
        return {
            "impl": impl,
            "link": dataclasses.asdict(link),
            "time_ms": {
                "total": pred.total_ms,
                "strategy": strategy_ms,
                "dispatch": pred.part_ms(simulate.DISPATCH),
                "slowest_compute": slowest,
                "exposed_comm": max(strategy_ms - slowest, 0.0),  # no float residue below 0
            },
            "tflops_per_gpu": per_gpu,
            "tflops_per_gpu_strategy": flops / point.num_devices / (strategy_ms * 1e-3) / 1e12,
            "load_imbalance": pred.load_imbalance,
            "rank_compute_ms": _round(pred.compute_ms.sum(axis=0)),
            "rank_exposed_ms": _round(pred.exposed_ms.sum(axis=0)),
            "compute_ms": float(pred.compute_ms.sum()),
            "bytes": {
                f"{part}_{d}": sched.bytes_sent(d, part)
                for part in (simulate.STRATEGY, simulate.DISPATCH)
                for d in ("fwd", "bwd")
            },
            "phases": [
                {
                    "name": ph.name,
                    "part": ph.part,
                    "ms": _sig(pred.phase_ms[i]),
                    "compute_ms": _round(pred.compute_ms[i]),
                    "exposed_ms": _round(pred.exposed_ms[i]),
                }
                for i, ph in enumerate(sched.phases)
            ],
            "single_device": {
                "key": base["key"],
                "status": base["status"],
                "reason": base["reason"],
                "seqlen": base["seqlen"],
                **(single or {}),
            },
            "efficiency_pct": 100.0 * per_gpu / single["tflops"] if single else None,
        }
