"""Real text on every machine: the running Python's standard library source, as byte tokens.

The corpus is every `*.py` file under `sysconfig.get_paths()["stdlib"]` outside third-party
(site-packages, dist-packages), test (test, tests) and IDLE (idlelib) folders, in the order of
its path relative to that folder, empty files and generated character-map codec tables left out.
It needs no download, its files are
real documents (a packed sequence's boundaries are where one file ends and the next begins), and
source code has structure a small model learns from context. It depends on the Python version:
the record names it (`Corpus.identity`), and a checkpoint refuses another one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BYTE_VOCAB = 256  # tokens are bytes: the model's vocabulary must hold 0..255
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})
# A module-level character map marks a codec that gencodec.py generated from a vendor table
# (encodings/cp855.py and about 70 more, 13% of the bytes): hex tables, not written source.
# Left in, a step drawn from them alone jumped to 1.6x the loss of the steps before it.
CODEC_TABLE = re.compile(rb"^(decoding_table = \(|decoding_map = )", re.MULTILINE)


@dataclass(frozen=True, eq=False)
class Corpus:
    """The files (relative paths, sorted), their bytes back to back in `data`, where each one
    starts in it and its size; the unigram byte entropy in nats; the Python version and a digest
    of the content."""

    names: tuple[str, ...]
    data: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    entropy: float
    python: str
    sha256: str

    @functools.cached_property
    def by_size(self) -> tuple[np.ndarray, np.ndarray]:
        """(file indices in increasing size, their sizes): the files of at least L bytes are a
        suffix of that order."""
        order = np.argsort(self.sizes, kind="stable")
        return order, self.sizes[order]

    def identity(self) -> dict:
        """What the batches depend on: Python version, file and byte counts, content digest."""
        return {
            "python": self.python,
            "files": len(self.names),
            "bytes": int(self.data.size),
            "sha256": self.sha256,
        }

    def summary(self) -> str:
        """One line on what was read (no machine paths)."""
        return (
            f"Python {self.python} standard library source, {len(self.names):,} files, "
            f"{self.data.size / 1e6:.1f} MB, byte tokens; unigram entropy {self.entropy:.2f} nats"
        )


def stdlib_root() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """The corpus's `*.py` files under `root` (relative POSIX paths, sorted; excluded folders
    are not entered, symlinked folders are not followed)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        rel = Path(folder).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


@functools.cache
def load() -> Corpus:
    """The corpus of the running Python, read once per process."""
    root = stdlib_root()
    texts = {name: (root / name).read_bytes() for name in source_files(root)}
    names = tuple(name for name, text in texts.items() if text and not CODEC_TABLE.search(text))
    blob = b"".join(texts[name] for name in names)
    data = np.frombuffer(blob, dtype=np.uint8)
    sizes = np.array([len(texts[name]) for name in names], dtype=np.int64)
    counts = np.bincount(data, minlength=BYTE_VOCAB)
    p = counts[counts > 0] / data.size
    return Corpus(
        names=names,
        data=data,
        starts=np.concatenate([[0], np.cumsum(sizes)[:-1]]),
        sizes=sizes,
        entropy=float(-(p * np.log(p)).sum()),
        python=f"{sys.version_info.major}.{sys.version_info.minor}",
        sha256=hashlib.sha256(blob).hexdigest()[:16],
    )


def document_sizes(corpus: Corpus, seqlen: int, rng: np.random.Generator, cap: int) -> list[int]:
    """Sizes of files drawn at random (each at most `cap`) until they fill `seqlen` tokens, the
    last one cropped: a packed sequence's document lengths."""
    lengths: list[int] = []
    left = seqlen
    while left > 0:
        size = min(int(corpus.sizes[rng.integers(len(corpus.sizes))]), cap, left)
        lengths.append(size)
        left -= size
    return lengths


def document_tokens(
    corpus: Corpus, seqlens: list[int], batch: int, rng: np.random.Generator
) -> np.ndarray:
    """(batch, sum(seqlens)) uint8: in every row, each document of length L is the first L
    bytes of a file of at least L bytes drawn at random, so every document starts a file."""
    order, sorted_sizes = corpus.by_size
    lens = np.asarray(seqlens, dtype=np.int64)
    first = np.searchsorted(sorted_sizes, lens, side="left")  # the files of >= L bytes
    if (first == len(order)).any():
        raise ValueError(f"no corpus file has {lens.max()} bytes (the longest: {sorted_sizes[-1]})")
    files = order[rng.integers(first, len(order), size=(batch, len(lens)))]
    doc = np.repeat(np.arange(len(lens)), lens)
    offset = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    return corpus.data[corpus.starts[files][:, doc] + offset]
