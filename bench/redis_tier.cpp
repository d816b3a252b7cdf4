// kvret-bench-redis-tier: save and restore throughput of one session's bytes through the shared tier on Redis
// (loopback) beside the local disk tier, in one run. A session is written as the session store writes it: one blob
// per layer (keys and values of every token, f16), then a small manifest blob; restore reads them back in order.
// Each restore is compared with what was saved (outside the timings).
//
//   kvret-bench-redis-tier [--layers 8] [--tokens 32768] [--kv-heads 8] [--head-dim 128] [--reps 3]
//                          [--chunk-mib 4] [--aof] [--url redis://...] [--dir PATH] [--json]
//
// Without --url it starts its own redis-server on a free loopback port (no persistence, or the append-only file
// with --aof: appendfsync everysec). The disk tier writes under --dir (default: a new directory under /tmp): each blob
// a temporary file, fsync, rename, directory fsync; its reads come from the page cache when the blobs fit there.
#include "session/redis_tier.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "redis_server.hpp"
#include "session/disk_tier.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int layers = 8;
  long long tokens = 32768;
  int kv_heads = 8;
  int head_dim = 128;
  int reps = 3;
  double chunk_mib = 4;
  bool aof = false;
  bool json = false;
  std::string url;
  std::string dir;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "kvret-bench-redis-tier: %s\nusage: kvret-bench-redis-tier [--layers N] [--tokens N] [--kv-heads N] "
               "[--head-dim N] [--reps N] [--chunk-mib X] [--aof] [--url redis://...] [--dir PATH] [--json]\n",
               why);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "--layers")
      o.layers = std::atoi(value().c_str());
    else if (a == "--tokens")
      o.tokens = std::atoll(value().c_str());
    else if (a == "--kv-heads")
      o.kv_heads = std::atoi(value().c_str());
    else if (a == "--head-dim")
      o.head_dim = std::atoi(value().c_str());
    else if (a == "--reps")
      o.reps = std::atoi(value().c_str());
    else if (a == "--chunk-mib")
      o.chunk_mib = std::atof(value().c_str());
    else if (a == "--url")
      o.url = value();
    else if (a == "--dir")
      o.dir = value();
    else if (a == "--aof")
      o.aof = true;
    else if (a == "--json")
      o.json = true;
    else
      usage(("unknown argument " + a).c_str());
  }
  if (o.layers < 1 || o.tokens < 1 || o.kv_heads < 1 || o.head_dim < 1 || o.reps < 1 || o.chunk_mib <= 0)
    usage("every size must be positive");
  return o;
}

double seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Seconds of each repetition, per measurement.
struct Result {
  std::vector<double> save_s;
  std::vector<double> restore_s;       // the disk tier: after its files were evicted from the page cache
  std::vector<double> restore_warm_s;  // the disk tier: read again, from the page cache
};

double best(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Asks the kernel to drop the (clean, fsynced) pages of every file under `dir` from the page cache.
void evict_page_cache(const std::string& dir) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

double restore(kvret::session::BlobTier& tier, const std::vector<std::vector<std::byte>>& layers) {
  std::vector<std::vector<std::byte>> back(layers.size());
  const auto t0 = Clock::now();
  if (!tier.get("bench/manifest")) usage("the manifest is missing");
  for (size_t l = 0; l < layers.size(); ++l) {
    auto blob = tier.get("bench/L" + std::to_string(l));
    if (!blob) usage("a layer is missing");
    back[l] = std::move(*blob);
  }
  const double s = seconds(t0);
  for (size_t l = 0; l < layers.size(); ++l)
    if (back[l] != layers[l]) {
      std::fprintf(stderr, "kvret-bench-redis-tier: %s: layer %zu restored differently\n", tier.name(), l);
      std::exit(1);
    }
  return s;
}

// One repetition through `tier`: save, restore (for the disk tier: cold, then warm), remove.
void rep(kvret::session::BlobTier& tier, const std::vector<std::vector<std::byte>>& layers, Result& r,
         const std::string* disk_dir) {
  const std::string manifest(512, 'm');
  const auto t0 = Clock::now();
  for (size_t l = 0; l < layers.size(); ++l)
    tier.put("bench/L" + std::to_string(l), layers[l].data(), layers[l].size(), 0);
  tier.put("bench/manifest", reinterpret_cast<const std::byte*>(manifest.data()), manifest.size(), 0);
  r.save_s.push_back(seconds(t0));
  if (disk_dir != nullptr) evict_page_cache(*disk_dir);
  r.restore_s.push_back(restore(tier, layers));
  if (disk_dir != nullptr) r.restore_warm_s.push_back(restore(tier, layers));
  for (size_t l = 0; l < layers.size(); ++l) tier.remove("bench/L" + std::to_string(l));
  tier.remove("bench/manifest");
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const size_t layer_bytes = static_cast<size_t>(o.tokens) * o.kv_heads * o.head_dim * 2 /*K,V*/ * 2 /*f16*/;
  const double gib = static_cast<double>(layer_bytes) * o.layers / double(1 << 30);
  std::vector<std::vector<std::byte>> layers(o.layers, std::vector<std::byte>(layer_bytes));
  std::mt19937_64 rng(42);
  for (auto& layer : layers)
    for (size_t i = 0; i + 8 <= layer.size(); i += 8) {
      const uint64_t v = rng();
      std::memcpy(layer.data() + i, &v, 8);
    }

  try {
    std::unique_ptr<kvret_test::RedisServer> server;
    std::string url = o.url;
    if (url.empty()) {
      if (kvret_test::find_redis_server().empty()) usage("redis-server is not installed and no --url was given");
      kvret_test::RedisServer::Options so;
      so.persistent = o.aof;
      server = std::make_unique<kvret_test::RedisServer>(so);
      if (!server->start()) usage("redis-server did not start");
      url = server->url();
    }
    kvret::session::RedisTier redis(kvret::session::parse_redis_url(url),
                                    static_cast<size_t>(o.chunk_mib * double(1 << 20)));
    redis.ping();

    std::string dir = o.dir;
    bool own_dir = false;
    if (dir.empty()) {
      char tmpl[] = "/tmp/kvret-bench-disk-XXXXXX";
      if (::mkdtemp(tmpl) == nullptr) usage("cannot make a temporary directory");
      dir = tmpl;
      own_dir = true;
    }
    Result r_redis;
    Result r_disk;
    {
      kvret::session::DiskTier disk(dir);
      for (int i = 0; i < o.reps; ++i) {  // interleaved: each repetition runs both tiers
        rep(redis, layers, r_redis, nullptr);
        rep(disk, layers, r_disk, &dir);
      }
    }
    if (own_dir) std::filesystem::remove_all(dir);

    // GiB/s of each measurement: the median over the repetitions, and the slowest and fastest
    struct Row {
      const char* name;
      const std::vector<double>* s;
    };
    const Row rows[] = {{"redis save", &r_redis.save_s},
                        {"redis restore", &r_redis.restore_s},
                        {"disk save", &r_disk.save_s},
                        {"disk restore (cold)", &r_disk.restore_s},
                        {"disk restore (page cache)", &r_disk.restore_warm_s}};
    const auto rate = [&](double s) { return gib / s; };
    const auto worst = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
    if (o.json) {
      std::printf(
          "{\"layers\": %d, \"tokens\": %lld, \"kv_heads\": %d, \"head_dim\": %d, \"session_gib\": %.4f, "
          "\"chunk_mib\": %g, \"aof\": %s, \"reps\": %d, \"gib_per_s\": {",
          o.layers, o.tokens, o.kv_heads, o.head_dim, gib, o.chunk_mib, o.aof ? "true" : "false", o.reps);
      bool first = true;
      for (const Row& row : rows) {
        std::printf("%s\n  \"%s\": {\"median\": %.3f, \"min\": %.3f, \"max\": %.3f}", first ? "" : ",", row.name,
                    rate(median(*row.s)), rate(worst(*row.s)), rate(best(*row.s)));
        first = false;
      }
      std::printf("}}\n");
    } else {
      std::printf(
          "session: %d layers x %lld tokens x %d KV heads x %d dims x 2 (K,V) x f16 = %.3f GiB (%zu MiB a layer)\n",
          o.layers, o.tokens, o.kv_heads, o.head_dim, gib, layer_bytes >> 20);
      std::printf("redis: %s, %g MiB chunks, %s; disk: %s; %d interleaved reps\n", redis.endpoint().describe().c_str(),
                  o.chunk_mib, o.aof ? "appendonly yes (everysec)" : "no persistence", dir.c_str(), o.reps);
      std::printf("%-26s %12s %18s\n", "GiB/s", "median", "(min - max)");
      for (const Row& row : rows)
        std::printf("%-26s %12.3f %8.3f - %-8.3f\n", row.name, rate(median(*row.s)), rate(worst(*row.s)),
                    rate(best(*row.s)));
    }
  } catch (const kvret::Error& e) {
    std::fprintf(stderr, "kvret-bench-redis-tier: %s\n", e.what());
    return 1;
  }
  return 0;
}
