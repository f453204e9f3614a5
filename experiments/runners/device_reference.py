"""Exact float64 attention rows computed on the device: the query rows' out and dq over every key
they see, the keys walked in chunks under jax.enable_x64, so only the rows' results leave the
device, not the keys (up to millions per head). The CP predictor's JAX ranks
(JaxRanks.reference_rows) and the JAX runner's row checks (jax_runner.row_reference) use it;
checks.rows_reference is the host's."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np

from experiments.runners import checks

REFERENCE_CHUNK = 1 << 16  # keys per pass of the float64 row reference (_passes)


def reference_chunk(keys: int, platform: str) -> int:
    """Keys per pass of the row reference over `keys` keys: REFERENCE_CHUNK on a GPU whatever
    the keys, so a preset's checks share their passes' few programs (run 10 on the H200
    compiled 38 of them, 0.46 s each, one per chunk and K/V head count) and pay float64 work
    on padding instead (milliseconds there); elsewhere the next power of two up to it, since a
    CPU's float64 work on a padded chunk costs more than a compile."""
    return REFERENCE_CHUNK if platform == "gpu" else fitted_chunk(keys)


def fitted_chunk(keys: int) -> int:
    """The next power of two of `keys` (at least 2), up to REFERENCE_CHUNK: chunks that hold
    less than twice the keys the rows see, at a few program shapes (the single-device checks',
    one program per power of two, traded for memory)."""
    return min(REFERENCE_CHUNK, 1 << max(keys - 1, 1).bit_length())


@cache
def _passes():
    """jitted float64 attention rows over one chunk of keys at a time, to trace under
    jax.enable_x64, so one program serves any number of keys: ("out": (state, q, k, v, lo,
    hi, cols, kv_of, scale) -> state, the online softmax's (top, total, acc) per head
    (H, B, n, 1 | D) after this chunk; "dq": (dq, q, k, v, dout, out, lse, lo, hi, cols,
    kv_of, scale) -> dq plus this chunk's share). q, dout (B, n, H, D) are the n query rows,
    k, v (B, c, G, D) the chunk's keys at global positions `cols` (-1: padding), a row seeing
    the keys in its intervals [lo, hi) (n, I), query head j reading K/V column kv_of[j];
    one head at a time, so the float64 scores of a chunk fit beside the inputs."""
    import jax
    import jax.numpy as jnp

    def scores(q, k, v, j, kv_of, seen, scale):
        """Query head j's masked, scaled float64 scores over the chunk, and its K and V."""
        qj = jnp.take(q, j, axis=2).astype(jnp.float64)
        kj, vj = (jnp.take(x, kv_of[j], axis=2).astype(jnp.float64) for x in (k, v))
        s = jnp.where(seen, jnp.einsum("bnd,bmd->bnm", qj, kj) * scale, -jnp.inf)
        return s, kj, vj

    def visible(lo, hi, cols):
        return ((cols >= lo[:, :, None]) & (cols < hi[:, :, None])).any(axis=1)

    def out_pass(state, q, k, v, lo, hi, cols, kv_of, scale):
        seen = visible(lo, hi, cols)

        def head(args):
            j, top, total, acc = args
            s, _, vj = scores(q, k, v, j, kv_of, seen, scale)
            new_top = jnp.maximum(top, s.max(axis=-1, keepdims=True))
            shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
            p, alpha = jnp.exp(s - shift), jnp.exp(top - shift)
            total = total * alpha + p.sum(axis=-1, keepdims=True)
            return new_top, total, acc * alpha + jnp.einsum("bnm,bmd->bnd", p, vj)

        return jax.lax.map(head, (jnp.arange(q.shape[2]), *state))

    def dq_pass(dq, q, k, v, dout, out, lse, lo, hi, cols, kv_of, scale):
        seen = visible(lo, hi, cols)

        def head(args):
            j, dq_j, out_j, lse_j = args
            s, kj, vj = scores(q, k, v, j, kv_of, seen, scale)
            doj = jnp.take(dout, j, axis=2).astype(jnp.float64)
            p = jnp.where(jnp.isfinite(lse_j), jnp.exp(s - lse_j), 0.0)
            dp = jnp.einsum("bnd,bmd->bnm", doj, vj)
            ds = p * (dp - (doj * out_j).sum(axis=-1, keepdims=True))
            return dq_j + jnp.einsum("bnm,bmd->bnd", ds, kj) * scale

        return jax.lax.map(head, (jnp.arange(q.shape[2]), dq, out, lse))

    return {"out": jax.jit(out_pass), "dq": jax.jit(dq_pass)}


def rows_reference(
    mask,
    rows: np.ndarray,
    q,
    dout,
    keys: Callable[[np.ndarray], tuple],
    kv_of: np.ndarray,
    scale: float,
    chunk: int | None = None,
    cols: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Float64 out (and dq where dout is given), (B, len(rows), H, D) each, of the global query
    `rows` over every key they see (checks.keys_seen), on the device. q, dout (B, n, H, D)
    hold the rows padded to n (padding rows see no key: their values do not matter), query
    head j reading K/V head kv_of[j]; keys(positions) gives k, v (B, c, G, D) at a chunk's
    global key positions (-1: padding, masked whatever its values), asked again for the dq
    pass instead of held. Rows, intervals and chunks are padded to a few shapes (n, a power of
    two, `chunk` keys: by default reference_chunk's for the device), so checks of any rows
    and keys share a few compiled passes. `cols`: the keys the rows see, where the caller has
    them already."""
    import jax
    import jax.numpy as jnp

    cols = checks.keys_seen(mask, rows) if cols is None else cols
    lo, hi = (x[rows] for x in mask.row_intervals())
    width = 1 << (lo.shape[1] - 1).bit_length()
    bounds = [np.zeros((q.shape[1], width), np.int32) for _ in range(2)]
    for b, x in zip(bounds, (lo, hi)):
        b[: len(rows), : x.shape[1]] = x
    if chunk is None:
        chunk = reference_chunk(len(cols), next(iter(q.devices())).platform)

    def chunks():
        """(k, v, global positions) of each chunk of the keys the rows see (padded)."""
        for start in range(0, len(cols), chunk):
            part = np.full(chunk, -1, np.int32)
            part[: len(cols[start : start + chunk])] = cols[start : start + chunk]
            yield (*keys(part), part)

    passes, kv_of, scale = _passes(), np.asarray(kv_of, np.int32), np.float64(scale)
    x64 = jax.enable_x64  # around the passes alone: keys() runs its programs as elsewhere
    with x64(True):
        shape = (q.shape[2], *q.shape[:2])
        state = (
            jnp.full((*shape, 1), -jnp.inf, jnp.float64),
            jnp.zeros((*shape, 1), jnp.float64),
            jnp.zeros((*shape, q.shape[-1]), jnp.float64),
        )
    for k, v, at in chunks():
        with x64(True):
            state = passes["out"](state, q, k, v, *bounds, at, kv_of, scale)
        del k, v  # before the next chunk is gathered: one chunk's keys held at a time
    with x64(True):
        top, total, acc = state
        seen = total > 0
        total = jnp.where(seen, total, 1.0)
        refs = {"out": acc / total}
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        lse = jnp.where(seen, top + jnp.log(total), -jnp.inf)
        dq = None if dout is None else jnp.zeros_like(acc)
    if dout is not None:
        for k, v, at in chunks():
            with x64(True):
                dq = passes["dq"](dq, q, k, v, dout, refs["out"], lse, *bounds, at, kv_of, scale)
            del k, v
        refs["dq"] = dq
    # per head (H, B, n, D) -> (B, rows, H, D)
    return {name: np.moveaxis(np.asarray(x), 0, 2)[:, : len(rows)] for name, x in refs.items()}
