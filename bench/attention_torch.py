#!/usr/bin/env python3
"""PyTorch's CPU decode attention at the sizes of kvret-bench-attention (BENCHMARKS.md, "CPU decode attention").

torch.nn.functional.scaled_dot_product_attention for one decode query of a Llama-3-8B-like layer: 32 query heads,
8 KV heads, head_dim 128, over 1,024 / 3,357 / 32,768 / 131,072 rows per KV head, on 1 and 2 threads
(torch.set_num_threads), with the keys and values in f16 (q in f16, as a model in f16 calls it) and in f32. The
grouped heads go through enable_gqa=True where this PyTorch has it, else through repeat_interleave inside the timed
call (the copy a model without enable_gqa makes). Each line is the median of the timed calls after warm-up calls.

Run: python3 bench/attention_torch.py [--repeats N] [--rows 1024 3357 ...] [--threads 1 2]
"""
import argparse
import inspect
import statistics
import time

import torch
import torch.nn.functional as F

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def has_enable_gqa() -> bool:
    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: try the keyword
        q = torch.zeros(1, 2, 1, 8)
        kv = torch.zeros(1, 1, 4, 8)
        try:
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
            return True
        except TypeError:
            return False


def attention_call(q, k, v, gqa: bool):
    if gqa:
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    return lambda: F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    )


def time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 3357, 32768, 131072])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    gqa = has_enable_gqa()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"GQA by {'enable_gqa' if gqa else 'repeat_interleave'}")
    print(f"{'rows':>8} {'threads':>7} {'f16 ms':>9} {'f32 ms':>9}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in args.rows:
            q32 = torch.randn(1, Q_HEADS, 1, HEAD_DIM, generator=gen)
            k32 = torch.randn(1, KV_HEADS, rows, HEAD_DIM, generator=gen)
            v32 = torch.randn(1, KV_HEADS, rows, HEAD_DIM, generator=gen)
            q16, k16, v16 = q32.half(), k32.half(), v32.half()
            for threads in args.threads:
                torch.set_num_threads(threads)
                # fewer timed calls where one call takes long
                reps = args.repeats if rows <= 32768 else max(5, args.repeats // 4)
                t16 = time_ms(attention_call(q16, k16, v16, gqa), reps)
                t32 = time_ms(attention_call(q32, k32, v32, gqa), reps)
                print(f"{rows:>8} {threads:>7} {t16:>9.3f} {t32:>9.3f}", flush=True)


if __name__ == "__main__":
    main()
