//! `Sequence::retained_set`: KVCrush's eviction-only mode (`kvret_seq_retained_set`).

mod common;

use common::*;
use kvret::{Context, IndexKind, Status};

#[test]
fn snapkv_base_plus_representatives() {
    let mut rng = Rng(15);
    let (k, v) = kv(&mut rng);
    let plain = Context::new(&config().index_kind(IndexKind::Streaming)).unwrap();
    let crushed = Context::new(&config().index_kind(IndexKind::Streaming).hamming_fraction(0.25)).unwrap();
    let mut a = plain.open_sequence().unwrap();
    let mut b = crushed.open_sequence().unwrap();
    a.append_prefill(0, &k, &v).unwrap();
    b.append_prefill(0, &k, &v).unwrap();
    let kept = b.retained_set(0, Some(40)).unwrap();
    assert_eq!(kept.count(), 40);
    let base = a.retained_set(0, Some(30)).unwrap(); // floor(0.25 * 40) = 10 representatives
    for h in 0..KV_HEADS {
        let row = kept.head(h);
        assert!(row.windows(2).all(|w| w[0] < w[1]), "distinct and ascending");
        assert!(row.iter().all(|&p| p as usize >= SINK && (p as usize) < TOKENS - LOCAL), "middle positions");
        assert!(base.head(h).iter().all(|p| row.binary_search(p).is_ok()), "the important part is SnapKV's set");
    }
    // into a caller's buffer; the call changes nothing: the same answer again
    let mut out = vec![-1i32; KV_HEADS * 64];
    assert_eq!(b.retained_set_into(0, Some(40), &mut out).unwrap(), 40);
    for h in 0..KV_HEADS {
        assert_eq!(&out[h * 64..h * 64 + 40], kept.head(h));
        assert!(out[h * 64 + 40..(h + 1) * 64].iter().all(|&p| p == -1));
    }
}

#[test]
fn refusals_name_the_problem() {
    let mut rng = Rng(16);
    let ctx = Context::new(&config().hamming_fraction(0.25)).unwrap();
    let mut seq = ctx.open_sequence().unwrap();
    let (k, v) = kv(&mut rng);
    seq.append_prefill(0, &k, &v).unwrap();
    let error = seq.retained_set(1, Some(8)).expect_err("layer 1 holds no tokens");
    assert_eq!(error.status(), Status::State, "{error}");
    assert!(error.message().contains("observation window"), "{error}");
    let error = seq.retained_set(0, Some(0)).expect_err("budget 0");
    assert_eq!(error.status(), Status::Budget, "{error}");
    assert!(error.message().contains("budget"), "{error}");
    let error = seq.retained_set(LAYERS, Some(8)).expect_err("layer out of range");
    assert_eq!(error.status(), Status::OutOfRange, "{error}");
    let mut odd = vec![-1i32; KV_HEADS * 8 + 1];
    let error = seq.retained_set_into(0, Some(8), &mut odd).expect_err("not [n_kv_heads, width]");
    assert_eq!(error.status(), Status::Shape, "{error}");
    assert!(odd.iter().all(|&p| p == -1), "nothing written");
}
