// The session store's directory is private to one context (docs/reliability.md, "Security rules"): directories
// created 0700 and files 0600; a directory that others can write or another user owns is refused at kvret_create;
// a second context on a directory in use is refused (KVRET_ERR_BUSY), in this process and in another; a link planted
// at a temporary file's old predictable name is never written through; a link or a FIFO planted in place of a blob
// reads as corrupt without blocking, and its target is left alone.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include "kvret.h"
#include "sequence_observer.hpp"
#include "test_util.hpp"

using namespace kvret::test;
namespace fs = std::filesystem;

#if defined(__SANITIZE_THREAD__)
#define KVRET_TEST_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVRET_TEST_UNDER_TSAN 1
#endif
#endif

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kvret-files-XXXXXX").string();
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

unsigned mode_of(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::lstat(p.c_str(), &st), 0) << p;
  return st.st_mode & 07777;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// The key a blob file's name stands for ("b<hex of the key>.kvb"); empty for another name.
std::string key_of(const std::string& name) {
  if (name.size() < 6 || name[0] != 'b' || name.substr(name.size() - 4) != ".kvb") return "";
  std::string key;
  for (size_t i = 1; i + 1 < name.size() - 4; i += 2)
    key += static_cast<char>(std::stoi(name.substr(i, 2), nullptr, 16));
  return key;
}

/// The blob files of the directory: (file name, key).
std::vector<std::pair<std::string, std::string>> blobs(const fs::path& dir) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (const std::string key = key_of(name); !key.empty()) out.emplace_back(name, key);
  }
  return out;
}

/// A context whose saves go to the disk tier at `dir` (nothing fits in DRAM).
kvret_config disk_config(const std::string& dir) {
  kvret_config c = small_config();
  c.disk_path = dir.c_str();
  c.session_dram_bytes = 1;
  return c;
}

void save_one(kvret_context* ctx, const char* id, uint64_t seed) {
  Seq s(ctx);
  F32 k({200, kHeads, kDim}), v({200, kHeads, kDim});
  clustered_kv(200, kHeads, kDim, seed, k, v);
  for (int32_t layer = 0; layer < kLayers; ++layer) prefill(s.s, layer, k, v, 0, 200);
  ASSERT_EQ(kvret_session_save(s.s, id), KVRET_OK) << kvret_last_error();
  ASSERT_EQ(kvret_session_flush(ctx), KVRET_OK) << kvret_last_error();
}

TEST(SessionFiles, DirectoriesAre0700AndFiles0600) {
  TempDir tmp;
  const std::string dir = (tmp.path / "a" / "b").string();  // neither exists
  ::umask(022);                                             // a usual umask: it would give 0755 and 0644
  {
    auto ctx = make_context(disk_config(dir));
    ASSERT_NE(ctx, nullptr);
    save_one(ctx.get(), "private", 1);
  }
  EXPECT_EQ(mode_of(tmp.path / "a"), 0700u);
  EXPECT_EQ(mode_of(dir), 0700u);
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    EXPECT_EQ(mode_of(e.path()), 0600u) << e.path();
    ++files;
  }
  EXPECT_GE(files, 4u);  // the lock, the manifest and the layers
}

TEST(SessionFiles, ADirectoryOthersCanWriteIsRefused) {
  for (const unsigned mode : {0777u, 0775u, 0722u}) {
    TempDir tmp;
    ASSERT_EQ(::chmod(tmp.path.c_str(), mode), 0);
    const std::string dir = tmp.path.string();
    kvret_context* ctx = nullptr;
    const kvret_config c = disk_config(dir);
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT) << std::oct << mode;
    EXPECT_EQ(ctx, nullptr);
    const std::string message = kvret_last_error();
    EXPECT_NE(message.find("config.disk_path"), std::string::npos) << message;
    EXPECT_NE(message.find("group or others"), std::string::npos) << message;
    EXPECT_TRUE(fs::is_empty(tmp.path)) << "nothing was written there";
  }
  TempDir ok;  // read and search bits for others are not a risk to the files (they are 0600)
  ASSERT_EQ(::chmod(ok.path.c_str(), 0755), 0);
  const std::string dir = ok.path.string();
  EXPECT_NE(make_context(disk_config(dir)), nullptr);
}

TEST(SessionFiles, ADirectoryOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory to another user";
  TempDir tmp;
  ASSERT_EQ(::chown(tmp.path.c_str(), 65534, 65534), 0);
  ASSERT_EQ(::chmod(tmp.path.c_str(), 0700), 0);
  const std::string dir = tmp.path.string();
  kvret_context* ctx = nullptr;
  const kvret_config c = disk_config(dir);
  EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ctx, nullptr);
  EXPECT_NE(std::string(kvret_last_error()).find("belongs to user id 65534"), std::string::npos) << kvret_last_error();
}

TEST(SessionFiles, ASecondContextOnADirectoryInUseIsRefused) {
  TempDir tmp;
  const std::string dir = tmp.path.string();
  auto first = make_context(disk_config(dir));
  ASSERT_NE(first, nullptr);
  save_one(first.get(), "kept", 2);
  // in this process
  kvret_context* second = nullptr;
  const kvret_config c = disk_config(dir);
  EXPECT_EQ(kvret_create(&c, &second), KVRET_ERR_BUSY);
  EXPECT_EQ(second, nullptr);
  EXPECT_NE(std::string(kvret_last_error()).find("in use by another kvret context"), std::string::npos)
      << kvret_last_error();
#ifndef KVRET_TEST_UNDER_TSAN  // ThreadSanitizer cannot run a child forked from a multi-threaded process
  // in another process
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    kvret_context* other = nullptr;
    ::_exit(static_cast<int>(kvret_create(&c, &other)));
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), KVRET_ERR_BUSY);
#endif
  // the first context's session is whole; once it is gone, the directory is free
  int32_t tier = -1;
  ASSERT_EQ(kvret_session_where(first.get(), "kept", &tier), KVRET_OK);
  EXPECT_EQ(tier, KVRET_TIER_DISK);
  first.reset();
  auto next = make_context(disk_config(dir));
  ASSERT_NE(next, nullptr);
  ASSERT_EQ(kvret_session_where(next.get(), "kept", &tier), KVRET_OK);
  EXPECT_EQ(tier, KVRET_TIER_DISK);
}

TEST(SessionFiles, ALinkAtATemporaryNameIsNotWrittenThrough) {
  TempDir tmp;
  const fs::path dir = tmp.path / "sessions";
  const fs::path victim = tmp.path / "victim.txt";
  { std::ofstream(victim) << "precious"; }
  const std::string dir_s = dir.string();
  auto ctx = make_context(disk_config(dir_s));
  ASSERT_NE(ctx, nullptr);
  save_one(ctx.get(), "s", 3);
  // links at the temporary names a put of each blob used to take (name.<pid>.tmp), to a file of this user's
  for (const auto& [name, key] : blobs(dir))
    ASSERT_EQ(::symlink(victim.c_str(), (dir / (name + "." + std::to_string(::getpid()) + ".tmp")).c_str()), 0);
  save_one(ctx.get(), "s", 4);  // writes the manifest again under the same name
  EXPECT_EQ(read_file(victim), "precious");
  // a link in place of the manifest: the next save replaces the link, not its target
  for (const auto& [name, key] : blobs(dir))
    if (key.size() > 2 && key.substr(key.size() - 2) == ".m") {
      fs::remove(dir / name);
      ASSERT_EQ(::symlink(victim.c_str(), (dir / name).c_str()), 0);
    }
  save_one(ctx.get(), "s", 5);
  EXPECT_EQ(read_file(victim), "precious");
}

/// Replaces the layer-0 blob of the only session in `dir` with what `plant` makes at its path.
template <class Plant>
void replace_layer0(const fs::path& dir, Plant plant) {
  bool done = false;
  for (const auto& [name, key] : blobs(dir))
    if (key.size() > 3 && key.substr(key.size() - 3) == ".l0") {
      fs::remove(dir / name);
      plant(dir / name);
      done = true;
    }
  ASSERT_TRUE(done) << "no layer-0 blob in " << dir;
}

/// Opens `id` on another thread; the status and that thread's message (kvret_last_error is per thread), or
/// KVRET_ERR_INTERNAL when it blocked past 10 s (then the FIFO at `fifo`, if any, is opened for writing and closed,
/// so that the blocked read ends).
std::pair<kvret_status, std::string> open_without_blocking(kvret_context* ctx, const char* id, const fs::path& fifo) {
  auto result = std::async(std::launch::async, [&] {
    kvret_seq* s = nullptr;
    const kvret_status st = kvret_session_open(ctx, id, &s);
    std::string message = kvret_last_error();
    if (s != nullptr) kvret_seq_close(s);
    return std::make_pair(st, message);
  });
  if (result.wait_for(std::chrono::seconds(10)) == std::future_status::ready) return result.get();
  ADD_FAILURE() << "kvret_session_open blocked";
  const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
  if (fd >= 0) ::close(fd);
  result.wait();
  return {KVRET_ERR_INTERNAL, "blocked"};
}

TEST(SessionFiles, AFifoInPlaceOfABlobIsCorruptAndDoesNotBlock) {
  TempDir tmp;
  const fs::path dir = tmp.path / "sessions";
  const std::string dir_s = dir.string();
  {
    auto ctx = make_context(disk_config(dir_s));
    save_one(ctx.get(), "s", 6);
  }
  fs::path fifo;
  replace_layer0(dir, [&](const fs::path& p) {
    fifo = p;
    ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0);
  });
  auto ctx = make_context(disk_config(dir_s));
  ASSERT_NE(ctx, nullptr);
  const auto [status, message] = open_without_blocking(ctx.get(), "s", fifo);
  EXPECT_EQ(status, KVRET_ERR_CORRUPT);
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
  EXPECT_FALSE(fs::exists(fs::symlink_status(fifo)));  // dropped with its session
  int32_t tier = -1;
  ASSERT_EQ(kvret_session_where(ctx.get(), "s", &tier), KVRET_OK);
  EXPECT_EQ(tier, KVRET_TIER_NONE);
}

TEST(SessionFiles, ALinkInPlaceOfABlobIsCorruptAndItsTargetStays) {
  TempDir tmp;
  const fs::path dir = tmp.path / "sessions";
  const std::string dir_s = dir.string();
  {
    auto ctx = make_context(disk_config(dir_s));
    save_one(ctx.get(), "s", 7);
  }
  const fs::path target = tmp.path / "elsewhere.kvb";
  replace_layer0(dir, [&](const fs::path& p) {
    // the genuine blob, moved out and linked back: still not followed
    { std::ofstream(target) << "some file of this user's"; }
    ASSERT_EQ(::symlink(target.c_str(), p.c_str()), 0);
  });
  auto ctx = make_context(disk_config(dir_s));
  ASSERT_NE(ctx, nullptr);
  const auto [status, message] = open_without_blocking(ctx.get(), "s", {});
  EXPECT_EQ(status, KVRET_ERR_CORRUPT);
  EXPECT_NE(message.find("symbolic link"), std::string::npos) << message;
  EXPECT_EQ(read_file(target), "some file of this user's");
}

}  // namespace
