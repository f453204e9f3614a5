"""Running the Mosaic GPU kernels in the CPU interpreter (jax >= 0.10), for tests.

The interpreter lacks three constructs these kernels use: layout casts (pure annotations, the
identity on CPU), and wgmma operands that are transposed shared-memory views (K^T) or register
arrays (P). enable_interpret_support() teaches it those through private JAX internals; the
kernels themselves are unchanged. It also makes the interpreter compile each warpgroup's program
once instead of once per warpgroup and grid point.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params(*, detect_races: bool = False) -> Any:
    """Parameters that run Mosaic GPU kernels in the CPU interpreter (jax >= 0.10).

    detect_races turns on the interpreter's happens-before race detector, which also orders
    TMA copies: shared memory read before the barrier of the copy that fills it is a race
    (races_found() says whether one was seen).
    """
    enable_interpret_support()
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params(detect_races=detect_races)


@contextlib.contextmanager
def launches_with_races() -> Iterator[list[bool]]:
    """Inside: one entry per kernel launch interpreted with detect_races, True if it raced.

    The interpreter keeps one race-detector state per launch and drops it at the next launch;
    this records each state as it is made, so a caller sees every kernel of a jitted function.
    """
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    made: list[Any] = []
    base = gpu_callbacks.RaceDetectionState

    class Recorded(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    flags: list[bool] = []
    gpu_callbacks.RaceDetectionState = Recorded
    try:
        yield flags
    finally:
        gpu_callbacks.RaceDetectionState = base
        flags.extend(bool(state.races_found) for state in made)


@functools.cache
def enable_interpret_support() -> None:
    """Teach the Mosaic GPU CPU interpreter the constructs these kernels need that it lacks
    (jax 0.10): layout casts (pure annotations: identity on CPU), wgmma operands that are
    transposed shared-memory views (K^T) or register arrays (P), and the TMA reduce-add of the
    fused backward's dQ. The kernels are unchanged.

    The interpreter runs every warpgroup of every grid point as its own XLA program and, in jax
    0.10, traces, lowers and compiles that program anew each time (a fresh closure defeats the
    jit cache): about 1 s of compilation per warpgroup and grid point, 3/4 of a test's time.
    _run_thread_program compiles it once per program and argument types and reruns it.
    """
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic.interpret import thread_map
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    gpu_callbacks.wgmma = functools.partial(_interpret_wgmma, gpu_callbacks)
    gpu_callbacks.copy_smem_to_gmem = functools.partial(
        _interpret_copy_smem_to_gmem, gpu_callbacks, gpu_callbacks.copy_smem_to_gmem
    )
    if hasattr(thread_map, "_run_jaxpr"):  # a speed-up only: without it the programs recompile
        thread_map._run_jaxpr = _run_thread_program


# One thread's program (a jaxpr of the interpreter) -> {argument types: [lock, compiled]}; the
# jaxpr is held by the outer program's callback, so entries go with the outer program.
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROGRAMS_LOCK = threading.Lock()


def _eval_jaxpr(jaxpr: Any, consts: Any, *args: Any) -> None:
    jax.core.eval_jaxpr(jaxpr, consts, *args)


def _run_thread_program(jaxpr: Any, consts: Any, *args: Any) -> None:
    """thread_map's _run_jaxpr (trace, lower, compile and run `jaxpr` on `consts` and `args`),
    with the compiled program kept for the next warpgroup and grid point: the same program, run
    the same way, compiled once. The first of concurrent callers compiles, the others wait."""
    types = tuple(jax.typeof(x) for x in (*jax.tree.leaves(consts), *args))
    with _PROGRAMS_LOCK:
        entry = _PROGRAMS.setdefault(jaxpr, {}).setdefault(
            (jax.tree.structure(consts), types), [threading.Lock(), None]
        )
    with entry[0]:
        if entry[1] is None:
            traced = jax.jit(_eval_jaxpr, static_argnums=(0,)).trace(jaxpr, consts, *args)
            entry[1] = traced.lower().compile()
    entry[1](consts, *args)


def _interpret_operand(callbacks: Any, key: Any, transforms: Any, thread: int) -> np.ndarray:
    """A wgmma operand in the interpreter: a register value, or a shared-memory buffer viewed
    through its indexers and transposes (tiling and swizzling are layout-only there)."""
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.state import indexing
    from jax._src.state.types import TransposeTransform

    key = np.asarray(key)
    if not np.issubdtype(key.dtype, np.integer):  # allocation keys are int32; values are not
        return key
    memory = callbacks._get_shared_memory()
    value, _, _ = memory.get_buffer_content(callbacks.HostAllocationKey.from_array(key), (), thread)
    value = np.asarray(value)
    for t in transforms or ():
        if isinstance(t, indexing.NDIndexer):
            value = value[interpret_utils.to_range([jax.tree.map(int, t)])]
        elif isinstance(t, TransposeTransform):
            value = np.transpose(value, t.permutation)
    return value


def _interpret_wgmma(
    callbacks: Any,
    *,
    device_id: Any,
    thread_id: Any,
    acc_allocation_key_as_array: Any,
    acc_transforms: Any,
    acc_dtype: Any,
    a_allocation_key_as_array: Any,
    a_transforms: Any,
    b_allocation_key_as_array: Any,
    b_transforms: Any,
    token: Any,
    **_: Any,
) -> Any:
    """acc += a @ b in the interpreter, with operands read by _interpret_operand."""
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils

    memory = callbacks._get_shared_memory()
    thread = memory.get_global_thread_id(int(device_id), int(thread_id))
    a = _interpret_operand(callbacks, a_allocation_key_as_array, a_transforms, thread)
    b = _interpret_operand(callbacks, b_allocation_key_as_array, b_transforms, thread)
    acc_key = callbacks.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc_range = interpret_utils.to_range(
        [jax.tree.map(int, t) for t in callbacks._remove_noop_transforms(acc_transforms)]
    )
    acc, _, _ = memory.get_buffer_content(acc_key, acc_range, thread)
    res = np.asarray(acc) + np.matmul(
        a.astype(np.float32), b.astype(np.float32), dtype=np.float32
    ).astype(acc_dtype)
    memory.store_buffer_content(acc_key, acc_range, res, thread)
    return token


def _interpret_copy_smem_to_gmem(
    callbacks: Any, copy: Any, *, reduction_op: Any = None, **kwargs: Any
) -> Any:
    """The interpreter's SMEM -> GMEM copy, and with reduction_op="add" dst += src (the copy is
    synchronous there, like every interpreted TMA)."""
    if reduction_op is None:
        return copy(reduction_op=None, **kwargs)
    if reduction_op != "add":
        raise NotImplementedError(f"TMA reduction {reduction_op!r} in interpret mode")
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils

    memory = callbacks._get_shared_memory()
    thread = memory.get_global_thread_id(int(kwargs["device_id"]), int(kwargs["thread_id"]))

    def where(side: str) -> tuple[Any, Any]:
        key = callbacks.HostAllocationKey.from_array(kwargs[f"{side}_allocation_key_as_array"])
        transforms = callbacks._remove_noop_transforms(kwargs[f"{side}_transforms"])
        return key, interpret_utils.to_range(jax.tree.map(int, transforms))

    src, dst = where("src"), where("dst")
    value, _, _ = memory.get_buffer_content(*src, thread)
    total, _, _ = memory.get_buffer_content(*dst, thread)
    memory.store_buffer_content(*dst, np.asarray(total) + np.asarray(value), thread)
    return kwargs["token"]
