"""The flash-attention kernels in the Triton language: forward, dK/dV and dQ, block-sparse.

Layout: q/out/dout (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), all contiguous; lse/delta (B, Hq, Sq)
fp32. Query head h reads KV head h // GROUP (GQA without repeating K/V). D is padded to the
power of two BLOCK_D inside (masked loads); sequence ends are masked likewise, so no length
needs padding on the host.

Each program walks a compacted tile list built on the host (triton_attn.launch): a forward or dQ
program the non-empty k tiles of its q tile, a dK/dV program the non-empty q tiles of its k tile,
for every query head of its GQA group in turn (so it owns its dK/dV tile: no atomics). The backward
is one launch whose first programs are dK/dV and the rest dQ, as FlexAttention's. A FULL tile is
used unmasked; a PARTIAL tile is masked from the per-row key intervals lo/hi (Sq, NUM_INTERVALS):
row i sees key j iff lo[i, r] <= j < hi[i, r] for some r. Edge tiles are always PARTIAL (launch.py
clears their full flag), which masks keys beyond Sk.

Softmax runs in base 2 (exp2) in fp32; the stored LSE is natural log, -inf on rows that see no
key (their output is 0). The backward takes delta = rowsum(out * dout) - dlse precomputed, so
it needs only the LSE and delta of the forward (a ring can pass merged statistics). delta has its
own kernel here, so both front ends sum each row in the same order: a framework's own reduction
(XLA's or torch's) sums in another order, and the dK and dQ programs then see other bits.

The kernel signatures put arrays and runtime scalars first, then the outputs, then constexprs,
which is the order jax_triton.triton_call passes them; the torch front end uses the same order.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; IEEE asks for full fp32 products (fp32 inputs, no TF32)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _below(idx, limit, ALWAYS: tl.constexpr):
    """idx < limit, or constant true when the launch knows it always holds (ALWAYS): the
    compiler then drops the predicates of the loads and stores it guards."""
    if ALWAYS:
        ok = tl.full(idx.shape, 1, tl.int1)
    else:
        ok = idx < limit
    return ok


@triton.jit
def _hit(lo_ptr, hi_ptr, row_ok, cols, r, KEYS_FIRST: tl.constexpr):
    """Whether key cols fall in interval r of query rows ((cols, rows) when KEYS_FIRST)."""
    lo = tl.load(lo_ptr + r, mask=row_ok, other=0)
    hi = tl.load(hi_ptr + r, mask=row_ok, other=0)
    if KEYS_FIRST:
        hit = (cols[:, None] >= lo[None, :]) & (cols[:, None] < hi[None, :])
    else:
        hit = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
    return hit


@triton.jit
def _visible(
    lo_ptr, hi_ptr, rows, row_ok, cols, NUM_INTERVALS: tl.constexpr, KEYS_FIRST: tl.constexpr
):
    """Visibility of (rows x cols) from the intervals, shaped (cols, rows) when KEYS_FIRST."""
    lo_rows = lo_ptr + rows * NUM_INTERVALS
    hi_rows = hi_ptr + rows * NUM_INTERVALS
    vis = _hit(lo_rows, hi_rows, row_ok, cols, 0, KEYS_FIRST)
    for r in tl.static_range(1, NUM_INTERVALS):
        vis = vis | _hit(lo_rows, hi_rows, row_ok, cols, r, KEYS_FIRST)
    return vis


@triton.jit
def _load_kv_tile(
    k_ptr,
    v_ptr,
    k_tile,
    kv_off,
    dim_ok,
    seqlen_k,
    k_row,
    BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """(key positions, K tile, V tile) of key tile k_tile; keys past seqlen_k load as zeros."""
    cols = k_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_mask = _below(cols, seqlen_k, EVEN_K)[:, None] & dim_ok[None, :]
    kv_start = k_tile.to(tl.int64) * BLOCK_N * k_row
    k = tl.load((k_ptr + kv_start) + kv_off, mask=kv_mask, other=0.0)
    v = tl.load((v_ptr + kv_start) + kv_off, mask=kv_mask, other=0.0)
    return cols, k, v


@triton.jit
def _div16(x, DIV16: tl.constexpr, BIT: tl.constexpr):
    """x, provably a multiple of 16 when bit BIT of DIV16 says the launch found it one (the
    rounding is exact then; tl.multiple_of has no effect on scalars)."""
    if (DIV16 >> BIT) & 1:
        x = (x >> 4) << 4
    return x


@triton.jit
def _sizes(seqlen_q, seqlen_k, heads_q, heads_kv, list_width, DIV16: tl.constexpr):
    """The runtime sizes with the launch's divisibility facts (launch.div16), so the compiler
    vectorises the same loads whichever front end launched the kernel."""
    return (
        _div16(seqlen_q, DIV16, 0),
        _div16(seqlen_k, DIV16, 1),
        _div16(heads_q, DIV16, 2),
        _div16(heads_kv, DIV16, 3),
        _div16(list_width, DIV16, 4),
    )


@triton.jit
def attn_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    lo_ptr,
    hi_ptr,
    kv_index_ptr,
    kv_count_ptr,
    kv_full_ptr,
    seqlen_q,
    seqlen_k,
    heads_q,
    heads_kv,
    list_width,
    scale,
    out_ptr,
    lse_ptr,
    GROUP: tl.constexpr,
    NUM_INTERVALS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
    DIV16: tl.constexpr,
    EVEN_Q: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """One (q tile, batch x query head): out tile and its LSE over the listed k tiles."""
    seqlen_q, seqlen_k, heads_q, heads_kv, list_width = _sizes(
        seqlen_q, seqlen_k, heads_q, heads_kv, list_width, DIV16
    )
    q_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads_q).to(tl.int64)
    h = bh % heads_q
    kvh = h // GROUP
    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = _below(rows, seqlen_q, EVEN_Q)
    dim_ok = _below(dims, HEAD_DIM, HEAD_DIM == BLOCK_D)
    q_row = heads_q * HEAD_DIM
    k_row = heads_kv * HEAD_DIM
    # Batch, head and tile starts go into the scalar pointers in int64 (long sequences stay
    # correct); the offset tensors hold only in-tile offsets, in int32 (fewer registers).
    q_start = (b * seqlen_q + q_tile * BLOCK_M) * q_row + h * HEAD_DIM
    q_ptr += q_start
    out_ptr += q_start
    kv_base = b * seqlen_k * k_row + kvh * HEAD_DIM
    k_ptr += kv_base
    v_ptr += kv_base
    lse_ptr += (b * heads_q + h) * seqlen_q
    q_off = tl.arange(0, BLOCK_M)[:, None] * q_row + dims[None, :]
    kv_off = tl.arange(0, BLOCK_N)[:, None] * k_row + dims[None, :]
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    count = tl.load(kv_count_ptr + q_tile)
    for n in range(0, count):
        k_tile = tl.load(kv_index_ptr + q_tile * list_width + n)
        full = tl.load(kv_full_ptr + q_tile * list_width + n)
        cols, k, v = _load_kv_tile(
            k_ptr, v_ptr, k_tile, kv_off, dim_ok, seqlen_k, k_row, BLOCK_N, EVEN_K
        )
        s = _dot(q, tl.trans(k), IEEE) * qk_scale
        if full == 0:
            vis = _visible(lo_ptr, hi_ptr, rows, row_ok, cols, NUM_INTERVALS, False)
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + rows, lse, mask=row_ok)


@triton.jit
def _dkdv_program(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    lo_ptr,
    hi_ptr,
    q_index_ptr,
    q_count_ptr,
    q_full_ptr,
    seqlen_q,
    seqlen_k,
    heads_q,
    heads_kv,
    list_width,
    scale,
    dk_ptr,
    dv_ptr,
    k_tile,
    bh,
    GROUP: tl.constexpr,
    NUM_INTERVALS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_Q: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """One (k tile, batch x KV head): dK and dV over the listed q tiles of every group head."""
    b = (bh // heads_kv).to(tl.int64)
    kvh = bh % heads_kv
    cols = k_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_ok = _below(cols, seqlen_k, EVEN_K)
    dim_ok = _below(dims, HEAD_DIM, HEAD_DIM == BLOCK_D)
    q_row = heads_q * HEAD_DIM
    k_row = heads_kv * HEAD_DIM
    # int64 batch/head/tile starts in the scalar pointers, int32 in-tile offset tensors.
    kv_start = (b * seqlen_k + k_tile * BLOCK_N) * k_row + kvh * HEAD_DIM
    k_ptr += kv_start
    v_ptr += kv_start
    dk_ptr += kv_start
    dv_ptr += kv_start
    kv_off = tl.arange(0, BLOCK_N)[:, None] * k_row + dims[None, :]
    q_off = tl.arange(0, BLOCK_M)[:, None] * q_row + dims[None, :]
    kv_mask = col_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    qk_scale = scale * LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    count = tl.load(q_count_ptr + k_tile)
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        q_head = b * seqlen_q * q_row + h * HEAD_DIM
        stat_head = (b * heads_q + h) * seqlen_q
        for n in range(0, count):
            q_tile = tl.load(q_index_ptr + k_tile * list_width + n)
            full = tl.load(q_full_ptr + k_tile * list_width + n)
            rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = _below(rows, seqlen_q, EVEN_Q)
            q_start = q_head + q_tile.to(tl.int64) * BLOCK_M * q_row
            q_mask = row_ok[:, None] & dim_ok[None, :]
            q = tl.load((q_ptr + q_start) + q_off, mask=q_mask, other=0.0)
            do = tl.load((do_ptr + q_start) + q_off, mask=q_mask, other=0.0)
            lse = tl.load((lse_ptr + stat_head) + rows, mask=row_ok, other=float("-inf"))
            delta = tl.load((delta_ptr + stat_head) + rows, mask=row_ok, other=0.0)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
            s_t = _dot(k, tl.trans(q), IEEE) * qk_scale
            p_t = tl.exp2(s_t - lse2[None, :])
            if full == 0:
                vis = _visible(lo_ptr, hi_ptr, rows, row_ok, cols, NUM_INTERVALS, True)
                p_t = tl.where(vis, p_t, 0.0)
            dv += _dot(p_t.to(do.dtype), do, IEEE)
            dp_t = _dot(v, tl.trans(do), IEEE)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, IEEE)
    tl.store(dk_ptr + kv_off, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_program(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    lo_ptr,
    hi_ptr,
    kv_index_ptr,
    kv_count_ptr,
    kv_full_ptr,
    seqlen_q,
    seqlen_k,
    heads_q,
    heads_kv,
    list_width,
    scale,
    dq_ptr,
    q_tile,
    bh,
    GROUP: tl.constexpr,
    NUM_INTERVALS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_Q: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """One (q tile, batch x query head): dQ over the listed k tiles."""
    b = (bh // heads_q).to(tl.int64)
    h = bh % heads_q
    kvh = h // GROUP
    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = _below(rows, seqlen_q, EVEN_Q)
    dim_ok = _below(dims, HEAD_DIM, HEAD_DIM == BLOCK_D)
    q_row = heads_q * HEAD_DIM
    k_row = heads_kv * HEAD_DIM
    # int64 batch/head/tile starts in the scalar pointers, int32 in-tile offset tensors.
    q_start = (b * seqlen_q + q_tile * BLOCK_M) * q_row + h * HEAD_DIM
    q_ptr += q_start
    do_ptr += q_start
    dq_ptr += q_start
    kv_base = b * seqlen_k * k_row + kvh * HEAD_DIM
    k_ptr += kv_base
    v_ptr += kv_base
    stat_head = (b * heads_q + h) * seqlen_q
    lse_ptr += stat_head
    delta_ptr += stat_head
    q_off = tl.arange(0, BLOCK_M)[:, None] * q_row + dims[None, :]
    kv_off = tl.arange(0, BLOCK_N)[:, None] * k_row + dims[None, :]
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=float("-inf"))
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    qk_scale = scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    count = tl.load(kv_count_ptr + q_tile)
    for n in range(0, count):
        k_tile = tl.load(kv_index_ptr + q_tile * list_width + n)
        full = tl.load(kv_full_ptr + q_tile * list_width + n)
        cols, k, v = _load_kv_tile(
            k_ptr, v_ptr, k_tile, kv_off, dim_ok, seqlen_k, k_row, BLOCK_N, EVEN_K
        )
        s = _dot(q, tl.trans(k), IEEE) * qk_scale
        p = tl.exp2(s - lse2[:, None])
        if full == 0:
            vis = _visible(lo_ptr, hi_ptr, rows, row_ok, cols, NUM_INTERVALS, False)
            p = tl.where(vis, p, 0.0)
        dp = _dot(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(dq_ptr + q_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def attn_bwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    lo_ptr,
    hi_ptr,
    q_index_ptr,
    q_count_ptr,
    q_full_ptr,
    kv_index_ptr,
    kv_count_ptr,
    kv_full_ptr,
    seqlen_q,
    seqlen_k,
    heads_q,
    heads_kv,
    dkdv_width,
    dq_width,
    dkdv_programs,
    scale,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    GROUP: tl.constexpr,
    NUM_INTERVALS: tl.constexpr,
    DKDV_BLOCK_M: tl.constexpr,
    DKDV_BLOCK_N: tl.constexpr,
    DQ_BLOCK_M: tl.constexpr,
    DQ_BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
    DIV16: tl.constexpr,
    EVEN_Q: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The backward in one launch: programs below dkdv_programs each own a (k tile, batch x KV
    head) dK/dV tile, the rest a (q tile, batch x query head) dQ tile. The dQ programs fill the
    SMs that the longest dK/dV lists (a question every answer reads, the first causal k tiles)
    would leave idle at the end of a dK/dV-only launch."""
    seqlen_q, seqlen_k, heads_q, heads_kv, dkdv_width = _sizes(
        seqlen_q, seqlen_k, heads_q, heads_kv, dkdv_width, DIV16
    )
    dq_width = _div16(dq_width, DIV16, 5)
    dkdv_programs = _div16(dkdv_programs, DIV16, 6)
    pid = tl.program_id(0)
    if pid < dkdv_programs:
        k_tiles = tl.cdiv(seqlen_k, DKDV_BLOCK_N)
        _dkdv_program(
            q_ptr,
            k_ptr,
            v_ptr,
            do_ptr,
            lse_ptr,
            delta_ptr,
            lo_ptr,
            hi_ptr,
            q_index_ptr,
            q_count_ptr,
            q_full_ptr,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            dkdv_width,
            scale,
            dk_ptr,
            dv_ptr,
            pid % k_tiles,
            pid // k_tiles,
            GROUP,
            NUM_INTERVALS,
            DKDV_BLOCK_M,
            DKDV_BLOCK_N,
            BLOCK_D,
            HEAD_DIM,
            IEEE,
            EVEN_Q,
            EVEN_K,
        )
    else:
        q_tiles = tl.cdiv(seqlen_q, DQ_BLOCK_M)
        p = pid - dkdv_programs
        _dq_program(
            q_ptr,
            k_ptr,
            v_ptr,
            do_ptr,
            lse_ptr,
            delta_ptr,
            lo_ptr,
            hi_ptr,
            kv_index_ptr,
            kv_count_ptr,
            kv_full_ptr,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            dq_width,
            scale,
            dq_ptr,
            p % q_tiles,
            p // q_tiles,
            GROUP,
            NUM_INTERVALS,
            DQ_BLOCK_M,
            DQ_BLOCK_N,
            BLOCK_D,
            HEAD_DIM,
            IEEE,
            EVEN_Q,
            EVEN_K,
        )


@triton.jit
def attn_bwd_delta_kernel(
    out_ptr,
    do_ptr,
    dlse_ptr,
    seqlen_q,
    heads_q,
    delta_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIV16: tl.constexpr,
):
    """One (q tile, batch x query head): delta = rowsum(out * dout) - dlse in fp32."""
    seqlen_q = _div16(seqlen_q, DIV16, 0)
    heads_q = _div16(heads_q, DIV16, 1)
    q_tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // heads_q).to(tl.int64)
    h = bh % heads_q
    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seqlen_q
    q_row = heads_q * HEAD_DIM
    start = (b * seqlen_q + q_tile * BLOCK_M) * q_row + h * HEAD_DIM
    off = tl.arange(0, BLOCK_M)[:, None] * q_row + dims[None, :]
    tile_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    out = tl.load((out_ptr + start) + off, mask=tile_mask, other=0.0).to(tl.float32)
    do = tl.load((do_ptr + start) + off, mask=tile_mask, other=0.0).to(tl.float32)
    stat = (b * heads_q + h) * seqlen_q
    dlse = tl.load((dlse_ptr + stat) + rows, mask=row_ok, other=0.0)
    tl.store((delta_ptr + stat) + rows, tl.sum(out * do, 1) - dlse, mask=row_ok)


def interpreted() -> bool:
    """Whether these kernels run in Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return type(attn_fwd_kernel).__name__ == "InterpretedFunction"
