// CLUSTER's segment build: the CPU path (cluster_segment_index) against the CUDA backend's device path
// (Backend::cluster_builder), on the same keys, one layer of n_kv_heads heads and `tokens` middle tokens cut into
// segments of cluster_segment_tokens (8192) as a prefill cuts them; the (head, segment) builds run one after the
// other (the library's CPU backend runs a prefill's on several threads). Prints the wall time of each path per layer
// (best of 3) and their ratio.
// Not wired into CMake; build it against a KVRET_THRUST_OMP build of the core (scripts/cuda_backend_omp.sh build-omp):
//   g++ -O2 -std=c++20 -fopenmp -Isrc -Ikernels -Iinclude bench/cluster_device_build.cpp build-omp/lib/libkvret_core.a
//   \
//     -o /tmp/cluster_device_build && /tmp/cluster_device_build 8192 32768
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "backend/backend.hpp"
#include "core/config.hpp"
#include "index/cluster_retriever.hpp"

int main(int argc, char** argv) {
  using clock = std::chrono::steady_clock;
  const int heads = 8, d = 128, segment = 8192, cluster_tokens = 80, reps = 3;
  kvret_config c;
  kvret::config_defaults(&c);
  c.device_type = KVRET_DEVICE_CUDA;
  c.n_kv_heads = heads;
  c.head_dim = d;
  std::unique_ptr<kvret::Backend> backend = kvret::make_backend(c);
  const auto builder = backend->cluster_builder();
  if (!builder) return std::fprintf(stderr, "no device builder in this build\n"), 1;
  for (int a = 1; a < argc; ++a) {
    const int64_t tokens = std::atoll(argv[a]);
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal;
    std::vector<float> keys(static_cast<size_t>(tokens) * d);
    for (float& x : keys) x = normal(rng);
    const int64_t parts = (tokens + segment - 1) / segment;
    double cpu_s = 1e30, dev_s = 1e30;
    for (int r = 0; r < reps; ++r) {
      for (const bool device : {false, true}) {
        const auto t0 = clock::now();
        for (int h = 0; h < heads; ++h)
          for (int64_t p = 0; p < parts; ++p) {
            const int64_t b = tokens * p / parts, e = tokens * (p + 1) / parts;
            kvret::ClusterSegmentJob job;
            job.keys = keys.data() + b * d;  // every head clusters the same keys: both paths do the same work
            job.n = e - b;
            job.d = d;
            job.k = static_cast<int>((job.n + cluster_tokens - 1) / cluster_tokens);
            job.begin = b;
            job.seed = static_cast<uint64_t>(h * 1000 + p);
            job.max_iters = 5;
            job.sample = 32 * job.k;
            const kvret::ClusterSegmentIndex out = device ? builder->build(job) : kvret::cluster_segment_index(job);
            if (out.ids.empty()) return 2;
          }
        const double s = std::chrono::duration<double>(clock::now() - t0).count();
        (device ? dev_s : cpu_s) = std::min(device ? dev_s : cpu_s, s);
      }
    }
    std::printf("tokens %lld: per layer (%d heads, d %d) cpu %.3f s, device path (%s) %.3f s, device/cpu %.2f\n",
                static_cast<long long>(tokens), heads, d, cpu_s, kvret::cuda_backend_system(), dev_s, dev_s / cpu_s);
  }
  return 0;
}
