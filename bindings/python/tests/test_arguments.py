"""Scalar arguments: every public call checks and converts its own (layer, budget, count, rows, scale, stream, config
fields, ...), so that a wrong type or a value its C type cannot hold gets a TypeError or a KvretError naming the
argument as the caller spelled it, never SWIG's "in method 'kvret_seq_budget', argument 2 of type 'int32_t'"."""

import re

import numpy as np
import pytest
from conftest import GEOMETRY, TOKENS, make_context, random_kv

import kvret

N_Q, N_KV, D = GEOMETRY["n_q_heads"], GEOMETRY["n_kv_heads"], GEOMETRY["head_dim"]

WRONG_TYPES = ["1", b"1", 1.0, 1.5, float("nan"), 1j, [1], (1,), object(), np.float32(2.0)]
INT32_OUT = [2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**64, -(2**100)]
INT64_OUT = [2**63, -(2**63) - 1, 2**64, 2**100, -(2**100)]
ABSURD_INT32 = [2**31 - 1, -(2**31)]  # fit an int32: the library refuses them, with its own message
FLOAT_WRONG_TYPES = ["1", b"1", 1j, [1.0], object(), None]
FLOAT_OUT = [1e39, -1e39, 10**400]

SWIG_MESSAGE = re.compile(r"in method|argument \d|of type '")


def check_refused(call, value, names):
    with pytest.raises((TypeError, ValueError, OverflowError, kvret.KvretError)) as info:
        call(value)
    message = str(info.value)
    assert not SWIG_MESSAGE.search(message), f"{value!r}: SWIG's message reached the user: {message}"
    assert any(name in message for name in names), f"{value!r}: the message does not name {names}: {message}"
    return info.value


@pytest.fixture
def filled(sequence, rng):
    for layer in range(GEOMETRY["n_layers"]):
        sequence.append_prefill(layer, *random_kv(rng))
    return sequence


def sequence_calls(seq, rng):
    """(argument name, names a message may use for it, C type, call taking the value) for every scalar argument."""
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    k, v = random_kv(rng)
    k_heads, v_heads = k.swapaxes(0, 1), v.swapaxes(0, 1)  # [n_kv_heads, rows, head_dim] for ctx.attend
    positions = seq.select(0, q, budget=4)
    ctx = seq.context
    return [
        ("append_prefill.layer", ["layer"], "int32", lambda x: seq.append_prefill(x, k, v)),
        ("append_decode.layer", ["layer"], "int32", lambda x: seq.append_decode(x, k[0], v[0])),
        ("wait_index.layer", ["layer"], "int32", lambda x: seq.wait_index(x)),
        ("length.layer", ["layer"], "int32", lambda x: seq.length(x)),
        ("budget.layer", ["layer"], "int32", lambda x: seq.budget(x)),
        ("working_set_capacity.layer", ["layer"], "int32", lambda x: seq.working_set_capacity(x)),
        ("working_set_capacity.budget", ["budget"], "int32", lambda x: seq.working_set_capacity(0, x)),
        ("select.layer", ["layer"], "int32", lambda x: seq.select(x, q)),
        ("select.budget", ["budget"], "int32", lambda x: seq.select(0, q, budget=x)),
        ("select_scored.layer", ["layer"], "int32", lambda x: seq.select_scored(x, q)),
        ("select_scored.budget", ["budget"], "int32", lambda x: seq.select_scored(0, q, budget=x)),
        ("attend.layer", ["layer"], "int32", lambda x: seq.attend(x, q)),
        ("attend.budget", ["budget"], "int32", lambda x: seq.attend(0, q, budget=x)),
        ("attend.scale", ["scale"], "float", lambda x: seq.attend(0, q, scale=x)),
        ("attend.stream", ["stream"], "stream", lambda x: seq.attend(0, q, stream=x)),
        ("fetch.layer", ["layer"], "int32", lambda x: seq.fetch(x, positions)),
        ("fetch.count", ["count"], "int32", lambda x: seq.fetch(0, positions, count=x)),
        ("fetch.stream", ["stream"], "stream", lambda x: seq.fetch(0, positions, stream=x)),
        ("prefetch.layer", ["layer"], "int32", lambda x: seq.prefetch(x, q)),
        ("prefetch.budget", ["budget"], "int32", lambda x: seq.prefetch(0, q, budget=x)),
        ("prefetch.stream", ["stream"], "stream", lambda x: seq.prefetch(0, q, stream=x)),
        ("read.layer", ["layer"], "int32", lambda x: seq.read(x, 0, 4)),
        ("read.begin", ["begin", "range"], "int64", lambda x: seq.read(0, x, 4)),
        ("read.end", ["end", "range"], "int64", lambda x: seq.read(0, 0, x)),
        ("truncate.length", ["length"], "length", lambda x: seq.truncate(x)),
        ("drop_front.keep", ["keep"], "length", lambda x: seq.drop_front(x, 1)),
        ("drop_front.count", ["count"], "length", lambda x: seq.drop_front(0, x)),
        ("ctx.attend.rows", ["rows"], "int64", lambda x: ctx.attend(q, k_heads, v_heads, x)),
        ("ctx.attend.scale", ["scale"], "float", lambda x: ctx.attend(q, k_heads, v_heads, scale=x)),
        ("ctx.attend.stream", ["stream"], "stream", lambda x: ctx.attend(q, k_heads, v_heads, stream=x)),
        ("select_batch.layer", ["layer"], "int32", lambda x: ctx.select_batch([seq], x, q[None])),
        ("select_batch.budget", ["budget"], "int32", lambda x: ctx.select_batch([seq], 0, q[None], budget=x)),
        ("synchronize.stream", ["stream"], "stream", lambda x: ctx.synchronize(x)),
        ("status_string.status", ["status"], "int32", lambda x: kvret.status_string(x)),
    ]


def bad_values(c_type):
    if c_type == "float":
        return [x for x in FLOAT_WRONG_TYPES if x is not None] + FLOAT_OUT  # None: the default scale
    if c_type == "stream":
        return ["0", 1.5, [0], object(), -1, 2**64, 2**100]
    if c_type == "length":  # any non-negative integer is a length (beyond every layer: a no-op)
        return WRONG_TYPES + [-1, -(2**63) - 1, -(2**100)]
    wrong = [x for x in WRONG_TYPES if x is not None]
    return wrong + (INT32_OUT + ABSURD_INT32 if c_type == "int32" else INT64_OUT)


def test_every_scalar_argument_is_checked_before_swig(filled, rng):
    for name, names, c_type, call in sequence_calls(filled, rng):
        for value in bad_values(c_type):
            if c_type == "int32" and value in ABSURD_INT32 and name == "status_string.status":
                continue  # any int32 has a name ("KVRET_ERR_UNKNOWN")
            try:
                check_refused(call, value, names)
            except AssertionError as error:
                raise AssertionError(f"{name}: {error}") from None
            except pytest.fail.Exception as error:
                raise AssertionError(f"{name}({value!r}) was accepted: {error}") from None
    assert filled.length(0) == TOKENS  # nothing refused changed the sequence


def test_integers_are_never_rounded_and_numpy_integers_are_integers(filled, rng):
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    np.testing.assert_array_equal(filled.select(np.int64(0), q, budget=np.int32(8)), filled.select(0, q, budget=8))
    assert filled.length(np.uint8(1)) == TOKENS
    error = check_refused(lambda x: filled.select(x, q), 0.0, ["layer"])
    assert isinstance(error, TypeError) and "integer" in str(error)
    error = check_refused(lambda x: filled.select(0, q, budget=x), 2**31, ["budget"])
    assert error.status == kvret.Status.BUDGET
    error = check_refused(lambda x: filled.length(x), 2**40, ["layer"])
    assert error.status == kvret.Status.OUT_OF_RANGE
    error = check_refused(lambda x: filled.read(0, x, 4), 2**63, ["begin"])
    assert error.status == kvret.Status.OUT_OF_RANGE


def test_scales_are_real_numbers(filled, rng):
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    np.testing.assert_array_equal(filled.attend(0, q, scale=np.float64(0.25)), filled.attend(0, q, scale=0.25))
    np.testing.assert_array_equal(filled.attend(0, q, scale=1), filled.attend(0, q, scale=1.0))  # an int is a real
    error = check_refused(lambda x: filled.attend(0, q, scale=x), 1e39, ["scale"])
    assert error.status == kvret.Status.INVALID_ARGUMENT


def config_values(field):
    """Wrong types and out-of-range values for a config field (its C type from the SWIG proxy's docstring)."""
    doc = getattr(kvret.kvret_swig.kvret_config, field).__doc__ or ""
    c_type = doc.partition(" : ")[2].strip()
    if isinstance(kvret.config.defaults()[field], float):
        assert c_type in ("float", "")
        return FLOAT_WRONG_TYPES + FLOAT_OUT
    wrong = [x for x in WRONG_TYPES if x is not None] + [None]
    beyond_any = [2**64, 2**100, -(2**63) - 1, -(2**100)]
    return wrong + beyond_any + {"int32_t": [2**31, -(2**31) - 1], "uint64_t": [-1]}.get(c_type, [])


def test_every_config_field_is_checked_before_swig():
    checked = 0
    for field in kvret.config.FIELDS:
        if field in ("disk_path", "session_shared_url"):
            continue  # strings: below
        for value in config_values(field):
            if isinstance(value, str) and field in kvret.config._ENUM_NAMES:
                continue  # a name: refused with ValueError (below)
            try:
                check_refused(lambda x: make_context(**{field: x}), value, [field])
            except AssertionError as error:
                raise AssertionError(f"config field {field}: {error}") from None
            checked += 1
    assert checked > 100
    check_refused(lambda x: make_context(index_kind=x), "faiss", ["index_kind"])
    check_refused(lambda x: make_context(device=x), "cuda:x", ["device"])
    check_refused(lambda x: make_context(device=x), 0, ["device"])
    check_refused(lambda x: make_context(device=x), f"cuda:{2**31}", ["device"])
    check_refused(lambda x: make_context(disk_path=x), 5, ["disk_path"])
    check_refused(lambda x: make_context(disk_path=x), "/tmp/a\0b", ["disk_path"])
    for value in (5, b"redis://localhost", ["redis://localhost"]):
        error = check_refused(lambda x: make_context(session_shared_url=x), value, ["session_shared_url"])
        assert isinstance(error, TypeError)
    for value in ("redis://local\0host:6379", "redis://\ud800"):
        error = check_refused(lambda x: make_context(session_shared_url=x), value, ["session_shared_url"])
        assert error.status == kvret.Status.INVALID_ARGUMENT


def test_config_values_that_fit_are_taken():
    with make_context(
        n_threads=np.int64(1), seed=2**64 - 1, max_seq_tokens=2**40, budget_ratio=np.float32(0.5), check_finite=True
    ) as ctx:
        config = ctx.config
        assert config["n_threads"] == 1 and config["seed"] == 2**64 - 1 and config["max_seq_tokens"] == 2**40
        assert config["budget_ratio"] == 0.5 and config["check_finite"] == 1


def test_other_arguments_of_the_wrong_kind(filled, rng):
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    positions = filled.select(0, q, budget=4)
    with pytest.raises(TypeError, match="kvret.Sequence"):
        filled.context.select_batch([filled, "not a sequence"], 0, np.stack([q, q]))
    with pytest.raises(TypeError, match=r"\(positions, scores\)"):
        filled.select_scored(0, q, out=np.zeros((N_KV, 8), np.int32))
    with pytest.raises(TypeError, match=r"\(k, v, positions\)"):
        filled.fetch(0, positions, out=np.zeros((N_KV, 64, D), np.float32))
    with pytest.raises(TypeError, match="cannot write into"):
        filled.select(0, q, out=[[0] * 8] * N_KV)
