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
