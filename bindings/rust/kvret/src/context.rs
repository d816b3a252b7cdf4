use std::ptr::NonNull;
use std::sync::Arc;

use crate::config::Config;
use crate::error::{check, rust_error, shape_error, Result, Status};
use crate::sequence::{budget_arg, count_of, layer_arg, ArcSequence, ContextHandle, Selection, Sequence, SequenceOf};
use crate::session::{session_id, SessionTier};
use crate::sys;
use crate::tensor::{buffer, product, Element, TensorMut, TensorRef};
use crate::working_set::WorkingSet;
use crate::Stats;

/// A kvret context: the model geometry, index settings and stores shared by its sequences.
///
/// A context is `Send + Sync` (the library's context is thread-safe). Its sequences hold it: a [`Sequence`]
/// borrows it, an [`ArcSequence`] shares an `Arc` of it, so it is dropped (`kvret_destroy`) only after all of them.
#[derive(Debug)]
pub struct Context {
    raw: NonNull<sys::kvret_context>,
    config: Config,
}

// SAFETY: kvret.h: "The context itself (create/destroy aside) is thread-safe"; destroy happens in Drop (exclusive).
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    /// Creates a context; the config is validated as a whole (a value a setter could not store, e.g. a count past
    /// the C field's range, is an error of status `InvalidArgument` naming the field).
    pub fn new(config: &Config) -> Result<Context> {
        config.check()?;
        let mut raw = std::ptr::null_mut();
        check(config.with_raw(|c| unsafe { sys::kvret_create(c, &mut raw) }))?;
        let raw = NonNull::new(raw).ok_or_else(|| rust_error(Status::Internal, "kvret_create returned no context"))?;
        // SAFETY: zeroed, then initialized by kvret_config_init before the library writes it.
        let mut effective: sys::kvret_config = unsafe { std::mem::zeroed() };
        let filled = check(unsafe { sys::kvret_config_init(&mut effective) })
            .and_then(|_| check(unsafe { sys::kvret_get_config(raw.as_ptr(), &mut effective) }));
        if let Err(error) = filled {
            unsafe { sys::kvret_destroy(raw.as_ptr()) };
            return Err(error);
        }
        Ok(Context { raw, config: Config::from_raw(effective) })
    }

    /// The effective config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    pub(crate) fn raw(&self) -> *mut sys::kvret_context {
        self.raw.as_ptr()
    }

    pub(crate) fn geometry(&self) -> (usize, usize, usize) {
        let c = self.config.raw();
        (c.n_q_heads as usize, c.n_kv_heads as usize, c.head_dim as usize)
    }

    /// Opens an empty sequence that borrows this context.
    pub fn open_sequence(&self) -> Result<Sequence<'_>> {
        SequenceOf::open(self)
    }

    /// Opens an empty sequence that shares this context: it holds a clone of the `Arc`, so it is `'static` and can
    /// be kept beside the `Arc` (e.g. in a map of a server's requests) or moved into another thread, and the
    /// context lives until the last of its `Arc`s and sequences is dropped.
    pub fn open_sequence_arc(self: &Arc<Self>) -> Result<ArcSequence> {
        SequenceOf::open(Arc::clone(self))
    }

    // ---- sessions across conversation turns ----

    /// A new sequence holding what [`Sequence::save_session`] saved under `session_id` (the same tokens, index and
    /// selections), borrowing this context; `Ok(None)` when no session has that id (never saved, dropped, expired
    /// or evicted); the session stays stored. A session id is a `&str` (its UTF-8) or bytes: 1 to 255 bytes without
    /// a NUL, else status `InvalidArgument`. A stored session whose files fail their checks is status `Corrupt`, and
    /// is dropped (the next open is `Ok(None)`).
    pub fn open_session(&self, session_id: impl AsRef<[u8]>) -> Result<Option<Sequence<'_>>> {
        SequenceOf::open_session(self, session_id.as_ref())
    }

    /// [`open_session`](Self::open_session) for an [`ArcSequence`], which shares this context.
    pub fn open_session_arc(self: &Arc<Self>, session_id: impl AsRef<[u8]>) -> Result<Option<ArcSequence>> {
        SequenceOf::open_session(Arc::clone(self), session_id.as_ref())
    }

    /// Removes a saved session from every tier: `Ok(true)` if there was one, `Ok(false)` if not.
    pub fn drop_session(&self, session_id: impl AsRef<[u8]>) -> Result<bool> {
        let id = session_id_arg(session_id.as_ref())?;
        match check(unsafe { sys::kvret_session_drop(self.raw(), id.as_ptr()) }) {
            Ok(()) => Ok(true),
            Err(error) if error.status() == Status::NotFound => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// The scheduler's job queue: the ids of the sessions it will run next, in order (ids may repeat; none clears
    /// it; an id need not be stored yet). It replaces the previous queue. With
    /// [`SessionPolicy::SchedulerAware`](crate::SessionPolicy), eviction keeps the sessions needed soonest, and
    /// those of the look-ahead window that are on disk are read into DRAM.
    pub fn schedule_sessions<I>(&self, session_ids: I) -> Result<()>
    where
        I: IntoIterator,
        I::Item: AsRef<[u8]>,
    {
        let ids = session_ids
            .into_iter()
            .enumerate()
            .map(|(i, id)| session_id(id.as_ref(), &format!("session_ids[{i}]")))
            .collect::<Result<Vec<_>>>()?;
        let n = i32::try_from(ids.len())
            .map_err(|_| rust_error(Status::InvalidArgument, format!("{} session ids (past i32)", ids.len())))?;
        let pointers: Vec<*const std::ffi::c_char> = ids.iter().map(|id| id.as_ptr()).collect();
        check(unsafe { sys::kvret_session_schedule(self.raw(), pointers.as_ptr(), n) })
    }

    /// Where a saved session is now; `None` when it is not stored.
    pub fn session_tier(&self, session_id: impl AsRef<[u8]>) -> Result<Option<SessionTier>> {
        let id = session_id_arg(session_id.as_ref())?;
        let mut tier = sys::KVRET_TIER_NONE;
        check(unsafe { sys::kvret_session_where(self.raw(), id.as_ptr(), &mut tier) })?;
        SessionTier::from_code(tier)
    }

    /// Waits until the session store's background writer has written every earlier save through to the shared
    /// tier, then returns the first failure, since the last flush, of the work the store does after a call has
    /// returned (a write-through to the shared tier; removing the files of a dropped, replaced or expired
    /// session), which no call reports itself.
    pub fn flush_sessions(&self) -> Result<()> {
        check(unsafe { sys::kvret_session_flush(self.raw()) })
    }

    /// Attention of q (exactly `[n_q_heads, head_dim]`) over a working set fetched for this context's geometry:
    /// `[n_q_heads, head_dim]` floats.
    pub fn attend<Q: Element, T: Element>(&self, q: &[Q], working_set: &WorkingSet<T>) -> Result<Vec<f32>> {
        let (n_q, n_kv, d) = self.geometry();
        if working_set.n_kv_heads != n_kv || working_set.head_dim != d {
            return Err(shape_error(format!(
                "working set of {} heads x {} dims for a model of {n_kv} x {d}",
                working_set.n_kv_heads, working_set.head_dim
            )));
        }
        let q = TensorRef::named("q", q, &[n_q, d])?;
        let shape = [n_kv, working_set.capacity, d];
        let k = TensorRef::named("working_set.k", &working_set.k, &shape)?;
        let v = TensorRef::named("working_set.v", &working_set.v, &shape)?;
        let mut out = buffer(product("out", &[n_q, d])?, "the attention output")?;
        self.attend_raw(&q, &k, &v, working_set.rows, 0.0, &mut TensorMut::named("out", &mut out, &[n_q, d])?)?;
        Ok(out)
    }

    /// Reference attention: `out[h] = softmax(scale * q[h] . k[g(h)]^T) v[g(h)]` over the first `rows` rows of k, v
    /// (`[n_kv_heads, >= rows, head_dim]`). A scale <= 0 means 1/sqrt(head_dim).
    pub fn attend_raw<Q: Element, T: Element>(
        &self,
        q: &TensorRef<'_, Q>,
        k: &TensorRef<'_, T>,
        v: &TensorRef<'_, T>,
        rows: usize,
        scale: f32,
        out: &mut TensorMut<'_, f32>,
    ) -> Result<()> {
        // more rows than an i64 holds are more than k holds: the library's error for too many rows
        let rows = i64::try_from(rows).map_err(|_| shape_error(format!("rows {rows} exceeds the rows of k")))?;
        let (q, k, v, out) = (q.raw(), k.raw(), v.raw(), out.raw());
        let null_stream = std::ptr::null_mut();
        check(unsafe { sys::kvret_attend(self.raw(), q.ptr(), k.ptr(), v.ptr(), rows, scale, out.ptr(), null_stream) })
    }

    /// [`Sequence::select`] for several distinct sequences of this context at once (all borrowing it, or all
    /// sharing it); q is exactly `[n, n_q_heads, head_dim]`.
    pub fn select_batch<Q: Element, H: ContextHandle>(
        &self,
        sequences: &mut [&mut SequenceOf<H>],
        layer: usize,
        q: &[Q],
        budget: Option<usize>,
    ) -> Result<Vec<Selection>> {
        let (n_q, n_kv, d) = self.geometry();
        let n = sequences.len();
        let q = TensorRef::named("q", q, &[n, n_q, d])?;
        let n_c = i32::try_from(n).map_err(|_| shape_error(format!("{n} sequences in one batch (past i32)")))?;
        if let Some(i) = sequences.iter().position(|s| !s.belongs_to(self)) {
            return Err(rust_error(Status::InvalidHandle, format!("sequences[{i}] belongs to another context")));
        }
        // never wider than the longest layer: an absurd budget is refused by the library, not by an allocation
        let width = sequences
            .iter()
            .map(|s| s.select_width(layer, budget))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .max()
            .unwrap_or(1);
        let mut positions = buffer(product("positions", &[n, n_kv, width])?, "positions")?;
        let mut counts = vec![0i32; n];
        let handles: Vec<*mut sys::kvret_seq> = sequences.iter().map(|s| s.raw()).collect();
        let (layer, budget) = (layer_arg(layer)?, budget_arg(budget)?);
        let mut out = TensorMut::named("positions", &mut positions, &[n, n_kv, width])?;
        let (q, out) = (q.raw(), out.raw());
        check(unsafe {
            sys::kvret_select_batch(
                self.raw(),
                n_c,
                handles.as_ptr(),
                layer,
                q.ptr(),
                budget,
                out.ptr(),
                counts.as_mut_ptr(),
            )
        })?;
        positions
            .chunks(n_kv * width)
            .zip(counts)
            .map(|(chunk, count)| {
                Ok(Selection::new(chunk.to_vec(), n_kv, width, count_of(count.into(), "kvret_select_batch")?))
            })
            .collect()
    }

    /// [`Sequence::fetch`] for several distinct sequences of this context in one call (`kvret_fetch_batch_async`):
    /// the working set of each sequence for its selection (as [`Context::select_batch`] returns them), into new
    /// buffers. The same bytes, row counts and stats as one fetch per sequence.
    ///
    /// [`Sequence::fetch`]: crate::SequenceOf::fetch
    pub fn fetch_batch<T: Element, H: ContextHandle>(
        &self,
        sequences: &mut [&mut SequenceOf<H>],
        layer: usize,
        selections: &[Selection],
    ) -> Result<Vec<WorkingSet<T>>> {
        let (_, n_kv, d) = self.geometry();
        if selections.len() != sequences.len() {
            return Err(shape_error(format!("{} selections for {} sequences", selections.len(), sequences.len())));
        }
        let mut working_sets = Vec::with_capacity(sequences.len());
        for (sequence, selection) in sequences.iter().zip(selections) {
            let length = sequence.length(layer)?;
            // a count above the length is the library's to refuse, naming the entry
            let capacity = if selection.count() > 0 {
                sequence.working_set_capacity(layer, Some(selection.count().min(length)))?
            } else {
                length
            };
            working_sets.push(WorkingSet::new(n_kv, capacity, d)?);
        }
        self.fetch_batch_into(sequences, layer, selections, &mut working_sets)?;
        Ok(working_sets)
    }

    /// [`Context::fetch_batch`] into working sets of the caller's (one per sequence, made for this context's
    /// `n_kv_heads` and `head_dim`); returns the rows per head of each. Every argument of every sequence is checked
    /// before anything is written: on an error no working set changes and the message names the entry.
    pub fn fetch_batch_into<T: Element, H: ContextHandle>(
        &self,
        sequences: &mut [&mut SequenceOf<H>],
        layer: usize,
        selections: &[Selection],
        working_sets: &mut [WorkingSet<T>],
    ) -> Result<Vec<usize>> {
        let (_, n_kv, d) = self.geometry();
        let n = sequences.len();
        if selections.len() != n || working_sets.len() != n {
            return Err(shape_error(format!(
                "{n} sequences, {} selections and {} working sets",
                selections.len(),
                working_sets.len()
            )));
        }
        let n_c = i32::try_from(n).map_err(|_| shape_error(format!("{n} sequences in one batch (past i32)")))?;
        if let Some(i) = sequences.iter().position(|s| !s.belongs_to(self)) {
            return Err(rust_error(Status::InvalidHandle, format!("sequences[{i}] belongs to another context")));
        }
        if let Some(i) = selections.iter().position(|s| s.n_kv_heads() != n_kv) {
            let heads = selections[i].n_kv_heads();
            return Err(shape_error(format!("selections[{i}] has {heads} KV heads for a model of {n_kv}")));
        }
        if let Some(i) = working_sets.iter().position(|w| w.n_kv_heads != n_kv || w.head_dim != d) {
            let (heads, dims) = (working_sets[i].n_kv_heads, working_sets[i].head_dim);
            return Err(shape_error(format!(
                "working_sets[{i}] is {heads} heads x {dims} dims for a model of {n_kv} x {d}"
            )));
        }
        // one [n, n_kv_heads, width] tensor and the counts, as kvret_select_batch writes them
        let width = selections.iter().map(Selection::count).max().unwrap_or(0).max(1);
        let mut positions = buffer(product("positions", &[n, n_kv, width])?, "positions")?;
        let mut counts = Vec::with_capacity(n);
        for (i, selection) in selections.iter().enumerate() {
            counts.push(
                i32::try_from(selection.count())
                    .map_err(|_| rust_error(Status::Budget, format!("selections[{i}]: count past i32")))?,
            );
            for h in 0..n_kv {
                let row = selection.head(h);
                positions[(i * n_kv + h) * width..][..row.len()].copy_from_slice(row);
            }
        }
        let layer = layer_arg(layer)?;
        let handles: Vec<*mut sys::kvret_seq> = sequences.iter().map(|s| s.raw()).collect();
        let positions_view = TensorRef::named("positions", &positions, &[n, n_kv, width])?;
        let mut views = Vec::with_capacity(n);
        for w in working_sets.iter_mut() {
            let shape = [n_kv, w.capacity, d];
            views.push((
                TensorMut::named("working_set.k", &mut w.k, &shape)?,
                TensorMut::named("working_set.v", &mut w.v, &shape)?,
                TensorMut::named("working_set.positions", &mut w.positions, &shape[..2])?,
            ));
        }
        let raws: Vec<_> = views.iter_mut().map(|(k, v, p)| (k.raw(), v.raw(), p.raw())).collect();
        let sets: Vec<sys::kvret_working_set> = raws
            .iter()
            .map(|(k, v, p)| sys::kvret_working_set { k: k.tensor, v: v.tensor, positions: p.tensor })
            .collect();
        let positions_raw = positions_view.raw();
        let mut rows = vec![0i64; n];
        check(unsafe {
            sys::kvret_fetch_batch_async(
                self.raw(),
                n_c,
                handles.as_ptr(),
                layer,
                positions_raw.ptr(),
                counts.as_ptr(),
                sets.as_ptr(),
                rows.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        drop(raws);
        drop(views);
        let mut out = Vec::with_capacity(n);
        for (w, r) in working_sets.iter_mut().zip(rows) {
            w.rows = count_of(r, "kvret_fetch_batch_async")?.min(w.capacity);
            out.push(w.rows);
        }
        Ok(out)
    }

    /// Waits for the work kvret enqueued on the default stream (a no-op on the CPU backend).
    pub fn synchronize(&self) -> Result<()> {
        check(unsafe { sys::kvret_synchronize(self.raw(), std::ptr::null_mut()) })
    }

    /// Statistics over the context's sequences, open and closed.
    pub fn stats(&self) -> Result<Stats> {
        let mut stats = Stats::default();
        check(unsafe { sys::kvret_stats_init(&mut stats) })?;
        check(unsafe { sys::kvret_context_stats(self.raw(), &mut stats) })?;
        Ok(stats)
    }
}

fn session_id_arg(id: &[u8]) -> Result<std::ffi::CString> {
    session_id(id, "session_id")
}

impl Drop for Context {
    fn drop(&mut self) {
        // Every sequence borrowed this context or held an Arc of it, so none is open any more.
        unsafe { sys::kvret_destroy(self.raw()) };
    }
}
