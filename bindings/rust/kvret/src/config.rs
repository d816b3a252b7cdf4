use std::ffi::{CStr, CString};

use crate::error::check;
use crate::sys;

/// The storage type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F16 = sys::KVRET_KV_F16 as isize,
    Bf16 = sys::KVRET_KV_BF16 as isize,
    F32 = sys::KVRET_KV_F32 as isize,
}

/// Which index selects the middle tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexKind {
    /// Exact q.k over every middle token: the quality oracle.
    Exact = sys::KVRET_INDEX_EXACT as isize,
    /// Product quantization of keys (PQCache).
    Pq = sys::KVRET_INDEX_PQ as isize,
    /// No retrieval: sink + local only.
    Streaming = sys::KVRET_INDEX_STREAMING as isize,
    Page = sys::KVRET_INDEX_PAGE as isize,
    Cluster = sys::KVRET_INDEX_CLUSTER as isize,
    Quant = sys::KVRET_INDEX_QUANT as isize,
}

/// How the query heads of one KV group are folded into one score per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GqaFold {
    SumProb = sys::KVRET_FOLD_SUM_PROB as isize,
    MaxLogit = sys::KVRET_FOLD_MAX_LOGIT as isize,
}

/// Replacement policy of the GPU block cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachePolicy {
    Lru = sys::KVRET_CACHE_LRU as isize,
    Lfu = sys::KVRET_CACHE_LFU as isize,
}

/// Where a context keeps its index and working sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(i32),
}

/// A context configuration: `kvret_config` with the library's defaults, set through chained methods.
///
/// Every field has a setter of the same name; [`Config::raw`] reads them all.
#[derive(Debug, Clone)]
pub struct Config {
    raw: sys::kvret_config,
    disk_path: Option<CString>,
}

// SAFETY: raw.disk_path is always null (the path lives in `disk_path` and is only lent during kvret_create).
unsafe impl Send for Config {}
unsafe impl Sync for Config {}

impl Default for Config {
    fn default() -> Self {
        Self::new()
    }
}

macro_rules! setters {
    ($($(#[$doc:meta])* $field:ident: $ty:ty),* $(,)?) => {
        $(
            $(#[$doc])*
            pub fn $field(mut self, value: $ty) -> Self {
                self.raw.$field = value;
                self
            }
        )*
    };
}

impl Config {
    /// The library's defaults (`kvret_config_init`).
    pub fn new() -> Self {
        // SAFETY: an all-zero kvret_config is a valid value to initialize.
        let mut raw: sys::kvret_config = unsafe { std::mem::zeroed() };
        check(unsafe { sys::kvret_config_init(&mut raw) }).expect("kvret_config_init");
        Config { raw, disk_path: None }
    }

    /// Adopts a config filled by the library, copying its disk path.
    pub(crate) fn from_raw(mut raw: sys::kvret_config) -> Self {
        let disk_path = (!raw.disk_path.is_null())
            // SAFETY: the library hands out a NUL-terminated path that is valid while the context lives.
            .then(|| unsafe { CStr::from_ptr(raw.disk_path) }.to_owned());
        raw.disk_path = std::ptr::null();
        Config { raw, disk_path }
    }

    /// All fields, as `kvret_config` (its `disk_path` is null: see [`Config::disk_path_str`]).
    pub fn raw(&self) -> &sys::kvret_config {
        &self.raw
    }

    /// The disk tier's directory, if any.
    pub fn disk_path_str(&self) -> Option<&str> {
        self.disk_path.as_deref().and_then(|p| p.to_str().ok())
    }

    /// Calls `f` with the raw config whose disk_path points at this config's path.
    pub(crate) fn with_raw<T>(&self, f: impl FnOnce(&sys::kvret_config) -> T) -> T {
        let mut raw = self.raw;
        raw.disk_path = self.disk_path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
        f(&raw)
    }

    setters! {
        n_layers: i32,
        n_q_heads: i32,
        n_kv_heads: i32,
        /// 64, 128 or 256.
        head_dim: i32,
        n_sink: i32,
        n_local: i32,
        /// Middle tokens selected per KV head; 0 = use the budget ratio.
        budget: i32,
        budget_ratio: f32,
        pq_m: i32,
        pq_bits: i32,
        pq_iters: i32,
        pq_tol: f32,
        pq_train_sample: i32,
        /// Share of each (layer, KV head)'s indexed tokens whose keys PQ quantizes worst that it keeps exact
        /// (scored with the exact q.k); 0 = off, at most 0.5.
        pq_exact_fraction: f32,
        cluster_tokens: i32,
        cluster_decode_interval: i32,
        cluster_decode_k: i32,
        page_size: i32,
        quant_bits: i32,
        hamming_fraction: f32,
        hamming_buckets: i32,
        max_seq_tokens: i64,
        host_bytes_limit: i64,
        block_tokens: i32,
        cache_capacity_tokens: i64,
        /// CPU threads for scoring and builds; 0 = all cores.
        n_threads: i32,
        seed: u64,
    }

    pub fn kv_dtype(mut self, value: KvDtype) -> Self {
        self.raw.kv_dtype = value as i32;
        self
    }

    pub fn index_kind(mut self, value: IndexKind) -> Self {
        self.raw.index_kind = value as i32;
        self
    }

    pub fn gqa_fold(mut self, value: GqaFold) -> Self {
        self.raw.gqa_fold = value as i32;
        self
    }

    pub fn cache_policy(mut self, value: CachePolicy) -> Self {
        self.raw.cache_policy = value as i32;
        self
    }

    pub fn device(mut self, value: Device) -> Self {
        (self.raw.device_type, self.raw.device_id) = match value {
            Device::Cpu => (sys::KVRET_DEVICE_CPU, 0),
            Device::Cuda(id) => (sys::KVRET_DEVICE_CUDA, id),
        };
        self
    }

    pub fn background_build(mut self, value: bool) -> Self {
        self.raw.background_build = value.into();
        self
    }

    pub fn check_finite(mut self, value: bool) -> Self {
        self.raw.check_finite = value.into();
        self
    }

    /// The disk tier's directory (reserved by the library). A path with a NUL byte is an error at context creation.
    pub fn disk_path(mut self, path: Option<&str>) -> Self {
        self.disk_path = path.map(|p| CString::new(p).unwrap_or_default());
        self
    }
}
