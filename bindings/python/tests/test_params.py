"""Each design's parameters as one keyword (pq=dict(m=8), crush=dict(...)): the values reach the context, and bad
ones (out of range, an unknown field, a flat field set next to its group) are refused with a specific error."""

import dataclasses

import pytest
from conftest import make_context

import kvret
from kvret.config import GROUPS


def test_groups_follow_the_header():
    assert GROUPS["pq"] == ("m", "bits", "iters", "tol", "train_sample", "exact_fraction")
    assert GROUPS["crush"] == ("fraction", "buckets", "importance", "granularity")
    assert set(GROUPS) == {"pq", "cluster", "quant", "crush", "session"}
    # the group pointers are no flat fields
    assert not set(GROUPS) & set(kvret.config.FIELDS)


def test_grouped_values_take_effect():
    with make_context(
        index_kind="pq",
        pq=dict(m=8, bits=4, exact_fraction=0.125),
        cluster=dict(tokens=48, reuse_steps=3),
        quant=dict(bits=1, group_size=32),
        crush=dict(fraction=0.25, importance="accumulated"),
        session=dict(ttl_ms=1234, policy="fifo"),
    ) as ctx:
        config = ctx.config
    assert (config["pq_m"], config["pq_bits"], config["pq_exact_fraction"]) == (8, 4, 0.125)
    assert (config["cluster_tokens"], config["cluster_reuse_steps"], config["cluster_decode_k"]) == (48, 3, 4)
    assert (config["quant_bits"], config["quant_group_size"], config["quant_residual"]) == (1, 32, 64)
    assert (config["hamming_fraction"], config["hamming_importance"]) == (0.25, "accumulated")
    assert (config["session_ttl_ms"], config["session_policy"]) == (1234, "fifo")
    # the effective config comes back in the flat fields, so it makes a context of the same config
    with kvret.Context(**config) as again:
        assert again.config == config


def test_a_dataclass_is_a_group():
    @dataclasses.dataclass
    class Pq:
        m: int = 16
        bits: int = 5

    with make_context(pq=Pq()) as ctx:
        assert (ctx.config["pq_m"], ctx.config["pq_bits"]) == (16, 5)


def test_flat_fields_still_work():
    with make_context(pq_m=16, quant_rerank=2) as ctx:
        assert (ctx.config["pq_m"], ctx.config["quant_rerank"]) == (16, 2)


@pytest.mark.parametrize(
    "group, value, field, why",
    [
        ("pq", dict(m=3), "config.pq.m: ", "does not divide head_dim 64"),
        ("pq", dict(exact_fraction=0.75), "config.pq.exact_fraction: ", "[0, 0.5]"),
        ("cluster", dict(reuse_steps=2000), "config.cluster.reuse_steps: ", "0..1024"),
        ("quant", dict(bits=3), "config.quant.bits: ", "1 or 2"),
        ("crush", dict(granularity=3), "config.crush.granularity: ", "power of two"),
        ("session", dict(ttl_ms=-1), "config.session.ttl_ms: ", ">= 0"),
    ],
)
def test_out_of_range_names_the_group_field(group, value, field, why):
    with pytest.raises(kvret.KvretError) as info:
        make_context(**{group: value})
    assert info.value.status == kvret.Status.INVALID_ARGUMENT
    assert info.value.message.startswith(field) and why in info.value.message, info.value.message


def test_a_value_its_c_type_cannot_hold_names_the_group_field():
    with pytest.raises(kvret.KvretError) as info:
        make_context(pq=dict(m=2**40))
    assert info.value.status == kvret.Status.INVALID_ARGUMENT
    assert info.value.message == "pq.m 1099511627776 does not fit an int32"
    with pytest.raises(TypeError, match=r"pq\.bits"):
        make_context(pq=dict(bits="six"))
    with pytest.raises(ValueError, match=r"session\.policy must be one of"):
        make_context(session=dict(policy="newest"))


def test_unknown_group_field_suggests_the_closest():
    with pytest.raises(TypeError, match=r"unknown pq parameter 'bit'; did you mean 'bits'\?"):
        make_context(pq=dict(bit=4))
    with pytest.raises(TypeError, match=r"unknown crush parameter 'importanse'; did you mean 'importance'\?"):
        make_context(crush=dict(importanse="window"))
    # the flat name is no field of the group
    with pytest.raises(TypeError, match=r"unknown pq parameter 'pq_m'"):
        make_context(pq=dict(pq_m=8))
    # a misspelt group is an unknown config field, with the group suggested
    with pytest.raises(TypeError, match=r"unknown config field 'crus'; did you mean 'crush'"):
        make_context(crus=dict(fraction=0.25))


def test_a_group_must_be_a_mapping():
    with pytest.raises(TypeError, match=r"pq must be a dict \(or a dataclass\) of pq parameters, not int"):
        make_context(pq=8)


@pytest.mark.parametrize(
    "flat, group, named",
    [
        (dict(pq_m=8), dict(pq=dict(bits=4)), "set pq.m only"),
        (dict(hamming_fraction=0.5), dict(crush=dict(buckets=2)), "set crush.fraction only"),
        (dict(session_policy="lru"), dict(session=dict()), "set session.policy only"),
    ],
)
def test_flat_field_and_its_group_conflict(flat, group, named):
    with pytest.raises(kvret.KvretError) as info:
        make_context(**flat, **group)
    assert info.value.status == kvret.Status.INVALID_ARGUMENT
    message = info.value.message
    assert message.startswith(f"config.{next(iter(flat))} is changed from its default and config.{next(iter(group))}")
    assert named in message, message
