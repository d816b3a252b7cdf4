"""kvret from Python: prefill -> select -> fetch -> attend with NumPy arrays.

Run from a build tree:  PYTHONPATH=<build>/bindings/python/site python3 examples/python/quickstart.py
or after `pip install .`:  python3 examples/python/quickstart.py
"""

import numpy as np

import kvret

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, TOKENS = 2, 8, 2, 64, 2048
GROUP = Q_HEADS // KV_HEADS


def main():
    rng = np.random.default_rng(0)
    config = dict(
        n_layers=LAYERS, n_q_heads=Q_HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        kv_dtype="f32", index_kind="pq", n_sink=16, n_local=64, budget=128,
    )
    with kvret.Context(**config) as ctx, ctx.open_sequence() as seq:
        # Prefill every layer: keys and values are [tokens, kv_heads, head_dim].
        kv = [tuple(rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM), dtype=np.float32) for _ in "kv")
              for _ in range(LAYERS)]
        for layer, (k, v) in enumerate(kv):
            seq.append_prefill(layer, k, v)

        # A decode-step query whose heads each look for one far-back "needle" token.
        layer = LAYERS - 1
        k, v = kv[layer]
        needles = rng.choice(np.arange(16, TOKENS - 64), size=Q_HEADS, replace=False)
        q = np.stack([
            1.2 * np.sqrt(HEAD_DIM) * k[n, h // GROUP] / np.linalg.norm(k[n, h // GROUP])
            + 0.5 * rng.standard_normal(HEAD_DIM)
            for h, n in enumerate(needles)
        ]).astype(np.float32)

        positions = seq.select(layer, q)           # int32 [kv_heads, budget]
        ws = seq.fetch(layer, positions)           # WorkingSet(k, v, positions), [kv_heads, rows, ...]
        out = ctx.attend(q, ws.k, ws.v)            # float32 [q_heads, head_dim]

        # Compare with attention over every token, and over sink + local only (no retrieval).
        all_k, all_v = (np.ascontiguousarray(x.transpose(1, 0, 2)) for x in (k, v))
        full = ctx.attend(q, all_k, all_v)
        window = np.r_[0:16, TOKENS - 64:TOKENS]
        streaming = ctx.attend(q, all_k[:, window], all_v[:, window])
        error = lambda o: np.linalg.norm(o - full) / np.linalg.norm(full)
        found = sum(n in positions[h // GROUP] for h, n in enumerate(needles))

        print(f"kvret {kvret.version()}: {TOKENS} tokens per layer, PQ index, budget {positions.shape[1]}")
        print(f"working set: {ws.k.shape[1]} rows per KV head; needles retrieved: {found}/{Q_HEADS}")
        print(f"output error vs full attention: {error(out):.3f} (sink + local only: {error(streaming):.3f})")

        try:
            seq.select(LAYERS, q)
        except kvret.KvretError as e:
            print(f"a bad call raises KvretError: status {e.status.name}: {e.message}")


if __name__ == "__main__":
    main()
