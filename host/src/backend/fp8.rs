//! FP8 weights: the OCP `e4m3` ("fn": no infinities, one NaN pattern, largest finite 448) codes
//! with their scales, as checkpoints publish them and as online quantization makes them.
//!
//! A quantized weight is a matrix of codes (one byte per element, row-major, `[rows, cols]` or
//! `[experts, rows, cols]`) and scales: the real value of an element is `decode(code) · scale`.
//! The two layouts a backend sees:
//! - [`Fp8Scales::Rows`]: one scale per output row (per-channel; a per-tensor scale is expanded
//!   to this, which changes nothing);
//! - [`Fp8Scales::Blocks`]: one per `b0 × b1` tile (128 × 128 in DeepSeek-style and Qwen FP8
//!   releases), `[ceil(rows / b0), ceil(cols / b1)]` per matrix; edge tiles are partial.
//!
//! Decoding is exact (every code is an f32), so [`Fp8Weight::dequantize`] is the oracle the CPU
//! backend computes with. Encoding rounds to nearest, ties to even, and saturates at ±448, as
//! the hardware's `cvt.rn.satfinite.e4m3x2.f32` does; online quantization divides by the row's
//! scale `max|w| / 448` first (exact division, the same on every backend).

use std::borrow::Cow;

use super::{BackendError, Result};

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The value of an e4m3 code (NaN for the two NaN codes).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = (code >> 3) & 0xF;
    let man = code & 0x7;
    if exp == 0xF && man == 0x7 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        // Subnormal: man/8 · 2^-6.
        f32::from(man) * (1.0 / 512.0)
    } else {
        (1.0 + f32::from(man) / 8.0) * f32::powi(2.0, i32::from(exp) - 7)
    };
    sign * magnitude
}

/// The e4m3 code nearest to `x` (ties to even), saturating at ±448; NaN gives the NaN code.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = f64::from(x.abs());
    // Below the smallest normal (2^-6) the grid is uniform with step 2^-9: code = a · 512.
    if a < 1.0 / 64.0 {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    if a >= f64::from(E4M3_MAX) {
        return sign | 0x7E;
    }
    let e = a.log2().floor() as i32;
    // log2 can land one off at exact powers of two; make 2^e ≤ a < 2^(e+1) hold.
    let e = if f64::powi(2.0, e) > a {
        e - 1
    } else if f64::powi(2.0, e + 1) <= a {
        e + 1
    } else {
        e
    };
    let mut q = ((a / f64::powi(2.0, e) - 1.0) * 8.0).round_ties_even() as i32;
    let mut e = e;
    if q == 8 {
        q = 0;
        e += 1;
    }
    let code = (((e + 7) as u8) << 3) | q as u8;
    sign | code.min(0x7E)
}

/// Where a quantized weight's scales apply.
#[derive(Debug, Clone, PartialEq)]
pub enum Fp8Scales<'a> {
    /// One scale per output row, over every matrix of the tensor (`experts · rows` values).
    Rows(Cow<'a, [f32]>),
    /// One scale per `block[0] × block[1]` tile: `[ceil(rows / b0), ceil(cols / b1)]` per matrix.
    Blocks {
        block: [usize; 2],
        scales: Cow<'a, [f32]>,
    },
}

/// A quantized weight on the host: e4m3 codes and their scales.
#[derive(Debug, Clone)]
pub struct Fp8Weight<'a> {
    /// `[rows, cols]`, or `[experts, rows, cols]` for stacked expert weights.
    pub shape: Vec<usize>,
    pub codes: Cow<'a, [u8]>,
    pub scales: Fp8Scales<'a>,
}

impl Fp8Weight<'_> {
    /// `(matrices, rows, cols)`.
    pub fn dims(&self) -> (usize, usize, usize) {
        match self.shape[..] {
            [r, c] => (1, r, c),
            [e, r, c] => (e, r, c),
            _ => (0, 0, 0),
        }
    }

    /// The number of scales the layout needs for this shape.
    pub fn scale_count(&self) -> usize {
        let (e, r, c) = self.dims();
        match &self.scales {
            Fp8Scales::Rows(_) => e * r,
            Fp8Scales::Blocks { block, .. } => e * r.div_ceil(block[0]) * c.div_ceil(block[1]),
        }
    }

    /// Shape, code count, scale count and block sizes agree.
    pub fn check(&self) -> Result<()> {
        let (e, r, c) = self.dims();
        let bad = |m: String| Err(BackendError::Invalid(format!("fp8 weight: {m}")));
        if e == 0 {
            return bad(format!("shape {:?} is not a matrix or a stack", self.shape));
        }
        if self.codes.len() != e * r * c {
            return bad(format!(
                "{} codes for shape {:?}",
                self.codes.len(),
                self.shape
            ));
        }
        let (given, what) = match &self.scales {
            Fp8Scales::Rows(s) => (s.len(), "row"),
            Fp8Scales::Blocks { block, scales } => {
                if block[0] == 0 || block[1] == 0 {
                    return bad(format!("block size {block:?}"));
                }
                (scales.len(), "block")
            }
        };
        if given != self.scale_count() {
            return bad(format!(
                "{given} {what} scales for shape {:?} (expected {})",
                self.shape,
                self.scale_count()
            ));
        }
        Ok(())
    }

    /// The scale of element `(matrix, row, col)`.
    pub fn scale_at(&self, m: usize, row: usize, col: usize) -> f32 {
        let (_, r, c) = self.dims();
        match &self.scales {
            Fp8Scales::Rows(s) => s[m * r + row],
            Fp8Scales::Blocks { block, scales } => {
                let (br, bc) = (r.div_ceil(block[0]), c.div_ceil(block[1]));
                scales[m * br * bc + (row / block[0]) * bc + col / block[1]]
            }
        }
    }

    /// Every element's real value, exactly (`decode(code) · scale` in f32).
    pub fn dequantize(&self) -> Vec<f32> {
        let lut: [f32; 256] = std::array::from_fn(|i| e4m3_to_f32(i as u8));
        let (e, r, c) = self.dims();
        let mut out = Vec::with_capacity(e * r * c);
        for m in 0..e {
            for row in 0..r {
                let codes = &self.codes[(m * r + row) * c..][..c];
                match &self.scales {
                    Fp8Scales::Rows(s) => {
                        let s = s[m * r + row];
                        out.extend(codes.iter().map(|&q| lut[q as usize] * s));
                    }
                    Fp8Scales::Blocks { block, .. } => {
                        for (j, chunk) in codes.chunks(block[1]).enumerate() {
                            let s = self.scale_at(m, row, j * block[1]);
                            out.extend(chunk.iter().map(|&q| lut[q as usize] * s));
                        }
                    }
                }
            }
        }
        out
    }
}

/// The scale of a row for online quantization: `max|w| / 448` (1 for an all-zero row, whose
/// codes are then zeros).
pub fn row_scale(row: &[f32]) -> f32 {
    let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax > 0.0 && amax.is_finite() {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// Quantizes `[.., cols]` rows of `w` to e4m3 with one scale per row (online quantization).
pub fn quantize_rows(w: &[f32], shape: &[usize]) -> Fp8Weight<'static> {
    let cols = shape.last().copied().unwrap_or(1).max(1);
    let mut codes = Vec::with_capacity(w.len());
    let mut scales = Vec::with_capacity(w.len() / cols);
    for row in w.chunks_exact(cols) {
        let s = row_scale(row);
        scales.push(s);
        codes.extend(row.iter().map(|&v| f32_to_e4m3(v / s)));
    }
    Fp8Weight {
        shape: shape.to_vec(),
        codes: Cow::Owned(codes),
        scales: Fp8Scales::Rows(Cow::Owned(scales)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_code_round_trips_and_the_grid_is_the_ocp_one() {
        for code in 0..=255u8 {
            let v = e4m3_to_f32(code);
            if code & 0x7F == 0x7F {
                assert!(v.is_nan());
                continue;
            }
            let back = f32_to_e4m3(v);
            // ±0 both encode by sign.
            assert_eq!(back, code, "code {code:#04x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert_eq!(e4m3_to_f32(0x08), 1.0 / 64.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert_eq!(e4m3_to_f32(0x3F), 1.875);
    }

    #[test]
    fn encoding_rounds_to_nearest_even_and_saturates() {
        // Between 1.0 (0x38) and 1.125 (0x39): the midpoint goes to the even code 0x38.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.0626), 0x39);
        // Between 1.125 (0x39) and 1.25 (0x3A): the midpoint goes to 0x3A.
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        // Subnormal midpoint 1.5/512 rounds to even 2/512.
        assert_eq!(f32_to_e4m3(1.5 / 512.0), 0x02);
        assert_eq!(f32_to_e4m3(0.4 / 512.0), 0x00);
        // 1.9375 rounds up into the next binade: 2.0.
        assert_eq!(f32_to_e4m3(1.9375), 0x40);
        assert_eq!(f32_to_e4m3(1e9), 0x7E);
        assert_eq!(f32_to_e4m3(-500.0), 0xFE);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
        // Against brute force: the nearest finite code, ties to the even mantissa.
        let grid: Vec<(u8, f32)> = (0..0x7Fu8).map(|c| (c, e4m3_to_f32(c))).collect();
        let mut x = 0.0f32;
        while x < 460.0 {
            let best = grid
                .iter()
                .min_by(|a, b| {
                    let (da, db) = ((a.1 - x).abs(), (b.1 - x).abs());
                    da.partial_cmp(&db).unwrap().then((a.0 & 1).cmp(&(b.0 & 1)))
                })
                .unwrap();
            assert_eq!(f32_to_e4m3(x), best.0, "x = {x}");
            x += 0.0137;
        }
    }

    #[test]
    fn dequantize_applies_row_and_partial_block_scales() {
        // 3 × 5 with 2 × 2 blocks: block grid 2 × 3, the last row and column partial.
        let codes: Vec<u8> = (0..15).map(|i| f32_to_e4m3(i as f32)).collect();
        let blocks = Fp8Weight {
            shape: vec![3, 5],
            codes: Cow::Borrowed(&codes),
            scales: Fp8Scales::Blocks {
                block: [2, 2],
                scales: Cow::Owned(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            },
        };
        blocks.check().unwrap();
        let y = blocks.dequantize();
        let want: Vec<f32> = (0..15)
            .map(|i| {
                let (r, c) = (i / 5, i % 5);
                i as f32 * [1.0, 2.0, 3.0, 4.0, 5.0, 6.0][(r / 2) * 3 + c / 2]
            })
            .collect();
        assert_eq!(y, want);
        let rows = Fp8Weight {
            shape: vec![3, 5],
            codes: Cow::Borrowed(&codes),
            scales: Fp8Scales::Rows(Cow::Owned(vec![0.5, 1.0, 2.0])),
        };
        rows.check().unwrap();
        assert_eq!(rows.dequantize()[14], 28.0);
        let short = Fp8Weight {
            scales: Fp8Scales::Rows(Cow::Owned(vec![1.0])),
            ..rows
        };
        assert!(
            short
                .check()
                .unwrap_err()
                .to_string()
                .contains("1 row scales")
        );
    }

    #[test]
    fn online_quantization_keeps_each_row_within_its_grid() {
        let w: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.013)
            .collect();
        let q = quantize_rows(&w, &[4, 16]);
        q.check().unwrap();
        let y = q.dequantize();
        for (row, (a, b)) in w.chunks(16).zip(y.chunks(16)).enumerate() {
            let s = row_scale(a);
            // The row's largest magnitude is exactly representable (448 · s).
            let amax = a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(
                b.iter().any(|v| (v.abs() - amax).abs() <= amax * 1e-6),
                "row {row}"
            );
            for (x, z) in a.iter().zip(b) {
                // Relative step of e4m3 is 2^-3 at worst in the normal range.
                assert!((x - z).abs() <= x.abs() / 16.0 + s / 512.0 * 0.5 + 1e-9);
            }
        }
        assert_eq!(quantize_rows(&[0.0; 4], &[1, 4]).dequantize(), vec![0.0; 4]);
    }
}
