#include "engine/layer_state.hpp"

#include <algorithm>
#include <chrono>

#include "core/error.hpp"

namespace kvret {

std::shared_ptr<const rope::Rope> rope_of(const kvret_config& c) {
  if (c.rope_keys == 0) return nullptr;
  rope::Llama3Scaling scaling;
  if (c.rope_scale_factor > 0.0f) {
    scaling.factor = c.rope_scale_factor;
    scaling.low_freq_factor = c.rope_low_freq_factor;
    scaling.high_freq_factor = c.rope_high_freq_factor;
    scaling.original_max_positions = c.rope_original_max_positions;
  }
  return std::make_shared<const rope::Rope>(c.rope_dims == 0 ? c.head_dim : c.rope_dims, c.rope_layout,
                                            static_cast<double>(c.rope_theta), scaling);
}

void LayerState::account_index(StatCounters& stats) noexcept {
  const int64_t bytes = index_->bytes();
  stats.index_bytes += bytes - index_bytes_;
  index_bytes_ = bytes;
}

void LayerState::index_to(int64_t mid_begin, int64_t end, bool build, int n_threads, StatCounters& stats) {
  if (end <= indexed_end()) return;
  const auto start = std::chrono::steady_clock::now();
  index_->extend(store_, std::max(indexed_end(), mid_begin), end, build, n_threads);
  account_index(stats);
  if (build) {
    stats.index_builds += 1;
    stats.index_build_ns +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  }
}

void LayerState::schedule_build(BuildQueue& queue, int64_t mid_begin, int64_t end, int n_threads, StatCounters& stats) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    build_pending_ = true;
  }
  try {
    queue.submit([this, mid_begin, end, n_threads, &stats] {
      kvret_status status = KVRET_OK;
      std::string message;
      try {
        index_to(mid_begin, end, true, n_threads, stats);
      } catch (...) {
        status = current_exception_status(message);
      }
      std::lock_guard<std::mutex> lock(mu_);
      build_status_ = status;
      build_message_ = message;
      build_pending_ = false;
      cv_.notify_all();
    });
  } catch (...) {  // the job was not queued: nothing will clear the flag
    std::lock_guard<std::mutex> lock(mu_);
    build_pending_ = false;
    cv_.notify_all();
    throw;
  }
}

void LayerState::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !build_pending_; });
  if (build_status_ == KVRET_OK) return;
  const kvret_status status = build_status_;
  const std::string message = build_message_;
  build_status_ = KVRET_OK;
  build_message_.clear();
  throw Error(status, "the background index build of layer " + std::to_string(layer_) + " failed: " + message +
                          " (the next select of this layer rebuilds it)");
}

void LayerState::drain() noexcept {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !build_pending_; });
}

void LayerState::cut_index(int64_t end, StatCounters& stats) noexcept {
  index_->cut(store_, end);
  account_index(stats);
}

void LayerState::replace_index(std::unique_ptr<Retriever> index, StatCounters& stats) noexcept {
  index_.swap(index);
  account_index(stats);
}

std::unique_ptr<LayerState> LayerState::fork() const {
  auto copy = std::make_unique<LayerState>(layer_, store_.fork(), index_->clone());
  copy->index_bytes_ = index_bytes_;
  return copy;
}

}  // namespace kvret
