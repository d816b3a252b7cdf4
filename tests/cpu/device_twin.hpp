#pragma once
// Twin sequences for the suites that compare the CUDA backend with the CPU backend (KVRET_TEST_DEVICE=cuda; in CI
// the build on Thrust's OpenMP host system): the same calls on a sequence of a context with device_type CUDA (its
// tensors labelled CUDA) and on one of a context with device_type CPU, selects compared bit for bit, and a random
// walk of appends, truncates, drop_fronts, forks and saved sessions between selects. The geometry is
// test::small_config's: 8 query heads (or as many as q holds: select, walk), 2 KV heads, head_dim 64.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvret.h"
#include "test_util.hpp"

namespace kvret::test::twin {

constexpr int kQHeads = 8;
constexpr int kHeads = 2;
constexpr int kDim = 64;

inline uint32_t bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

/// Equal bits, or both NaN.
inline bool same_bits(float a, float b) { return (a != a && b != b) || bits(a) == bits(b); }

/// A tensor for a context of `device_type`.
template <class T>
T& label(T& t, int32_t device_type) {
  t.t.device = {device_type, 0};
  return t;
}

inline int64_t length_of(kvret_seq* seq) {
  int64_t n = 0;
  EXPECT_EQ(kvret_seq_length(seq, 0, &n), KVRET_OK) << kvret_last_error();
  return n;
}

inline kvret_stats stats_of(kvret_seq* seq) {
  kvret_stats s;
  kvret_stats_init(&s);
  kvret_seq_stats(seq, &s);
  return s;
}

/// The same random tokens into layers [0, layers) of dev (the suite's label) and, unless null, cpu (CPU label).
inline void append_both(kvret_seq* dev, kvret_seq* cpu, int32_t layers, int64_t tokens, uint64_t seed) {
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  k.data = random_vector(static_cast<size_t>(tokens * kHeads * kDim), seed);
  v.data = random_vector(static_cast<size_t>(tokens * kHeads * kDim), seed + 1);
  k.refresh();
  v.refresh();
  for (int32_t l = 0; l < layers; ++l) expect_ok(kvret_append_prefill(dev, l, &k.t, &v.t));
  if (cpu == nullptr) return;
  label(k, KVRET_DEVICE_CPU);
  label(v, KVRET_DEVICE_CPU);
  for (int32_t l = 0; l < layers; ++l) expect_ok(kvret_append_prefill(cpu, l, &k.t, &v.t));
}

/// A sequence of each context: a of `dev`, b of `cpu`.
inline void open_both(kvret_context* dev, kvret_context* cpu, kvret_seq*& a, kvret_seq*& b) {
  expect_ok(kvret_seq_open(dev, &a));
  expect_ok(kvret_seq_open(cpu, &b));
}

/// Both truncated to the same random length: `length` - 1 - rng() % span.
inline void truncate_both(kvret_seq* a, kvret_seq* b, int64_t length, int64_t span, std::mt19937_64& rng) {
  const int64_t to = length - 1 - static_cast<int64_t>(rng() % static_cast<uint64_t>(span));
  expect_ok(kvret_seq_truncate(a, to));
  expect_ok(kvret_seq_truncate(b, to));
}

/// The same random drop_front of both: after rng() % 60 tokens, 1 + rng() % span of them.
inline void drop_front_both(kvret_seq* a, kvret_seq* b, int64_t span, std::mt19937_64& rng) {
  const int64_t keep = static_cast<int64_t>(rng() % 60), count = 1 + static_cast<int64_t>(rng() % span);
  expect_ok(kvret_seq_drop_front(a, keep, count));
  expect_ok(kvret_seq_drop_front(b, keep, count));
}

/// A fork of each: fa of a, fb of b.
inline void fork_both(kvret_seq* a, kvret_seq* b, kvret_seq*& fa, kvret_seq*& fb) {
  expect_ok(kvret_seq_fork(a, &fa));
  expect_ok(kvret_seq_fork(b, &fb));
}

/// Both saved as session `id`, then closed; a and b go on as the sessions opened from it in `dev` and `cpu`.
inline void reopen_both(kvret_context* dev, kvret_context* cpu, kvret_seq*& a, kvret_seq*& b, const std::string& id) {
  expect_ok(kvret_session_save(a, id.c_str()));
  expect_ok(kvret_session_save(b, id.c_str()));
  kvret_seq *oa = nullptr, *ob = nullptr;
  expect_ok(kvret_session_open(dev, id.c_str(), &oa));
  expect_ok(kvret_session_open(cpu, id.c_str(), &ob));
  expect_ok(kvret_seq_close(a));
  expect_ok(kvret_seq_close(b));
  a = oa;
  b = ob;
}

struct Selected {
  int32_t count = 0;
  std::vector<int32_t> positions;
  std::vector<float> scores;
};

/// A select (scored or not) of q [q.size() / kDim, kDim] into tensors of `device_type`, [kHeads, width]; the
/// elements past the count stay -7.
inline Selected select(kvret_seq* seq, int32_t device_type, int32_t layer, const std::vector<float>& q, int32_t budget,
                       int64_t width, bool scored) {
  F32 qt({static_cast<int64_t>(q.size()) / kDim, kDim});
  qt.data = q;
  qt.refresh();
  label(qt, device_type);
  I32 out({kHeads, width}, -7);
  F32 sc({kHeads, width}, -7.0f);
  label(out, device_type);
  label(sc, device_type);
  Selected s;
  const kvret_status st = scored ? kvret_select_scored(seq, layer, &qt.t, budget, &out.t, &sc.t, &s.count)
                                 : kvret_select(seq, layer, &qt.t, budget, &out.t, &s.count);
  EXPECT_EQ(st, KVRET_OK) << kvret_last_error();
  s.positions = out.data;
  s.scores = sc.data;
  return s;
}

inline void expect_same(const Selected& a, const Selected& b, const std::string& where) {
  ASSERT_EQ(a.count, b.count) << where;
  ASSERT_EQ(a.positions, b.positions) << where;
  ASSERT_EQ(a.scores.size(), b.scores.size());
  for (size_t i = 0; i < a.scores.size(); ++i)
    ASSERT_TRUE(same_bits(a.scores[i], b.scores[i])) << where << " score " << i;
}

/// How a walk draws its steps.
struct Walk {
  int steps = 60;
  int64_t truncate_span = 40;  ///< a truncate cuts up to this many tokens
  int64_t chunk_span = 30;     ///< an appended chunk has up to this many tokens
  std::string session;         ///< the prefix of the session ids it saves
  /// The kind keeps no device copy (EXACT): a select ran on the device when it read every middle key over the bus
  /// (stats.bytes_h2d) with device_bytes still 0.
  bool reads_keys = false;
};

/// `w.steps` random steps on the twins a (dev_ctx's) and b (cpu_ctx's), which it may replace (a fork or an opened
/// session goes on in their place): truncates, drop_fronts, forks, session saves and opens, decodes and chunks, and
/// otherwise a select of a random layer and budget (1, the middle, past it, or between) that must give the same
/// positions and scores on both, with the CUDA backend's copy of the index counted. Returns the selects made.
inline int walk(kvret_context* dev_ctx, kvret_context* cpu_ctx, kvret_seq*& a, kvret_seq*& b, const kvret_config& c,
                std::mt19937_64& rng, const Walk& w, const std::string& where) {
  int selects = 0;
  for (int step = 0; step < w.steps; ++step) {
    const int64_t length = length_of(a);
    EXPECT_EQ(length, length_of(b));
    const uint64_t op = rng() % 24;
    const std::string at = where + " step " + std::to_string(step);
    if (op == 0 && length > 100) {
      truncate_both(a, b, length, w.truncate_span, rng);
    } else if (op == 1 && length > 120) {
      drop_front_both(a, b, 30, rng);
    } else if (op == 2) {
      kvret_seq *fa = nullptr, *fb = nullptr;
      fork_both(a, b, fa, fb);
      if (rng() % 2 == 0) std::swap(a, fa), std::swap(b, fb);  // go on with the fork, or the parent
      append_both(fa, fb, c.n_layers, 3, 500 + static_cast<uint64_t>(step));
      expect_ok(kvret_seq_close(fa));
      expect_ok(kvret_seq_close(fb));
    } else if (op == 3) {
      reopen_both(dev_ctx, cpu_ctx, a, b, w.session + "-" + std::to_string(step));
    } else if (op < 10) {
      const int64_t tokens =
          op < 7 ? 1 : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(w.chunk_span));  // decodes, chunks
      append_both(a, b, c.n_layers, tokens, 1000 + static_cast<uint64_t>(step));
    } else {
      const int32_t layer = static_cast<int32_t>(rng() % 2);
      const int64_t middle = length - c.n_sink - c.n_local;
      const uint64_t kind = rng() % 4;
      const int64_t budget = kind == 0   ? 1
                             : kind == 1 ? length  // past the middle: the whole middle
                             : kind == 2 ? middle
                                         : 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(middle));
      const std::vector<float> q =
          random_vector(static_cast<size_t>(c.n_q_heads) * kDim, 9000 + static_cast<uint64_t>(step), 2.0f);
      const int64_t h2d = stats_of(a).bytes_h2d;
      const bool scored = rng() % 2 == 0;
      const int64_t width = std::min(budget, middle) + static_cast<int64_t>(rng() % 3);
      const Selected x = select(a, KVRET_DEVICE_CUDA, layer, q, static_cast<int32_t>(budget), width, scored);
      const Selected y = select(b, KVRET_DEVICE_CPU, layer, q, static_cast<int32_t>(budget), width, scored);
      EXPECT_EQ(x.count, std::min(budget, middle)) << at;
      expect_same(x, y, at);
      if (::testing::Test::HasFatalFailure()) return selects;
      if (w.reads_keys) {
        const int64_t key_bytes = c.kv_dtype == KVRET_KV_F32 ? 4 : 2;
        EXPECT_EQ(stats_of(a).bytes_h2d - h2d, kHeads * middle * kDim * key_bytes)
            << at << ": the device read the keys";
        EXPECT_EQ(stats_of(a).device_bytes, 0) << at << ": no device copy";
      } else {
        EXPECT_GT(stats_of(a).device_bytes, 0) << at << ": the select ran on the device";
      }
      ++selects;
    }
  }
  return selects;
}

}  // namespace kvret::test::twin
