import numpy as np
import pytest

import kvret

GEOMETRY = dict(n_layers=2, n_q_heads=8, n_kv_heads=2, head_dim=64)
N_SINK, N_LOCAL, BUDGET, TOKENS = 4, 16, 32, 400


def make_context(**overrides):
    options = dict(GEOMETRY, kv_dtype="f32", index_kind="exact", n_sink=N_SINK, n_local=N_LOCAL, budget=BUDGET)
    options.update(overrides)
    return kvret.Context(**options)


def random_kv(rng, tokens=TOKENS, n_kv_heads=GEOMETRY["n_kv_heads"], head_dim=GEOMETRY["head_dim"]):
    shape = (tokens, n_kv_heads, head_dim)
    return rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)


def reference_attention(q, k, v, scale=None):
    """out[h] = softmax(scale * q[h] . k[g(h)]^T) v[g(h)] in float64."""
    n_q_heads, head_dim = q.shape
    group = n_q_heads // k.shape[0]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    out = np.empty((n_q_heads, head_dim))
    for h in range(n_q_heads):
        logits = scale * (k[h // group].astype(np.float64) @ q[h].astype(np.float64))
        weights = np.exp(logits - logits.max())
        out[h] = (weights / weights.sum()) @ v[h // group].astype(np.float64)
    return out


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def context():
    with make_context() as ctx:
        yield ctx


@pytest.fixture
def sequence(context):
    with context.open_sequence() as seq:
        yield seq
