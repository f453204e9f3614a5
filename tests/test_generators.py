"""The 14 mask generators: reference golden values, definitions element-wise, errors, speed."""

import random
import re
import time

import numpy as np
import pytest

from attn_masks.generators import MASK_NAMES, make_mask, make_masks
from attn_masks.sampling import generate_seqlens

S8K = 8192

# docs/masks.md, Reference values: seed 42, first mask, S = 8192, reference_compat=True.
GOLDEN_8K = {
    "full": (1, 67_108_864, {}),
    "causal": (1, 33_558_528, {}),
    "full_document": (17, 15_108_732, {}),
    "causal_document": (17, 7_558_462, {}),
    "sliding_window_causal": (2, 7_872_000, {"window": 1024}),
    "sliding_window": (2, 7_872_000, {"window": 1024}),
    "share_question": (17, 10_325_629, {}),
    "causal_blockwise": (17, 8_271_614, {}),
    "prefix_lm_causal": (2, 35_222_928, {"prefix_length": 1825}),
    "prefix_lm_document": (26, 7_849_026, {"prefix_length": 236}),
    "global_sliding_window": (5, 36_937_092, {"global_size": 2620}),
    "block_causal_document": (8, 19_922_944, {"block_size": 1024}),
}
GOLDEN_TFLOP_8K = {
    "full": 2.1990,
    "causal": 1.0996,
    "full_document": 0.4951,
    "causal_document": 0.2477,
    "sliding_window_causal": 0.2579,
    "share_question": 0.3384,
    "causal_blockwise": 0.2710,
    "prefix_lm_causal": 1.1542,
    "prefix_lm_document": 0.2572,
    "global_sliding_window": 1.2104,
    "block_causal_document": 0.6528,
}
DOC_MASKS = {
    "full_document",
    "causal_document",
    "share_question",
    "causal_blockwise",
    "prefix_lm_document",
    "block_causal_document",
    "full_document_long",
    "causal_document_long",
}


def test_mask_names():
    assert list(MASK_NAMES) == [
        "full",
        "causal",
        "full_document",
        "causal_document",
        "sliding_window_causal",
        "sliding_window",
        "share_question",
        "causal_blockwise",
        "prefix_lm_causal",
        "prefix_lm_document",
        "global_sliding_window",
        "block_causal_document",
        "full_document_long",
        "causal_document_long",
    ]


@pytest.mark.parametrize("name", list(GOLDEN_8K))
def test_golden_8k(name):
    slices, area, draws = GOLDEN_8K[name]
    m = make_mask(name, S8K, reference_compat=True)
    assert m.slices[2].shape[0] == slices
    assert m.area() == area
    for key, value in draws.items():
        assert m.params[key] == value
    if name in GOLDEN_TFLOP_8K:
        assert round(4 * area * 64 * 128 / 1e12, 4) == GOLDEN_TFLOP_8K[name]


def test_golden_documents():
    full = make_mask("full_document", S8K, reference_compat=True)
    cu = full.params["cu_seqlens"]
    assert len(cu) == 18 and np.diff(cu)[:5].tolist() == [353, 559, 102, 421, 322]
    assert (
        len(make_mask("block_causal_document", S8K, reference_compat=True).params["cu_seqlens"])
        == 4
    )
    cu16 = make_mask("causal_document", 16384, reference_compat=True).params["cu_seqlens"]
    assert np.diff(cu16)[:5].tolist() == [545, 719, 166, 581, 482]
    assert (
        make_mask("causal_document", 16384, reference_compat=True).params["distribution"]
        == "prolong64k"
    )


def test_golden_slice_layouts():
    q, k, t = make_mask("sliding_window_causal", S8K, reference_compat=True).slices
    assert q.tolist() == [[0, 1024], [1024, S8K]]
    assert k.tolist() == [[0, 1024], [0, S8K]]
    assert t.tolist() == [1, 3]
    q, k, t = make_mask("global_sliding_window", S8K, reference_compat=True).slices
    w = 2620
    assert q.tolist() == [[0, S8K], [0, w], [w, 2 * w], [2 * w, S8K - w], [S8K - w, S8K]]
    assert k.tolist() == [[0, w], [w, S8K], [w, 3 * w], [w, S8K], [S8K - 2 * w, S8K]]
    assert t.tolist() == [1, 1, 1, 3, 2]


def test_reference_slice_layouts_for_documents():
    lens = [3, 4, 5, 6]
    q, k, t = make_mask("share_question", 18, seqlens=lens, reference_compat=True).slices
    assert q.tolist() == [[0, 7], [7, 18], [7, 12], [12, 18]]
    assert k.tolist() == [[0, 7], [0, 3], [7, 12], [12, 18]]
    assert t.tolist() == [1, 0, 1, 1]
    q, k, t = make_mask("causal_blockwise", 18, seqlens=lens, reference_compat=True).slices
    assert q.tolist() == [[0, 3], [3, 7], [7, 12], [12, 18]]
    assert k.tolist() == [[0, 3], [3, 7], [7, 12], [0, 18]]
    assert t.tolist() == [1, 1, 1, 1]
    m = make_mask("prefix_lm_document", 18, seqlens=lens, prefix_length=4, reference_compat=True)
    q, k, t = m.slices
    assert q.tolist() == [[0, 3], [3, 7], [7, 11], [11, 12], [12, 16], [16, 18]]
    assert k.tolist() == [[0, 3], [3, 7], [7, 11], [7, 12], [12, 16], [12, 18]]
    assert t.tolist() == [0, 0, 0, 1, 0, 1]
    m = make_mask("block_causal_document", 8, seqlens=[4, 2, 2], block_size=2)
    q, k, t = m.slices
    assert q.tolist() == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert k.tolist() == [[0, 2], [0, 4], [4, 6], [6, 8]]
    assert t.tolist() == [0, 0, 0, 0]


# --- element-wise definitions -------------------------------------------------------------


def _doc_ids(cu: np.ndarray, n: int) -> np.ndarray:
    return np.searchsorted(np.asarray(cu), np.arange(n), side="right") - 1


def _expected(m, name: str, n: int, window: int, compat: bool) -> np.ndarray:
    """The mask straight from its written definition (docs/masks.md, The 14 named masks)."""
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    diff = i - j
    p = m.params
    if "cu_seqlens" in p:
        cu = p["cu_seqlens"]
        doc = _doc_ids(cu, n)
        same = doc[:, None] == doc[None, :]
        start = np.asarray(cu)[doc]
    if name == "full":
        return np.ones((n, n), bool)
    if name == "causal":
        return diff >= 0
    if name in ("full_document", "full_document_long"):
        return same
    if name in ("causal_document", "causal_document_long"):
        return same & (diff >= 0)
    if name == "sliding_window_causal":
        return (diff >= 0) & (diff <= window)
    if name == "sliding_window":
        if compat:
            return np.ones((n, n), bool) if window >= n else (diff >= 0) & (diff <= window)
        return np.abs(diff) <= window
    if name == "share_question":
        return (diff >= 0) & (same | (doc[None, :] == 0))
    if name == "causal_blockwise":
        return (diff >= 0) & (same | (doc[:, None] == doc.max()))
    if name == "prefix_lm_causal":
        pl = p["prefix_length"]
        return (diff >= 0) | ((i < pl) & (j < pl))
    if name == "prefix_lm_document":
        pl = p["prefix_length"]
        s = start[:, None]
        return same & ((diff >= 0) | ((i - s < pl) & (j - s < pl)))
    if name == "global_sliding_window":
        g = p["global_size"]
        if not compat:
            return (i < g) | (j < g) | (np.abs(diff) <= window)
        tail = (i >= n - g) & (j < g) & (j <= i - (n - g))
        head = (i < g) & (j >= g) & (j <= i + n - g)
        band = (i >= g) & (j >= g) & (np.abs(diff) <= g)
        return tail | head | band
    if name == "block_causal_document":
        b = p["block_size"]
        return same & (j // b <= i // b)
    raise AssertionError(name)


def _params_for(name: str, n: int) -> dict:
    return {"block_size": 64} if name == "block_causal_document" and n % 1024 else {}


@pytest.mark.parametrize("compat", [False, True])
@pytest.mark.parametrize("name", MASK_NAMES)
def test_definitions_elementwise(name, compat):
    for n, seed, window in [(64, 0, 5), (320, 1, 17), (1024, 42, 100), (2048, 7, 1024)]:
        m = make_mask(
            name, n, seed=seed, window=window, reference_compat=compat, **_params_for(name, n)
        )
        dense = m.dense()
        assert dense.shape == (n, n)
        assert m.area() == int(dense.sum())
        np.testing.assert_array_equal(dense, _expected(m, name, n, window, compat), err_msg=name)


@pytest.mark.parametrize("compat", [False, True])
@pytest.mark.parametrize(
    "name", ["sliding_window", "sliding_window_causal", "global_sliding_window"]
)
def test_window_edges(name, compat):
    n = 96
    for window in (0, 1, 2, n - 2, n - 1, n, n + 3):
        m = make_mask(name, n, window=window, reference_compat=compat, seed=window)
        assert m.area() == int(m.dense().sum())
        np.testing.assert_array_equal(m.dense(), _expected(m, name, n, window, compat))
        assert m.params["window"] == (
            m.params["global_size"] if compat and "global" in name else window
        )


@pytest.mark.parametrize("compat", [False, True])
def test_global_size_edges(compat):
    n = 80
    for g in (0, 1, 30, n - 1, n):
        m = make_mask("global_sliding_window", n, window=9, global_size=g, reference_compat=compat)
        np.testing.assert_array_equal(
            m.dense(), _expected(m, "global_sliding_window", n, 9, compat)
        )


def test_documents_follow_sampler():
    for name in ("full_document", "share_question", "prefix_lm_document"):
        for seed in range(3):
            m = make_mask(name, 3000, seed=seed)
            lens = generate_seqlens("pile", 3000, random.Random(seed))
            assert np.diff(m.params["cu_seqlens"]).tolist() == lens
            cu = m.params["cu_seqlens"]
            assert cu.dtype == np.int64 and cu[0] == 0 and cu[-1] == 3000


def test_long_documents_composition():
    n = 65536
    for compat in (False, True):
        m = make_mask("causal_document_long", n, seed=3, reference_compat=compat)
        rng = random.Random(3)
        short = generate_seqlens("prolong512k", int(n * 0.4), rng)
        long_ = generate_seqlens({(8192, 30720): 1.0}, n - int(n * 0.4), rng)
        rng.shuffle(merged := short + long_)
        assert np.diff(m.params["cu_seqlens"]).tolist() == merged
        assert m.params["distribution"] == "prolong512k"


def test_random_draw_ranges():
    for seed in range(40):
        n = 900 + seed
        p = make_mask("prefix_lm_causal", n, seed=seed).params["prefix_length"]
        assert 1 <= p <= n
        pd = make_mask("prefix_lm_document", n, seed=seed).params
        assert 1 <= pd["prefix_length"] <= pd["cu_seqlens"][1]
        g = make_mask("global_sliding_window", n, seed=seed).params["global_size"]
        assert 1 <= g <= n // 3 - 1
        assert (
            g
            == make_mask("global_sliding_window", n, seed=seed, reference_compat=True).params[
                "global_size"
            ]
        )
        lens = np.diff(
            make_mask("block_causal_document", 4096, seed=seed, block_size=128).params["cu_seqlens"]
        )
        assert np.all(lens % 128 == 0) and np.all(lens[:-1] <= 8 * 128)


def test_explicit_parameters():
    m = make_mask("prefix_lm_causal", 500, prefix_length=500)
    assert m.slices[2].tolist() == [0]
    m = make_mask("prefix_lm_document", 500, prefix_length=7, seqlens=[100, 5, 395])
    assert m.params["prefix_length"] == 7 and m.params["cu_seqlens"].tolist() == [0, 100, 105, 500]
    np.testing.assert_array_equal(m.dense(), _expected(m, "prefix_lm_document", 500, 0, False))
    m = make_mask("block_causal_document", 512, block_size=64, seqlens=[100, 300, 112])
    np.testing.assert_array_equal(m.dense(), _expected(m, "block_causal_document", 512, 0, False))
    m = make_mask("causal_document_long", 600, seqlens=[600])
    assert m.slices[2].tolist() == [1]
    m = make_mask("share_question", 10, seqlens=[10])
    assert m.area() == 55


def test_metadata():
    for name in MASK_NAMES:
        m = make_mask(name, 2048, seed=5)
        assert m.name == name
        assert m.params["reference_compat"] is False and m.params["seed"] == 5
        assert ("cu_seqlens" in m.params) == (name in DOC_MASKS)
        assert m.seqlen_q == m.seqlen_k == 2048
    assert make_mask("block_causal_document", 2048).params["block_size"] == 1024
    sw = make_mask("sliding_window", 2048, window=33).params
    assert sw["window"] == 33


def test_distribution_choice():
    n = 65536
    assert make_mask("full_document", n).params["distribution"] == "prolong512k"
    assert (
        make_mask("full_document", n, reference_compat=True).params["distribution"] == "prolong64k"
    )
    assert make_mask("full_document", 1024, distribution="short").params["distribution"] == "short"
    custom = {(10, 20): 1.0}
    m = make_mask("full_document", 1000, distribution=custom)
    assert m.params["distribution"] == "custom"
    assert np.all(np.diff(m.params["cu_seqlens"])[:-1] >= 10)
    named = make_mask("causal_document", 5000, distribution="pile").params["cu_seqlens"]
    from attn_masks.sampling import load_distribution

    as_dict = make_mask("causal_document", 5000, distribution=load_distribution("pile"))
    np.testing.assert_array_equal(named, as_dict.params["cu_seqlens"])
    big = make_mask("full_document_long", 2 * n, reference_compat=True)
    assert big.params["distribution"] == "prolong512k"
    with pytest.raises(ValueError, match=r"131072.*\[1, 65536\]"):
        make_mask("full_document", 2 * n, reference_compat=True)


def test_one_million_tokens_is_fast():
    make_mask("causal_document", 1 << 10)
    best = min(_timed(lambda: make_mask("causal_document", 1 << 20)) for _ in range(2))
    assert best < 1.0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: make_mask("causal_doc", 64), r"'causal_doc'.*causal_document"),
        (lambda: make_mask("causal", 0), r"seqlen .*got 0"),
        (lambda: make_mask("causal", -8), r"seqlen .*got -8"),
        (lambda: make_mask("causal", 1.5), r"seqlen .*got 1.5"),
        (lambda: make_mask("sliding_window", 64, window=-1), r"window .*got -1"),
        (lambda: make_mask("prefix_lm_causal", 64, prefix_length=0), r"\[1, 64\], got 0"),
        (lambda: make_mask("prefix_lm_causal", 64, prefix_length=65), r"\[1, 64\], got 65"),
        (lambda: make_mask("global_sliding_window", 64, global_size=65), r"\[0, 64\], got 65"),
        (lambda: make_mask("global_sliding_window", 5), "seqlen 5"),
        (lambda: make_mask("block_causal_document", 1500), "1500"),
        (lambda: make_mask("block_causal_document", 1024, block_size=0), r"block_size .*got 0"),
        (lambda: make_mask("block_causal_document", 1024, block_size=-4), r"block_size .*got -4"),
        (lambda: make_mask("full_document", 100, seqlens=[50, 40]), "seqlen 100, got sum 90"),
        (lambda: make_mask("full_document", 100, seqlens=[120, -20]), "-20"),
        (lambda: make_mask("full_document", 100, prefixlen=3), "prefixlen"),
        (lambda: make_mask("full_document", 100, distribution="wiki"), "wiki"),
    ],
)
def test_errors(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_block_size_error_names_valid_rule():
    with pytest.raises(ValueError, match=re.escape("multiple of block_size 1024")):
        make_mask("block_causal_document", 1500)


# --- mask streams (MaskIterator) --------------------------------------------------------------


def _reference_seqlens(table: dict, total: int, rng: random.Random) -> list[int]:
    """docs/masks.md's sampler: normalised weights, one choices() bucket, randint inclusive of b."""
    buckets = list(table)
    weight_sum = sum(table.values())
    probs = [w / weight_sum for w in table.values()]
    out: list[int] = []
    while sum(out) < total:
        a, b = rng.choices(buckets, weights=probs, k=1)[0]
        out.append(max(min(rng.randint(a, b), total - sum(out)), 1))
    return out


def _reference_stream(name: str, n: int, count: int, seed: int) -> list:
    """What the reference's MaskIterator draws: every mask continues one Random(seed) stream."""
    from attn_masks.sampling import load_distribution

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if name == "causal_document_long":
            short = _reference_seqlens(load_distribution("prolong512k"), int(n * 0.4), rng)
            long_ = _reference_seqlens({(8192, 30720): 1.0}, n - int(n * 0.4), rng)
            lens = short + long_
            rng.shuffle(lens)
            out.append(lens)
        elif name == "prefix_lm_document":
            lens = _reference_seqlens(load_distribution("pile"), n, rng)
            out.append((lens, rng.randint(1, lens[0])))
        elif name == "global_sliding_window":
            out.append(max(1, rng.randint(1, n // 3 - 1)))
    return out


def _drawn(m, name: str):
    lens = np.diff(m.params["cu_seqlens"]).tolist() if "cu_seqlens" in m.params else None
    if name == "causal_document_long":
        return lens
    if name == "prefix_lm_document":
        return (lens, m.params["prefix_length"])
    return m.params["global_size"]


@pytest.mark.parametrize(
    "name, n",
    [("causal_document_long", 65536), ("prefix_lm_document", 4096), ("global_sliding_window", 900)],
)
def test_make_masks_continue_one_stream_like_mask_iterator(name, n):
    masks = make_masks(name, n, 4, seed=42, reference_compat=True)
    expected = _reference_stream(name, n, 4, 42)
    assert [_drawn(m, name) for m in masks] == expected
    assert [m.params["draw"] for m in masks] == [0, 1, 2, 3]
    assert all(m.params["seed"] == 42 for m in masks)


@pytest.mark.parametrize("compat", [False, True])
@pytest.mark.parametrize("name", MASK_NAMES)
def test_make_masks_first_equals_make_mask(name, compat):
    kw = dict(seed=7, window=33, reference_compat=compat, **_params_for(name, 2048))
    first = make_masks(name, 2048, 2, **kw)[0]
    one = make_mask(name, 2048, **kw)
    for a, b in zip(first.slices, one.slices):
        np.testing.assert_array_equal(a, b)
    assert {k: v for k, v in first.params.items() if k != "draw"}.keys() == one.params.keys()
    if "cu_seqlens" in one.params:
        np.testing.assert_array_equal(first.params["cu_seqlens"], one.params["cu_seqlens"])


def test_make_masks_second_draw_continues_the_stream():
    rng = random.Random(42)
    generate_seqlens("pile", 8192, rng)
    second = generate_seqlens("pile", 8192, rng)
    masks = make_masks("causal_document", 8192, 3, reference_compat=True)
    assert np.diff(masks[1].params["cu_seqlens"]).tolist() == second
    cus = [m.params["cu_seqlens"].tolist() for m in masks]
    assert cus[0] != cus[1] and cus[1] != cus[2] and cus[0] != cus[2]
    assert masks[0].area() == GOLDEN_8K["causal_document"][1]
    for m in make_masks("causal_document", 1024, 3, seed=5):
        np.testing.assert_array_equal(m.dense(), _expected(m, "causal_document", 1024, 0, False))


def test_make_masks_errors():
    with pytest.raises(ValueError, match="count must be a positive integer, got 0"):
        make_masks("causal", 64, 0)
    with pytest.raises(ValueError, match=r"'causal_doc'"):
        make_masks("causal_doc", 64, 2)
