"""jax_cp's executor: the plan bound to a mesh, shard_map over it, and the public entry points
(attention, build, executor_plan); the per-device strategy bodies are in the sibling modules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from attn_masks import Mask, from_slices
from attn_masks.cache import MaskCache
from attn_masks.shapes import check_attention_shapes
from jax_attn.mask_arrays import (
    MaskArrays,
    empty_mask_arrays,
    stack_mask_arrays,
    widen_mask_arrays,
)

from ..exchange import Exchange, plan_exchanges
from ..plan import CPPlan, make_plan
from ..schedules import StepIndex
from ..strategies import ALLGATHER_CORE, NO_ULYSSES, RING_CORE, STRATEGY
from ._allgather import allgather_attention
from ._local import REFERENCE, local_attention, piece_arrays, resolve_impl
from ._ring import make_ring, step_arrays
from ._ulysses import heads_to_seq, lse_heads_to_seq, seq_to_heads

ULYSSES, RING = "ulysses", "ring"
_CACHE_SIZE = 16
MIN_INTERVALS = 4
SHARD_BUCKETS = 16  # a bucketed ring shard is at most 1/SHARD_BUCKETS longer (bucket_multiple)


def shard_map(f, mesh: Mesh, in_specs, out_specs):
    """jax.shard_map (jax >= 0.6) or the experimental one, without replication checks."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


@dataclass(frozen=True)
class _Config:
    """The compile-time description of one executor (a jit static argument)."""

    mesh: Mesh
    core: str  # CPPlan.core
    steps: tuple[StepIndex, ...]
    ring_size: int
    num_windows: int
    ulysses_size: int
    replicate: int
    impl: str
    scale: float
    return_lse: bool
    padded_seqlen: int
    # the (src, dst) rank pairs of each ppermute round into / out of the layout; None: the
    # length does not split evenly, and dispatch gathers global arrays
    dispatch_rounds: tuple[tuple[tuple[int, int], ...], ...] | None = None
    undispatch_rounds: tuple[tuple[tuple[int, int], ...], ...] | None = None

    @property
    def tokens(self) -> P:
        return P(None, self.mesh.axis_names)

    @property
    def lse_tokens(self) -> P:
        return P(None, None, self.mesh.axis_names)


def _device_body(cfg: _Config):
    """The per-device program: Ulysses in, the strategy's core, Ulysses out."""

    def body(q, k, v, arrays, key_order):
        arrays = jax.tree.map(lambda x: x[0], arrays)
        if cfg.ulysses_size > 1:
            q = seq_to_heads(q, ULYSSES)
            k = seq_to_heads(k, ULYSSES, cfg.replicate)
            v = seq_to_heads(v, ULYSSES, cfg.replicate)
        if cfg.core == RING_CORE:
            ring = make_ring(cfg.steps, cfg.ring_size, cfg.num_windows, cfg.impl, cfg.scale, RING)
            out, lse = ring(q, k, v, arrays)
        elif cfg.core == ALLGATHER_CORE:
            out, lse = allgather_attention(
                q, k, v, step_arrays(arrays, 0), cfg.impl, cfg.scale, RING, key_order
            )
        else:
            out, lse = local_attention(q, k, v, step_arrays(arrays, 0), cfg.impl, cfg.scale)
        if cfg.ulysses_size > 1:
            out = heads_to_seq(out, ULYSSES)
            lse = lse_heads_to_seq(lse, ULYSSES) if cfg.return_lse else lse
        return (out, lse) if cfg.return_lse else out

    return body


@cache
def _sharded_fn(cfg: _Config):
    names = cfg.mesh.axis_names
    out_specs = (cfg.tokens, cfg.lse_tokens) if cfg.return_lse else cfg.tokens
    in_specs = (cfg.tokens, cfg.tokens, cfg.tokens, P(names), P())
    return shard_map(_device_body(cfg), cfg.mesh, in_specs, out_specs)


@partial(jax.jit, static_argnames=("cfg",))
def _run_sharded(q, k, v, arrays, inverse, cfg: _Config):
    return _sharded_fn(cfg)(q, k, v, arrays, inverse)


def _exchange_body(rounds, names: tuple[str, ...], axis: int):
    """Per device: send each round's rows, pool [own rows, received rows, a zero row], gather."""

    def body(x, send, gather):
        parts = [x]
        for pairs, rows in zip(rounds, send):
            buf = jnp.take(x, rows[0], axis=axis, mode="clip")
            parts.append(jax.lax.ppermute(buf, names, pairs))
        zero = list(x.shape)
        zero[axis] = 1
        parts.append(jnp.zeros(zero, x.dtype))
        pool = jnp.concatenate(parts, axis=axis)
        return jnp.take(pool, gather[0], axis=axis, mode="clip")

    return body


def _exchange(x: jax.Array, tables, rounds, cfg: _Config, axis: int) -> jax.Array:
    """Re-shard x along `axis` between the contiguous split and the layout (tables: the
    Exchange's (send, gather) as rank-sharded arrays), moving only the tokens that change rank."""
    names = cfg.mesh.axis_names
    spec = cfg.tokens if axis == 1 else cfg.lse_tokens
    fn = shard_map(_exchange_body(rounds, names, axis), cfg.mesh, (spec, P(names), P(names)), spec)
    return fn(x, *tables)


def _dispatch(x: jax.Array, order: jax.Array, cfg: _Config, tables=None) -> jax.Array:
    if cfg.dispatch_rounds is not None:
        return _exchange(x, tables[0], cfg.dispatch_rounds, cfg, 1)
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, cfg.padded_seqlen - x.shape[1])
    x = jnp.pad(x, pad)
    x = jnp.take(x, order, axis=1)
    return jax.lax.with_sharding_constraint(x, NamedSharding(cfg.mesh, cfg.tokens))


def _undispatch(y: jax.Array, inverse: jax.Array, cfg: _Config, tables, axis: int) -> jax.Array:
    if cfg.undispatch_rounds is not None:
        return _exchange(y, tables[1], cfg.undispatch_rounds, cfg, axis)
    return jnp.take(y, inverse, axis=axis)


def _run(q, k, v, order, inverse, arrays, tables, cfg: _Config):
    qd, kd, vd = (_dispatch(x, order, cfg, tables) for x in (q, k, v))
    res = _sharded_fn(cfg)(qd, kd, vd, arrays, inverse)
    if not cfg.return_lse:
        return _undispatch(res, inverse, cfg, tables, 1)
    return _undispatch(res[0], inverse, cfg, tables, 1), _undispatch(
        res[1], inverse, cfg, tables, 2
    )


def _explicit_sharding(x) -> NamedSharding | None:
    """x's sharding when it is typed on a mesh with Explicit axes (jax.make_mesh's default)."""
    typeof, axis_type = getattr(jax, "typeof", None), getattr(jax.sharding, "AxisType", None)
    if typeof is None or axis_type is None:
        return None
    sharding = getattr(typeof(x), "sharding", None)
    types = getattr(getattr(sharding, "mesh", None), "axis_types", None) or ()
    return sharding if axis_type.Explicit in types else None


@partial(jax.jit, static_argnames=("cfg",))
def _run_global(q, k, v, order, inverse, arrays, tables, cfg: _Config):
    explicit = _explicit_sharding(q)
    if explicit is None:
        return _run(q, k, v, order, inverse, arrays, tables, cfg)
    # Explicit axes: run on the executor's (Auto) mesh; the output keeps q's sharding.
    spec = tuple(explicit.spec) + (None,) * (4 - len(explicit.spec))
    out_spec = P(*spec)
    lse_spec = P(spec[0], spec[2], spec[1])

    def inner(q, k, v):
        with jax.sharding.use_abstract_mesh(cfg.mesh.abstract_mesh):
            return _run(q, k, v, order, inverse, arrays, tables, cfg)

    user_mesh = getattr(explicit.mesh, "abstract_mesh", explicit.mesh)
    with jax.sharding.use_abstract_mesh(user_mesh):
        out_sharding = (out_spec, lse_spec) if cfg.return_lse else out_spec
        return jax.sharding.auto_axes(inner, out_sharding=out_sharding)(q, k, v)


def _global_array(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global jax.Array from a host array every process holds (works multi-process)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _mesh_factors(mesh: Mesh, axis: str) -> tuple[np.ndarray, int | None, str | None]:
    """(devices in rank order, U fixed by the mesh or None, inner axis fixed by it or None)."""
    names = tuple(mesh.axis_names)
    if names == (axis,):
        return mesh.devices.reshape(-1), None, None
    if len(names) == 2 and set(names) == {ULYSSES, RING}:
        return mesh.devices.reshape(-1), int(mesh.shape[ULYSSES]), names[-1]
    raise ValueError(
        f"the CP mesh must be 1-D with axis {axis!r} or 2-D with axes ('{ULYSSES}', '{RING}') in "
        f"either order; got axes {names}"
    )


def cp_mesh(devices: np.ndarray, plan: CPPlan) -> Mesh:
    """The 2-D (ulysses x ring) mesh of `plan` over devices in rank order."""
    u, r = plan.ulysses_size, plan.ring_size
    if plan.inner_axis == ULYSSES:
        return Mesh(np.asarray(devices).reshape(r, u), (RING, ULYSSES))
    return Mesh(np.asarray(devices).reshape(u, r), (ULYSSES, RING))


def distinct_pieces(plan: CPPlan) -> tuple[list, list[int]]:
    """(the plan's distinct pieces, each piece's index among them in rank-major order): pieces
    of equal typed slices are one (a Mask compares by identity). A 64-rank plan of a document
    mask has 4096 pieces, about 240 distinct (most are empty or whole blocks)."""
    built: dict[tuple, int] = {}
    distinct, index = [], []
    for piece in (p for row in plan.pieces for p in row):
        slices = (piece.q_ranges, piece.k_ranges, piece.types)
        key = (piece.seqlen_q, piece.seqlen_k, *(a.tobytes() for a in slices))
        if key not in built:
            built[key] = len(distinct)
            distinct.append(piece)
        index.append(built[key])
    return distinct, index


def interval_count(plan: CPPlan, pieces: list | None = None) -> int:
    """Key intervals per row in the executor's stacked mask arrays (an array shape of every
    kernel call): the widest piece's, rounded up to a power of two, at least MIN_INTERVALS.
    pieces: the plan's distinct pieces where the caller has them (distinct_pieces).

    A mask whose rows see many key runs (random blocks) gives counts that vary between masks;
    rounded up, plans share a few counts and their compiled programs. The extra intervals are
    empty (lo == hi == 0).
    """
    return _interval_count(distinct_pieces(plan)[0] if pieces is None else pieces)


def _interval_count(pieces: list) -> int:
    """Reads a piece's rows only where its slice depth, rounded up as the count is, could
    raise the count so far."""
    count = MIN_INTERVALS
    for piece in pieces:
        if 1 << (max(piece.slice_depth(), 1) - 1).bit_length() > count:
            widest = piece.row_intervals()[0].shape[1]
            count = max(count, 1 << (widest - 1).bit_length())
    return count


def distinct_mask_arrays(
    plan: CPPlan, impl: str, head_dim: int, dtype: Any
) -> tuple[MaskArrays, np.ndarray]:
    """(stacked MaskArrays of the plan's distinct pieces, (R, T) index of each ring rank's
    piece at each kept step among them), in the shapes the executor passes its kernels (the
    same for every mask of a length). A 64-rank plan of a document mask has 4096 pieces and
    about 240 distinct ones: whoever needs one piece at a time (the CP predictor) indexes these
    instead of materialising every (rank, step) copy."""
    pieces, index = distinct_pieces(plan)
    distinct = [piece_arrays(piece, impl, head_dim, dtype) for piece in pieces]
    # stacked with an empty widest mask, so every mask of a length has the same shapes
    widest = empty_mask_arrays(distinct[0], _interval_count(pieces))
    stacked = stack_mask_arrays([*distinct, widest])
    return stacked, np.array(index).reshape(plan.ring_size, plan.num_steps)


def stacked_piece_arrays(
    piece: Mask, impl: str, head_dim: int, dtype: Any, intervals: int
) -> MaskArrays:
    """One piece's host MaskArrays in the shapes of a stack of a plan's pieces (full-width tile
    lists, `intervals` intervals per row: interval_count), built alone: the CP predictor runs
    a few of a plan's pieces and needs no stack of all of them."""
    return widen_mask_arrays(piece_arrays(piece, impl, head_dim, dtype), intervals)


def piece_tiles(impl: str, head_dim: int, dtype: Any) -> tuple[int, int] | None:
    """(block_q, block_k) of the tile lists `impl` walks, or None for an impl without them."""
    arrays = piece_arrays(_probe_mask(), impl, head_dim, dtype)
    return None if arrays.kv is None else (arrays.block_q, arrays.block_k)


def ring_mask_arrays(plan: CPPlan, impl: str, head_dim: int, dtype: Any) -> MaskArrays:
    """(R, T, ...) host MaskArrays of every ring rank's piece at every kept step, in the shapes
    the executor passes its kernels; each distinct piece is built once."""
    stacked, index = distinct_mask_arrays(plan, impl, head_dim, dtype)
    return jax.tree.map(lambda x: x[index], stacked)


def bucket_multiple(shard_len: int, multiple: int) -> int:
    """The pad multiple (for executor_plan) that rounds a ring shard of shard_len tokens, a
    multiple of `multiple` (the plan's own: tiles and Ulysses size), up to shared lengths:
    `multiple` times the largest power of two within 1/SHARD_BUCKETS of the shard, so at most
    that many more tokens and 8-16 lengths per power of two. Padding for the zigzag and
    balanced layouts, which pad each rank's list at its end; a contiguous layout moves tokens."""
    return multiple << max((shard_len // (SHARD_BUCKETS * multiple)).bit_length() - 1, 0)


def shard_multiple(impl: str, head_dim: int, dtype: Any) -> int:
    """The multiple ring shards are padded to: whole kernel tiles of `impl`."""
    if impl == REFERENCE:
        return 1
    arrays = piece_arrays(_probe_mask(), impl, head_dim, dtype)
    return math.lcm(arrays.block_q, arrays.block_k)


@cache
def _probe_mask() -> Mask:
    """A one-token mask, to ask an impl for its tile sizes."""
    return from_slices([[0, 1]], [[0, 1]], [0], 1, 1)


@jax.tree_util.register_pytree_node_class
class CPExecutor:
    """A plan bound to a mesh and an impl: dispatch, sharded attention, undispatch.

    A pytree (device arrays as leaves, the static config as aux data), so it can be passed into
    a jitted function: executors of different masks with equal shapes share one compilation.
    Called inside a trace it is not an argument of, it uses host copies (compiled in as
    constants), since a global array spanning other processes cannot be closed over.
    """

    def __init__(
        self,
        plan: CPPlan,
        devices: np.ndarray,
        *,
        impl: str,
        head_dim: int,
        dtype: Any,
        scale: float | None = None,
        return_lse: bool = False,
    ):
        self.plan = plan
        self.mesh = cp_mesh(devices, plan)
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        exchanges = plan_exchanges(plan)
        rounds = (None, None) if exchanges is None else tuple(e.rounds for e in exchanges)
        self.config = _Config(
            mesh=self.mesh,
            core=plan.core,
            steps=tuple((s.outer, s.inner) for s in plan.steps),
            ring_size=plan.ring_size,
            num_windows=plan.num_windows,
            ulysses_size=plan.ulysses_size,
            replicate=plan.kv_replication,
            impl=impl,
            scale=scale,
            return_lse=return_lse,
            padded_seqlen=plan.padded_seqlen,
            dispatch_rounds=rounds[0],
            undispatch_rounds=rounds[1],
        )
        self.token_sharding = NamedSharding(self.mesh, self.config.tokens)
        self._host = (
            self._host_arrays(impl, head_dim, dtype),
            plan.order().astype(np.int32),
            plan.inverse().astype(np.int32),
            None if exchanges is None else tuple(_tables(e) for e in exchanges),
        )
        rank_sharded = NamedSharding(self.mesh, P(self.mesh.axis_names))
        replicated = NamedSharding(self.mesh, P())
        self.arrays = jax.tree.map(lambda x: _global_array(x, rank_sharded), self._host[0])
        self.order = _global_array(self._host[1], replicated)
        self.inverse = _global_array(self._host[2], replicated)
        self.tables = jax.tree.map(lambda x: _global_array(x, rank_sharded), self._host[3])

    def tree_flatten(self) -> tuple[tuple, _Config]:
        return (self.arrays, self.order, self.inverse, self.tables), self.config

    @classmethod
    def tree_unflatten(cls, config: _Config, leaves: tuple) -> CPExecutor:
        ex = cls.__new__(cls)
        ex.plan, ex.config, ex.mesh, ex._host = None, config, config.mesh, None
        ex.token_sharding = NamedSharding(config.mesh, config.tokens)
        ex.arrays, ex.order, ex.inverse, ex.tables = leaves
        return ex

    @property
    def splits_evenly(self) -> bool:
        """True when inputs may come sequence-sharded (S divisible by the devices): dispatch then
        moves only the tokens that change device, and outputs come back in that sharding."""
        return self.config.dispatch_rounds is not None

    def _host_arrays(self, impl: str, head_dim: int, dtype: Any) -> MaskArrays:
        """(N, T, ...) host MaskArrays: rank n's pieces for every kept step."""
        plan = self.plan
        per_ring = ring_mask_arrays(plan, impl, head_dim, dtype)
        ranks = np.array([plan.ring_rank(n) for n in range(plan.world_size)])
        return jax.tree.map(lambda x: x[ranks], per_ring)

    def _leaves(self, *xs: jax.Array) -> tuple:
        """(arrays, order, inverse, tables): host copies when called inside a foreign trace."""
        if self._host is not None and any(isinstance(x, jax.core.Tracer) for x in xs):
            return self._host
        return self.arrays, self.order, self.inverse, self.tables

    @property
    def padded_seqlen(self) -> int:
        """S_pad: the length of dispatched arrays (S plus the layout's padding tokens)."""
        return self.config.padded_seqlen

    def dispatch(self, x: jax.Array) -> jax.Array:
        """(B, S, ...) in global order -> (B, S_pad, ...) in rank order, sharded on tokens: q, k,
        v (B, S, H, D), or per-token data such as token ids (B, S); padding tokens are zeros."""
        _, order, _, tables = self._leaves(x)
        return _dispatch_jit(x, order, tables, self.config)

    def undispatch(self, y: jax.Array) -> jax.Array:
        """(B, S_pad, ...) in rank order -> (B, S, ...) in global order (padding dropped)."""
        _, _, inverse, tables = self._leaves(y)
        return _undispatch_jit(y, inverse, tables, self.config, 1)

    def undispatch_lse(self, lse: jax.Array) -> jax.Array:
        """(B, H, S_pad) in rank order -> (B, H, S) in global order."""
        _, _, inverse, tables = self._leaves(lse)
        return _undispatch_jit(lse, inverse, tables, self.config, 2)

    def sharded(self, q: jax.Array, k: jax.Array, v: jax.Array):
        """Attention on dispatched arrays: out (and lse) stay in rank order, sharded."""
        arrays, _, inverse, _ = self._leaves(q, k, v)
        return _run_sharded(q, k, v, arrays, inverse, self.config)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array):
        """Attention on global arrays in global token order (differentiable)."""
        arrays, order, inverse, tables = self._leaves(q, k, v)
        return _run_global(q, k, v, order, inverse, arrays, tables, self.config)


def _tables(ex: Exchange) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """An exchange's index tables, each (N, ...) with rank n's row on device n."""
    return ex.send, ex.gather


@partial(jax.jit, static_argnames=("cfg",))
def _dispatch_jit(x, order, tables, cfg: _Config):
    return _dispatch(x, order, cfg, tables)


@partial(jax.jit, static_argnames=("cfg", "axis"))
def _undispatch_jit(y, inverse, tables, cfg: _Config, axis: int):
    return _undispatch(y, inverse, cfg, tables, axis)


def executor_plan(
    mask: Mask,
    world_size: int,
    strategy: str,
    layout: str = "zigzag",
    ulysses_size: int | None = None,
    *,
    impl: str,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    dtype: Any,
    num_windows: int | None = None,
    inner_axis: str = ULYSSES,
    pad_multiple: int | None = None,
    like: CPPlan | None = None,
) -> CPPlan:
    """The plan an executor of `impl` runs on `world_size` devices: ring shards padded to whole
    kernel tiles unless pad_multiple says otherwise (bucket_multiple: to shared lengths).
    like: the plan of the same mask and settings under another pad_multiple, whose pieces
    make_plan takes where only the padding differs (make_plan's like)."""
    if pad_multiple is None:
        pad_multiple = shard_multiple(impl, head_dim, dtype)
    return make_plan(
        mask,
        world_size,
        strategy,
        layout,
        ulysses_size,
        num_windows=num_windows,
        inner_axis=inner_axis,
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        head_dim=head_dim,
        pad_multiple=pad_multiple,
        like=like,
    )


def build(
    mask: Mask,
    *,
    mesh: Mesh,
    strategy: str,
    layout: str = "zigzag",
    axis: str = "cp",
    ulysses_size: int | None = None,
    impl: str | None = None,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    dtype: Any = jnp.float32,
    scale: float | None = None,
    return_lse: bool = False,
    num_windows: int | None = None,
    inner_axis: str = ULYSSES,
    pad_multiple: int | None = None,
) -> CPExecutor:
    """Plan `strategy` for `mask` on `mesh` and bind it (for callers holding dispatched shards)."""
    impl = resolve_impl(impl)
    devices, mesh_u, mesh_inner = _mesh_factors(mesh, axis)
    if mesh_u is not None:
        if ulysses_size not in (None, mesh_u):
            raise ValueError(
                f"ulysses_size={ulysses_size} contradicts the mesh's ulysses axis {mesh_u}"
            )
        ulysses_size, inner_axis = mesh_u, mesh_inner
        if strategy in STRATEGY and STRATEGY[strategy].ulysses == NO_ULYSSES and mesh_u == 1:
            ulysses_size = None
    plan = executor_plan(
        mask,
        len(devices),
        strategy,
        layout,
        ulysses_size,
        impl=impl,
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        head_dim=head_dim,
        dtype=dtype,
        num_windows=num_windows,
        inner_axis=inner_axis,
        pad_multiple=pad_multiple,
    )
    return CPExecutor(
        plan,
        devices,
        impl=impl,
        head_dim=head_dim,
        dtype=dtype,
        scale=scale,
        return_lse=return_lse,
    )


_EXECUTORS = MaskCache(size=_CACHE_SIZE)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: Mask,
    *,
    mesh: Mesh,
    strategy: str,
    layout: str = "zigzag",
    axis: str = "cp",
    ulysses_size: int | None = None,
    impl: str | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    num_windows: int | None = None,
    inner_axis: str = ULYSSES,
):
    """Context-parallel attention: q (B,S,Hq,D), k/v (B,S,Hkv,D) global, in global token order.

    Returns out (B,S,Hq,D) [and lse (B,Hq,S) float32 with return_lse]; differentiable. The plan
    and its device arrays are cached per (mask object, mesh, settings, shapes).
    """
    check_attention_shapes(q.shape, k.shape, v.shape, mask)
    key = (
        mesh,
        strategy,
        layout,
        axis,
        ulysses_size,
        impl,
        scale,
        return_lse,
        num_windows,
        inner_axis,
        q.shape[2],
        k.shape[2],
        q.shape[3],
        jnp.dtype(q.dtype),
    )

    def executor() -> CPExecutor:
        return build(
            mask,
            mesh=mesh,
            strategy=strategy,
            layout=layout,
            axis=axis,
            ulysses_size=ulysses_size,
            impl=impl,
            num_heads_q=q.shape[2],
            num_heads_kv=k.shape[2],
            head_dim=q.shape[3],
            dtype=q.dtype,
            scale=scale,
            return_lse=return_lse,
            num_windows=num_windows,
            inner_axis=inner_axis,
        )

    return _EXECUTORS.get(mask, key, executor)(q, k, v)
