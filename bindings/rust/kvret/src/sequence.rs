use std::marker::PhantomData;
use std::ops::Range;
use std::ptr::NonNull;

use crate::context::{layer_arg, Context};
use crate::error::{check, shape_error, KvretError, Result, Status};
use crate::sys;
use crate::tensor::{Element, TensorMut, TensorRef};
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
    pub(crate) fn new(positions: Vec<i32>, n_kv_heads: usize, width: usize, count: usize) -> Self {
        Selection { positions, scores: None, n_kv_heads, width, count }
    }

    /// Positions selected per KV head.
    pub fn count(&self) -> usize {
        self.count
    }

    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    /// The positions selected for one KV head.
    pub fn head(&self, head: usize) -> &[i32] {
        &self.positions[head * self.width..head * self.width + self.count]
    }

    /// The scores of one KV head's positions, aligned with [`Selection::head`]: the folded score the index ranked
    /// each by (see `kvret_select_scored`). `None` for a selection made by [`Sequence::select`].
    pub fn scores(&self, head: usize) -> Option<&[f32]> {
        self.scores.as_ref().map(|s| &s[head * self.width..head * self.width + self.count])
    }
}

/// One request or conversation: its keys and values are stored, indexed and retrieved by kvret.
///
/// A sequence borrows its [`Context`]. It is `Send` but not `Sync`: one thread at a time uses it (mutating calls take
/// `&mut self`), while distinct sequences run in parallel. Dropping it closes it (`kvret_seq_close`).
#[derive(Debug)]
pub struct Sequence<'ctx> {
    raw: NonNull<sys::kvret_seq>,
    context: &'ctx Context,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

// SAFETY: kvret.h: different sequences may be used from different threads; one sequence from one thread at a time,
// which `&mut self` and !Sync guarantee.
unsafe impl Send for Sequence<'_> {}

impl<'ctx> Sequence<'ctx> {
    pub(crate) fn from_raw(context: &'ctx Context, raw: NonNull<sys::kvret_seq>) -> Self {
        Sequence { raw, context, _not_sync: PhantomData }
    }

    pub(crate) fn raw(&self) -> *mut sys::kvret_seq {
        self.raw.as_ptr()
    }

    pub fn context(&self) -> &'ctx Context {
        self.context
    }

    // ---- appending ----

    /// Appends prefill tokens to `layer`: k and v are compact `[tokens, n_kv_heads, head_dim]` (F16, Bf16 or f32).
    /// Schedules the layer's index build (in the background by default).
    pub fn append_prefill<T: Element>(&mut self, layer: usize, k: &[T], v: &[T]) -> Result<()> {
        let (_, n_kv, d) = self.context.geometry();
        let shape = [tokens_of(k.len(), n_kv * d, "k")?, n_kv, d];
        self.append_prefill_strided(layer, &TensorRef::new(k, &shape)?, &TensorRef::new(v, &shape)?)
    }

    /// [`append_prefill`](Self::append_prefill) with any `[tokens, n_kv_heads, head_dim]` views, e.g. heads-first
    /// memory seen through strides.
    pub fn append_prefill_strided<T: Element>(
        &mut self,
        layer: usize,
        k: &TensorRef<'_, T>,
        v: &TensorRef<'_, T>,
    ) -> Result<()> {
        let (k, v) = (k.raw(), v.raw());
        check(unsafe { sys::kvret_append_prefill(self.raw(), layer_arg(layer)?, k.ptr(), v.ptr()) })
    }

    /// Appends one decode token (`[n_kv_heads, head_dim]`) to `layer`.
    pub fn append_decode<T: Element>(&mut self, layer: usize, k: &[T], v: &[T]) -> Result<()> {
        let (_, n_kv, d) = self.context.geometry();
        let (k, v) = (TensorRef::new(k, &[n_kv, d])?, TensorRef::new(v, &[n_kv, d])?);
        let (k, v) = (k.raw(), v.raw());
        check(unsafe { sys::kvret_append_decode(self.raw(), layer_arg(layer)?, k.ptr(), v.ptr()) })
    }

    /// Waits until the index of `layer` (every layer for `None`) is built.
    pub fn wait_index(&mut self, layer: Option<usize>) -> Result<()> {
        let layer = layer.map_or(Ok(-1), layer_arg)?;
        check(unsafe { sys::kvret_wait_index(self.raw(), layer) })
    }

    /// A new sequence of the same context holding what this one holds (every layer's tokens and index), for beam
    /// search, parallel sampling or several continuations of one prompt. The two share their KV pages copy on
    /// write and are independent from then on (see `kvret_seq_fork`).
    pub fn fork(&mut self) -> Result<Sequence<'ctx>> {
        let mut raw = std::ptr::null_mut();
        check(unsafe { sys::kvret_seq_fork(self.raw(), &mut raw) })?;
        Ok(Sequence::from_raw(self.context, NonNull::new(raw).expect("kvret_seq_fork returned OK and a null sequence")))
    }

    /// Rolls the sequence back to its first `length` tokens in every layer (speculative decoding: drop the
    /// rejected draft tokens; regeneration). The sequence is then as if the dropped tokens had never been
    /// appended; on failure nothing changes (see `kvret_seq_truncate`).
    pub fn truncate(&mut self, length: usize) -> Result<()> {
        let length = i64::try_from(length).unwrap_or(i64::MAX); // beyond every layer: a no-op
        check(unsafe { sys::kvret_seq_truncate(self.raw(), length) })
    }

    // ---- queries ----

    /// Tokens stored for `layer`.
    pub fn length(&self, layer: usize) -> Result<usize> {
        let mut tokens = 0i64;
        check(unsafe { sys::kvret_seq_length(self.raw(), layer_arg(layer)?, &mut tokens) })?;
        Ok(tokens as usize)
    }

    /// The budget select uses by default for `layer` at its current length.
    pub fn budget(&self, layer: usize) -> Result<usize> {
        let mut budget = 0i32;
        check(unsafe { sys::kvret_seq_budget(self.raw(), layer_arg(layer)?, &mut budget) })?;
        Ok(budget as usize)
    }

    /// Upper bound of the working-set rows for `layer` at `budget` (`None`: the default budget).
    pub fn working_set_capacity(&self, layer: usize, budget: Option<usize>) -> Result<usize> {
        let mut rows = 0i64;
        check(unsafe {
            sys::kvret_working_set_capacity(self.raw(), layer_arg(layer)?, budget_arg(budget)?, &mut rows)
        })?;
        Ok(rows as usize)
    }

    pub fn stats(&self) -> Result<Stats> {
        let mut stats = Stats::default();
        check(unsafe { sys::kvret_stats_init(&mut stats) })?;
        check(unsafe { sys::kvret_seq_stats(self.raw(), &mut stats) })?;
        Ok(stats)
    }

    // ---- retrieval ----

    /// Selects the top `budget` middle tokens of every KV head (`None`: the default budget) for query q
    /// (`[n_q_heads, head_dim]`).
    pub fn select<Q: Element>(&mut self, layer: usize, q: &[Q], budget: Option<usize>) -> Result<Selection> {
        let (_, n_kv, _) = self.context.geometry();
        budget_arg(budget)?; // a budget past i32 is refused before anything is allocated
        // never wider than the layer: an absurd budget is refused by the library, not by a failed allocation
        let width = match budget {
            Some(b) => b.min(self.length(layer)?),
            None => self.budget(layer)?,
        }
        .max(1);
        let mut positions = vec![0i32; n_kv * width];
        let count = self.select_into(layer, q, budget, &mut positions)?;
        Ok(Selection::new(positions, n_kv, width, count))
    }

    /// [`Sequence::select`] with the score of each position (read with [`Selection::scores`]): the folded score
    /// the index ranked it by, see `kvret_select_scored`.
    pub fn select_scored<Q: Element>(&mut self, layer: usize, q: &[Q], budget: Option<usize>) -> Result<Selection> {
        let (n_q, n_kv, d) = self.context.geometry();
        budget_arg(budget)?;
        let width = match budget {
            Some(b) => b.min(self.length(layer)?),
            None => self.budget(layer)?,
        }
        .max(1);
        let mut positions = vec![0i32; n_kv * width];
        let mut scores = vec![0f32; n_kv * width];
        let q = TensorRef::new(q, &[n_q, d])?;
        let mut positions_tensor = TensorMut::new(&mut positions, &[n_kv, width])?;
        let mut scores_tensor = TensorMut::new(&mut scores, &[n_kv, width])?;
        let (q, p, s) = (q.raw(), positions_tensor.raw(), scores_tensor.raw());
        let (layer, budget) = (layer_arg(layer)?, budget_arg(budget)?);
        let mut count = 0i32;
        check(unsafe {
            sys::kvret_select_scored(self.raw(), layer, q.ptr(), budget, p.ptr(), s.ptr(), &mut count)
        })?;
        let mut selection = Selection::new(positions, n_kv, width, count as usize);
        selection.scores = Some(scores);
        Ok(selection)
    }

    /// Attention of q (`[n_q_heads, head_dim]`) over this step's working set of `layer`, in one call: select,
    /// fetch and attention inside kvret (see `kvret_seq_attend`). `None` budget: the default one. Returns
    /// `[n_q_heads, head_dim]` floats.
    pub fn attend<Q: Element>(&mut self, layer: usize, q: &[Q], budget: Option<usize>) -> Result<Vec<f32>> {
        let (n_q, _, d) = self.context.geometry();
        let q = TensorRef::new(q, &[n_q, d])?;
        let mut out = vec![0f32; n_q * d];
        let mut out_tensor = TensorMut::new(&mut out, &[n_q, d])?;
        let (q, out_raw) = (q.raw(), out_tensor.raw());
        let (layer, budget) = (layer_arg(layer)?, budget_arg(budget)?);
        check(unsafe {
            sys::kvret_seq_attend(self.raw(), layer, q.ptr(), budget, 0.0, out_raw.ptr(), std::ptr::null_mut())
        })?;
        Ok(out)
    }

    /// Selects into `positions` (`[n_kv_heads, width]` with width >= budget); returns the count per head.
    pub fn select_into<Q: Element>(
        &mut self,
        layer: usize,
        q: &[Q],
        budget: Option<usize>,
        positions: &mut [i32],
    ) -> Result<usize> {
        let (n_q, n_kv, d) = self.context.geometry();
        let q = TensorRef::new(q, &[n_q, d])?;
        let width = positions.len() / n_kv.max(1);
        let mut out = TensorMut::new(positions, &[n_kv, width])?;
        let (q, out) = (q.raw(), out.raw());
        let (layer, budget) = (layer_arg(layer)?, budget_arg(budget)?);
        let mut count = 0i32;
        check(unsafe { sys::kvret_select(self.raw(), layer, q.ptr(), budget, out.ptr(), &mut count) })?;
        Ok(count as usize)
    }

    /// Fetches the working set of a selection into new buffers of element type `T` (the KV dtype or f32).
    pub fn fetch<T: Element>(&mut self, layer: usize, selection: &Selection) -> Result<WorkingSet<T>> {
        let (_, n_kv, d) = self.context.geometry();
        let capacity = if selection.count > 0 {
            self.working_set_capacity(layer, Some(selection.count))?
        } else {
            self.length(layer)?
        };
        let mut working_set = WorkingSet::new(n_kv, capacity, d);
        self.fetch_into(layer, selection, &mut working_set)?;
        Ok(working_set)
    }

    /// Writes the working set of a selection into `working_set`; returns the rows per head.
    pub fn fetch_into<T: Element>(
        &mut self,
        layer: usize,
        selection: &Selection,
        working_set: &mut WorkingSet<T>,
    ) -> Result<usize> {
        let (_, n_kv, d) = self.context.geometry();
        if working_set.n_kv_heads != n_kv || working_set.head_dim != d {
            return Err(shape_error(format!(
                "working set of {} heads x {} dims for a model of {n_kv} x {d}",
                working_set.n_kv_heads, working_set.head_dim
            )));
        }
        let positions = TensorRef::new(&selection.positions, &[selection.n_kv_heads, selection.width])?;
        let shape = [n_kv, working_set.capacity, d];
        let mut k = TensorMut::new(&mut working_set.k, &shape)?;
        let mut v = TensorMut::new(&mut working_set.v, &shape)?;
        let mut rows_positions = TensorMut::new(&mut working_set.positions, &shape[..2])?;
        let (positions, k, v, rows_positions) = (positions.raw(), k.raw(), v.raw(), rows_positions.raw());
        let set = sys::kvret_working_set { k: k.tensor, v: v.tensor, positions: rows_positions.tensor };
        let layer = layer_arg(layer)?;
        let mut rows = 0i64;
        let status = unsafe {
            sys::kvret_fetch_async(
                self.raw(),
                layer,
                positions.ptr(),
                selection.count as i32,
                &set,
                &mut rows,
                std::ptr::null_mut(),
            )
        };
        check(status)?;
        working_set.rows = rows as usize;
        Ok(working_set.rows)
    }

    /// Experimental: the stored keys and values of `positions` of `layer`, each `[len, n_kv_heads, head_dim]`.
    pub fn read<T: Element>(&self, layer: usize, positions: Range<usize>) -> Result<(Vec<T>, Vec<T>)> {
        let (_, n_kv, d) = self.context.geometry();
        let len = positions.end.saturating_sub(positions.start);
        let (mut k, mut v) = (vec![T::default(); len * n_kv * d], vec![T::default(); len * n_kv * d]);
        let shape = [len, n_kv, d];
        let (mut k_view, mut v_view) = (TensorMut::new(&mut k, &shape)?, TensorMut::new(&mut v, &shape)?);
        let (k_out, v_out) = (k_view.raw(), v_view.raw());
        let (layer, begin, end) = (layer_arg(layer)?, positions.start as i64, positions.end as i64);
        check(unsafe { sys::kvret_seq_read(self.raw(), layer, begin, end, k_out.ptr(), v_out.ptr()) })?;
        Ok((k, v))
    }

    /// Experimental: selects with a guessed next query and loads those blocks into the GPU block cache.
    pub fn prefetch<Q: Element>(&mut self, layer: usize, q_guess: &[Q], budget: Option<usize>) -> Result<()> {
        let (n_q, _, d) = self.context.geometry();
        let q = TensorRef::new(q_guess, &[n_q, d])?;
        let q = q.raw();
        let (layer, budget) = (layer_arg(layer)?, budget_arg(budget)?);
        check(unsafe { sys::kvret_prefetch_async(self.raw(), layer, q.ptr(), budget, std::ptr::null_mut()) })
    }
}

impl Drop for Sequence<'_> {
    fn drop(&mut self) {
        unsafe { sys::kvret_seq_close(self.raw()) };
    }
}

fn tokens_of(len: usize, row: usize, name: &str) -> Result<usize> {
    if row == 0 || len % row != 0 {
        return Err(shape_error(format!("{name} has {len} elements, not a whole number of rows of {row}")));
    }
    Ok(len / row)
}

pub(crate) fn budget_arg(budget: Option<usize>) -> Result<i32> {
    match budget {
        None => Ok(sys::KVRET_BUDGET_DEFAULT),
        Some(b) => i32::try_from(b)
            .map_err(|_| KvretError::new(Status::Budget, format!("kvret (rust): budget {b} does not fit an i32"))),
    }
}
