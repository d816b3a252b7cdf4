// workload.cpp — see workload.hpp for what is modelled.
//
// Construction (per layer l, KV head g; D = head_dim, P = D/2 RoPE pairs, pair i = dims (i, i+P) at frequency
// theta^(-2i/D)). Dedicated pairs at the low-frequency end: the sink pair P-1, then max(2, P/16) needle pairs below
// it, and the outlier channels among the ~0.15 P pairs below those.
//
// Paragraphs: a paragraph begins at token t when t is a multiple of 4099 (a forced boundary, so that finding the
// start of a paragraph is a bounded walk back) or, independently per token, with the probability that makes the mean
// paragraph length topic_run_tokens (1/132 at 128): lengths are about geometric at token granularity, and boundaries
// fall on every residue modulo a page size alike (they used to fall on 16-token blocks, which suited 16-token pages).
// A paragraph's topic is floor(n_topics u^topic_zipf), u a hash of its first position.
//
//   key (pre-RoPE) of a token t in paragraph topic z:
//       k = c_g + o_l + key_topic_norm * T[g][z] + n_t (+ 16 * N[g][n] inside needle span n)
//     c_g  recency constant: random angle, magnitude 1.5 per pair in the high-frequency pairs [0, 3P/8);
//     o_l  outlier offsets: n_outlier_channels dims (one layer's heads share them), +-outlier_magnitude (0.7..1.3x),
//          with a per-token jitter of 1;
//     T    unit topic directions drawn with the semantic profile: weight^2 = sigmoid((i - semantic_center P) /
//          (0.05 P)) over pairs i, i.e. for D = 128 mostly pairs 45..58, whose wavelengths (2 pi / f >= 63k tokens)
//          keep a topic recognisable across a 32k context, as in real models;
//     N    unit needle directions in the needle pairs (no topic or noise energy there but key_noise): ordinary
//          queries do not hit needles by accident, retrieval heads do;
//     n_t  noise: key_noise per dim everywhere plus key_semantic_noise (as a norm) spread with the semantic profile.
//   sink tokens (t < n_sinks): k = c_g + o_l + 16 U[g] + 0.3 n_t, U in the sink pair at a random angle.
//   value: value_topic_norm * V[g][z] + N(0,1) per dim (+ 8 V_N[g][n] in needle spans); sinks: 0.2 N(0,1).
//
//   query (pre-RoPE) of head h (group g) at step s, position p = n_prefill + s:
//       q = lambda_T(h) sum_z y_z(h,s) T[g][z] + lambda_U(h,p) U[g] + alpha(h) c_g + 0.25 sign(o_l) + r(h,s)
//           (+ lambda_N N[g][needle(h)] for retrieval heads)
//     y(h,s) = sqrt(gqa_correlation) G(g,s) + sqrt(1 - gqa_correlation) P(h,s), with G (per KV group) and P (per
//     head) AR(1) processes of coefficient query_correlation and N(0,1) marginals, plus current_topic_boost on the
//     topic of position p (the paragraph being written);
//     lambda_T(h) = topic_logit_h sqrt(D) / key_topic_norm: one unit of affinity is topic_logit_h logits
//     (topic_logit_h = topic_logit * exp(0.25 N(0,1)) per head);
//     alpha(h) makes the recency kernel sum_i |c_i|^2 cos(delta f_i) / sqrt(D) peak at recency_logit_h (0.6..1.4 x
//     recency_logit) at distance 0; it falls to ~1/8 by distance 64 and to noise by ~200;
//     lambda_U(h,p) puts the sink logit at log(p) + (the head's estimated middle log-mean-exp) + log-odds of the
//     head's sink share - log(n_sinks); the head's sink share is sink_mass spread by N(0,1) in log-odds, so sink
//     attention keeps its share as the context grows;
//     lambda_N = needle_logit sqrt(D) / 16: the needle's logit is needle_logit above what its topic gives;
//     r(h,s) is an AR(1) noise of 0.2 per dim.
//
// Calibration (kvret-workload-stats --pq: exact attention over all tokens; n_sink = 16 and n_local = 64, the
// library's defaults; budget 10% of the context) at the defaults (32 layers, 32 q / 8 kv heads, D = 128, 32768
// prefill, 16 decode steps, seed 1), averaged over layers, steps and query heads:
//     sinks 0.32, local 0.14: sink + local 0.46 (per layer 0.34..0.58);
//     sink + local + the top 10% of the middle by the head's own logit: 0.976 (per layer 0.960..0.985);
//     the same with the KV group's folded top 10% (sum of softmax probabilities, kvret's default fold): 0.965
//     (per layer 0.946..0.980);
//     a product quantizer (2 sub-spaces x 64 centroids, Forgy k-means, 20 iterations on 8192 sampled keys) selecting
//     10% with the same fold: mass 0.914 (per layer 0.84..0.95), token recall against the folded exact top 10%: 0.70;
//     retrieval heads (1/32 of the heads) put 0.50 of their mass on their needle; the folded exact top 10% holds
//     0.86 of the needle tokens, the PQ selection 0.09 (needles are what PQ codes lose).
// (Measured with paragraphs that begin at any token. With the former 16-token-aligned paragraphs, whose mean length
// came out at 117 rather than 128, they were: sinks 0.33, local 0.16, sink + local 0.48 (per layer 0.32..0.68), PQ mass
// per layer 0.87..0.95, PQ token recall 0.69, needle mass 0.49, needle tokens 0.85 exact / 0.06 PQ, the rest the same
// within 0.002.)
// The knobs move them as follows: topic_logit sharpens attention (top-10% mass up, sink+local down); the noise
// knobs (key_semantic_noise, key_noise) and recency_logit add token-level variance that a PQ code cannot see (PQ mass
// down, exact top-10% mass up); outlier_magnitude costs PQ centroids; gqa_correlation sets how much the GQA fold loses.
// Regenerate the figures with `kvret-workload-stats --pq` after changing anything here.
#include "workload.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace kvret::workload {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;

inline uint64_t mix64(uint64_t x) {
  x += kGolden;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// A stream key from a tuple of integers.
inline uint64_t hkey(uint64_t a, uint64_t b, uint64_t c = 0, uint64_t d = 0, uint64_t e = 0) {
  uint64_t h = mix64(a ^ 0x6b7672657457ULL);
  h = mix64(h ^ b);
  h = mix64(h ^ c);
  h = mix64(h ^ d);
  return mix64(h ^ e);
}

/// Uniform in [0, 1) from the top 24 bits.
inline float unit(uint64_t h) { return static_cast<float>(h >> 40) * (1.0f / 16777216.0f); }

/// Two approximately standard normal numbers from one hash (Irwin-Hall sum of four 8-bit uniforms each).
inline void normal2(uint64_t h, float& a, float& b) {
  const uint32_t lo = static_cast<uint32_t>(h);
  const uint32_t hi = static_cast<uint32_t>(h >> 32);
  const int sa = static_cast<int>((lo & 255u) + ((lo >> 8) & 255u) + ((lo >> 16) & 255u) + (lo >> 24));
  const int sb = static_cast<int>((hi & 255u) + ((hi >> 8) & 255u) + ((hi >> 16) & 255u) + (hi >> 24));
  constexpr float kScale = 1.0f / 147.8006f;  // sqrt(4 * (256^2 - 1) / 12)
  a = static_cast<float>(sa - 510) * kScale;
  b = static_cast<float>(sb - 510) * kScale;
}

/// One standard normal number (for parameters, where cost does not matter).
inline float normal(uint64_t h) {
  float a = 0.f;
  float b = 0.f;
  normal2(h, a, b);
  // combine the two to get a smoother distribution (still unit variance)
  return (a + b) * 0.70710678f;
}

// stream tags
enum : uint64_t {
  kTagTopicK = 1,
  kTagTopicV,
  kTagNeedleK,
  kTagNeedleV,
  kTagSink,
  kTagRecency,
  kTagOutlier,
  kTagNoiseK,
  kTagNoiseV,
  kTagPara,
  kTagParaTopic,
  kTagNeedlePos,
  kTagHead,
  kTagQGroup,
  kTagQHead,
  kTagQNoise,
  kTagLayer,
};

// Paragraphs: a boundary at each token with probability p_para, plus a forced one at every multiple of kParaAnchor
// (which bounds the walk back to a paragraph's start). kParaAnchor is odd (a prime), so the forced boundaries do not
// line up with any power-of-two page either; p_para is set so that the mean paragraph length is topic_run_tokens.
constexpr int64_t kParaAnchor = 4099;
constexpr float kSinkKeyNorm = 16.f;
constexpr float kNeedleKeyNorm = 16.f;
constexpr float kNeedleValueNorm = 8.f;
constexpr float kRecencyMagnitude = 1.5f;  // per pair
constexpr float kQueryNoise = 0.2f;
constexpr float kQueryOutlier = 0.25f;
// Estimated log-mean-exp of a head's middle logits, as a function of its topic logit scale (measured; used only to
// place the sink logit so that the sink share comes out near the head's target).
inline float middle_lme(float topic_logit) { return 1.9f * topic_logit + 0.5f; }

}  // namespace

struct HeadKV {                 // per (layer, KV head)
  std::vector<float> topic_k;   // [n_topics, D] unit
  std::vector<float> topic_v;   // [n_topics, D] unit
  std::vector<float> needle_k;  // [n_needles, D] unit
  std::vector<float> needle_v;  // [n_needles, D] unit
  std::vector<float> sink;      // [D] unit
  std::vector<float> mean_k;    // [D] recency constant + outlier offsets
  std::vector<float> noise_k;   // [D] per-dim noise std
  std::vector<float> recency;   // [D] the recency constant alone
  uint64_t key_noise_stream = 0;
  uint64_t value_noise_stream = 0;
};

struct HeadQ {  // per (layer, query head)
  float topic_logit = 0.f;
  float recency_logit = 0.f;
  float sink_logodds = 0.f;
  int needle = -1;
};

struct LayerParams {
  std::vector<HeadKV> kv;
  std::vector<HeadQ> q;
  std::vector<int> outlier_dims;
};

struct Workload::Impl {
  Config cfg;
  int D = 0;
  int P = 0;
  std::vector<double> inv_freq;    // [P]
  std::vector<float> sem_profile;  // [D], sum of squares 1
  std::vector<LayerParams> layers;
  std::vector<int64_t> needles;  // first positions, ascending
  int needle_pairs = 2;          // RoPE pairs reserved for the needle directions
  uint64_t para_stream = 0;      // paragraph boundaries: hash stream
  float p_para = 1.f;            // paragraph boundaries: probability per token (besides the forced ones)

  /// Whether a paragraph begins at token `t`.
  bool para_begins(int64_t t) const {
    return t % kParaAnchor == 0 || unit(mix64(para_stream ^ (static_cast<uint64_t>(t) * kGolden))) < p_para;
  }

  /// First token of the paragraph holding `pos`.
  int64_t para_start(int64_t pos) const {
    while (!para_begins(pos)) --pos;
    return pos;
  }

  /// The topic of the paragraph that begins at `start`.
  int para_topic(int64_t start) const {
    const float u = unit(hkey(cfg.seed, kTagParaTopic, static_cast<uint64_t>(start)));
    const int z = static_cast<int>(static_cast<float>(cfg.n_topics) * std::pow(u, cfg.topic_zipf));
    return std::min(z, cfg.n_topics - 1);
  }

  int topic_of(int64_t pos) const { return para_topic(para_start(pos)); }

  int needle_at(int64_t pos) const {
    auto it = std::upper_bound(needles.begin(), needles.end(), pos);
    if (it == needles.begin()) return -1;
    --it;
    return pos < *it + cfg.needle_tokens ? static_cast<int>(it - needles.begin()) : -1;
  }

  /// A random unit vector with per-dim weights `w` (zero weight = no component).
  void random_dir(uint64_t stream, const std::vector<float>& w, float* out) const {
    double n2 = 0.0;
    for (int d = 0; d < D; ++d) {
      out[d] = w[d] * normal(mix64(stream + static_cast<uint64_t>(d)));
      n2 += static_cast<double>(out[d]) * out[d];
    }
    const float inv = n2 > 0 ? static_cast<float>(1.0 / std::sqrt(n2)) : 0.f;
    for (int d = 0; d < D; ++d) out[d] *= inv;
  }

  void build() {
    const Config& c = cfg;
    if (c.head_dim < 8 || c.head_dim % 2 != 0) throw std::invalid_argument("workload: head_dim must be even and >= 8");
    if (c.n_layers < 1 || c.n_kv_heads < 1 || c.n_q_heads < c.n_kv_heads || c.n_q_heads % c.n_kv_heads != 0) {
      throw std::invalid_argument("workload: bad head counts");
    }
    if (c.n_topics < 1 || c.n_sinks < 0 || c.n_needles < 0 || c.needle_tokens < 1 || c.topic_run_tokens < 1 ||
        c.n_prefill < 0 || c.n_outlier_channels < 0) {
      throw std::invalid_argument("workload: bad structure parameters");
    }
    D = c.head_dim;
    P = D / 2;
    inv_freq.resize(P);
    for (int i = 0; i < P; ++i) inv_freq[i] = std::pow(static_cast<double>(c.rope_theta), -2.0 * i / D);

    // dedicated pairs: the sink pair (P-1) and the needle pairs just below it; the outlier channels below those
    needle_pairs = std::max(2, P / 16);
    const int needle_lo = P - 1 - needle_pairs;
    // semantic profile over pairs: sigmoid centred at semantic_center * P, width 0.05 P; dedicated pairs excluded
    std::vector<float> pair_w(P);
    for (int i = 0; i < P; ++i) {
      const double x = (i - static_cast<double>(cfg.semantic_center) * P) / (0.05 * P);
      pair_w[i] = static_cast<float>(std::sqrt(1.0 / (1.0 + std::exp(-x))));
    }
    for (int i = needle_lo; i < P; ++i) pair_w[i] = 0.f;

    // paragraphs: one forced boundary per kParaAnchor tokens and (kParaAnchor - 1) p_para random ones on average,
    // so kParaAnchor / topic_run_tokens in all (topic_run_tokens >= kParaAnchor gives paragraphs of kParaAnchor)
    para_stream = hkey(c.seed, kTagPara);
    const double per_anchor = static_cast<double>(kParaAnchor) / c.topic_run_tokens;
    p_para = static_cast<float>(std::clamp((per_anchor - 1.0) / static_cast<double>(kParaAnchor - 1), 0.0, 1.0));

    // needle positions: evenly spread over [5%, 85%) of the prefill with jitter
    needles.clear();
    const int64_t lo = std::max<int64_t>(c.n_sinks + 16, c.n_prefill / 20);
    const int64_t hi = c.n_prefill * 85 / 100;
    if (c.n_needles > 0 && hi - lo >= static_cast<int64_t>(c.n_needles) * c.needle_tokens * 2) {
      const int64_t slot = (hi - lo) / c.n_needles;
      for (int n = 0; n < c.n_needles; ++n) {
        const float u = unit(hkey(c.seed, kTagNeedlePos, static_cast<uint64_t>(n)));
        needles.push_back(lo + n * slot + static_cast<int64_t>(u * static_cast<float>(slot - c.needle_tokens)));
      }
    }

    const int group = c.n_q_heads / c.n_kv_heads;
    layers.resize(c.n_layers);
    for (int l = 0; l < c.n_layers; ++l) {
      LayerParams& L = layers[l];
      const auto ul = static_cast<uint64_t>(l);
      // outlier dims: distinct, among the ~0.15 P pairs below the needle pairs, either half (low frequency: they
      // rotate slowly and stay large channels)
      L.outlier_dims.clear();
      const int lo_pair = std::max(0, needle_lo - std::max(2, static_cast<int>(0.15 * P)));
      const int n_cand = std::max(1, (needle_lo - lo_pair) * 2);
      for (int o = 0, tries = 0; o < c.n_outlier_channels && tries < 1000; ++tries) {
        const int k = static_cast<int>(unit(hkey(c.seed, kTagOutlier, ul, static_cast<uint64_t>(tries))) *
                                       static_cast<float>(n_cand));
        const int pair = lo_pair + k / 2;
        const int dim = pair + (k % 2) * P;
        if (pair >= needle_lo || std::find(L.outlier_dims.begin(), L.outlier_dims.end(), dim) != L.outlier_dims.end()) {
          continue;
        }
        L.outlier_dims.push_back(dim);
        ++o;
      }
      std::vector<float> sem_w(D);
      for (int d = 0; d < D; ++d) sem_w[d] = pair_w[d % P];
      for (int d : L.outlier_dims) sem_w[d] = 0.f;
      double s2 = 0.0;
      for (float w : sem_w) s2 += static_cast<double>(w) * w;
      std::vector<float> sem_unit(D);  // profile normalized to sum of squares 1
      for (int d = 0; d < D; ++d) sem_unit[d] = static_cast<float>(sem_w[d] / std::sqrt(s2));
      const std::vector<float> ones(D, 1.f);
      std::vector<float> needle_w(D, 0.f);  // needles: their own pairs, which topics and noise leave alone
      for (int d = 0; d < D; ++d) needle_w[d] = (d % P >= needle_lo && d % P < P - 1) ? 1.f : 0.f;

      L.kv.resize(c.n_kv_heads);
      for (int g = 0; g < c.n_kv_heads; ++g) {
        HeadKV& H = L.kv[g];
        const auto ug = static_cast<uint64_t>(g);
        H.topic_k.assign(static_cast<size_t>(c.n_topics) * D, 0.f);
        H.topic_v.assign(static_cast<size_t>(c.n_topics) * D, 0.f);
        for (int z = 0; z < c.n_topics; ++z) {
          random_dir(hkey(c.seed, kTagTopicK, ul, ug, static_cast<uint64_t>(z)), sem_w, &H.topic_k[z * D]);
          random_dir(hkey(c.seed, kTagTopicV, ul, ug, static_cast<uint64_t>(z)), ones, &H.topic_v[z * D]);
        }
        H.needle_k.assign(static_cast<size_t>(c.n_needles) * D, 0.f);
        H.needle_v.assign(static_cast<size_t>(c.n_needles) * D, 0.f);
        for (int n = 0; n < c.n_needles; ++n) {
          // needle directions live in their own low-frequency pairs, away from the topic directions, so that
          // ordinary queries do not hit needles by accident: only retrieval heads look for them
          random_dir(hkey(c.seed, kTagNeedleK, ul, ug, static_cast<uint64_t>(n)), needle_w, &H.needle_k[n * D]);
          random_dir(hkey(c.seed, kTagNeedleV, ul, ug, static_cast<uint64_t>(n)), ones, &H.needle_v[n * D]);
        }
        // sink direction: the lowest-frequency pair, random angle
        H.sink.assign(D, 0.f);
        const float phi = 6.2831853f * unit(hkey(c.seed, kTagSink, ul, ug));
        H.sink[P - 1] = std::cos(phi);
        H.sink[D - 1] = std::sin(phi);
        // recency constant in the high-frequency pairs
        H.recency.assign(D, 0.f);
        const int n_rec = std::max(1, 3 * P / 8);
        for (int i = 0; i < n_rec; ++i) {
          const float a = 6.2831853f * unit(hkey(c.seed, kTagRecency, ul, ug, static_cast<uint64_t>(i)));
          H.recency[i] = kRecencyMagnitude * std::cos(a);
          H.recency[i + P] = kRecencyMagnitude * std::sin(a);
        }
        H.mean_k = H.recency;
        for (size_t o = 0; o < L.outlier_dims.size(); ++o) {
          const uint64_t h = hkey(c.seed, kTagOutlier, ul, ug, 1000 + o);
          const float sign = (h & 1) ? 1.f : -1.f;
          H.mean_k[L.outlier_dims[o]] = sign * c.outlier_magnitude * (0.7f + 0.6f * unit(h));
        }
        H.noise_k.resize(D);
        for (int d = 0; d < D; ++d) {
          const double s = c.key_semantic_noise * sem_unit[d];
          H.noise_k[d] = static_cast<float>(std::sqrt(double(c.key_noise) * c.key_noise + s * s));
        }
        for (int d : L.outlier_dims) H.noise_k[d] = 1.0f;
        H.key_noise_stream = hkey(c.seed, kTagNoiseK, ul, ug);
        H.value_noise_stream = hkey(c.seed, kTagNoiseV, ul, ug);
      }

      L.q.resize(c.n_q_heads);
      for (int h = 0; h < c.n_q_heads; ++h) {
        HeadQ& Q = L.q[h];
        const auto uh = static_cast<uint64_t>(h);
        Q.topic_logit = c.topic_logit * std::exp(0.25f * normal(hkey(c.seed, kTagHead, ul, uh, 1)));
        Q.recency_logit = c.recency_logit * (0.6f + 0.8f * unit(hkey(c.seed, kTagHead, ul, uh, 2)));
        const float sm = std::clamp(c.sink_mass, 1e-4f, 1.f - 1e-4f);
        Q.sink_logodds = std::log(sm / (1.f - sm)) + normal(hkey(c.seed, kTagHead, ul, uh, 3));
        Q.needle = -1;
        if (!needles.empty() && unit(hkey(c.seed, kTagHead, ul, uh, 4)) < c.retrieval_fraction) {
          Q.needle = static_cast<int>(hkey(c.seed, kTagHead, ul, uh, 5) % static_cast<uint64_t>(needles.size()));
        }
      }
      (void)group;
    }
  }

  void keys_values(int layer, int64_t begin, int64_t end, float* k, float* v) const {
    if (layer < 0 || layer >= cfg.n_layers) throw std::out_of_range("workload: layer out of range");
    if (begin < 0 || end < begin) throw std::out_of_range("workload: bad token range");
    const LayerParams& L = layers[layer];
    const int H = cfg.n_kv_heads;
    const int64_t n = end - begin;
    const float kt = cfg.key_topic_norm;
    const float vt = cfg.value_topic_norm;
#pragma omp parallel if (n >= 64)  // a few tokens (decode) are not worth waking the team
    {
      std::vector<float> cs(P), sn(P), pre(D);
      int64_t next_t = -1;  // this thread's tokens come in runs: the paragraph walk is done once per run
      int z = 0;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = begin + i;
        const auto ut = static_cast<uint64_t>(t);
        const bool sink = t < cfg.n_sinks;
        if (t != next_t) {
          z = topic_of(t);
        } else if (para_begins(t)) {
          z = para_topic(t);
        }
        next_t = t + 1;
        const int nd = sink ? -1 : needle_at(t);
        if (k) {
          for (int p = 0; p < P; ++p) {
            const double a = static_cast<double>(t) * inv_freq[p];
            cs[p] = static_cast<float>(std::cos(a));
            sn[p] = static_cast<float>(std::sin(a));
          }
        }
        for (int g = 0; g < H; ++g) {
          const HeadKV& hp = L.kv[g];
          if (k) {
            const uint64_t base = mix64(hp.key_noise_stream ^ (ut * kGolden));
            const float ns = sink ? 0.3f : 1.0f;
            for (int d = 0; d < D; d += 2) {
              float a = 0.f;
              float b = 0.f;
              normal2(mix64(base + static_cast<uint64_t>(d)), a, b);
              pre[d] = hp.mean_k[d] + ns * hp.noise_k[d] * a;
              pre[d + 1] = hp.mean_k[d + 1] + ns * hp.noise_k[d + 1] * b;
            }
            if (sink) {
              for (int d = 0; d < D; ++d) pre[d] += kSinkKeyNorm * hp.sink[d];
            } else {
              const float* tz = &hp.topic_k[static_cast<size_t>(z) * D];
              for (int d = 0; d < D; ++d) pre[d] += kt * tz[d];
              if (nd >= 0) {
                const float* nk = &hp.needle_k[static_cast<size_t>(nd) * D];
                for (int d = 0; d < D; ++d) pre[d] += kNeedleKeyNorm * nk[d];
              }
            }
            float* kr = k + (i * H + g) * D;
            for (int p = 0; p < P; ++p) {
              const float x = pre[p];
              const float y = pre[p + P];
              kr[p] = x * cs[p] - y * sn[p];
              kr[p + P] = y * cs[p] + x * sn[p];
            }
          }
          if (v) {
            const uint64_t base = mix64(hp.value_noise_stream ^ (ut * kGolden));
            float* vr = v + (i * H + g) * D;
            for (int d = 0; d < D; d += 2) {
              float a = 0.f;
              float b = 0.f;
              normal2(mix64(base + static_cast<uint64_t>(d)), a, b);
              vr[d] = a;
              vr[d + 1] = b;
            }
            if (sink) {
              for (int d = 0; d < D; ++d) vr[d] *= 0.2f;
            } else {
              const float* tz = &hp.topic_v[static_cast<size_t>(z) * D];
              for (int d = 0; d < D; ++d) vr[d] += vt * tz[d];
              if (nd >= 0) {
                const float* nv = &hp.needle_v[static_cast<size_t>(nd) * D];
                for (int d = 0; d < D; ++d) vr[d] += kNeedleValueNorm * nv[d];
              }
            }
          }
        }
      }
    }
  }

  void queries(int layer, int n_steps, float* q) const {
    if (layer < 0 || layer >= cfg.n_layers) throw std::out_of_range("workload: layer out of range");
    if (n_steps < 0) throw std::out_of_range("workload: negative n_steps");
    const LayerParams& L = layers[layer];
    const auto ul = static_cast<uint64_t>(layer);
    const int T = cfg.n_topics;
    const int HQ = cfg.n_q_heads;
    const int group = HQ / cfg.n_kv_heads;
    const float rho = std::clamp(cfg.query_correlation, 0.f, 1.f);
    const float innov = std::sqrt(1.f - rho * rho);
    const float wg = std::sqrt(std::clamp(cfg.gqa_correlation, 0.f, 1.f));
    const float wp = std::sqrt(1.f - wg * wg);
    const float sqrt_d = std::sqrt(static_cast<float>(D));
    std::vector<float> G(static_cast<size_t>(cfg.n_kv_heads) * T), Pv(static_cast<size_t>(HQ) * T);
    std::vector<float> R(static_cast<size_t>(HQ) * D);
    std::vector<float> y(T), pre(D);
    for (int s = 0; s < n_steps; ++s) {
      const auto us = static_cast<uint64_t>(s);
      const int64_t pos = cfg.n_prefill + s;
      const int zc = topic_of(pos);
      auto ar = [&](float& x, uint64_t h) {
        const float e = normal(h);
        x = s == 0 ? e : rho * x + innov * e;
      };
      for (int g = 0; g < cfg.n_kv_heads; ++g) {
        for (int z = 0; z < T; ++z) {
          ar(G[g * T + z], hkey(cfg.seed, kTagQGroup, ul, static_cast<uint64_t>(g), us * 65536 + z));
        }
      }
      for (int h = 0; h < HQ; ++h) {
        const auto uh = static_cast<uint64_t>(h);
        for (int z = 0; z < T; ++z) ar(Pv[h * T + z], hkey(cfg.seed, kTagQHead, ul, uh, us * 65536 + z));
        for (int d = 0; d < D; ++d) ar(R[h * D + d], hkey(cfg.seed, kTagQNoise, ul, uh, us * 65536 + d));
      }
      for (int h = 0; h < HQ; ++h) {
        const int g = h / group;
        const HeadQ& Q = L.q[h];
        const HeadKV& hp = L.kv[g];
        for (int z = 0; z < T; ++z) y[z] = wg * G[g * T + z] + wp * Pv[h * T + z];
        y[zc] += cfg.current_topic_boost;
        const float lt = Q.topic_logit * sqrt_d / cfg.key_topic_norm;
        for (int d = 0; d < D; ++d) pre[d] = kQueryNoise * R[h * D + d];
        for (int z = 0; z < T; ++z) {
          const float a = lt * y[z];
          const float* tz = &hp.topic_k[static_cast<size_t>(z) * D];
          for (int d = 0; d < D; ++d) pre[d] += a * tz[d];
        }
        // sink: logit = log(pos) + middle log-mean-exp + log-odds of the head's sink share - log(n_sinks)
        if (cfg.n_sinks > 0) {
          const float ls = std::log(static_cast<float>(std::max<int64_t>(pos, 1))) + middle_lme(Q.topic_logit) +
                           Q.sink_logodds - std::log(static_cast<float>(cfg.n_sinks));
          const float lu = ls * sqrt_d / kSinkKeyNorm;
          for (int d = 0; d < D; ++d) pre[d] += lu * hp.sink[d];
        }
        // recency: alpha * |c|^2 / sqrt(D) = recency_logit at distance 0
        double c2 = 0.0;
        for (int d = 0; d < D; ++d) c2 += static_cast<double>(hp.recency[d]) * hp.recency[d];
        const float alpha = c2 > 0 ? static_cast<float>(Q.recency_logit * sqrt_d / c2) : 0.f;
        for (int d = 0; d < D; ++d) pre[d] += alpha * hp.recency[d];
        for (size_t o = 0; o < L.outlier_dims.size(); ++o) {
          const int d = L.outlier_dims[o];
          pre[d] += hp.mean_k[d] > 0 ? kQueryOutlier : -kQueryOutlier;
        }
        if (Q.needle >= 0) {
          const float ln = cfg.needle_logit * sqrt_d / kNeedleKeyNorm;
          const float* nk = &hp.needle_k[static_cast<size_t>(Q.needle) * D];
          for (int d = 0; d < D; ++d) pre[d] += ln * nk[d];
        }
        float* qr = q + (static_cast<size_t>(s) * HQ + h) * D;
        for (int p = 0; p < P; ++p) {
          const double a = static_cast<double>(pos) * inv_freq[p];
          const auto c = static_cast<float>(std::cos(a));
          const auto sn = static_cast<float>(std::sin(a));
          qr[p] = pre[p] * c - pre[p + P] * sn;
          qr[p + P] = pre[p + P] * c + pre[p] * sn;
        }
      }
    }
  }
};

Workload::Workload(const Config& config) : impl_(std::make_unique<Impl>()) {
  impl_->cfg = config;
  impl_->build();
}
Workload::~Workload() = default;
Workload::Workload(Workload&&) noexcept = default;
Workload& Workload::operator=(Workload&&) noexcept = default;

const Config& Workload::config() const { return impl_->cfg; }

void Workload::keys_values(int layer, int64_t begin, int64_t end, float* k, float* v) const {
  impl_->keys_values(layer, begin, end, k, v);
}

void Workload::queries(int layer, int n_steps, float* q) const { impl_->queries(layer, n_steps, q); }

const std::vector<int64_t>& Workload::needle_positions() const { return impl_->needles; }

int Workload::needle_of_head(int layer, int q_head) const {
  if (layer < 0 || layer >= impl_->cfg.n_layers || q_head < 0 || q_head >= impl_->cfg.n_q_heads) return -1;
  return impl_->layers[layer].q[q_head].needle;
}

int Workload::topic_of(int64_t position) const { return impl_->topic_of(position); }

int64_t Workload::paragraph_start(int64_t position) const { return impl_->para_start(position); }

}  // namespace kvret::workload
