"""Document-length tables, the reference sampler and the table-selection rules."""

import hashlib
import random
import re
from importlib import resources

import pytest

from attn_masks.sampling import (
    TABLE_NAMES,
    default_distribution,
    generate_seqlens,
    load_distribution,
    parse_bucket,
)

TABLE_SHA256 = {
    "pile": "0eaba39cc011c7eeb25a11eaaf10388bf4c61e326dd186738b90042467668bfd",
    "prolong64k": "6a72815e64ae998c084f5919ef9d1d6e5e5636334c7e011362c144652a364ae5",
    "prolong512k": "94fa0259e667096f952e7f2cf508fec6babae50757df7eca32686dee1c5b734a",
}


def _reference_sampler(table: dict, total: int, rng: random.Random) -> list[int]:
    """docs/masks.md's sampler written out plainly: normalise, choices(weights=...), randint, clip,
    raise 0."""
    norm = sum(table.values())
    buckets = list(table)
    weights = [w / norm for w in table.values()]
    out: list[int] = []
    while sum(out) < total:
        a, b = rng.choices(buckets, weights=weights, k=1)[0]
        out.append(max(min(rng.randint(a, b), total - sum(out)), 1))
    return out


@pytest.mark.parametrize(
    "name, buckets, first, last, raw_sum",
    [
        ("pile", 41, ((0, 32), 0.029931), ((14208, 9323168), 0.002246), 0.999555),
        ("prolong64k", 44, ((0, 64), 0.041225), ((50272, 61920), 0.001531), 0.999991),
        ("prolong512k", 42, ((0, 32), 0.010066), ((10912, 475872), 0.007308), 0.999508),
        ("long", 12, ((0, 2048), 0.16), ((2097152, 4194304), 0.01), 1.31),
        ("short", 18, ((0, 256), 0.0766), ((20480, 65536), 0.0064), 1.0),
    ],
)
def test_tables(name, buckets, first, last, raw_sum):
    table = load_distribution(name)
    items = list(table.items())
    assert len(items) == buckets
    assert items[0] == first and items[-1] == last
    assert sum(table.values()) == pytest.approx(raw_sum, abs=1e-9)
    assert all(a < b for a, b in table)


def test_vendored_tables_are_verbatim():
    for name, digest in TABLE_SHA256.items():
        data = resources.files("attn_masks").joinpath("distributions", f"{name}.json").read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, name


@pytest.mark.parametrize(
    "table, seqlen, docs, first, longest",
    [
        ("pile", 1024, 4, [353, 559, 102, 10], 559),
        ("pile", 8192, 17, [353, 559, 102, 421, 322], 3608),
        ("prolong64k", 16384, 25, [545, 719, 166, 581, 482], 4167),
        ("prolong64k", 32768, 59, [545, 719, 166, 581, 482], 4167),
        ("prolong64k", 49152, 77, [545, 719, 166, 581, 482], 4167),
    ],
)
def test_golden_documents(table, seqlen, docs, first, longest):
    lens = generate_seqlens(table, seqlen, random.Random(42))
    assert len(lens) == docs
    assert lens[: len(first)] == first
    assert max(lens) == longest
    assert sum(lens) == seqlen


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_matches_plain_reference_sampler(name):
    table = load_distribution(name)
    for seed in range(6):
        for total in (1, 777, 8192, 100_000):
            ours = generate_seqlens(name, total, random.Random(seed))
            assert ours == _reference_sampler(table, total, random.Random(seed))
            assert sum(ours) == total and min(ours) >= 1


def test_rng_stream_continues_after_sampling():
    rng_a, rng_b = random.Random(7), random.Random(7)
    generate_seqlens("pile", 4096, rng_a)
    _reference_sampler(load_distribution("pile"), 4096, rng_b)
    assert rng_a.random() == rng_b.random()


def test_upper_bound_inclusive_and_zero_raised_to_one():
    lens = generate_seqlens({(3, 4): 1.0}, 10_000, random.Random(0))
    assert set(lens[:-1]) == {3, 4}
    assert generate_seqlens({(0, 0): 1.0}, 5, random.Random(0)) == [1] * 5
    assert generate_seqlens("pile", 0, random.Random(0)) == []


def test_dict_keys_forms_agree():
    as_tuples = {(0, 100): 2.0, (100, 1000): 1.0}
    as_strings = {"[0,100)": 2.0, "[100,1000)": 1.0}
    a = generate_seqlens(as_tuples, 5000, random.Random(3))
    assert a == generate_seqlens(as_strings, 5000, random.Random(3))
    assert parse_bucket("[256,512)") == (256, 512)
    assert parse_bucket((256.0, 512.0)) == (256, 512)


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("wiki", "wiki"),
        ({"[1,2,3)": 1.0}, "[1,2,3)"),
        ({(5, 2): 1.0}, "b=2"),
        ({(0, 4): -1.0}, "-1.0"),
        ({(0, 4): 0.0}, "positive weight"),
        (12, "int"),
    ],
)
def test_bad_distributions(bad, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        load_distribution(bad)


def test_negative_total():
    with pytest.raises(ValueError, match="-3"):
        generate_seqlens("pile", -3, random.Random(0))


@pytest.mark.parametrize(
    "seqlen, cp, kernel",
    [
        (1, "pile", "pile"),
        (12 * 1024, "pile", "pile"),
        (12 * 1024 + 1, "prolong64k", "prolong64k"),
        (64 * 1024 - 1, "prolong64k", "prolong64k"),
        (64 * 1024, "prolong512k", "prolong64k"),
        (1024 * 1024, "prolong512k", None),
    ],
)
def test_table_selection(seqlen, cp, kernel):
    assert default_distribution(seqlen, "cp") == cp
    assert default_distribution(seqlen) == cp
    if kernel is None:
        with pytest.raises(ValueError, match=f"{seqlen}.*\\[1, 65536\\]"):
            default_distribution(seqlen, "kernel")
    else:
        assert default_distribution(seqlen, "kernel") == kernel


@pytest.mark.parametrize(
    "seqlen, rule", [(1024 * 1024 + 1, "cp"), (0, "cp"), (64 * 1024 + 1, "kernel")]
)
def test_table_selection_out_of_range(seqlen, rule):
    with pytest.raises(ValueError, match=str(seqlen)):
        default_distribution(seqlen, rule)


def test_unknown_rule():
    with pytest.raises(ValueError, match="flash"):
        default_distribution(1024, "flash")
