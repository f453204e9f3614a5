"""Baselines from JAX itself: the Pallas Triton `attention.mha` and the Mosaic GPU
`attention_mgpu` kernels (both GPU only, imported lazily so CPU imports stay safe)."""

from __future__ import annotations

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from attn_masks import MaskPattern, classify

from .common import (
    HALF,
    Adapter,
    Request,
    Unsupported,
    describe,
    first_reason,
    needs_cuda,
    needs_static_mask,
)

MHA_BLOCK = 128  # attention.mha's default forward tiles (BlockSizes.get_default())
MGPU_BLOCK_Q, MGPU_BLOCK_KV, MGPU_BWD_BLOCK = 64, 128, 64


def _mha_module():
    with warnings.catch_warnings():
        # jax >= 0.11 deprecates this module in favour of tokamax at import time.
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention
    return attention


def _mgpu_module():
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    return attention_mgpu


def _mha_pattern(st: MaskPattern) -> tuple[bool, np.ndarray | None] | str:
    """(causal, cu_seqlens or None) for attention.mha, or why the mask is not expressible."""
    if not st.square:
        return f"pallas_mha needs Sq == Sk (got {st.seqlen_q} x {st.seqlen_k})"
    if st.is_full:
        return False, None
    if st.is_causal:
        return True, None
    if st.documents is not None:
        cu, causal = st.documents
        return causal, cu
    return (
        "pallas_mha (attention.mha) expresses only full, causal and full/causal document "
        f"(segment_ids) masks; this is a {describe(st)}"
    )


def _check_mha(req: Request) -> str | None:
    def device() -> str | None:
        cap = req.gpu.capability if req.gpu is not None else None
        if cap is not None and cap < (8, 0):
            return f"pallas_mha (Triton) needs compute capability >= 8.0, got {cap}"
        return None

    def dtype() -> str | None:
        ok = (*HALF, np.dtype(np.float32))
        if req.dtype is not None and req.dtype not in ok:
            return f"pallas_mha takes bfloat16, float16 or float32, got {req.dtype.name}"
        return None

    def head_dim() -> str | None:
        d = req.head_dim
        if d is not None and not (32 <= d <= 128 and d % 8 == 0):
            return f"pallas_mha needs 32 <= head_dim <= 128, a multiple of 8; got {d}"
        return None

    def shape() -> str | None:
        found = _mha_pattern(req.pattern)
        if isinstance(found, str):
            return found
        if req.seqlen_q % MHA_BLOCK:
            return (
                f"pallas_mha tiles the sequence by {MHA_BLOCK}: its length must be a multiple "
                f"of {MHA_BLOCK}, got {req.seqlen_q}"
            )
        return None

    def lse() -> str | None:
        if req.return_lse:
            return "pallas_mha returns an LSE only without differentiation; return_lse is refused"
        return None

    return first_reason(
        lambda: needs_static_mask(req, "pallas_mha"),
        lambda: needs_cuda(req, "pallas_mha"),
        device,
        dtype,
        head_dim,
        lse,
        shape,
    )


@partial(jax.jit, static_argnames=("scale", "causal", "interpret"))
def pallas_mha(q, k, v, segment_ids, *, scale: float, causal: bool, interpret: bool = False):
    """attention.mha with K/V repeated to Hq heads (it has no GQA) and B x S segment ids."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k = jnp.repeat(k, group, axis=2)
        v = jnp.repeat(v, group, axis=2)
    if segment_ids is not None:
        segment_ids = jnp.broadcast_to(segment_ids, (q.shape[0], q.shape[1]))
    return _mha_module().mha(
        q, k, v, segment_ids, sm_scale=scale, causal=causal, interpret=interpret
    )


def segment_ids_from_cu(cu: np.ndarray) -> np.ndarray:
    """Per-token document index (int32) from cu_seqlens."""
    return np.repeat(np.arange(len(cu) - 1, dtype=np.int32), np.diff(cu))


def _run_mha(q, k, v, mask, *, scale: float, return_lse: bool):
    del return_lse
    causal, cu = _mha_pattern(classify(mask))
    seg = None if cu is None else jnp.asarray(segment_ids_from_cu(cu))
    return pallas_mha(q, k, v, seg, scale=scale, causal=causal), None


PALLAS_MHA = Adapter("pallas_mha", _check_mha, _run_mha)


def _mgpu_causal(st: MaskPattern) -> bool | str:
    """Whether attention_mgpu runs causal for this mask, or why it cannot."""
    if st.is_full:
        return False
    if st.is_causal and st.square:
        return True
    return (
        "mosaic_mha (attention_mgpu) expresses only full and causal (Sq == Sk) masks; this is a "
        f"{describe(st)}"
    )


def _check_mgpu(req: Request) -> str | None:
    def device() -> str | None:
        cap = req.gpu.capability if req.gpu is not None else None
        if cap is not None and cap != (9, 0):
            return f"mosaic_mha needs a Hopper GPU (compute capability 9.0), got {cap}"
        return None

    def dtype() -> str | None:
        if req.dtype is not None and req.dtype != np.dtype(np.float16):
            return (
                "mosaic_mha (attention_mgpu) stages its tiles in float16 shared memory: "
                f"float16 only, got {req.dtype.name}"
            )
        return None

    def head_dim() -> str | None:
        if req.head_dim is not None and req.head_dim not in (64, 128):
            return f"mosaic_mha supports head_dim 64 or 128 here, got {req.head_dim}"
        return None

    def shape() -> str | None:
        causal = _mgpu_causal(req.pattern)
        if isinstance(causal, str):
            return causal
        tile = 2 * MGPU_BLOCK_Q
        if req.seqlen_q % tile or req.seqlen_k % tile:
            return (
                f"mosaic_mha needs Sq and Sk multiples of {tile} (two {MGPU_BLOCK_Q}-row "
                f"warpgroups; K/V blocks of {MGPU_BLOCK_KV}), got {req.seqlen_q} x {req.seqlen_k}"
            )
        if min(req.seqlen_q, req.seqlen_k) < 2 * MGPU_BLOCK_KV:
            return (
                f"mosaic_mha pipelines two {MGPU_BLOCK_KV}-token blocks: Sq and Sk must be at "
                f"least {2 * MGPU_BLOCK_KV}, got {req.seqlen_q} x {req.seqlen_k}"
            )
        if causal and req.grads:
            return (
                "mosaic_mha has no backward for causal masks (attention_mgpu raises "
                "NotImplementedError); forward only: mode='fwd'"
            )
        return None

    def lse() -> str | None:
        if req.return_lse:
            return "mosaic_mha returns an LSE only without differentiation; return_lse is refused"
        return None

    return first_reason(
        lambda: needs_static_mask(req, "mosaic_mha"),
        lambda: needs_cuda(req, "mosaic_mha"),
        device,
        dtype,
        head_dim,
        lse,
        shape,
    )


def _mgpu_config(causal: bool):
    """The anchors' forward tiles; backward tiles of JAX's own tests (two compute warpgroups)."""
    return _mgpu_module().TuningConfig(
        block_q=MGPU_BLOCK_Q,
        block_kv=MGPU_BLOCK_KV,
        max_concurrent_steps=2,
        causal=causal,
        compute_wgs_bwd=2,
        block_q_dkv=MGPU_BWD_BLOCK,
        block_kv_dkv=MGPU_BWD_BLOCK,
        block_q_dq=MGPU_BWD_BLOCK,
        block_kv_dq=MGPU_BWD_BLOCK,
    )


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mgpu_forward_only(q, k, v, config):
    return _mgpu_module().attention(q, k, v, config)


def _mgpu_forward_only_fwd(q, k, v, config):
    return _mgpu_module().attention(q, k, v, config), None


def _mgpu_forward_only_bwd(config, res, g):
    del config, res, g
    raise Unsupported(
        "mosaic_mha has no backward for causal masks (attention_mgpu raises NotImplementedError)"
    )


_mgpu_forward_only.defvjp(_mgpu_forward_only_fwd, _mgpu_forward_only_bwd)


@partial(jax.jit, static_argnames=("scale", "causal"))
def _mgpu(q, k, v, *, scale: float, causal: bool):
    # attention_mgpu applies no softmax scale: fold it into q.
    q = (q * jnp.asarray(scale, jnp.float32)).astype(q.dtype)
    config = _mgpu_config(causal)
    if causal:
        return _mgpu_forward_only(q, k, v, config)
    return _mgpu_module().attention(q, k, v, config)


def _run_mgpu(q, k, v, mask, *, scale: float, return_lse: bool):
    del return_lse
    return _mgpu(q, k, v, scale=scale, causal=_mgpu_causal(classify(mask))), None


MOSAIC_MHA = Adapter("mosaic_mha", _check_mgpu, _run_mgpu)
