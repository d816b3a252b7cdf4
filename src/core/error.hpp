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

/// Throws Error(status, message) unless `condition` holds. The message is built before the call: in loops, use
/// KVRET_REQUIRE, which builds it only on failure.
inline void require(bool condition, kvret_status status, const std::string& message) {
  if (!condition) throw Error(status, message);
}

}  // namespace kvret

/// require() whose message expression is evaluated only when the condition fails (for checks inside loops).
#define KVRET_REQUIRE(condition, status, message)                \
  do {                                                           \
    if (!(condition)) throw ::kvret::Error((status), (message)); \
  } while (0)
