"""What the CP predictor asks of a framework: one plan's ranks on this one device.

A subclass per framework (cp_ranks_jax.py, cp_ranks_torch.py) builds the plan its executor
builds, runs a rank's local work with that executor's own step functions, and times one call;
everything else (the float64 checks, which calls to time, the cost model, the schedule replay,
the record) is shared and lives in cp_simulate.py and cp_rank_checks.py.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Container
from typing import NamedTuple

import numpy as np

from attn_masks import default_scale
from experiments.core.points import Point
from experiments.runners import call_model, checks, frameworks, inputs, timing

CHECK_TILES = 4  # query tiles of a shard a row check emulates, where the framework can
MIN_DRAW = 128  # the fewest rows a host draw asks of the device (draw_length)
LONG_CALL_MS = 100.0  # a timed call at least this long is sampled once (Ranks.time)
# the largest emulated out kept for a forward point (Ranks.emulated): a JAX row check's rows are
# megabytes, a PyTorch rank's whole shard at 32K tokens and 64 heads 1 GiB
FORWARD_KEPT_BYTES = 64 << 20


class CallTimes(NamedTuple):
    """A timed call's per-sample milliseconds; by_first_run: its one sample is its first run
    that compiled nothing (Ranks.time); after_compile: a run before it compiled the call's
    program (its class's first call); untimed_ms: the run before the samples that none of
    them is (None where there was none, or it compiled), so the records show what a run of
    a program's first call costs beyond the samples (a class's first call is run twice)."""

    ms: list[float]
    by_first_run: bool
    after_compile: bool = False
    untimed_ms: float | None = None


class CallTimer(NamedTuple):
    """One call made ready (Ranks.timer): `run()` runs it once, its inputs ready and the L2
    flushed before the clock starts, stopped at its result (ms, or None where the run traced or
    compiled); `sample(warmup, iters, known_ms)` times it with the timing loop (known_ms: a
    measured run's ms, from which its chains take their length)."""

    run: Callable[[], float | None]
    sample: Callable[[int, int, float | None], list[float]]


def draw_length(n: int) -> int:
    """n rounded up to one of four lengths per power of two (at least MIN_DRAW): at most 25%
    more rows than asked for, and few distinct lengths over any range of n."""
    n = max(n, MIN_DRAW)
    step = 1 << max(n.bit_length() - 3, 0)
    return -(-n // step) * step


def plan_settings(point: Point) -> dict:
    """The plan keywords both executors take from a point (strategy, layout, sizes, placement)."""
    return {
        "world_size": point.num_devices,
        "strategy": point.cp,
        "layout": point.layout,
        "ulysses_size": point.ulysses_size,
        "inner_axis": frameworks.inner_axis(point.ulysses_intra_node),
        "num_heads_q": point.heads_q,
        "num_heads_kv": point.heads_kv,
        "head_dim": point.head_dim,
    }


class Ranks(ABC):
    """The ranks of one plan in one mode on this device: inputs, calls, end to end runs.

    A rank is (ring rank r, Ulysses rank u): the query rows of ring shard r and the heads of
    Ulysses group position u (K/V heads repeated when U > Hkv, as the all-to-all delivers them).
    A call is (kind, ring rank, kept step, group start) with a kind of shard_strategies.simulate
    (ATTEND, ATTEND_BWD, ATTEND_ONCE, ATTEND_ONCE_BWD), made with rank (r, 0)'s shapes and mask
    piece. A rank's inputs are drawn on the device for its own tokens only (`device_rows`),
    never the whole sequence, which at 64 devices x 32K tokens would not fit one device, and the
    checks copy back only the rows and keys they compare; timed calls run on synthetic
    inputs of the same shapes (`timed_queries`, `timed_keys`): a call's time depends on its
    shapes and mask piece, not on the values, so only the checks need the real ones.
    """

    COMPILES_AHEAD = False  # whether lower_calls gives programs to compile before they run

    def __init__(self, plan, impl: str, point: Point, index: int) -> None:
        self.plan, self.impl, self.mode = plan, impl, point.mode
        self.batch = point.batch
        self.chain_ms = point.chain_ms  # timed calls: one at a time (0) or in chains (timing.py)
        self._shapes = inputs.shapes(
            point.batch, point.seqlen_total, point.heads_q, point.heads_kv, point.head_dim
        )
        self._source = (point.seed, index)
        self.emulate_seconds = 0.0  # spent in emulated(): the checks' runs of the ranks
        # emulated outs of the plan's forward+backward point, for its forward point (emulated)
        self.forwards: dict[tuple, np.ndarray] | None = None
        self.forwards_taken = 0  # emulations a forward point took from them
        self._timing_inputs: dict[tuple, object] = {}
        u, hq, rep = plan.ulysses_size, plan.num_heads_q, plan.kv_replication
        hkv = plan.num_heads_kv * rep
        self.q_heads = [np.arange(j * hq // u, (j + 1) * hq // u) for j in range(u)]
        self.kv_heads = [np.arange(j * hkv // u, (j + 1) * hkv // u) // rep for j in range(u)]

    def _synthetic(self, name: str, tokens: int, heads: int):
        """A timed call's input `name` of `tokens` tokens and `heads` heads (once per shape)."""
        shape = (self.batch, tokens, heads, self._shapes[name][3])
        if (name, shape) not in self._timing_inputs:
            self._timing_inputs[name, shape] = self.normal(shape, len(self._timing_inputs))
        return self._timing_inputs[name, shape]

    def timed_queries(self, name: str, r: int):
        """Synthetic q or dout with ring rank r's shapes (Ulysses rank 0's heads)."""
        return self._synthetic(name, len(self.plan.layout.positions[r]), len(self.q_heads[0]))

    def timed_keys(self, r: int, t: int) -> tuple:
        """Synthetic K and V with the shapes of ring rank r's block at kept step t."""
        n, heads = int(self.plan.key_counts[r, t]), len(self.kv_heads[0])
        return tuple(self._synthetic(name, n, heads) for name in ("k", "v"))

    @staticmethod
    @abstractmethod
    def resolve_impl(point: Point, runner) -> str:
        """The local kernel the executor runs for the point's impl on the runner's device."""

    @staticmethod
    @abstractmethod
    def executor_plan(point: Point, mask, impl: str):
        """The CPPlan the executor builds for the point (ValueError when it cannot)."""

    @staticmethod
    def timed_plan(point: Point, mask, impl: str, plan):
        """The plan whose ranks the predictor checks and times for the executor's `plan`: that
        plan here; a framework that compiles per shape may pad its shards to shared lengths
        (the schedule, and so the communication charged, stays the executor's)."""
        return plan

    def host(self, name: str, rows: np.ndarray | None = None, heads=None) -> np.ndarray:
        """Float32 host copy of input `name` as the kernels see it: all of it, or the given
        token rows and heads (device_rows, copied back). The rows are drawn padded to
        draw_length with positions past the end, so the checks' ever-different row and key
        counts share a few compiled draws instead of compiling one each."""
        if rows is None:
            return self.host_draw(name, None, heads)
        return self.host_draw(name, self.padded_positions(name, rows), heads)[:, : len(rows)]

    def padded_positions(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Token positions `rows` of input `name`, padded to draw_length with positions past
        its end (drawn as zeros), so draws of ever-different counts share a few programs."""
        padded = np.full(draw_length(len(rows)), self._shapes[name][1], np.int64)
        padded[: len(rows)] = rows
        return padded

    def host_draw(self, name: str, positions: np.ndarray | None, heads) -> np.ndarray:
        """device_rows(name, positions, heads) as a float32 host array."""
        return self.to_host(self.device_rows(name, positions, heads))

    def reference_rows(
        self, mask, rows_of: list[np.ndarray], u: int, heads: np.ndarray, grads: bool, scale: float
    ) -> dict[str, np.ndarray]:
        """Float64 out (and dq), (B, rows, len(heads), D) each, at the global query rows of
        `rows_of` (one array per rank, concatenated) in the local query `heads` of Ulysses
        position u, over every key those rows see: on the host from float32 copies of the
        inputs, the queries drawn rank by rank (no draw holds more than one rank's own tokens);
        a framework may compute it on its device."""
        qh, kh = self.q_heads[u], np.unique(self.kv_heads[u])
        rows = np.concatenate(rows_of)
        cols = checks.keys_seen(mask, rows)
        q = np.concatenate([self.host("q", r, qh) for r in rows_of], axis=1)
        # dout is read only for the gradients; without them q stands in for it
        dout = np.concatenate([self.host("dout", r, qh) for r in rows_of], axis=1) if grads else q
        inp = checks.Inputs(q=q, k=self.host("k", cols, kh), v=self.host("v", cols, kh), dout=dout)
        return checks.rows_reference(inp, mask, checks.CheckPlan(rows, cols, heads), scale, grads)

    @abstractmethod
    def normal(self, shape: tuple[int, ...], seed: int):
        """A device array of standard normal values in the point's dtype, a timed call's input
        (a framework may repeat one draw: the values do not change a call's time)."""

    @abstractmethod
    def device_rows(self, name: str, positions: np.ndarray | None = None, heads=None):
        """Input `name` (q, k, v, dout) at token positions (default all; past the end: zeros)
        and heads (default all), drawn on the device in the point's dtype. A value depends only
        on (input, batch, token, head, dim), so any rank's tokens and any sampled rows agree
        without the host drawing anything."""

    @abstractmethod
    def drop_arrays(self) -> None:
        """Drop the device arrays a check left cached here, so a point checked ahead of its
        turn holds none while other points run (CPSimulator._check_ahead)."""

    @abstractmethod
    def to_host(self, x) -> np.ndarray:
        """A float32 numpy copy of a device array."""

    @abstractmethod
    def all_finite(self, x) -> bool:
        """Whether a device array holds no inf or NaN (decided on the device)."""

    def check_block(self) -> int | None:
        """The query tile in which this framework's emulation can be restricted to some rows of
        a shard (check_rows), or None: a row check emulates whole shards."""
        return None

    @property
    def scale(self) -> float:
        """The attention's softmax scale, 1 / sqrt(head dim): the ranks' calls and their checks'
        float64 reference use it alike."""
        return default_scale(self.plan.head_dim)

    def check_rows(self, r: int, seqlen: int) -> np.ndarray | None:
        """Local rows of ring rank r's shard that a row check emulates: up to CHECK_TILES whole
        query tiles holding real tokens (the first, the last, evenly between); each kernel call
        sees those tiles as the shard's call does, at a fraction of its work on a block-sparse
        kernel. A partial last tile (a shard not padded to tiles) is never picked. None, all
        rows: the framework cannot restrict, the shard is short (fewer than 4 x CHECK_TILES
        whole tiles: its whole emulation is cheap), or no whole tile holds a real token."""
        block = self.check_block()
        positions = self.plan.layout.positions[r]
        count = 0 if block is None else len(positions) // block
        if count < 4 * CHECK_TILES:
            return None
        real = (positions[: count * block] < seqlen).reshape(count, block).any(axis=1)
        tiles = np.flatnonzero(real)
        if not len(tiles):
            return None
        # evenly spaced indices >= 1 apart, so distinct after rounding
        picks = np.linspace(0, len(tiles) - 1, min(len(tiles), CHECK_TILES)).round().astype(int)
        return (tiles[picks][:, None] * block + np.arange(block)).ravel()

    def emulated(self, r: int, u: int, rows: np.ndarray | None = None) -> dict:
        """emulate(r, u, rows), its seconds added to emulate_seconds, so a point's record can
        split its check between running the ranks and the float64 reference. Where the ranks'
        forward is the same in every mode (shares_forward) and `forwards` is given (the
        simulator's store for one plan and its inputs), an emulation in another mode leaves its
        out there (up to FORWARD_KEPT_BYTES) and a forward point takes it instead of running
        the same programs on the same inputs again."""
        key = (r, u, None if rows is None else np.asarray(rows, np.int64).tobytes())
        store = self.forwards if self.shares_forward() else None
        if store is not None and self.mode == "fwd" and key in store:
            self.forwards_taken += 1
            return {"out": store.pop(key)}
        start = time.perf_counter()
        try:
            result = self.emulate(r, u, rows)
        finally:
            self.emulate_seconds += time.perf_counter() - start
        if store is not None and self.mode != "fwd" and result["out"].nbytes <= FORWARD_KEPT_BYTES:
            store[key] = result["out"]
        return result

    def shares_forward(self) -> bool:
        """Whether a forward emulation runs the same programs on the same inputs as the
        forward part of a forward+backward one, so the two give the same out (emulated)."""
        return False

    @abstractmethod
    def emulate(self, r: int, u: int, rows: np.ndarray | None = None) -> dict:
        """Rank (r, u) end to end: its output "out" (and "dq") as float32 host arrays, and
        "dkv": (kept step, dK, dV) of every block it saw, over that block's key positions, left
        on the device (to_host copies them where a check compares them; a row check only asks
        all_finite, so 64 steps of dK/dV never cross to the host for it). rows
        (check_rows; only where check_block is not None): only those rows of its shard, in
        that order, emulated in the shard's shapes with the other rows given no inputs and no
        keys (their dK/dV parts only), so its calls run the timed calls' compiled programs."""

    @abstractmethod
    def call_shape(self, r: int, t: int) -> tuple | None:
        """What sets the shapes of ring rank r's call at kept step t beyond the plan's (part of
        the call's class), or None where the executor makes no call there."""

    def call_kind(self, r: int, t: int) -> tuple:
        """What of call_shape(r, t) changes a call's cost per tile beyond its sizes (part of the
        call's kind, whose cost model spans every size: cp_simulate)."""
        return ()

    @abstractmethod
    def fingerprint(self, r: int, t: int) -> str:
        """Identity of the mask piece ring rank r's kernel receives at kept step t."""

    @abstractmethod
    def features(self) -> np.ndarray:
        """(R, T, F) the cost model's work features of every piece's call (call_model)."""

    def slots(self) -> int:
        """CTAs the device runs at once in the cost model's schedule (call_model.SLOTS here)."""
        return call_model.SLOTS

    def grid_heads(self) -> tuple[int, int]:
        """(query, K/V) heads times the batch of one rank's kernel call: its grid's heads."""
        return self.batch * len(self.q_heads[0]), self.batch * len(self.kv_heads[0])

    def piece_stats(self, r: int, t: int) -> dict[str, int] | None:
        """call_model.work_stats of ring rank r's piece at kept step t, where the framework's
        kernels take tile maps (None here: a piece's work is its area)."""
        return None

    def call_tokens(self, r: int, t: int) -> tuple[int, int]:
        """(query, key) tokens of ring rank r's timed call at kept step t."""
        return len(self.plan.layout.positions[r]), int(self.plan.key_counts[r, t])

    def lower_calls(self, calls: list[tuple], skip: Container = ()) -> tuple[list, dict]:
        """(each call's program, {program: an object whose compile() makes it ready} of those
        not in `skip`) for these calls (timer's call tuples): what the simulator compiles side
        by side before the check and the timing run them. By default none: the framework
        compiles on first use (COMPILES_AHEAD says which ranks do compile ahead)."""
        return [None] * len(calls), {}

    def time(self, call: tuple, warmup: int, iters: int, *, warm: bool = False) -> CallTimes:
        """Per-call milliseconds of one call (synthetic inputs of its shapes), run once (timer)
        first, then with the timing loop: `iters` samples, or one where that one takes at least
        LONG_CALL_MS (its spread is small against its length, and at 64 devices an all-gather
        or Ulysses call takes seconds). A `warm` call (its compiled program has run before, as
        an earlier call of its class) asked for no warm-up is timed by its first run alone
        where that run takes timing.SAMPLE_RUN_MS or more and compiled nothing: the host's
        share of so long a call is under half a percent, and an untimed run and one or two
        samples would double or triple its device time; so is a call whose program never ran
        (compiled ahead) where that run takes timing.FIRST_PROGRAM_RUN_MS or more (what a program's
        first run adds, loading it, is milliseconds). A call whose first run compiled (its
        class's first) and is asked for no warm-up is run once more: that run, its program's
        first warm one, counts as a warm call's first run (at 32K tokens a GPU a class's first
        call takes 0.3-2.4 s, which a warm-up and a sample would spend again)."""
        timer = self.timer(call)
        first_ms = timer.run()
        compiled = first_ms is None
        if compiled and warmup == 0:
            first_ms, warm = timer.run(), True
        enough = timing.SAMPLE_RUN_MS if warm else timing.FIRST_PROGRAM_RUN_MS
        if warmup == 0 and first_ms is not None and first_ms >= enough:
            return CallTimes([first_ms], by_first_run=True, after_compile=compiled)
        times = timer.sample(warmup, 1, first_ms)
        if iters > 1 and times[0] < LONG_CALL_MS:
            times += timer.sample(0, iters - 1, first_ms)
        return CallTimes(times, by_first_run=False, after_compile=compiled, untimed_ms=first_ms)

    @abstractmethod
    def timer(self, call: tuple) -> CallTimer:
        """One call made ready (its inputs made once), to run and time (CallTimer): a run is
        measured as one sample of the timing loop is (timing.jax_first_ms,
        timing.torch_first_ms), None where the framework saw it compile."""
