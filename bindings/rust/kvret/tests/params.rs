//! Each design's parameters in one struct (`Config::new().pq(PqParams::new().m(8))`): the values reach the context,
//! and bad ones (out of range, past the C type, a flat field set next to its struct) are errors with a status and a
//! message naming the field, and no context.

mod common;

use common::*;
use kvret::{
    ClusterParams, Context, CrushParams, Importance, PqParams, QuantParams, SessionParams, SessionPolicy, Status,
};

#[track_caller]
fn refused(config: &kvret::Config, status: Status, prefix: &str, part: &str) {
    let error = Context::new(config).map(|_| ()).expect_err("a bad value was accepted");
    assert_eq!(error.status(), status, "{error}");
    assert!(error.message().starts_with(prefix), "{}", error.message());
    assert!(error.message().contains(part), "{}", error.message());
}

#[test]
fn defaults_are_the_flat_defaults() {
    let flat = kvret::Config::new();
    let (pq, crush, session) = (PqParams::new(), CrushParams::new(), SessionParams::new());
    assert_eq!(pq.raw().struct_size, std::mem::size_of::<kvret::sys::kvret_pq_params>());
    assert_eq!(
        (pq.raw().m, pq.raw().bits, pq.raw().exact_fraction),
        (flat.raw().pq_m, 6, flat.raw().pq_exact_fraction)
    );
    assert_eq!(ClusterParams::new().raw().tokens, flat.raw().cluster_tokens);
    assert_eq!(QuantParams::new().raw().rerank, flat.raw().quant_rerank);
    assert_eq!(crush.raw().importance, flat.raw().hamming_importance);
    assert_eq!(session.raw().policy, flat.raw().session_policy);
}

#[test]
fn grouped_values_take_effect() {
    let grouped = config()
        .index_kind(kvret::IndexKind::Pq)
        .pq(PqParams::new().m(8usize).bits(4).exact_fraction(0.125))
        .cluster(ClusterParams::new().tokens(48).reuse_steps(3))
        .quant(QuantParams::new().bits(1).group_size(32))
        .crush(CrushParams::new().fraction(0.25).importance(Importance::Accumulated))
        .session(SessionParams::new().ttl_ms(1234).policy(SessionPolicy::Fifo));
    let ctx = Context::new(&grouped).unwrap();
    let got = ctx.config().raw();
    assert_eq!((got.pq_m, got.pq_bits, got.pq_exact_fraction, got.pq_iters), (8, 4, 0.125, 0));
    assert_eq!((got.cluster_tokens, got.cluster_reuse_steps, got.cluster_decode_k), (48, 3, 4));
    assert_eq!((got.quant_bits, got.quant_group_size, got.quant_residual), (1, 32, 64));
    assert_eq!((got.hamming_fraction, got.hamming_importance), (0.25, Importance::Accumulated as i32));
    assert_eq!((got.session_ttl_ms, got.session_policy), (1234, SessionPolicy::Fifo as i32));
    assert!(got.pq.is_null() && got.session.is_null());

    // the flat setters, kept for one release, still work
    let ctx = Context::new(&config().pq_m(16usize)).unwrap();
    assert_eq!(ctx.config().raw().pq_m, 16);
}

#[test]
fn out_of_range_names_the_struct_field() {
    let bad = Status::InvalidArgument;
    refused(&config().pq(PqParams::new().m(3)), bad, "config.pq.m: ", "does not divide head_dim 64");
    refused(&config().pq(PqParams::new().exact_fraction(0.75)), bad, "config.pq.exact_fraction: ", "[0, 0.5]");
    refused(&config().cluster(ClusterParams::new().reuse_steps(2000)), bad, "config.cluster.reuse_steps: ", "0..1024");
    refused(&config().quant(QuantParams::new().bits(3)), bad, "config.quant.bits: ", "1 or 2");
    refused(&config().crush(CrushParams::new().fraction(1.0)), bad, "config.crush.fraction: ", "[0, 1)");
    refused(&config().session(SessionParams::new().ttl_ms(-1)), bad, "config.session.ttl_ms: ", ">= 0");
    // a value the C field cannot hold is refused before the library is called, naming the struct field
    refused(
        &config().pq(PqParams::new().m(u64::MAX)),
        bad,
        "kvret (rust): config.pq.m = ",
        "does not fit its C type int32_t",
    );
    refused(
        &config().session(SessionParams::new().dram_bytes(u64::MAX)),
        bad,
        "kvret (rust): config.session.dram_bytes = ",
        "int64_t",
    );
}

#[test]
fn a_flat_field_next_to_its_struct_is_refused() {
    let bad = Status::InvalidArgument;
    refused(
        &config().pq_m(8usize).pq(PqParams::new().bits(4)),
        bad,
        "config.pq_m is changed from its default and config.pq is given too",
        "set pq.m only",
    );
    refused(
        &config().hamming_importance(Importance::Accumulated).crush(CrushParams::new()),
        bad,
        "config.hamming_importance is changed",
        "crush.importance",
    );
    refused(
        &config().session_policy(SessionPolicy::Lru).session(SessionParams::new()),
        bad,
        "config.session_policy is changed",
        "session.policy",
    );
    // a flat field at its default is no conflict
    assert!(Context::new(&config().pq_bits(6).pq(PqParams::new().m(2))).is_ok());
}
