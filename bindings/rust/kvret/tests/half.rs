//! F16 and Bf16: bit patterns, and conversions from f32 (round to nearest, ties to even) and to f32 (exact),
//! checked against a reference that finds the nearest value by search, on every bit pattern and the edge cases.

mod common;

use common::Rng;
use kvret::{Bf16, F16};

/// The nearest of the finite non-negative values of a 16-bit format (bit patterns 0..=max_finite, increasing in
/// value), ties to the even pattern; from `overflow` up, infinity. `x` is finite and >= 0.
fn nearest(x: f64, max_finite: u16, infinity: u16, overflow: f64, to_f64: impl Fn(u16) -> f64) -> u16 {
    if x >= overflow {
        return infinity;
    }
    // the first pattern whose value is >= x
    let (mut lo, mut hi) = (0u32, max_finite as u32 + 1);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if to_f64(mid as u16) < x {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let above = lo.min(max_finite as u32) as u16;
    if above == 0 || to_f64(above) == x {
        return above;
    }
    if to_f64(above) < x {
        return above; // x above MAX but below the overflow threshold
    }
    let below = above - 1;
    let (d_below, d_above) = (x - to_f64(below), to_f64(above) - x);
    if d_below < d_above || (d_below == d_above && below % 2 == 0) {
        below
    } else {
        above
    }
}

fn f16_ref(x: f32) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    // half a unit (2^5) above MAX = 65504 rounds to infinity
    sign | nearest((x as f64).abs(), 0x7bff, 0x7c00, 65520.0, |b| F16(b).to_f32() as f64)
}

fn bf16_ref(x: f32) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000 } else { 0 };
    let overflow = (2.0 - 2f64.powi(-8)) * 2f64.powi(127); // half a unit above MAX
    sign | nearest((x as f64).abs(), 0x7f7f, 0x7f80, overflow, |b| Bf16(b).to_f32() as f64)
}

#[test]
fn bits_round_trip() {
    for bits in 0..=u16::MAX {
        assert_eq!(F16::from_bits(bits).to_bits(), bits);
        assert_eq!(F16::from_bits(bits), F16(bits));
        assert_eq!(Bf16::from_bits(bits).to_bits(), bits);
        let (h, b) = (F16(bits), Bf16(bits));
        // to f32 is exact, and back gives the same bits for every non-NaN pattern
        if h.is_nan() {
            assert!(h.to_f32().is_nan() && F16::from_f32(h.to_f32()).is_nan());
            assert_eq!(F16::from_f32(h.to_f32()).is_sign_negative(), h.is_sign_negative());
        } else {
            assert_eq!(F16::from_f32(h.to_f32()), h, "{bits:#06x}");
            assert_eq!(f64::from(h), h.to_f32() as f64);
        }
        if b.is_nan() {
            assert!(b.to_f32().is_nan() && Bf16::from_f32(b.to_f32()).is_nan());
        } else {
            assert_eq!(Bf16::from_f32(b.to_f32()), b, "{bits:#06x}");
            assert_eq!(b.to_f32().to_bits(), (bits as u32) << 16); // bf16 is the high half of an f32
        }
        assert_eq!(h.is_finite(), h.to_f32().is_finite());
        assert_eq!(h.is_infinite(), h.to_f32().is_infinite());
        assert_eq!(b.is_finite(), b.to_f32().is_finite());
        assert_eq!(b.is_infinite(), b.to_f32().is_infinite());
    }
}

#[test]
fn from_f32_rounds_to_nearest_even() {
    let mut rng = Rng(0x16);
    let mut values: Vec<f32> = Vec::new();
    // every f32 bit pattern class: random bits, and random mantissas at every exponent near the 16-bit ranges
    for _ in 0..20_000 {
        values.push(f32::from_bits(rng.next_u64() as u32));
    }
    for exponent in 0..255u32 {
        for _ in 0..64 {
            let mantissa = rng.next_u64() as u32 & 0x7f_ffff;
            values.push(f32::from_bits(exponent << 23 | mantissa));
            values.push(-f32::from_bits(exponent << 23 | mantissa));
        }
    }
    // exact midpoints between neighbouring 16-bit values, and one f32 ulp either side
    for bits in 0..0x7bffu16 {
        let mid = ((F16(bits).to_f32() as f64 + F16(bits + 1).to_f32() as f64) / 2.0) as f32;
        values.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits().saturating_sub(1))]);
    }
    for bits in (0..0x7f7fu16).step_by(7) {
        let mid = ((Bf16(bits).to_f32() as f64 + Bf16(bits + 1).to_f32() as f64) / 2.0) as f32;
        values.extend([mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits().saturating_sub(1))]);
    }
    for x in values.into_iter().filter(|x| !x.is_nan()) {
        assert_eq!(F16::from_f32(x).to_bits(), f16_ref(x), "F16 of {x:e} ({:#010x})", x.to_bits());
        assert_eq!(Bf16::from_f32(x).to_bits(), bf16_ref(x), "Bf16 of {x:e} ({:#010x})", x.to_bits());
        assert_eq!(F16::from(x), F16::from_f32(x));
        assert_eq!(Bf16::from(x), Bf16::from_f32(x));
    }
}

/// 2^e as an f32, computed exactly (f32's powi goes through 2^-e, which overflows below 2^-127).
fn p2(e: i32) -> f32 {
    2f64.powi(e) as f32
}

#[test]
fn edge_cases() {
    // zeros keep their sign
    assert_eq!(F16::from_f32(0.0).to_bits(), 0x0000);
    assert_eq!(F16::from_f32(-0.0).to_bits(), 0x8000);
    assert_eq!(Bf16::from_f32(-0.0).to_bits(), 0x8000);
    // infinities
    assert_eq!(F16::from_f32(f32::INFINITY), F16::INFINITY);
    assert_eq!(F16::from_f32(f32::NEG_INFINITY), F16::NEG_INFINITY);
    assert_eq!(Bf16::from_f32(f32::INFINITY), Bf16::INFINITY);
    assert_eq!(Bf16::from_f32(f32::NEG_INFINITY), Bf16::NEG_INFINITY);
    assert_eq!(F16::INFINITY.to_f32(), f32::INFINITY);
    assert_eq!(Bf16::NEG_INFINITY.to_f32(), f32::NEG_INFINITY);
    // overflow: half a unit above MAX (65504 + 16) and up is infinity, just below it MAX
    assert_eq!(F16::MAX.to_f32(), 65504.0);
    assert_eq!(F16::from_f32(65519.996), F16::MAX);
    assert_eq!(F16::from_f32(65520.0), F16::INFINITY);
    assert_eq!(F16::from_f32(-1e6), F16::NEG_INFINITY);
    assert_eq!(F16::from_f32(f32::MAX), F16::INFINITY);
    assert_eq!(Bf16::from_f32(f32::MAX), Bf16::INFINITY);
    assert_eq!(Bf16::from_f32(-f32::MAX), Bf16::NEG_INFINITY);
    assert_eq!(Bf16::MAX.to_f32(), f32::from_bits(0x7f7f_0000));
    // NaN: quiet, same sign, high payload bits kept
    for nan in
        [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001), f32::from_bits(0xffc0_1234), f32::from_bits(0x7fbf_e000)]
    {
        let (h, b) = (F16::from_f32(nan), Bf16::from_f32(nan));
        assert!(h.is_nan() && h.to_f32().is_nan() && b.is_nan() && b.to_f32().is_nan(), "{:#x}", nan.to_bits());
        assert_eq!(h.is_sign_negative(), nan.is_sign_negative());
        assert_eq!(b.is_sign_negative(), nan.is_sign_negative());
        assert_ne!(h.to_bits() & 0x200, 0, "quiet");
        assert_ne!(b.to_bits() & 0x40, 0, "quiet");
    }
    assert_eq!(F16::from_f32(f32::from_bits(0x7fbf_e000)).to_bits(), 0x7fff); // payload 0x3fe000 >> 13, quieted
    assert_eq!(Bf16::from_f32(f32::from_bits(0x7f81_0000)).to_bits(), 0x7fc1);
    assert!(F16::NAN.is_nan() && Bf16::NAN.is_nan() && !F16::INFINITY.is_nan());
    // F16 subnormals: 2^-24 is the smallest; 2^-25 is a tie between 0 and it (to 0, even); above it rounds up
    assert_eq!(F16::MIN_POSITIVE_SUBNORMAL.to_f32(), p2(-24));
    assert_eq!(F16::from_f32(p2(-24)).to_bits(), 0x0001);
    assert_eq!(F16::from_f32(p2(-25)).to_bits(), 0x0000);
    assert_eq!(F16::from_f32(-p2(-25)).to_bits(), 0x8000);
    assert_eq!(F16::from_f32(p2(-25) * 1.000_001).to_bits(), 0x0001);
    assert_eq!(F16::from_f32(3.0 * p2(-25)).to_bits(), 0x0002); // tie between 1 and 2 units: 2 (even)
    assert_eq!(F16::from_f32(5.0 * p2(-25)).to_bits(), 0x0002); // tie between 2 and 3 units: 2 (even)
    assert_eq!(F16::from_f32(p2(-26)).to_bits(), 0x0000);
    assert_eq!(F16::from_f32(1e-30).to_bits(), 0x0000);
    assert_eq!(F16::from_f32(f32::from_bits(1)).to_bits(), 0x0000); // an f32 subnormal
    assert_eq!(F16::from_f32(p2(-14)), F16::MIN_POSITIVE);
    assert_eq!(F16(0x03ff).to_f32(), 1023.0 * p2(-24)); // the largest subnormal
    assert_eq!(F16::from_f32(p2(-14) - p2(-25)).to_bits(), 0x0400); // tie: up to the even normal
                                                                    // F16 normal ties: 1 + 2^-11 is halfway between 1 and 1 + 2^-10
    assert_eq!(F16::from_f32(1.0 + p2(-11)), F16::ONE);
    assert_eq!(F16::from_f32(1.0 + 3.0 * p2(-11)).to_bits(), 0x3c02);
    assert_eq!(F16::from_f32(2048.0 + 1.0).to_f32(), 2048.0); // 2049: tie between 2048 and 2050
    assert_eq!(F16::from_f32(2048.0 + 3.0).to_f32(), 2052.0); // 2051: tie between 2050 and 2052
                                                              // Bf16 ties, subnormals
    assert_eq!(Bf16::from_f32(1.0 + p2(-8)), Bf16::ONE);
    assert_eq!(Bf16::from_f32(1.0 + 3.0 * p2(-8)).to_bits(), 0x3f82);
    assert_eq!(Bf16::MIN_POSITIVE_SUBNORMAL.to_f32(), p2(-133));
    assert_eq!(Bf16::from_f32(p2(-130)).to_f32(), p2(-130));
    assert_eq!(Bf16::from_f32(p2(-134)).to_bits(), 0x0000); // tie with 0
    assert_eq!(Bf16::from_f32(3.0 * p2(-134)).to_bits(), 0x0002); // tie between 1 and 2 units
    assert_eq!(Bf16::from_f32(f32::MIN_POSITIVE), Bf16::MIN_POSITIVE);
    // conversions through From
    assert_eq!(f32::from(F16::from(1.5f32)), 1.5);
    assert_eq!(f32::from(Bf16::from(-2.5f32)), -2.5);
    assert_eq!(f64::from(Bf16::ONE), 1.0);
}
