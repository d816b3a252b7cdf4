// kvret-eval — retrieval quality of every index kind, over budgets and context lengths, on the synthetic workload
// (tools/workload) and on real-model traces (tools/traces/make_traces.py).
//
// For each context length N and each evaluated layer: prefill N tokens into a one-layer kvret context per index kind
// (through the public C ABI, as an engine would), then decode `steps` tokens: append the step's key/value, select at
// every budget (a fraction of the current context length) with the step's query, and keep the positions. Then the
// exact attention of every step (every query head over every stored token, the KV rounded to the KV dtype as kvret
// stores it) scores every selection: token recall, attention-mass recall and output error (tools/eval/quality.hpp).
// Means over layers, steps and heads are printed as a markdown table, and written as CSV/JSON.
//
//   kvret-eval [--contexts 8192,32768,131072] [--budgets 0.2,0.1,0.05,0.02] [--retrievers
//   exact,pq,page,streaming(,cluster,quant1,quant2)]
//              [--layers 2] [--steps 4] [--kv-dtype f16|f32] [--fold sum|max] [--threads 0] [--seed 1]
//              [--traces DIR [--trace-layers all|0,5,...] [--trace-rope post|pre|kvret]]
//              [--pq-m M] [--pq-bits B] [--pq-iters I] [--pq-sample S] [--pq-exact-fraction F] [--page-size P]
//              (defaults: kvret's)
//              [--markdown FILE] [--csv FILE] [--json FILE] [--quiet]
//
// With --traces, the contexts must leave room for the decode steps (N + steps <= the trace's tokens); the queries
// are the model's own at positions N .. N+steps-1. --trace-rope pre selects with the keys and queries before RoPE
// (as an engine storing pre-RoPE keys would) while quality is still judged against the model's real attention.
// --trace-rope kvret gives kvret the keys before RoPE with config.rope_keys = 1 (the trace's theta and layout), so
// that kvret rotates them at their positions, and selects with the model's own (rotated) queries.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "core/half.hpp"
#include "kvret.h"
#include "quality.hpp"
#include "traces.hpp"
#include "workload.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Retriever {
  std::string name;
  int kind;
  int quant_bits;  ///< the quant index's bits; 0: kvret's default
};

const Retriever kRetrievers[] = {{"exact", KVRET_INDEX_EXACT, 0},     {"pq", KVRET_INDEX_PQ, 0},
                                 {"page", KVRET_INDEX_PAGE, 0},       {"streaming", KVRET_INDEX_STREAMING, 0},
                                 {"cluster", KVRET_INDEX_CLUSTER, 0}, {"quant1", KVRET_INDEX_QUANT, 1},
                                 {"quant2", KVRET_INDEX_QUANT, 2}};
/// The default --retrievers: the first four. Not cluster, whose k-means (about tokens^2 / cluster_tokens * head_dim
/// per iteration and head) makes the 131072-token contexts slow on a CPU, nor the quant index at 1 and 2 bits; ask
/// for them by name.
constexpr size_t kDefaultRetrievers = 4;

struct Options {
  std::vector<int64_t> contexts{8192, 32768, 131072};
  std::vector<double> budgets{0.2, 0.1, 0.05, 0.02};
  std::vector<Retriever> retrievers{std::begin(kRetrievers), std::begin(kRetrievers) + kDefaultRetrievers};
  int layers = 2;
  int steps = 4;
  bool f16 = true;
  bool max_fold = false;
  int threads = 0;
  uint64_t seed = 1;
  std::string traces;
  std::string trace_layers = "all";
  bool trace_pre_rope = false;   ///< load the trace's pre-RoPE keys and queries
  bool trace_rope_keys = false;  ///< --trace-rope kvret: pre-RoPE keys with config.rope_keys = 1, rotated queries
  std::string markdown, csv, json;
  bool quiet = false;
  // index parameters (-1: kvret's default)
  int pq_m = -1, pq_bits = -1, pq_iters = -1, pq_sample = -1, page_size = -1;
  float pq_exact_fraction = -1;
};

[[noreturn]] void usage(const char* why) {
  if (why) std::fprintf(stderr, "kvret-eval: %s\n", why);
  std::fprintf(
      stderr,
      "usage: kvret-eval [--contexts N,...] [--budgets f,...] [--retrievers "
      "exact,pq,page,streaming,cluster,quant1,quant2]\n"
      "                  [--layers L] [--steps S] [--kv-dtype f16|f32] [--fold sum|max] [--threads T]\n"
      "                  [--seed X] [--traces DIR [--trace-layers all|i,j,...] [--trace-rope post|pre|kvret]]\n"
      "                  [--pq-m M] [--pq-bits B] [--pq-iters I] [--pq-sample S] [--pq-exact-fraction F]\n"
      "                  [--page-size P]\n"
      "                  [--markdown FILE] [--csv FILE] [--json FILE] [--quiet]\n");
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  for (size_t p = 0; p <= s.size();) {
    const size_t q = std::min(s.find(',', p), s.size());
    if (q > p) out.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage((a + " needs a value").c_str());
      return argv[++i];
    };
    if (a == "--contexts") {
      o.contexts.clear();
      for (const auto& s : split(value())) o.contexts.push_back(std::atoll(s.c_str()));
    } else if (a == "--budgets") {
      o.budgets.clear();
      for (const auto& s : split(value())) o.budgets.push_back(std::atof(s.c_str()));
    } else if (a == "--retrievers") {
      o.retrievers.clear();
      for (const auto& s : split(value())) {
        const auto it = std::find_if(std::begin(kRetrievers), std::end(kRetrievers),
                                     [&](const Retriever& r) { return r.name == s; });
        if (it == std::end(kRetrievers)) usage(("unknown retriever " + s).c_str());
        o.retrievers.push_back(*it);
      }
    } else if (a == "--layers") {
      o.layers = std::atoi(value().c_str());
    } else if (a == "--steps") {
      o.steps = std::atoi(value().c_str());
    } else if (a == "--kv-dtype") {
      const std::string v = value();
      if (v != "f16" && v != "f32") usage("--kv-dtype is f16 or f32");
      o.f16 = v == "f16";
    } else if (a == "--fold") {
      const std::string v = value();
      if (v != "sum" && v != "max") usage("--fold is sum or max");
      o.max_fold = v == "max";
    } else if (a == "--threads") {
      o.threads = std::atoi(value().c_str());
    } else if (a == "--seed") {
      o.seed = std::strtoull(value().c_str(), nullptr, 10);
    } else if (a == "--traces") {
      o.traces = value();
    } else if (a == "--trace-layers") {
      o.trace_layers = value();
    } else if (a == "--trace-rope") {
      const std::string v = value();
      if (v != "post" && v != "pre" && v != "kvret") usage("--trace-rope is post, pre or kvret");
      o.trace_pre_rope = v != "post";
      o.trace_rope_keys = v == "kvret";
    } else if (a == "--markdown") {
      o.markdown = value();
    } else if (a == "--csv") {
      o.csv = value();
    } else if (a == "--json") {
      o.json = value();
    } else if (a == "--pq-m") {
      o.pq_m = std::atoi(value().c_str());
    } else if (a == "--pq-bits") {
      o.pq_bits = std::atoi(value().c_str());
    } else if (a == "--pq-iters") {
      o.pq_iters = std::atoi(value().c_str());
    } else if (a == "--pq-sample") {
      o.pq_sample = std::atoi(value().c_str());
    } else if (a == "--pq-exact-fraction") {
      o.pq_exact_fraction = std::strtof(value().c_str(), nullptr);
    } else if (a == "--page-size") {
      o.page_size = std::atoi(value().c_str());
    } else if (a == "--quiet") {
      o.quiet = true;
    } else if (a == "--help" || a == "-h") {
      usage(nullptr);
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  if (o.contexts.empty() || o.budgets.empty() || o.retrievers.empty()) usage("empty list");
  if (o.layers < 1 || o.steps < 1) usage("--layers and --steps must be >= 1");
  for (double b : o.budgets)
    if (!(b > 0 && b <= 1)) usage("budgets are fractions in (0, 1]");
  return o;
}

void check(kvret_status s, const char* what) {
  if (s != KVRET_OK) {
    std::fprintf(stderr, "kvret-eval: %s: %s: %s\n", what, kvret_status_string(s), kvret_last_error());
    std::exit(1);
  }
}

struct Geometry {
  int n_q_heads, n_kv_heads, head_dim;
};

struct TensorF32 {
  std::vector<int64_t> shape;
  kvret_tensor t{};
  TensorF32(const float* data, std::vector<int64_t> s) : shape(std::move(s)) {
    t.data = const_cast<float*>(data);
    t.device = {KVRET_DEVICE_CPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = {KVRET_DTYPE_FLOAT, 32, 1};
    t.shape = shape.data();
  }
};

/// What one (source, context, retriever, budget) accumulates.
struct Cell {
  kvret::quality::Totals totals;
  double select_ms = 0;
  int64_t selects = 0;
  int64_t budget_tokens = 0;  ///< the budget at the first step of the first layer, for the table
};

struct Key {
  std::string source;
  int64_t context;
  std::string retriever;
  double budget;
  bool operator<(const Key& o) const {
    return std::tie(source, context, retriever, budget) < std::tie(o.source, o.context, o.retriever, o.budget);
  }
};

/// One layer's data at one context length: keys/values of N + steps tokens and the steps' queries, in kvret's
/// layout. sel_k/sel_q are what kvret selects with (the same unless pre-RoPE selection is asked for).
struct LayerData {
  int64_t context = 0;
  int steps = 0;
  const float* k = nullptr;  // [N + steps, Hkv, D]
  const float* v = nullptr;
  const float* q = nullptr;  // [steps, Hq, D]
  const float* sel_k = nullptr;
  const float* sel_q = nullptr;
  uint64_t seed = 0;
  // sel_k before RoPE, rotated by kvret (config.rope_keys = 1) with these parameters
  bool rope_keys = false;
  double rope_theta = 10000.0;
  int rope_layout = KVRET_ROPE_NEOX;
  int rope_dims = 0;
};

void evaluate_layer(const Options& o, const Geometry& geo, const std::string& source, const LayerData& data,
                    std::map<Key, Cell>& cells) {
  const int HQ = geo.n_q_heads, HK = geo.n_kv_heads, D = geo.head_dim;
  const int64_t N = data.context;
  const size_t row = static_cast<size_t>(HK) * D;
  // selections[retriever][budget][step]: per KV head `count` positions
  struct Selection {
    int64_t count = 0;
    std::vector<int32_t> positions;  // [HK, count]
  };
  std::vector<std::vector<std::vector<Selection>>> sel(
      o.retrievers.size(), std::vector<std::vector<Selection>>(o.budgets.size(), std::vector<Selection>(data.steps)));
  int n_sink = 0, n_local = 0;
  for (size_t r = 0; r < o.retrievers.size(); ++r) {
    kvret_config c;
    check(kvret_config_init(&c), "config_init");
    c.n_layers = 1;
    c.n_q_heads = HQ;
    c.n_kv_heads = HK;
    c.head_dim = D;
    c.kv_dtype = o.f16 ? KVRET_KV_F16 : KVRET_KV_F32;
    c.index_kind = o.retrievers[r].kind;
    if (o.retrievers[r].quant_bits > 0) c.quant_bits = o.retrievers[r].quant_bits;
    c.gqa_fold = o.max_fold ? KVRET_FOLD_MAX_LOGIT : KVRET_FOLD_SUM_PROB;
    c.n_threads = o.threads;
    c.seed = data.seed;
    if (o.pq_m >= 0) c.pq_m = o.pq_m;
    if (o.pq_bits >= 0) c.pq_bits = o.pq_bits;
    if (o.pq_iters >= 0) c.pq_iters = o.pq_iters;
    if (o.pq_sample >= 0) c.pq_train_sample = o.pq_sample;
    if (o.pq_exact_fraction >= 0) c.pq_exact_fraction = o.pq_exact_fraction;
    if (o.page_size >= 0) c.page_size = o.page_size;
    if (data.rope_keys) {
      c.rope_keys = 1;
      c.rope_theta = static_cast<float>(data.rope_theta);
      c.rope_layout = data.rope_layout;
      c.rope_dims = data.rope_dims;
    }
    n_sink = c.n_sink;
    n_local = c.n_local;
    kvret_context* ctx = nullptr;
    check(kvret_create(&c, &ctx), "create");
    kvret_seq* seq = nullptr;
    check(kvret_seq_open(ctx, &seq), "seq_open");
    const TensorF32 kp(data.sel_k, {N, HK, D}), vp(data.v, {N, HK, D});
    check(kvret_append_prefill(seq, 0, &kp.t, &vp.t), "append_prefill");
    check(kvret_wait_index(seq, 0), "wait_index");
    for (int s = 0; s < data.steps; ++s) {
      const TensorF32 kd(data.sel_k + (N + s) * row, {HK, D}), vd(data.v + (N + s) * row, {HK, D});
      check(kvret_append_decode(seq, 0, &kd.t, &vd.t), "append_decode");
      const TensorF32 q(data.sel_q + static_cast<size_t>(s) * HQ * D, {HQ, D});
      const int64_t len = N + s + 1;
      const int64_t middle = std::max<int64_t>(0, len - std::min<int64_t>(n_sink, len) - n_local);
      for (size_t b = 0; b < o.budgets.size(); ++b) {
        Selection& out = sel[r][b][static_cast<size_t>(s)];
        const int64_t budget =
            std::clamp<int64_t>(std::llround(o.budgets[b] * static_cast<double>(len)), 1, std::max<int64_t>(middle, 1));
        out.positions.assign(static_cast<size_t>(HK * budget), 0);
        const TensorF32 dummy(nullptr, {HK, budget});
        kvret_tensor pos = dummy.t;
        pos.data = out.positions.data();
        pos.dtype = {KVRET_DTYPE_INT, 32, 1};
        int32_t count = 0;
        const auto t0 = Clock::now();
        check(kvret_select(seq, 0, &q.t, static_cast<int32_t>(budget), &pos, &count), "select");
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        out.count = count;
        Cell& cell = cells[{source, N, o.retrievers[r].name, o.budgets[b]}];
        cell.select_ms += ms;
        cell.selects += 1;
        if (cell.budget_tokens == 0) cell.budget_tokens = budget;
        // compact the rows to [HK, count]
        for (int h = 1; h < HK && count < budget; ++h)
          std::memmove(&out.positions[static_cast<size_t>(h) * count], &out.positions[static_cast<size_t>(h * budget)],
                       sizeof(int32_t) * static_cast<size_t>(count));
      }
    }
    check(kvret_destroy(ctx), "destroy");
  }

  // exact attention of every step, and every selection scored against it
  for (int s = 0; s < data.steps; ++s) {
    const int64_t len = N + s + 1;
    kvret::quality::StepInput in;
    in.q = data.q + static_cast<size_t>(s) * HQ * D;
    in.k = data.k;
    in.v = data.v;
    in.length = len;
    in.n_q_heads = HQ;
    in.n_kv_heads = HK;
    in.head_dim = D;
    in.mid_begin = std::min<int64_t>(n_sink, len);
    in.mid_end = std::max(in.mid_begin, len - n_local);
    in.fold = o.max_fold ? kvret::quality::Fold::kMaxLogit : kvret::quality::Fold::kSumProb;
    const kvret::quality::ExactAttention exact(in, o.threads);
    for (size_t r = 0; r < o.retrievers.size(); ++r)
      for (size_t b = 0; b < o.budgets.size(); ++b) {
        const Selection& x = sel[r][b][static_cast<size_t>(s)];
        std::vector<const int32_t*> rows(static_cast<size_t>(HK));
        for (int h = 0; h < HK; ++h)
          rows[static_cast<size_t>(h)] = x.positions.data() + static_cast<size_t>(h) * x.count;
        kvret::quality::score_selection(exact, rows.data(), x.count,
                                        cells[{source, N, o.retrievers[r].name, o.budgets[b]}].totals);
      }
  }
}

/// Rounds to what an f16 KV cache stores.
void round_f16(std::vector<float>& x) {
  for (float& f : x) f = kvret::f16_to_f32(kvret::f32_to_f16(f));
}

std::string budget_label(double b) {
  char buf[32];
  const double inv = 1.0 / b;
  if (std::fabs(inv - std::round(inv)) < 1e-6)
    std::snprintf(buf, sizeof buf, "1/%d", static_cast<int>(std::round(inv)));
  else
    std::snprintf(buf, sizeof buf, "%.3g", b);
  return buf;
}

std::string context_label(int64_t n) {
  char buf[32];
  if (n % 1024 == 0)
    std::snprintf(buf, sizeof buf, "%lldk", static_cast<long long>(n / 1024));
  else
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(n));
  return buf;
}

void write_outputs(const Options& o, const std::map<Key, Cell>& cells, const std::string& header) {
  // rows ordered by source, context, retriever (in the order asked), budget (largest first)
  std::vector<Key> keys;
  for (const auto& [k, c] : cells) keys.push_back(k);
  auto rank = [&](const std::string& name) {
    for (size_t i = 0; i < o.retrievers.size(); ++i)
      if (o.retrievers[i].name == name) return i;
    return o.retrievers.size();
  };
  std::stable_sort(keys.begin(), keys.end(), [&](const Key& a, const Key& b) {
    return std::make_tuple(a.source, a.context, rank(a.retriever), -a.budget) <
           std::make_tuple(b.source, b.context, rank(b.retriever), -b.budget);
  });
  std::string md = header;
  md +=
      "| source | context | retriever | budget | B (tokens) | token recall | mass recall | output error | select ms "
      "|\n";
  md += "|---|---:|---|---:|---:|---:|---:|---:|---:|\n";
  std::string csv = "source,context,retriever,budget,budget_tokens,token_recall,mass_recall,output_error,select_ms\n";
  std::string json = "[\n";
  for (size_t i = 0; i < keys.size(); ++i) {
    const Key& k = keys[i];
    const Cell& c = cells.at(k);
    const double ms = c.selects ? c.select_ms / static_cast<double>(c.selects) : 0.0;
    char buf[512];
    std::snprintf(buf, sizeof buf, "| %s | %s | %s | %s | %lld | %.3f | %.3f | %.3f | %.2f |\n", k.source.c_str(),
                  context_label(k.context).c_str(), k.retriever.c_str(), budget_label(k.budget).c_str(),
                  static_cast<long long>(c.budget_tokens), c.totals.token_recall(), c.totals.mass_recall(),
                  c.totals.output_error(), ms);
    md += buf;
    std::snprintf(buf, sizeof buf, "%s,%lld,%s,%.6g,%lld,%.6f,%.6f,%.6f,%.4f\n", k.source.c_str(),
                  static_cast<long long>(k.context), k.retriever.c_str(), k.budget,
                  static_cast<long long>(c.budget_tokens), c.totals.token_recall(), c.totals.mass_recall(),
                  c.totals.output_error(), ms);
    csv += buf;
    std::snprintf(buf, sizeof buf,
                  "  {\"source\": \"%s\", \"context\": %lld, \"retriever\": \"%s\", \"budget\": %.6g, "
                  "\"budget_tokens\": %lld, \"token_recall\": %.6f, \"mass_recall\": %.6f, \"output_error\": %.6f, "
                  "\"select_ms\": %.4f}%s\n",
                  k.source.c_str(), static_cast<long long>(k.context), k.retriever.c_str(), k.budget,
                  static_cast<long long>(c.budget_tokens), c.totals.token_recall(), c.totals.mass_recall(),
                  c.totals.output_error(), ms, i + 1 < keys.size() ? "," : "");
    json += buf;
  }
  json += "]\n";
  auto save = [](const std::string& path, const std::string& text) {
    if (path.empty()) return;
    FILE* f = std::fopen(path.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "kvret-eval: cannot write %s\n", path.c_str());
      std::exit(1);
    }
    std::fputs(text.c_str(), f);
    std::fclose(f);
  };
  save(o.markdown, md);
  save(o.csv, csv);
  save(o.json, json);
  if (!o.quiet) std::fputs(md.c_str(), stdout);
}

void log(const Options& o, const char* fmt, const std::string& a, long long b, int c) {
  if (!o.quiet) std::fprintf(stderr, fmt, a.c_str(), b, c);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::map<Key, Cell> cells;
  const auto t_start = Clock::now();
  std::string header;
  char buf[512];

  if (o.traces.empty()) {
    // ---- the synthetic workload: a Llama-3-8B-like geometry ----
    const Geometry geo{32, 8, 128};
    for (int64_t n : o.contexts) {
      kvret::workload::Config wc;
      wc.n_layers = o.layers;
      wc.n_q_heads = geo.n_q_heads;
      wc.n_kv_heads = geo.n_kv_heads;
      wc.head_dim = geo.head_dim;
      wc.n_prefill = n;
      wc.n_decode = o.steps;
      wc.seed = o.seed;
      const kvret::workload::Workload w(wc);
      const size_t kv = static_cast<size_t>(n + o.steps) * geo.n_kv_heads * geo.head_dim;
      std::vector<float> k(kv), v(kv), q(static_cast<size_t>(o.steps) * geo.n_q_heads * geo.head_dim);
      for (int l = 0; l < o.layers; ++l) {
        log(o, "[%s] context %lld, layer %d\n", "synthetic", static_cast<long long>(n), l);
        w.keys_values(l, 0, n + o.steps, k.data(), v.data());
        w.queries(l, o.steps, q.data());
        if (o.f16) {
          round_f16(k);
          round_f16(v);
        }
        LayerData d;
        d.context = n;
        d.steps = o.steps;
        d.k = d.sel_k = k.data();
        d.v = v.data();
        d.q = d.sel_q = q.data();
        d.seed = o.seed * 1000 + static_cast<uint64_t>(l);
        evaluate_layer(o, geo, "synthetic", d, cells);
      }
    }
    std::snprintf(buf, sizeof buf,
                  "Synthetic workload (tools/workload, seed %llu): 32 query heads, 8 KV heads, head_dim 128, KV %s, "
                  "%d layers x %d decode steps per context; sink 16, local 64; budget = fraction of the context.\n\n",
                  static_cast<unsigned long long>(o.seed), o.f16 ? "f16" : "f32", o.layers, o.steps);
    header = buf;
  } else {
    // ---- real-model traces ----
    try {
      const kvret::eval::Trace trace(o.traces);
      const auto& m = trace.meta();
      const Geometry geo{m.n_q_heads, m.n_kv_heads, trace.padded_dim()};
      std::vector<int> layers = m.layers;
      if (o.trace_layers != "all") {
        layers.clear();
        for (const auto& s : split(o.trace_layers)) layers.push_back(std::atoi(s.c_str()));
      }
      const std::string source = o.trace_rope_keys ? "trace-rope-keys" : o.trace_pre_rope ? "trace-pre-rope" : "trace";
      for (int l : layers) {
        kvret::eval::TraceLayer t = trace.layer(l, o.trace_pre_rope);
        if (o.f16) {
          for (auto* x : {&t.k, &t.v, &t.k_pre}) round_f16(*x);
        }
        for (int64_t n : o.contexts) {
          if (n + o.steps > m.tokens) {
            std::fprintf(stderr, "kvret-eval: context %lld + %d steps exceeds the trace's %lld tokens\n",
                         static_cast<long long>(n), o.steps, static_cast<long long>(m.tokens));
            return 2;
          }
          log(o, "[%s] context %lld, layer %d\n", source, static_cast<long long>(n), l);
          LayerData d;
          d.context = n;
          d.steps = o.steps;
          d.k = t.k.data();
          d.v = t.v.data();
          d.q = t.q.data() + static_cast<size_t>(n) * geo.n_q_heads * geo.head_dim;
          d.sel_k = o.trace_pre_rope ? t.k_pre.data() : d.k;
          d.sel_q = o.trace_pre_rope && !o.trace_rope_keys
                        ? t.q_pre.data() + static_cast<size_t>(n) * geo.n_q_heads * geo.head_dim
                        : d.q;
          d.rope_keys = o.trace_rope_keys;
          d.rope_theta = m.rope_theta;
          d.rope_layout = m.rope_adjacent_pairs ? KVRET_ROPE_GPTJ : KVRET_ROPE_NEOX;
          d.rope_dims = m.head_dim;
          d.seed = o.seed * 1000 + static_cast<uint64_t>(l);
          evaluate_layer(o, geo, source, d, cells);
        }
      }
      std::snprintf(
          buf, sizeof buf,
          "Real-model traces: %s, %d query heads, %d KV heads, head_dim %d%s, %zu layers x %d decode steps "
          "per context, KV %s, selection on keys %s; sink 16, local 64.\n\n",
          m.model.c_str(), m.n_q_heads, m.n_kv_heads, m.head_dim,
          geo.head_dim != m.head_dim ? (" (zero-padded to " + std::to_string(geo.head_dim) + ")").c_str() : "",
          layers.size(), o.steps, o.f16 ? "f16" : "f32",
          o.trace_rope_keys  ? "given before RoPE and rotated by kvret (config.rope_keys = 1)"
          : o.trace_pre_rope ? "and queries before RoPE"
                             : "after RoPE");
      header = buf;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kvret-eval: %s\n", e.what());
      return 1;
    }
  }
  if (!o.quiet) std::fprintf(stderr, "done in %.1f s\n", std::chrono::duration<double>(Clock::now() - t_start).count());
  write_outputs(o, cells, header);
  return 0;
}
