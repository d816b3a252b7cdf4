//! Safe Rust API of kvret: KV-cache retrieval for long-context LLM decoding.
//!
//! ```no_run
//! use kvret::{Config, Context, IndexKind, KvDtype};
//!
//! # fn main() -> kvret::Result<()> {
//! let config = Config::new().n_layers(2).n_q_heads(8).n_kv_heads(2).head_dim(64)
//!     .kv_dtype(KvDtype::F32).index_kind(IndexKind::Exact).budget(32);
//! let ctx = Context::new(&config)?;
//! let mut seq = ctx.open_sequence()?;
//! let (k, v) = (vec![0.5f32; 400 * 2 * 64], vec![1.0f32; 400 * 2 * 64]);
//! seq.append_prefill(0, &k, &v)?;                 // [tokens, n_kv_heads, head_dim]
//! let q = vec![0.1f32; 8 * 64];                    // [n_q_heads, head_dim]
//! let selection = seq.select(0, &q, None)?;        // None: the default budget
//! let ws = seq.fetch::<f32>(0, &selection)?;        // sink + selected + local rows per KV head
//! let out = ctx.attend(&q, &ws)?;                  // [n_q_heads, head_dim]
//! # Ok(()) }
//! ```
//!
//! Handles free themselves on drop; a [`Sequence`] borrows its [`Context`], so it cannot outlive it, and an
//! [`ArcSequence`] (from [`Context::open_sequence_arc`]) shares an `Arc<Context>`, so it can be stored or moved to
//! another thread on its own:
//!
//! ```no_run
//! # fn main() -> kvret::Result<()> {
//! # let config = kvret::Config::new();
//! let ctx = std::sync::Arc::new(kvret::Context::new(&config)?);
//! let mut seq = ctx.open_sequence_arc()?;          // kvret::ArcSequence: 'static + Send
//! let worker = std::thread::spawn(move || seq.length(0));
//! drop(ctx);                                       // the sequence keeps the context alive
//! # let _ = worker.join();
//! # Ok(()) }
//! ```
//!
//! Every failure is a [`KvretError`] with the library's [`Status`] and message, never a panic: slices whose length
//! is not exactly what the call's shape needs are refused (status [`Status::Shape`]) before the library is called,
//! and sizes are converted and multiplied with checks (a value past the C type is an error, not a wrap).

mod config;
mod context;
mod error;
mod half;
mod params;
mod sequence;
mod session;
mod tensor;
mod working_set;

pub use config::{
    CachePolicy, Config, ConfigInt, Device, GqaFold, Importance, IndexKind, KvDtype, RopeLayout, SessionPolicy,
};
pub use context::Context;
pub use error::{KvretError, Result, Status};
pub use half::{Bf16, F16};
pub use kvret_sys as sys;
pub use params::{ClusterParams, CrushParams, PqParams, QuantParams, SessionParams};
pub use sequence::{ArcSequence, ContextHandle, Selection, Sequence, SequenceOf};
pub use session::SessionTier;
pub use tensor::{Element, Scalar, TensorMut, TensorRef};
pub use working_set::WorkingSet;

/// Statistics of a sequence or a context (`kvret_stats`).
pub type Stats = sys::kvret_stats;

/// The version of the loaded libkvret ("MAJOR.MINOR.PATCH").
pub fn version() -> String {
    // SAFETY: a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(sys::kvret_version_string()) }.to_string_lossy().into_owned()
}
