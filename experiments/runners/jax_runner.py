"""Runs one JAX point (single-device kernel or shard_map CP): build, check, time, measure."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from experiments.core.flags import COMPILE_THREADS
from experiments.core.outcomes import WRONG, PointFailure
from experiments.core.points import Point
from experiments.runners import (
    checks,
    device_reference,
    frameworks,
    inputs,
    measure,
    memory,
    timing,
)
from experiments.runners.cp_ranks import draw_length
from experiments.runners.cp_ranks_jax import JaxRanks
from experiments.runners.cp_simulate import CPSimulator


def _slowest_process(times: list[float], peak: float | None) -> tuple[list[float], float | None]:
    """Multi-process runs: per call the slowest process's time, and the highest peak."""
    import jax

    if jax.process_count() == 1:
        return times, peak
    from jax.experimental import multihost_utils

    t = multihost_utils.process_allgather(np.asarray(times, np.float64))
    p = multihost_utils.process_allgather(np.asarray(-1.0 if peak is None else peak))
    return t.max(axis=0).tolist(), (None if peak is None else float(p.max()))


def _dispatch_qkv(executor, q, k, v) -> tuple:
    """q, k and v in a CP executor's layout (one program; the executor is a pytree argument, so
    executors of equal shapes share its compilation)."""
    return tuple(executor.dispatch(x) for x in (q, k, v))


def fetch_rows(x, index: np.ndarray | None) -> np.ndarray:
    """Float32 host copy of x, only the given positions along the sequence axis (the `fetch` of
    checks.check_point): gathered and converted in one program whose index is padded to
    draw_length, so the checks' ever-different row and key counts share a few compilations."""
    from jax.experimental import multihost_utils

    n = None if index is None else len(index)
    x = _take_f32()(x, None if index is None else _padded(index), None)
    if not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)[:, :n]


def _padded(index: np.ndarray) -> np.ndarray:
    """index padded with position 0 to draw_length, so gathers of ever-different counts share
    a few programs (fetch_rows, row_reference)."""
    padded = np.zeros(draw_length(len(index)), np.int64)
    padded[: len(index)] = index
    return padded


@functools.cache
def _take_f32() -> Callable:
    """jitted (x, positions or None, heads or None) -> x at those positions along axis 1 and
    heads along axis 2 (None: all), as float32."""
    import jax
    import jax.numpy as jnp

    def take(x, positions, heads):
        x = x if positions is None else jnp.take(x, positions, axis=1)
        x = x if heads is None else jnp.take(x, heads, axis=2)
        return x.astype(jnp.float32)

    return jax.jit(take)


def row_reference(
    args: dict, mask
) -> Callable[[checks.CheckPlan, float, bool], dict[str, np.ndarray]]:
    """The `reference` of checks.check_point for a single-device point's inputs `args` (on the
    device): a row plan's float64 rows computed there (device_reference), so neither the keys
    the rows see (128K per head at the longest) nor a host float64 pass over them is paid. The
    rows are gathered padded to draw_length, the keys a chunk at a time in float32, only the
    K/V heads the compared query heads read, in chunks of less than twice the keys the rows
    see (device_reference.fitted_chunk): the check holds device memory of the order of the
    host path's copy of those keys (one chunk of k and v, and a chunk's float64 scores), which
    the point's recorded peak may include."""

    def reference(plan: checks.CheckPlan, scale: float, grads: bool) -> dict[str, np.ndarray]:
        heads_q, heads_kv = args["q"].shape[2], args["k"].shape[2]
        heads = np.arange(heads_q) if plan.heads is None else np.asarray(plan.heads)
        # the K/V heads read, gathered alone; kv_of indexes them
        kv, kv_of = np.unique(heads // (heads_q // heads_kv), return_inverse=True)
        rows = _padded(plan.rows)
        q = _take_f32()(args["q"], rows, heads)
        dout = _take_f32()(args["dout"], rows, heads) if grads else None

        def keys(positions: np.ndarray) -> tuple:
            """k, v at a chunk's positions, padding (-1) read at position 0 (masked)."""
            at = np.maximum(positions, 0)
            return tuple(_take_f32()(args[n], at, kv) for n in ("k", "v"))

        return device_reference.rows_reference(
            mask,
            plan.rows,
            q,
            dout,
            keys,
            kv_of,
            scale,
            chunk=device_reference.fitted_chunk(len(plan.cols)),
            cols=plan.cols,
        )

    return reference


def all_finite(x) -> bool:
    """No NaN or inf in x (the `finite` of checks.check_point)."""
    import jax.numpy as jnp

    return bool(jnp.isfinite(x).all())


def build_call(
    mode: str, attn: Callable, a: dict, run: Callable[[Callable, tuple], object] | None = None
) -> tuple[Callable, tuple, dict]:
    """(timed jitted fn, its args, first results by name) of attn(q, k, v) in a direction: fwd,
    bwd (the pullback alone) or fwd_bwd, with a['dout'] as the output's cotangent. run(fn,
    args) makes the timed fn's first call (default fn(*args)), which compiles it."""
    import jax

    run = run or (lambda fn, args: fn(*args))
    q, k, v, do = a["q"], a["k"], a["v"], a["dout"]
    if mode == "fwd":
        fn = jax.jit(attn)
        return fn, (q, k, v), {"out": run(fn, (q, k, v))}
    if mode == "bwd":
        forward = jax.jit(lambda q, k, v: jax.vjp(attn, q, k, v))
        out, vjp_fn = forward(q, k, v)
        fn = jax.jit(lambda f, d: f(d))
        dq, dk, dv = run(fn, (vjp_fn, do))
        return fn, (vjp_fn, do), {"out": out, "dq": dq, "dk": dk, "dv": dv}

    def fwd_bwd(q, k, v, d):
        out, f = jax.vjp(attn, q, k, v)
        return out, f(d)

    fn = jax.jit(fwd_bwd)
    out, (dq, dk, dv) = run(fn, (q, k, v, do))
    return fn, (q, k, v, do), {"out": out, "dq": dq, "dk": dk, "dv": dv}


# Where a GPU run keeps its compiled programs unless the environment names a folder.
COMPILATION_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "jax"


def use_compilation_cache(jax) -> str:
    """The folder JAX's persistent compilation cache uses: the one configured (for example by
    JAX_COMPILATION_CACHE_DIR), else COMPILATION_CACHE. A sweep resumed in pieces
    (--time_budget) or run again on the same machine then loads its slow compilations (over
    JAX's minimum compile time) instead of compiling them again."""
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(COMPILATION_CACHE))
    return jax.config.jax_compilation_cache_dir


class JaxRunner:
    """Holds the devices, mesh cache and L2 flusher shared by the JAX points of a sweep."""

    def __init__(
        self,
        *,
        rtol_override: float | None = None,
        sim_baseline_max_seqlen: int | None = None,
        sim_timed_calls: int = 0,
        sim_validation_share: float = 1.0,
        sim_compile_threads: int = COMPILE_THREADS,
    ) -> None:
        import jax

        self.jax = jax
        self.device = jax.local_devices()[0]
        self.on_gpu = jax.default_backend() == "gpu"
        if self.on_gpu:
            use_compilation_cache(jax)
        self.flush = timing.jax_l2_flusher(jax.local_devices())
        self.rtol_override = rtol_override
        self._meshes: dict = {}
        self._inputs = inputs.DeviceInputs()
        self._dispatch_qkv = jax.jit(_dispatch_qkv)
        self.simulator = CPSimulator(
            self,
            JaxRanks,
            baseline_max_seqlen=sim_baseline_max_seqlen,
            timed_calls=sim_timed_calls,
            validation_share=sim_validation_share,
            compile_threads=sim_compile_threads,
        )

    def mesh(self, point: Point):
        """A 1-D 'cp' mesh over the point's first num_devices devices."""
        from jax.sharding import Mesh

        if point.num_devices not in self._meshes:
            devs = self.jax.devices()[: point.num_devices]
            self._meshes[point.num_devices] = Mesh(np.array(devs), ("cp",))
        return self._meshes[point.num_devices]

    def _sharding(self, shape: tuple[int, ...], mesh):
        """One device, or the CP mesh split along the sequence when it divides."""
        from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

        if mesh is None:
            return SingleDeviceSharding(self.device)
        spec = PartitionSpec(None, "cp") if shape[1] % mesh.size == 0 else PartitionSpec()
        return NamedSharding(mesh, spec)

    def inputs(self, point: Point, index: int, mesh) -> dict:
        """q, k, v, dout in the point's dtype; each process builds only the shards it holds."""
        import jax

        dtype = frameworks.framework_dtype("jax", point.dtype)
        sizes = inputs.shapes(
            point.batch, point.seqlen_total, point.heads_q, point.heads_kv, point.head_dim
        )
        key = (tuple(sizes.items()), str(dtype), point.seed, index, id(mesh))
        nbytes = sum(int(np.prod(s)) for s in sizes.values()) * dtype.itemsize

        def build() -> dict:
            out = {}
            for name, shape in sizes.items():

                def shard(idx, name=name, shape=shape):
                    x = inputs.block(name, shape, point.seed, index, idx[1])
                    return inputs.cast(x[idx[0], :, idx[2], idx[3]], dtype)

                out[name] = jax.make_array_from_callback(shape, self._sharding(shape, mesh), shard)
            return out

        return self._inputs.get(key, nbytes, build)

    def _barrier(self) -> Callable[[], None] | None:
        """Lines the processes up before each timed call in multi-process runs."""
        if self.jax.process_count() == 1:
            return None
        from jax.experimental import multihost_utils

        return lambda: multihost_utils.sync_global_devices("experiments.timing")

    def _check(self, point: Point, mask, index: int, args: dict, got: dict):
        """Compare the first results with float64 attention (whole, or sampled rows)."""
        return checks.check_point(
            point,
            mask,
            index,
            args,
            got,
            fetch=fetch_rows,
            finite=all_finite,
            on_gpu=self.on_gpu,
            rtol_override=self.rtol_override,
            reference=self._row_reference(point, mask, args),
        )

    def _row_reference(self, point: Point, mask, args: dict) -> Callable | None:
        """check_point's `reference`: a single-device point's row reference computed on its
        GPU (row_reference: about 0.04 s where fetching the keys and numpy's pass took 1.5 s
        at 128K tokens on an H100); None on a CPU, where numpy's pass is the faster (0.3 s against
        0.6 s at 16K tokens), and for CP points, whose ranks check their rows themselves."""
        if point.is_cp or not self.on_gpu:
            return None
        return row_reference(args, mask)

    def _time(self, point: Point, fn: Callable, call_args: tuple) -> list[float]:
        """Per-call ms of fn(*call_args): the point's warmup, iters and chains, L2 flush,
        barrier."""
        loop = dict(warmup=point.warmup, iters=point.iters, chain_ms=point.chain_ms)
        return timing.jax_time_calls(
            fn, call_args, flush=self.flush, barrier=self._barrier(), **loop
        )

    def _compiling_run_is_the_sample(self, point: Point, first_ms: float | None) -> bool:
        """Whether a single-device mask's compiling run (first_ms, timing.jax_compiling_run_ms)
        is its one sample: no warm-up asked, one process (no barrier to line up with), and the
        run took timing.FIRST_PROGRAM_RUN_MS or more (a 128K-token forward+backward baseline
        of the CP predictor runs 6 s, which its check's run and two samples would spend three
        times)."""
        if first_ms is None or point.warmup != 0 or self._barrier() is not None:
            return False
        return first_ms >= timing.FIRST_PROGRAM_RUN_MS

    def _dispatch_times(self, point: Point, executor, args: dict) -> list[float]:
        """Per-call ms (slowest process) of dispatching q, k and v together into the executor's
        layout: the data-side step a CP model pays once per batch, kept out of the attention's."""
        qkv = (args["q"], args["k"], args["v"])
        times = self._time(point, self._dispatch_qkv, (executor, *qkv))
        return _slowest_process(times, None)[0]

    def _build_cp(self, point: Point, mask, mesh, args: dict) -> tuple:
        """CP: the executor built once, the inputs dispatched into its layout once (untimed),
        the timed call on the dispatched arrays; its first results back in global order."""
        executor = frameworks.cp_executor("jax", point, mask, mesh=mesh, axis="cp")
        dispatched = {name: executor.dispatch(x) for name, x in args.items()}
        fn, call_args, got = build_call(point.mode, executor.sharded, dispatched)
        return executor, fn, call_args, {name: executor.undispatch(y) for name, y in got.items()}

    def _run_mask(self, point: Point, mask, index: int, mesh) -> dict:
        """Build, check, then time one mask of a point (CP: on inputs already in its layout)."""
        devices = list(mesh.devices.flat) if mesh is not None else [self.device]
        local = [d for d in devices if d.process_index == self.jax.process_index()]
        args = self.inputs(point, index, mesh)
        extra = frameworks.cp_plan_info(point, mask) if point.is_cp else None
        peak_before = timing.jax_peak_bytes(local)
        first_ms = None
        if point.is_cp:
            executor, fn, call_args, got = self._build_cp(point, mask, mesh, args)
        else:
            attn = frameworks.attention_fn("jax", point, mask)
            first = []  # the compiling run's ms: a long one is the sample (_time)

            def run(compiling: Callable, inputs: tuple) -> object:
                out, ms = timing.jax_compiling_run_ms(compiling, inputs, self.flush)
                first.append(ms)
                return out

            fn, call_args, got = build_call(point.mode, attn, args, run)
            first_ms = first[0]
        check = self._check(point, mask, index, args, got)
        if not check.ok:
            raise PointFailure(WRONG, f"mask {index}: {check.message}", {"check": check.as_dict()})
        del got
        if self._compiling_run_is_the_sample(point, first_ms):
            times, extra = [first_ms], {**(extra or {}), "sample": "compiling run"}
        else:
            times = self._time(point, fn, call_args)
        resident = timing.L2_FLUSH_BYTES if self.flush is not None else 0
        peak, source = timing.jax_call_peak(
            peak_before, timing.jax_peak_bytes(local), fn, call_args, resident=resident
        )
        times, peak = _slowest_process(times, peak)
        dispatch = self._dispatch_times(point, executor, args) if point.is_cp else None
        return measure.mask_result(
            point, mask, index, times, peak, source, check.as_dict(), extra, dispatch
        )

    def expect(self, points: list[Point], recorded: Iterable[dict] = ()) -> None:
        """The points this runner will be given, in order (the CP predictor looks ahead), and
        the run's records so far (whose single-device baselines it takes, and the calls timed
        on devices like this one's)."""
        self.simulator.expect(points, recorded, "jax")

    def run(self, point: Point) -> dict:
        """Metrics and check summary of a point; raises on any non-ok outcome."""
        if point.simulated:
            return self.simulator.run(point)
        capacity, host = memory.jax_capacity()
        memory.require_fits(point, capacity, host=host)
        masks = frameworks.make_masks(point)
        if not point.is_cp:
            frameworks.require_support("jax", point.impl, masks, point)
        mesh = self.mesh(point) if point.is_cp else None
        per_mask = [self._run_mask(point, m, i, mesh) for i, m in enumerate(masks)]
        return measure.aggregate(point, per_mask)
