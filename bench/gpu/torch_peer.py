#!/usr/bin/env python3
"""PyTorch peer of kvret-bench-gpu.

The same operations as kvret-bench-gpu, written with PyTorch ops (matmul/einsum, gather, softmax, topk, sort,
index_select, scaled_dot_product_attention), on the same shapes, timed the same way (CUDA events around each call,
median of the repetitions), printed as the same "section=... key=value" lines with impl=torch. Run both in one
session on the same GPU and compare line by line:

    build-cuda/bin/kvret-bench-gpu          > kvret.txt
    python3 bench/gpu/torch_peer.py         > torch.txt

--device cpu runs every section on the CPU with tiny sizes: a smoke test of the script, not a measurement.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

Q_HEADS = 32
KV_HEADS = 8
HEAD_DIM = 128
PQ_M = 2
PQ_BITS = 6
SINK = 16
LOCAL = 64
BUDGET_RATIO = 0.1
KMEANS_ITERS = 25


def budget_of(tokens):
    return max(1, int(BUDGET_RATIO * tokens))


def time_it(fn, device, warmup, reps):
    """Median and min in microseconds of fn(), timed with CUDA events (or perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1000.0)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), min(times)


def time_wall(fn, device, warmup, reps):
    """Like time_it, but with the host clock around fn() plus a synchronize: for work that runs partly on the CPU."""
    def synced():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        synced()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        synced()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), min(times)


# ---------------------------------------------------------------------------------------------------------------
def select_torch(q, centroids, codes_flat, budget, scale):
    """PQ scores with the sum-of-probabilities GQA fold, then top-k positions sorted ascending.

    q [B, n_q, D] f32; centroids [B, n_kv, m, K, sub] f32; codes_flat [B, n_kv, n * m] int64 holding
    code + j * K (the index into the flattened table, prepared once: the peer's best layout)."""
    batch, n_kv, m, k, sub = centroids.shape
    group = q.shape[1] // n_kv
    n = codes_flat.shape[2] // m
    qs = q.view(batch, n_kv, group, m, sub)
    lut = torch.einsum("bhgms,bhmks->bhgmk", qs, centroids).reshape(batch, n_kv, group, m * k) * scale
    index = codes_flat.unsqueeze(2).expand(batch, n_kv, group, n * m)
    logits = torch.gather(lut, 3, index).view(batch, n_kv, group, n, m).sum(-1)
    scores = torch.softmax(logits, dim=-1).sum(2)
    top = torch.topk(scores, budget, dim=-1, sorted=False).indices
    return torch.sort(top, dim=-1).values


def bench_select(args, device, sizes):
    n_centroids = 1 << PQ_BITS
    sub = HEAD_DIM // PQ_M
    scale = HEAD_DIM ** -0.5
    for batch in (1, 16):
        for tokens in sizes:
            budget = budget_of(tokens)
            gen = torch.Generator(device="cpu").manual_seed(1)
            q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen).to(device)
            centroids = torch.randn(batch, KV_HEADS, PQ_M, n_centroids, sub, generator=gen).to(device)
            offsets = (torch.arange(PQ_M) * n_centroids).to(device)
            sets = []
            for _ in range(3):  # rotating inputs, like kvret-bench-gpu
                codes = torch.randint(0, n_centroids, (batch, KV_HEADS, tokens, PQ_M), generator=gen).to(device)
                sets.append((codes.long() + offsets).reshape(batch, KV_HEADS, tokens * PQ_M).contiguous())
            state = {"i": 0}

            def run():
                codes_flat = sets[state["i"] % len(sets)]
                state["i"] += 1
                return select_torch(q, centroids, codes_flat, budget, scale)

            med, best = time_it(run, device, 5, args.reps)
            print(f"section=select impl=torch tokens={tokens} kv_heads={KV_HEADS} q_heads={Q_HEADS} batch={batch} "
                  f"budget={budget} pq_m={PQ_M} pq_bits={PQ_BITS} us_per_call={med:.2f} us_min={best:.2f}",
                  flush=True)


# ---------------------------------------------------------------------------------------------------------------
def working_set_index(tokens, budget, gen):
    """[n_kv, rows] positions: sink + sorted random middle + local, per head."""
    rows = []
    for _ in range(KV_HEADS):
        middle = torch.randperm(tokens - LOCAL - SINK, generator=gen)[:budget] + SINK
        rows.append(torch.cat([torch.arange(SINK), torch.sort(middle).values, torch.arange(tokens - LOCAL, tokens)]))
    return torch.stack(rows)


def bench_fetch(args, device, sizes):
    pinned = device.type == "cuda"
    for tokens in sizes:
        budget = budget_of(tokens)
        gen = torch.Generator(device="cpu").manual_seed(2)
        host_k = torch.ones(tokens, KV_HEADS, HEAD_DIM, dtype=torch.float16)
        host_v = torch.full((tokens, KV_HEADS, HEAD_DIM), 2.0, dtype=torch.float16)
        if pinned:
            host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
        positions = working_set_index(tokens, budget, gen)
        rows = positions.shape[1]
        flat = (positions * KV_HEADS + torch.arange(KV_HEADS)[:, None]).reshape(-1)  # rows of [tokens * n_kv, D]
        staging_k = torch.empty(KV_HEADS * rows, HEAD_DIM, dtype=torch.float16)
        staging_v = torch.empty_like(staging_k)
        if pinned:
            staging_k, staging_v = staging_k.pin_memory(), staging_v.pin_memory()
        out_k = torch.empty(KV_HEADS * rows, HEAD_DIM, dtype=torch.float16, device=device)
        out_v = torch.empty_like(out_k)
        nbytes = 2 * out_k.numel() * out_k.element_size()

        def cpu_gather_then_copy():  # the PyTorch way to fetch scattered host rows: gather on the CPU, copy
            torch.index_select(host_k.view(-1, HEAD_DIM), 0, flat, out=staging_k)
            torch.index_select(host_v.view(-1, HEAD_DIM), 0, flat, out=staging_v)
            out_k.copy_(staging_k, non_blocking=True)
            out_v.copy_(staging_v, non_blocking=True)

        contiguous_k = host_k.view(-1, HEAD_DIM)[: KV_HEADS * rows]
        contiguous_v = host_v.view(-1, HEAD_DIM)[: KV_HEADS * rows]

        def contiguous_copy():
            out_k.copy_(contiguous_k, non_blocking=True)
            out_v.copy_(contiguous_v, non_blocking=True)

        dev_k = host_k.to(device)
        dev_v = host_v.to(device)
        flat_dev = flat.to(device)

        def device_gather():  # the rows already on the GPU (kvret's cache-hit path)
            torch.index_select(dev_k.view(-1, HEAD_DIM), 0, flat_dev, out=out_k)
            torch.index_select(dev_v.view(-1, HEAD_DIM), 0, flat_dev, out=out_v)

        g_med, _ = time_wall(cpu_gather_then_copy, device, 3, args.reps)
        c_med, _ = time_it(contiguous_copy, device, 3, args.reps)
        d_med, _ = time_it(device_gather, device, 3, args.reps)
        print(f"section=fetch impl=torch tokens={tokens} kv_heads={KV_HEADS} rows_per_head={rows} row_bytes="
              f"{HEAD_DIM * 2} bytes={nbytes} gather_us={g_med:.2f} gather_GBps={nbytes / (g_med * 1e3):.2f} "
              f"contiguous_memcpy_us={c_med:.2f} contiguous_GBps={nbytes / (c_med * 1e3):.2f} "
              f"ratio={c_med / g_med:.3f} cache_hit_gather_us={d_med:.2f} "
              f"cache_hit_GBps={nbytes / (d_med * 1e3):.2f}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
def kmeans_torch(x, init, iters):
    """Lloyd iterations for P problems at once: x [P, n, dim], init [P, K] point indices."""
    problems, n, dim = x.shape
    k = init.shape[1]
    c = torch.gather(x, 1, init.unsqueeze(-1).expand(problems, k, dim)).clone()
    xn = (x * x).sum(-1, keepdim=True)
    ones = torch.ones(problems, n, device=x.device)
    assign = None
    for _ in range(iters):
        cn = (c * c).sum(-1).unsqueeze(1)
        dist = torch.baddbmm(cn, x, c.transpose(1, 2), alpha=-2.0) + xn
        assign = dist.argmin(-1)
        sums = torch.zeros(problems, k, dim, device=x.device).scatter_add_(1, assign.unsqueeze(-1).expand(-1, -1, dim), x)
        counts = torch.zeros(problems, k, device=x.device).scatter_add_(1, assign, ones)
        c = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp(min=1).unsqueeze(-1), c)
    return c, assign


def encode_torch(x, c):
    """Nearest centroid of every point: x [P, n, dim], c [P, K, dim] -> uint8 [P, n]."""
    dist = torch.baddbmm((c * c).sum(-1).unsqueeze(1), x, c.transpose(1, 2), alpha=-2.0)
    return dist.argmin(-1).to(torch.uint8)


def split_subspaces(keys, sample):
    """keys [tokens, n_kv, D] f16 -> f32 points [n_kv * m, n, D / m] (problem = head * m + j)."""
    sub = HEAD_DIM // PQ_M
    x = keys[sample].float().view(-1, KV_HEADS, PQ_M, sub)
    return x.permute(1, 2, 0, 3).reshape(KV_HEADS * PQ_M, -1, sub).contiguous()


def bench_build(args, device, sizes):
    n_centroids = 1 << PQ_BITS
    for tokens in sizes:
        keys = (torch.rand(tokens, KV_HEADS, HEAD_DIM, device=device) * 0.875 + 0.125).half()
        all_tokens = torch.arange(tokens, device=device)
        for sample in (8192, 0):
            n_points = tokens if sample == 0 else min(sample, tokens)
            sample_idx = (torch.arange(n_points, device=device) * tokens) // n_points
            init = (torch.arange(n_centroids, device=device) * (n_points // n_centroids)).expand(
                KV_HEADS * PQ_M, n_centroids).contiguous()
            result = {}

            def build():
                x = split_subspaces(keys, sample_idx)
                result["c"], _ = kmeans_torch(x, init, KMEANS_ITERS)

            def encode():
                return encode_torch(split_subspaces(keys, all_tokens), result["c"])

            reps = 3 if args.quick else 5
            k_med, _ = time_it(build, device, 1, reps)
            e_med, _ = time_it(encode, device, 1, reps)
            print(f"section=build impl=torch tokens={tokens} kv_heads={KV_HEADS} pq_m={PQ_M} pq_bits={PQ_BITS} "
                  f"train_points={n_points} iters={KMEANS_ITERS} kmeans_ms={k_med / 1e3:.3f} "
                  f"encode_ms={e_med / 1e3:.3f} build_ms={(k_med + e_med) / 1e3:.3f}", flush=True)
            if args.quick:
                break


def bench_prefill(args, device, sizes):
    """The prefill attention of one layer (causal, GQA, bf16 SDPA): what the index build should hide behind."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for tokens in sizes:
        q = torch.randn(1, Q_HEADS, tokens, HEAD_DIM, device=device, dtype=dtype)
        k = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, device=device, dtype=dtype)
        v = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, device=device, dtype=dtype)

        def attend():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        med, _ = time_it(attend, device, 1, 3)
        print(f"section=prefill impl=torch tokens={tokens} kv_heads={KV_HEADS} q_heads={Q_HEADS} "
              f"attention_ms={med / 1e3:.3f}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
def bench_attend(args, device, sizes):
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    for batch in (1, 16):
        for tokens in sizes:
            rows = SINK + budget_of(tokens) + LOCAL
            q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device=device, dtype=dtype)
            k = torch.randn(batch, KV_HEADS, rows, HEAD_DIM, device=device, dtype=dtype)
            v = torch.randn(batch, KV_HEADS, rows, HEAD_DIM, device=device, dtype=dtype)

            def attend():
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            med, _ = time_it(attend, device, 5, args.reps)
            nbytes = 2 * k.numel() * k.element_size()
            print(f"section=attend impl=torch tokens={tokens} rows={rows} kv_heads={KV_HEADS} q_heads={Q_HEADS} "
                  f"batch={batch} us={med:.2f} GBps={nbytes / (med * 1e3):.1f}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
def bench_step(args, device, sizes):
    """The peers of kvret-bench-backend --step (section=step): one decode step of one layer for a batch, f16, with
    the whole KV in device memory: dense SDPA over every token; and a top-k select (q . k over every key, the
    softmax folded over each KV head's query heads, torch.topk of the budget), alone and followed by the gather of
    the selected rows and SDPA over them."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    group = Q_HEADS // KV_HEADS
    lengths = [t for t in sizes if t >= 32768] or sizes
    for tokens in lengths:
        for batch in (1, 8, 32) if device.type == "cuda" else (1,):
            budget = budget_of(tokens)
            q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device=device, dtype=dtype)
            k = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, device=device, dtype=dtype)
            v = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, device=device, dtype=dtype)
            scale = HEAD_DIM ** -0.5

            def dense():
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            def select():
                logits = torch.einsum("bkgd,bktd->bkgt", q.view(batch, KV_HEADS, group, HEAD_DIM), k) * scale
                folded = torch.softmax(logits.float(), dim=-1).sum(dim=2)
                return torch.topk(folded, budget, dim=-1).indices

            def sparse():
                index = select().unsqueeze(-1).expand(-1, -1, -1, HEAD_DIM)
                return F.scaled_dot_product_attention(q, k.gather(2, index), v.gather(2, index), enable_gqa=True)

            dense_us, _ = time_it(dense, device, 3, args.reps)
            select_us, _ = time_it(select, device, 3, args.reps)
            sparse_us, _ = time_it(sparse, device, 3, args.reps)
            print(f"section=step impl=torch tokens={tokens} batch={batch} kv_heads={KV_HEADS} q_heads={Q_HEADS} "
                  f"head_dim={HEAD_DIM} budget={budget} dense_us={dense_us:.1f} topk_select_us={select_us:.1f} "
                  f"topk_step_us={sparse_us:.1f}", flush=True)
            del q, k, v


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8k and 32k tokens only, fewer repetitions")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sections", default="select,fetch,build,prefill,attend",
                        help="comma-separated; also: step (the device check's peers of kvret-bench-backend --step)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("torch_peer: no CUDA device; nothing to measure")
        return
    if device.type == "cpu":
        sizes = [1024]
        args.reps = min(args.reps, 3)
        args.quick = True
    elif args.quick:
        sizes = [8192, 32768]
        args.reps = min(args.reps, 10)
    else:
        sizes = [8192, 16384, 32768, 65536, 131072]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        print(f'device="{props.name}" sms={props.multi_processor_count} torch={torch.__version__}', flush=True)
    sections = set(args.sections.split(","))
    with torch.inference_mode():
        if "select" in sections:
            bench_select(args, device, sizes)
        if "fetch" in sections:
            bench_fetch(args, device, sizes)
        if "build" in sections:
            bench_build(args, device, sizes)
        if "prefill" in sections:
            bench_prefill(args, device, sizes)
        if "attend" in sections:
            bench_attend(args, device, sizes)
        if "step" in sections:
            bench_step(args, device, sizes if args.quick else [32768, 131072])


if __name__ == "__main__":
    main()
