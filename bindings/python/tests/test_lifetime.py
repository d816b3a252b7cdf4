"""Context managers, close() and use after close."""

import gc

import numpy as np
import pytest
from conftest import make_context, random_kv

import kvret


def test_context_managers_close(rng):
    with make_context() as ctx:
        with ctx.open_sequence() as seq:
            seq.append_prefill(0, *random_kv(rng))
            assert not seq.closed
        assert seq.closed and not ctx.closed
    assert ctx.closed
    seq.close()  # closing twice is a no-op
    ctx.close()


def test_use_after_close_raises(rng):
    ctx = make_context()
    seq = ctx.open_sequence()
    seq.close()
    with pytest.raises(kvret.KvretError) as info:
        seq.append_prefill(0, *random_kv(rng))
    assert info.value.status == kvret.Status.INVALID_HANDLE
    ctx.close()
    with pytest.raises(kvret.KvretError) as info:
        ctx.open_sequence()
    assert info.value.status == kvret.Status.INVALID_HANDLE


def test_closing_the_context_closes_its_sequences(rng):
    ctx = make_context()
    seqs = [ctx.open_sequence() for _ in range(3)]
    seqs[0].append_prefill(0, *random_kv(rng))
    ctx.close()
    assert all(s.closed for s in seqs)
    with pytest.raises(kvret.KvretError):
        seqs[1].length(0)


def test_garbage_collection_frees_in_any_order(rng):
    for _ in range(3):
        ctx = make_context()
        seq = ctx.open_sequence()
        seq.append_prefill(0, *random_kv(rng))
        ctx._cycle = [ctx, seq]  # a reference cycle: the collector picks the order
        del ctx, seq
        gc.collect()


def test_sequence_keeps_its_context_alive(rng):
    seq = make_context().open_sequence()
    gc.collect()
    seq.append_prefill(0, *random_kv(rng))
    assert seq.length(0) == 400
    seq.context.close()


def sequence_calls(seq, rng):
    """Every public call of a sequence, with valid arguments."""
    k, v = random_kv(rng)
    q = rng.standard_normal((8, 64), dtype=np.float32)
    positions = np.zeros((2, 4), np.int32)
    return {
        "append_prefill": lambda: seq.append_prefill(0, k, v),
        "append_decode": lambda: seq.append_decode(0, k[0], v[0]),
        "wait_index": lambda: seq.wait_index(),
        "fork": lambda: seq.fork(),
        "truncate": lambda: seq.truncate(3),
        "drop_front": lambda: seq.drop_front(4, 3),
        "save_session": lambda: seq.save_session("s"),
        "length": lambda: seq.length(0),
        "budget": lambda: seq.budget(0),
        "working_set_capacity": lambda: seq.working_set_capacity(0),
        "stats": lambda: seq.stats(),
        "select": lambda: seq.select(0, q),
        "select_scored": lambda: seq.select_scored(0, q),
        "attend": lambda: seq.attend(0, q),
        "fetch": lambda: seq.fetch(0, positions),
        "prefetch": lambda: seq.prefetch(0, q),
        "read": lambda: seq.read(0, 0, 4),
        "select_batch": lambda: seq.context.select_batch([seq], 0, q[None]),
    }


def assert_closed(call, message):
    with pytest.raises(kvret.KvretError) as info:
        call()
    assert info.value.status == kvret.Status.INVALID_HANDLE
    assert message in info.value.message and "NULL" not in info.value.message, info.value.message


def test_a_closed_sequence_says_it_is_closed(rng):
    with make_context() as ctx:
        seq = ctx.open_sequence()
        seq.append_prefill(0, *random_kv(rng))
        seq.close()
        for name, call in sequence_calls(seq, rng).items():
            expected = "sequences[0] is closed" if name == "select_batch" else "the sequence is closed"
            assert_closed(call, expected)
        orphan = ctx.open_sequence()
    assert orphan.closed
    for name, call in sequence_calls(orphan, rng).items():
        assert_closed(call, "the context is closed" if name == "select_batch" else "closed (its context was closed)")


def test_a_closed_context_says_it_is_closed(rng):
    ctx = make_context()
    seq = ctx.open_sequence()
    ctx.close()
    q = rng.standard_normal((8, 64), dtype=np.float32)
    k, v = random_kv(rng, tokens=8)
    calls = [
        ctx.open_sequence,
        lambda: kvret.Sequence(ctx),
        lambda: ctx.attend(q, k.swapaxes(0, 1), v.swapaxes(0, 1)),
        lambda: ctx.select_batch([seq], 0, q[None]),
        lambda: ctx.select_batch([], 0, q[None]),
        ctx.synchronize,
        ctx.stats,
        lambda: ctx.open_session("s"),
        lambda: ctx.drop_session("s"),
        lambda: ctx.schedule_sessions(["s"]),
        lambda: ctx.session_tier("s"),
        ctx.flush_sessions,
    ]
    for call in calls:
        assert_closed(call, "the context is closed")
    assert ctx.config["n_layers"] == 2  # what it was made with stays readable
