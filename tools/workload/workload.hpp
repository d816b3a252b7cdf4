// workload.hpp — a seeded, deterministic synthetic KV/query generator that behaves like a real long-context model.
//
// Used by kvret-demo, the library's tests and the benchmarks. It knows nothing of kvret.
//
// What it models (per layer, KV head and token; see workload.cpp for the construction and the calibration):
//  - RoPE (Llama/HF "rotate_half": dim i pairs with dim i + D/2 at frequency theta^(-2i/D)) applied to keys at
//    their position and to queries at theirs (decode step s sits at position n_prefill + s);
//  - topic structure: the text is a sequence of paragraphs (runs of ~topic_run_tokens tokens that begin at any
//    token, not on page-sized blocks), each about one of n_topics latent topics (mildly Zipf-distributed); a key is
//    its topic's direction plus noise. The semantic signal lives mostly in the low-frequency RoPE pairs, so it
//    survives long distances;
//  - a RoPE recency kernel: a constant key component in the high-frequency pairs that every query shares, so that
//    nearby tokens score higher (the source of local attention) and far ones get position-dependent noise;
//  - n_outlier_channels key channels of large magnitude (shared by the heads of a layer);
//  - attention sinks: the first n_sinks tokens have a key along a direction every query points to;
//  - needles: n_needles spans of needle_tokens tokens far back whose keys carry a needle direction; a fraction of
//    the query heads (retrieval heads) look for one needle each;
//  - queries: a latent topic affinity per head, AR(1) across decode steps (query_correlation), shared in part by
//    the heads of a KV group (gqa_correlation), plus a boost for the current paragraph's topic;
//  - values: topic direction plus noise; sinks have small values.
//
// Every random number is a counter-based hash of (seed, layer, head, position/step, index): generation is
// O(tokens), parallel (OpenMP) and any range of tokens is bit-identical to the same tokens of a larger range.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace kvret::workload {

struct Config {
  // geometry
  int n_layers = 32;
  int n_q_heads = 32;
  int n_kv_heads = 8;
  int head_dim = 128;  ///< even; calibrated at 128 (64 and 256 work, with somewhat different figures)
  int64_t n_prefill = 32768;
  int n_decode = 16;
  uint64_t seed = 1;

  float rope_theta = 500000.f;
  int n_topics = 32;
  int n_outlier_channels = 4;
  int n_sinks = 4;
  int n_needles = 8;
  float query_correlation = 0.9f;  ///< AR(1) coefficient of the query process across decode steps

  // --- structure (defaults are the calibrated ones; see workload.cpp) ---
  float gqa_correlation = 0.85f;  ///< share of a query head's latent topic affinity common to its KV group
  int topic_run_tokens = 128;     ///< mean paragraph length in tokens (lengths ~geometric, boundaries at any token)
  float topic_zipf = 1.5f;        ///< topic frequency skew: topic = floor(n_topics * u^topic_zipf), u uniform
  float semantic_center = 0.8f;   ///< centre of the semantic profile, as a fraction of the D/2 RoPE pairs
  int needle_tokens = 8;          ///< tokens per needle span
  float retrieval_fraction = 0.03125f;  ///< fraction of query heads that retrieve a needle

  // --- logit scales (in units of the attention logit q.k/sqrt(head_dim)) ---
  float topic_logit = 2.8f;          ///< logit per unit of topic affinity (affinities are ~N(0,1)); per-head spread
  float current_topic_boost = 2.0f;  ///< affinity added to the current paragraph's topic
  float recency_logit = 6.0f;        ///< peak logit of the RoPE recency kernel (distance 0); decays by ~100 tokens
  float sink_mass = 0.3f;            ///< target mean share of attention held by the sinks (varies per head)
  float needle_logit = 16.f;         ///< logit a retrieval head gives its needle on top of the needle's topic

  // --- magnitudes of the key/value components (pre-RoPE, per-dimension standard deviations or norms) ---
  float key_noise = 0.3f;          ///< i.i.d. noise per key dimension
  float key_topic_norm = 12.f;     ///< norm of the topic component of a key
  float key_semantic_noise = 2.f;  ///< norm of the within-topic noise in the semantic (low-frequency) dims
  float outlier_magnitude = 12.f;  ///< mean |value| of an outlier channel
  float value_topic_norm = 6.f;    ///< norm of the topic component of a value (noise is 1 per dim)
};

class Workload {
 public:
  explicit Workload(const Config& config);
  ~Workload();
  Workload(Workload&&) noexcept;
  Workload& operator=(Workload&&) noexcept;
  Workload(const Workload&) = delete;
  Workload& operator=(const Workload&) = delete;

  const Config& config() const;

  /// Keys and values of tokens [begin, end) of `layer`, f32, layout [end-begin, n_kv_heads, head_dim] (row-major).
  /// Keys are RoPE-rotated at their position. Deterministic in (config, layer, position): any range gives the same
  /// values as a larger range containing it. Positions past n_prefill continue the text (decode tokens).
  /// k or v may be null to skip it.
  void keys_values(int layer, int64_t begin, int64_t end, float* k, float* v) const;

  /// Queries of decode steps [0, n_steps) of `layer` (step s sits at position n_prefill + s), RoPE-rotated,
  /// layout [n_steps, n_q_heads, head_dim]. Deterministic; the first steps do not depend on n_steps.
  void queries(int layer, int n_steps, float* q) const;

  // --- introspection (for tests and reports) ---
  /// First positions of the needle spans (each needle_tokens long), ascending.
  const std::vector<int64_t>& needle_positions() const;
  /// The needle query head `q_head` of `layer` retrieves, or -1 when it is not a retrieval head.
  int needle_of_head(int layer, int q_head) const;
  /// The topic of the paragraph holding `position` (sinks included; -1 never).
  int topic_of(int64_t position) const;
  /// The first position of the paragraph holding `position` (<= position; 0 for the first paragraph).
  int64_t paragraph_start(int64_t position) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvret::workload
