#include "select/gqa_fold.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/pq4_avx2.hpp"
#include "core/vec_math.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVRET_FOLD_AVX2 1
#endif

namespace kvret {

namespace {

constexpr float kLowest = -std::numeric_limits<float>::infinity();

/// The scratch row of exp terms, kept per thread (select runs one KV head per OpenMP thread).
float* exp_scratch(int64_t n) {
  thread_local std::vector<float> e;
  if (e.size() < static_cast<size_t>(n)) e.resize(static_cast<size_t>(n));
  return e.data();
}

/// The normalizer of one head's exp terms: eight double partial sums (lane i takes the terms at 8b + i of the
/// whole blocks of eight), added in lane order, then the tail in index order. Eight independent chains, so that
/// the vector code (two __m256d per head) is not bound by the latency of one chain of n dependent adds.
double unweighted_sum(const float* e, int64_t n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t u = 0;
  for (; u + 8 <= n; u += 8)
    for (int i = 0; i < 8; ++i) lane[i] += static_cast<double>(e[u + i]);
  double z = 0;
  for (const double x : lane) z += x;
  for (; u < n; ++u) z += e[u];
  return z;
}

/// One head of the sum-of-probabilities fold, scalar: folded += softmax(l) (weighted by `weight` when not null).
void softmax_accumulate_scalar(const float* l, const int32_t* weight, int64_t n, float* e, float* folded) {
  float mx = kLowest;
  if (weight) {
    for (int64_t u = 0; u < n; ++u) mx = std::max(mx, weight[u] > 0 ? l[u] : kLowest);
  } else {
    for (int64_t u = 0; u < n; ++u) mx = std::max(mx, l[u]);
  }
  if (!(mx > kLowest)) return;
  for (int64_t u = 0; u < n; ++u) e[u] = exp_nonpositive(l[u] - mx);
  double z = 0;
  if (weight) {
    float zf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t u = 0;
    for (; u + 8 <= n; u += 8)
      for (int i = 0; i < 8; ++i) zf[i] += static_cast<float>(weight[u + i]) * e[u + i];
    for (float x : zf) z += x;
    for (; u < n; ++u) z += static_cast<double>(weight[u]) * e[u];
  } else {
    z = unweighted_sum(e, n);
  }
  if (z <= 0) return;
  const float inv = static_cast<float>(1.0 / z);
  for (int64_t u = 0; u < n; ++u) folded[u] += e[u] * inv;
}

#ifdef KVRET_FOLD_AVX2
// The same computation eight lanes at a time, bit for bit: exp_nonpositive's operations in its order (AVX2 without
// FMA, so nothing is contracted), the weighted sum in the eight float partial sums of the scalar code, and a max
// that ignores NaN as std::max(mx, x) does (its only possible difference, the sign of a zero maximum, changes no
// l - mx).

__attribute__((target("avx2"))) inline __m256 exp_nonpositive_avx2(__m256 x) noexcept {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  x = _mm256_min_ps(_mm256_setzero_ps(), x);  // 0 where x > 0; x where x is NaN (min returns its second operand)
  x = _mm256_max_ps(lo, x);                   // lo where x < -87; x where x is NaN
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256i n = _mm256_cvttps_epi32(_mm256_sub_ps(t, _mm256_set1_ps(0.5f)));
  const __m256 fn = _mm256_cvtepi32_ps(n);
  const __m256 f = _mm256_sub_ps(t, fn);
  const __m256 y = _mm256_mul_ps(f, _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(0.5f));
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(1.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, y), _mm256_set1_ps(1.0f));
  // 2^fn from fn converted back to an integer, as the scalar code does (the same bits for out-of-range input)
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fn), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LE_OQ), r);  // 0 where x <= -87
}

/// The maximum of l over the entries of positive weight (all when weight is null), NaN ignored; kLowest if none.
__attribute__((target("avx2"))) float row_max_avx2(const float* l, const int32_t* weight, int64_t n) {
  const __m256 lowest = _mm256_set1_ps(kLowest);
  float mx = kLowest;
  __m256 m = lowest;
  int64_t u = 0;
  if (weight) {
    for (; u + 8 <= n; u += 8) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weight + u));
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(w, _mm256_setzero_si256()));
      m = _mm256_max_ps(_mm256_blendv_ps(lowest, _mm256_loadu_ps(l + u), keep), m);  // NaN keeps m
    }
  } else {
    for (; u + 8 <= n; u += 8) m = _mm256_max_ps(_mm256_loadu_ps(l + u), m);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float x : lanes) mx = std::max(mx, x);
  if (weight) {
    for (; u < n; ++u) mx = std::max(mx, weight[u] > 0 ? l[u] : kLowest);
  } else {
    for (; u < n; ++u) mx = std::max(mx, l[u]);
  }
  return mx;
}

/// folded[u] += e[u] * inv, as the scalar code.
__attribute__((target("avx2"))) void accumulate_scaled_avx2(const float* e, float inv, int64_t n, float* folded) {
  const __m256 vinv = _mm256_set1_ps(inv);
  int64_t u = 0;
  for (; u + 8 <= n; u += 8)
    _mm256_storeu_ps(folded + u,
                     _mm256_add_ps(_mm256_loadu_ps(folded + u), _mm256_mul_ps(_mm256_loadu_ps(e + u), vinv)));
  for (; u < n; ++u) folded[u] += e[u] * inv;
}

/// exp_table's whole blocks of eight entries; returns the number of entries done.
__attribute__((target("avx2"))) int64_t exp_table_avx2(const float* in, int64_t k, float sub, const float* extra,
                                                       float* out) noexcept {
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) {
    __m256 x = _mm256_sub_ps(_mm256_loadu_ps(in + c), _mm256_set1_ps(sub));
    if (extra) x = _mm256_sub_ps(x, _mm256_set1_ps(*extra));
    _mm256_storeu_ps(out + c, exp_nonpositive_avx2(x));
  }
  return c;
}

/// pq4_products from the four exp tables (k <= 64, each padded to 64 entries), sixteen tokens at a time with no
/// gather: an entry of a 64-entry table is one of two 32-entry permutes (vpermi2ps reads only the code's low five
/// bits), chosen by the code's bit 5; the products are the pair tables' (E_0 E_1)(E_2 E_3). Returns the tokens done.
__attribute__((target("avx512f"))) int64_t pq4_products_avx512(const float (*ej)[64], const uint8_t* codes, int64_t n,
                                                               float* e) noexcept {
  __m512 table[4][4];
  for (int j = 0; j < 4; ++j)
    for (int q = 0; q < 4; ++q) table[j][q] = _mm512_loadu_ps(ej[j] + 16 * q);
  const __m512i bit5 = _mm512_set1_epi32(32);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512i w = _mm512_loadu_si512(codes + t * 4);
    __m512 v[4];
    for (int j = 0; j < 4; ++j) {
      // code j in bits 0..5 (the bits above are ignored); maskz: GCC 12 warns on the unmasked shift's undefined
      const __m512i c = _mm512_maskz_srli_epi32(__mmask16{0xffff}, w, 8 * static_cast<unsigned>(j));
      const __m512 low = _mm512_permutex2var_ps(table[j][0], c, table[j][1]);
      const __m512 high = _mm512_permutex2var_ps(table[j][2], c, table[j][3]);
      v[j] = _mm512_mask_blend_ps(_mm512_test_epi32_mask(c, bit5), low, high);
    }
    _mm512_storeu_ps(e + t, _mm512_mul_ps(_mm512_mul_ps(v[0], v[1]), _mm512_mul_ps(v[2], v[3])));
  }
  return t;
}

/// pq4_products of four heads at once, whole blocks of eight tokens, with no gather: t4[j][c] holds the four heads'
/// E_j[c] side by side (16 bytes, j-major, 64 codes per j), so one 16-byte load per token and sub-space reads the
/// entries of the four heads, and the products (E_0 E_1)(E_2 E_3) of tokens t and t + 4 share a register. A 4 x 4
/// transpose in each 128-bit lane turns the eight tokens' registers into one per head. Returns the tokens done.
__attribute__((target("avx2"))) int64_t pq4_products4_avx2(const float* t4, const uint8_t* codes, int64_t n,
                                                           float* const* rows) noexcept {
  const auto pair = [t4](const uint8_t* ca, const uint8_t* cb, int j) __attribute__((target("avx2"))) {
    const float* tj = t4 + j * 4 * 64;
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(tj + 4 * ca[j])), _mm_load_ps(tj + 4 * cb[j]), 1);
  };
  const auto products = [&pair](const uint8_t* ca, const uint8_t* cb) __attribute__((target("avx2"))) {
    return _mm256_mul_ps(_mm256_mul_ps(pair(ca, cb, 0), pair(ca, cb, 1)),
                         _mm256_mul_ps(pair(ca, cb, 2), pair(ca, cb, 3)));
  };
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const uint8_t* c = codes + t * 4;
    // r_i = [token i: heads 0..3 | token i + 4: heads 0..3]
    const __m256 r0 = products(c, c + 16), r1 = products(c + 4, c + 20);
    const __m256 r2 = products(c + 8, c + 24), r3 = products(c + 12, c + 28);
    const __m256 u0 = _mm256_unpacklo_ps(r0, r1), u1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 u2 = _mm256_unpacklo_ps(r2, r3), u3 = _mm256_unpackhi_ps(r2, r3);
    _mm256_storeu_ps(rows[0] + t, _mm256_shuffle_ps(u0, u2, 0x44));
    _mm256_storeu_ps(rows[1] + t, _mm256_shuffle_ps(u0, u2, 0xee));
    _mm256_storeu_ps(rows[2] + t, _mm256_shuffle_ps(u1, u3, 0x44));
    _mm256_storeu_ps(rows[3] + t, _mm256_shuffle_ps(u1, u3, 0xee));
  }
  return t;
}

/// lane_sums4's whole blocks of eight, four rows at a time: eight independent chains of double adds (two __m256d
/// per row) instead of two. Returns the tokens done.
__attribute__((target("avx2"))) int64_t lane_sums4_avx2(float* const* rows, int64_t n, double (*lane)[8]) noexcept {
  __m256d lo[4], hi[4];
  for (int i = 0; i < 4; ++i) {
    lo[i] = _mm256_loadu_pd(lane[i]);
    hi[i] = _mm256_loadu_pd(lane[i] + 4);
  }
  int64_t u = 0;
  for (; u + 8 <= n; u += 8)
    for (int i = 0; i < 4; ++i) {
      const __m256 x = _mm256_loadu_ps(rows[i] + u);
      lo[i] = _mm256_add_pd(lo[i], _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
      hi[i] = _mm256_add_pd(hi[i], _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
    }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_pd(lane[i], lo[i]);
    _mm256_storeu_pd(lane[i] + 4, hi[i]);
  }
  return u;
}

/// folded[u] += rows[a][u] * inv[a] for a = 0..count-1 in that order (count <= 4), in one pass; returns the tokens
/// done (whole blocks of eight).
__attribute__((target("avx2"))) int64_t accumulate4_avx2(const float* const* rows, const float* inv, int count,
                                                         int64_t n, float* folded) noexcept {
  __m256 vinv[4];
  for (int a = 0; a < count; ++a) vinv[a] = _mm256_set1_ps(inv[a]);
  int64_t u = 0;
  for (; u + 8 <= n; u += 8) {
    __m256 f = _mm256_loadu_ps(folded + u);
    for (int a = 0; a < count; ++a) f = _mm256_add_ps(f, _mm256_mul_ps(_mm256_loadu_ps(rows[a] + u), vinv[a]));
    _mm256_storeu_ps(folded + u, f);
  }
  return u;
}

/// The unweighted fold of `group` heads (e: [group, n] scratch), four heads at a time: each head's normalizer is
/// unweighted_sum's eight double partial sums (two __m256d per head), and folded's additions (head by head, in head
/// order) are made in one pass for the four heads. Every head's z and every addition are the one-head code's.
__attribute__((target("avx2"))) void softmax_fold_avx2(const float* logits, int group, int64_t n, float* e,
                                                       float* folded) {
  for (int g0 = 0; g0 < group; g0 += 4) {
    const int heads = std::min(4, group - g0);
    const float* l[4];
    float* ev[4];
    float mx[4];
    bool active[4];
    for (int i = 0; i < 4; ++i) {
      l[i] = logits;
      ev[i] = e;
      mx[i] = kLowest;
      active[i] = false;
      if (i >= heads) continue;
      l[i] = logits + (g0 + i) * n;
      ev[i] = e + (g0 + i) * n;
      mx[i] = row_max_avx2(l[i], nullptr, n);
      active[i] = mx[i] > kLowest;
    }
    __m256d zlo[4], zhi[4];  // lanes 0..3 and 4..7 of unweighted_sum's partial sums, per head
    for (int i = 0; i < 4; ++i) zlo[i] = zhi[i] = _mm256_setzero_pd();
    int64_t u = 0;
    for (; u + 8 <= n; u += 8)
      for (int i = 0; i < 4; ++i) {
        if (!active[i]) continue;
        const __m256 x = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(l[i] + u), _mm256_set1_ps(mx[i])));
        _mm256_storeu_ps(ev[i] + u, x);
        zlo[i] = _mm256_add_pd(zlo[i], _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        zhi[i] = _mm256_add_pd(zhi[i], _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
      }
    double z[4];
    for (int i = 0; i < 4; ++i) {
      alignas(32) double lanes[8];
      _mm256_store_pd(lanes, zlo[i]);
      _mm256_store_pd(lanes + 4, zhi[i]);
      z[i] = 0;
      for (const double x : lanes) z[i] += x;
    }
    // the heads that add to folded, in head order, and their 1 / z
    const float* add[4];
    float inv[4];
    int adding = 0;
    for (int i = 0; i < heads; ++i) {
      if (!active[i]) continue;
      for (int64_t v = u; v < n; ++v) {
        ev[i][v] = exp_nonpositive(l[i][v] - mx[i]);
        z[i] += ev[i][v];
      }
      if (z[i] <= 0) continue;
      add[adding] = ev[i];
      inv[adding++] = static_cast<float>(1.0 / z[i]);
    }
    // folded += e_i * inv_i head after head, as accumulate_scaled_avx2 would do one head at a time, in one pass
    if (adding == 0) continue;
    __m256 vinv[4];
    for (int a = 0; a < adding; ++a) vinv[a] = _mm256_set1_ps(inv[a]);
    int64_t v = 0;
    for (; v + 8 <= n; v += 8) {
      __m256 f = _mm256_loadu_ps(folded + v);
      for (int a = 0; a < adding; ++a) f = _mm256_add_ps(f, _mm256_mul_ps(_mm256_loadu_ps(add[a] + v), vinv[a]));
      _mm256_storeu_ps(folded + v, f);
    }
    for (; v < n; ++v)
      for (int a = 0; a < adding; ++a) folded[v] += add[a][v] * inv[a];
  }
}

__attribute__((target("avx2"))) void softmax_accumulate_avx2(const float* l, const int32_t* weight, int64_t n, float* e,
                                                             float* folded) {
  const float mx = row_max_avx2(l, weight, n);
  if (!(mx > kLowest)) return;
  const __m256 vmx = _mm256_set1_ps(mx);
  double z = 0;
  int64_t u = 0;
  if (weight) {
    __m256 zf = _mm256_setzero_ps();
    for (; u + 8 <= n; u += 8) {
      const __m256 x = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(l + u), vmx));
      _mm256_storeu_ps(e + u, x);
      const __m256 w = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(weight + u)));
      zf = _mm256_add_ps(zf, _mm256_mul_ps(w, x));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, zf);
    for (float x : lanes) z += x;
    for (; u < n; ++u) {
      e[u] = exp_nonpositive(l[u] - mx);
      z += static_cast<double>(weight[u]) * e[u];
    }
  } else {
    for (; u + 8 <= n; u += 8)
      _mm256_storeu_ps(e + u, exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(l + u), vmx)));
    for (; u < n; ++u) e[u] = exp_nonpositive(l[u] - mx);
    z = unweighted_sum(e, n);
  }
  if (z <= 0) return;
  accumulate_scaled_avx2(e, static_cast<float>(1.0 / z), n, folded);
}
#endif

}  // namespace

namespace {

/// Largest k of pq4_softmax_fold: its two pair tables of k^2 floats stay in L1 (32 KiB at k = 64).
constexpr int kPq4MaxK = 64;

/// Tokens per block of pq4_softmax_fold (a multiple of sixteen): four rows of terms, 16 KiB.
constexpr int64_t kPq4Block = 1024;

/// The maximum of x[0, n), NaN ignored; kLowest if none.
float max_ignoring_nan(const float* x, int64_t n) noexcept {
#ifdef KVRET_FOLD_AVX2
  // the same maximum (only the sign of a zero maximum may differ, which changes no difference with it)
  if (n >= 64 && cpu_has_avx2()) return row_max_avx2(x, nullptr, n);
#endif
  float mx = kLowest;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);  // std::max(mx, NaN) keeps mx
  return mx;
}

/// out[c] = exp_nonpositive(in[c] - sub), or (in[c] - sub) - extra when extra is not null.
void exp_table(const float* in, int64_t k, float sub, const float* extra, float* out) noexcept {
  int64_t c = 0;
#ifdef KVRET_FOLD_AVX2
  if (cpu_has_avx2()) c = exp_table_avx2(in, k, sub, extra, out);
#endif
  for (; c < k; ++c) out[c] = exp_nonpositive(extra ? (in[c] - sub) - *extra : in[c] - sub);
}

/// e[t] = a[c0 + k c1] * b[c2 + k c3] for t in [0, n), the pair tables of one head.
void pq4_products_scalar(const float* a, const float* b, int k, const uint8_t* codes, int64_t n, float* e) noexcept {
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* c = codes + t * 4;
    e[t] = a[c[0] + k * c[1]] * b[c[2] + k * c[3]];
  }
}

/// unweighted_sum's eight lane sums of four rows, continued from lane[i] (whole blocks of eight tokens only).
void lane_sums4(float* const* rows, int64_t n, double (*lane)[8]) noexcept {
  int64_t u = 0;
#ifdef KVRET_FOLD_AVX2
  if (cpu_has_avx2()) u = lane_sums4_avx2(rows, n, lane);
#endif
  for (; u + 8 <= n; u += 8)
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 8; ++i) lane[r][i] += static_cast<double>(rows[r][u + i]);
}

}  // namespace

// Four heads at a time (a group of another size is padded with copies of its last head, whose results are dropped):
// the products of all tokens, the exact tokens' terms put in, the normalizers (unweighted_sum's lanes, four heads'
// chains side by side), then one pass adding the heads to folded in head order. Every step keeps the per-head
// definition's operations and order, so every path gives its bits.
bool pq4_softmax_fold(const float* lut, int group, int k, const uint8_t* codes, int64_t n, const int64_t* exact,
                      const float* exact_logits, int64_t n_exact, float* folded) {
  if (k > kPq4MaxK || k <= 0 || n <= 0) return false;
  // Every head's reference first, so that nothing is written unless all are finite.
  thread_local std::vector<float> reference;
  reference.resize(2 * static_cast<size_t>(group));
  float* ref = reference.data();
  float* shift = ref + group;
  for (int g = 0; g < group; ++g) {
    const float* l = lut + static_cast<int64_t>(g) * 4 * k;
    float sum = 0;
    for (int j = 0; j < 4; ++j) sum += max_ignoring_nan(l + j * k, k);
    const float m = std::max(sum, max_ignoring_nan(exact_logits + g * n_exact, n_exact));
    if (!std::isfinite(sum) || !std::isfinite(m)) return false;
    ref[g] = m;
    shift[g] = m - sum;
  }
  // scratch: four rows of n terms, then the four heads' exact terms
  float* e = exp_scratch(4 * (n + n_exact));
  float* row[4];
  float* exact_e[4];
  for (int i = 0; i < 4; ++i) {
    row[i] = e + i * n;
    exact_e[i] = e + 4 * n + i * n_exact;
  }
  alignas(64) float ej[4][4][kPq4MaxK] = {};  // [head of the four][sub-space][code]
#ifdef KVRET_FOLD_AVX2
  alignas(16) float t4[4][kPq4MaxK][4] = {};  // [sub-space][code][head of the four]
#endif
  thread_local std::vector<float> pair_tables;
  std::fill(folded, folded + n, 0.0f);
#ifdef KVRET_FOLD_AVX2
  const bool avx512 = cpu_has_avx512f(), avx2 = cpu_has_avx2(), vector_path = avx2 || avx512;
#else
  const bool vector_path = false;
#endif
  for (int g0 = 0; g0 < group; g0 += 4) {
    const int heads = std::min(4, group - g0);
    for (int i = 0; i < 4; ++i) {
      const int g = g0 + std::min(i, heads - 1);
      const float* l = lut + static_cast<int64_t>(g) * 4 * k;
      for (int j = 0; j < 4; ++j)
        exp_table(l + j * k, k, max_ignoring_nan(l + j * k, k), j == 0 ? &shift[g] : nullptr, ej[i][j]);
      exp_table(exact_logits + g * n_exact, n_exact, ref[g], nullptr, exact_e[i]);
    }
#ifdef KVRET_FOLD_AVX2
    if (avx2 && !avx512)
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < k; ++c)
          for (int i = 0; i < 4; ++i) t4[j][c][i] = ej[i][j][c];
#endif
    if (!vector_path) {  // the products of each head from its pair tables (k^2 products, then two loads per token)
      pair_tables.resize(2 * static_cast<size_t>(k) * k);
      float* pa = pair_tables.data();
      float* pb = pa + k * k;
      for (int i = 0; i < heads; ++i) {
        for (int c1 = 0; c1 < k; ++c1)
          for (int c0 = 0; c0 < k; ++c0) {
            pa[c0 + k * c1] = ej[i][0][c0] * ej[i][1][c1];
            pb[c0 + k * c1] = ej[i][2][c0] * ej[i][3][c1];
          }
        pq4_products_scalar(pa, pb, k, codes, n, row[i]);
      }
    }
    // Block by block (the four rows of a block stay in L1): the products (vector paths), the exact tokens' terms put
    // in, the lane sums of the normalizers (unweighted_sum's order; blocks are whole multiples of eight tokens but the
    // last).
    double lane[4][8] = {};
    int64_t x0 = 0;  // the first exact token of the block
    for (int64_t b0 = 0; b0 < n; b0 += kPq4Block) {
      const int64_t len = std::min(kPq4Block, n - b0);
      const uint8_t* bc = codes + b0 * 4;
      float* brow[4];
      for (int i = 0; i < 4; ++i) brow[i] = row[i] + b0;
      int64_t done = 0;
#ifdef KVRET_FOLD_AVX2
      if (avx512) {
        for (int i = 0; i < heads; ++i) done = pq4_products_avx512(ej[i], bc, len, brow[i]);
      } else if (avx2) {
        done = pq4_products4_avx2(&t4[0][0][0], bc, len, brow);
      }
#endif
      for (int i = 0; i < heads && vector_path; ++i) {
        for (int64_t t = done; t < len; ++t) {  // a vector path's remainder: the four table entries of each token
          const uint8_t* c = bc + t * 4;
          brow[i][t] = (ej[i][0][c[0]] * ej[i][1][c[1]]) * (ej[i][2][c[2]] * ej[i][3][c[3]]);
        }
      }
      int64_t x1 = x0;
      while (x1 < n_exact && exact[x1] < b0 + len) ++x1;
      for (int64_t x = x0; x < x1; ++x)
        for (int i = 0; i < heads; ++i) row[i][exact[x]] = exact_e[i][x];
      x0 = x1;
      lane_sums4(brow, len, lane);
    }
    const int64_t whole = n / 8 * 8;
    const float* add[4];
    float inv[4];
    int adding = 0;
    for (int i = 0; i < heads; ++i) {
      double z = 0;
      for (const double x : lane[i]) z += x;
      for (int64_t u = whole; u < n; ++u) z += row[i][u];
      if (z <= 0) continue;
      add[adding] = row[i];
      inv[adding++] = static_cast<float>(1.0 / z);
    }
    // folded += e * (1 / z), head after head
    int64_t u = 0;
#ifdef KVRET_FOLD_AVX2
    if (avx2 && adding > 0) u = accumulate4_avx2(add, inv, adding, n, folded);
#endif
    for (int a = 0; a < adding; ++a)  // the rest head by head (each folded[v] still adds the heads in order)
      for (int64_t v = u; v < n; ++v) folded[v] += add[a][v] * inv[a];
  }
  return true;
}

void fold_weighted_logits(const float* logits, const int32_t* weight, int group, int64_t n, kvret_gqa_fold fold,
                          float* folded) {
  if (fold == KVRET_FOLD_MAX_LOGIT) {
    std::fill(folded, folded + n, kLowest);
    for (int g = 0; g < group; ++g) {
      const float* l = logits + g * n;
      for (int64_t u = 0; u < n; ++u) folded[u] = std::max(folded[u], l[u]);
    }
    return;
  }
  // Sum of softmax probabilities: one exp per entry and head.
  std::fill(folded, folded + n, 0.0f);
#ifdef KVRET_FOLD_AVX2
  if (cpu_has_avx2() && !weight) {
    softmax_fold_avx2(logits, group, n, exp_scratch(static_cast<int64_t>(group) * n), folded);
    return;
  }
#endif
  float* e = exp_scratch(n);
#ifdef KVRET_FOLD_AVX2
  if (cpu_has_avx2()) {
    for (int g = 0; g < group; ++g) softmax_accumulate_avx2(logits + g * n, weight, n, e, folded);
    return;
  }
#endif
  for (int g = 0; g < group; ++g) softmax_accumulate_scalar(logits + g * n, weight, n, e, folded);
}

void fold_logits(const float* logits, int group, int64_t n, kvret_gqa_fold fold, float* folded) {
  fold_weighted_logits(logits, nullptr, group, n, fold, folded);
}

}  // namespace kvret
