#include "index/change_log.hpp"

#include <algorithm>
#include <atomic>

namespace kvret {

uint64_t ChangeLog::next_version() noexcept {
  static std::atomic<uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

void ChangeLog::mark(int64_t first) noexcept {
  changes_[next_] = {version_, first};
  next_ = (next_ + 1) % changes_.size();
  version_ = next_version();
}

void ChangeLog::reset() noexcept {
  changes_ = {};
  next_ = 0;
  version_ = next_version();
}

int64_t ChangeLog::changed_since(uint64_t v, int64_t units) const noexcept {
  if (v == version_) return units;
  int64_t first = units;
  for (size_t i = 0; i < changes_.size(); ++i) {  // newest first
    const Change& c = changes_[(next_ + changes_.size() - 1 - i) % changes_.size()];
    if (c.from == 0) break;
    first = std::min(first, c.first);
    if (c.from == v) return first;
  }
  return 0;
}

}  // namespace kvret
