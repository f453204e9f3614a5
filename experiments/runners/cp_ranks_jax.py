"""The CP predictor's JAX ranks: the JAX executor's plan (padded to kernel tiles) and its step
functions (jax_cp.forward_step, backward_start, backward_step, local_attention), jitted once,
run on each rank's inputs (its own tokens, drawn for it on the device) with the mask piece in
the executor's stacked MaskArrays shapes."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Container
from functools import cache
from types import SimpleNamespace

import numpy as np

from attn_masks import default_scale, joined_slices
from experiments.core.points import DEFAULT_IMPL, Point
from experiments.runners import call_model, device_reference, frameworks, inputs, timing
from experiments.runners.cp_ranks import CallTimer, Ranks, plan_settings
from shard_strategies.strategies import RING_CORE


class PlanPieces:
    """A plan's distinct mask pieces as the predictor's JAX ranks use them: the (R, T) index of
    each ring rank's piece at each kept step, each piece's work features and digest read from
    its slices and tile counts, and its MaskArrays in the executor's stacked shapes built only
    when a call runs it (at 2M tokens a piece's arrays take a third of a second and a point
    runs a few of the 65)."""

    def __init__(self, plan, impl: str, head_dim: int, dtype) -> None:
        from shard_strategies import jax_cp

        self.plan, self.impl, self.head_dim, self.dtype = plan, impl, head_dim, dtype
        self.pieces, index = jax_cp.distinct_pieces(plan)
        self.index = np.array(index).reshape(plan.ring_size, plan.num_steps)
        self.intervals = jax_cp.interval_count(plan, self.pieces)
        self.tiles = jax_cp.piece_tiles(impl, head_dim, dtype)
        self.key_counts = plan.key_counts.tolist()  # call_shape's, read for every call keyed
        self._arrays: dict[int, object] = {}
        self._digests: dict[int, str] = {}
        self._features: dict[tuple, np.ndarray] = {}  # per (heads_q, heads_kv, slots)
        self._layouts: list[tuple[dict, call_model.PieceWork]] = []  # per distinct piece

    @classmethod
    def of(cls, plan, impl: str, head_dim: int, dtype) -> PlanPieces:
        """The plan's PlanPieces, kept on the plan object for its next point (the predictor
        keeps a problem's plans for its points in both modes and drops them with it)."""
        how = (impl, head_dim, np.dtype(dtype).name)
        kept = plan.__dict__.setdefault("_predictor_pieces", {})
        if how not in kept:
            kept[how] = cls(plan, impl, head_dim, dtype)
        return kept[how]

    def arrays(self, i: int):
        """Host MaskArrays of distinct piece i in the executor's stacked shapes."""
        from shard_strategies import jax_cp

        if i not in self._arrays:
            self._arrays[i] = jax_cp.stacked_piece_arrays(
                self.pieces[i], self.impl, self.head_dim, self.dtype, self.intervals
            )
        return self._arrays[i]

    def digest(self, i: int) -> str:
        """Identity of the arrays of distinct piece i: a digest of its typed slices (joined
        where they split a rectangle: an all-gather rank's full piece is one call at every
        layout), tiles and interval count, from which the arrays are built."""
        if i not in self._digests:
            self._digests[i] = _piece_digest(self.pieces[i], self.tiles, self.intervals)
        return self._digests[i]

    def features(self, heads_q: int, heads_kv: int, slots: int) -> np.ndarray:
        """(R, T, F) work features of every (ring rank, kept step) piece run for heads_q query
        and heads_kv K/V heads (times the batch): its kernels' spans on `slots` (call_model.
        span_features, from its tiles per row and column: what its tile lists hold), or its
        area times the heads for an impl without tile lists; read once for the plan's points."""
        key = (heads_q, heads_kv, slots)
        if key not in self._features:
            if self.tiles is None:
                self._features[key] = call_model.area_features(self.plan.piece_area, heads_q)
            else:
                distinct = [_piece_spans(work, *key) for _, work in self.layouts()]
                self._features[key] = np.array(distinct)[self.index]
        return self._features[key]

    def layouts(self) -> list[tuple[dict, call_model.PieceWork]]:
        """(call_model.work_stats, tiles per row and column) of each distinct piece, from its
        tile geometry, read once for all plans of a run that hold the piece (_piece_layout)."""
        if not self._layouts:
            for i, piece in enumerate(self.pieces):
                self._layouts.append(_piece_layout(self.digest(i), piece, self.tiles))
        return self._layouts

    def stats(self, r: int, t: int) -> dict[str, int] | None:
        """call_model.work_stats of ring rank r's piece at kept step t (None without tiles)."""
        if self.tiles is None:
            return None
        return self.layouts()[int(self.index[r, t])][0]


# Distinct pieces whose digest, tile layout and spans a run keeps across plans: a 64-GPU plan
# has thousands (a document mask's zigzag ring about 3,700 at 8K tokens a device, a few KB of
# tile counts each), and the points of a problem's strategies and layouts share many (a double
# ring's pieces are its ring's: 5,700 distinct of 11,400 in the 64-GPU 8K problems).
LAYOUTS_KEPT = 8192
_layouts_kept: OrderedDict[str, tuple[dict, call_model.PieceWork]] = OrderedDict()
_digests_kept: OrderedDict[str, str] = OrderedDict()  # by the piece's own slices (_piece_digest)
_spans_kept: OrderedDict[tuple, np.ndarray] = OrderedDict()  # by profile and heads (_piece_spans)


def _kept(store: OrderedDict, key, make: Callable):
    """store[key], made by make() where missing, the store keeping its last LAYOUTS_KEPT."""
    value = store.pop(key, None)
    if value is None:
        value = make()
    store[key] = value
    while len(store) > LAYOUTS_KEPT:
        store.popitem(last=False)
    return value


def _piece_digest(piece, tiles, intervals: int) -> str:
    """PlanPieces.digest of a piece: a digest of its typed slices joined where they split a
    rectangle (joined_slices), its lengths, tiles and interval count; kept by a digest of the
    slices as they are (equal slices join alike), so a piece in several plans joins once."""
    head = repr((piece.seqlen_q, piece.seqlen_k, tiles, intervals))
    slices = (piece.q_ranges, piece.k_ranges, piece.types)
    raw = hashlib.sha1((head + repr([(a.dtype.str, a.shape) for a in slices])).encode())
    for a in slices:
        raw.update(np.ascontiguousarray(a).tobytes())

    def digest() -> str:
        h = hashlib.sha1(head.encode())
        for a in joined_slices(*slices):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    return _kept(_digests_kept, raw.hexdigest(), digest)


def _piece_spans(work: call_model.PieceWork, heads_q: int, heads_kv: int, slots: int):
    """call_model.span_features of a piece's tiles per row and column (`work`): pieces of one
    profile share their spans, in a plan and across plans."""
    profile = hashlib.sha1()  # a digest, not the bytes: a 2M-key piece's counts are 265 KB
    for a in (np.asarray(a, np.int64) for p in work for a in p):
        profile.update(len(a).to_bytes(8, "little") + a.tobytes())  # lengths: one split only
    key = (profile.hexdigest(), heads_q, heads_kv, slots)
    return _kept(
        _spans_kept, key, lambda: call_model.span_features(*work, heads_q, heads_kv, slots)
    )


def _piece_layout(digest: str, piece, tiles: tuple[int, int]) -> tuple[dict, call_model.PieceWork]:
    """(work_stats, tiles per row and column) of a piece from its tile geometry (its tile map is
    built only where a call runs it: a 2M-token piece's holds 268M tiles, seconds to build),
    kept for the last LAYOUTS_KEPT pieces by digest (PlanPieces.digest: its slices, tiles and
    interval count)."""

    def layout() -> tuple[dict, call_model.PieceWork]:
        work = piece.tile_counts(*tiles)
        shape = (len(work[0][0]), len(work[1][0]))
        return call_model.work_stats(shape, work), work

    return _kept(_layouts_kept, digest, layout)


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
def _rows_at():
    """jitted (seed, positions, heads, seqlen, batch, heads_total, head_dim, dtype, out_dtype) ->
    the values at those positions and heads (B, n, len(heads), D) in out_dtype: each token's
    (B, H, D) values drawn in dtype from the seed's key folded with its position, zeros past
    seqlen. One compilation per shape, whatever the positions (a rank's shard, a key block,
    sampled rows), the sequence length and the seed (traced: a preset's device counts and
    lengths share the check's draws, and no key is made eagerly, a dispatch per draw)."""
    import jax
    import jax.numpy as jnp

    def rows_at(seed, positions, heads, seqlen, batch, num_heads, head_dim, dtype, out_dtype):
        key = jax.random.key(seed)

        def token(p):
            token_key = jax.random.fold_in(key, p)
            return jax.random.normal(token_key, (batch, num_heads, head_dim), dtype)

        x = jax.vmap(token)(positions)
        x = jnp.where((positions < seqlen)[:, None, None, None], x, jnp.zeros((), dtype))
        return jnp.moveaxis(x, 0, 1)[:, :, heads].astype(out_dtype)

    return jax.jit(rows_at, static_argnums=(4, 5, 6, 7, 8))


def _program_key(jax, fn: Callable, args: tuple) -> tuple:
    """What picks fn's compiled program for args: fn, the arguments' structure, shapes and
    dtypes (not their values)."""
    leaves, tree = jax.tree.flatten(args)
    return (id(fn), tree, tuple((x.shape, str(x.dtype)) for x in leaves))


def _cast_like(x, like):
    """x in like's dtype: a forward step's output as a backward step's input (JaxRanks.call)."""
    return x.astype(like.dtype)


# Values a draw may hold beyond its asked heads (_draw): 1 GiB in float32.
DRAW_ALL_HEADS = 1 << 28


def _asked_heads(rows, asked: int):
    """The first `asked` heads of a device draw (_draw), copied only when it holds more."""
    return rows if asked == rows.shape[2] else rows[:, :, :asked]


# Values of one timing input's random draw: odd, so a token's values start at another offset
# of the draw in each repeat. A timed call's time does not depend on its inputs' values.
TIMING_POOL = (1 << 22) - 1


@cache
def _timing_pool(seed: int, dtype):
    """TIMING_POOL normal values drawn from the seed, drawn once a run: every point's ranks
    number their timing inputs from 0, and a CPU takes tens of milliseconds a draw."""
    import jax

    return jax.random.normal(jax.random.key(seed), (TIMING_POOL,), dtype)


@cache
def _repeat():
    """jitted (pool, shape) -> the pool's values repeated to fill the shape: every timing input
    from one compiled random draw and a small copy program per shape, where drawing each shape
    compiles a random-number program of its own (0.4 s each on the H200, 20 in 215 points)."""
    import jax
    import jax.numpy as jnp

    def repeat(pool, shape):
        n = math.prod(shape)
        return jnp.tile(pool, -(-n // pool.size))[:n].reshape(shape)

    return jax.jit(repeat, static_argnums=1)


@cache
def _all_finite():
    """jitted x -> whether x holds no inf or NaN: one program per shape, not one per operation."""
    import jax
    import jax.numpy as jnp

    def all_finite(x):
        return jnp.isfinite(x).all()

    return jax.jit(all_finite)


@cache
def _rows_f32():
    """jitted (x, rows) -> float32 x at local rows `rows` (axis 1): one program per shape."""
    import jax
    import jax.numpy as jnp

    def rows_f32(x, rows):
        return jnp.take(x, rows, axis=1).astype(jnp.float32)

    return jax.jit(rows_f32)


ZEROS_KEPT = 4  # zero arrays a point's Ranks keeps (_zeros): the dK, dV and LSE shapes it asks


class JaxRanks(Ranks):
    """One plan's ranks on the JaxRunner's device, with the JAX executor's step functions."""

    COMPILES_AHEAD = True
    _shapes_only = False  # a call's inputs as their shapes alone, no arrays (lower_calls)

    def __init__(self, plan, impl: str, point: Point, index: int, runner) -> None:
        import jax
        import jax.numpy as jnp

        super().__init__(plan, impl, point, index)
        self.jax, self.jnp = jax, jnp
        self.flush = runner.flush
        d = plan.head_dim
        self.steps = _steps(impl, default_scale(d))
        self.dtype = frameworks.framework_dtype("jax", point.dtype)
        self.pieces = PlanPieces.of(plan, impl, d, self.dtype)  # shared by a plan's points
        self._row_pieces: dict[tuple[int, bytes], object] = {}  # row_piece's, this point's
        self._zero_arrays: dict[tuple, object] = {}  # _zeros', oldest first

    @staticmethod
    def resolve_impl(point: Point, runner) -> str:
        from shard_strategies.jax_cp import resolve_impl

        return resolve_impl(None if point.impl == DEFAULT_IMPL else point.impl)

    @staticmethod
    def executor_plan(point: Point, mask, impl: str):
        from shard_strategies import jax_cp

        dtype = frameworks.framework_dtype("jax", point.dtype)
        return jax_cp.executor_plan(mask, impl=impl, dtype=dtype, **plan_settings(point))

    @staticmethod
    def timed_plan(point: Point, mask, impl: str, plan):
        """The executor's plan with its ring shards padded up to shared lengths
        (jax_cp.bucket_multiple) where that only adds padding, which a block-sparse kernel
        skips: every rank holds the same real tokens in the same order, so its calls do the
        same work, in shapes that the preset's document masks (per-document zigzag: 8320,
        8576, ... tokens) share."""
        from shard_strategies import jax_cp

        dtype = frameworks.framework_dtype("jax", point.dtype)
        tile = jax_cp.shard_multiple(impl, point.head_dim, dtype)
        bucket = jax_cp.bucket_multiple(plan.shard_len, math.lcm(tile, plan.ulysses_size))
        if tile == 1 or plan.shard_len % bucket == 0:
            return plan
        settings = plan_settings(point)
        bucketed = jax_cp.executor_plan(
            mask, impl=impl, dtype=dtype, pad_multiple=bucket, like=plan, **settings
        )
        same = all(
            np.array_equal(a[a < plan.seqlen], b[b < plan.seqlen])
            for a, b in zip(plan.layout.positions, bucketed.layout.positions)
        )
        return bucketed if same else plan

    @property
    def ring_core(self) -> bool:
        return self.plan.core == RING_CORE

    def shares_forward(self) -> bool:
        """A ring core's forward steps (fwd) are the same in both modes; an all-gather core
        runs its forward alone (once) or under a VJP (once_vjp): other programs."""
        return self.ring_core

    def _host_piece(self, r: int, t: int):
        """The executor's MaskArrays of ring rank r at kept step t, on the host."""
        return self.pieces.arrays(int(self.pieces.index[r, t]))

    def piece(self, r: int, t: int):
        """The executor's MaskArrays of ring rank r at kept step t, on the device (their
        shapes alone while lowering)."""
        if self._shapes_only:
            return self.jax.eval_shape(lambda piece: piece, self._host_piece(r, t))
        return self.jax.device_put(self._host_piece(r, t))

    def check_block(self) -> int:
        return self.pieces.tiles[0] if self.pieces.tiles else self._host_piece(0, 0).block_q

    def row_piece(self, r: int, t: int, rows: np.ndarray):
        """The piece of ring rank r at kept step t with only the shard's local `rows` seeing
        keys, in the shapes of the point's pieces (its interval count, full-width tile lists),
        so it runs the timed calls' compiled programs; on the device. Built once per distinct
        piece and rows in a point: a checked rank's steps repeat pieces (a ring's full blocks)."""
        i = int(self.pieces.index[r, t])
        key = (i, np.asarray(rows, np.int64).tobytes())
        if key not in self._row_pieces:
            self._row_pieces[key] = self._rows_only(i, rows)
        return self._row_pieces[key]

    def _rows_only(self, i: int, rows: np.ndarray):
        """Device arrays of distinct piece i with only the local `rows` (whole query tiles:
        check_rows) seeing keys (row_piece): the piece restricted to those rows, its arrays
        placed at their tiles (scatter_query_tiles; work in the rows, not in the piece)."""
        from jax_attn.mask_arrays import scatter_query_tiles
        from shard_strategies.jax_cp import piece_arrays

        piece = self.pieces.pieces[i]
        rows = np.asarray(rows, np.int64)
        kept = piece.restrict(rows, np.arange(piece.seqlen_k))
        arrays = piece_arrays(kept, self.impl, self.plan.head_dim, self.dtype)
        return scatter_query_tiles(arrays, rows, piece.seqlen_q, self.pieces.intervals)

    def call_shape(self, r: int, t: int) -> tuple:
        """The key block's length (every step of every rank makes its call) and the pieces'
        interval count (a partial tile tests each interval)."""
        return (self.pieces.key_counts[r][t], self.pieces.intervals)

    def call_kind(self, r: int, t: int) -> tuple:
        return (self.pieces.intervals,)

    def fingerprint(self, r: int, t: int) -> str:
        """A digest of the piece whose arrays the kernel receives."""
        return self.pieces.digest(int(self.pieces.index[r, t]))

    def features(self) -> np.ndarray:
        return self.pieces.features(*self.grid_heads(), self.slots())

    def slots(self) -> int:
        """CTAs the device runs at once in the cost model's schedule: its SMs on a GPU."""
        device = self.jax.devices()[0]
        if device.platform == "gpu" and getattr(device, "core_count", None):
            return int(device.core_count)
        return call_model.SLOTS

    def piece_stats(self, r: int, t: int) -> dict[str, int] | None:
        return self.pieces.stats(r, t)

    def queries(self, name: str, r: int, u: int, rows: np.ndarray | None = None):
        """q or dout of rank (r, u): its ring shard's tokens (or those local rows of it, zeros
        elsewhere), its Ulysses group's heads."""
        positions = self.plan.layout.positions[r].copy()
        if rows is not None:
            positions[~np.isin(np.arange(len(positions)), rows)] = self._shapes[name][1]
        return self.device_rows(name, positions, self.q_heads[u])

    def keys(self, r: int, u: int, t: int):
        """The K/V block rank (r, u) attends to at kept step t (its K/V heads)."""
        rows, heads = self.plan.key_positions(r, t), self.kv_heads[u]
        return tuple(self.device_rows(n, rows, heads) for n in ("k", "v"))

    def reference_rows(
        self, mask, rows_of: list[np.ndarray], u: int, heads: np.ndarray, grads: bool, scale: float
    ) -> dict[str, np.ndarray]:
        """Ranks.reference_rows computed on the device in float64 (device_reference): only the
        sampled rows' out and dq come back, not the keys they see (at 64 devices, millions of
        keys per head); the rows drawn padded, each chunk of keys drawn for every K/V head, again
        for the dq pass instead of held."""
        rows = np.concatenate(rows_of)
        gq = self.q_heads[u][heads]
        kv_of = gq // (self.plan.num_heads_q // self.plan.num_heads_kv)  # of all K/V heads
        seqlen = self._shapes["k"][1]

        def draw(name: str):
            positions = self.padded_positions(name, rows)
            return _asked_heads(*self._draw(name, positions, gq, self.jnp.float32))

        def keys(positions: np.ndarray) -> tuple:
            """k, v at a chunk's positions, padding (-1) drawn past the end (zeros)."""
            at = np.where(positions < 0, seqlen, positions)
            return tuple(self._draw(x, at, None, self.jnp.float32)[0] for x in ("k", "v"))

        dout = draw("dout") if grads else None
        return device_reference.rows_reference(mask, rows, draw("q"), dout, keys, kv_of, scale)

    def normal(self, shape: tuple[int, ...], seed: int):
        """The seed's TIMING_POOL values (_timing_pool), repeated to the shape (_repeat)."""
        if self._shapes_only:
            return self.jax.ShapeDtypeStruct(tuple(shape), self.dtype)
        return _repeat()(_timing_pool(seed, self.dtype), tuple(shape))

    def device_rows(self, name: str, positions: np.ndarray | None = None, heads=None):
        return _asked_heads(*self._draw(name, positions, heads, self.dtype))

    def host_draw(self, name: str, positions: np.ndarray | None, heads) -> np.ndarray:
        """Drawn and converted to float32 in one program (no eager conversion compiled per
        shape), the asked heads kept on the host."""
        rows, asked = self._draw(name, positions, heads, self.jnp.float32)
        return np.asarray(rows)[:, :, :asked]

    def _draw(self, name: str, positions: np.ndarray | None, heads, out_dtype) -> tuple:
        """(the values at the positions of the asked heads, then of the input's others where
        that draw holds at most DRAW_ALL_HEADS values; how many heads were asked): rows_at
        draws every head anyway, so draws of one length share one program whatever heads a
        rank takes, and a draw of a rank's whole sequence (pure Ulysses at 2M tokens) keeps
        only its own heads."""
        b, s, h, d = self._shapes[name]
        positions = np.arange(s) if positions is None else np.asarray(positions)
        heads = np.arange(h) if heads is None else np.asarray(heads)
        width = h if b * len(positions) * h * d <= DRAW_ALL_HEADS else len(heads)
        padded = np.resize(heads, max(width, len(heads))).astype(np.int32)
        seed = np.uint32(inputs.device_seed(name, *self._source))
        rows = _rows_at()(seed, positions.astype(np.int32), padded, np.int32(s), b, h, d,
                          self.dtype, out_dtype)  # fmt: skip
        return rows, len(heads)

    def drop_arrays(self) -> None:
        """The check's row pieces and zero accumulators (row_piece, _zeros)."""
        self._row_pieces.clear()
        self._zero_arrays.clear()

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x.astype(self.jnp.float32))

    def all_finite(self, x) -> bool:
        return bool(_all_finite()(x))

    def _host_rows(self, x, rows: np.ndarray | None) -> np.ndarray:
        """A float32 host copy of the local rows `rows` of x (all where None), gathered on the
        device, so only the rows a check compares cross to the host."""
        if rows is None:
            return self.to_host(x)
        return np.asarray(_rows_f32()(x, rows.astype(np.int32)))

    def _zero_lse(self, q):
        return self._zeros((q.shape[0], q.shape[2], q.shape[1]), self.jnp.float32)

    def _zero_dkv(self, k, v) -> tuple:
        """An empty dK/dV accumulator (fp32 at least) for the block (k, v) of a backward step."""
        acc = self.jnp.promote_types(k.dtype, self.jnp.float32)
        return self._zeros(k.shape, acc), self._zeros(v.shape, acc)

    def _zeros(self, shape: tuple[int, ...], dtype):
        """A zero array of the shape, made once while its shape is among the ZEROS_KEPT last
        asked (a point's steps ask thousands, dispatched one by one otherwise); the steps
        take it as an input and return new arrays, so one serves them all."""
        key = (tuple(shape), self.jnp.dtype(dtype))
        if self._shapes_only:
            return self.jax.ShapeDtypeStruct(*key)
        kept = self._zero_arrays
        zeros = kept.pop(key, None)
        if zeros is None:
            while len(kept) >= ZEROS_KEPT:
                kept.pop(next(iter(kept)))
            zeros = self.jnp.zeros(shape, dtype)
        kept[key] = zeros  # the last asked last
        return zeros

    def call(self, call: str, r: int, t: int, group_start: bool, run: Callable | None = None):
        """(jitted fn, args) of one timed call with rank (r, 0)'s shapes and mask piece.

        A later forward step merges into, and a backward step takes as residuals, an output and
        LSE of a forward step's shapes (_residuals) and what the steps before it make of them,
        once a point for all its calls of those shapes (_made_once): the kernels' work depends
        on the mask tiles and shapes, not on these values. run(fn, *args) makes those inputs: by
        default it runs the steps; jax.eval_shape gives their shapes alone (precompile). The
        all-gather's pullback holds its own piece, so it is made per call.
        """
        from shard_strategies import simulate

        s = self.steps
        made = run or self._made_once
        forward = self._residuals if run is None else lambda *x: run(s.fwd, *x, None, None)
        run = run or (lambda fn, *args: fn(*args))
        q, (k, v) = self.timed_queries("q", r), self.timed_keys(r, t)
        a = self.piece(r, t)
        if call == simulate.ATTEND:
            if t == 0:
                return s.fwd, (q, k, v, a, None, None)
            return s.fwd, (q, k, v, a, *forward(q, k, v, a))
        dout = self.timed_queries("dout", r)
        if call == simulate.ATTEND_BWD:
            out, lse = forward(q, k, v, a)
            out = made(_cast_like, out, q)
            dlse = self._zero_lse(q)
            if t == 0:
                return s.first_bwd, (q, k, v, a, out, lse, dout, dlse)
            rowdot, dq = made(s.start, q, out, dout)
            dkv = None if group_start else self._zero_dkv(k, v)
            return s.bwd, (q, k, v, a, (out, lse, dout, dlse, rowdot), dq, dkv)
        if call == simulate.ATTEND_ONCE:
            return (s.once if self.mode == "fwd" else s.once_vjp), (q, k, v, a)
        _, pullback = run(s.once_vjp, q, k, v, a)
        return s.pullback, (pullback, (dout, self._zero_lse(q)))

    def _residuals(self, q, k, v, a) -> tuple:
        """(out, LSE) of a forward step's shapes for the timed calls after it: normal values,
        the LSE near log(keys) as a softmax's is, once per shapes in a point. Not a forward run:
        the one piece it ran on could be empty (LSE -inf everywhere), and every backward call
        after it would multiply zero probabilities, which a power-limited GPU runs faster."""
        key = ("residuals", q.shape, str(q.dtype), k.shape)
        if key not in self._timing_inputs:
            shapes = self.jax.eval_shape(self.steps.fwd, q, k, v, a, None, None)
            out, lse = (
                _repeat()(_timing_pool(i + 1, x.dtype), tuple(x.shape))
                for i, x in enumerate(shapes)
            )
            self._timing_inputs[key] = (out, lse + np.float32(math.log(k.shape[1])))
        return self._timing_inputs[key]

    def _made_once(self, fn: Callable, *args):
        """fn(*args), run once per step function and argument shapes in this point (call)."""
        key = ("made", *_program_key(self.jax, fn, args))
        if key not in self._timing_inputs:
            self._timing_inputs[key] = fn(*args)
        return self._timing_inputs[key]

    def lower_calls(self, calls: list[tuple], skip: Container = ()) -> tuple[list, dict]:
        """(each call's program, {program: jax Lowered} of those not in `skip`), lowered from
        the inputs' shapes alone: no array is made on the device, so a thread may lower beside
        a check without adding to its memory (CPSimulator._ahead). Calls of one step function
        with equal argument structure and shapes share a program."""
        jax, kept, zeros = self.jax, self._timing_inputs, self._zero_arrays
        self._timing_inputs, self._zero_arrays, self._shapes_only = {}, {}, True
        programs, lowered = [], {}
        try:
            for c in calls:
                fn, args = self.call(*c, run=jax.eval_shape)
                key = _program_key(jax, fn, args)
                if key not in lowered and key not in skip:
                    lowered[key] = fn.lower(*args)
                programs.append(key)
        finally:
            self._timing_inputs, self._zero_arrays, self._shapes_only = kept, zeros, False
        return programs, lowered

    def timer(self, call: tuple) -> CallTimer:
        """A run that traced or compiled (the jitted step's cache grew) has no time."""
        fn, args = self.call(*call)
        programs = getattr(fn, "_cache_size", lambda: 0)

        def run() -> float | None:
            before = programs()
            ms = timing.jax_first_ms(fn, args, self.flush)
            return ms if programs() == before else None

        def sample(warmup: int, iters: int, known_ms: float | None) -> list[float]:
            return timing.jax_time_calls(
                fn, args, warmup=warmup, iters=iters, flush=self.flush, chain_ms=self.chain_ms,
                known_ms=known_ms,
            )  # fmt: skip

        return CallTimer(run, sample)

    def emulate(self, r: int, u: int, rows: np.ndarray | None = None) -> dict:
        """Each backward step adds its dK/dV to an empty accumulator and the pullback runs
        jitted, as in the timed calls, so an emulation compiles no kernel program of its own."""
        s = self.steps
        grads = self.mode != "fwd"
        q = self.queries("q", r, u, rows)
        steps = range(self.plan.num_steps) if self.ring_core else range(1)
        piece = self.piece if rows is None else lambda r, t: self.row_piece(r, t, rows)
        blocks = {t: (*self.keys(r, u, t), piece(r, t)) for t in steps}
        parts = []
        if self.ring_core:
            out = lse = None
            for t in steps:
                out, lse = s.fwd(q, *blocks[t], out, lse)
            out = out.astype(q.dtype)
            if grads:
                dout = self.queries("dout", r, u, rows)
                rowdot, dq = s.start(q, out, dout)
                res = (out, lse, dout, self._zero_lse(q), rowdot)
                for t in steps:
                    dq, dkv = s.bwd(q, *blocks[t], res, dq, self._zero_dkv(*blocks[t][:2]))
                    parts.append((t, dkv))
        elif not grads:
            out, _ = s.once(q, *blocks[0])
        else:
            (out, _), pullback = s.once_vjp(q, *blocks[0])
            cts = (self.queries("dout", r, u, rows), self._zero_lse(q))
            dq, dk, dv = s.pullback(pullback, cts)
            parts.append((0, (dk, dv)))
        result = {"out": self._host_rows(out, rows)}
        if grads:
            result["dq"] = self._host_rows(dq, rows)
            result["dkv"] = [(t, *kv) for t, kv in parts]
        return result
