"""The --variants parser of experiments/mosaic_variants.py (CPU only: no kernel runs)."""

from __future__ import annotations

import dataclasses

import pytest

from experiments.mosaic_variants import parse_variant
from jax_attn.mosaic_gpu import KernelConfig


@dataclasses.dataclass(frozen=True)
class WithBool:
    """A config with a bool field, as KernelConfig may gain (the parser reads the annotations)."""

    block_k: int = 128
    fused_bwd: bool = False


def test_spec_sets_fields_on_the_base_config():
    base = KernelConfig()
    assert parse_variant("default", base) == ("default", base)
    name, cfg = parse_variant("dkv128:block_k_dkv=128+num_stages_bwd=3", base)
    assert name == "dkv128"
    assert cfg == KernelConfig(block_k_dkv=128, num_stages_bwd=3)
    assert cfg != base
    # fields the spec leaves out keep the base's values, not the dataclass defaults
    assert parse_variant("k64:block_k=64", KernelConfig(max_concurrent_steps=3))[1] == KernelConfig(
        block_k=64, max_concurrent_steps=3
    )


def test_kernel_config_bool_field():
    name, cfg = parse_variant("fused:fused_bwd=1+bwd_warpgroups=2", KernelConfig())
    assert (name, cfg) == ("fused", KernelConfig(fused_bwd=True, bwd_warpgroups=2))
    assert cfg.fused_bwd is True


def test_bool_fields_take_bools_and_int_fields_ints():
    assert parse_variant("fused:fused_bwd=1", WithBool())[1] == WithBool(fused_bwd=True)
    assert parse_variant("f:fused_bwd=false+block_k=64", WithBool(fused_bwd=True))[1] == WithBool(
        block_k=64
    )
    assert parse_variant("fused:fused_bwd=1", WithBool())[1].fused_bwd is True


@pytest.mark.parametrize(
    "spec, named",
    [
        ("x:blok_k=64", ["'blok_k=64'", "unknown key 'blok_k'", "block_k_dkv, "]),
        ("x:fused_bwd=2", ["'fused_bwd=2'", "takes 0/1/true/false", "fused_bwd"]),
        ("x:block_k=abc", ["'block_k=abc'", "takes an integer", "num_stages_bwd"]),
        ("x:block_k", ["'block_k'", "expected key=value", "block_k_dq"]),
        ("x:block_k=64+", ["item ''", "expected key=value"]),
        ("x:block_k=100", ["'x:block_k=100'", "block_k=100 is invalid"]),
        ("x:num_stages_bwd=9", ["'x:num_stages_bwd=9'", "num_stages_bwd=9 is invalid"]),
        (":block_k=64", ["':block_k=64'", "expected name"]),
    ],
)
def test_bad_spec_raises_naming_the_item(spec, named):
    with pytest.raises(ValueError) as err:
        parse_variant(spec, KernelConfig())
    for text in named:
        assert text in str(err.value)


def test_none_sets_fields_that_admit_it():
    """`none` hands a field the library decides per call back to it (fused_bwd, block_q_dkv);
    a field that does not admit None refuses it, naming the value."""
    base = KernelConfig(bwd_warpgroups=2, fused_bwd=True, block_q_dkv=64)
    cfg = parse_variant("percall:fused_bwd=none+block_q_dkv=None", base)[1]
    assert (cfg.fused_bwd, cfg.block_q_dkv, cfg.bwd_warpgroups) == (None, None, 2)
    with pytest.raises(ValueError, match=r"'block_k=none'.*takes an integer, got 'none'"):
        parse_variant("x:block_k=none", base)
    with pytest.raises(ValueError, match=r"fused_bwd takes 0/1/true/false or none, got '2'"):
        parse_variant("x:fused_bwd=2", base)


def test_bad_bool_value_is_named():
    with pytest.raises(ValueError, match=r"'fused_bwd=2'.*takes 0/1/true/false.*fused_bwd"):
        parse_variant("fused:fused_bwd=2", WithBool())


def test_recorded_lists_final_records_of_this_head_dim_and_dtype(tmp_path):
    """What --resume skips: the (mask, seqlen, heads, mode, variant, spec) of records at the run's
    head dim and dtype whose status is final; error records and other head dims or dtypes run
    again, and a missing file means nothing is recorded."""
    import json

    from experiments.mosaic_variants import recorded

    base = dict(mask="causal", seqlen=16384, heads="64:8", head_dim=128, dtype="bf16", mode="fwd")
    rows = [
        dict(base, variant="cudnn", spec="cudnn", status="ok"),
        dict(base, variant="tf", spec="tf:tiles_fastest=1", status="wrong"),
        dict(base, variant="ov", spec="ov:bwd_overlap=1", status="error"),
        dict(base, variant="pers", spec="pers:persistent_fwd=1", status="unsupported"),
        dict(base, variant="d64", spec="d64", status="ok", head_dim=64),
        dict(base, variant="fp16", spec="fp16", status="ok", dtype="fp16"),
    ]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    key = ("causal", 16384, "64:8", "fwd")
    assert recorded(str(path), 128, "bf16") == {
        (*key, "cudnn", "cudnn"),
        (*key, "tf", "tf:tiles_fastest=1"),
        (*key, "pers", "pers:persistent_fwd=1"),
    }
    assert recorded(str(tmp_path / "absent.jsonl"), 128, "bf16") == set()
