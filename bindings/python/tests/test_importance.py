"""Sequence.observe and Sequence.observe_attention: where KVCrush's importance comes from (the prompt's queries, or
accumulated attention under hamming_importance="accumulated")."""

import numpy as np
import pytest
from conftest import GEOMETRY, N_LOCAL, N_SINK, TOKENS, make_context, random_kv

import kvret

N_Q, N_KV, D = GEOMETRY["n_q_heads"], GEOMETRY["n_kv_heads"], GEOMETRY["head_dim"]


def test_observe_moves_the_retained_set_to_the_queries(rng):
    k, v = random_kv(rng)
    with make_context(n_q_heads=N_KV) as ctx:  # one query head per KV head
        with ctx.open_sequence() as keys, ctx.open_sequence() as queries, ctx.open_sequence() as other:
            for s in (keys, queries, other):
                s.append_prefill(0, k, v)
            queries.observe(0, k[-32:])  # the keys' own window as queries: the keys' rule exactly
            np.testing.assert_array_equal(queries.retained_set(0, budget=40), keys.retained_set(0, budget=40))
            # real queries: SnapKV's top tokens by their summed softmax over the layer's keys
            q = rng.standard_normal((8, N_KV, D), dtype=np.float32)
            other.observe(0, q)
            kept = other.retained_set(0, budget=40)
            scale = 1.0 / np.sqrt(D)
            for h in range(N_KV):
                logits = scale * (q[:, h].astype(np.float64) @ k[:, h].astype(np.float64).T)
                p = np.exp(logits - logits.max(axis=1, keepdims=True))
                importance = (p / p.sum(axis=1, keepdims=True)).sum(axis=0)[N_SINK : TOKENS - N_LOCAL]
                cut = np.sort(importance)[::-1][39]
                assert (importance[kept[h] - N_SINK] >= cut * (1 - 1e-5)).all()


def test_accumulated_attention_drives_the_retained_set(rng):
    k, v = random_kv(rng)
    with make_context(hamming_importance="accumulated") as ctx, ctx.open_sequence() as seq:
        assert ctx.config["hamming_importance"] == "accumulated"
        seq.append_prefill(0, k, v)
        probs = np.zeros((N_Q, TOKENS), np.float32)
        favourites = np.array([50, 120, 121, 300, 301, 302])
        probs[:, favourites] = 1.0 / len(favourites)
        seq.observe_attention(0, probs)
        kept = seq.retained_set(0, budget=len(favourites))
        for h in range(N_KV):
            np.testing.assert_array_equal(kept[h], favourites)


def test_observe_refusals_change_nothing(rng):
    k, v = random_kv(rng)
    with make_context() as ctx, ctx.open_sequence() as seq:
        seq.append_prefill(0, k, v)
        before = seq.retained_set(0, budget=20)
        for bad, status in [
            (np.zeros((4, N_Q, D + 1), np.float32), kvret.Status.SHAPE),
            (np.zeros((TOKENS + 1, N_Q, D), np.float32), kvret.Status.SHAPE),
            (np.zeros((4, N_KV + 1, D), np.float32), kvret.Status.SHAPE),
            (np.zeros((N_Q, D), np.float32), kvret.Status.SHAPE),
        ]:
            with pytest.raises(kvret.KvretError) as info:
                seq.observe(0, bad)
            assert info.value.status == status
        with pytest.raises(kvret.KvretError) as info:
            seq.observe(1, np.zeros((4, N_Q, D), np.float32))
        assert info.value.status == kvret.Status.STATE
        with pytest.raises(kvret.KvretError) as info:
            seq.observe_attention(0, np.zeros((N_Q, TOKENS), np.float32))
        assert info.value.status == kvret.Status.STATE and "hamming_importance" in info.value.message
        np.testing.assert_array_equal(seq.retained_set(0, budget=20), before)
    with make_context(hamming_importance="accumulated") as ctx, ctx.open_sequence() as seq:
        seq.append_prefill(0, k, v)
        probs = np.full((N_Q, TOKENS), 0.01, np.float32)
        probs[2, 7] = -1.0
        with pytest.raises(kvret.KvretError) as info:
            seq.observe_attention(0, probs)
        assert info.value.status == kvret.Status.INVALID_ARGUMENT and "query head 2, position 7" in info.value.message
        with pytest.raises(kvret.KvretError) as info:
            seq.observe_attention(0, np.zeros((N_Q, TOKENS + 1), np.float32))
        assert info.value.status == kvret.Status.SHAPE
