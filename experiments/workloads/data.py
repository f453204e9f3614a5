"""Synthetic packed-document batches: lengths from the attn_masks tables, a learnable task.

Every step's batch is a pure function of (seed, step), so the data position saved in a
checkpoint is just the next step number and a resumed run sees exactly the same batches.

Task: each document draws its tokens uniformly from its own small random alphabet. A model
that attends within the document learns to spread its prediction over the alphabet seen so far
(loss -> ~ln(alphabet)); one that cannot (or that leaks across documents) stays near ln(vocab).
All rows of a batch share one document layout, hence one causal_document mask per step.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np

from attn_masks import Mask, default_distribution, generate_seqlens, make_mask

MASK_NAME = "causal_document"


@dataclass(frozen=True)
class DataConfig:
    """Batch shape, vocabulary, seed, length table (None: the CP rule's default for seqlen),
    per-document alphabet size, the multiple every document length is rounded to, and whether
    every step keeps step 0's document layout (new tokens, one mask: for compile-time masks)."""

    seqlen: int
    batch: int
    vocab: int
    seed: int = 0
    distribution: str | None = None
    alphabet: int = 4
    doc_multiple: int = 1
    fixed_layout: bool = False

    def table(self) -> str:
        """The length table used."""
        return self.distribution or default_distribution(self.seqlen, "cp")


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
    rng = random.Random(cfg.seed * 1_000_003 + (0 if cfg.fixed_layout else step))
    return round_lengths(generate_seqlens(cfg.table(), cfg.seqlen, rng), cfg.doc_multiple)


def batch_at(cfg: DataConfig, step: int) -> PackedBatch:
    """The batch of training step `step` (0-based)."""
    lens = document_lengths(cfg, step)
    rng = np.random.default_rng([cfg.seed, step])
    doc = np.repeat(np.arange(len(lens)), lens)
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
