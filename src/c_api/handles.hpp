#pragma once
// The C++ object behind a C handle: handles are numbers, not addresses (see HandleRegistry in kvret_c_api.cpp),
// so the tests that inspect a sequence's index reach it through this lookup.
#include "kvret.h"

namespace kvret {

class Context;
class Sequence;

/// The sequence of a live handle, else nullptr.
Sequence* sequence_from_handle(const kvret_seq* seq);
/// The context of a live handle, else nullptr (for tests and extensions that add row sources).
Context* context_from_handle(const kvret_context* ctx);

}  // namespace kvret
