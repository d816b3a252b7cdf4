// quality.hpp — retrieval quality against exact attention, the metrics kvret-eval and the demo
// report. One object per (layer, decode step): it computes exact attention of every query head over every token
// once, then scores any number of selections (index kinds, budgets) against it.
//
//   token recall@B  per KV head: |selected ∩ exact top-B| / B, where the exact top-B ranks the middle tokens by the
//                   group's folded score — the fold kvret selects by (default: the sum over the KV group's query
//                   heads of each head's softmax probability over the middle tokens; or the max logit) — so an exact
//                   retriever scores 1.0. Scores within a relative 1e-4 of the B-th best count as ties (f32
//                   round-off in the library's scoring). An empty selection (streaming) scores 0.
//   mass recall     per query head: the exact softmax mass (over all tokens) that falls in the working set
//                   (sink + selected + local).
//   output error    per query head: ||o_ws - o_full|| / ||o_full||, o_full exact attention over every token, o_ws
//                   attention over the working set only (computed here from the exact logits restricted to it, or
//                   given, e.g. from kvret_attend).
//
// Plain arrays in; nothing of kvret is needed (link kvret_quality alone).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvret::quality {

enum class Fold { kSumProb, kMaxLogit };

/// One layer at one decode step. Keys and values are token-major, as kvret takes them: row t of KV head h at
/// (t * n_kv_heads + h) * head_dim.
struct StepInput {
  const float* q = nullptr;  ///< [n_q_heads, head_dim]
  const float* k = nullptr;  ///< [length, n_kv_heads, head_dim]
  const float* v = nullptr;  ///< [length, n_kv_heads, head_dim]
  int64_t length = 0;        ///< tokens attended (sink + middle + local)
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int64_t mid_begin = 0;  ///< the middle is [mid_begin, mid_end); sink before, local after
  int64_t mid_end = 0;
  float scale = 0.0f;  ///< logit scale; <= 0 means 1/sqrt(head_dim)
  Fold fold = Fold::kSumProb;
};

struct StepsInput;

class ExactAttention {
 public:
  /// Computes every query head's softmax over all tokens, its output, and each group's folded middle score.
  /// n_threads <= 0: OpenMP's default.
  explicit ExactAttention(const StepInput& in, int n_threads = 0);

  int n_q_heads() const noexcept { return n_q_; }
  int n_kv_heads() const noexcept { return n_kv_; }
  int head_dim() const noexcept { return head_dim_; }
  int64_t length() const noexcept { return length_; }
  int64_t mid_begin() const noexcept { return mid_begin_; }
  int64_t mid_end() const noexcept { return mid_end_; }

  /// Token recall@count of one KV head's selection (absolute middle positions, any order, no duplicates).
  double token_recall(int kv_head, const int32_t* selected, int64_t count) const;
  /// Exact attention mass of query head q_head that falls in sink + selected + local.
  double mass_recall(int q_head, const int32_t* selected, int64_t count) const;
  /// Output error of attention over sink + selected + local (computed here).
  double output_error(int q_head, const int32_t* selected, int64_t count) const;
  /// Output error of a given working-set output o_ws [head_dim].
  double output_error(int q_head, const float* o_ws) const;

  /// Exact probabilities of query head h over all tokens [length].
  const float* probabilities(int q_head) const noexcept { return &prob_[static_cast<size_t>(q_head) * length_]; }
  /// The folded score of KV head g over the middle tokens [mid_end - mid_begin].
  const float* folded(int kv_head) const noexcept {
    return &fold_[static_cast<size_t>(kv_head) * (mid_end_ - mid_begin_)];
  }
  /// Exact output of query head h [head_dim].
  const double* output(int q_head) const noexcept { return &out_[static_cast<size_t>(q_head) * head_dim_]; }

 private:
  friend std::vector<ExactAttention> exact_attention_steps(const StepsInput& in, int n_threads);
  /// Sized for one step of exact_attention_steps, which fills it.
  ExactAttention(const float* v, int64_t length, int64_t mid_begin, int64_t mid_end, int n_q, int n_kv, int head_dim,
                 Fold fold);

  const float* v_;
  int64_t length_, mid_begin_, mid_end_;
  int n_q_, n_kv_, head_dim_, group_;
  std::vector<float> prob_;  ///< [n_q, length]
  std::vector<double> out_;  ///< [n_q, head_dim]
  std::vector<float> fold_;  ///< [n_kv, middle]
};

/// Several decode steps of one layer over the same keys and values: step s attends with its own query to the first
/// lengths[s] tokens, its middle being [min(n_sink, len), max(that, len - n_local)). Computed together: every key
/// and value row is read once for all steps and query heads of a KV group (kvret-demo scores 16 steps of a 32k
/// context this way). Each step's ExactAttention is what StepInput would give, up to f32 rounding of the outputs.
struct StepsInput {
  const float* q = nullptr;  ///< [steps, n_q_heads, head_dim]
  const float* k = nullptr;  ///< [max length, n_kv_heads, head_dim]
  const float* v = nullptr;  ///< [max length, n_kv_heads, head_dim]
  std::vector<int64_t> lengths;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int64_t n_sink = 0;
  int64_t n_local = 0;
  float scale = 0.0f;  ///< logit scale; <= 0 means 1/sqrt(head_dim)
  Fold fold = Fold::kSumProb;
};

/// One ExactAttention per step of `in`. n_threads <= 0: OpenMP's default.
std::vector<ExactAttention> exact_attention_steps(const StepsInput& in, int n_threads = 0);

/// Running means of the three metrics.
struct Totals {
  double token_recall_sum = 0, mass_recall_sum = 0, output_error_sum = 0;
  int64_t groups = 0, heads = 0;
  double token_recall() const noexcept { return groups ? token_recall_sum / static_cast<double>(groups) : 0.0; }
  double mass_recall() const noexcept { return heads ? mass_recall_sum / static_cast<double>(heads) : 0.0; }
  double output_error() const noexcept { return heads ? output_error_sum / static_cast<double>(heads) : 0.0; }
};

/// Scores one step's selection — selected[g] holds `count` positions of KV head g — for every KV head and query
/// head, adding to totals. o_ws ([n_q_heads, head_dim]) may be given (e.g. kvret_attend's output); NULL computes it.
void score_selection(const ExactAttention& exact, const int32_t* const* selected, int64_t count, Totals& totals,
                     const float* o_ws = nullptr);

}  // namespace kvret::quality
