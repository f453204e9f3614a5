"""The Pallas tuning space (--tune): launch-config candidates of the Pallas Triton kernel, each
named so that its name alone rebuilds it (the name is part of the point's key).

A space is space-separated `key=v1,v2` items; keys left out take SPACE_DEFAULTS. A candidate is
mask tiles block_q x block_k, a forward launch (num_warps, num_stages, fwd_block_k) and, in
backward modes, a backward launch (bwd_splits: dK/dV walks block_q/split query rows per step and
dQ block_k/split keys; num_warps_bwd/num_stages_bwd, empty = as the forward) of one kind:
two kernels (dkv_split programs per key tile) or one fused kernel adding dQ with atomics
(fused_bwd=1, relaxed_atomics=1 for relaxed-order adds). include_default=1 adds the library's
default config ("default", and in backward modes its fused / dkv_split variants).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

SPACE_DEFAULTS = {
    "block_q": "64,128",
    "block_k": "64,128",
    "num_warps": "4,8",
    "num_stages": "2,3",
    "bwd_splits": "1,2",
    "fused_bwd": "0",
    "relaxed_atomics": "0",
    "dkv_split": "1",
    "num_warps_bwd": "",
    "num_stages_bwd": "",
    "fwd_block_k": "0",
    "include_default": "1",
}
DEFAULT_SPACE = " ".join(f"{key}={values}" for key, values in SPACE_DEFAULTS.items())
TUNED_IMPL = "pallas"
DEFAULT = "default"
_SWEPT = re.compile(
    r"^q(\d+)k(\d+)w(\d+)s(\d+)(?:f(\d+))?x(\d+)(?:-bw(\d+)s(\d+))?(-fused)?(-relaxed)?"
    r"(?:-dkv(\d+))?$"
)
_DEFAULTS = re.compile(r"^default(-fused)?(-relaxed)?(?:-dkv(\d+))?$")


def parse_space(text: str) -> dict[str, tuple[int, ...]]:
    """A space's values by key (SPACE_DEFAULTS for keys it leaves out); ValueError names a
    malformed item or an unknown key."""
    given: dict[str, str] = {}
    for item in text.split():
        key, sep, values = item.partition("=")
        if not sep or key not in SPACE_DEFAULTS:
            raise ValueError(
                f"bad --tune item {item!r}: expected key=v1,v2 with key one of "
                f"{', '.join(SPACE_DEFAULTS)}"
            )
        given[key] = values
    space = {}
    for key, default in SPACE_DEFAULTS.items():
        values = given.get(key, default)
        if not all(v.isdigit() for v in values.split(",") if v):
            raise ValueError(f"bad --tune values {key}={values}: expected integers")
        space[key] = tuple(int(v) for v in values.split(",") if v)
    return space


def _kind_suffix(fused: bool, relaxed: bool, dkv_split: int) -> str:
    """Name suffix of a backward kind: "", "-fused", "-fused-relaxed" or "-dkv4"."""
    suffix = ("-fused" if fused else "") + ("-relaxed" if relaxed else "")
    return suffix + (f"-dkv{dkv_split}" if dkv_split > 1 else "")


def _backward_kinds(space: dict) -> list[tuple[bool, bool, int]]:
    """(fused, relaxed atomics, dkv_split); the split applies to the two-kernel backward only."""
    kinds = [(False, False, d) for d in space["dkv_split"]] if 0 in space["fused_bwd"] else []
    if 1 in space["fused_bwd"]:
        kinds += [(True, bool(r), 1) for r in space["relaxed_atomics"]]
    return kinds


def _swept_names(space: dict, mode: str) -> list[str]:
    """Names of the swept candidates, e.g. q128k128w4s2f64x2-bw8s2-fused."""
    fwd_k = space["fwd_block_k"][0] if space["fwd_block_k"] else 0
    bwd_launch = mode != "fwd" and bool(space["num_warps_bwd"] or space["num_stages_bwd"])
    names = []
    tiles = itertools.product(
        space["block_q"], space["block_k"], space["num_warps"], space["num_stages"]
    )
    for bq, bk, w, s in tiles:
        base = f"q{bq}k{bk}w{w}s{s}" + (f"f{fwd_k}" if fwd_k else "")
        if mode == "fwd":
            names.append(f"{base}x1")
            continue
        backward = itertools.product(
            space["bwd_splits"],
            space["num_warps_bwd"] or (w,),
            space["num_stages_bwd"] or (s,),
            _backward_kinds(space),
        )
        for split, wb, sb, kind in backward:
            launch = f"-bw{wb}s{sb}" if bwd_launch else ""
            names.append(f"{base}x{split}{launch}{_kind_suffix(*kind)}")
    return names


def _default_names(space: dict, mode: str) -> list[str]:
    """The library default, plus in backward modes its fused / dkv_split variants."""
    if not space["include_default"] or not space["include_default"][0]:
        return []
    kinds = [k for k in _backward_kinds(space) if k[0] or k[2] > 1] if mode != "fwd" else []
    return [DEFAULT] + [DEFAULT + _kind_suffix(*k) for k in kinds]


@functools.lru_cache(maxsize=64)
def candidate_names(space_text: str, mode: str, head_dim: int, dtype: str) -> tuple[str, ...]:
    """The candidates of a space in a mode: swept ones (those equal to a default dropped), then
    the defaults."""
    space = parse_space(space_text)
    defaults = _default_names(space, mode)
    seen = {candidate(n, head_dim, dtype) for n in defaults}
    swept = []
    for name in _swept_names(space, mode):
        built = candidate(name, head_dim, dtype)
        if built not in seen:
            seen.add(built)
            swept.append(name)
    return tuple(swept + defaults)


def candidate(name: str, head_dim: int, dtype: str) -> tuple[int, int, object]:
    """(block_q, block_k, KernelConfig) of a candidate name; ValueError for a malformed one."""
    from jax_attn.pallas_triton import KernelConfig, block_sizes, default_config

    default = _DEFAULTS.match(name)
    if default:
        fused, relaxed, dkv = default.groups()
        bq, bk = block_sizes(head_dim, dtype)
        config = dataclasses.replace(
            default_config(head_dim, dtype),
            fused_bwd=bool(fused),
            relaxed_atomics=bool(relaxed),
            dkv_split=int(dkv or 1),
        )
        return bq, bk, config
    swept = _SWEPT.match(name)
    if not swept:
        raise ValueError(f"not a tuning candidate name: {name!r}")
    bq, bk, w, s, fwd_k, split, wb, sb = (int(g) if g else 0 for g in swept.groups()[:8])
    fused, relaxed, dkv = swept.groups()[8:]
    config = KernelConfig(
        block_k=fwd_k or None,
        num_warps=w,
        num_stages=s,
        num_warps_bwd=wb or w,
        num_stages_bwd=sb or s,
        block_q_dkv=bq // split,
        block_k_dq=bk // split,
        fused_bwd=bool(fused),
        relaxed_atomics=bool(relaxed),
        dkv_split=int(dkv or 1),
    )
    return bq, bk, config
