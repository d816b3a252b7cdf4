//! Sessions across conversation turns (save_session, open_session, drop_session, schedule_sessions, session_tier,
//! flush_sessions) and context-window truncation (drop_front): round trips, misses, tiers, and bad input.

mod common;

use std::sync::Arc;

use common::*;
use kvret::{Context, KvretError, RopeLayout, SequenceOf, SessionPolicy, SessionTier, Status};

const SESSION_KV_BYTES: usize = 2 * LAYERS * TOKENS * TOKEN_LEN * 4;

#[track_caller]
fn expect_status<T: std::fmt::Debug>(result: kvret::Result<T>, status: Status, word: &str) -> KvretError {
    let error = result.expect_err("a bad value was accepted");
    assert_eq!(error.status(), status, "{error}");
    assert!(error.message().contains(word), "{error}");
    error
}

fn filled<'c>(ctx: &'c Context, tokens: usize, rng: &mut Rng) -> kvret::Sequence<'c> {
    let mut seq = ctx.open_sequence().unwrap();
    for layer in 0..LAYERS {
        let (k, v) = (rng.gaussian(tokens * TOKEN_LEN), rng.gaussian(tokens * TOKEN_LEN));
        seq.append_prefill(layer, &k, &v).unwrap();
    }
    seq
}

fn contents<H: kvret::ContextHandle>(seq: &SequenceOf<H>) -> Vec<(Vec<f32>, Vec<f32>)> {
    (0..LAYERS).map(|layer| seq.read::<f32>(layer, 0..seq.length(layer).unwrap()).unwrap()).collect()
}

fn assert_same_sequence<H: kvret::ContextHandle, G: kvret::ContextHandle>(
    a: &mut SequenceOf<H>,
    b: &mut SequenceOf<G>,
    rng: &mut Rng,
) {
    assert_eq!(contents(a), contents(b));
    let q = rng.gaussian(Q_LEN);
    for layer in 0..LAYERS {
        assert_eq!(a.select(layer, &q, None).unwrap(), b.select(layer, &q, None).unwrap());
        assert_eq!(a.attend(layer, &q, None).unwrap(), b.attend(layer, &q, None).unwrap());
    }
}

#[test]
fn save_then_open_gives_the_same_sequence() {
    let mut rng = Rng(0x5e55);
    let ctx = Context::new(&config()).unwrap();
    let mut seq = filled(&ctx, TOKENS, &mut rng);
    seq.save_session("conversation-1").unwrap();
    assert_eq!(ctx.session_tier("conversation-1").unwrap(), Some(SessionTier::Dram));
    let mut reopened = ctx.open_session("conversation-1").unwrap().expect("a saved session");
    assert_same_sequence(&mut seq, &mut reopened, &mut rng);
    let token = rng.gaussian(TOKEN_LEN);
    reopened.append_decode(0, &token, &token).unwrap(); // independent of the saved sequence
    assert_eq!((reopened.length(0).unwrap(), seq.length(0).unwrap()), (TOKENS + 1, TOKENS));
    drop(reopened);
    let stats = ctx.stats().unwrap();
    assert_eq!((stats.session_saves, stats.session_hits_dram, stats.session_misses), (1, 1, 0));
    assert_eq!(stats.session_dram_count, 1);
    assert!(stats.session_dram_bytes >= SESSION_KV_BYTES as i64);
}

#[test]
fn a_miss_is_none_and_drop_says_whether_there_was_a_session() {
    let mut rng = Rng(11);
    let ctx = Context::new(&config()).unwrap();
    let mut seq = filled(&ctx, 40, &mut rng);
    assert!(ctx.open_session("never-saved").unwrap().is_none());
    assert_eq!(ctx.session_tier("never-saved").unwrap(), None);
    assert!(!ctx.drop_session("never-saved").unwrap());
    seq.save_session(b"a").unwrap(); // bytes ids are the same ids as their str
    assert!(ctx.drop_session("a").unwrap());
    assert_eq!(ctx.session_tier("a").unwrap(), None);
    assert!(ctx.open_session("a").unwrap().is_none());
    assert!(!ctx.drop_session(String::from("a")).unwrap());
    let stats = ctx.stats().unwrap();
    assert_eq!((stats.session_misses, stats.sequences), (2, 1)); // a miss opens no sequence
}

#[test]
fn ids_are_their_utf8_bytes_and_arc_sequences_open_too() {
    let mut rng = Rng(12);
    let ctx = Arc::new(Context::new(&config()).unwrap());
    let mut seq = ctx.open_sequence_arc().unwrap();
    let (k, v) = kv(&mut rng);
    seq.append_prefill(0, &k, &v).unwrap();
    seq.save_session("café-🙂").unwrap();
    assert_eq!(ctx.session_tier("café-🙂".as_bytes()).unwrap(), Some(SessionTier::Dram));
    assert_eq!(ctx.session_tier("cafe-🙂").unwrap(), None);
    let longest = "x".repeat(255);
    seq.save_session(&longest).unwrap();
    assert_eq!(ctx.session_tier(&longest).unwrap(), Some(SessionTier::Dram));
    seq.save_session([0xffu8, 0xfe]).unwrap(); // any bytes but NUL
    let reopened = ctx.open_session_arc([0xffu8, 0xfe]).unwrap().expect("a saved session");
    let worker = std::thread::spawn(move || reopened.length(0).unwrap()); // 'static + Send
    assert_eq!(worker.join().unwrap(), TOKENS);
}

#[test]
fn sessions_move_to_the_disk_tier_and_open_from_it() {
    let mut rng = Rng(13);
    let dir = std::env::temp_dir().join(format!("kvret-rust-sessions-{}", std::process::id()));
    let config = config()
        .disk_path(dir.to_str())
        .session_dram_bytes(SESSION_KV_BYTES * 3 / 2)
        .session_policy(SessionPolicy::Lru);
    {
        let ctx = Context::new(&config).unwrap();
        assert_eq!(ctx.config().disk_path_str(), dir.to_str());
        let (mut first, mut second) = (filled(&ctx, TOKENS, &mut rng), filled(&ctx, TOKENS, &mut rng));
        first.save_session("first").unwrap();
        second.save_session("second").unwrap(); // DRAM holds one of them: the first moves to disk
        ctx.flush_sessions().unwrap();
        assert_eq!(ctx.session_tier("first").unwrap(), Some(SessionTier::Disk));
        assert_eq!(ctx.session_tier("second").unwrap(), Some(SessionTier::Dram));
        let stats = ctx.stats().unwrap();
        assert!(stats.session_evictions >= 1 && stats.disk_bytes > 0, "{stats:?}");
        let mut reopened = ctx.open_session("first").unwrap().expect("a session on disk");
        assert_same_sequence(&mut first, &mut reopened, &mut rng);
        assert_eq!(ctx.stats().unwrap().session_hits_disk, 1);
        ctx.schedule_sessions(["second", "first", "second"]).unwrap();
        ctx.schedule_sessions(Vec::<String>::new()).unwrap();
        ctx.schedule_sessions(vec![b"first".to_vec()]).unwrap();
        ctx.flush_sessions().unwrap();
        assert!(ctx.drop_session("first").unwrap());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_new_context_on_the_same_directory_sees_the_saved_sessions() {
    let mut rng = Rng(16);
    let dir = std::env::temp_dir().join(format!("kvret-rust-persisted-{}", std::process::id()));
    let config = config().disk_path(dir.to_str());
    let expected = {
        let ctx = Context::new(&config.clone().session_dram_bytes(1)).unwrap();
        let mut seq = filled(&ctx, TOKENS, &mut rng);
        seq.save_session("persisted").unwrap(); // fits no DRAM: straight to disk
        assert_eq!(ctx.session_tier("persisted").unwrap(), Some(SessionTier::Disk));
        contents(&seq)
    };
    {
        let ctx = Context::new(&config).unwrap();
        assert_eq!(ctx.session_tier("persisted").unwrap(), Some(SessionTier::Disk));
        let reopened = ctx.open_session("persisted").unwrap().expect("a session left on disk");
        assert_eq!(contents(&reopened), expected);
        drop(reopened);
        assert!(ctx.drop_session("persisted").unwrap());
    }
    assert_eq!(Context::new(&config).unwrap().session_tier("persisted").unwrap(), None);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn drop_front_keeps_the_first_tokens_and_moves_the_rest() {
    let mut rng = Rng(14);
    let ctx = Context::new(&config()).unwrap();
    let mut seq = ctx.open_sequence().unwrap();
    let (k0, v0) = kv(&mut rng);
    let (k1, v1) = (rng.gaussian(10 * TOKEN_LEN), rng.gaussian(10 * TOKEN_LEN));
    seq.append_prefill(0, &k0, &v0).unwrap();
    seq.append_prefill(1, &k1, &v1).unwrap();
    seq.drop_front(SINK, 100).unwrap();
    assert_eq!(seq.length(0).unwrap(), TOKENS - 100);
    assert_eq!(seq.length(1).unwrap(), SINK); // fewer than keep + count tokens: the rest is dropped
    let without = |x: &[f32]| [&x[..SINK * TOKEN_LEN], &x[(SINK + 100) * TOKEN_LEN..]].concat();
    assert_eq!(seq.read::<f32>(0, 0..TOKENS - 100).unwrap(), (without(&k0), without(&v0)));
    assert_eq!(seq.read::<f32>(1, 0..SINK).unwrap().0, k1[..SINK * TOKEN_LEN].to_vec());
    assert!(seq.select(0, &rng.gaussian(Q_LEN), None).unwrap().count() > 0);
    seq.drop_front(0, 0).unwrap();
    seq.drop_front(usize::MAX, usize::MAX).unwrap(); // past every layer: a no-op
    assert_eq!(seq.length(0).unwrap(), TOKENS - 100);
    seq.drop_front(0, usize::MAX).unwrap();
    assert_eq!((seq.length(0).unwrap(), seq.length(1).unwrap()), (0, 0));
}

/// With pre-RoPE keys a token is rotated at the position it has now, so after drop_front the sequence holds what a
/// sequence given only the remaining tokens holds, whether or not kvret applies RoPE.
#[test]
fn drop_front_equals_a_sequence_of_the_tokens_left() {
    for rope_keys in [false, true] {
        let mut rng = Rng(17);
        let ctx = Context::new(&config().rope_keys(rope_keys)).unwrap();
        assert_eq!(ctx.config().raw().rope_keys, i32::from(rope_keys));
        let (mut a, mut b) = (ctx.open_sequence().unwrap(), ctx.open_sequence().unwrap());
        let (k, v) = kv(&mut rng);
        let without = |x: &[f32]| [&x[..SINK * TOKEN_LEN], &x[(SINK + 50) * TOKEN_LEN..]].concat();
        for layer in 0..LAYERS {
            a.append_prefill(layer, &k, &v).unwrap();
            b.append_prefill(layer, &without(&k), &without(&v)).unwrap();
        }
        a.drop_front(SINK, 50).unwrap();
        assert_same_sequence(&mut a, &mut b, &mut rng);
    }
}

#[test]
fn pre_rope_sessions_round_trip_through_disk_after_drop_front() {
    let mut rng = Rng(19);
    let dir = std::env::temp_dir().join(format!("kvret-rust-rope-{}", std::process::id()));
    {
        let ctx = Context::new(&config().rope_keys(true).disk_path(dir.to_str()).session_dram_bytes(1)).unwrap();
        let mut seq = filled(&ctx, TOKENS, &mut rng);
        seq.drop_front(SINK, 30).unwrap();
        seq.save_session("rope").unwrap();
        assert_eq!(ctx.session_tier("rope").unwrap(), Some(SessionTier::Disk));
        let mut reopened = ctx.open_session("rope").unwrap().expect("a session on disk");
        assert_same_sequence(&mut seq, &mut reopened, &mut rng);
        let token = rng.gaussian(TOKEN_LEN);
        seq.append_decode(0, &token, &token).unwrap();
        reopened.append_decode(0, &token, &token).unwrap(); // rotated at the same position in both
        assert_same_sequence(&mut seq, &mut reopened, &mut rng);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_session_ids_are_refused_and_change_nothing() {
    let mut rng = Rng(15);
    let ctx = Context::new(&config()).unwrap();
    let mut seq = filled(&ctx, 40, &mut rng);
    seq.save_session("kept").unwrap();
    let before = ctx.stats().unwrap();
    let (too_long, two_byte) = ("x".repeat(256), "é".repeat(128)); // 256 bytes each
    let bad: [(&[u8], &str); 5] =
        [(b"", "empty"), (too_long.as_bytes(), "256"), (two_byte.as_bytes(), "256"), (b"a\0b", "NUL"), (b"\0", "NUL")];
    for (id, word) in bad {
        for error in [
            expect_status(seq.save_session(id), Status::InvalidArgument, word),
            expect_status(ctx.open_session(id).map(|s| s.is_some()), Status::InvalidArgument, word),
            expect_status(ctx.drop_session(id), Status::InvalidArgument, word),
            expect_status(ctx.session_tier(id), Status::InvalidArgument, word),
            expect_status(ctx.schedule_sessions([b"kept".as_slice(), id]), Status::InvalidArgument, word),
        ] {
            assert!(error.message().contains("session_id"), "{error}");
        }
    }
    let error = expect_status(ctx.schedule_sessions(["a", "b", ""]), Status::InvalidArgument, "empty");
    assert!(error.message().contains("session_ids[2]"), "{error}");
    assert_eq!(ctx.stats().unwrap(), before);
    assert_eq!(ctx.session_tier("kept").unwrap(), Some(SessionTier::Dram));
    assert_eq!(seq.length(0).unwrap(), 40);
}

#[test]
fn invalid_session_and_rope_config_values() {
    let bad = [
        (config().session_dram_bytes(-1i64), "session_dram_bytes"),
        (config().session_disk_bytes(-1i64), "session_disk_bytes"),
        (config().session_ttl_ms(-1i64), "session_ttl_ms"),
        (config().rope_dims(3), "rope_dims"),
        (config().rope_dims(-2), "rope_dims"),
        (config().rope_dims(HEAD_DIM + 2), "rope_dims"),
        (config().rope_dims(1u64 << 40), "rope_dims"), // past i32: refused by the crate
        (config().rope_theta(0.0), "rope_theta"),
        (config().rope_theta(f32::NAN), "rope_theta"),
        (config().rope_theta(f32::INFINITY), "rope_theta"),
        (config().rope_scale_factor(0.5), "rope_scale_factor"),
        (config().rope_scale_factor(-1.0), "rope_scale_factor"),
        (config().rope_low_freq_factor(0.0), "rope_low_freq_factor"),
        (config().rope_high_freq_factor(1.0), "rope_high_freq_factor"), // not above the low factor (1)
        (config().rope_high_freq_factor(f32::NAN), "rope_high_freq_factor"),
        (config().rope_original_max_positions(0), "rope_original_max_positions"),
        (config().rope_original_max_positions(-5), "rope_original_max_positions"),
        (config().session_ttl_ms(u64::MAX), "session_ttl_ms"), // past i64: refused by the crate
        (config().session_shared_url(Some("redis://local\0host")), "session_shared_url"),
        (config().disk_path(Some("/tmp/a\0b")), "disk_path"),
    ];
    for (config, field) in bad {
        let error = Context::new(&config).expect_err(field);
        assert_eq!(error.status(), Status::InvalidArgument, "{error}");
        assert!(error.message().contains(field), "{error}");
    }
    // the last value set wins
    let fixed = config().session_shared_url(Some("a\0b")).session_shared_url(None);
    assert!(Context::new(&fixed).is_ok());
}

/// Whether this build serves the shared tier or not, the URL crosses: the context has it, or the library refused it by
/// name (no server listens on port 1).
#[test]
fn the_shared_url_reaches_the_library() {
    let url = "redis://127.0.0.1:1/0?prefix=kvret-rust&timeout_ms=200";
    let config = config().session_shared_url(Some(url));
    assert_eq!(config.session_shared_url_str(), Some(url));
    assert_eq!(config.clone().session_shared_url_str(), Some(url));
    match Context::new(&config) {
        Ok(ctx) => assert_eq!(ctx.config().session_shared_url_str(), Some(url)),
        Err(error) => assert!(error.message().contains("session_shared_url"), "{error}"),
    }
}

#[test]
fn session_and_rope_fields_round_trip() {
    let config = config()
        .session_policy(SessionPolicy::Fifo)
        .rope_layout(RopeLayout::Gptj)
        .session_ttl_ms(60_000)
        .session_dram_bytes(1u64 << 40);
    let ctx = Context::new(&config).unwrap();
    let raw = ctx.config().raw();
    assert_eq!(raw.session_policy, SessionPolicy::Fifo as i32);
    assert_eq!(raw.rope_layout, RopeLayout::Gptj as i32);
    assert_eq!((raw.session_ttl_ms, raw.session_dram_bytes), (60_000, 1 << 40));
    assert!(raw.session_shared_url.is_null() && raw.disk_path.is_null());
    assert_eq!(ctx.config().session_shared_url_str(), None);
}

#[test]
fn disk_paths_are_utf8_both_ways() {
    let mut rng = Rng(18);
    let parent = std::env::temp_dir().join(format!("kvret-rust-utf8-{}", std::process::id()));
    let dir = parent.join("café-🙂");
    {
        let ctx = Context::new(&config().disk_path(dir.to_str()).session_dram_bytes(1)).unwrap();
        assert_eq!(ctx.config().disk_path_str(), dir.to_str());
        let mut seq = filled(&ctx, 40, &mut rng);
        seq.save_session("s").unwrap();
        assert_eq!(ctx.session_tier("s").unwrap(), Some(SessionTier::Disk));
        assert!(dir.is_dir());
    }
    let _ = std::fs::remove_dir_all(&parent);
}
