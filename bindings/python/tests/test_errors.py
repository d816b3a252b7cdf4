"""Failures raise kvret.KvretError carrying the status and the library's message."""

import numpy as np
import pytest
from conftest import GEOMETRY, TOKENS, make_context, random_kv

import kvret

N_Q, N_KV, D = GEOMETRY["n_q_heads"], GEOMETRY["n_kv_heads"], GEOMETRY["head_dim"]


def raised(call, status):
    with pytest.raises(kvret.KvretError) as info:
        call()
    error = info.value
    assert error.status == status, error
    assert isinstance(error.message, str) and error.message, "the library's message"
    assert error.message in str(error)
    return error


def test_wrong_shape_leaves_the_sequence_as_it_was(sequence, rng):
    k, v = random_kv(rng)
    sequence.append_prefill(0, k, v)
    bad_k = rng.standard_normal((TOKENS, N_KV + 1, D), dtype=np.float32)
    raised(lambda: sequence.append_prefill(0, bad_k, bad_k), kvret.Status.SHAPE)
    assert sequence.length(0) == TOKENS
    raised(lambda: sequence.select(0, np.zeros((N_Q, D + 1), np.float32)), kvret.Status.SHAPE)


def test_layer_out_of_range(sequence, rng):
    error = raised(lambda: sequence.append_prefill(GEOMETRY["n_layers"], *random_kv(rng)), kvret.Status.OUT_OF_RANGE)
    assert str(GEOMETRY["n_layers"]) in error.message
    raised(lambda: sequence.length(-3), kvret.Status.OUT_OF_RANGE)


def test_budget_zero(sequence, rng):
    sequence.append_prefill(0, *random_kv(rng))
    error = raised(lambda: sequence.select(0, np.zeros((N_Q, D), np.float32), budget=0), kvret.Status.BUDGET)
    # Python's spelling of the default budget, not the C constant
    assert "None" in error.message and "KVRET_BUDGET_DEFAULT" not in error.message


def test_select_scored_outputs(sequence, rng):
    sequence.append_prefill(0, *random_kv(rng))
    q = np.zeros((N_Q, D), np.float32)
    positions = np.full((N_KV, 8), -1, np.int32)
    raised(lambda: sequence.select_scored(0, q, budget=8, out=(positions, np.zeros((N_KV, 8), np.int32))),
           kvret.Status.DTYPE)
    raised(lambda: sequence.select_scored(0, q, budget=8, out=(positions, np.zeros((N_KV, 7), np.float32))),
           kvret.Status.SHAPE)
    assert (positions == -1).all()  # nothing written by a refused call


def test_wrong_dtype_and_read_only_output(sequence, rng):
    sequence.append_prefill(0, *random_kv(rng))
    q = np.zeros((N_Q, D), np.float32)
    raised(lambda: sequence.select(0, q, out=np.zeros((N_KV, 64), np.int64)), kvret.Status.DTYPE)
    read_only = np.zeros((N_KV, 64), np.int32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        sequence.select(0, q, out=read_only)


def test_invalid_config():
    raised(lambda: make_context(n_q_heads=6, n_kv_heads=4), kvret.Status.INVALID_ARGUMENT)
    with pytest.raises(TypeError, match="unknown config field") as info:
        make_context(n_layer=2)
    assert "did you mean 'n_layers'" in str(info.value)
    assert "budget_ratio" not in str(info.value)  # the closest names, not all of them
    with pytest.raises(TypeError, match="unknown config field 'zzz' \\(kvret.config.FIELDS"):
        make_context(zzz=1)
    with pytest.raises(ValueError, match="index_kind"):
        make_context(index_kind="faiss")


@pytest.mark.parametrize("fraction", [-0.1, 0.75, float("nan")])
def test_invalid_pq_exact_fraction(fraction):
    error = raised(lambda: make_context(pq_exact_fraction=fraction), kvret.Status.INVALID_ARGUMENT)
    assert "pq_exact_fraction" in error.message


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"index_kind": "quant", "quant_group_size": 48}, "quant_group_size"),
        ({"index_kind": "quant", "quant_residual": -1}, "quant_residual"),
        ({"index_kind": "quant", "quant_attention": 2}, "quant_attention"),
        ({"index_kind": "pq", "quant_attention": 1}, "quant_attention"),
        ({"cluster_segment_tokens": -1}, "cluster_segment_tokens"),
        ({"index_kind": "cluster", "cluster_reuse_steps": -1}, "cluster_reuse_steps"),
        ({"index_kind": "cluster", "cluster_reuse_steps": 1025}, "cluster_reuse_steps"),
        ({"device_bytes_limit": -1}, "device_bytes_limit"),
        ({"index_kind": "cluster", "cluster_exact_fraction": -0.1}, "cluster_exact_fraction"),
        ({"index_kind": "cluster", "cluster_exact_fraction": 0.6}, "cluster_exact_fraction"),
        ({"index_kind": "cluster", "cluster_exact_fraction": float("nan")}, "cluster_exact_fraction"),
        ({"index_kind": "quant", "quant_rerank": 0}, "quant_rerank"),
        ({"index_kind": "quant", "quant_rerank": 65}, "quant_rerank"),
        ({"hamming_importance": 2}, "hamming_importance"),
        ({"hamming_importance": -1}, "hamming_importance"),
        ({"hamming_fraction": 0.25, "hamming_granularity": 3}, "hamming_granularity"),
        ({"hamming_fraction": 0.25, "hamming_granularity": -1}, "hamming_granularity"),
        ({"hamming_fraction": 0.25, "hamming_granularity": 8192}, "hamming_granularity"),
    ],
)
def test_invalid_quant_and_cluster_fields(overrides, field):
    error = raised(lambda: make_context(**overrides), kvret.Status.INVALID_ARGUMENT)
    assert field in error.message


def test_error_is_a_runtime_error_and_pickles():
    import pickle

    error = kvret.KvretError(kvret.Status.BUDGET, "budget must be >= 1")
    assert isinstance(error, RuntimeError)
    again = pickle.loads(pickle.dumps(error))
    assert again.status == kvret.Status.BUDGET and again.message == error.message


def test_absurd_budgets_are_refused_before_any_allocation(sequence, rng):
    sequence.append_prefill(0, *random_kv(rng))
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    for budget in (2**40, 10**9, TOKENS + 1):  # past int32; within it but past the layer's tokens
        with pytest.raises(kvret.KvretError) as info:
            sequence.select(0, q, budget=budget)
        assert info.value.status == kvret.Status.BUDGET, info.value
        with pytest.raises(kvret.KvretError) as info:
            sequence.context.select_batch([sequence], 0, q[None], budget=budget)
        assert info.value.status == kvret.Status.BUDGET
    with pytest.raises(TypeError):
        sequence.select(0, q, budget=3.5)  # not rounded to 3


def test_positions_and_arrays_are_never_silently_converted(sequence, rng):
    sequence.append_prefill(0, *random_kv(rng))
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    positions = sequence.select(0, q, budget=4)
    wrapped = positions.astype(np.int64) + 2**32  # would wrap to the same positions as int32
    with pytest.raises(kvret.KvretError) as info:
        sequence.fetch(0, wrapped)
    assert info.value.status == kvret.Status.OUT_OF_RANGE and "int32" in str(info.value)
    with pytest.raises(TypeError, match="positions must be integers"):
        sequence.fetch(0, positions + 0.9)  # not rounded down to the selected positions
    np.testing.assert_array_equal(sequence.fetch(0, positions.astype(np.int64)).positions,
                                  sequence.fetch(0, positions).positions)  # in-range int64 is fine
    for bad in (q.astype(np.int8), q > 0, q.astype(np.complex64)):
        with pytest.raises(TypeError, match="floating point"):
            sequence.select(0, bad)


def test_sequence_edits_and_attend_refuse_bad_values(sequence, rng):
    sequence.append_prefill(0, *random_kv(rng))
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    raised(lambda: sequence.attend(0, q[:, : D // 2]), kvret.Status.SHAPE)
    raised(lambda: sequence.attend(5, q), kvret.Status.OUT_OF_RANGE)
    raised(lambda: sequence.attend(0, q, budget=TOKENS + 1), kvret.Status.BUDGET)
    with pytest.raises(ValueError, match="length"):
        sequence.truncate(-3)
    assert sequence.length(0) == TOKENS  # nothing changed
    sequence.close()
    raised(lambda: sequence.fork(), kvret.Status.INVALID_HANDLE)
    raised(lambda: sequence.attend(0, q), kvret.Status.INVALID_HANDLE)


def test_a_call_refused_by_the_extension_releases_only_what_it_converted(sequence, rng):
    # On a failed conversion SWIG releases every tensor argument of the call, also those after the failing one; they
    # must start empty (they were stack garbage, and the release crashed or freed a random object).
    c = kvret.kvret_swig
    k, v = random_kv(rng)
    sequence.append_prefill(0, k, v)
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    positions, scores = np.zeros((N_KV, 8), np.int32), np.zeros((N_KV, 8), np.float32)
    rows = np.zeros((N_KV, 64, D), np.float32)
    working_set = (rows, rows.copy(), np.zeros((N_KV, 64), np.int32))
    for _ in range(50):
        with pytest.raises(TypeError):
            c.kvret_select_scored(sequence._handle, "layer", q, 8, positions, scores)
        with pytest.raises(TypeError):
            c.kvret_append_prefill(sequence._handle, 0, "not an array", v)
        with pytest.raises(TypeError):
            c.kvret_seq_attend(sequence._handle, 0, q, 8, "scale", np.zeros((N_Q, D), np.float32), None)
        with pytest.raises(TypeError):
            c.kvret_fetch_async(sequence._handle, "layer", positions, 8, working_set, None)
        with pytest.raises(TypeError):
            c.kvret_select_batch(
                sequence.context._handle, [sequence._handle], "layer", q[None], 8, positions[None], np.zeros(1, np.int32)
            )
        # the raw batched fetch: arrays of another length than the batch are refused before the call
        ctx_handle, handles, one_row = sequence.context._handle, [sequence._handle], np.zeros(1, np.int64)
        with pytest.raises(ValueError):
            c.kvret_fetch_batch_async(
                ctx_handle, handles, 0, positions[None], np.zeros(2, np.int32), [working_set], one_row, None
            )
        with pytest.raises(ValueError):
            c.kvret_fetch_batch_async(
                ctx_handle, handles, 0, positions[None], np.zeros(1, np.int32), [], one_row, None
            )
        with pytest.raises(ValueError):
            c.kvret_fetch_batch_async(
                ctx_handle, handles, 0, positions[None], np.zeros(1, np.int32), [working_set], np.zeros(3, np.int64), 0
            )
        with pytest.raises(TypeError):
            c.kvret_fetch_batch_async(
                ctx_handle, handles, 0, positions[None], np.zeros(1, np.int64), [working_set], one_row, None
            )
        with pytest.raises(TypeError):
            c.kvret_fetch_batch_async(
                ctx_handle, handles, 0, positions[None], np.zeros(1, np.int32), [rows], one_row, None
            )
    assert sequence.length(0) == TOKENS


@pytest.mark.parametrize("field", ["n_layers", "n_q_heads"])
def test_geometry_past_its_bound_is_refused_naming_the_limit(field):
    overrides = {field: 2**31 - 1}
    if field == "n_q_heads":
        overrides["n_kv_heads"] = 2**31 - 1
    error = raised(lambda: make_context(**overrides), kvret.Status.INVALID_ARGUMENT)
    assert field in error.message and "4096" in error.message


def test_an_object_that_is_no_array_is_named_as_such(sequence):
    class NotAnArray:
        pass

    with pytest.raises(TypeError, match="expected an array .* got NotAnArray"):
        sequence.append_prefill(0, NotAnArray(), NotAnArray())
    assert sequence.length(0) == 0
