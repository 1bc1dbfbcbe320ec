//! ggml tensor types and their dequantization to f32, block by block, as ggml defines them
//! (`ggml-quants.c`, `dequantize_row_*`):
//!
//! | type | block | bytes | layout | value |
//! |---|---|---|---|---|
//! | Q4_0 | 32 | 18 | `d: f16, qs[16]` | `(nibble − 8)·d`; element `j` is the low nibble of `qs[j]`, `j+16` the high one |
//! | Q4_1 | 32 | 20 | `d: f16, m: f16, qs[16]` | `nibble·d + m`, nibbles as Q4_0 |
//! | Q8_0 | 32 | 34 | `d: f16, qs[32]: i8` | `q·d` |
//! | Q4_K | 256 | 144 | `d, dmin: f16, scales[12], qs[128]` | 8 sub-blocks of 32 with 6-bit scale `sc` and min `m`: `d·sc·nibble − dmin·m`; each 32 bytes of `qs` hold two sub-blocks (low nibbles, then high) |
//! | Q6_K | 256 | 210 | `ql[128], qh[64], scales[16]: i8, d: f16` | `d·scale·(q − 32)`, `q` = 4 low bits from `ql`, 2 high bits from `qh`; 16 sub-blocks of 16 |
//!
//! F32, F16 and BF16 are plain little-endian arrays.

use half::{bf16, f16};

/// The ggml types chimera can load (others are named in the error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
    /// A type the file may hold but this loader does not dequantize (its ggml id).
    Other(u32),
}

/// ggml's names of the type ids (for errors about types that do not load).
fn ggml_name(id: u32) -> &'static str {
    match id {
        6 => "Q5_0",
        7 => "Q5_1",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        13 => "Q5_K",
        15 => "Q8_K",
        16..=23 => "IQ*",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            14 => Self::Q6K,
            30 => Self::BF16,
            6 | 7 | 9..=11 | 13 | 15..=29 | 34 | 35 | 39 => Self::Other(id),
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q6K => 14,
            Self::BF16 => 30,
            Self::Other(id) => id,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4K => "Q4_K",
            Self::Q6K => "Q6_K",
            Self::Other(id) => ggml_name(id),
        }
    }

    /// (elements per block, bytes per block). Types that do not load report (1, 0) so the
    /// table still parses; loading them is an error.
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
            Self::Q4K => (256, 144),
            Self::Q6K => (256, 210),
            Self::Other(id) => match id {
                6 => (32, 22),
                7 => (32, 24),
                9 => (32, 36),
                10 => (256, 84),
                11 => (256, 110),
                13 => (256, 176),
                15 => (256, 292),
                24 => (1, 1),
                25 => (1, 2),
                26 => (1, 4),
                27 | 28 => (1, 8),
                _ => (1, 0),
            },
        }
    }
}

/// The supported types, for error messages.
pub const SUPPORTED: &str = "F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K";

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes `bytes` (whole blocks of `ty`) to f32. `Err` names an unsupported type or a
/// byte count that is not whole blocks.
pub fn dequantize(ty: GgmlType, bytes: &[u8]) -> Result<Vec<f32>, String> {
    let (block, size) = ty.block();
    if matches!(ty, GgmlType::Other(_)) {
        return Err(format!(
            "ggml type {} does not load (supported: {SUPPORTED})",
            ty.name()
        ));
    }
    if !bytes.len().is_multiple_of(size) {
        return Err(format!(
            "{} bytes are not whole {} blocks of {size} bytes",
            bytes.len(),
            ty.name()
        ));
    }
    let mut out = vec![0f32; bytes.len() / size * block];
    let blocks = bytes.chunks_exact(size).zip(out.chunks_exact_mut(block));
    match ty {
        GgmlType::F32 => blocks.for_each(|(b, y)| {
            y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }),
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = h(b, 0)),
        GgmlType::BF16 => {
            blocks.for_each(|(b, y)| y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| q4_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| q6_k(b, y)),
        GgmlType::Other(_) => {}
    }
    Ok(out)
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = h(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = (f32::from(qs[j] & 0x0f) - 8.0) * d;
        y[j + 16] = (f32::from(qs[j] >> 4) - 8.0) * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (h(b, 0), h(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = f32::from(qs[j] & 0x0f) * d + m;
        y[j + 16] = f32::from(qs[j] >> 4) * d + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = h(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[2..34]) {
        *v = f32::from(q as i8) * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) packed in Q4_K's 12 scale bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (h(b, 0), h(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    // Four groups of 64 values: 32 bytes of `qs`, low nibbles then high nibbles.
    for g in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * g, scales);
        let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, min2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let q = &qs[32 * g..32 * g + 32];
        let out = &mut y[64 * g..64 * g + 64];
        for l in 0..32 {
            out[l] = d1 * f32::from(q[l] & 0x0f) - min1;
            out[l + 32] = d2 * f32::from(q[l] >> 4) - min2;
        }
    }
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let ql_all = &b[0..128];
    let qh_all = &b[128..192];
    let sc_all = &b[192..208];
    let d = h(b, 208);
    // Two halves of 128 values: 64 bytes of `ql`, 32 of `qh`, 8 scales each.
    for half in 0..2 {
        let ql = &ql_all[64 * half..64 * half + 64];
        let qh = &qh_all[32 * half..32 * half + 32];
        let sc = &sc_all[8 * half..8 * half + 8];
        let out = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            let s = |k: usize| d * f32::from(sc[is + k] as i8);
            out[l] = s(0) * q1 as f32;
            out[l + 32] = s(2) * q2 as f32;
            out[l + 64] = s(4) * q3 as f32;
            out[l + 96] = s(6) * q4 as f32;
        }
    }
}

/// Quantizes to Q8_0 the way ggml does (`d = max|x| / 127`, round to nearest): for writing
/// test files.
pub fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 34);
    for block in x.chunks(32) {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn f16b(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn q8_0_block_by_hand() {
        let mut b = f16b(0.5).to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let y = dequantize(GgmlType::Q8_0, &b).unwrap();
        let want: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        assert_eq!(y, want);
    }

    #[test]
    fn q4_0_and_q4_1_put_low_nibbles_first() {
        // qs[j] = (hi = 15 - j) << 4 | (lo = j)
        let qs: Vec<u8> = (0..16u8).map(|j| ((15 - j) << 4) | j).collect();
        let mut b = f16b(2.0).to_vec();
        b.extend(&qs);
        let y = dequantize(GgmlType::Q4_0, &b).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 2.0, "low {j}");
            assert_eq!(y[j + 16], (7.0 - j as f32) * 2.0, "high {j}");
        }
        let mut b = f16b(0.25).to_vec();
        b.extend(f16b(-1.0));
        b.extend(&qs);
        let y = dequantize(GgmlType::Q4_1, &b).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 0.25 - 1.0);
            assert_eq!(y[j + 16], (15 - j) as f32 * 0.25 - 1.0);
        }
    }

    #[test]
    fn q4_k_scales_and_mins_unpack_from_twelve_bytes() {
        // Sub-block j gets scale j + 1 and min 2j (6 bits each, the upper two bits of the
        // high sub-blocks stored in the top bits of bytes 0..8).
        let sc: Vec<u8> = (0..8)
            .map(|j| j + 1 + if j >= 4 { 48 } else { 0 })
            .collect();
        let mn: Vec<u8> = (0..8)
            .map(|j| 2 * j + if j >= 4 { 32 } else { 0 })
            .collect();
        let mut scales = [0u8; 12];
        for j in 0..4 {
            scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            scales[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            scales[j + 8] = (sc[j + 4] & 0x0f) | ((mn[j + 4] & 0x0f) << 4);
        }
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &scales), (sc[j], mn[j]), "sub-block {j}");
        }
        let mut b = f16b(0.5).to_vec();
        b.extend(f16b(0.125));
        b.extend(scales);
        // Every low nibble 3, every high nibble 12.
        b.extend([0xc3u8; 128]);
        let y = dequantize(GgmlType::Q4K, &b).unwrap();
        for (i, v) in y.iter().enumerate() {
            let sub = i / 32;
            let q = if sub % 2 == 0 { 3.0 } else { 12.0 };
            let want = 0.5 * f32::from(sc[sub]) * q - 0.125 * f32::from(mn[sub]);
            assert_eq!(*v, want, "element {i}");
        }
    }

    #[test]
    fn q6_k_combines_low_and_high_bits() {
        // q = 37 everywhere (low 4 bits 5, high 2 bits 2): value d·scale·5.
        let mut b = vec![0x55u8; 128]; // ql: both nibbles 5
        b.extend([0xaau8; 64]); // qh: every 2-bit field = 2
        let scales: Vec<i8> = (0..16).map(|i| i as i8 - 8).collect();
        b.extend(scales.iter().map(|&s| s as u8));
        b.extend(f16b(0.75));
        let y = dequantize(GgmlType::Q6K, &b).unwrap();
        for (i, v) in y.iter().enumerate() {
            let scale = f32::from(scales[i / 16]);
            assert_eq!(*v, 0.75 * scale * 5.0, "element {i}");
        }
    }

    #[test]
    fn plain_types_and_bad_lengths() {
        let y = dequantize(GgmlType::F16, &[f16b(1.5), f16b(-2.0)].concat()).unwrap();
        assert_eq!(y, [1.5, -2.0]);
        let y = dequantize(GgmlType::BF16, &bf16::from_f32(3.0).to_le_bytes()).unwrap();
        assert_eq!(y, [3.0]);
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33]).is_err());
        let e = dequantize(GgmlType::Other(13), &[0u8; 176]).unwrap_err();
        assert!(e.contains("Q5_K") && e.contains("Q4_K"), "{e}");
    }

    #[test]
    fn q8_0_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 29) as f32 - 14.0) / 7.0)
            .collect();
        let y = dequantize(GgmlType::Q8_0, &quantize_q8_0(&x)).unwrap();
        for (block, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let step = xs.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            for (a, b) in xs.iter().zip(ys) {
                assert!(
                    (a - b).abs() <= 0.51 * step + 1e-3 * step,
                    "block {block}: {a} vs {b}"
                );
            }
        }
    }
}
