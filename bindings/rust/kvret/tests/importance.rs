//! `Sequence::observe` and `Sequence::observe_attention`: where KVCrush's importance comes from (the prompt's
//! queries, or accumulated attention under `Importance::Accumulated`).

mod common;

use common::*;
use kvret::{Context, Importance};

#[test]
fn the_keys_as_a_query_window_give_the_keys_rule() {
    let mut rng = Rng(31);
    let (k, v) = kv(&mut rng);
    let ctx = Context::new(&config().n_q_heads(KV_HEADS).hamming_fraction(0.25)).unwrap();
    let mut a = ctx.open_sequence().unwrap();
    let mut b = ctx.open_sequence().unwrap();
    a.append_prefill(0, &k, &v).unwrap();
    b.append_prefill(0, &k, &v).unwrap();
    b.observe(0, &k[(TOKENS - 32) * TOKEN_LEN..]).unwrap(); // [32, n_q_heads = n_kv_heads, head_dim]
    let (x, y) = (a.retained_set(0, Some(40)).unwrap(), b.retained_set(0, Some(40)).unwrap());
    for h in 0..KV_HEADS {
        assert_eq!(x.head(h), y.head(h));
    }
    // other queries choose otherwise
    b.observe(0, &rng.gaussian(8 * KV_HEADS * HEAD_DIM)).unwrap();
    let z = b.retained_set(0, Some(40)).unwrap();
    assert!((0..KV_HEADS).any(|h| z.head(h) != x.head(h)));
}

#[test]
fn accumulated_attention_drives_the_retained_set() {
    let mut rng = Rng(32);
    let (k, v) = kv(&mut rng);
    let ctx = Context::new(&config().hamming_importance(Importance::Accumulated)).unwrap();
    assert_eq!(ctx.config().raw().hamming_importance, Importance::Accumulated as i32);
    let mut seq = ctx.open_sequence().unwrap();
    seq.append_prefill(0, &k, &v).unwrap();
    let favourites = [50i32, 120, 121, 300, 301, 302];
    let mut probs = vec![0.0f32; Q_HEADS * TOKENS];
    for i in 0..Q_HEADS {
        for &p in &favourites {
            probs[i * TOKENS + p as usize] = 1.0 / favourites.len() as f32;
        }
    }
    seq.observe_attention(0, &probs).unwrap();
    let kept = seq.retained_set(0, Some(favourites.len())).unwrap();
    for h in 0..KV_HEADS {
        assert_eq!(kept.head(h), &favourites[..]);
    }
}
