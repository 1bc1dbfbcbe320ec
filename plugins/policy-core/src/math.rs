//! Fast, deterministic `exp` and `ln` for `f32`.
//!
//! `f32::exp` on `wasm32-unknown-unknown` goes through a slow software libm, and a platform
//! libm may differ in the last bit between the host and the guest. These versions use only
//! IEEE-754 single-precision add/multiply/divide and integer bit manipulation, so they are
//! bit-identical wherever they run (Rust never fuses multiply-adds on its own).
//!
//! Accuracy: relative error below 3e-7 over the whole finite range (checked in the tests
//! against `f64`). Special values follow IEEE: `exp(-inf) = 0`, `exp(+inf) = +inf`,
//! `ln(0) = -inf`, `ln(x < 0) = NaN`, NaN in gives NaN out.

const LOG2_E: f32 = core::f32::consts::LOG2_E;
/// ln 2 split into a high part exact in f32 products with small integers and a low part.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
const LN2: f32 = core::f32::consts::LN_2;
/// Above this `exp` overflows to +inf.
const EXP_MAX: f32 = 88.722_83;
/// Below this `exp` is flushed to zero (the result would be subnormal).
const EXP_MIN: f32 = -87.336_54;

/// `e^x`.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_MAX {
        return f32::INFINITY;
    }
    if x < EXP_MIN {
        return 0.0;
    }
    exp_in_range(x)
}

/// `e^x` for `x` in `[EXP_MIN, 0]`, without branches, so loops over it vectorise. Gives the
/// same bits as [`exp`] there.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    let (p, n) = exp_parts(x);
    // n >= -126 here: 2^n is a normal number and one product suffices.
    p * pow2(n)
}

#[inline(always)]
fn exp_in_range(x: f32) -> f32 {
    let (p, n) = exp_parts(x);
    scale_by_pow2(p, n)
}

/// `(p, n)` with `e^x = p · 2^n`, for `|x| < 89`.
#[inline(always)]
fn exp_parts(x: f32) -> (f32, i32) {
    // x = n ln2 + r with |r| <= ln2 / 2. Adding 1.5 · 2^23 rounds x·log2(e) to the nearest
    // integer (ties to even) and leaves that integer in the low mantissa bits: no float-to-int
    // conversion, so the same plain IEEE operations run in scalar and vector code.
    const SHIFTER: f32 = 12_582_912.0;
    let k = x * LOG2_E + SHIFTER;
    let nf = k - SHIFTER;
    let n = k.to_bits() as i32 - SHIFTER.to_bits() as i32;
    let r = (x - nf * LN2_HI) - nf * LN2_LO;
    // Taylor polynomial of e^r to degree 7 (error < 1e-8 on |r| <= 0.347).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    (p, n)
}

/// `p · 2^n` for `p` in [0.7, 1.42] and `n` in the range `exp` produces.
#[inline]
fn scale_by_pow2(p: f32, n: i32) -> f32 {
    // Split the scale in two so neither factor leaves the normal range.
    let half = n / 2;
    let rest = n - half;
    p * pow2(half) * pow2(rest)
}

#[inline]
fn pow2(n: i32) -> f32 {
    f32::from_bits(((n + 127) as u32) << 23)
}

/// Natural logarithm.
#[inline]
pub fn ln(x: f32) -> f32 {
    if x.is_nan() || x < 0.0 {
        return f32::NAN;
    }
    if x == 0.0 {
        return f32::NEG_INFINITY;
    }
    if x == f32::INFINITY {
        return x;
    }
    let mut bits = x.to_bits();
    let mut e: i32 = 0;
    if bits < 0x0080_0000 {
        // Subnormal: scale into the normal range first.
        bits = (x * 16_777_216.0).to_bits();
        e -= 24;
    }
    e += ((bits >> 23) as i32) - 127;
    // Mantissa in [1, 2), then folded into [sqrt(1/2), sqrt(2)).
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    if m > core::f32::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    // ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716.
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let series =
        s * (2.0 + s2 * (2.0 / 3.0 + s2 * (2.0 / 5.0 + s2 * (2.0 / 7.0 + s2 * (2.0 / 9.0)))));
    (e as f32) * LN2 + series
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel_err(got: f32, want: f64) -> f64 {
        if want == 0.0 {
            got.abs() as f64
        } else {
            ((got as f64 - want) / want).abs()
        }
    }

    extern crate std;

    #[test]
    fn exp_is_accurate_over_its_range() {
        let mut worst = 0.0f64;
        let mut x = EXP_MIN + 0.01;
        while x < EXP_MAX {
            let want = (x as f64).exp();
            worst = worst.max(rel_err(exp(x), want));
            x += 0.000_731;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
    }

    #[test]
    fn exp_nonpositive_matches_exp() {
        let mut x = EXP_MIN;
        while x <= 0.0 {
            assert_eq!(exp_nonpositive(x).to_bits(), exp(x).to_bits(), "x={x}");
            x += 0.000_913;
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[test]
    fn exp_special_values() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn ln_is_accurate_including_subnormals() {
        let mut worst = 0.0f64;
        // Every 4099th positive finite bit pattern, subnormals included.
        for bits in (1u32..0x7f80_0000).step_by(4099) {
            let x = f32::from_bits(bits);
            let want = (x as f64).ln();
            // Absolute error near ln = 0, relative elsewhere.
            let err = if want.abs() < 1.0 {
                (ln(x) as f64 - want).abs()
            } else {
                rel_err(ln(x), want)
            };
            worst = worst.max(err);
        }
        assert!(worst < 3e-7, "worst error {worst}");
    }

    #[test]
    fn ln_special_values() {
        assert_eq!(ln(1.0), 0.0);
        assert_eq!(ln(0.0), f32::NEG_INFINITY);
        assert!(ln(-1.0).is_nan());
        assert!(ln(f32::NAN).is_nan());
        assert_eq!(ln(f32::INFINITY), f32::INFINITY);
    }

    #[test]
    fn exp_ln_round_trip() {
        for i in 1..2000 {
            let x = i as f32 * 0.037;
            let back = exp(ln(x));
            assert!(rel_err(back, x as f64) < 1e-6, "x={x} back={back}");
        }
    }
}
