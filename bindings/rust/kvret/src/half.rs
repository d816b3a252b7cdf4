//! The two 16-bit float formats of kvret's KV data, without external crates: IEEE 754 binary16 ([`F16`]) and
//! bfloat16 ([`Bf16`]). Each is its bit pattern (`#[repr(transparent)]` over `u16`, the layout of C's `_Float16` /
//! CUDA's `__half` and `__nv_bfloat16`), so a `&[u16]` of either format, e.g. from a model file, converts with
//! [`F16::from_bits`] / [`Bf16::from_bits`] and no arithmetic.
//!
//! Conversion from `f32` rounds to nearest, ties to even (as IEEE 754's default rounding and CUDA's
//! `__float2half_rn` / `__float2bfloat16_rn`): a value above the largest finite one by half a unit or more becomes
//! infinity, one below half the smallest subnormal becomes a (signed) zero, and a NaN stays a NaN (quiet, same sign,
//! the high bits of its payload kept). Conversion to `f32` is exact for every bit pattern.

/// An IEEE 754 binary16 value, stored as its bits: 1 sign bit, 5 exponent bits, 10 mantissa bits.
///
/// `F16(bits)` and [`F16::from_bits`] are the same; equality and hashing compare bits (so `+0 != -0`, and a NaN
/// equals itself), as a bit pattern does.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct F16(pub u16);

/// A bfloat16 value, stored as its bits: the high 16 bits of an `f32` (1 sign, 8 exponent, 7 mantissa bits).
///
/// `Bf16(bits)` and [`Bf16::from_bits`] are the same; equality and hashing compare bits.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Bf16(pub u16);

impl F16 {
    pub const ZERO: F16 = F16(0x0000);
    pub const ONE: F16 = F16(0x3c00);
    pub const INFINITY: F16 = F16(0x7c00);
    pub const NEG_INFINITY: F16 = F16(0xfc00);
    /// A quiet NaN.
    pub const NAN: F16 = F16(0x7e00);
    /// The largest finite value, 65504.
    pub const MAX: F16 = F16(0x7bff);
    /// The smallest positive normal value, 2^-14.
    pub const MIN_POSITIVE: F16 = F16(0x0400);
    /// The smallest positive subnormal value, 2^-24.
    pub const MIN_POSITIVE_SUBNORMAL: F16 = F16(0x0001);

    /// The value with these bits.
    pub const fn from_bits(bits: u16) -> F16 {
        F16(bits)
    }

    /// The bits of the value.
    pub const fn to_bits(self) -> u16 {
        self.0
    }

    /// The nearest value to `x`, ties to even (IEEE 754's default rounding, CUDA's `__float2half_rn`). From
    /// 65520 up (half a unit above [`F16::MAX`]) it is infinity; up to 2^-25 (half of
    /// [`F16::MIN_POSITIVE_SUBNORMAL`]) a zero of `x`'s sign; a NaN stays a quiet NaN of the same sign, with the
    /// high bits of its payload.
    pub fn from_f32(x: f32) -> F16 {
        let bits = x.to_bits();
        let sign = ((bits >> 16) & 0x8000) as u16;
        let exponent = ((bits >> 23) & 0xff) as i32;
        let mantissa = bits & 0x7f_ffff;
        if exponent == 0xff {
            // infinity, or a NaN kept quiet with the high bits of its payload
            let nan = if mantissa != 0 { 0x200 | (mantissa >> 13) as u16 } else { 0 };
            return F16(sign | 0x7c00 | nan);
        }
        let e = exponent - 127 + 15; // the binary16 exponent field, before rounding
        if e >= 0x1f {
            return F16(sign | 0x7c00);
        }
        if e <= 0 {
            // a subnormal (or zero): below half of 2^-24 it rounds to zero
            if e < -10 {
                return F16(sign);
            }
            let m = mantissa | 0x80_0000;
            let shift = (14 - e) as u32; // 14..=24
            let half = 1u32 << (shift - 1);
            // round half to even; a carry out of the mantissa gives the smallest normal, as the bits do
            let rounded = (m + half - 1 + ((m >> shift) & 1)) >> shift;
            return F16(sign | rounded as u16);
        }
        let rounded = mantissa + 0xfff + ((mantissa >> 13) & 1);
        if rounded & 0x80_0000 != 0 {
            // the mantissa rounded up to the next power of two
            let e = e + 1;
            return F16(if e >= 0x1f { sign | 0x7c00 } else { sign | ((e as u16) << 10) });
        }
        F16(sign | ((e as u16) << 10) | (rounded >> 13) as u16)
    }

    /// The value as an `f32` (exact).
    pub fn to_f32(self) -> f32 {
        let sign = ((self.0 & 0x8000) as u32) << 16;
        let exponent = ((self.0 >> 10) & 0x1f) as u32;
        let mantissa = (self.0 & 0x3ff) as u32;
        let bits = match (exponent, mantissa) {
            (0, 0) => sign,
            (0, m) => {
                // a subnormal: normalize (the highest set bit of m becomes the implicit one)
                let shift = m.leading_zeros() - 21;
                sign | ((127 - 15 + 1 - shift) << 23) | ((m << shift) & 0x3ff) << 13
            }
            (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
            (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
        };
        f32::from_bits(bits)
    }

    pub const fn is_nan(self) -> bool {
        self.0 & 0x7c00 == 0x7c00 && self.0 & 0x3ff != 0
    }

    pub const fn is_infinite(self) -> bool {
        self.0 & 0x7fff == 0x7c00
    }

    pub const fn is_finite(self) -> bool {
        self.0 & 0x7c00 != 0x7c00
    }

    pub const fn is_sign_negative(self) -> bool {
        self.0 & 0x8000 != 0
    }
}

impl Bf16 {
    pub const ZERO: Bf16 = Bf16(0x0000);
    pub const ONE: Bf16 = Bf16(0x3f80);
    pub const INFINITY: Bf16 = Bf16(0x7f80);
    pub const NEG_INFINITY: Bf16 = Bf16(0xff80);
    /// A quiet NaN.
    pub const NAN: Bf16 = Bf16(0x7fc0);
    /// The largest finite value, (2 - 2^-7) * 2^127.
    pub const MAX: Bf16 = Bf16(0x7f7f);
    /// The smallest positive normal value, 2^-126 (as `f32::MIN_POSITIVE`).
    pub const MIN_POSITIVE: Bf16 = Bf16(0x0080);
    /// The smallest positive subnormal value, 2^-133.
    pub const MIN_POSITIVE_SUBNORMAL: Bf16 = Bf16(0x0001);

    /// The value with these bits.
    pub const fn from_bits(bits: u16) -> Bf16 {
        Bf16(bits)
    }

    /// The bits of the value.
    pub const fn to_bits(self) -> u16 {
        self.0
    }

    /// The nearest value to `x`, ties to even (IEEE 754's default rounding, CUDA's `__float2bfloat16_rn`): from
    /// half a unit above [`Bf16::MAX`] it is infinity, `f32` subnormals round like any other value, and a NaN
    /// stays a quiet NaN of the same sign, with the high bits of its payload.
    pub fn from_f32(x: f32) -> Bf16 {
        let bits = x.to_bits();
        if x.is_nan() {
            // kept quiet, with the sign and the high bits of the payload
            return Bf16((bits >> 16) as u16 | 0x40);
        }
        // no overflow: the largest non-NaN pattern is 0xff80_0000 (-infinity)
        Bf16(((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16)
    }

    /// The value as an `f32` (exact).
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }

    pub const fn is_nan(self) -> bool {
        self.0 & 0x7f80 == 0x7f80 && self.0 & 0x7f != 0
    }

    pub const fn is_infinite(self) -> bool {
        self.0 & 0x7fff == 0x7f80
    }

    pub const fn is_finite(self) -> bool {
        self.0 & 0x7f80 != 0x7f80
    }

    pub const fn is_sign_negative(self) -> bool {
        self.0 & 0x8000 != 0
    }
}

impl From<f32> for F16 {
    /// [`F16::from_f32`]: rounds to nearest even; overflows to infinity.
    fn from(x: f32) -> Self {
        F16::from_f32(x)
    }
}

impl From<F16> for f32 {
    /// [`F16::to_f32`] (exact).
    fn from(x: F16) -> Self {
        x.to_f32()
    }
}

impl From<F16> for f64 {
    /// Exact.
    fn from(x: F16) -> Self {
        x.to_f32().into()
    }
}

impl From<f32> for Bf16 {
    /// [`Bf16::from_f32`]: rounds to nearest even; overflows to infinity.
    fn from(x: f32) -> Self {
        Bf16::from_f32(x)
    }
}

impl From<Bf16> for f32 {
    /// [`Bf16::to_f32`] (exact).
    fn from(x: Bf16) -> Self {
        x.to_f32()
    }
}

impl From<Bf16> for f64 {
    /// Exact.
    fn from(x: Bf16) -> Self {
        x.to_f32().into()
    }
}
