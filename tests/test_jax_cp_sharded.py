"""JAX CP on sequence-sharded inputs (8 virtual CPU devices): results against the float64 oracle,
and the compiled program's collectives (no whole-sequence gather of q, k, v or the output)."""

import math
from functools import partial

import cp_cases
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cp_cases import named_mask
from hlo_ops import collectives
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from attn_masks import make_mask, reference_attention
from shard_strategies import jax_cp
from shard_strategies.exchange import contiguous_positions, make_exchange

N, D, TOL = 8, 16, 1e-4
# The unoptimised CPU backend compiles about twice as fast; the programs here are tiny.
FAST = {"xla_backend_optimization_level": 0}


def flat_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:N]), ("cp",))


def grid_mesh() -> Mesh:
    """2 (Ulysses) x 4 (ring), ring ranks consecutive."""
    return Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("ulysses", "ring"))


def explicit_mesh() -> Mesh:
    """jax.make_mesh with Explicit axes (its default on recent jax)."""
    return jax.make_mesh((N,), ("cp",), axis_types=(jax.sharding.AxisType.Explicit,))


def host_inputs(seed: int, seqlen: int, hq: int, hkv: int):
    rng = np.random.default_rng(seed)
    shapes = [(1, seqlen, hq, D), (1, seqlen, hkv, D), (1, seqlen, hkv, D), (1, seqlen, hq, D)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def seq_sharded(xs, mesh: Mesh):
    """Split along the sequence over every mesh axis, in mesh order (device i: block i)."""
    sharding = NamedSharding(mesh, P(None, mesh.axis_names))
    return [jax.device_put(x, sharding) for x in xs]


assert_close = partial(cp_cases.assert_close, tol=TOL)


def assert_reference(got, host, mask, tag: str) -> None:
    """out, dq, dk, dv against the float64 oracle on the host inputs (dout = host[3])."""
    ref = reference_attention(*host[:3], mask, dout=host[3])
    for name, g, want in zip(("out", "dq", "dk", "dv"), got, (ref.out, ref.dq, ref.dk, ref.dv)):
        assert_close(g, want, f"{tag} {name}")


def cp_fn(mask, mesh, strategy, layout, **kw):
    """What a caller writes: jax_cp.attention on the arrays it holds."""
    return lambda q, k, v: jax_cp.attention(
        q, k, v, mask, mesh=mesh, strategy=strategy, layout=layout, impl="reference", **kw
    )


def forward_backward(attn):
    @partial(jax.jit, compiler_options=FAST)
    def run(q, k, v, do):
        out, pullback = jax.vjp(attn, q, k, v)
        return (out, *pullback(do))

    return run


def check_sharded(mask, mesh, strategy, layout, hq=4, hkv=2, seed=0, **kw):
    host = host_inputs(seed, mask.seqlen_q, hq, hkv)
    q, k, v, do = seq_sharded(host, mesh)
    out, dq, dk, dv = forward_backward(cp_fn(mask, mesh, strategy, layout, **kw))(q, k, v, do)
    tag = f"{mask.name}/{strategy}/{layout}"
    assert_reference((out, dq, dk, dv), host, mask, tag)
    # the output stays split along the sequence like the inputs (nothing gathered whole)
    same = out.sharding.is_equivalent_to(q.sharding, 4)
    assert same, f"{tag}: out sharding {out.sharding}, inputs {q.sharding}"


CASES = [
    ("ring", "zigzag", flat_mesh, 4, {}),
    ("ring", "contiguous", flat_mesh, 4, {}),
    ("allgather", "zigzag", flat_mesh, 4, {}),
    ("allgather", "contiguous", flat_mesh, 4, {}),
    ("ulysses", "zigzag", flat_mesh, 8, {}),
    ("ulysses", "contiguous", flat_mesh, 8, {}),
    ("usp", "zigzag", grid_mesh, 4, {}),
    ("usp", "contiguous", grid_mesh, 4, {}),
    ("double_ring", "zigzag", flat_mesh, 4, {"ulysses_size": 2}),
    ("double_ring", "contiguous", flat_mesh, 4, {}),
]


@pytest.mark.parametrize(
    "strategy,layout,mesh,hq,kw", CASES, ids=[f"{c[0]}-{c[1]}-{c[2].__name__}" for c in CASES]
)
def test_sequence_sharded_matches_reference(strategy, layout, mesh, hq, kw):
    mask = make_mask("causal", 128)
    check_sharded(mask, mesh(), strategy, layout, hq=hq, seed=len(strategy) + len(layout), **kw)


def test_documents_padding_and_uneven_pairs():
    """Per-document zigzag (a mask-dependent placement) with padding: S = 200 splits into 25
    tokens a device, the layout pads each rank to 30 (zeros that must never reach the output)."""
    mask = named_mask("causal_document", 200)
    check_sharded(mask, flat_mesh(), "ring", "zigzag", seed=3)
    check_sharded(mask, grid_mesh(), "usp", "balanced", seed=4)


def test_explicit_mesh_and_lse():
    """Inputs typed on a jax.make_mesh mesh (Explicit axes, where jnp.take on the sharded
    sequence raised ShardingTypeError) keep their sharding; the LSE comes back in order too."""
    mask = make_mask("causal", 128)
    mesh = explicit_mesh()
    host = host_inputs(5, 128, 4, 2)
    q, k, v, _ = seq_sharded(host, mesh)
    fn = cp_fn(mask, mesh, "ring", "zigzag", return_lse=True)
    out, lse = jax.jit(fn, compiler_options=FAST)(q, k, v)
    ref = reference_attention(*host[:3], mask)
    assert_close(out, ref.out, "out")
    assert_close(lse, ref.lse, "lse")
    assert out.sharding.is_equivalent_to(q.sharding, 4)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v)[0] * host[3])

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), compiler_options=FAST)(q, k, v)
    ref = reference_attention(*host[:3], mask, dout=host[3])
    for name, got, want in zip(("dq", "dk", "dv"), grads, (ref.dq, ref.dk, ref.dv)):
        assert_close(got, want, name)


def check_replicated(mask, mesh, seed):
    """Ring/zigzag on replicated (global) q, k, v against the reference; returns the executor
    that jax_cp.build makes for the same placement."""
    host = host_inputs(seed, mask.seqlen_q, 4, 2)
    rep = [jax.device_put(x, NamedSharding(mesh, P())) for x in host]
    assert_reference(forward_backward(cp_fn(mask, mesh, "ring", "zigzag"))(*rep), host, mask, "")
    return jax_cp.build(
        mask, mesh=mesh, strategy="ring", layout="zigzag", num_heads_q=4, num_heads_kv=2, head_dim=D
    )


def test_uneven_length_falls_back_to_the_global_dispatch():
    """S = 100 does not split over 8 devices: the executor gathers global arrays as before, on an
    Explicit-axis mesh too (replicated inputs, replicated output)."""
    ex = check_replicated(make_mask("causal", 100), explicit_mesh(), seed=7)
    assert not ex.splits_evenly


def test_replicated_inputs_and_methods():
    """Global (replicated) inputs still work; dispatch / undispatch on sharded arrays match the
    plan's order and round-trip (padding dropped)."""
    mesh = flat_mesh()
    ex = check_replicated(named_mask("causal_document", 200), mesh, seed=6)
    assert ex.splits_evenly
    pos = np.arange(200, dtype=np.float32).reshape(1, 200, 1, 1) + 1
    xd = ex.dispatch(seq_sharded([pos], mesh)[0])
    want = np.where(ex.plan.order() < 200, ex.plan.order() + 1, 0)
    assert np.array_equal(np.asarray(xd)[0, :, 0, 0], want)
    assert np.array_equal(np.asarray(ex.undispatch(xd)), pos)


@pytest.mark.parametrize("seqlen", [200, 100])
def test_dispatch_of_token_ids(seqlen):
    """(B, S) integer arrays (token ids, positions) dispatch like q: rank order, padding zero,
    and back. S = 200 splits over 8 devices (the exchange), S = 100 does not (the gather)."""
    mesh = flat_mesh()
    ex = jax_cp.build(
        named_mask("causal_document", seqlen), mesh=mesh, strategy="ring", layout="zigzag",
        num_heads_q=4, num_heads_kv=2, head_dim=D,
    )  # fmt: skip
    ids = np.arange(2 * seqlen, dtype=np.int32).reshape(2, seqlen) + 1
    spec = P(None, "cp") if ex.splits_evenly else P()
    got = ex.dispatch(jax.device_put(ids, NamedSharding(mesh, spec)))
    order = ex.plan.order()
    want = np.where(order < seqlen, ids[:, np.minimum(order, seqlen - 1)], 0)
    assert ex.splits_evenly == (seqlen % N == 0) and ex.padded_seqlen > seqlen
    assert got.dtype == np.int32 and np.array_equal(np.asarray(got), want)
    assert np.array_equal(np.asarray(ex.undispatch(got)), ids)


def test_exchange_moves_only_what_changes_rank():
    """Host model of the exchange: exact for every rank, and zigzag over 8 ranks needs two
    rounds of half a shard (the shard's worth), contiguous none."""
    mask = make_mask("causal", 1024)
    flat = contiguous_positions(1024, N)
    for layout, sizes in (("zigzag", (64, 64)), ("contiguous", ())):
        plan = jax_cp.executor_plan(
            mask, N, "ring", layout, impl="reference", num_heads_q=4, num_heads_kv=2,
            head_dim=D, dtype=jnp.float32,
        )  # fmt: skip
        ex = make_exchange(flat, plan.positions, 1024)
        assert ex.sizes == sizes
        got = ex.apply(flat[..., None].astype(np.float64))[..., 0]
        assert np.array_equal(got, plan.positions)
        back = make_exchange(plan.positions, flat, 1024)
        assert np.array_equal(back.apply(got[..., None])[..., 0], flat)


S_HLO = 1024  # 128 tokens a device: a whole-sequence dim (1024) is unmistakable
HLO_CASES = [
    ("ring", flat_mesh, 4, 2, "collective-permute"),
    ("allgather", flat_mesh, 4, 2, "all-gather"),
    ("ulysses", flat_mesh, 8, 2, "all-to-all"),
    ("usp", grid_mesh, 4, 2, "all-to-all"),
    ("double_ring", grid_mesh, 4, 2, "collective-permute"),
]


@pytest.mark.parametrize(
    "strategy,mesh,hq,hkv,needs", HLO_CASES, ids=[c[0] for c in HLO_CASES]
)  # fmt: skip
def test_sharded_program_moves_no_whole_sequence(strategy, mesh, hq, hkv, needs):
    """Forward and backward compiled for sequence-sharded inputs: the only collectives with a
    whole-sequence dimension are the all-gather strategy's K/V gathers (and their backward's
    reduce-scatters, which XLA may show as all-reduces of K/V-sized gradients). Before the
    exchange, dispatch all-gathered q, k, v whole and all-reduced the whole output."""
    mesh = mesh()
    mask = make_mask("causal", S_HLO)
    q, k, v, do = seq_sharded(
        [np.zeros(s, np.float32) for s in [(1, S_HLO, hq, D), *[(1, S_HLO, hkv, D)] * 2]]
        + [np.zeros((1, S_HLO, hq, D), np.float32)],
        mesh,
    )
    run = forward_backward(cp_fn(mask, mesh, strategy, "zigzag"))
    found = collectives(run.lower(q, k, v, do).compile().as_text())
    assert any(op == needs for op, _ in found), f"{strategy}: no {needs} in {found}"
    kv_whole = (1, S_HLO, hkv, D)
    for op, dims in found:
        whole = any(d >= S_HLO for d in dims) or math.prod(dims) >= S_HLO * D
        if op not in ("all-gather", "all-reduce") or not whole:
            continue
        allowed = (
            strategy == "allgather" and op in ("all-gather", "all-reduce") and dims == kv_whole
        )
        assert allowed, f"{strategy}: {op} of whole-sequence shape {dims}"
