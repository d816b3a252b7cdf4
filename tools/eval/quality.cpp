#include "quality.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

namespace kvret::quality {

namespace {

float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // independent partial sums: vectorizes without fast-math
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

constexpr float kTieTolerance = 1e-4f;

}  // namespace

ExactAttention::ExactAttention(const StepInput& in, int n_threads)
    : v_(in.v),
      length_(in.length),
      mid_begin_(std::clamp<int64_t>(in.mid_begin, 0, in.length)),
      mid_end_(std::clamp<int64_t>(in.mid_end, mid_begin_, in.length)),
      n_q_(in.n_q_heads),
      n_kv_(in.n_kv_heads),
      head_dim_(in.head_dim),
      group_(in.n_q_heads / in.n_kv_heads),
      prob_(static_cast<size_t>(in.n_q_heads) * in.length),
      out_(static_cast<size_t>(in.n_q_heads) * in.head_dim, 0.0),
      fold_(static_cast<size_t>(in.n_kv_heads) * (mid_end_ - mid_begin_),
            in.fold == Fold::kMaxLogit ? -std::numeric_limits<float>::infinity() : 0.0f) {
  const float scale = in.scale > 0 ? in.scale : 1.0f / std::sqrt(static_cast<float>(in.head_dim));
  const int64_t len = length_, middle = mid_end_ - mid_begin_;
  const int d = head_dim_, hk = n_kv_;
  const int threads = n_threads > 0 ? n_threads : 0;
  // one KV group per task: its query heads add into the group's fold without synchronization
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads != 1)
  for (int g = 0; g < hk; ++g) {
    std::vector<double> acc(static_cast<size_t>(d));
    for (int h = g * group_; h < (g + 1) * group_; ++h) {
      const float* q = in.q + static_cast<size_t>(h) * d;
      float* p = &prob_[static_cast<size_t>(h) * len];
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < len; ++j) {
        p[j] = scale * dot(q, in.k + (static_cast<size_t>(j) * hk + g) * d, d);
        mx = std::max(mx, p[j]);
      }
      float* f = &fold_[static_cast<size_t>(g) * middle];
      if (in.fold == Fold::kMaxLogit)
        for (int64_t j = 0; j < middle; ++j) f[j] = std::max(f[j], p[mid_begin_ + j]);
      double z = 0;
      for (int64_t j = 0; j < len; ++j) z += (p[j] = std::exp(p[j] - mx));
      const auto inv = static_cast<float>(1.0 / z);
      std::fill(acc.begin(), acc.end(), 0.0);
      double mid_z = 0;
      for (int64_t j = 0; j < len; ++j) {
        p[j] *= inv;
        const float* vr = in.v + (static_cast<size_t>(j) * hk + g) * d;
        for (int i = 0; i < d; ++i) acc[static_cast<size_t>(i)] += static_cast<double>(p[j]) * vr[i];
        if (j >= mid_begin_ && j < mid_end_) mid_z += p[j];
      }
      std::copy(acc.begin(), acc.end(), out_.begin() + static_cast<int64_t>(h) * d);
      // SUM_PROB: the head's softmax over the middle tokens only, summed over the group
      if (in.fold == Fold::kSumProb && mid_z > 0) {
        const auto mi = static_cast<float>(1.0 / mid_z);
        for (int64_t j = 0; j < middle; ++j) f[j] += p[mid_begin_ + j] * mi;
      }
    }
  }
}

double ExactAttention::token_recall(int kv_head, const int32_t* selected, int64_t count) const {
  const int64_t middle = mid_end_ - mid_begin_;
  if (count <= 0 || middle <= 0) return 0.0;
  count = std::min(count, middle);
  const float* f = folded(kv_head);
  std::vector<float> sorted(f, f + middle);
  std::nth_element(sorted.begin(), sorted.begin() + (count - 1), sorted.end(), std::greater<float>());
  const float kth = sorted[static_cast<size_t>(count - 1)];
  const float threshold = kth - kTieTolerance * std::abs(kth);
  int64_t hit = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t t = selected[i] - mid_begin_;
    if (t >= 0 && t < middle && f[t] >= threshold) ++hit;
  }
  return static_cast<double>(std::min(hit, count)) / static_cast<double>(count);
}

double ExactAttention::mass_recall(int q_head, const int32_t* selected, int64_t count) const {
  const float* p = probabilities(q_head);
  double mass = 0;
  for (int64_t j = 0; j < mid_begin_; ++j) mass += p[j];
  for (int64_t j = mid_end_; j < length_; ++j) mass += p[j];
  for (int64_t i = 0; i < count; ++i) mass += p[selected[i]];
  return mass;
}

double ExactAttention::output_error(int q_head, const float* o_ws) const {
  const double* o = output(q_head);
  double e2 = 0, f2 = 0;
  for (int i = 0; i < head_dim_; ++i) {
    e2 += (o_ws[i] - o[i]) * (o_ws[i] - o[i]);
    f2 += o[i] * o[i];
  }
  return f2 > 0 ? std::sqrt(e2 / f2) : 0.0;
}

double ExactAttention::output_error(int q_head, const int32_t* selected, int64_t count) const {
  // softmax over the working set = the exact probabilities restricted to it, renormalized
  const float* p = probabilities(q_head);
  const int g = q_head / group_;
  std::vector<double> acc(static_cast<size_t>(head_dim_), 0.0);
  double z = 0;
  auto add = [&](int64_t j) {
    const float* vr = v_ + (static_cast<size_t>(j) * n_kv_ + g) * head_dim_;
    for (int i = 0; i < head_dim_; ++i) acc[static_cast<size_t>(i)] += static_cast<double>(p[j]) * vr[i];
    z += p[j];
  };
  for (int64_t j = 0; j < mid_begin_; ++j) add(j);
  for (int64_t i = 0; i < count; ++i) add(selected[i]);
  for (int64_t j = mid_end_; j < length_; ++j) add(j);
  std::vector<float> o_ws(static_cast<size_t>(head_dim_), 0.0f);
  if (z > 0)
    for (int i = 0; i < head_dim_; ++i)
      o_ws[static_cast<size_t>(i)] = static_cast<float>(acc[static_cast<size_t>(i)] / z);
  return output_error(q_head, o_ws.data());
}

void score_selection(const ExactAttention& exact, const int32_t* const* selected, int64_t count, Totals& totals,
                     const float* o_ws) {
  const int group = exact.n_q_heads() / exact.n_kv_heads();
  for (int g = 0; g < exact.n_kv_heads(); ++g) {
    const int32_t* sel = count > 0 ? selected[g] : nullptr;
    totals.token_recall_sum += exact.token_recall(g, sel, count);
    totals.groups += 1;
    for (int h = g * group; h < (g + 1) * group; ++h) {
      totals.mass_recall_sum += exact.mass_recall(h, sel, count);
      totals.output_error_sum += o_ws ? exact.output_error(h, o_ws + static_cast<size_t>(h) * exact.head_dim())
                                      : exact.output_error(h, sel, count);
      totals.heads += 1;
    }
  }
}

}  // namespace kvret::quality
