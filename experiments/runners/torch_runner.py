"""Runs one PyTorch point: a single-device kernel, or a CP strategy on every rank of a group.

Under CP every rank holds the same global inputs (same seed) and dispatches them once to its
shards; the timed call is the strategy on the shards (collective), its first results are
all-gathered back for rank 0 to check in global order, and the dispatch is timed apart. All
ranks agree on each phase's outcome before going on, so one failing rank ends the point on every
rank instead of hanging the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from experiments.core.flags import COMPILE_THREADS
from experiments.core.outcomes import OK, WRONG, PointFailure, classify, short_traceback
from experiments.core.points import Point
from experiments.runners import checks, frameworks, inputs, measure, memory, timing
from experiments.runners.cp_ranks_torch import TorchRanks
from experiments.runners.cp_simulate import CPSimulator


class TorchRunner:
    """Device, process group and tolerance shared by the torch points of a sweep."""

    def __init__(
        self,
        *,
        device=None,
        group=None,
        rtol_override: float | None = None,
        sim_baseline_max_seqlen: int | None = None,
        sim_timed_calls: int = 0,
        sim_validation_share: float = 1.0,
        sim_compile_threads: int = COMPILE_THREADS,
    ) -> None:
        import torch

        self.torch = torch
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.on_gpu = self.device.type == "cuda"
        self.group = group
        self.rtol_override = rtol_override
        # one shape held: the peak memory a timed call records counts every allocated byte
        self._inputs = inputs.DeviceInputs(entries=1)
        self.simulator = CPSimulator(
            self,
            TorchRanks,
            baseline_max_seqlen=sim_baseline_max_seqlen,
            timed_calls=sim_timed_calls,
            validation_share=sim_validation_share,
            compile_threads=sim_compile_threads,
        )

    # ------------------------------------------------------------------ collective helpers

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group) if self.group is not None else 0

    def _agree(self, failure: BaseException | None) -> None:
        """Raise the same PointFailure on every rank if any rank failed in this phase."""
        if self.group is None:
            if failure is not None:
                raise failure
            return
        import torch.distributed as dist

        mine = (OK, "") if failure is None else classify(failure)
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        details = {} if failure is None else {"traceback": short_traceback(failure)}
        for rank, (status, reason) in enumerate(everyone):
            if status != OK:
                raise PointFailure(
                    status, reason if rank == 0 else f"rank {rank}: {reason}", details
                ) from failure

    def _phase(self, fn: Callable[[], object]) -> object:
        """Run fn on this rank, then agree on success across ranks."""
        try:
            result, failure = fn(), None
        except Exception as e:
            result, failure = None, e
        self._agree(failure)
        return result

    def _share(self, obj: object) -> object:
        """Rank 0's object on every rank."""
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _barrier(self) -> Callable[[], None] | None:
        if self.group is None:
            return None
        import torch.distributed as dist

        return lambda: dist.barrier(group=self.group)

    def _slowest(self, times: list[float]) -> tuple[list[float], list[float]]:
        """(per-call time of the slowest rank, per-rank median times)."""
        median = float(np.median(times))
        if self.group is None:
            return times, [median]
        import torch.distributed as dist

        t = self.torch.tensor(times, dtype=self.torch.float64, device=self.device)
        medians = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(medians, median, group=self.group)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.cpu().tolist(), medians

    def _peaks(self, peak: float | None) -> tuple[float | None, float | None]:
        """(max, mean) peak GiB over ranks."""
        if self.group is None or peak is None:
            return peak, peak
        import torch.distributed as dist

        peaks = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(peaks, peak, group=self.group)
        return max(peaks), sum(peaks) / len(peaks)

    # ------------------------------------------------------------------------------ points

    def _callable(self, mode: str, attn: Callable, t: dict) -> tuple[Callable, dict]:
        """(timed fn, first results by name). bwd times only the backward of one untimed
        forward, with fresh gradients per call (autograd.grad, nothing accumulates)."""
        torch = self.torch
        q, k, v, do = t["q"], t["k"], t["v"], t["dout"]
        if mode == "fwd":
            fn = lambda: attn(q, k, v)  # noqa: E731
            return fn, {"out": fn()}
        for x in (q, k, v):
            x.requires_grad_(True)
        if mode == "bwd":
            out = attn(q, k, v)
            fn = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)  # noqa: E731
            dq, dk, dv = fn()
            return fn, {"out": out, "dq": dq, "dk": dk, "dv": dv}

        def fwd_bwd():
            out = attn(q, k, v)
            return out, torch.autograd.grad(out, (q, k, v), do)

        out, (dq, dk, dv) = fwd_bwd()
        return fwd_bwd, {"out": out, "dq": dq, "dk": dk, "dv": dv}

    def inputs(self, point: Point, index: int) -> dict:
        """q, k, v, dout in the point's dtype on this rank's device (same on every rank); each
        call gets its own views (detached), so a backward point's requires_grad stays its own."""
        dtype = frameworks.framework_dtype("torch", point.dtype)
        sizes = inputs.shapes(
            point.batch, point.seqlen_total, point.heads_q, point.heads_kv, point.head_dim
        )
        key = (tuple(sizes.items()), str(dtype), point.seed, index)
        nbytes = sum(int(np.prod(s)) for s in sizes.values()) * dtype.itemsize

        def build() -> dict:
            return {
                n: self.torch.from_numpy(inputs.block(n, s, point.seed, index)).to(
                    self.device, dtype
                )
                for n, s in sizes.items()
            }

        return {n: x.detach() for n, x in self._inputs.get(key, nbytes, build).items()}

    def _fetch(self, x, index) -> object:
        """Float32 host copy of x, only the given positions along the sequence axis."""
        if index is not None:
            x = x[:, self.torch.as_tensor(index, device=x.device)]
        return x.detach().float().cpu().numpy()

    def _check(self, point: Point, mask, index: int, args: dict, got: dict) -> dict:
        """Rank 0 compares with float64 attention; every rank gets the verdict."""

        def run() -> dict:
            return checks.check_point(
                point,
                mask,
                index,
                args,
                got,
                fetch=self._fetch,
                finite=lambda x: bool(self.torch.isfinite(x).all()),
                on_gpu=self.on_gpu,
                rtol_override=self.rtol_override,
            ).as_dict()

        verdict, failure = None, None
        if self.rank == 0:
            try:
                verdict = run()
            except Exception as e:
                failure = e
        self._agree(failure)
        return self._share(verdict)

    def _time(self, point: Point, fn: Callable[[], object]) -> tuple[list[float], float | None]:
        """(per-call ms, peak GiB) of fn on this rank: the point's warmup, iters and chains, ranks
        lined up before each call; every rank agrees that it ran."""
        loop = dict(
            warmup=point.warmup, iters=point.iters, chain_ms=point.chain_ms, device=self.device
        )
        return self._phase(lambda: timing.torch_time_calls(fn, barrier=self._barrier(), **loop))

    def _dispatch_times(self, point: Point, executor, args: dict) -> list[float]:
        """Per-call ms (slowest rank) of dispatching q, k and v into this rank's shards: the
        data-side step a CP model pays once per batch, kept out of the attention's time."""
        qkv = (args["q"], args["k"], args["v"])
        times, _ = self._time(point, lambda: [executor.dispatch(x) for x in qkv])
        return self._slowest(times)[0]

    def _build_cp(self, point: Point, mask, args: dict) -> tuple:
        """CP: the executor's plan bound once, q, k, v, dout dispatched to this rank's shards
        once (untimed), the timed call on the shards; its first results back in global order."""
        executor = frameworks.cp_executor("torch", point, mask, group=self.group)
        shards = {name: executor.dispatch(x) for name, x in args.items()}
        fn, got = self._callable(point.mode, executor.sharded, shards)
        with self.torch.no_grad():
            return executor, fn, {name: executor.undispatch(y) for name, y in got.items()}

    def _run_mask(self, point: Point, mask, index: int) -> dict:
        """Build, check, then time one mask of a point (CP: collectively, on this rank's
        shards)."""
        args = self.inputs(point, index)
        if point.is_cp:
            plan = self._phase(lambda: frameworks.cp_plan_info(point, mask))
            executor, fn, got = self._phase(lambda: self._build_cp(point, mask, args))
        else:
            attn = frameworks.attention_fn("torch", point, mask)
            fn, got = self._phase(lambda: self._callable(point.mode, attn, args))
        check = self._check(point, mask, index, args, got)
        if not check["ok"]:
            raise PointFailure(WRONG, f"mask {index}: {check['message']}", {"check": check})
        del got
        times, peak = self._time(point, fn)
        slowest, rank_medians = self._slowest(times)
        peak_max, peak_mean = self._peaks(peak)
        extra, dispatch = None, None
        if point.is_cp:
            extra = {"rank_median_ms": rank_medians, "peak_mem_gib_mean": peak_mean, **plan}
            dispatch = self._dispatch_times(point, executor, args)
        source = "torch_max_memory_allocated" if peak_max is not None else None
        return measure.mask_result(
            point, mask, index, slowest, peak_max, source, check, extra, dispatch
        )

    def expect(self, points: list[Point], recorded: Iterable[dict] = ()) -> None:
        """The points this runner will be given, in order (the CP predictor looks ahead), and
        the run's records so far (whose single-device baselines it takes, and the calls timed
        on devices like this one's)."""
        self.simulator.expect(points, recorded, "torch")

    def run(self, point: Point) -> dict:
        """Metrics and check summary of a point; raises on any non-ok outcome."""
        if point.simulated:
            return self.simulator.run(point)
        capacity, host = memory.torch_capacity(self.device)
        memory.require_fits(point, capacity, host=host)
        masks = self._phase(lambda: frameworks.make_masks(point))
        if not point.is_cp:
            frameworks.require_support("torch", point.impl, masks, point)
        per_mask = [self._run_mask(point, m, i) for i, m in enumerate(masks)]
        return measure.aggregate(point, per_mask)
