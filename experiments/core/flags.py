"""Command-line flags of run.py (absl) with validators, and their conversion to grids/settings.

Flags left unset take the preset's value; an explicitly given flag replaces it in every grid.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from absl import flags

from attn_masks import MODES
from experiments.core import points, presets, tuning
from shard_strategies import LAYOUTS

FLAGS = flags.FLAGS

_SEQLEN = re.compile(r"^(\d+)([kKmM]?)$")


def _usable_cpus() -> int:
    """CPUs this process may run on (a container's limit where the OS says it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this OS
        return os.cpu_count() or 1


# --sim_compile_threads' default: threads compiling the CP predictor's step programs ahead
COMPILE_THREADS = min(8, _usable_cpus())


def parse_seqlen(text: str) -> int:
    """'8K' -> 8192, '1M' -> 1048576, '512' -> 512."""
    m = _SEQLEN.match(text.strip())
    if not m:
        raise ValueError(f"bad seqlen {text!r}: expected an integer with optional K or M suffix")
    value = int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"seqlen must be positive, got {text!r}")
    return value


def _choices(values: list[str] | None, valid: tuple[str, ...], what: str, allow_all=False) -> bool:
    for v in values or []:
        if v == points.ALL and allow_all:
            continue
        if v not in valid:
            extra = ", all" if allow_all else ""
            raise flags.ValidationError(
                f"unknown {what} {v!r}; valid values: {', '.join(valid)}{extra}"
            )
    return True


def _mask_names() -> tuple[str, ...]:
    try:
        from attn_masks import MASK_NAMES
    except ImportError:
        return presets.ALL_MASKS
    return tuple(MASK_NAMES)


def _check_masks(values: list[str] | None) -> bool:
    return _choices(values, _mask_names(), "mask", allow_all=True)


def _check_seqlens(values: list[str] | None) -> bool:
    for v in values or []:
        try:
            parse_seqlen(v)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
    return True


def _check_tune(value: str | None) -> bool:
    try:
        tuning.parse_space(value or "")
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True


def _check_positive_ints(values: list[str] | None, what: str) -> bool:
    for v in values or []:
        if not v.isdigit() or int(v) <= 0:
            raise flags.ValidationError(f"bad {what} {v!r}: expected a positive integer")
    return True


SIM_DEVICES = (2, 128)  # the --simulate_devices range
MIN_TIMED_CALLS = 4  # --sim_timed_calls, if not 0: a call per feature of the CP cost model, +1
SIM_TIMED_CALLS = 8  # its default
SIM_VALIDATION_SHARE = 0.25  # --sim_validation_share's default
GPUS_PER_NODE = (1, 1024)


def _check_simulate_devices(values: list[str] | None) -> bool:
    lo, hi = SIM_DEVICES
    for v in values or []:
        if not v.strip().isdigit() or not lo <= int(v) <= hi:
            raise flags.ValidationError(
                f"bad --simulate_devices value {v!r}: expected an integer from {lo} to {hi}"
            )
    return True


def _check_bandwidth(name: str, value: float) -> bool:
    if not value > 0:
        raise flags.ValidationError(f"bad --{name}={value:g}: expected GB/s > 0 (inf allowed)")
    return True


def _check_latency(name: str, value: float) -> bool:
    if not 0 <= value < float("inf"):
        raise flags.ValidationError(f"bad --{name}={value:g}: expected microseconds >= 0, finite")
    return True


def _check_gpus_per_node(value: int) -> bool:
    lo, hi = GPUS_PER_NODE
    if not lo <= value <= hi:
        raise flags.ValidationError(
            f"bad --gpus_per_node={value}: expected an integer from {lo} to {hi}"
        )
    return True


def _check_timed_calls(value: int) -> bool:
    if 0 < value < MIN_TIMED_CALLS:
        raise flags.ValidationError(
            f"bad --sim_timed_calls={value}: expected 0 (time every call) or at least "
            f"{MIN_TIMED_CALLS}"
        )
    return True


def _check_validation_share(value: float) -> bool:
    if not 0.0 < value <= 1.0:
        raise flags.ValidationError(
            f"bad --sim_validation_share={value}: expected a share in (0, 1]"
        )
    return True


def _check_max_seqlen(value: str | None) -> bool:
    if value is None:
        return True
    try:
        parse_seqlen(value)
    except ValueError as e:
        raise flags.ValidationError(f"--sim_baseline_max_seqlen: {e}") from None
    return True


def _define_simulation_flags() -> None:
    """The flags of --simulate_devices: the simulated sizes and the link model."""
    from shard_strategies.simulate import LinkModel

    h200 = LinkModel()
    flags.DEFINE_list(
        "simulate_devices",
        None,
        "Predict CP on these device counts (list, 2-128) from this one device: every rank's "
        "local work of every step is run and timed here, communication is modelled by the "
        "--link_* flags. One --framework at a time. Default: the preset's (cp_predict: "
        "8,16,32,64), else none.",
    )
    flags.DEFINE_integer(
        "gpus_per_node",
        h200.gpus_per_node,
        "Simulated GPUs per node (links between nodes: --link_inter_node_gbps).",
    )
    links = {
        "link_p2p_gbps": (h200.p2p_gbps, "intra-node point-to-point (ppermute) GB/s per GPU"),
        "link_alltoall_gbps": (h200.alltoall_gbps, "intra-node all-to-all GB/s per GPU"),
        "link_allgather_gbps": (
            h200.allgather_gbps,
            "intra-node ring collective (all-gather, reduce-scatter, all-reduce) bus GB/s",
        ),
        "link_inter_node_gbps": (h200.inter_node_gbps, "GB/s per GPU between nodes"),
    }
    for name, (default, what) in links.items():
        flags.DEFINE_float(name, default, f"Simulated link: {what} (H200 default).")
        flags.register_validator(name, lambda v, n=name: _check_bandwidth(n, v))
    lat = {"link_latency_us": h200.latency_us, "link_inter_latency_us": h200.inter_latency_us}
    for name, default in lat.items():
        where = "between nodes" if "inter" in name else "within a node"
        flags.DEFINE_float(name, default, f"Simulated per-message latency {where} (us).")
        flags.register_validator(name, lambda v, n=name: _check_latency(n, v))
    flags.DEFINE_string(
        "sim_baseline_max_seqlen",
        None,
        "Longest whole sequence timed on one device as a simulated point's efficiency baseline; "
        "a longer problem's baseline is its mask's TFLOP/s at this length (status 'scaled'). "
        "Default: 128K on a GPU (a 512K forward+backward call takes about a minute), 2K on a "
        "CPU, whose dense reference impl needs a minute per call at 8K.",
    )
    flags.DEFINE_integer(
        "sim_timed_calls",
        SIM_TIMED_CALLS,
        "Calls timed per class of simulated calls (same kernel call and shapes, only the mask "
        "piece differs) to fit its cost model; the rest are predicted from their pieces' "
        "schedule spans, and 4 more timed calls per checked class (--sim_validation_share) "
        "measure the model's error; at later points the class's fit predicts the calls its "
        "timed ones span, times the others, and holds out 1 call of a checked class. 0 times "
        f"every distinct call; otherwise at least {MIN_TIMED_CALLS} (one per feature of the "
        "model, and one more).",
        lower_bound=0,
    )
    flags.register_validator("sim_timed_calls", _check_timed_calls)
    flags.DEFINE_float(
        "sim_validation_share",
        SIM_VALIDATION_SHARE,
        "Share of the classes of simulated calls whose cost model is checked on timed calls "
        "held out of its fit (4 a class fitted on its own calls, then 1 at each later point its "
        "fit serves; 1 a class predicted from its kind's model); the others are predicted "
        "without that check. Drawn by the class's name (the same classes in every process), "
        "and a kind's first modelled class until one of the kind was checked; records and "
        "reports state the error of the checked ones. 1 checks every class.",
    )
    flags.register_validator("sim_validation_share", _check_validation_share)
    flags.DEFINE_integer(
        "sim_compile_threads",
        COMPILE_THREADS,
        "Threads that compile a simulated point's new step programs (and at a problem's first "
        "point those of the points after it of the same problem) side by side before they "
        "run, and the next problem's while the problem's checks run (never while calls are "
        "timed); 0 compiles each on first use and checks each point at its turn instead. "
        "Default: 8, or fewer usable CPUs.",
        lower_bound=0,
    )
    flags.register_validator("simulate_devices", _check_simulate_devices)
    flags.register_validator("gpus_per_node", _check_gpus_per_node)
    flags.register_validator("sim_baseline_max_seqlen", _check_max_seqlen)


def define_flags() -> None:
    """Register every run.py flag on the global absl FLAGS (once)."""
    if "framework" in FLAGS:
        return
    flags.DEFINE_enum("framework", "jax", [*points.FRAMEWORKS, "both"], "Framework(s) to measure.")
    flags.DEFINE_enum(
        "workload",
        "attention",
        ["attention", "train_step"],
        "What to measure: attention calls, or a Transformer LM training step.",
    )
    flags.DEFINE_list(
        "impl",
        None,
        "Kernel impls (comma list) or 'all' = every impl that supports the point. "
        "Default: all for kernel sweeps, the strategy's default kernel under CP.",
    )
    flags.DEFINE_list(
        "cp",
        None,
        f"Context parallelism: {'|'.join(points.CP_CHOICES)} (comma list, or all). "
        "Default: from the preset.",
    )
    flags.DEFINE_list("layout", None, f"CP token layout: {'|'.join(LAYOUTS)} (list).")
    flags.DEFINE_list("mask", None, "Mask names (comma list) or 'all'.")
    flags.DEFINE_list(
        "seqlen",
        None,
        "Sequence lengths, K/M suffix accepted (8K = 8192). Under CP: tokens per device "
        "(--cp_scaling=weak, the default), or the total with --cp_scaling=strong.",
    )
    flags.DEFINE_enum("cp_scaling", None, list(points.SCALINGS), "CP scaling (default weak).")
    flags.DEFINE_integer("batch", None, "Batch size.", lower_bound=1)
    flags.DEFINE_list(
        "heads_q", None, "Query heads (list, zipped with --heads_kv; alone it means MHA)."
    )
    flags.DEFINE_list(
        "heads_kv", None, "Key/value heads (list; each Hq a multiple; alone it means MHA)."
    )
    flags.DEFINE_integer("head_dim", None, "Head dimension.", lower_bound=1)
    flags.DEFINE_enum("dtype", None, list(points.DTYPES), "Input dtype.")
    flags.DEFINE_list("mode", None, f"Directions: {'|'.join(MODES)} (comma list).")
    flags.DEFINE_integer("warmup", None, "Untimed warm-up calls per mask.", lower_bound=0)
    flags.DEFINE_integer("iters", None, "Timed calls per mask.", lower_bound=1)
    flags.DEFINE_integer(
        "chain_ms",
        None,
        "0: time one call at a time (JAX: wall time to its result; torch: CUDA events); N > 0: "
        "each timed sample is a chain of back-to-back calls of about N ms, less the L2 "
        "flushes' time, so the host's launch and wait are paid once a chain in both frameworks.",
        lower_bound=0,
    )
    flags.DEFINE_integer("seed", 42, "Seed of the mask stream (as MaskIterator) and inputs.")
    flags.DEFINE_integer("num_masks", None, "Masks drawn per point.", lower_bound=1)
    flags.DEFINE_integer("window", None, "Sliding-window size.", lower_bound=0)
    flags.DEFINE_bool("reference_compat", None, "Reproduce the published (buggy) masks.")
    flags.DEFINE_enum(
        "preset",
        "smoke",
        list(presets.PRESETS),
        "Sweep preset (smoke|paper|full|cp_bench|tune_pallas|cp_predict).",
    )
    flags.DEFINE_string(
        "tune",
        None,
        "Pallas tuning space of kernel grids (pallas points), space-separated key=v1,v2 items: "
        f"{', '.join(tuning.SPACE_DEFAULTS)}. Default: the tune_pallas preset's "
        "(block_q=64,128 block_k=64,128 num_warps=4,8 num_stages=2,3 bwd_splits=1,2), "
        "no tuning in the other presets.",
    )
    flags.DEFINE_string(
        "out_dir",
        None,
        "Output folder (default results/local/<run name>); rerunning into the same folder resumes.",
    )
    flags.DEFINE_integer(
        "num_devices",
        0,
        "CP size (0 = all JAX devices; torch: all GPUs or 4 CPU gloo ranks).",
        lower_bound=0,
    )
    flags.DEFINE_integer(
        "ulysses_size",
        0,
        "Ulysses group size for usp/double_ring (0 = the strategy's default).",
        lower_bound=0,
    )
    flags.DEFINE_bool(
        "ulysses_intra_node",
        True,
        "Place Ulysses groups on consecutive devices "
        "(same node) and the ring across; False = the reverse.",
    )
    flags.DEFINE_string("coordinator_address", None, "JAX multi-host coordinator host:port.")
    flags.DEFINE_integer("num_processes", None, "JAX multi-host process count.", lower_bound=1)
    flags.DEFINE_integer("process_id", None, "JAX multi-host process id.", lower_bound=0)
    flags.DEFINE_float(
        "check_rtol",
        None,
        "Relative error threshold of the correctness check "
        "(default per dtype: bf16 2e-2, fp16 1e-2, fp32 1e-4 on CPU).",
    )
    flags.DEFINE_bool("retry_errors", False, "Re-run points recorded with status error.")
    flags.DEFINE_bool("report", True, "Write CSV/plots/markdown after the sweep.")
    flags.DEFINE_bool("dry_run", False, "List the planned points and exit without running.")
    flags.DEFINE_bool(
        "allow_slow",
        False,
        "Run a GPU-sized preset (paper, full, cp_bench, tune_pallas) on a CPU anyway; refused "
        "otherwise, since it takes many hours there.",
    )
    flags.DEFINE_float(
        "time_budget",
        0.0,
        "Seconds after which the sweep stops at the next point boundary (0: no limit); the "
        "same command continues it. For grids longer than one time slot.",
        lower_bound=0.0,
    )
    _define_simulation_flags()

    flags.register_validator("cp", lambda v: _choices(v, points.CP_CHOICES, "cp", True))
    flags.register_validator("layout", lambda v: _choices(v, LAYOUTS, "layout"))
    flags.register_validator("mode", lambda v: _choices(v, MODES, "mode"))
    flags.register_validator("mask", _check_masks)
    flags.register_validator("seqlen", _check_seqlens)
    flags.register_validator("tune", _check_tune)
    flags.register_validator("heads_q", lambda v: _check_positive_ints(v, "heads_q"))
    flags.register_validator("heads_kv", lambda v: _check_positive_ints(v, "heads_kv"))
    flags.register_multi_flags_validator(
        ["heads_q", "heads_kv"], _check_heads, "heads_q/heads_kv mismatch"
    )


def _heads_pairs(hq: list[str] | None, hkv: list[str] | None) -> list[tuple[int, int]] | None:
    if hq is None and hkv is None:
        return None
    hq = [int(x) for x in hq] if hq else None
    hkv = [int(x) for x in hkv] if hkv else None
    hq = hq or hkv
    hkv = hkv or hq
    if len(hq) != len(hkv) and 1 not in (len(hq), len(hkv)):
        raise ValueError(f"--heads_q has {len(hq)} values and --heads_kv {len(hkv)}")
    n = max(len(hq), len(hkv))
    pairs = [(hq[i % len(hq)], hkv[i % len(hkv)]) for i in range(n)]
    for a, b in pairs:
        if a % b:
            raise ValueError(f"heads_q={a} must be a multiple of heads_kv={b}")
    return pairs


def _check_heads(values: dict) -> bool:
    try:
        _heads_pairs(values["heads_q"], values["heads_kv"])
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True


@dataclass(frozen=True)
class Settings:
    """Run-wide settings (not grid axes), picklable for spawned CP workers."""

    frameworks: tuple[str, ...]
    workload: str
    preset: str
    seed: int
    out_dir: str
    num_devices: int
    ulysses_size: int | None
    ulysses_intra_node: bool
    check_rtol: float | None
    retry_errors: bool
    report: bool
    dry_run: bool
    time_budget: float
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    flag_values: dict
    simulate_devices: tuple[int, ...] = ()
    link: str = ""
    sim_baseline_max_seqlen: int | None = None
    sim_timed_calls: int = 0
    sim_validation_share: float = 1.0
    sim_compile_threads: int = COMPILE_THREADS
    allow_slow: bool = False


def requested_cps() -> tuple[str, ...] | None:
    """--cp as a tuple ('all' expanded), or None when not given."""
    if FLAGS.cp is None:
        return None
    out: list[str] = []
    for c in FLAGS.cp:
        out += list(points.CP_STRATEGIES) if c == points.ALL else [c]
    return tuple(dict.fromkeys(out))


def grid_overrides() -> dict:
    """Grid fields given explicitly on the command line."""
    o: dict = {}
    if FLAGS.impl is not None:
        o["impls"] = tuple(FLAGS.impl)
    if FLAGS.layout is not None:
        o["layouts"] = tuple(FLAGS.layout)
    if FLAGS.mask is not None:
        o["masks"] = _mask_names() if points.ALL in FLAGS.mask else tuple(FLAGS.mask)
    if FLAGS.seqlen is not None:
        o["seqlens"] = tuple(parse_seqlen(s) for s in FLAGS.seqlen)
    heads = _heads_pairs(FLAGS.heads_q, FLAGS.heads_kv)
    if heads is not None:
        o["heads"] = tuple(heads)
    if FLAGS.mode is not None:
        o["modes"] = tuple(dict.fromkeys(FLAGS.mode))
    simple = {
        "cp_scaling": "scaling",
        "batch": "batch",
        "head_dim": "head_dim",
        "dtype": "dtype",
        "warmup": "warmup",
        "iters": "iters",
        "chain_ms": "chain_ms",
        "num_masks": "num_masks",
        "window": "window",
        "reference_compat": "reference_compat",
        "tune": "tune",
    }
    for flag, field in simple.items():
        if FLAGS[flag].value is not None:
            o[field] = FLAGS[flag].value
    return o


def default_out_dir() -> str:
    """A folder named after the run, so the same command resumes into the same folder."""
    cps = requested_cps()
    cp = "-".join(cps) if cps else "default"
    sim = "-sim" if FLAGS.simulate_devices else ""
    return f"results/local/{FLAGS.preset}-{FLAGS.framework}-{cp}{sim}"


def settings() -> Settings:
    """Run-wide settings from the parsed flags."""
    frameworks = points.FRAMEWORKS if FLAGS.framework == "both" else (FLAGS.framework,)
    names = [f.name for f in FLAGS.get_flags_for_module(__name__)]
    return Settings(
        frameworks=frameworks,
        workload=FLAGS.workload,
        preset=FLAGS.preset,
        seed=FLAGS.seed,
        out_dir=FLAGS.out_dir or default_out_dir(),
        num_devices=FLAGS.num_devices,
        ulysses_size=FLAGS.ulysses_size or None,
        ulysses_intra_node=FLAGS.ulysses_intra_node,
        check_rtol=FLAGS.check_rtol,
        retry_errors=FLAGS.retry_errors,
        report=FLAGS.report,
        dry_run=FLAGS.dry_run,
        time_budget=FLAGS.time_budget,
        coordinator_address=FLAGS.coordinator_address,
        num_processes=FLAGS.num_processes,
        process_id=FLAGS.process_id,
        flag_values={n: FLAGS[n].value for n in sorted(names)},
        simulate_devices=tuple(dict.fromkeys(int(n) for n in FLAGS.simulate_devices or ())),
        link=link_model().spec(),
        sim_baseline_max_seqlen=(
            None
            if FLAGS.sim_baseline_max_seqlen is None
            else parse_seqlen(FLAGS.sim_baseline_max_seqlen)
        ),
        sim_timed_calls=FLAGS.sim_timed_calls,
        sim_validation_share=FLAGS.sim_validation_share,
        sim_compile_threads=FLAGS.sim_compile_threads,
        allow_slow=FLAGS.allow_slow,
    )


def link_model():
    """The simulated link model the --link_* and --gpus_per_node flags describe."""
    from shard_strategies.simulate import LinkModel

    return LinkModel(
        p2p_gbps=FLAGS.link_p2p_gbps,
        alltoall_gbps=FLAGS.link_alltoall_gbps,
        allgather_gbps=FLAGS.link_allgather_gbps,
        inter_node_gbps=FLAGS.link_inter_node_gbps,
        latency_us=FLAGS.link_latency_us,
        inter_latency_us=FLAGS.link_inter_latency_us,
        gpus_per_node=FLAGS.gpus_per_node,
    )
