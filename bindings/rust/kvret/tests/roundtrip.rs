//! prefill -> select -> fetch -> attend through slices, errors as `Err`, RAII and threads.

mod common;

use common::*;
use kvret::{Context, KvDtype, Sequence, Status, TensorRef, F16};

fn reference_attention(q: &[f32], k: &[f32], v: &[f32], rows: usize, capacity: usize) -> Vec<f64> {
    let group = Q_HEADS / KV_HEADS;
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    let mut out = vec![0f64; Q_HEADS * HEAD_DIM];
    for h in 0..Q_HEADS {
        let base = (h / group) * capacity * HEAD_DIM;
        let logits: Vec<f64> = (0..rows)
            .map(|r| {
                let row = &k[base + r * HEAD_DIM..base + (r + 1) * HEAD_DIM];
                scale * row.iter().zip(&q[h * HEAD_DIM..]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
            })
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
        let sum: f64 = weights.iter().sum();
        for (r, w) in weights.iter().enumerate() {
            for d in 0..HEAD_DIM {
                out[h * HEAD_DIM + d] += w / sum * v[base + r * HEAD_DIM + d] as f64;
            }
        }
    }
    out
}

#[test]
fn round_trip() -> kvret::Result<()> {
    let mut rng = Rng(42);
    let ctx = Context::new(&config())?;
    let mut seq = ctx.open_sequence()?;
    for layer in 0..LAYERS {
        let (k, v) = kv(&mut rng);
        seq.append_prefill(layer, &k, &v)?;
    }
    seq.wait_index(None)?;
    for layer in 0..LAYERS {
        assert_eq!(seq.length(layer)?, TOKENS);
        let q = rng.gaussian(Q_HEADS * HEAD_DIM);
        let selection = seq.select(layer, &q, None)?;
        assert_eq!(selection.count(), BUDGET);
        for head in 0..KV_HEADS {
            let positions = selection.head(head);
            assert!(positions.windows(2).all(|w| w[0] < w[1]), "ascending");
            assert!(positions.iter().all(|&p| p as usize >= SINK && (p as usize) < TOKENS - LOCAL), "middle");
        }
        let ws = seq.fetch::<f32>(layer, &selection)?;
        assert_eq!(ws.rows(), SINK + BUDGET + LOCAL);
        assert_eq!(ws.positions(0)[0], 0);
        assert_eq!(*ws.positions(1).last().unwrap() as usize, TOKENS - 1);

        let out = ctx.attend(&q, &ws)?;
        let expected = reference_attention(&q, ws.k_buffer(), ws.v_buffer(), ws.rows(), ws.capacity());
        for (got, want) in out.iter().zip(&expected) {
            assert!((*got as f64 - want).abs() < 1e-4, "{got} vs {want}");
        }
    }
    Ok(())
}

#[test]
fn fetched_rows_equal_stored_rows() -> kvret::Result<()> {
    let mut rng = Rng(7);
    let ctx = Context::new(&config())?;
    let mut seq = ctx.open_sequence()?;
    let (k, v) = kv(&mut rng);
    seq.append_prefill(0, &k, &v)?;
    let selection = seq.select(0, &rng.gaussian(Q_HEADS * HEAD_DIM), None)?;
    let ws = seq.fetch::<f32>(0, &selection)?;
    for head in 0..KV_HEADS {
        for (row, &position) in ws.positions(head).iter().enumerate() {
            let stored = (position as usize * KV_HEADS + head) * HEAD_DIM;
            assert_eq!(&ws.k(head)[row * HEAD_DIM..(row + 1) * HEAD_DIM], &k[stored..stored + HEAD_DIM]);
            assert_eq!(&ws.v(head)[row * HEAD_DIM..(row + 1) * HEAD_DIM], &v[stored..stored + HEAD_DIM]);
        }
    }
    let (k_read, _) = seq.read::<f32>(0, 10..20)?;
    assert_eq!(k_read, k[10 * KV_HEADS * HEAD_DIM..20 * KV_HEADS * HEAD_DIM]);
    Ok(())
}

#[test]
fn strided_views_and_half_precision() -> kvret::Result<()> {
    let mut rng = Rng(3);
    let ctx = Context::new(&config().kv_dtype(KvDtype::F16))?;
    let mut seq = ctx.open_sequence()?;
    // [KV_HEADS, TOKENS, HEAD_DIM] memory seen as [TOKENS, KV_HEADS, HEAD_DIM].
    let heads_first: Vec<F16> = rng.gaussian(KV_HEADS * TOKENS * HEAD_DIM).into_iter().map(F16::from).collect();
    let strides = [HEAD_DIM, TOKENS * HEAD_DIM, 1];
    let view = TensorRef::strided(&heads_first, &[TOKENS, KV_HEADS, HEAD_DIM], &strides)?;
    seq.append_prefill_strided(0, &view, &view)?;
    let (k, _) = seq.read::<F16>(0, 5..6)?;
    assert_eq!(k[HEAD_DIM + 3], heads_first[(TOKENS + 5) * HEAD_DIM + 3]);
    let selection = seq.select(0, &rng.gaussian(Q_HEADS * HEAD_DIM), None)?;
    let ws = seq.fetch::<F16>(0, &selection)?;
    assert_eq!(ws.rows(), SINK + BUDGET + LOCAL);
    Ok(())
}

#[test]
fn half_conversions_round_trip() {
    for x in [0.0f32, -0.0, 1.0, -2.5, 65504.0, 6.1035156e-5, 5.9604645e-8, 0.333_251_95] {
        assert_eq!(f32::from(F16::from(x)), x, "{x}");
    }
    assert!(f32::from(F16::from(1e6)).is_infinite());
    assert_eq!(f32::from(kvret::Bf16::from(1.5f32)), 1.5);
}

#[test]
fn errors_carry_status_and_message() -> kvret::Result<()> {
    let mut rng = Rng(11);
    let ctx = Context::new(&config())?;
    let mut seq = ctx.open_sequence()?;
    let (k, v) = kv(&mut rng);
    seq.append_prefill(0, &k, &v)?;
    let q = rng.gaussian(Q_HEADS * HEAD_DIM);

    let error = seq.append_prefill(LAYERS, &k, &v).unwrap_err();
    assert_eq!(error.status(), Status::OutOfRange);
    assert!(error.message().contains(&LAYERS.to_string()), "{error}");
    assert!(error.to_string().starts_with("[KVRET_ERR_OUT_OF_RANGE]"), "{error}");

    let error = seq.select(0, &q, Some(0)).unwrap_err();
    assert_eq!(error.status(), Status::Budget);
    assert!(!error.message().is_empty());

    // A wrong geometry is caught before the call, the sequence is unchanged.
    let error = seq.append_prefill(0, &k[..100], &v[..100]).unwrap_err();
    assert_eq!(error.status(), Status::Shape);
    assert_eq!(seq.length(0)?, TOKENS);

    let error = Context::new(&config().n_q_heads(6).n_kv_heads(4)).unwrap_err();
    assert_eq!(error.status(), Status::InvalidArgument);
    assert_eq!(Status::from_code(error.status().code()), error.status());
    for fraction in [-0.1f32, 0.75, f32::NAN] {
        let error = Context::new(&config().pq_exact_fraction(fraction)).unwrap_err();
        assert_eq!(error.status(), Status::InvalidArgument);
        assert!(error.message().contains("pq_exact_fraction"), "{error}");
    }
    Ok(())
}

#[test]
fn distinct_sequences_on_threads() -> kvret::Result<()> {
    fn run(seq: &mut Sequence<'_>, seed: u64) -> kvret::Result<Vec<Vec<i32>>> {
        let mut rng = Rng(seed);
        let (k, v) = kv(&mut rng);
        seq.append_prefill(1, &k, &v)?;
        (0..4).map(|_| Ok(seq.select(1, &rng.gaussian(Q_HEADS * HEAD_DIM), None)?.head(1).to_vec())).collect()
    }
    let ctx = Context::new(&config())?;
    let expected: Vec<_> = (0..4).map(|s| run(&mut ctx.open_sequence()?, s + 100)).collect::<kvret::Result<_>>()?;
    let got: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|s| {
                let ctx = &ctx;
                scope.spawn(move || run(&mut ctx.open_sequence()?, s + 100))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect::<kvret::Result<Vec<_>>>()
    })?;
    assert_eq!(expected, got);

    let mut a = ctx.open_sequence()?;
    let mut b = ctx.open_sequence()?;
    let mut rng = Rng(5);
    for seq in [&mut a, &mut b] {
        let (k, v) = kv(&mut rng);
        seq.append_prefill(0, &k, &v)?;
    }
    let q = rng.gaussian(2 * Q_HEADS * HEAD_DIM);
    let batch = ctx.select_batch(&mut [&mut a, &mut b], 0, &q, None)?;
    assert_eq!(batch[1], b.select(0, &q[Q_HEADS * HEAD_DIM..], None)?);
    assert!(ctx.stats()?.selections >= 3);
    Ok(())
}

#[test]
fn effective_config_and_version() -> kvret::Result<()> {
    let ctx = Context::new(&config().seed(u64::MAX).n_threads(2i32).max_seq_tokens(1i64 << 40))?;
    assert_eq!(ctx.config().raw().n_kv_heads, KV_HEADS as i32);
    assert_eq!((ctx.config().raw().n_threads, ctx.config().raw().max_seq_tokens), (2, 1 << 40)); // the C types too
    assert_eq!(ctx.config().raw().seed, u64::MAX);
    assert_eq!(ctx.config().disk_path_str(), None);
    assert!(kvret::version().starts_with("0."));
    Ok(())
}

#[test]
fn truncate_rolls_back_decode_steps() -> kvret::Result<()> {
    let mut rng = Rng(11);
    let ctx = Context::new(&config())?;
    let mut a = ctx.open_sequence()?;
    let mut b = ctx.open_sequence()?;
    let (k, v) = kv(&mut rng);
    a.append_prefill(0, &k, &v)?;
    b.append_prefill(0, &k, &v)?;
    for _ in 0..5 {
        // draft tokens, then rejected
        let step = rng.gaussian(KV_HEADS * HEAD_DIM);
        a.append_decode(0, &step, &step)?;
    }
    assert_eq!(a.length(0)?, TOKENS + 5);
    a.truncate(TOKENS)?;
    assert_eq!(a.length(0)?, TOKENS);
    let q = rng.gaussian(Q_HEADS * HEAD_DIM);
    assert_eq!(a.select(0, &q, None)?, b.select(0, &q, None)?);
    a.truncate(usize::MAX)?; // beyond every layer: nothing to drop
    assert_eq!(a.length(0)?, TOKENS);
    Ok(())
}

#[test]
fn fork_branches_independently() -> kvret::Result<()> {
    let mut rng = Rng(13);
    let ctx = Context::new(&config())?;
    let mut parent = ctx.open_sequence()?;
    let mut direct = ctx.open_sequence()?;
    let (k, v) = kv(&mut rng);
    parent.append_prefill(0, &k, &v)?;
    direct.append_prefill(0, &k, &v)?;
    let mut child = parent.fork()?;
    assert_eq!(child.length(0)?, TOKENS);
    let step = rng.gaussian(KV_HEADS * HEAD_DIM);
    child.append_decode(0, &step, &step)?;
    direct.append_decode(0, &step, &step)?;
    assert_eq!(parent.length(0)?, TOKENS);
    let q = rng.gaussian(Q_HEADS * HEAD_DIM);
    assert_eq!(child.select(0, &q, None)?, direct.select(0, &q, None)?);
    drop(child);
    assert_eq!(parent.length(0)?, TOKENS);
    Ok(())
}

#[test]
fn sequence_attend_equals_select_fetch_attend() -> kvret::Result<()> {
    let mut rng = Rng(17);
    let ctx = Context::new(&config())?;
    let mut seq = ctx.open_sequence()?;
    let (k, v) = kv(&mut rng);
    seq.append_prefill(0, &k, &v)?;
    let q = rng.gaussian(Q_HEADS * HEAD_DIM);
    let got = seq.attend(0, &q, None)?;
    let selection = seq.select(0, &q, None)?;
    let ws = seq.fetch::<f32>(0, &selection)?;
    assert_eq!(got, ctx.attend(&q, &ws)?);
    Ok(())
}

#[test]
fn absurd_budgets_are_refused_before_any_allocation() -> kvret::Result<()> {
    let mut rng = Rng(19);
    let ctx = Context::new(&config())?;
    let mut seq = ctx.open_sequence()?;
    let (k, v) = kv(&mut rng);
    seq.append_prefill(0, &k, &v)?;
    let q = rng.gaussian(Q_HEADS * HEAD_DIM);
    for budget in [1usize << 40, usize::MAX, 1_000_000_000, TOKENS + 1] {
        let err = seq.select(0, &q, Some(budget)).expect_err("an absurd budget was accepted");
        assert_eq!(err.status(), kvret::Status::Budget, "{budget}: {err}");
        let err = ctx.select_batch(&mut [&mut seq], 0, &q, Some(budget)).expect_err("accepted in a batch");
        assert_eq!(err.status(), kvret::Status::Budget, "{budget}: {err}");
    }
    Ok(())
}

#[test]
fn sequence_attend_refuses_bad_values() -> kvret::Result<()> {
    let mut rng = Rng(23);
    let ctx = Context::new(&config())?;
    let mut seq = ctx.open_sequence()?;
    let (k, v) = kv(&mut rng);
    seq.append_prefill(0, &k, &v)?;
    let q = rng.gaussian(Q_HEADS * HEAD_DIM);
    assert_eq!(seq.attend(0, &q[..Q_HEADS * HEAD_DIM / 2], None).unwrap_err().status(), kvret::Status::Shape);
    assert_eq!(seq.attend(7, &q, None).unwrap_err().status(), kvret::Status::OutOfRange);
    assert_eq!(seq.attend(0, &q, Some(TOKENS + 1)).unwrap_err().status(), kvret::Status::Budget);
    assert_eq!(seq.length(0)?, TOKENS);
    Ok(())
}

#[test]
fn select_scored_ranks_the_selection() -> kvret::Result<()> {
    let mut rng = Rng(29);
    let ctx = Context::new(&config())?;
    let mut seq = ctx.open_sequence()?;
    let (k, v) = kv(&mut rng);
    seq.append_prefill(0, &k, &v)?;
    let q = rng.gaussian(Q_HEADS * HEAD_DIM);
    let middle = TOKENS - SINK - LOCAL;
    let all = seq.select_scored(0, &q, Some(middle))?;
    let top = seq.select_scored(0, &q, Some(20))?;
    let plain = seq.select(0, &q, Some(20))?;
    assert!(plain.scores(0).is_none());
    for head in 0..KV_HEADS {
        assert_eq!(top.head(head), plain.head(head));
        let every = all.scores(head).expect("scored");
        let sum: f64 = every.iter().map(|&s| f64::from(s)).sum();
        assert!((sum - (Q_HEADS / KV_HEADS) as f64).abs() < 1e-3, "{sum}"); // one softmax per query head
        let scores = top.scores(head).expect("scored");
        let lowest = scores.iter().cloned().fold(f32::INFINITY, f32::min);
        for (&p, &s) in top.head(head).iter().zip(scores) {
            assert_eq!(s, every[p as usize - SINK]); // independent of the budget
        }
        for (t, &s) in every.iter().enumerate().take(middle) {
            if !top.head(head).contains(&((t + SINK) as i32)) {
                assert!(s <= lowest);
            }
        }
    }
    Ok(())
}

#[test]
fn fetch_batch_equals_one_fetch_per_sequence() -> kvret::Result<()> {
    let mut rng = Rng(11);
    let ctx = Context::new(&config())?;
    let lengths = [200usize, 400, 650];
    let (mut batched, mut single) = (Vec::new(), Vec::new());
    for &tokens in &lengths {
        let (k, v) = (rng.gaussian(tokens * TOKEN_LEN), rng.gaussian(tokens * TOKEN_LEN));
        for group in [&mut batched, &mut single] {
            let mut seq = ctx.open_sequence()?;
            seq.append_prefill(1, &k, &v)?;
            group.push(seq);
        }
    }
    let q = rng.gaussian(3 * Q_LEN);
    let mut refs: Vec<&mut Sequence> = batched.iter_mut().collect();
    let selections = ctx.select_batch(&mut refs, 1, &q, None)?;
    let sets = ctx.fetch_batch::<f32, _>(&mut refs, 1, &selections)?;
    for (i, seq) in single.iter_mut().enumerate() {
        let expected = seq.fetch::<f32>(1, &selections[i])?;
        assert_eq!(sets[i].rows(), expected.rows());
        assert_eq!(sets[i].rows(), SINK + BUDGET + LOCAL);
        assert_eq!(sets[i].k_buffer(), expected.k_buffer(), "sequence {i}: keys");
        assert_eq!(sets[i].v_buffer(), expected.v_buffer(), "sequence {i}: values");
        for h in 0..KV_HEADS {
            assert_eq!(sets[i].positions(h), expected.positions(h));
        }
        let (a, b) = (batched[i].stats()?, seq.stats()?);
        assert_eq!((a.fetches, a.fetched_rows, a.cache_misses), (b.fetches, b.fetched_rows, b.cache_misses));
        assert_eq!(a.fetches, 1);
    }
    let mut none: Vec<&mut Sequence> = Vec::new();
    assert!(ctx.fetch_batch::<f32, _>(&mut none, 1, &[])?.is_empty());
    Ok(())
}

#[test]
fn fetch_batch_refuses_a_bad_entry_and_writes_nothing() -> kvret::Result<()> {
    let mut rng = Rng(12);
    let ctx = Context::new(&config())?;
    let mut seqs = Vec::new();
    for &tokens in &[400usize, 200, 400] {
        let mut seq = ctx.open_sequence()?;
        seq.append_prefill(0, &rng.gaussian(tokens * TOKEN_LEN), &rng.gaussian(tokens * TOKEN_LEN))?;
        seqs.push(seq);
    }
    // entry 1 gets a selection of 300 per head, above the 180 middle tokens of its 200
    let wide = seqs[0].select(0, &rng.gaussian(Q_LEN), Some(300))?;
    let mut selections = Vec::new();
    for seq in seqs.iter_mut() {
        selections.push(seq.select(0, &rng.gaussian(Q_LEN), None)?);
    }
    let good = selections[1].clone();
    selections[1] = wide;
    let mut outs: Vec<kvret::WorkingSet<f32>> =
        (0..3).map(|_| kvret::WorkingSet::new(KV_HEADS, SINK + 300 + LOCAL, HEAD_DIM)).collect::<kvret::Result<_>>()?;
    let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
    let error = ctx.fetch_batch_into(&mut refs, 0, &selections, &mut outs).unwrap_err();
    assert_eq!(error.status(), Status::Budget);
    assert!(error.message().contains("counts[1]"), "{}", error.message());
    for out in &outs {
        assert!(out.k_buffer().iter().all(|&x| x == 0.0), "nothing written");
        assert_eq!(out.rows(), 0);
    }
    for seq in refs.iter() {
        assert_eq!(seq.stats()?.fetches, 0);
    }
    selections[1] = good;
    let rows = ctx.fetch_batch_into(&mut refs, 0, &selections, &mut outs)?;
    assert_eq!(rows, vec![SINK + BUDGET + LOCAL; 3]);
    for seq in refs.iter() {
        assert_eq!(seq.stats()?.fetches, 1);
    }
    Ok(())
}
