#include "engine/context.hpp"

#include <algorithm>

#include "core/config.hpp"
#include "core/error.hpp"
#include "core/vec_math.hpp"
#include "engine/sequence.hpp"
#include "index/cluster_retriever.hpp"

namespace kvret {

static_assert(HostKvStore::kPageTokens == kConfigPageTokens, "config.cpp checks host_bytes_limit in host pages");

namespace {

/// `url` with the password of its user part (scheme://[user]:PASSWORD@host...) replaced by "***"; the rest as
/// given. The authority ends at the first '/' or '?', as parse_redis_url reads it.
std::string url_without_password(const std::string& url) {
  const size_t scheme = url.find("://");
  if (scheme == std::string::npos) return url;
  const size_t start = scheme + 3;
  const size_t end = std::min(url.find('/', start), url.find('?', start));
  const size_t at = url.rfind('@', end == std::string::npos ? std::string::npos : end - 1);
  if (at == std::string::npos || at < start) return url;
  const size_t colon = url.find(':', start);
  const size_t secret = colon != std::string::npos && colon < at ? colon + 1 : start;  // no ':': all of it
  return url.substr(0, secret) + "***" + url.substr(at);
}

}  // namespace

Context::Context(const kvret_config& config, std::string disk_path, std::unique_ptr<Backend> backend,
                 std::string shared_url)
    : config_(config),
      kind_(find_retriever_kind(config.index_kind)),
      backend_(backend ? std::move(backend) : make_backend(config)),
      disk_path_(std::move(disk_path)),
      shared_url_(std::move(shared_url)),
      threads_(resolve_threads(config.n_threads)) {
  if (kind_ == nullptr)  // neither built in nor registered
    throw Error(KVRET_ERR_INVALID_ARGUMENT, "config.index_kind: unknown value " + std::to_string(config.index_kind));
  kind_ = with_cluster_builder(kind_, backend_->cluster_builder());  // CLUSTER built on the backend's device
  config_.disk_path = disk_path_.empty() ? nullptr : disk_path_.c_str();
  shown_url_ = url_without_password(shared_url_);
  config_.session_shared_url = shown_url_.empty() ? nullptr : shown_url_.c_str();
}

Context::~Context() {
  std::vector<std::unique_ptr<Sequence>> open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    open.swap(sequences_);
  }
  open.clear();  // each waits for its own builds, which the queue is still alive to run
}

void Context::reserve_host_bytes(int64_t bytes) {
  if (bytes <= 0) return;
  const int64_t limit = config_.host_bytes_limit;
  int64_t current = host_bytes_.load();
  for (;;) {
    require(limit == 0 || bytes <= limit - current, KVRET_ERR_CAPACITY,
            "host KV store is full: " + std::to_string(current) + " of " + std::to_string(limit) +
                " bytes (config.host_bytes_limit) used, the append needs " + std::to_string(bytes) + " more");
    if (host_bytes_.compare_exchange_weak(current, current + bytes)) return;
  }
}

void Context::release_host_bytes(int64_t bytes) noexcept { host_bytes_ -= bytes; }

void Context::add_row_source(std::shared_ptr<const RowSource> source) {
  std::lock_guard<std::mutex> lock(mu_);
  auto next = row_sources_ ? std::make_shared<std::vector<std::shared_ptr<const RowSource>>>(*row_sources_)
                           : std::make_shared<std::vector<std::shared_ptr<const RowSource>>>();
  next->push_back(std::move(source));
  row_sources_ = std::move(next);
}

std::shared_ptr<const std::vector<std::shared_ptr<const RowSource>>> Context::row_sources() const {
  std::lock_guard<std::mutex> lock(mu_);
  return row_sources_;
}

Sequence* Context::open_sequence() {
  auto seq = std::make_unique<Sequence>(*this);
  std::lock_guard<std::mutex> lock(mu_);
  sequences_.push_back(std::move(seq));
  return sequences_.back().get();
}

Sequence* Context::adopt_sequence(std::unique_ptr<Sequence> seq) {
  std::lock_guard<std::mutex> lock(mu_);
  sequences_.push_back(std::move(seq));  // on bad_alloc, seq (and its reserved bytes) is released by the caller
  return sequences_.back().get();
}

void Context::close_sequence(Sequence* seq) {
  std::unique_ptr<Sequence> owned;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(sequences_.begin(), sequences_.end(), [seq](const auto& s) { return s.get() == seq; });
    if (it == sequences_.end()) return;
    owned = std::move(*it);
    sequences_.erase(it);
  }
  owned->drain();  // waits for its builds outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    owned->stats().add_into(closed_);
  }
  owned.reset();
}

bool Context::owns(const Sequence* seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::any_of(sequences_.begin(), sequences_.end(), [seq](const auto& s) { return s.get() == seq; });
}

std::vector<Sequence*> Context::sequences() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Sequence*> out;
  for (const auto& s : sequences_) out.push_back(s.get());
  return out;
}

void Context::stats(kvret_stats* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  out->sequences += static_cast<int64_t>(sequences_.size());
  closed_.add_to(out);
  for (const auto& s : sequences_) s->stats().add_to(out);
}

}  // namespace kvret
