use std::ptr::NonNull;

use crate::config::Config;
use crate::error::{check, shape_error, Result};
use crate::sequence::{Selection, Sequence};
use crate::sys;
use crate::tensor::{Element, TensorMut, TensorRef};
use crate::working_set::WorkingSet;
use crate::Stats;

/// A kvret context: the model geometry, index settings and stores shared by its sequences.
///
/// A context is `Send + Sync` (the library's context is thread-safe); its [`Sequence`]s borrow it, so it is dropped
/// (`kvret_destroy`) only after all of them.
#[derive(Debug)]
pub struct Context {
    raw: NonNull<sys::kvret_context>,
    config: Config,
}

// SAFETY: kvret.h: "The context itself (create/destroy aside) is thread-safe"; destroy happens in Drop (exclusive).
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    /// Creates a context; the config is validated as a whole.
    pub fn new(config: &Config) -> Result<Context> {
        let mut raw = std::ptr::null_mut();
        check(config.with_raw(|c| unsafe { sys::kvret_create(c, &mut raw) }))?;
        let raw = NonNull::new(raw).expect("kvret_create returned OK and a null context");
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

    /// Opens an empty sequence.
    pub fn open_sequence(&self) -> Result<Sequence<'_>> {
        let mut raw = std::ptr::null_mut();
        check(unsafe { sys::kvret_seq_open(self.raw(), &mut raw) })?;
        Ok(Sequence::from_raw(self, NonNull::new(raw).expect("kvret_seq_open returned OK and a null sequence")))
    }

    /// Attention of q (`[n_q_heads, head_dim]`) over a fetched working set: `[n_q_heads, head_dim]` floats.
    pub fn attend<Q: Element, T: Element>(&self, q: &[Q], working_set: &WorkingSet<T>) -> Result<Vec<f32>> {
        let (n_q, n_kv, d) = self.geometry();
        let q = TensorRef::new(q, &[n_q, d])?;
        let shape = [n_kv, working_set.capacity, d];
        let k = TensorRef::new(&working_set.k, &shape)?;
        let v = TensorRef::new(&working_set.v, &shape)?;
        let mut out = vec![0f32; n_q * d];
        self.attend_raw(&q, &k, &v, working_set.rows, 0.0, &mut TensorMut::new(&mut out, &[n_q, d])?)?;
        Ok(out)
    }

    /// Reference attention: out[h] = softmax(scale * q[h] . k[g(h)]^T) v[g(h)] over the first `rows` rows of k, v
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
        let (q, k, v, out) = (q.raw(), k.raw(), v.raw(), out.raw());
        let null_stream = std::ptr::null_mut();
        check(unsafe {
            sys::kvret_attend(self.raw(), q.ptr(), k.ptr(), v.ptr(), rows as i64, scale, out.ptr(), null_stream)
        })
    }

    /// [`Sequence::select`] for several distinct sequences of this context at once; q is
    /// `[n, n_q_heads, head_dim]`.
    pub fn select_batch<Q: Element>(
        &self,
        sequences: &mut [&mut Sequence<'_>],
        layer: usize,
        q: &[Q],
        budget: Option<usize>,
    ) -> Result<Vec<Selection>> {
        let (n_q, n_kv, d) = self.geometry();
        let n = sequences.len();
        let q = TensorRef::new(q, &[n, n_q, d])?;
        let budget_c = crate::sequence::budget_arg(budget)?; // refused before anything is allocated
        // never wider than the longest layer: an absurd budget is refused by the library, not by an allocation
        let width = sequences
            .iter()
            .map(|s| match budget {
                Some(b) => s.length(layer).map(|len| b.min(len)),
                None => s.budget(layer),
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .max()
            .unwrap_or(1)
            .max(1);
        let mut positions = vec![0i32; n * n_kv * width];
        let mut counts = vec![0i32; n];
        let handles: Vec<*mut sys::kvret_seq> = sequences.iter().map(|s| s.raw()).collect();
        let budget = budget_c;
        let layer = layer_arg(layer)?;
        let mut out = TensorMut::new(&mut positions, &[n, n_kv, width])?;
        let (q, out) = (q.raw(), out.raw());
        check(unsafe {
            sys::kvret_select_batch(
                self.raw(),
                n as i32,
                handles.as_ptr(),
                layer,
                q.ptr(),
                budget,
                out.ptr(),
                counts.as_mut_ptr(),
            )
        })?;
        Ok(positions
            .chunks(n_kv * width)
            .zip(counts)
            .map(|(chunk, count)| Selection::new(chunk.to_vec(), n_kv, width, count as usize))
            .collect())
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

impl Drop for Context {
    fn drop(&mut self) {
        // Every Sequence borrowed this context, so none is open any more.
        unsafe { sys::kvret_destroy(self.raw()) };
    }
}

pub(crate) fn layer_arg(layer: usize) -> Result<i32> {
    i32::try_from(layer).map_err(|_| shape_error(format!("layer {layer} does not fit an i32")))
}
