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

// The two hot loops of the quality pass, compiled for AVX2/FMA too where GCC can dispatch at run time.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define KVRET_QUALITY_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define KVRET_QUALITY_CLONES
#endif

/// P[r * ldp + j] = scale * q[r] . K[j * stride .. + D] for r < R, j < n. Rows go four at a time so that each key
/// chunk is loaded once for four independent accumulators.
KVRET_QUALITY_CLONES void logits_rows(const float* const* q, int R, const float* K, int64_t stride, int64_t n, int D,
                                      float scale, float* P, int64_t ldp) {
  for (int64_t j = 0; j < n; ++j) {
    const float* k = K + j * stride;
    int r = 0;
    for (; r + 4 <= R; r += 4) {
      const float *q0 = q[r], *q1 = q[r + 1], *q2 = q[r + 2], *q3 = q[r + 3];
      float a0[8] = {}, a1[8] = {}, a2[8] = {}, a3[8] = {};
      int d = 0;
      for (; d + 8 <= D; d += 8) {
        for (int t = 0; t < 8; ++t) {
          const float kv = k[d + t];
          a0[t] += q0[d + t] * kv;
          a1[t] += q1[d + t] * kv;
          a2[t] += q2[d + t] * kv;
          a3[t] += q3[d + t] * kv;
        }
      }
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      for (; d < D; ++d) s0 += q0[d] * k[d], s1 += q1[d] * k[d], s2 += q2[d] * k[d], s3 += q3[d] * k[d];
      for (int t = 0; t < 8; ++t) s0 += a0[t], s1 += a1[t], s2 += a2[t], s3 += a3[t];
      P[r * ldp + j] = s0 * scale;
      P[(r + 1) * ldp + j] = s1 * scale;
      P[(r + 2) * ldp + j] = s2 * scale;
      P[(r + 3) * ldp + j] = s3 * scale;
    }
    for (; r < R; ++r) P[r * ldp + j] = dot(q[r], k, D) * scale;
  }
}

/// O[r * D .. + D] += P[r * ldp + j] * V[j * stride .. + D] for r < R, j < n. Blocks of 64 values rows (they stay in
/// cache across the R rows) and 32-wide output chunks (their accumulators stay in registers).
KVRET_QUALITY_CLONES void weighted_values(const float* P, int64_t ldp, int R, const float* V, int64_t stride, int64_t n,
                                          int D, float* O) {
  constexpr int64_t kRows = 64;
  constexpr int kC = 32;
  for (int64_t jb = 0; jb < n; jb += kRows) {
    const int64_t je = std::min(n, jb + kRows);
    for (int r = 0; r < R; ++r) {
      const float* p = P + r * ldp;
      float* o = O + static_cast<int64_t>(r) * D;
      int c = 0;
      for (; c + kC <= D; c += kC) {
        float acc[kC];
        for (int t = 0; t < kC; ++t) acc[t] = o[c + t];
        for (int64_t j = jb; j < je; ++j) {
          const float pj = p[j];
          const float* v = V + j * stride + c;
          for (int t = 0; t < kC; ++t) acc[t] += pj * v[t];
        }
        for (int t = 0; t < kC; ++t) o[c + t] = acc[t];
      }
      for (; c < D; ++c) {
        for (int64_t j = jb; j < je; ++j) o[c] += p[j] * V[j * stride + c];
      }
    }
  }
}

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

ExactAttention::ExactAttention(const float* v, int64_t length, int64_t mid_begin, int64_t mid_end, int n_q, int n_kv,
                               int head_dim, Fold fold)
    : v_(v),
      length_(length),
      mid_begin_(mid_begin),
      mid_end_(mid_end),
      n_q_(n_q),
      n_kv_(n_kv),
      head_dim_(head_dim),
      group_(n_q / n_kv),
      prob_(static_cast<size_t>(n_q) * length),
      out_(static_cast<size_t>(n_q) * head_dim, 0.0),
      fold_(static_cast<size_t>(n_kv) * (mid_end - mid_begin),
            fold == Fold::kMaxLogit ? -std::numeric_limits<float>::infinity() : 0.0f) {}

std::vector<ExactAttention> exact_attention_steps(const StepsInput& in, int n_threads) {
  const int steps = static_cast<int>(in.lengths.size());
  const int n_q = in.n_q_heads, n_kv = in.n_kv_heads, d = in.head_dim, group = n_q / n_kv;
  const int rows = steps * group;  // query rows of one KV group: r = s * group + i
  const int64_t total = steps > 0 ? *std::max_element(in.lengths.begin(), in.lengths.end()) : 0;
  const float scale = in.scale > 0 ? in.scale : 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<ExactAttention> out;
  out.reserve(static_cast<size_t>(steps));
  for (const int64_t len : in.lengths) {
    const int64_t mid_begin = std::min(in.n_sink, len);
    const int64_t mid_end = std::max(mid_begin, len - in.n_local);
    out.push_back(ExactAttention(in.v, len, mid_begin, mid_end, n_q, n_kv, d, in.fold));
  }
  const int threads = n_threads > 0 ? n_threads : 0;
#pragma omp parallel num_threads(threads) if (threads != 1)
  {
    std::vector<float> p_all(static_cast<size_t>(rows) * total), o_all(static_cast<size_t>(rows) * d);
    std::vector<const float*> q(static_cast<size_t>(rows));
#pragma omp for schedule(dynamic, 1)
    for (int g = 0; g < n_kv; ++g) {
      for (int r = 0; r < rows; ++r)
        q[static_cast<size_t>(r)] = in.q + (static_cast<size_t>(r / group) * n_q + g * group + r % group) * d;
      logits_rows(q.data(), rows, in.k + static_cast<size_t>(g) * d, static_cast<int64_t>(n_kv) * d, total, d, scale,
                  p_all.data(), total);
      for (int r = 0; r < rows; ++r) {
        ExactAttention& e = out[static_cast<size_t>(r / group)];
        const int h = g * group + r % group;
        float* p = &p_all[static_cast<size_t>(r) * total];
        const int64_t len = e.length_, middle = e.mid_end_ - e.mid_begin_;
        float* f = &e.fold_[static_cast<size_t>(g) * middle];
        if (in.fold == Fold::kMaxLogit)
          for (int64_t j = 0; j < middle; ++j) f[j] = std::max(f[j], p[e.mid_begin_ + j]);
        const float mx = *std::max_element(p, p + len);
        double z = 0;
        for (int64_t j = 0; j < len; ++j) z += (p[j] = std::exp(p[j] - mx));
        const auto inv = static_cast<float>(1.0 / z);
        double mid_z = 0;
        for (int64_t j = 0; j < len; ++j) {
          p[j] *= inv;
          if (j >= e.mid_begin_ && j < e.mid_end_) mid_z += p[j];
        }
        std::fill(p + len, p + total, 0.0f);
        std::copy(p, p + len, &e.prob_[static_cast<size_t>(h) * len]);
        if (in.fold == Fold::kSumProb && mid_z > 0) {
          const auto mi = static_cast<float>(1.0 / mid_z);
          for (int64_t j = 0; j < middle; ++j) f[j] += p[e.mid_begin_ + j] * mi;
        }
      }
      std::fill(o_all.begin(), o_all.end(), 0.0f);
      weighted_values(p_all.data(), total, rows, in.v + static_cast<size_t>(g) * d, static_cast<int64_t>(n_kv) * d,
                      total, d, o_all.data());
      for (int r = 0; r < rows; ++r) {
        ExactAttention& e = out[static_cast<size_t>(r / group)];
        const int h = g * group + r % group;
        std::copy_n(&o_all[static_cast<size_t>(r) * d], d, e.out_.begin() + static_cast<int64_t>(h) * d);
      }
    }
  }
  return out;
}

}  // namespace kvret::quality
