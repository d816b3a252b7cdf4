"""Sequence.retained_set: KVCrush's eviction-only mode (kvret_seq_retained_set)."""

import numpy as np
import pytest
from conftest import GEOMETRY, N_LOCAL, N_SINK, TOKENS, make_context, random_kv

import kvret

N_KV = GEOMETRY["n_kv_heads"]


def test_retained_set_keeps_snapkv_base_plus_representatives(rng):
    k, v = random_kv(rng)
    with make_context(index_kind="streaming") as plain, make_context(
        index_kind="streaming", hamming_fraction=0.25
    ) as crushed:
        with plain.open_sequence() as a, crushed.open_sequence() as b:
            a.append_prefill(0, k, v)
            b.append_prefill(0, k, v)
            budget = 40
            kept = b.retained_set(0, budget=budget)
            assert kept.shape == (N_KV, budget) and kept.dtype == np.int32
            base = a.retained_set(0, budget=budget - budget // 4)  # floor(0.25 * 40) = 10 representatives
            for h in range(N_KV):
                row = kept[h]
                assert (np.diff(row) > 0).all(), "distinct and ascending"
                assert row.min() >= N_SINK and row.max() < TOKENS - N_LOCAL, "middle positions"
                assert set(base[h]) <= set(row), "the important part is SnapKV's set"
            # into a caller's buffer, and the call changes nothing: the same answer again
            out = np.full((N_KV, 64), -1, np.int32)
            view = b.retained_set(0, budget=budget, out=out)
            np.testing.assert_array_equal(view, kept)
            assert (out[:, budget:] == -1).all()


def test_retained_set_refusals_name_the_problem(rng):
    with make_context(hamming_fraction=0.25) as ctx, ctx.open_sequence() as seq:
        seq.append_prefill(0, *random_kv(rng))
        with pytest.raises(kvret.KvretError) as info:
            seq.retained_set(1)  # layer 1 holds no tokens
        assert info.value.status == kvret.Status.STATE and "observation window" in info.value.message
        with pytest.raises(kvret.KvretError) as info:
            seq.retained_set(0, budget=0)
        assert info.value.status == kvret.Status.BUDGET and "budget" in info.value.message
        with pytest.raises(kvret.KvretError) as info:
            seq.retained_set(GEOMETRY["n_layers"], budget=8)
        assert info.value.status == kvret.Status.OUT_OF_RANGE and "layer" in info.value.message
        out = np.full((N_KV, 8), -1, np.int64)
        with pytest.raises(kvret.KvretError) as info:
            seq.retained_set(0, budget=8, out=out)
        assert info.value.status == kvret.Status.DTYPE and "out_positions" in info.value.message
        assert (out == -1).all()
