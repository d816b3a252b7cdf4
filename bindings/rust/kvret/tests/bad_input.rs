//! Bad input through the safe API: every slice whose length is not exactly what the call's shape needs, and
//! extreme sizes, layers and budgets, are errors with a status (never a panic, an abort or a partial write), and
//! the sequence is unchanged after each.

mod common;

use common::*;
use kvret::{
    Context, Importance, IndexKind, KvretError, Selection, Sequence, Status, TensorMut, TensorRef, WorkingSet, F16,
};

/// A context with one sequence holding TOKENS tokens in layer 0, a query, and a selection of layer 0.
fn prefilled(ctx: &Context) -> (Sequence<'_>, Vec<f32>, Selection) {
    let mut rng = Rng(0xbad);
    let mut seq = ctx.open_sequence().unwrap();
    let (k, v) = kv(&mut rng);
    seq.append_prefill(0, &k, &v).unwrap();
    let q = rng.gaussian(Q_LEN);
    let selection = seq.select(0, &q, None).unwrap();
    (seq, q, selection)
}

#[track_caller]
fn expect_status<T: std::fmt::Debug>(result: kvret::Result<T>, status: Status) -> KvretError {
    let error = result.expect_err("a bad value was accepted");
    assert_eq!(error.status(), status, "{error}");
    assert!(!error.message().is_empty());
    error
}

/// Slices that are one element, one row or one token too long or too short, or empty.
fn wrong_lengths(len: usize, row: usize) -> Vec<usize> {
    let mut lengths = vec![0, len - 1, len + 1, len - row, len + row, 2 * len];
    lengths.retain(|&l| l != len);
    lengths
}

#[test]
fn append_slices_must_match_exactly() {
    let ctx = Context::new(&config()).unwrap();
    let (mut seq, _, _) = prefilled(&ctx);
    let before = snapshot(&seq);
    let token = vec![0.25f32; TOKEN_LEN];
    let big = vec![0.25f32; 3 * TOKEN_LEN];

    // decode: exactly one token; two tokens' worth used to store one and return Ok
    for len in wrong_lengths(TOKEN_LEN, HEAD_DIM) {
        let error = expect_status(seq.append_decode(0, &big[..len], &token), Status::Shape);
        assert!(error.message().contains('k'), "{error}");
        let error = expect_status(seq.append_decode(0, &token, &big[..len]), Status::Shape);
        assert!(error.message().contains('v'), "{error}");
    }
    // prefill: k a whole number of tokens, v exactly as long as k
    let (k, v) = (vec![0.5f32; 10 * TOKEN_LEN], vec![0.5f32; 11 * TOKEN_LEN]);
    for (k_len, v_len) in [(10 * TOKEN_LEN, 11 * TOKEN_LEN), (10 * TOKEN_LEN, 9 * TOKEN_LEN), (10 * TOKEN_LEN, 0)] {
        expect_status(seq.append_prefill(0, &k[..k_len], &v[..v_len]), Status::Shape);
    }
    for k_len in [1, TOKEN_LEN - 1, TOKEN_LEN + 1, 10 * TOKEN_LEN - HEAD_DIM] {
        expect_status(seq.append_prefill(0, &k[..k_len], &v[..k_len]), Status::Shape);
    }
    // strided views: every element they address must be in the slice
    let data = vec![F16::ONE; 4 * TOKEN_LEN];
    let strides = [HEAD_DIM, 4 * HEAD_DIM, 1]; // heads-first memory of 4 tokens
    assert!(TensorRef::strided(&data, &[4, KV_HEADS, HEAD_DIM], &strides).is_ok());
    expect_status(TensorRef::strided(&data, &[5, KV_HEADS, HEAD_DIM], &strides), Status::Shape);
    expect_status(TensorRef::strided(&data[1..], &[4, KV_HEADS, HEAD_DIM], &strides), Status::Shape);
    expect_status(TensorRef::strided(&data, &[4, KV_HEADS, HEAD_DIM], &strides[..2]), Status::Shape);
    assert_eq!(snapshot(&seq), before);
}

#[test]
fn query_slices_must_match_exactly() {
    let ctx = Context::new(&config()).unwrap();
    let (mut seq, q, selection) = prefilled(&ctx);
    let ws = seq.fetch::<f32>(0, &selection).unwrap();
    let before = snapshot(&seq);
    let long = [q.clone(), q.clone()].concat();
    for len in wrong_lengths(Q_LEN, HEAD_DIM) {
        let bad = &long[..len];
        expect_status(seq.select(0, bad, None), Status::Shape);
        expect_status(seq.select_scored(0, bad, None), Status::Shape);
        let mut positions = vec![-7i32; KV_HEADS * BUDGET];
        expect_status(seq.select_into(0, bad, None, &mut positions), Status::Shape);
        assert!(positions.iter().all(|&p| p == -7), "written on failure");
        expect_status(seq.attend(0, bad, None), Status::Shape);
        expect_status(seq.prefetch(0, bad, None), Status::Shape);
        expect_status(ctx.attend(bad, &ws), Status::Shape);
        // a batch of one sequence takes exactly one query
        expect_status(ctx.select_batch(&mut [&mut seq], 0, bad, None), Status::Shape);
    }
    // a batch of none takes none
    let mut none: Vec<&mut Sequence<'_>> = Vec::new();
    assert_eq!(ctx.select_batch::<f32, _>(&mut none, 0, &[], None).unwrap(), vec![]);
    expect_status(ctx.select_batch(&mut none, 0, &q, None), Status::Shape);
    assert_eq!(snapshot(&seq), before);
}

#[test]
fn output_slices_must_match_exactly() {
    let ctx = Context::new(&config()).unwrap();
    let (mut seq, q, selection) = prefilled(&ctx);
    let before = snapshot(&seq);
    // select_into: [n_kv_heads, width], so a whole number of heads
    for len in [1, KV_HEADS * BUDGET + 1, KV_HEADS * BUDGET - 1] {
        let mut positions = vec![-7i32; len];
        expect_status(seq.select_into(0, &q, None, &mut positions), Status::Shape);
        assert!(positions.iter().all(|&p| p == -7), "written on failure");
    }
    // too narrow for the budget: the library's check, still nothing written
    let mut narrow = vec![-7i32; KV_HEADS * (BUDGET - 1)];
    expect_status(seq.select_into(0, &q, None, &mut narrow), Status::Shape);
    assert!(narrow.iter().all(|&p| p == -7));

    // fetch_into: a working set of another geometry
    for (heads, dim) in [(KV_HEADS + 1, HEAD_DIM), (KV_HEADS, HEAD_DIM / 2), (1, HEAD_DIM)] {
        let mut ws = WorkingSet::<f32>::new(heads, TOKENS, dim).unwrap();
        expect_status(seq.fetch_into(0, &selection, &mut ws), Status::Shape);
        assert_eq!(ws.rows(), 0);
        assert!(ws.k_buffer().iter().all(|&x| x == 0.0));
        expect_status(ctx.attend(&q, &ws), Status::Shape);
    }
    // a selection made by a context of another geometry
    let other = Context::new(&config().n_q_heads(4).n_kv_heads(4)).unwrap();
    let mut other_seq = other.open_sequence().unwrap();
    let mut rng = Rng(3);
    let (k, v) = (rng.gaussian(TOKENS * 4 * HEAD_DIM), rng.gaussian(TOKENS * 4 * HEAD_DIM));
    other_seq.append_prefill(0, &k, &v).unwrap();
    let foreign = other_seq.select(0, &rng.gaussian(4 * HEAD_DIM), None).unwrap();
    expect_status(seq.fetch::<f32>(0, &foreign), Status::Shape);
    let mut ws = WorkingSet::<f32>::new(KV_HEADS, TOKENS, HEAD_DIM).unwrap();
    expect_status(seq.fetch_into(0, &foreign, &mut ws), Status::Shape);
    assert_eq!(ws.rows(), 0);
    // attend_raw: views of exactly their shape; rows past i64
    let mut out = vec![0f32; Q_LEN];
    expect_status(TensorMut::new(&mut out[..Q_LEN - 1], &[Q_HEADS, HEAD_DIM]), Status::Shape);
    expect_status(TensorRef::new(&q, &[Q_HEADS, HEAD_DIM - 1]), Status::Shape);
    let full = seq.fetch::<f32>(0, &selection).unwrap();
    let shape = [KV_HEADS, full.capacity(), HEAD_DIM];
    let (k, v) = (TensorRef::new(full.k_buffer(), &shape).unwrap(), TensorRef::new(full.v_buffer(), &shape).unwrap());
    let q_view = TensorRef::new(&q, &[Q_HEADS, HEAD_DIM]).unwrap();
    let mut out_view = TensorMut::new(&mut out, &[Q_HEADS, HEAD_DIM]).unwrap();
    for rows in [usize::MAX, i64::MAX as usize + 1, full.capacity() + 1] {
        expect_status(ctx.attend_raw(&q_view, &k, &v, rows, 0.0, &mut out_view), Status::Shape);
    }
    drop(out_view);
    assert!(out.iter().all(|&x| x == 0.0));
    let after = snapshot(&seq);
    assert_eq!(
        (after.lengths, after.selections, after.fetches),
        (before.lengths, before.selections, before.fetches + 1)
    );
}

#[test]
fn read_ranges_are_checked_before_allocating() {
    let ctx = Context::new(&config()).unwrap();
    let (seq, _, _) = prefilled(&ctx);
    #[allow(clippy::reversed_empty_ranges)]
    for range in [0..usize::MAX, usize::MAX - 1..usize::MAX, 10..5, TOKENS..TOKENS + 1, 0..TOKENS + 1] {
        expect_status(seq.read::<f32>(0, range), Status::OutOfRange);
    }
    expect_status(seq.read::<f32>(1, 0..1), Status::OutOfRange); // layer 1 is empty
    assert_eq!(seq.read::<f32>(0, 7..7).unwrap(), (vec![], vec![]));
    assert_eq!(seq.read::<f32>(0, 0..TOKENS).unwrap().0.len(), TOKENS * TOKEN_LEN);
}

#[test]
fn extreme_layers_are_out_of_range() {
    let ctx = Context::new(&config()).unwrap();
    let (mut seq, q, selection) = prefilled(&ctx);
    let before = snapshot(&seq);
    let token = vec![0f32; TOKEN_LEN];
    for layer in [LAYERS, i32::MAX as usize, i32::MAX as usize + 1, u32::MAX as usize, usize::MAX] {
        expect_status(seq.append_prefill(layer, &token, &token), Status::OutOfRange);
        expect_status(seq.append_decode(layer, &token, &token), Status::OutOfRange);
        expect_status(seq.wait_index(Some(layer)), Status::OutOfRange);
        expect_status(seq.length(layer), Status::OutOfRange);
        expect_status(seq.budget(layer), Status::OutOfRange);
        expect_status(seq.working_set_capacity(layer, None), Status::OutOfRange);
        expect_status(seq.select(layer, &q, None), Status::OutOfRange);
        expect_status(seq.select_scored(layer, &q, None), Status::OutOfRange);
        expect_status(seq.select_into(layer, &q, None, &mut [0; KV_HEADS * BUDGET]), Status::OutOfRange);
        expect_status(seq.attend(layer, &q, None), Status::OutOfRange);
        expect_status(seq.prefetch(layer, &q, None), Status::OutOfRange);
        expect_status(seq.fetch::<f32>(layer, &selection), Status::OutOfRange);
        let mut ws = WorkingSet::<f32>::new(KV_HEADS, TOKENS, HEAD_DIM).unwrap();
        expect_status(seq.fetch_into(layer, &selection, &mut ws), Status::OutOfRange);
        expect_status(seq.read::<f32>(layer, 0..1), Status::OutOfRange);
        expect_status(ctx.select_batch(&mut [&mut seq], layer, &q, None), Status::OutOfRange);
    }
    assert_eq!(snapshot(&seq), before);
}

#[test]
fn extreme_budgets_are_refused() {
    let ctx = Context::new(&config()).unwrap();
    let (mut seq, q, _) = prefilled(&ctx);
    let before = snapshot(&seq);
    let budgets = [TOKENS + 1, i32::MAX as usize, i32::MAX as usize + 1, 1 << 40, usize::MAX];
    for budget in budgets {
        let b = Some(budget);
        expect_status(seq.select(0, &q, b), Status::Budget);
        expect_status(seq.select_scored(0, &q, b), Status::Budget);
        expect_status(seq.select_into(0, &q, b, &mut [0; KV_HEADS * BUDGET]), Status::Budget);
        expect_status(seq.attend(0, &q, b), Status::Budget);
        expect_status(seq.prefetch(0, &q, b), Status::Budget);
        expect_status(seq.working_set_capacity(0, b), Status::Budget);
        expect_status(ctx.select_batch(&mut [&mut seq], 0, &q, b), Status::Budget);
    }
    assert_eq!(snapshot(&seq), before);
    seq.truncate(usize::MAX).unwrap(); // beyond every layer: nothing to drop
    assert_eq!(snapshot(&seq), before);
}

#[test]
fn extreme_sizes_are_errors_not_panics() {
    // products that overflow a usize, extents past i64, too many dimensions
    let data = [0f32; 4];
    for shape in [&[usize::MAX, 2][..], &[2, usize::MAX], &[1 << 32, 1 << 32], &[i64::MAX as usize + 1], &[1; 5]] {
        expect_status(TensorRef::new(&data, shape), Status::Shape);
        expect_status(TensorMut::new(&mut [0f32; 4], shape), Status::Shape);
    }
    for (shape, strides) in [
        ([2usize, 2], [usize::MAX, 1usize]),
        ([usize::MAX, 1], [1, 1]),
        ([3, 1], [i64::MAX as usize + 1, 1]),
        ([1, 1], [i64::MAX as usize + 1, 1]), // addresses nothing past the first element, but does not fit an i64
    ] {
        expect_status(TensorRef::strided(&data, &shape, &strides), Status::Shape);
    }
    // an empty shape addresses nothing: any extents and strides that fit an i64 describe it
    expect_status(TensorRef::strided(&data[..0], &[0, usize::MAX], &[1, 1]), Status::Shape);
    assert!(TensorRef::strided(&data[..0], &[0, 1 << 40], &[1 << 40, 1]).is_ok());
    assert!(TensorRef::new(&data[..0], &[0, 1 << 40]).is_ok());
    assert!(TensorRef::new(&data[..0], &[1 << 40, 1 << 40, 0]).is_ok());

    // working sets too large to describe, or to allocate
    expect_status(WorkingSet::<f32>::new(usize::MAX, usize::MAX, 2), Status::Shape);
    expect_status(WorkingSet::<f32>::new(2, usize::MAX / 2 + 1, 1), Status::Shape);
    expect_status(WorkingSet::<f32>::new(1, 1 << 50, 64), Status::OutOfMemory);
    expect_status(WorkingSet::<F16>::new(1, usize::MAX / 4, 1), Status::OutOfMemory);
    let empty = WorkingSet::<f32>::new(0, 0, 0).unwrap();
    assert_eq!(empty.k(0), &[] as &[f32]);

    // accessors of a head out of range are empty
    let ctx = Context::new(&config()).unwrap();
    let (mut seq, _, selection) = prefilled(&ctx);
    let ws = seq.fetch::<f32>(0, &selection).unwrap();
    for head in [KV_HEADS, usize::MAX / HEAD_DIM, usize::MAX] {
        assert!(selection.head(head).is_empty());
        assert!(ws.k(head).is_empty() && ws.v(head).is_empty() && ws.positions(head).is_empty());
    }
    assert_eq!(selection.scores(0), None);
    let scored = seq.select_scored(0, &vec![0.5f32; Q_LEN], None).unwrap();
    assert_eq!(scored.scores(usize::MAX), Some(&[][..]));
}

#[test]
fn config_values_past_the_c_types_are_refused() {
    for (config, field) in [
        (config().n_layers(usize::MAX), "n_layers"),
        (config().n_layers(i32::MAX as usize + 1), "n_layers"),
        (config().budget(u32::MAX), "budget"),
        (config().n_threads(1u64 << 40), "n_threads"),
        (config().max_seq_tokens(u64::MAX), "max_seq_tokens"),
        (config().host_bytes_limit(usize::MAX), "host_bytes_limit"),
        (config().cache_capacity_tokens(i64::MAX as u64 + 1), "cache_capacity_tokens"),
        (config().page_size(i64::MIN), "page_size"),
    ] {
        let error = expect_status(Context::new(&config), Status::InvalidArgument);
        assert!(error.message().contains(field), "{error}");
    }
    // negative values reach the library, which names the field
    for (config, field) in [
        (config().n_sink(-1), "n_sink"),
        (config().max_seq_tokens(-5i64), "max_seq_tokens"),
        (config().index_kind(IndexKind::Quant).quant_group_size(48), "quant_group_size"),
        (config().index_kind(IndexKind::Quant).quant_residual(-1), "quant_residual"),
        (config().index_kind(IndexKind::Quant).quant_attention(2), "quant_attention"),
        (config().index_kind(IndexKind::Pq).quant_attention(1), "quant_attention"),
        (config().cluster_segment_tokens(-1), "cluster_segment_tokens"),
        (config().index_kind(IndexKind::Cluster).cluster_reuse_steps(-1), "cluster_reuse_steps"),
        (config().index_kind(IndexKind::Cluster).cluster_reuse_steps(1025), "cluster_reuse_steps"),
        (config().device_bytes_limit(-1i64), "device_bytes_limit"),
        (config().index_kind(IndexKind::Cluster).cluster_exact_fraction(-0.1), "cluster_exact_fraction"),
        (config().index_kind(IndexKind::Cluster).cluster_exact_fraction(0.6), "cluster_exact_fraction"),
        (config().index_kind(IndexKind::Cluster).cluster_exact_fraction(f32::NAN), "cluster_exact_fraction"),
        (config().index_kind(IndexKind::Quant).quant_rerank(0), "quant_rerank"),
        (config().index_kind(IndexKind::Quant).quant_rerank(65), "quant_rerank"),
        (config().hamming_fraction(0.25).hamming_granularity(3), "hamming_granularity"),
        (config().hamming_fraction(0.25).hamming_granularity(-1), "hamming_granularity"),
        (config().hamming_fraction(0.25).hamming_granularity(8192), "hamming_granularity"),
    ] {
        let error = expect_status(Context::new(&config), Status::InvalidArgument);
        assert!(error.message().contains(field), "{error}");
    }
    // the last value set wins
    let fixed = config().n_layers(usize::MAX).n_layers(3usize);
    assert_eq!(Context::new(&fixed).unwrap().config().raw().n_layers, 3);
    // a path with a NUL byte is refused, not emptied
    let error = expect_status(Context::new(&config().disk_path(Some("/tmp/a\0b"))), Status::InvalidArgument);
    assert!(error.message().contains("disk_path"), "{error}");
    assert!(Context::new(&config().disk_path(Some("/tmp/a\0b")).disk_path(None)).is_ok());
}

#[test]
fn batches_refuse_sequences_of_another_context() {
    let ctx = Context::new(&config()).unwrap();
    let other = Context::new(&config()).unwrap();
    let (mut mine, q, _) = prefilled(&ctx);
    let (mut theirs, _, _) = prefilled(&other);
    let before = snapshot(&theirs);
    let queries = [q.clone(), q.clone()].concat();
    expect_status(ctx.select_batch(&mut [&mut mine, &mut theirs], 0, &queries, None), Status::InvalidHandle);
    assert_eq!(snapshot(&theirs), before);
}

#[test]
fn a_batch_of_no_sequences_selects_nothing() {
    let ctx = Context::new(&config()).unwrap();
    let mut none: [&mut Sequence<'_>; 0] = [];
    assert!(ctx.select_batch(&mut none, 0, &[] as &[f32], None).unwrap().is_empty());
}

#[test]
fn select_scored_refuses_what_select_refuses() {
    let ctx = Context::new(&config()).unwrap();
    let (mut seq, q, _) = prefilled(&ctx);
    let before = snapshot(&seq);
    for len in wrong_lengths(Q_LEN, HEAD_DIM) {
        expect_status(seq.select_scored(0, &vec![0f32; len], None), Status::Shape);
    }
    expect_status(seq.select_scored(0, &q, Some(0)), Status::Budget);
    expect_status(seq.select_scored(0, &q, Some(usize::MAX)), Status::Budget);
    expect_status(seq.select_scored(LAYERS, &q, None), Status::OutOfRange);
    assert_eq!(snapshot(&seq), before);
}

#[test]
fn kvcrush_importance_inputs_are_refused_by_name() {
    let mut rng = Rng(41);
    let (k, v) = kv(&mut rng);
    let ctx = Context::new(&config()).unwrap();
    let mut seq = ctx.open_sequence().unwrap();
    seq.append_prefill(0, &k, &v).unwrap();
    let good = vec![0.0f32; 4 * Q_LEN];
    expect_status(seq.observe(1, &good), Status::State); // layer 1 holds no tokens
    expect_status(seq.observe(LAYERS, &good), Status::OutOfRange);
    expect_status(seq.observe(0, &good[..Q_LEN - 1]), Status::Shape);
    expect_status(seq.observe(0, &[] as &[f32]), Status::Shape);
    expect_status(seq.observe(0, &vec![0.0f32; (TOKENS + 1) * Q_LEN]), Status::Shape);
    let error = expect_status(seq.observe_attention(0, &vec![0.0f32; Q_HEADS * TOKENS]), Status::State);
    assert!(error.message().contains("hamming_importance"), "{error}");
    let ctx = Context::new(&config().hamming_importance(Importance::Accumulated)).unwrap();
    let mut seq = ctx.open_sequence().unwrap();
    seq.append_prefill(0, &k, &v).unwrap();
    let mut probs = vec![0.01f32; Q_HEADS * TOKENS];
    probs[2 * TOKENS + 7] = -1.0;
    let error = expect_status(seq.observe_attention(0, &probs), Status::InvalidArgument);
    assert!(error.message().contains("query head 2, position 7"), "{error}");
    probs[2 * TOKENS + 7] = f32::NAN;
    expect_status(seq.observe_attention(0, &probs), Status::InvalidArgument);
    expect_status(seq.observe_attention(0, &vec![0.0f32; Q_HEADS * (TOKENS + 1)]), Status::Shape);
    expect_status(seq.observe_attention(0, &vec![0.0f32; Q_HEADS * TOKENS - 1]), Status::Shape);
}
