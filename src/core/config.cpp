#include "core/config.hpp"

#include <cmath>
#include <cstring>
#include <iterator>

#include "core/error.hpp"

namespace kvret {

void config_defaults(kvret_config* c) noexcept {
  std::memset(c, 0, sizeof *c);
  c->struct_size = sizeof(kvret_config);
  c->n_layers = 32;
  c->n_q_heads = 32;
  c->n_kv_heads = 8;
  c->head_dim = 128;
  c->kv_dtype = KVRET_KV_F16;
  c->device_type = KVRET_DEVICE_CPU;
  c->device_id = 0;
  c->n_sink = 16;
  c->n_local = 64;
  c->budget = 0;
  c->budget_ratio = 0.1f;
  c->gqa_fold = KVRET_FOLD_SUM_PROB;
  c->index_kind = KVRET_INDEX_PQ;
  c->pq_m = 4;
  c->pq_bits = 6;
  c->pq_iters = 0;
  c->pq_tol = 1e-3f;
  c->pq_train_sample = 8192;
  c->cluster_tokens = 32;
  c->cluster_decode_interval = 320;
  c->cluster_decode_k = 4;
  c->page_size = 16;
  c->quant_bits = 2;
  c->hamming_fraction = 0.0f;
  c->hamming_buckets = 0;
  c->max_seq_tokens = 0;
  c->host_bytes_limit = 0;
  c->disk_path = nullptr;
  c->block_tokens = 128;
  c->cache_policy = KVRET_CACHE_LRU;
  c->cache_capacity_tokens = 4096;
  c->n_threads = 0;
  c->background_build = 1;
  c->check_finite = 0;
  c->seed = 42;
  c->pq_exact_fraction = kDefaultPqExactFraction;
  c->quant_group_size = 64;
  c->quant_residual = 64;
  c->cluster_segment_tokens = 4096;
  c->quant_attention = 0;
  c->quant_rerank = 4;
  c->cluster_reuse_steps = 1;
  c->device_bytes_limit = 0;
  c->session_dram_bytes = 0;
  c->session_disk_bytes = 0;
  c->session_ttl_ms = 0;
  c->session_policy = KVRET_SESSION_SCHEDULER_AWARE;
  c->rope_keys = 0;
  c->rope_dims = 0;
  c->rope_layout = KVRET_ROPE_NEOX;
  c->rope_theta = 10000.0f;
  c->rope_scale_factor = 0.0f;
  c->rope_low_freq_factor = 1.0f;
  c->rope_high_freq_factor = 4.0f;
  c->rope_original_max_positions = 8192;
  c->session_shared_url = nullptr;
  c->cluster_exact_fraction = 0.05f;
  c->hamming_importance = KVRET_IMPORTANCE_WINDOW;
  c->hamming_granularity = 0;
}

namespace {

/// Most steps config.cluster_reuse_steps keeps a cluster resident (the copy is bounded by the layer's middle anyway).
constexpr int32_t kMaxClusterReuseSteps = 1024;

void check(bool ok, const std::string& field, const std::string& why) {
  require(ok, KVRET_ERR_INVALID_ARGUMENT, "config." + field + ": " + why);
}

}  // namespace

/// Every field of kvret_config in declaration order (a struct from an older version ends at one of their
/// offsets). Keep in step with kvret.h: the static_assert below fails when a field is appended without it.
// clang-format off
#define KVRET_CONFIG_FIELDS(X)                                                                                        \
  X(struct_size)                                                                                                      \
  X(n_layers) X(n_q_heads) X(n_kv_heads) X(head_dim) X(kv_dtype) X(device_type) X(device_id) X(n_sink) X(n_local)     \
      X(budget) X(budget_ratio) X(gqa_fold) X(index_kind) X(pq_m) X(pq_bits) X(pq_iters) X(pq_tol) X(pq_train_sample) \
          X(cluster_tokens) X(cluster_decode_interval) X(cluster_decode_k) X(page_size) X(quant_bits)                 \
              X(hamming_fraction) X(hamming_buckets) X(max_seq_tokens) X(host_bytes_limit) X(disk_path)               \
                  X(block_tokens) X(cache_policy) X(cache_capacity_tokens) X(n_threads) X(background_build)           \
                      X(check_finite) X(seed) X(pq_exact_fraction) X(quant_group_size) X(quant_residual)              \
                          X(cluster_segment_tokens) X(quant_attention) X(cluster_reuse_steps)                         \
                              X(device_bytes_limit) X(session_dram_bytes) X(session_disk_bytes)           \
                                  X(session_ttl_ms) X(session_policy) X(rope_keys) X(rope_dims)               \
                                      X(rope_layout) X(rope_theta) X(rope_scale_factor)                       \
                                          X(rope_low_freq_factor) X(rope_high_freq_factor)                    \
                                              X(rope_original_max_positions) X(session_shared_url)           \
                                                  X(cluster_exact_fraction) X(quant_rerank) X(hamming_importance) \
                                                      X(hamming_granularity) X(pq) X(cluster) X(quant) X(crush)   \
                                                          X(session)
// clang-format on

namespace {

#define KVRET_FIELD_END(f) offsetof(kvret_config, f) + sizeof(kvret_config::f),
constexpr size_t kFieldEnds[] = {KVRET_CONFIG_FIELDS(KVRET_FIELD_END)};
#undef KVRET_FIELD_END
static_assert((kFieldEnds[std::size(kFieldEnds) - 1] + alignof(kvret_config) - 1) / alignof(kvret_config) *
                      alignof(kvret_config) ==
                  sizeof(kvret_config),
              "KVRET_CONFIG_FIELDS misses a field appended to kvret_config");

/// Whether a caller's struct_size is that of a version of the struct: it ends at a field's end, or at that end
/// rounded up to the struct's alignment (its sizeof), or is at least this version's sizeof. Any other size would
/// split a field (half a disk_path pointer).
bool whole_fields(size_t size) {
  if (size >= sizeof(kvret_config)) return true;
  constexpr size_t a = alignof(kvret_config);
  for (size_t end : kFieldEnds)
    if (size == end || size == (end + a - 1) / a * a) return true;
  return false;
}

}  // namespace

// Each design's parameter struct: (struct member, flat kvret_config field) in declaration order. A struct's version
// ends at one of its fields, as kvret_config's does.
// clang-format off
#define KVRET_PQ_PARAMS(X)                                                                                             \
  X(m, pq_m) X(bits, pq_bits) X(iters, pq_iters) X(tol, pq_tol) X(train_sample, pq_train_sample)                      \
      X(exact_fraction, pq_exact_fraction)
#define KVRET_CLUSTER_PARAMS(X)                                                                                        \
  X(tokens, cluster_tokens) X(decode_interval, cluster_decode_interval) X(decode_k, cluster_decode_k)                 \
      X(segment_tokens, cluster_segment_tokens) X(reuse_steps, cluster_reuse_steps)                                   \
          X(exact_fraction, cluster_exact_fraction)
#define KVRET_QUANT_PARAMS(X)                                                                                          \
  X(bits, quant_bits) X(group_size, quant_group_size) X(residual, quant_residual) X(rerank, quant_rerank)             \
      X(attention, quant_attention)
#define KVRET_CRUSH_PARAMS(X)                                                                                          \
  X(fraction, hamming_fraction) X(buckets, hamming_buckets) X(importance, hamming_importance)                         \
      X(granularity, hamming_granularity)
#define KVRET_SESSION_PARAMS(X)                                                                                        \
  X(dram_bytes, session_dram_bytes) X(disk_bytes, session_disk_bytes) X(ttl_ms, session_ttl_ms)                       \
      X(policy, session_policy)
// clang-format on

// Calls X(group, struct member, flat field) for every grouped field of every design.
#define KVRET_GROUP_PQ(m, f) X(pq, m, f)
#define KVRET_GROUP_CLUSTER(m, f) X(cluster, m, f)
#define KVRET_GROUP_QUANT(m, f) X(quant, m, f)
#define KVRET_GROUP_CRUSH(m, f) X(crush, m, f)
#define KVRET_GROUP_SESSION(m, f) X(session, m, f)
#define KVRET_GROUPED_FIELDS                \
  KVRET_PQ_PARAMS(KVRET_GROUP_PQ)           \
  KVRET_CLUSTER_PARAMS(KVRET_GROUP_CLUSTER) \
  KVRET_QUANT_PARAMS(KVRET_GROUP_QUANT)     \
  KVRET_CRUSH_PARAMS(KVRET_GROUP_CRUSH) KVRET_SESSION_PARAMS(KVRET_GROUP_SESSION)

// Each design's defaults are those of its flat fields in config_defaults.
#define KVRET_PARAMS_DEFAULTS(G, LIST)                       \
  void G##_params_defaults(kvret_##G##_params* p) noexcept { \
    kvret_config c;                                          \
    config_defaults(&c);                                     \
    std::memset(p, 0, sizeof *p);                            \
    p->struct_size = sizeof *p;                              \
    LIST(KVRET_DEFAULT)                                      \
  }
#define KVRET_DEFAULT(m, f) p->m = c.f;
KVRET_PARAMS_DEFAULTS(pq, KVRET_PQ_PARAMS)
KVRET_PARAMS_DEFAULTS(cluster, KVRET_CLUSTER_PARAMS)
KVRET_PARAMS_DEFAULTS(quant, KVRET_QUANT_PARAMS)
KVRET_PARAMS_DEFAULTS(crush, KVRET_CRUSH_PARAMS)
KVRET_PARAMS_DEFAULTS(session, KVRET_SESSION_PARAMS)
#undef KVRET_DEFAULT
#undef KVRET_PARAMS_DEFAULTS

namespace {

/// Reads the caller's *user of a parameter struct P honouring its struct_size as read_config does for the config:
/// a size that ends inside a field or before the first one is KVRET_ERR_VERSION naming config.<group>; a larger one
/// is accepted only when the bytes this library does not know are zero. Fields past an older struct's end keep the
/// defaults in *out.
template <class P, size_t N>
void read_params(const P* user, const size_t (&ends)[N], const char* group, P* out) {
  const size_t size = user->struct_size;
  const std::string name = std::string("config.") + group + "->struct_size";
  const std::string type = std::string("kvret_") + group + "_params";
  require(size >= ends[0], KVRET_ERR_VERSION, name + " is " + std::to_string(size) + "; call " + type + "_init first");
  bool whole = size >= sizeof(P);
  constexpr size_t a = alignof(P);
  for (size_t end : ends) whole = whole || size == end || size == (end + a - 1) / a * a;
  require(whole, KVRET_ERR_VERSION,
          name + " is " + std::to_string(size) + ", which ends inside a field: no version of " + type +
              " has that size (call " + type + "_init)");
  if (size > sizeof(P)) {
    const auto* extra = reinterpret_cast<const unsigned char*>(user) + sizeof(P);
    for (size_t i = 0; i < size - sizeof(P); ++i)
      require(extra[i] == 0, KVRET_ERR_VERSION,
              name + " is " + std::to_string(size) + ": the caller sets fields this library version does not know (" +
                  type + " has " + std::to_string(sizeof(P)) + " bytes)");
  }
  std::memcpy(out, user, size < sizeof(P) ? size : sizeof(P));
  out->struct_size = sizeof(P);
}

template <class T>
bool same_value(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof a) == 0;
}

#define KVRET_END_OF(P, m) offsetof(kvret_##P##_params, m) + sizeof(kvret_##P##_params::m),
#define KVRET_END_PQ(m, f) KVRET_END_OF(pq, m)
#define KVRET_END_CLUSTER(m, f) KVRET_END_OF(cluster, m)
#define KVRET_END_QUANT(m, f) KVRET_END_OF(quant, m)
#define KVRET_END_CRUSH(m, f) KVRET_END_OF(crush, m)
#define KVRET_END_SESSION(m, f) KVRET_END_OF(session, m)
constexpr size_t kPqEnds[] = {KVRET_PQ_PARAMS(KVRET_END_PQ)};
constexpr size_t kClusterEnds[] = {KVRET_CLUSTER_PARAMS(KVRET_END_CLUSTER)};
constexpr size_t kQuantEnds[] = {KVRET_QUANT_PARAMS(KVRET_END_QUANT)};
constexpr size_t kCrushEnds[] = {KVRET_CRUSH_PARAMS(KVRET_END_CRUSH)};
constexpr size_t kSessionEnds[] = {KVRET_SESSION_PARAMS(KVRET_END_SESSION)};
#undef KVRET_END_PQ
#undef KVRET_END_CLUSTER
#undef KVRET_END_QUANT
#undef KVRET_END_CRUSH
#undef KVRET_END_SESSION
#undef KVRET_END_OF

template <class P, size_t N>
constexpr bool lists_every_field(const size_t (&ends)[N]) {
  return (ends[N - 1] + alignof(P) - 1) / alignof(P) * alignof(P) == sizeof(P);
}
static_assert(lists_every_field<kvret_pq_params>(kPqEnds), "KVRET_PQ_PARAMS misses a field of kvret_pq_params");
static_assert(lists_every_field<kvret_cluster_params>(kClusterEnds), "KVRET_CLUSTER_PARAMS misses a field");
static_assert(lists_every_field<kvret_quant_params>(kQuantEnds), "KVRET_QUANT_PARAMS misses a field");
static_assert(lists_every_field<kvret_crush_params>(kCrushEnds), "KVRET_CRUSH_PARAMS misses a field");
static_assert(lists_every_field<kvret_session_params>(kSessionEnds), "KVRET_SESSION_PARAMS misses a field");

/// Moves the parameter structs the config points at into its flat fields (c's pointers are cleared). A flat field
/// changed from its default next to its design's struct is refused, naming both. Returns which designs came as
/// structs, for naming their fields in validation messages.
struct Grouped {
  bool pq = false, cluster = false, quant = false, crush = false, session = false;
};

Grouped apply_params(kvret_config& c) {
  kvret_config d;
  config_defaults(&d);
  Grouped given;
#define KVRET_APPLY_GROUP(G, LIST, ENDS) \
  if (c.G != nullptr) {                  \
    kvret_##G##_params p;                \
    G##_params_defaults(&p);             \
    read_params(c.G, ENDS, #G, &p);      \
    LIST(KVRET_CONFLICT)                 \
    LIST(KVRET_COPY)                     \
    given.G = true;                      \
  }
#define KVRET_CONFLICT(m, f)                                                                    \
  require(same_value(c.f, d.f), KVRET_ERR_INVALID_ARGUMENT,                                     \
          "config." #f " is changed from its default and config." + std::string(group_of(#f)) + \
              " is given too: set " + group_of(#f) + "." #m " only (the flat field is kept for one release)");
#define KVRET_COPY(m, f) c.f = p.m;
  const auto group_of = [](const char* flat) -> std::string {
    const std::string f = flat;
    if (f.rfind("pq_", 0) == 0) return "pq";
    if (f.rfind("cluster_", 0) == 0) return "cluster";
    if (f.rfind("quant_", 0) == 0) return "quant";
    if (f.rfind("hamming_", 0) == 0) return "crush";
    return "session";
  };
  KVRET_APPLY_GROUP(pq, KVRET_PQ_PARAMS, kPqEnds)
  KVRET_APPLY_GROUP(cluster, KVRET_CLUSTER_PARAMS, kClusterEnds)
  KVRET_APPLY_GROUP(quant, KVRET_QUANT_PARAMS, kQuantEnds)
  KVRET_APPLY_GROUP(crush, KVRET_CRUSH_PARAMS, kCrushEnds)
  KVRET_APPLY_GROUP(session, KVRET_SESSION_PARAMS, kSessionEnds)
#undef KVRET_COPY
#undef KVRET_CONFLICT
#undef KVRET_APPLY_GROUP
  c.pq = nullptr;
  c.cluster = nullptr;
  c.quant = nullptr;
  c.crush = nullptr;
  c.session = nullptr;
  return given;
}

/// validate_config's message with a grouped field named as the caller gave it ("config.pq_m: ..." becomes
/// "config.pq.m: ..." when the config came with a kvret_pq_params).
std::string grouped_message(const std::string& message, const Grouped& given) {
#define X(G, m, f)                                        \
  if (given.G && message.rfind("config." #f ":", 0) == 0) \
    return "config." #G "." #m + message.substr(std::strlen("config." #f));
  KVRET_GROUPED_FIELDS
#undef X
  return message;
}

}  // namespace

kvret_config read_config(const kvret_config* user, std::string* disk_path, std::string* shared_url) {
  kvret_config c;
  config_defaults(&c);
  if (user != nullptr) {
    const size_t size = user->struct_size;
    require(size >= offsetof(kvret_config, n_layers) + sizeof(int32_t), KVRET_ERR_VERSION,
            "config.struct_size is " + std::to_string(size) + "; call kvret_config_init first");
    require(whole_fields(size), KVRET_ERR_VERSION,
            "config.struct_size is " + std::to_string(size) +
                ", which ends inside a field: no version of kvret_config has that size (call kvret_config_init)");
    if (size > sizeof c) {
      const auto* extra = reinterpret_cast<const unsigned char*>(user) + sizeof c;
      for (size_t i = 0; i < size - sizeof c; ++i)
        require(extra[i] == 0, KVRET_ERR_VERSION,
                "config.struct_size is " + std::to_string(size) +
                    ": the caller sets fields this library version does not know (its struct has " +
                    std::to_string(sizeof c) + " bytes)");
    }
    std::memcpy(&c, user, size < sizeof c ? size : sizeof c);
    c.struct_size = sizeof c;
  }
  const Grouped given = apply_params(c);
  try {
    validate_config(c);
  } catch (const Error& e) {
    throw Error(e.status(), grouped_message(e.what(), given));
  }
  disk_path->assign(c.disk_path ? c.disk_path : "");
  c.disk_path = nullptr;
  if (shared_url != nullptr) shared_url->assign(c.session_shared_url ? c.session_shared_url : "");
  c.session_shared_url = nullptr;  // the URL itself is checked when the session store opens the tier
  return c;
}

void validate_config(const kvret_config& c) {
  check(c.n_layers >= 1 && c.n_layers <= kMaxLayers, "n_layers",
        "must be in 1.." + std::to_string(kMaxLayers) + ", got " + std::to_string(c.n_layers));
  check(c.n_q_heads >= 1 && c.n_q_heads <= kMaxQHeads, "n_q_heads",
        "must be in 1.." + std::to_string(kMaxQHeads) + ", got " + std::to_string(c.n_q_heads));
  check(c.n_kv_heads >= 1, "n_kv_heads", "must be >= 1, got " + std::to_string(c.n_kv_heads));
  check(c.n_q_heads % c.n_kv_heads == 0, "n_q_heads",
        std::to_string(c.n_q_heads) + " is not a multiple of n_kv_heads " + std::to_string(c.n_kv_heads));
  static_assert(kMaxHeadDim == 256, "head_dim's check below lists the accepted sizes");
  check(c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256, "head_dim",
        "must be 64, 128 or 256, got " + std::to_string(c.head_dim));
  check(c.kv_dtype == KVRET_KV_F16 || c.kv_dtype == KVRET_KV_BF16 || c.kv_dtype == KVRET_KV_F32, "kv_dtype",
        "unknown value " + std::to_string(c.kv_dtype));
  check(c.device_type == KVRET_DEVICE_CPU || c.device_type == KVRET_DEVICE_CUDA, "device_type",
        "must be KVRET_DEVICE_CPU or KVRET_DEVICE_CUDA, got " + std::to_string(c.device_type));
  // whether this build has the CUDA backend and a device: make_backend, when the context is made
  check(c.n_sink >= 0, "n_sink", "must be >= 0");
  check(c.n_local >= 0, "n_local", "must be >= 0");
  check(c.budget >= 0, "budget", "must be >= 0 (0 = use budget_ratio)");
  check(c.budget > 0 || (c.budget_ratio > 0.0f && c.budget_ratio <= 1.0f), "budget_ratio",
        "must be in (0, 1] when budget is 0");
  check(c.gqa_fold == KVRET_FOLD_SUM_PROB || c.gqa_fold == KVRET_FOLD_MAX_LOGIT, "gqa_fold",
        "unknown value " + std::to_string(c.gqa_fold));
  // index_kind: checked against the registered index kinds when the context is made (Context::Context)
  check(c.pq_m >= 1 && c.head_dim % c.pq_m == 0, "pq_m",
        std::to_string(c.pq_m) + " does not divide head_dim " + std::to_string(c.head_dim));
  check(c.pq_bits >= 1 && c.pq_bits <= 8, "pq_bits", "must be in 1..8, got " + std::to_string(c.pq_bits));
  check(c.pq_iters >= 0 && c.pq_iters <= 1000, "pq_iters", "must be in 0..1000 (0 = adaptive)");
  check(c.pq_tol >= 0.0f, "pq_tol", "must be >= 0");
  check(c.pq_train_sample == 0 || c.pq_train_sample >= (1 << c.pq_bits), "pq_train_sample",
        "must be 0 (all tokens) or at least 2^pq_bits = " + std::to_string(1 << c.pq_bits));
  check(c.pq_exact_fraction >= 0.0f && c.pq_exact_fraction <= kMaxPqExactFraction, "pq_exact_fraction",
        "must be in [0, 0.5] (0 = off), got " + std::to_string(c.pq_exact_fraction));
  check(c.cluster_tokens >= 1, "cluster_tokens", "must be >= 1");
  check(c.cluster_decode_interval >= 1, "cluster_decode_interval", "must be >= 1");
  check(c.cluster_decode_k >= 1, "cluster_decode_k", "must be >= 1");
  check(c.cluster_segment_tokens >= 0, "cluster_segment_tokens",
        "must be >= 0 (0 = no limit), got " + std::to_string(c.cluster_segment_tokens));
  check(c.cluster_exact_fraction >= 0.0f && c.cluster_exact_fraction <= 0.5f, "cluster_exact_fraction",
        "must be in [0, 0.5] (0 = off), got " + std::to_string(c.cluster_exact_fraction));
  check(c.cluster_reuse_steps >= 0 && c.cluster_reuse_steps <= kMaxClusterReuseSteps, "cluster_reuse_steps",
        "must be in 0..1024 (0 = off), got " + std::to_string(c.cluster_reuse_steps));
  check(c.page_size >= 1 && c.page_size <= 65536, "page_size",
        "must be in 1..65536, got " + std::to_string(c.page_size));
  check(c.quant_bits == 1 || c.quant_bits == 2, "quant_bits", "must be 1 or 2, got " + std::to_string(c.quant_bits));
  check(c.quant_group_size == 32 || c.quant_group_size == 64, "quant_group_size",
        "must be 32 or 64, got " + std::to_string(c.quant_group_size));
  check(c.quant_residual >= 0 && c.quant_residual <= 65536, "quant_residual",
        "must be in 0..65536, got " + std::to_string(c.quant_residual));
  check(c.quant_rerank >= 1 && c.quant_rerank <= 64, "quant_rerank",
        "must be in 1..64, got " + std::to_string(c.quant_rerank));
  check(c.quant_attention == 0 || c.quant_attention == 1, "quant_attention",
        "must be 0 or 1, got " + std::to_string(c.quant_attention));
  check(c.quant_attention == 0 || c.index_kind == KVRET_INDEX_QUANT, "quant_attention",
        "1 needs index_kind = KVRET_INDEX_QUANT (the low-bit copy it attends over)");
  check(c.hamming_fraction >= 0.0f && c.hamming_fraction < 1.0f, "hamming_fraction",
        "must be in [0, 1), got " + std::to_string(c.hamming_fraction));
  check(c.hamming_buckets >= 0, "hamming_buckets", "must be >= 0");
  check(c.hamming_importance == KVRET_IMPORTANCE_WINDOW || c.hamming_importance == KVRET_IMPORTANCE_ACCUMULATED,
        "hamming_importance", "unknown value " + std::to_string(c.hamming_importance));
  check(c.hamming_granularity >= 0 && c.hamming_granularity <= 4096 &&
            (c.hamming_granularity & (c.hamming_granularity - 1)) == 0,
        "hamming_granularity",
        "must be 0, 1 or a power of two up to 4096, got " + std::to_string(c.hamming_granularity));
  check(c.max_seq_tokens >= 0, "max_seq_tokens", "must be >= 0 (0 = unlimited)");
  check(c.host_bytes_limit >= 0, "host_bytes_limit", "must be >= 0 (0 = unlimited)");
  {
    // a sequence holding one token in every layer holds one page (K and V of every KV head) per layer; the
    // geometry's bounds above keep this product far inside 64 bits
    const int64_t element = c.kv_dtype == KVRET_KV_F32 ? 4 : 2;
    const int64_t one_token_everywhere =
        int64_t{c.n_layers} * kConfigPageTokens * 2 * c.n_kv_heads * c.head_dim * element;
    check(c.host_bytes_limit == 0 || c.host_bytes_limit >= one_token_everywhere, "host_bytes_limit",
          std::to_string(c.host_bytes_limit) + " bytes cannot hold one token in every layer: that takes " +
              std::to_string(one_token_everywhere) + " bytes (a " + std::to_string(kConfigPageTokens) +
              "-token page of K and V per layer: n_layers x 256 x 2 x n_kv_heads x head_dim x element size)");
  }
  check(c.device_bytes_limit >= 0, "device_bytes_limit", "must be >= 0 (0 = unlimited)");
  check(c.session_dram_bytes >= 0, "session_dram_bytes", "must be >= 0 (0 = unlimited)");
  check(c.session_disk_bytes >= 0, "session_disk_bytes", "must be >= 0 (0 = unlimited)");
  check(c.session_ttl_ms >= 0, "session_ttl_ms", "must be >= 0 (0 = never)");
  check(c.session_policy == KVRET_SESSION_SCHEDULER_AWARE || c.session_policy == KVRET_SESSION_LRU ||
            c.session_policy == KVRET_SESSION_FIFO,
        "session_policy", "unknown value " + std::to_string(c.session_policy));
  check(c.rope_keys == 0 || c.rope_keys == 1, "rope_keys", "must be 0 or 1, got " + std::to_string(c.rope_keys));
  check(c.rope_dims >= 0 && c.rope_dims <= c.head_dim && c.rope_dims % 2 == 0, "rope_dims",
        "must be even and in 0..head_dim (0 = head_dim), got " + std::to_string(c.rope_dims));
  check(c.rope_layout == KVRET_ROPE_NEOX || c.rope_layout == KVRET_ROPE_GPTJ, "rope_layout",
        "unknown value " + std::to_string(c.rope_layout));
  check(std::isfinite(c.rope_theta) && c.rope_theta > 0.0f, "rope_theta",
        "must be finite and > 0, got " + std::to_string(c.rope_theta));
  check(c.rope_scale_factor == 0.0f || (std::isfinite(c.rope_scale_factor) && c.rope_scale_factor >= 1.0f),
        "rope_scale_factor", "must be 0 (no scaling) or finite and >= 1, got " + std::to_string(c.rope_scale_factor));
  check(std::isfinite(c.rope_low_freq_factor) && c.rope_low_freq_factor > 0.0f, "rope_low_freq_factor",
        "must be finite and > 0, got " + std::to_string(c.rope_low_freq_factor));
  check(std::isfinite(c.rope_high_freq_factor) && c.rope_high_freq_factor > c.rope_low_freq_factor,
        "rope_high_freq_factor",
        "must be finite and > rope_low_freq_factor, got " + std::to_string(c.rope_high_freq_factor));
  check(c.rope_original_max_positions >= 1, "rope_original_max_positions",
        "must be >= 1, got " + std::to_string(c.rope_original_max_positions));
  check(c.block_tokens >= 1, "block_tokens", "must be >= 1");
  check(c.cache_policy == KVRET_CACHE_LRU || c.cache_policy == KVRET_CACHE_LFU, "cache_policy", "unknown value");
  check(c.cache_capacity_tokens >= 0, "cache_capacity_tokens", "must be >= 0");
  check(c.n_threads >= 0, "n_threads", "must be >= 0 (0 = all cores)");
  check(c.background_build == 0 || c.background_build == 1, "background_build", "must be 0 or 1");
  check(c.check_finite == 0 || c.check_finite == 1, "check_finite", "must be 0 or 1");
}

}  // namespace kvret
