#pragma once
// The shared tier of the session store: blobs kept on a Redis server that every node of a serving stack reaches
// (docs/redis.md). A blob is stored as chunks of at most `chunk_bytes` bytes, each under its own key with its CRC-32,
// and one small head value naming the chunks; the head is written last, in one transaction, so a reader sees the old
// blob or the new one, never a part:
//
//   P:c:KEY:v<version>:<i>  chunk i of one version of the blob KEY (version: 16 hex digits, random per put)
//   P:h:KEY                 the head: magic, version, size, chunk size, chunk count, each chunk's CRC-32, its own
//                           CRC-32
//
// put: chunks first (pipelined, each with an expiry: the blob's time-to-live, or an orphan guard when it has none, so
// that a writer that dies mid-put leaves nothing behind for good), then MULTI / [PERSIST the chunks] / SET head GET /
// EXEC; the replaced version's chunks are then given a short expiry (a reader that read the old head a moment ago
// still finds them). get: the head, then the chunks (pipelined), each checked against its size and CRC-32; a chunk
// that is gone (the blob was replaced or expired meanwhile) makes the read start again from the head, a few times,
// and then it is a miss. A checksum or framing failure is KVRET_ERR_CORRUPT, a lost connection or a timeout
// KVRET_ERR_IO naming the endpoint (the next call connects again), a server out of memory KVRET_ERR_CAPACITY.
//
// Built with hiredis (KVRET_WITH_HIREDIS); without it, RedisTier's constructor throws KVRET_ERR_UNSUPPORTED and
// parse_redis_url still checks URLs. One connection per tier, guarded by a mutex: calls from several threads are
// serialized.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "session/blob_tier.hpp"

namespace kvret::session {

/// Where a shared tier is: the parts of a redis:// URL.
struct RedisEndpoint {
  bool tls = false;              // rediss://
  std::string host;              // a name, an IPv4 address, or an IPv6 address (without its brackets)
  int port = 6379;               // 1..65535
  int db = 0;                    // the database SELECTed after connecting, 0..2^31-1
  std::string username;          // AUTH username password (Redis 6 ACLs); empty: AUTH password
  std::string password;          // empty: no AUTH
  std::string prefix = "kvret";  // every key starts with "prefix:"
  int timeout_ms = 2000;         // connect and per-reply timeout, 1..3600000

  /// "redis://host:port/db (prefix P)", without the password: for messages.
  std::string describe() const;
};

/// Parses redis://[[username]:password@]host[:port][/db][?prefix=P&timeout_ms=N] (and rediss:// for TLS).
/// Percent-escapes (%XX) are decoded in the username, password and prefix. Throws kvret::Error
/// KVRET_ERR_INVALID_ARGUMENT naming what is wrong (the message never repeats the password); rediss:// parses, and
/// RedisTier refuses it when the build has no TLS.
RedisEndpoint parse_redis_url(const std::string& url);

/// True when this build has the Redis tier (hiredis); TLS (rediss://) is not built in either case.
bool redis_tier_available() noexcept;

class RedisTier;
/// The shared tier a context's config names: nullptr for NULL or "" (no shared tier), else a RedisTier on the parsed
/// URL (not connected yet). Throws kvret::Error as parse_redis_url and RedisTier's constructor do.
std::unique_ptr<RedisTier> open_shared_tier(const char* url);

class RedisTier final : public BlobTier {
 public:
  static constexpr size_t kDefaultChunkBytes = size_t{4} << 20;
  /// A replaced version's chunks stay readable this long for readers that read its head before the replace.
  static constexpr int64_t kDefaultReplaceGraceMs = 30'000;
  /// Chunks of a put without time-to-live expire after this long unless the put commits (a dead writer's chunks).
  static constexpr int64_t kOrphanGuardMs = 3'600'000;

  /// No connection is made here: the first call connects (and a failed call connects again on the next one).
  /// Throws kvret::Error KVRET_ERR_UNSUPPORTED (no hiredis in this build, or rediss:// without TLS),
  /// KVRET_ERR_INVALID_ARGUMENT (chunk_bytes 0 or above 512 MiB, a prefix with ':' at its end).
  explicit RedisTier(RedisEndpoint endpoint, size_t chunk_bytes = kDefaultChunkBytes,
                     int64_t replace_grace_ms = kDefaultReplaceGraceMs);
  ~RedisTier() override;
  RedisTier(const RedisTier&) = delete;
  RedisTier& operator=(const RedisTier&) = delete;

  const char* name() const noexcept override { return "redis"; }
  void put(const std::string& key, const std::byte* data, size_t size, int64_t ttl_ms) override;
  std::optional<std::vector<std::byte>> get(const std::string& key) override;
  bool remove(const std::string& key) override;

  /// Connects if needed and sends PING; throws KVRET_ERR_IO when the server cannot be reached.
  void ping();

  const RedisEndpoint& endpoint() const noexcept { return endpoint_; }
  size_t chunk_bytes() const noexcept { return chunk_bytes_; }
  /// The Redis keys of a blob's head and of chunk i of one version (for tools and tests).
  std::string head_key(const std::string& key) const;
  std::string chunk_key(const std::string& key, uint64_t version, size_t i) const;

 private:
  struct Connection;

  Connection& connection();  // connected, authenticated and on the endpoint's database; throws KVRET_ERR_IO
  void drop_connection() noexcept;
  void reseed();  // seeds rng_ (the versions of puts) for this process
  std::optional<std::vector<std::byte>> get_once(Connection& c, const std::string& key, bool& retry);

  RedisEndpoint endpoint_;
  size_t chunk_bytes_;
  int64_t replace_grace_ms_;
  std::mutex mutex_;
  std::unique_ptr<Connection> conn_;
  int conn_pid_ = 0;  // the process that made conn_: a forked child connects anew instead of sharing the socket
  std::mt19937_64 rng_;
  int rng_pid_ = 0;  // the process that seeded rng_
};

}  // namespace kvret::session
