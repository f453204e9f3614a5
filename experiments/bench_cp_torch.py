"""GPU benchmark of PyTorch context parallelism: every strategy x layout under torchrun.

For each (tokens per GPU, mask, strategy, layout, impl, mode) it builds the shared plan, draws
random shards on every rank, checks a few global query rows (out, lse, and dq for fwd_bwd)
against a float32 computation on rank 0, times `torch_cp.shard_attention` on the shards (the
slowest rank per call), and rank 0 appends one JSON line to --out: per-GPU TFLOP/s (global mask
FLOPs / N / slowest-rank median time), the single-GPU rate of the same impl on the per-GPU
problem (the mask at tokens-per-GPU length, every GPU alone), peak memory per GPU, the plan's
bytes moved and the bytes this executor really sent. An impl that cannot run some rank's mask
piece (sdpa_cudnn/sdpa_flash take only full or square causal pieces) is recorded "unsupported".

  torchrun --standalone --nproc-per-node=8 experiments/bench_cp_torch.py --out cp_torch.jsonl
  torchrun --standalone --nproc-per-node=8 experiments/bench_cp_torch.py --out cp_torch.jsonl \
      --impls flex,sdpa_cudnn --tokens_per_gpu 8192,16384,32768,65536 --max_minutes 0
  srun --ntasks-per-node=8 --gpus-per-node=8 python experiments/bench_cp_torch.py --out x.jsonl

Points already in --out (same world size) are skipped, so a run that died (an OOM inside a
collective cannot be recovered on every rank) resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.bench_cp_common import (
    Deadline,
    check_rows,
    csv_list,
    failed_checks,
    parse,
    parser,
    rel_err,
    sweep,
)

KEY_FIELDS = ("world_size", "tokens_per_gpu", "mask", "strategy", "layout", "impl", "mode")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (comma-separated lists)."""
    p = parser(
        __doc__.split("\n\n")[0],
        out_help="JSON-lines file rank 0 appends to",
        check_rows=16,
        max_minutes=0,
    )
    p.add_argument(
        "--impls",
        type=csv_list,
        default=["flex"],
        help="e.g. flex,sdpa_cudnn,sdpa_flash",
    )
    p.add_argument("--num_windows", type=int, default=0, help="double_ring W (0: default)")
    return parse(p, argv)


def status_of(e: BaseException, *, planning: bool = False) -> str:
    """oom / unsupported / error; while planning, a ValueError (a strategy that cannot split
    these heads or this mask) is unsupported, as the JAX benchmark records it."""
    import torch_attn

    if isinstance(e, torch_attn.Unsupported) or (planning and isinstance(e, ValueError)):
        return "unsupported"
    return "oom" if "out of memory" in str(e).lower() else "error"


class Bench:
    """One sweep on every rank: device, shards, checks, timing; rank 0 writes the records."""

    def __init__(self, args: argparse.Namespace):
        import torch
        import torch.distributed as dist

        from experiments import provenance, timing
        from shard_strategies import torch_cp

        self.torch, self.dist, self.timing, self.cp = torch, dist, timing, torch_cp
        self.args = args
        self.device = torch_cp.init_distributed(timeout_s=600)
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.dtype = getattr(torch, args.dtype)
        self.meta = {
            "framework": "torch",
            "world_size": self.n,
            "heads_q": args.heads_q,
            "heads_kv": args.heads_kv,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "inner_axis": args.inner_axis,
            "versions": provenance.package_versions(),
            "devices": provenance.torch_devices(),
            "git": provenance.git_state(),
        }
        self.single: dict[tuple, dict] = {}
        self.done = self._done_keys()

    def _done_keys(self) -> set[tuple]:
        if not os.path.exists(self.args.out):
            return set()
        with open(self.args.out) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        return {tuple(r.get(k) for k in KEY_FIELDS) for r in recs if r.get("framework") == "torch"}

    def write(self, record: dict) -> None:
        """Rank 0 appends one line (with the run's metadata) and prints a summary."""
        if self.rank != 0:
            return
        rec = {**self.meta, **record, "time": time.time()}
        with open(self.args.out, "a") as f:
            f.write(json.dumps(rec, default=float) + "\n")
        brief = {k: record.get(k) for k in (*KEY_FIELDS[1:], "status")}
        nums = {k: record[k] for k in ("tflops_per_gpu", "single_gpu_tflops") if k in record}
        print(brief, nums, record.get("error", "")[:200], flush=True)

    def agree(self, fn, *, planning: bool = False):
        """Run fn here, then raise on every rank if it failed on any (with the first reason)."""
        try:
            result, mine = fn(), None
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"[:2000]
            result, mine = None, (status_of(e, planning=planning), reason)
            if mine[0] == "error":
                traceback.print_exc()
        everyone: list = [None] * self.n
        self.dist.all_gather_object(everyone, mine)
        for r, failure in enumerate(everyone):
            if failure is not None:
                raise PointError(failure[0], f"rank {r}: {failure[1]}")
        return result

    def shards(self, plan) -> list:
        """Random local q, k, v, do of this rank (different on every rank)."""
        a, torch = self.args, self.torch
        g = torch.Generator(device=self.device).manual_seed(a.seed * 1000 + self.rank)
        shapes = [(1, plan.local_len, h, a.head_dim) for h in (a.heads_q, a.heads_kv)]
        shapes = [shapes[0], shapes[1], shapes[1], shapes[0]]
        return [torch.randn(s, generator=g, device=self.device, dtype=self.dtype) for s in shapes]

    def call(self, plan, impl: str, mode: str, q, k, v, do):
        """One timed unit: forward (out, lse), or forward + backward (out, lse, dq, dk, dv)."""
        torch, cp = self.torch, self.cp
        if mode == "fwd":
            with torch.no_grad():
                return cp.shard_attention(q, k, v, plan, impl=impl, return_lse=True)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = cp.shard_attention(*leaves, plan, impl=impl, return_lse=True)
        return (out, lse, *torch.autograd.grad(out, leaves, do))

    def rows(self, plan, rows, local) -> object:
        """Global rows (R, ...) of a sharded tensor (1, L, ...) summed over ranks (fp32)."""
        torch = self.torch
        slot = plan.inverse()[rows]
        mine = slot // plan.local_len == self.rank
        buf = torch.zeros((len(rows), *local.shape[2:]), dtype=torch.float32, device=self.device)
        idx = torch.as_tensor(slot[mine] % plan.local_len, device=self.device)
        buf[torch.as_tensor(mine, device=self.device)] = local[0, idx].float()
        self.dist.all_reduce(buf)
        return buf

    def check(self, plan, mask, q, k, v, do, outs, mode: str) -> dict:
        """Max relative errors of a few global rows vs float32 on rank 0 (same dict everywhere)."""
        torch = self.torch
        rows = check_rows(mask.seqlen_q, self.args.check_rows)
        with torch.no_grad():
            kg, vg = (self.cp.undispatch(x, plan)[0] for x in (k, v))
            lse_local = outs[1].transpose(1, 2)
            got = {"out": self.rows(plan, rows, outs[0]), "lse": self.rows(plan, rows, lse_local)}
            if mode == "fwd_bwd":
                got["dq"] = self.rows(plan, rows, outs[2])
            qr, dor = self.rows(plan, rows, q), self.rows(plan, rows, do)
        errors = [None]
        if self.rank == 0:
            want = rows_reference(torch, mask, rows, qr, kg, vg, dor, self.args.head_dim)
            errors[0] = {key: rel_err(got[key].cpu(), want[key].cpu()) for key in got}
        self.dist.broadcast_object_list(errors)
        return errors[0]

    def timed(self, fn) -> dict:
        """Slowest-rank per-call times (ms), their stats, and per-GPU peak memory (GiB, CUDA)."""
        torch = self.torch
        times, peak = self.timing.torch_time_calls(
            fn,
            warmup=self.args.warmup,
            iters=self.args.iters,
            device=self.device,
            barrier=self.dist.barrier,
        )
        t = torch.tensor(times, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        peaks: list = [None] * self.n
        self.dist.all_gather_object(peaks, peak)
        known = [p for p in peaks if p is not None]
        return {
            "time_ms": self.timing.time_stats(t.tolist()),
            "peak_gib_max": max(known) if known else None,
            "peak_gib_mean": sum(known) / len(known) if known else None,
        }

    def single_gpu(self, name: str, tokens: int, impl: str, mode: str) -> dict:
        """The same impl with the mask at tokens-per-GPU length on each GPU alone (no comm)."""
        key = (name, tokens, impl, mode)
        if key in self.single:
            return self.single[key]
        import torch_attn
        from attn_masks import attention_flops, make_mask

        torch, a = self.torch, self.args
        mask = make_mask(name, tokens, seed=a.seed)
        g = torch.Generator(device=self.device).manual_seed(a.seed)
        q, do = (
            torch.randn(
                1, tokens, a.heads_q, a.head_dim, generator=g, device=self.device, dtype=self.dtype
            )
            for _ in range(2)
        )
        k, v = (
            torch.randn(
                1, tokens, a.heads_kv, a.head_dim, generator=g, device=self.device, dtype=self.dtype
            )
            for _ in range(2)
        )

        def run():
            if mode == "fwd":
                with torch.no_grad():
                    return torch_attn.attention(q, k, v, mask, impl=impl)
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = torch_attn.attention(*leaves, mask, impl=impl)
            return torch.autograd.grad(out, leaves, do)

        try:
            stats = self.agree(lambda: self.timed(run))
            flops = attention_flops(mask, a.heads_q, a.head_dim, mode)
            res = {
                "single_gpu_tflops": self.timing.tflops_stats(flops, stats["time_ms"])["median"],
                "single_gpu_ms": stats["time_ms"]["median"],
                "single_gpu_peak_gib": stats["peak_gib_max"],
            }
        except PointError as e:
            res = {"single_gpu_status": e.status, "single_gpu_error": e.reason[:300]}
        self.single[key] = res
        return res

    def point(self, name: str, mask, tokens: int, strategy: str, layout: str, impl: str) -> None:
        """All modes of one (mask, tokens, strategy, layout, impl): plan, check, time, record."""
        from attn_masks import attention_flops

        a, cp = self.args, self.cp
        base = {
            "tokens_per_gpu": tokens,
            "seqlen": mask.seqlen_q,
            "mask": name,
            "strategy": strategy,
            "layout": layout,
            "impl": impl,
        }
        modes = [
            m
            for m in a.modes
            if tuple({**self.meta, **base, "mode": m}[k] for k in KEY_FIELDS) not in self.done
        ]
        if not modes:
            return
        t0 = time.perf_counter()
        try:
            plan = self.agree(
                lambda: cp.get_plan(
                    mask,
                    self.n,
                    strategy,
                    layout,
                    a.ulysses_size or None,
                    num_windows=(a.num_windows or None) if strategy == "double_ring" else None,
                    inner_axis=a.inner_axis,
                    num_heads_q=a.heads_q,
                    num_heads_kv=a.heads_kv,
                    head_dim=a.head_dim,
                ),
                planning=True,
            )
            self.agree(lambda: cp.bind(plan, None, impl), planning=True)
        except PointError as e:
            for mode in modes:
                self.write({**base, "mode": mode, "status": e.status, "error": e.reason})
            return
        itemsize = self.torch.finfo(self.dtype).bits // 8
        info = {
            "plan": plan.summary(),
            "plan_seconds": time.perf_counter() - t0,
            "comm": plan.comm_volume(itemsize=itemsize),
        }
        q, k, v, do = self.shards(plan)
        for mode in modes:
            rec = {**base, "mode": mode, **info}
            try:
                rec.update(self.measure(plan, mask, impl, mode, q, k, v, do))
                flops = attention_flops(mask, a.heads_q, a.head_dim, mode)
                tflops = self.timing.tflops_stats(flops / self.n, rec["time_ms"])
                rec.update(
                    status="ok",
                    tflops_per_gpu=tflops["median"],
                    **self.single_gpu(name, tokens, impl, mode),
                )
            except PointError as e:
                rec.update(status=e.status, error=e.reason)
            self.write(rec)

    def measure(self, plan, mask, impl: str, mode: str, q, k, v, do) -> dict:
        """First call (compiles, counts bytes), the row check, then the timed calls."""
        cp = self.cp
        rec: dict = {}

        def first():
            cp.reset_sent_bytes()
            t1 = time.perf_counter()
            outs = self.call(plan, impl, mode, q, k, v, do)
            if self.device.type == "cuda":
                self.torch.cuda.synchronize(self.device)
            rec["first_call_seconds"] = time.perf_counter() - t1
            rec["sent_bytes"] = cp.sent_bytes()
            return outs

        outs = [self.agree(first)]
        if self.args.check_rows:
            rec["check"] = self.agree(lambda: self.check(plan, mask, q, k, v, do, outs[0], mode))
            bad = failed_checks(rec["check"])
            if bad:
                raise PointError("wrong", f"errors {bad}")
        outs.clear()
        rec.update(self.agree(lambda: self.timed(lambda: self.call(plan, impl, mode, q, k, v, do))))
        return rec

    def run(self) -> None:
        """Every point in order; stops starting new points after --max_minutes."""
        a = self.args
        deadline = Deadline(a.max_minutes)
        for tokens, name, mask, strategy, layout in sweep(a, self.n):
            for impl in a.impls:
                if deadline.passed():
                    self.write({"status": "stopped", "error": "--max_minutes reached"})
                    return
                self.point(name, mask, tokens, strategy, layout, impl)


class PointError(Exception):
    """A point's outcome agreed by every rank: status (oom/unsupported/wrong/error) and reason."""

    def __init__(self, status: str, reason: str):
        super().__init__(f"{status}: {reason}")
        self.status, self.reason = status, reason


def rows_reference(torch, mask, rows, q, k, v, do, head_dim: int) -> dict:
    """float32 out (R,Hq,D), lse (R,Hq), dq of global rows against their visible keys only."""
    lo, hi = mask.row_intervals()
    scale = head_dim**-0.5
    hkv = k.shape[1]
    out, lse, dq = [], [], []
    for i, row in enumerate(rows.tolist()):
        idx = torch.cat(
            [torch.arange(a, b) for a, b in zip(lo[row], hi[row]) if b > a]
            or [torch.zeros(0, dtype=torch.long)]
        ).to(k.device)
        kk, vv = k[idx].float(), v[idx].float()
        qg = q[i].view(hkv, -1, q.shape[-1])
        dog = do[i].view(hkv, -1, q.shape[-1])
        s = torch.einsum("hgd,nhd->hgn", qg, kk) * scale
        m = (
            torch.logsumexp(s, -1)
            if idx.numel()
            else torch.full(s.shape[:2], float("-inf"), device=k.device)
        )
        p = torch.exp(s - m[..., None]) if idx.numel() else torch.zeros_like(s)
        o = torch.einsum("hgn,nhd->hgd", p, vv)
        dp = torch.einsum("hgd,nhd->hgn", dog, vv)
        ds = p * (dp - (dog * o).sum(-1, keepdim=True))
        out.append(o.reshape(-1, q.shape[-1]))
        lse.append(m.reshape(-1))
        dq.append((torch.einsum("hgn,nhd->hgd", ds, kk) * scale).reshape(-1, q.shape[-1]))
    return {"out": torch.stack(out), "lse": torch.stack(lse), "dq": torch.stack(dq)}


def main(argv: list[str] | None = None) -> None:
    """Run the sweep the flags describe on every rank, then leave the process group."""
    bench = Bench(parse_args(argv))
    bench.run()
    bench.dist.barrier()  # no rank tears gloo down while another still talks to it
    bench.dist.destroy_process_group()


if __name__ == "__main__":
    main()
