"""Simulated CP points (--simulate_devices): every rank of an N-device plan, run on one device.

The runner builds the JAX executor's plan for N devices and runs each rank's local work of every
step with the executor's own step functions on that rank's real inputs (its query shard and
heads, the step's key block, the mask piece in the executor's array shapes). Each distinct call
is timed with the timing loop; calls of equal shapes and equal mask arrays share one timing.
The executor's schedule is then replayed with a link model (shard_strategies.simulate). Before
any timing, ranks are emulated end to end and checked against float64 attention; the whole mask
on this one device is the efficiency baseline (an ordinary kernel point, checked and timed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from functools import cache
from types import SimpleNamespace

import numpy as np

from experiments.core.outcomes import UNSUPPORTED, WRONG, PointFailure
from experiments.core.points import DEFAULT_IMPL, Point
from experiments.runners import call_model, checks, frameworks, measure, timing
from shard_strategies.simulate import ATTEND_ONCE, ATTEND_ONCE_BWD
from shard_strategies.strategies import RING_CORE

QUANTILES = ("median", "p20", "p80", "min", "max")
# Longest whole mask timed on one device as the efficiency baseline, unless given: on a CPU the
# dense reference impl takes minutes and gigabytes per call beyond 8K tokens.
BASELINE_MAX_SEQLEN = {"gpu": 512 * 1024, "cpu": 8 * 1024}
DIGITS = 4  # significant digits of the per-step, per-rank times in a record


def kernel_point(point: Point, impl: str) -> Point:
    """The single-device point of the same total work: the whole mask on one device."""
    return dataclasses.replace(
        point,
        impl=impl,
        cp="none",
        layout="none",
        ulysses_size=None,
        ulysses_intra_node=None,
        seqlen_per_device=point.seqlen_total,
        scaling="none",
        num_devices=1,
        simulated=False,
        link="",
        grid=f"{point.grid}_single_device",
    )


def _round(x: np.ndarray) -> list:
    """Values at DIGITS significant digits, for compact records."""
    return [float(f"{v:.{DIGITS}g}") for v in np.asarray(x, np.float64).ravel()]


@cache
def _steps(impl: str, scale: float) -> SimpleNamespace:
    """The executor's per-rank step functions, jitted once per impl and scale."""
    import jax

    from shard_strategies import jax_cp

    def first_bwd(q, k, v, a, out, lse, dout, dlse):
        rowdot, dq = jax_cp.backward_start(q, out, dout)
        res = (out, lse, dout, dlse, rowdot)
        return jax_cp.backward_step(q, k, v, a, impl, scale, res, dq, None)

    def once_vjp(q, k, v, a):
        def attend(q_, k_, v_):
            return jax_cp.local_attention(q_, k_, v_, a, impl, scale)

        return jax.vjp(attend, q, k, v)

    return SimpleNamespace(
        fwd=jax.jit(lambda q, k, v, a, o, s: jax_cp.forward_step(q, k, v, a, impl, scale, o, s)),
        start=jax.jit(jax_cp.backward_start),
        first_bwd=jax.jit(first_bwd),
        bwd=jax.jit(
            lambda q, k, v, a, res, dq, dkv: jax_cp.backward_step(
                q, k, v, a, impl, scale, res, dq, dkv
            )
        ),
        once=jax.jit(lambda q, k, v, a: jax_cp.local_attention(q, k, v, a, impl, scale)),
        once_vjp=jax.jit(once_vjp),
        pullback=jax.jit(lambda f, cts: f(cts)),
    )


@cache
def _gather():
    """Jitted (x, rows, heads) -> x at token positions `rows` (positions past its end are
    padding: zeros) and `heads`."""
    import jax
    import jax.numpy as jnp

    def gather(x, rows, heads):
        real = rows < x.shape[1]
        picked = jnp.take(jnp.take(x, jnp.where(real, rows, 0), 1), heads, 2)
        return jnp.where(real[None, :, None, None], picked, jnp.zeros((), x.dtype))

    return jax.jit(gather)


class _Ranks:
    """One plan's ranks on this device: their inputs, the calls they make, end to end runs."""

    def __init__(self, plan, impl: str, args: dict, dtype, mode: str):
        import jax
        import jax.numpy as jnp

        from shard_strategies import jax_cp

        self.jax, self.jnp = jax, jnp
        self.plan, self.mode, self.impl = plan, mode, impl
        self._digests: dict[tuple[int, int], str] = {}
        d = plan.head_dim
        self.steps = _steps(impl, 1.0 / math.sqrt(d))
        self.x = args
        self.arrays = jax_cp.ring_mask_arrays(plan, impl, d, dtype)
        u, hq, rep = plan.ulysses_size, plan.num_heads_q, plan.kv_replication
        hkv = plan.num_heads_kv * rep
        self.q_heads = [np.arange(j * hq // u, (j + 1) * hq // u) for j in range(u)]
        self.kv_heads = [np.arange(j * hkv // u, (j + 1) * hkv // u) // rep for j in range(u)]
        self._take = _gather()

    @property
    def ring_core(self) -> bool:
        return self.plan.core == RING_CORE

    def piece(self, r: int, t: int):
        """The executor's MaskArrays of ring rank r at kept step t, on the device."""
        return self.jax.device_put(self.jax.tree.map(lambda a: a[r, t], self.arrays))

    def fingerprint(self, r: int, t: int) -> str:
        """Identity of a mask piece: a digest of the arrays the kernel receives."""
        if (r, t) not in self._digests:
            h = hashlib.sha1()
            for leaf in self.jax.tree.leaves(self.jax.tree.map(lambda a: a[r, t], self.arrays)):
                h.update(np.ascontiguousarray(leaf).tobytes())
            self._digests[r, t] = h.hexdigest()
        return self._digests[r, t]

    def queries(self, name: str, r: int, u: int):
        """q or dout of rank (r, u): its ring shard's tokens, its Ulysses group's heads."""
        rows = np.asarray(self.plan.layout.positions[r], np.int32)
        return self._take(self.x[name], rows, self.q_heads[u].astype(np.int32))

    def keys(self, r: int, u: int, t: int):
        """The K/V block rank (r, u) attends to at kept step t (its K/V heads)."""
        rows = np.asarray(self.plan.key_positions(r, t), np.int32)
        heads = self.kv_heads[u].astype(np.int32)
        return tuple(self._take(self.x[n], rows, heads) for n in ("k", "v"))

    def _zero_lse(self, q):
        return self.jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), self.jnp.float32)

    def call(self, call: str, r: int, t: int, group_start: bool):
        """(jitted fn, args) of one timed call, on rank (r, 0)'s inputs.

        Backward steps get the step's own output and LSE as residuals: the kernels' work depends
        on the mask tiles and shapes, not on these values.
        """
        from shard_strategies import simulate

        s, jnp = self.steps, self.jnp
        q = self.queries("q", r, 0)
        k, v = self.keys(r, 0, t)
        a = self.piece(r, t)
        if call == simulate.ATTEND:
            if t == 0:
                return s.fwd, (q, k, v, a, None, None)
            return s.fwd, (q, k, v, a, *s.fwd(q, k, v, a, None, None))
        dout = self.queries("dout", r, 0)
        if call == simulate.ATTEND_BWD:
            out, lse = s.fwd(q, k, v, a, None, None)
            out = out.astype(q.dtype)
            dlse = self._zero_lse(q)
            if t == 0:
                return s.first_bwd, (q, k, v, a, out, lse, dout, dlse)
            rowdot, dq = s.start(q, out, dout)
            acc = jnp.promote_types(k.dtype, jnp.float32)
            dkv = None if group_start else (jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc))
            return s.bwd, (q, k, v, a, (out, lse, dout, dlse, rowdot), dq, dkv)
        if call == simulate.ATTEND_ONCE:
            return (s.once if self.mode == "fwd" else s.once_vjp), (q, k, v, a)
        _, pullback = s.once_vjp(q, k, v, a)
        return s.pullback, (pullback, (dout, self._zero_lse(q)))

    def emulate(self, r: int, u: int) -> dict:
        """Rank (r, u) end to end: its merged output (and dq), and the dK/dV of every block it
        saw with that block's key positions."""
        s, jnp = self.steps, self.jnp
        grads = self.mode != "fwd"
        q = self.queries("q", r, u)
        steps = range(self.plan.num_steps) if self.ring_core else range(1)
        blocks = {t: (*self.keys(r, u, t), self.piece(r, t)) for t in steps}
        parts = []
        if self.ring_core:
            out = lse = None
            for t in steps:
                out, lse = s.fwd(q, *blocks[t], out, lse)
            out = out.astype(q.dtype)
            if grads:
                dout = self.queries("dout", r, u)
                rowdot, dq = s.start(q, out, dout)
                res = (out, lse, dout, self._zero_lse(q), rowdot)
                for t in steps:
                    dq, dkv = s.bwd(q, *blocks[t], res, dq, None)
                    parts.append((t, dkv))
        elif not grads:
            out, _ = s.once(q, *blocks[0])
        else:
            (out, _), pullback = s.once_vjp(q, *blocks[0])
            dq, dk, dv = pullback((self.queries("dout", r, u), self._zero_lse(q)))
            parts.append((0, (dk, dv)))
        result = {"out": np.asarray(out.astype(jnp.float32))}
        if grads:
            result["dq"] = np.asarray(dq.astype(jnp.float32))
            f32 = jnp.float32
            result["dkv"] = [(t, *(np.asarray(g.astype(f32)) for g in kv)) for t, kv in parts]
        return result


def _merge_checks(results: list[tuple[int, checks.CheckResult]]) -> checks.CheckResult:
    """One result of several ranks' row checks: the worst error per tensor."""
    errors: dict[str, float] = {}
    for _, c in results:
        for n, e in c.errors.items():
            errors[n] = max(errors.get(n, 0.0), e)
    bad = [f"rank {g}: {c.message}" for g, c in results if not c.ok]
    return checks.CheckResult(
        ok=not bad,
        kind="rows",
        errors=errors,
        rtol=results[0][1].rtol,
        rows=sum(c.rows or 0 for _, c in results),
        unchecked=sorted({n for _, c in results for n in c.unchecked}),
        message="; ".join(bad),
    )


def _fetch(x, rows: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """Float32 host copy of the given tokens and heads of a device array."""
    import jax.numpy as jnp

    part = jnp.take(jnp.take(x, jnp.asarray(rows), axis=1), jnp.asarray(heads), axis=2)
    return np.asarray(part.astype(jnp.float32))


def _full_check(ranks: _Ranks, mask, args: dict, grads: bool, rtol: float) -> checks.CheckResult:
    """Every rank emulated, its output rows (and dq rows, dK/dV of every block it saw) put back
    in global order, and the whole compared with float64 attention."""
    plan, s = ranks.plan, mask.seqlen_q
    host = {n: np.asarray(a.astype(ranks.jnp.float32)) for n, a in args.items()}
    got = {n: np.zeros(host["q"].shape) for n in ("out", "dq")}
    got.update({n: np.zeros(host["k"].shape) for n in ("dk", "dv")})
    for g in range(plan.world_size):
        r, u = plan.ring_rank(g), plan.ulysses_rank(g)
        res = ranks.emulate(r, u)
        pos = plan.layout.positions[r]
        real = pos < s
        for n in ("out", "dq") if grads else ("out",):
            got[n][:, pos[real][:, None], ranks.q_heads[u][None, :]] = res[n][:, real]
        for t, dk, dv in res.get("dkv", []):
            keys = plan.key_positions(r, t)
            seen = keys < s
            for j, h in enumerate(ranks.kv_heads[u]):
                got["dk"][:, keys[seen], h] += dk[:, seen, j]
                got["dv"][:, keys[seen], h] += dv[:, seen, j]
    inputs = checks.Inputs(**host)
    return checks.compare(mask, inputs, got, plan=checks.CheckPlan(), grads=grads, rtol=rtol)


def _rank_check(
    ranks: _Ranks, mask, args: dict, r: int, u: int, grads: bool, rtol: float, seed: int
) -> checks.CheckResult:
    """Rank (r, u) emulated and compared at sampled rows of its own tokens and heads (its
    blocks' dK/dV: finite only, as a row check of the whole problem would)."""
    plan = ranks.plan
    res = ranks.emulate(r, u)
    pos = plan.layout.positions[r]
    rows_plan = checks.sample_rows(mask, pos[pos < mask.seqlen_q], seed)
    order = np.argsort(pos)
    local = order[np.searchsorted(pos[order], rows_plan.rows)]
    qh, kh = ranks.q_heads[u], np.unique(ranks.kv_heads[u])
    inp = checks.Inputs(
        q=_fetch(args["q"], rows_plan.rows, qh),
        k=_fetch(args["k"], rows_plan.cols, kh),
        v=_fetch(args["v"], rows_plan.cols, kh),
        dout=_fetch(args["dout"], rows_plan.rows, qh),
    )
    parts = res.get("dkv", [])
    finite = {n: all(np.isfinite(p[i]).all() for p in parts) for i, n in ((1, "dk"), (2, "dv"))}
    got = {n: res[n][:, local] for n in ("out", "dq") if n in res}
    return checks.compare(mask, inp, got, plan=rows_plan, grads=grads, rtol=rtol, finite=finite)


def check_ranks(
    ranks: _Ranks, point: Point, mask, index: int, args: dict, rtol: float
) -> tuple[checks.CheckResult, list[int]]:
    """(check, global ranks checked): every rank against float64 attention of the whole problem
    when it is small (checks.FULL_CHECK_ELEMENTS), else the first rank and the first rank of
    the busiest ring rank, each at sampled rows."""
    from shard_strategies.simulate import global_rank

    plan, s = ranks.plan, mask.seqlen_q
    grads = point.mode != "fwd"
    if point.batch * point.heads_q * s * s <= checks.FULL_CHECK_ELEMENTS:
        return _full_check(ranks, mask, args, grads, rtol), list(range(plan.world_size))
    busiest = int(np.argmax(plan.piece_area.sum(axis=1)))
    members = sorted({(plan.ring_rank(0), plan.ulysses_rank(0)), (busiest, 0)})
    seed = point.seed + index
    results = [
        (global_rank(plan, r, u), _rank_check(ranks, mask, args, r, u, grads, rtol, seed))
        for r, u in members
    ]
    return _merge_checks(results), [g for g, _ in results]


class CPSimulator:
    """Runs simulated points for a JaxRunner (its device, L2 flush, inputs and kernel points)."""

    def __init__(
        self, runner, *, baseline_max_seqlen: int | None = None, timed_calls: int = 0
    ) -> None:
        self.runner = runner
        if baseline_max_seqlen is None:
            baseline_max_seqlen = BASELINE_MAX_SEQLEN["gpu" if runner.on_gpu else "cpu"]
        self.baseline_max_seqlen = baseline_max_seqlen
        self.timed_calls = timed_calls  # calibration calls per class of calls; 0: time them all
        self._baselines: dict[str, dict] = {}
        self._timings: dict[tuple, dict] = {}  # per distinct call: its time statistics
        self._fitted: dict[tuple, dict] = {}  # per class: features of the calls fitted on

    def baseline(self, point: Point, impl: str) -> dict:
        """The kernel point of the whole mask on this device ({status, reason, result}), run once
        per key and shared by every strategy and layout of the same problem."""
        kp = kernel_point(point, impl)
        if kp.key in self._baselines:
            return self._baselines[kp.key]
        cap = self.baseline_max_seqlen
        if cap is not None and kp.seqlen_total > cap:
            out = {
                "status": "not_run",
                "reason": f"{kp.seqlen_total} tokens > --sim_baseline_max_seqlen={cap}",
            }
        else:
            try:
                out = {"status": "ok", "reason": None, "result": self.runner.run(kp)}
            except PointFailure as e:
                out = {"status": e.status, "reason": e.reason}
            except Exception as e:
                from experiments.core.outcomes import classify

                status, reason = classify(e)
                out = {"status": status, "reason": reason}
        out["key"] = kp.key
        self._baselines[kp.key] = out
        return out

    def run(self, point: Point) -> dict:
        """Metrics (predicted), check and per-mask detail of a simulated point."""
        from shard_strategies.jax_cp import resolve_impl

        impl = resolve_impl(None if point.impl == DEFAULT_IMPL else point.impl)
        masks = frameworks.make_masks(point)
        base = self.baseline(point, impl)
        per_mask = [self._run_mask(point, m, i, impl, base) for i, m in enumerate(masks)]
        result = measure.aggregate(point, per_mask)
        sims = [m["simulation"] for m in per_mask]
        eff = [s["efficiency_pct"] for s in sims]
        result["metrics"].update(
            efficiency_pct=float(np.mean(eff)) if None not in eff else None,
            load_imbalance=float(np.mean([s["load_imbalance"] for s in sims])),
            single_device_status=base["status"],
        )
        return result

    def _plan(self, point: Point, mask, impl: str):
        from shard_strategies import jax_cp

        try:
            return jax_cp.executor_plan(
                mask,
                point.num_devices,
                point.cp,
                point.layout,
                point.ulysses_size,
                impl=impl,
                num_heads_q=point.heads_q,
                num_heads_kv=point.heads_kv,
                head_dim=point.head_dim,
                dtype=frameworks.framework_dtype("jax", point.dtype),
                inner_axis=frameworks.inner_axis(point.ulysses_intra_node),
            )
        except ValueError as e:
            raise PointFailure(UNSUPPORTED, f"not applicable: {e}") from e

    def _time_calls(self, ranks: _Ranks, sched, point: Point) -> tuple[dict, dict]:
        """({quantile: (P, N) compute ms}, counts): every (rank, step) call's time statistics.

        A distinct call (kind, shapes, mask arrays) is timed once, here or by an earlier point.
        With --sim_timed_calls=k > 0, a class of calls (kind and shapes; only the mask piece
        differs) with more untimed calls than k + call_model.VALIDATION_CALLS is timed on a
        calibration sample spanning its pieces' work and the rest predicted by the class's
        cost model (experiments/runners/call_model.py), whose error on further timed,
        held-out calls the counts report."""
        plan = sched.plan
        ring_of = np.array([plan.ring_rank(g) for g in range(plan.world_size)])
        features = call_model.piece_features(ranks.arrays.kv, plan.piece_area)
        shapes = (point.batch, plan.shard_len, len(ranks.q_heads[0]), len(ranks.kv_heads[0]))
        common = (ranks.impl, point.dtype, point.head_dim, *shapes, point.warmup, point.iters)
        uses: list[tuple[int, int, tuple]] = []  # (phase, ring rank, call key)
        classes: dict[tuple, dict[tuple, tuple]] = {}  # class -> {key: (call args, features)}
        for p, ph in enumerate(sched.phases):
            if ph.call is None:
                continue
            once = ph.call in (ATTEND_ONCE, ATTEND_ONCE_BWD)
            for r in range(plan.ring_size):
                keys = len(plan.key_positions(r, ph.step))
                call = (ph.call, point.mode if once else "", ph.step == 0, ph.group_start)
                cls = (*common, *call, keys)
                key = (*cls, ranks.fingerprint(r, ph.step))
                classes.setdefault(cls, {})[key] = (
                    (ph.call, r, ph.step, ph.group_start),
                    features[r, ph.step],
                )
                uses.append((p, r, key))
        stats: dict[tuple, dict] = {}
        counts = {"distinct": sum(map(len, classes.values())), "timed": 0, "modelled": 0}
        held_out: list[tuple[float, float]] = []  # (predicted, measured) median ms
        for cls, members in classes.items():
            timed, predicted, errors = self._class_stats(ranks, point, cls, members)
            counts["timed"] += timed
            counts["modelled"] += len(predicted)
            held_out += errors
            stats.update(predicted)
            stats.update({key: self._timings[key] for key in members if key in self._timings})
        if held_out:
            pred, meas = zip(*held_out)
            counts["model"] = call_model.held_out_error(pred, meas).as_dict()
        compute = {q: np.zeros((len(sched.phases), plan.world_size)) for q in QUANTILES}
        for p, r, key in uses:
            for q in QUANTILES:
                compute[q][p, ring_of == r] = stats[key][q]
        return compute, counts

    def _time(self, ranks: _Ranks, point: Point, key: tuple, call: tuple) -> None:
        """Time one distinct call (compiled and run once untimed first) into self._timings."""
        fn, args = ranks.call(*call)
        ranks.jax.block_until_ready(fn(*args))
        times = timing.jax_time_calls(
            fn, args, warmup=point.warmup, iters=point.iters, flush=self.runner.flush
        )
        self._timings[key] = timing.time_stats(times)

    def _class_stats(
        self, ranks: _Ranks, point: Point, cls: tuple, members: dict[tuple, tuple]
    ) -> tuple[int, dict[tuple, dict], list[tuple[float, float]]]:
        """(calls timed now, {key: predicted stats}, held-out (predicted, measured) medians) of
        one class of calls: all timed, or a calibration sample timed and the rest modelled."""
        keys = list(members)
        untimed = [k for k in keys if k not in self._timings]
        k = self.timed_calls
        if k == 0 or len(untimed) <= k + call_model.VALIDATION_CALLS:
            for key in untimed:
                self._time(ranks, point, key, members[key][0])
            return len(untimed), {}, []
        x = np.array([members[key][1] for key in keys])
        calibrate = [keys[i] for i in call_model.calibration_picks(x, k)]
        rest = [key for key in untimed if key not in set(calibrate)]
        rng = np.random.default_rng(point.seed + len(self._timings))
        held = [rest[i] for i in rng.choice(len(rest), call_model.VALIDATION_CALLS, replace=False)]
        fresh = [key for key in calibrate if key not in self._timings] + held
        for key in fresh:
            self._time(ranks, point, key, members[key][0])
        known = self._fitted.setdefault(cls, {})
        known.update({key: members[key][1] for key in calibrate})
        coef = self._fit(known)
        errors = [(float(members[key][1] @ coef), self._timings[key]["median"]) for key in held]
        known.update({key: members[key][1] for key in held})  # then fitted on them too
        coef = self._fit(known)
        ratios = call_model.quantile_ratios([self._timings[key] for key in known], QUANTILES)
        predicted = {
            key: call_model.scaled_quantiles(float(members[key][1] @ coef), ratios)
            for key in rest
            if key not in self._timings
        }
        return len(fresh), predicted, errors

    def _fit(self, known: dict[tuple, np.ndarray]) -> np.ndarray:
        """The tile model's coefficients of the median times of the calls in `known`."""
        keys = list(known)
        x = np.array([known[key] for key in keys])
        return call_model.fit(x, [self._timings[key]["median"] for key in keys])

    def _run_mask(self, point: Point, mask, index: int, impl: str, base: dict) -> dict:
        from shard_strategies import simulate

        plan = self._plan(point, mask, impl)
        itemsize = frameworks.ITEMSIZE[point.dtype]
        sched = simulate.schedule(plan, point.mode, itemsize=itemsize, batch=point.batch)
        dtype = frameworks.framework_dtype("jax", point.dtype)
        args = self.runner.inputs(kernel_point(point, impl), index, None)
        ranks = _Ranks(plan, impl, args, dtype, point.mode)
        rtol = checks.tolerance(
            point.dtype, on_gpu=self.runner.on_gpu, override=self.runner.rtol_override
        )
        check, checked = check_ranks(ranks, point, mask, index, args, rtol)
        if not check.ok:
            raise PointFailure(WRONG, f"mask {index}: {check.message}", {"check": check.as_dict()})
        compute, counts = self._time_calls(ranks, sched, point)
        link = simulate.LinkModel.from_spec(point.link)
        preds = {q: simulate.predict(sched, compute[q], link) for q in QUANTILES}
        t = {q: preds[q].total_ms for q in QUANTILES} | {"n": point.iters}
        med = preds["median"]
        comm = plan.comm_volume(itemsize=itemsize, batch=point.batch)
        sim = self._summary(point, mask, index, sched, med, link, impl, base)
        sim["calls"] = {"total": int((compute["median"] > 0).sum()), **counts}
        sim["check_ranks"] = checked
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
        return {
            "impl": impl,
            "link": dataclasses.asdict(link),
            "time_ms": {
                "total": pred.total_ms,
                "strategy": strategy_ms,
                "dispatch": pred.part_ms(simulate.DISPATCH),
                "slowest_compute": slowest,
                "exposed_comm": strategy_ms - slowest,
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
                    "ms": float(f"{pred.phase_ms[i]:.{DIGITS}g}"),
                    "compute_ms": _round(pred.compute_ms[i]),
                    "exposed_ms": _round(pred.exposed_ms[i]),
                }
                for i, ph in enumerate(sched.phases)
            ],
            "single_device": {
                "key": base["key"],
                "status": base["status"],
                "reason": base["reason"],
                **(single or {}),
            },
            "efficiency_pct": 100.0 * per_gpu / single["tflops"] if single else None,
        }
