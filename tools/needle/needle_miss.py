#!/usr/bin/env python3
"""Where does an index lose the needle? For one needle-suite case (from the suite's --cache) and one run of an index
(PQ by default) that answers wrong: at the first generated position where its token differs from full attention's,
per layer and KV head of that decode step, the attention mass full attention puts on the asked pass key's tokens
(the largest over the group's query heads), the ranks of those tokens in EXACT's selection order and in the index's
own, and how many of them each selection holds at the budget. Heads below --min-mass are shown only where the two
selections hold different numbers of key tokens.

    PYTHONPATH=build/bindings/python/site python3 tools/needle/needle_miss.py --cache DIR \
        --kind twohop --length 4096 --depth 0.1 --seed 3 --budget 0.05
"""
import argparse
import os
import sys
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "llm"))
import needle_suite as ns  # noqa: E402
import kvret_decode  # noqa: E402
import smollm2  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--kind", required=True)
ap.add_argument("--length", type=int, required=True)
ap.add_argument("--depth", type=float, required=True)
ap.add_argument("--haystack", default="licenses")
ap.add_argument("--case-seed", type=int, default=0)
ap.add_argument("--seed", type=int, default=1, help="k-means seed of the run examined")
ap.add_argument("--budget", type=float, default=0.1)
ap.add_argument("--index", default="pq", help="index kind of the run examined")
ap.add_argument("--cache", required=True, help="the needle suite's --cache directory holding the case")
ap.add_argument("--min-mass", type=float, default=0.05, help="smallest key-token mass of the heads listed")
args = ap.parse_args()

import kvret  # noqa: E402

model = smollm2.load_model(None)
tok = model.tokenizer
hs = ns.Haystacks(tok)
cs = zlib.crc32(repr((args.kind, args.length, args.depth, args.haystack, args.case_seed)).encode())
ids, answer = ns.make_case(tok, hs, args.kind, args.length, args.depth, args.haystack, cs)
max_new = ns.MAX_NEW.get(args.kind, 18)
key = zlib.crc32(repr((ids, max_new, os.path.basename(model.path))).encode())
z = np.load(os.path.join(args.cache, f"case-{key:08x}.npz"))
keys = [a.astype(np.float32) for a in z["keys"]]
values = [a.astype(np.float32) for a in z["values"]]
ref = [int(t) for t in z["ref_tokens"]]
start = len(ids) - 1
stop = {tok.ids["<|im_end|>"], model.eos_id}
done = ns.answer_done(tok, args.kind)

# positions of the asked pass key's tokens: every occurrence of the answer's digits in the prompt
digits = []
for code in answer.split(","):
    cid = tok.encode(" " + code + ".")[1:-1]  # the digit tokens
    for p in range(len(ids) - len(cid)):
        if ids[p : p + len(cid)] == cid:
            digits += list(range(p, p + len(cid)))
digits = sorted(set(digits))
print(f"case {args.kind} {len(ids)} depth {args.depth}: answer {answer}, key tokens at {digits}")


def ranking(seq, layer, q, n):
    """Every middle token of every KV head in the index's selection order (select_scored over the whole middle)."""
    pos, score = seq.select_scored(layer, q, n - SINK - LOCAL)
    return [pos[h][np.argsort(-score[h], kind="stable")] for h in range(pos.shape[0])]


class Recording(kvret_decode.KvretAttention):
    """The index's decode, with an EXACT sequence over the same keys beside it; at call `record_call` of every
    layer: the index's selection and both rankings."""

    def __init__(self, model, ctx, exact_ctx, record_call=None):
        super().__init__(model, ctx, keys, values)
        self.record_call = record_call
        self.exact = exact_ctx.open_sequence()
        for l in range(model.n_layers):
            self.exact.append_prefill(l, keys[l], values[l])
        self.exact.wait_index()
        self.k_all = [k.copy() for k in keys]
        self.ncalls = [0] * model.n_layers
        self.rec = {}

    def __call__(self, layer, q, k, v):
        self.k_all[layer] = np.concatenate([self.k_all[layer], k.astype(np.float16).astype(np.float32)[None]])
        self.exact.append_decode(layer, k, v)
        i = self.ncalls[layer]
        self.ncalls[layer] += 1
        out = super().__call__(layer, q, k, v)
        if i == self.record_call:
            n = self.k_all[layer].shape[0]
            budget = self.seq.select(layer, q).shape[1]
            self.rec[layer] = (q.copy(), budget, ranking(self.seq, layer, q, n), ranking(self.exact, layer, q, n))
        return out

    def close(self):
        self.exact.close()
        super().close()


SINK, LOCAL = 16, 64


def run(record_call=None):
    cfg = dict(budget_ratio=args.budget, n_threads=1)
    with kvret.Context(**kvret_decode.kvret_config(model, index_kind=args.index, seed=args.seed, **cfg)) as ctx, \
            kvret.Context(**kvret_decode.kvret_config(model, index_kind="exact", **cfg)) as exact_ctx:
        att = Recording(model, ctx, exact_ctx, record_call=record_call)
        try:
            toks, _ = kvret_decode.generate(model, att, ids[-1:], start, max_new, stop, done)
        finally:
            att.close()
    return toks, att


toks, _ = run()
print("full attention:", repr(tok.decode(ref)))
print(f"{args.index} seed {args.seed} at {args.budget}:", repr(tok.decode(toks)))
div = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)
if div is None:
    sys.exit("no divergence")
print(f"first different token: position {div}: {tok.decode(ref[div:div + 1])!r} (full attention) vs "
      f"{tok.decode(toks[div:div + 1])!r}")
toks2, att = run(record_call=div)
assert toks2 == toks, "the index's decode is not deterministic"
g = model.group
scale = 1.0 / np.sqrt(model.head_dim)
rows = []
for layer in range(model.n_layers):
    q, budget, idx_order, exact_order = att.rec[layer]
    K = att.k_all[layer]  # including this step's key
    for h in range(model.n_kv):
        s = q[h * g : (h + 1) * g] @ K[:, h, :].T * scale  # [g, n]
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        mass = p[:, digits].sum(axis=1).max()
        er = {int(t): r for r, t in enumerate(exact_order[h])}
        ir = {int(t): r for r, t in enumerate(idx_order[h])}
        e_ranks = [er.get(t) for t in digits]
        i_ranks = [ir.get(t) for t in digits]
        n_e = sum(1 for r in e_ranks if r is not None and r < budget)
        n_i = sum(1 for r in i_ranks if r is not None and r < budget)
        rows.append((mass, layer, h, budget, e_ranks, i_ranks, n_e, n_i))
rows.sort(key=lambda r: -r[0])
print(f"budget {rows[0][3]} middle tokens per KV head; {len(digits)} key tokens")
print(f"layer head | full-attention mass on the key | EXACT rank of each key token | {args.index} rank | "
      f"held by EXACT | held by {args.index}")
for mass, layer, h, budget, er, ir, n_e, n_i in rows:
    if mass < args.min_mass and n_e == n_i:
        continue
    print(f"{layer:5d} {h:4d} | {mass:5.3f} | {er} | {ir} | {n_e} | {n_i}")
