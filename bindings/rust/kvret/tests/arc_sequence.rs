//! Sequences that share an `Arc<Context>`: kept in a map beside the context, moved into spawned threads, and
//! keeping the context alive after every other handle is dropped.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Barrier, Weak};
use std::thread;

use common::*;
use kvret::{ArcSequence, Context, Sequence, Status};

fn assert_send_static<T: Send + 'static>() {}

/// Appends a prefill and a few decode steps to layer 1, then selects with a few queries: the selected positions.
fn work<H: kvret::ContextHandle>(seq: &mut kvret::SequenceOf<H>, seed: u64) -> kvret::Result<Vec<Vec<i32>>> {
    let mut rng = Rng(seed);
    let (k, v) = kv(&mut rng);
    seq.append_prefill(1, &k, &v)?;
    for _ in 0..3 {
        let step = rng.gaussian(TOKEN_LEN);
        seq.append_decode(1, &step, &step)?;
    }
    (0..4).map(|_| Ok(seq.select(1, &rng.gaussian(Q_LEN), None)?.head(1).to_vec())).collect()
}

#[test]
fn arc_sequences_are_send_and_static() {
    assert_send_static::<ArcSequence>();
    assert_send_static::<Arc<Context>>();
    assert_send_static::<Sequence<'static>>();
}

#[test]
fn sequences_move_into_threads_and_keep_the_context_alive() -> kvret::Result<()> {
    const THREADS: usize = 4;
    let ctx = Arc::new(Context::new(&config())?);
    let weak: Weak<Context> = Arc::downgrade(&ctx);
    // every thread waits until the main thread has dropped its Arc
    let dropped = Arc::new(Barrier::new(THREADS + 1));
    let workers: Vec<_> = (0..THREADS)
        .map(|i| {
            let mut seq = ctx.open_sequence_arc()?;
            let dropped = Arc::clone(&dropped);
            Ok(thread::spawn(move || {
                dropped.wait();
                let selected = work(&mut seq, 100 + i as u64)?;
                assert_eq!(seq.length(1)?, TOKENS + 3);
                // a fork shares the context too, and moves on to yet another thread
                let child = seq.fork()?;
                let grandchild = thread::spawn(move || child.length(1)).join().unwrap()?;
                assert_eq!(grandchild, TOKENS + 3);
                assert_eq!(seq.context().config().raw().n_layers, LAYERS as i32);
                kvret::Result::Ok(selected)
            }))
        })
        .collect::<kvret::Result<_>>()?;
    drop(ctx);
    assert!(weak.upgrade().is_some(), "the sequences hold the context");
    dropped.wait();
    let got: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect::<kvret::Result<_>>()?;
    assert!(weak.upgrade().is_none(), "the context was destroyed with its last sequence");

    // the same work through borrowed sequences of a fresh context selects the same positions
    let fresh = Context::new(&config())?;
    let expected: Vec<_> =
        (0..THREADS).map(|i| work(&mut fresh.open_sequence()?, 100 + i as u64)).collect::<kvret::Result<_>>()?;
    assert_eq!(got, expected);
    Ok(())
}

/// What a server keeps: the shared context and its open requests.
struct Server {
    ctx: Arc<Context>,
    requests: HashMap<u64, ArcSequence>,
}

impl Server {
    fn open(&mut self, id: u64) -> kvret::Result<()> {
        self.requests.insert(id, self.ctx.open_sequence_arc()?);
        Ok(())
    }
}

#[test]
fn sequences_live_in_a_map_beside_their_context() -> kvret::Result<()> {
    let mut server = Server { ctx: Arc::new(Context::new(&config())?), requests: HashMap::new() };
    for id in 0..3 {
        server.open(id)?;
    }
    let mut rng = Rng(9);
    for seq in server.requests.values_mut() {
        let (k, v) = kv(&mut rng);
        seq.append_prefill(0, &k, &v)?;
    }
    // a batch over sequences taken out of the map
    let mut a = server.requests.remove(&0).unwrap();
    let mut b = server.requests.remove(&1).unwrap();
    let q = rng.gaussian(2 * Q_LEN);
    let batch = server.ctx.select_batch(&mut [&mut a, &mut b], 0, &q, None)?;
    assert_eq!(batch[1], b.select(0, &q[Q_LEN..], None)?);
    assert_eq!(batch[0].count(), BUDGET);

    // a sequence of another context is refused in a batch
    let other = Arc::new(Context::new(&config())?);
    let mut stranger = other.open_sequence_arc()?;
    stranger.append_prefill(0, &kv(&mut rng).0, &kv(&mut rng).1)?;
    let error = server.ctx.select_batch(&mut [&mut a, &mut stranger], 0, &q, None).unwrap_err();
    assert_eq!(error.status(), Status::InvalidHandle);

    // the server goes away first; the requests it handed out still work
    let Server { ctx, requests } = server;
    drop(ctx);
    drop(requests);
    assert_eq!(a.length(0)?, TOKENS);
    assert_eq!(Arc::strong_count(a.context()), 2); // a and b
    Ok(())
}
