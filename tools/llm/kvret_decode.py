"""A decode loop with kvret in it, as an inference engine runs one: the prompt is prefilled densely, its keys and
values go to kvret, and every layer of every decode step appends the new token's key/value to kvret, selects the
middle tokens that matter for the query, fetches the working set (sink + selected + local) and attends to it alone.

    model = smollm2.Model()
    keys, values, _ = model.prefill(prompt[:-1], kv_round=np.float16)
    with kvret.Context(**kvret_config(model, index_kind="pq", budget_ratio=0.1)) as ctx:
        attention = KvretAttention(model, ctx, keys, values)
        tokens = generate(model, attention, prompt[-1:], len(prompt) - 1, max_new=8)
        attention.close()

DenseAttention is the reference: full attention over every token, with the same f16 rounding of the cache.
"""
import time

import numpy as np


def kvret_config(model, **overrides):
    """kvret.Context keyword arguments for `model`'s geometry (f16 KV cache), plus overrides."""
    config = dict(
        n_layers=model.n_layers,
        n_q_heads=model.n_heads,
        n_kv_heads=model.n_kv,
        head_dim=model.head_dim,
        kv_dtype="f16",
    )
    config.update(overrides)
    return config


class DenseAttention:
    """Full attention over every cached token: the reference the retrieved runs are compared with."""

    def __init__(self, model, keys, values, capacity=64):
        self.model = model
        t = keys[0].shape[0]
        self.length = t
        self.k = [np.empty((t + capacity, model.n_kv, model.head_dim), np.float32) for _ in keys]
        self.v = [np.empty_like(a) for a in self.k]
        for l in range(model.n_layers):
            self.k[l][:t] = keys[l]
            self.v[l][:t] = values[l]
        self.lengths = [t] * model.n_layers
        self.kvret_seconds = 0.0
        self.attention_seconds = 0.0

    def __call__(self, layer, q, k, v):
        t0 = time.perf_counter()
        n = self.lengths[layer]
        self.k[layer][n] = k.astype(np.float16).astype(np.float32)
        self.v[layer][n] = v.astype(np.float16).astype(np.float32)
        self.lengths[layer] = n + 1
        out = attend_rows(q, self.k[layer][: n + 1].transpose(1, 0, 2), self.v[layer][: n + 1].transpose(1, 0, 2))
        self.attention_seconds += time.perf_counter() - t0
        return out

    def close(self):
        pass


def attend_rows(q, k, v):
    """q [Hq, D], k/v [Hkv, rows, D] -> [Hq, D]: softmax attention of each query head over its KV head's rows."""
    hq, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    qg = q.reshape(hkv, g, d)
    s = np.einsum("hgd,hrd->hgr", qg, k.astype(np.float32)) * np.float32(1.0 / np.sqrt(d))
    s -= s.max(axis=2, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=2, keepdims=True)
    return np.einsum("hgr,hrd->hgd", s, v.astype(np.float32)).reshape(hq, d)


class KvretAttention:
    """Attention over kvret's working set. Opens a sequence of `ctx`, appends the prefill keys/values of every layer
    (index builds start in the background) and, per decode call: append_decode, select, fetch, attend.

    budget: middle tokens per KV head (None: the context's default, budget_ratio of the length).
    seq_attend: one call, Sequence.attend (kvret_seq_attend: select, fetch and attention inside kvret), instead of
    select, fetch and attend; the way to run a context with quant_attention = 1 (attention over the low-bit copy of
    every token with the selected rows exact), whose time counts as attention.
    Timings: kvret_seconds (append, select, fetch), attention_seconds (the attention over the working set),
    selected_rows (sum over calls of the working-set rows)."""

    def __init__(self, model, ctx, keys, values, budget=None, use_kvret_attend=True, seq_attend=False):
        self.model = model
        self.ctx = ctx
        self.budget = budget
        self.use_kvret_attend = use_kvret_attend
        self.seq_attend = seq_attend
        self.seq = ctx.open_sequence()
        t0 = time.perf_counter()
        for l in range(model.n_layers):
            self.seq.append_prefill(l, keys[l], values[l])
        self.seq.wait_index()
        self.build_seconds = time.perf_counter() - t0
        self.kvret_seconds = 0.0
        self.attention_seconds = 0.0
        self.rows = 0
        self.calls = 0

    def __call__(self, layer, q, k, v):
        t0 = time.perf_counter()
        seq = self.seq
        seq.append_decode(layer, k, v)
        if self.seq_attend:
            t1 = time.perf_counter()
            out = seq.attend(layer, q, self.budget)
            self.kvret_seconds += t1 - t0
            self.attention_seconds += time.perf_counter() - t1
            self.calls += 1
            return out
        positions = seq.select(layer, q, self.budget)
        ws = seq.fetch(layer, positions)
        t1 = time.perf_counter()
        if self.use_kvret_attend:
            out = self.ctx.attend(q, ws.k, ws.v)
        else:
            out = attend_rows(q, ws.k, ws.v)
        t2 = time.perf_counter()
        self.kvret_seconds += t1 - t0
        self.attention_seconds += t2 - t1
        self.rows += ws.k.shape[1]
        self.calls += 1
        return out

    def close(self):
        self.seq.close()


def generate(model, attention, tail, start, max_new, stop=(), done=None):
    """Feeds the prompt's last tokens `tail` (positions start, start + 1, ...) through attention, then decodes
    greedily up to max_new tokens, stopping after a token in `stop` or when done(tokens) is true. Returns (new
    tokens, seconds per step: total, kvret, attention)."""
    t0 = time.perf_counter()
    pos = start
    logits = None
    steps = 0
    for token in tail:
        logits = model.step(token, pos, attention)
        pos += 1
        steps += 1
    out = []
    while len(out) < max_new:
        token = int(np.argmax(logits))
        out.append(token)
        if token in stop or len(out) == max_new or (done is not None and done(out)):
            break
        logits = model.step(token, pos, attention)
        pos += 1
        steps += 1
    total = time.perf_counter() - t0
    return out, {
        "steps": steps,
        "step_seconds": total / steps,
        "kvret_seconds": attention.kvret_seconds / steps,
        "attention_seconds": attention.attention_seconds / steps,
    }
