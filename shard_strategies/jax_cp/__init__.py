"""JAX context-parallel attention: a CPPlan run with shard_map over a device mesh.

Inputs and outputs are global arrays in global token order; the executor pads and permutes
tokens into the plan's layout, runs the strategy per device (Ulysses all-to-all, then ring /
double ring / all-gather / local attention) with that device's stacked per-step MaskArrays, and
permutes back. The mesh is 1-D (axis `axis`) or 2-D with axes "ulysses" and "ring"; the last
mesh axis is made of consecutive devices (the "intra-node" one).

When the length splits evenly over the devices, the permutation runs on the contiguous
sequence sharding (device i of the mesh's flattened order holding tokens [i S/N, (i+1) S/N)):
a few ppermute rounds move each device only the tokens its layout shard needs
(shard_strategies/exchange.py), and the output comes back in that sharding. Otherwise the
global arrays are gathered into the layout (XLA: an all-gather of each input, an all-reduce of
the output). Inputs sharded on a mesh with Explicit axes are run under auto_axes.

A caller that runs a whole model in the layout (the train step) skips the per-call permutation:
`CPExecutor.dispatch` puts its per-token inputs ((B, S, ...) of any dtype: token ids, targets,
positions) into layout order once, and every layer calls `CPExecutor.sharded`.

Modules, as in torch_cp: _api (the executor and entry points), _ring (ring and double ring
steps), _allgather, _ulysses (the all-to-alls), _local (one device's attention and LSE merge).
The ring step functions are exported for the CP predictor, which times them rank by rank.
"""

from ._api import (
    CPExecutor,
    attention,
    bucket_multiple,
    build,
    cp_mesh,
    distinct_mask_arrays,
    distinct_pieces,
    executor_plan,
    interval_count,
    piece_tiles,
    ring_mask_arrays,
    shard_multiple,
    stacked_piece_arrays,
)
from ._local import local_attention, piece_arrays, resolve_impl
from ._ring import backward_start, backward_step, forward_step

__all__ = [
    "CPExecutor",
    "attention",
    "backward_start",
    "backward_step",
    "bucket_multiple",
    "build",
    "cp_mesh",
    "distinct_mask_arrays",
    "distinct_pieces",
    "executor_plan",
    "forward_step",
    "interval_count",
    "local_attention",
    "piece_arrays",
    "piece_tiles",
    "resolve_impl",
    "ring_mask_arrays",
    "shard_multiple",
    "stacked_piece_arrays",
]
