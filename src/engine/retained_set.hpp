#pragma once
// KVCrush's eviction-only mode (kvret_seq_retained_set): the static set of middle tokens an engine that drops KV,
// instead of offloading it, keeps per KV head: SnapKV's base (importance from an observation window at the end of
// the layer) plus bucket representatives of the tokens it leaves out. Reads the sequence; changes nothing.
#include <cstdint>

#include "kvret.h"

namespace kvret {

class Sequence;

/// Writes the retained middle positions of every KV head of `layer`, ascending, into out_positions (int32,
/// [n_kv_heads, >= count]) and returns count: the budget as kvret_select resolves it (KVRET_BUDGET_DEFAULT,
/// min(budget, middle tokens)). The important part, budget - floor(hamming_fraction * budget) (capped as a select's
/// split is), is the head's top tokens by SnapKV importance over the window of the layer's last KvCrushLayer::kWindow
/// keys; the rest, KVCrush's representatives of the other middle tokens (docs/kvcrush.md, "Eviction-only mode").
/// Throws (nothing written) on a bad layer, budget or tensor, and KVRET_ERR_STATE when the layer holds no tokens.
int64_t retained_set(Sequence& seq, int32_t layer, int32_t budget, const kvret_tensor* out_positions);

}  // namespace kvret
