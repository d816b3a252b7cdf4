/*
 * kvret.h — the whole public C ABI of kvret.
 *
 * kvret keeps a long KV cache off the GPU, a compact index of it near the compute, and at every decode step
 * retrieves the few tokens that matter for the current query. This header is C99, has no CUDA or C++ includes,
 * and is the only header a user needs.
 *
 * Conventions (they hold for every call below):
 *  - Every function returns a kvret_status; KVRET_OK (0) is success. On failure the calling thread's last-error
 *    message (kvret_last_error) says what was wrong, and the object the call was given is left exactly as it was.
 *  - The library never aborts, never throws across this boundary and never prints.
 *  - Config and stats structs start with `struct_size`; fill them with their *_init function first.
 *    A NULL config means the defaults.
 *  - Tensors are borrowed for the duration of the call (for *_async calls: until the stream reaches the work).
 *  - Different sequences may be used from different threads at once. One sequence must not be used from two
 *    threads at once: every call that takes a kvret_seq* (the read-only ones too, and each sequence of a batch call)
 *    marks it in use for the call's duration with one atomic compare-and-swap, and a call that finds it marked
 *    returns KVRET_ERR_BUSY with nothing done. The context itself (create/destroy aside) is thread-safe.
 */
#ifndef KVRET_H
#define KVRET_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------------------------
 * Versioning and symbol visibility
 * ------------------------------------------------------------------------------------------------------------- */
#define KVRET_VERSION_MAJOR 0
#define KVRET_VERSION_MINOR 1
#define KVRET_VERSION_PATCH 0
#define KVRET_VERSION_NUMBER (KVRET_VERSION_MAJOR * 10000 + KVRET_VERSION_MINOR * 100 + KVRET_VERSION_PATCH)
#define KVRET_VERSION_STRING "0.1.0"

#if defined(_WIN32)
#if defined(KVRET_BUILDING_LIBRARY)
#define KVRET_API __declspec(dllexport)
#else
#define KVRET_API __declspec(dllimport)
#endif
#elif defined(__GNUC__)
#define KVRET_API __attribute__((visibility("default")))
#else
#define KVRET_API
#endif

/** The runtime version as KVRET_VERSION_NUMBER would compute it (compare with the macro to detect a mismatch). */
KVRET_API unsigned kvret_version_number(void);
/** The runtime version as "MAJOR.MINOR.PATCH"; a static string. */
KVRET_API const char* kvret_version_string(void);

/* ---------------------------------------------------------------------------------------------------------------
 * Status and errors
 * ------------------------------------------------------------------------------------------------------------- */
typedef enum kvret_status {
  KVRET_OK = 0,
  KVRET_ERR_INVALID_ARGUMENT = 1, /**< a NULL pointer where one is required, or a value outside its domain */
  KVRET_ERR_INVALID_HANDLE = 2,   /**< a NULL, closed or foreign context/sequence handle */
  KVRET_ERR_SHAPE = 3,            /**< a tensor's ndim or shape does not match the model geometry */
  KVRET_ERR_DTYPE = 4,            /**< a tensor's dtype is not accepted by this call */
  KVRET_ERR_STRIDE = 5,           /**< a tensor's strides are not supported (innermost must be contiguous) */
  KVRET_ERR_DEVICE = 6,           /**< a tensor lives on a device this call cannot read or write */
  KVRET_ERR_OUT_OF_RANGE = 7,     /**< a layer or head index outside the model */
  KVRET_ERR_BUDGET = 8,           /**< a budget of 0, or above the current context length */
  KVRET_ERR_CAPACITY = 9,         /**< the append would exceed the sequence's or context's token capacity */
  KVRET_ERR_OUT_OF_MEMORY = 10,   /**< host, pinned or device allocation failed */
  KVRET_ERR_NONFINITE = 11,       /**< NaN or Inf in keys/values/queries (only when check_finite is on) */
  KVRET_ERR_STATE = 12,           /**< the call is out of order (e.g. decode before any prefill of that layer) */
  KVRET_ERR_UNSUPPORTED = 13,     /**< the build or this version does not provide the requested feature */
  KVRET_ERR_IO = 14,              /**< a read or write in the disk tier failed (full disk, permissions), or the
                                       shared tier's server could not be reached or did not answer in time */
  KVRET_ERR_CORRUPT = 15,         /**< a file of the disk tier or a saved session is corrupt or truncated */
  KVRET_ERR_CUDA = 16,            /**< a CUDA runtime error (including ones from earlier asynchronous work) */
  KVRET_ERR_VERSION = 17,         /**< a struct_size this library does not understand */
  KVRET_ERR_INTERNAL = 18,        /**< a bug in kvret; please report it with the message */
  KVRET_ERR_NOT_FOUND = 19,       /**< no saved session has that id (never saved, dropped, expired or evicted) */
  KVRET_ERR_BUSY = 20             /**< the sequence is in a call on another thread (one sequence, one call at a
                                       time): nothing was done */
} kvret_status;

/** A static, human-readable name for a status ("KVRET_ERR_SHAPE", ...). Never NULL. */
KVRET_API const char* kvret_status_string(kvret_status status);
/** The message of the last failed call on this thread ("" if none). Valid until the next kvret call on it. */
KVRET_API const char* kvret_last_error(void);
/** Clears this thread's last-error message. */
KVRET_API void kvret_clear_error(void);

/* ---------------------------------------------------------------------------------------------------------------
 * Tensors: a borrowed descriptor laid out exactly like DLPack's DLTensor, so that a DLTensor* can be passed as a
 * kvret_tensor* and NumPy / PyTorch / CuPy / JAX arrays map onto it without copies.
 * ------------------------------------------------------------------------------------------------------------- */
typedef enum kvret_device_type {
  KVRET_DEVICE_CPU = 1,      /**< == kDLCPU */
  KVRET_DEVICE_CUDA = 2,     /**< == kDLCUDA */
  KVRET_DEVICE_CUDA_HOST = 3 /**< == kDLCUDAHost: pinned host memory, readable by the CPU backend */
} kvret_device_type;

/* Which memory a call's tensors may be in is the context's backend's rule, the same for every argument of every
 * call (a tensor elsewhere is KVRET_ERR_DEVICE, naming it, and nothing changes):
 * - CPU backend (config.device_type = KVRET_DEVICE_CPU): KVRET_DEVICE_CPU or KVRET_DEVICE_CUDA_HOST memory.
 * - CUDA backend (KVRET_DEVICE_CUDA): memory of the context's GPU (KVRET_DEVICE_CUDA with device_id =
 *   config.device_id) or pinned host memory (KVRET_DEVICE_CUDA_HOST, allocated mapped, e.g. cudaHostAlloc with
 *   cudaHostAllocMapped or PyTorch's pin_memory). Pageable KVRET_DEVICE_CPU memory is refused. The label is also
 *   checked against the memory itself (cudaPointerGetAttributes): device memory labelled KVRET_DEVICE_CUDA_HOST,
 *   another GPU's memory, and pageable host memory where a kernel touches the tensor in place (the working set of
 *   kvret_fetch_async, the tensors of kvret_attend, q and out of kvret_seq_attend; unless the GPU has pageable
 *   memory access) are KVRET_ERR_DEVICE before anything runs. Calls with a stream
 *   argument order their device work on that stream and may return before it is done (kvret_synchronize); the
 *   calls of one sequence whose work is in flight together must use one stream. The others (append, select, read)
 *   copy what they read from device memory after the work on the legacy default stream and return when their
 *   outputs are written. */

typedef struct kvret_device {
  int32_t device_type; /**< a kvret_device_type value */
  int32_t device_id;
} kvret_device;

typedef enum kvret_dtype_code {
  KVRET_DTYPE_INT = 0,   /**< == kDLInt */
  KVRET_DTYPE_UINT = 1,  /**< == kDLUInt */
  KVRET_DTYPE_FLOAT = 2, /**< == kDLFloat */
  KVRET_DTYPE_BFLOAT = 4 /**< == kDLBfloat */
} kvret_dtype_code;

typedef struct kvret_dtype {
  uint8_t code;   /**< a kvret_dtype_code value */
  uint8_t bits;   /**< 16, 32, ... */
  uint16_t lanes; /**< always 1 */
} kvret_dtype;

typedef struct kvret_tensor {
  void* data; /**< base pointer (add byte_offset) */
  kvret_device device;
  int32_t ndim;
  kvret_dtype dtype;
  const int64_t* shape;   /**< ndim extents */
  const int64_t* strides; /**< ndim strides in elements, or NULL for compact row-major */
  uint64_t byte_offset;
} kvret_tensor;

/** The storage type of the KV cache. */
typedef enum kvret_kv_dtype { KVRET_KV_F16 = 0, KVRET_KV_BF16 = 1, KVRET_KV_F32 = 2 } kvret_kv_dtype;

/* ---------------------------------------------------------------------------------------------------------------
 * Configuration
 * ------------------------------------------------------------------------------------------------------------- */

/** Which index selects the middle tokens. */
typedef enum kvret_index_kind {
  KVRET_INDEX_EXACT = 0,     /**< exact q.k over every middle token: the quality oracle */
  KVRET_INDEX_PQ = 1,        /**< product quantization of keys (PQCache) */
  KVRET_INDEX_STREAMING = 2, /**< no retrieval: the working set is sink + local only (the baseline) */
  KVRET_INDEX_PAGE = 3,      /**< per-page min/max key bounds (Quest): pages of page_size tokens, best bound first */
  KVRET_INDEX_CLUSTER = 4,   /**< cosine k-means clusters of keys (ClusterKV; CPU): whole clusters, best first */
  KVRET_INDEX_QUANT = 5      /**< KIVI 1- or 2-bit copy of K and V (SpeCache; CPU): tokens scored from its keys */
} kvret_index_kind;

/** How the query heads of one KV group are folded into one score per token. */
typedef enum kvret_gqa_fold {
  KVRET_FOLD_SUM_PROB = 0, /**< sum over the group of each head's softmax probability (default) */
  KVRET_FOLD_MAX_LOGIT = 1 /**< max over the group of each head's logit */
} kvret_gqa_fold;

/** Replacement policy of the GPU block cache (CUDA backend). */
typedef enum kvret_cache_policy { KVRET_CACHE_LRU = 0, KVRET_CACHE_LFU = 1 } kvret_cache_policy;

/** Which saved session a full tier of the session store evicts (docs/sessions.md). */
typedef enum kvret_session_policy {
  KVRET_SESSION_SCHEDULER_AWARE = 0, /**< the one the job queue (kvret_session_schedule) needs furthest in the future;
                                          sessions not in the queue first, least recently used first (AttentionStore) */
  KVRET_SESSION_LRU = 1,             /**< the least recently used */
  KVRET_SESSION_FIFO = 2             /**< the earliest stored */
} kvret_session_policy;

/** How the rotary embedding pairs the dimensions of a head (config.rope_keys). */
typedef enum kvret_rope_layout {
  KVRET_ROPE_NEOX = 0, /**< dimension i pairs with i + rope_dims/2 (GPT-NeoX, Llama in Hugging Face) */
  KVRET_ROPE_GPTJ = 1  /**< dimension 2i pairs with 2i + 1 (GPT-J, Meta's original Llama) */
} kvret_rope_layout;

/** Where KVCrush's token importance comes from (crush.importance, kvret_crush_params; docs/kvcrush.md). */
typedef enum kvret_importance {
  KVRET_IMPORTANCE_WINDOW = 0, /**< SnapKV's observation window: the prompt's last queries given to
                                    kvret_seq_observe, else the layer's last 32 keys as stand-in queries (default) */
  KVRET_IMPORTANCE_ACCUMULATED =
      1 /**< H2O's accumulated attention: per query head and token, the sum of the attention
             probabilities of every decode step kvret_seq_attend computed or the engine handed
             to kvret_seq_observe_attention; the window until a layer has observed a step */
} kvret_importance;

/* Per-design parameters. Each retrieval design's knobs are in one struct of their own, with its own struct_size
 * and *_init (the defaults are those of kvret_config_init), reached from the config through a pointer:
 *
 *   kvret_pq_params pq;
 *   kvret_pq_params_init(&pq);
 *   pq.m = 8;
 *   config.pq = &pq;  // NULL (the default): the design keeps its defaults
 *
 * kvret_create reads the struct during the call only. A struct_size no version of the struct has is
 * KVRET_ERR_VERSION naming the struct; a value out of its range is KVRET_ERR_INVALID_ARGUMENT naming the field as
 * config.pq.m. The same knobs are still flat fields of kvret_config (pq_m, cluster_tokens, quant_bits, hamming_*,
 * session_*): those are kept for one release and then removed. Changing a flat field from its default while also
 * giving its design's struct is KVRET_ERR_INVALID_ARGUMENT naming both; kvret_get_config reports the effective values
 * in the flat fields (and NULL pointers). */

/** The parameters of PQCache, the pq index (KVRET_INDEX_PQ; docs/pq.md). Fill with kvret_pq_params_init; reached from
 * config.pq. */
typedef struct kvret_pq_params {
  size_t struct_size;   /**< sizeof(kvret_pq_params), set by kvret_pq_params_init */
  int32_t m;            /**< sub-spaces; head_dim % m == 0; default 4 */
  int32_t bits;         /**< bits per code (2^bits centroids), 1..8; default 6 */
  int32_t iters;        /**< k-means iterations; 0 = adaptive (stop when the objective improves < tol, at most 25);
                            default 0 */
  float tol;            /**< relative objective improvement that ends adaptive k-means; default 1e-3 */
  int32_t train_sample; /**< max tokens sampled per (layer, KV head) for training; 0 = all; default 8192 */
  float exact_fraction; /**< share of each (layer, KV head)'s indexed tokens whose keys quantize worst (largest
                            squared reconstruction error ||k - k_hat||^2) that PQ keeps exact: a copy of the key in
                            the index (in kv_dtype), scored with the exact q.k instead of the codes. A rare, sharp
                            key (the one a retrieval head copies from) is the one PQ reconstructs worst.
                            ceil(fraction * n) tokens per head at each training, ties to the earlier position; a
                            token encoded later with the same codebook becomes exact when its error exceeds the
                            smallest error in the exact set, while the set holds less than twice its share. Costs
                            fraction * n * head_dim * (2 or 4) bytes per head. 0 = off; valid range [0, 0.5]; default
                            0.05 */
} kvret_pq_params;

/** Fills *params with the defaults of kvret_pq_params (those of kvret_config_init) and sets struct_size. */
KVRET_API kvret_status kvret_pq_params_init(kvret_pq_params* params);

/** The parameters of ClusterKV, the cluster index (KVRET_INDEX_CLUSTER; docs/cluster.md). Fill with
 * kvret_cluster_params_init; reached from config.cluster. */
typedef struct kvret_cluster_params {
  size_t struct_size;      /**< sizeof(kvret_cluster_params), set by kvret_cluster_params_init */
  int32_t tokens;          /**< tokens per cluster at prefill (ceil(n / this) clusters); default 32 (ClusterKV's own
                               setting is 80: docs/cluster.md compares them) */
  int32_t decode_interval; /**< decode tokens clustered at a time (scored exactly until then); default 320 */
  int32_t decode_k;        /**< clusters made from each decoded interval; default 4 */
  int32_t segment_tokens;  /**< most middle tokens one k-means of the cluster index clusters: a longer prefill is cut
                               into ceil(n / this) segments of equal length, clustered apart, so the build is linear
                               in the prefill length; 0 = the whole prefill in one k-means (quadratic in its length);
                               default 4096 */
  int32_t reuse_steps;     /**< R: on a KVRET_INDEX_CLUSTER context, the clusters a layer's fetches took in its last
                               R fetches (steps) stay resident in the sequence: a copy of the rows fetched from them
                               (in kv_dtype), from which the next fetch serves the selected rows it holds instead of
                               the host store (the same bytes). A cluster fetched again stays resident with every row
                               it holds; one not fetched in R steps is dropped. Hits count in
                               stats.cluster_reuse_hits (and cache_hits), so cluster_reuse_hits / cluster_reuse_rows
                               is the hit rate. Truncating a layer drops its copy; a fork starts without one. 0 =
                               off; 0..1024; default 1. Ignored by the other index kinds */
  float exact_fraction;    /**< share of each clustered segment's tokens (per KV head) that the cluster index keeps
                               out of the clusters: the ceil(fraction * n) keys of lowest cosine to their k-means
                               direction (ties to the earlier position; at most n minus the segment's clusters), each
                               a group of its own, scored by its exact q.k. A rare, sharp key (the one a retrieval
                               head copies from) is the one its cluster's mean hides. Costs fraction * n * head_dim *
                               4 bytes per head. 0 = off (ClusterKV's own index); [0, 0.5]; default 0.05 */
} kvret_cluster_params;

/** Fills *params with the defaults of kvret_cluster_params (those of kvret_config_init) and sets struct_size. */
KVRET_API kvret_status kvret_cluster_params_init(kvret_cluster_params* params);

/** The parameters of SpeCache's quantized copy, the quant index (KVRET_INDEX_QUANT; docs/quant.md). Fill with
 * kvret_quant_params_init; reached from config.quant. */
typedef struct kvret_quant_params {
  size_t struct_size; /**< sizeof(kvret_quant_params), set by kvret_quant_params_init */
  int32_t bits;       /**< bits per quantized key and value element: 1 or 2; default 2 */
  int32_t group_size; /**< elements per quantization group of the quant index (keys: tokens of one channel, values:
                          channels of one token), each with its own f16 min and max: 32 or 64; default 64 */
  int32_t residual;   /**< most recent middle tokens the quant index keeps in f16 (KIVI's residual window; up to
                          group_size - 1 more wait for a full key group): 0..65536; default 64 */
  int32_t rerank;     /**< on a KVRET_INDEX_QUANT context, select takes the rerank x budget middle tokens the low-bit
                          keys score highest (at most the middle) as candidates, scores them again with their exact
                          keys from the KV store and keeps the top budget of those: a key the 1-bit copy ranks just
                          below the cut (a needle) is recovered for candidates x head_dim multiply-adds more and a
                          read of the candidates' keys. 1 = off (the low-bit ranking alone, SpeCache's); 1..64;
                          default 4. Ignored by the other index kinds. Under attention = 1 the candidates also enter
                          that attention with their exact keys */
  int32_t attention;  /**< 1: on a KVRET_INDEX_QUANT context, kvret_seq_attend attends over every token of the layer,
                          the sink, local and selected tokens exact, select's rerank x budget candidates with their
                          exact keys (their values low-bit unless selected) and every other middle token as the
                          low-bit copy has it (computed on the host); 0 (default): over the working set, as for every
                          other index. 1 needs index_kind = KVRET_INDEX_QUANT */
} kvret_quant_params;

/** Fills *params with the defaults of kvret_quant_params (those of kvret_config_init) and sets struct_size. */
KVRET_API kvret_status kvret_quant_params_init(kvret_quant_params* params);

/** The parameters of KVCrush's hamming grouping of the tokens left out (docs/kvcrush.md). Fill with
 * kvret_crush_params_init; reached from config.crush. */
typedef struct kvret_crush_params {
  size_t struct_size;  /**< sizeof(kvret_crush_params), set by kvret_crush_params_init */
  float fraction;      /**< share of each select's budget spent on bucket representatives of the tokens left out, in
                           [0, 1): floor(fraction * budget) of them; default 0 (off) */
  int32_t buckets;     /**< most representatives (buckets) per KV head and select; default 0 = no cap */
  int32_t importance;  /**< a kvret_importance: where the importance behind KVCrush's signatures, its representatives
                           and kvret_seq_retained_set comes from; default KVRET_IMPORTANCE_WINDOW */
  int32_t granularity; /**< tokens per KVCrush representative unit: 0 or 1 = single tokens (default 0); a power of
                           two 2..4096 = aligned runs of that many positions (chunks of 8, or the engine's KV page),
                           each representative unit sending all its tokens the index did not select; the count a
                           select returns does not change */
} kvret_crush_params;

/** Fills *params with the defaults of kvret_crush_params (those of kvret_config_init) and sets struct_size. */
KVRET_API kvret_status kvret_crush_params_init(kvret_crush_params* params);

/** The parameters of the session store (AttentionStore; docs/sessions.md); its disk tier is config.disk_path and its
 * shared tier config.session_shared_url. Fill with kvret_session_params_init; reached from config.session. */
typedef struct kvret_session_params {
  size_t struct_size; /**< sizeof(kvret_session_params), set by kvret_session_params_init */
  int64_t dram_bytes; /**< capacity of the session store's host DRAM tier in bytes; 0 = unlimited; default 0; >= 0 */
  int64_t disk_bytes; /**< capacity of the disk tier (config.disk_path) in bytes; 0 = unlimited; default 0; >= 0 */
  int64_t ttl_ms;     /**< a saved session expires this many milliseconds after its save (then it is a miss, and its
                          bytes are freed); 0 = never; default 0; >= 0 */
  int32_t policy;     /**< a kvret_session_policy; default KVRET_SESSION_SCHEDULER_AWARE */
} kvret_session_params;

/** Fills *params with the defaults of kvret_session_params (those of kvret_config_init) and sets struct_size. */
KVRET_API kvret_status kvret_session_params_init(kvret_session_params* params);

typedef struct kvret_config {
  size_t struct_size; /**< sizeof(kvret_config), set by kvret_config_init */

  /* model geometry */
  int32_t n_layers;   /**< 1..4096; default 32 */
  int32_t n_q_heads;  /**< 1..4096; default 32 */
  int32_t n_kv_heads; /**< default 8; n_q_heads % n_kv_heads == 0 */
  int32_t head_dim;   /**< 64, 128 or 256; default 128 */
  int32_t kv_dtype;   /**< a kvret_kv_dtype; default KVRET_KV_F16 */

  /* where the index and working set live */
  int32_t device_type; /**< KVRET_DEVICE_CPU (default) or KVRET_DEVICE_CUDA (KVRET_ERR_UNSUPPORTED in a build
                            without the CUDA backend, KVRET_ERR_CUDA where no CUDA device can be used) */
  int32_t device_id;   /**< CUDA device ordinal; default 0 */

  /* token groups and budget */
  int32_t n_sink;     /**< first tokens always attended; default 16 */
  int32_t n_local;    /**< most recent tokens always attended; default 64 */
  int32_t budget;     /**< middle tokens selected per KV head; 0 = use budget_ratio (default 0) */
  float budget_ratio; /**< budget as a fraction of the context length when budget == 0; default 0.1 */
  int32_t gqa_fold;   /**< a kvret_gqa_fold; default KVRET_FOLD_SUM_PROB */
  int32_t index_kind; /**< a kvret_index_kind; default KVRET_INDEX_PQ */

  /* PQ (PQCache) */
  int32_t pq_m;            /**< kept for one release: use pq.m */
  int32_t pq_bits;         /**< kept for one release: use pq.bits */
  int32_t pq_iters;        /**< kept for one release: use pq.iters */
  float pq_tol;            /**< kept for one release: use pq.tol */
  int32_t pq_train_sample; /**< kept for one release: use pq.train_sample */

  /* ClusterKV (the cluster index, docs/cluster.md) */
  int32_t cluster_tokens;          /**< kept for one release: use cluster.tokens */
  int32_t cluster_decode_interval; /**< kept for one release: use cluster.decode_interval */
  int32_t cluster_decode_k;        /**< kept for one release: use cluster.decode_k */

  /* Quest pages (the page index) */
  int32_t page_size; /**< tokens per page; default 16 */

  /* SpeCache quantized copy (the quant index, docs/quant.md; quant_group_size and quant_residual are at the end) */
  int32_t quant_bits; /**< kept for one release: use quant.bits */

  /* KVCrush hamming grouping (docs/kvcrush.md) */
  float hamming_fraction;  /**< kept for one release: use crush.fraction */
  int32_t hamming_buckets; /**< kept for one release: use crush.buckets */

  /* storage and capacity */
  int64_t max_seq_tokens;   /**< token capacity of one sequence (per layer); 0 = unlimited; default 0 */
  int64_t host_bytes_limit; /**< capacity of the host KV store over all sequences; 0 = unlimited; default 0. When
                                 set, at least one 256-token page of K and V per layer (n_layers x 256 x 2 x
                                 n_kv_heads x head_dim x element size): less is KVRET_ERR_INVALID_ARGUMENT */
  const char* disk_path;    /**< directory of the session store's disk tier (docs/sessions.md), created if missing;
                                 NULL or "" = no disk tier. kvret_create copies
                                 the string; kvret_get_config returns a pointer valid until kvret_destroy */

  /* GPU block cache (CUDA backend; docs/cuda_backend.md) */
  int32_t block_tokens;          /**< tokens per cache block (positions [b * block_tokens, (b+1) * block_tokens));
                                      default 128; >= 1 */
  int32_t cache_policy;          /**< a kvret_cache_policy: which cached block a newly admitted one replaces;
                                      default KVRET_CACHE_LRU */
  int64_t cache_capacity_tokens; /**< block cache capacity per (sequence, layer, KV head) on the CUDA backend:
                                      cache_capacity_tokens / block_tokens slots (at most 2048; 0 slots = no
                                      cache) of keys and values in device memory, made at the layer's first fetch
                                      or prefetch, counted in stats.device_bytes and under device_bytes_limit (a
                                      layer whose cache does not fit runs without one). Fetches serve rows of
                                      cached blocks from it (stats.cache_hits) and admit the complete blocks
                                      holding the most selected rows; the still-growing last block is never
                                      cached. With it come the device windows: the first n_sink and the last
                                      n_local rows (each at most 4096) in device memory, loaded as the layer grows,
                                      from which fetches serve their sink and local rows. Results are the same
                                      with and without it. Ignored by the CPU backend, whose KV is already in host
                                      memory; default 4096; >= 0 */

  /* runtime */
  int32_t n_threads;        /**< CPU threads for scoring and builds; 0 = all cores; default 0 */
  int32_t background_build; /**< 1: index builds run in the background after append_prefill (default) */
  int32_t check_finite;     /**< 1: reject NaN/Inf in appended keys/values and queries; default 0 */
  uint64_t seed;            /**< seed of every randomized step (k-means init, sampling); default 42 */

  /* PQ exact outliers (appended: older, smaller structs get the default) */
  float pq_exact_fraction; /**< kept for one release: use pq.exact_fraction */

  /* SpeCache quantized copy, continued (appended: older, smaller structs get the defaults) */
  int32_t quant_group_size; /**< kept for one release: use quant.group_size */
  int32_t quant_residual;   /**< kept for one release: use quant.residual */

  /* ClusterKV, continued (appended: older, smaller structs get the default) */
  int32_t cluster_segment_tokens; /**< kept for one release: use cluster.segment_tokens */

  /* SpeCache's output rule (appended: older, smaller structs get the default) */
  int32_t quant_attention; /**< kept for one release: use quant.attention */

  /* ClusterKV's reuse between steps (appended: older, smaller structs get the default; docs/cluster.md) */
  int32_t cluster_reuse_steps; /**< kept for one release: use cluster.reuse_steps */

  /* The CUDA backend's device memory (appended: older, smaller structs get the default) */
  int64_t device_bytes_limit; /**< most bytes of device memory the context's sequences keep between calls (the
                                   working sets of kvret_seq_attend and the block caches; stats.device_bytes). A
                                   working set that would pass it is KVRET_ERR_CAPACITY, naming this field, before
                                   the call changes anything; a block cache that would pass it is not made (that
                                   layer's fetches read every row from host memory and succeed; a later fetch
                                   tries again), and a cache's block table that cannot grow stops admitting blocks
                                   past it. The temporaries of a call (gather lists, attention weights, the
                                   cache's bookkeeping), freed before it returns, are not counted. 0 = unlimited
                                   (default); >= 0. Ignored by the CPU backend, which uses no device memory */

  /* The session store (AttentionStore; docs/sessions.md; appended: older, smaller structs get the defaults). Its
     disk tier is the directory config.disk_path. */
  int64_t session_dram_bytes; /**< kept for one release: use session.dram_bytes */
  int64_t session_disk_bytes; /**< kept for one release: use session.disk_bytes */
  int64_t session_ttl_ms;     /**< kept for one release: use session.ttl_ms */
  int32_t session_policy;     /**< kept for one release: use session.policy */

  /* Positional decoupling: keys stored before the rotary embedding (appended: older, smaller structs get the
     defaults; docs/rope.md) */
  int32_t rope_keys;                   /**< 1: the keys appended are before RoPE; kvret rotates them at the position
                                            each token has now (its index in the sequence) wherever keys are read:
                                            index builds, select, fetch, attention and kvret_seq_read. Queries stay
                                            rotated as before. 0 (default): keys are given rotated */
  int32_t rope_dims;                   /**< rotated dimensions of each head (even, <= head_dim; the rest pass
                                            unrotated); 0 = head_dim (default) */
  int32_t rope_layout;                 /**< a kvret_rope_layout; default KVRET_ROPE_NEOX */
  float rope_theta;                    /**< the base of the rotary frequencies; > 0; default 10000 */
  float rope_scale_factor;             /**< Llama-3 frequency scaling: the factor; 0 = none (default); else >= 1 */
  float rope_low_freq_factor;          /**< Llama-3 scaling: low-frequency factor; > 0; default 1 */
  float rope_high_freq_factor;         /**< Llama-3 scaling: high-frequency factor; > rope_low_freq_factor;
                                            default 4 */
  int32_t rope_original_max_positions; /**< Llama-3 scaling: the original context length; >= 1; default 8192 */

  /* The shared session tier (appended: older, smaller structs get the default; docs/sessions.md) */
  const char* session_shared_url; /**< a Redis server every node of a serving stack reads saved sessions from
                                       (docs/redis.md): redis://[[user]:password@]host[:port][/db][?prefix=P&
                                       timeout_ms=N]; NULL or "" = none (default). Saves write through to it, and
                                       open, where and drop look there on a local miss. kvret_create parses it (a
                                       bad URL: KVRET_ERR_INVALID_ARGUMENT; rediss:// or a build without hiredis:
                                       KVRET_ERR_UNSUPPORTED; no context is made) but does not connect: the first
                                       session call that needs the server does. kvret_create copies the string;
                                       kvret_get_config returns a pointer valid until kvret_destroy */

  /* ClusterKV's exact singletons (appended: older, smaller structs get the default; docs/cluster.md) */
  float cluster_exact_fraction; /**< kept for one release: use cluster.exact_fraction */

  /* The quant index's exact re-ranking (appended: older, smaller structs get the default; docs/quant.md) */
  int32_t quant_rerank; /**< kept for one release: use quant.rerank */

  /* KVCrush's importance (appended: older, smaller structs get the default; docs/kvcrush.md) */
  int32_t hamming_importance; /**< kept for one release: use crush.importance */

  /* KVCrush's representative unit (appended; docs/kvcrush.md) */
  int32_t hamming_granularity; /**< kept for one release: use crush.granularity */

  /* Per-design parameters (appended: older, smaller structs get NULL). NULL = the design's flat fields above */
  const kvret_pq_params* pq;           /**< PQCache's parameters, or NULL */
  const kvret_cluster_params* cluster; /**< ClusterKV's parameters, or NULL */
  const kvret_quant_params* quant;     /**< the quant index's parameters, or NULL */
  const kvret_crush_params* crush;     /**< KVCrush's parameters, or NULL */
  const kvret_session_params* session; /**< the session store's parameters, or NULL */
} kvret_config;

/** Fills *config with the documented defaults and sets struct_size. */
KVRET_API kvret_status kvret_config_init(kvret_config* config);

/* ---------------------------------------------------------------------------------------------------------------
 * Context and sequences
 * ------------------------------------------------------------------------------------------------------------- */
/** Handles: opaque values, never dereferenced by the caller. Each is issued once and never reused, so after
 *  kvret_destroy / kvret_seq_close every call with the old handle returns KVRET_ERR_INVALID_HANDLE, even when a
 *  new context or sequence takes the old one's memory. */
typedef struct kvret_context kvret_context;
typedef struct kvret_seq kvret_seq;

/** An opaque stream, ABI-identical to cudaStream_t. NULL means the library's default stream. Ignored by the CPU
 *  backend, where every call completes before it returns. */
typedef struct kvret_stream_opaque* kvret_stream;

/** Creates a context from *config (NULL = defaults). Validates the whole config; on failure *out is NULL.
 *  KVRET_ERR_OUT_OF_MEMORY also when the context's background build thread cannot be started. With device_type
 *  KVRET_DEVICE_CUDA it reads the device's compute capability M.m and refuses, with KVRET_ERR_UNSUPPORTED and a
 *  message naming its sm_Mm and the architectures this library was built for, a device it has no code for: code is
 *  there when real code (SASS) for sm_Xy with X == M and y <= m is embedded (sm_Xya: only M.m == X.y), or PTX for
 *  compute_Xy with X.y <= M.m, which the driver compiles at the first load. The default build carries sm_80, sm_89,
 *  sm_90 and sm_100 and PTX for compute_100: every device of compute capability 8.0 or newer. */
KVRET_API kvret_status kvret_create(const kvret_config* config, kvret_context** out);
/** Waits for background work, closes every open sequence and frees the context. NULL is a no-op (KVRET_OK). */
KVRET_API kvret_status kvret_destroy(kvret_context* ctx);
/** Copies the context's effective config into *out (out->struct_size must be set, e.g. by kvret_config_init). */
KVRET_API kvret_status kvret_get_config(const kvret_context* ctx, kvret_config* out);

/** Opens an empty sequence (one request or conversation). */
KVRET_API kvret_status kvret_seq_open(kvret_context* ctx, kvret_seq** out);
/** Waits for the sequence's background builds and frees it. NULL is a no-op (KVRET_OK). */
KVRET_API kvret_status kvret_seq_close(kvret_seq* seq);
/** Tokens stored for `layer` (sink + middle + local). */
KVRET_API kvret_status kvret_seq_length(const kvret_seq* seq, int32_t layer, int64_t* out_tokens);
/** The budget select uses by default for `layer` at its current length (config budget, or ratio * length,
 *  clamped to the number of middle tokens). */
KVRET_API kvret_status kvret_seq_budget(const kvret_seq* seq, int32_t layer, int32_t* out_budget);
/** Rolls the sequence back to its first `length` tokens in every layer (a layer holding fewer keeps its own): for
 *  speculative decoding (drop the rejected draft tokens) and regeneration. Afterwards the sequence is as if the
 *  dropped tokens had never been appended: lengths, stats (whole KV pages past the end are freed), index and
 *  selections equal those of a sequence given the same appends up to `length`. One exception: where `length` falls
 *  inside the tokens a PQ index was trained on (its prefill), that index is rebuilt from the remaining tokens, as a
 *  prefill of exactly those tokens would build it. Cached blocks (CUDA backend) holding a position >= length are
 *  dropped. Waits for the sequence's background builds. Strong guarantee: on failure (KVRET_ERR_OUT_OF_MEMORY while
 *  rebuilding) nothing changes. KVCrush's inputs (docs/kvcrush.md): the accumulated attention keeps the remaining
 *  tokens' sums (a layer cut to 0 tokens forgets its steps too); a query window given to kvret_seq_observe is
 *  dropped when `length` is below the layer's length at that call. length < 0: KVRET_ERR_INVALID_ARGUMENT; a length
 *  at or above every layer's is a no-op. */
KVRET_API kvret_status kvret_seq_truncate(kvret_seq* seq, int64_t length);
/** Opens a new sequence of the same context that holds what `seq` holds (every layer's tokens and index): for
 *  beam search, parallel sampling, or several continuations of one prompt. The two share their KV pages copy on
 *  write (a page is copied when either appends into it), so a fork costs the index copy, not the KV. From then on
 *  they are independent: appends, truncations, selections and closing one never change the other, and each may
 *  be used from its own thread. Its stats start with the state (tokens_stored, host_bytes, index_bytes) and no
 *  activity, and an empty block cache (CUDA backend); a page the two share counts in the host_bytes of each, so
 *  host_bytes_limit is never exceeded when one of them later copies it. KVCrush's state and inputs (signatures, an
 *  observed query window, accumulated attention) are copied. Waits for `seq`'s background builds. Strong guarantee:
 *  on failure (CAPACITY, OUT_OF_MEMORY) *out is NULL and nothing was created. */
KVRET_API kvret_status kvret_seq_fork(kvret_seq* seq, kvret_seq** out);

/* ---------------------------------------------------------------------------------------------------------------
 * Appending keys and values
 *
 * k and v are [T, n_kv_heads, head_dim] (any strides whose innermost is 1, so [n_kv_heads, T, head_dim] memory
 * passes as a strided view), dtype f16, bf16 or f32 (converted to kv_dtype), in memory the backend reads (see
 * kvret_device_type). Keys are
 * the ones attention uses: after the rotary embedding (RoPE). Queries given to select are likewise rotated and
 * unscaled: select multiplies every logit by 1/sqrt(head_dim) before folding the GQA group.
 * ------------------------------------------------------------------------------------------------------------- */

/** Appends T prefill tokens to `layer` and schedules that layer's index build (in the background when
 *  background_build is on: the call returns before the build ends; its failure, if any, is reported by the next
 *  call that waits for it; with background_build off a failed build fails the call and the tokens are not
 *  appended, so it may be retried). A layer holds at most 2^31 - 1 tokens (positions are int32; beyond,
 *  KVRET_ERR_CAPACITY). May be called again (chunked prefill): the first build trains the index; a later
 *  one retrains it when the middle has at least doubled since the last training, else encodes the new tokens
 *  with the current codebook. A call on a layer whose build is still running waits for that build first. */
KVRET_API kvret_status kvret_append_prefill(kvret_seq* seq, int32_t layer, const kvret_tensor* k,
                                            const kvret_tensor* v);
/** Appends one decode token ([n_kv_heads, head_dim] or [1, n_kv_heads, head_dim]) to `layer`. The token that
 *  leaves the local window enters the middle and gets its index entry (e.g. its nearest PQ code). */
KVRET_API kvret_status kvret_append_decode(kvret_seq* seq, int32_t layer, const kvret_tensor* k, const kvret_tensor* v);
/** Waits until the index of `layer` (or of every layer when layer == -1) is built. */
KVRET_API kvret_status kvret_wait_index(kvret_seq* seq, int32_t layer);

/* ---------------------------------------------------------------------------------------------------------------
 * Selection, fetch, attention
 * ------------------------------------------------------------------------------------------------------------- */

/** Pass as `budget` to use the sequence's default budget (kvret_seq_budget). */
#define KVRET_BUDGET_DEFAULT (-1)

/** Scores the middle tokens of `layer` for query q ([n_q_heads, head_dim], f16/bf16/f32), folds each KV group,
 *  and writes the top `budget` middle positions of every KV head, ascending, into out_positions (int32,
 *  [n_kv_heads, >= count]; elements past count are left as they were). *out_count receives the number written per head:
 * min(budget, middle tokens), and 0 for KVRET_INDEX_STREAMING. A budget of 0, or above the layer's length, is
 * KVRET_ERR_BUDGET. Waits for this layer's index only. Ties between equal scores go to the earlier position. */
KVRET_API kvret_status kvret_select(kvret_seq* seq, int32_t layer, const kvret_tensor* q, int32_t budget,
                                    const kvret_tensor* out_positions, int32_t* out_count);

/** kvret_select that also writes the score of each selected position into out_scores (f32, [n_kv_heads,
 *  >= count]), aligned with out_positions: the folded score the index ranked it by, higher first (for
 *  KVRET_FOLD_SUM_PROB the group's summed softmax probability, estimated by the index: a PQ cell's or a page's
 *  tokens share their cell's or page's score; for KVRET_FOLD_MAX_LOGIT the largest scaled logit). Scores compare
 *  within one call; a caller may weight, merge or threshold a selection with them. The quant index with
 *  config.quant_rerank > 1 scores with the exact keys of its candidates (KVRET_FOLD_SUM_PROB: a softmax over the
 *  candidates, so a token's score depends on the budget). With config.hamming_fraction
 *  > 0, the KVCrush representatives score -infinity (they were not ranked by the query). */
KVRET_API kvret_status kvret_select_scored(kvret_seq* seq, int32_t layer, const kvret_tensor* q, int32_t budget,
                                           const kvret_tensor* out_positions, const kvret_tensor* out_scores,
                                           int32_t* out_count);

/** kvret_select for n sequences at once (q is [n, n_q_heads, head_dim]; out_positions [n, n_kv_heads, >= budget];
 *  out_counts has n entries). The sequences must belong to ctx and be distinct. All are validated before any is
 *  touched. Threads: the call uses every sequence of the batch, so none of them may be in another call at the
 *  same time; other sequences may be used from other threads meanwhile. kvret_fetch_batch_async fetches the
 *  working sets of such a selection in one call. On the CUDA backend, with q and out_positions in device memory,
 *  the selects of the batch (with KVCrush's representatives too) run as one set of passes for the sequences of the
 *  same count whose middles are within a factor of two (never run on a GPU). */
KVRET_API kvret_status kvret_select_batch(kvret_context* ctx, int32_t n, kvret_seq* const* seqs, int32_t layer,
                                          const kvret_tensor* q, int32_t budget, const kvret_tensor* out_positions,
                                          int32_t* out_counts);

/** Output buffers of a working set: sink + selected + local tokens of every KV head, in position order. */
typedef struct kvret_working_set {
  kvret_tensor k;         /**< [n_kv_heads, capacity, head_dim], dtype = kv_dtype (or f32) */
  kvret_tensor v;         /**< same shape and dtype as k */
  kvret_tensor positions; /**< int32 [n_kv_heads, capacity]: the token position of each row */
} kvret_working_set;

/** Rows of the working set of `layer` for `budget` selected tokens per head: sink + min(budget, middle) + local.
 *  KVRET_BUDGET_DEFAULT and 0 (a count select may return) are accepted. */
KVRET_API kvret_status kvret_working_set_capacity(const kvret_seq* seq, int32_t layer, int32_t budget,
                                                  int64_t* out_rows);

/** Writes the working set of `layer` for the selection (positions: int32 [n_kv_heads, >= count], as written by
 *  kvret_select) into *out and its row count into *out_rows. Each head's positions must be distinct middle positions
 *  at the time of this call (else KVRET_ERR_OUT_OF_RANGE / KVRET_ERR_INVALID_ARGUMENT). A selection made at an
 *  earlier length stays valid, since the middle only grows, and fetches exactly the tokens it names: it does not
 *  see the tokens that entered the middle since (select again at each decode step for those). On the CUDA backend
 *  the positions are checked on the host (read from device memory after the work on the legacy default stream)
 *  and the gather is ordered on `stream`: *out is valid after that stream's work (kvret_synchronize). There the
 *  sink and local rows and the rows of blocks in the layer's block cache (config.cache_capacity_tokens) are read
 *  from device memory, the others from host memory, and after the gather, on the same stream, the cache admits the
 *  complete blocks holding the most selected rows (the rows are the same either way; with row sources, e.g.
 *  ClusterKV's reuse, the cache is not used). The rows the cache served and the bytes it loaded are counted on the
 *  device and added to the stats when they are read (kvret_seq_stats then waits for the device), so the call
 *  waits for the device only to copy positions in device memory to the host to check them (none for positions in
 *  pinned host memory; kvret_seq_attend is the path that keeps them on the device). On the CPU backend the copy is
 *  complete, and *out valid, when the call returns. */
KVRET_API kvret_status kvret_fetch_async(kvret_seq* seq, int32_t layer, const kvret_tensor* positions, int32_t count,
                                         const kvret_working_set* out, int64_t* out_rows, kvret_stream stream);

/** kvret_fetch_async for n sequences at once, taking what kvret_select_batch wrote: for every i, the working set
 *  of seqs[i] for its selection positions[i] (count counts[i]) into outs[i] and its row count into out_row_counts[i],
 *  the same bytes, row counts and stats as kvret_fetch_async(seqs[i], layer, positions[i], counts[i], &outs[i],
 *  &out_row_counts[i], stream).
 *  - positions: int32 [n, n_kv_heads, >= max(counts)] (kvret_select_batch's out_positions); it is not read, and
 *    may be NULL, when every count is 0. counts, outs, out_row_counts: n entries each; outs[i] as kvret_fetch_async's
 *    out, sized for seqs[i] (kvret_working_set_capacity). n = 0 does nothing.
 *  - The sequences must belong to ctx and be distinct. Every argument of every sequence is checked before any
 *    working set is written: on an error nothing is written, no sequence changes, and the message names the
 *    entry and the argument ("seqs[2] ...", "counts[1] ...", "positions[3]: ...", "outs[0].k: ..."). Errors:
 *    KVRET_ERR_INVALID_HANDLE for a NULL, closed or foreign ctx or seqs[i], or one of another context;
 *    KVRET_ERR_INVALID_ARGUMENT for n < 0, NULL seqs, counts, outs or out_row_counts, NULL positions while a
 *    count is above 0, a sequence twice in the batch, a negative count or a repeated position;
 *    KVRET_ERR_OUT_OF_RANGE for the layer or a position that is not a middle position of seqs[i];
 *    KVRET_ERR_BUDGET for a count above seqs[i]'s middle tokens; KVRET_ERR_SHAPE / KVRET_ERR_DTYPE /
 *    KVRET_ERR_STRIDE / KVRET_ERR_DEVICE for positions (its leading dimension must be n) or outs[i]'s tensors, as
 *    kvret_fetch_async. A failure while gathering (a row source's error,
 *    KVRET_ERR_OUT_OF_MEMORY, KVRET_ERR_CUDA) may leave some working sets written; the sequences' stats stay as
 *    they were (a cluster index's resident copies are dropped, as a failed kvret_fetch_async drops its own).
 *  - Devices and streams as kvret_fetch_async: on the CUDA backend positions is copied to the host once for the
 *    batch and the batch is gathered in one pass ordered on `stream` (one launch for the sequences without row
 *    sources; never run on a GPU); on the CPU backend every working set is written when the call returns.
 *  - Threads: as for kvret_select_batch, the call uses every sequence of the batch: none of them may be in
 *    another call at the same time; other sequences of the context may be used from other threads meanwhile. */
KVRET_API kvret_status kvret_fetch_batch_async(kvret_context* ctx, int32_t n, kvret_seq* const* seqs, int32_t layer,
                                               const kvret_tensor* positions, const int32_t* counts,
                                               const kvret_working_set* outs, int64_t* out_row_counts,
                                               kvret_stream stream);

/** Decode attention: out[h] = softmax(scale * q[h] . k[g(h)]^T) v[g(h)] over the first `rows` rows, where
 *  g(h) = h / (n_q_heads / n_kv_heads). q: [n_q_heads, head_dim]; k, v: [n_kv_heads, >= rows, head_dim] (each
 *  f32, f16 or bf16); out: [n_q_heads, head_dim], f32, f16 or bf16 (an f16 or bf16 out is the f32 result rounded
 *  to nearest even, on either backend). scale <= 0 means 1/sqrt(head_dim).
 *  On the CPU backend each key and value row is read once for all the query heads of its group, the work is spread
 *  over config.n_threads threads even for one KV head, and the result's bits depend neither on n_threads nor on
 *  the SIMD path (KVRET_MAX_CPU_ISA).
 *  - Non-finite inputs: a row whose score is -inf gets weight 0. A head with a NaN or +inf score (a NaN in q[h] or
 *    in a key row; an infinite key element meeting a q element of the same sign), or whose every score is -inf, is
 *    NaN in every element. A NaN or infinite element of v makes that element of every head of its group NaN or
 *    infinite, whatever the row's weight. */
KVRET_API kvret_status kvret_attend(kvret_context* ctx, const kvret_tensor* q, const kvret_tensor* k,
                                    const kvret_tensor* v, int64_t rows, float scale, const kvret_tensor* out,
                                    kvret_stream stream);
/** Attention of q over the sequence's working set for `layer`, in one call: select (budget as in kvret_select),
 *  fetch (as kvret_fetch_async, into buffers of kvret's own) and attention (as kvret_attend, scale <= 0 meaning
 *  1/sqrt(head_dim)), for engines without a sparse attention of their own. The output is what those three calls
 *  give with the same budget and scale, bit for bit; the stats count one selection and one fetch. A later backend
 *  may answer it from state the separate calls cannot use (cached blocks, a low-bit copy). q: [n_q_heads,
 *  head_dim]; out: [n_q_heads, head_dim], f32, f16 or bf16 (as kvret_attend: the f32 result rounded to nearest
 *  even); both checked before anything runs. Under config.hamming_importance =
 *  KVRET_IMPORTANCE_ACCUMULATED it also adds the step's attention probabilities to the layer's accumulated attention
 *  (as kvret_seq_observe_attention): each query head's softmax over the working set (sink, selected and local
 *  tokens; with config.quant_attention, over those exact rows only), every other token 0 that step; computed on the
 *  host, n_q_heads x (working set) x head_dim multiply-adds and n_q_heads x tokens additions per call. On the CUDA
 *  backend, where q is labelled KVRET_DEVICE_CUDA and the layer's select runs on the device (and without
 *  quant_attention, accumulated importance, row sources, ClusterKV's reuse or a pending prefetch of the layer), the
 *  selected positions stay on the device from select to attention: the gather, the block cache's update and the
 *  attention make no host wait (a select with config.check_finite waits once), and the cache's hits, misses and
 *  bytes are counted on the device and added to the stats when they are read. Never run on a GPU. */
KVRET_API kvret_status kvret_seq_attend(kvret_seq* seq, int32_t layer, const kvret_tensor* q, int32_t budget,
                                        float scale, const kvret_tensor* out, kvret_stream stream);

/* ---------------------------------------------------------------------------------------------------------------
 * Sessions across conversation turns (AttentionStore, docs/sessions.md)
 *
 * A context keeps a session store: a host DRAM tier (config.session_dram_bytes), a disk tier (the directory
 * config.disk_path, config.session_disk_bytes) and optionally a shared tier on Redis (config.session_shared_url).
 * A session is the whole of a sequence at the end of a turn (every layer's keys, values and index), stored all or
 * nothing under an id: a non-empty string of at most 255 bytes (any bytes but NUL). The next turn opens a new
 * sequence from it and appends only the new tokens; the index is restored, not rebuilt. Every call here has the
 * strong guarantee: on failure the store and the sequences are as they were (except that a session found corrupt
 * is dropped). A new context on the same config.disk_path sees the sessions a previous one left on disk; one
 * directory serves one context at a time. With a shared tier, every context (on any machine) pointed at the same
 * Redis server and key prefix sees the sessions the others saved (docs/redis.md).
 * ------------------------------------------------------------------------------------------------------------- */

/** Where a saved session is (kvret_session_where). */
typedef enum kvret_session_tier {
  KVRET_TIER_NONE = 0,  /**< not stored: opening it is KVRET_ERR_NOT_FOUND */
  KVRET_TIER_DRAM = 1,  /**< host memory */
  KVRET_TIER_DISK = 2,  /**< the disk tier */
  KVRET_TIER_SHARED = 3 /**< only in the shared tier */
} kvret_session_tier;

/** Saves what `seq` holds now under `session_id`, replacing an older save of that id once the new one is whole.
 *  The sequence stays open and unchanged (saving shares its KV pages copy on write, as kvret_seq_fork does), so the
 *  engine may go on appending to it or close it. Waits for the sequence's background builds. The session goes
 *  into DRAM, evicting to disk (and from disk, dropping) the sessions config.session_policy ranks first; one that
 *  fits no tier is not stored (KVRET_ERR_CAPACITY, nothing changed). The files of the sessions it evicts to disk
 *  are written by the store's background writer: they stay in DRAM, and open from there, until their files are
 *  complete; a failed write is reported by kvret_session_flush and leaves the session in DRAM, and the next
 *  kvret_session_save or kvret_session_schedule queues it again (3 writes in all; then it stays in DRAM until it
 *  is dropped, saved again, moved back or expires). The writer's copies hold at most config.session_dram_bytes
 *  (when set) as a save starts: a save finding more waits. When the session itself goes to disk because the policy
 *  ranks it first, the writer writes it too, from a fork of the sequence (the call returns before; the fork serves
 *  it meanwhile; until its files are complete the disk holds the previous save of the id, if any). One larger than
 *  the DRAM tier (config.session_dram_bytes) is written before the call returns: a full disk or another write
 *  error is then KVRET_ERR_IO and nothing changed. With a shared tier (config.session_shared_url) the session is then
 * queued for the background writer too, which writes it through (from a fork of the sequence; the call returns before;
 *  kvret_session_flush waits for it). A failure there (the server unreachable: KVRET_ERR_IO) does not fail the
 *  save, which the local tiers hold: the next kvret_session_flush reports it, and the shared tier keeps the
 *  previous save of the id (or none). A sequence of a session still loading from disk waits for its layers (and
 *  fails with what stopped them). A sequence with KVCrush's state (config.hamming_fraction > 0, or a query window
 *  given to kvret_seq_observe, or attention accumulated under KVRET_IMPORTANCE_ACCUMULATED) cannot be saved:
 *  KVRET_ERR_UNSUPPORTED. */
KVRET_API kvret_status kvret_session_save(kvret_seq* seq, const char* session_id);
/** Opens a new sequence holding what was saved under `session_id`: the same tokens, index and selections. From DRAM
 *  it shares the saved pages copy on write. From disk the call returns once the manifest is checked and layer 0 is
 *  read and its index restored (not rebuilt); a thread of the store then loads layers 1, 2, ... in order, and
 *  every call on layer l of the new sequence (append, select, fetch, attend, read, length, kvret_wait_index(seq,
 *  l)) first waits for layer l, as calls wait for a background index build; calls on every layer (kvret_seq_fork,
 *  kvret_seq_truncate, kvret_seq_drop_front, kvret_session_save, kvret_wait_index(seq, -1)) wait for them all.
 *  kvret_seq_close (or kvret_destroy) during the load stops the loader before its next layer. A layer that fails
 *  while loading answers, on every call on it and on the later layers (and on the calls on every layer), the
 *  failure: KVRET_ERR_CORRUPT (its file failed its checks: the session is dropped from the store first, so the next
 *  open is KVRET_ERR_NOT_FOUND), KVRET_ERR_IO, or KVRET_ERR_CAPACITY (config.host_bytes_limit); the layers before
 *  it work. The session stays stored.
 *  No such session: KVRET_ERR_NOT_FOUND and *out is NULL. A stored session whose manifest or layer 0 fail their
 *  checks (CRC-32, sizes, framing) is KVRET_ERR_CORRUPT, and is dropped: the next open is KVRET_ERR_NOT_FOUND.
 *  With a shared tier, a session in no local tier is read from it (every layer, before the call returns; one
 *  saved by a context of another configuration is KVRET_ERR_NOT_FOUND; the server unreachable, KVRET_ERR_IO), and
 *  a local copy whose save the shared tier no longer names (another context saved the id since) is replaced by the
 *  shared tier's. */
KVRET_API kvret_status kvret_session_open(kvret_context* ctx, const char* session_id, kvret_seq** out);
/** Removes a session from every tier, the shared tier included. KVRET_ERR_NOT_FOUND when there was none. A
 *  shared tier that cannot be reached fails the call (KVRET_ERR_IO) only when no local tier held the session; else
 *  the local copy is dropped and kvret_session_flush reports the failure. */
KVRET_API kvret_status kvret_session_drop(kvret_context* ctx, const char* session_id);
/** The scheduler's job queue: the ids of the sessions it will run next, in order (n >= 0; ids may repeat; an id need
 *  not be stored yet). With config.session_policy = KVRET_SESSION_SCHEDULER_AWARE, eviction keeps the sessions
 *  needed soonest, and the sessions of the look-ahead window that are on disk are read into DRAM before the call
 *  returns (evicting to disk only sessions needed later). Replaces the previous queue. */
KVRET_API kvret_status kvret_session_schedule(kvret_context* ctx, const char* const* session_ids, int32_t n);
/** The tier that serves a session now (a kvret_session_tier), KVRET_TIER_NONE when none:
 *  - KVRET_TIER_DRAM: a copy in host memory serves it. That is a session in the DRAM tier, and also one placed on
 *    disk whose files are not complete: its write queued or running on the background writer, or failed (and
 *    waiting for a retry, or out of tries); its DRAM copy serves the opens until its manifest is written.
 *  - KVRET_TIER_DISK: its files are complete and its DRAM copy released; an open reads them.
 *  - KVRET_TIER_SHARED: in no local tier; the shared tier names it (looked up there; KVRET_ERR_IO when the server
 *    cannot be reached).
 *  A session evicted to disk thus goes from DRAM to DISK when the writer is done (kvret_session_flush waits for
 *  that); the stats' session_dram_count and session_disk_count count placement's tiers, where it is on disk from
 *  the save on. */
KVRET_API kvret_status kvret_session_where(kvret_context* ctx, const char* session_id, int32_t* out_tier);
/** Waits until the store's background writer has written everything queued before the call (the files of sessions
 *  evicted to disk, the write-through to the shared tier), then reports the first failure since the last flush of
 *  what no call reports itself: those writes, and the store's cleanups (removing the files of a dropped, replaced
 *  or expired session); KVRET_OK when there was none. */
KVRET_API kvret_status kvret_session_flush(kvret_context* ctx);

/** Context-window truncation (docs/rope.md): drops `count` tokens of every layer, starting after its first `keep`
 *  tokens (keep 0: the earliest tokens; keep = config.n_sink keeps the attention sinks, as StreamingLLM does). The
 *  tokens after them move `count` positions earlier; with config.rope_keys = 1 their keys are rotated at the new
 *  positions from then on (from the pre-RoPE keys kept, so exactly as a sequence given only the remaining tokens
 *  rotates them); with rope_keys = 0 keys are kept as given, rotated at their old positions. Each shortened layer's
 *  index is rebuilt, on the calling thread, for the keys it now has: the sequence then selects as one given the
 *  remaining tokens in one prefill. KVCrush's signatures are recomputed at the next select, a query window given to
 *  kvret_seq_observe is dropped and the accumulated attention loses the dropped tokens' sums (the others move with
 *  their tokens); a kvret_prefetch_async
 *  selection and ClusterKV's resident clusters of a shortened layer are dropped. A layer holding at most `keep`
 *  tokens is unchanged; one holding fewer than keep + count keeps its first `keep`. Waits for the sequence's
 *  background builds. While it runs it holds a second copy of the pages it rewrites (not counted against
 *  config.host_bytes_limit; the pages freed are). Cached blocks (CUDA backend) holding a position >= keep are
 *  dropped. Strong guarantee. keep < 0 or count < 0:
 *  KVRET_ERR_INVALID_ARGUMENT; count 0 is a no-op. */
KVRET_API kvret_status kvret_seq_drop_front(kvret_seq* seq, int64_t keep, int64_t count);

/* ---------------------------------------------------------------------------------------------------------------
 * Eviction-only mode (KVCrush, docs/kvcrush.md): for engines that drop KV instead of offloading it
 * ------------------------------------------------------------------------------------------------------------- */

/** The static retained set of `layer`: the middle positions an engine that evicts KV after the prefill keeps per
 *  KV head, chosen without any decode query. Call it after the layer's prefill; the engine then keeps, per KV head,
 *  the sink tokens (the first n_sink), these positions and the local window (the last n_local tokens), and may
 *  drop every other token's KV.
 *  - budget: middle tokens kept per KV head, sink and local not counted (as in kvret_select): 1 up to the layer's
 *    length, or KVRET_BUDGET_DEFAULT for the sequence's default budget (kvret_seq_budget); *out_count receives
 *    min(budget, middle tokens), 0 when the layer has no middle. 0, a negative budget other than the default, or
 *    a budget above the layer's length is KVRET_ERR_BUDGET.
 *  - The set is SnapKV's base plus KVCrush's representatives. Importance: under KVRET_IMPORTANCE_ACCUMULATED, once the
 *    layer has observed a decode step, the accumulated attention (H2O; kvret_seq_observe_attention), a KV head's
 *    importance the sum over its query heads; else, when the prompt's queries were given (kvret_seq_observe), their
 *    window, with the same sum; else an observation window of the layer's last 32 keys at this call (all of them when
 *    it holds fewer; the keys stand in for the prompt's last queries), each key taken as a query of its own KV head; a
 *    token's importance for a head is the sum over the window rows of the softmax over all the layer's tokens of (k_j .
 *    k_t / sqrt(head_dim)). Of count, floor(config.hamming_fraction * count) (at most config.hamming_buckets when that
 *    is positive) are representatives, the rest the head's highest-importance middle tokens (ties to the earlier
 *    position). The representatives are drawn from the other middle tokens by KVCrush's grouping (one bit per KV head,
 *    or per query head with queries or accumulated attention: the token is in that head's top half by importance;
 *    ordered by Hamming distance to the alternating anchor, cut into buckets of near-equal size, from each the token of
 *    largest importance for the head). hamming_fraction = 0 gives SnapKV's top count tokens exactly. Works with every
 *    index kind (KVRET_INDEX_STREAMING included, whose context builds no index: the natural configuration of an
 *    evicting engine); the index is not used.
 *  - out_positions: int32 [n_kv_heads, >= count]; row h receives head h's count distinct middle positions,
 *    ascending (elements past count are left as they were).
 *  - Reads the layer's keys only: the sequence, its stats and the selections of later calls are unchanged (the
 *    window of kvret_select's own KVCrush step is separate). Costs 32 x tokens x head_dim multiply-adds and 32 x
 *    tokens exponentials per KV head, on the host, at every call (about 0.23 s at 32k tokens, 8 KV heads,
 *    head_dim 128 on 2 cores: bench/kvcrush_cost.cpp).
 *  - Errors (nothing is written): a NULL or closed seq, KVRET_ERR_INVALID_HANDLE; NULL out_count or out_positions,
 *    KVRET_ERR_INVALID_ARGUMENT; layer outside [0, n_layers), KVRET_ERR_OUT_OF_RANGE; a layer holding no tokens
 *    (no observation window: prefill it first), KVRET_ERR_STATE; out_positions not int32, too small or not of
 *    rank 2, or in memory the backend cannot use, KVRET_ERR_DTYPE / KVRET_ERR_SHAPE / KVRET_ERR_DEVICE.
 *  - Threads: as every call on a sequence (it must not overlap another call on the same sequence). */
KVRET_API kvret_status kvret_seq_retained_set(kvret_seq* seq, int32_t layer, int32_t budget,
                                              const kvret_tensor* out_positions, int32_t* out_count);

/** The prompt's observation window for KVCrush (SnapKV's w last queries), an optional input given after the layer's
 *  prefill: `q_window` holds the queries of the layer's last w prompt tokens, as the model's attention used them
 *  (after RoPE, as kvret_select takes them). From then on the importance behind the layer's KVCrush signatures and
 *  representatives (config.hamming_fraction > 0) and behind kvret_seq_retained_set comes from these queries
 *  instead of the layer's last 32 keys: for query head i, token t's importance is the sum over the w rows of
 *  softmax over all the layer's tokens of (q_j[i] . k_t[g(i)] / sqrt(head_dim)), g(i) = i / (n_q_heads /
 *  n_kv_heads) its KV head as in attention. Signatures have one bit per query head (bit i: the token is in query
 *  head i's top half); a KV head's importance (its top tokens, its representatives) is the sum over its query heads.
 *  With n_q_heads == n_kv_heads and the layer's last 32 keys as q_window, everything equals the keys' rule.
 *  - q_window: f16, bf16 or f32 [w, n_q_heads, head_dim], 1 <= w <= the layer's length (rows in any order: the
 *    importance is a sum over them). kvret keeps an f32 copy (w x n_q_heads x head_dim x 4 bytes, host memory).
 *  - When: the layer's select signatures are computed at its next select that spends budget on representatives,
 *    over the tokens it then holds; tokens appended later are scored against the same rows and normalizers. A
 *    second call replaces the window (and recomputes the signatures at the next such select). Under
 *    KVRET_IMPORTANCE_ACCUMULATED the window serves until the layer has observed a decode step.
 *  - The window is dropped (the keys' rule again) by kvret_seq_truncate to fewer tokens than the layer held at
 *    this call and by kvret_seq_drop_front of the layer; kvret_seq_fork copies it. A sequence holding one cannot be
 *    saved as a session (KVRET_ERR_UNSUPPORTED), as with every KVCrush state.
 *  - Errors (nothing changes): a NULL or closed seq, KVRET_ERR_INVALID_HANDLE; layer outside [0, n_layers),
 *    KVRET_ERR_OUT_OF_RANGE; a layer holding no tokens, KVRET_ERR_STATE; q_window NULL, of another dtype, rank,
 *    shape (n_q_heads, head_dim, w outside 1..length) or memory, KVRET_ERR_INVALID_ARGUMENT / KVRET_ERR_DTYPE /
 *    KVRET_ERR_SHAPE / KVRET_ERR_DEVICE; NaN or Inf in it with config.check_finite, KVRET_ERR_NONFINITE.
 *  - Threads: as every call on a sequence (it must not overlap another call on the same sequence). */
KVRET_API kvret_status kvret_seq_observe(kvret_seq* seq, int32_t layer, const kvret_tensor* q_window);

/** One decode step's attention probabilities of `layer`, for engines that attend themselves, added to the layer's
 *  accumulated attention (H2O) under config.hamming_importance = KVRET_IMPORTANCE_ACCUMULATED. probs: f16, bf16 or
 *  f32 [n_q_heads, n], 1 <= n <= the layer's length: probs[i][t] is the probability query head i gave token
 *  position t this step; tokens at n and after get 0 (so a step taken before the last appends may be handed in).
 *  Values must be finite and >= 0; they need not sum to 1 (a step over part of the tokens is summed as given).
 *  kvret_seq_attend adds its own steps the same way, its probabilities over its working set (sink, selected and
 *  local tokens; every other token gets 0 that step).
 *  - Effect: per query head and token a float sum (n_q_heads x tokens x 4 bytes per layer, host memory); once a
 *    layer has one step, its KVCrush signatures (one bit per query head: the token is in that head's top half by
 *    its sum), representatives (a KV head's importance: the sum over its query heads) and
 *    kvret_seq_retained_set's important part come from the sums, recomputed at every select after a new step.
 *    Tokens appended after the last step have sum 0 until a step attends them.
 *  - kvret_seq_truncate cuts the sums to the remaining tokens; kvret_seq_drop_front removes the dropped tokens'
 *    sums (the others keep theirs at their new positions); kvret_seq_fork copies them. A sequence holding them
 *    cannot be saved as a session (KVRET_ERR_UNSUPPORTED).
 *  - Errors (nothing changes): a NULL or closed seq, KVRET_ERR_INVALID_HANDLE; config.hamming_importance not
 *    KVRET_IMPORTANCE_ACCUMULATED, KVRET_ERR_STATE; layer outside [0, n_layers), KVRET_ERR_OUT_OF_RANGE; a layer
 *    holding no tokens, KVRET_ERR_STATE; probs NULL, of another dtype, rank, shape (n_q_heads, n outside
 *    1..length) or memory, KVRET_ERR_INVALID_ARGUMENT / KVRET_ERR_DTYPE / KVRET_ERR_SHAPE / KVRET_ERR_DEVICE; a
 *    negative, NaN or infinite value, KVRET_ERR_INVALID_ARGUMENT naming its head and position.
 *  - Threads: as every call on a sequence. */
KVRET_API kvret_status kvret_seq_observe_attention(kvret_seq* seq, int32_t layer, const kvret_tensor* probs);

/** Waits for the work the library enqueued on `stream` (no-op on the CPU backend). Errors of earlier
 *  asynchronous work surface here. */
KVRET_API kvret_status kvret_synchronize(kvret_context* ctx, kvret_stream stream);

/* ---------------------------------------------------------------------------------------------------------------
 * Statistics
 * ------------------------------------------------------------------------------------------------------------- */
typedef struct kvret_stats {
  size_t struct_size;    /**< sizeof(kvret_stats), set by kvret_stats_init */
  int64_t sequences;     /**< open sequences (context stats) or 1 */
  int64_t tokens_stored; /**< tokens over all layers */
  int64_t host_bytes;    /**< KV bytes in host memory */
  int64_t device_bytes;  /**< bytes in GPU memory now (kvret_seq_attend's working set, the block caches and
                              their windows) */
  int64_t disk_bytes;    /**< bytes of the session store's files in the disk tier (context stats) */
  int64_t index_bytes;   /**< bytes of the index (wherever it lives) */
  int64_t index_builds;  /**< completed layer builds */
  double index_build_ms; /**< summed wall time of those builds */
  int64_t selections;    /**< select calls (per sequence and layer) */
  int64_t fetches;       /**< fetch calls */
  int64_t fetched_rows;  /**< working-set rows written */
  int64_t cache_hits;    /**< working-set rows served before the host store (the GPU block cache and its sink
                              and local windows, row sources) */
  int64_t cache_misses;  /**< rows read from host memory (cache_hits + cache_misses = fetched_rows) */
  int64_t prefetch_hits; /**< fetched middle rows that the layer's last kvret_prefetch_async had selected */
  int64_t bytes_h2d;     /**< bytes moved host to device: rows fetched from host memory, keys and values,
                              blocks and window rows copied into the block cache, QUANT's low-bit copy sent to the device and its
                              re-ranking's candidate keys, and the keys EXACT's device select reads in place (CUDA
                              backend; 0 on the CPU backend). The device copies of PAGE, CLUSTER and PQ indexes
                              are not counted (docs/cuda_backend.md) */
  int64_t disk_reads;    /**< files the session store read from the disk tier (context stats) */
  int64_t disk_writes;   /**< files the session store wrote to the disk tier (context stats) */
  /* ClusterKV's reuse between steps (appended; config.cluster_reuse_steps, docs/cluster.md) */
  int64_t cluster_reuse_rows;  /**< selected (middle) rows that fetches of KVRET_INDEX_CLUSTER layers wrote, summed
                                    over KV heads (counted with reuse off too): the hit rate's denominator */
  int64_t cluster_reuse_hits;  /**< those of them served from the resident copy of the clusters the layer fetched
                                    in its last cluster_reuse_steps fetches (they count in cache_hits too) */
  int64_t cluster_reuse_bytes; /**< bytes the resident copies hold now (keys, values and their position maps) */
  /* The session store (appended; context stats only, 0 in a sequence's; docs/sessions.md). A session's bytes are
     its keys and values plus its index's, in every tier. */
  int64_t session_saves;      /**< kvret_session_save calls that stored a session */
  int64_t session_hits_dram;  /**< kvret_session_open served from host DRAM */
  int64_t session_hits_disk;  /**< kvret_session_open served from the disk tier */
  int64_t session_misses;     /**< kvret_session_open answered KVRET_ERR_NOT_FOUND */
  int64_t session_evictions;  /**< sessions moved from DRAM to disk, or dropped, to make room */
  int64_t session_expired;    /**< sessions dropped by config.session_ttl_ms */
  int64_t session_corrupt;    /**< sessions dropped because a file failed its checks (KVRET_ERR_CORRUPT) */
  int64_t session_dram_bytes; /**< bytes of the sessions held in DRAM now */
  int64_t session_dram_count; /**< sessions held in DRAM now */
  int64_t session_disk_count; /**< sessions held on disk now */
  /* The session store's shared tier and background writes (appended; context stats only; docs/sessions.md) */
  int64_t session_hits_shared;    /**< kvret_session_open served from the shared tier (config.session_shared_url) */
  int64_t session_shared_writes;  /**< saves written through to the shared tier */
  int64_t session_write_failures; /**< writes below DRAM that failed: evictions to disk (the session stays in DRAM)
                                       and write-throughs to the shared tier; kvret_session_flush reports the
                                       first */
} kvret_stats;

/** Sets struct_size and zeroes the rest. */
KVRET_API kvret_status kvret_stats_init(kvret_stats* stats);
/** Statistics of one sequence. On the CUDA backend with a block cache this waits for the device's work of the
 *  sequence's fetches, whose cache counts (cache_hits, cache_misses, bytes_h2d) are kept on the device. */
KVRET_API kvret_status kvret_seq_stats(const kvret_seq* seq, kvret_stats* out);
/** Statistics of the context: the sum over open sequences plus what closed sequences contributed. */
KVRET_API kvret_status kvret_context_stats(const kvret_context* ctx, kvret_stats* out);

/* ---------------------------------------------------------------------------------------------------------------
 * Experimental: may change between minor versions. Define KVRET_EXPERIMENTAL to see these declarations.
 * ------------------------------------------------------------------------------------------------------------- */
#ifdef KVRET_EXPERIMENTAL
/** Selects with a guessed next query (SpeCache's speculative token, or simply the current query; budget as in
 *  kvret_select) and keeps that selection as the layer's prefetched rows: the layer's next fetch counts the rows it
 *  takes from them in stats.prefetch_hits, so prefetch_hits / (rows fetched from the middle) is the speculative hit
 *  rate. Nothing of the guess is stored. Counts as a selection in the stats. On the CUDA backend the complete
 *  blocks the selection touches are also loaded into the layer's block cache (config.cache_capacity_tokens; up to
 *  every slot, by the same admission rule as after a fetch), ordered on `stream`, so that the next fetch of those
 *  rows reads them from device memory (stats.cache_hits; the bytes copied count in bytes_h2d); the CPU backend
 *  loads nothing. A refused call keeps the last prefetch. */
KVRET_API kvret_status kvret_prefetch_async(kvret_seq* seq, int32_t layer, const kvret_tensor* q_guess, int32_t budget,
                                            kvret_stream stream);
/** Copies the stored keys and values of positions [begin, end) of `layer` into k and v
 *  ([end-begin, n_kv_heads, head_dim], kv_dtype or f32). With config.rope_keys = 1 the keys are the ones kvret
 *  selects and fetches with: rotated at their current positions (not the pre-RoPE keys appended). Meant for tests
 *  and tooling. */
KVRET_API kvret_status kvret_seq_read(const kvret_seq* seq, int32_t layer, int64_t begin, int64_t end,
                                      const kvret_tensor* k, const kvret_tensor* v);
#endif

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVRET_H */
