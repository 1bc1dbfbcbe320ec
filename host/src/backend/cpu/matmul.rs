//! Dense products of the CPU backend: `c[m, n] = a[m, k] · b[n, k]ᵀ` (row-major), the shape of
//! every linear layer (`a` the activations, `b` the weight).
//!
//! Two paths, chosen by the number of activation rows `m`:
//! - **skinny** (`m ≤ SKINNY_MAX_ROWS`: decode steps, small batches): the weight is read once,
//!   straight from its rows, split over output columns (weight rows) across rayon's threads.
//!   Each output element is one dot product with a fixed order of operations (16 lanes of
//!   partial sums over `k`, a fixed tree to add them, then the tail), so its bits do not depend
//!   on the thread count, on how the rows are split, or on which other rows share the call. A
//!   decode step is memory-bound: this path streams each weight byte once per step, where a
//!   packing GEMM copies the whole weight first.
//! - **GEMM** (larger `m`: prefill): `matrixmultiply`'s packed, cache-blocked, threaded sgemm.
//!
//! The skinny kernel has two builds: AVX2 intrinsics with fused multiply-adds (4 weight rows
//! per pass over the activations, the next 4 prefetched) where the CPU has them, checked once at
//! run time, and plain Rust with a separate multiply and add for the baseline x86-64 and other
//! targets. One machine always takes the same one; the release build needs no `target-cpu`.
//! It must not allocate per element or hold state between calls; the only allocation is the
//! small lists of weight blocks and output slices a call hands to its tasks.

use rayon::prelude::*;

/// Up to this many activation rows take the skinny path. Above it the packing GEMM, which reuses
/// each loaded weight for many rows from registers, does less work per output.
pub(crate) const SKINNY_MAX_ROWS: usize = 8;

/// Partial sums per dot product (two AVX2 registers; LLVM vectorises the fixed-size loops).
const LANES: usize = 16;
/// Weight rows that share one pass over an activation row.
const ROW_TILE: usize = 4;
/// Below this many multiply-adds a call runs on the calling thread (a rayon hand-off costs
/// more than the work).
const PAR_MIN_MACS: usize = 1 << 15;

/// `c[m, n] = a[m, k] · b[n, k]ᵀ`. The slices hold `m·k`, `n·k` and `m·n` values (callers check).
pub(crate) fn gemm_nt(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    if n == 0 {
        return;
    }
    gemm_nt_shared(a, m, k, &mut [Product { w: b, out: c }]);
}

/// One product of a [`gemm_nt_shared`] call: a weight `[n, k]` and its output `[m, n]`.
pub(crate) struct Product<'a> {
    pub w: &'a [f32],
    pub out: &'a mut [f32],
}

/// `out_s = a[m, k] · w_sᵀ` for weights that share their input (a layer's q/k/v projections):
/// on the skinny path all of them in one parallel dispatch, each output element as
/// [`gemm_nt`] computes it alone.
pub(crate) fn gemm_nt_shared(a: &[f32], m: usize, k: usize, products: &mut [Product<'_>]) {
    if m == 0 {
        return;
    }
    if k == 0 {
        products.iter_mut().for_each(|p| p.out.fill(0.0));
        return;
    }
    if m <= SKINNY_MAX_ROWS {
        skinny(a, m, k, products);
    } else {
        for p in products.iter_mut() {
            packed(a, p.w, p.out, m, k, p.w.len() / k);
        }
    }
}

/// `matrixmultiply`'s sgemm (its own threads).
fn packed(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    // SAFETY: the slices hold m*k, n*k and m*n elements (checked by the callers) and the
    // strides below address exactly those ranges; `c` does not alias `a` or `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            1,
            k as isize,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// The skinny path: each weight's rows in blocks, one rayon task per block (all on the
/// calling thread when the call is small).
fn skinny(a: &[f32], m: usize, k: usize, products: &mut [Product<'_>]) {
    let rows: usize = products.iter().map(|p| p.w.len() / k).sum();
    let threads = rayon::current_num_threads().max(1);
    let serial = m * rows * k < PAR_MIN_MACS || threads == 1;
    // A few blocks per thread so a thread slowed by another process does not hold up the
    // step, each a multiple of the row tile.
    let block_rows = match serial {
        true => rows.max(1),
        false => rows
            .div_ceil(threads * 4)
            .next_multiple_of(ROW_TILE)
            .max(ROW_TILE),
    };
    // The tasks: a block of weight rows, and (block-major, `m` per block) the slices of the
    // output rows it fills.
    let mut weights: Vec<&[f32]> = Vec::new();
    let mut outs: Vec<&mut [f32]> = Vec::new();
    for p in products.iter_mut() {
        let n = p.w.len() / k;
        if n == 0 {
            continue;
        }
        let per = block_rows.min(n);
        let mut parts: Vec<_> = p
            .out
            .chunks_exact_mut(n)
            .map(|r| r.chunks_mut(per))
            .collect();
        for w in p.w.chunks(per * k) {
            weights.push(w);
            for r in parts.iter_mut() {
                outs.extend(r.next());
            }
        }
    }
    if serial {
        for (w, o) in weights.iter().zip(outs.chunks_mut(m)) {
            block(a, w, o, k);
        }
    } else {
        outs.par_chunks_mut(m)
            .zip(weights.par_iter())
            .for_each(|(o, w)| block(a, w, o, k));
    }
}

/// One block: `outs[i][j] = a_i · w_j` for the weight rows `w` (`outs[i].len()` of them).
fn block(a: &[f32], w: &[f32], outs: &mut [&mut [f32]], k: usize) {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time just above).
        unsafe { avx2::block(a, w, outs, k) };
        return;
    }
    portable_block(a, w, outs, k);
}

/// `x · y` (equal lengths) with the order of operations of one element of [`gemm_nt`]'s
/// skinny path (for other kernels' short dot products, such as attention scores).
pub(crate) fn dot(x: &[f32], y: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time just above).
        return unsafe { avx2::dot1(x, y) };
    }
    portable_dot(x, y)
}

/// The block on any CPU: one row at a time.
fn portable_block(a: &[f32], w: &[f32], outs: &mut [&mut [f32]], k: usize) {
    for (j, row) in w.chunks_exact(k).enumerate() {
        for (x, out) in a.chunks_exact(k).zip(outs.iter_mut()) {
            out[j] = portable_dot(x, row);
        }
    }
}

/// One dot product with a multiply then an add per product (LLVM vectorises the 16 running
/// sums with the baseline SIMD).
fn portable_dot(x: &[f32], y: &[f32]) -> f32 {
    let (xc, xt) = x.as_chunks::<LANES>();
    let (yc, yt) = y.as_chunks::<LANES>();
    let mut acc = [0f32; LANES];
    for (xs, ys) in xc.iter().zip(yc) {
        for ((a, x), y) in acc.iter_mut().zip(xs).zip(ys) {
            *a += x * y;
        }
    }
    let tail: f32 = xt.iter().zip(yt).fold(0.0, |t, (x, y)| t + x * y);
    hsum(acc) + tail
}

/// The 16 partial sums added pairwise (a fixed tree: lane l takes lane l + 8, then l + 4, …).
fn hsum(mut v: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        let (lo, hi) = v.split_at_mut(width);
        for (a, b) in lo.iter_mut().zip(hi.iter()) {
            *a += b;
        }
        width /= 2;
    }
    v[0]
}

/// The block with AVX2 registers and fused multiply-adds: [`ROW_TILE`] weight rows share each
/// load of the activations. Every output element takes the same operations whether it was
/// computed in a tile or alone: two 8-wide running sums over `k`'s 16-wide chunks, the fixed
/// tree of [`hsum`], then the fused sum over the tail.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{LANES, ROW_TILE};

    pub(super) fn available() -> bool {
        use std::sync::OnceLock;
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }

    /// While a tile's rows are read, the next tile's are prefetched, one cache line per
    /// 16-wide chunk: a tile's rows are short streams that cross pages, which the hardware
    /// prefetchers follow late (measured here: decode 13% faster with it).
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn block(a: &[f32], w: &[f32], outs: &mut [&mut [f32]], k: usize) {
        let rows = w.len() / k;
        let row = |j: usize| &w[j * k..(j + 1) * k];
        let mut j = 0;
        while j + ROW_TILE <= rows {
            let tile: [&[f32]; ROW_TILE] = std::array::from_fn(|r| row(j + r));
            let ahead = match j + 2 * ROW_TILE <= rows {
                true => j + ROW_TILE,
                false => j,
            };
            let next: [&[f32]; ROW_TILE] = std::array::from_fn(|r| row(ahead + r));
            for (x, out) in a.chunks_exact(k).zip(outs.iter_mut()) {
                out[j..j + ROW_TILE].copy_from_slice(&dot::<ROW_TILE>(x, tile, next));
            }
            j += ROW_TILE;
        }
        for j in j..rows {
            for (x, out) in a.chunks_exact(k).zip(outs.iter_mut()) {
                out[j] = dot::<1>(x, [row(j)], [row(j)])[0];
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot1(x: &[f32], y: &[f32]) -> f32 {
        dot::<1>(x, [y], [y])[0]
    }

    /// `R` dot products of `x` with the rows `w` (each as long as `x`), prefetching the rows
    /// `next` (as long as `x`) alongside.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn dot<const R: usize>(x: &[f32], w: [&[f32]; R], next: [&[f32]; R]) -> [f32; R] {
        let chunks = x.len() / LANES;
        let mut lo = [_mm256_setzero_ps(); R];
        let mut hi = [_mm256_setzero_ps(); R];
        assert!(w.iter().chain(&next).all(|row| row.len() == x.len()));
        let xp = x.as_ptr();
        let (wp, np) = (w.map(<[f32]>::as_ptr), next.map(<[f32]>::as_ptr));
        for c in 0..chunks {
            // SAFETY: c·16 + 16 ≤ x.len() = w[r].len() = next[r].len(), so every load and
            // prefetch is in bounds.
            unsafe {
                let x0 = _mm256_loadu_ps(xp.add(c * LANES));
                let x1 = _mm256_loadu_ps(xp.add(c * LANES + 8));
                for r in 0..R {
                    _mm_prefetch::<_MM_HINT_T0>(np[r].add(c * LANES).cast::<i8>());
                    let p = wp[r].add(c * LANES);
                    lo[r] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(p), lo[r]);
                    hi[r] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(p.add(8)), hi[r]);
                }
            }
        }
        std::array::from_fn(|r| {
            let mut tail = 0.0f32;
            for (xv, wv) in x[chunks * LANES..].iter().zip(&w[r][chunks * LANES..]) {
                tail = xv.mul_add(*wv, tail);
            }
            hsum(lo[r], hi[r]) + tail
        })
    }

    /// [`super::hsum`]'s tree on the two halves of the 16 sums.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum(lo: __m256, hi: __m256) -> f32 {
        let v8 = _mm256_add_ps(lo, hi);
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        let v1 = _mm_add_ss(v2, _mm_shuffle_ps::<0b01>(v2, v2));
        _mm_cvtss_f32(v1)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn reference(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| f64::from(a[i * k + p]) * f64::from(b[j * k + p]))
                    .sum();
            }
        }
        c
    }

    fn run(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![f32::NAN; m * n];
        gemm_nt(a, b, &mut c, m, k, n);
        c
    }

    #[test]
    fn both_paths_match_a_wide_reference() {
        // Row counts on both sides of the skinny limit; widths with and without a tail; output
        // counts that leave a partial row tile and partial blocks.
        for &(m, k, n) in &[
            (1, 576, 192),
            (1, 33, 7),
            (2, 100, 1031),
            (3, 16, 5),
            (SKINNY_MAX_ROWS, 200, 333),
            (SKINNY_MAX_ROWS + 1, 200, 333),
            (40, 70, 90),
            (1, 1, 1),
        ] {
            let (a, b) = (values(m * k, 1), values(n * k, 2));
            let c = run(&a, &b, m, k, n);
            let want = reference(&a, &b, m, k, n);
            for (i, (got, want)) in c.iter().zip(&want).enumerate() {
                let err = (f64::from(*got) - want).abs();
                assert!(
                    err <= 1e-5 * (k as f64).sqrt() * (1.0 + want.abs()),
                    "({m},{k},{n}) element {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn skinny_results_do_not_depend_on_threads_or_batch() {
        let (m, k, n) = (5, 300, 2053);
        let (a, b) = (values(m * k, 3), values(n * k, 4));
        let many = run(&a, &b, m, k, n);
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(|| run(&a, &b, m, k, n));
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap()
            .install(|| run(&a, &b, m, k, n));
        assert_eq!(many, one);
        assert_eq!(many, three);
        // Each row alone gives the bits it had in the batch.
        for i in 0..m {
            let alone = run(&a[i * k..(i + 1) * k], &b, 1, k, n);
            assert_eq!(alone, &many[i * n..(i + 1) * n], "row {i}");
        }
    }

    #[test]
    fn shared_products_equal_separate_ones() {
        for m in [1, 3, SKINNY_MAX_ROWS + 2] {
            let k = 70;
            let a = values(m * k, 7);
            let ws: Vec<Vec<f32>> = [33, 8, 1, 0]
                .iter()
                .map(|&n| values(n * k, n as u64))
                .collect();
            let mut outs: Vec<Vec<f32>> =
                ws.iter().map(|w| vec![f32::NAN; m * w.len() / k]).collect();
            let mut products: Vec<Product> = ws
                .iter()
                .zip(outs.iter_mut())
                .map(|(w, out)| Product { w, out })
                .collect();
            gemm_nt_shared(&a, m, k, &mut products);
            for (w, out) in ws.iter().zip(&outs) {
                assert_eq!(
                    *out,
                    run(&a, w, m, k, w.len() / k),
                    "m {m}, n {}",
                    w.len() / k
                );
            }
        }
    }

    #[test]
    fn empty_reduction_writes_zeros() {
        let mut c = vec![f32::NAN; 6];
        gemm_nt(&[], &[], &mut c, 2, 0, 3);
        assert_eq!(c, [0.0; 6]);
    }

    /// Timing of both paths at SmolLM2-135M's shapes (not a check; run with
    /// `cargo test --release -p chimera --lib matmul::tests::timing -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn timing() {
        for &(k, n) in &[
            (576, 576),
            (576, 192),
            (576, 1536),
            (1536, 576),
            (576, 49152),
        ] {
            let b = values(n * k, 5);
            for m in [1, 2, 4, 8, 16, 64, 300] {
                let a = values(m * k, 6);
                let mut c = vec![0f32; m * n];
                let time = |f: &mut dyn FnMut(&mut [f32])| {
                    let mut c = c.clone();
                    f(&mut c);
                    let reps = (2_000_000_000 / (m * n * k)).clamp(3, 2000);
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        f(&mut c);
                    }
                    t.elapsed().as_secs_f64() * 1e6 / reps as f64
                };
                let s = time(&mut |c| skinny(&a, m, k, &mut [Product { w: &b, out: c }]));
                let p = time(&mut |c| packed(&a, &b, c, m, k, n));
                c[0] = 0.0;
                println!(
                    "m {m:4} k {k:5} n {n:6}: skinny {s:9.1} us ({:5.1} GB/s), packed {p:9.1} us",
                    (n * k * 4) as f64 / s / 1e3
                );
            }
        }
    }
}
