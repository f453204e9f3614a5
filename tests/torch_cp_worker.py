"""One rank of tests/test_torch_cp.py: runs every CP configuration and writes one JSON line each.

Launched by the test as plain processes with torchrun's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), gloo on CPU. Imports only torch, numpy, attn_masks, torch_attn and
shard_strategies (never jax: forking or starting after a jax import can deadlock). Each rank
checks its own global out/lse/dq/dk/dv against the float64 oracle and its sent bytes against
the plan, so a rank that ends up with wrong gradients is caught too. Each case's oracle is
computed once, by one rank, and read by all (share_oracles).
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from cp_cases import DOC_MASKS  # the generators that take a seqlens list
from gloo_ranks import leave_group

import torch_attn
from attn_masks import (
    MASK_NAMES,
    Mask,
    MaskType,
    from_slices,
    make_mask,
    reference_attention,
    uniform_block_sparse,
)
from shard_strategies import LAYOUTS, torch_cp

SEQLEN = 90
HEAD_DIM = 8
HEADS = ((4, 4), (4, 2), (8, 1))  # (Hq, Hkv): MHA, GQA, GQA with K/V replication under U=4
SUBGROUP = (1, 3)
# (label, strategy, options, group, all masks?): group "world" is group=None (real subgroups),
# "copy" a new group of all ranks (a caller's group: no subgroups made), "pair" SUBGROUP only.
# The five strategies run every mask; their variants a few masks with the hard cases.
STRATEGIES = (
    ("ring", "ring", {}, "world", True),
    ("allgather", "allgather", {}, "world", True),
    ("ulysses", "ulysses", {}, "world", True),
    ("usp", "usp", {"ulysses_size": 2}, "world", True),
    ("double_ring", "double_ring", {"num_windows": 2}, "world", True),
    ("usp_ring_inner", "usp", {"ulysses_size": 2, "inner_axis": "ring"}, "world", False),
    ("usp_copy", "usp", {"ulysses_size": 2, "inner_axis": "ring"}, "copy", False),
    ("double_ring_w4", "double_ring", {"num_windows": 4}, "world", False),
    ("double_ring_usp", "double_ring", {"ulysses_size": 2}, "copy", False),
    ("ring_pair", "ring", {}, "pair", False),
    ("ulysses_pair", "ulysses", {}, "pair", False),
)
FEW_MASKS = ("causal_document", "share_question", "sliding_window", "random_slices", "late_causal")
GROUP_SIZE = {"world": 4, "copy": 4, "pair": len(SUBGROUP)}
SHARD_API = ("usp", "double_ring", "ring_pair")
# Heads a Ulysses group of 4 cannot split: (Hq, Hkv) and a phrase the error must contain.
BAD_HEADS = (((6, 2), "num_heads_q (6) divisible by 4"), ((12, 6), "num_heads_kv (6) to divide"))
TOL = {
    "float32": {"out": 2e-5, "lse": 2e-5, "dq": 1e-4, "dk": 1e-4, "dv": 1e-4},
    "bfloat16": {"out": 2e-2, "lse": 2e-2, "dq": 4e-2, "dk": 4e-2, "dv": 4e-2},
}


@dataclass(frozen=True)
class Case:
    """One configuration: strategy x layout x mask x heads, and what to check."""

    name: str
    strategy: str
    options: dict
    group: str
    layout: str
    mask_name: str
    heads: tuple[int, int]
    dtype: str
    return_lse: bool
    api: str = "global"  # "global": attention(); "shards": dispatch/shard_attention/undispatch


def _seqlens(rng: random.Random, total: int) -> list[int]:
    """Random document lengths (1..40, some tiny) summing to total."""
    out = []
    while sum(out) < total:
        out.append(min(rng.choice([1, 2, 3, rng.randint(4, 40)]), total - sum(out)))
    return out


def random_slices(rng: random.Random, seqlen: int) -> Mask:
    """Disjoint query blocks, each with a random key range and type; some blocks see nothing."""
    cuts = sorted(rng.sample(range(1, seqlen), 7))
    bounds = [0, *cuts, seqlen]
    q, k, t = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if rng.random() < 0.25:
            continue
        k0 = rng.randrange(seqlen)
        q.append((a, b))
        k.append((k0, rng.randint(k0 + 1, seqlen)))
        t.append(rng.choice(list(MaskType)))
    return from_slices(q, k, t, seqlen, seqlen, name="random_slices")


def build_mask(name: str, seed: int) -> Mask:
    """A mask by name: a generator, block-sparse, random slices, or one of two with empty rows."""
    rng = random.Random(seed)
    if name in MASK_NAMES:
        kw: dict = {"window": 7}
        if name in DOC_MASKS:
            kw["seqlens"] = _seqlens(rng, SEQLEN)
        if name == "block_causal_document":
            kw["block_size"] = 6
        return make_mask(name, SEQLEN, seed=seed, **kw)
    if name == "uniform_block_sparse":
        return uniform_block_sparse(SEQLEN, 6, 0.3, seed=seed)
    if name == "random_slices":
        return random_slices(rng, SEQLEN)
    if name == "late_causal":  # bottom-right causal with lq > lk: the first 50 rows see nothing
        return from_slices([[0, SEQLEN]], [[0, 40]], [MaskType.CAUSAL], SEQLEN, name=name)
    if name == "empty_tail":  # the last third of the queries sees nothing
        return from_slices([[0, 60]], [[0, SEQLEN]], [MaskType.FULL], SEQLEN, name=name)
    raise ValueError(name)


# Given a seqlens list, as build_mask gives every document mask, the *_long generators build the
# masks full_document and causal_document build (test_torch_cp checks it): those two run instead.
SAME_AS = {"full_document_long": "full_document", "causal_document_long": "causal_document"}
GENERATORS = tuple(name for name in MASK_NAMES if name not in SAME_AS)
MASKS = (*GENERATORS, "uniform_block_sparse", "random_slices", "late_causal", "empty_tail")


def cases() -> list[Case]:
    """Strategies x layouts x masks; heads cycle through MHA/GQA; one bf16 case per strategy."""
    out = []
    n = 0
    for label, strategy, options, group, every_mask in STRATEGIES:
        for layout in LAYOUTS:
            for mask_name in MASKS if every_mask else FEW_MASKS:
                heads = HEADS[n % len(HEADS)]
                n += 1
                name = f"{label}/{layout}/{mask_name}/{heads[0]}:{heads[1]}"
                out.append(
                    Case(
                        name,
                        strategy,
                        options,
                        group,
                        layout,
                        mask_name,
                        heads,
                        "float32",
                        return_lse=n % 3 == 0,
                    )
                )
        out.append(
            Case(
                f"{label}/zigzag/causal_document/4:2/bf16",
                strategy,
                options,
                group,
                "zigzag",
                "causal_document",
                (4, 2),
                "bfloat16",
                return_lse=False,
            )
        )
        if label in SHARD_API:
            for mask_name in ("causal_document", "late_causal"):
                out.append(
                    Case(
                        f"{label}/zigzag/{mask_name}/4:2/shards",
                        strategy,
                        options,
                        group,
                        "zigzag",
                        mask_name,
                        (4, 2),
                        "float32",
                        return_lse=mask_name == "late_causal",
                        api="shards",
                    )
                )
    return out


def _inputs(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout (and dlse) drawn from one generator: identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = case.heads
    q = torch.randn(2, SEQLEN, hq, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(2, SEQLEN, hkv, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(2, SEQLEN, hkv, HEAD_DIM, generator=g, dtype=torch.float64)
    dout = torch.randn(2, SEQLEN, hq, HEAD_DIM, generator=g, dtype=torch.float64)
    dlse = torch.randn(2, hq, SEQLEN, generator=g, dtype=torch.float64)
    return q, k, v, dout, dlse


def _oracle(case: Case, mask: Mask, q, k, v, dout, dlse) -> dict[str, np.ndarray]:
    """float64 results: attn_masks' oracle, or torch_attn naive in fp64 when the LSE is used."""
    if not case.return_lse:
        ref = reference_attention(q.numpy(), k.numpy(), v.numpy(), mask, dout=dout.numpy())
        return {"out": ref.out, "lse": ref.lse, "dq": ref.dq, "dk": ref.dk, "dv": ref.dv}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = torch_attn.attention(*leaves, mask, impl="naive", return_lse=True)
    _loss(out, lse, dout, dlse).backward()
    res = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    return {key: t.detach().numpy() for key, t in res.items()}


def _loss(out, lse, dout, dlse):
    loss = (out.double() * dout).sum()
    if lse is not None:
        finite = torch.isfinite(lse)
        loss = loss + (torch.where(finite, lse.double(), 0.0) * dlse).sum()
    return loss


def _error(got: np.ndarray, ref: np.ndarray) -> float:
    """Max abs error relative to (1 + max |ref|); -inf entries must match exactly."""
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), finite) or np.isnan(got).any():
        return float("inf")
    scale = 1.0 + float(np.abs(ref[finite]).max(initial=0.0))
    return float(np.abs(got[finite] - ref[finite]).max(initial=0.0)) / scale


def _plan(case: Case, mask: Mask):
    """The plan attention() makes for this case (the same cached object)."""
    return torch_cp.get_plan(
        mask,
        GROUP_SIZE[case.group],
        case.strategy,
        case.layout,
        case.options.get("ulysses_size"),
        num_windows=case.options.get("num_windows"),
        inner_axis=case.options.get("inner_axis", "ulysses"),
        num_heads_q=case.heads[0],
        num_heads_kv=case.heads[1],
        head_dim=HEAD_DIM,
    )


def _forward(case: Case, mask: Mask, leaves: list[torch.Tensor], group):
    """(out, lse or None) in global order, through attention() or the shard-level API."""
    if case.api == "global":
        kw = dict(strategy=case.strategy, layout=case.layout, impl="naive", **case.options)
        res = torch_cp.attention(*leaves, mask, group=group, return_lse=case.return_lse, **kw)
        return res if case.return_lse else (res, None)
    plan = _plan(case, mask)
    shards = [torch_cp.dispatch(x, plan, group=group) for x in leaves]
    res = torch_cp.shard_attention(
        *shards, plan, group=group, impl="naive", return_lse=case.return_lse
    )
    if not case.return_lse:
        return torch_cp.undispatch(res, plan, group=group), None
    out, lse = res
    return torch_cp.undispatch(out, plan, group=group), torch_cp.undispatch(
        lse, plan, group=group, dim=2
    )


def _oracle_path(index: int) -> str:
    """Where share_oracles saves case `index`'s float64 oracle for every rank to read."""
    return os.path.join(os.environ["CP_TEST_OUT"], f"oracle{index}.npz")


def share_oracles(todo: list[tuple[int, Case]], seed: int, rank: int, world: int) -> None:
    """Compute the float64 oracle of every world-th case (the inputs and the mask are the same on
    every rank, so so is the oracle) into CP_TEST_OUT, then wait for the other ranks' share: each
    oracle is computed once instead of on every rank. A case whose oracle fails here is left to
    run_case, which computes it again and reports the exception."""
    for index, case in todo[rank::world]:
        try:
            mask = build_mask(case.mask_name, seed + index)
            ref = _oracle(case, mask, *_inputs(case, seed + index))
        except Exception:
            continue
        np.savez(_oracle_path(index) + ".tmp.npz", **ref)
        os.replace(_oracle_path(index) + ".tmp.npz", _oracle_path(index))
    dist.barrier()


def run_case(case: Case, seed: int, group, index: int | None = None) -> dict:
    """Run one case on this rank: errors vs the oracle (the one share_oracles saved for case
    `index`, if any), sent bytes vs the plan."""
    mask = build_mask(case.mask_name, seed)
    q, k, v, dout, dlse = _inputs(case, seed)
    dtype = getattr(torch, case.dtype)
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    torch_cp.reset_sent_bytes()
    out, lse = _forward(case, mask, leaves, group)
    fwd = torch_cp.sent_bytes()
    _loss(out, lse, dout, dlse if case.return_lse else None).backward()
    sent = torch_cp.sent_bytes()
    plan = _plan(case, mask)
    vol = plan.comm_volume(itemsize=leaves[0].element_size(), batch=q.shape[0])
    got = {"out": out, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    if lse is not None:
        got["lse"] = lse
    path = None if index is None else _oracle_path(index)
    if path is not None and os.path.exists(path):
        with np.load(path) as saved:
            ref = dict(saved)
    else:
        ref = _oracle(case, mask, q, k, v, dout, dlse)
    errors = {key: _error(t.detach().double().numpy(), ref[key]) for key, t in got.items()}
    return {
        "errors": errors,
        "sent": {"fwd": fwd["fwd"], "bwd": sent["bwd"]},
        "plan": {"fwd": vol["fwd_bytes"], "bwd": vol["bwd_bytes"]},
    }


def bad_heads(heads: tuple[int, int]) -> str:
    """The error Ulysses over all ranks raises for heads it cannot split ("" if none)."""
    hq, hkv = heads
    x = torch.zeros(1, SEQLEN, hq, HEAD_DIM)
    kv = torch.zeros(1, SEQLEN, hkv, HEAD_DIM)
    try:
        torch_cp.attention(x, kv, kv, build_mask("causal", 0), strategy="ulysses", impl="naive")
    except ValueError as e:
        return str(e)
    return ""


def main() -> None:
    """Run every case this rank takes part in; one JSON line per case into CP_TEST_OUT/rank*."""
    torch_cp.init_distributed(timeout_s=240)
    rank = dist.get_rank()
    seed = int(os.environ["CP_TEST_SEED"])
    only = os.environ.get("CP_TEST_FILTER", "")
    groups = {
        "world": None,
        "copy": dist.new_group(list(range(4))),
        "pair": dist.new_group(list(SUBGROUP)),
    }
    todo = [(i, case) for i, case in enumerate(cases()) if only in case.name]
    share_oracles(todo, seed, rank, dist.get_world_size())
    path = os.path.join(os.environ["CP_TEST_OUT"], f"rank{rank}.jsonl")
    with open(path, "w") as f:
        for i, case in todo:
            if case.group == "pair" and rank not in SUBGROUP:
                continue
            try:
                rec = run_case(case, seed + i, groups[case.group], i)
            except Exception:
                rec = {"exception": traceback.format_exc()}
            f.write(json.dumps({"case": case.name, "rank": rank, **rec}) + "\n")
            f.flush()
        for heads, _ in BAD_HEADS:
            f.write(json.dumps({"bad_heads": heads, "rank": rank, "error": bad_heads(heads)}))
            f.write("\n")
        f.write(json.dumps({"done": True, "rank": rank, "jax": "jax" in sys.modules}) + "\n")
    leave_group()


if __name__ == "__main__":
    main()
