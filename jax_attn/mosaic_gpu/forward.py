"""Warp-specialised Hopper forward kernel (Pallas Mosaic GPU) over a block-sparse mask.

One CTA owns 2 x 64 query rows of one (batch, q head). Warpgroup 2 is the producer: it walks
the CTA's compacted list of non-empty key tiles and TMA-loads each K and V tile into a ring of
shared-memory stages. Warpgroups 0 and 1 are consumers, each owning 64 of the rows: per tile,
S = Q K^T by wgmma, in-register masking from the per-row key intervals on partial tiles only,
online softmax in fp32 with exp2 (scale folded in log2 units), then O += P V by wgmma. The two
consumers take turns on the tensor cores (a ping-pong barrier), so one's softmax overlaps the
other's matmuls. Output and LSE go back through shared memory by TMA stores.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..kernel_inputs import LN2, LOG2E
from .config import CONSUMER_WARPGROUPS, PRODUCER, KernelConfig, grid_axes
from .ws_ring import take_turn, take_turns

HOPPER_SMS = 132  # H100/H200 SXM: persistent CTAs when lowering without a GPU attached
INTERPRET_CTAS = 5  # persistent CTAs under the interpreter: several items each, unevenly
COST_BUCKETS = 32  # bands of key-tile count in the persistent deal (deal_items)
WALK_RUN = 4  # q tiles dealt as one run by deal_by_walk_start (at most; sharing a walk start)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one launch (padded lengths, heads, tiles)."""

    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    intervals: int
    config: KernelConfig
    in_place_pv: bool = False  # O += P V straight into O's registers (GPU lowering only)
    overlap: bool = False  # S(n + 1) issued before the softmax of step n (KernelConfig.fwd_overlap)
    ctas: int = 0  # persistent CTAs walking the work items in turn (0: one CTA per item)

    @property
    def persistent(self) -> bool:
        return self.ctas > 0

    @property
    def num_items(self) -> int:
        """(q tile, q head, batch) work items: the CTAs of the non-persistent grid."""
        return self.num_q_tiles * self.heads_q * self.batch

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def num_q_tiles(self) -> int:
        return self.seq_q // self.config.mask_block_q

    @property
    def num_k_tiles(self) -> int:
        """Key tiles of the mask arrays (also walk_starts' index for a q tile seeing none)."""
        return -(-self.seq_k // self.config.tiles[1])


def _smem_transforms() -> tuple[Any, ...]:
    """128-byte swizzled (8, 64) tiles: the layout wgmma reads half-precision operands in."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _row_layout(x: jax.Array) -> jax.Array:
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def _tile_layout(x: jax.Array) -> jax.Array:
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def _rows(x: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """A per-row vector broadcast along the columns of a (rows, cols) tile."""
    return lax.broadcast_in_dim(x, shape, [0])


def _mask_scores(s: jax.Array, bounds: list[tuple[jax.Array, jax.Array]], start: Any) -> jax.Array:
    """s where key start + j lies in one of the row's [lo, hi) intervals, else -inf.

    Built from compares and selects only (no boolean and/or), the cheapest form in registers.
    """
    cols = _tile_layout(lax.broadcasted_iota(jnp.int32, s.shape, 1)) + start
    hidden = jnp.full(s.shape, -jnp.inf, jnp.float32)
    out = hidden
    for lo, hi in bounds:
        inside = jnp.where(cols < _rows(hi, s.shape), s, out)
        out = jnp.where(cols >= _rows(lo, s.shape), inside, out)
    return out


def _persistent_ctas(interpret: Any) -> int:
    """One persistent CTA per SM of the GPU."""
    if interpret is not None:
        return INTERPRET_CTAS
    try:
        return jax.local_devices(backend="gpu")[0].core_count
    except RuntimeError:
        return HOPPER_SMS


def deal_items(geo: Geometry, count: jax.Array, first: jax.Array | None = None) -> jax.Array:
    """(3, items) int32: the persistent walk's (q tile, q head, batch) items in the order they
    are dealt. Items come in COST_BUCKETS bands of key-tile count, costliest first, so dealt in
    snake rows they stay close to longest-first list scheduling; inside a band, one K/V head's
    items (its batch, its group of q heads) come together, q tiles by decreasing count, so the
    CTAs resident at once share that head's K/V tiles in L2. With `first` (each q tile's first
    key tile, KernelConfig.deal_by_walk_start) runs of up to WALK_RUN neighbouring q tiles
    starting their walks at one key tile (a document's) are banded by their longest walk and
    dealt together, sharing that document's K/V; longer runs cost balance (the snake rows'
    costs no longer fall monotonically)."""
    tiles, group = geo.num_q_tiles, geo.group
    most = jnp.maximum(jnp.max(count), 1)
    if first is None:
        cost, by_rank = count, jnp.argsort(-count, stable=True)
    else:
        runs = -(-tiles // WALK_RUN)
        run = first * runs + jnp.arange(tiles) // WALK_RUN
        segments = (geo.num_k_tiles + 1) * runs  # walk starts and walk_starts' none
        cost = jax.ops.segment_max(count, run, num_segments=segments)[run]
        by_rank = jnp.lexsort((-count, run, -cost))
    band = jnp.minimum((most - cost) * COST_BUCKETS // most, COST_BUCKETS - 1)
    rank = jnp.argsort(by_rank, stable=True)
    tile, section, member = jnp.meshgrid(
        jnp.arange(tiles), jnp.arange(geo.batch * geo.heads_kv), jnp.arange(group), indexing="ij"
    )
    sections = geo.batch * geo.heads_kv
    key = ((band[tile] * sections + section) * tiles + rank[tile]) * group + member
    order = jnp.argsort(key.ravel())
    head = lax.rem(section, geo.heads_kv) * group + member
    items = jnp.stack([tile.ravel(), head.ravel(), lax.div(section, geo.heads_kv).ravel()])
    return items[:, order].astype(jnp.int32)


def walk_starts(geo: Geometry, index: jax.Array, count: jax.Array) -> jax.Array:
    """Each q tile's first key tile (its walk's smallest index), num_k_tiles where it walks
    none."""
    none = geo.num_k_tiles
    listed = jnp.arange(index.shape[-1]) < count[:, None]
    return jnp.min(jnp.where(listed, index, none), axis=1, initial=none)


def _item(items_ref: Any, flat: jax.Array, rows: int = 3) -> tuple[jax.Array, ...]:
    """(q tile, q head, batch) of dealt item `flat` (deal_items), then with rows=5 its
    key-tile count and partial count (item_table)."""
    return tuple(items_ref[row, flat] for row in range(rows))


def item_table(items: jax.Array, count: jax.Array, n_partial: jax.Array) -> jax.Array:
    """(5, items) int32: the dealt items (deal_items) with each one's q tile's key-tile count
    and partial count beside it, so the kernel reads an item's walk without a second,
    dependent global load (KernelConfig.early_scalar_loads)."""
    tiles = items[0]
    return jnp.concatenate([items, jnp.stack([count[tiles], n_partial[tiles]])]).astype(jnp.int32)


def _snake(geo: Geometry, cta: jax.Array, local: Any) -> jax.Array:
    """Work item of persistent CTA `cta`'s local step `local`: row `local` of the item list in
    rows of `ctas`, walked left to right on even rows and right to left on odd ones."""
    column = jnp.where(lax.rem(local, 2) == 0, cta, geo.ctas - 1 - cta)
    return local * geo.ctas + column


def _local_items(geo: Geometry, cta: jax.Array) -> jax.Array:
    """How many work items persistent CTA `cta` runs: one per full row, and one of the partial
    last row if its column there is inside it."""
    rows, tail = divmod(geo.num_items, geo.ctas)
    return rows + (_snake(geo, cta, rows) - rows * geo.ctas < tail).astype(jnp.int32)


def _kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    bounds_ref: Any,
    index_ref: Any,
    n_partial_ref: Any,
    count_ref: Any,
    *refs: Any,
    geo: Geometry,
    scale: float,
) -> None:
    """refs: the dealt items (deal_items; persistent grid only), out, lse."""
    items_ref, out_ref, lse_ref = refs if geo.persistent else (None, *refs)
    cfg = geo.config
    bq, bk, d, stages = cfg.block_q, cfg.block_k, geo.head_dim, cfg.max_concurrent_steps
    dtype = q_ref.dtype
    buffers = 2 if geo.persistent else 1

    def body(smem: tuple, ready: tuple, free: tuple, sched: Any) -> None:
        q_smem, k_smem, v_smem, bounds_smem, lse_smem = smem
        k_ready, v_ready, q_ready, bounds_ready = ready
        k_free, v_free = free
        wg = lax.axis_index("wg")

        def buffer(ref: Any, b: Any) -> Any:
            """This consumer's slot of a per-item buffer (two alternate when persistent)."""
            return ref.at[b, wg] if geo.persistent else ref.at[wg]

        def arrival(barriers: Any, b: Any) -> Any:
            return barriers.at[b * CONSUMER_WARPGROUPS + wg] if geo.persistent else barriers.at[wg]

        if geo.persistent:
            cta = lax.axis_index("sm")
            local_items = _local_items(geo, cta)
            item_rows = 5 if cfg.early_scalar_loads else 3  # the item table's rows (item_table)
        else:
            tile = geo.num_q_tiles - 1 - lax.axis_index("q")  # longest (last) q tiles first
            first = (tile, lax.axis_index("heads"), lax.axis_index("batch"))

        pingpong = functools.partial(take_turn, sched)

        @pl.when(wg < PRODUCER)
        def _consumer() -> None:
            plgpu.set_max_registers(cfg.consumer_registers, action="increase")
            qk_scale = scale * LOG2E
            raw_max = cfg.raw_score_max and qk_scale > 0

            def load_item(item: tuple, b: Any) -> None:
                """TMA-load an item's Q rows and row bounds into buffer b."""
                tile, head, batch = item
                row0 = tile * cfg.mask_block_q + wg * bq
                plgpu.copy_gmem_to_smem(
                    q_ref.at[batch, pl.ds(row0, bq), head], buffer(q_smem, b), arrival(q_ready, b)
                )
                plgpu.copy_gmem_to_smem(
                    bounds_ref.at[tile * CONSUMER_WARPGROUPS + wg],
                    buffer(bounds_smem, b),
                    arrival(bounds_ready, b),
                )

            def run_item(
                item: tuple,
                b: Any,
                base: Any,
                turns: bool,
                after_partial: Callable[[], None] | None = None,
            ) -> None:
                """Attention of one item's rows from buffer b; its key tiles are ring steps
                base, base + 1, ... (None: 0, 1, ...). turns: offset the two consumers' turns
                on the tensor cores around this item's walk (else the caller does, once).
                after_partial: called once, between the item's partial and full steps (at its
                start where it has no partial tile), with no matmul of this warpgroup in
                flight."""
                tile, head, batch = item[:3]
                count, n_partial = item[3:] if len(item) > 3 else (None, None)
                count = count_ref[tile] if count is None else count
                q_tile = buffer(q_smem, b)
                plgpu.barrier_wait(arrival(bounds_ready, b))
                rows_smem = buffer(bounds_smem, b)
                bounds = [
                    (_row_layout(rows_smem[2 * r]), _row_layout(rows_smem[2 * r + 1]))
                    for r in range(geo.intervals)
                ]
                plgpu.barrier_wait(arrival(q_ready, b))

                def ring(n: jax.Array) -> jax.Array:
                    return lax.rem(n if base is None else n + base, stages)

                def key_start(n: jax.Array) -> jax.Array:
                    """First key of step n's tile (a global load)."""
                    return index_ref[tile, n] * bk

                def softmax(
                    s: jax.Array, carry: tuple, n: jax.Array, masked: bool, start: Any = None
                ) -> tuple:
                    """Scaled, masked scores s of step n (its tile's first key `start`, loaded
                    here if None) into (O rescaled, m, l, P in the input dtype)."""
                    acc, m_prev, l_prev = carry
                    if not raw_max:
                        s = s * qk_scale
                    if masked:
                        s = _mask_scores(s, bounds, key_start(n) if start is None else start)
                    row_max = s.max(axis=1)
                    m_next = jnp.maximum(m_prev, row_max * qk_scale if raw_max else row_max)
                    m_use = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
                    alpha = jnp.exp2(m_prev - m_use)
                    p = jnp.exp2((s * qk_scale if raw_max else s) - _rows(m_use, s.shape))
                    l_next = l_prev * alpha + p.sum(axis=1)
                    acc = acc * _rows(alpha, acc.shape)
                    p16 = p.astype(dtype)
                    return lax.optimization_barrier((acc, m_next, l_next, p16))

                def pv(acc: jax.Array, p16: jax.Array, slot: jax.Array) -> jax.Array:
                    """O + P V, once this warpgroup's turn on the tensor cores and V have
                    come."""
                    plgpu.barrier_arrive(sched)
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_wait(sched)
                    if geo.in_place_pv:
                        return pl.run_state(
                            lambda acc_ref: plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                        )(plgpu.ACC.init(acc))

                    def fresh(acc_ref: Any) -> jax.Array:
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                        return acc_ref[...]

                    return acc + pl.run_scoped(fresh, plgpu.ACC((bq, d), jnp.float32))

                def issue_qk(acc_ref: Any, slot: jax.Array) -> None:
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.wgmma(acc_ref, q_tile, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))

                def early_start(n: jax.Array, masked: bool) -> Any:
                    """Step n's first key loaded before its matmuls are issued, so the load's
                    latency hides under them (early_scalar_loads), else None."""
                    return key_start(n) if masked and cfg.early_scalar_loads else None

                def step(n: jax.Array, carry: tuple, masked: bool) -> tuple:
                    slot = ring(n)
                    start = early_start(n, masked)

                    def qk(acc_ref: Any) -> jax.Array:
                        issue_qk(acc_ref, slot)
                        pingpong()
                        return acc_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    acc, m_next, l_next, p16 = softmax(s, carry, n, masked, start)
                    acc = pv(acc, p16, slot)
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_next, l_next

                def overlapped_step(n: jax.Array, carry: tuple, masked: bool) -> tuple:
                    """step with S(n + 1) = Q K(n + 1)^T issued before the softmax of step n,
                    whose scores came in the carry, so the tensor cores work through the
                    softmax."""
                    *state, s = carry
                    slot, later = ring(n), ring(n + 1)
                    start = early_start(n, masked)

                    def body(acc_ref: Any) -> tuple:
                        pl.when(n + 1 < count)(lambda: issue_qk(acc_ref, later))
                        pingpong()
                        acc, m_next, l_next, p16 = softmax(s, tuple(state), n, masked, start)
                        acc = pv(acc, p16, slot)  # waits for every wgmma: S(n + 1) is done too
                        return acc, m_next, l_next, acc_ref[...]

                    out = pl.run_scoped(body, plgpu.ACC((bq, bk), jnp.float32))
                    plgpu.barrier_arrive(v_free.at[slot])
                    pl.when(n + 1 < count)(lambda: plgpu.barrier_arrive(k_free.at[later]))
                    return out

                carry = (
                    _tile_layout(jnp.zeros((bq, d), jnp.float32)),
                    _row_layout(jnp.full((bq,), -jnp.inf, jnp.float32)),
                    _row_layout(jnp.zeros((bq,), jnp.float32)),
                )
                n_partial = n_partial_ref[tile] if n_partial is None else n_partial

                def steps(_: Any, carry: tuple = carry) -> tuple:
                    walk = step
                    if geo.overlap:

                        def first_qk(acc_ref: Any) -> jax.Array:
                            pl.when(count > 0)(lambda: issue_qk(acc_ref, ring(jnp.int32(0))))
                            return acc_ref[...]

                        s0 = pl.run_scoped(first_qk, plgpu.ACC((bq, bk), jnp.float32))

                        @pl.when(count > 0)
                        def _release_first() -> None:
                            plgpu.barrier_arrive(k_free.at[ring(jnp.int32(0))])

                        carry, walk = (*carry, s0), overlapped_step
                    carry = lax.fori_loop(0, n_partial, functools.partial(walk, masked=True), carry)
                    if after_partial is not None:
                        after_partial()
                    return lax.fori_loop(
                        n_partial, count, functools.partial(walk, masked=False), carry
                    )

                carry = take_turns(sched if turns else None, wg, steps)
                acc, m, denom = carry[:3]
                empty = denom == 0.0
                denom = jnp.where(empty, 1.0, denom)
                out = acc * _rows(1.0 / denom, acc.shape)
                q_tile[...] = out.astype(dtype)  # Q is read: its buffer stages O for the store
                lse_tile = buffer(lse_smem, b)
                lse_tile[...] = jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(denom))
                plgpu.commit_smem()
                row0 = tile * cfg.mask_block_q + wg * bq
                plgpu.copy_smem_to_gmem(q_tile, out_ref.at[batch, pl.ds(row0, bq), head])
                plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[batch, head, pl.ds(row0, bq)])

            if geo.persistent:
                first_row = _item(items_ref, _snake(geo, cta, 0), rows=item_rows)
                load_item(first_row[:3], 0)

                def persistent_item(local: jax.Array, carry: tuple) -> tuple:
                    """Item `local` of this CTA's walk; carry: its first ring step and, with
                    early_scalar_loads, its table row, loaded one item ahead."""
                    base, item = carry
                    b = lax.rem(local, 2)
                    following = ()
                    if cfg.early_scalar_loads:
                        ahead = _snake(geo, cta, jnp.minimum(local + 1, local_items - 1))
                        following = _item(items_ref, ahead, rows=5)

                    def prefetch() -> None:
                        @pl.when(local + 1 < local_items)
                        def _next() -> None:
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last item's O, LSE
                            if cfg.early_scalar_loads:
                                nxt = following[:3]
                            else:
                                nxt = _item(items_ref, _snake(geo, cta, local + 1))
                            load_item(nxt, 1 - b)

                    if not cfg.late_q_prefetch:
                        prefetch()
                    if not cfg.early_scalar_loads:  # else the carry holds its row
                        item = _item(items_ref, _snake(geo, cta, local))
                    after_partial = prefetch if cfg.late_q_prefetch else None
                    run_item(item, b, base, turns=False, after_partial=after_partial)
                    count = item[3] if cfg.early_scalar_loads else count_ref[item[0]]
                    return base + count, following

                take_turns(
                    sched,
                    wg,
                    lambda _: lax.fori_loop(
                        0,
                        local_items,
                        persistent_item,
                        (jnp.int32(0), first_row if cfg.early_scalar_loads else ()),
                    ),
                )
            else:
                load_item(first, 0)
                run_item(first, 0, None, turns=True)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == PRODUCER)
        def _producer() -> None:
            plgpu.set_max_registers(cfg.producer_registers, action="decrease")

            def produce(item: tuple, base: Any) -> Any:
                """Load an item's K and V tiles into ring steps base, base + 1, ...; the next
                base."""
                tile, head, batch = item[:3]
                kv_head = lax.div(head, jnp.int32(geo.group))
                count = item[3] if len(item) > 3 else count_ref[tile]

                def issue(n: jax.Array, _: Any) -> None:
                    step = n if base is None else n + base
                    slot = lax.rem(step, stages)
                    rows = (batch, pl.ds(index_ref[tile, n] * bk, bk), kv_head)

                    @pl.when(step >= stages)
                    def _() -> None:
                        plgpu.barrier_wait(k_free.at[slot])

                    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])

                    @pl.when(step >= stages)
                    def _() -> None:
                        plgpu.barrier_wait(v_free.at[slot])

                    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

                lax.fori_loop(0, count, issue, None)
                return count if base is None else count + base

            def drain(n: jax.Array, _: Any) -> None:
                slot = lax.rem(n, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            if geo.persistent:
                steps = lax.fori_loop(
                    0,
                    local_items,
                    lambda local, base: produce(
                        _item(items_ref, _snake(geo, cta, local), rows=item_rows), base
                    ),
                    jnp.int32(0),
                )
            else:
                steps = produce(first, None)
            # Wait for the consumers to release the last stages, so that every phase of the
            # release barriers is observed before they are freed.
            lax.fori_loop(jnp.maximum(steps - stages, 0), steps, drain, None)

    transforms = _smem_transforms()
    per_item = (buffers, CONSUMER_WARPGROUPS) if geo.persistent else (CONSUMER_WARPGROUPS,)
    pl.run_scoped(
        lambda *refs: body(*refs),
        (
            plgpu.SMEM((*per_item, bq, d), dtype, transforms=transforms),
            plgpu.SMEM((stages, bk, d), dtype, transforms=transforms),
            plgpu.SMEM((stages, bk, d), dtype, transforms=transforms),
            plgpu.SMEM((*per_item, 2 * geo.intervals, bq), jnp.int32),
            plgpu.SMEM((*per_item, bq), jnp.float32),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=buffers * CONSUMER_WARPGROUPS),
            plgpu.Barrier(num_barriers=buffers * CONSUMER_WARPGROUPS),
        ),
        (
            plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS, num_barriers=stages),
        ),
        plgpu.Barrier(num_arrivals=CONSUMER_WARPGROUPS),
        collective_axes="wg",
    )


def _geometry(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], intervals: int, config: KernelConfig
) -> Geometry:
    """The static sizes of padded q (B,Sq,Hq,D) and k (B,Sk,Hkv,D) shapes, before forward
    chooses the persistent CTAs and the P V form for the GPU or the interpreter."""
    batch, seq_q, heads_q, head_dim = q_shape
    return Geometry(
        batch=batch,
        seq_q=seq_q,
        seq_k=k_shape[1],
        heads_q=heads_q,
        heads_kv=k_shape[2],
        head_dim=head_dim,
        intervals=intervals,
        config=config,
        overlap=config.fwd_overlap,
    )


def dealt_items(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    walk: tuple[jax.Array, jax.Array, jax.Array],
    *,
    intervals: int,
    config: KernelConfig,
) -> jax.Array | None:
    """The persistent forward's items (deal_items, with item_table's rows under
    early_scalar_loads) for padded q and k shapes, rows of `intervals` key intervals and the q
    tiles' walk (index, n_partial, count); None without config.persistent_fwd. Built once per
    mask and shape (mask_operands), not per call."""
    if not config.persistent_fwd:
        return None
    geo = _geometry(q_shape, k_shape, intervals, config)
    index, n_partial, count = walk
    if count.shape != (geo.num_q_tiles,):
        raise ValueError(
            f"count has shape {count.shape}; expected ({geo.num_q_tiles},), one per q tile"
        )
    first = walk_starts(geo, index, count) if config.deal_by_walk_start else None
    items = deal_items(geo, count, first)
    return item_table(items, count, n_partial) if config.early_scalar_loads else items


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bounds: jax.Array,
    index: jax.Array,
    n_partial: jax.Array,
    count: jax.Array,
    *,
    scale: float,
    config: KernelConfig,
    interpret: Any = None,
    items: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Padded q (B,Sq,Hq,D), k/v (B,Sk,Hkv,D) -> out (B,Sq,Hq,D), lse (B,Hq,Sq) float32.

    bounds: (Sq/64, 2K, 64) int32, rows' [lo, hi) key intervals per 64-row slice (lo, hi
    interleaved); index/n_partial/count: the q tiles' key-tile lists, partial tiles first.
    interpret: None for the GPU, or InterpretGPUParams to run on CPU (which runs the
    fresh-accumulator P V whatever config.in_place_pv says: run_state is not interpretable).
    items: the persistent forward's dealt items (dealt_items; the persistent forward only).
    """
    geo = dataclasses.replace(
        _geometry(q.shape, k.shape, bounds.shape[1] // 2, config),
        in_place_pv=config.in_place_pv and not interpret,
    )
    if config.persistent_fwd:
        geo = dataclasses.replace(geo, ctas=min(geo.num_items, _persistent_ctas(interpret)))
    kernel = plgpu.kernel(
        functools.partial(_kernel, geo=geo, scale=float(scale)),
        out_type=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((geo.batch, geo.heads_q, geo.seq_q), jnp.float32),
        ),
        **(
            dict(grid=(geo.ctas,), grid_names=("sm",))
            if geo.persistent
            else grid_axes(
                ("q", geo.num_q_tiles), geo.heads_q, geo.batch, tiles_fastest=config.tiles_fastest
            )
        ),
        num_threads=CONSUMER_WARPGROUPS + 1,
        thread_name="wg",
        kernel_name="mosaic_flash_fwd",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    if not geo.persistent:
        return kernel(q, k, v, bounds, index, n_partial, count)
    if items is None:
        raise ValueError("the persistent forward walks dealt items: pass items=dealt_items(...)")
    return kernel(q, k, v, bounds, index, n_partial, count, items)
