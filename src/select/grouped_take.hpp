#pragma once
// The grouped take: select a budget of tokens from groups of tokens that share one score (PQ code cells, PAGE
// pages, and later clusters), whole groups best first, the group that crosses the budget trimmed. One order for
// every retriever: score descending, NaN lowest (as -inf), -0 as +0, ties to the lower group id (descending_key).
#include <cstdint>
#include <vector>

namespace kvret {

/// Group states written by grouped_take.
enum : uint8_t { kSkip = 0, kTake = 1, kTrim = 2 };

/// The groups of positive count, in the order (score descending, id ascending), are taken whole (state kTake) while
/// they fit the budget; the first that does not fit is trimmed (kTrim: the caller keeps its first `quota` tokens,
/// the return value) unless the budget is already full; every other group is kSkip. Returns 0 when no group is
/// trimmed. The states are those of popping a heap in that order, found by a weighted quickselect (expected
/// O(groups); only the taken side is ever ordered). keys: scratch, grown as needed. state: [groups].
int64_t grouped_take(const float* scores, const int32_t* counts, int64_t groups, int64_t budget,
                     std::vector<uint64_t>& keys, uint8_t* state);

}  // namespace kvret
