use crate::tensor::Element;

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
    /// Zeroed buffers for `capacity` rows per KV head.
    pub fn new(n_kv_heads: usize, capacity: usize, head_dim: usize) -> Self {
        WorkingSet {
            k: vec![T::default(); n_kv_heads * capacity * head_dim],
            v: vec![T::default(); n_kv_heads * capacity * head_dim],
            positions: vec![0; n_kv_heads * capacity],
            n_kv_heads,
            capacity,
            head_dim,
            rows: 0,
        }
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

    /// The keys of one head's rows: `rows * head_dim` elements.
    pub fn k(&self, head: usize) -> &[T] {
        let start = head * self.capacity * self.head_dim;
        &self.k[start..start + self.rows * self.head_dim]
    }

    /// The values of one head's rows: `rows * head_dim` elements.
    pub fn v(&self, head: usize) -> &[T] {
        let start = head * self.capacity * self.head_dim;
        &self.v[start..start + self.rows * self.head_dim]
    }

    /// The token positions of one head's rows.
    pub fn positions(&self, head: usize) -> &[i32] {
        let start = head * self.capacity;
        &self.positions[start..start + self.rows]
    }

    /// The whole key buffer, `[n_kv_heads, capacity, head_dim]`.
    pub fn k_buffer(&self) -> &[T] {
        &self.k
    }

    /// The whole value buffer, `[n_kv_heads, capacity, head_dim]`.
    pub fn v_buffer(&self) -> &[T] {
        &self.v
    }
}
