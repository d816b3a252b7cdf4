#include "engine/cluster_reuse.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

namespace kvret {

namespace {

/// The step of a cluster no fetch has taken.
constexpr int64_t kNever = std::numeric_limits<int64_t>::min() / 2;

/// Rows this far ahead are prefetched (as gather_working_set does: scattered rows are latency-bound).
constexpr int64_t kPrefetchDistance = 16;

inline void prefetch(const std::byte* row, size_t bytes) noexcept {
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 0);
}

}  // namespace

/// The per-fetch source: serves each head from the layer's copy (see ClusterReuseLayer::serve).
class ClusterReuseSource final : public RowSource {
 public:
  ClusterReuseSource(ClusterReuseLayer& layer, int64_t mid_begin, int64_t count, int32_t keep)
      : layer_(layer), mid_begin_(mid_begin), count_(count), keep_(keep) {}
  const char* name() const noexcept override { return "cluster reuse"; }
  int64_t serve(const RowRequest& request) const override { return layer_.serve(request, mid_begin_, count_, keep_); }

 private:
  ClusterReuseLayer& layer_;
  int64_t mid_begin_, count_;
  int32_t keep_;
};

void ClusterReuseLayer::sync(const ClusterRetriever& index, int n_kv_heads) {
  const std::vector<ClusterRetriever::Segment>& segments = index.segments();
  const bool grew = static_cast<int>(heads_.size()) == n_kv_heads && label_base_ == index.indexed_begin() &&
                    segments_.size() <= segments.size() &&
                    std::equal(segments_.begin(), segments_.end(), segments.begin());
  if (!grew) {  // a new index (or the first sync): nothing resident can keep its cluster
    clear();
    heads_.resize(static_cast<size_t>(n_kv_heads));
    label_base_ = index.indexed_begin();
  }
  if (segments_.size() == segments.size()) return;
  const int64_t clustered = index.clustered_end() - label_base_;
  const size_t first = segments_.size();
  // allocate every head's room first: a failure leaves the maps as they were
  for (Head& h : heads_) {
    h.labels.reserve(static_cast<size_t>(clustered));
    h.cluster_step.reserve(static_cast<size_t>(index.clusters()));
  }
  segments_.reserve(segments.size());
  for (int head = 0; head < n_kv_heads; ++head) {
    Head& h = heads_[static_cast<size_t>(head)];
    h.labels.resize(static_cast<size_t>(clustered), -1);
    h.cluster_step.resize(static_cast<size_t>(index.clusters()), kNever);
    const std::vector<int32_t>& offsets = index.offsets(head);
    const std::vector<int32_t>& ids = index.sorted_ids(head);
    for (size_t s = first; s < segments.size(); ++s)
      for (int32_t c = segments[s].first_cluster; c < segments[s].first_cluster + segments[s].clusters; ++c)
        for (int32_t i = offsets[static_cast<size_t>(c)]; i < offsets[static_cast<size_t>(c) + 1]; ++i)
          h.labels[static_cast<size_t>(ids[static_cast<size_t>(i)] - label_base_)] = c;
  }
  segments_.assign(segments.begin(), segments.end());
}

std::shared_ptr<const RowSource> ClusterReuseLayer::begin_fetch(int64_t mid_begin, int64_t count, int32_t keep_steps) {
  auto source = std::make_shared<ClusterReuseSource>(*this, mid_begin, count, keep_steps);
  ++step_;
  return source;
}

int64_t ClusterReuseLayer::serve(const RowRequest& request, int64_t mid_begin, int64_t count, int32_t keep) {
  Head& h = heads_[static_cast<size_t>(request.head)];
  const HostKvStore& store = *request.store;
  const size_t row_bytes = store.row_bytes();
  const size_t slot_bytes = 2 * row_bytes;
  const DType type = store.dtype();
  const int64_t step = step_;
  h.hits = 0;
  if (h.slot_of.size() < static_cast<size_t>(store.size())) h.slot_of.resize(static_cast<size_t>(store.size()), -1);
  const auto unit_of = [&](int32_t p) -> int64_t {
    const int64_t at = p - label_base_;
    if (at >= 0 && at < static_cast<int64_t>(h.labels.size())) return h.labels[static_cast<size_t>(at)];
    return -(static_cast<int64_t>(p) + 1);
  };

  // 1. serve the resident rows and mark every selected row's cluster as fetched at this step
  int64_t hits = 0, misses = 0;
  const int64_t end = mid_begin + count;
  for (int64_t i = mid_begin; i < end; ++i) {
    if (i + kPrefetchDistance < end) {  // resident rows lie in slot order, not position order
      const int32_t ahead = h.slot_of[static_cast<size_t>(request.positions[i + kPrefetchDistance])];
      if (ahead >= 0) prefetch(h.rows.data() + static_cast<size_t>(ahead) * slot_bytes, slot_bytes);
    }
    const int32_t p = request.positions[i];
    const int64_t unit = unit_of(p);
    const int32_t slot = h.slot_of[static_cast<size_t>(p)];
    if (slot >= 0) {
      if (request.served[i] == 0) {
        const std::byte* row = h.rows.data() + static_cast<size_t>(slot) * slot_bytes;
        write_row(request, 0, i, row, type);
        write_row(request, 1, i, row + row_bytes, type);
        request.served[i] = 1;
        ++hits;
      }
      Resident& e = h.resident[static_cast<size_t>(slot)];
      e.unit = unit;  // a pending position may have been clustered since
      e.step = step;
    } else {
      ++misses;
    }
    if (unit >= 0) h.cluster_step[static_cast<size_t>(unit)] = step;
  }

  // 2. drop the clusters no fetch took in the last `keep` steps (this one included), with their rows
  const int64_t oldest = step - keep;  // a cluster stays when its last step is above it
  const auto last_step = [&](const Resident& e) {
    return e.unit >= 0 ? h.cluster_step[static_cast<size_t>(e.unit)] : e.step;
  };
  for (size_t s = 0; s < h.resident.size();) {
    if (last_step(h.resident[s]) > oldest) {
      ++s;
      continue;
    }
    h.slot_of[static_cast<size_t>(h.resident[s].position)] = -1;
    const size_t back = h.resident.size() - 1;
    if (s != back) {  // the last slot moves into the hole: the copy stays dense
      std::memcpy(h.rows.data() + s * slot_bytes, h.rows.data() + back * slot_bytes, slot_bytes);
      h.resident[s] = h.resident[back];
      h.slot_of[static_cast<size_t>(h.resident[s].position)] = static_cast<int32_t>(s);
    }
    h.resident.pop_back();
  }

  // 3. the copy keeps the rows the store serves (room first: nothing below allocates)
  const size_t need = (h.resident.size() + static_cast<size_t>(misses)) * slot_bytes;
  if (h.rows.size() < need) {
    const size_t grown = std::max(need, h.rows.size() + h.rows.size() / 4);
    h.rows.reserve(grown);  // exactly (resize alone may double the capacity)
    h.rows.resize(grown);
  }
  h.resident.reserve(h.resident.size() + static_cast<size_t>(misses));
  for (int64_t i = mid_begin; i < end && misses > 0; ++i) {
    if (i + kPrefetchDistance < end) {
      const int32_t ahead = request.positions[i + kPrefetchDistance];
      if (h.slot_of[static_cast<size_t>(ahead)] < 0) {
        prefetch(store.key_row(request.head, ahead), row_bytes);
        prefetch(store.value_row(request.head, ahead), row_bytes);
      }
    }
    const int32_t p = request.positions[i];
    if (h.slot_of[static_cast<size_t>(p)] >= 0) continue;
    const auto slot = static_cast<int32_t>(h.resident.size());
    std::byte* row = h.rows.data() + static_cast<size_t>(slot) * slot_bytes;
    std::memcpy(row, store.key_row(request.head, p), row_bytes);
    std::memcpy(row + row_bytes, store.value_row(request.head, p), row_bytes);
    h.resident.push_back({p, unit_of(p), step});
    h.slot_of[static_cast<size_t>(p)] = slot;
  }
  // give memory back once the copy is much smaller than it was
  const size_t used = h.resident.size() * slot_bytes;
  if (h.rows.size() > 4 * used && h.rows.size() > (size_t{64} << 10)) {
    std::vector<std::byte>(h.rows.begin(), h.rows.begin() + static_cast<std::ptrdiff_t>(used + used / 4)).swap(h.rows);
    std::vector<Resident>(h.resident).swap(h.resident);
  }
  h.hits = hits;
  return hits;
}

int64_t ClusterReuseLayer::last_hits() const noexcept {
  int64_t hits = 0;
  for (const Head& h : heads_) hits += h.hits;
  return hits;
}

void ClusterReuseLayer::clear() noexcept {
  heads_.clear();
  segments_.clear();
  label_base_ = 0;
}

int64_t ClusterReuseLayer::bytes() const noexcept {
  size_t bytes = 0;
  for (const Head& h : heads_)
    bytes += h.rows.capacity() + (h.labels.capacity() + h.slot_of.capacity()) * sizeof(int32_t) +
             h.resident.capacity() * sizeof(Resident) + h.cluster_step.capacity() * sizeof(int64_t);
  return static_cast<int64_t>(bytes);
}

}  // namespace kvret
