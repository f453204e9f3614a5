"""Where the train step's arrays live: one device, or a 1-D CP mesh with tokens split along the
sequence (in the CP executor's layout order) and parameters replicated (works multi-process:
every process builds the same host batch and contributes its own shards)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from experiments.workloads.nnx_attention import AttentionBackend

CP_AXIS = "cp"


def cp_mesh(num_devices: int = 0) -> Mesh:
    """A 1-D mesh named 'cp' over the first num_devices devices (0: all of them)."""
    devices = jax.devices()
    n = num_devices or len(devices)
    if n > len(devices):
        raise ValueError(f"asked for {n} CP devices but JAX sees {len(devices)}")
    return Mesh(np.array(devices[:n]), (CP_AXIS,))


def token_sharding(backend: AttentionBackend, seqlen: int) -> Sharding:
    """(B, S, ...) arrays: split on S over the CP mesh when it divides, else replicated."""
    if not backend.is_cp:
        return SingleDeviceSharding(jax.devices()[0])
    mesh = backend.mesh
    spec = P(None, mesh.axis_names) if seqlen % mesh.size == 0 else P()
    return NamedSharding(mesh, spec)


def replicated(backend: AttentionBackend) -> Sharding:
    """Parameters and optimizer state: on every CP device, or on the one device."""
    if not backend.is_cp:
        return SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(backend.mesh, P())


def put_global(x: np.ndarray, sharding: Sharding) -> jax.Array:
    """A global array from a host array that every process holds in full."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def dispatched(
    executor: Any, host: Sequence[np.ndarray], backend: AttentionBackend
) -> tuple[jax.Array, ...]:
    """(B, S) host arrays and the tokens' global positions (1, S), put into the CP executor's
    layout order: (B, S_pad) sharded on tokens, padding tokens zero (so of zero loss weight).
    The train step's one dispatch per batch: the model then runs in that order throughout."""
    seqlen = host[0].shape[1]
    sharding = token_sharding(backend, seqlen)
    positions = np.arange(seqlen, dtype=np.int32)[None]
    return tuple(executor.dispatch(put_global(x, sharding)) for x in (*host, positions))
