// kvret-bench-sessions: times the session store (kvret_session_*) on one sequence of a model's shape filled with
// random keys and values: save to DRAM, open from DRAM, a save that evicts another session to disk (it returns
// before the background writer has written the evicted one; then kvret_session_flush waits for it), save to disk (a
// context whose DRAM tier holds nothing), open from disk (a new context on the same directory: until the first layer is
// ready, and until every layer is), and the bytes on disk. docs/sessions.md, "Timings".
//
// --io-compare R: instead, the disk tier's block I/O alone, its buffered writes and reads (DiskTier::put and get,
// the store's own code) against the same files written and read with O_DIRECT, in the same run, R rounds
// alternating which goes first: a session's layer blobs (the shape's KV bytes per layer) written (fsync'd,
// renamed), then read back with the page cache dropped (buffered) or bypassed (O_DIRECT), and, buffered, read again
// from the page cache. docs/sessions.md, "O_DIRECT".
#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "core/checksum.hpp"
#include "kvret.h"
#include "session/disk_tier.hpp"

namespace {

struct Options {
  int32_t layers = 32;
  int32_t q_heads = 32;
  int32_t kv_heads = 8;
  int32_t head_dim = 128;
  int64_t tokens = 2048;
  int32_t index = KVRET_INDEX_PQ;
  std::string dir;  // empty: a new directory under $TMPDIR (removed at the end)
  bool drop_cache = true;
  bool json = false;
  uint64_t seed = 1;
  std::string shared_url;  // non-empty: also time the shared tier (Redis) through the store
  int io_compare = 0;      // > 0: compare buffered and O_DIRECT block I/O over this many rounds instead
};

void usage() {
  std::printf(
      "usage: kvret-bench-sessions [options]\n"
      "  --layers N --q-heads N --kv-heads N --head-dim N   the model's shape (default 32, 32, 8, 128: Llama-3-8B)\n"
      "  --tokens N            tokens of the sequence (default 2048)\n"
      "  --index K             exact | pq | page | cluster | quant | streaming (default pq)\n"
      "  --dir PATH            the disk tier's directory (default: a new one under $TMPDIR, removed after)\n"
      "  --keep-cache          do not evict the session's files from the page cache before opening from disk\n"
      "  --seed N              (default 1)\n"
      "  --shared-url URL      also time the shared tier: a save written through to the Redis server at URL\n"
      "                        (config.session_shared_url) and flushed, and an open from it in a context without\n"
      "                        a disk tier\n"
      "  --io-compare R        instead: the disk tier's buffered block I/O against O_DIRECT, R rounds (a\n"
      "                        session's layer blobs written, read cold, read warm)\n"
      "  --json                one JSON object instead of the table\n");
}

int32_t index_of(std::string_view s) {
  if (s == "exact") return KVRET_INDEX_EXACT;
  if (s == "pq") return KVRET_INDEX_PQ;
  if (s == "page") return KVRET_INDEX_PAGE;
  if (s == "cluster") return KVRET_INDEX_CLUSTER;
  if (s == "quant") return KVRET_INDEX_QUANT;
  if (s == "streaming") return KVRET_INDEX_STREAMING;
  throw std::invalid_argument("--index: unknown kind '" + std::string(s) + "'");
}

const char* index_name(int32_t k) {
  static const char* names[] = {"exact", "pq", "streaming", "page", "cluster", "quant"};
  return names[k];
}

void check(kvret_status s, const char* what) {
  if (s != KVRET_OK) throw std::runtime_error(std::string(what) + ": " + kvret_last_error());
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// xorshift64*: uniform floats in [-1, 1) (the shape of the data does not matter to the store).
struct Random {
  uint64_t s;
  float next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return static_cast<float>(static_cast<double>((s * 2685821657736338717ull) >> 40) / 8388608.0 - 1.0);
  }
};

kvret_config make_config(const Options& o, const char* disk_path, int64_t dram_bytes) {
  kvret_config c;
  kvret_config_init(&c);
  c.n_layers = o.layers;
  c.n_q_heads = o.q_heads;
  c.n_kv_heads = o.kv_heads;
  c.head_dim = o.head_dim;
  c.index_kind = o.index;
  c.kv_dtype = KVRET_KV_F16;
  c.disk_path = disk_path;
  c.session_dram_bytes = dram_bytes;
  return c;
}

/// A sequence of `ctx` holding o.tokens random tokens in every layer (index builds finished); returns the seconds.
double prefill(kvret_context* ctx, const Options& o, kvret_seq** out) {
  check(kvret_seq_open(ctx, out), "kvret_seq_open");
  const size_t n = static_cast<size_t>(o.tokens) * static_cast<size_t>(o.kv_heads) * static_cast<size_t>(o.head_dim);
  std::vector<float> k(n), v(n);
  Random rng{o.seed * 0x9e3779b97f4a7c15ull + 1};
  int64_t shape[3] = {o.tokens, o.kv_heads, o.head_dim};
  kvret_tensor kt{k.data(), {KVRET_DEVICE_CPU, 0}, 3, {KVRET_DTYPE_FLOAT, 32, 1}, shape, nullptr, 0};
  kvret_tensor vt = kt;
  vt.data = v.data();
  double total = 0;
  for (int32_t l = 0; l < o.layers; ++l) {
    for (size_t i = 0; i < n; ++i) k[i] = rng.next(), v[i] = rng.next();
    const auto t0 = std::chrono::steady_clock::now();
    check(kvret_append_prefill(*out, l, &kt, &vt), "kvret_append_prefill");
    total += seconds_since(t0);
  }
  const auto t0 = std::chrono::steady_clock::now();
  check(kvret_wait_index(*out, -1), "kvret_wait_index");
  return total + seconds_since(t0);
}

/// Evicts the directory's files from the page cache (their pages are clean after the store's fsync), so the open
/// reads the disk.
void drop_cache(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const int fd = ::open((dir + "/" + e->d_name).c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  ::closedir(d);
}

void remove_dir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  while (const dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    ::unlink((dir + "/" + e->d_name).c_str());
  }
  ::closedir(d);
  ::rmdir(dir.c_str());
}

// ---- --io-compare: buffered (DiskTier, the store's code) against O_DIRECT ---------------------------------------

constexpr size_t kAlign = 4096;  // the logical block size O_DIRECT needs (offsets, lengths, buffer addresses)
constexpr size_t kHeader = 32;   // DiskTier's blob header

size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct AlignedBuffer {
  std::byte* p = nullptr;
  explicit AlignedBuffer(size_t n) {
    void* q = nullptr;
    if (::posix_memalign(&q, kAlign, std::max<size_t>(n, kAlign)) != 0) throw std::bad_alloc();
    p = static_cast<std::byte*>(q);
  }
  ~AlignedBuffer() { std::free(p); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

[[noreturn]] void sys_error(const std::string& what) { throw std::runtime_error(what + ": " + std::strerror(errno)); }

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) sys_error("opening " + dir);
  ::fsync(fd);
  ::close(fd);
}

/// The blob as DiskTier::put writes it (the same header: magic, version, size, expiry, CRC-32s), with O_DIRECT:
/// header and payload copied into an aligned buffer padded to the block size, written, truncated to the blob's
/// size, fsync'd, renamed over the old file, the directory fsync'd.
void direct_put(const std::string& dir, const std::string& name, const std::byte* data, size_t size) {
  const size_t total = kHeader + size;
  AlignedBuffer buf(round_up(total));
  std::byte* h = buf.p;
  const uint32_t magic = 0x4253564bu, version = 1, zero = 0;
  const uint64_t n = size;
  const int64_t expires = 0;
  std::memcpy(h, &magic, 4);
  std::memcpy(h + 4, &version, 4);
  std::memcpy(h + 8, &n, 8);
  std::memcpy(h + 16, &expires, 8);
  const uint32_t crc = kvret::crc32_of(data, size);
  std::memcpy(h + 24, &crc, 4);
  std::memcpy(h + 28, &zero, 4);
  const uint32_t hcrc = kvret::crc32_of(h, 28);
  std::memcpy(h + 28, &hcrc, 4);
  std::memcpy(h + kHeader, data, size);
  std::memset(h + total, 0, round_up(total) - total);
  const std::string path = dir + "/" + name, tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0) sys_error("opening " + tmp + " with O_DIRECT");
  size_t done = 0;
  while (done < round_up(total)) {
    const ssize_t w = ::write(fd, h + done, round_up(total) - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      sys_error("writing " + tmp);
    }
    done += static_cast<size_t>(w);
  }
  if (::ftruncate(fd, static_cast<off_t>(total)) != 0) sys_error("truncating " + tmp);
  if (::fsync(fd) != 0) sys_error("syncing " + tmp);
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) sys_error("renaming " + tmp);
  fsync_dir(dir);
}

/// The blob's payload read with O_DIRECT into an aligned buffer, its CRC-32s checked (as DiskTier::get does), and
/// copied out.
std::vector<std::byte> direct_get(const std::string& dir, const std::string& name) {
  const std::string path = dir + "/" + name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) sys_error("opening " + path + " with O_DIRECT");
  struct stat st {};
  ::fstat(fd, &st);
  const auto total = static_cast<size_t>(st.st_size);
  AlignedBuffer buf(round_up(total));
  size_t done = 0;
  while (done < total) {
    const ssize_t r = ::read(fd, buf.p + done, round_up(total) - done);
    if (r < 0) {
      if (errno == EINTR) continue;
      sys_error("reading " + path);
    }
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  ::close(fd);
  if (done < total || total < kHeader) throw std::runtime_error(path + ": short read");
  uint32_t hcrc = 0, crc = 0;
  std::memcpy(&hcrc, buf.p + 28, 4);
  std::memcpy(&crc, buf.p + 24, 4);
  if (hcrc != kvret::crc32_of(buf.p, 28) || crc != kvret::crc32_of(buf.p + kHeader, total - kHeader))
    throw std::runtime_error(path + ": checksum mismatch");
  return std::vector<std::byte>(buf.p + kHeader, buf.p + total);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// --io-compare: o.layers blobs of `layer_bytes` each (random bytes), written and read back by both ways.
void io_compare(const Options& o, size_t layer_bytes) {
  std::vector<std::byte> payload(layer_bytes);
  Random rng{o.seed * 0x9e3779b97f4a7c15ull + 7};
  for (size_t i = 0; i < payload.size(); i += 4) {
    const float f = rng.next();
    std::memcpy(payload.data() + i, &f, std::min<size_t>(4, payload.size() - i));
  }
  const std::string bdir = o.dir + "/buffered", ddir = o.dir + "/direct";
  ::mkdir(bdir.c_str(), 0755);
  ::mkdir(ddir.c_str(), 0755);
  kvret::session::DiskTier tier(bdir);
  std::vector<std::string> keys;  // "l<layer>"
  for (int32_t l = 0; l < o.layers; ++l) keys.push_back(std::string(1, 'l').append(std::to_string(l)));
  const auto key = [&](int32_t l) -> const std::string& { return keys[static_cast<size_t>(l)]; };
  std::vector<double> bw, bcold, bwarm, dw, dcold;
  uint64_t checksum = 0;  // of what was read, so no read is optimized away
  for (int round = 0; round < o.io_compare; ++round) {
    for (int turn = 0; turn < 2; ++turn) {
      const bool direct = (round + turn) % 2 == 1;  // alternate which goes first
      if (!direct) {
        auto t0 = std::chrono::steady_clock::now();
        for (int32_t l = 0; l < o.layers; ++l) tier.put(key(l), payload.data(), payload.size(), 0);
        bw.push_back(seconds_since(t0));
        t0 = std::chrono::steady_clock::now();  // warm: the page cache holds what was just written
        for (int32_t l = 0; l < o.layers; ++l) checksum += static_cast<uint64_t>((*tier.get(key(l)))[7]);
        bwarm.push_back(seconds_since(t0));
        drop_cache(bdir);
        t0 = std::chrono::steady_clock::now();
        for (int32_t l = 0; l < o.layers; ++l) checksum += static_cast<uint64_t>((*tier.get(key(l)))[7]);
        bcold.push_back(seconds_since(t0));
      } else {
        auto t0 = std::chrono::steady_clock::now();
        for (int32_t l = 0; l < o.layers; ++l) direct_put(ddir, key(l), payload.data(), payload.size());
        dw.push_back(seconds_since(t0));
        t0 = std::chrono::steady_clock::now();
        for (int32_t l = 0; l < o.layers; ++l) checksum += static_cast<uint64_t>(direct_get(ddir, key(l))[7]);
        dcold.push_back(seconds_since(t0));
      }
    }
  }
  const double total = static_cast<double>(layer_bytes) * o.layers, gib = 1024.0 * 1024.0 * 1024.0;
  const auto rate = [&](double s) { return total / gib / s; };
  if (o.json) {
    std::printf(
        "{\"layers\": %d, \"layer_bytes\": %zu, \"rounds\": %d, \"buffered_write_s\": %.4f, "
        "\"direct_write_s\": %.4f, \"buffered_read_cold_s\": %.4f, \"direct_read_s\": %.4f, "
        "\"buffered_read_warm_s\": %.4f, \"checksum\": %llu}\n",
        o.layers, layer_bytes, o.io_compare, median(bw), median(dw), median(bcold), median(dcold), median(bwarm),
        static_cast<unsigned long long>(checksum));
    return;
  }
  std::printf("%d layer blobs of %.1f MiB (%.1f MiB), medians of %d rounds\n", o.layers,
              static_cast<double>(layer_bytes) / 1048576.0, total / 1048576.0, o.io_compare);
  std::printf(
      "  write (fsync'd, renamed)   buffered %.3f s (%.2f GiB/s)   O_DIRECT %.3f s (%.2f GiB/s)   direct/buffered "
      "%.2f\n",
      median(bw), rate(median(bw)), median(dw), rate(median(dw)), median(dw) / median(bw));
  std::printf(
      "  read, cold                 buffered %.3f s (%.2f GiB/s)   O_DIRECT %.3f s (%.2f GiB/s)   direct/buffered "
      "%.2f\n",
      median(bcold), rate(median(bcold)), median(dcold), rate(median(dcold)), median(dcold) / median(bcold));
  std::printf("  read, warm (page cache)    buffered %.3f s (%.2f GiB/s)   (O_DIRECT has no warm case)\n",
              median(bwarm), rate(median(bwarm)));
  std::printf("  each round: %s\n", "buffered write, warm read, cold read; O_DIRECT write, read (order alternating)");
  (void)checksum;
}

kvret_stats stats_of(kvret_context* ctx) {
  kvret_stats s;
  kvret_stats_init(&s);
  check(kvret_context_stats(ctx, &s), "kvret_context_stats");
  return s;
}

int run(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> const char* {
      if (i + 1 >= argc) throw std::invalid_argument(std::string(a) + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    } else if (a == "--layers") {
      o.layers = std::stoi(value());
    } else if (a == "--q-heads") {
      o.q_heads = std::stoi(value());
    } else if (a == "--kv-heads") {
      o.kv_heads = std::stoi(value());
    } else if (a == "--head-dim") {
      o.head_dim = std::stoi(value());
    } else if (a == "--tokens") {
      o.tokens = std::stoll(value());
    } else if (a == "--index") {
      o.index = index_of(value());
    } else if (a == "--dir") {
      o.dir = value();
    } else if (a == "--keep-cache") {
      o.drop_cache = false;
    } else if (a == "--seed") {
      o.seed = std::stoull(value());
    } else if (a == "--shared-url") {
      o.shared_url = value();
    } else if (a == "--json") {
      o.json = true;
    } else if (a == "--io-compare") {
      o.io_compare = std::stoi(value());
    } else {
      usage();
      throw std::invalid_argument("unknown option " + std::string(a));
    }
  }
  if (o.tokens < 1 || o.layers < 1) throw std::invalid_argument("--tokens and --layers must be >= 1");
  bool own_dir = false;
  if (o.dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/kvret-bench-sessions-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    o.dir = tmpl;
    own_dir = true;
  }
  const double kv_bytes =
      2.0 * static_cast<double>(o.tokens) * o.layers * o.kv_heads * o.head_dim * 2.0;  // K and V, f16
  if (o.io_compare > 0) {
    io_compare(o, static_cast<size_t>(kv_bytes / o.layers));
    remove_dir(o.dir + "/buffered");
    remove_dir(o.dir + "/direct");
    if (own_dir) remove_dir(o.dir);
    return 0;
  }

  // DRAM: a context whose DRAM tier holds one session (1.5 x the KV bytes), its disk tier in a subdirectory.
  double prefill_s = 0, save_dram_s = 0, open_dram_s = 0, save_evict_s = 0, flush_evict_s = 0;
  int64_t session_bytes = 0;
  const std::string evict_dir = o.dir + "/evict";
  {
    const kvret_config c = make_config(o, evict_dir.c_str(), static_cast<int64_t>(kv_bytes * 1.5));
    kvret_context* ctx = nullptr;
    check(kvret_create(&c, &ctx), "kvret_create");
    kvret_seq* seq = nullptr;
    prefill_s = prefill(ctx, o, &seq);
    auto t0 = std::chrono::steady_clock::now();
    check(kvret_session_save(seq, "bench"), "kvret_session_save (DRAM)");
    save_dram_s = seconds_since(t0);
    session_bytes = stats_of(ctx).session_dram_bytes;
    kvret_seq* opened = nullptr;
    t0 = std::chrono::steady_clock::now();
    check(kvret_session_open(ctx, "bench", &opened), "kvret_session_open (DRAM)");
    open_dram_s = seconds_since(t0);
    check(kvret_seq_close(opened), "kvret_seq_close");
    // A second session: "bench" (least recently used) is evicted to disk by the background writer.
    t0 = std::chrono::steady_clock::now();
    check(kvret_session_save(seq, "bench-2"), "kvret_session_save (evicting)");
    save_evict_s = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    check(kvret_session_flush(ctx), "kvret_session_flush (the eviction)");
    flush_evict_s = seconds_since(t0);
    int32_t tier = KVRET_TIER_NONE;
    check(kvret_session_where(ctx, "bench", &tier), "kvret_session_where");
    if (tier != KVRET_TIER_DISK) throw std::runtime_error("the first session was not evicted to disk");
    kvret_destroy(ctx);
    remove_dir(evict_dir);
  }
  // Disk: a context whose DRAM tier holds nothing (1 byte), so the save writes the session itself to disk.
  double save_disk_s = 0, open_disk_s = 0, open_disk_all_s = 0;
  int64_t disk_bytes = 0;
  {
    const kvret_config c = make_config(o, o.dir.c_str(), 1);
    kvret_context* ctx = nullptr;
    check(kvret_create(&c, &ctx), "kvret_create");
    kvret_seq* seq = nullptr;
    prefill(ctx, o, &seq);
    const auto t0 = std::chrono::steady_clock::now();
    check(kvret_session_save(seq, "bench"), "kvret_session_save (disk)");
    check(kvret_session_flush(ctx), "kvret_session_flush");
    save_disk_s = seconds_since(t0);
    disk_bytes = stats_of(ctx).disk_bytes;
    kvret_destroy(ctx);
  }
  {
    if (o.drop_cache) drop_cache(o.dir);
    const kvret_config c = make_config(o, o.dir.c_str(), 1);
    kvret_context* ctx = nullptr;
    check(kvret_create(&c, &ctx), "kvret_create");
    kvret_seq* opened = nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    check(kvret_session_open(ctx, "bench", &opened), "kvret_session_open (disk)");
    open_disk_s = seconds_since(t0);
    check(kvret_wait_index(opened, -1), "kvret_wait_index (every layer loaded)");
    open_disk_all_s = seconds_since(t0);
    kvret_destroy(ctx);
  }
  // Shared tier: a DRAM-only context whose saves are written through to Redis; a second one without a disk tier
  // opens the session from Redis (every layer read before the call returns).
  double save_shared_s = -1, flush_shared_s = -1, open_shared_s = -1;
  if (!o.shared_url.empty()) {
    kvret_config c = make_config(o, nullptr, 0);
    c.session_shared_url = o.shared_url.c_str();
    kvret_context* ctx = nullptr;
    check(kvret_create(&c, &ctx), "kvret_create (shared tier)");
    kvret_seq* seq = nullptr;
    prefill(ctx, o, &seq);
    auto t0 = std::chrono::steady_clock::now();
    check(kvret_session_save(seq, "bench-shared"), "kvret_session_save (shared)");
    save_shared_s = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    check(kvret_session_flush(ctx), "kvret_session_flush (the write-through)");
    flush_shared_s = seconds_since(t0);
    kvret_context* reader = nullptr;
    check(kvret_create(&c, &reader), "kvret_create (shared tier reader)");
    kvret_seq* opened = nullptr;
    t0 = std::chrono::steady_clock::now();
    check(kvret_session_open(reader, "bench-shared", &opened), "kvret_session_open (shared)");
    open_shared_s = seconds_since(t0);
    check(kvret_session_drop(reader, "bench-shared"), "kvret_session_drop (shared)");
    kvret_destroy(reader);
    kvret_destroy(ctx);
  }
  if (own_dir) remove_dir(o.dir);

  const double mib = 1024.0 * 1024.0;
  if (o.json) {
    std::printf(
        "{\"layers\": %d, \"q_heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"tokens\": %lld, \"index\": \"%s\", "
        "\"kv_bytes\": %.0f, \"session_bytes\": %lld, \"prefill_s\": %.6f, \"save_dram_s\": %.6f, "
        "\"open_dram_s\": %.6f, \"save_evicting_s\": %.6f, \"flush_eviction_s\": %.6f, \"save_disk_s\": %.6f, "
        "\"open_disk_s\": %.6f, \"open_disk_all_layers_s\": %.6f, "
        "\"disk_bytes\": %lld, \"page_cache_dropped\": %s, \"save_shared_s\": %.6f, \"flush_shared_s\": %.6f, "
        "\"open_shared_s\": %.6f}\n",
        o.layers, o.q_heads, o.kv_heads, o.head_dim, static_cast<long long>(o.tokens), index_name(o.index), kv_bytes,
        static_cast<long long>(session_bytes), prefill_s, save_dram_s, open_dram_s, save_evict_s, flush_evict_s,
        save_disk_s, open_disk_s, open_disk_all_s, static_cast<long long>(disk_bytes), o.drop_cache ? "true" : "false",
        save_shared_s, flush_shared_s, open_shared_s);
  } else {
    std::printf("%d layers, %d KV heads of %d, f16, %lld tokens, index %s: %.1f MiB of KV, %.1f MiB saved\n", o.layers,
                o.kv_heads, o.head_dim, static_cast<long long>(o.tokens), index_name(o.index), kv_bytes / mib,
                static_cast<double>(session_bytes) / mib);
    std::printf("  prefill (appends + index builds)   %10.3f s\n", prefill_s);
    std::printf("  save to DRAM                       %10.3f ms\n", save_dram_s * 1e3);
    std::printf("  open from DRAM                     %10.3f ms\n", open_dram_s * 1e3);
    std::printf("  save evicting one to disk: returns %10.3f ms\n", save_evict_s * 1e3);
    std::printf("  then flush (the eviction written)  %10.3f s\n", flush_evict_s);
    std::printf("  save to disk (fsync'd)             %10.3f s\n", save_disk_s);
    std::printf("  open from disk: layer 0 ready      %10.3f s\n", open_disk_s);
    std::printf("  open from disk: every layer ready  %10.3f s\n", open_disk_all_s);
    std::printf("  bytes on disk                      %10.1f MiB%s\n", static_cast<double>(disk_bytes) / mib,
                o.drop_cache ? "" : " (page cache kept)");
    if (!o.shared_url.empty()) {
      std::printf("  save written through to Redis: returns %7.3f ms\n", save_shared_s * 1e3);
      std::printf("  then flush (in Redis)              %10.3f s\n", flush_shared_s);
      std::printf("  open from Redis (another context)  %10.3f s\n", open_shared_s);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvret-bench-sessions: %s\n", e.what());
    return 1;
  }
}
