#pragma once
// The C++ core reports failures by throwing kvret::Error; the C boundary (src/c_api) turns it into a status and
// the thread-local last-error message. Nothing below the boundary knows about C.
#include <new>
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

/// The status and message of the exception being handled (call it inside a catch block): an Error's own,
/// KVRET_ERR_OUT_OF_MEMORY for std::bad_alloc, KVRET_ERR_INTERNAL for anything else. The one translation of
/// exceptions into statuses, shared by the C boundary and the background build thread. Never throws: when the
/// message cannot be copied (no memory) it is left empty.
inline kvret_status current_exception_status(std::string& message) noexcept {
  const auto set = [&](const char* text) {
    try {
      message = text;
    } catch (...) {
      message.clear();
    }
  };
  try {
    throw;
  } catch (const Error& e) {
    set(e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    set("out of host memory");
    return KVRET_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set(e.what());
    return KVRET_ERR_INTERNAL;
  } catch (...) {
    set("unknown internal error");
    return KVRET_ERR_INTERNAL;
  }
}

}  // namespace kvret

/// require() whose message expression is evaluated only when the condition fails (for checks inside loops).
#define KVRET_REQUIRE(condition, status, message)                \
  do {                                                           \
    if (!(condition)) throw ::kvret::Error((status), (message)); \
  } while (0)
