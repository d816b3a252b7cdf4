use std::ffi::{CStr, CString};

use crate::error::{check, rust_error, Result, Status};
use crate::params::{ClusterParams, CrushParams, PqParams, QuantParams, SessionParams};
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

/// Which saved session a full tier of the session store evicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionPolicy {
    SchedulerAware = sys::KVRET_SESSION_SCHEDULER_AWARE as isize,
    Lru = sys::KVRET_SESSION_LRU as isize,
    Fifo = sys::KVRET_SESSION_FIFO as isize,
}

/// Where KVCrush's token importance comes from (`kvret_config.hamming_importance`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Importance {
    /// SnapKV's observation window: the queries given to `Sequence::observe`, else the layer's last 32 keys.
    Window = sys::KVRET_IMPORTANCE_WINDOW as isize,
    /// H2O's accumulated attention of decode steps (`Sequence::attend`, `Sequence::observe_attention`).
    Accumulated = sys::KVRET_IMPORTANCE_ACCUMULATED as isize,
}

/// How the rotary embedding pairs the dimensions of a head (pre-RoPE keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    Neox = sys::KVRET_ROPE_NEOX as isize,
    Gptj = sys::KVRET_ROPE_GPTJ as isize,
}

/// Where a context keeps its index and working sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(i32),
}

mod sealed {
    pub trait Sealed: Copy {
        fn wide(self) -> i128;
    }
    macro_rules! sealed {
        ($($t:ty)*) => {$(impl Sealed for $t { fn wide(self) -> i128 { self as i128 } })*};
    }
    sealed!(i8 i16 i32 i64 isize u8 u16 u32 u64 usize);

    /// The C type of an integer field of kvret_config.
    pub trait CInt: TryFrom<i128> {
        const NAME: &'static str;
        const MIN: Self;
        const MAX: Self;
    }
    impl CInt for i32 {
        const NAME: &'static str = "int32_t";
        const MIN: i32 = i32::MIN;
        const MAX: i32 = i32::MAX;
    }
    impl CInt for i64 {
        const NAME: &'static str = "int64_t";
        const MIN: i64 = i64::MIN;
        const MAX: i64 = i64::MAX;
    }
}

/// The integer a count or size setter of [`Config`] takes: any primitive integer up to 64 bits, so `usize` (as the
/// rest of the API counts) and the C field's own `i32` / `i64` both work.
///
/// A value the C field cannot hold (e.g. `n_layers(usize::MAX)`) is not wrapped: [`Context::new`] refuses the config
/// with status [`InvalidArgument`](crate::Status::InvalidArgument), naming the field. A negative value reaches the
/// library, which refuses it the same way: no integer field of `kvret_config` has a negative sentinel (each is
/// validated `>= 0` or `>= 1`; 0 is the "automatic" / "unlimited" value where there is one).
///
/// [`Context::new`]: crate::Context::new
pub trait ConfigInt: sealed::Sealed {}

impl<T: sealed::Sealed> ConfigInt for T {}

/// Stores `value` in a field of C type `T`, or records in `rejected` that it does not fit (the last call for a field
/// wins); `field` names it in the message (`n_layers`, `pq.m`).
pub(crate) fn store_int<T: sealed::CInt>(
    rejected: &mut Vec<(&'static str, String)>,
    field: &'static str,
    value: impl ConfigInt,
) -> T {
    rejected.retain(|(f, _)| *f != field);
    let wide = value.wide();
    T::try_from(wide).unwrap_or_else(|_| {
        let message = format!("config.{field} = {wide} does not fit its C type {}", T::NAME);
        rejected.push((field, message));
        if wide < 0 {
            T::MIN
        } else {
            T::MAX
        }
    })
}

/// A context configuration: `kvret_config` with the library's defaults, set through chained methods.
///
/// Every field has a setter of the same name; [`Config::raw`] reads them all. Setters never fail: a value they
/// cannot store (see [`ConfigInt`], [`Config::disk_path`]) is reported by [`Context::new`](crate::Context::new).
#[derive(Debug, Clone)]
pub struct Config {
    raw: sys::kvret_config,
    disk_path: Option<CString>,
    session_shared_url: Option<CString>,
    /// (field, message) of each value a setter could not store; refused by Context::new.
    rejected: Vec<(&'static str, String)>,
    /// The per-design parameter structs; raw's pointers to them are null but for the duration of kvret_create.
    pq: Option<PqParams>,
    cluster: Option<ClusterParams>,
    quant: Option<QuantParams>,
    crush: Option<CrushParams>,
    session: Option<SessionParams>,
}

// SAFETY: raw.disk_path, raw.session_shared_url and the parameter pointers (raw.pq, ...) are always null (the strings
// and structs live in the Config's own fields and are only lent during kvret_create).
unsafe impl Send for Config {}
unsafe impl Sync for Config {}

impl Default for Config {
    fn default() -> Self {
        Self::new()
    }
}

impl Config {
    /// The library's defaults (`kvret_config_init`).
    pub fn new() -> Self {
        // SAFETY: an all-zero kvret_config is a valid value to initialize.
        let mut raw: sys::kvret_config = unsafe { std::mem::zeroed() };
        check(unsafe { sys::kvret_config_init(&mut raw) }).expect("kvret_config_init");
        Config {
            raw,
            disk_path: None,
            session_shared_url: None,
            rejected: Vec::new(),
            pq: None,
            cluster: None,
            quant: None,
            crush: None,
            session: None,
        }
    }

    /// Adopts a config filled by the library, copying its strings.
    pub(crate) fn from_raw(mut raw: sys::kvret_config) -> Self {
        let copy = |text: *const std::ffi::c_char| {
            // SAFETY: the library hands out NUL-terminated strings that are valid while the context lives.
            (!text.is_null()).then(|| unsafe { CStr::from_ptr(text) }.to_owned())
        };
        let (disk_path, session_shared_url) = (copy(raw.disk_path), copy(raw.session_shared_url));
        raw.disk_path = std::ptr::null();
        raw.session_shared_url = std::ptr::null();
        (raw.pq, raw.cluster, raw.quant, raw.crush, raw.session) =
            (std::ptr::null(), std::ptr::null(), std::ptr::null(), std::ptr::null(), std::ptr::null());
        Config {
            raw,
            disk_path,
            session_shared_url,
            rejected: Vec::new(),
            pq: None,
            cluster: None,
            quant: None,
            crush: None,
            session: None,
        }
    }

    /// All fields, as `kvret_config` (its `disk_path` and `session_shared_url` are null: see
    /// [`Config::disk_path_str`], [`Config::session_shared_url_str`]). A field whose
    /// setter got a value out of its C type's range holds that type's nearest bound here, and the config is
    /// refused by [`Context::new`](crate::Context::new).
    pub fn raw(&self) -> &sys::kvret_config {
        &self.raw
    }

    /// The directory of the session store's disk tier, if any.
    pub fn disk_path_str(&self) -> Option<&str> {
        self.disk_path.as_deref().and_then(|p| p.to_str().ok())
    }

    /// The Redis URL of the shared session tier, if any.
    pub fn session_shared_url_str(&self) -> Option<&str> {
        self.session_shared_url.as_deref().and_then(|p| p.to_str().ok())
    }

    /// The values the setters could not store, as an error (status InvalidArgument) naming the first field.
    pub(crate) fn check(&self) -> Result<()> {
        match self.rejected.first() {
            None => Ok(()),
            Some((_, message)) => Err(rust_error(Status::InvalidArgument, message)),
        }?;
        self.pq.as_ref().map_or(Ok(()), PqParams::check)?;
        self.cluster.as_ref().map_or(Ok(()), ClusterParams::check)?;
        self.quant.as_ref().map_or(Ok(()), QuantParams::check)?;
        self.crush.as_ref().map_or(Ok(()), CrushParams::check)?;
        self.session.as_ref().map_or(Ok(()), SessionParams::check)
    }

    /// Stores `value` in a field of C type `T`, or records that it does not fit (the last call for a field wins).
    fn int_field<T: sealed::CInt>(&mut self, field: &'static str, value: impl ConfigInt) -> T {
        store_int(&mut self.rejected, field, value)
    }

    /// Calls `f` with the raw config whose strings point at this config's.
    pub(crate) fn with_raw<T>(&self, f: impl FnOnce(&sys::kvret_config) -> T) -> T {
        let mut raw = self.raw;
        raw.disk_path = self.disk_path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
        raw.session_shared_url = self.session_shared_url.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
        raw.pq = self.pq.as_ref().map_or(std::ptr::null(), |p| p.raw());
        raw.cluster = self.cluster.as_ref().map_or(std::ptr::null(), |p| p.raw());
        raw.quant = self.quant.as_ref().map_or(std::ptr::null(), |p| p.raw());
        raw.crush = self.crush.as_ref().map_or(std::ptr::null(), |p| p.raw());
        raw.session = self.session.as_ref().map_or(std::ptr::null(), |p| p.raw());
        f(&raw)
    }

    /// Stores an optional string field, or records that it holds a NUL byte.
    fn string_field(&mut self, field: &'static str, value: Option<&str>) -> Option<CString> {
        self.rejected.retain(|(f, _)| *f != field);
        match value.map(CString::new) {
            None => None,
            Some(Ok(text)) => Some(text),
            Some(Err(_)) => {
                self.rejected.push((field, format!("config.{field} contains a NUL byte")));
                None
            }
        }
    }

    // The setters of every field but the device and the strings, from include/kvret.h (bindings/gen_config.py;
    // do not edit by hand).
    // <generated setters>
    /// `kvret_config.n_layers`: 1..4096; default 32
    pub fn n_layers(mut self, value: impl ConfigInt) -> Self {
        self.raw.n_layers = self.int_field("n_layers", value);
        self
    }

    /// `kvret_config.n_q_heads`: 1..4096; default 32
    pub fn n_q_heads(mut self, value: impl ConfigInt) -> Self {
        self.raw.n_q_heads = self.int_field("n_q_heads", value);
        self
    }

    /// `kvret_config.n_kv_heads`: default 8; n_q_heads % n_kv_heads == 0
    pub fn n_kv_heads(mut self, value: impl ConfigInt) -> Self {
        self.raw.n_kv_heads = self.int_field("n_kv_heads", value);
        self
    }

    /// `kvret_config.head_dim`: 64, 128 or 256; default 128
    pub fn head_dim(mut self, value: impl ConfigInt) -> Self {
        self.raw.head_dim = self.int_field("head_dim", value);
        self
    }

    /// `kvret_config.kv_dtype`: a kvret_kv_dtype; default KVRET_KV_F16
    pub fn kv_dtype(mut self, value: KvDtype) -> Self {
        self.raw.kv_dtype = value as i32;
        self
    }

    /// `kvret_config.n_sink`: first tokens always attended; default 16
    pub fn n_sink(mut self, value: impl ConfigInt) -> Self {
        self.raw.n_sink = self.int_field("n_sink", value);
        self
    }

    /// `kvret_config.n_local`: most recent tokens always attended; default 64
    pub fn n_local(mut self, value: impl ConfigInt) -> Self {
        self.raw.n_local = self.int_field("n_local", value);
        self
    }

    /// `kvret_config.budget`: middle tokens selected per KV head; 0 = use budget_ratio (default 0)
    pub fn budget(mut self, value: impl ConfigInt) -> Self {
        self.raw.budget = self.int_field("budget", value);
        self
    }

    /// `kvret_config.budget_ratio`: budget as a fraction of the context length when budget == 0; default 0.1
    pub fn budget_ratio(mut self, value: f32) -> Self {
        self.raw.budget_ratio = value;
        self
    }

    /// `kvret_config.gqa_fold`: a kvret_gqa_fold; default KVRET_FOLD_SUM_PROB
    pub fn gqa_fold(mut self, value: GqaFold) -> Self {
        self.raw.gqa_fold = value as i32;
        self
    }

    /// `kvret_config.index_kind`: a kvret_index_kind; default KVRET_INDEX_PQ
    pub fn index_kind(mut self, value: IndexKind) -> Self {
        self.raw.index_kind = value as i32;
        self
    }

    /// `kvret_config.pq_m`: kept for one release: use pq.m
    pub fn pq_m(mut self, value: impl ConfigInt) -> Self {
        self.raw.pq_m = self.int_field("pq_m", value);
        self
    }

    /// `kvret_config.pq_bits`: kept for one release: use pq.bits
    pub fn pq_bits(mut self, value: impl ConfigInt) -> Self {
        self.raw.pq_bits = self.int_field("pq_bits", value);
        self
    }

    /// `kvret_config.pq_iters`: kept for one release: use pq.iters
    pub fn pq_iters(mut self, value: impl ConfigInt) -> Self {
        self.raw.pq_iters = self.int_field("pq_iters", value);
        self
    }

    /// `kvret_config.pq_tol`: kept for one release: use pq.tol
    pub fn pq_tol(mut self, value: f32) -> Self {
        self.raw.pq_tol = value;
        self
    }

    /// `kvret_config.pq_train_sample`: kept for one release: use pq.train_sample
    pub fn pq_train_sample(mut self, value: impl ConfigInt) -> Self {
        self.raw.pq_train_sample = self.int_field("pq_train_sample", value);
        self
    }

    /// `kvret_config.cluster_tokens`: kept for one release: use cluster.tokens
    pub fn cluster_tokens(mut self, value: impl ConfigInt) -> Self {
        self.raw.cluster_tokens = self.int_field("cluster_tokens", value);
        self
    }

    /// `kvret_config.cluster_decode_interval`: kept for one release: use cluster.decode_interval
    pub fn cluster_decode_interval(mut self, value: impl ConfigInt) -> Self {
        self.raw.cluster_decode_interval = self.int_field("cluster_decode_interval", value);
        self
    }

    /// `kvret_config.cluster_decode_k`: kept for one release: use cluster.decode_k
    pub fn cluster_decode_k(mut self, value: impl ConfigInt) -> Self {
        self.raw.cluster_decode_k = self.int_field("cluster_decode_k", value);
        self
    }

    /// `kvret_config.page_size`: tokens per page; default 16
    pub fn page_size(mut self, value: impl ConfigInt) -> Self {
        self.raw.page_size = self.int_field("page_size", value);
        self
    }

    /// `kvret_config.quant_bits`: kept for one release: use quant.bits
    pub fn quant_bits(mut self, value: impl ConfigInt) -> Self {
        self.raw.quant_bits = self.int_field("quant_bits", value);
        self
    }

    /// `kvret_config.hamming_fraction`: kept for one release: use crush.fraction
    pub fn hamming_fraction(mut self, value: f32) -> Self {
        self.raw.hamming_fraction = value;
        self
    }

    /// `kvret_config.hamming_buckets`: kept for one release: use crush.buckets
    pub fn hamming_buckets(mut self, value: impl ConfigInt) -> Self {
        self.raw.hamming_buckets = self.int_field("hamming_buckets", value);
        self
    }

    /// `kvret_config.max_seq_tokens`: token capacity of one sequence (per layer); 0 = unlimited; default 0
    pub fn max_seq_tokens(mut self, value: impl ConfigInt) -> Self {
        self.raw.max_seq_tokens = self.int_field("max_seq_tokens", value);
        self
    }

    /// `kvret_config.host_bytes_limit`: capacity of the host KV store over all sequences; 0 = unlimited; default 0. When set, at least one
    /// 256-token page of K and V per layer (n_layers x 256 x 2 x n_kv_heads x head_dim x element size):
    /// less is KVRET_ERR_INVALID_ARGUMENT
    pub fn host_bytes_limit(mut self, value: impl ConfigInt) -> Self {
        self.raw.host_bytes_limit = self.int_field("host_bytes_limit", value);
        self
    }

    /// `kvret_config.block_tokens`: tokens per cache block (positions [b * block_tokens, (b+1) * block_tokens)); default 128; >= 1
    pub fn block_tokens(mut self, value: impl ConfigInt) -> Self {
        self.raw.block_tokens = self.int_field("block_tokens", value);
        self
    }

    /// `kvret_config.cache_policy`: a kvret_cache_policy: which cached block a newly admitted one replaces; default KVRET_CACHE_LRU
    pub fn cache_policy(mut self, value: CachePolicy) -> Self {
        self.raw.cache_policy = value as i32;
        self
    }

    /// `kvret_config.cache_capacity_tokens`: block cache capacity per (sequence, layer, KV head) on the CUDA backend: cache_capacity_tokens /
    /// block_tokens slots (at most 2048; 0 slots = no cache) of keys and values in device memory, made at
    /// the layer's first fetch or prefetch, counted in stats.device_bytes and under device_bytes_limit (a
    /// layer whose cache does not fit runs without one). Fetches serve rows of cached blocks from it
    /// (stats.cache_hits) and admit the complete blocks holding the most selected rows; the still-growing
    /// last block is never cached. With it come the device windows: the first n_sink and the last n_local
    /// rows (each at most 4096) in device memory, loaded as the layer grows, from which fetches serve their
    /// sink and local rows. Results are the same with and without it. Ignored by the CPU backend, whose KV
    /// is already in host memory; default 4096; >= 0
    pub fn cache_capacity_tokens(mut self, value: impl ConfigInt) -> Self {
        self.raw.cache_capacity_tokens = self.int_field("cache_capacity_tokens", value);
        self
    }

    /// `kvret_config.n_threads`: CPU threads for scoring and builds; 0 = all cores; default 0
    pub fn n_threads(mut self, value: impl ConfigInt) -> Self {
        self.raw.n_threads = self.int_field("n_threads", value);
        self
    }

    /// `kvret_config.background_build`: 1: index builds run in the background after append_prefill (default)
    pub fn background_build(mut self, value: bool) -> Self {
        self.raw.background_build = value.into();
        self
    }

    /// `kvret_config.check_finite`: 1: reject NaN/Inf in appended keys/values and queries; default 0
    pub fn check_finite(mut self, value: bool) -> Self {
        self.raw.check_finite = value.into();
        self
    }

    /// `kvret_config.seed`: seed of every randomized step (k-means init, sampling); default 42
    pub fn seed(mut self, value: u64) -> Self {
        self.raw.seed = value;
        self
    }

    /// `kvret_config.pq_exact_fraction`: kept for one release: use pq.exact_fraction
    pub fn pq_exact_fraction(mut self, value: f32) -> Self {
        self.raw.pq_exact_fraction = value;
        self
    }

    /// `kvret_config.quant_group_size`: kept for one release: use quant.group_size
    pub fn quant_group_size(mut self, value: impl ConfigInt) -> Self {
        self.raw.quant_group_size = self.int_field("quant_group_size", value);
        self
    }

    /// `kvret_config.quant_residual`: kept for one release: use quant.residual
    pub fn quant_residual(mut self, value: impl ConfigInt) -> Self {
        self.raw.quant_residual = self.int_field("quant_residual", value);
        self
    }

    /// `kvret_config.cluster_segment_tokens`: kept for one release: use cluster.segment_tokens
    pub fn cluster_segment_tokens(mut self, value: impl ConfigInt) -> Self {
        self.raw.cluster_segment_tokens = self.int_field("cluster_segment_tokens", value);
        self
    }

    /// `kvret_config.quant_attention`: kept for one release: use quant.attention
    pub fn quant_attention(mut self, value: impl ConfigInt) -> Self {
        self.raw.quant_attention = self.int_field("quant_attention", value);
        self
    }

    /// `kvret_config.cluster_reuse_steps`: kept for one release: use cluster.reuse_steps
    pub fn cluster_reuse_steps(mut self, value: impl ConfigInt) -> Self {
        self.raw.cluster_reuse_steps = self.int_field("cluster_reuse_steps", value);
        self
    }

    /// `kvret_config.device_bytes_limit`: most bytes of device memory the context's sequences keep between calls (the working sets of
    /// kvret_seq_attend and the block caches; stats.device_bytes). A working set that would pass it is
    /// KVRET_ERR_CAPACITY, naming this field, before the call changes anything; a block cache that would
    /// pass it is not made (that layer's fetches read every row from host memory and succeed; a later fetch
    /// tries again), and a cache's block table that cannot grow stops admitting blocks past it. The
    /// temporaries of a call (gather lists, attention weights, the cache's bookkeeping), freed before it
    /// returns, are not counted. 0 = unlimited (default); >= 0. Ignored by the CPU backend, which uses no
    /// device memory
    pub fn device_bytes_limit(mut self, value: impl ConfigInt) -> Self {
        self.raw.device_bytes_limit = self.int_field("device_bytes_limit", value);
        self
    }

    /// `kvret_config.session_dram_bytes`: kept for one release: use session.dram_bytes
    pub fn session_dram_bytes(mut self, value: impl ConfigInt) -> Self {
        self.raw.session_dram_bytes = self.int_field("session_dram_bytes", value);
        self
    }

    /// `kvret_config.session_disk_bytes`: kept for one release: use session.disk_bytes
    pub fn session_disk_bytes(mut self, value: impl ConfigInt) -> Self {
        self.raw.session_disk_bytes = self.int_field("session_disk_bytes", value);
        self
    }

    /// `kvret_config.session_ttl_ms`: kept for one release: use session.ttl_ms
    pub fn session_ttl_ms(mut self, value: impl ConfigInt) -> Self {
        self.raw.session_ttl_ms = self.int_field("session_ttl_ms", value);
        self
    }

    /// `kvret_config.session_policy`: kept for one release: use session.policy
    pub fn session_policy(mut self, value: SessionPolicy) -> Self {
        self.raw.session_policy = value as i32;
        self
    }

    /// `kvret_config.rope_keys`: 1: the keys appended are before RoPE; kvret rotates them at the position each token has now (its
    /// index in the sequence) wherever keys are read: index builds, select, fetch, attention and
    /// kvret_seq_read. Queries stay rotated as before. 0 (default): keys are given rotated
    pub fn rope_keys(mut self, value: bool) -> Self {
        self.raw.rope_keys = value.into();
        self
    }

    /// `kvret_config.rope_dims`: rotated dimensions of each head (even, <= head_dim; the rest pass unrotated); 0 = head_dim (default)
    pub fn rope_dims(mut self, value: impl ConfigInt) -> Self {
        self.raw.rope_dims = self.int_field("rope_dims", value);
        self
    }

    /// `kvret_config.rope_layout`: a kvret_rope_layout; default KVRET_ROPE_NEOX
    pub fn rope_layout(mut self, value: RopeLayout) -> Self {
        self.raw.rope_layout = value as i32;
        self
    }

    /// `kvret_config.rope_theta`: the base of the rotary frequencies; > 0; default 10000
    pub fn rope_theta(mut self, value: f32) -> Self {
        self.raw.rope_theta = value;
        self
    }

    /// `kvret_config.rope_scale_factor`: Llama-3 frequency scaling: the factor; 0 = none (default); else >= 1
    pub fn rope_scale_factor(mut self, value: f32) -> Self {
        self.raw.rope_scale_factor = value;
        self
    }

    /// `kvret_config.rope_low_freq_factor`: Llama-3 scaling: low-frequency factor; > 0; default 1
    pub fn rope_low_freq_factor(mut self, value: f32) -> Self {
        self.raw.rope_low_freq_factor = value;
        self
    }

    /// `kvret_config.rope_high_freq_factor`: Llama-3 scaling: high-frequency factor; > rope_low_freq_factor; default 4
    pub fn rope_high_freq_factor(mut self, value: f32) -> Self {
        self.raw.rope_high_freq_factor = value;
        self
    }

    /// `kvret_config.rope_original_max_positions`: Llama-3 scaling: the original context length; >= 1; default 8192
    pub fn rope_original_max_positions(mut self, value: impl ConfigInt) -> Self {
        self.raw.rope_original_max_positions = self.int_field("rope_original_max_positions", value);
        self
    }

    /// `kvret_config.cluster_exact_fraction`: kept for one release: use cluster.exact_fraction
    pub fn cluster_exact_fraction(mut self, value: f32) -> Self {
        self.raw.cluster_exact_fraction = value;
        self
    }

    /// `kvret_config.quant_rerank`: kept for one release: use quant.rerank
    pub fn quant_rerank(mut self, value: impl ConfigInt) -> Self {
        self.raw.quant_rerank = self.int_field("quant_rerank", value);
        self
    }

    /// `kvret_config.hamming_importance`: kept for one release: use crush.importance
    pub fn hamming_importance(mut self, value: Importance) -> Self {
        self.raw.hamming_importance = value as i32;
        self
    }

    /// `kvret_config.hamming_granularity`: kept for one release: use crush.granularity
    pub fn hamming_granularity(mut self, value: impl ConfigInt) -> Self {
        self.raw.hamming_granularity = self.int_field("hamming_granularity", value);
        self
    }
    // </generated setters>

    /// PQCache's parameters in one place (`kvret_config.pq`), in place of the flat `pq_*` setters, which are kept for
    /// one release: `Config::new().pq(PqParams::new().m(8))`. Setting a flat `pq_*` field from its default as well is
    /// refused by [`Context::new`](crate::Context::new) (status InvalidArgument, naming both).
    pub fn pq(mut self, value: PqParams) -> Self {
        self.pq = Some(value);
        self
    }

    /// ClusterKV's parameters in one place (`kvret_config.cluster`), in place of the flat `cluster_*` setters.
    pub fn cluster(mut self, value: ClusterParams) -> Self {
        self.cluster = Some(value);
        self
    }

    /// The quant index's parameters in one place (`kvret_config.quant`), in place of the flat `quant_*` setters.
    pub fn quant(mut self, value: QuantParams) -> Self {
        self.quant = Some(value);
        self
    }

    /// KVCrush's parameters in one place (`kvret_config.crush`), in place of the flat `hamming_*` setters.
    pub fn crush(mut self, value: CrushParams) -> Self {
        self.crush = Some(value);
        self
    }

    /// The session store's parameters in one place (`kvret_config.session`), in place of the flat `session_*`
    /// setters (but `session_shared_url`).
    pub fn session(mut self, value: SessionParams) -> Self {
        self.session = Some(value);
        self
    }

    pub fn device(mut self, value: Device) -> Self {
        (self.raw.device_type, self.raw.device_id) = match value {
            Device::Cpu => (sys::KVRET_DEVICE_CPU, 0),
            Device::Cuda(id) => (sys::KVRET_DEVICE_CUDA, id),
        };
        self
    }

    /// The directory of the session store's disk tier, created if missing (`None` or "": no disk tier). A path
    /// with a NUL byte is an error at context creation (status InvalidArgument).
    pub fn disk_path(mut self, path: Option<&str>) -> Self {
        self.disk_path = self.string_field("disk_path", path);
        self
    }

    /// The shared session tier: a Redis server every node of a serving stack reads saved sessions from,
    /// `redis://[:password@]host[:port][/db][?prefix=P&timeout_ms=N]` or `rediss://` for TLS (`None` or "": none,
    /// the default). A URL with a NUL byte is an error at context creation (status InvalidArgument); a library built
    /// without the Redis client refuses a URL (status Unsupported).
    pub fn session_shared_url(mut self, url: Option<&str>) -> Self {
        self.session_shared_url = self.string_field("session_shared_url", url);
        self
    }
}
