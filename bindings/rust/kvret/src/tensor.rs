use std::marker::PhantomData;

use crate::error::{shape_error, KvretError, Result, Status};
use crate::half::{Bf16, F16};
use crate::sys;

/// A descriptor that borrows the view it was made from (its shape and strides), so it cannot outlive it.
pub(crate) struct Raw<'a> {
    pub(crate) tensor: sys::kvret_tensor,
    _view: PhantomData<&'a ()>,
}

impl Raw<'_> {
    pub(crate) fn ptr(&self) -> *const sys::kvret_tensor {
        &self.tensor
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for i32 {}
    impl Sealed for super::F16 {}
    impl Sealed for super::Bf16 {}
}

/// A type a kvret tensor can hold: an [`Element`] (keys, values, queries, outputs) or `i32` (token positions).
///
/// Sealed: the library reads and writes these types only.
pub trait Scalar: sealed::Sealed + Copy + Default + Send + Sync + 'static {
    /// The DLPack dtype of the type (its size and representation, exactly).
    const DTYPE: sys::kvret_dtype;
}

/// The element type of keys, values and queries: `f32`, [`F16`] or [`Bf16`]. Integers are not data: `i32` is a
/// [`Scalar`] for positions only, so a slice of integers is refused at compile time wherever keys, values or
/// queries are expected.
///
/// ```compile_fail
/// fn keys<T: kvret::Element>(_: &[T]) {}
/// keys(&[1i32, 2, 3]); // i32 is not an Element
/// ```
///
/// Sealed, like [`Scalar`].
pub trait Element: Scalar {}

const fn dtype(code: sys::kvret_dtype_code, bits: u8) -> sys::kvret_dtype {
    sys::kvret_dtype { code: code as u8, bits, lanes: 1 }
}

impl Scalar for f32 {
    const DTYPE: sys::kvret_dtype = dtype(sys::KVRET_DTYPE_FLOAT, 32);
}
impl Scalar for F16 {
    const DTYPE: sys::kvret_dtype = dtype(sys::KVRET_DTYPE_FLOAT, 16);
}
impl Scalar for Bf16 {
    const DTYPE: sys::kvret_dtype = dtype(sys::KVRET_DTYPE_BFLOAT, 16);
}
impl Scalar for i32 {
    const DTYPE: sys::kvret_dtype = dtype(sys::KVRET_DTYPE_INT, 32);
}
impl Element for f32 {}
impl Element for F16 {}
impl Element for Bf16 {}

/// The most dimensions a kvret tensor has (`TensorView::kMaxDims` of the library).
const MAX_DIMS: usize = 4;

/// The shape and strides as i64, after checking that they address only elements of a slice of `len` elements.
/// `exact`: row-major over the whole slice (its length is the product of the shape). Every product and sum is
/// checked: no shape or stride, however large, panics or wraps.
fn extents(name: &str, shape: &[usize], strides: Option<&[usize]>, len: usize) -> Result<(Vec<i64>, Option<Vec<i64>>)> {
    if shape.len() > MAX_DIMS {
        return Err(shape_error(format!("{name}: {} dimensions (at most {MAX_DIMS})", shape.len())));
    }
    let too_large =
        || shape_error(format!("{name}: shape {shape:?} with strides {strides:?} addresses more than 2^63 elements"));
    let to_i64 = |v: &[usize]| v.iter().map(|&x| i64::try_from(x).map_err(|_| too_large())).collect::<Result<Vec<_>>>();
    let shape_i64 = to_i64(shape)?;
    let empty = shape.contains(&0);
    match strides {
        None => {
            let elements = if empty { Some(0) } else { shape.iter().try_fold(1usize, |n, &e| n.checked_mul(e)) };
            match elements {
                Some(n) if n == len => {}
                Some(n) => {
                    return Err(shape_error(format!("{name} has {len} elements; shape {shape:?} needs exactly {n}")))
                }
                None => return Err(too_large()),
            }
            Ok((shape_i64, None))
        }
        Some(strides) => {
            if strides.len() != shape.len() {
                return Err(shape_error(format!("{name}: {} strides for {} dimensions", strides.len(), shape.len())));
            }
            let strides_i64 = to_i64(strides)?;
            if !empty {
                // the offset of the last element addressed
                let last = shape
                    .iter()
                    .zip(strides)
                    .try_fold(0usize, |sum, (&e, &s)| (e - 1).checked_mul(s).and_then(|span| sum.checked_add(span)))
                    .ok_or_else(too_large)?;
                if last >= len {
                    return Err(shape_error(format!(
                        "{name}: shape {shape:?} with strides {strides:?} needs more than its {len} elements"
                    )));
                }
            }
            Ok((shape_i64, Some(strides_i64)))
        }
    }
}

/// A borrowed, bounds-checked tensor that kvret reads: a slice, a shape and optional strides (in elements).
#[derive(Debug)]
pub struct TensorRef<'a, T: Scalar> {
    data: &'a [T],
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
}

impl<'a, T: Scalar> TensorRef<'a, T> {
    /// A row-major view of all of `data` with `shape`: the length of `data` must be the product of the shape
    /// (otherwise an error of status [`Shape`](crate::Status::Shape)).
    pub fn new(data: &'a [T], shape: &[usize]) -> Result<Self> {
        Self::named("data", data, shape)
    }

    /// A strided view of `data` (strides in elements; kvret needs the innermost to be 1). Every element the shape
    /// and strides address must lie in `data`, which may hold more (e.g. a view of some heads of a larger buffer).
    pub fn strided(data: &'a [T], shape: &[usize], strides: &[usize]) -> Result<Self> {
        let (shape, strides) = extents("data", shape, Some(strides), data.len())?;
        Ok(TensorRef { data, shape, strides })
    }

    /// [`TensorRef::new`] whose errors name the argument.
    pub(crate) fn named(name: &str, data: &'a [T], shape: &[usize]) -> Result<Self> {
        let (shape, strides) = extents(name, shape, None, data.len())?;
        Ok(TensorRef { data, shape, strides })
    }

    pub fn shape(&self) -> Vec<usize> {
        self.shape.iter().map(|&e| e as usize).collect()
    }

    pub(crate) fn raw(&self) -> Raw<'_> {
        raw_tensor(self.data.as_ptr() as *mut T, &self.shape, self.strides.as_deref(), T::DTYPE)
    }
}

/// A borrowed, bounds-checked tensor that kvret writes.
#[derive(Debug)]
pub struct TensorMut<'a, T: Scalar> {
    data: &'a mut [T],
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
}

impl<'a, T: Scalar> TensorMut<'a, T> {
    /// A row-major view of all of `data` with `shape` (its length must be the product of the shape).
    pub fn new(data: &'a mut [T], shape: &[usize]) -> Result<Self> {
        Self::named("data", data, shape)
    }

    /// A strided view of `data`; every element addressed must lie in `data`.
    pub fn strided(data: &'a mut [T], shape: &[usize], strides: &[usize]) -> Result<Self> {
        let (shape, strides) = extents("data", shape, Some(strides), data.len())?;
        Ok(TensorMut { data, shape, strides })
    }

    pub(crate) fn named(name: &str, data: &'a mut [T], shape: &[usize]) -> Result<Self> {
        let (shape, strides) = extents(name, shape, None, data.len())?;
        Ok(TensorMut { data, shape, strides })
    }

    pub fn shape(&self) -> Vec<usize> {
        self.shape.iter().map(|&e| e as usize).collect()
    }

    pub(crate) fn raw(&mut self) -> Raw<'_> {
        raw_tensor(self.data.as_mut_ptr(), &self.shape, self.strides.as_deref(), T::DTYPE)
    }
}

fn raw_tensor<'a, T>(data: *mut T, shape: &'a [i64], strides: Option<&'a [i64]>, dtype: sys::kvret_dtype) -> Raw<'a> {
    let tensor = sys::kvret_tensor {
        data: data.cast(),
        device: sys::kvret_device { device_type: sys::KVRET_DEVICE_CPU, device_id: 0 },
        ndim: shape.len() as i32, // at most MAX_DIMS (extents)
        dtype,
        shape: shape.as_ptr(),
        strides: strides.map_or(std::ptr::null(), |s| s.as_ptr()),
        byte_offset: 0,
    };
    Raw { tensor, _view: PhantomData }
}

/// `len` default elements, or an error (never an abort) when the allocation is impossible.
pub(crate) fn buffer<T: Scalar>(len: usize, what: &str) -> Result<Vec<T>> {
    let mut buffer = Vec::new();
    buffer.try_reserve_exact(len).map_err(|_| {
        KvretError::new(
            Status::OutOfMemory,
            format!("kvret (rust): cannot allocate {len} elements of {} bytes for {what}", std::mem::size_of::<T>()),
        )
    })?;
    buffer.resize(len, T::default());
    Ok(buffer)
}

/// The product of extents, or a Shape error when it does not fit a usize.
pub(crate) fn product(what: &str, extents: &[usize]) -> Result<usize> {
    extents
        .iter()
        .try_fold(1usize, |n, &e| n.checked_mul(e))
        .ok_or_else(|| shape_error(format!("{what}: {extents:?} holds more than usize::MAX elements")))
}
