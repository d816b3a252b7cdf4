// libFuzzer target over the bytes kvret reads back: the session store's files in the disk tier, and the replies of a
// Redis server to the shared tier. Any status is fine (these are untrusted bytes); a crash, a sanitizer report, a
// hang or KVRET_ERR_INTERNAL is a finding.
//
// Input byte 0 picks the part: 0..5 a disk session of one index kind, 6 and 7 a Redis call.
//
// Disk: once per process, a session of each index kind (EXACT, PQ, PAGE, STREAMING, CLUSTER, QUANT; two layers, a
// prefill and some decodes) is saved to a private directory, and its files are kept in memory. Each input writes them
// back with one file changed -- byte 1 picks the file (the manifest or a layer) and how: (0) byte edits of the
// payload, (1) the payload replaced by the input, (2) the payload cut or extended, then edited -- with the blob's
// checksums recomputed, so that the change gets past the CRCs to the parsers; or (3) the whole file, header included,
// replaced by the input as it is. Then a context opens the directory (reading the manifests), opens the session and,
// when that works, selects, fetches, reads and decodes on every layer and saves the session again.
//
// Redis: a thread of the process plays the server on a loopback port: on each connection it sends the reply bytes
// the input describes -- RESP items (statuses, errors, integers, nils, bulk strings, arrays, raw bytes) and, the item
// the fuzzer starts from, the whole reply a correct server gives to the call (a blob's head and chunks with their
// checksums), with one element changed -- then ends its side. The input's call (get, put, remove or ping, with a
// password and a database now and then) runs on the shared tier against it.
//
// With KVRET_FUZZ_STATS set, the process prints at exit how many inputs took each path and how many got KVRET_OK.
// Build: cmake -DKVRET_BUILD_FUZZ=ON with clang (scripts/fuzz.sh --target=session). Corpus: tests/fuzz/corpus_session.
#ifndef KVRET_EXPERIMENTAL
#define KVRET_EXPERIMENTAL
#endif
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/checksum.hpp"
#include "core/error.hpp"
#include "host_tensor.hpp"
#include "kvret.h"
#include "session/redis_tier.hpp"

namespace {

#define FUZZ_CHECK(cond)           \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

using Tensor = kvret::tools::HostTensor;
using kvret::tools::kF32;
using kvret::tools::kI32;

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool empty() const { return p_ >= end_; }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  uint8_t u8() { return p_ < end_ ? *p_++ : 0; }
  uint16_t u16() { return static_cast<uint16_t>(u8() | u8() << 8); }
  std::string bytes(size_t n) {
    n = std::min(n, left());
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  std::string rest() { return bytes(left()); }

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

// ----------------------------------------------------------------------------------------------------- statistics
enum Path {
  kInputs,
  kDiskCreate,
  kDiskOpen,
  kDiskSelect,
  kDiskFetch,
  kDiskRead,
  kDiskDecode,
  kDiskSave,
  kRedisGet,
  kRedisPut,
  kRedisRemove,
  kRedisPing,
  kPaths
};
const char* const kPathNames[kPaths] = {"inputs",     "disk_create", "disk_open",    "disk_select",
                                        "disk_fetch", "disk_read",   "disk_decode",  "disk_save",
                                        "redis_get",  "redis_put",   "redis_remove", "redis_ping"};
uint64_t g_made[kPaths], g_ok[kPaths], g_internal;
std::map<kvret_status, uint64_t> g_status;  // every status the paths returned, for the report

kvret_status tally(Path path, kvret_status status) {
  ++g_made[path];
  g_ok[path] += status == KVRET_OK;
  ++g_status[status];
  if (status == KVRET_ERR_INTERNAL) {
    // kvret's own bug by definition: stop here (with the message) when asked, else count it for the report
    if (++g_internal <= 5) std::fprintf(stderr, "kvret-fuzz INTERNAL: %s\n", kvret_last_error());
    if (std::getenv("KVRET_FUZZ_STRICT")) __builtin_trap();
  }
  return status;
}

void print_stats() {
  for (int i = 0; i < kPaths; ++i)
    std::fprintf(stderr, "kvret-fuzz %-14s %10llu calls %10llu OK %5.1f%%\n", kPathNames[i],
                 static_cast<unsigned long long>(g_made[i]), static_cast<unsigned long long>(g_ok[i]),
                 g_made[i] ? 100.0 * static_cast<double>(g_ok[i]) / static_cast<double>(g_made[i]) : 0.0);
  for (const auto& [status, n] : g_status)
    std::fprintf(stderr, "kvret-fuzz-status %-28s %10llu\n", kvret_status_string(status),
                 static_cast<unsigned long long>(n));
}

// ----------------------------------------------------------------------------------------------------------- disk
constexpr size_t kHeaderBytes = 32;  // the disk tier's blob header (src/session/disk_tier.cpp)
constexpr int kKinds = 6;
const int kKindOf[kKinds] = {KVRET_INDEX_EXACT,     KVRET_INDEX_PQ,      KVRET_INDEX_PAGE,
                             KVRET_INDEX_STREAMING, KVRET_INDEX_CLUSTER, KVRET_INDEX_QUANT};
constexpr int kLayers = 2, kKv = 2, kQ = 4, kDim = 64, kPrefill = 80, kDecodes = 6;
const char* const kId = "fuzz-session";

struct Saved {
  std::string dir;
  std::vector<std::pair<std::string, std::string>> files;  // name, bytes; the manifest first
};
Saved g_saved[kKinds];
std::string g_root;

kvret_config config_of(int kind, const std::string& dir) {
  kvret_config c;
  kvret_config_init(&c);
  c.n_layers = kLayers;
  c.n_kv_heads = kKv;
  c.n_q_heads = kQ;
  c.head_dim = kDim;
  c.kv_dtype = KVRET_KV_F16;
  c.index_kind = kKindOf[kind];
  c.n_sink = 2;
  c.n_local = 4;
  c.pq_m = 2;
  c.pq_bits = 4;
  c.pq_iters = 2;
  c.pq_train_sample = 0;
  c.page_size = 8;
  c.cluster_tokens = 8;
  c.cluster_decode_interval = 4;
  c.cluster_decode_k = 2;
  c.quant_group_size = 32;
  c.quant_residual = 8;
  c.n_threads = 1;
  c.background_build = 0;
  c.session_dram_bytes = 1;  // every session is larger: a save writes its files before it returns
  c.disk_path = dir.c_str();
  return c;
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') names.emplace_back(e->d_name);
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

void write_file(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  FUZZ_CHECK(fd >= 0);
  FUZZ_CHECK(::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

std::string read_file(const std::string& path) {
  std::string out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FUZZ_CHECK(fd >= 0);
  char buf[65536];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

void fill(std::vector<float>& x, uint64_t& rng) {
  for (float& v : x) v = static_cast<float>(static_cast<int64_t>(splitmix(rng) % 2001) - 1000) / 250.0f;
}

/// Saves the session of index kind `kind` into its own directory and keeps its files.
void save_session(int kind) {
  Saved& s = g_saved[kind];
  s.dir = g_root + "/k" + std::to_string(kind);
  FUZZ_CHECK(::mkdir(s.dir.c_str(), 0700) == 0);
  const kvret_config c = config_of(kind, s.dir);
  kvret_context* ctx = nullptr;
  FUZZ_CHECK(kvret_create(&c, &ctx) == KVRET_OK);
  kvret_seq* seq = nullptr;
  FUZZ_CHECK(kvret_seq_open(ctx, &seq) == KVRET_OK);
  uint64_t rng = 7 + static_cast<uint64_t>(kind);
  for (int l = 0; l < kLayers; ++l) {
    std::vector<float> k(kPrefill * kKv * kDim), v(k.size());
    fill(k, rng);
    fill(v, rng);
    Tensor kt(k.data(), {kPrefill, kKv, kDim}, kF32), vt(v.data(), kt.shape, kF32);
    FUZZ_CHECK(kvret_append_prefill(seq, l, &kt.t, &vt.t) == KVRET_OK);
    for (int i = 0; i < kDecodes; ++i) {
      std::vector<float> dk(kKv * kDim), dv(dk.size());
      fill(dk, rng);
      fill(dv, rng);
      Tensor dkt(dk.data(), {kKv, kDim}, kF32), dvt(dv.data(), dkt.shape, kF32);
      FUZZ_CHECK(kvret_append_decode(seq, l, &dkt.t, &dvt.t) == KVRET_OK);
    }
  }
  FUZZ_CHECK(kvret_session_save(seq, kId) == KVRET_OK);
  FUZZ_CHECK(kvret_session_flush(ctx) == KVRET_OK);
  kvret_seq_close(seq);
  FUZZ_CHECK(kvret_destroy(ctx) == KVRET_OK);
  // the manifest (its key ends in ".m", hex "2e6d") first, then the layers in order
  for (const std::string& name : list_dir(s.dir)) {
    if (name.size() < 5 || name.compare(name.size() - 4, 4, ".kvb") != 0) continue;
    const bool manifest = name.compare(name.size() - 8, 8, "2e6d.kvb") == 0;
    auto entry = std::make_pair(name, read_file(s.dir + "/" + name));
    if (manifest)
      s.files.insert(s.files.begin(), entry);
    else
      s.files.push_back(entry);
  }
  FUZZ_CHECK(s.files.size() == 1 + kLayers);
}

/// A blob file around `payload`, with the header the disk tier writes (no expiry).
std::string blob(const std::string& payload) {
  std::string out(kHeaderBytes, '\0');
  kvret::store_le<uint32_t>(out.data(), 0x4253564bu);
  kvret::store_le<uint32_t>(out.data() + 4, 1);
  kvret::store_le<uint64_t>(out.data() + 8, payload.size());
  kvret::store_le<int64_t>(out.data() + 16, 0);
  kvret::store_le<uint32_t>(out.data() + 24, kvret::crc32_of(payload.data(), payload.size()));
  kvret::store_le<uint32_t>(out.data() + 28, kvret::crc32_of(out.data(), 28));
  return out + payload;
}

void edit(std::string& payload, Reader& r) {
  while (r.left() >= 3 && !payload.empty()) {
    const size_t at = r.u16() % payload.size();
    payload[at] = static_cast<char>(r.u8());
  }
}

void run_disk(int kind, Reader& r) {
  const Saved& s = g_saved[kind];
  const uint8_t how = r.u8();
  const size_t target = how % s.files.size();
  // the directory as the save left it, but for the target file
  for (const std::string& name : list_dir(s.dir)) ::unlink((s.dir + "/" + name).c_str());
  for (size_t i = 0; i < s.files.size(); ++i) {
    std::string bytes = s.files[i].second;
    if (i == target) {
      std::string payload = bytes.substr(kHeaderBytes);
      switch (how >> 6) {
        case 0:
          edit(payload, r);
          break;
        case 1:
          payload = r.rest();
          break;
        case 2: {
          const size_t size = r.u16();
          payload.resize(size % (payload.size() + 64), '\0');
          edit(payload, r);
          break;
        }
        default:
          break;
      }
      bytes = how >> 6 == 3 ? r.rest() : blob(payload);
    }
    write_file(s.dir + "/" + s.files[i].first, bytes);
  }

  const kvret_config c = config_of(kind, s.dir);
  kvret_context* ctx = nullptr;
  if (tally(kDiskCreate, kvret_create(&c, &ctx)) != KVRET_OK) return;
  kvret_seq* seq = nullptr;
  if (tally(kDiskOpen, kvret_session_open(ctx, kId, &seq)) == KVRET_OK) {
    uint64_t rng = how;
    for (int l = 0; l < kLayers; ++l) {
      int64_t len = 0;
      if (kvret_seq_length(seq, l, &len) != KVRET_OK) continue;
      FUZZ_CHECK(len >= 0);
      std::vector<float> q(kQ * kDim);
      fill(q, rng);
      int32_t cap = 0;
      if (kvret_seq_budget(seq, l, &cap) != KVRET_OK) cap = 0;
      const int32_t width = std::max<int32_t>(1, cap);
      std::vector<int32_t> pos(static_cast<size_t>(kKv) * width, -1);
      Tensor qt(q.data(), {kQ, kDim}, kF32), pt(pos.data(), {kKv, width}, kI32);
      int32_t count = -1;
      if (tally(kDiskSelect, kvret_select(seq, l, &qt.t, KVRET_BUDGET_DEFAULT, &pt.t, &count)) == KVRET_OK) {
        int64_t rows = 0;
        if (kvret_working_set_capacity(seq, l, count, &rows) == KVRET_OK && rows <= (1 << 20)) {
          std::vector<float> wk(static_cast<size_t>(kKv * rows * kDim)), wv(wk.size());
          std::vector<int32_t> wp(static_cast<size_t>(kKv * rows));
          Tensor kt(wk.data(), {kKv, rows, kDim}, kF32), vt(wv.data(), kt.shape, kF32),
              wpt(wp.data(), {kKv, rows}, kI32);
          kvret_working_set ws{kt.t, vt.t, wpt.t};
          int64_t got = -1;
          tally(kDiskFetch, kvret_fetch_async(seq, l, &pt.t, count, &ws, &got, nullptr));
        }
      }
      if (len > 0 && len <= (1 << 16)) {
        std::vector<float> k(static_cast<size_t>(len * kKv * kDim)), v(k.size());
        Tensor kt(k.data(), {len, kKv, kDim}, kF32), vt(v.data(), kt.shape, kF32);
        tally(kDiskRead, kvret_seq_read(seq, l, 0, len, &kt.t, &vt.t));
      }
      std::vector<float> dk(kKv * kDim), dv(dk.size());
      fill(dk, rng);
      fill(dv, rng);
      Tensor dkt(dk.data(), {kKv, kDim}, kF32), dvt(dv.data(), dkt.shape, kF32);
      tally(kDiskDecode, kvret_append_decode(seq, l, &dkt.t, &dvt.t));
    }
    tally(kDiskSave, kvret_session_save(seq, kId));
    kvret_seq_close(seq);
  }
  kvret_destroy(ctx);
}

// ---------------------------------------------------------------------------------------------------------- redis
/// The fake server: each connection it accepts gets the current script, then the end of the server's side; what the
/// client sends is read and dropped until it closes.
class FakeServer {
 public:
  bool start() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return false;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 16) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      return false;
    port_ = ntohs(a.sin_port);
    std::thread([this] { loop(); }).detach();
    return true;
  }
  int port() const { return port_; }
  void set_script(std::string s) {
    std::lock_guard<std::mutex> lock(mu_);
    script_ = std::move(s);
  }
  uint64_t accepted() {
    std::lock_guard<std::mutex> lock(mu_);
    return accepted_;
  }
  /// Waits until every connection accepted so far is closed (the client closed its side).
  void wait_closed() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return closed_ == accepted_; });
  }

 private:
  void loop() {
    for (;;) {
      const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      std::string script;
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++accepted_;
        script = script_;
      }
      const timeval tv{5, 0};
      ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      size_t done = 0;
      while (done < script.size()) {
        const ssize_t n = ::send(c, script.data() + done, script.size() - done, MSG_NOSIGNAL);
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      ::shutdown(c, SHUT_WR);
      char buf[65536];
      while (::recv(c, buf, sizeof buf, 0) > 0) {
      }
      ::close(c);
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++closed_;
      }
      cv_.notify_all();
    }
  }

  int fd_ = -1;
  int port_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string script_;
  uint64_t accepted_ = 0, closed_ = 0;
};
FakeServer* g_server = nullptr;

std::string bulk(const std::string& s) { return "$" + std::to_string(s.size()) + "\r\n" + s + "\r\n"; }
const std::string kNil = "$-1\r\n";

/// The head value of a blob (src/session/redis_tier.cpp's layout), its checksum right.
std::string head_value(uint64_t version, const std::string& payload, size_t chunk) {
  std::string h = "KVRB";
  char b[8];
  const auto put32 = [&](uint32_t v) {
    kvret::store_le<uint32_t>(b, v);
    h.append(b, 4);
  };
  const auto put64 = [&](uint64_t v) {
    kvret::store_le<uint64_t>(b, v);
    h.append(b, 8);
  };
  const size_t n = (payload.size() + chunk - 1) / chunk;
  put32(1);
  put64(version);
  put64(payload.size());
  put64(chunk);
  put64(n);
  for (size_t i = 0; i < n; ++i) {
    const size_t len = std::min(chunk, payload.size() - i * chunk);
    put32(kvret::crc32_of(payload.data() + i * chunk, len));
  }
  put32(kvret::crc32_of(h.data(), h.size()));
  return h;
}

/// One RESP item of the script, as the input describes it (depth: of nested arrays).
std::string item(Reader& r, int depth) {
  const uint8_t t = r.u8();
  switch (t % 8) {
    case 0:
      return kNil;
    case 1: {
      const char* const statuses[] = {"+OK\r\n", "+QUEUED\r\n", "+PONG\r\n", "+\r\n"};
      return statuses[(t >> 3) % 4];
    }
    case 2:
      return t & 0x80 ? "-OOM command not allowed\r\n" : "-ERR fuzz\r\n";
    case 3:
      return ":" + std::to_string(static_cast<int8_t>(r.u8())) + "\r\n";
    case 4: {  // an array of up to 7 items (or a nil or huge one)
      const int n = (t >> 3) % 8;
      if (depth > 2 || n == 7) return (t & 0x80) ? "*-1\r\n" : "*99999999\r\n";
      std::string s = "*" + std::to_string(n) + "\r\n";
      for (int i = 0; i < n; ++i) s += item(r, depth + 1);
      return s;
    }
    case 5:
      return bulk(r.bytes(r.u8()));
    case 6:
      return r.bytes(r.u8());  // raw bytes: framing of any kind, a reply cut short
    default: {                 // a bulk string whose declared length is off
      const std::string body = r.bytes(r.u8() % 32);
      return "$" + std::to_string(static_cast<int64_t>(body.size()) + static_cast<int8_t>(r.u8())) + "\r\n" + body +
             "\r\n";
    }
  }
}

void run_redis(Reader& r) {
  if (g_server == nullptr) return;
  const uint8_t flags = r.u8();
  const uint8_t op = flags % 4;
  kvret::session::RedisEndpoint e;
  e.host = "127.0.0.1";
  e.port = g_server->port();
  e.prefix = "f";
  e.timeout_ms = 2000;
  if (flags & 0x10) e.password = "secret";
  if (flags & 0x20) e.db = 3;
  const size_t chunk = 1 + r.u8() % 64;
  // the blob of the call: a payload of up to 255 bytes from a seed
  const size_t size = r.u8();
  uint64_t rng = r.u8();
  std::string payload(size, '\0');
  for (char& ch : payload) ch = static_cast<char>(splitmix(rng));
  const size_t n = (size + chunk - 1) / chunk;
  // the replies a correct server gives, as a list of items
  std::vector<std::string> replies;
  if (!e.password.empty()) replies.push_back("+OK\r\n");
  if (e.db != 0) replies.push_back("+OK\r\n");
  const std::string head = head_value(splitmix(rng), payload, chunk);
  switch (op) {
    case 0:  // get: the head, then the chunks
      replies.push_back(bulk(head));
      for (size_t i = 0; i < n; ++i) replies.push_back(bulk(payload.substr(i * chunk, chunk)));
      break;
    case 1: {  // put: OK per chunk, MULTI, QUEUED per PERSIST and the SET, EXEC's array (with the replaced head)
      for (size_t i = 0; i < n; ++i) replies.push_back("+OK\r\n");
      replies.push_back("+OK\r\n");
      for (size_t i = 0; i < n + 1; ++i) replies.push_back("+QUEUED\r\n");
      std::string exec = "*" + std::to_string(n + 1) + "\r\n";
      for (size_t i = 0; i < n; ++i) exec += ":1\r\n";
      exec += flags & 0x40 ? bulk(head_value(1, std::string(40, 'o'), 16)) : kNil;
      replies.push_back(exec);
      if (flags & 0x40)
        for (int i = 0; i < 3; ++i) replies.push_back(":1\r\n");  // the old chunks' PEXPIRE
      break;
    }
    case 2:  // remove: the head (GETDEL), then an UNLINK per chunk
      replies.push_back(bulk(head));
      for (size_t i = 0; i < n; ++i) replies.push_back(":1\r\n");
      break;
    default:
      replies.push_back("+PONG\r\n");
      break;
  }
  // the input's changes: (index, item) pairs replace a reply, insert one, or cut the list there
  while (r.left() >= 2) {
    const uint8_t at = r.u8();
    const size_t i = replies.empty() ? 0 : (at & 0x3f) % (replies.size() + 1);
    switch (at >> 6) {
      case 0:
        if (i < replies.size()) replies[i] = item(r, 0);
        break;
      case 1:
        replies.insert(replies.begin() + static_cast<std::ptrdiff_t>(i), item(r, 0));
        break;
      case 2:
        replies.resize(std::min(i, replies.size()));
        break;
      default:
        if (i < replies.size() && !replies[i].empty())  // flip one byte of a reply
          replies[i][r.u8() % replies[i].size()] ^= static_cast<char>(1 + r.u8() % 255);
        break;
    }
  }
  std::string script;
  for (const std::string& s : replies) script += s;
  g_server->set_script(script);

  try {
    kvret::session::RedisTier tier(e, chunk, 0);
    try {
      switch (op) {
        case 0: {
          const auto got = tier.get("k");
          tally(kRedisGet, KVRET_OK);
          if (got) FUZZ_CHECK(got->size() <= (size_t{16} << 20));
          break;
        }
        case 1:
          tier.put("k", reinterpret_cast<const std::byte*>(payload.data()), payload.size(), flags & 0x80 ? 1000 : 0);
          tally(kRedisPut, KVRET_OK);
          break;
        case 2:
          tier.remove("k");
          tally(kRedisRemove, KVRET_OK);
          break;
        default:
          tier.ping();
          tally(kRedisPing, KVRET_OK);
          break;
      }
    } catch (const kvret::Error& err) {
      tally(static_cast<Path>(kRedisGet + op), err.status());
    }
  } catch (const kvret::Error& err) {
    FUZZ_CHECK(err.status() != KVRET_ERR_INTERNAL);
  }
  g_server->wait_closed();
}

void remove_tree() {
  for (int k = 0; k < kKinds; ++k) {
    if (g_saved[k].dir.empty()) continue;
    for (const std::string& name : list_dir(g_saved[k].dir)) ::unlink((g_saved[k].dir + "/" + name).c_str());
    ::unlink((g_saved[k].dir + "/.lock").c_str());
    ::rmdir(g_saved[k].dir.c_str());
  }
  ::rmdir(g_root.c_str());
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
  g_root = dir;
  std::atexit(remove_tree);
  for (int k = 0; k < kKinds; ++k) save_session(k);
  if (kvret::session::redis_tier_available()) {
    g_server = new FakeServer;  // lives as long as the process (its thread does)
    if (!g_server->start()) {
      std::perror("kvret-fuzz: the fake Redis server");
      std::abort();
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ++g_made[kInputs];
  ++g_ok[kInputs];
  Reader r(data, size);
  const uint8_t part = r.u8() % 8;
  if (part < kKinds)
    run_disk(part, r);
  else
    run_redis(r);
  return 0;
}
