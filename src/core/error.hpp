#pragma once
// The C++ core reports failures by throwing kvret::Error; the C boundary (src/c_api) turns it into a status and
// the thread-local last-error message. Nothing below the boundary knows about C.
#include <stdexcept>
#include <string>

#include "kvret.h"

namespace kvret {

class Error : public std::runtime_error {
 public:
  Error(kvret_status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  kvret_status status() const noexcept { return status_; }

 private:
  kvret_status status_;
};

/// Throws Error(status, message) unless `condition` holds.
inline void require(bool condition, kvret_status status, const std::string& message) {
  if (!condition) throw Error(status, message);
}

}  // namespace kvret
