use crate::error::Result;
use crate::tensor::{buffer, product, Element};

/// The buffers of a working set: sink + selected + local tokens of every KV head, in position order.
///
/// k and v are `[n_kv_heads, capacity, head_dim]`, positions `[n_kv_heads, capacity]`; after a fetch the first
/// [`rows`](WorkingSet::rows) rows of each head are valid. One working set can be reused for every step.
#[derive(Debug, Clone)]
pub struct WorkingSet<T: Element> {
    pub(crate) k: Vec<T>,
    pub(crate) v: Vec<T>,
    pub(crate) positions: Vec<i32>,
    pub(crate) n_kv_heads: usize,
    pub(crate) capacity: usize,
    pub(crate) head_dim: usize,
    pub(crate) rows: usize,
}

impl<T: Element> WorkingSet<T> {
    /// Zeroed buffers for `capacity` rows per KV head (see [`Sequence::working_set_capacity`]).
    ///
    /// Sizes whose product does not fit a `usize` are an error of status [`Shape`](crate::Status::Shape), and an
    /// allocation that fails is one of status [`OutOfMemory`](crate::Status::OutOfMemory): neither panics.
    ///
    /// [`Sequence::working_set_capacity`]: crate::SequenceOf::working_set_capacity
    pub fn new(n_kv_heads: usize, capacity: usize, head_dim: usize) -> Result<Self> {
        let elements = product("working set", &[n_kv_heads, capacity, head_dim])?;
        let rows = product("working set positions", &[n_kv_heads, capacity])?;
        Ok(WorkingSet {
            k: buffer(elements, "working set keys")?,
            v: buffer(elements, "working set values")?,
            positions: buffer(rows, "working set positions")?,
            n_kv_heads,
            capacity,
            head_dim,
            rows: 0,
        })
    }

    /// Rows per KV head written by the last fetch.
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The keys of one head's rows: `rows * head_dim` elements (empty for a head past `n_kv_heads`).
    pub fn k(&self, head: usize) -> &[T] {
        self.head_rows(&self.k, head, self.head_dim)
    }

    /// The values of one head's rows: `rows * head_dim` elements (empty for a head past `n_kv_heads`).
    pub fn v(&self, head: usize) -> &[T] {
        self.head_rows(&self.v, head, self.head_dim)
    }

    /// The token positions of one head's rows (empty for a head past `n_kv_heads`).
    pub fn positions(&self, head: usize) -> &[i32] {
        self.head_rows(&self.positions, head, 1)
    }

    /// The whole key buffer, `[n_kv_heads, capacity, head_dim]`.
    pub fn k_buffer(&self) -> &[T] {
        &self.k
    }

    /// The whole value buffer, `[n_kv_heads, capacity, head_dim]`.
    pub fn v_buffer(&self) -> &[T] {
        &self.v
    }

    /// The first `rows * row` elements of head `head`'s `capacity * row`, or nothing for a head out of range.
    fn head_rows<'a, E>(&self, buffer: &'a [E], head: usize, row: usize) -> &'a [E] {
        if head >= self.n_kv_heads {
            return &[];
        }
        // in range: head * capacity * row < buffer.len(), and rows <= capacity
        let start = head * self.capacity * row;
        buffer.get(start..start + self.rows * row).unwrap_or(&[])
    }
}
