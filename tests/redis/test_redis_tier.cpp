// The shared session tier on Redis (src/session/redis_tier.hpp). Each test that needs a server starts its own
// redis-server on loopback (a free port, its own temporary directory, stopped at the end); without redis-server on
// the PATH those tests are skipped. The URL tests need no server.
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "redis_server.hpp"
#include "session/redis_tier.hpp"

namespace {

using kvret::Error;
using kvret::session::parse_redis_url;
using kvret::session::RedisEndpoint;
using kvret::session::RedisTier;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using kvret_test::find_redis_server;
using kvret_test::free_port;
using kvret_test::Raw;
using kvret_test::RedisServer;

// ---- helpers --------------------------------------------------------------------------------------------------

std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    for (size_t b = 0; b < 8 && i + b < n; ++b) out[i + b] = static_cast<std::byte>((v >> (8 * b)) & 0xff);
  }
  return out;
}

RedisEndpoint endpoint_of(const RedisServer& server, const std::string& tail = "") {
  return parse_redis_url(server.url(tail));
}

kvret_status status_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.status();
  }
  return KVRET_OK;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// True when `got` holds exactly `want` (a miss is false, not a crash).
bool holds(const std::optional<std::vector<std::byte>>& got, const std::vector<std::byte>& want) {
  return got.has_value() && *got == want;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

#define SKIP_WITHOUT_REDIS()                                                                                         \
  do {                                                                                                               \
    if (!kvret::session::redis_tier_available()) GTEST_SKIP() << "built without hiredis";                            \
    if (find_redis_server().empty()) GTEST_SKIP() << "redis-server is not installed (apt-get install redis-server)"; \
  } while (0)

// ---- the URL --------------------------------------------------------------------------------------------------

TEST(RedisUrl, ParsesEveryPart) {
  RedisEndpoint e = parse_redis_url("redis://cache.example-1.internal");
  EXPECT_FALSE(e.tls);
  EXPECT_EQ(e.host, "cache.example-1.internal");
  EXPECT_EQ(e.port, 6379);
  EXPECT_EQ(e.db, 0);
  EXPECT_EQ(e.password, "");
  EXPECT_EQ(e.prefix, "kvret");
  EXPECT_EQ(e.timeout_ms, 2000);

  e = parse_redis_url("redis://:s3cr%40t%3A@10.0.0.7:6380/5?prefix=fleet%3Aa&timeout_ms=250");
  EXPECT_EQ(e.host, "10.0.0.7");
  EXPECT_EQ(e.port, 6380);
  EXPECT_EQ(e.db, 5);
  EXPECT_EQ(e.username, "");
  EXPECT_EQ(e.password, "s3cr@t:");
  EXPECT_EQ(e.prefix, "fleet:a");
  EXPECT_EQ(e.timeout_ms, 250);
  EXPECT_EQ(e.describe(), "redis://10.0.0.7:6380/5");

  e = parse_redis_url("REDIS://kv:pw@[::1]:7000/");
  EXPECT_EQ(e.host, "::1");
  EXPECT_EQ(e.port, 7000);
  EXPECT_EQ(e.db, 0);
  EXPECT_EQ(e.username, "kv");
  EXPECT_EQ(e.password, "pw");
  EXPECT_EQ(e.describe(), "redis://[::1]:7000/0");

  e = parse_redis_url("rediss://h?timeout_ms=1");
  EXPECT_TRUE(e.tls);
  EXPECT_EQ(e.timeout_ms, 1);
}

TEST(RedisUrl, RefusesBadUrlsByName) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "redis://"},
      {"http://h", "redis://"},
      {"redis://", "no host"},
      {"redis:///3", "no host"},
      {"redis://h:0", "port"},
      {"redis://h:65536", "port"},
      {"redis://h:", "port"},
      {"redis://h:12x", "port"},
      {"redis://h/-1", "database"},
      {"redis://h/abc", "database"},
      {"redis://h/1/2", "database"},
      {"redis://h/99999999999", "database"},
      {"redis://h?timeout_ms=0", "timeout_ms"},
      {"redis://h?timeout_ms=3600001", "timeout_ms"},
      {"redis://h?timeout_ms=", "timeout_ms"},
      {"redis://h?prefix=", "prefix"},
      {"redis://h?prefix=a&prefix=b", "twice"},
      {"redis://h?pfx=a", "unknown query parameter"},
      {"redis://h?prefix", "no '='"},
      {"redis://h?prefix=%zz", "escape"},
      {"redis://h?prefix=%4", "escape"},
      {"redis://h?prefix=%00", "%00"},
      {"redis://h#frag", "fragment"},
      {"redis://h ost", "spaces"},
      {"redis://bad_host!", "bad character"},
      {"redis://[::1", "']'"},
      {"redis://[]:1", "empty IPv6"},
      {"redis://[::1]x", "after the IPv6"},
      {"redis://[::g]", "IPv6"},
      {"redis://hunter2@h", "[username]:password@"},
      {"redis://user:@h", "empty password"},
  };
  for (const auto& [url, what] : bad) {
    std::string message;
    kvret_status status = KVRET_OK;
    try {
      parse_redis_url(url);
    } catch (const Error& e) {
      status = e.status();
      message = e.what();
    }
    EXPECT_EQ(status, KVRET_ERR_INVALID_ARGUMENT) << url;
    EXPECT_NE(message.find(what), std::string::npos) << url << " -> " << message;
    EXPECT_NE(message.find("session_shared_url"), std::string::npos) << message;
  }
  // the password is never repeated in a message
  const std::string message = message_of([] { parse_redis_url("redis://:hunter2%zz@h"); });
  EXPECT_NE(message.find("password"), std::string::npos) << message;
  EXPECT_EQ(message.find("hunter2"), std::string::npos) << message;
}

TEST(RedisUrl, NoUrlIsNoSharedTier) {
  EXPECT_EQ(kvret::session::open_shared_tier(nullptr), nullptr);
  EXPECT_EQ(kvret::session::open_shared_tier(""), nullptr);
  EXPECT_EQ(status_of([] { kvret::session::open_shared_tier("redis://h:0"); }), KVRET_ERR_INVALID_ARGUMENT);
  if (kvret::session::redis_tier_available()) {
    const auto tier = kvret::session::open_shared_tier("redis://10.1.2.3:7000/2?prefix=p");
    ASSERT_NE(tier, nullptr);
    EXPECT_EQ(tier->endpoint().describe(), "redis://10.1.2.3:7000/2");
    EXPECT_EQ(tier->head_key("k"), "p:h:k");
  } else {
    EXPECT_EQ(status_of([] { kvret::session::open_shared_tier("redis://h"); }), KVRET_ERR_UNSUPPORTED);
  }
}

TEST(RedisUrl, TlsIsRefusedAsUnsupported) {
  const RedisEndpoint e = parse_redis_url("rediss://:pw@h:6380");
  const std::string message = message_of([&] { RedisTier tier(e); });
  EXPECT_EQ(status_of([&] { RedisTier tier(e); }), KVRET_ERR_UNSUPPORTED);
  EXPECT_NE(message.find("TLS"), std::string::npos) << message;
}

TEST(RedisUrl, TierArgumentsAreChecked) {
  if (!kvret::session::redis_tier_available()) GTEST_SKIP() << "built without hiredis";
  const RedisEndpoint e = parse_redis_url("redis://127.0.0.1:1");
  EXPECT_EQ(status_of([&] { RedisTier tier(e, 0); }), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([&] { RedisTier tier(e, (size_t{512} << 20) + 1); }), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([&] { RedisTier tier(e, 1024, -1); }), KVRET_ERR_INVALID_ARGUMENT);
  RedisTier tier(e);  // no connection is made here
  const std::byte b{1};
  EXPECT_EQ(status_of([&] { tier.put("", &b, 1, 0); }), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([&] { tier.put(std::string("a\0b", 3), &b, 1, 0); }), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([&] { tier.put("k", &b, 1, -5); }), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([&] { tier.put("k", nullptr, 1, 0); }), KVRET_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(status_of([&] { (void)tier.get(""); }), KVRET_ERR_INVALID_ARGUMENT);
}

// ---- against a server -----------------------------------------------------------------------------------------

class RedisTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_REDIS();
    server_ = std::make_unique<RedisServer>(options());
    ASSERT_TRUE(server_->start()) << "redis-server did not start: " << server_->log();
  }
  virtual RedisServer::Options options() { return {}; }

  std::unique_ptr<RedisServer> server_;
};

TEST_F(RedisTierTest, RoundTripsByteExact) {
  constexpr size_t kChunk = 64 << 10;
  RedisTier tier(endpoint_of(*server_), kChunk);
  EXPECT_FALSE(tier.get("never").has_value());
  const std::vector<size_t> sizes = {0, 1, 7, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk, (1 << 20) + 123};
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::vector<std::byte> data = random_bytes(sizes[i], 100 + i);
    const std::string key = "blob/" + std::to_string(i);
    tier.put(key, data.data(), data.size(), 0);
    const auto got = tier.get(key);
    ASSERT_TRUE(got.has_value()) << sizes[i];
    EXPECT_EQ(*got, data) << sizes[i];
  }
  // every blob is still there, each byte-exact (no put disturbed another)
  for (size_t i = 0; i < sizes.size(); ++i)
    EXPECT_TRUE(holds(tier.get("blob/" + std::to_string(i)), random_bytes(sizes[i], 100 + i)));

  // keys with ':', spaces and high bytes; a key that spells another blob's chunk name is its own blob
  const std::string odd = std::string("sess:42 layer\xff\x01", 15);
  const auto a = random_bytes(3 * kChunk, 1);
  tier.put(odd, a.data(), a.size(), 0);
  const auto b = random_bytes(10, 2);
  const std::string look_alike = odd + ":v0000000000000000:0";
  tier.put(look_alike, b.data(), b.size(), 0);
  EXPECT_TRUE(holds(tier.get(odd), a));
  EXPECT_TRUE(holds(tier.get(look_alike), b));

  // a blob without TTL keeps no expiry on any of its keys (the chunks' orphan guard is lifted by the commit)
  Raw raw(server_->port());
  size_t expected = sizes.size() + 2 + 3 + 1;  // heads, and the chunks of the two odd keys
  for (const size_t size : sizes) expected += (size + kChunk - 1) / kChunk;
  const auto keys = raw.keys("kvret:*");
  EXPECT_EQ(keys.size(), expected);
  for (const std::string& k : keys) EXPECT_EQ(raw.integer({"PTTL", k}), -1) << k;
}

TEST_F(RedisTierTest, ReplaceIsAtomicForAConcurrentReader) {
  constexpr size_t kChunk = 16 << 10;
  // the writer and the reader are two nodes: two tiers, two connections
  RedisTier writer(endpoint_of(*server_), kChunk, /*replace_grace_ms=*/300);
  RedisTier reader(endpoint_of(*server_), kChunk, 300);
  // version v: a header word v, then bytes drawn from seed v; sizes vary so that chunk counts differ
  const auto make = [](uint64_t v) {
    std::vector<std::byte> out = random_bytes(40'000 + (v % 7) * 23'456, v);
    for (int b = 0; b < 8; ++b) out[b] = static_cast<std::byte>((v >> (8 * b)) & 0xff);
    return out;
  };
  constexpr uint64_t kVersions = 80;
  const auto first = make(1);
  writer.put("s", first.data(), first.size(), 0);
  std::atomic<bool> done{false};
  std::atomic<uint64_t> reads{0};
  std::atomic<uint64_t> bad{0};
  std::atomic<uint64_t> distinct_seen{0};
  std::string failure;
  std::thread reading([&] {
    uint64_t last = 0;
    while (!done.load()) {
      try {
        const auto got = reader.get("s");
        if (!got || got->size() < 8) {
          if (bad++ == 0) failure = "a miss or a short blob while the key was always present";
          continue;
        }
        uint64_t v = 0;
        for (int b = 0; b < 8; ++b) v |= uint64_t{std::to_integer<uint8_t>((*got)[b])} << (8 * b);
        if (v < 1 || v > kVersions || *got != make(v)) {
          if (bad++ == 0) failure = "a blob that is no version whole";
        }
        if (v != last) ++distinct_seen;
        last = v;
        ++reads;
      } catch (const Error& e) {
        if (bad++ == 0) failure = e.what();
      }
    }
  });
  for (uint64_t v = 2; v <= kVersions; ++v) {
    const auto data = make(v);
    writer.put("s", data.data(), data.size(), 0);
  }
  done = true;
  reading.join();
  EXPECT_EQ(bad.load(), 0u) << failure;
  EXPECT_GT(reads.load(), 20u);
  EXPECT_GE(distinct_seen.load(), 2u);  // the reader did see the blob change under it
  EXPECT_TRUE(holds(reader.get("s"), make(kVersions)));

  // the replaced versions' chunks are gone once their grace is over: the last version's keys are all that is left
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  Raw raw(server_->port());
  const size_t last_chunks = (make(kVersions).size() + kChunk - 1) / kChunk;
  EXPECT_EQ(raw.keys("kvret:*").size(), 1 + last_chunks);
}

TEST_F(RedisTierTest, TimeToLiveExpiresTheWholeBlob) {
  constexpr size_t kChunk = 4096;
  RedisTier tier(endpoint_of(*server_), kChunk);
  const auto data = random_bytes(5 * kChunk + 5, 7);
  tier.put("short", data.data(), data.size(), 1200);
  tier.put("long", data.data(), data.size(), 60'000);
  EXPECT_TRUE(holds(tier.get("short"), data));
  Raw raw(server_->port());
  for (const std::string& k : raw.keys("kvret:*")) {  // every key of both blobs carries an expiry within its TTL
    const long long pttl = raw.integer({"PTTL", k});
    EXPECT_GT(pttl, 0) << k;
    EXPECT_LE(pttl, 60'000) << k;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_FALSE(tier.get("short").has_value());
  EXPECT_TRUE(holds(tier.get("long"), data));
  EXPECT_TRUE(raw.keys("kvret:h:short").empty());
  EXPECT_TRUE(raw.keys("kvret:c:short:*").empty());
  // a put replacing a blob with TTL by one without: no expiry left anywhere
  tier.put("long", data.data(), data.size(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(raw.integer({"PTTL", "kvret:h:long"}), -1);
}

TEST_F(RedisTierTest, RemoveTakesEveryKey) {
  RedisTier tier(endpoint_of(*server_), 1000);
  const auto data = random_bytes(4500, 3);
  tier.put("gone", data.data(), data.size(), 0);
  tier.put("kept", data.data(), data.size(), 0);
  EXPECT_TRUE(tier.remove("gone"));
  EXPECT_FALSE(tier.get("gone").has_value());
  EXPECT_FALSE(tier.remove("gone"));
  EXPECT_FALSE(tier.remove("never"));
  Raw raw(server_->port());
  EXPECT_TRUE(raw.keys("kvret:*gone*").empty());
  EXPECT_EQ(raw.keys("kvret:*kept*").size(), 1u + 5u);
  EXPECT_TRUE(holds(tier.get("kept"), data));
}

TEST_F(RedisTierTest, PrefixesAndDatabasesAreSeparate) {
  RedisTier a(endpoint_of(*server_, "?prefix=node-a"), 1000);
  RedisTier b(endpoint_of(*server_, "/3?prefix=node-a"), 1000);
  RedisTier c(endpoint_of(*server_, "?prefix=node-c"), 1000);
  const auto x = random_bytes(2500, 5);
  a.put("k", x.data(), x.size(), 0);
  EXPECT_TRUE(holds(a.get("k"), x));
  EXPECT_FALSE(b.get("k").has_value());
  EXPECT_FALSE(c.get("k").has_value());
  b.put("k", x.data(), 10, 0);
  EXPECT_EQ(a.get("k").value_or(std::vector<std::byte>()).size(), x.size());
  Raw raw(server_->port());
  EXPECT_EQ(raw.keys("node-a:*").size(), 1u + 3u);
  raw.cmd({"SELECT", "3"});
  EXPECT_EQ(raw.keys("node-a:*").size(), 1u + 1u);
}

TEST_F(RedisTierTest, CorruptChunkOrHeadIsCorruptAndAMissingChunkIsAMiss) {
  constexpr size_t kChunk = 1000;
  RedisTier tier(endpoint_of(*server_), kChunk, /*replace_grace_ms=*/0);  // a replaced version's chunks go at once
  const auto data = random_bytes(3 * kChunk + 10, 9);
  tier.put("c", data.data(), data.size(), 0);
  Raw raw(server_->port());
  // the key of chunk i of the version the head names now (the head: magic, format, then the version, little-endian)
  const auto current_chunk = [&](size_t i) {
    const auto h = raw.cmd({"GET", "kvret:h:c"});
    uint64_t version = 0;
    for (int b = 0; b < 8 && h && h->len >= 16; ++b)
      version |= uint64_t{static_cast<unsigned char>(h->str[8 + b])} << (8 * b);
    return tier.chunk_key("c", version, i);
  };
  std::vector<std::string> chunks = raw.keys("kvret:c:c:v*:1");
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0], current_chunk(1));
  // same size, one byte changed: the CRC-32 fails
  std::string flipped(reinterpret_cast<const char*>(data.data()) + kChunk, kChunk);
  flipped[500] = static_cast<char>(flipped[500] ^ 0x10);
  raw.cmd({"SET", chunks[0], flipped});
  std::string message = message_of([&] { (void)tier.get("c"); });
  EXPECT_EQ(status_of([&] { (void)tier.get("c"); }), KVRET_ERR_CORRUPT);
  EXPECT_NE(message.find("checksum"), std::string::npos) << message;
  // a truncated chunk
  raw.cmd({"SET", chunks[0], flipped.substr(0, 999)});
  EXPECT_EQ(status_of([&] { (void)tier.get("c"); }), KVRET_ERR_CORRUPT);
  // the connection is still usable after a corrupt read (replies were all taken)
  const auto other = random_bytes(100, 10);
  tier.put("d", other.data(), other.size(), 0);
  EXPECT_TRUE(holds(tier.get("d"), other));
  // a put over the corrupt blob repairs it
  tier.put("c", data.data(), data.size(), 0);
  EXPECT_TRUE(holds(tier.get("c"), data));
  // a corrupt head
  const auto head = raw.cmd({"GET", "kvret:h:c"});
  std::string bad_head(head->str, head->len);
  bad_head[12] = static_cast<char>(bad_head[12] ^ 1);
  raw.cmd({"SET", "kvret:h:c", bad_head});
  EXPECT_EQ(status_of([&] { (void)tier.get("c"); }), KVRET_ERR_CORRUPT);
  raw.cmd({"SET", "kvret:h:c", "garbage"});
  EXPECT_EQ(status_of([&] { (void)tier.get("c"); }), KVRET_ERR_CORRUPT);
  // a chunk that is gone (evicted, expired) while its head stays: a clean miss
  tier.put("c", data.data(), data.size(), 0);
  EXPECT_EQ(raw.integer({"DEL", current_chunk(2)}), 1);
  EXPECT_FALSE(tier.get("c").has_value());
}

TEST_F(RedisTierTest, OneTierServesSeveralThreads) {
  RedisTier tier(endpoint_of(*server_), 2048);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        std::string key = std::to_string(t);  // (not "t" + ...: GCC 12's -Wrestrict false positive)
        key += '/';
        key += std::to_string(i % 3);
        const auto data = random_bytes(1000 + 997 * static_cast<size_t>(i), static_cast<uint64_t>(t * 1000 + i));
        try {
          tier.put(key, data.data(), data.size(), 0);
          const auto got = tier.get(key);
          if (!got || *got != data) ++bad;
        } catch (const Error&) {
          ++bad;
        }
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST_F(RedisTierTest, AForkedChildConnectsAnew) {
  // parent and child use the tier at the same time: on one shared socket their replies would interleave
  RedisTier tier(endpoint_of(*server_), 4096);
  const auto a = random_bytes(50'000, 21);
  const auto b = random_bytes(30'000, 22);
  tier.put("a", a.data(), a.size(), 0);  // connected before the fork
  tier.put("b", b.data(), b.size(), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  const bool in_child = child == 0;
  const auto& mine = in_child ? b : a;
  int bad = 0;
  try {  // each process's first put after the fork: their versions must differ (a shared one could mix chunks)
    tier.put(in_child ? "first/child" : "first/parent", mine.data(), 10, 0);
  } catch (const Error&) {
    ++bad;
  }
  for (int i = 0; i < 300; ++i) {
    try {
      const auto got = tier.get(in_child ? "b" : "a");
      if (!got || *got != mine) ++bad;
    } catch (const Error&) {
      ++bad;
    }
  }
  if (in_child) ::_exit(bad == 0 ? 0 : 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(bad, 0);
  Raw raw(server_->port());
  const auto version_of = [&](const std::string& head_key) {
    const auto h = raw.cmd({"GET", head_key});
    return h && h->len >= 16 ? std::string(h->str + 8, 8) : std::string();
  };
  const std::string child_version = version_of("kvret:h:first/child");
  ASSERT_EQ(child_version.size(), 8u);
  EXPECT_NE(child_version, version_of("kvret:h:first/parent"));
}

TEST_F(RedisTierTest, ServerOutOfMemoryIsCapacityAndTheOldBlobStays) {
  Raw raw(server_->port());
  raw.cmd({"CONFIG", "SET", "maxmemory-policy", "noeviction"});
  RedisTier tier(endpoint_of(*server_), 64 << 10);
  const auto old = random_bytes(100'000, 11);
  tier.put("k", old.data(), old.size(), 0);
  raw.cmd({"CONFIG", "SET", "maxmemory", std::to_string(4 << 20)});
  const auto big = random_bytes(16 << 20, 12);
  const std::string message = message_of([&] { tier.put("k", big.data(), big.size(), 0); });
  EXPECT_NE(message.find("OOM"), std::string::npos) << message;
  EXPECT_EQ(status_of([&] { tier.put("k", big.data(), big.size(), 0); }), KVRET_ERR_CAPACITY);
  EXPECT_TRUE(holds(tier.get("k"), old));
  raw.cmd({"CONFIG", "SET", "maxmemory", "0"});
  EXPECT_EQ(raw.keys("kvret:c:k:*").size(), 2u);  // the failed puts' chunks were taken back
}

TEST(RedisTierLink, ConnectionRefusedIsIoQuickly) {
  if (!kvret::session::redis_tier_available()) GTEST_SKIP() << "built without hiredis";
  const int port = free_port();
  ASSERT_NE(port, 0);
  RedisTier tier(parse_redis_url("redis://127.0.0.1:" + std::to_string(port) + "?timeout_ms=300"));
  const auto t0 = Clock::now();
  const std::string message = message_of([&] { (void)tier.get("k"); });
  EXPECT_LT(seconds_since(t0), 2.0);
  EXPECT_NE(message.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << message;
  const std::byte b{1};
  EXPECT_EQ(status_of([&] { tier.put("k", &b, 1, 0); }), KVRET_ERR_IO);
  EXPECT_EQ(status_of([&] { (void)tier.remove("k"); }), KVRET_ERR_IO);
  EXPECT_EQ(status_of([&] { tier.ping(); }), KVRET_ERR_IO);
}

TEST_F(RedisTierTest, AStalledServerTimesOutAndTheTierReconnects) {
  RedisTier tier(endpoint_of(*server_, "?timeout_ms=200"), 4096);
  const auto data = random_bytes(10'000, 13);
  tier.put("k", data.data(), data.size(), 0);
  server_->signal(SIGSTOP);
  auto t0 = Clock::now();
  const std::string message = message_of([&] { (void)tier.get("k"); });
  EXPECT_LT(seconds_since(t0), 2.0);
  EXPECT_NE(message.find("timed out after 200 ms"), std::string::npos) << message;
  t0 = Clock::now();
  EXPECT_EQ(status_of([&] { tier.put("k2", data.data(), data.size(), 0); }), KVRET_ERR_IO);  // a fresh connection
  EXPECT_LT(seconds_since(t0), 2.0);
  server_->signal(SIGCONT);
  EXPECT_TRUE(holds(tier.get("k"), data));
}

TEST_F(RedisTierTest, ATricklingServerTimesOutAfterTimeoutMsForTheWholeReply) {
  // one byte of each reply every 0.3 s: every read(2) gets a byte well within the timeout, and the 4 KiB chunk's
  // reply would take 20 minutes; the whole reply has timeout_ms
  const auto data = random_bytes(4096, 21);
  RedisTier direct(endpoint_of(*server_), 4096);
  direct.put("k", data.data(), data.size(), 0);
  kvret_test::SlowProxy proxy(server_->port(), std::chrono::milliseconds(300));
  ASSERT_NE(proxy.port(), 0);
  RedisTier slow(parse_redis_url(proxy.url("?timeout_ms=1000")), 4096);
  for (int attempt = 0; attempt < 2; ++attempt) {  // and again on a fresh connection
    const auto t0 = Clock::now();
    kvret_status status = KVRET_OK;
    std::string message;
    try {
      (void)slow.get("k");
    } catch (const Error& e) {
      status = e.status();
      message = e.what();
    }
    const double took = seconds_since(t0);
    EXPECT_EQ(status, KVRET_ERR_IO) << message;
    EXPECT_NE(message.find("timed out after 1000 ms"), std::string::npos) << message;
    EXPECT_GE(took, 0.9);
    EXPECT_LT(took, 3.0);
  }
  const auto t0 = Clock::now();
  EXPECT_EQ(status_of([&] { slow.put("k", data.data(), data.size(), 0); }), KVRET_ERR_IO);
  EXPECT_LT(seconds_since(t0), 3.0);
  EXPECT_TRUE(holds(direct.get("k"), data));  // the server itself is fine
}

// A fake server that answers the first command it reads with `reply` (sent as fast as the socket takes it), then
// keeps the connection open without a word until it is destroyed.
class FakeServer {
 public:
  explicit FakeServer(std::string reply) : reply_(std::move(reply)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd_, 4) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
      return;
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) ::close(fd_);
  }
  int port() const { return port_; }
  size_t sent() const { return sent_; }

 private:
  void serve() {
    int client = -1;
    while (!stop_ && client < 0) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) > 0) client = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    }
    if (client < 0) return;
    char buf[4096];
    bool answered = false;
    size_t off = 0;
    while (!stop_) {
      pollfd p{client, static_cast<short>(POLLIN | (answered && off < reply_.size() ? POLLOUT : 0)), 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      if ((p.revents & POLLIN) != 0) {
        if (::recv(client, buf, sizeof buf, 0) <= 0) break;
        answered = true;
      }
      if ((p.revents & POLLOUT) != 0) {
        const ssize_t n = ::send(client, reply_.data() + off, reply_.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) off += static_cast<size_t>(n);
        sent_ = off;
      }
    }
    ::close(client);
  }

  std::string reply_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<size_t> sent_{0};
  std::thread thread_;
};

TEST(RedisTierLink, AReplyLongerThanItsValueCanBeIsRefusedAsItArrives) {
  if (!kvret::session::redis_tier_available()) GTEST_SKIP() << "built without hiredis";
  // a head's GET answered with a 1 GB bulk string, 32 MiB of it sent at once: no head is that long, and the tier
  // refuses it as it arrives (before its timeout, buffering at most the head's limit) instead of waiting for the rest
  std::string reply = "$1000000000\r\n";
  reply.append(size_t{32} << 20, 'x');
  FakeServer fake(reply);
  ASSERT_NE(fake.port(), 0);
  RedisTier tier(parse_redis_url("redis://127.0.0.1:" + std::to_string(fake.port()) + "?timeout_ms=20000"));
  const auto t0 = Clock::now();
  kvret_status status = KVRET_OK;
  std::string message;
  try {
    (void)tier.get("k");
  } catch (const Error& e) {
    status = e.status();
    message = e.what();
  }
  EXPECT_EQ(status, KVRET_ERR_CORRUPT) << message;
  EXPECT_NE(message.find("longer than"), std::string::npos) << message;
  EXPECT_LT(seconds_since(t0), 10.0);
  EXPECT_LT(fake.sent(), size_t{32} << 20);  // not all of it was even taken
}

TEST(RedisTierLink, AnArrayReplyClaimingMoreElementsThanItCanHaveIsRefusedAtItsHeader) {
  if (!kvret::session::redis_tier_available()) GTEST_SKIP() << "built without hiredis";
  // 13 bytes claiming 2^31 - 1 elements: hiredis would make the element table (16 GiB) at the header; the tier
  // refuses the reply there, at once, naming the count (no reply of the tier has more than about a million)
  FakeServer fake("*2147483647\r\n");
  ASSERT_NE(fake.port(), 0);
  RedisTier tier(parse_redis_url("redis://127.0.0.1:" + std::to_string(fake.port()) + "?timeout_ms=20000"));
  const auto t0 = Clock::now();
  kvret_status status = KVRET_OK;
  std::string message;
  try {
    tier.ping();
  } catch (const Error& e) {
    status = e.status();
    message = e.what();
  }
  EXPECT_EQ(status, KVRET_ERR_IO) << message;
  EXPECT_NE(message.find("a reply of 2147483647 elements"), std::string::npos) << message;
  EXPECT_LT(seconds_since(t0), 5.0);
}

TEST_F(RedisTierTest, AServerGoneAwayIsIoAndNoSigpipe) {
  // a write to a connection whose server died raises SIGPIPE, whose default action would end this process
  RedisTier tier(endpoint_of(*server_), 1 << 20);
  const auto small = random_bytes(100, 18);
  tier.put("k", small.data(), small.size(), 0);  // connected
  server_->kill9();
  const auto big = random_bytes(32 << 20, 19);
  const auto t0 = Clock::now();
  EXPECT_EQ(status_of([&] { tier.put("k", big.data(), big.size(), 0); }), KVRET_ERR_IO);
  EXPECT_EQ(status_of([&] { tier.put("k", big.data(), big.size(), 0); }), KVRET_ERR_IO);  // refused now
  EXPECT_LT(seconds_since(t0), 5.0);
  ASSERT_TRUE(server_->start()) << server_->log();
  tier.put("k", small.data(), small.size(), 0);
  EXPECT_TRUE(holds(tier.get("k"), small));
}

class RedisTierAuthTest : public RedisTierTest {
  RedisServer::Options options() override { return {false, {"--requirepass", "pa:ss@word"}}; }
};

TEST_F(RedisTierAuthTest, PasswordIsSentAndAWrongOneIsIoWithoutEchoingIt) {
  RedisTier good(parse_redis_url("redis://:pa%3Ass%40word@127.0.0.1:" + std::to_string(server_->port())), 4096);
  const auto data = random_bytes(9000, 14);
  good.put("k", data.data(), data.size(), 0);
  EXPECT_TRUE(holds(good.get("k"), data));
  RedisTier wrong(parse_redis_url("redis://:n0tth3p4ss@127.0.0.1:" + std::to_string(server_->port())), 4096);
  const std::string message = message_of([&] { (void)wrong.get("k"); });
  EXPECT_EQ(status_of([&] { (void)wrong.get("k"); }), KVRET_ERR_IO);
  EXPECT_EQ(message.find("n0tth3p4ss"), std::string::npos) << message;
  RedisTier none(endpoint_of(*server_), 4096);
  EXPECT_EQ(status_of([&] { (void)none.get("k"); }), KVRET_ERR_IO);
}

class RedisTierPersistentTest : public RedisTierTest {
  // appendfsync always: with everysec, a server whose background fsync is slow (a busy disk) postpones its AOF
  // write for up to 2 s while it replies, so a kill -9 right after a put could lose it
  RedisServer::Options options() override { return {true, {"--appendfsync", "always"}}; }
};

TEST_F(RedisTierPersistentTest, ARestartedServerStillServesTheBlob) {
  RedisTier tier(endpoint_of(*server_), 64 << 10);
  const auto data = random_bytes((1 << 20) + 77, 15);
  tier.put("k", data.data(), data.size(), 0);
  tier.put("t", data.data(), 1000, 600'000);
  server_->kill9();
  EXPECT_EQ(status_of([&] { (void)tier.get("k"); }), KVRET_ERR_IO);
  ASSERT_TRUE(server_->start()) << server_->log();
  EXPECT_TRUE(holds(tier.get("k"), data));  // the same tier object: it connects again
  EXPECT_EQ(tier.get("t").value_or(std::vector<std::byte>()).size(), 1000u);
  RedisTier other(endpoint_of(*server_), 64 << 10);  // and another node reads it too
  EXPECT_TRUE(holds(other.get("k"), data));
}

TEST_F(RedisTierPersistentTest, KillingTheServerMidPutLeavesTheOldBlob) {
  constexpr size_t kChunk = 1 << 20;
  RedisTier tier(endpoint_of(*server_), kChunk);
  const auto old = random_bytes(3 * kChunk + 5, 16);
  tier.put("s", old.data(), old.size(), 0);
  const auto big = random_bytes(96 * kChunk, 17);
  // another thread watches the new version's chunks arrive and kills the server with SIGKILL after a few
  std::atomic<bool> killed{false};
  std::thread killer([&] {
    Raw raw(server_->port());
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (Clock::now() < deadline && raw.ok()) {
      if (raw.keys("kvret:c:s:*").size() >= 4 + 4) {
        server_->signal(SIGKILL);
        killed = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  kvret_status status = KVRET_OK;
  std::string message;
  try {
    tier.put("s", big.data(), big.size(), 0);
  } catch (const Error& e) {
    status = e.status();
    message = e.what();
  }
  killer.join();
  ASSERT_TRUE(killed.load());
  EXPECT_EQ(status, KVRET_ERR_IO);
  EXPECT_NE(message.find("127.0.0.1:" + std::to_string(server_->port())), std::string::npos) << message;
  server_->kill9();  // reap it
  ASSERT_TRUE(server_->start()) << server_->log();
  // the old blob whole: the new version's head was never written
  std::optional<std::vector<std::byte>> got;
  EXPECT_EQ(status_of([&] { got = tier.get("s"); }), KVRET_OK);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(*got, old);
  // the dead put's chunks carry the orphan guard's expiry; the old blob's keys none
  Raw raw(server_->port());
  for (const std::string& k : raw.keys("kvret:c:s:*")) {
    const long long pttl = raw.integer({"PTTL", k});
    EXPECT_TRUE(pttl == -1 || (pttl > 0 && pttl <= RedisTier::kOrphanGuardMs)) << k << " " << pttl;
  }
  // and the tier works on
  tier.put("s", big.data(), big.size(), 0);
  EXPECT_TRUE(holds(tier.get("s"), big));
}

}  // namespace
