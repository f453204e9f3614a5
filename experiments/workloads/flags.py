"""absl flags of the train-step workload and the parity bundle, and their conversion to configs.

Importing this module needs absl only (run.py defines these flags even without jax or flax).

These flags are defined next to run.py's own (experiments/core/flags.py), whose shared flags keep
their meaning where it applies: --seqlen (one value: the total packed length), --batch, --dtype,
--seed, --warmup (untimed steps), --iters (timed calls of the attention-share measurement),
--impl, --cp, --layout (one value each), --num_devices, --ulysses_size, --out_dir, --framework,
--mask and --check_rtol (parity bundle), and the multi-host settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from absl import flags

from experiments.core.points import DTYPE_NAMES
from experiments.core.results import folder_problem

if TYPE_CHECKING:
    from .config import TrainConfig

FLAGS = flags.FLAGS

# CPU: one block of width 64 with 2 heads of 32 (the synthetic document's 4-token set fits the
# value space with little interference; 4 heads of 16 learn it ~0.3 nats slower), vocab 32 for
# synthetic data so the loss without attention (ln 32 = 3.47) stays far above the task's floor
# (about ln 4 = 1.39); byte tokens (the default data) take vocab 256 instead. AdamW 3e-3 with 30
# warm-up steps and cosine decay, clipped at norm 1: the usual small-LM recipe. On the default
# data the 20-step mean loss ends at 2.48, below the corpus's unigram entropy (3.24 nats on
# Python 3.11), in about 15 s on 2 cores.
CPU_DEFAULTS = {
    "depth": 1,
    "width": 64,
    "lm_heads_q": 2,
    "lm_heads_kv": 2,
    "vocab": 32,  # --lm_data=synthetic (byte tokens: 256)
    "seqlen": 512,
    "batch": 2,
    "dtype": "fp32",
    "steps": 400,
    "learning_rate": 3e-3,
    "lr_warmup": 30,
    "warmup": 2,
    "iters": 5,
}
# GPU: a 0.35B-parameter LM (0.42B at the synthetic vocab 32768) on 32K-token packed sequences;
# a 3x lower peak rate than on the CPU (3e-3 after 5 warm-up steps diverged) and a warm-up whose
# first rate, 1e-5, is the best first AdamW step at this width (results/cpu/train_first_step; a
# 20-step warm-up's 5e-5 doubled the loss at step 1).
GPU_DEFAULTS = {
    "depth": 8,
    "width": 2048,
    "lm_heads_q": 16,
    "lm_heads_kv": 4,
    "vocab": 32768,  # --lm_data=synthetic (byte tokens: 256)
    "seqlen": 32768,
    "batch": 1,
    "dtype": "bf16",
    "steps": 200,
    "learning_rate": 1e-3,
    "lr_warmup": 100,
    "warmup": 5,
    "iters": 20,
}


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """Register the workload flags on `flag_values` (once; later calls do nothing)."""
    if "steps" in flag_values:
        return
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("steps", None, "train_step: total training steps.", lower_bound=1, **fv)
    flags.DEFINE_integer(
        "checkpoint_every",
        0,
        "train_step: Orbax checkpoint every N steps and at the end (0: never).",
        lower_bound=0,
        **fv,
    )
    flags.DEFINE_string(
        "ckpt_dir", None, "train_step: checkpoint folder (default <out_dir>/checkpoints).", **fv
    )
    flags.DEFINE_bool(
        "resume", False, "train_step: continue from the newest checkpoint in --ckpt_dir.", **fv
    )
    flags.DEFINE_integer("depth", None, "train_step: Transformer blocks.", lower_bound=1, **fv)
    flags.DEFINE_integer("width", None, "train_step: model width.", lower_bound=2, **fv)
    flags.DEFINE_integer("lm_heads_q", None, "train_step: query heads.", lower_bound=1, **fv)
    flags.DEFINE_integer(
        "lm_heads_kv", None, "train_step: key/value heads (GQA).", lower_bound=1, **fv
    )
    flags.DEFINE_integer(
        "vocab",
        None,
        "train_step: vocabulary size (default 256 for --lm_data=stdlib, whose tokens are bytes).",
        lower_bound=2,
        **fv,
    )
    flags.DEFINE_enum(
        "lm_data",
        "stdlib",
        ["stdlib", "synthetic"],
        "train_step: training data: stdlib (the running Python's standard library source as "
        "byte tokens, one file per document) or synthetic (per-document random alphabets).",
        **fv,
    )
    flags.DEFINE_string(
        "lm_distribution",
        None,
        "train_step: document-length table of --lm_data=synthetic (pile|prolong64k|prolong512k|"
        "long|short; default: attn_masks' CP rule for the sequence length).",
        **fv,
    )
    flags.DEFINE_integer(
        "lm_doc_multiple",
        0,
        "train_step: round document lengths to this multiple (0: 2 x CP devices under zigzag).",
        lower_bound=0,
        **fv,
    )
    flags.DEFINE_bool(
        "lm_fixed_layout",
        False,
        "train_step: every step keeps step 0's document layout (new tokens each step), so impls "
        "that take masks only at compile time (xla, cudnn, triton) compile once.",
        **fv,
    )
    flags.DEFINE_float(
        "learning_rate", None, "train_step: peak AdamW learning rate.", lower_bound=0.0, **fv
    )
    flags.DEFINE_integer(
        "lr_warmup",
        None,
        "train_step: learning-rate warm-up steps (then cosine decay over --steps).",
        lower_bound=0,
        **fv,
    )
    flags.DEFINE_string(
        "parity_bundle",
        None,
        "Parity bundle folder: --framework=jax saves one attention call (inputs, mask, outputs, "
        "gradients) there; --framework=torch checks torch_attn on it.",
        **fv,
    )


def shared(flag_values: flags.FlagValues, name: str, default: Any = None) -> Any:
    """A run.py flag's value, or `default` when it is undefined or unset."""
    if name not in flag_values or flag_values[name].value is None:
        return default
    return flag_values[name].value


def single(
    flag_values: flags.FlagValues, name: str, default: str | None = None, *, what: str = "value"
) -> str | None:
    """The one value of a list flag (None or `default` when unset); several values are an error
    that names them and what one value is (`what`)."""
    values = shared(flag_values, name)
    if not values:
        return default
    if len(values) != 1:
        raise flags.ValidationError(
            f"--{name}={','.join(values)}: takes one {what}, got {len(values)}"
        )
    return values[0]


def _seqlen(text: str | None) -> int | None:
    if text is None:
        return None
    from experiments.core.flags import parse_seqlen

    return parse_seqlen(text)


def defaults(on_gpu: bool) -> dict:
    """Sizes used for flags left unset: a minute-long CPU default, or a GPU-sized model."""
    return GPU_DEFAULTS if on_gpu else CPU_DEFAULTS


def train_configs(flag_values: flags.FlagValues, on_gpu: bool) -> list[TrainConfig]:
    """One TrainConfig per --impl value (the same run on each kernel, checkpoints kept apart)."""
    import dataclasses

    impls = shared(flag_values, "impl") or ["default"]
    base = train_config(flag_values, on_gpu, impl=impls[0])
    if len(impls) == 1:
        return [base]
    return [
        dataclasses.replace(
            base,
            impl=None if impl == "default" else impl,
            ckpt_dir=f"{base.ckpt_dir}/{impl}",
        )
        for impl in impls
    ]


def train_config(
    flag_values: flags.FlagValues, on_gpu: bool, impl: str | None = None
) -> TrainConfig:
    """The TrainConfig the parsed flags describe (`impl`: one of several --impl values)."""
    from .config import TrainConfig
    from .data import SOURCES, DataConfig
    from .lm import LMConfig
    from .train import OptimConfig

    d = defaults(on_gpu)

    def get(name: str):
        return shared(flag_values, name, d.get(name))

    cp = single(flag_values, "cp", what="CP strategy")
    impl = impl or single(flag_values, "impl")
    out_dir = shared(flag_values, "out_dir") or default_out_dir(cp)
    source = get("lm_data") or SOURCES[0]
    vocab = _vocab(flag_values, source, d["vocab"])
    distribution = get("lm_distribution")
    if distribution and source == "stdlib":
        raise flags.ValidationError(
            f"--lm_distribution={distribution}: no length table for --lm_data=stdlib (its "
            "documents are whole files); expected only with --lm_data=synthetic"
        )
    return TrainConfig(
        model=LMConfig(
            vocab=vocab,
            width=get("width"),
            depth=get("depth"),
            heads_q=get("lm_heads_q"),
            heads_kv=get("lm_heads_kv"),
            dtype=DTYPE_NAMES[get("dtype")],
        ),
        data=DataConfig(
            seqlen=_seqlen(single(flag_values, "seqlen", what="sequence length")) or d["seqlen"],
            batch=get("batch"),
            vocab=vocab,
            seed=get("seed") or 0,
            distribution=distribution,
            doc_multiple=get("lm_doc_multiple"),
            fixed_layout=bool(get("lm_fixed_layout")),
            source=source,
        ),
        optim=OptimConfig(
            learning_rate=get("learning_rate"),
            warmup_steps=get("lr_warmup"),
            decay_steps=get("steps"),
        ),
        steps=get("steps"),
        warmup=get("warmup"),
        attention_iters=get("iters"),
        impl=None if impl in (None, "default") else impl,
        cp=None if cp in (None, "none") else cp,
        layout=single(flag_values, "layout", "zigzag", what="layout"),
        num_devices=get("num_devices") or 0,
        ulysses_size=get("ulysses_size") or None,
        checkpoint_every=get("checkpoint_every"),
        ckpt_dir=get("ckpt_dir") or f"{out_dir}/checkpoints",
        resume=bool(get("resume")),
        out_dir=out_dir,
    )


def _vocab(flag_values: flags.FlagValues, source: str, synthetic_default: int) -> int:
    """--vocab, or its default for the data source: 256 for byte tokens, else the sizes' own.
    A vocabulary that cannot hold every byte is a ValidationError naming it and the range."""
    from .text_corpus import BYTE_VOCAB

    vocab = shared(flag_values, "vocab")
    if source != "stdlib":
        return synthetic_default if vocab is None else vocab
    if vocab is None:
        return BYTE_VOCAB
    if vocab < BYTE_VOCAB:
        raise flags.ValidationError(
            f"--vocab={vocab}: too small for --lm_data=stdlib, whose tokens are bytes (0..255); "
            f"expected >= {BYTE_VOCAB}"
        )
    return vocab


def check_folders(cfgs: list[TrainConfig]) -> None:
    """Make every folder the runs write (--out_dir, and --ckpt_dir when they checkpoint), up
    front: a bad one would otherwise fail late, inside Orbax's writer threads."""
    for cfg in cfgs:
        _writable_folder("out_dir", cfg.out_dir)
        if cfg.uses_checkpoints:
            _writable_folder("ckpt_dir", cfg.ckpt_dir)


def _writable_folder(name: str, path: str) -> None:
    """Create folder `path` (flag --name) if missing and check that files can be written in it;
    ValidationError naming the value and what is expected otherwise."""
    problem = folder_problem(path)
    if problem:
        raise flags.ValidationError(f"--{name}={path}: {problem}")


def default_out_dir(cp: str | None) -> str:
    """results/local/train_step-<cp or kernel>, so the same command finds the same folder."""
    return f"results/local/train_step-{cp or 'kernel'}"


def flag_dict(flag_values: flags.FlagValues) -> dict:
    """This module's flags and every flag given on the command line (for provenance)."""
    own = {f.name for f in flag_values.get_flags_for_module(__name__)}
    return {
        name: flag_values[name].value
        for name in sorted(flag_values)
        if name in own or flag_values[name].present
    }
