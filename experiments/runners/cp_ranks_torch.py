"""The CP predictor's PyTorch ranks: the PyTorch executor's plan (torch_cp.get_plan), its split
into trimmed pieces (torch_cp.plan_pieces) and its step functions (forward_step into an
LseMerge, backward_step and add_grads, local_core), run on each rank's inputs (its own tokens,
drawn for it on the device).

The executor makes no call for an empty piece, so such a (rank, step) costs nothing; a piece's
call runs on its trimmed rows and columns, which are part of the call's class. The cost model
uses the piece's visible area times its heads as its work (call_model.area_features).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from attn_masks import joined_slices
from experiments.core.points import DEFAULT_IMPL, Point
from experiments.runners import call_model, frameworks, inputs, timing
from experiments.runners.cp_ranks import CallTimer, Ranks, plan_settings
from shard_strategies import simulate
from shard_strategies.strategies import LOCAL_CORE, RING_CORE


class TorchRanks(Ranks):
    """One plan's ranks on the TorchRunner's device, with the PyTorch executor's step functions."""

    def __init__(self, plan, impl: str, point: Point, index: int, runner) -> None:
        import torch

        from shard_strategies import torch_cp

        super().__init__(plan, impl, point, index)
        self.torch, self.cp = torch, torch_cp
        self.device = runner.device
        self.dtype = frameworks.framework_dtype("torch", point.dtype)
        self.pieces = torch_cp.plan_pieces(plan, impl)
        self._digests: dict[tuple[int, int], str] = {}

    @staticmethod
    def resolve_impl(point: Point, runner) -> str:
        from shard_strategies import torch_cp

        if point.impl == DEFAULT_IMPL:
            return torch_cp.default_impl(runner.device)
        return point.impl

    @staticmethod
    def executor_plan(point: Point, mask, impl: str):
        """torch_cp.get_plan with what torch_cp.attention passes it (no padding to tiles)."""
        from shard_strategies import torch_cp

        return torch_cp.get_plan(mask, num_windows=None, **plan_settings(point))

    def queries(self, name: str, r: int, u: int):
        """q or dout of rank (r, u): its ring shard's tokens, its Ulysses group's heads."""
        return self.device_rows(name, self.plan.layout.positions[r], self.q_heads[u])

    def keys(self, r: int, u: int, t: int) -> tuple:
        """The K/V block rank (r, u) attends to at kept step t (its K/V heads)."""
        rows, heads = self.plan.key_positions(r, t), self.kv_heads[u]
        return tuple(self.device_rows(n, rows, heads) for n in ("k", "v"))

    def normal(self, shape: tuple[int, ...], seed: int):
        gen = self.torch.Generator(self.device).manual_seed(seed)
        return self.torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)

    def device_rows(self, name: str, positions: np.ndarray | None = None, heads=None):
        """Drawn chunk by chunk (inputs.CHUNK tokens, each from its own seed), only the chunks
        those positions fall in."""
        torch = self.torch
        b, s, h, d = self._shapes[name]
        positions = np.arange(s) if positions is None else np.asarray(positions, np.int64)
        heads = torch.as_tensor(np.arange(h) if heads is None else heads, device=self.device)
        out = torch.zeros(
            (b, positions.size, heads.numel(), d), device=self.device, dtype=self.dtype
        )
        chunk_of = np.where(positions < s, positions // inputs.CHUNK, -1)
        for c in np.unique(chunk_of[chunk_of >= 0]).tolist():
            sel = np.flatnonzero(chunk_of == c)
            start = c * inputs.CHUNK
            seed = inputs.device_seed(name, *self._source, c)
            drawn = self.normal((b, min(inputs.CHUNK, s - start), h, d), seed)
            local = torch.as_tensor(positions[sel] - start, device=self.device)
            out[:, torch.as_tensor(sel, device=self.device)] = drawn[:, local][:, :, heads]
        return out

    def drop_arrays(self) -> None:
        """Nothing to drop: these ranks keep no device arrays between their calls."""

    def to_host(self, x) -> np.ndarray:
        return _f32(x)

    def all_finite(self, x) -> bool:
        return bool(self.torch.isfinite(x).all())

    @property
    def _local(self) -> bool:
        return self.plan.core == LOCAL_CORE

    def shares_forward(self) -> bool:
        """Both modes run the executor's forward steps alike, except a local core, whose
        forward+backward runs its forward under autograd."""
        return not self._local

    def call_shape(self, r: int, t: int) -> tuple | None:
        """(rows, columns, fresh merge) of the piece's call, and for FlexAttention the interval
        columns its mask_mod unrolls (torch_attn.flex.interval_width: compiled in, so pieces of
        other widths are other programs); the local core calls its kernel on an empty shard
        too."""
        piece = self.pieces[r][t]
        if piece is None:
            n = self.plan.shard_len
            return (n, n, True) if self._local else None
        fresh = all(p is None for p in self.pieces[r][:t])
        shape = (_span(piece.rows), _span(piece.cols), fresh)
        if self.impl == "flex":
            from torch_attn.flex import interval_width

            return (*shape, interval_width(piece.mask))
        return shape

    def call_tokens(self, r: int, t: int) -> tuple[int, int]:
        """(rows, columns) the call computes: its piece trimmed (call_shape)."""
        return self.call_shape(r, t)[:2]

    def call_kind(self, r: int, t: int) -> tuple:
        """Whether the call starts the rank's merge (its cost differs from a merging one) and
        flex's interval columns (a partial tile tests each)."""
        shape = self.call_shape(r, t)
        return () if shape is None else shape[2:]

    def fingerprint(self, r: int, t: int) -> str:
        """A digest of the piece's rows, columns and typed slices (joined where they split a
        rectangle)."""
        if (r, t) not in self._digests:
            piece = self.pieces[r][t]
            h = hashlib.sha1()
            if piece is not None:
                m = piece.mask
                h.update(repr((piece.rows, piece.cols, m.seqlen_q, m.seqlen_k)).encode())
                for a in joined_slices(m.q_ranges, m.k_ranges, m.types):
                    h.update(np.ascontiguousarray(a).tobytes())
            self._digests[r, t] = h.hexdigest()
        return self._digests[r, t]

    def features(self) -> np.ndarray:
        return call_model.area_features(self.plan.piece_area, self.grid_heads()[0])

    def _local_inputs(self, r: int, u: int, grads: bool, timed: bool = False) -> tuple:
        """(q, k, v) of the local core on rank (r, u) (timed: synthetic, of rank (r, 0)'s
        shapes), leaves that require grad when grads."""
        if timed:
            qkv = (self.timed_queries("q", r), *self.timed_keys(r, 0))
        else:
            qkv = (self.queries("q", r, u), *self.keys(r, u, 0))
        return tuple(x.detach().requires_grad_(grads) for x in qkv)

    def _local_core(self, r: int, qkv: tuple):
        """The local core's (out, lse) of ring rank r, as the executor calls it."""
        return self.cp.local_core(*qkv, self.pieces[r][0], self.plan, self.scale, self.impl)

    def _forward(self, q, blocks: dict, r: int):
        """The merged (out, lse) of ring rank r's kept steps, as the executor's forward makes
        them (no graph)."""
        merge = self.cp.LseMerge(q)
        with self.torch.no_grad():
            for t, kv in blocks.items():
                self.cp.forward_step(merge, q, kv, self.pieces[r][t], self.scale, self.impl)
        return merge.out.to(q.dtype), merge.lse

    def call(self, kind: str, r: int, t: int, group_start: bool) -> Callable[[], object]:
        """One timed call with rank (r, 0)'s shapes and piece, as the executor makes it at kept
        step t.

        A backward step gets the step's own output and LSE as the merged ones: the kernels'
        work depends on the piece and shapes, not on these values.
        """
        torch, cp = self.torch, self.cp
        if self._local:
            grads = self.mode != "fwd"
            qkv = self._local_inputs(r, 0, grads, timed=True)
            if kind == simulate.ATTEND_ONCE:

                def attend():
                    with torch.set_grad_enabled(grads):
                        return self._local_core(r, qkv)

                return attend
            with torch.enable_grad():
                out, _ = self._local_core(r, qkv)
            dout = self.timed_queries("dout", r)
            return lambda: torch.autograd.grad(out, qkv, dout, retain_graph=True)
        q, piece = self.timed_queries("q", r), self.pieces[r][t]
        kv = torch.stack(self.timed_keys(r, t))
        if kind in (simulate.ATTEND, simulate.ATTEND_ONCE):
            fresh = all(p is None for p in self.pieces[r][:t])
            merge = cp.LseMerge(q)  # an earlier step's result, when not fresh
            merge.fresh = False

            def forward() -> None:
                with torch.no_grad():
                    m = cp.LseMerge(q) if fresh else merge
                    cp.forward_step(m, q, kv, piece, self.scale, self.impl)

            return forward
        out, lse = self._forward(q, {t: kv}, r)
        dout = self.timed_queries("dout", r)
        dt = cp.acc_dtype(q.dtype)
        once = kind == simulate.ATTEND_ONCE_BWD  # all-gather: dK/dV in the input dtype
        cot, dq = cp.Cotangents.build(dout, out, lse, None), torch.zeros_like(q, dtype=dt)
        dkv = torch.zeros_like(kv, dtype=kv.dtype if once else dt)

        def backward() -> None:
            c, g = (
                (cp.Cotangents.build(dout, out, lse, None), torch.zeros_like(dq))
                if t == 0
                else (cot, dq)
            )
            d = torch.zeros_like(dkv) if once or group_start else dkv
            cp.add_grads(g, d, piece, cp.backward_step(q, kv, piece, c, self.scale, self.impl))

        return backward

    def timer(self, call: tuple) -> CallTimer:
        fn = self.call(*call)

        def sample(warmup: int, iters: int, known_ms: float | None) -> list[float]:
            return timing.torch_time_calls(
                fn, warmup=warmup, iters=iters, device=self.device, chain_ms=self.chain_ms,
                known_ms=known_ms,
            )[0]  # fmt: skip

        return CallTimer(lambda: timing.torch_first_ms(fn, self.device), sample)

    def emulate(self, r: int, u: int, rows: np.ndarray | None = None) -> dict:
        if rows is not None:
            raise ValueError("torch ranks emulate whole shards (their check_block is None)")
        torch, cp = self.torch, self.cp
        grads = self.mode != "fwd"
        if self._local:
            qkv = self._local_inputs(r, u, grads)
            with torch.set_grad_enabled(grads):
                out, _ = self._local_core(r, qkv)
            result = {"out": _f32(out)}
            if grads:
                dq, dk, dv = torch.autograd.grad(out, qkv, self.queries("dout", r, u))
                result.update(dq=_f32(dq), dkv=[(0, dk, dv)])
            return result
        q = self.queries("q", r, u)
        steps = range(self.plan.num_steps if self.plan.core == RING_CORE else 1)
        blocks = {t: torch.stack(self.keys(r, u, t)) for t in steps}
        out, lse = self._forward(q, blocks, r)
        result = {"out": _f32(out)}
        if grads:
            cot = cp.Cotangents.build(self.queries("dout", r, u), out, lse, None)
            dq = torch.zeros_like(q, dtype=cp.acc_dtype(q.dtype))
            parts = []
            for t, kv in blocks.items():
                piece, dkv = self.pieces[r][t], torch.zeros_like(kv, dtype=dq.dtype)
                cp.add_grads(
                    dq, dkv, piece, cp.backward_step(q, kv, piece, cot, self.scale, self.impl)
                )
                parts.append((t, dkv[0], dkv[1]))
            result.update(dq=_f32(dq), dkv=parts)
        return result


def _span(s: slice) -> int:
    return s.stop - s.start


def _f32(x) -> np.ndarray:
    """Float32 host copy of a tensor."""
    return x.detach().float().cpu().numpy()
