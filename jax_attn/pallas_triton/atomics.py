"""dQ atomics of the fused backward: Pallas' public atomic add, or the same add relaxed-ordered.

pallas.triton.atomic_add lowers to an acq_rel atomic, which Triton keeps as ordered `atom`
instructions. dQ is read only after the kernel has ended, so its adds need no ordering: the
relaxed variant (atomic_rmw's abstract evaluation and interpret-mode discharge, a Triton
lowering with relaxed semantics) lets Triton emit `red` reductions instead. It rests on private
JAX internals, loaded on first use, so that the public path never depends on them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton


def atomic_add(ref: Any, idx: tuple, value: jax.Array, *, relaxed: bool) -> None:
    """ref[idx] += value atomically; relaxed: without memory ordering (Triton `red`)."""
    if not relaxed:
        public = getattr(pl_triton, "atomic_add", None) or pl.atomic_add  # pl before jax 0.7
        public(ref, idx, value)
        return
    from jax._src.state import primitives as state_primitives

    primitive, add = _relaxed_add()
    ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "atomic_add")
    flat, tree = jax.tree_util.tree_flatten((ref, transforms, value, None))
    primitive.bind(*flat, args_tree=tree, atomic_type=add)


@functools.cache
def _relaxed_add() -> tuple[Any, Any]:
    """(primitive, AtomicOpType.ADD): pallas.triton's atomic_rmw with a relaxed Triton lowering."""
    from jax._src import core
    from jax._src.lib.triton import dialect as tt
    from jax._src.pallas.triton import lowering, primitives
    from jax._src.state import discharge

    base = primitives.atomic_rmw_p
    primitive = core.Primitive("atomic_add_relaxed")
    primitive.def_effectful_abstract_eval(base.abstract_eval)
    discharge.register_discharge_rule(primitive)(discharge._discharge_rules[base])

    def lower(ctx: Any, *args_flat: Any, args_tree: Any, atomic_type: Any) -> Any:
        del atomic_type  # always ADD
        ptr, (idx,), value, _ = args_tree.unflatten(args_flat)
        *_, value_aval, _ = args_tree.unflatten(ctx.avals_in)
        ptr = lowering._compute_pointers_from_indices(ptr, ctx.block_infos[0], idx)
        value = lowering._ensure_ir_value(value, value_aval)
        return lowering._atomic_rmw(tt.RMWOp.FADD, ptr, value, semantic=tt.MemSemantic.RELAXED)

    lowering.register_lowering(primitive)(lower)
    return primitive, primitives.AtomicOpType.ADD
