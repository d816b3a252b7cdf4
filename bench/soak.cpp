// kvret-soak: a long decode through the C ABI, to see that a serving process stays healthy: every step appends one
// token to every layer, selects, fetches and (every `--edit-every` steps) rolls back two tokens or forks and closes
// a branch. At checkpoints it prints one JSON line: tokens, the mean microseconds per step since the last
// checkpoint, the process RSS, and the KV and index bytes kvret reports. At the end it closes everything and prints
// the RSS again (after malloc_trim, which returns the allocator's free pages).
//
//   build/bin/kvret-soak [--steps 100000] [--prefill 1024] [--layers 2] [--index pq|page|exact|streaming]
//                        [--checkpoints 10] [--edit-every 1000]
#include <malloc.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "host_tensor.hpp"
#include "kvret.h"

namespace {

#define SOAK_CHECK(call)                                                                                          \
  do {                                                                                                            \
    const kvret_status status_ = (call);                                                                          \
    if (status_ != KVRET_OK) {                                                                                    \
      std::fprintf(stderr, "kvret-soak: %s: %s (%s)\n", #call, kvret_status_string(status_), kvret_last_error()); \
      std::exit(1);                                                                                               \
    }                                                                                                             \
  } while (0)

double rss_mib() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
  std::fclose(f);
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

using Tensor = kvret::tools::HostTensor;

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 100000, prefill = 1024, checkpoints = 10, edit_every = 1000;
  int layers = 2;
  std::string index = "pq";
  static const char* const usage =
      "usage: kvret-soak [--steps N] [--prefill N] [--layers N] [--index pq|page|exact|streaming]\n"
      "                  [--checkpoints N] [--edit-every N]\n"
      "A long decode through the C ABI; one JSON line per checkpoint (tokens, microseconds per step, RSS, the KV\n"
      "and index bytes kvret reports). Defaults: --steps 100000 --prefill 1024 --layers 2 --index pq\n"
      "--checkpoints 10 --edit-every 1000.\n";
  // every argument is read (a lone --help included); a flag without its value or a value that is not a positive
  // number is refused before anything runs
  const auto number = [](const std::string& flag, const char* text, int64_t* out) {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || n < 1) {
      std::fprintf(stderr, "kvret-soak: %s needs a positive whole number, got '%s'\n", flag.c_str(), text);
      return false;
    }
    *out = n;
    return true;
  };
  int64_t layers64 = layers;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "kvret-soak: %s needs a value\n%s", flag.c_str(), usage);
      return 2;
    }
    const char* value = argv[++i];
    bool ok = true;
    if (flag == "--steps")
      ok = number(flag, value, &steps);
    else if (flag == "--prefill")
      ok = number(flag, value, &prefill);
    else if (flag == "--layers")
      ok = number(flag, value, &layers64);
    else if (flag == "--checkpoints")
      ok = number(flag, value, &checkpoints);
    else if (flag == "--edit-every")
      ok = number(flag, value, &edit_every);
    else if (flag == "--index") {
      index = value;
      ok = index == "pq" || index == "page" || index == "exact" || index == "streaming";
      if (!ok) std::fprintf(stderr, "kvret-soak: --index must be pq, page, exact or streaming, got '%s'\n", value);
    } else {
      std::fprintf(stderr, "kvret-soak: unknown flag %s\n%s", flag.c_str(), usage);
      return 2;
    }
    if (!ok) return 2;
  }
  if (layers64 > 4096) {
    std::fprintf(stderr, "kvret-soak: --layers must be at most 4096\n");
    return 2;
  }
  layers = static_cast<int>(layers64);
  constexpr kvret_dtype f32 = kvret::tools::kF32, i32 = kvret::tools::kI32;
  kvret_config c;
  SOAK_CHECK(kvret_config_init(&c));
  c.n_layers = layers;
  c.n_q_heads = 32;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.index_kind = index == "page"        ? KVRET_INDEX_PAGE
                 : index == "exact"     ? KVRET_INDEX_EXACT
                 : index == "streaming" ? KVRET_INDEX_STREAMING
                                        : KVRET_INDEX_PQ;
  c.budget = 256;
  kvret_context* ctx = nullptr;
  SOAK_CHECK(kvret_create(&c, &ctx));
  kvret_seq* seq = nullptr;
  SOAK_CHECK(kvret_seq_open(ctx, &seq));
  const int H = c.n_kv_heads, D = c.head_dim, HQ = c.n_q_heads;
  std::mt19937 rng(1);
  std::normal_distribution<float> n01;
  {
    std::vector<float> k(static_cast<size_t>(prefill * H * D)), v(k.size());
    for (auto& x : k) x = n01(rng);
    for (auto& x : v) x = n01(rng);
    Tensor kt(k.data(), {prefill, H, D}, f32), vt(v.data(), {prefill, H, D}, f32);
    for (int l = 0; l < layers; ++l) SOAK_CHECK(kvret_append_prefill(seq, l, &kt.t, &vt.t));
    SOAK_CHECK(kvret_wait_index(seq, -1));
  }
  std::vector<float> k1(static_cast<size_t>(H * D)), v1(k1.size()), q(static_cast<size_t>(HQ * D));
  Tensor kt(k1.data(), {H, D}, f32), vt(v1.data(), {H, D}, f32), qt(q.data(), {HQ, D}, f32);
  std::vector<int32_t> selected(static_cast<size_t>(H * c.budget));
  Tensor st(selected.data(), {H, c.budget}, i32);
  const int64_t capacity = c.n_sink + c.budget + c.n_local;
  std::vector<float> wk(static_cast<size_t>(H * capacity * D)), wv(wk.size());
  std::vector<int32_t> wp(static_cast<size_t>(H * capacity));
  Tensor wkt(wk.data(), {H, capacity, D}, f32), wvt(wv.data(), {H, capacity, D}, f32),
      wpt(wp.data(), {H, capacity}, i32);
  const kvret_working_set ws{wkt.t, wvt.t, wpt.t};
  const double rss_start = rss_mib();
  std::printf("{\"event\": \"start\", \"index\": \"%s\", \"layers\": %d, \"prefill\": %lld, \"rss_mib\": %.1f}\n",
              index.c_str(), layers, static_cast<long long>(prefill), rss_start);
  auto last = std::chrono::steady_clock::now();
  int64_t last_step = 0;
  // time in each call since the last checkpoint: the append must stay flat as the sequence grows; select scores
  // every middle token, so it grows with them
  using Clock = std::chrono::steady_clock;
  double append_us = 0, select_us = 0, fetch_us = 0;
  auto timed = [](double& total, auto&& call) {
    const auto t0 = Clock::now();
    call();
    total += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  };
  for (int64_t step = 1; step <= steps; ++step) {
    for (auto& x : k1) x = n01(rng);
    for (auto& x : v1) x = n01(rng);
    for (auto& x : q) x = n01(rng);
    for (int l = 0; l < layers; ++l) {
      timed(append_us, [&] { SOAK_CHECK(kvret_append_decode(seq, l, &kt.t, &vt.t)); });
      int32_t count = 0;
      timed(select_us, [&] { SOAK_CHECK(kvret_select(seq, l, &qt.t, KVRET_BUDGET_DEFAULT, &st.t, &count)); });
      int64_t rows = 0;
      timed(fetch_us, [&] { SOAK_CHECK(kvret_fetch_async(seq, l, &st.t, count, &ws, &rows, nullptr)); });
    }
    if (edit_every > 0 && step % edit_every == 0) {
      if ((step / edit_every) % 2 == 0) {  // a speculative draft of two tokens, rejected
        int64_t length = 0;
        SOAK_CHECK(kvret_seq_length(seq, 0, &length));
        for (int l = 0; l < layers; ++l) {
          SOAK_CHECK(kvret_append_decode(seq, l, &kt.t, &vt.t));
          SOAK_CHECK(kvret_append_decode(seq, l, &kt.t, &vt.t));
        }
        SOAK_CHECK(kvret_seq_truncate(seq, length));
      } else {  // a branch that decodes one token and is dropped
        kvret_seq* branch = nullptr;
        SOAK_CHECK(kvret_seq_fork(seq, &branch));
        for (int l = 0; l < layers; ++l) SOAK_CHECK(kvret_append_decode(branch, l, &kt.t, &vt.t));
        SOAK_CHECK(kvret_seq_close(branch));
      }
    }
    if (step % (steps / std::max<int64_t>(checkpoints, 1)) == 0 || step == steps) {
      const auto now = std::chrono::steady_clock::now();
      const auto n = static_cast<double>(step - last_step);
      const double us = std::chrono::duration<double, std::micro>(now - last).count() / n;
      last = now;
      last_step = step;
      kvret_stats s;
      SOAK_CHECK(kvret_stats_init(&s));
      SOAK_CHECK(kvret_seq_stats(seq, &s));
      int64_t length = 0;
      SOAK_CHECK(kvret_seq_length(seq, 0, &length));
      const struct mallinfo2 heap = mallinfo2();  // what glibc holds: in use (heap and mmapped), and free in its arenas
      std::printf(
          "{\"event\": \"checkpoint\", \"step\": %lld, \"tokens\": %lld, \"us_per_step\": %.1f, "
          "\"us_append\": %.2f, \"us_select\": %.1f, \"us_fetch\": %.1f, \"rss_mib\": %.1f, \"host_mib\": %.1f, "
          "\"index_mib\": %.2f, \"malloc_in_use_mib\": %.1f, \"malloc_free_mib\": %.1f}\n",
          static_cast<long long>(step), static_cast<long long>(length), us, append_us / n / layers,
          select_us / n / layers, fetch_us / n / layers, rss_mib(), static_cast<double>(s.host_bytes) / (1 << 20),
          static_cast<double>(s.index_bytes) / (1 << 20), static_cast<double>(heap.uordblks + heap.hblkhd) / (1 << 20),
          static_cast<double>(heap.fordblks) / (1 << 20));
      std::fflush(stdout);
      append_us = select_us = fetch_us = 0;
    }
  }
  SOAK_CHECK(kvret_seq_close(seq));
  SOAK_CHECK(kvret_destroy(ctx));
  const double rss_closed = rss_mib();
  malloc_trim(0);
  std::printf("{\"event\": \"end\", \"rss_mib_closed\": %.1f, \"rss_mib_trimmed\": %.1f}\n", rss_closed, rss_mib());
  return 0;
}
