#pragma once
// ClusterKV's reuse between decode steps at cluster granularity (config.cluster_reuse_steps = R): per (sequence,
// layer, KV head), the clusters that the layer's last R fetches took stay resident as a copy of the rows fetched
// from them (keys and values in the store's dtype), and a fetch serves the selected rows that copy holds instead of
// the host store. A cluster fetched again stays resident with every row it holds; one that no fetch took in R
// steps is dropped with its rows. A selected position that is not clustered yet (the cluster index's pending tail)
// is a cluster of its own. See docs/cluster.md, "Reuse between steps".
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "fetch/working_set.hpp"
#include "index/cluster_retriever.hpp"
#include "store/host_kv_store.hpp"

namespace kvret {

/// One layer's resident clusters (all KV heads). Not thread-safe, except that during a fetch each head's state is
/// touched by one thread only (the source's serve).
class ClusterReuseLayer {
 public:
  /// Brings the position-to-cluster map of every head up to `index`'s clusters (incrementally when the index only
  /// grew by whole segments; rebuilt otherwise). Call before the fetch's gather, with no build running on `index`.
  void sync(const ClusterRetriever& index, int n_kv_heads);
  /// Starts a fetch (a step): the source to put first among the gather's row sources. `mid_begin` and `count` say
  /// which rows of each head's request are the selected ones (sink and local rows are not the cluster copy's).
  /// The source keeps a reference to this layer: it must not outlive the fetch.
  std::shared_ptr<const RowSource> begin_fetch(int64_t mid_begin, int64_t count, int32_t keep_steps);
  /// The selected rows the last fetch served from the copy, over all heads.
  int64_t last_hits() const noexcept;
  /// Drops every resident row and the position maps (truncate; a failed fetch). Never throws.
  void clear() noexcept;
  /// Bytes held: resident rows (keys and values) and the per-head position maps.
  int64_t bytes() const noexcept;
  /// bytes() less what the last call returned plus what it counted before (for a live stats counter).
  int64_t bytes_change() noexcept {
    const int64_t now = bytes();
    const int64_t change = now - accounted_;
    accounted_ = now;
    return change;
  }

 private:
  friend class ClusterReuseSource;
  struct Resident {
    int32_t position;
    int64_t unit;  ///< a cluster id (>= 0), or -(position + 1) for a position that was not clustered
    int64_t step;  ///< the last step that fetched the row (for an unclustered position, its cluster's)
  };
  struct Head {
    std::vector<int32_t> labels;        ///< [clustered positions - label_base]: the cluster of each clustered position
    std::vector<int32_t> slot_of;       ///< [positions]: the resident slot of a position, -1 when not resident
    std::vector<Resident> resident;     ///< slot -> its position and cluster
    std::vector<std::byte> rows;        ///< slot -> keys then values (2 x row_bytes)
    std::vector<int64_t> cluster_step;  ///< [clusters]: the last step that fetched each cluster
    int64_t hits = 0;                   ///< of the last fetch
  };
  /// Serves head `h`'s selected rows that are resident, marks their clusters fetched, drops the clusters no fetch
  /// took in the last `keep` steps, and copies the rows the store serves into the copy.
  int64_t serve(const RowRequest& request, int64_t mid_begin, int64_t count, int32_t keep);

  std::vector<Head> heads_;
  std::vector<ClusterRetriever::Segment> segments_;  ///< the index's segments the labels hold
  int64_t label_base_ = 0;                           ///< the position of labels[0]
  int64_t step_ = 0;                                 ///< fetches of the layer (with reuse on)
  int64_t accounted_ = 0;                            ///< bytes() at the last bytes_change()
};

}  // namespace kvret
