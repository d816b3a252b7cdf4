use std::marker::PhantomData;
use std::ops::{Deref, Range};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::context::Context;
use crate::error::{check, rust_error, shape_error, Result, Status};
use crate::session::session_id;
use crate::sys;
use crate::tensor::{buffer, product, Element, TensorMut, TensorRef};
use crate::working_set::WorkingSet;
use crate::Stats;

/// The result of [`Sequence::select`]: `count` ascending middle positions per KV head, and after
/// [`Sequence::select_scored`] the score each was ranked by.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    positions: Vec<i32>,
    scores: Option<Vec<f32>>,
    n_kv_heads: usize,
    width: usize,
    count: usize,
}

impl Selection {
    /// `positions` is `[n_kv_heads, width]` with `count <= width` valid per head.
    pub(crate) fn new(positions: Vec<i32>, n_kv_heads: usize, width: usize, count: usize) -> Self {
        Selection { positions, scores: None, n_kv_heads, width, count: count.min(width) }
    }

    /// Positions selected per KV head.
    pub fn count(&self) -> usize {
        self.count
    }

    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    /// The positions selected for one KV head (empty for a head past [`n_kv_heads`](Selection::n_kv_heads)).
    pub fn head(&self, head: usize) -> &[i32] {
        self.row(&self.positions, head)
    }

    /// The scores of one KV head's positions, aligned with [`Selection::head`]: the folded score the index ranked
    /// each by (see `kvret_select_scored`). `None` for a selection made by [`Sequence::select`]; an empty slice for
    /// a head past [`n_kv_heads`](Selection::n_kv_heads).
    pub fn scores(&self, head: usize) -> Option<&[f32]> {
        self.scores.as_ref().map(|s| self.row(s, head))
    }

    fn row<'a, T>(&self, buffer: &'a [T], head: usize) -> &'a [T] {
        if head >= self.n_kv_heads {
            return &[];
        }
        let start = head * self.width; // < buffer.len(): the buffer is [n_kv_heads, width]
        buffer.get(start..start + self.count).unwrap_or(&[])
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for &crate::Context {}
    impl Sealed for std::sync::Arc<crate::Context> {}
}

/// How a [`SequenceOf`] holds its context: `&'ctx Context` ([`Sequence`]) or `Arc<Context>` ([`ArcSequence`]).
///
/// Sealed: a handle must keep the context it points to alive, and the same one, for as long as it lives.
pub trait ContextHandle: sealed::Sealed + Deref<Target = Context> + Clone {}

impl ContextHandle for &Context {}
impl ContextHandle for Arc<Context> {}

/// One request or conversation: its keys and values are stored, indexed and retrieved by kvret.
///
/// `H` is how it holds its context: borrowed ([`Sequence`], from [`Context::open_sequence`]) or shared through an
/// `Arc` ([`ArcSequence`], from [`Context::open_sequence_arc`]); both have the same methods. A sequence is `Send`
/// but not `Sync`: one thread at a time uses it (mutating calls take `&mut self`), while distinct sequences run in
/// parallel. Dropping it closes it (`kvret_seq_close`) before it lets go of its context.
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<kvret::ArcSequence>(); // a sequence is not Sync
/// ```
#[derive(Debug)]
pub struct SequenceOf<H: ContextHandle> {
    raw: NonNull<sys::kvret_seq>,
    context: H,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

/// A sequence that borrows its [`Context`] (from [`Context::open_sequence`]): it cannot outlive it.
pub type Sequence<'ctx> = SequenceOf<&'ctx Context>;

/// A sequence that owns a share of its context (from [`Context::open_sequence_arc`]): `'static` and `Send`, so it
/// can live in a map beside the `Arc<Context>` or move into a spawned thread; the context is destroyed when the
/// last `Arc` (the sequences' included) is dropped.
pub type ArcSequence = SequenceOf<Arc<Context>>;

// SAFETY: kvret.h: different sequences may be used from different threads; one sequence from one thread at a time,
// which `&mut self` and !Sync guarantee. Both handles are Send (a Context is Send + Sync).
unsafe impl<H: ContextHandle + Send> Send for SequenceOf<H> {}

impl<'ctx> SequenceOf<&'ctx Context> {
    /// The context this sequence borrows.
    pub fn context(&self) -> &'ctx Context {
        self.context
    }
}

impl SequenceOf<Arc<Context>> {
    /// The context this sequence shares.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

impl<H: ContextHandle> SequenceOf<H> {
    /// Opens an empty sequence of the handle's context.
    pub(crate) fn open(context: H) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        check(unsafe { sys::kvret_seq_open(context.raw(), &mut raw) })?;
        Self::adopt(context, raw, "kvret_seq_open")
    }

    /// Opens the sequence saved under `id`; `None` on a miss.
    pub(crate) fn open_session(context: H, id: &[u8]) -> Result<Option<Self>> {
        let id = session_id(id, "session_id")?;
        let mut raw = std::ptr::null_mut();
        match check(unsafe { sys::kvret_session_open(context.raw(), id.as_ptr(), &mut raw) }) {
            Ok(()) => Self::adopt(context, raw, "kvret_session_open").map(Some),
            Err(error) if error.status() == Status::NotFound => Ok(None),
            Err(error) => Err(error),
        }
    }

    fn adopt(context: H, raw: *mut sys::kvret_seq, call: &str) -> Result<Self> {
        let raw =
            NonNull::new(raw).ok_or_else(|| rust_error(Status::Internal, format!("{call} returned no sequence")))?;
        Ok(SequenceOf { raw, context, _not_sync: PhantomData })
    }

    pub(crate) fn raw(&self) -> *mut sys::kvret_seq {
        self.raw.as_ptr()
    }

    /// Whether this sequence belongs to `context`.
    pub(crate) fn belongs_to(&self, context: &Context) -> bool {
        std::ptr::eq(&*self.context, context)
    }

    // ---- appending ----

    /// Appends prefill tokens to `layer`: k and v are compact `[tokens, n_kv_heads, head_dim]` (F16, Bf16 or f32),
    /// of the same length, a whole number of tokens. Schedules the layer's index build (in the background by
    /// default).
    pub fn append_prefill<T: Element>(&mut self, layer: usize, k: &[T], v: &[T]) -> Result<()> {
        let (_, n_kv, d) = self.context.geometry();
        let shape =
            [rows_of(k.len(), product("a token", &[n_kv, d])?, "k", "a token (n_kv_heads * head_dim)")?, n_kv, d];
        self.append_prefill_strided(layer, &TensorRef::named("k", k, &shape)?, &TensorRef::named("v", v, &shape)?)
    }

    /// [`append_prefill`](Self::append_prefill) with any `[tokens, n_kv_heads, head_dim]` views, e.g. heads-first
    /// memory seen through strides.
    pub fn append_prefill_strided<T: Element>(
        &mut self,
        layer: usize,
        k: &TensorRef<'_, T>,
        v: &TensorRef<'_, T>,
    ) -> Result<()> {
        let layer = layer_arg(layer)?;
        let (k, v) = (k.raw(), v.raw());
        check(unsafe { sys::kvret_append_prefill(self.raw(), layer, k.ptr(), v.ptr()) })
    }

    /// Appends one decode token to `layer`: k and v are exactly `[n_kv_heads, head_dim]`.
    pub fn append_decode<T: Element>(&mut self, layer: usize, k: &[T], v: &[T]) -> Result<()> {
        let (_, n_kv, d) = self.context.geometry();
        let (k, v) = (TensorRef::named("k", k, &[n_kv, d])?, TensorRef::named("v", v, &[n_kv, d])?);
        let layer = layer_arg(layer)?;
        let (k, v) = (k.raw(), v.raw());
        check(unsafe { sys::kvret_append_decode(self.raw(), layer, k.ptr(), v.ptr()) })
    }

    /// Waits until the index of `layer` (every layer for `None`) is built.
    pub fn wait_index(&mut self, layer: Option<usize>) -> Result<()> {
        let layer = layer.map_or(Ok(-1), layer_arg)?;
        check(unsafe { sys::kvret_wait_index(self.raw(), layer) })
    }

    /// A new sequence of the same context holding what this one holds (every layer's tokens and index), for beam
    /// search, parallel sampling or several continuations of one prompt. The two share their KV pages copy on
    /// write and are independent from then on (see `kvret_seq_fork`). It holds the context as this one does.
    pub fn fork(&mut self) -> Result<SequenceOf<H>> {
        let mut raw = std::ptr::null_mut();
        check(unsafe { sys::kvret_seq_fork(self.raw(), &mut raw) })?;
        Self::adopt(self.context.clone(), raw, "kvret_seq_fork")
    }

    /// Rolls the sequence back to its first `length` tokens in every layer (speculative decoding: drop the
    /// rejected draft tokens; regeneration). The sequence is then as if the dropped tokens had never been
    /// appended; on failure nothing changes (see `kvret_seq_truncate`).
    pub fn truncate(&mut self, length: usize) -> Result<()> {
        let length = i64::try_from(length).unwrap_or(i64::MAX); // beyond every layer: a no-op
        check(unsafe { sys::kvret_seq_truncate(self.raw(), length) })
    }

    /// Context-window truncation: drops `count` tokens of every layer after its first `keep` tokens (keep 0: the
    /// earliest tokens; keep = n_sink keeps the attention sinks, as StreamingLLM does). The later tokens move `count`
    /// positions earlier: with [`Config::rope_keys`](crate::Config::rope_keys) their keys are rotated at their new
    /// positions (exactly as in a sequence given only the remaining tokens), without it they stay as given. Each
    /// shortened layer's index is rebuilt, on the calling thread, so the sequence selects as one given the remaining
    /// tokens. A layer holding at most `keep` tokens is unchanged; one holding fewer than keep + count keeps its
    /// first `keep`. Count 0 changes nothing; on failure nothing changes (see `kvret_seq_drop_front`).
    pub fn drop_front(&mut self, keep: usize, count: usize) -> Result<()> {
        // past i64: past every layer, which means the same as i64::MAX
        let (keep, count) = (i64::try_from(keep).unwrap_or(i64::MAX), i64::try_from(count).unwrap_or(i64::MAX));
        check(unsafe { sys::kvret_seq_drop_front(self.raw(), keep, count) })
    }

    // ---- sessions ----

    /// Saves what this sequence holds now under `session_id` (a `&str`, its UTF-8, or bytes: 1 to 255 bytes without
    /// a NUL, else status `InvalidArgument`) in the context's session store, replacing an older save of that id
    /// once the new one is whole. The sequence is unchanged: go on appending to it, or drop it; a later turn reopens
    /// it with [`Context::open_session`]. Errors (nothing changes): status `Capacity` for a session that fits no
    /// tier, `Io` when a disk write it needs fails (a full disk), `Unsupported` for a sequence of a context with
    /// `hamming_fraction` > 0 (KVCrush's state is not saved).
    pub fn save_session(&mut self, session_id: impl AsRef<[u8]>) -> Result<()> {
        let id = crate::session::session_id(session_id.as_ref(), "session_id")?;
        check(unsafe { sys::kvret_session_save(self.raw(), id.as_ptr()) })
    }

    // ---- queries ----

    /// Tokens stored for `layer`.
    pub fn length(&self, layer: usize) -> Result<usize> {
        let mut tokens = 0i64;
        check(unsafe { sys::kvret_seq_length(self.raw(), layer_arg(layer)?, &mut tokens) })?;
        count_of(tokens, "kvret_seq_length")
    }

    /// The budget select uses by default for `layer` at its current length.
    pub fn budget(&self, layer: usize) -> Result<usize> {
        let mut budget = 0i32;
        check(unsafe { sys::kvret_seq_budget(self.raw(), layer_arg(layer)?, &mut budget) })?;
        count_of(budget.into(), "kvret_seq_budget")
    }

    /// Upper bound of the working-set rows for `layer` at `budget` (`None`: the default budget).
    pub fn working_set_capacity(&self, layer: usize, budget: Option<usize>) -> Result<usize> {
        let mut rows = 0i64;
        check(unsafe {
            sys::kvret_working_set_capacity(self.raw(), layer_arg(layer)?, budget_arg(budget)?, &mut rows)
        })?;
        count_of(rows, "kvret_working_set_capacity")
    }

    pub fn stats(&self) -> Result<Stats> {
        let mut stats = Stats::default();
        check(unsafe { sys::kvret_stats_init(&mut stats) })?;
        check(unsafe { sys::kvret_seq_stats(self.raw(), &mut stats) })?;
        Ok(stats)
    }

    // ---- retrieval ----

    /// The width of the positions buffer of a selection at `budget`: never wider than the layer, so that an absurd
    /// budget is refused by the library (status Budget) rather than by a failed allocation; a budget past i32 is
    /// refused before anything is allocated.
    pub(crate) fn select_width(&self, layer: usize, budget: Option<usize>) -> Result<usize> {
        budget_arg(budget)?;
        let width = match budget {
            Some(b) => b.min(self.length(layer)?),
            None => self.budget(layer)?,
        };
        Ok(width.max(1))
    }

    /// Selects the top `budget` middle tokens of every KV head (`None`: the default budget) for query q
    /// (exactly `[n_q_heads, head_dim]`).
    pub fn select<Q: Element>(&mut self, layer: usize, q: &[Q], budget: Option<usize>) -> Result<Selection> {
        let (n_q, n_kv, d) = self.context.geometry();
        TensorRef::named("q", q, &[n_q, d])?; // checked before anything is allocated
        let width = self.select_width(layer, budget)?;
        let mut positions = buffer(product("positions", &[n_kv, width])?, "positions")?;
        let count = self.select_into(layer, q, budget, &mut positions)?;
        Ok(Selection::new(positions, n_kv, width, count))
    }

    /// [`Sequence::select`] with the score of each position (read with [`Selection::scores`]): the folded score
    /// the index ranked it by, see `kvret_select_scored`.
    pub fn select_scored<Q: Element>(&mut self, layer: usize, q: &[Q], budget: Option<usize>) -> Result<Selection> {
        let (n_q, n_kv, d) = self.context.geometry();
        let q = TensorRef::named("q", q, &[n_q, d])?;
        let width = self.select_width(layer, budget)?;
        let elements = product("positions", &[n_kv, width])?;
        let mut positions = buffer(elements, "positions")?;
        let mut scores = buffer(elements, "scores")?;
        let mut positions_tensor = TensorMut::named("positions", &mut positions, &[n_kv, width])?;
        let mut scores_tensor = TensorMut::named("scores", &mut scores, &[n_kv, width])?;
        let (layer, budget) = (layer_arg(layer)?, budget_arg(budget)?);
        let (q, p, s) = (q.raw(), positions_tensor.raw(), scores_tensor.raw());
        let mut count = 0i32;
        check(unsafe { sys::kvret_select_scored(self.raw(), layer, q.ptr(), budget, p.ptr(), s.ptr(), &mut count) })?;
        let mut selection = Selection::new(positions, n_kv, width, count_of(count.into(), "kvret_select_scored")?);
        selection.scores = Some(scores);
        Ok(selection)
    }

    /// Attention of q (exactly `[n_q_heads, head_dim]`) over this step's working set of `layer`, in one call:
    /// select, fetch and attention inside kvret (see `kvret_seq_attend`). `None` budget: the default one. Returns
    /// `[n_q_heads, head_dim]` floats.
    pub fn attend<Q: Element>(&mut self, layer: usize, q: &[Q], budget: Option<usize>) -> Result<Vec<f32>> {
        let (n_q, _, d) = self.context.geometry();
        let q = TensorRef::named("q", q, &[n_q, d])?;
        let (layer, budget) = (layer_arg(layer)?, budget_arg(budget)?);
        let mut out = buffer(product("out", &[n_q, d])?, "the attention output")?;
        let mut out_tensor = TensorMut::named("out", &mut out, &[n_q, d])?;
        let (q, out_raw) = (q.raw(), out_tensor.raw());
        check(unsafe {
            sys::kvret_seq_attend(self.raw(), layer, q.ptr(), budget, 0.0, out_raw.ptr(), std::ptr::null_mut())
        })?;
        Ok(out)
    }

    /// Selects into `positions`, `[n_kv_heads, width]` (its length a multiple of n_kv_heads, with width >= the
    /// budget); returns the count per head.
    pub fn select_into<Q: Element>(
        &mut self,
        layer: usize,
        q: &[Q],
        budget: Option<usize>,
        positions: &mut [i32],
    ) -> Result<usize> {
        let (n_q, n_kv, d) = self.context.geometry();
        let q = TensorRef::named("q", q, &[n_q, d])?;
        let width = rows_of(positions.len(), n_kv, "positions", "n_kv_heads")?;
        let mut out = TensorMut::named("positions", positions, &[n_kv, width])?;
        let (layer, budget) = (layer_arg(layer)?, budget_arg(budget)?);
        let (q, out) = (q.raw(), out.raw());
        let mut count = 0i32;
        check(unsafe { sys::kvret_select(self.raw(), layer, q.ptr(), budget, out.ptr(), &mut count) })?;
        count_of(count.into(), "kvret_select")
    }

    /// KVCrush's eviction-only mode (`kvret_seq_retained_set`): the middle positions to keep per KV head of `layer`
    /// after its prefill, for an engine that drops KV instead of offloading it. No query: SnapKV's top tokens by
    /// importance from the queries given to [`Sequence::observe`] (else a window of the layer's last 32 keys; under
    /// `Importance::Accumulated`, the accumulated attention once a step was observed), plus floor(hamming_fraction *
    /// count) bucket
    /// representatives of the other middle tokens (the context's `hamming_fraction`; 0 gives SnapKV's set exactly).
    /// Sink and local tokens are kept besides and not counted in `budget` (`None`: the default budget). The
    /// selection holds min(budget, middle tokens) ascending positions per head. Changes nothing in the sequence.
    /// Errors: status `State` when the layer holds no tokens (no observation window), `Budget` for a budget of 0 or
    /// above the layer's length, `OutOfRange` for a bad layer.
    pub fn retained_set(&mut self, layer: usize, budget: Option<usize>) -> Result<Selection> {
        let (_, n_kv, _) = self.context.geometry();
        let width = self.select_width(layer, budget)?;
        let mut positions = buffer(product("positions", &[n_kv, width])?, "positions")?;
        let count = self.retained_set_into(layer, budget, &mut positions)?;
        Ok(Selection::new(positions, n_kv, width, count))
    }

    /// [`Sequence::retained_set`] into `positions`, `[n_kv_heads, width]` (its length a multiple of n_kv_heads, with
    /// width >= the budget); returns the count per head.
    pub fn retained_set_into(&mut self, layer: usize, budget: Option<usize>, positions: &mut [i32]) -> Result<usize> {
        let (_, n_kv, _) = self.context.geometry();
        let width = rows_of(positions.len(), n_kv, "positions", "n_kv_heads")?;
        let mut out = TensorMut::named("positions", positions, &[n_kv, width])?;
        let (layer, budget) = (layer_arg(layer)?, budget_arg(budget)?);
        let out = out.raw();
        let mut count = 0i32;
        check(unsafe { sys::kvret_seq_retained_set(self.raw(), layer, budget, out.ptr(), &mut count) })?;
        count_of(count.into(), "kvret_seq_retained_set")
    }

    /// Gives KVCrush the prompt's observation window of `layer` (`kvret_seq_observe`): the queries of its last w
    /// prompt tokens, `[w, n_q_heads, head_dim]` (w from the slice's length; 1 <= w <= the layer's length), after the
    /// layer's prefill. From then on the importance behind the layer's KVCrush signatures (one bit per query head),
    /// representatives and [`Sequence::retained_set`] comes from these queries instead of the layer's last 32 keys.
    /// A second call replaces the window. Errors: status `State` when the layer holds no tokens, `Shape` for a
    /// wrong shape, `OutOfRange` for a bad layer; nothing changes then.
    pub fn observe<Q: Element>(&mut self, layer: usize, q_window: &[Q]) -> Result<()> {
        let (n_q, _, d) = self.context.geometry();
        let w = rows_of(q_window.len(), product("a query row", &[n_q, d])?, "q_window", "n_q_heads * head_dim")?;
        let q = TensorRef::named("q_window", q_window, &[w, n_q, d])?;
        let layer = layer_arg(layer)?;
        let q = q.raw();
        check(unsafe { sys::kvret_seq_observe(self.raw(), layer, q.ptr()) })
    }

    /// Adds one decode step's attention probabilities of `layer`, `[n_q_heads, n]` (n from the slice's length;
    /// 1 <= n <= the layer's length; finite and >= 0), to its accumulated attention (H2O;
    /// `kvret_seq_observe_attention`), on a context with [`Importance::Accumulated`](crate::Importance). Once a
    /// layer has a step, its KVCrush signatures, representatives and [`Sequence::retained_set`] come from the sums.
    /// Errors: status `State` on a context without accumulated importance or a layer holding no tokens, `Shape` for
    /// a wrong shape, `InvalidArgument` for a negative or non-finite value; nothing changes then.
    pub fn observe_attention<P: Element>(&mut self, layer: usize, probs: &[P]) -> Result<()> {
        let (n_q, _, _) = self.context.geometry();
        let n = rows_of(probs.len(), n_q, "probs", "n_q_heads")?;
        let p = TensorRef::named("probs", probs, &[n_q, n])?;
        let layer = layer_arg(layer)?;
        let p = p.raw();
        check(unsafe { sys::kvret_seq_observe_attention(self.raw(), layer, p.ptr()) })
    }

    /// Fetches the working set of a selection into new buffers of element type `T` (the KV dtype or f32).
    pub fn fetch<T: Element>(&mut self, layer: usize, selection: &Selection) -> Result<WorkingSet<T>> {
        let (_, n_kv, d) = self.context.geometry();
        check_selection(selection, n_kv)?;
        let capacity = if selection.count > 0 {
            self.working_set_capacity(layer, Some(selection.count))?
        } else {
            self.length(layer)?
        };
        let mut working_set = WorkingSet::new(n_kv, capacity, d)?;
        self.fetch_into(layer, selection, &mut working_set)?;
        Ok(working_set)
    }

    /// Writes the working set of a selection into `working_set` (made for this context's `n_kv_heads` and
    /// `head_dim`); returns the rows per head.
    pub fn fetch_into<T: Element>(
        &mut self,
        layer: usize,
        selection: &Selection,
        working_set: &mut WorkingSet<T>,
    ) -> Result<usize> {
        let (_, n_kv, d) = self.context.geometry();
        check_selection(selection, n_kv)?;
        if working_set.n_kv_heads != n_kv || working_set.head_dim != d {
            return Err(shape_error(format!(
                "working set of {} heads x {} dims for a model of {n_kv} x {d}",
                working_set.n_kv_heads, working_set.head_dim
            )));
        }
        let count = i32::try_from(selection.count).map_err(|_| rust_error(Status::Budget, "count past i32"))?;
        let layer = layer_arg(layer)?;
        let positions = TensorRef::named("positions", &selection.positions, &[n_kv, selection.width])?;
        let shape = [n_kv, working_set.capacity, d];
        let mut k = TensorMut::named("working_set.k", &mut working_set.k, &shape)?;
        let mut v = TensorMut::named("working_set.v", &mut working_set.v, &shape)?;
        let mut rows_positions = TensorMut::named("working_set.positions", &mut working_set.positions, &shape[..2])?;
        let (positions, k, v, rows_positions) = (positions.raw(), k.raw(), v.raw(), rows_positions.raw());
        let set = sys::kvret_working_set { k: k.tensor, v: v.tensor, positions: rows_positions.tensor };
        let mut rows = 0i64;
        let status = unsafe {
            sys::kvret_fetch_async(self.raw(), layer, positions.ptr(), count, &set, &mut rows, std::ptr::null_mut())
        };
        check(status)?;
        working_set.rows = count_of(rows, "kvret_fetch_async")?.min(working_set.capacity);
        Ok(working_set.rows)
    }

    /// Experimental: the stored keys and values of `positions` of `layer` (within its length), each
    /// `[len, n_kv_heads, head_dim]`. A range outside the layer is an error of status `OutOfRange`, refused before
    /// anything is allocated.
    pub fn read<T: Element>(&self, layer: usize, positions: Range<usize>) -> Result<(Vec<T>, Vec<T>)> {
        let (_, n_kv, d) = self.context.geometry();
        let length = self.length(layer)?;
        if positions.start > positions.end || positions.end > length {
            return Err(rust_error(
                Status::OutOfRange,
                format!(
                    "range [{}, {}) is outside the {length} tokens of layer {layer}",
                    positions.start, positions.end
                ),
            ));
        }
        let len = positions.end - positions.start;
        let elements = product("read", &[len, n_kv, d])?;
        let (mut k, mut v) = (buffer(elements, "the keys read")?, buffer(elements, "the values read")?);
        let shape = [len, n_kv, d];
        let (mut k_view, mut v_view) = (TensorMut::named("k", &mut k, &shape)?, TensorMut::named("v", &mut v, &shape)?);
        let (k_out, v_out) = (k_view.raw(), v_view.raw());
        // both fit an i64: they are at most the layer's length, an i64
        let (layer, begin, end) = (layer_arg(layer)?, positions.start as i64, positions.end as i64);
        check(unsafe { sys::kvret_seq_read(self.raw(), layer, begin, end, k_out.ptr(), v_out.ptr()) })?;
        Ok((k, v))
    }

    /// Experimental: selects with a guessed next query (exactly `[n_q_heads, head_dim]`); the layer's next fetch
    /// counts the rows it takes from that selection as prefetch hits (the speculative hit rate). Nothing is loaded
    /// ahead yet.
    pub fn prefetch<Q: Element>(&mut self, layer: usize, q_guess: &[Q], budget: Option<usize>) -> Result<()> {
        let (n_q, _, d) = self.context.geometry();
        let q = TensorRef::named("q_guess", q_guess, &[n_q, d])?;
        let (layer, budget) = (layer_arg(layer)?, budget_arg(budget)?);
        let q = q.raw();
        check(unsafe { sys::kvret_prefetch_async(self.raw(), layer, q.ptr(), budget, std::ptr::null_mut()) })
    }
}

impl<H: ContextHandle> Drop for SequenceOf<H> {
    fn drop(&mut self) {
        // The handle (a borrow, or a share of the Arc) is dropped after this body: the sequence closes first.
        unsafe { sys::kvret_seq_close(self.raw()) };
    }
}

/// `len / row`, or a Shape error when `len` is not a whole number of rows.
pub(crate) fn rows_of(len: usize, row: usize, name: &str, row_name: &str) -> Result<usize> {
    if row == 0 || len % row != 0 {
        return Err(shape_error(format!("{name} has {len} elements, not a whole number of {row_name} = {row}")));
    }
    Ok(len / row)
}

/// A selection made for another geometry (another context) is refused before the call.
fn check_selection(selection: &Selection, n_kv: usize) -> Result<()> {
    if selection.n_kv_heads != n_kv {
        return Err(shape_error(format!("a selection of {} KV heads for a model of {n_kv}", selection.n_kv_heads)));
    }
    Ok(())
}

/// A count or size the library returned (never negative).
pub(crate) fn count_of(value: i64, call: &str) -> Result<usize> {
    usize::try_from(value).map_err(|_| rust_error(Status::Internal, format!("{call} returned {value}")))
}

/// The layer for the C call: a layer past i32 is out of range, as the library says for one past n_layers.
pub(crate) fn layer_arg(layer: usize) -> Result<i32> {
    i32::try_from(layer).map_err(|_| rust_error(Status::OutOfRange, format!("layer {layer} does not fit an i32")))
}

pub(crate) fn budget_arg(budget: Option<usize>) -> Result<i32> {
    match budget {
        None => Ok(sys::KVRET_BUDGET_DEFAULT),
        Some(b) => i32::try_from(b).map_err(|_| rust_error(Status::Budget, format!("budget {b} does not fit an i32"))),
    }
}
