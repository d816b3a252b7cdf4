#pragma once
// The background load of a sequence's layers (a session opened from the disk tier; docs/sessions.md): a loader
// thread brings the layers in, in layer order, and every call on layer l of the sequence first waits for layer l,
// as calls wait for a layer's background index build.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "kvret.h"

namespace kvret {

class LayerLoad {
 public:
  /// `n_layers` layers, of which the first `ready` are in already.
  LayerLoad(int32_t n_layers, int32_t ready) : n_layers_(n_layers), ready_(ready) {}
  ~LayerLoad() { stop(); }
  LayerLoad(const LayerLoad&) = delete;
  LayerLoad& operator=(const LayerLoad&) = delete;

  /// Runs `body` on a new thread (the loader). Throws std::system_error when the thread cannot start.
  void start(std::function<void()> body);
  /// Asks the loader to stop before its next layer and joins it. Idempotent; safe from any thread but the loader.
  void stop() noexcept;

  // ---- the loader's side
  bool cancelled() const noexcept { return cancelled_.load(std::memory_order_relaxed); }
  /// Layers [0, ready) are in (their LayerState placed in the sequence before this call).
  void set_ready(int32_t ready) noexcept;
  /// The load ended before every layer was in: the layers from ready() on answer `status` and `message`.
  void fail(kvret_status status, const std::string& message) noexcept;

  // ---- the sequence's side
  /// Waits until layer `layer` is in; throws the failure that stopped the load before it.
  void wait(int32_t layer) const;
  /// Waits for every layer.
  void wait_all() const { wait(n_layers_ - 1); }
  int32_t ready() const noexcept { return ready_.load(std::memory_order_acquire); }

 private:
  const int32_t n_layers_;
  std::atomic<int32_t> ready_;
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool failed_ = false;
  kvret_status status_ = KVRET_OK;
  std::string message_;
  std::mutex join_mu_;
  std::thread thread_;
};

}  // namespace kvret
