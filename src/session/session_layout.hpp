#pragma once
// The on-disk and shared-tier layout of saved sessions (tags, keys, the configuration fingerprint) and small helpers
// of the session store, shared by its files: session_store.cpp (save, open, drop, placement), session_writer.cpp (the
// background writer, the disk scan) and session_shared.cpp (the shared tier).
#include <bit>
#include <chrono>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "session/session_store.hpp"

namespace kvret::session::session_detail {

constexpr uint32_t kManifestTag = 0x4e414d53u;  // "SMAN"
constexpr uint32_t kLayerTag = 0x52594c53u;     // "SLYR"
constexpr uint32_t kLayoutVersion = 1;

inline int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

inline Policy policy_of(int32_t p) {
  switch (p) {
    case KVRET_SESSION_LRU:
      return Policy::lru;
    case KVRET_SESSION_FIFO:
      return Policy::fifo;
    default:
      return Policy::scheduler_aware;
  }
}

inline uint64_t capacity_of(int64_t bytes) {
  return bytes == 0 ? std::numeric_limits<uint64_t>::max() : static_cast<uint64_t>(bytes);
}

inline PlacementConfig placement_config(const Context& ctx) {
  const kvret_config& c = ctx.config();
  PlacementConfig p;
  p.policy = policy_of(c.session_policy);
  p.dram_bytes = capacity_of(c.session_dram_bytes);
  p.disk_bytes = ctx.disk_path().empty() ? 0 : capacity_of(c.session_disk_bytes);
  return p;
}

/// The configuration a saved session must match to be opened by a context (the shapes of its layers and index).
inline std::vector<int32_t> fingerprint(const kvret_config& c) {
  std::vector<int32_t> f{c.n_layers,   c.n_q_heads, c.n_kv_heads, c.head_dim, c.kv_dtype,
                         c.index_kind, c.n_sink,    c.n_local,    c.rope_keys};
  if (c.rope_keys != 0) {  // pre-RoPE keys: the rotation the index was built on
    for (const int32_t v : {c.rope_dims, c.rope_layout, c.rope_original_max_positions}) f.push_back(v);
    for (const float v : {c.rope_theta, c.rope_scale_factor, c.rope_low_freq_factor, c.rope_high_freq_factor})
      f.push_back(std::bit_cast<int32_t>(v));
  }
  return f;
}

inline std::string hex64(uint64_t v) {
  static const char* digits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = digits[v & 15];
  return s;
}

/// FNV-1a, 64 bits: a stable name for an id's blobs (the id itself is stored in its manifest).
inline uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

inline std::string manifest_key(const std::string& stem) { return stem + ".m"; }
inline std::string layer_key(const std::string& stem, uint64_t generation, int32_t layer) {
  return stem + ".g" + std::to_string(generation) + ".l" + std::to_string(layer);
}

/// The shared tier's keys of a session: "s.<hex of the id's bytes>.m" (the manifest) and
/// "s.<hex>.<generation: 16 hex digits>.l<layer>", the same on every node.
inline std::string shared_stem(const std::string& id) {
  static const char* digits = "0123456789abcdef";
  std::string s = "s.";
  for (const char c : id) {
    const auto b = static_cast<unsigned char>(c);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}
inline std::string shared_layer_key(const std::string& stem, uint64_t generation, int32_t layer) {
  return stem + "." + hex64(generation) + ".l" + std::to_string(layer);
}

/// A random generation for a save to the shared tier (never 0 or all ones, Meta's markers).
inline uint64_t new_generation() {
  std::random_device rd;
  for (;;) {
    const uint64_t g = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    if (g != 0 && g != std::numeric_limits<uint64_t>::max()) return g;
  }
}

inline kvret_dtype dtype_of(DType d) {
  switch (d) {
    case DType::F16:
      return kvret_dtype{KVRET_DTYPE_FLOAT, 16, 1};
    case DType::BF16:
      return kvret_dtype{KVRET_DTYPE_BFLOAT, 16, 1};
    default:
      return kvret_dtype{KVRET_DTYPE_FLOAT, 32, 1};
  }
}

}  // namespace kvret::session::session_detail
