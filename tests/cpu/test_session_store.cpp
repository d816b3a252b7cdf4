// The session store (kvret_session_*): byte-exact round trips through DRAM and disk for every index kind, a new
// context reopening the directory, crash safety (a writer killed with SIGKILL mid-save), damaged files, I/O errors,
// time-to-live, capacities, the three placement policies and every bad input.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.hpp"
#include "core/checksum.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "engine/context.hpp"
#include "engine/sequence.hpp"
#include "kvret.h"
#include "sequence_observer.hpp"
#include "session/blob_tier.hpp"
#include "session/session_store.hpp"
#include "test_util.hpp"

using namespace kvret::test;
namespace fs = std::filesystem;

namespace {

/// A fresh directory under the system's temporary directory, removed at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kvret-session-XXXXXX").string();
    char* p = ::mkdtemp(tmpl.data());
    EXPECT_NE(p, nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
};

/// The disk tier's lock file (".lock", kept in its directory while a context uses it, and left there after).
bool is_lock(const fs::directory_entry& e) { return e.path().filename() == ".lock"; }

/// True when the directory holds no file but the store's lock file (".lock", kept while a context uses it).
bool holds_no_files(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != ".lock") return false;
  return true;
}

int32_t where(kvret_context* ctx, const char* id) {
  int32_t tier = -1;
  EXPECT_EQ(kvret_session_where(ctx, id, &tier), KVRET_OK) << kvret_last_error();
  return tier;
}

kvret_stats context_stats(kvret_context* ctx) {
  kvret_stats s;
  kvret_stats_init(&s);
  EXPECT_EQ(kvret_context_stats(ctx, &s), KVRET_OK);
  return s;
}

/// A sequence holding tokens [begin, end) of k/v in every layer: a prefill of all but the last 12, then 12 decodes.
void fill(kvret_seq* s, const F32& k, const F32& v, int64_t begin, int64_t end) {
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(s, layer, k, v, begin, end - 12);
    decode(s, layer, k, v, end - 12, end);
  }
}

kvret_seq* open_session(kvret_context* ctx, const char* id) {
  kvret_seq* s = nullptr;
  EXPECT_EQ(kvret_session_open(ctx, id, &s), KVRET_OK) << kvret_last_error();
  return s;
}

/// The bytes the store counts for one session of `config` filled with tokens [begin, end).
int64_t session_size(kvret_config config, const F32& k, const F32& v, int64_t begin, int64_t end) {
  config.disk_path = nullptr;
  config.session_dram_bytes = 0;
  auto ctx = make_context(config);
  Seq s(ctx.get());
  fill(s.s, k, v, begin, end);
  EXPECT_EQ(kvret_session_save(s.s, "measure"), KVRET_OK) << kvret_last_error();
  return context_stats(ctx.get()).session_dram_bytes;
}

// ---------------------------------------------------------------------------------------------------------------
// Round trips for every index kind

class SessionRoundTrip : public ::testing::TestWithParam<int> {
 protected:
  SessionRoundTrip() : config(small_config(GetParam())), k({1400, kHeads, kDim}), v({1400, kHeads, kDim}) {
    clustered_kv(1400, kHeads, kDim, 7, k, v);
  }
  kvret_config config;
  F32 k, v;
};

TEST_P(SessionRoundTrip, ThroughDramAndDiskWithEvictionsAndANewContext) {
  TempDir dir;
  // A and B have the same size; DRAM holds one and a half of them, so saving B evicts A to disk.
  const int64_t size_a = session_size(config, k, v, 0, 600), size_b = session_size(config, k, v, 700, 1300);
  ASSERT_GT(size_a, 0);
  ASSERT_GT(size_b, 0);
  config.disk_path = dir.path.c_str();
  config.session_dram_bytes = std::max(size_a, size_b) + std::min(size_a, size_b) / 2;
  Observed observed_a, observed_b;
  std::vector<float> raw_a, raw_b;
  {
    auto ctx = make_context(config);
    Seq a(ctx.get()), b(ctx.get());
    fill(a.s, k, v, 0, 600);
    fill(b.s, k, v, 700, 1300);
    observed_a = observe(a.s);
    observed_b = observe(b.s);
    raw_a = read_layers(a.s);
    raw_b = read_layers(b.s);

    KVRET_ASSERT_OK(kvret_session_save(a.s, "conversation-a"));
    EXPECT_EQ(where(ctx.get(), "conversation-a"), KVRET_TIER_DRAM);
    KVRET_ASSERT_OK(kvret_session_save(b.s, "conversation-b"));
    KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));                 // its files are written in the background
    EXPECT_EQ(where(ctx.get(), "conversation-a"), KVRET_TIER_DISK);  // evicted (least recently used)
    EXPECT_EQ(where(ctx.get(), "conversation-b"), KVRET_TIER_DRAM);
    kvret_stats st = context_stats(ctx.get());
    EXPECT_EQ(st.session_saves, 2);
    EXPECT_EQ(st.session_evictions, 1);
    EXPECT_EQ(st.session_dram_bytes, size_b);
    EXPECT_EQ(st.session_dram_count, 1);
    EXPECT_EQ(st.session_disk_count, 1);
    EXPECT_GT(st.disk_bytes, size_a / 2);
    EXPECT_EQ(st.disk_writes, kLayers + 1);  // one blob per layer and the manifest

    // Opened from disk and from DRAM: the same tokens, the same selections and working sets.
    Seq ra(open_session(ctx.get(), "conversation-a"));
    Seq rb(open_session(ctx.get(), "conversation-b"));
    EXPECT_EQ(read_layers(ra.s), raw_a);
    EXPECT_EQ(read_layers(rb.s), raw_b);
    EXPECT_EQ(observe(ra.s), observed_a);
    EXPECT_EQ(observe(rb.s), observed_b);
    st = context_stats(ctx.get());
    EXPECT_EQ(st.session_hits_disk, 1);
    EXPECT_EQ(st.session_hits_dram, 1);
    EXPECT_EQ(st.disk_reads, kLayers + 1);

    // The next turn: new tokens appended to the restored sequence equal those appended to the original.
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      decode(a.s, layer, k, v, 1300, 1330);
      decode(ra.s, layer, k, v, 1300, 1330);
      prefill(b.s, layer, k, v, 1330, 1390);
      prefill(rb.s, layer, k, v, 1330, 1390);
    }
    EXPECT_EQ(observe(ra.s), observe(a.s));
    EXPECT_EQ(observe(rb.s), observe(b.s));
    EXPECT_EQ(read_layers(ra.s), read_layers(a.s));
    // The saved sessions did not change with the sequences opened from them.
    Seq again(open_session(ctx.get(), "conversation-b"));
    EXPECT_EQ(read_layers(again.s), raw_b);
  }
  // A new context on the same directory (as a new process would): A is on disk, B was only in DRAM.
  auto ctx = make_context(config);
  EXPECT_EQ(where(ctx.get(), "conversation-a"), KVRET_TIER_DISK);
  EXPECT_EQ(where(ctx.get(), "conversation-b"), KVRET_TIER_NONE);
  Seq ra(open_session(ctx.get(), "conversation-a"));
  EXPECT_EQ(read_layers(ra.s), raw_a);
  EXPECT_EQ(observe(ra.s), observed_a);
  kvret_seq* none = reinterpret_cast<kvret_seq*>(1);
  EXPECT_EQ(kvret_session_open(ctx.get(), "conversation-b", &none), KVRET_ERR_NOT_FOUND);
  EXPECT_EQ(none, nullptr);
  EXPECT_EQ(context_stats(ctx.get()).session_misses, 1);
}

INSTANTIATE_TEST_SUITE_P(Kinds, SessionRoundTrip,
                         ::testing::Values(KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_CLUSTER,
                                           KVRET_INDEX_QUANT, KVRET_INDEX_STREAMING),
                         [](const ::testing::TestParamInfo<int>& i) { return kind_name(i.param); });

// ---------------------------------------------------------------------------------------------------------------
// The store's behaviour on one small configuration

class SessionStore : public ::testing::Test {
 protected:
  SessionStore() : config(small_config(KVRET_INDEX_EXACT)), k({1200, kHeads, kDim}), v({1200, kHeads, kDim}) {
    clustered_kv(1200, kHeads, kDim, 11, k, v);
  }
  /// Tokens of session i (all sessions have the same size).
  void fill_session(kvret_seq* s, int i) { fill(s, k, v, 100 * i, 100 * i + 300); }
  int64_t one_session() { return session_size(config, k, v, 0, 300); }

  kvret_config config;
  F32 k, v;
};

TEST_F(SessionStore, PreRopeKeysRoundTripThroughDisk) {
  for (const int kind : {KVRET_INDEX_EXACT, KVRET_INDEX_PQ}) {
    TempDir dir;
    config.index_kind = kind;
    config.rope_keys = 1;
    config.rope_theta = 500000.0f;
    config.disk_path = dir.path.c_str();
    config.session_dram_bytes = 1;  // to disk
    Observed before;
    std::vector<float> raw;
    {
      auto ctx = make_context(config);
      Seq s(ctx.get());
      fill_session(s.s, 3);
      before = observe(s.s);
      raw = read_layers(s.s);
      KVRET_ASSERT_OK(kvret_session_save(s.s, "r"));
      ASSERT_EQ(where(ctx.get(), "r"), KVRET_TIER_DISK);
      Seq r(open_session(ctx.get(), "r"));
      EXPECT_EQ(read_layers(r.s), raw);  // the keys read are rotated at their positions, as the original's
      EXPECT_EQ(observe(r.s), before);
      for (int32_t layer = 0; layer < kLayers; ++layer) {
        decode(s.s, layer, k, v, 1000, 1020);
        decode(r.s, layer, k, v, 1000, 1020);
      }
      EXPECT_EQ(observe(r.s), observe(s.s));
    }
    // A context with another rotation does not take the session (its index was built on other keys).
    kvret_config other = config;
    other.rope_theta = 10000.0f;
    {
      auto ctx = make_context(other);
      EXPECT_EQ(where(ctx.get(), "r"), KVRET_TIER_NONE);
    }
    auto ctx = make_context(config);
    Seq r(open_session(ctx.get(), "r"));
    EXPECT_EQ(read_layers(r.s), raw);
  }
}

/// The path of the file of layer `layer`'s blob in a disk tier holding one session (file names are "b", the hex of
/// the key, ".kvb"; a layer's key ends in ".l<layer>").
fs::path layer_file(const fs::path& dir, int32_t layer) {
  const std::string suffix = ".l" + std::to_string(layer);
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.size() < 5 || name[0] != 'b') continue;
    std::string key;
    for (size_t i = 1; i + 1 < name.size() - 4; i += 2)
      key += static_cast<char>(std::stoi(name.substr(i, 2), nullptr, 16));
    if (key.size() >= suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0)
      return e.path();
  }
  ADD_FAILURE() << "no file of layer " << layer << " in " << dir;
  return {};
}

void flip_byte(const fs::path& file) {
  const auto size = fs::file_size(file);
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(size / 2));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(size / 2));
  f.write(&c, 1);
}

TEST_F(SessionStore, DamagedLayerFileIsCorruptThenNotFound) {
  for (const bool truncate : {false, true}) {
    TempDir dir;
    config.disk_path = dir.path.c_str();
    config.session_dram_bytes = 1;  // every session goes to disk
    auto ctx = make_context(config);
    Seq s(ctx.get());
    fill_session(s.s, 0);
    KVRET_ASSERT_OK(kvret_session_save(s.s, "x"));
    ASSERT_EQ(where(ctx.get(), "x"), KVRET_TIER_DISK);
    // Layer 0's file: the open reads it before returning (a later layer fails later: SessionLoad).
    const fs::path layer0 = layer_file(dir.path, 0);
    ASSERT_GT(fs::file_size(layer0), 1000u);
    if (truncate)
      fs::resize_file(layer0, fs::file_size(layer0) - 100);
    else
      flip_byte(layer0);
    kvret_seq* out = nullptr;
    EXPECT_EQ(kvret_session_open(ctx.get(), "x", &out), KVRET_ERR_CORRUPT);
    EXPECT_NE(std::string(kvret_last_error()).find("corrupt"), std::string::npos) << kvret_last_error();
    EXPECT_EQ(out, nullptr);
    EXPECT_EQ(kvret_session_open(ctx.get(), "x", &out), KVRET_ERR_NOT_FOUND);
    EXPECT_EQ(where(ctx.get(), "x"), KVRET_TIER_NONE);
    EXPECT_EQ(context_stats(ctx.get()).session_corrupt, 1);
    EXPECT_EQ(context_stats(ctx.get()).disk_bytes, 0);  // the dropped session's files are gone
  }
}

// A layer file whose index state was changed and its checksums computed again (no checksum can catch it): whatever
// the index kind, a state whose range is not a start of the layer's middle is refused at open (CORRUPT, the session
// dropped), never opened to fail every select with INTERNAL.
TEST_F(SessionStore, AForgedIndexRangeIsCorruptForEveryIndexKind) {
  constexpr int64_t kTokens = 300;  // fill_session(0): the middle is [n_sink, kTokens - n_local)
  enum Forgery { kBeforeTheMiddle, kAGapAtItsStart, kPastItsEnd };
  for (const int kind : {KVRET_INDEX_EXACT, KVRET_INDEX_PQ, KVRET_INDEX_PAGE, KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT})
    for (const Forgery forgery : {kBeforeTheMiddle, kAGapAtItsStart, kPastItsEnd}) {
      SCOPED_TRACE(std::string(kind_name(kind)) + " forgery " + std::to_string(forgery));
      TempDir dir;
      config.index_kind = kind;
      config.disk_path = dir.path.c_str();
      config.session_dram_bytes = 1;  // every session goes to disk
      auto ctx = make_context(config);
      {
        Seq s(ctx.get());
        fill_session(s.s, 0);
        KVRET_ASSERT_OK(kvret_wait_index(s.s, -1));
        KVRET_ASSERT_OK(kvret_session_save(s.s, "x"));
      }
      ASSERT_EQ(where(ctx.get(), "x"), KVRET_TIER_DISK);
      const fs::path layer0 = layer_file(dir.path, 0);
      std::string bytes;
      {
        std::ifstream in(layer0, std::ios::binary);
        bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      }
      constexpr size_t kHeader = 32;  // the disk tier's blob header; the layer blob follows
      ASSERT_GT(bytes.size(), kHeader + 64);
      // The index state is the layer blob's last part and starts with the state magic "KVRT" (after the rows; the
      // layer blob's own header starts with it too). Its range is the first (n_sink, end) pair of int64s in it.
      const size_t state = bytes.find("KVRT", kHeader + 16);
      ASSERT_NE(state, std::string::npos);
      size_t at = std::string::npos;
      int64_t end = 0;
      for (size_t i = state; i + 16 <= bytes.size() && at == std::string::npos; ++i) {
        int64_t b = 0, e = 0;
        std::memcpy(&b, bytes.data() + i, 8);
        std::memcpy(&e, bytes.data() + i + 8, 8);
        if (b == config.n_sink && e > b && e <= kTokens - config.n_local) at = i, end = e;
      }
      ASSERT_NE(at, std::string::npos) << "no indexed range in the layer's state";
      const int64_t forged_begin = forgery == kBeforeTheMiddle ? 0 : forgery == kAGapAtItsStart ? 5 : config.n_sink;
      const int64_t forged_end = forgery == kPastItsEnd ? kTokens : end;
      std::memcpy(bytes.data() + at, &forged_begin, 8);
      std::memcpy(bytes.data() + at + 8, &forged_end, 8);
      const uint32_t payload_crc = kvret::crc32_of(bytes.data() + kHeader, bytes.size() - kHeader);
      std::memcpy(bytes.data() + 24, &payload_crc, 4);
      const uint32_t header_crc = kvret::crc32_of(bytes.data(), 28);
      std::memcpy(bytes.data() + 28, &header_crc, 4);
      {
        std::ofstream out(layer0, std::ios::binary | std::ios::trunc);
        out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      }
      kvret_seq* out = nullptr;
      EXPECT_EQ(kvret_session_open(ctx.get(), "x", &out), KVRET_ERR_CORRUPT) << kvret_last_error();
      EXPECT_EQ(out, nullptr);
      kvret_seq_close(out);
      EXPECT_EQ(kvret_session_open(ctx.get(), "x", &out), KVRET_ERR_NOT_FOUND);
      EXPECT_EQ(where(ctx.get(), "x"), KVRET_TIER_NONE);
    }
}

TEST_F(SessionStore, DamagedManifestIsAMissForANewContext) {
  TempDir dir;
  config.disk_path = dir.path.c_str();
  config.session_dram_bytes = 1;
  {
    auto ctx = make_context(config);
    Seq s(ctx.get());
    fill_session(s.s, 0);
    KVRET_ASSERT_OK(kvret_session_save(s.s, "x"));
  }
  fs::path smallest;
  uintmax_t smallest_size = UINTMAX_MAX;
  for (const auto& e : fs::directory_iterator(dir.path))
    if (!is_lock(e) && e.file_size() < smallest_size) smallest_size = e.file_size(), smallest = e.path();
  fs::resize_file(smallest, smallest_size - 3);
  auto ctx = make_context(config);
  EXPECT_EQ(where(ctx.get(), "x"), KVRET_TIER_NONE);
  kvret_seq* out = nullptr;
  EXPECT_EQ(kvret_session_open(ctx.get(), "x", &out), KVRET_ERR_NOT_FOUND);
  EXPECT_EQ(context_stats(ctx.get()).session_corrupt, 1);
  // The layer blobs it named are removed with it.
  EXPECT_TRUE(holds_no_files(dir.path));
}

/// A disk tier the test can make unwritable and writable again: no file of the process may grow past 0 bytes
/// (RLIMIT_FSIZE; SIGXFSZ ignored), so every write of a blob fails with EFBIG, as on a full disk, even as root. (The
/// tier keeps its directory open, so replacing the directory would not stop its writes.)
struct BreakableDisk {
  explicit BreakableDisk(const fs::path& parent) : disk(parent / "disk") {}
  ~BreakableDisk() {
    if (broken) repair();
  }
  BreakableDisk(const BreakableDisk&) = delete;
  BreakableDisk& operator=(const BreakableDisk&) = delete;
  void break_it() {
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
    old_handler = ::signal(SIGXFSZ, SIG_IGN);
    rlimit none = old_limit;
    none.rlim_cur = 0;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &none), 0);
    broken = true;
  }
  void repair() {
    ::setrlimit(RLIMIT_FSIZE, &old_limit);
    ::signal(SIGXFSZ, old_handler);
    broken = false;
  }
  size_t files() const {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(disk)) n += e.path().extension() == ".kvb";
    return n;
  }
  fs::path disk;
  bool broken = false;
  rlimit old_limit{};
  void (*old_handler)(int) = SIG_DFL;
};

TEST_F(SessionStore, AnUnwritableDiskIsReportedByFlushAndTheEvictedSessionStaysInDram) {
  TempDir dir;
  const int64_t size = one_session();
  BreakableDisk disk(dir.path);
  config.disk_path = disk.disk.c_str();
  config.session_dram_bytes = size + size / 2;
  auto ctx = make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  fill_session(a.s, 0);
  fill_session(b.s, 1);
  const std::vector<float> raw_a = read_layers(a.s);
  KVRET_ASSERT_OK(kvret_session_save(a.s, "a"));
  disk.break_it();                                // every write fails (as root, permissions would not stop one)
  KVRET_ASSERT_OK(kvret_session_save(b.s, "b"));  // A's eviction to disk is the background writer's
  EXPECT_EQ(kvret_session_flush(ctx.get()), KVRET_ERR_IO);
  EXPECT_NE(std::string(kvret_last_error()).find("disk tier"), std::string::npos) << kvret_last_error();
  EXPECT_NE(std::string(kvret_last_error()).find("stays in DRAM"), std::string::npos) << kvret_last_error();
  KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));    // reported once
  EXPECT_EQ(where(ctx.get(), "a"), KVRET_TIER_DRAM);  // its files failed: its DRAM copy serves it
  EXPECT_EQ(where(ctx.get(), "b"), KVRET_TIER_DRAM);
  {
    Seq ra(open_session(ctx.get(), "a"));
    EXPECT_EQ(read_layers(ra.s), raw_a);  // nothing lost
  }
  kvret_stats st = context_stats(ctx.get());
  EXPECT_EQ(st.session_saves, 2);
  EXPECT_EQ(st.session_evictions, 1);
  EXPECT_EQ(st.disk_bytes, 0);
  EXPECT_EQ(st.session_write_failures, 1);
  // The disk back: saving A again puts it in DRAM and evicts B, whose files are written.
  disk.repair();
  const std::vector<float> raw_b = read_layers(b.s);
  KVRET_ASSERT_OK(kvret_session_save(a.s, "a"));
  KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
  EXPECT_EQ(where(ctx.get(), "a"), KVRET_TIER_DRAM);
  EXPECT_EQ(where(ctx.get(), "b"), KVRET_TIER_DISK);
  EXPECT_GT(context_stats(ctx.get()).disk_bytes, 0);
  // A new context finds B on disk.
  ctx.reset();
  auto next = make_context(config);
  Seq rb(open_session(next.get(), "b"));
  EXPECT_EQ(read_layers(rb.s), raw_b);
}

TEST_F(SessionStore, AFailedEvictionIsRetriedByTheNextSaveAndLandsOnDisk) {
  TempDir dir;
  const int64_t size = one_session();
  BreakableDisk d(dir.path);
  config.disk_path = d.disk.c_str();
  config.session_dram_bytes = size + size / 2;  // DRAM holds one session
  std::vector<float> raw_a;
  {
    auto ctx = make_context(config);
    Seq a(ctx.get()), b(ctx.get());
    fill_session(a.s, 0);
    fill_session(b.s, 1);
    raw_a = read_layers(a.s);
    KVRET_ASSERT_OK(kvret_session_save(a.s, "a"));
    d.break_it();
    KVRET_ASSERT_OK(kvret_session_save(b.s, "b"));  // evicts A: its write fails
    EXPECT_EQ(kvret_session_flush(ctx.get()), KVRET_ERR_IO);
    EXPECT_NE(std::string(kvret_last_error()).find("tries again"), std::string::npos) << kvret_last_error();
    EXPECT_EQ(where(ctx.get(), "a"), KVRET_TIER_DRAM);
    d.repair();
    EXPECT_EQ(d.files(), 0u);
    KVRET_ASSERT_OK(kvret_session_save(b.s, "b"));  // B stays in DRAM; A's write is queued again
    KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
    EXPECT_EQ(where(ctx.get(), "a"), KVRET_TIER_DISK);
    EXPECT_EQ(where(ctx.get(), "b"), KVRET_TIER_DRAM);
    EXPECT_EQ(d.files(), static_cast<size_t>(kLayers + 1));
    const kvret_stats st = context_stats(ctx.get());
    EXPECT_EQ(st.session_write_failures, 1);
    EXPECT_EQ(st.session_evictions, 1);
    Seq ra(open_session(ctx.get(), "a"));  // from its files
    EXPECT_EQ(read_layers(ra.s), raw_a);
    EXPECT_EQ(context_stats(ctx.get()).session_hits_disk, 1);
  }
  // A new context finds it.
  auto next = make_context(config);
  EXPECT_EQ(where(next.get(), "a"), KVRET_TIER_DISK);
  Seq ra(open_session(next.get(), "a"));
  EXPECT_EQ(read_layers(ra.s), raw_a);
}

TEST_F(SessionStore, AFailedEvictionIsTriedAtMostThreeTimesAndStaysWholeInDram) {
  TempDir dir;
  const int64_t size = one_session();
  BreakableDisk d(dir.path);
  config.disk_path = d.disk.c_str();
  config.session_dram_bytes = size + size / 2;
  auto ctx = make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  fill_session(a.s, 0);
  fill_session(b.s, 1);
  const std::vector<float> raw_a = read_layers(a.s);
  KVRET_ASSERT_OK(kvret_session_save(a.s, "a"));
  d.break_it();
  KVRET_ASSERT_OK(kvret_session_save(b.s, "b"));  // the first try
  // Each save or schedule queues the write again while it has failed fewer than 3 times; flush hears each try.
  std::vector<kvret_status> heard{kvret_session_flush(ctx.get())};
  for (int i = 0; i < 5; ++i) {
    if (i % 2 == 0)
      KVRET_ASSERT_OK(kvret_session_save(b.s, "b"));
    else
      KVRET_ASSERT_OK(kvret_session_schedule(ctx.get(), nullptr, 0));
    heard.push_back(kvret_session_flush(ctx.get()));
    EXPECT_EQ(where(ctx.get(), "a"), KVRET_TIER_DRAM) << i;
  }
  EXPECT_EQ(heard, (std::vector<kvret_status>{KVRET_ERR_IO, KVRET_ERR_IO, KVRET_ERR_IO, KVRET_OK, KVRET_OK, KVRET_OK}));
  EXPECT_EQ(context_stats(ctx.get()).session_write_failures, 3);
  // No more tries, even with the disk back; nothing lost: it serves from DRAM, whole.
  d.repair();
  KVRET_ASSERT_OK(kvret_session_save(b.s, "b"));
  KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
  EXPECT_EQ(where(ctx.get(), "a"), KVRET_TIER_DRAM);
  EXPECT_EQ(d.files(), 0u);
  EXPECT_EQ(context_stats(ctx.get()).session_write_failures, 3);
  {
    Seq ra(open_session(ctx.get(), "a"));
    EXPECT_EQ(read_layers(ra.s), raw_a);
  }
  // Saving it again starts afresh: into DRAM, B evicted and written.
  KVRET_ASSERT_OK(kvret_session_save(a.s, "a"));
  KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
  EXPECT_EQ(where(ctx.get(), "a"), KVRET_TIER_DRAM);
  EXPECT_EQ(where(ctx.get(), "b"), KVRET_TIER_DISK);
  EXPECT_EQ(d.files(), static_cast<size_t>(kLayers + 1));
}

TEST_F(SessionStore, AFailedWriteOfASaveSentToDiskKeepsTheNewSaveInDramAndTheOldOnDisk) {
  TempDir dir;
  const int64_t size = one_session();
  BreakableDisk d(dir.path);
  config.disk_path = d.disk.c_str();
  config.session_dram_bytes = size + size / 2;
  config.session_policy = KVRET_SESSION_SCHEDULER_AWARE;  // q queued, s not: s goes to disk itself
  std::vector<float> raw2;
  {
    auto ctx = make_context(config);
    Seq q(ctx.get()), s(ctx.get());
    fill_session(q.s, 0);
    fill_session(s.s, 1);
    KVRET_ASSERT_OK(kvret_session_save(q.s, "q"));
    const char* queue[] = {"q"};
    KVRET_ASSERT_OK(kvret_session_schedule(ctx.get(), queue, 1));
    KVRET_ASSERT_OK(kvret_session_save(s.s, "s"));
    KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
    ASSERT_EQ(where(ctx.get(), "s"), KVRET_TIER_DISK);
    decode(s.s, 1, k, v, 900, 910);
    raw2 = read_layers(s.s);
    d.break_it();
    KVRET_ASSERT_OK(kvret_session_save(s.s, "s"));  // returns: the writer's write fails
    EXPECT_EQ(kvret_session_flush(ctx.get()), KVRET_ERR_IO);
    EXPECT_EQ(where(ctx.get(), "s"), KVRET_TIER_DRAM);
    {
      Seq rs(open_session(ctx.get(), "s"));  // the new save, from DRAM
      EXPECT_EQ(read_layers(rs.s), raw2);
    }
    d.repair();
    EXPECT_EQ(d.files(), static_cast<size_t>(kLayers + 1));  // the first save's files, whole
    KVRET_ASSERT_OK(kvret_session_save(q.s, "q"));           // the retry
    KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
    EXPECT_EQ(where(ctx.get(), "s"), KVRET_TIER_DISK);
    EXPECT_EQ(d.files(), static_cast<size_t>(kLayers + 1));  // the new save's only
    EXPECT_EQ(context_stats(ctx.get()).session_write_failures, 1);
  }
  auto next = make_context(config);
  Seq rs(open_session(next.get(), "s"));
  EXPECT_EQ(read_layers(rs.s), raw2);
}

TEST_F(SessionStore, AWriteFailingMidFileIsIoAndKeepsTheOldVersion) {
  TempDir dir;
  config.disk_path = dir.path.c_str();
  config.session_dram_bytes = 1;  // to disk
  auto ctx = make_context(config);
  Seq s(ctx.get());
  fill_session(s.s, 0);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "v"));
  const std::vector<float> v1 = read_layers(s.s);
  decode(s.s, 1, k, v, 900, 920);
  const std::vector<float> v2 = read_layers(s.s);
  // Files may not grow past 64 KiB: a layer file's write fails part way (EFBIG), as on a full disk.
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const kvret_status st = kvret_session_save(s.s, "v");
  const std::string message = kvret_last_error();
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(st, KVRET_ERR_IO) << message;
  EXPECT_NE(message.find("disk tier: writing"), std::string::npos) << message;
  // The old version is whole, and nothing of the failed save is left.
  EXPECT_EQ(where(ctx.get(), "v"), KVRET_TIER_DISK);
  {
    Seq r(open_session(ctx.get(), "v"));
    EXPECT_EQ(read_layers(r.s), v1);
  }
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) {
    if (is_lock(e)) continue;
    EXPECT_EQ(e.path().extension(), ".kvb") << e.path();
    ++files;
  }
  EXPECT_EQ(files, static_cast<size_t>(kLayers + 1));
  EXPECT_EQ(context_stats(ctx.get()).session_saves, 1);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "v"));
  Seq r(open_session(ctx.get(), "v"));
  EXPECT_EQ(read_layers(r.s), v2);
}

TEST_F(SessionStore, AMissingDirectoryIsCreatedAndAnUncreatableOneIsIo) {
  TempDir dir;
  const fs::path nested = dir.path / "a" / "b";
  config.disk_path = nested.c_str();
  { auto ctx = make_context(config); }
  EXPECT_TRUE(fs::is_directory(nested));
  std::ofstream((dir.path / "file").string()) << "x";
  const fs::path under_file = dir.path / "file" / "d";
  config.disk_path = under_file.c_str();
  kvret_context* ctx = nullptr;
  EXPECT_EQ(kvret_create(&config, &ctx), KVRET_ERR_IO);
  EXPECT_EQ(ctx, nullptr);
}

TEST_F(SessionStore, TimeToLive) {
  TempDir dir;
  config.session_ttl_ms = 1000;  // long enough for a save on a loaded machine
  config.disk_path = dir.path.c_str();
  auto ctx = make_context(config);
  Seq s(ctx.get());
  fill_session(s.s, 0);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "t"));
  EXPECT_EQ(where(ctx.get(), "t"), KVRET_TIER_DRAM);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_EQ(where(ctx.get(), "t"), KVRET_TIER_NONE);
  kvret_seq* out = nullptr;
  EXPECT_EQ(kvret_session_open(ctx.get(), "t", &out), KVRET_ERR_NOT_FOUND);
  kvret_stats st = context_stats(ctx.get());
  EXPECT_EQ(st.session_expired, 1);
  EXPECT_EQ(st.session_dram_bytes, 0);
  EXPECT_EQ(st.session_dram_count, 0);
  // On disk: the expiry is in the files, so a new context misses it too and removes them.
  config.session_dram_bytes = 1;
  kvret_seq_close(s.s);
  s.s = nullptr;
  ctx.reset();  // one context per directory
  {
    auto c2 = make_context(config);
    Seq s2(c2.get());
    fill_session(s2.s, 0);
    KVRET_ASSERT_OK(kvret_session_save(s2.s, "t"));
    EXPECT_EQ(where(c2.get(), "t"), KVRET_TIER_DISK);
    EXPECT_GT(context_stats(c2.get()).disk_bytes, 0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  auto c3 = make_context(config);
  EXPECT_EQ(where(c3.get(), "t"), KVRET_TIER_NONE);
  EXPECT_EQ(context_stats(c3.get()).disk_bytes, 0);
  EXPECT_TRUE(holds_no_files(dir.path));
}

TEST_F(SessionStore, CapacityRefusalChangesNothing) {
  TempDir dir;
  const int64_t size = one_session();
  config.session_dram_bytes = size - 1;  // no disk tier: a session fits nowhere
  {
    auto ctx = make_context(config);
    Seq s(ctx.get());
    fill_session(s.s, 0);
    EXPECT_EQ(kvret_session_save(s.s, "big"), KVRET_ERR_CAPACITY);
    EXPECT_NE(std::string(kvret_last_error()).find("session_dram_bytes"), std::string::npos);
    EXPECT_EQ(where(ctx.get(), "big"), KVRET_TIER_NONE);
    EXPECT_EQ(context_stats(ctx.get()).session_saves, 0);
  }
  config.disk_path = dir.path.c_str();
  config.session_disk_bytes = size - 1;
  auto ctx = make_context(config);
  Seq s(ctx.get());
  fill_session(s.s, 0);
  EXPECT_EQ(kvret_session_save(s.s, "big"), KVRET_ERR_CAPACITY);
  EXPECT_EQ(where(ctx.get(), "big"), KVRET_TIER_NONE);
  EXPECT_TRUE(holds_no_files(dir.path));
}

/// Sessions a, b, c of the same size; DRAM holds two; the disk all.
class SessionPolicy : public SessionStore {
 protected:
  void run(int32_t policy, bool queue_b) {
    TempDir dir;
    const int64_t size = one_session();
    config.disk_path = dir.path.c_str();
    config.session_dram_bytes = 2 * size + size / 2;
    config.session_policy = policy;
    auto ctx = make_context(config);
    Seq a(ctx.get()), b(ctx.get()), c(ctx.get());
    fill_session(a.s, 0);
    fill_session(b.s, 1);
    fill_session(c.s, 2);
    KVRET_ASSERT_OK(kvret_session_save(a.s, "a"));
    KVRET_ASSERT_OK(kvret_session_save(b.s, "b"));
    Seq used(open_session(ctx.get(), "a"));  // a is now the more recently used
    if (queue_b) {
      const char* queue[] = {"b", "c"};
      KVRET_ASSERT_OK(kvret_session_schedule(ctx.get(), queue, 2));
    }
    KVRET_ASSERT_OK(kvret_session_save(c.s, "c"));
    KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));  // the evicted session's files are written
    tiers = {where(ctx.get(), "a"), where(ctx.get(), "b"), where(ctx.get(), "c")};
    if (policy == KVRET_SESSION_SCHEDULER_AWARE) {
      // Prefetch: a queued session on disk comes back to DRAM, evicting one needed later.
      const char* queue[] = {"a", "b"};
      KVRET_ASSERT_OK(kvret_session_schedule(ctx.get(), queue, 2));
      KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
      prefetched = {where(ctx.get(), "a"), where(ctx.get(), "b"), where(ctx.get(), "c")};
      Seq ra(open_session(ctx.get(), "a"));
      EXPECT_EQ(read_layers(ra.s), read_layers(a.s));
      EXPECT_EQ(context_stats(ctx.get()).session_hits_dram, 2);
    }
  }
  std::vector<int32_t> tiers, prefetched;
};

TEST_F(SessionPolicy, LruEvictsTheLeastRecentlyUsed) {
  run(KVRET_SESSION_LRU, false);
  EXPECT_EQ(tiers, (std::vector<int32_t>{KVRET_TIER_DRAM, KVRET_TIER_DISK, KVRET_TIER_DRAM}));
}

TEST_F(SessionPolicy, FifoEvictsTheFirstStored) {
  run(KVRET_SESSION_FIFO, false);
  EXPECT_EQ(tiers, (std::vector<int32_t>{KVRET_TIER_DISK, KVRET_TIER_DRAM, KVRET_TIER_DRAM}));
}

TEST_F(SessionPolicy, SchedulerAwareKeepsTheQueuedAndPrefetches) {
  // b is queued, a is not: a goes to disk although it was used last (LRU would evict b).
  run(KVRET_SESSION_SCHEDULER_AWARE, true);
  EXPECT_EQ(tiers, (std::vector<int32_t>{KVRET_TIER_DISK, KVRET_TIER_DRAM, KVRET_TIER_DRAM}));
  EXPECT_EQ(prefetched, (std::vector<int32_t>{KVRET_TIER_DRAM, KVRET_TIER_DRAM, KVRET_TIER_DISK}));
}

TEST_F(SessionPolicy, SchedulerAwareWithoutAQueueIsLru) {
  run(KVRET_SESSION_SCHEDULER_AWARE, false);
  EXPECT_EQ(tiers, (std::vector<int32_t>{KVRET_TIER_DRAM, KVRET_TIER_DISK, KVRET_TIER_DRAM}));
}

TEST_F(SessionStore, DropAndResave) {
  TempDir dir;
  config.disk_path = dir.path.c_str();
  config.session_dram_bytes = 1;
  auto ctx = make_context(config);
  Seq s(ctx.get());
  fill_session(s.s, 0);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "d"));
  // A re-save replaces the session on disk (a new generation of its files; the old one is removed).
  decode(s.s, 0, k, v, 900, 910);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "d"));
  const std::vector<float> raw = read_layers(s.s);
  {
    Seq r(open_session(ctx.get(), "d"));
    EXPECT_EQ(read_layers(r.s), raw);
  }
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) files += !is_lock(e);
  EXPECT_EQ(files, static_cast<size_t>(kLayers + 1));
  KVRET_ASSERT_OK(kvret_session_drop(ctx.get(), "d"));
  EXPECT_EQ(where(ctx.get(), "d"), KVRET_TIER_NONE);
  EXPECT_EQ(kvret_session_drop(ctx.get(), "d"), KVRET_ERR_NOT_FOUND);
  EXPECT_TRUE(holds_no_files(dir.path));
  EXPECT_EQ(context_stats(ctx.get()).disk_bytes, 0);
}

TEST_F(SessionStore, AnyIdBytesAreSafeFileNames) {
  TempDir dir;
  config.disk_path = dir.path.c_str();
  config.session_dram_bytes = 1;
  const std::string ids[] = {"../../etc/passwd", "a/b\\c\n\t:*?", std::string("\xff\xfe\x01 x", 5),
                             std::string(255, 'z')};
  std::vector<std::vector<float>> raws;
  {
    auto ctx = make_context(config);
    for (size_t i = 0; i < std::size(ids); ++i) {
      Seq s(ctx.get());
      fill_session(s.s, static_cast<int>(i));
      raws.push_back(read_layers(s.s));
      KVRET_ASSERT_OK(kvret_session_save(s.s, ids[i].c_str()));
    }
  }
  for (const auto& e : fs::directory_iterator(dir.path)) {
    if (is_lock(e)) continue;
    const std::string name = e.path().filename().string();
    EXPECT_EQ(name.find_first_not_of("0123456789abcdef.b-kv"), std::string::npos) << name;
  }
  auto ctx = make_context(config);
  for (size_t i = 0; i < std::size(ids); ++i) {
    EXPECT_EQ(where(ctx.get(), ids[i].c_str()), KVRET_TIER_DISK);
    Seq r(open_session(ctx.get(), ids[i].c_str()));
    EXPECT_EQ(read_layers(r.s), raws[i]);
  }
}

TEST_F(SessionStore, BadInputsAreRefusedAndChangeNothing) {
  auto ctx = make_context(config);
  Seq s(ctx.get());
  fill_session(s.s, 0);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "kept"));
  const std::string too_long(256, 'x');
  const auto expect = [&](kvret_status got, kvret_status want, const char* words) {
    EXPECT_EQ(got, want) << kvret_status_string(got) << ": " << kvret_last_error();
    EXPECT_NE(std::string(kvret_last_error()).find(words), std::string::npos) << kvret_last_error();
  };
  expect(kvret_session_save(s.s, nullptr), KVRET_ERR_INVALID_ARGUMENT, "session_id is NULL");
  expect(kvret_session_save(s.s, ""), KVRET_ERR_INVALID_ARGUMENT, "session_id is empty");
  expect(kvret_session_save(s.s, too_long.c_str()), KVRET_ERR_INVALID_ARGUMENT, "at most 255");
  expect(kvret_session_save(nullptr, "x"), KVRET_ERR_INVALID_HANDLE, "NULL");
  kvret_seq* out = reinterpret_cast<kvret_seq*>(1);
  expect(kvret_session_open(ctx.get(), nullptr, &out), KVRET_ERR_INVALID_ARGUMENT, "session_id is NULL");
  EXPECT_EQ(out, nullptr);
  expect(kvret_session_open(ctx.get(), "kept", nullptr), KVRET_ERR_INVALID_ARGUMENT, "out is NULL");
  expect(kvret_session_open(nullptr, "kept", &out), KVRET_ERR_INVALID_HANDLE, "NULL");
  expect(kvret_session_drop(ctx.get(), ""), KVRET_ERR_INVALID_ARGUMENT, "empty");
  expect(kvret_session_drop(nullptr, "kept"), KVRET_ERR_INVALID_HANDLE, "NULL");
  int32_t tier = 7;
  expect(kvret_session_where(ctx.get(), "kept", nullptr), KVRET_ERR_INVALID_ARGUMENT, "out_tier is NULL");
  expect(kvret_session_where(ctx.get(), too_long.c_str(), &tier), KVRET_ERR_INVALID_ARGUMENT, "at most 255");
  EXPECT_EQ(tier, 7);
  const char* queue[] = {"kept", nullptr};
  expect(kvret_session_schedule(ctx.get(), queue, -1), KVRET_ERR_INVALID_ARGUMENT, "n must be >= 0");
  expect(kvret_session_schedule(ctx.get(), nullptr, 2), KVRET_ERR_INVALID_ARGUMENT, "session_ids is NULL");
  expect(kvret_session_schedule(ctx.get(), queue, 2), KVRET_ERR_INVALID_ARGUMENT, "session_ids[1] is NULL");
  KVRET_ASSERT_OK(kvret_session_schedule(ctx.get(), nullptr, 0));
  expect(kvret_session_flush(nullptr), KVRET_ERR_INVALID_HANDLE, "NULL");
  // A closed sequence and a destroyed context.
  kvret_seq* closed = nullptr;
  KVRET_ASSERT_OK(kvret_seq_open(ctx.get(), &closed));
  KVRET_ASSERT_OK(kvret_seq_close(closed));
  expect(kvret_session_save(closed, "x"), KVRET_ERR_INVALID_HANDLE, "closed");
  kvret_context* gone = nullptr;
  KVRET_ASSERT_OK(kvret_create(&config, &gone));
  KVRET_ASSERT_OK(kvret_destroy(gone));
  expect(kvret_session_where(gone, "kept", &tier), KVRET_ERR_INVALID_HANDLE, "destroyed");
  // Nothing changed.
  EXPECT_EQ(where(ctx.get(), "kept"), KVRET_TIER_DRAM);
  EXPECT_EQ(where(ctx.get(), "x"), KVRET_TIER_NONE);
  EXPECT_EQ(context_stats(ctx.get()).session_saves, 1);
  // KVCrush's state is not saved: refused.
  kvret_config crush = config;
  crush.hamming_fraction = 0.25f;
  auto cctx = make_context(crush);
  Seq cs(cctx.get());
  fill_session(cs.s, 0);
  expect(kvret_session_save(cs.s, "c"), KVRET_ERR_UNSUPPORTED, "hamming_fraction");
}

// ---------------------------------------------------------------------------------------------------------------
// Layer-wise loading: a session opened from disk returns with layer 0 in; a loader brings in the others

/// The loader hook of these tests: records the layers it is called for and holds the loader before `block_layer`
/// until `release` is set.
std::atomic<int> g_block_layer{-1};
std::atomic<bool> g_release{false};
std::atomic<int> g_max_layer_seen{-1};
std::atomic<int> g_hook_calls{0};

void blocking_hook(const char*, int32_t layer) {
  ++g_hook_calls;
  int seen = g_max_layer_seen.load();
  while (layer > seen && !g_max_layer_seen.compare_exchange_weak(seen, layer)) {
  }
  if (layer != g_block_layer.load()) return;
  while (!g_release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

/// Installs blocking_hook holding the loader before `layer` (-1: never), and removes it at scope exit.
struct LoadHook {
  explicit LoadHook(int layer) {
    g_block_layer = layer;
    g_release = false;
    g_max_layer_seen = -1;
    g_hook_calls = 0;
    kvret::session::g_layer_load_hook = &blocking_hook;
  }
  ~LoadHook() {
    g_release = true;
    kvret::session::g_layer_load_hook = nullptr;
  }
};

class SessionLoad : public SessionStore {
 protected:
  static constexpr int32_t kLoadLayers = 6;
  SessionLoad() {
    config.n_layers = kLoadLayers;
    config.disk_path = dir.path.c_str();
    config.session_dram_bytes = 1;  // every session goes to disk
  }
  /// Saves a session "x" of every layer (layer l holds tokens [40 l, 40 l + 300 + 20 l)) to disk; returns its bytes
  /// as read_layers sees them.
  std::vector<float> save_x(kvret_context* ctx) {
    Seq s(ctx);
    for (int32_t layer = 0; layer < kLoadLayers; ++layer)
      prefill(s.s, layer, k, v, 40 * layer, 40 * layer + 300 + 20 * layer);
    EXPECT_EQ(kvret_session_save(s.s, "x"), KVRET_OK) << kvret_last_error();
    EXPECT_EQ(where(ctx, "x"), KVRET_TIER_DISK);
    return read_layers(s.s, kLoadLayers);
  }
  static int64_t read_status(kvret_seq* s, int32_t layer) {
    F32 kk({4, kHeads, kDim}), vv({4, kHeads, kDim});
    return kvret_seq_read(s, layer, 0, 4, &kk, &vv);
  }
  TempDir dir;
};

TEST_F(SessionLoad, CallsOnALayerWaitForItAndTheSessionArrivesWhole) {
  auto ctx = make_context(config);
  const std::vector<float> raw = save_x(ctx.get());
  for (const int32_t blocked : {1, 4}) {
    LoadHook hook(blocked);
    Seq r(open_session(ctx.get(), "x"));
    // The layers before the held one are in (or arrive) and answer; the held one and those after it wait.
    for (int32_t layer = 0; layer < blocked; ++layer) EXPECT_EQ(read_status(r.s, layer), KVRET_OK) << layer;
    std::atomic<bool> done{false};
    kvret_status status = KVRET_ERR_INTERNAL;
    std::thread waiter([&] {
      F32 kk({4, kHeads, kDim}), vv({4, kHeads, kDim});
      status = kvret_seq_read(r.s, blocked, 0, 4, &kk, &vv);
      done = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    EXPECT_FALSE(done.load()) << "a call on layer " << blocked << " returned before the layer was loaded";
    EXPECT_EQ(g_max_layer_seen.load(), blocked);  // the loader goes in layer order and is held there
    g_release = true;
    waiter.join();
    EXPECT_EQ(status, KVRET_OK) << kvret_last_error();
    KVRET_ASSERT_OK(kvret_wait_index(r.s, -1));
    EXPECT_EQ(read_layers(r.s, kLoadLayers), raw);    // byte for byte
    EXPECT_EQ(g_hook_calls.load(), kLoadLayers - 1);  // layer 0 came with the open
    kvret_stats st;
    kvret_stats_init(&st);
    KVRET_ASSERT_OK(kvret_seq_stats(r.s, &st));
    int64_t tokens = 0;
    for (int32_t layer = 0; layer < kLoadLayers; ++layer) tokens += 300 + 20 * layer;
    EXPECT_EQ(st.tokens_stored, tokens);
  }
  EXPECT_EQ(context_stats(ctx.get()).session_hits_disk, 2);
}

TEST_F(SessionLoad, ClosingALoadingSequenceStopsItsLoader) {
  auto ctx = make_context(config);
  const std::vector<float> raw = save_x(ctx.get());
  const int64_t host_before = context_stats(ctx.get()).host_bytes;
  {
    LoadHook hook(2);
    kvret_seq* r = open_session(ctx.get(), "x");
    ASSERT_NE(r, nullptr);
    while (g_max_layer_seen.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // held at 2
    std::atomic<bool> closed{false};
    std::thread closer([&] {
      EXPECT_EQ(kvret_seq_close(r), KVRET_OK);
      closed = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    g_release = true;  // the loader finishes layer 2, then sees the close
    closer.join();
    EXPECT_TRUE(closed.load());
    EXPECT_EQ(g_max_layer_seen.load(), 2) << "the loader went on after the sequence was closed";
  }
  EXPECT_EQ(context_stats(ctx.get()).host_bytes, host_before);  // what it had loaded is freed
  // The session is untouched: it opens again, whole.
  Seq again(open_session(ctx.get(), "x"));
  EXPECT_EQ(read_layers(again.s, kLoadLayers), raw);
}

TEST_F(SessionLoad, DestroyingTheContextStopsALoader) {
  auto ctx = make_context(config);
  save_x(ctx.get());
  LoadHook hook(3);
  kvret_seq* r = open_session(ctx.get(), "x");
  ASSERT_NE(r, nullptr);
  std::thread releaser([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    g_release = true;
  });
  ctx.reset();  // closes r, stopping its loader
  releaser.join();
  EXPECT_LE(g_max_layer_seen.load(), 4);
}

TEST_F(SessionLoad, ACorruptLayerAfterOpenFailsItsCallsAndDropsTheSession) {
  auto ctx = make_context(config);
  const std::vector<float> raw = save_x(ctx.get());
  flip_byte(layer_file(dir.path, 4));
  Seq r(open_session(ctx.get(), "x"));  // layer 0 is whole: the open succeeds
  for (int32_t layer = 0; layer < 4; ++layer) EXPECT_EQ(read_status(r.s, layer), KVRET_OK) << layer;
  for (int32_t layer = 4; layer < kLoadLayers; ++layer) {
    EXPECT_EQ(read_status(r.s, layer), KVRET_ERR_CORRUPT) << layer;
    EXPECT_NE(std::string(kvret_last_error()).find("layer 4"), std::string::npos) << kvret_last_error();
  }
  EXPECT_EQ(kvret_wait_index(r.s, -1), KVRET_ERR_CORRUPT);
  EXPECT_EQ(kvret_session_save(r.s, "y"), KVRET_ERR_CORRUPT);  // a sequence missing layers cannot be saved
  kvret_seq* fork = nullptr;
  EXPECT_EQ(kvret_seq_fork(r.s, &fork), KVRET_ERR_CORRUPT);
  // Dropped before the calls heard of it: the next open is a miss.
  kvret_seq* out = nullptr;
  EXPECT_EQ(kvret_session_open(ctx.get(), "x", &out), KVRET_ERR_NOT_FOUND);
  EXPECT_EQ(where(ctx.get(), "y"), KVRET_TIER_NONE);
  EXPECT_EQ(context_stats(ctx.get()).session_corrupt, 1);
  EXPECT_EQ(context_stats(ctx.get()).disk_bytes, 0);  // its files are gone
  // A damaged layer 0 is reported by the open itself.
  save_x(ctx.get());
  flip_byte(layer_file(dir.path, 0));
  EXPECT_EQ(kvret_session_open(ctx.get(), "x", &out), KVRET_ERR_CORRUPT);
  EXPECT_EQ(out, nullptr);
  EXPECT_EQ(kvret_session_open(ctx.get(), "x", &out), KVRET_ERR_NOT_FOUND);
  EXPECT_EQ(context_stats(ctx.get()).session_corrupt, 2);
}

TEST_F(SessionLoad, FilesALoaderReadsOutliveADropAndAResave) {
  auto ctx = make_context(config);
  const std::vector<float> raw = save_x(ctx.get());
  {
    LoadHook hook(2);
    Seq r(open_session(ctx.get(), "x"));
    KVRET_ASSERT_OK(kvret_session_drop(ctx.get(), "x"));  // while layers 2.. are still to read
    EXPECT_EQ(where(ctx.get(), "x"), KVRET_TIER_NONE);
    const std::vector<float> raw2 = save_x(ctx.get());  // a new save of the same id: other files
    g_release = true;
    KVRET_ASSERT_OK(kvret_wait_index(r.s, -1));
    EXPECT_EQ(read_layers(r.s, kLoadLayers), raw);  // the old save, whole
    Seq again(open_session(ctx.get(), "x"));
    EXPECT_EQ(read_layers(again.s, kLoadLayers), raw2);
  }
  KVRET_ASSERT_OK(kvret_session_drop(ctx.get(), "x"));
  EXPECT_EQ(context_stats(ctx.get()).disk_bytes, 0);  // the dropped save's files went once its loader ended
  KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
}

/// Host pages, counted: the allocator of PageCountingBackend.
class CountedPages final : public kvret::PageAllocator {
 public:
  std::byte* allocate(size_t bytes) noexcept override {
    live += static_cast<int64_t>(bytes);
    return kvret::host_page_allocator().allocate(bytes);
  }
  void deallocate(std::byte* p, size_t bytes) noexcept override {
    live -= static_cast<int64_t>(bytes);
    kvret::host_page_allocator().deallocate(p, bytes);
  }
  std::atomic<int64_t> live{0};
};

/// The CPU backend with its pages counted (as the CUDA backend's pages are its pinned allocations).
class PageCountingBackend final : public kvret::CpuBackend {
 public:
  kvret::PageAllocator& pages() noexcept override { return *counted; }
  std::shared_ptr<CountedPages> counted = std::make_shared<CountedPages>();
};

TEST(SessionBackend, ARestoredSessionsLayersArriveOneByOneInTheBackendsPages) {
  if (device_type() != KVRET_DEVICE_CPU) GTEST_SKIP() << "a backend of the test's own, on the CPU";
  TempDir dir;
  constexpr int32_t kLayersHere = 5;
  kvret_config c = small_config(KVRET_INDEX_PQ);
  c.n_layers = kLayersHere;
  c.disk_path = dir.path.c_str();
  c.session_dram_bytes = 1;  // to disk
  std::string disk;
  const kvret_config config = kvret::read_config(&c, &disk);
  auto backend = std::make_unique<PageCountingBackend>();
  const std::shared_ptr<CountedPages> pages = backend->counted;  // outlives the context
  F32 k({900, kHeads, kDim}), v({900, kHeads, kDim});
  clustered_kv(900, kHeads, kDim, 4, k, v);
  {
    kvret::Context ctx(config, disk, std::move(backend));
    kvret::session::SessionStore store(ctx);
    std::vector<int64_t> layer_bytes;
    {
      kvret::Sequence* seq = ctx.open_sequence();
      for (int32_t l = 0; l < kLayersHere; ++l) {
        const int64_t n = 300 + 100 * l;  // layers of different sizes
        F32 kl({n, kHeads, kDim}), vl({n, kHeads, kDim});
        std::copy(k.data.begin(), k.data.begin() + static_cast<std::ptrdiff_t>(kl.data.size()), kl.data.begin());
        std::copy(v.data.begin(), v.data.begin() + static_cast<std::ptrdiff_t>(vl.data.size()), vl.data.begin());
        seq->append_prefill(l, &kl.t, &vl.t);
        layer_bytes.push_back(seq->store(l).bytes());
      }
      store.save(*seq, "x");
      ctx.close_sequence(seq);
    }
    ASSERT_EQ(store.where("x"), KVRET_TIER_DISK);
    ASSERT_EQ(pages->live.load(), 0) << "the session is on disk only";
    for (int32_t held = 1; held < kLayersHere; ++held) {
      SCOPED_TRACE(held);
      std::unique_ptr<kvret::Sequence> opened;
      {
        LoadHook hook(held);  // the loader stops before layer `held`
        opened = store.open("x");
        while (g_max_layer_seen.load() < held) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        int64_t in = 0;
        for (int32_t l = 0; l < held; ++l) in += layer_bytes[static_cast<size_t>(l)];
        EXPECT_EQ(pages->live.load(), in) << "layers 0.." << held - 1 << " in, each in the backend's pages";
      }  // released
      opened->wait_loaded();
      int64_t all = 0;
      for (int32_t l = 0; l < kLayersHere; ++l) {
        EXPECT_EQ(opened->store(l).bytes(), layer_bytes[static_cast<size_t>(l)]);
        all += layer_bytes[static_cast<size_t>(l)];
      }
      EXPECT_EQ(pages->live.load(), all);
      opened.reset();
      EXPECT_EQ(pages->live.load(), 0) << "closing it gave the pages back to the backend";
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The write-through to a shared tier runs on a background writer (a test tier in memory stands in for Redis)

/// Blobs in memory shared by every context of a test; puts wait while `hold` is set and fail while `fail` is.
struct MemoryTierState {
  std::mutex mu;
  std::map<std::string, std::vector<std::byte>> blobs;
  std::atomic<bool> hold{false};
  std::atomic<bool> fail{false};
  std::atomic<int> puts_waiting{0};
};
MemoryTierState* g_memory_tier = nullptr;

class MemoryTier final : public kvret::session::BlobTier {
 public:
  const char* name() const noexcept override { return "memory"; }
  void put(const std::string& key, const std::byte* data, size_t size, int64_t) override {
    MemoryTierState& s = *g_memory_tier;
    ++s.puts_waiting;
    while (s.hold.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    --s.puts_waiting;
    if (s.fail.load()) throw kvret::Error(KVRET_ERR_IO, "memory tier: the test fails its writes");
    std::lock_guard<std::mutex> lock(s.mu);
    s.blobs[key].assign(data, data + size);
  }
  std::optional<std::vector<std::byte>> get(const std::string& key) override {
    std::lock_guard<std::mutex> lock(g_memory_tier->mu);
    const auto it = g_memory_tier->blobs.find(key);
    if (it == g_memory_tier->blobs.end()) return std::nullopt;
    return it->second;
  }
  bool remove(const std::string& key) override {
    std::lock_guard<std::mutex> lock(g_memory_tier->mu);
    return g_memory_tier->blobs.erase(key) != 0;
  }
};

/// Saves `seq` as `id` on another thread and checks that the save waits (the writer's copies are past their
/// bound) until `release` lets the writer go on; then the save succeeds.
template <class Release>
void expect_save_waits(kvret_seq* seq, const char* id, Release release) {
  std::atomic<bool> saved{false};
  std::thread saver([&] {
    EXPECT_EQ(kvret_session_save(seq, id), KVRET_OK) << kvret_last_error();
    saved = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(saved.load()) << "a save went past the writer's bound";
  release();
  saver.join();
  EXPECT_TRUE(saved.load());
}

/// Flushes `ctx` on another thread and checks that the flush waits until `release` lets the writer go on; then the
/// flush succeeds (`what`: what the flush should have waited for, for the message).
template <class Release>
void expect_flush_waits(kvret_context* ctx, const char* what, Release release) {
  std::atomic<bool> flushed{false};
  kvret_status status = KVRET_ERR_INTERNAL;
  std::thread flusher([&] {
    status = kvret_session_flush(ctx);
    flushed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(flushed.load()) << "kvret_session_flush returned before " << what;
  release();
  flusher.join();
  EXPECT_EQ(status, KVRET_OK) << kvret_last_error();
}

class SessionWriter : public SessionStore {
 protected:
  SessionWriter() {
    g_memory_tier = &state;
    kvret::session::g_shared_tier_factory = [] { return std::unique_ptr<kvret::session::BlobTier>(new MemoryTier); };
    config.session_shared_url = "redis://127.0.0.1:1";  // replaced by the memory tier
  }
  ~SessionWriter() override {
    state.hold = false;
    kvret::session::g_shared_tier_factory = nullptr;
  }
  size_t manifests() {
    std::lock_guard<std::mutex> lock(state.mu);
    size_t n = 0;
    for (const auto& [key, blob] : state.blobs) n += key.size() > 2 && key.compare(key.size() - 2, 2, ".m") == 0;
    return n;
  }
  MemoryTierState state;
};

TEST_F(SessionWriter, ASaveReturnsBeforeItsWriteThroughAndFlushWaitsForIt) {
  auto a = make_context(config);
  auto b = make_context(config);
  Seq s(a.get());
  fill_session(s.s, 0);
  const std::vector<float> raw = read_layers(s.s);
  state.hold = true;
  KVRET_ASSERT_OK(kvret_session_save(s.s, "w"));  // returns with the writer held at its first put
  EXPECT_EQ(where(a.get(), "w"), KVRET_TIER_DRAM);
  EXPECT_EQ(where(b.get(), "w"), KVRET_TIER_NONE);  // not in the shared tier yet
  {
    Seq local(open_session(a.get(), "w"));  // the local copy serves meanwhile
    EXPECT_EQ(read_layers(local.s), raw);
  }
  expect_flush_waits(a.get(), "the write-through", [&] { state.hold = false; });
  EXPECT_EQ(context_stats(a.get()).session_shared_writes, 1);
  EXPECT_EQ(context_stats(a.get()).session_write_failures, 0);
  EXPECT_EQ(where(b.get(), "w"), KVRET_TIER_SHARED);
  EXPECT_EQ(context_stats(b.get()).session_hits_shared, 0);
  Seq other(open_session(b.get(), "w"));
  EXPECT_EQ(read_layers(other.s), raw);
  EXPECT_EQ(context_stats(b.get()).session_hits_shared, 1);
  EXPECT_EQ(context_stats(b.get()).session_hits_dram + context_stats(b.get()).session_hits_disk, 0);
}

TEST_F(SessionWriter, AFailedWriteThroughIsReportedByFlushAndTheSessionStaysInDram) {
  auto a = make_context(config);
  Seq s(a.get());
  fill_session(s.s, 1);
  const std::vector<float> raw = read_layers(s.s);
  state.fail = true;
  KVRET_ASSERT_OK(kvret_session_save(s.s, "f"));
  EXPECT_EQ(kvret_session_flush(a.get()), KVRET_ERR_IO);
  EXPECT_NE(std::string(kvret_last_error()).find("write-through"), std::string::npos) << kvret_last_error();
  EXPECT_EQ(context_stats(a.get()).session_write_failures, 1);
  EXPECT_EQ(context_stats(a.get()).session_shared_writes, 0);
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));  // reported once
  EXPECT_EQ(manifests(), 0u);
  EXPECT_EQ(where(a.get(), "f"), KVRET_TIER_DRAM);
  Seq local(open_session(a.get(), "f"));
  EXPECT_EQ(read_layers(local.s), raw);
  state.fail = false;  // the next save writes through
  KVRET_ASSERT_OK(kvret_session_save(s.s, "f"));
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  EXPECT_EQ(manifests(), 1u);
  EXPECT_EQ(context_stats(a.get()).session_shared_writes, 1);
  EXPECT_EQ(context_stats(a.get()).session_write_failures, 1);
}

TEST_F(SessionWriter, ADropWhileTheWriterRunsLeavesNothingInTheSharedTier) {
  auto a = make_context(config);
  Seq s(a.get());
  fill_session(s.s, 2);
  state.hold = true;
  KVRET_ASSERT_OK(kvret_session_save(s.s, "d1"));  // running, held
  KVRET_ASSERT_OK(kvret_session_save(s.s, "d2"));  // queued behind it
  while (state.puts_waiting.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  KVRET_ASSERT_OK(kvret_session_drop(a.get(), "d1"));
  KVRET_ASSERT_OK(kvret_session_drop(a.get(), "d2"));
  state.hold = false;
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  EXPECT_EQ(where(a.get(), "d1"), KVRET_TIER_NONE);
  EXPECT_EQ(where(a.get(), "d2"), KVRET_TIER_NONE);
  std::lock_guard<std::mutex> lock(state.mu);
  EXPECT_TRUE(state.blobs.empty()) << state.blobs.size() << " blobs left";
}

TEST_F(SessionWriter, TheWritersCopiesAreBoundedBySessionDramBytes) {
  const int64_t one = one_session();
  {
    std::lock_guard<std::mutex> lock(state.mu);
    state.blobs.clear();  // one_session's own save
  }
  config.session_dram_bytes = one + one / 2;  // the writer may hold one session, then a second that goes past
  auto a = make_context(config);
  Seq s(a.get());
  fill_session(s.s, 3);
  state.hold = true;
  KVRET_ASSERT_OK(kvret_session_save(s.s, "b1"));  // pending: one session (below the bound)
  KVRET_ASSERT_OK(kvret_session_save(s.s, "b2"));  // pending: two (past it)
  expect_save_waits(s.s, "b3", [&] { state.hold = false; });
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  EXPECT_EQ(manifests(), 3u);
}

TEST_F(SessionWriter, DestroyingTheContextFinishesTheQueuedWrites) {
  {
    auto a = make_context(config);
    Seq s(a.get());
    fill_session(s.s, 4);
    KVRET_ASSERT_OK(kvret_session_save(s.s, "q1"));
    KVRET_ASSERT_OK(kvret_session_save(s.s, "q2"));
  }
  EXPECT_EQ(manifests(), 2u);
}

// ---------------------------------------------------------------------------------------------------------------
// Evictions to disk run on the background writer

std::atomic<bool> g_hold_disk{false};
std::atomic<int> g_disk_writes_seen{0};
void holding_disk_hook(const char*) {
  ++g_disk_writes_seen;
  while (g_hold_disk.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

class SessionEviction : public SessionStore {
 protected:
  SessionEviction() {
    size = one_session();
    config.disk_path = dir.path.c_str();
    config.session_dram_bytes = size + size / 2;  // DRAM holds one session
    g_hold_disk = true;
    g_disk_writes_seen = 0;
    kvret::session::g_disk_write_hook = &holding_disk_hook;
  }
  ~SessionEviction() override {
    g_hold_disk = false;
    kvret::session::g_disk_write_hook = nullptr;
  }
  size_t files() const {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir.path)) n += e.path().extension() == ".kvb";
    return n;
  }
  int64_t size = 0;
  TempDir dir;
};

TEST_F(SessionEviction, AnEvictedSessionServesFromDramUntilItsFilesAreWritten) {
  auto ctx = make_context(config);
  Seq a(ctx.get()), b(ctx.get());
  fill_session(a.s, 0);
  fill_session(b.s, 1);
  const std::vector<float> raw_a = read_layers(a.s);
  KVRET_ASSERT_OK(kvret_session_save(a.s, "a"));
  KVRET_ASSERT_OK(kvret_session_save(b.s, "b"));              // evicts A; returns with its write held
  EXPECT_EQ(where(ctx.get(), "a"), KVRET_TIER_DRAM);          // on its way to disk, served from DRAM
  EXPECT_EQ(context_stats(ctx.get()).session_disk_count, 1);  // placed on disk
  EXPECT_EQ(files(), 0u);                                     // nothing of A on disk yet
  {
    Seq ra(open_session(ctx.get(), "a"));  // its DRAM copy
    EXPECT_EQ(read_layers(ra.s), raw_a);
    EXPECT_EQ(context_stats(ctx.get()).session_hits_dram, 1);
  }
  expect_flush_waits(ctx.get(), "the eviction was written", [] { g_hold_disk = false; });
  EXPECT_EQ(files(), static_cast<size_t>(kLayers + 1));
  EXPECT_EQ(where(ctx.get(), "a"), KVRET_TIER_DISK);  // its files complete, its DRAM copy released
  Seq ra(open_session(ctx.get(), "a"));               // from its files now
  EXPECT_EQ(read_layers(ra.s), raw_a);
  EXPECT_EQ(context_stats(ctx.get()).disk_reads, kLayers + 1);
  EXPECT_EQ(context_stats(ctx.get()).session_hits_disk, 1);
  EXPECT_EQ(context_stats(ctx.get()).session_hits_dram, 1);
}

TEST_F(SessionEviction, ADropOrAResaveWhileTheWriteRunsLeavesNoStaleFiles) {
  auto ctx = make_context(config);
  Seq a(ctx.get()), b(ctx.get()), c(ctx.get());
  fill_session(a.s, 0);
  fill_session(b.s, 1);
  fill_session(c.s, 2);
  const std::vector<float> raw_a = read_layers(a.s), raw_b = read_layers(b.s);
  KVRET_ASSERT_OK(kvret_session_save(a.s, "a"));
  KVRET_ASSERT_OK(kvret_session_save(b.s, "b"));  // A's eviction: held
  while (g_disk_writes_seen.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  KVRET_ASSERT_OK(kvret_session_drop(ctx.get(), "a"));  // dropped while its write runs
  KVRET_ASSERT_OK(kvret_session_save(c.s, "c"));        // evicts B (queued)
  std::thread release([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    g_hold_disk = false;
  });
  KVRET_ASSERT_OK(kvret_session_save(b.s, "b"));  // waits for the writer's room; B saved again: to DRAM, C evicted
  release.join();
  KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
  EXPECT_EQ(where(ctx.get(), "a"), KVRET_TIER_NONE);
  EXPECT_EQ(where(ctx.get(), "b"), KVRET_TIER_DRAM);
  EXPECT_EQ(where(ctx.get(), "c"), KVRET_TIER_DISK);
  EXPECT_EQ(files(), static_cast<size_t>(kLayers + 1));  // C's only
  Seq rb(open_session(ctx.get(), "b"));
  EXPECT_EQ(read_layers(rb.s), raw_b);
  // A new context finds C alone.
  const std::vector<float> raw_c = read_layers(c.s);
  ctx.reset();
  auto next = make_context(config);
  EXPECT_EQ(where(next.get(), "a"), KVRET_TIER_NONE);
  EXPECT_EQ(where(next.get(), "b"), KVRET_TIER_NONE);
  Seq rc(open_session(next.get(), "c"));
  EXPECT_EQ(read_layers(rc.s), raw_c);
}

TEST_F(SessionEviction, ASaveWaitsWhileTheWritersCopiesReachSessionDramBytes) {
  auto ctx = make_context(config);
  Seq s(ctx.get());
  fill_session(s.s, 3);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "s1"));
  KVRET_ASSERT_OK(kvret_session_save(s.s, "s2"));  // evicts s1: the writer holds one session (below the bound)
  KVRET_ASSERT_OK(kvret_session_save(s.s, "s3"));  // evicts s2: two (past it)
  expect_save_waits(s.s, "s4", [&] { g_hold_disk = false; });
  KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
  for (const char* id : {"s1", "s2", "s3"}) EXPECT_EQ(where(ctx.get(), id), KVRET_TIER_DISK) << id;
  EXPECT_EQ(where(ctx.get(), "s4"), KVRET_TIER_DRAM);
  EXPECT_EQ(files(), static_cast<size_t>(3 * (kLayers + 1)));
}

TEST_F(SessionEviction, ASessionSavedStraightToDiskIsWrittenByTheWriter) {
  // Scheduler-aware: q is queued, s is not, and DRAM holds one of them: s goes to disk itself.
  config.session_policy = KVRET_SESSION_SCHEDULER_AWARE;
  std::vector<float> raw_s2;
  {
    auto ctx = make_context(config);
    Seq q(ctx.get()), s(ctx.get());
    fill_session(q.s, 0);
    fill_session(s.s, 1);
    const std::vector<float> raw_s = read_layers(s.s);
    KVRET_ASSERT_OK(kvret_session_save(q.s, "q"));
    const char* queue[] = {"q"};
    KVRET_ASSERT_OK(kvret_session_schedule(ctx.get(), queue, 1));
    KVRET_ASSERT_OK(kvret_session_save(s.s, "s"));  // returns with its write held
    EXPECT_EQ(where(ctx.get(), "s"), KVRET_TIER_DRAM);
    EXPECT_EQ(where(ctx.get(), "q"), KVRET_TIER_DRAM);
    EXPECT_EQ(context_stats(ctx.get()).session_disk_count, 1);
    EXPECT_EQ(context_stats(ctx.get()).session_evictions, 0);
    EXPECT_EQ(files(), 0u);
    {
      Seq rs(open_session(ctx.get(), "s"));  // its DRAM copy
      EXPECT_EQ(read_layers(rs.s), raw_s);
    }
    expect_flush_waits(ctx.get(), "the save's files were written", [] { g_hold_disk = false; });
    EXPECT_EQ(files(), static_cast<size_t>(kLayers + 1));
    EXPECT_EQ(where(ctx.get(), "s"), KVRET_TIER_DISK);
    {
      Seq rs(open_session(ctx.get(), "s"));  // from its files
      EXPECT_EQ(read_layers(rs.s), raw_s);
    }
    // A re-save while its write is held: the older files stay (a crash finds them whole), the new copy serves.
    g_hold_disk = true;
    decode(s.s, 1, k, v, 900, 920);
    raw_s2 = read_layers(s.s);
    KVRET_ASSERT_OK(kvret_session_save(s.s, "s"));
    EXPECT_EQ(where(ctx.get(), "s"), KVRET_TIER_DRAM);
    EXPECT_EQ(files(), static_cast<size_t>(kLayers + 1));  // the first save's
    {
      Seq rs(open_session(ctx.get(), "s"));
      EXPECT_EQ(read_layers(rs.s), raw_s2);
    }
    g_hold_disk = false;
    KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
    EXPECT_EQ(where(ctx.get(), "s"), KVRET_TIER_DISK);
    EXPECT_EQ(files(), static_cast<size_t>(kLayers + 1));  // one generation left
    EXPECT_EQ(context_stats(ctx.get()).session_write_failures, 0);
  }
  auto next = make_context(config);
  Seq rs(open_session(next.get(), "s"));
  EXPECT_EQ(read_layers(rs.s), raw_s2);
}

TEST_F(SessionEviction, ASessionLargerThanTheDramTierIsWrittenInTheSave) {
  config.session_dram_bytes = 1;  // a copy for the writer would need more DRAM than the tier has
  auto ctx = make_context(config);
  Seq s(ctx.get());
  fill_session(s.s, 2);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "big"));  // the writer is held, but not asked
  EXPECT_EQ(g_disk_writes_seen.load(), 0);
  EXPECT_EQ(files(), static_cast<size_t>(kLayers + 1));
  EXPECT_EQ(where(ctx.get(), "big"), KVRET_TIER_DISK);
}

// ---------------------------------------------------------------------------------------------------------------
// Crash safety: a writer killed mid-save

/// The writer: saves one of three versions of session "s" again and again into $KVRET_SESSION_WRITER_DIR (every
/// save to disk), touching "<dir>.ready" after the first. With $KVRET_SESSION_WRITER_BACKGROUND set, the saves go
/// through the background writer (a queued session "pin" holds DRAM, scheduler-aware placement sends "s" to disk
/// itself, and DRAM would hold it: the save returns before its files are written), each followed by a flush;
/// else DRAM holds 1 byte and each save writes in the call. Run by SessionCrash as a child process; skipped
/// otherwise.
TEST(SessionWriterChild, SavesInALoop) {
  const char* dir = std::getenv("KVRET_SESSION_WRITER_DIR");
  if (dir == nullptr) GTEST_SKIP() << "run by SessionCrash.KilledWriterLeavesOldVersionOrMiss";
  const bool background = std::getenv("KVRET_SESSION_WRITER_BACKGROUND") != nullptr;
  kvret_config config = small_config(KVRET_INDEX_EXACT);
  F32 k({3000, kHeads, kDim}), v({3000, kHeads, kDim});
  clustered_kv(3000, kHeads, kDim, 5, k, v);
  config.disk_path = dir;
  config.session_dram_bytes = 1;
  if (background) {
    const int64_t largest = session_size(config, k, v, 0, 2800);
    config.session_dram_bytes = largest + largest / 2;  // holds any version, not the pin and a version together
    config.session_policy = KVRET_SESSION_SCHEDULER_AWARE;
  }
  auto ctx = make_context(config);
  std::vector<std::unique_ptr<Seq>> versions;
  for (int i = 0; i < 3; ++i) {
    versions.push_back(std::make_unique<Seq>(ctx.get()));
    fill(versions.back()->s, k, v, 0, 2000 + 400 * i);
  }
  static std::atomic<int> writer_writes{0};  // the background writer's disk writes
  if (background) {
    kvret::session::g_disk_write_hook = [](const char*) { ++writer_writes; };
    ASSERT_EQ(kvret_session_save(versions[2]->s, "pin"), KVRET_OK) << kvret_last_error();
    const char* queue[] = {"pin"};
    ASSERT_EQ(kvret_session_schedule(ctx.get(), queue, 1), KVRET_OK) << kvret_last_error();
  }
  for (int i = 0;; ++i) {
    ASSERT_EQ(kvret_session_save(versions[static_cast<size_t>(i % 3)]->s, "s"), KVRET_OK) << kvret_last_error();
    if (background) {
      ASSERT_EQ(kvret_session_flush(ctx.get()), KVRET_OK) << kvret_last_error();
      int32_t tier = -1;
      ASSERT_EQ(kvret_session_where(ctx.get(), "s", &tier), KVRET_OK);
      ASSERT_EQ(tier, KVRET_TIER_DISK) << "the save did not go to disk";
      ASSERT_EQ(writer_writes.load(), i + 1) << "the save was not written by the background writer";
    }
    if (i == 0) std::ofstream(std::string(dir) + ".ready") << "1";
  }
}

class SessionCrash : public ::testing::TestWithParam<bool> {};

TEST_P(SessionCrash, KilledWriterLeavesOldVersionOrMiss) {
  const bool background = GetParam();
  TempDir dir;
  const std::string disk = (dir.path / "disk").string();
  kvret_config config = small_config(KVRET_INDEX_EXACT);
  config.disk_path = disk.c_str();
  config.session_dram_bytes = 1;
  F32 k({3000, kHeads, kDim}), v({3000, kHeads, kDim});
  clustered_kv(3000, kHeads, kDim, 5, k, v);
  // The three versions' contents, as the writer fills them.
  std::vector<std::vector<float>> versions;
  {
    kvret_config plain = config;
    plain.disk_path = nullptr;
    auto ctx = make_context(plain);
    for (int i = 0; i < 3; ++i) {
      Seq s(ctx.get());
      fill(s.s, k, v, 0, 2000 + 400 * i);
      versions.push_back(read_layers(s.s));
    }
  }
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  int hits = 0, misses = 0, mid_save = 0;
  std::vector<int> seen(3, 0);
  for (int round = 0; round < 8; ++round) {
    fs::remove(disk + ".ready");
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::setenv("KVRET_SESSION_WRITER_DIR", disk.c_str(), 1);
      // not a shard of a sharded run (scripts/gtest_shards.sh): its one test might fall in another shard
      ::unsetenv("GTEST_TOTAL_SHARDS");
      ::unsetenv("GTEST_SHARD_INDEX");
      ::unsetenv("GTEST_SHARD_STATUS_FILE");
      if (background) ::setenv("KVRET_SESSION_WRITER_BACKGROUND", "1", 1);
      const int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      ::execl(self.c_str(), self.c_str(), "--gtest_filter=SessionWriterChild.SavesInALoop", nullptr);
      ::_exit(127);
    }
    // Wait for a whole save (generously: a sanitizer build on a loaded machine takes many seconds to fill and save
    // the three versions), then kill at a different moment each round.
    int early = 0;
    bool exited = false;
    for (int i = 0; i < 24000 && !fs::exists(disk + ".ready"); ++i) {
      if (::waitpid(pid, &early, WNOHANG) == pid) {
        exited = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_FALSE(exited) << "the writer exited before its first save, status " << early;
    if (!fs::exists(disk + ".ready")) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      FAIL() << "the writer never finished a save in two minutes";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(3 + 11 * round));
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the writer exited on its own, status " << status;
    // What the kill left: a temporary file or the layer blobs of a save without its manifest yet, or the old
    // generation's blobs not removed yet (more files than one session has).
    size_t left = 0;
    for (const auto& e : fs::directory_iterator(disk)) left += !is_lock(e);
    if (left != static_cast<size_t>(kLayers + 1)) ++mid_save;

    auto ctx = make_context(config);
    kvret_seq* s = nullptr;
    const kvret_status st = kvret_session_open(ctx.get(), "s", &s);
    ASSERT_TRUE(st == KVRET_OK || st == KVRET_ERR_NOT_FOUND)
        << "round " << round << ": " << kvret_status_string(st) << ": " << kvret_last_error();
    if (st == KVRET_OK) {
      ++hits;
      Seq guard(s);
      const std::vector<float> got = read_layers(s);
      int match = -1;
      for (int i = 0; i < 3; ++i)
        if (got == versions[static_cast<size_t>(i)]) match = i;
      ASSERT_GE(match, 0) << "round " << round << ": the session is none of the versions saved";
      ++seen[static_cast<size_t>(match)];
      // The restored index selects.
      F32 q({kQHeads, kDim});
      q.data = random_vector(static_cast<size_t>(kQHeads * kDim), 9);
      q.refresh();
      I32 out({kHeads, 40});
      int32_t count = 0;
      KVRET_ASSERT_OK(kvret_select(s, 0, &q, 40, &out, &count));
      EXPECT_EQ(count, 40);
    } else {
      ++misses;
    }
    // The killed save's leftovers (temporary files, unnamed layer blobs) were removed on reopening.
    size_t files = 0;
    for (const auto& e : fs::directory_iterator(disk)) {
      if (is_lock(e)) continue;
      EXPECT_EQ(e.path().extension(), ".kvb") << e.path();
      ++files;
    }
    EXPECT_EQ(files, st == KVRET_OK ? static_cast<size_t>(kLayers + 1) : 0u);
  }
  std::printf("[ SessionCrash ] %s: 8 kills, %d of them mid-save: %d hits (versions %d/%d/%d), %d clean misses\n",
              background ? "background writer" : "in the save", mid_save, hits, seen[0], seen[1], seen[2], misses);
  EXPECT_EQ(hits + misses, 8);
  EXPECT_GE(mid_save, 1) << "no kill landed inside a save: the test did not test anything";
}

std::string crash_mode(const ::testing::TestParamInfo<bool>& p) { return p.param ? "BackgroundWriter" : "InTheSave"; }
INSTANTIATE_TEST_SUITE_P(InTheSaveAndByTheWriter, SessionCrash, ::testing::Bool(), crash_mode);

}  // namespace
