// kvret-workload-stats — prints, per layer, how the synthetic workload's exact attention is distributed, so that
// the generator can be calibrated against what real models do (see workload.cpp for the figures at the defaults).
//
// For every decode step s (context = prefill + s + 1 tokens, as kvret-demo sees it) and query head, averaged:
//   sink      share of the softmax mass (over all tokens) on the first --n-sink tokens
//   local     share on the last --n-local tokens
//   s+l       sink + local: what a streaming (sink + local window) cache keeps
//   top_head  sink + local + the top B middle tokens by that head's own logit (B = budget ratio x context)
//   top_fold  sink + local + the top B middle tokens by the KV group's folded score (sum over the group of each
//             head's softmax probability over the middle tokens: kvret's default fold)
//   pq_mass   (--pq) sink + local + the top B by a product quantizer's approximate scores, folded the same way
//             (2 sub-spaces x 64 centroids by default, Forgy-initialised k-means on 8192 sampled middle keys)
//   pq_tok    (--pq) per KV head, |PQ selection ∩ folded exact top B| / B
//   needle    (retrieval heads only) share of the mass on the head's needle span
//   ndl_ex / ndl_pq  (retrieval heads only) fraction of the needle span in the folded exact / PQ selection
//   maxprob   the largest single-token probability
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "workload.hpp"

namespace {

struct Options {
  kvret::workload::Config cfg;
  int n_sink = 16;
  int n_local = 64;
  double budget_ratio = 0.1;
  bool pq = false;
  int pq_m = 2;
  int pq_k = 64;
  int pq_iters = 20;
  int pq_sample = 8192;
  int layer_stride = 1;
  int max_layers = -1;
};

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: kvret-workload-stats [--layers N] [--q-heads N] [--kv-heads N] [--head-dim N] [--prefill N]\n"
               "         [--decode N] [--seed N] [--topics N] [--needles N] [--sinks N] [--budget-ratio R]\n"
               "         [--n-sink N] [--n-local N] [--layer-stride N] [--max-layers N]\n"
               "         [--pq] [--pq-m N] [--pq-bits N] [--pq-iters N] [--pq-sample N]\n"
               "         [--set NAME=VALUE]  (topic_logit, recency_logit, sink_mass, needle_logit, gqa_correlation,\n"
               "                              current_topic_boost, key_semantic_noise, key_topic_norm, key_noise,\n"
               "                              outlier_magnitude, query_correlation, topic_zipf, topic_run_tokens)\n");
  std::exit(2);
}

bool set_param(kvret::workload::Config& c, const std::string& kv) {
  const auto eq = kv.find('=');
  if (eq == std::string::npos) return false;
  const std::string k = kv.substr(0, eq);
  const float v = std::strtof(kv.c_str() + eq + 1, nullptr);
  if (k == "topic_logit")
    c.topic_logit = v;
  else if (k == "recency_logit")
    c.recency_logit = v;
  else if (k == "sink_mass")
    c.sink_mass = v;
  else if (k == "needle_logit")
    c.needle_logit = v;
  else if (k == "gqa_correlation")
    c.gqa_correlation = v;
  else if (k == "current_topic_boost")
    c.current_topic_boost = v;
  else if (k == "key_semantic_noise")
    c.key_semantic_noise = v;
  else if (k == "key_topic_norm")
    c.key_topic_norm = v;
  else if (k == "key_noise")
    c.key_noise = v;
  else if (k == "outlier_magnitude")
    c.outlier_magnitude = v;
  else if (k == "query_correlation")
    c.query_correlation = v;
  else if (k == "topic_zipf")
    c.topic_zipf = v;
  else if (k == "topic_run_tokens")
    c.topic_run_tokens = static_cast<int>(v);
  else if (k == "rope_theta")
    c.rope_theta = v;
  else if (k == "semantic_center")
    c.semantic_center = v;
  else if (k == "retrieval_fraction")
    c.retrieval_fraction = v;
  else
    return false;
  return true;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (a == "--layers")
      o.cfg.n_layers = std::atoi(next());
    else if (a == "--q-heads")
      o.cfg.n_q_heads = std::atoi(next());
    else if (a == "--kv-heads")
      o.cfg.n_kv_heads = std::atoi(next());
    else if (a == "--head-dim")
      o.cfg.head_dim = std::atoi(next());
    else if (a == "--prefill")
      o.cfg.n_prefill = std::atoll(next());
    else if (a == "--decode")
      o.cfg.n_decode = std::atoi(next());
    else if (a == "--seed")
      o.cfg.seed = std::strtoull(next(), nullptr, 10);
    else if (a == "--topics")
      o.cfg.n_topics = std::atoi(next());
    else if (a == "--needles")
      o.cfg.n_needles = std::atoi(next());
    else if (a == "--sinks")
      o.cfg.n_sinks = std::atoi(next());
    else if (a == "--budget-ratio")
      o.budget_ratio = std::atof(next());
    else if (a == "--n-sink")
      o.n_sink = std::atoi(next());
    else if (a == "--n-local")
      o.n_local = std::atoi(next());
    else if (a == "--layer-stride")
      o.layer_stride = std::max(1, std::atoi(next()));
    else if (a == "--max-layers")
      o.max_layers = std::atoi(next());
    else if (a == "--pq")
      o.pq = true;
    else if (a == "--pq-m")
      o.pq_m = std::atoi(next());
    else if (a == "--pq-bits")
      o.pq_k = 1 << std::atoi(next());
    else if (a == "--pq-iters")
      o.pq_iters = std::atoi(next());
    else if (a == "--pq-sample")
      o.pq_sample = std::atoi(next());
    else if (a == "--set") {
      if (!set_param(o.cfg, next())) usage();
    } else
      usage();
  }
  if (o.cfg.n_decode < 1 || o.cfg.head_dim % o.pq_m != 0) usage();
  return o;
}

inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // independent partial sums: vectorizes without fast-math
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (float x : acc) s += x;
  return s;
}

inline float dist2(const float* a, const float* b, int n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) {
      const float t = a[i + j] - b[i + j];
      acc[j] += t * t;
    }
  float s = 0.f;
  for (; i < n; ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  for (float x : acc) s += x;
  return s;
}

/// A minimal product quantizer of the middle keys of one KV head (for the PQ premise check only).
struct PQ {
  int m = 2, k = 64, sub = 64;
  std::vector<float> centroids;  // [m, k, sub]
  std::vector<uint8_t> codes;    // [n, m]

  void train_encode(const float* keys, int64_t stride, int64_t begin, int64_t end, int dim, int iters, int sample,
                    uint64_t seed) {
    sub = dim / m;
    const int64_t n = end - begin;
    centroids.assign(static_cast<size_t>(m) * k * sub, 0.f);
    codes.assign(static_cast<size_t>(n) * m, 0);
    std::vector<int64_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), begin);
    uint64_t st = seed * 0x9e3779b97f4a7c15ULL + 12345;
    auto rnd = [&]() {
      st ^= st << 13;
      st ^= st >> 7;
      st ^= st << 17;
      return st;
    };
    const int64_t ns = std::min<int64_t>(n, sample);
    for (int64_t i = 0; i < ns; ++i) std::swap(idx[i], idx[i + static_cast<int64_t>(rnd() % (n - i))]);
    std::vector<float> sums(static_cast<size_t>(k) * sub);
    std::vector<int> counts(k);
    std::vector<int> assign(static_cast<size_t>(ns));
    for (int s = 0; s < m; ++s) {
      float* C = &centroids[static_cast<size_t>(s) * k * sub];
      for (int c = 0; c < k; ++c) std::memcpy(C + c * sub, keys + idx[c % ns] * stride + s * sub, sub * sizeof(float));
      for (int it = 0; it < iters; ++it) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < ns; ++i) {
          const float* x = keys + idx[i] * stride + s * sub;
          float best = 1e30f;
          int bc = 0;
          for (int c = 0; c < k; ++c) {
            const float d2 = dist2(x, C + c * sub, sub);
            if (d2 < best) best = d2, bc = c;
          }
          assign[i] = bc;
        }
        std::fill(sums.begin(), sums.end(), 0.f);
        std::fill(counts.begin(), counts.end(), 0);
        for (int64_t i = 0; i < ns; ++i) {
          const float* x = keys + idx[i] * stride + s * sub;
          for (int j = 0; j < sub; ++j) sums[assign[i] * sub + j] += x[j];
          ++counts[assign[i]];
        }
        for (int c = 0; c < k; ++c) {
          if (counts[c] == 0) {  // re-seed an empty cluster
            std::memcpy(C + c * sub, keys + idx[rnd() % ns] * stride + s * sub, sub * sizeof(float));
            continue;
          }
          for (int j = 0; j < sub; ++j) C[c * sub + j] = sums[c * sub + j] / static_cast<float>(counts[c]);
        }
      }
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        const float* x = keys + (begin + i) * stride + s * sub;
        float best = 1e30f;
        int bc = 0;
        for (int c = 0; c < k; ++c) {
          const float d2 = dist2(x, C + c * sub, sub);
          if (d2 < best) best = d2, bc = c;
        }
        codes[i * m + s] = static_cast<uint8_t>(bc);
      }
    }
  }
};

/// Indices of the `b` largest of `score` (ties arbitrary).
std::vector<int64_t> top_b(const std::vector<float>& score, int64_t b) {
  std::vector<int64_t> idx(score.size());
  std::iota(idx.begin(), idx.end(), 0);
  b = std::min<int64_t>(b, static_cast<int64_t>(idx.size()));
  std::nth_element(idx.begin(), idx.begin() + b, idx.end(), [&](int64_t a, int64_t c) { return score[a] > score[c]; });
  idx.resize(b);
  return idx;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const auto& c = o.cfg;
  const auto t0 = std::chrono::steady_clock::now();
  kvret::workload::Workload w(c);
  const int D = c.head_dim, HQ = c.n_q_heads, HK = c.n_kv_heads, G = HQ / HK;
  const int64_t total = c.n_prefill + c.n_decode;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> K(static_cast<size_t>(total) * HK * D), V(static_cast<size_t>(total) * HK * D);
  std::vector<float> Q(static_cast<size_t>(c.n_decode) * HQ * D);

  std::printf("workload: layers=%d q_heads=%d kv_heads=%d head_dim=%d prefill=%lld decode=%d seed=%llu\n", c.n_layers,
              HQ, HK, D, static_cast<long long>(c.n_prefill), c.n_decode, static_cast<unsigned long long>(c.seed));
  std::printf("needles at:");
  for (auto p : w.needle_positions()) std::printf(" %lld", static_cast<long long>(p));
  std::printf("\nn_sink=%d n_local=%d budget_ratio=%.3f%s\n", o.n_sink, o.n_local, o.budget_ratio,
              o.pq ? " (with the PQ check)" : "");
  enum Metric { kSink, kLocal, kSinkLocal, kTopHead, kTopFold, kPqMass, kPqTok, kNeedle, kNdlEx, kNdlPq, kMaxP, kN };
  const char* names[kN] = {"sink",   "local",  "s+l",    "top_head", "top_fold", "pq_mass",
                           "pq_tok", "needle", "ndl_ex", "ndl_pq",   "maxprob"};
  struct Acc {
    double sum[kN] = {};
    int64_t cnt[kN] = {};
    void add(int m, double x) { sum[m] += x, ++cnt[m]; }
    void merge(const Acc& a) {
      for (int m = 0; m < kN; ++m) sum[m] += a.sum[m], cnt[m] += a.cnt[m];
    }
    void print(const char* label, const char* extra) const {
      std::printf("%5s", label);
      for (int m = 0; m < kN; ++m) {
        if (cnt[m] > 0)
          std::printf(" %8.3f", sum[m] / static_cast<double>(cnt[m]));
        else
          std::printf(" %8s", "-");
      }
      std::printf("%s\n", extra);
    }
  } all;
  std::printf("%5s", "layer");
  for (auto* nm : names) std::printf(" %8s", nm);
  std::printf(" %7s\n", "gen_s");
  int layers_done = 0;
  for (int l = 0; l < c.n_layers; l += o.layer_stride) {
    if (o.max_layers >= 0 && layers_done >= o.max_layers) break;
    ++layers_done;
    const auto g0 = std::chrono::steady_clock::now();
    w.keys_values(l, 0, total, K.data(), V.data());
    const double gen_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - g0).count();
    w.queries(l, c.n_decode, Q.data());
    Acc acc;
    std::vector<PQ> pqs(HK);
    if (o.pq) {
      for (int g = 0; g < HK; ++g) {
        pqs[g].m = o.pq_m;
        pqs[g].k = o.pq_k;
        pqs[g].train_encode(K.data() + g * D, static_cast<int64_t>(HK) * D, o.n_sink, c.n_prefill - o.n_local, D,
                            o.pq_iters, o.pq_sample, c.seed + static_cast<uint64_t>(l * 131 + g));
      }
    }
    for (int s = 0; s < c.n_decode; ++s) {
      const int64_t len = c.n_prefill + s + 1;
      const int64_t mid_lo = std::min<int64_t>(o.n_sink, len), mid_hi = std::max(mid_lo, len - o.n_local);
      const int64_t n_mid = mid_hi - mid_lo;
      const int64_t B = std::min<int64_t>(n_mid, static_cast<int64_t>(o.budget_ratio * static_cast<double>(len)));
      // exact probabilities over all tokens, per head
      std::vector<std::vector<float>> prob(HQ, std::vector<float>(len));
      std::vector<std::vector<float>> logit(HQ, std::vector<float>(len));
#pragma omp parallel for schedule(dynamic)
      for (int h = 0; h < HQ; ++h) {
        const float* q = &Q[(static_cast<size_t>(s) * HQ + h) * D];
        const int g = h / G;
        float mx = -1e30f;
        for (int64_t j = 0; j < len; ++j) {
          logit[h][j] = dot(q, &K[(j * HK + g) * D], D) * scale;
          mx = std::max(mx, logit[h][j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < len; ++j) sum += (prob[h][j] = std::exp(logit[h][j] - mx));
        for (int64_t j = 0; j < len; ++j) prob[h][j] = static_cast<float>(prob[h][j] / sum);
      }
      for (int g = 0; g < HK; ++g) {
        // folded exact score over the middle: sum over the group of each head's softmax over the middle
        std::vector<float> fold(n_mid, 0.f), fold_pq(n_mid, 0.f);
        for (int h = g * G; h < (g + 1) * G; ++h) {
          double mid_mass = 0;
          for (int64_t j = mid_lo; j < mid_hi; ++j) mid_mass += prob[h][j];
          for (int64_t j = mid_lo; j < mid_hi; ++j)
            fold[j - mid_lo] += static_cast<float>(prob[h][j] / std::max(mid_mass, 1e-30));
          if (o.pq) {
            const float* q = &Q[(static_cast<size_t>(s) * HQ + h) * D];
            const PQ& pq = pqs[g];
            std::vector<float> lut(static_cast<size_t>(pq.m) * pq.k);
            for (int sb = 0; sb < pq.m; ++sb)
              for (int cc = 0; cc < pq.k; ++cc)
                lut[sb * pq.k + cc] =
                    dot(q + sb * pq.sub, &pq.centroids[(static_cast<size_t>(sb) * pq.k + cc) * pq.sub], pq.sub) * scale;
            // tokens past the trained range (decode tokens in the middle) are scored exactly: they are few
            std::vector<float> al(n_mid);
            float mx = -1e30f;
            const int64_t n_coded = static_cast<int64_t>(pq.codes.size()) / pq.m;
            for (int64_t j = 0; j < n_mid; ++j) {
              float a = 0.f;
              if (j < n_coded) {
                for (int sb = 0; sb < pq.m; ++sb) a += lut[sb * pq.k + pq.codes[j * pq.m + sb]];
              } else {
                a = logit[h][mid_lo + j];
              }
              al[j] = a;
              mx = std::max(mx, a);
            }
            double sum = 0;
            for (int64_t j = 0; j < n_mid; ++j) sum += std::exp(static_cast<double>(al[j] - mx));
            for (int64_t j = 0; j < n_mid; ++j)
              fold_pq[j] += static_cast<float>(std::exp(static_cast<double>(al[j] - mx)) / sum);
          }
        }
        const auto sel_fold = top_b(fold, B);
        std::vector<int64_t> sel_pq;
        if (o.pq) {
          sel_pq = top_b(fold_pq, B);
          std::vector<char> in(n_mid, 0);
          for (auto j : sel_fold) in[j] = 1;
          int64_t hit = 0;
          for (auto j : sel_pq) hit += in[j];
          acc.add(kPqTok, B > 0 ? static_cast<double>(hit) / static_cast<double>(B) : 0.0);
        }
        for (int h = g * G; h < (g + 1) * G; ++h) {
          const auto& p = prob[h];
          double sink = 0, local = 0;
          for (int64_t j = 0; j < mid_lo; ++j) sink += p[j];
          for (int64_t j = mid_hi; j < len; ++j) local += p[j];
          std::vector<float> mid_logit(logit[h].begin() + mid_lo, logit[h].begin() + mid_hi);
          double top = 0, topf = 0, pqm = 0;
          for (auto j : top_b(mid_logit, B)) top += p[mid_lo + j];
          for (auto j : sel_fold) topf += p[mid_lo + j];
          for (auto j : sel_pq) pqm += p[mid_lo + j];
          acc.add(kSink, sink);
          acc.add(kLocal, local);
          acc.add(kSinkLocal, sink + local);
          acc.add(kTopHead, sink + local + top);
          acc.add(kTopFold, sink + local + topf);
          if (o.pq) acc.add(kPqMass, sink + local + pqm);
          acc.add(kMaxP, *std::max_element(p.begin(), p.end()));
          const int nd = w.needle_of_head(l, h);
          if (nd >= 0) {
            const int64_t np = w.needle_positions()[nd];
            double m = 0;
            for (int64_t j = np; j < np + c.needle_tokens && j < len; ++j) m += p[j];
            acc.add(kNeedle, m);
            auto recall = [&](const std::vector<int64_t>& sel) {
              int64_t hit = 0;
              for (auto j : sel) hit += (mid_lo + j >= np && mid_lo + j < np + c.needle_tokens) ? 1 : 0;
              return static_cast<double>(hit) / c.needle_tokens;
            };
            acc.add(kNdlEx, recall(sel_fold));
            if (o.pq) acc.add(kNdlPq, recall(sel_pq));
          }
        }
      }
    }
    char extra[32];
    std::snprintf(extra, sizeof extra, " %7.3f", gen_s);
    acc.print(std::to_string(l).c_str(), extra);
    std::fflush(stdout);
    all.merge(acc);
  }
  all.print("mean", "");
  std::printf("total %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}
