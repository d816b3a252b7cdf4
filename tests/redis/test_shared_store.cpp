// The session store with its shared tier on Redis (config.session_shared_url), through the C ABI: contexts stand for
// the nodes of a serving stack, each with its own local tiers, all pointed at one redis-server of the test's own.
// A bad URL makes no context; a save writes through, and a server that is down fails only the write-through
// (kvret_session_flush reports it; the local tiers keep the session); a newer save on another node replaces a local
// copy; drop removes the session everywhere; another configuration does not see it; damage is KVRET_ERR_CORRUPT and
// then a miss; time-to-live; a restarted server with persistence serves the session; killing the server mid-save
// leaves the old version or a miss, never a corrupt hit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kvret.h"
#include "redis_server.hpp"
#include "sequence_observer.hpp"
#include "test_util.hpp"

namespace {

using namespace kvret::test;
using kvret_test::Raw;
using kvret_test::RedisServer;
namespace fs = std::filesystem;

constexpr const char* kPrefix = "store-test";

/// Every layer's length, keys and values, as kvret_seq_read gives them.

/// `tokens` clustered tokens (from `seed`) as a prefill of every layer.
void fill(kvret_seq* s, int32_t layers, int64_t tokens, uint64_t seed) {
  F32 k({tokens, kHeads, kDim}), v({tokens, kHeads, kDim});
  clustered_kv(tokens, kHeads, kDim, seed, k, v);
  for (int32_t layer = 0; layer < layers; ++layer) prefill(s, layer, k, v, 0, tokens);
}

int32_t where(kvret_context* ctx, const char* id) {
  int32_t tier = -1;
  EXPECT_EQ(kvret_session_where(ctx, id, &tier), KVRET_OK) << kvret_last_error();
  return tier;
}

/// The status of opening `id`, and what the opened sequence holds (empty on failure).
std::pair<kvret_status, std::vector<float>> open_contents(kvret_context* ctx, const char* id, int32_t layers) {
  kvret_seq* s = nullptr;
  const kvret_status st = kvret_session_open(ctx, id, &s);
  if (st != KVRET_OK) {
    EXPECT_EQ(s, nullptr);
    return {st, {}};
  }
  Seq opened(s);
  return {st, read_layers(s, layers)};
}

// ---- the URL at kvret_create -------------------------------------------------------------------------------------

TEST(SharedStoreUrl, ABadUrlMakesNoContext) {
  kvret_config c = small_config();
  for (const char* url : {"http://127.0.0.1:6379", "redis://", "redis://127.0.0.1:0", "redis://127.0.0.1:6379/x",
                          "redis://127.0.0.1:6379?colour=red"}) {
    c.session_shared_url = url;
    kvret_context* ctx = nullptr;
    EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT) << url;
    EXPECT_EQ(ctx, nullptr) << url;
    EXPECT_NE(std::string(kvret_last_error()).find("config.session_shared_url"), std::string::npos)
        << kvret_last_error();
  }
  c.session_shared_url = "redis://:secret-word@127.0.0.1:6379?colour=red";
  kvret_context* ctx = nullptr;
  EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(kvret_last_error()).find("secret-word"), std::string::npos) << kvret_last_error();
  c.session_shared_url = "rediss://127.0.0.1:6379";
  EXPECT_EQ(kvret_create(&c, &ctx), KVRET_ERR_UNSUPPORTED);
  EXPECT_EQ(ctx, nullptr);
}

TEST(SharedStoreUrl, AGoodUrlConnectsOnFirstUseAndTheContextKeepsACopy) {
  // nothing listens there: kvret_create does not connect
  std::string url = "redis://127.0.0.1:" + std::to_string(kvret_test::free_port()) + "/3?prefix=p&timeout_ms=500";
  kvret_config c = small_config();
  c.session_shared_url = url.c_str();
  auto ctx = make_context(c);
  ASSERT_NE(ctx, nullptr);
  url.assign(url.size(), 'x');  // the caller's string may change once kvret_create returns
  kvret_config got;
  kvret_config_init(&got);
  KVRET_ASSERT_OK(kvret_get_config(ctx.get(), &got));
  ASSERT_NE(got.session_shared_url, nullptr);
  EXPECT_NE(std::strstr(got.session_shared_url, "/3?prefix=p&timeout_ms=500"), nullptr) << got.session_shared_url;
  // the first call that needs the server: a lookup on a local miss is KVRET_ERR_IO naming the endpoint
  int32_t tier = -1;
  EXPECT_EQ(kvret_session_where(ctx.get(), "absent", &tier), KVRET_ERR_IO);
  EXPECT_NE(std::string(kvret_last_error()).find("redis://127.0.0.1:"), std::string::npos) << kvret_last_error();
  kvret_seq* s = nullptr;
  EXPECT_EQ(kvret_session_open(ctx.get(), "absent", &s), KVRET_ERR_IO);
  EXPECT_EQ(s, nullptr);
  // "" is no shared tier
  c.session_shared_url = "";
  auto plain = make_context(c);
  KVRET_ASSERT_OK(kvret_get_config(plain.get(), &got));
  EXPECT_EQ(got.session_shared_url, nullptr);
  EXPECT_EQ(where(plain.get(), "absent"), KVRET_TIER_NONE);
}

TEST(SharedStoreUrl, TheConfigShowsTheUrlWithItsPasswordMasked) {
  // the context keeps the password to authenticate with; kvret_get_config (what a caller logs) shows "***"
  if (kvret_test::find_redis_server().empty()) GTEST_SKIP() << "redis-server is not installed";
  RedisServer server(RedisServer::Options{false, {"--requirepass", "s3cret:pw@x"}});
  ASSERT_TRUE(server.start()) << server.log();
  const std::string port = std::to_string(server.port());
  for (const std::string& user : {std::string(), std::string("default")}) {
    SCOPED_TRACE(user.empty() ? "password only" : "username and password");
    const std::string url = "redis://" + user + ":s3cret%3Apw%40x@127.0.0.1:" + port + "/0?prefix=masked";
    kvret_config c = small_config();
    c.session_shared_url = url.c_str();
    auto ctx = make_context(c);
    ASSERT_NE(ctx, nullptr) << kvret_last_error();
    kvret_config got;
    kvret_config_init(&got);
    KVRET_ASSERT_OK(kvret_get_config(ctx.get(), &got));
    ASSERT_NE(got.session_shared_url, nullptr);
    const std::string shown = got.session_shared_url;
    EXPECT_EQ(shown.find("s3cret"), std::string::npos) << shown;
    EXPECT_EQ(shown, "redis://" + user + ":***@127.0.0.1:" + port + "/0?prefix=masked");
    // and the real password still authenticates: a save reaches the server, a second context opens it
    Seq s(ctx.get());
    fill(s.s, kLayers, 100, 3);
    KVRET_ASSERT_OK(kvret_session_save(s.s, "masked"));
    KVRET_ASSERT_OK(kvret_session_flush(ctx.get()));
    auto other = make_context(c);
    EXPECT_EQ(where(other.get(), "masked"), KVRET_TIER_SHARED);
  }
}

// ---- with a server -------------------------------------------------------------------------------------------------

class SharedStore : public ::testing::Test {
 protected:
  virtual bool persistent() const { return false; }
  void SetUp() override {
    if (kvret_test::find_redis_server().empty()) GTEST_SKIP() << "redis-server is not installed";
    server_ = std::make_unique<RedisServer>(RedisServer::Options{persistent(), {"--appendfsync", "always"}});
    ASSERT_TRUE(server_->start()) << server_->log();
    url_ = server_->url(std::string("?prefix=") + kPrefix + "&timeout_ms=2000");
    char tmpl[] = "/tmp/kvret-shared-store-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  /// A node's configuration: DRAM only, or (disk) its own directory under dir_ with no room in DRAM.
  kvret_config config(int index_kind = KVRET_INDEX_PQ, const std::string& disk = "") {
    kvret_config c = small_config(index_kind);
    c.session_shared_url = url_.c_str();
    if (!disk.empty()) {
      disks_.push_back(std::make_unique<std::string>(dir_ + "/" + disk));
      c.disk_path = disks_.back()->c_str();
      c.session_dram_bytes = 1;  // no session fits in DRAM: saves go to the disk
    }
    return c;
  }
  std::vector<std::string> heads() {
    Raw raw(server_->port());
    return raw.keys(std::string(kPrefix) + ":h:*");
  }

  std::unique_ptr<RedisServer> server_;
  std::string url_, dir_;
  std::vector<std::unique_ptr<std::string>> disks_;
};

TEST_F(SharedStore, AServerDownAtSaveFailsOnlyTheWriteThrough) {
  for (const std::string disk : {"", "node-a"}) {
    SCOPED_TRACE(disk.empty() ? "DRAM" : "disk");  // the server runs (SetUp, or started again below)
    auto a = make_context(config(KVRET_INDEX_PQ, disk));
    server_->kill9();
    Seq s(a.get());
    fill(s.s, kLayers, 300, 5);
    const std::vector<float> saved = read_layers(s.s, kLayers);
    KVRET_ASSERT_OK(kvret_session_save(s.s, "down"));
    EXPECT_EQ(kvret_session_flush(a.get()), KVRET_ERR_IO);
    EXPECT_NE(std::string(kvret_last_error()).find("write-through"), std::string::npos) << kvret_last_error();
    KVRET_ASSERT_OK(kvret_session_flush(a.get()));  // reported once
    // the local tiers have it, and serve it without the server
    EXPECT_EQ(where(a.get(), "down"), disk.empty() ? KVRET_TIER_DRAM : KVRET_TIER_DISK);
    const auto [st, got] = open_contents(a.get(), "down", kLayers);
    ASSERT_EQ(st, KVRET_OK) << kvret_last_error();
    EXPECT_EQ(got, saved);
    KVRET_ASSERT_OK(kvret_session_flush(a.get()));
    // the server back: the next save writes through, and another node opens it
    ASSERT_TRUE(server_->start()) << server_->log();
    KVRET_ASSERT_OK(kvret_session_save(s.s, "down"));
    KVRET_ASSERT_OK(kvret_session_flush(a.get()));
    auto b = make_context(config());
    EXPECT_EQ(where(b.get(), "down"), KVRET_TIER_SHARED);
    const auto [st_b, got_b] = open_contents(b.get(), "down", kLayers);
    ASSERT_EQ(st_b, KVRET_OK) << kvret_last_error();
    EXPECT_EQ(got_b, saved);
    // down again: a node serves its own copy (it cannot ask whether another node saved a later one)
    server_->kill9();
    const auto [st_a, got_a] = open_contents(a.get(), "down", kLayers);
    ASSERT_EQ(st_a, KVRET_OK) << kvret_last_error();
    EXPECT_EQ(got_a, saved);
    EXPECT_EQ(open_contents(b.get(), "down", kLayers).first, KVRET_ERR_IO);  // b has no copy of its own
    KVRET_ASSERT_OK(kvret_session_drop(a.get(), "down"));  // the local copy goes; the shared one cannot
    EXPECT_EQ(kvret_session_flush(a.get()), KVRET_ERR_IO);
    ASSERT_TRUE(server_->start()) << server_->log();  // without persistence: empty
    EXPECT_EQ(kvret_session_drop(b.get(), "down"), KVRET_ERR_NOT_FOUND);
    EXPECT_EQ(where(a.get(), "down"), KVRET_TIER_NONE);
  }
}

TEST_F(SharedStore, ANewerSaveOnAnotherNodeReplacesTheLocalCopy) {
  auto a = make_context(config());
  auto b = make_context(config());
  Seq s(a.get());
  fill(s.s, kLayers, 300, 7);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "conversation"));
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  EXPECT_EQ(where(a.get(), "conversation"), KVRET_TIER_DRAM);
  EXPECT_EQ(where(b.get(), "conversation"), KVRET_TIER_SHARED);

  // the next turn runs on b: it opens the session, appends, saves
  kvret_seq* opened = nullptr;
  KVRET_ASSERT_OK(kvret_session_open(b.get(), "conversation", &opened));
  Seq turn(opened);
  EXPECT_EQ(read_layers(turn.s, kLayers), read_layers(s.s, kLayers));
  F32 k({40, kHeads, kDim}), v({40, kHeads, kDim});
  clustered_kv(40, kHeads, kDim, 8, k, v);
  for (int32_t layer = 0; layer < kLayers; ++layer) decode(turn.s, layer, k, v, 0, 40);
  const std::vector<float> second = read_layers(turn.s, kLayers);
  KVRET_ASSERT_OK(kvret_session_save(turn.s, "conversation"));
  KVRET_ASSERT_OK(kvret_session_flush(b.get()));

  // the turn after runs on a again: its own copy is of the older save, so it reads the newer one
  EXPECT_EQ(where(a.get(), "conversation"), KVRET_TIER_DRAM);
  auto [st, got] = open_contents(a.get(), "conversation", kLayers);
  ASSERT_EQ(st, KVRET_OK) << kvret_last_error();
  EXPECT_EQ(got, second);
  EXPECT_EQ(where(a.get(), "conversation"), KVRET_TIER_SHARED);  // the older copy was dropped
  // b's own copy is the current save: served as is
  std::tie(st, got) = open_contents(b.get(), "conversation", kLayers);
  ASSERT_EQ(st, KVRET_OK) << kvret_last_error();
  EXPECT_EQ(got, second);
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  KVRET_ASSERT_OK(kvret_session_flush(b.get()));

  // one node's drop removes it everywhere (b's local copy, the shared tier's keys); a's drop then finds nothing
  KVRET_ASSERT_OK(kvret_session_drop(b.get(), "conversation"));
  EXPECT_EQ(where(b.get(), "conversation"), KVRET_TIER_NONE);
  EXPECT_EQ(where(a.get(), "conversation"), KVRET_TIER_NONE);
  EXPECT_EQ(open_contents(a.get(), "conversation", kLayers).first, KVRET_ERR_NOT_FOUND);
  EXPECT_EQ(kvret_session_drop(a.get(), "conversation"), KVRET_ERR_NOT_FOUND);
  EXPECT_TRUE(heads().empty());
  kvret_stats st_a;
  kvret_stats_init(&st_a);
  KVRET_ASSERT_OK(kvret_context_stats(a.get(), &st_a));
  EXPECT_GE(st_a.session_misses, 1);
}

TEST_F(SharedStore, ASlowServerFailsWithinTheTimeoutAndHoldsUpNoLocalCall) {
  // the session in Redis, saved by a node with a direct link
  auto a = make_context(config());
  Seq s(a.get());
  fill(s.s, kLayers, 300, 9);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "remote"));
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  // a node behind a link that trickles the server's replies (one byte every 0.3 s), timeout_ms=1000
  kvret_test::SlowProxy proxy(server_->port(), std::chrono::milliseconds(300));
  ASSERT_NE(proxy.port(), 0);
  const std::string slow_url = proxy.url(std::string("?prefix=") + kPrefix + "&timeout_ms=1000");
  kvret_config c = small_config();
  c.session_shared_url = slow_url.c_str();
  auto b = make_context(c);
  Seq local(b.get());
  fill(local.s, kLayers, 200, 10);
  KVRET_ASSERT_OK(kvret_session_save(local.s, "local"));  // in DRAM; its write-through fails
  EXPECT_EQ(kvret_session_flush(b.get()), KVRET_ERR_IO);
  // an open that needs the server, and meanwhile a lookup of a local session on another thread
  std::atomic<bool> opening{false};
  kvret_status open_status = KVRET_OK;
  std::string open_error;
  double open_seconds = 0;
  std::thread opener([&] {
    const auto t0 = std::chrono::steady_clock::now();
    kvret_seq* got = nullptr;
    opening = true;
    open_status = kvret_session_open(b.get(), "remote", &got);
    open_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (open_status != KVRET_OK) open_error = kvret_last_error();
    if (got != nullptr) kvret_seq_close(got);
  });
  while (!opening) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the open is waiting on the server
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(where(b.get(), "local"), KVRET_TIER_DRAM);
  const double where_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  opener.join();
  EXPECT_LT(where_seconds, 0.5);  // not held by the open's round trips
  EXPECT_EQ(open_status, KVRET_ERR_IO) << open_error;
  EXPECT_NE(open_error.find("timed out after 1000 ms"), std::string::npos) << open_error;
  EXPECT_LT(open_seconds, 3.0);  // about timeout_ms, not the reply's length times 0.3 s
  // the local session opens whole
  const auto [st, got] = open_contents(b.get(), "local", kLayers);
  EXPECT_EQ(st, KVRET_OK) << kvret_last_error();
}

TEST_F(SharedStore, AnotherConfigurationDoesNotSeeIt) {
  auto a = make_context(config(KVRET_INDEX_PQ));
  Seq s(a.get());
  fill(s.s, kLayers, 200, 9);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "pq-session"));
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  auto other = make_context(config(KVRET_INDEX_EXACT));
  EXPECT_EQ(where(other.get(), "pq-session"), KVRET_TIER_NONE);
  EXPECT_EQ(open_contents(other.get(), "pq-session", kLayers).first, KVRET_ERR_NOT_FOUND);
  EXPECT_NE(std::string(kvret_last_error()).find("another configuration"), std::string::npos) << kvret_last_error();
  auto same = make_context(config(KVRET_INDEX_PQ));
  EXPECT_EQ(where(same.get(), "pq-session"), KVRET_TIER_SHARED);
}

TEST_F(SharedStore, ADamagedLayerIsCorruptThenAMiss) {
  auto a = make_context(config());
  Seq s(a.get());
  fill(s.s, kLayers, 300, 11);
  const std::vector<float> saved = read_layers(s.s, kLayers);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "damaged"));
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  Raw raw(server_->port());
  const std::vector<std::string> chunks = raw.keys(std::string(kPrefix) + ":c:*.l1:*");
  ASSERT_FALSE(chunks.empty());
  const auto r = raw.cmd({"GETRANGE", chunks[0], "100", "100"});
  ASSERT_TRUE(r && r->type == REDIS_REPLY_STRING && r->len == 1);
  const std::string flipped(1, static_cast<char>(r->str[0] ^ 0x5a));
  ASSERT_GT(raw.integer({"SETRANGE", chunks[0], "100", flipped}), 100);  // the chunk's length

  auto b = make_context(config());
  EXPECT_EQ(open_contents(b.get(), "damaged", kLayers).first, KVRET_ERR_CORRUPT);
  EXPECT_EQ(open_contents(b.get(), "damaged", kLayers).first, KVRET_ERR_NOT_FOUND);  // dropped from the tier
  EXPECT_EQ(where(b.get(), "damaged"), KVRET_TIER_NONE);
  kvret_stats st;
  kvret_stats_init(&st);
  KVRET_ASSERT_OK(kvret_context_stats(b.get(), &st));
  EXPECT_EQ(st.session_corrupt, 1);
  // a's own copy is untouched
  const auto [st_a, got] = open_contents(a.get(), "damaged", kLayers);
  ASSERT_EQ(st_a, KVRET_OK) << kvret_last_error();
  EXPECT_EQ(got, saved);
}

TEST_F(SharedStore, TimeToLive) {
  kvret_config c = config();
  c.session_ttl_ms = 700;
  auto a = make_context(c);
  Seq s(a.get());
  fill(s.s, kLayers, 100, 13);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "short-lived"));
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  std::this_thread::sleep_for(std::chrono::milliseconds(900));
  auto b = make_context(c);
  EXPECT_EQ(where(b.get(), "short-lived"), KVRET_TIER_NONE);
  EXPECT_EQ(open_contents(b.get(), "short-lived", kLayers).first, KVRET_ERR_NOT_FOUND);
  EXPECT_TRUE(heads().empty());  // Redis expired every key
}

class SharedStorePersistent : public SharedStore {
 protected:
  bool persistent() const override { return true; }
};

TEST_F(SharedStorePersistent, ARestartedServerStillServesTheSession) {
  auto a = make_context(config());
  Seq s(a.get());
  fill(s.s, kLayers, 600, 15);
  KVRET_ASSERT_OK(kvret_session_save(s.s, "survivor"));
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  const Observed before = observe(s.s);
  const std::vector<float> saved = read_layers(s.s, kLayers);
  server_->kill9();
  ASSERT_TRUE(server_->start()) << server_->log();  // from its append-only file
  auto b = make_context(config());
  EXPECT_EQ(where(b.get(), "survivor"), KVRET_TIER_SHARED);
  kvret_seq* opened = nullptr;
  KVRET_ASSERT_OK(kvret_session_open(b.get(), "survivor", &opened));
  Seq restored(opened);
  EXPECT_EQ(read_layers(restored.s, kLayers), saved);
  EXPECT_EQ(observe(restored.s), before);  // the same selections and working sets
}

TEST_F(SharedStorePersistent, KillingTheServerMidSaveLeavesTheOldVersionOrAMiss) {
  // 6 layers of 6000 tokens (6 MiB each, in 4 MiB chunks): the server is killed once the new save's first layer is
  // in, while the others are being written
  constexpr int32_t layers = 6;
  auto make = [&] {
    kvret_config c = config(KVRET_INDEX_EXACT);
    c.n_layers = layers;
    return make_context(c);
  };
  auto a = make();
  Seq old_turn(a.get());
  fill(old_turn.s, layers, 200, 17);
  KVRET_ASSERT_OK(kvret_session_save(old_turn.s, "killed"));
  KVRET_ASSERT_OK(kvret_session_flush(a.get()));
  const std::vector<float> old_version = read_layers(old_turn.s, layers);
  const size_t old_heads = heads().size();
  ASSERT_EQ(old_heads, static_cast<size_t>(layers + 1));

  Seq new_turn(a.get());
  fill(new_turn.s, layers, 6000, 19);
  const std::vector<float> new_version = read_layers(new_turn.s, layers);
  std::atomic<bool> killed{false}, stop{false};
  std::thread killer([&] {
    Raw raw(server_->port());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!stop && std::chrono::steady_clock::now() < deadline) {
      if (raw.keys(std::string(kPrefix) + ":h:*").size() > old_heads) {  // a layer of the new save is in
        server_->kill9();
        killed = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  const kvret_status saved = kvret_session_save(new_turn.s, "killed");
  EXPECT_EQ(saved, KVRET_OK) << kvret_last_error();           // the local tier has it whatever the server did
  const kvret_status flushed = kvret_session_flush(a.get());  // the write-through runs in the background till here
  stop = true;
  killer.join();
  EXPECT_TRUE(flushed == KVRET_OK || flushed == KVRET_ERR_IO) << kvret_status_string(flushed);
  ASSERT_TRUE(killed) << "the server was not killed during the save";

  ASSERT_TRUE(server_->start()) << server_->log();
  auto b = make();
  const auto [st, got] = open_contents(b.get(), "killed", layers);
  ASSERT_TRUE(st == KVRET_OK || st == KVRET_ERR_NOT_FOUND) << kvret_status_string(st) << ": " << kvret_last_error();
  if (st == KVRET_OK) {
    EXPECT_TRUE(got == old_version || got == new_version) << "neither the old nor the new save";
  }
  if (flushed == KVRET_ERR_IO) {  // the write-through failed: the old version (appendfsync always kept it)
    EXPECT_EQ(st, KVRET_OK);
  }
  // the saving node still serves its own newer copy
  const auto [st_a, got_a] = open_contents(a.get(), "killed", layers);
  ASSERT_EQ(st_a, KVRET_OK) << kvret_last_error();
  EXPECT_EQ(got_a, new_version);
}

}  // namespace
