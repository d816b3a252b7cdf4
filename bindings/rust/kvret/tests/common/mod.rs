//! What the integration tests share: a small model, deterministic data (no crates) and a state snapshot.
#![allow(dead_code)] // each test file uses a part

use kvret::{Config, IndexKind, KvDtype, SequenceOf};

pub const LAYERS: usize = 2;
pub const Q_HEADS: usize = 8;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 64;
pub const SINK: usize = 4;
pub const LOCAL: usize = 16;
pub const BUDGET: usize = 32;
pub const TOKENS: usize = 400;
pub const Q_LEN: usize = Q_HEADS * HEAD_DIM;
pub const TOKEN_LEN: usize = KV_HEADS * HEAD_DIM;

/// The setters take usize, as the rest of the API.
pub fn config() -> Config {
    Config::new()
        .n_layers(LAYERS)
        .n_q_heads(Q_HEADS)
        .n_kv_heads(KV_HEADS)
        .head_dim(HEAD_DIM)
        .kv_dtype(KvDtype::F32)
        .index_kind(IndexKind::Exact)
        .n_sink(SINK)
        .n_local(LOCAL)
        .budget(BUDGET)
}

/// xorshift + Box-Muller.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    pub fn gaussian(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| ((-2.0 * self.uniform().ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()) as f32)
            .collect()
    }
}

/// Keys and values of TOKENS tokens.
pub fn kv(rng: &mut Rng) -> (Vec<f32>, Vec<f32>) {
    (rng.gaussian(TOKENS * TOKEN_LEN), rng.gaussian(TOKENS * TOKEN_LEN))
}

/// What a refused call must leave as it was: every layer's length and the counts of selections and fetches.
#[derive(Debug, PartialEq)]
pub struct Snapshot {
    pub lengths: Vec<usize>,
    pub selections: i64,
    pub fetches: i64,
    pub tokens_stored: i64,
}

pub fn snapshot<H: kvret::ContextHandle>(seq: &SequenceOf<H>) -> Snapshot {
    let stats = seq.stats().unwrap();
    Snapshot {
        lengths: (0..LAYERS).map(|layer| seq.length(layer).unwrap()).collect(),
        selections: stats.selections,
        fetches: stats.fetches,
        tokens_stored: stats.tokens_stored,
    }
}
