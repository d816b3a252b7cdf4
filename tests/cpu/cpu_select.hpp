#pragma once
// For the suites that hold the CPU retrievers against models built from the kernels' math headers (ExactMath,
// PageMath, ClusterMath, QuantMath, PqMath): one select of a CPU retriever (every KV head's positions and scores, a
// `budget` of each) and the header's GQA fold of a group's logits.
#include <cmath>
#include <cstdint>
#include <vector>

#include "index/retriever.hpp"
#include "math/page_math.h"
#include "store/host_kv_store.hpp"

namespace kvret::test {

struct HeadsSelected {
  SelectRequest req;  ///< the request made (req.q points into the caller's q)
  std::vector<std::vector<int32_t>> rows;
  std::vector<std::vector<float>> scores;
  int64_t count = 0;  ///< what select returned
};

/// `index`'s select over the middle [begin, end) of `store` (kv_heads heads of head_dim d) for q [kv_heads * group,
/// d]: scale 1 / sqrt(d), n_threads 2.
template <class Index>
HeadsSelected select_heads(Index& index, const HostKvStore& store, const std::vector<float>& q, int kv_heads, int d,
                           int group, int64_t begin, int64_t end, int64_t budget, kvret_gqa_fold fold) {
  HeadsSelected s;
  s.req.q = q.data();
  s.req.n_q_heads = kv_heads * group;
  s.req.group = group;
  s.req.scale = 1.0f / std::sqrt(static_cast<float>(d));
  s.req.mid_begin = begin;
  s.req.mid_end = end;
  s.req.budget = budget;
  s.req.fold = fold;
  s.req.n_threads = 2;
  s.rows.assign(static_cast<size_t>(kv_heads), std::vector<int32_t>(static_cast<size_t>(budget)));
  s.scores.assign(static_cast<size_t>(kv_heads), std::vector<float>(static_cast<size_t>(budget)));
  std::vector<int32_t*> row_ptrs;
  std::vector<float*> score_ptrs;
  for (size_t h = 0; h < s.rows.size(); ++h) {
    row_ptrs.push_back(s.rows[h].data());
    score_ptrs.push_back(s.scores[h].data());
  }
  s.count = index.select(store, s.req, row_ptrs.data(), score_ptrs.data());
  return s;
}

/// A header's fold of logits [group, n] over the group: max_step(acc, logit) under MAX_LOGIT, else
/// sum_step(acc, logit, terms) with each head's softmax terms, terms(a copy of that head's n logits).
template <class Terms, class MaxStep, class SumStep>
std::vector<float> header_fold(const std::vector<float>& logits, int group, int64_t n, kvret_gqa_fold fold, Terms terms,
                               MaxStep max_step, SumStep sum_step) {
  std::vector<float> out(static_cast<size_t>(n), fold == KVRET_FOLD_MAX_LOGIT ? kvret::cuda::math::neg_inf() : 0.0f);
  for (int g = 0; g < group; ++g) {
    std::vector<float> l(logits.begin() + g * n, logits.begin() + (g + 1) * n);
    if (fold == KVRET_FOLD_MAX_LOGIT) {
      for (int64_t u = 0; u < n; ++u)
        out[static_cast<size_t>(u)] = max_step(out[static_cast<size_t>(u)], l[static_cast<size_t>(u)]);
      continue;
    }
    const auto s = terms(l.data());
    for (int64_t u = 0; u < n; ++u)
      out[static_cast<size_t>(u)] = sum_step(out[static_cast<size_t>(u)], l[static_cast<size_t>(u)], s);
  }
  return out;
}

/// The fold of kernels/math/page_math.h (page_max_step, page_sum_prob_step) with softmax terms from `terms`.
template <class Terms>
std::vector<float> header_fold(const std::vector<float>& logits, int group, int64_t n, kvret_gqa_fold fold,
                               Terms terms) {
  namespace m = kvret::cuda::math;
  return header_fold(
      logits, group, n, fold, terms, [](float acc, float l) { return m::page_max_step(acc, l); },
      [](float acc, float l, const m::PageSoftmax& s) { return m::page_sum_prob_step(acc, l, s); });
}

}  // namespace kvret::test
