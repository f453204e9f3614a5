"""The train step's default data: the running Python's standard library source as byte tokens,
packed one file per document. Checked against the files read here, not through the loader."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
from absl import flags
from test_workload import _parse_run_flags

from experiments.workloads import data, text_corpus
from experiments.workloads import flags as workload_flags

EXCLUDED = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
# Long enough that most steps hold several files, with rows that draw different files.
CFG = data.DataConfig(seqlen=8192, batch=3, vocab=256, seed=5)
STEPS = range(6)


def _codec_table(text: bytes) -> bool:
    """A generated character-map codec: a line that starts a module-level decoding table/map."""
    return any(
        line.startswith((b"decoding_table = (", b"decoding_map = ")) for line in text.splitlines()
    )


@pytest.fixture(scope="module")
def source() -> dict[str, bytes]:
    """Every file under the corpus's folders, read directly (the loader is not used)."""
    root = text_corpus.stdlib_root()
    return {name: (root / name).read_bytes() for name in text_corpus.source_files(root)}


@pytest.fixture(scope="module")
def files(source) -> dict[str, bytes]:
    """The files the corpus should hold: not empty, not a generated codec table."""
    return {name: text for name, text in source.items() if text and not _codec_table(text)}


def _documents(batch: data.PackedBatch) -> list[tuple[int, int, bytes]]:
    """(row, start, bytes) of every document of every row."""
    starts = np.cumsum([0, *batch.seqlens[:-1]])
    return [
        (row, int(s), bytes(batch.tokens[row, s : s + n].astype(np.uint8)))
        for row in range(batch.tokens.shape[0])
        for s, n in zip(starts, batch.seqlens)
    ]


def test_source_files_skip_tests_and_third_party_folders(tmp_path):
    for rel in ["b.py", "a/z.py", "a/b.py", "test/t.py", "a/tests/t.py", "site-packages/s.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    for rel in ["dist-packages/d.py", "idlelib/i.py", "a/notes.txt", "a/test_ok.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert text_corpus.source_files(tmp_path) == ["a/b.py", "a/test_ok.py", "a/z.py", "b.py"]


def test_corpus_is_the_sorted_non_empty_stdlib_source(files):
    corpus = text_corpus.load()
    assert text_corpus.load() is corpus  # read once per process
    assert len(corpus.names) > 100 and list(corpus.names) == sorted(corpus.names)
    assert all(name.endswith(".py") for name in corpus.names)
    assert not any(EXCLUDED & set(name.split("/")[:-1]) for name in corpus.names)
    assert "os.py" in corpus.names and "json/__init__.py" in corpus.names
    assert corpus.names == tuple(sorted(files))
    assert corpus.sizes.tolist() == [len(files[name]) for name in corpus.names]
    i = corpus.names.index("os.py")
    start, size = corpus.starts[i], corpus.sizes[i]
    assert corpus.data[start : start + size].tobytes() == files["os.py"]


def test_generated_codec_tables_are_left_out(source):
    """The codecs gencodec.py wrote from vendor tables are dropped, hand-written codecs kept."""
    names = text_corpus.load().names
    tables = sorted(name for name, text in source.items() if _codec_table(text))
    assert "encodings/cp1252.py" in tables and len(tables) > 30
    assert not set(tables) & set(names)
    assert {"encodings/__init__.py", "encodings/utf_8.py", "encodings/aliases.py"} <= set(names)


def test_unigram_entropy_and_summary(files):
    corpus = text_corpus.load()
    counts = np.bincount(np.frombuffer(b"".join(files.values()), np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    assert corpus.entropy == pytest.approx(-(p * np.log(p)).sum(), rel=1e-9)
    assert 1.0 < corpus.entropy < np.log(256)
    line = CFG.describe()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert line.startswith(f"data: Python {version} standard library source, ")
    assert f"{len(corpus.names):,} files" in line and f"{corpus.entropy:.2f} nats" in line
    assert str(text_corpus.stdlib_root()) not in line
    assert CFG.floor() == (corpus.entropy, "unigram entropy (no context)")


def test_batches_are_deterministic_per_seed_and_step():
    a, b = data.batch_at(CFG, 3), data.batch_at(CFG, 3)
    assert np.array_equal(a.tokens, b.tokens) and a.seqlens == b.seqlens and a.mask is b.mask
    assert a.tokens.dtype == np.int32 and a.tokens.min() >= 0 and a.tokens.max() < 256
    other_step = data.batch_at(CFG, 4)
    other_seed = data.batch_at(dataclasses.replace(CFG, seed=6), 3)
    assert not np.array_equal(a.tokens, other_step.tokens)
    assert not np.array_equal(a.tokens, other_seed.tokens)
    assert not np.array_equal(a.tokens[0], a.tokens[1])  # rows draw their own files


def test_layouts_are_file_sizes_until_the_sequence_is_full():
    sizes = set(text_corpus.load().sizes.tolist())
    layouts = [data.document_lengths(CFG, step) for step in range(20)]
    assert sum(len(lens) > 1 for lens in layouts) >= 5, layouts  # real boundaries are exercised
    for lens in layouts:
        assert sum(lens) == CFG.seqlen and min(lens) > 0
        assert all(n in sizes for n in lens[:-1]), lens  # the last one is cropped
        assert lens[-1] <= max(sizes)


@pytest.mark.parametrize("multiple", [1, 16])
def test_every_document_is_the_start_of_a_corpus_file(files, multiple):
    cfg = dataclasses.replace(CFG, doc_multiple=multiple)
    for step in STEPS:
        batch = data.batch_at(cfg, step)
        assert sum(batch.seqlens) == cfg.seqlen and all(n % multiple == 0 for n in batch.seqlens)
        for row, start, doc in _documents(batch):
            assert any(text.startswith(doc) for text in files.values()), (step, row, start)


@pytest.mark.parametrize("multiple", [1, 16])
def test_targets_weights_and_mask_follow_the_layout(multiple):
    cfg = dataclasses.replace(CFG, doc_multiple=multiple)
    for step in STEPS:
        batch = data.batch_at(cfg, step)
        ends = np.cumsum(batch.seqlens) - 1
        assert np.array_equal(batch.targets[:, :-1], batch.tokens[:, 1:])
        want = np.ones(cfg.seqlen, np.float32)
        want[ends] = 0  # the next token starts another document, or the sequence ends
        assert (batch.weights == want).all()
        lo, hi = batch.mask.row_intervals()  # row i sees [its document's start, i]
        assert (hi[:, 0] == np.arange(cfg.seqlen) + 1).all() and (hi[:, 1:] == 0).all()
        starts = np.unique(lo[:, 0])
        assert np.diff([*starts, cfg.seqlen]).tolist() == list(batch.seqlens)


def test_fixed_layout_keeps_step_0s_layout_with_new_tokens():
    fixed = dataclasses.replace(CFG, fixed_layout=True, doc_multiple=16)
    batches = [data.batch_at(fixed, step) for step in STEPS]
    assert len({b.seqlens for b in batches}) == 1 and len({b.mask for b in batches}) == 1
    assert batches[0].seqlens == tuple(data.document_lengths(fixed, 0))
    assert all(not np.array_equal(batches[0].tokens, b.tokens) for b in batches[1:])
    moving = dataclasses.replace(fixed, fixed_layout=False)
    assert len({data.batch_at(moving, step).seqlens for step in STEPS}) > 1


def _train_config(*args: str, on_gpu: bool = False):
    """The TrainConfig of run.py's flags `args` (the flags are reset afterwards)."""
    fv = _parse_run_flags(["--workload=train_step", *args])
    try:
        return workload_flags.train_config(fv, on_gpu)
    finally:
        fv.unparse_flags()


def test_the_flag_chooses_the_data_and_its_vocabulary():
    workload_flags.define_flags()
    assert flags.FLAGS["lm_data"].parser.enum_values == list(data.SOURCES)
    assert data.SOURCES[0] == "stdlib" == data.DataConfig(seqlen=8, batch=1, vocab=256).source
    for on_gpu, synthetic_vocab in [(False, 32), (True, 32768)]:
        stdlib = _train_config(on_gpu=on_gpu)
        synthetic = _train_config("--lm_data=synthetic", on_gpu=on_gpu)
        assert (stdlib.data.source, stdlib.data.vocab, stdlib.model.vocab) == ("stdlib", 256, 256)
        assert synthetic.data.source == "synthetic"
        assert synthetic.data.vocab == synthetic.model.vocab == synthetic_vocab
    assert _train_config("--lm_data=stdlib", "--vocab=300").data.vocab == 300


def test_a_vocabulary_below_256_for_byte_tokens_is_refused():
    with pytest.raises(flags.ValidationError, match=r"--vocab=100: .*>= 256"):
        _train_config("--lm_data=stdlib", "--vocab=100")
    with pytest.raises(flags.ValidationError, match="--lm_distribution=long: "):
        _train_config("--lm_data=stdlib", "--vocab=256", "--lm_distribution=long")
    with pytest.raises(ValueError, match="vocab 100 .* >= 256"):
        data.DataConfig(seqlen=8, batch=1, vocab=100)


def test_records_and_checkpoints_name_the_corpus():
    """Another Python's standard library gives other batches: the record names the corpus read,
    and a checkpoint's fingerprint includes it (synthetic data has none)."""
    from experiments.workloads import lm
    from experiments.workloads.config import TrainConfig, fingerprint, point_fields

    cfg = TrainConfig(model=lm.LMConfig(vocab=256), data=CFG)
    corpus = text_corpus.load()
    want = {"python": corpus.python, "files": len(corpus.names), "bytes": corpus.data.size}
    assert fingerprint(cfg)["corpus"] == {**want, "sha256": corpus.sha256}
    assert point_fields(cfg, cfg.backend())["data"]["corpus"] == fingerprint(cfg)["corpus"]
    synthetic = dataclasses.replace(cfg, data=dataclasses.replace(CFG, source="synthetic"))
    assert fingerprint(synthetic)["corpus"] is None
