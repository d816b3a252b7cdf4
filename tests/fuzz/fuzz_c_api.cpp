// libFuzzer target over the C API. The input is a program: a 20-byte header (a context configuration, most of them
// valid, and the seed of the generated keys, values and queries), then operations of 5 bytes each -- an opcode, a
// byte naming the sequence slot, the layer and two flags, and three argument bytes -- on up to four sequences. Every
// call of the C API that takes a sequence or a context is reached: open, close, append_prefill, append_decode, select,
// select_scored, select_batch, fetch_async, fetch_batch_async, prefetch_async, attend, seq_attend, retained_set,
// observe, observe_attention, truncate, drop_front, fork, read, wait_index, the stats, and the session store (save,
// open, drop, where, flush, schedule) on a disk tier in a private directory of the process (emptied before each
// program) with a small DRAM tier, so that saved sessions go to disk and come back from it.
//
// Deep states by construction: an operation on an empty slot opens it first, and one that needs tokens in a layer
// prefills it first (unless the slot byte's 0x40 flag asks for the call as it is, to test the refusals); arguments are
// clamped to valid ranges most of the time and left raw now and then. A program appends at most 1024 tokens over all
// its sequences and makes at most 128 operations, so that executions stay fast.
//
// Every call must return a status (no crash, no abort: the sanitizers watch), never KVRET_ERR_INTERNAL, and these
// oracles hold (the harness models every sequence's stored keys and values):
//   - a selection (select, select_scored, retained_set) that succeeds is well formed: per head, count ascending,
//     distinct middle positions; the same select with scores returns the same positions, each with a score that is
//     not NaN when the stored keys are finite;
//   - a fetch that succeeds returns, for every row, the stored key and value of the position it names (the input
//     rounded to the KV dtype; the keys only when they are stored before RoPE), and the rows in position order;
//     kvret_seq_read returns the stored keys and values likewise;
//   - a batched fetch that is refused (always when a count is broken) writes no working set and no row count;
//   - truncate and drop_front leave every layer at the length the model says, a fork holds its source's lengths, and
//     an attention over values of 1 (or over a sequence's stored values) is a convex combination of them;
//   - a session that opens holds the lengths it was saved with; one the harness never saved successfully (or dropped)
//     is in no tier.
// A violated oracle calls __builtin_trap, which libFuzzer reports with the input.
// With KVRET_FUZZ_STATS set, the process prints at exit how many times each call was made and returned KVRET_OK;
// with KVRET_FUZZ_DEBUG set, every refused call prints kvret's message (to see why a call's OK share is low).
// Build: cmake -DKVRET_BUILD_FUZZ=ON with clang (scripts/fuzz.sh). Corpus: tests/fuzz/corpus.
#ifndef KVRET_EXPERIMENTAL
#define KVRET_EXPERIMENTAL
#endif
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "host_tensor.hpp"
#include "kvret.h"

namespace {

#define FUZZ_CHECK(cond)           \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool empty() const { return p_ >= end_; }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  uint8_t u8() { return p_ < end_ ? *p_++ : 0; }
  uint32_t u32() {
    uint32_t x = 0;
    for (int i = 0; i < 4; ++i) x = x << 8 | u8();
    return x;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

using Tensor = kvret::tools::HostTensor;
using kvret::tools::kF32;
using kvret::tools::kI32;

/// The stored value of x in the context's KV dtype, as f32.
float stored(float x, int kv_dtype) {
  if (kv_dtype == KVRET_KV_F16) return kvret::f16_to_f32(kvret::f32_to_f16(x));
  if (kv_dtype == KVRET_KV_BF16) return kvret::bf16_to_f32(kvret::f32_to_bf16(x));
  return x;
}

bool same_bits(float a, float b) {
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

/// What the harness knows a sequence holds: per layer [tokens, n_kv, d] keys and values as stored (rounded).
struct Model {
  std::vector<std::vector<float>> k, v;
};

struct Seq {
  kvret_seq* handle = nullptr;
  Model m;
  std::vector<std::vector<int32_t>> selection;  // per layer: the last successful select [n_kv, count]
  std::vector<int32_t> count;
};

/// Calls made and calls that returned KVRET_OK, per kind; printed at exit when KVRET_FUZZ_STATS is set.
enum Call {
  kProgram,
  kCreate,
  kOpen,
  kClose,
  kPrefill,
  kDecode,
  kSelect,
  kSelectScored,
  kFetch,
  kBatch,
  kFetchBatch,
  kPrefetch,
  kAttend,
  kSeqAttend,
  kRetained,
  kObserve,
  kObserveAttention,
  kTruncate,
  kDropFront,
  kFork,
  kRead,
  kWaitIndex,
  kStats,
  kSave,
  kSessionOpen,
  kSessionDrop,
  kSessionWhere,
  kSessionFlush,
  kSessionSchedule,
  kCalls
};
const char* const kCallNames[kCalls] = {
    "programs",     "create",        "open",          "close",         "prefill",      "decode",
    "select",       "select_scored", "fetch",         "select_batch",  "fetch_batch",  "prefetch",
    "attend",       "seq_attend",    "retained_set",  "observe",       "observe_attn", "truncate",
    "drop_front",   "fork",          "read",          "wait_index",    "stats",        "session_save",
    "session_open", "session_drop",  "session_where", "session_flush", "session_sched"};
uint64_t g_made[kCalls], g_ok[kCalls];

kvret_status tally(Call call, kvret_status status) {
  ++g_made[call];
  g_ok[call] += status == KVRET_OK;
  if (status != KVRET_OK && std::getenv("KVRET_FUZZ_DEBUG"))
    std::fprintf(stderr, "%s: %s\n", kCallNames[call], kvret_last_error());
  FUZZ_CHECK(status != KVRET_ERR_INTERNAL);  // a bug in kvret by its own definition
  return status;
}

void print_stats() {
  for (int i = 0; i < kCalls; ++i)
    std::fprintf(stderr, "kvret-fuzz %-14s %10llu calls %10llu OK %5.1f%%\n", kCallNames[i],
                 static_cast<unsigned long long>(g_made[i]), static_cast<unsigned long long>(g_ok[i]),
                 g_made[i] ? 100.0 * static_cast<double>(g_ok[i]) / static_cast<double>(g_made[i]) : 0.0);
}

/// The disk tier's directory: private to the process, emptied before each program.
std::string g_dir;

void empty_dir() {
  DIR* d = ::opendir(g_dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d))
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.emplace_back(e->d_name);
  ::closedir(d);
  for (const std::string& n : names) ::unlink((g_dir + "/" + n).c_str());
}

void remove_dir() {
  empty_dir();
  ::rmdir(g_dir.c_str());
}

constexpr int kSlots = 4;
constexpr int64_t kMaxProgramTokens = 1024;
constexpr int kMaxOps = 128;

class Program {
 public:
  explicit Program(Reader& r) : r_(r) {}
  void run();

 private:
  int64_t length(const Seq& s, int32_t layer) const {
    return static_cast<int64_t>(s.m.k[static_cast<size_t>(layer)].size()) / (H_ * D_);
  }
  void reset(Seq& s, kvret_seq* handle) {
    s = Seq{};
    s.handle = handle;
    s.m.k.assign(static_cast<size_t>(L_), {});
    s.m.v.assign(static_cast<size_t>(L_), {});
    s.selection.assign(static_cast<size_t>(L_), {});
    s.count.assign(static_cast<size_t>(L_), 0);
  }
  void check_lengths(const Seq& s) {
    for (int32_t l = 0; l < L_; ++l) {
      int64_t tokens = -1;
      FUZZ_CHECK(kvret_seq_length(s.handle, l, &tokens) == KVRET_OK && tokens == length(s, l));
    }
  }
  std::vector<float> queries(size_t n) {
    std::vector<float> q(n);
    for (float& x : q) x = static_cast<float>(static_cast<int64_t>(splitmix(rng_) % 201) - 100) / 50.0f;
    return q;
  }
  /// A budget: mostly one the layer can give (the default, or 1..64 cut to the layer's length), now and then raw.
  int32_t budget_of(uint8_t a, uint8_t b, uint8_t c, int64_t len) const {
    const int choice = a % 8;
    if (choice == 0) return KVRET_BUDGET_DEFAULT;
    if (choice == 7) return static_cast<int32_t>(static_cast<int8_t>(b)) * 1000 + c;
    int32_t budget = 1 + b % 64;
    if (choice != 6 && len > 0) budget = static_cast<int32_t>(std::min<int64_t>(budget, len));
    return budget;
  }
  /// Checks a selection: per head, count ascending middle positions (stride `width`).
  void check_selection(const std::vector<int32_t>& out, int32_t width, int32_t n_out, int32_t budget, int64_t len) {
    const int64_t mid_begin = std::min<int64_t>(c_.n_sink, len);
    const int64_t mid_end = std::max<int64_t>(mid_begin, len - c_.n_local);
    FUZZ_CHECK(n_out >= 0 && n_out <= mid_end - mid_begin && (budget < 0 || n_out <= budget));
    for (int h = 0; h < H_; ++h)
      for (int32_t i = 0; i < n_out; ++i) {
        const int32_t p = out[static_cast<size_t>(h) * width + i];
        FUZZ_CHECK(p >= mid_begin && p < mid_end);
        FUZZ_CHECK(i == 0 || p > out[static_cast<size_t>(h) * width + i - 1]);
      }
  }

  bool append(Seq& s, int32_t layer, int64_t tokens, bool decode, uint8_t special);
  void prefill_if_empty(Seq& s, int32_t layer, uint8_t a);
  void op_select(Seq& s, int32_t layer, uint8_t a, uint8_t b, uint8_t c);
  void op_fetch(Seq& s, int32_t layer);
  void op_batch(int32_t layer, uint8_t a, uint8_t b, uint8_t c);
  void op_attend(Seq& s, int32_t layer, uint8_t a, uint8_t b);
  void op_truncate(Seq& s, uint8_t a, uint8_t b);
  void op_drop_front(Seq& s, uint8_t a, uint8_t b, uint8_t c);
  void op_fork(Seq& s, uint8_t c);
  void op_retained(Seq& s, int32_t layer, uint8_t a, uint8_t b, uint8_t c);
  void op_observe(Seq& s, int32_t layer, uint8_t a, uint8_t b);
  void op_observe_attention(Seq& s, int32_t layer, uint8_t a, uint8_t b);
  void op_prefetch(Seq& s, int32_t layer, uint8_t a, uint8_t b, uint8_t c);
  void op_read(Seq& s, int32_t layer, uint8_t a, uint8_t b, uint8_t c);
  std::string session_id(uint8_t a) const {
    if (a % 16 == 14) return "";
    if (a % 16 == 15) return std::string(300, 'x');  // longer than an id may be
    return "s" + std::to_string(a % 4);
  }

  Reader& r_;
  kvret_config c_{};
  kvret_context* ctx_ = nullptr;
  int H_ = 0, D_ = 0, L_ = 0;
  Seq seqs_[kSlots];
  uint64_t rng_ = 0;
  int64_t tokens_left_ = kMaxProgramTokens;
  std::map<std::string, Model> saved_;  // the sessions saved (and not dropped) in this program
};

bool Program::append(Seq& s, int32_t layer, int64_t tokens, bool decode, uint8_t special) {
  if (tokens > tokens_left_) {  // the program's budget of tokens (a prefill of 0 tokens is still made)
    if (tokens_left_ == 0) return false;
    tokens = tokens_left_;
  }
  std::vector<float> k(static_cast<size_t>(tokens * H_ * D_)), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(static_cast<int64_t>(splitmix(rng_) % 2001) - 1000) / 250.0f;
    v[i] = static_cast<float>(static_cast<int64_t>(splitmix(rng_) % 2001) - 1000) / 250.0f;
  }
  if (special < 8 && !k.empty()) k[special % k.size()] = special % 2 ? 1e30f : -0.0f;
  Tensor kt(k.data(), decode ? std::vector<int64_t>{H_, D_} : std::vector<int64_t>{tokens, H_, D_}, kF32);
  Tensor vt(v.data(), kt.shape, kF32);
  const kvret_status st = decode ? tally(kDecode, kvret_append_decode(s.handle, layer, &kt.t, &vt.t))
                                 : tally(kPrefill, kvret_append_prefill(s.handle, layer, &kt.t, &vt.t));
  if (st != KVRET_OK) return false;
  tokens_left_ -= tokens;
  auto& mk = s.m.k[static_cast<size_t>(layer)];
  auto& mv = s.m.v[static_cast<size_t>(layer)];
  for (float x : k) mk.push_back(stored(x, c_.kv_dtype));
  for (float x : v) mv.push_back(stored(x, c_.kv_dtype));
  return true;
}

void Program::prefill_if_empty(Seq& s, int32_t layer, uint8_t a) {
  if (length(s, layer) == 0) append(s, layer, c_.n_sink + c_.n_local + 24 + a % 64, false, 0xff);
}

void Program::op_select(Seq& s, int32_t layer, uint8_t a, uint8_t b, uint8_t c) {
  const int64_t len = length(s, layer);
  const int32_t budget = budget_of(a, b, c, len);
  std::vector<float> q = queries(static_cast<size_t>(c_.n_q_heads * D_));
  int32_t cap = 0;
  if (kvret_seq_budget(s.handle, layer, &cap) != KVRET_OK) cap = 0;
  const int32_t width = std::max<int32_t>({1, budget, cap});
  if (width > (1 << 20)) return;
  std::vector<int32_t> out(static_cast<size_t>(H_) * width, -1);
  Tensor qt(q.data(), {c_.n_q_heads, D_}, kF32), ot(out.data(), {H_, width}, kI32);
  int32_t n_out = -1;
  if (tally(kSelect, kvret_select(s.handle, layer, &qt.t, budget, &ot.t, &n_out)) != KVRET_OK) return;
  check_selection(out, width, n_out, budget, len);
  auto& sel = s.selection[static_cast<size_t>(layer)];
  sel.assign(static_cast<size_t>(H_) * n_out, 0);
  for (int h = 0; h < H_; ++h)
    std::copy_n(out.begin() + static_cast<int64_t>(h) * width, n_out, sel.begin() + static_cast<int64_t>(h) * n_out);
  s.count[static_cast<size_t>(layer)] = n_out;
  // the same select with scores: the same positions, and a number for each when the stored keys are finite (a key
  // past the f16 range is stored as infinity, and 0 * infinity is NaN; rotating keys mixes them in too)
  if (c % 4 != 0) return;
  const auto& keys = s.m.k[static_cast<size_t>(layer)];
  const bool finite = std::all_of(keys.begin(), keys.end(), [](float x) { return std::isfinite(x); });
  std::vector<int32_t> again(out.size(), -1);
  std::vector<float> scores(out.size(), 0.0f);
  Tensor at(again.data(), {H_, width}, kI32), st(scores.data(), {H_, width}, kF32);
  int32_t n_again = -1;
  if (tally(kSelectScored, kvret_select_scored(s.handle, layer, &qt.t, budget, &at.t, &st.t, &n_again)) != KVRET_OK)
    return;
  FUZZ_CHECK(n_again == n_out);
  for (int h = 0; h < H_; ++h)
    for (int32_t i = 0; i < n_out; ++i) {
      const size_t at_i = static_cast<size_t>(h) * width + i;
      FUZZ_CHECK(again[at_i] == out[at_i] && !(finite && std::isnan(scores[at_i])));
    }
}

void Program::op_fetch(Seq& s, int32_t layer) {
  const int32_t count = s.count[static_cast<size_t>(layer)];
  int64_t capacity = 0;
  if (kvret_working_set_capacity(s.handle, layer, count, &capacity) != KVRET_OK) return;
  std::vector<float> wk(static_cast<size_t>(H_ * capacity * D_)), wv(wk.size());
  std::vector<int32_t> wp(static_cast<size_t>(H_ * capacity));
  std::vector<int32_t> sel = s.selection[static_cast<size_t>(layer)];
  if (sel.empty()) sel.assign(1, 0);
  Tensor kt(wk.data(), {H_, capacity, D_}, kF32), vt(wv.data(), {H_, capacity, D_}, kF32),
      pt(wp.data(), {H_, capacity}, kI32), st(sel.data(), {H_, std::max(count, 1)}, kI32);
  kvret_working_set ws{kt.t, vt.t, pt.t};
  int64_t rows = -1;
  if (tally(kFetch, kvret_fetch_async(s.handle, layer, &st.t, count, &ws, &rows, nullptr)) != KVRET_OK) return;
  const auto& sk = s.m.k[static_cast<size_t>(layer)];
  const auto& sv = s.m.v[static_cast<size_t>(layer)];
  const int64_t len = length(s, layer);
  FUZZ_CHECK(rows >= 0 && rows <= capacity && rows <= len);
  for (int h = 0; h < H_; ++h)
    for (int64_t i = 0; i < rows; ++i) {
      const int32_t p = wp[static_cast<size_t>(h * capacity + i)];
      FUZZ_CHECK(p >= 0 && p < len);
      FUZZ_CHECK(i == 0 || p > wp[static_cast<size_t>(h * capacity + i - 1)]);
      for (int d = 0; d < D_; ++d) {
        const size_t src = (static_cast<size_t>(p) * H_ + static_cast<size_t>(h)) * D_ + d;
        const size_t dst = (static_cast<size_t>(h) * capacity + static_cast<size_t>(i)) * D_ + d;
        FUZZ_CHECK(same_bits(wv[dst], sv[src]) && (c_.rope_keys || same_bits(wk[dst], sk[src])));
      }
    }
}

void Program::op_batch(int32_t layer, uint8_t a, uint8_t b, uint8_t c) {
  // the open sequences with tokens past the sink and local windows in this layer (now and then every open one)
  const bool all = a % 8 == 7;
  std::vector<kvret_seq*> open;
  for (Seq& x : seqs_)
    if (x.handle && (all || length(x, layer) > c_.n_sink + c_.n_local + 8)) open.push_back(x.handle);
  if (open.empty()) return;
  const int32_t n = static_cast<int32_t>(open.size());
  const int32_t budget = 1 + b % 8;
  std::vector<float> q(static_cast<size_t>(n * c_.n_q_heads * D_), 0.25f);
  std::vector<int32_t> out(static_cast<size_t>(n * H_ * budget)), counts(static_cast<size_t>(n));
  Tensor qt(q.data(), {n, c_.n_q_heads, D_}, kF32), ot(out.data(), {n, H_, budget}, kI32);
  if (tally(kBatch, kvret_select_batch(ctx_, n, open.data(), layer, &qt.t, budget, &ot.t, counts.data())) != KVRET_OK ||
      c % 8 == 7)
    return;
  // the batched fetch of that selection, now and then with one count broken: a refused batch writes nothing
  const int32_t broken = c % 8 == 6 ? static_cast<int32_t>((c >> 3) % n) : -1;
  if (broken >= 0) counts[static_cast<size_t>(broken)] = c & 0x80 ? -1 : 1 << 20;
  std::vector<std::vector<float>> wk(open.size()), wv(open.size());
  std::vector<std::vector<int32_t>> wp(open.size());
  std::vector<Tensor> views;
  views.reserve(3 * open.size());
  std::vector<kvret_working_set> outs;
  for (size_t i = 0; i < open.size(); ++i) {
    int64_t capacity = 0;
    if (kvret_working_set_capacity(open[i], layer, budget, &capacity) != KVRET_OK) capacity = 1;
    wk[i].assign(static_cast<size_t>(H_ * capacity * D_), -3.0f);
    wv[i].assign(wk[i].size(), -3.0f);
    wp[i].assign(static_cast<size_t>(H_ * capacity), -3);
    views.emplace_back(wk[i].data(), std::vector<int64_t>{H_, capacity, D_}, kF32);
    views.emplace_back(wv[i].data(), std::vector<int64_t>{H_, capacity, D_}, kF32);
    views.emplace_back(wp[i].data(), std::vector<int64_t>{H_, capacity}, kI32);
    outs.push_back({views[3 * i].t, views[3 * i + 1].t, views[3 * i + 2].t});
  }
  std::vector<int64_t> rows(open.size(), -3);
  const kvret_status st = tally(kFetchBatch, kvret_fetch_batch_async(ctx_, n, open.data(), layer, &ot.t, counts.data(),
                                                                     outs.data(), rows.data(), nullptr));
  if (broken >= 0) FUZZ_CHECK(st != KVRET_OK);
  if (st != KVRET_OK) {
    for (size_t i = 0; i < open.size(); ++i) {
      FUZZ_CHECK(rows[i] == -3);
      for (int32_t p : wp[i]) FUZZ_CHECK(p == -3);
      for (float x : wk[i]) FUZZ_CHECK(x == -3.0f);
    }
  } else {
    for (size_t i = 0; i < open.size(); ++i)
      FUZZ_CHECK(rows[i] >= counts[i] && (rows[i] == 0 || wp[i][0] != -3));  // no rows: maybe no buffer
  }
}

void Program::op_attend(Seq& s, int32_t layer, uint8_t a, uint8_t b) {
  const int64_t rows = a % 40;
  std::vector<float> q(static_cast<size_t>(c_.n_q_heads * D_), 0.5f),
      k(static_cast<size_t>(H_ * std::max<int64_t>(rows, 1) * D_), 0.1f), v(k.size(), 1.0f),
      o(static_cast<size_t>(c_.n_q_heads * D_));
  Tensor qt(q.data(), {c_.n_q_heads, D_}, kF32), kt(k.data(), {H_, std::max<int64_t>(rows, 1), D_}, kF32),
      vt(v.data(), kt.shape, kF32), ot(o.data(), {c_.n_q_heads, D_}, kF32);
  // values all 1: every output is a convex combination of ones
  if (a % 4 == 3) {
    if (tally(kAttend, kvret_attend(ctx_, &qt.t, &kt.t, &vt.t, rows, 0.0f, &ot.t, nullptr)) == KVRET_OK && rows > 0)
      for (float x : o) FUZZ_CHECK(x > 0.9999f && x < 1.0001f);
    return;
  }
  // over a sequence's working set: every output is a convex combination of stored values (|v| <= 4)
  if (!s.handle) return;
  const int32_t budget = b & 1 ? static_cast<int32_t>(b >> 1) % 64 : KVRET_BUDGET_DEFAULT;  // 0 now and then
  if (tally(kSeqAttend, kvret_seq_attend(s.handle, layer, &qt.t, budget, 0.0f, &ot.t, nullptr)) == KVRET_OK)
    for (float x : o) FUZZ_CHECK(!(x > 4.001f) && !(x < -4.001f));
}

void Program::op_truncate(Seq& s, uint8_t a, uint8_t b) {
  // mostly within the longest layer, now and then negative or far beyond
  int64_t longest = 0;
  for (int32_t l = 0; l < L_; ++l) longest = std::max(longest, length(s, l));
  const int pick = a % 16;
  const int64_t to = pick == 15   ? -static_cast<int64_t>(b) - 1
                     : pick == 14 ? longest + b
                                  : static_cast<int64_t>((b | (a >> 4) << 8) % (longest + 1));
  const kvret_status st = tally(kTruncate, kvret_seq_truncate(s.handle, to));
  FUZZ_CHECK(to >= 0 ? st == KVRET_OK || st == KVRET_ERR_OUT_OF_MEMORY : st == KVRET_ERR_INVALID_ARGUMENT);
  if (st != KVRET_OK) return;
  for (int32_t l = 0; l < L_; ++l) {
    const size_t keep = static_cast<size_t>(std::min<int64_t>(to, length(s, l))) * static_cast<size_t>(H_ * D_);
    s.m.k[static_cast<size_t>(l)].resize(keep);
    s.m.v[static_cast<size_t>(l)].resize(keep);
  }
  check_lengths(s);
}

void Program::op_drop_front(Seq& s, uint8_t a, uint8_t b, uint8_t c) {
  // keep: mostly the sink or a few tokens; count: mostly within the layer; now and then negative
  const int64_t keep = a % 16 == 15 ? -1 : (a % 4 == 0 ? c_.n_sink : a % 24);
  const int64_t count = c % 16 == 15 ? -static_cast<int64_t>(b) - 1 : static_cast<int64_t>(b) * (1 + c % 4);
  const kvret_status st = tally(kDropFront, kvret_seq_drop_front(s.handle, keep, count));
  if (keep < 0 || count < 0) {
    FUZZ_CHECK(st == KVRET_ERR_INVALID_ARGUMENT);
    return;
  }
  FUZZ_CHECK(st == KVRET_OK || st == KVRET_ERR_OUT_OF_MEMORY || st == KVRET_ERR_CAPACITY);
  if (st != KVRET_OK) return;
  const size_t row = static_cast<size_t>(H_ * D_);
  for (int32_t l = 0; l < L_; ++l) {
    const int64_t len = length(s, l);
    if (len <= keep || count == 0) continue;
    const int64_t end = std::min(len, keep + count);
    for (auto* m : {&s.m.k[static_cast<size_t>(l)], &s.m.v[static_cast<size_t>(l)]})
      m->erase(m->begin() + static_cast<int64_t>(static_cast<size_t>(keep) * row),
               m->begin() + static_cast<int64_t>(static_cast<size_t>(end) * row));
    s.selection[static_cast<size_t>(l)].clear();  // positions moved: the old selection names other tokens
    s.count[static_cast<size_t>(l)] = 0;
  }
  check_lengths(s);
}

void Program::op_fork(Seq& s, uint8_t c) {
  Seq* slot = &seqs_[c % kSlots];
  if (slot == &s) {
    slot = nullptr;
    for (Seq& x : seqs_)
      if (!x.handle) slot = &x;
    if (!slot) return;
  }
  if (slot->handle) {
    FUZZ_CHECK(tally(kClose, kvret_seq_close(slot->handle)) == KVRET_OK);
    slot->handle = nullptr;
  }
  kvret_seq* forked = nullptr;
  const kvret_status st = tally(kFork, kvret_seq_fork(s.handle, &forked));
  FUZZ_CHECK(st == KVRET_OK ? forked != nullptr : forked == nullptr);
  if (st != KVRET_OK) return;
  *slot = s;
  slot->handle = forked;
  check_lengths(*slot);
}

void Program::op_retained(Seq& s, int32_t layer, uint8_t a, uint8_t b, uint8_t c) {
  const int64_t len = length(s, layer);
  const int32_t budget = budget_of(a, b, c, len);
  int32_t cap = 0;
  if (kvret_seq_budget(s.handle, layer, &cap) != KVRET_OK) cap = 0;
  const int32_t width = std::max<int32_t>({1, budget, cap});
  if (width > (1 << 20)) return;
  std::vector<int32_t> out(static_cast<size_t>(H_) * width, -1);
  Tensor ot(out.data(), {H_, width}, kI32);
  int32_t n_out = -1;
  if (tally(kRetained, kvret_seq_retained_set(s.handle, layer, budget, &ot.t, &n_out)) == KVRET_OK)
    check_selection(out, width, n_out, budget, len);
}

void Program::op_observe(Seq& s, int32_t layer, uint8_t a, uint8_t b) {
  const int64_t len = length(s, layer);
  const int64_t w = b % 16 == 15 ? len + 1 : 1 + a % std::max<int64_t>(1, std::min<int64_t>(len, 48));
  if (w > 64) return;
  std::vector<float> q = queries(static_cast<size_t>(w * c_.n_q_heads * D_));
  Tensor qt(q.data(), {w, c_.n_q_heads, D_}, kF32);
  tally(kObserve, kvret_seq_observe(s.handle, layer, &qt.t));
}

void Program::op_observe_attention(Seq& s, int32_t layer, uint8_t a, uint8_t b) {
  const int64_t len = length(s, layer);
  const int64_t n = b % 16 == 15 ? len + 1 : 1 + static_cast<int64_t>(a | (b & 7) << 8) % std::max<int64_t>(1, len);
  std::vector<float> probs(static_cast<size_t>(c_.n_q_heads * n));
  for (float& p : probs) p = static_cast<float>(splitmix(rng_) % 1000) / 1000.0f;
  if (b % 16 == 14 && !probs.empty()) probs[a % probs.size()] = -1.0f;  // refused, naming head and position
  Tensor pt(probs.data(), {c_.n_q_heads, n}, kF32);
  tally(kObserveAttention, kvret_seq_observe_attention(s.handle, layer, &pt.t));
}

void Program::op_prefetch(Seq& s, int32_t layer, uint8_t a, uint8_t b, uint8_t c) {
  const int32_t budget = budget_of(a, b, c, length(s, layer));
  std::vector<float> q = queries(static_cast<size_t>(c_.n_q_heads * D_));
  Tensor qt(q.data(), {c_.n_q_heads, D_}, kF32);
  tally(kPrefetch, kvret_prefetch_async(s.handle, layer, &qt.t, budget, nullptr));
}

void Program::op_read(Seq& s, int32_t layer, uint8_t a, uint8_t b, uint8_t c) {
  const int64_t len = length(s, layer);
  int64_t begin = a % (len + 1);
  int64_t end = begin + b % (len - begin + 1);
  if (c % 16 == 15) end = len + 1 + c / 16;  // past the end
  if (c % 16 == 14) std::swap(begin, end);   // reversed
  const int64_t rows = std::max<int64_t>(end - begin, 0);
  std::vector<float> k(static_cast<size_t>(std::max<int64_t>(rows, 1) * H_ * D_), -3.0f), v(k.size(), -3.0f);
  Tensor kt(k.data(), {rows, H_, D_}, kF32), vt(v.data(), kt.shape, kF32);
  if (tally(kRead, kvret_seq_read(s.handle, layer, begin, end, &kt.t, &vt.t)) != KVRET_OK) return;
  FUZZ_CHECK(begin >= 0 && begin <= end && end <= len);
  const auto& sk = s.m.k[static_cast<size_t>(layer)];
  const auto& sv = s.m.v[static_cast<size_t>(layer)];
  const size_t off = static_cast<size_t>(begin * H_ * D_);
  for (size_t i = 0; i < static_cast<size_t>(rows * H_ * D_); ++i)
    FUZZ_CHECK(same_bits(v[i], sv[off + i]) && (c_.rope_keys || same_bits(k[i], sk[off + i])));
}

void Program::run() {
  // the header: the configuration (20 bytes with the seed)
  kvret_config_init(&c_);
  uint8_t h[16];
  for (uint8_t& x : h) x = r_.u8();
  c_.n_layers = 1 + (h[0] & 1);
  c_.n_kv_heads = 1 + (h[0] >> 1 & 1);
  c_.n_q_heads = c_.n_kv_heads * (1 + (h[0] >> 2) % 3);
  const int dims[] = {64, 128, 64, 256, 64};  // the sizes kvret accepts, 64 most often (fast)
  c_.head_dim = dims[h[1] % 5];
  c_.kv_dtype = h[2] % 3;
  const int kinds[] = {KVRET_INDEX_EXACT, KVRET_INDEX_PQ,      KVRET_INDEX_PAGE, KVRET_INDEX_STREAMING,
                       KVRET_INDEX_PQ,    KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT};
  c_.index_kind = kinds[h[3] % 7];
  c_.n_sink = h[4] % 6;
  c_.n_local = h[5] % 12;
  c_.pq_m = 1 << (h[6] % 3);  // 1, 2, 4: divides every head_dim above
  c_.pq_bits = 1 + (h[6] >> 2) % 6;
  c_.pq_train_sample = 0;
  c_.pq_iters = 1 + h[7] % 3;  // a few k-means iterations keep an input fast
  c_.pq_exact_fraction = static_cast<float>((h[7] >> 2) % 4) * 0.05f;
  c_.page_size = 1 + h[8] % 20;
  c_.budget_ratio = 0.05f + static_cast<float>(h[9] % 20) * 0.05f;
  c_.gqa_fold = h[10] & 1;
  c_.n_threads = 1 + (h[10] >> 1 & 1);
  c_.background_build = h[10] >> 2 & 1;
  c_.check_finite = h[10] >> 3 & 1;
  c_.rope_keys = h[10] >> 4 & 1;
  const bool disk = (h[10] >> 5 & 1) == 0;
  if (h[10] & 0x40) c_.hamming_fraction = 0.25f;  // KVCrush: a select spends a quarter on representatives
  if (h[10] & 0x80) c_.hamming_importance = KVRET_IMPORTANCE_ACCUMULATED;
  c_.cluster_tokens = 1 + h[11] % 32;  // small clusters and intervals: a short program makes several
  c_.cluster_decode_interval = 1 + h[12] % 16;
  c_.cluster_decode_k = 1 + (h[12] >> 4) % 4;
  const int64_t dram[] = {0, 1, 4096, 65536};  // 1: every session is larger than the DRAM tier
  c_.session_dram_bytes = dram[h[13] % 4];
  c_.quant_bits = 1 + (h[13] >> 2 & 1);
  c_.quant_group_size = h[13] >> 3 & 1 ? 32 : 64;
  c_.quant_residual = (h[13] >> 4) % 4 * 8;
  c_.quant_rerank = h[13] >> 6 & 1 ? 1 : 4;
  c_.session_policy = h[15] % 3;
  c_.cluster_reuse_steps = (h[15] >> 2) % 3;
  if (disk) {
    empty_dir();  // a program sees only the sessions it saved
    c_.disk_path = g_dir.c_str();
  }
  if (h[14] % 16 == 15) {  // now and then an invalid config
    switch (h[15] >> 4) {
      case 0:
        c_.head_dim = static_cast<int32_t>(h[14]) - 8;
        break;
      case 1:
        c_.n_q_heads = c_.n_kv_heads * 3 + 1;
        break;
      case 2:
        c_.pq_m = 3;
        break;
      case 3:
        c_.page_size = 0;
        break;
      case 4:
        c_.session_dram_bytes = -1;
        break;
      case 5:
        c_.quant_group_size = 48;
        break;
      case 6:
        c_.hamming_fraction = 1.0f;
        break;
      default:
        c_.index_kind = 6 + h[14] / 16;
        break;
    }
  }
  rng_ = r_.u32();
  if (tally(kCreate, kvret_create(&c_, &ctx_)) != KVRET_OK) {
    if (std::getenv("KVRET_FUZZ_DEBUG")) std::fprintf(stderr, "create: %s\n", kvret_last_error());
    FUZZ_CHECK(ctx_ == nullptr);
    return;
  }
  H_ = c_.n_kv_heads;
  D_ = c_.head_dim;
  L_ = c_.n_layers;

  for (int step = 0; step < kMaxOps && r_.left() >= 1; ++step) {
    const uint8_t op = r_.u8() % 24, sl = r_.u8(), a = r_.u8(), b = r_.u8(), c = r_.u8();
    Seq& s = seqs_[sl % kSlots];
    int32_t layer = (sl >> 2) % L_;
    const bool raw = (sl & 0x40) != 0;  // the call as it is: no implicit open or prefill
    // the calls on a sequence: an empty slot is opened first
    const bool on_seq = op >= 2 && op != 18 && op < 20;
    if (on_seq && !s.handle) {
      if (raw) continue;
      kvret_seq* handle = nullptr;
      FUZZ_CHECK(tally(kOpen, kvret_seq_open(ctx_, &handle)) == KVRET_OK);
      reset(s, handle);
    }
    // the calls on a layer's tokens: an empty layer is prefilled first (or another layer holding tokens is taken)
    const bool on_tokens = on_seq && op != 2 && op != 8 && op != 9 && op != 10 && op != 11 && op != 17;
    if (on_tokens && !raw && length(s, layer) == 0) {
      for (int32_t other = 0; other < L_; ++other)
        if (length(s, other) > 0) layer = other;
      prefill_if_empty(s, layer, a);
    }
    switch (op) {
      case 0: {  // open (or reopen)
        if (s.handle) FUZZ_CHECK(tally(kClose, kvret_seq_close(s.handle)) == KVRET_OK);
        kvret_seq* handle = nullptr;
        FUZZ_CHECK(tally(kOpen, kvret_seq_open(ctx_, &handle)) == KVRET_OK);
        reset(s, handle);
        break;
      }
      case 1:  // close
        if (s.handle) FUZZ_CHECK(tally(kClose, kvret_seq_close(s.handle)) == KVRET_OK);
        s = Seq{};
        break;
      case 2:  // prefill: tokens from the generator, now and then a special key
        append(s, layer, b & 0x80 ? a % 8 : a + ((b & 3) << 8), false, c);
        break;
      case 3: {  // decodes: a run of them
        if (length(s, layer) == 0) append(s, layer, c_.n_sink + c_.n_local + 24, false, 0xff);
        for (int i = 0, n = 1 + a % 32; i < n; ++i)
          if (!append(s, layer, 1, true, i == 0 ? c : 0xff)) break;
        break;
      }
      case 4:
        op_select(s, layer, a, b, c);
        break;
      case 5: {  // fetch the last selection (possibly stale), after a select now and then
        if (a % 4 == 1) op_select(s, layer, b, c, 0);
        op_fetch(s, layer);
        break;
      }
      case 6:
        op_observe(s, layer, a, b);
        break;
      case 7:
        op_attend(s, layer, a, b);
        break;
      case 8:
        op_truncate(s, a, b);
        break;
      case 9:
        op_drop_front(s, a, b, c);
        break;
      case 10:
        op_fork(s, c);
        break;
      case 11: {  // wait and stats
        FUZZ_CHECK(tally(kWaitIndex, kvret_wait_index(s.handle, a % 4 == 0 ? -1 : layer)) != KVRET_ERR_INVALID_HANDLE);
        kvret_stats st;
        kvret_stats_init(&st);
        FUZZ_CHECK(tally(kStats, kvret_seq_stats(s.handle, &st)) == KVRET_OK);
        int64_t tokens = 0;
        for (int32_t l = 0; l < L_; ++l) tokens += length(s, l);
        FUZZ_CHECK(st.tokens_stored == tokens && st.sequences == 1);
        kvret_stats_init(&st);
        FUZZ_CHECK(tally(kStats, kvret_context_stats(ctx_, &st)) == KVRET_OK);
        break;
      }
      case 12:
        op_retained(s, layer, a, b, c);
        break;
      case 13:
        op_observe_attention(s, layer, a, b);
        break;
      case 14:
        op_prefetch(s, layer, a, b, c);
        break;
      case 15:
        op_read(s, layer, a, b, c);
        break;
      case 16: {  // a decode step as an engine takes it: select, fetch, attend
        op_select(s, layer, a, b, c);
        op_fetch(s, layer);
        op_attend(s, layer, 0, b);
        break;
      }
      case 17: {  // save
        const std::string id = session_id(a);
        const kvret_status st = tally(kSave, kvret_session_save(s.handle, id.c_str()));
        if (st == KVRET_OK) saved_[id] = s.m;
        check_lengths(s);  // the sequence is unchanged
        break;
      }
      case 18: {  // open a saved session into a slot
        const std::string id = session_id(a);
        if (s.handle) {
          FUZZ_CHECK(tally(kClose, kvret_seq_close(s.handle)) == KVRET_OK);
          s = Seq{};
        }
        kvret_seq* handle = nullptr;
        const kvret_status st = tally(kSessionOpen, kvret_session_open(ctx_, id.c_str(), &handle));
        FUZZ_CHECK(st == KVRET_OK ? handle != nullptr : handle == nullptr);
        if (st != KVRET_OK) break;
        const auto it = saved_.find(id);
        FUZZ_CHECK(it != saved_.end());
        reset(s, handle);
        s.m = it->second;
        check_lengths(s);
        break;
      }
      case 19:
        op_batch(layer, a, b, c);
        break;
      case 20: {  // drop
        const std::string id = session_id(a);
        const kvret_status st = tally(kSessionDrop, kvret_session_drop(ctx_, id.c_str()));
        if (st == KVRET_OK) FUZZ_CHECK(saved_.erase(id) == 1);
        if (st == KVRET_OK || st == KVRET_ERR_NOT_FOUND) saved_.erase(id);
        break;
      }
      case 21: {  // where: a session never saved (or dropped) is in no tier
        const std::string id = session_id(a);
        int32_t tier = -1;
        if (tally(kSessionWhere, kvret_session_where(ctx_, id.c_str(), &tier)) == KVRET_OK)
          FUZZ_CHECK(tier >= KVRET_TIER_NONE && tier <= KVRET_TIER_SHARED &&
                     (saved_.count(id) != 0 || tier == KVRET_TIER_NONE));
        break;
      }
      case 22:  // flush
        tally(kSessionFlush, kvret_session_flush(ctx_));
        break;
      default: {  // the scheduler's queue: up to four ids
        std::string ids[4];
        const char* ptrs[4];
        const int n = a % 5;
        for (int i = 0; i < n; ++i) {
          ids[i] = session_id(static_cast<uint8_t>(b >> (2 * i) & 3));
          ptrs[i] = ids[i].c_str();
        }
        tally(kSessionSchedule, kvret_session_schedule(ctx_, ptrs, n));
        break;
      }
    }
  }
  FUZZ_CHECK(kvret_destroy(ctx_) == KVRET_OK);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (std::getenv("KVRET_FUZZ_STATS")) std::atexit(print_stats);
  const char* base = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  std::string dir = std::string(base) + "/kvret-fuzz-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) {
    std::perror("kvret-fuzz: mkdtemp");
    std::abort();
  }
  g_dir = dir;
  std::atexit(remove_dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ++g_made[kProgram];
  ++g_ok[kProgram];
  Reader r(data, size);
  Program p(r);
  p.run();
  return 0;
}
