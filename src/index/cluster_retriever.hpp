#pragma once
// ClusterKV's index: the middle keys of every (layer, KV head) grouped by cosine k-means into semantic clusters;
// a query scores each cluster by q . mu (mu: the mean of the cluster's keys) and select takes whole clusters best
// first (grouped_take), the cluster that crosses the budget trimmed to its earliest positions.
//
// The indexed range is cut into segments of consecutive positions, each clustered once and never again:
//   - a prefill extend (may_retrain) clusters every not yet clustered token up to its end (the pending decode
//     tokens before it included): n tokens make ceil(n / segment_tokens) segments of equal length (one when
//     segment_tokens is 0), each of ceil(len / cluster_tokens) clusters (at most len), so the build is linear in n;
//   - decode tokens wait in a pending tail; every cluster_decode_interval of them become one segment of
//     min(cluster_decode_k, interval) clusters. The prefill clusters stay as they are.
// Pending tokens are selectable: each is a group of its own, scored by its exact q . k (at most interval - 1 keys
// per head, read from the store at select).
//
// Layout per head: the centroids [C, d] (the raw mean of each cluster's keys, not normalized: q . mu is the mean
// logit of the cluster), the sizes [C], their prefix sums [C + 1], and the clustered positions sorted stably by
// cluster (ascending within a cluster). Cluster ids run over the segments in order, so a segment owns a contiguous
// range of clusters and of sorted ids, and a cut at a segment boundary (or inside the pending tail) is exact.
//
// See docs/cluster.md.
#include <cstdint>
#include <memory>
#include <vector>

#include "index/retriever.hpp"

namespace kvret {

/// Spherical (cosine) k-means of n points [n, d] (row i at x + i * d) into k clusters.
/// Init: k distinct points drawn with the seed (a partial Fisher-Yates shuffle, as kmeans()'s Forgy init); with
/// fewer points than k the rest repeat them. Each iteration assigns every point to the centroid of maximum cosine
/// (ties: the lower index; a zero point has cosine 0 with every centroid) and records the objective (the sum of
/// the cosines), then moves each centroid to the normalized mean of its points' unit vectors (the maximizer of the
/// cluster's sum of cosines); an emptied centroid is re-seeded at the point of lowest cosine, so the objective does
/// not fall (up to float rounding). Stops when no assignment changed, or after max_iters iterations.
///
/// With 0 < sample < n the iterations run on `sample` of the points (at least k), drawn without repeats with the
/// seed and kept in their order, and every point is then assigned once to the max-cosine of the trained directions
/// (the cost of an iteration falls from n to sample points; the final assignment is one pass over n).
struct CosineKmeansResult {
  std::vector<float> directions;  ///< [k, d]: the unit centroids the last assignment used
  std::vector<int32_t> labels;    ///< [n]: every point's max-cosine direction
  std::vector<double> objective;  ///< after each iteration's assignment, over the training points
  int iterations = 0;
  int64_t trained = 0;  ///< the training points: n, or the sample
};
CosineKmeansResult cosine_kmeans(const float* x, int64_t n, int d, int k, uint64_t seed, int max_iters,
                                 int64_t sample = 0);

/// cosine_kmeans' training points for that sample: their indices, ascending, or none when every point trains.
std::vector<int64_t> cosine_kmeans_sample(int64_t n, int k, uint64_t seed, int64_t sample);

/// One (KV head, segment) to cluster: its n keys [n, d] (f32, host memory), k clusters, `exacts` singletons, the
/// position of its first key, the k-means seed, iteration cap and training sample.
struct ClusterSegmentJob {
  const float* keys = nullptr;
  int64_t n = 0;
  int d = 0;
  int k = 1;
  int64_t exacts = 0;
  int64_t begin = 0;
  uint64_t seed = 0;
  int max_iters = 1;
  int64_t sample = 0;
};

/// A segment's part of one head's index: the scoring centroids [k, d] (the raw means of the clusters' keys), the
/// sizes [k], the clustered positions sorted stably by cluster, the exact singletons' positions (ascending) and keys
/// [E, d]; and the k-means behind them (its directions, labels and objective).
struct ClusterSegmentIndex {
  std::vector<float> centroids;
  std::vector<int32_t> sizes;
  std::vector<int32_t> ids;
  std::vector<int32_t> exact_pos;
  std::vector<float> exact_keys;
  CosineKmeansResult kmeans;
};

/// The CPU build of one segment: cosine_kmeans, the exact singletons (the lowest fits), the layout.
ClusterSegmentIndex cluster_segment_index(const ClusterSegmentJob& job);

/// Builds segments elsewhere (the CUDA backend's device: Backend::cluster_builder), with cluster_segment_index's
/// result bit for bit. Called from build threads and decode calls at once: it keeps no state between calls.
class ClusterSegmentBuilder {
 public:
  virtual ~ClusterSegmentBuilder() = default;
  virtual ClusterSegmentIndex build(const ClusterSegmentJob& job) const = 0;
};

class ClusterRetriever final : public Retriever {
 public:
  struct Params {
    int cluster_tokens = 80;      ///< tokens per cluster at prefill
    int decode_interval = 320;    ///< pending decode tokens clustered at a time
    int decode_k = 4;             ///< clusters per decode interval
    int max_iters = 5;            ///< k-means iteration cap
    int segment_tokens = 8192;    ///< most tokens one prefill k-means clusters (cluster_segment_tokens; 0: no limit)
    int sample_per_cluster = 32;  ///< k-means trains on at most this many keys per cluster (0: on every key)
    float exact_fraction = 0.0f;  ///< share of each segment's tokens kept out of the clusters as exact singletons
    uint64_t seed = 42;           ///< the layer's seed (config.seed and the layer)
  };
  /// One clustered run of positions [begin, end), owning clusters [first_cluster, first_cluster + clusters).
  struct Segment {
    int64_t begin = 0, end = 0;
    int32_t first_cluster = 0, clusters = 0;
    int32_t first_exact = 0, exacts = 0;       ///< the segment's exact singletons (the same count in every head)
    bool operator==(const Segment& o) const {  // spelled out: nvcc compiles this header as C++17 (the CUDA backend)
      return begin == o.begin && end == o.end && first_cluster == o.first_cluster && clusters == o.clusters &&
             first_exact == o.first_exact && exacts == o.exacts;
    }
  };

  ClusterRetriever(int n_kv_heads, int head_dim, const Params& params);

  int64_t select(const HostKvStore& store, const SelectRequest& request, int32_t* const* out_rows,
                 float* const* out_scores) const override;
  int64_t bytes() const noexcept override;
  /// At a segment boundary or inside the pending tail (or dropping everything); a cut inside a segment cannot
  /// keep its clusters, and the sequence rebuilds.
  bool can_cut(int64_t end) const noexcept override;
  std::unique_ptr<Retriever> clone() const override { return std::make_unique<ClusterRetriever>(*this); }
  const Retriever* selects_as() const noexcept override { return this; }
  std::vector<std::byte> save() const override;
  void restore(const HostKvStore& store, const std::byte* data, size_t size) override;

  // Introspection (tests, benchmarks).
  const Params& params() const noexcept { return params_; }
  int n_kv_heads() const noexcept { return n_kv_; }
  int head_dim() const noexcept { return d_; }
  int64_t size() const noexcept { return base_ < 0 ? 0 : end_ - base_; }
  const std::vector<Segment>& segments() const noexcept { return segments_; }
  /// The end of the clustered positions: the pending tail is [clustered_end(), indexed_end()).
  int64_t clustered_end() const noexcept { return segments_.empty() ? indexed_begin() : segments_.back().end; }
  int64_t pending() const noexcept { return indexed_end() - clustered_end(); }
  int32_t clusters() const noexcept {
    return segments_.empty() ? 0 : segments_.back().first_cluster + segments_.back().clusters;
  }
  const std::vector<float>& centroids(int head) const noexcept { return centroids_[static_cast<size_t>(head)]; }
  const std::vector<int32_t>& sizes(int head) const noexcept { return sizes_[static_cast<size_t>(head)]; }
  const std::vector<int32_t>& offsets(int head) const noexcept { return offsets_[static_cast<size_t>(head)]; }
  const std::vector<int32_t>& sorted_ids(int head) const noexcept { return ids_[static_cast<size_t>(head)]; }
  /// The exact singletons: positions (ascending within each segment) and their keys [E, d] (f32).
  int32_t exacts() const noexcept {
    return segments_.empty() ? 0 : segments_.back().first_exact + segments_.back().exacts;
  }
  const std::vector<int32_t>& exact_positions(int head) const noexcept { return exact_pos_[static_cast<size_t>(head)]; }
  const std::vector<float>& exact_keys(int head) const noexcept { return exact_keys_[static_cast<size_t>(head)]; }
  /// The k-means seed of (head, segment starting at `begin`).
  uint64_t segment_seed(int head, int64_t begin) const noexcept;
  /// The version of the clusters (segments, centroids, sizes, ids, exact singletons): a new one, unique in the
  /// process, after every change of them (an extend that clusters a segment, a cut that drops one, a restore); the
  /// pending tail may grow and shrink under one version. A copy (clone) keeps it. (The CUDA backend's mirror.)
  uint64_t version() const noexcept { return version_; }
  /// The version that segment i came with (the index's version once the extend or restore that made it committed):
  /// while segment i keeps its stamp, it and every segment before it are as they were then (the CUDA backend's
  /// mirror sends only the segments after the ones it holds).
  uint64_t segment_stamp(size_t i) const noexcept { return stamps_[i]; }
  /// Where segments are clustered: `builder` (a backend's device), or the CPU when null. Copies share it.
  void set_builder(std::shared_ptr<const ClusterSegmentBuilder> builder) noexcept { builder_ = std::move(builder); }
  const ClusterSegmentBuilder* builder() const noexcept { return builder_.get(); }

 protected:
  void on_extend(const HostKvStore& store, int64_t begin, int64_t end, bool may_retrain, int n_threads) override;
  void on_cut(const HostKvStore& store, int64_t end) noexcept override;

 private:
  int n_kv_;
  int d_;
  Params params_;
  std::vector<Segment> segments_;
  std::vector<uint64_t> stamps_;                 ///< per segment: segment_stamp
  std::vector<std::vector<float>> centroids_;    ///< per head [C, d]
  std::vector<std::vector<int32_t>> sizes_;      ///< per head [C]
  std::vector<std::vector<int32_t>> offsets_;    ///< per head [C + 1], offsets[0] = 0
  std::vector<std::vector<int32_t>> ids_;        ///< per head [clustered - exact]: positions sorted stably by cluster
  std::vector<std::vector<int32_t>> exact_pos_;  ///< per head [E]: the exact singletons' positions
  std::vector<std::vector<float>> exact_keys_;   ///< per head [E, d]: their keys
  uint64_t version_;
  std::shared_ptr<const ClusterSegmentBuilder> builder_;
};

/// The KVRET_INDEX_CLUSTER kind.
std::shared_ptr<const RetrieverKind> make_cluster_kind();

/// `kind` itself, or, when it is the KVRET_INDEX_CLUSTER kind and `builder` is not null, a CLUSTER kind whose
/// retrievers cluster their segments with `builder`.
std::shared_ptr<const RetrieverKind> with_cluster_builder(std::shared_ptr<const RetrieverKind> kind,
                                                          std::shared_ptr<const ClusterSegmentBuilder> builder);

}  // namespace kvret
