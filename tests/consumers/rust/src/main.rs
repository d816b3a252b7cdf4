//! A program that uses an installed kvret the way a Rust engine would (the Rust twin of ../consumer.c): it runs
//! prefill -> select -> fetch -> attend, checks the results, and prints the version and the file of the libkvret it
//! loaded, which consumer.cmake compares with the install prefix.

use std::sync::Arc;

use kvret::{Config, Context, IndexKind, KvDtype, Status};

const Q_HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const TOKENS: usize = 256;
const SINK: usize = 4;
const LOCAL: usize = 16;
const BUDGET: usize = 24;
const NEEDLE: usize = 100;

/// The libkvret shared object mapped into this process (Linux), if it can be found.
fn loaded_library() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.contains("libkvret"))
        .map(String::from)
}

fn run() -> Result<(), String> {
    let fail = |e: kvret::KvretError| e.to_string();
    let config = Config::new()
        .n_layers(1)
        .n_q_heads(Q_HEADS)
        .n_kv_heads(KV_HEADS)
        .head_dim(HEAD_DIM)
        .kv_dtype(KvDtype::F32)
        .index_kind(IndexKind::Exact)
        .n_sink(SINK)
        .n_local(LOCAL)
        .budget(BUDGET);
    let ctx = Arc::new(Context::new(&config).map_err(fail)?);

    let mut seed = 12345u32;
    let mut k = vec![0f32; TOKENS * KV_HEADS * HEAD_DIM];
    for x in &mut k {
        seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
        *x = (seed >> 8) as f32 / 16_777_216.0 - 0.5;
    }
    let v: Vec<f32> = (0..k.len()).map(|i| i as f32 / k.len() as f32).collect();
    // every query head looks for the keys of token NEEDLE
    let needle = &k[NEEDLE * KV_HEADS * HEAD_DIM..(NEEDLE + 1) * KV_HEADS * HEAD_DIM];
    let q: Vec<f32> = (0..Q_HEADS * HEAD_DIM).map(|i| needle[i % (KV_HEADS * HEAD_DIM)]).collect();

    // a sequence that shares the context, used from another thread after the main thread let go of the Arc
    let mut seq = ctx.open_sequence_arc().map_err(fail)?;
    let weak = Arc::downgrade(&ctx);
    drop(ctx);
    let worker = std::thread::spawn(move || -> kvret::Result<_> {
        seq.append_prefill(0, &k, &v)?;
        let selection = seq.select(0, &q, None)?;
        let ws = seq.fetch::<f32>(0, &selection)?;
        let out = seq.context().attend(&q, &ws)?;
        // stored rows come back as they were appended
        let stored = (0..KV_HEADS).all(|h| {
            ws.positions(h).iter().enumerate().all(|(r, &p)| {
                let row = (p as usize * KV_HEADS + h) * HEAD_DIM;
                ws.k(h)[r * HEAD_DIM..(r + 1) * HEAD_DIM] == k[row..row + HEAD_DIM]
            })
        });
        // a query one element short is refused, and nothing changes
        let short = seq.select(0, &q[1..], None).map(|_| ()).unwrap_err();
        let after = seq.length(0)?;
        Ok((selection, ws.rows(), out, stored, short, after))
    });
    let (selection, rows, out, stored, short, length) =
        worker.join().map_err(|_| "the worker thread panicked".to_string())?.map_err(fail)?;
    if weak.upgrade().is_some() {
        return Err("the context outlived its last sequence".into());
    }

    let found = (0..KV_HEADS).all(|h| selection.head(h).contains(&(NEEDLE as i32)));
    let norm = out.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
    println!(
        "kvret-consumer: selected {} per KV head, working set {rows} rows, |out| = {norm:.4}, token {NEEDLE} {}",
        selection.count(),
        if found { "retrieved" } else { "MISSED" }
    );
    if !found || !stored || rows != SINK + BUDGET + LOCAL || selection.count() != BUDGET || !norm.is_finite() {
        return Err(format!("checks failed: found={found} stored={stored} rows={rows}"));
    }
    if short.status() != Status::Shape || length != TOKENS {
        return Err(format!("a short query: {short}, length {length}"));
    }
    Ok(())
}

fn main() {
    println!("kvret-consumer: version {}", kvret::version());
    println!("kvret-consumer: libkvret {}", loaded_library().unwrap_or_else(|| "(not found)".into()));
    match run() {
        Ok(()) => println!("kvret-consumer: OK"),
        Err(message) => {
            eprintln!("kvret-consumer: FAILED: {message}");
            std::process::exit(1);
        }
    }
}
