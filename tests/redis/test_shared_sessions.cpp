// A session saved by one process opens in another: byte-exact keys and values, identical selections and working
// sets. The saving process is this test program again (run with KVRET_SHARED_CHILD_* set), with its own context;
// it writes what it observed of the saved sequence to a file, and the opening process compares. Two ways to share:
// a disk directory both processes use, and the shared tier on Redis (a redis-server of the test's own; the opening
// context has no disk tier: it finds the session in Redis only).
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "kvret.h"
#include "redis_server.hpp"
#include "sequence_observer.hpp"
#include "test_util.hpp"

extern char** environ;

namespace {

using namespace kvret::test;
namespace fs = std::filesystem;

constexpr const char* kSessionId = "conversation-7";

// ---- what a process observed, written to a file and read back --------------------------------------------------

struct Snapshot {
  Observed observed;
  std::vector<float> raw;  // every layer's length, keys and values
  bool operator==(const Snapshot&) const = default;
};

void PrintTo(const Snapshot& s, std::ostream* os) {
  PrintTo(s.observed, os);
  *os << ", " << s.raw.size() << " raw floats";
}

template <typename T>
void put_vec(std::ofstream& f, const std::vector<T>& v) {
  const uint64_t n = v.size();
  f.write(reinterpret_cast<const char*>(&n), sizeof n);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
}
template <typename T>
std::vector<T> get_vec(std::ifstream& f) {
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), sizeof n);
  if (!f || n > (uint64_t{1} << 32)) return {};
  std::vector<T> v(n);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
  return v;
}

bool write_snapshot(const std::string& path, const Snapshot& s) {
  std::ofstream f(path, std::ios::binary);
  put_vec(f, s.observed.lengths);
  put_vec(f, std::vector<int64_t>{s.observed.tokens, s.observed.host_bytes, s.observed.index_bytes});
  put_vec(f, std::vector<uint64_t>{s.observed.selections.size(), s.observed.working_sets.size()});
  for (const auto& sel : s.observed.selections) put_vec(f, sel);
  for (const auto& ws : s.observed.working_sets) put_vec(f, ws);
  put_vec(f, s.raw);
  return static_cast<bool>(f);
}

Snapshot read_snapshot(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  Snapshot s;
  s.observed.lengths = get_vec<int64_t>(f);
  const auto stats = get_vec<int64_t>(f);
  if (stats.size() == 3) {
    s.observed.tokens = stats[0];
    s.observed.host_bytes = stats[1];
    s.observed.index_bytes = stats[2];
  }
  const auto counts = get_vec<uint64_t>(f);
  if (counts.size() == 2) {
    for (uint64_t i = 0; i < counts[0]; ++i) s.observed.selections.push_back(get_vec<int32_t>(f));
    for (uint64_t i = 0; i < counts[1]; ++i) s.observed.working_sets.push_back(get_vec<float>(f));
  }
  s.raw = get_vec<float>(f);
  return s;
}

Snapshot snapshot(kvret_seq* s) {
  Snapshot out;
  out.observed = observe(s);
  out.raw = read_layers(s);
  return out;
}

// The configuration both processes use: `how` is "disk" (at = a directory) or "redis" (at = a URL). It points into
// `at`, which must outlive it.
kvret_config shared_config(const std::string& how, const std::string& at) {
  kvret_config c = small_config(KVRET_INDEX_PQ);
  if (how == "disk") {
    c.disk_path = at.c_str();
    c.session_dram_bytes = 1;  // no session fits in DRAM: saves go to the disk
  }
  if (how == "redis") c.session_shared_url = at.c_str();
  return c;
}

// ---- the saving process ----------------------------------------------------------------------------------------

TEST(SharedSessionsChild, Save) {
  const char* how = std::getenv("KVRET_SHARED_CHILD_HOW");
  const char* at = std::getenv("KVRET_SHARED_CHILD_AT");
  const char* out = std::getenv("KVRET_SHARED_CHILD_OUT");
  if (how == nullptr || at == nullptr || out == nullptr)
    GTEST_SKIP() << "the saving process of SharedSessions (run by it, with KVRET_SHARED_CHILD_* set)";
  const std::string how_s = how, at_s = at;  // the config points into at_s
  const kvret_config config = shared_config(how_s, at_s);
  auto ctx = make_context(config);
  F32 k({900, kHeads, kDim}), v({900, kHeads, kDim});
  clustered_kv(900, kHeads, kDim, 5, k, v);
  Seq s(ctx.get());
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    prefill(s.s, layer, k, v, 0, 880);
    decode(s.s, layer, k, v, 880, 900);
  }
  ASSERT_EQ(kvret_session_save(s.s, kSessionId), KVRET_OK) << kvret_last_error();
  ASSERT_EQ(kvret_session_flush(ctx.get()), KVRET_OK) << kvret_last_error();  // the shared tier's write is done
  ASSERT_TRUE(write_snapshot(out, snapshot(s.s)));
}

// ---- the opening process ---------------------------------------------------------------------------------------

// Runs this program as the saving process; its exit status.
int run_saver(const std::string& how, const std::string& at, const std::string& out) {
  std::vector<std::string> env_strings = {"KVRET_SHARED_CHILD_HOW=" + how, "KVRET_SHARED_CHILD_AT=" + at,
                                          "KVRET_SHARED_CHILD_OUT=" + out};
  std::vector<char*> env;
  for (std::string& e : env_strings) env.push_back(e.data());
  for (char** e = environ; *e != nullptr; ++e)
    if (std::string(*e).rfind("KVRET_SHARED_CHILD_", 0) != 0) env.push_back(*e);
  env.push_back(nullptr);
  std::string exe = fs::read_symlink("/proc/self/exe").string();
  std::string filter = "--gtest_filter=SharedSessionsChild.Save";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  pid_t pid = 0;
  if (::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, env.data()) != 0) return -1;
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

class SharedSessions : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvret-shared-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string dir_;
};

TEST_P(SharedSessions, SavedInOneProcessOpensByteExactInAnother) {
  const std::string how = GetParam();
  std::unique_ptr<kvret_test::RedisServer> server;
  std::string at = dir_ + "/sessions";
  if (how == "redis") {
    if (kvret_test::find_redis_server().empty()) GTEST_SKIP() << "redis-server is not installed";
    server = std::make_unique<kvret_test::RedisServer>(kvret_test::RedisServer::Options{});
    ASSERT_TRUE(server->start()) << server->log();
    at = server->url("?prefix=shared-test");
  }
  const std::string out = dir_ + "/saved.snapshot";
  ASSERT_EQ(run_saver(how, at, out), 0) << "the saving process failed";
  const Snapshot saved = read_snapshot(out);
  ASSERT_FALSE(saved.raw.empty());
  ASSERT_FALSE(saved.observed.selections.empty());
  ASSERT_FALSE(saved.observed.working_sets.empty());

  // another process, another context: for Redis, one without a disk tier of its own (another node)
  auto ctx = make_context(shared_config(how, at));
  int32_t tier = -1;
  ASSERT_EQ(kvret_session_where(ctx.get(), kSessionId, &tier), KVRET_OK) << kvret_last_error();
  EXPECT_EQ(tier, how == "redis" ? KVRET_TIER_SHARED : KVRET_TIER_DISK);
  kvret_seq* opened = nullptr;
  ASSERT_EQ(kvret_session_open(ctx.get(), kSessionId, &opened), KVRET_OK) << kvret_last_error();
  Seq restored(opened);
  EXPECT_EQ(snapshot(restored.s), saved);
}

INSTANTIATE_TEST_SUITE_P(Through, SharedSessions, ::testing::Values("disk", "redis"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param == "disk" ? std::string("ADiskDirectory") : std::string("Redis");
                         });

}  // namespace
