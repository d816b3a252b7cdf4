use std::marker::PhantomData;

use crate::error::{shape_error, Result};
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

/// An element type kvret understands.
///
/// # Safety
/// `DTYPE` must describe `Self`'s size and representation exactly.
pub unsafe trait Element: Copy + Default + 'static {
    const DTYPE: sys::kvret_dtype;
}

const fn dtype(code: sys::kvret_dtype_code, bits: u8) -> sys::kvret_dtype {
    sys::kvret_dtype { code: code as u8, bits, lanes: 1 }
}

unsafe impl Element for f32 {
    const DTYPE: sys::kvret_dtype = dtype(sys::KVRET_DTYPE_FLOAT, 32);
}
unsafe impl Element for i32 {
    const DTYPE: sys::kvret_dtype = dtype(sys::KVRET_DTYPE_INT, 32);
}
unsafe impl Element for F16 {
    const DTYPE: sys::kvret_dtype = dtype(sys::KVRET_DTYPE_FLOAT, 16);
}
unsafe impl Element for Bf16 {
    const DTYPE: sys::kvret_dtype = dtype(sys::KVRET_DTYPE_BFLOAT, 16);
}

/// An IEEE binary16 value (bits).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct F16(pub u16);

/// A bfloat16 value (bits).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Bf16(pub u16);

impl From<f32> for Bf16 {
    /// Rounds to nearest even.
    fn from(x: f32) -> Self {
        let bits = x.to_bits();
        if x.is_nan() {
            return Bf16((bits >> 16) as u16 | 0x40);
        }
        Bf16(((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16)
    }
}

impl From<Bf16> for f32 {
    fn from(x: Bf16) -> Self {
        f32::from_bits((x.0 as u32) << 16)
    }
}

impl From<f32> for F16 {
    /// Rounds to nearest even; overflows to infinity.
    fn from(x: f32) -> Self {
        let bits = x.to_bits();
        let sign = ((bits >> 16) & 0x8000) as u16;
        let exponent = ((bits >> 23) & 0xff) as i32;
        let mantissa = bits & 0x7f_ffff;
        if exponent == 0xff {
            return F16(sign | 0x7c00 | if mantissa != 0 { 0x200 } else { 0 });
        }
        let e = exponent - 127 + 15;
        if e >= 0x1f {
            return F16(sign | 0x7c00);
        }
        if e <= 0 {
            if e < -10 {
                return F16(sign);
            }
            let m = mantissa | 0x80_0000;
            let shift = (14 - e) as u32;
            let half = 1u32 << (shift - 1);
            let rounded = (m + half - 1 + ((m >> shift) & 1)) >> shift;
            return F16(sign | rounded as u16);
        }
        let rounded = mantissa + 0xfff + ((mantissa >> 13) & 1);
        if rounded & 0x80_0000 != 0 {
            let e = e + 1;
            return F16(if e >= 0x1f { sign | 0x7c00 } else { sign | ((e as u16) << 10) });
        }
        F16(sign | ((e as u16) << 10) | (rounded >> 13) as u16)
    }
}

impl From<F16> for f32 {
    fn from(x: F16) -> Self {
        let sign = ((x.0 & 0x8000) as u32) << 16;
        let exponent = ((x.0 >> 10) & 0x1f) as u32;
        let mantissa = (x.0 & 0x3ff) as u32;
        let bits = match (exponent, mantissa) {
            (0, 0) => sign,
            (0, m) => {
                let shift = m.leading_zeros() - 21;
                sign | ((127 - 15 + 1 - shift) << 23) | ((m << shift) & 0x3ff) << 13
            }
            (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
            (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
        };
        f32::from_bits(bits)
    }
}

fn extents(shape: &[usize], strides: Option<&[usize]>, len: usize) -> Result<(Vec<i64>, Option<Vec<i64>>)> {
    if let Some(strides) = strides {
        if strides.len() != shape.len() {
            return Err(shape_error(format!("{} strides for {} dimensions", strides.len(), shape.len())));
        }
    }
    let row_major: Vec<usize> = (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
    let strides_used = strides.unwrap_or(&row_major);
    if shape.iter().all(|&e| e > 0) {
        let last: usize = shape.iter().zip(strides_used).map(|(&e, &s)| (e - 1) * s).sum();
        if last >= len {
            return Err(shape_error(format!(
                "shape {shape:?} with strides {strides_used:?} needs more than {len} elements"
            )));
        }
    }
    let to_i64 = |v: &[usize]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
    Ok((to_i64(shape), strides.map(to_i64)))
}

/// A borrowed, bounds-checked tensor that kvret reads: a slice, a shape and optional strides (in elements).
#[derive(Debug)]
pub struct TensorRef<'a, T: Element> {
    data: &'a [T],
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
}

impl<'a, T: Element> TensorRef<'a, T> {
    /// A row-major view of `data` with `shape`.
    pub fn new(data: &'a [T], shape: &[usize]) -> Result<Self> {
        let (shape, strides) = extents(shape, None, data.len())?;
        Ok(TensorRef { data, shape, strides })
    }

    /// A strided view of `data` (strides in elements; kvret needs the innermost to be 1).
    pub fn strided(data: &'a [T], shape: &[usize], strides: &[usize]) -> Result<Self> {
        let (shape, strides) = extents(shape, Some(strides), data.len())?;
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
pub struct TensorMut<'a, T: Element> {
    data: &'a mut [T],
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
}

impl<'a, T: Element> TensorMut<'a, T> {
    pub fn new(data: &'a mut [T], shape: &[usize]) -> Result<Self> {
        let (shape, strides) = extents(shape, None, data.len())?;
        Ok(TensorMut { data, shape, strides })
    }

    pub fn strided(data: &'a mut [T], shape: &[usize], strides: &[usize]) -> Result<Self> {
        let (shape, strides) = extents(shape, Some(strides), data.len())?;
        Ok(TensorMut { data, shape, strides })
    }

    pub(crate) fn raw(&mut self) -> Raw<'_> {
        raw_tensor(self.data.as_mut_ptr(), &self.shape, self.strides.as_deref(), T::DTYPE)
    }
}

fn raw_tensor<'a, T>(data: *mut T, shape: &'a [i64], strides: Option<&'a [i64]>, dtype: sys::kvret_dtype) -> Raw<'a> {
    let tensor = sys::kvret_tensor {
        data: data.cast(),
        device: sys::kvret_device { device_type: sys::KVRET_DEVICE_CPU, device_id: 0 },
        ndim: shape.len() as i32,
        dtype,
        shape: shape.as_ptr(),
        strides: strides.map_or(std::ptr::null(), |s| s.as_ptr()),
        byte_offset: 0,
    };
    Raw { tensor, _view: PhantomData }
}
