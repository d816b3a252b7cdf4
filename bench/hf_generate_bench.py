#!/usr/bin/env python3
"""Decode speed of Hugging Face generate() with kvret.hf.KvretCache against the model's default cache, in one run.

    python3 bench/hf_generate_bench.py --model smollm2 --lengths 2000,8000 --new-tokens 32

For every prompt length (a pass-key prompt of about that many tokens) generate() runs greedily with the default
cache, then with a KvretCache (--index, --budget as a share of the context), forced to --new-tokens tokens. A logits
processor stamps the time of every step: the prefill is the time to the first step's logits, decode tokens/s counts
the steps after the first. kvret's share is the time inside kvret's calls (appends and kvret_seq_attend over every
full-attention layer) during those decode steps, over their wall time. Prints a Markdown table.

--threads sets torch's thread count; --kvret-first swaps the order of the two runs at every length, to check that
the order does not favour either cache.
"""
import argparse
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools", "llm"))

import hf_models  # noqa: E402


class Stamps:
    """A logits processor that records when each step's logits arrive (and kvret's time so far)."""

    def __init__(self, cache=None):
        self.cache, self.times, self.kvret = cache, [], []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        self.kvret.append(self.cache.kvret_seconds if self.cache is not None else 0.0)
        return scores


def run(model, inputs, new_tokens, cache):
    import torch
    from transformers import LogitsProcessorList

    stamps = Stamps(cache)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  logits_processor=LogitsProcessorList([stamps]))
    if cache is not None:
        kwargs["past_key_values"] = cache
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, **kwargs)
    steps = len(stamps.times) - 1
    decode = stamps.times[-1] - stamps.times[0]
    return dict(
        tokens=out[0, inputs["input_ids"].shape[1] :].tolist(),
        prefill=stamps.times[0] - started,
        tps=steps / decode,
        step_ms=1e3 * decode / steps,
        kvret_ms=1e3 * (stamps.kvret[-1] - stamps.kvret[0]) / steps,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=hf_models.MODELS, default="smollm2")
    ap.add_argument("--lengths", default="2000,8000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--index", default="pq")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--kvret-first", action="store_true",
                    help="run generate() with the KvretCache before the default cache at every length")
    args = ap.parse_args()

    import torch

    import kvret.hf

    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = hf_models.load(args.model)
    warm = hf_models.chat(tokenizer, "Hello!")  # the first generate() of a process pays one-time costs
    run(model, warm, 2, None)
    with kvret.hf.KvretCache(model, index_kind=args.index, budget_ratio=args.budget) as cache:
        run(model, warm, 2, cache)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        inputs = hf_models.pass_key_prompt(tokenizer, length)
        n = inputs["input_ids"].shape[1]
        if not args.kvret_first:
            default = run(model, inputs, args.new_tokens, None)
        cache = kvret.hf.KvretCache(model, index_kind=args.index, budget_ratio=args.budget)
        ours = run(model, inputs, args.new_tokens, cache)
        layers = f"{len(cache.kvret_layers)}/{len(cache.layers)}"
        cache.close()
        if args.kvret_first:
            default = run(model, inputs, args.new_tokens, None)
        same = sum(a == b for a, b in zip(ours["tokens"], default["tokens"])) / len(default["tokens"])
        rows.append((n, layers, default, ours, same))
        print(f"{args.model} {n} tokens: default {default['tps']:.2f} tok/s, kvret {ours['tps']:.2f} tok/s, "
              f"kvret share {ours['kvret_ms'] / ours['step_ms']:.0%}", file=sys.stderr, flush=True)

    print(f"| model | prompt tokens | kvret layers | default cache tok/s | kvret ({args.index}, {args.budget:g}) tok/s "
          "| speed-up | decode step ms (default / kvret) | kvret's share of a step | prefill s (default / kvret) "
          "| tokens equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, layers, d, k, same in rows:
        print(f"| {args.model} | {n} | {layers} | {d['tps']:.2f} | {k['tps']:.2f} | {k['tps'] / d['tps']:.2f}x "
              f"| {d['step_ms']:.0f} / {k['step_ms']:.0f} | {k['kvret_ms']:.0f} ms ({k['kvret_ms'] / k['step_ms']:.0%}) "
              f"| {d['prefill']:.1f} / {k['prefill']:.1f} | {same:.0%} |")


if __name__ == "__main__":
    main()
