//! kvret from Rust: prefill -> select -> fetch -> attend, compared with attention over every token.
//!
//! Run from a build tree:
//!   KVRET_LIB_DIR=<build>/lib LD_LIBRARY_PATH=<build>/lib cargo run --offline --manifest-path examples/rust/Cargo.toml
//! or against an installed kvret (found through pkg-config): cargo run --manifest-path examples/rust/Cargo.toml

use kvret::{Config, Context, IndexKind, KvDtype, TensorMut, TensorRef};

const LAYERS: usize = 2;
const Q_HEADS: usize = 8;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const TOKENS: usize = 2048;
const GROUP: usize = Q_HEADS / KV_HEADS;

/// xorshift + Box-Muller: deterministic data without external crates.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn gaussian(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| ((-2.0 * self.uniform().ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()) as f32)
            .collect()
    }
}

fn main() -> kvret::Result<()> {
    let mut rng = Rng(0x5eed);
    let config = Config::new()
        .n_layers(LAYERS as i32)
        .n_q_heads(Q_HEADS as i32)
        .n_kv_heads(KV_HEADS as i32)
        .head_dim(HEAD_DIM as i32)
        .kv_dtype(KvDtype::F32)
        .index_kind(IndexKind::Pq)
        .n_sink(16)
        .n_local(64)
        .budget(128);
    let ctx = Context::new(&config)?;
    let mut seq = ctx.open_sequence()?;

    // Prefill every layer: keys and values are [tokens, kv_heads, head_dim].
    let kv: Vec<(Vec<f32>, Vec<f32>)> = (0..LAYERS)
        .map(|_| (rng.gaussian(TOKENS * KV_HEADS * HEAD_DIM), rng.gaussian(TOKENS * KV_HEADS * HEAD_DIM)))
        .collect();
    for (layer, (k, v)) in kv.iter().enumerate() {
        seq.append_prefill(layer, k, v)?;
    }

    // A decode-step query whose heads each look for one far-back "needle" token.
    let layer = LAYERS - 1;
    let (k, v) = &kv[layer];
    let noise = rng.gaussian(Q_HEADS * HEAD_DIM);
    let needles: Vec<usize> = (0..Q_HEADS).map(|_| 16 + (rng.uniform() * (TOKENS - 80) as f64) as usize).collect();
    let mut q = vec![0f32; Q_HEADS * HEAD_DIM];
    for (h, &needle) in needles.iter().enumerate() {
        let key = &k[(needle * KV_HEADS + h / GROUP) * HEAD_DIM..][..HEAD_DIM];
        let norm = key.iter().map(|x| x * x).sum::<f32>().sqrt();
        for d in 0..HEAD_DIM {
            q[h * HEAD_DIM + d] = 1.2 * (HEAD_DIM as f32).sqrt() * key[d] / norm + 0.5 * noise[h * HEAD_DIM + d];
        }
    }

    let selection = seq.select(layer, &q, None)?;
    let ws = seq.fetch::<f32>(layer, &selection)?;
    let out = ctx.attend(&q, &ws)?;

    // Attention over every token: the stored [tokens, kv_heads, head_dim] seen as [kv_heads, tokens, head_dim].
    let strides = [HEAD_DIM, KV_HEADS * HEAD_DIM, 1];
    let all_k = TensorRef::strided(k, &[KV_HEADS, TOKENS, HEAD_DIM], &strides)?;
    let all_v = TensorRef::strided(v, &[KV_HEADS, TOKENS, HEAD_DIM], &strides)?;
    let mut full = vec![0f32; Q_HEADS * HEAD_DIM];
    let q_view = TensorRef::new(&q, &[Q_HEADS, HEAD_DIM])?;
    ctx.attend_raw(&q_view, &all_k, &all_v, TOKENS, 0.0, &mut TensorMut::new(&mut full, &[Q_HEADS, HEAD_DIM])?)?;

    let diff: f32 = out.iter().zip(&full).map(|(a, b)| (a - b) * (a - b)).sum();
    let norm: f32 = full.iter().map(|b| b * b).sum();
    let found = needles.iter().enumerate().filter(|(h, n)| selection.head(h / GROUP).contains(&(**n as i32))).count();
    println!("kvret {}: {TOKENS} tokens per layer, PQ index, budget {}", kvret::version(), selection.count());
    println!("working set: {} rows per KV head; needles retrieved: {found}/{Q_HEADS}", ws.rows());
    println!("output error vs full attention: {:.3}", (diff / norm).sqrt());

    match seq.select(LAYERS, &q, None) {
        Err(e) => println!("a bad call returns Err: {e}"),
        Ok(_) => unreachable!("layer {LAYERS} is out of range"),
    }
    Ok(())
}
