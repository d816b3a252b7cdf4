#pragma once
// Twin sequences for the suites that compare the CUDA backend with the CPU backend (KVRET_TEST_DEVICE=cuda; in CI
// the build on Thrust's OpenMP host system): the same calls on a sequence of a context with device_type CUDA (its
// tensors labelled CUDA) and on one of a context with device_type CPU, selects compared bit for bit, and a random
// walk of appends, truncates, drop_fronts, forks and saved sessions between selects. The geometry is
// test::small_config's: 8 query heads (or as many as q holds: select, walk), 2 KV heads, head_dim 64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "c_api/handles.hpp"
#include "engine/context.hpp"
#include "kvret.h"
#include "test_util.hpp"

namespace kvret::test::twin {

using test::F32;  // the tensors the twins take
using test::I32;

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

/// Random floats in [lo, hi), about one in 16 of them one of `specials` instead (each suite its own awkward values).
inline std::vector<float> awkward_floats(size_t n, uint64_t seed, float lo, float hi,
                                         const std::vector<float>& specials) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = rng() % 16 == 0 ? specials[rng() % specials.size()] : u(rng);
  return out;
}

/// The bytes of one stored key element of a `kv_dtype` store.
inline int64_t key_bytes(int kv_dtype) { return kv_dtype == KVRET_KV_F32 ? 4 : 2; }

/// A suite that runs only where the tests run on the CUDA backend (KVRET_TEST_DEVICE=cuda), and skips otherwise.
class OnDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::device_type() != KVRET_DEVICE_CUDA) GTEST_SKIP() << "run with KVRET_TEST_DEVICE=cuda";
    ASSERT_NE(kvret::cuda_backend_system(), nullptr) << "KVRET_TEST_DEVICE=cuda in a build without the CUDA backend";
  }
};

/// test::small_config(index_kind) for a context of `device_type`, kv_dtype kv and gqa_fold fold, its index built in
/// the foreground.
inline kvret_config twin_config(int index_kind, int32_t device_type, int kv, int fold) {
  kvret_config c = small_config(index_kind);
  c.device_type = device_type;
  c.kv_dtype = kv;
  c.gqa_fold = fold;
  c.background_build = 0;
  return c;
}

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

/// The same select (scored or not) of a (a sequence of a CUDA context) and b (of a CPU context), tensors labelled so:
/// the same positions and scores, bit for bit.
inline void expect_same_select(kvret_seq* a, kvret_seq* b, int32_t layer, const std::vector<float>& q, int32_t budget,
                               int64_t width, bool scored, const std::string& where) {
  expect_same(select(a, KVRET_DEVICE_CUDA, layer, q, budget, width, scored),
              select(b, KVRET_DEVICE_CPU, layer, q, budget, width, scored), where);
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
        EXPECT_EQ(stats_of(a).bytes_h2d - h2d, kHeads * middle * kDim * key_bytes(c.kv_dtype))
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

/// walk on twins of new contexts of dc (CUDA) and cc (CPU) that start with `tokens` random tokens (`seed`) in every
/// layer, its steps drawn by a generator seeded `rng_seed`; closes them unless a check failed fatally. Returns the
/// selects made.
inline int walk_twins(const kvret_config& dc, const kvret_config& cc, int64_t tokens, uint64_t seed, uint64_t rng_seed,
                      const Walk& w, const std::string& where) {
  auto dev_ctx = make_context(dc), cpu_ctx = make_context(cc);
  kvret_seq *a = nullptr, *b = nullptr;
  open_both(dev_ctx.get(), cpu_ctx.get(), a, b);
  append_both(a, b, dc.n_layers, tokens, seed);
  std::mt19937_64 rng(rng_seed);
  const int selects = walk(dev_ctx.get(), cpu_ctx.get(), a, b, dc, rng, w, where);
  if (::testing::Test::HasFatalFailure()) return selects;
  expect_ok(kvret_seq_close(a));
  expect_ok(kvret_seq_close(b));
  return selects;
}

/// How batch_equals_single_selects draws its sequences and what it checks besides the batch against single selects.
struct Batch {
  int q_heads = 8;
  int32_t budget = 30;
  int64_t width = 32;
  int64_t length_step = 37;  ///< sequence i holds 200 + length_step * i tokens ...
  uint64_t seed = 40;        ///< ... drawn from seed + i
  /// The kind keeps no device copy (EXACT): the device batch read every middle key over the bus (stats.bytes_h2d),
  /// the CPU one nothing; otherwise the device batch's sequences hold a copy (device_bytes > 0).
  bool reads_keys = false;
  bool single_on_each = false;    ///< the single selects on each backend's sequences (else all on the device's)
  bool compare_backends = false;  ///< the device batch's positions equal the CPU batch's
  /// The device batch ran as `select_sets` selects: that many times the device passes (Backend::device_passes) of
  /// the single select of its first sequence, though the sequences' middles differ in length.
  bool fused = false;
  int select_sets = 1;
  bool nan_first = false;  ///< the first (shortest) sequence's q is all NaN (check_finite off: it selects still)
};

/// The device passes the CUDA backends of the process have run (Backend::device_passes).
inline int64_t device_passes(kvret_context* ctx) { return context_from_handle(ctx)->backend().device_passes(); }

/// kvret_select_batch (layer 1) over 3 sequences of a context of `dc` (CUDA) and of `cc` (CPU) equals one select per
/// sequence.
inline void batch_equals_single_selects(const kvret_config& dc, const kvret_config& cc, const Batch& w) {
  constexpr int kSeqs = 3;
  auto dev_ctx = make_context(dc), cpu_ctx = make_context(cc);
  std::vector<kvret_seq*> a(kSeqs), b(kSeqs);
  for (size_t i = 0; i < kSeqs; ++i) {
    open_both(dev_ctx.get(), cpu_ctx.get(), a[i], b[i]);
    append_both(a[i], b[i], dc.n_layers, 200 + w.length_step * static_cast<int64_t>(i), w.seed + i);
  }
  const auto per_seq = static_cast<std::ptrdiff_t>(w.q_heads * kDim);
  F32 q({kSeqs, w.q_heads, kDim});
  q.data = random_vector(static_cast<size_t>(kSeqs * per_seq), 88, 2.0f);
  if (w.nan_first) std::fill(q.data.begin(), q.data.begin() + per_seq, std::numeric_limits<float>::quiet_NaN());
  q.refresh();
  std::vector<int32_t> results[2];
  for (const int32_t device_type : {KVRET_DEVICE_CUDA, KVRET_DEVICE_CPU}) {
    const bool dev = device_type == KVRET_DEVICE_CUDA;
    const std::vector<kvret_seq*>& seqs = dev ? a : b;
    std::vector<int64_t> h2d(kSeqs);
    if (w.reads_keys)
      for (size_t i = 0; i < kSeqs; ++i) h2d[i] = stats_of(seqs[i]).bytes_h2d;
    label(q, device_type);
    I32 out({kSeqs, kHeads, w.width}, -7);
    label(out, device_type);
    std::vector<int32_t> counts(kSeqs, -1);
    const int64_t passes_before = device_passes(dev_ctx.get());
    expect_ok(kvret_select_batch(dev ? dev_ctx.get() : cpu_ctx.get(), kSeqs, seqs.data(), 1, &q.t, w.budget, &out.t,
                                 counts.data()));
    const int64_t batch_passes = device_passes(dev_ctx.get()) - passes_before;
    results[dev ? 0 : 1] = out.data;
    for (size_t i = 0; i < kSeqs; ++i) {
      if (w.reads_keys) {
        const int64_t middle = length_of(seqs[i]) - dc.n_sink - dc.n_local;
        EXPECT_EQ(stats_of(seqs[i]).bytes_h2d - h2d[i], dev ? kHeads * middle * kDim * key_bytes(dc.kv_dtype) : 0)
            << "sequence " << i << ": " << (dev ? "selected on the device" : "no bus on the CPU backend");
      } else if (dev) {  // the batch selected on the device: its copy of the index is there
        EXPECT_GT(stats_of(seqs[i]).device_bytes, 0) << "sequence " << i;
      }
      const auto at = static_cast<std::ptrdiff_t>(i);
      const std::vector<float> qi(q.data.begin() + at * per_seq, q.data.begin() + (at + 1) * per_seq);
      const int64_t single_before = device_passes(dev_ctx.get());
      const Selected single = w.single_on_each ? select(seqs[i], device_type, 1, qi, w.budget, w.width, false)
                                               : select(a[i], KVRET_DEVICE_CUDA, 1, qi, w.budget, w.width, false);
      if (w.fused && dev && i == 0) {
        EXPECT_GT(batch_passes, 0) << "the batch ran on the device";
        EXPECT_EQ(batch_passes, w.select_sets * (device_passes(dev_ctx.get()) - single_before))
            << "the batch of " << kSeqs << " sequences ran the passes of " << w.select_sets << " select(s)";
      }
      ASSERT_EQ(counts[i], single.count);
      const auto n = static_cast<std::ptrdiff_t>(kHeads * w.width);
      const std::vector<int32_t> batched(out.data.begin() + at * n, out.data.begin() + (at + 1) * n);
      EXPECT_EQ(batched, single.positions) << "sequence " << i << " device " << device_type;
    }
  }
  if (w.compare_backends) {
    EXPECT_EQ(results[0], results[1]);
  }
  for (size_t i = 0; i < kSeqs; ++i) {
    expect_ok(kvret_seq_close(a[i]));
    expect_ok(kvret_seq_close(b[i]));
  }
}

}  // namespace kvret::test::twin
