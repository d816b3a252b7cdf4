//! Raw FFI declarations of libkvret's C ABI, one for one with `kvret.h` (version 0.1).
//!
//! Everything here is `unsafe` and C-shaped; use the `kvret` crate for a safe API. The tests of this crate parse
//! `kvret.h` and compare every function signature, struct field, enum constant and macro with the declarations
//! below, and compare struct layouts with a C compiler's, so the two cannot drift apart.
//!
//! Calls marked *experimental* sit behind `KVRET_EXPERIMENTAL` in the header and may change between minor versions.

#![allow(non_camel_case_types)]
#![no_std]

use core::ffi::{c_char, c_int, c_uint, c_void};
use core::marker::{PhantomData, PhantomPinned};

// ---- versioning ----
pub const KVRET_VERSION_MAJOR: c_int = 0;
pub const KVRET_VERSION_MINOR: c_int = 1;
pub const KVRET_VERSION_PATCH: c_int = 0;
pub const KVRET_VERSION_NUMBER: c_int = KVRET_VERSION_MAJOR * 10000 + KVRET_VERSION_MINOR * 100 + KVRET_VERSION_PATCH;
pub const KVRET_VERSION_STRING: &str = "0.1.0";

// ---- status ----
/// `kvret_status` (a C enum: an `int`). Kept as an integer so that an unknown value is never undefined behaviour.
pub type kvret_status = c_int;
pub const KVRET_OK: kvret_status = 0;
pub const KVRET_ERR_INVALID_ARGUMENT: kvret_status = 1;
pub const KVRET_ERR_INVALID_HANDLE: kvret_status = 2;
pub const KVRET_ERR_SHAPE: kvret_status = 3;
pub const KVRET_ERR_DTYPE: kvret_status = 4;
pub const KVRET_ERR_STRIDE: kvret_status = 5;
pub const KVRET_ERR_DEVICE: kvret_status = 6;
pub const KVRET_ERR_OUT_OF_RANGE: kvret_status = 7;
pub const KVRET_ERR_BUDGET: kvret_status = 8;
pub const KVRET_ERR_CAPACITY: kvret_status = 9;
pub const KVRET_ERR_OUT_OF_MEMORY: kvret_status = 10;
pub const KVRET_ERR_NONFINITE: kvret_status = 11;
pub const KVRET_ERR_STATE: kvret_status = 12;
pub const KVRET_ERR_UNSUPPORTED: kvret_status = 13;
pub const KVRET_ERR_IO: kvret_status = 14;
pub const KVRET_ERR_CORRUPT: kvret_status = 15;
pub const KVRET_ERR_CUDA: kvret_status = 16;
pub const KVRET_ERR_VERSION: kvret_status = 17;
pub const KVRET_ERR_INTERNAL: kvret_status = 18;
pub const KVRET_ERR_NOT_FOUND: kvret_status = 19;
pub const KVRET_ERR_BUSY: kvret_status = 20;

// ---- tensors (DLPack's DLTensor layout) ----
pub type kvret_device_type = c_int;
pub const KVRET_DEVICE_CPU: kvret_device_type = 1;
pub const KVRET_DEVICE_CUDA: kvret_device_type = 2;
pub const KVRET_DEVICE_CUDA_HOST: kvret_device_type = 3;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct kvret_device {
    pub device_type: i32,
    pub device_id: i32,
}

pub type kvret_dtype_code = c_int;
pub const KVRET_DTYPE_INT: kvret_dtype_code = 0;
pub const KVRET_DTYPE_UINT: kvret_dtype_code = 1;
pub const KVRET_DTYPE_FLOAT: kvret_dtype_code = 2;
pub const KVRET_DTYPE_BFLOAT: kvret_dtype_code = 4;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct kvret_dtype {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvret_tensor {
    pub data: *mut c_void,
    pub device: kvret_device,
    pub ndim: i32,
    pub dtype: kvret_dtype,
    pub shape: *const i64,
    pub strides: *const i64,
    pub byte_offset: u64,
}

pub type kvret_kv_dtype = c_int;
pub const KVRET_KV_F16: kvret_kv_dtype = 0;
pub const KVRET_KV_BF16: kvret_kv_dtype = 1;
pub const KVRET_KV_F32: kvret_kv_dtype = 2;

// ---- configuration ----
pub type kvret_index_kind = c_int;
pub const KVRET_INDEX_EXACT: kvret_index_kind = 0;
pub const KVRET_INDEX_PQ: kvret_index_kind = 1;
pub const KVRET_INDEX_STREAMING: kvret_index_kind = 2;
pub const KVRET_INDEX_PAGE: kvret_index_kind = 3;
pub const KVRET_INDEX_CLUSTER: kvret_index_kind = 4;
pub const KVRET_INDEX_QUANT: kvret_index_kind = 5;

pub type kvret_gqa_fold = c_int;
pub const KVRET_FOLD_SUM_PROB: kvret_gqa_fold = 0;
pub const KVRET_FOLD_MAX_LOGIT: kvret_gqa_fold = 1;

pub type kvret_cache_policy = c_int;
pub const KVRET_CACHE_LRU: kvret_cache_policy = 0;
pub const KVRET_CACHE_LFU: kvret_cache_policy = 1;

pub type kvret_session_policy = c_int;
pub const KVRET_SESSION_SCHEDULER_AWARE: kvret_session_policy = 0;
pub const KVRET_SESSION_LRU: kvret_session_policy = 1;
pub const KVRET_SESSION_FIFO: kvret_session_policy = 2;

pub type kvret_rope_layout = c_int;
pub const KVRET_ROPE_NEOX: kvret_rope_layout = 0;
pub const KVRET_ROPE_GPTJ: kvret_rope_layout = 1;
pub type kvret_importance = i32;
pub const KVRET_IMPORTANCE_WINDOW: kvret_importance = 0;
pub const KVRET_IMPORTANCE_ACCUMULATED: kvret_importance = 1;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvret_pq_params {
    pub struct_size: usize,
    pub m: i32,
    pub bits: i32,
    pub iters: i32,
    pub tol: f32,
    pub train_sample: i32,
    pub exact_fraction: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvret_cluster_params {
    pub struct_size: usize,
    pub tokens: i32,
    pub decode_interval: i32,
    pub decode_k: i32,
    pub segment_tokens: i32,
    pub reuse_steps: i32,
    pub exact_fraction: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvret_quant_params {
    pub struct_size: usize,
    pub bits: i32,
    pub group_size: i32,
    pub residual: i32,
    pub rerank: i32,
    pub attention: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvret_crush_params {
    pub struct_size: usize,
    pub fraction: f32,
    pub buckets: i32,
    pub importance: i32,
    pub granularity: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvret_session_params {
    pub struct_size: usize,
    pub dram_bytes: i64,
    pub disk_bytes: i64,
    pub ttl_ms: i64,
    pub policy: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvret_config {
    pub struct_size: usize,
    pub n_layers: i32,
    pub n_q_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
    pub kv_dtype: i32,
    pub device_type: i32,
    pub device_id: i32,
    pub n_sink: i32,
    pub n_local: i32,
    pub budget: i32,
    pub budget_ratio: f32,
    pub gqa_fold: i32,
    pub index_kind: i32,
    pub pq_m: i32,
    pub pq_bits: i32,
    pub pq_iters: i32,
    pub pq_tol: f32,
    pub pq_train_sample: i32,
    pub cluster_tokens: i32,
    pub cluster_decode_interval: i32,
    pub cluster_decode_k: i32,
    pub page_size: i32,
    pub quant_bits: i32,
    pub hamming_fraction: f32,
    pub hamming_buckets: i32,
    pub max_seq_tokens: i64,
    pub host_bytes_limit: i64,
    pub disk_path: *const c_char,
    pub block_tokens: i32,
    pub cache_policy: i32,
    pub cache_capacity_tokens: i64,
    pub n_threads: i32,
    pub background_build: i32,
    pub check_finite: i32,
    pub seed: u64,
    pub pq_exact_fraction: f32,
    pub quant_group_size: i32,
    pub quant_residual: i32,
    pub cluster_segment_tokens: i32,
    pub quant_attention: i32,
    pub cluster_reuse_steps: i32,
    pub device_bytes_limit: i64,
    pub session_dram_bytes: i64,
    pub session_disk_bytes: i64,
    pub session_ttl_ms: i64,
    pub session_policy: i32,
    pub rope_keys: i32,
    pub rope_dims: i32,
    pub rope_layout: i32,
    pub rope_theta: f32,
    pub rope_scale_factor: f32,
    pub rope_low_freq_factor: f32,
    pub rope_high_freq_factor: f32,
    pub rope_original_max_positions: i32,
    pub session_shared_url: *const c_char,
    pub cluster_exact_fraction: f32,
    pub quant_rerank: i32,
    pub hamming_importance: i32,
    pub hamming_granularity: i32,
    pub pq: *const kvret_pq_params,
    pub cluster: *const kvret_cluster_params,
    pub quant: *const kvret_quant_params,
    pub crush: *const kvret_crush_params,
    pub session: *const kvret_session_params,
}

// ---- context and sequences: opaque handles ----
#[repr(C)]
pub struct kvret_context {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

#[repr(C)]
pub struct kvret_seq {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

#[repr(C)]
pub struct kvret_stream_opaque {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

/// ABI-identical to `cudaStream_t`; null is the library's default stream.
pub type kvret_stream = *mut kvret_stream_opaque;

pub const KVRET_BUDGET_DEFAULT: i32 = -1;

// ---- sessions ----
pub type kvret_session_tier = c_int;
pub const KVRET_TIER_NONE: kvret_session_tier = 0;
pub const KVRET_TIER_DRAM: kvret_session_tier = 1;
pub const KVRET_TIER_DISK: kvret_session_tier = 2;
pub const KVRET_TIER_SHARED: kvret_session_tier = 3;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvret_working_set {
    pub k: kvret_tensor,
    pub v: kvret_tensor,
    pub positions: kvret_tensor,
}

// ---- statistics ----
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct kvret_stats {
    pub struct_size: usize,
    pub sequences: i64,
    pub tokens_stored: i64,
    pub host_bytes: i64,
    pub device_bytes: i64,
    pub disk_bytes: i64,
    pub index_bytes: i64,
    pub index_builds: i64,
    pub index_build_ms: f64,
    pub selections: i64,
    pub fetches: i64,
    pub fetched_rows: i64,
    pub cache_hits: i64,
    pub cache_misses: i64,
    pub prefetch_hits: i64,
    pub bytes_h2d: i64,
    pub disk_reads: i64,
    pub disk_writes: i64,
    pub cluster_reuse_rows: i64,
    pub cluster_reuse_hits: i64,
    pub cluster_reuse_bytes: i64,
    pub session_saves: i64,
    pub session_hits_dram: i64,
    pub session_hits_disk: i64,
    pub session_misses: i64,
    pub session_evictions: i64,
    pub session_expired: i64,
    pub session_corrupt: i64,
    pub session_dram_bytes: i64,
    pub session_dram_count: i64,
    pub session_disk_count: i64,
    pub session_hits_shared: i64,
    pub session_shared_writes: i64,
    pub session_write_failures: i64,
}

extern "C" {
    pub fn kvret_version_number() -> c_uint;
    pub fn kvret_version_string() -> *const c_char;

    pub fn kvret_status_string(status: kvret_status) -> *const c_char;
    pub fn kvret_last_error() -> *const c_char;
    pub fn kvret_clear_error();

    pub fn kvret_pq_params_init(params: *mut kvret_pq_params) -> kvret_status;
    pub fn kvret_cluster_params_init(params: *mut kvret_cluster_params) -> kvret_status;
    pub fn kvret_quant_params_init(params: *mut kvret_quant_params) -> kvret_status;
    pub fn kvret_crush_params_init(params: *mut kvret_crush_params) -> kvret_status;
    pub fn kvret_session_params_init(params: *mut kvret_session_params) -> kvret_status;

    pub fn kvret_config_init(config: *mut kvret_config) -> kvret_status;

    pub fn kvret_create(config: *const kvret_config, out: *mut *mut kvret_context) -> kvret_status;
    pub fn kvret_destroy(ctx: *mut kvret_context) -> kvret_status;
    pub fn kvret_get_config(ctx: *const kvret_context, out: *mut kvret_config) -> kvret_status;

    pub fn kvret_seq_open(ctx: *mut kvret_context, out: *mut *mut kvret_seq) -> kvret_status;
    pub fn kvret_seq_close(seq: *mut kvret_seq) -> kvret_status;
    pub fn kvret_seq_length(seq: *const kvret_seq, layer: i32, out_tokens: *mut i64) -> kvret_status;
    pub fn kvret_seq_budget(seq: *const kvret_seq, layer: i32, out_budget: *mut i32) -> kvret_status;

    pub fn kvret_append_prefill(
        seq: *mut kvret_seq,
        layer: i32,
        k: *const kvret_tensor,
        v: *const kvret_tensor,
    ) -> kvret_status;
    pub fn kvret_append_decode(
        seq: *mut kvret_seq,
        layer: i32,
        k: *const kvret_tensor,
        v: *const kvret_tensor,
    ) -> kvret_status;
    pub fn kvret_wait_index(seq: *mut kvret_seq, layer: i32) -> kvret_status;

    pub fn kvret_seq_truncate(seq: *mut kvret_seq, length: i64) -> kvret_status;

    pub fn kvret_seq_fork(seq: *mut kvret_seq, out: *mut *mut kvret_seq) -> kvret_status;

    pub fn kvret_select(
        seq: *mut kvret_seq,
        layer: i32,
        q: *const kvret_tensor,
        budget: i32,
        out_positions: *const kvret_tensor,
        out_count: *mut i32,
    ) -> kvret_status;
    pub fn kvret_select_scored(
        seq: *mut kvret_seq,
        layer: i32,
        q: *const kvret_tensor,
        budget: i32,
        out_positions: *const kvret_tensor,
        out_scores: *const kvret_tensor,
        out_count: *mut i32,
    ) -> kvret_status;
    pub fn kvret_select_batch(
        ctx: *mut kvret_context,
        n: i32,
        seqs: *const *mut kvret_seq,
        layer: i32,
        q: *const kvret_tensor,
        budget: i32,
        out_positions: *const kvret_tensor,
        out_counts: *mut i32,
    ) -> kvret_status;
    pub fn kvret_working_set_capacity(
        seq: *const kvret_seq,
        layer: i32,
        budget: i32,
        out_rows: *mut i64,
    ) -> kvret_status;
    pub fn kvret_fetch_async(
        seq: *mut kvret_seq,
        layer: i32,
        positions: *const kvret_tensor,
        count: i32,
        out: *const kvret_working_set,
        out_rows: *mut i64,
        stream: kvret_stream,
    ) -> kvret_status;
    pub fn kvret_fetch_batch_async(
        ctx: *mut kvret_context,
        n: i32,
        seqs: *const *mut kvret_seq,
        layer: i32,
        positions: *const kvret_tensor,
        counts: *const i32,
        outs: *const kvret_working_set,
        out_row_counts: *mut i64,
        stream: kvret_stream,
    ) -> kvret_status;
    pub fn kvret_attend(
        ctx: *mut kvret_context,
        q: *const kvret_tensor,
        k: *const kvret_tensor,
        v: *const kvret_tensor,
        rows: i64,
        scale: f32,
        out: *const kvret_tensor,
        stream: kvret_stream,
    ) -> kvret_status;
    pub fn kvret_seq_attend(
        seq: *mut kvret_seq,
        layer: i32,
        q: *const kvret_tensor,
        budget: i32,
        scale: f32,
        out: *const kvret_tensor,
        stream: kvret_stream,
    ) -> kvret_status;

    // ---- sessions across conversation turns ----
    pub fn kvret_session_save(seq: *mut kvret_seq, session_id: *const c_char) -> kvret_status;
    pub fn kvret_session_open(
        ctx: *mut kvret_context,
        session_id: *const c_char,
        out: *mut *mut kvret_seq,
    ) -> kvret_status;
    pub fn kvret_session_drop(ctx: *mut kvret_context, session_id: *const c_char) -> kvret_status;
    pub fn kvret_session_schedule(ctx: *mut kvret_context, session_ids: *const *const c_char, n: i32) -> kvret_status;
    pub fn kvret_session_where(ctx: *mut kvret_context, session_id: *const c_char, out_tier: *mut i32) -> kvret_status;
    pub fn kvret_session_flush(ctx: *mut kvret_context) -> kvret_status;

    pub fn kvret_seq_drop_front(seq: *mut kvret_seq, keep: i64, count: i64) -> kvret_status;

    pub fn kvret_synchronize(ctx: *mut kvret_context, stream: kvret_stream) -> kvret_status;

    // ---- eviction-only mode (KVCrush) ----
    pub fn kvret_seq_retained_set(
        seq: *mut kvret_seq,
        layer: i32,
        budget: i32,
        out_positions: *const kvret_tensor,
        out_count: *mut i32,
    ) -> kvret_status;
    pub fn kvret_seq_observe(seq: *mut kvret_seq, layer: i32, q_window: *const kvret_tensor) -> kvret_status;
    pub fn kvret_seq_observe_attention(seq: *mut kvret_seq, layer: i32, probs: *const kvret_tensor) -> kvret_status;

    pub fn kvret_stats_init(stats: *mut kvret_stats) -> kvret_status;
    pub fn kvret_seq_stats(seq: *const kvret_seq, out: *mut kvret_stats) -> kvret_status;
    pub fn kvret_context_stats(ctx: *const kvret_context, out: *mut kvret_stats) -> kvret_status;

    /// Experimental.
    pub fn kvret_prefetch_async(
        seq: *mut kvret_seq,
        layer: i32,
        q_guess: *const kvret_tensor,
        budget: i32,
        stream: kvret_stream,
    ) -> kvret_status;
    /// Experimental.
    pub fn kvret_seq_read(
        seq: *const kvret_seq,
        layer: i32,
        begin: i64,
        end: i64,
        k: *const kvret_tensor,
        v: *const kvret_tensor,
    ) -> kvret_status;
}
