#pragma once
// Helpers shared by the CPU test suites: owning f32/i32 buffers with kvret_tensor descriptors, RAII handles, and
// exact reference computations written independently of the library's code.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvret.h"

#if KVRET_TEST_CUDA_RUNTIME
#include <cuda_runtime_api.h>
#endif

namespace kvret::test {

/// Fault injection for strong-guarantee tests (defined with the replacement operator new in test_page.cpp): while
/// >= 0, the calling thread's n-th allocation from now fails with std::bad_alloc (0: the next one).
extern thread_local int64_t g_allocations_until_failure;

/// Runs call() with its 0th, 1st, ... allocation failing until a run succeeds; after each run that threw
/// std::bad_alloc, calls after_failure(fail_at) (which checks that nothing changed). Stops at a fatal failure.
/// Returns the number of runs that threw.
template <class Call, class AfterFailure>
int fail_each_allocation(Call&& call, AfterFailure&& after_failure) {
  int failures = 0;
  for (int64_t fail_at = 0;; ++fail_at) {
    g_allocations_until_failure = fail_at;
    bool threw = false;
    try {
      call();
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    g_allocations_until_failure = -1;
    if (!threw) return failures;
    ++failures;
    after_failure(fail_at);
    if (::testing::Test::HasFatalFailure()) return failures;
  }
}

/// The backend the suite runs against: KVRET_TEST_DEVICE=cuda runs it on the CUDA backend (in a build that has one:
/// on Thrust's OpenMP host system "device" memory is host memory, so the tests read their buffers directly);
/// unset or "cpu", the CPU backend.
inline int32_t device_type() {
  static const int32_t type = [] {
    const char* e = std::getenv("KVRET_TEST_DEVICE");
    return e != nullptr && std::string(e) == "cuda" ? KVRET_DEVICE_CUDA : KVRET_DEVICE_CPU;
  }();
  return type;
}
/// Where the suite's tensors say they are.
inline kvret_device device() { return {device_type(), 0}; }

/// Memory for the suite's tensors: the heap, or, with KVRET_TEST_DEVICE=cuda in a build with the CUDA runtime (a real
/// GPU), managed memory, which the GPU reaches and the tests read and write directly (run the suite there with
/// CUDA_LAUNCH_BLOCKING=1, so that every stream-ordered call has finished when a test reads its outputs).
template <class T>
struct TensorAllocator {
  using value_type = T;
  TensorAllocator() = default;
  template <class U>
  TensorAllocator(const TensorAllocator<U>&) noexcept {}
  T* allocate(size_t n) {
#if KVRET_TEST_CUDA_RUNTIME
    if (device_type() == KVRET_DEVICE_CUDA) {
      void* p = nullptr;
      if (cudaMallocManaged(&p, n == 0 ? 1 : n * sizeof(T)) != cudaSuccess) throw std::bad_alloc();
      return static_cast<T*>(p);
    }
#endif
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
#if KVRET_TEST_CUDA_RUNTIME
    if (device_type() == KVRET_DEVICE_CUDA) {
      (void)cudaFree(p);
      return;
    }
#endif
    std::allocator<T>().deallocate(p, n);
  }
  template <class U>
  bool operator==(const TensorAllocator<U>&) const noexcept {
    return true;
  }
  template <class U>
  bool operator!=(const TensorAllocator<U>&) const noexcept {
    return false;
  }
};
/// A test tensor's elements: a vector in TensorAllocator's memory that converts to and from std::vector and compares
/// with one.
template <class T>
struct TensorVector : std::vector<T, TensorAllocator<T>> {
  using Base = std::vector<T, TensorAllocator<T>>;
  using Base::Base;
  TensorVector() = default;
  TensorVector(const std::vector<T>& v) : Base(v.begin(), v.end()) {}
  TensorVector& operator=(const std::vector<T>& v) {
    this->assign(v.begin(), v.end());
    return *this;
  }
  TensorVector& operator=(std::initializer_list<T> v) {
    this->assign(v.begin(), v.end());
    return *this;
  }
  operator std::vector<T>() const { return std::vector<T>(this->begin(), this->end()); }
  friend bool operator==(const TensorVector& a, const TensorVector& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend bool operator==(const TensorVector& a, const std::vector<T>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
};
/// Memory the backend under test cannot reach (pageable host memory for the CUDA backend, device memory for the
/// CPU's), for the device-check tests.
inline kvret_device foreign_device() {
  return device_type() == KVRET_DEVICE_CUDA ? kvret_device{KVRET_DEVICE_CPU, 0} : kvret_device{KVRET_DEVICE_CUDA, 0};
}
/// kvret_config_init, on the backend under test.
inline void init_config(kvret_config* c) {
  kvret_config_init(c);
  c->device_type = device_type();
}

template <class T>
struct Buffer {
  TensorVector<T> data;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // empty = row-major
  kvret_tensor t{};

  explicit Buffer(std::vector<int64_t> s, T fill = T{}) : shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    data.assign(static_cast<size_t>(n), fill);
    refresh();
  }
  void refresh() {
    t.data = data.data();
    t.device = device();
    t.ndim = static_cast<int32_t>(shape.size());
    if constexpr (std::is_same_v<T, float>) t.dtype = {KVRET_DTYPE_FLOAT, 32, 1};
    if constexpr (std::is_same_v<T, int32_t>) t.dtype = {KVRET_DTYPE_INT, 32, 1};
    if constexpr (std::is_same_v<T, uint16_t>) t.dtype = {KVRET_DTYPE_FLOAT, 16, 1};
    t.shape = shape.data();
    t.strides = strides.empty() ? nullptr : strides.data();
    t.byte_offset = 0;
  }
  const kvret_tensor* operator&() const { return &t; }
  kvret_tensor* get() { return &t; }
};
using F32 = Buffer<float>;
using I32 = Buffer<int32_t>;

inline void expect_ok(kvret_status s) {
  ASSERT_EQ(s, KVRET_OK) << kvret_status_string(s) << ": " << kvret_last_error();
}
#define KVRET_ASSERT_OK(call)                                                                                        \
  do {                                                                                                               \
    kvret_status kvret_s_ = (call);                                                                                  \
    ASSERT_EQ(kvret_s_, KVRET_OK) << #call << " -> " << kvret_status_string(kvret_s_) << ": " << kvret_last_error(); \
  } while (0)

struct ContextDeleter {
  void operator()(kvret_context* c) const { kvret_destroy(c); }
};
using ContextPtr = std::unique_ptr<kvret_context, ContextDeleter>;

inline kvret_config small_config(int index_kind = KVRET_INDEX_PQ) {
  kvret_config c;
  init_config(&c);
  c.n_layers = 2;
  c.n_q_heads = 8;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.kv_dtype = KVRET_KV_F32;
  c.n_sink = 4;
  c.n_local = 16;
  c.index_kind = index_kind;
  c.n_threads = 2;
  return c;
}

inline ContextPtr make_context(const kvret_config& c) {
  kvret_context* ctx = nullptr;
  const kvret_status s = kvret_create(&c, &ctx);
  EXPECT_EQ(s, KVRET_OK) << kvret_last_error();
  return ContextPtr(ctx);
}

/// f32 working-set buffers for `count` selected tokens per KV head of `layer`, sized by kvret_working_set_capacity.
struct WorkingSetBuffers {
  int64_t capacity;
  Buffer<float> k, v;
  Buffer<int32_t> positions;
  kvret_working_set ws;

  WorkingSetBuffers(kvret_seq* seq, int32_t layer, int32_t count, int heads, int head_dim)
      : capacity(capacity_of(seq, layer, count)),
        k({heads, capacity, head_dim}),
        v({heads, capacity, head_dim}),
        positions({heads, capacity}),
        ws{k.t, v.t, positions.t} {}

  /// Asserts that rows [0, rows) of every head hold the key stored at their position: keys is [T, heads, head_dim].
  void expect_stored_keys(int64_t rows, const std::vector<float>& keys, int heads, int head_dim) const {
    for (int h = 0; h < heads; ++h)
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t pos = positions.data[static_cast<size_t>(h * capacity + r)];
        for (int i = 0; i < head_dim; ++i)
          ASSERT_EQ(k.data[static_cast<size_t>((h * capacity + r) * head_dim + i)],
                    keys[static_cast<size_t>((static_cast<int64_t>(pos) * heads + h) * head_dim + i)])
              << "head " << h << " row " << r << " position " << pos;
      }
  }

 private:
  static int64_t capacity_of(kvret_seq* seq, int32_t layer, int32_t count) {
    int64_t c = 0;
    EXPECT_EQ(kvret_working_set_capacity(seq, layer, count, &c), KVRET_OK) << kvret_last_error();
    return c;
  }
};

/// Random clustered keys/values [T, H, D] (keys around a few centers, so PQ has structure to find).
inline void clustered_kv(int64_t tokens, int heads, int d, uint64_t seed, F32& k, F32& v) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  const int centers = 12;
  std::vector<float> c(static_cast<size_t>(centers * heads * d));
  for (auto& x : c) x = 2.0f * n01(rng);
  for (int64_t t = 0; t < tokens; ++t) {
    const int which = static_cast<int>(rng() % centers);
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d; ++i) {
        const size_t at = static_cast<size_t>((t * heads + h) * d + i);
        k.data[at] = c[static_cast<size_t>((which * heads + h) * d + i)] + 0.5f * n01(rng);
        v.data[at] = n01(rng);
      }
  }
}

inline std::vector<float> random_vector(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01(0.0f, scale);
  std::vector<float> x(n);
  for (auto& e : x) e = n01(rng);
  return x;
}

/// The exact folded score of middle tokens for one KV head, computed from scratch.
/// k: [T, H, D] row-major; q: [Hq, D]. Returns scores over positions [mid_begin, mid_end).
inline std::vector<double> exact_folded(const std::vector<float>& k, int heads, int d, const std::vector<float>& q,
                                        int group, int kv_head, int64_t mid_begin, int64_t mid_end, bool max_logit) {
  const int64_t n = mid_end - mid_begin;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> folded(static_cast<size_t>(n), max_logit ? -1e300 : 0.0);
  for (int g = 0; g < group; ++g) {
    const float* qg = q.data() + static_cast<size_t>((kv_head * group + g) * d);
    std::vector<double> logit(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      const float* kt = k.data() + static_cast<size_t>(((mid_begin + t) * heads + kv_head) * d);
      double s = 0;
      for (int i = 0; i < d; ++i) s += static_cast<double>(qg[i]) * kt[i];
      logit[static_cast<size_t>(t)] = s * scale;
    }
    if (max_logit) {
      for (int64_t t = 0; t < n; ++t)
        folded[static_cast<size_t>(t)] = std::max(folded[static_cast<size_t>(t)], logit[static_cast<size_t>(t)]);
      continue;
    }
    const double mx = *std::max_element(logit.begin(), logit.end());
    double z = 0;
    for (double l : logit) z += std::exp(l - mx);
    for (int64_t t = 0; t < n; ++t) folded[static_cast<size_t>(t)] += std::exp(logit[static_cast<size_t>(t)] - mx) / z;
  }
  return folded;
}

/// Positions (absolute) of the top-b entries of `scores` (indices offset by base).
inline std::set<int32_t> top_positions(const std::vector<double>& scores, int64_t b, int64_t base) {
  std::vector<int32_t> idx(scores.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t c) {
    return scores[static_cast<size_t>(a)] > scores[static_cast<size_t>(c)];
  });
  std::set<int32_t> out;
  for (int64_t i = 0; i < b; ++i) out.insert(static_cast<int32_t>(base + idx[static_cast<size_t>(i)]));
  return out;
}

}  // namespace kvret::test
