#pragma once
#include <cstdint>
#include <string>

#include "kvret.h"

namespace kvret {

/// Default of kvret_config.pq_exact_fraction, chosen on the real-model needle suite (docs/pq.md; keep the "default"
/// in kvret.h's comment of the field in step with it).
constexpr float kDefaultPqExactFraction = 0.05f;
/// Largest accepted kvret_config.pq_exact_fraction.
constexpr float kMaxPqExactFraction = 0.5f;
/// The largest head_dim a config may give (read_config accepts 64, 128 and 256).
constexpr int kMaxHeadDim = 256;
/// The largest n_layers and n_q_heads a config may give: far above any model's (a few hundred), far below what
/// makes opening a sequence allocate without bound (kvret.h).
constexpr int32_t kMaxLayers = 4096;
constexpr int32_t kMaxQHeads = 4096;
/// Tokens per page of a layer's host store (HostKvStore::kPageTokens): a sequence holding one token in every
/// layer holds one page per layer, which host_bytes_limit must allow.
constexpr int64_t kConfigPageTokens = 256;

/// Fills every field of *config with the documented defaults (see kvret.h).
void config_defaults(kvret_config* config) noexcept;

/// Fill each design's parameter struct with the defaults of its flat kvret_config fields and set struct_size.
void pq_params_defaults(kvret_pq_params* params) noexcept;
void cluster_params_defaults(kvret_cluster_params* params) noexcept;
void quant_params_defaults(kvret_quant_params* params) noexcept;
void crush_params_defaults(kvret_crush_params* params) noexcept;
void session_params_defaults(kvret_session_params* params) noexcept;

/// Reads a caller's config honouring struct_size (older, smaller structs get defaults for the newer fields; larger
/// ones are accepted only when the bytes this library does not know are zero), validates it, and returns it.
/// `disk_path` receives a copy of config->disk_path, and `shared_url` (when not null) one of
/// config->session_shared_url, so the returned struct does not borrow the caller's strings (both are null in it).
/// The design parameter structs the config points at (config->pq, ...) are read into their flat fields (their own
/// struct_size honoured the same way); the returned struct's pointers are null.
kvret_config read_config(const kvret_config* config, std::string* disk_path, std::string* shared_url = nullptr);

/// Throws kvret::Error (KVRET_ERR_INVALID_ARGUMENT or KVRET_ERR_UNSUPPORTED) naming the first bad field.
void validate_config(const kvret_config& config);

}  // namespace kvret
