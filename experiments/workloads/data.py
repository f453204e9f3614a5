"""Packed-document batches: real Python source bytes (default) or a synthetic learnable task.

Every step's batch is a pure function of (seed, step), so the data position saved in a
checkpoint is just the next step number and a resumed run sees exactly the same batches.
All rows of a batch share one document layout, hence one causal_document mask per step.

stdlib (default): the running Python's standard library source as byte tokens
(text_corpus.py). The layout is the sizes of files drawn at random until the sequence is full
(the last one cropped); each row fills every document slot of length L with the first L bytes
of a randomly drawn file of at least L bytes, so every document starts where a file starts. The
corpus's unigram byte entropy is the best loss without context; a model below it uses context.

synthetic: lengths from the attn_masks tables; each document draws its tokens uniformly from
its own small random alphabet. A model that attends within the document learns to spread its
prediction over the alphabet seen so far (loss -> ~ln(alphabet)); one that cannot (or that
leaks across documents) stays near ln(vocab).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import numpy as np

from attn_masks import Mask, default_distribution, generate_seqlens, make_mask

from . import text_corpus

MASK_NAME = "causal_document"
SOURCES = ("stdlib", "synthetic")  # --lm_data values, the default first


@dataclass(frozen=True)
class DataConfig:
    """Batch shape, vocabulary, seed, length table (synthetic only; None: the CP rule's default
    for seqlen), per-document alphabet size (synthetic only), the multiple every document length
    is rounded to, whether every step keeps step 0's document layout (new tokens, one mask: for
    compile-time masks), and the data source (one of SOURCES)."""

    seqlen: int
    batch: int
    vocab: int
    seed: int = 0
    distribution: str | None = None
    alphabet: int = 4
    doc_multiple: int = 1
    fixed_layout: bool = False
    source: str = SOURCES[0]

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data source {self.source!r}: expected one of {', '.join(SOURCES)}")
        if self.source == "stdlib" and self.vocab < text_corpus.BYTE_VOCAB:
            raise ValueError(
                f"vocab {self.vocab} is too small for byte tokens; "
                f"expected >= {text_corpus.BYTE_VOCAB}"
            )
        if self.source == "stdlib" and self.distribution:
            raise ValueError("a length table applies to synthetic data only")

    def table(self) -> str:
        """Where document lengths come from: 'stdlib' (file sizes) or the length table used."""
        if self.source == "stdlib":
            return "stdlib"
        return self.distribution or default_distribution(self.seqlen, "cp")

    def floor(self) -> tuple[float, str]:
        """The loss the curve is read against, and its legend label: the corpus's unigram
        entropy (the best loss without context), or the synthetic task's floor ln(alphabet)."""
        if self.source == "stdlib":
            return text_corpus.load().entropy, "unigram entropy (no context)"
        return math.log(self.alphabet), "task floor"

    def describe(self) -> str:
        """One line on the data a run reads."""
        if self.source == "stdlib":
            return f"data: {text_corpus.load().summary()}"
        return (
            f"data: synthetic documents, each from its own {self.alphabet}-token alphabet "
            f"(vocab {self.vocab:,}); task floor about ln {self.alphabet} = "
            f"{math.log(self.alphabet):.2f} nats"
        )

    def identity(self) -> dict | None:
        """What the batches depend on beyond this config: the corpus (None for synthetic)."""
        return text_corpus.load().identity() if self.source == "stdlib" else None


@dataclass(frozen=True)
class PackedBatch:
    """tokens/targets (B,S) int32, weights (B,S) float32 (0 where the next token starts a new
    document or the sequence ends), the document lengths and their causal_document mask."""

    step: int
    tokens: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    seqlens: tuple[int, ...]
    mask: Mask


def round_lengths(seqlens: list[int], multiple: int) -> list[int]:
    """Document boundaries snapped to multiples of `multiple` (empty documents dropped).

    The total is kept (it must be a multiple). Zigzag CP wants every document divisible into
    2 x ring-size equal chunks, as Megatron-style packing requires, so the layout needs no padding.
    """
    total = sum(seqlens)
    if multiple <= 1:
        return list(seqlens)
    if total % multiple:
        raise ValueError(f"seqlen {total} must be a multiple of the document multiple {multiple}")
    bounds = np.cumsum(seqlens)
    snapped = np.unique(np.clip(np.rint(bounds / multiple).astype(np.int64) * multiple, 0, total))
    snapped = np.concatenate([[0], snapped[snapped > 0]])
    return np.diff(snapped).astype(int).tolist()


def document_lengths(cfg: DataConfig, step: int) -> list[int]:
    """The document lengths of a step's packed sequence."""
    layout_step = 0 if cfg.fixed_layout else step
    if cfg.source == "stdlib":
        corpus = text_corpus.load()
        # Snapping to the multiple lengthens a document by at most one multiple: the cap keeps
        # every slot within the longest file's size.
        snap = cfg.doc_multiple if cfg.doc_multiple > 1 else 0
        cap = max(int(corpus.sizes.max()) - snap, 1)
        rng = np.random.default_rng([cfg.seed, layout_step, 1])
        lens = text_corpus.document_sizes(corpus, cfg.seqlen, rng, cap)
    else:
        rng = random.Random(cfg.seed * 1_000_003 + layout_step)
        lens = generate_seqlens(cfg.table(), cfg.seqlen, rng)
    return round_lengths(lens, cfg.doc_multiple)


def batch_at(cfg: DataConfig, step: int) -> PackedBatch:
    """The batch of training step `step` (0-based)."""
    lens = document_lengths(cfg, step)
    rng = np.random.default_rng([cfg.seed, step])
    doc = np.repeat(np.arange(len(lens)), lens)
    if cfg.source == "stdlib":
        tokens = text_corpus.document_tokens(text_corpus.load(), lens, cfg.batch, rng)
    else:
        alphabets = rng.integers(0, cfg.vocab, (cfg.batch, len(lens), cfg.alphabet))
        pick = rng.integers(0, cfg.alphabet, (cfg.batch, cfg.seqlen))
        tokens = np.take_along_axis(alphabets[:, doc, :], pick[..., None], axis=-1)[..., 0]
    targets = np.concatenate([tokens[:, 1:], np.zeros((cfg.batch, 1), tokens.dtype)], axis=1)
    same_doc = np.concatenate([doc[1:] == doc[:-1], [False]])
    weights = np.broadcast_to(same_doc.astype(np.float32), tokens.shape).copy()
    return PackedBatch(
        step=step,
        tokens=tokens.astype(np.int32),
        targets=targets.astype(np.int32),
        weights=weights,
        seqlens=tuple(lens),
        mask=packed_mask(cfg.seqlen, tuple(lens)),
    )


@functools.lru_cache(maxsize=64)
def packed_mask(seqlen: int, seqlens: tuple[int, ...]) -> Mask:
    """The causal_document mask of a layout, one object per layout (masks compare by identity,
    so steps with the same layout share every table and compiled step derived from it)."""
    return make_mask(MASK_NAME, seqlen, seqlens=list(seqlens))
