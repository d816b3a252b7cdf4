"""prefill -> select -> fetch -> attend through NumPy arrays."""

import numpy as np
import pytest
from conftest import BUDGET, GEOMETRY, N_LOCAL, N_SINK, TOKENS, make_context, random_kv, reference_attention

import kvret

N_Q, N_KV, D = GEOMETRY["n_q_heads"], GEOMETRY["n_kv_heads"], GEOMETRY["head_dim"]


def test_round_trip(sequence, rng):
    ctx = sequence.context
    stored = {}
    for layer in range(GEOMETRY["n_layers"]):
        stored[layer] = random_kv(rng)
        sequence.append_prefill(layer, *stored[layer])
    sequence.wait_index()
    for layer in range(GEOMETRY["n_layers"]):
        assert sequence.length(layer) == TOKENS
        q = rng.standard_normal((N_Q, D), dtype=np.float32)
        positions = sequence.select(layer, q)
        assert isinstance(positions, np.ndarray) and positions.dtype == np.int32
        assert positions.shape == (N_KV, BUDGET)
        for head in range(N_KV):
            assert np.all(np.diff(positions[head]) > 0), "ascending, distinct"
            assert positions[head].min() >= N_SINK and positions[head].max() < TOKENS - N_LOCAL, "middle tokens"

        ws = sequence.fetch(layer, positions)
        assert isinstance(ws, kvret.WorkingSet)
        rows = N_SINK + BUDGET + N_LOCAL
        assert ws.k.shape == (N_KV, rows, D) and ws.v.shape == (N_KV, rows, D) and ws.positions.shape == (N_KV, rows)
        for head in range(N_KV):
            expected = np.concatenate([np.arange(N_SINK), positions[head], np.arange(TOKENS - N_LOCAL, TOKENS)])
            np.testing.assert_array_equal(ws.positions[head], expected)

        out = ctx.attend(q, ws.k, ws.v)
        assert out.dtype == np.float32 and out.shape == (N_Q, D)
        np.testing.assert_allclose(out, reference_attention(q, ws.k, ws.v), rtol=1e-4, atol=1e-5)


def test_fetched_rows_equal_stored_rows(sequence, rng):
    k, v = random_kv(rng)
    sequence.append_prefill(0, k, v)
    positions = sequence.select(0, rng.standard_normal((N_Q, D), dtype=np.float32))
    ws = sequence.fetch(0, positions)
    for head in range(N_KV):
        np.testing.assert_array_equal(ws.k[head], k[ws.positions[head], head])
        np.testing.assert_array_equal(ws.v[head], v[ws.positions[head], head])
    k_read, v_read = sequence.read(0, 10, 20)
    np.testing.assert_array_equal(k_read, k[10:20])
    np.testing.assert_array_equal(v_read, v[10:20])


def test_exact_index_selects_the_top_logits(rng):
    # One query head per KV head: every fold ranks tokens by the head's logit.
    with make_context(n_q_heads=N_KV) as ctx, ctx.open_sequence() as seq:
        k, v = random_kv(rng)
        seq.append_prefill(0, k, v)
        q = rng.standard_normal((N_KV, D), dtype=np.float32)
        positions = seq.select(0, q, budget=20)
        for head in range(N_KV):
            middle = np.arange(N_SINK, TOKENS - N_LOCAL)
            logits = k[middle, head] @ q[head]
            top = np.sort(middle[np.argsort(-logits)[:20]])
            np.testing.assert_array_equal(positions[head], top)


def test_select_scored_ranks_by_the_exact_scores(rng):
    # EXACT with one query head per KV head and the max-logit fold: a position's score is its scaled logit.
    with make_context(n_q_heads=N_KV, gqa_fold="max_logit") as ctx, ctx.open_sequence() as seq:
        k, v = random_kv(rng)
        seq.append_prefill(0, k, v)
        q = rng.standard_normal((N_KV, D), dtype=np.float32)
        positions, scores = seq.select_scored(0, q, budget=20)
        np.testing.assert_array_equal(positions, seq.select(0, q, budget=20))
        assert scores.dtype == np.float32 and scores.shape == positions.shape
        for head in range(N_KV):
            want = k[positions[head], head].astype(np.float64) @ q[head].astype(np.float64) / np.sqrt(D)
            np.testing.assert_allclose(scores[head], want, rtol=1e-5, atol=1e-5)
            middle = np.arange(N_SINK, TOKENS - N_LOCAL)
            left_out = np.setdiff1d(middle, positions[head])
            assert (k[left_out, head] @ q[head] / np.sqrt(D)).max() <= scores[head].min() + 1e-5


def test_full_budget_matches_full_attention(rng):
    with make_context() as ctx, ctx.open_sequence() as seq:
        k, v = random_kv(rng)
        seq.append_prefill(0, k, v)
        q = rng.standard_normal((N_Q, D), dtype=np.float32)
        ws = seq.fetch(0, seq.select(0, q, budget=TOKENS - N_SINK - N_LOCAL))
        full = reference_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2))
        np.testing.assert_allclose(ctx.attend(q, ws.k, ws.v), full, rtol=1e-4, atol=1e-5)


def test_outputs_are_written_in_place(sequence, rng):
    k, v = random_kv(rng)
    sequence.append_prefill(0, k, v)
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    out_positions = np.full((N_KV, 48), -1, dtype=np.int32)
    positions = sequence.select(0, q, budget=BUDGET, out=out_positions)
    assert np.shares_memory(positions, out_positions)
    capacity = sequence.working_set_capacity(0, BUDGET)
    assert capacity >= N_SINK + BUDGET + N_LOCAL
    buffers = (
        np.zeros((N_KV, capacity, D), np.float32),
        np.zeros((N_KV, capacity, D), np.float32),
        np.zeros((N_KV, capacity), np.int32),
    )
    ws = sequence.fetch(0, positions, out=buffers)
    assert all(np.shares_memory(a, b) for a, b in zip(ws, buffers))
    out = np.empty((N_Q, D), np.float32)
    assert ctx_attend(sequence, q, ws, out) is out


def ctx_attend(sequence, q, ws, out):
    return sequence.context.attend(q, ws.k, ws.v, out=out)


def test_strided_and_converted_inputs(sequence, rng):
    # [n_kv_heads, T, head_dim] memory passed as a [T, n_kv_heads, head_dim] view (no copy needed), and float64
    # values (converted to float32).
    k_heads_first = rng.standard_normal((N_KV, TOKENS, D), dtype=np.float32)
    v64 = rng.standard_normal((TOKENS, N_KV, D))
    sequence.append_prefill(0, k_heads_first.transpose(1, 0, 2), v64)
    k_read, v_read = sequence.read(0, 0, TOKENS)
    np.testing.assert_array_equal(k_read, k_heads_first.transpose(1, 0, 2))
    np.testing.assert_array_equal(v_read, v64.astype(np.float32))


def test_half_precision_store(rng):
    with make_context(kv_dtype="f16") as ctx, ctx.open_sequence() as seq:
        k, v = (x.astype(np.float16) for x in random_kv(rng))
        seq.append_prefill(0, k, v)
        ws = seq.fetch(0, seq.select(0, rng.standard_normal((N_Q, D), dtype=np.float32)))
        assert ws.k.dtype == np.float16
        for head in range(N_KV):
            np.testing.assert_array_equal(ws.k[head], k[ws.positions[head], head])
        ws32 = seq.fetch(0, seq.select(0, rng.standard_normal((N_Q, D), dtype=np.float32)), dtype=np.float32)
        assert ws32.k.dtype == np.float32


def test_decode_tokens_join_the_local_window(sequence, rng):
    k, v = random_kv(rng)
    sequence.append_prefill(0, k, v)
    for _ in range(3):
        sequence.append_decode(0, *(x[0] for x in random_kv(rng, tokens=1)))
    assert sequence.length(0) == TOKENS + 3
    ws = sequence.fetch(0, sequence.select(0, rng.standard_normal((N_Q, D), dtype=np.float32)))
    assert ws.positions[0, -1] == TOKENS + 2


def test_select_batch(context, rng):
    sequences = [context.open_sequence() for _ in range(3)]
    q = rng.standard_normal((3, N_Q, D), dtype=np.float32)
    for seq in sequences:
        seq.append_prefill(1, *random_kv(rng))
    batched = context.select_batch(sequences, 1, q)
    for i, seq in enumerate(sequences):
        np.testing.assert_array_equal(batched[i], seq.select(1, q[i]))
        seq.close()


def test_select_batch_of_no_sequences(context, rng):
    # n = 0 is allowed by kvret_select_batch and does nothing
    assert context.select_batch([], 0, np.zeros((0, N_Q, D), np.float32)) == []
    assert context.select_batch((), 1, np.zeros((0, N_Q, D), np.float32), budget=8) == []


FETCH_STATS = ("fetches", "fetched_rows", "cache_hits", "cache_misses", "prefetch_hits", "bytes_h2d")


def test_fetch_batch_equals_one_fetch_per_sequence(context, rng):
    # two copies of three sequences of different lengths: one fetched in a batch, the other one by one
    data = [random_kv(rng, tokens=t) for t in (200, 400, 650)]
    batched, single = [], []
    for k, v in data:
        for group in (batched, single):
            group.append(context.open_sequence())
            group[-1].append_prefill(1, k, v)
    q = rng.standard_normal((3, N_Q, D), dtype=np.float32)
    selections = context.select_batch(batched, 1, q)
    working_sets = context.fetch_batch(batched, 1, selections)
    for i, (a, b) in enumerate(zip(batched, single)):
        expected = b.fetch(1, selections[i])
        assert isinstance(working_sets[i], kvret.WorkingSet)
        assert working_sets[i].k.shape == (N_KV, N_SINK + BUDGET + N_LOCAL, D)
        for got, want in zip(working_sets[i], expected):
            np.testing.assert_array_equal(got, want)
        assert {f: a.stats()[f] for f in FETCH_STATS} == {f: b.stats()[f] for f in FETCH_STATS}
        assert a.stats()["fetches"] == 1
    # into buffers of the caller's: views of them
    outs = [context._empty_working_set(N_SINK + BUDGET + N_LOCAL, None) for _ in batched]
    again = context.fetch_batch(batched, 1, selections, outs=outs)
    for i in range(3):
        assert np.shares_memory(again[i].k, outs[i][0])
        np.testing.assert_array_equal(again[i].positions, working_sets[i].positions)
    assert context.fetch_batch([], 1, []) == []
    for seq in batched + single:
        seq.close()


def test_fetch_batch_refuses_a_bad_entry_and_writes_nothing(context, rng):
    sequences = [context.open_sequence() for _ in range(3)]
    for seq in sequences:
        seq.append_prefill(0, *random_kv(rng))
    selections = context.select_batch(sequences, 0, rng.standard_normal((3, N_Q, D), dtype=np.float32))
    outs = [
        tuple(np.full_like(x, -7) for x in context._empty_working_set(N_SINK + BUDGET + N_LOCAL, None))
        for _ in sequences
    ]
    bad = [s.copy() for s in selections]
    bad[1][0, 3] = TOKENS - 1  # a local position: not a middle one
    with pytest.raises(kvret.KvretError) as refused:
        context.fetch_batch(sequences, 0, bad, outs=outs)
    assert refused.value.status == kvret.Status.OUT_OF_RANGE
    assert "positions[1]" in str(refused.value)
    for out in outs:
        for x in out:
            assert np.all(x == -7), "nothing written"
    assert all(s.stats()["fetches"] == 0 for s in sequences)
    # a working set too small in the middle of the batch
    small = list(outs)
    small[1] = context._empty_working_set(N_SINK + BUDGET + N_LOCAL - 1, None)
    with pytest.raises(kvret.KvretError) as refused:
        context.fetch_batch(sequences, 0, selections, outs=small)
    assert refused.value.status == kvret.Status.SHAPE and "outs[1].k" in str(refused.value)
    assert all(np.all(x == -7) for out in outs for x in out)
    # a selection of the wrong shape, a closed sequence, a repeated one
    with pytest.raises(kvret.KvretError) as refused:
        context.fetch_batch(sequences, 0, [selections[0], selections[1][0], selections[2]])
    assert refused.value.status == kvret.Status.SHAPE and "selections[1]" in str(refused.value)
    with pytest.raises(kvret.KvretError) as refused:
        context.fetch_batch([sequences[0], sequences[0]], 0, selections[:2])
    assert refused.value.status == kvret.Status.INVALID_ARGUMENT and "seqs[1] appears twice" in str(refused.value)
    with pytest.raises(ValueError):
        context.fetch_batch(sequences, 0, selections[:2])
    sequences[2].close()
    with pytest.raises(kvret.KvretError) as refused:
        context.fetch_batch(sequences, 0, selections)
    assert refused.value.status == kvret.Status.INVALID_HANDLE and "sequences[2]" in str(refused.value)
    assert all(s.stats()["fetches"] == 0 for s in sequences[:2])
    for seq in sequences[:2]:
        seq.close()


def test_config_gives_enumerated_fields_by_name(rng):
    options = dict(kv_dtype="bf16", index_kind="page", gqa_fold="max_logit", cache_policy="lfu", device="cpu")
    with make_context(**options) as ctx:
        config = ctx.config
        assert (config["kv_dtype"], config["index_kind"], config["gqa_fold"]) == ("bf16", "page", "max_logit")
        assert (config["cache_policy"], config["device_type"], config["device_id"]) == ("lfu", "cpu", 0)
        assert "index_kind=page" in repr(ctx)
        with kvret.Context(**config) as again:  # a config dict makes a context of the same config
            assert again.config == config
    names = {"kv_dtype": "f16", "index_kind": "pq", "gqa_fold": "sum_prob", "cache_policy": "lru", "device_type": "cpu"}
    defaults = kvret.config.defaults()
    assert {name: defaults[name] for name in names} == names
    for number, name in ((0, "f16"), (1, "bf16"), (2, "f32")):  # numbers are still taken, and shown by name
        with make_context(kv_dtype=number) as ctx:
            assert ctx.config["kv_dtype"] == name
    raw = kvret.kvret_swig.kvret_config()
    kvret.kvret_swig.kvret_config_init(raw)
    raw.index_kind = 99  # a number this version has no name for stays a number
    assert kvret.config.to_dict(raw)["index_kind"] == 99


def test_stats_and_config(sequence, rng):
    sequence.append_prefill(0, *random_kv(rng))
    sequence.select(0, rng.standard_normal((N_Q, D), dtype=np.float32))
    stats = sequence.stats()
    assert stats["selections"] == 1 and stats["tokens_stored"] == TOKENS
    assert sequence.context.stats()["selections"] >= 1
    config = sequence.context.config
    assert config["n_kv_heads"] == N_KV and config["budget"] == BUDGET
    assert config["index_kind"] == "exact"


def test_version():
    assert kvret.version().startswith("0.")
    assert kvret.status_string(kvret.Status.SHAPE) == "KVRET_ERR_SHAPE"


@pytest.mark.parametrize("name", ["n_layers", "budget_ratio", "pq_bits", "seed", "disk_path"])
def test_every_config_field_is_a_keyword(name):
    assert name in kvret.config.FIELDS


def test_truncate_rolls_back_decode_steps(rng):
    with make_context() as ctx, ctx.open_sequence() as a, ctx.open_sequence() as b:
        k, v = random_kv(rng)
        a.append_prefill(0, k, v)
        b.append_prefill(0, k, v)
        for _ in range(5):  # draft tokens, then rejected
            dk, dv = random_kv(rng, tokens=1)
            a.append_decode(0, dk[0], dv[0])
        assert a.length(0) == TOKENS + 5
        a.truncate(TOKENS)
        assert a.length(0) == TOKENS and a.stats()["tokens_stored"] == b.stats()["tokens_stored"]
        q = rng.standard_normal((N_Q, D), dtype=np.float32)
        np.testing.assert_array_equal(a.select(0, q), b.select(0, q))
        positions = a.select(0, q)
        ws_a, ws_b = a.fetch(0, positions), b.fetch(0, positions)
        np.testing.assert_array_equal(ws_a.k, ws_b.k)
        np.testing.assert_array_equal(ws_a.positions, ws_b.positions)
        with pytest.raises(ValueError, match="length"):
            a.truncate(-1)
        with pytest.raises(TypeError):
            a.truncate(3.5)  # not rounded to 3
        a.truncate(2**70)  # beyond every layer: nothing to drop
        assert a.length(0) == TOKENS


def test_fork_branches_independently(rng):
    with make_context() as ctx, ctx.open_sequence() as parent, ctx.open_sequence() as direct:
        k, v = random_kv(rng)
        parent.append_prefill(0, k, v)
        direct.append_prefill(0, k, v)
        with parent.fork() as child:
            assert isinstance(child, kvret.Sequence) and child.context is ctx
            assert child.length(0) == TOKENS
            dk, dv = random_kv(rng, tokens=3)
            for t in range(3):  # the child goes on; the parent stays as it was
                child.append_decode(0, dk[t], dv[t])
                direct.append_decode(0, dk[t], dv[t])
            assert parent.length(0) == TOKENS and child.length(0) == TOKENS + 3
            q = rng.standard_normal((N_Q, D), dtype=np.float32)
            np.testing.assert_array_equal(child.select(0, q), direct.select(0, q))
            positions = child.select(0, q)
            np.testing.assert_array_equal(child.fetch(0, positions).k, direct.fetch(0, positions).k)
        assert parent.length(0) == TOKENS  # closing the fork leaves its source
        parent.close()
        with pytest.raises(kvret.KvretError):
            parent.fork()


def test_sequence_attend_equals_select_fetch_attend(sequence, rng):
    ctx = sequence.context
    k, v = random_kv(rng)
    sequence.append_prefill(0, k, v)
    q = rng.standard_normal((N_Q, D), dtype=np.float32)
    got = sequence.attend(0, q)
    assert got.dtype == np.float32 and got.shape == (N_Q, D)
    ws = sequence.fetch(0, sequence.select(0, q))
    np.testing.assert_array_equal(got, ctx.attend(q, ws.k, ws.v))
    out = np.empty((N_Q, D), dtype=np.float32)
    assert sequence.attend(0, q, budget=8, scale=0.2, out=out) is out
    ws8 = sequence.fetch(0, sequence.select(0, q, budget=8))
    np.testing.assert_array_equal(out, ctx.attend(q, ws8.k, ws8.v, scale=0.2))


@pytest.mark.parametrize("bits,group", [(1, 32), (2, 64)])
def test_quant_index_selects_from_its_low_bit_copy(rng, bits, group):
    # The quant index: the settings by keyword, a selection of middle positions, and index bytes that are the KIVI
    # copy: (bits + 32 / group) / 16 of the f16 keys and values of the quantized tokens, the rest in f16.
    with make_context(index_kind="quant", quant_bits=bits, quant_group_size=group, quant_residual=0) as ctx:
        config = ctx.config
        assert (config["quant_bits"], config["quant_group_size"], config["quant_residual"]) == (bits, group, 0)
        with ctx.open_sequence() as seq:
            seq.append_prefill(0, *random_kv(rng))
            positions = seq.select(0, rng.standard_normal((N_Q, D), dtype=np.float32))
            assert positions.shape == (N_KV, BUDGET)
            assert ((positions >= N_SINK) & (positions < TOKENS - N_LOCAL)).all()
            middle = TOKENS - N_SINK - N_LOCAL
            quantized = middle // group * group
            f16_token = 2 * 2 * D  # keys and values
            per_head = quantized * f16_token * (bits + 32 / group) / 16 + (middle - quantized) * f16_token
            assert seq.stats()["index_bytes"] == N_KV * per_head
