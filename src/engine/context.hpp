#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "engine/build_queue.hpp"
#include "engine/stats.hpp"
#include "fetch/working_set.hpp"
#include "index/retriever.hpp"
#include "kvret.h"

namespace kvret {

class Sequence;

class Context {
 public:
  /// `config` must have passed read_config.
  /// `backend` null: make_backend(config). config().disk_path and config().session_shared_url point at the copies
  /// `disk_path` and `shared_url` (null when empty; the URL's password masked).
  Context(const kvret_config& config, std::string disk_path, std::unique_ptr<Backend> backend = nullptr,
          std::string shared_url = {});
  ~Context();  ///< closes every open sequence (waiting for their builds)
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  const kvret_config& config() const noexcept { return config_; }
  const std::string& disk_path() const noexcept { return disk_path_; }
  /// The URL of the session store's shared tier, with its password; empty for none. config().session_shared_url is
  /// this URL with the password replaced by "***" (a config that is logged does not log the secret).
  const std::string& shared_url() const noexcept { return shared_url_; }
  int threads() const noexcept { return threads_; }
  BuildQueue& builds() noexcept { return builds_; }
  /// Adds a row source that fetch asks before the host store (after those added before it).
  void add_row_source(std::shared_ptr<const RowSource> source);
  /// The row sources, in order (a snapshot: sources added later are not in it).
  std::shared_ptr<const std::vector<std::shared_ptr<const RowSource>>> row_sources() const;
  /// The index kind of config.index_kind, as registered when the context was created.
  const RetrieverKind& kind() const noexcept { return *kind_; }

  /// The backend (config.device_type, or the one given at construction).
  Backend& backend() const noexcept { return *backend_; }
  /// A caller's tensor, validated for a call of this context: its layout (TensorView::from), then whether the
  /// backend can access its memory (Backend::check_access).
  TensorView view(const kvret_tensor* t, const char* name, DTypeSet allowed, std::initializer_list<int> ranks) const {
    TensorView v = TensorView::from(t, name, allowed, ranks);
    backend_->check_access(v);
    return v;
  }
  /// Accounts `bytes` more host memory against host_bytes_limit; throws KVRET_ERR_CAPACITY past it.
  void reserve_host_bytes(int64_t bytes);
  void release_host_bytes(int64_t bytes) noexcept;

  Sequence* open_sequence();
  /// Takes a sequence made for this context (a fork) into the open ones.
  Sequence* adopt_sequence(std::unique_ptr<Sequence> seq);
  void close_sequence(Sequence* seq);
  bool owns(const Sequence* seq) const;
  std::vector<Sequence*> sequences() const;

  void stats(kvret_stats* out) const;

 private:
  kvret_config config_;
  std::shared_ptr<const RetrieverKind> kind_;
  std::unique_ptr<Backend> backend_;  // outlives the sequences: ~Context closes them in its body
  std::string disk_path_;
  std::string shared_url_;
  std::string shown_url_;  // shared_url_ without its password: what config_.session_shared_url points at
  int threads_;
  std::atomic<int64_t> host_bytes_{0};
  std::shared_ptr<const std::vector<std::shared_ptr<const RowSource>>> row_sources_;  // guarded by mu_
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Sequence>> sequences_;
  StatCounters closed_;
  BuildQueue builds_;  // ~Context closes the sequences (draining their jobs) before members are destroyed
};

}  // namespace kvret
