// Generated from include/kvret.h by bindings/gen_config.py; do not edit by hand.
//! The per-design parameter structs (`kvret_pq_params`, ...), given to [`Config`](crate::Config) by
//! [`Config::pq`](crate::Config::pq) and its siblings.

use crate::config::{store_int, ConfigInt, Importance, SessionPolicy};
use crate::error::{rust_error, Result, Status};
use crate::sys;

/// `kvret_pq_params`: The parameters of PQCache, the pq index (KVRET_INDEX_PQ; docs/pq.md). Fill with
/// kvret_pq_params_init; reached from config.pq. Setters never fail: a value out of range is reported by
/// `Context::new`, naming the field, e.g. `config.pq.m`.
#[derive(Debug, Clone)]
pub struct PqParams {
    raw: sys::kvret_pq_params,
    rejected: Vec<(&'static str, String)>,
}

impl Default for PqParams {
    fn default() -> Self {
        Self::new()
    }
}

impl PqParams {
    /// The library's defaults (`kvret_pq_params_init`).
    pub fn new() -> Self {
        // SAFETY: an all-zero kvret_pq_params is a valid value to initialize.
        let mut raw: sys::kvret_pq_params = unsafe { std::mem::zeroed() };
        crate::error::check(unsafe { sys::kvret_pq_params_init(&mut raw) }).expect("kvret_pq_params_init");
        PqParams { raw, rejected: Vec::new() }
    }

    /// All fields, as `kvret_pq_params`.
    pub fn raw(&self) -> &sys::kvret_pq_params {
        &self.raw
    }

    /// The values the setters could not store, as an error (status InvalidArgument).
    pub(crate) fn check(&self) -> Result<()> {
        match self.rejected.first() {
            None => Ok(()),
            Some((_, message)) => Err(rust_error(Status::InvalidArgument, message)),
        }
    }

    /// `kvret_pq_params.m`: sub-spaces; head_dim % m == 0; default 4
    pub fn m(mut self, value: impl ConfigInt) -> Self {
        self.raw.m = store_int(&mut self.rejected, "pq.m", value);
        self
    }

    /// `kvret_pq_params.bits`: bits per code (2^bits centroids), 1..8; default 6
    pub fn bits(mut self, value: impl ConfigInt) -> Self {
        self.raw.bits = store_int(&mut self.rejected, "pq.bits", value);
        self
    }

    /// `kvret_pq_params.iters`: k-means iterations; 0 = adaptive (stop when the objective improves < tol, at most 25); default 0
    pub fn iters(mut self, value: impl ConfigInt) -> Self {
        self.raw.iters = store_int(&mut self.rejected, "pq.iters", value);
        self
    }

    /// `kvret_pq_params.tol`: relative objective improvement that ends adaptive k-means; default 1e-3
    pub fn tol(mut self, value: f32) -> Self {
        self.raw.tol = value;
        self
    }

    /// `kvret_pq_params.train_sample`: max tokens sampled per (layer, KV head) for training; 0 = all; default 8192
    pub fn train_sample(mut self, value: impl ConfigInt) -> Self {
        self.raw.train_sample = store_int(&mut self.rejected, "pq.train_sample", value);
        self
    }

    /// `kvret_pq_params.exact_fraction`: share of each (layer, KV head)'s indexed tokens whose keys quantize worst (largest squared
    /// reconstruction error ||k - k_hat||^2) that PQ keeps exact: a copy of the key in the index (in
    /// kv_dtype), scored with the exact q.k instead of the codes. A rare, sharp key (the one a retrieval
    /// head copies from) is the one PQ reconstructs worst. ceil(fraction * n) tokens per head at each
    /// training, ties to the earlier position; a token encoded later with the same codebook becomes exact
    /// when its error exceeds the smallest error in the exact set, while the set holds less than twice its
    /// share. Costs fraction * n * head_dim * (2 or 4) bytes per head. 0 = off; valid range [0, 0.5];
    /// default 0.05
    pub fn exact_fraction(mut self, value: f32) -> Self {
        self.raw.exact_fraction = value;
        self
    }
}

/// `kvret_cluster_params`: The parameters of ClusterKV, the cluster index (KVRET_INDEX_CLUSTER; docs/cluster.md). Fill
/// with kvret_cluster_params_init; reached from config.cluster. Setters never fail: a value out of range is reported by
/// `Context::new`, naming the field, e.g. `config.cluster.tokens`.
#[derive(Debug, Clone)]
pub struct ClusterParams {
    raw: sys::kvret_cluster_params,
    rejected: Vec<(&'static str, String)>,
}

impl Default for ClusterParams {
    fn default() -> Self {
        Self::new()
    }
}

impl ClusterParams {
    /// The library's defaults (`kvret_cluster_params_init`).
    pub fn new() -> Self {
        // SAFETY: an all-zero kvret_cluster_params is a valid value to initialize.
        let mut raw: sys::kvret_cluster_params = unsafe { std::mem::zeroed() };
        crate::error::check(unsafe { sys::kvret_cluster_params_init(&mut raw) }).expect("kvret_cluster_params_init");
        ClusterParams { raw, rejected: Vec::new() }
    }

    /// All fields, as `kvret_cluster_params`.
    pub fn raw(&self) -> &sys::kvret_cluster_params {
        &self.raw
    }

    /// The values the setters could not store, as an error (status InvalidArgument).
    pub(crate) fn check(&self) -> Result<()> {
        match self.rejected.first() {
            None => Ok(()),
            Some((_, message)) => Err(rust_error(Status::InvalidArgument, message)),
        }
    }

    /// `kvret_cluster_params.tokens`: tokens per cluster at prefill (ceil(n / this) clusters); default 32 (ClusterKV's own setting is 80:
    /// docs/cluster.md compares them)
    pub fn tokens(mut self, value: impl ConfigInt) -> Self {
        self.raw.tokens = store_int(&mut self.rejected, "cluster.tokens", value);
        self
    }

    /// `kvret_cluster_params.decode_interval`: decode tokens clustered at a time (scored exactly until then); default 320
    pub fn decode_interval(mut self, value: impl ConfigInt) -> Self {
        self.raw.decode_interval = store_int(&mut self.rejected, "cluster.decode_interval", value);
        self
    }

    /// `kvret_cluster_params.decode_k`: clusters made from each decoded interval; default 4
    pub fn decode_k(mut self, value: impl ConfigInt) -> Self {
        self.raw.decode_k = store_int(&mut self.rejected, "cluster.decode_k", value);
        self
    }

    /// `kvret_cluster_params.segment_tokens`: most middle tokens one k-means of the cluster index clusters: a longer prefill is cut into ceil(n /
    /// this) segments of equal length, clustered apart, so the build is linear in the prefill length; 0 =
    /// the whole prefill in one k-means (quadratic in its length); default 4096
    pub fn segment_tokens(mut self, value: impl ConfigInt) -> Self {
        self.raw.segment_tokens = store_int(&mut self.rejected, "cluster.segment_tokens", value);
        self
    }

    /// `kvret_cluster_params.reuse_steps`: R: on a KVRET_INDEX_CLUSTER context, the clusters a layer's fetches took in its last R fetches
    /// (steps) stay resident in the sequence: a copy of the rows fetched from them (in kv_dtype), from
    /// which the next fetch serves the selected rows it holds instead of the host store (the same bytes). A
    /// cluster fetched again stays resident with every row it holds; one not fetched in R steps is dropped.
    /// Hits count in stats.cluster_reuse_hits (and cache_hits), so cluster_reuse_hits / cluster_reuse_rows
    /// is the hit rate. Truncating a layer drops its copy; a fork starts without one. 0 = off; 0..1024;
    /// default 1. Ignored by the other index kinds
    pub fn reuse_steps(mut self, value: impl ConfigInt) -> Self {
        self.raw.reuse_steps = store_int(&mut self.rejected, "cluster.reuse_steps", value);
        self
    }

    /// `kvret_cluster_params.exact_fraction`: share of each clustered segment's tokens (per KV head) that the cluster index keeps out of the
    /// clusters: the ceil(fraction * n) keys of lowest cosine to their k-means direction (ties to the
    /// earlier position; at most n minus the segment's clusters), each a group of its own, scored by its
    /// exact q.k. A rare, sharp key (the one a retrieval head copies from) is the one its cluster's mean
    /// hides. Costs fraction * n * head_dim * 4 bytes per head. 0 = off (ClusterKV's own index); [0, 0.5];
    /// default 0.05
    pub fn exact_fraction(mut self, value: f32) -> Self {
        self.raw.exact_fraction = value;
        self
    }
}

/// `kvret_quant_params`: The parameters of SpeCache's quantized copy, the quant index (KVRET_INDEX_QUANT;
/// docs/quant.md). Fill with kvret_quant_params_init; reached from config.quant. Setters never fail: a value out of
/// range is reported by `Context::new`, naming the field, e.g. `config.quant.bits`.
#[derive(Debug, Clone)]
pub struct QuantParams {
    raw: sys::kvret_quant_params,
    rejected: Vec<(&'static str, String)>,
}

impl Default for QuantParams {
    fn default() -> Self {
        Self::new()
    }
}

impl QuantParams {
    /// The library's defaults (`kvret_quant_params_init`).
    pub fn new() -> Self {
        // SAFETY: an all-zero kvret_quant_params is a valid value to initialize.
        let mut raw: sys::kvret_quant_params = unsafe { std::mem::zeroed() };
        crate::error::check(unsafe { sys::kvret_quant_params_init(&mut raw) }).expect("kvret_quant_params_init");
        QuantParams { raw, rejected: Vec::new() }
    }

    /// All fields, as `kvret_quant_params`.
    pub fn raw(&self) -> &sys::kvret_quant_params {
        &self.raw
    }

    /// The values the setters could not store, as an error (status InvalidArgument).
    pub(crate) fn check(&self) -> Result<()> {
        match self.rejected.first() {
            None => Ok(()),
            Some((_, message)) => Err(rust_error(Status::InvalidArgument, message)),
        }
    }

    /// `kvret_quant_params.bits`: bits per quantized key and value element: 1 or 2; default 2
    pub fn bits(mut self, value: impl ConfigInt) -> Self {
        self.raw.bits = store_int(&mut self.rejected, "quant.bits", value);
        self
    }

    /// `kvret_quant_params.group_size`: elements per quantization group of the quant index (keys: tokens of one channel, values: channels of
    /// one token), each with its own f16 min and max: 32 or 64; default 64
    pub fn group_size(mut self, value: impl ConfigInt) -> Self {
        self.raw.group_size = store_int(&mut self.rejected, "quant.group_size", value);
        self
    }

    /// `kvret_quant_params.residual`: most recent middle tokens the quant index keeps in f16 (KIVI's residual window; up to group_size - 1
    /// more wait for a full key group): 0..65536; default 64
    pub fn residual(mut self, value: impl ConfigInt) -> Self {
        self.raw.residual = store_int(&mut self.rejected, "quant.residual", value);
        self
    }

    /// `kvret_quant_params.rerank`: on a KVRET_INDEX_QUANT context, select takes the rerank x budget middle tokens the low-bit keys
    /// score highest (at most the middle) as candidates, scores them again with their exact keys from the
    /// KV store and keeps the top budget of those: a key the 1-bit copy ranks just below the cut (a needle)
    /// is recovered for candidates x head_dim multiply-adds more and a read of the candidates' keys. 1 =
    /// off (the low-bit ranking alone, SpeCache's); 1..64; default 4. Ignored by the other index kinds.
    /// Under attention = 1 the candidates also enter that attention with their exact keys
    pub fn rerank(mut self, value: impl ConfigInt) -> Self {
        self.raw.rerank = store_int(&mut self.rejected, "quant.rerank", value);
        self
    }

    /// `kvret_quant_params.attention`: 1: on a KVRET_INDEX_QUANT context, kvret_seq_attend attends over every token of the layer, the sink,
    /// local and selected tokens exact, select's rerank x budget candidates with their exact keys (their
    /// values low-bit unless selected) and every other middle token as the low-bit copy has it (computed on
    /// the host); 0 (default): over the working set, as for every other index. 1 needs index_kind =
    /// KVRET_INDEX_QUANT
    pub fn attention(mut self, value: impl ConfigInt) -> Self {
        self.raw.attention = store_int(&mut self.rejected, "quant.attention", value);
        self
    }
}

/// `kvret_crush_params`: The parameters of KVCrush's hamming grouping of the tokens left out (docs/kvcrush.md). Fill
/// with kvret_crush_params_init; reached from config.crush. Setters never fail: a value out of range is reported by
/// `Context::new`, naming the field, e.g. `config.crush.fraction`.
#[derive(Debug, Clone)]
pub struct CrushParams {
    raw: sys::kvret_crush_params,
    rejected: Vec<(&'static str, String)>,
}

impl Default for CrushParams {
    fn default() -> Self {
        Self::new()
    }
}

impl CrushParams {
    /// The library's defaults (`kvret_crush_params_init`).
    pub fn new() -> Self {
        // SAFETY: an all-zero kvret_crush_params is a valid value to initialize.
        let mut raw: sys::kvret_crush_params = unsafe { std::mem::zeroed() };
        crate::error::check(unsafe { sys::kvret_crush_params_init(&mut raw) }).expect("kvret_crush_params_init");
        CrushParams { raw, rejected: Vec::new() }
    }

    /// All fields, as `kvret_crush_params`.
    pub fn raw(&self) -> &sys::kvret_crush_params {
        &self.raw
    }

    /// The values the setters could not store, as an error (status InvalidArgument).
    pub(crate) fn check(&self) -> Result<()> {
        match self.rejected.first() {
            None => Ok(()),
            Some((_, message)) => Err(rust_error(Status::InvalidArgument, message)),
        }
    }

    /// `kvret_crush_params.fraction`: share of each select's budget spent on bucket representatives of the tokens left out, in [0, 1):
    /// floor(fraction * budget) of them; default 0 (off)
    pub fn fraction(mut self, value: f32) -> Self {
        self.raw.fraction = value;
        self
    }

    /// `kvret_crush_params.buckets`: most representatives (buckets) per KV head and select; default 0 = no cap
    pub fn buckets(mut self, value: impl ConfigInt) -> Self {
        self.raw.buckets = store_int(&mut self.rejected, "crush.buckets", value);
        self
    }

    /// `kvret_crush_params.importance`: a kvret_importance: where the importance behind KVCrush's signatures, its representatives and
    /// kvret_seq_retained_set comes from; default KVRET_IMPORTANCE_WINDOW
    pub fn importance(mut self, value: Importance) -> Self {
        self.raw.importance = value as i32;
        self
    }

    /// `kvret_crush_params.granularity`: tokens per KVCrush representative unit: 0 or 1 = single tokens (default 0); a power of two 2..4096 =
    /// aligned runs of that many positions (chunks of 8, or the engine's KV page), each representative unit
    /// sending all its tokens the index did not select; the count a select returns does not change
    pub fn granularity(mut self, value: impl ConfigInt) -> Self {
        self.raw.granularity = store_int(&mut self.rejected, "crush.granularity", value);
        self
    }
}

/// `kvret_session_params`: The parameters of the session store (AttentionStore; docs/sessions.md); its disk tier is
/// config.disk_path and its shared tier config.session_shared_url. Fill with kvret_session_params_init; reached from
/// config.session. Setters never fail: a value out of range is reported by `Context::new`, naming the field, e.g.
/// `config.session.dram_bytes`.
#[derive(Debug, Clone)]
pub struct SessionParams {
    raw: sys::kvret_session_params,
    rejected: Vec<(&'static str, String)>,
}

impl Default for SessionParams {
    fn default() -> Self {
        Self::new()
    }
}

impl SessionParams {
    /// The library's defaults (`kvret_session_params_init`).
    pub fn new() -> Self {
        // SAFETY: an all-zero kvret_session_params is a valid value to initialize.
        let mut raw: sys::kvret_session_params = unsafe { std::mem::zeroed() };
        crate::error::check(unsafe { sys::kvret_session_params_init(&mut raw) }).expect("kvret_session_params_init");
        SessionParams { raw, rejected: Vec::new() }
    }

    /// All fields, as `kvret_session_params`.
    pub fn raw(&self) -> &sys::kvret_session_params {
        &self.raw
    }

    /// The values the setters could not store, as an error (status InvalidArgument).
    pub(crate) fn check(&self) -> Result<()> {
        match self.rejected.first() {
            None => Ok(()),
            Some((_, message)) => Err(rust_error(Status::InvalidArgument, message)),
        }
    }

    /// `kvret_session_params.dram_bytes`: capacity of the session store's host DRAM tier in bytes; 0 = unlimited; default 0; >= 0
    pub fn dram_bytes(mut self, value: impl ConfigInt) -> Self {
        self.raw.dram_bytes = store_int(&mut self.rejected, "session.dram_bytes", value);
        self
    }

    /// `kvret_session_params.disk_bytes`: capacity of the disk tier (config.disk_path) in bytes; 0 = unlimited; default 0; >= 0
    pub fn disk_bytes(mut self, value: impl ConfigInt) -> Self {
        self.raw.disk_bytes = store_int(&mut self.rejected, "session.disk_bytes", value);
        self
    }

    /// `kvret_session_params.ttl_ms`: a saved session expires this many milliseconds after its save (then it is a miss, and its bytes are
    /// freed); 0 = never; default 0; >= 0
    pub fn ttl_ms(mut self, value: impl ConfigInt) -> Self {
        self.raw.ttl_ms = store_int(&mut self.rejected, "session.ttl_ms", value);
        self
    }

    /// `kvret_session_params.policy`: a kvret_session_policy; default KVRET_SESSION_SCHEDULER_AWARE
    pub fn policy(mut self, value: SessionPolicy) -> Self {
        self.raw.policy = value as i32;
        self
    }
}
