"""One process of the multi-process CP test: 4 CPU devices, gloo collectives, vs the oracle.

Checks ring attention with gradients inside a user jit (the executor's arrays compiled in) and
USP across processes (all-to-all and ring over gloo) with the executor passed as a jit argument.
Usage: python jax_cp_worker.py PROCESS_ID NUM_PROCESSES PORT
Prints "OK <max relative error>" and exits 0 when everything matches the float64 oracle.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from cp_cases import named_mask  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from attn_masks import reference_attention  # noqa: E402
from shard_strategies import jax_cp  # noqa: E402

SEQLEN, HQ, HKV, D = 100, 4, 2, 16


def main() -> int:
    process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
    if hasattr(jax.config, "jax_cpu_collectives_implementation"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    devices = np.array(jax.devices())
    assert devices.size == 4 * num_processes, devices
    mesh = Mesh(devices, ("cp",))
    mask = named_mask("causal_document", SEQLEN)
    rng = np.random.default_rng(0)  # the same inputs on every process
    host = [
        rng.standard_normal(shape).astype(np.float32)
        for shape in (
            (1, SEQLEN, HQ, D),
            (1, SEQLEN, HKV, D),
            (1, SEQLEN, HKV, D),
            (1, SEQLEN, HQ, D),
        )
    ]
    replicated = NamedSharding(mesh, P())
    q, k, v, do = (
        jax.make_array_from_callback(x.shape, replicated, lambda i, x=x: x[i]) for x in host
    )

    @jax.jit
    def forward_backward(q, k, v, do):
        def f(q, k, v):
            return jax_cp.attention(q, k, v, mask, mesh=mesh, strategy="ring", layout="zigzag")

        out, pullback = jax.vjp(f, q, k, v)
        return (out, *pullback(do))

    ex = jax_cp.build(
        mask,
        mesh=mesh,
        strategy="usp",
        layout="balanced",
        ulysses_size=2,
        num_heads_q=HQ,
        num_heads_kv=HKV,
        head_dim=D,
    )
    usp_out = jax.jit(lambda ex, q, k, v: ex(q, k, v))(ex, q, k, v)
    got = [*forward_backward(q, k, v, do), usp_out]
    got = [multihost_utils.process_allgather(x, tiled=True) for x in got]
    ref = reference_attention(*host[:3], mask, dout=host[3])
    worst = 0.0
    for a, b in zip(got, (ref.out, ref.dq, ref.dk, ref.dv, ref.out)):
        worst = max(worst, float(np.max(np.abs(a - b)) / np.max(np.abs(b))))
    jax.distributed.shutdown()
    print(f"OK {worst:.3e}" if worst < 1e-4 else f"MISMATCH {worst:.3e}", flush=True)
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
