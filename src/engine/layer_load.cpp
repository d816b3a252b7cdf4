#include "engine/layer_load.hpp"

#include "core/error.hpp"

namespace kvret {

void LayerLoad::start(std::function<void()> body) {
  std::lock_guard<std::mutex> lock(join_mu_);
  thread_ = std::thread(std::move(body));
}

void LayerLoad::stop() noexcept {
  cancelled_.store(true, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(join_mu_);
  if (thread_.joinable()) thread_.join();
  // A loader that ended early (cancelled) leaves the rest failed, so no waiter is left waiting.
  std::lock_guard<std::mutex> state(mu_);
  if (ready_.load(std::memory_order_acquire) < n_layers_ && !failed_) {
    failed_ = true;
    status_ = KVRET_ERR_STATE;
    message_ = "the sequence's layers stopped loading (the sequence or its context is being closed)";
    cv_.notify_all();
  }
}

void LayerLoad::set_ready(int32_t ready) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  ready_.store(ready, std::memory_order_release);
  cv_.notify_all();
}

void LayerLoad::fail(kvret_status status, const std::string& message) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return;
  failed_ = true;
  status_ = status;
  try {
    message_ = message;
  } catch (...) {
  }
  cv_.notify_all();
}

void LayerLoad::wait(int32_t layer) const {
  if (layer < ready_.load(std::memory_order_acquire)) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return layer < ready_.load(std::memory_order_acquire) || failed_; });
  if (layer < ready_.load(std::memory_order_acquire)) return;
  throw Error(status_, message_);
}

}  // namespace kvret
