//! Tests of the attention planner and launches: every query covered once by the work list
//! (fixed and dynamic plans, splits and their combine), kernels by dtype, head dim and rows,
//! the Hopper kernels' swizzled tile layouts and a model of their pipelines' barriers
//! (no deadlock, no overwrite of a live stage), refused shapes and warm plans.

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

fn cu_of(q_lens: &[u32]) -> Vec<u32> {
    let mut cu = vec![0];
    for &q in q_lens {
        cu.push(cu.last().copied().unwrap_or(0) + q);
    }
    cu
}

fn dims(heads: u32, kv_heads: u32, head_dim: u32, num_seqs: usize) -> AttnDims {
    AttnDims {
        heads,
        kv_heads,
        head_dim,
        block_size: 16,
        num_seqs: num_seqs as u32,
        kv_fp8: false,
    }
}

/// Replays the kernels' grid decomposition (attention.cu `tile_of`, the partial and
/// combine indexing) and checks that every (token, head) is written exactly once and
/// sees exactly the keys `0..=ctx + i`, each once.
fn check_coverage(q_lens: &[u32], ctx: &[u32], shape: AttnDims, bf16: bool) {
    check_plan_coverage(q_lens, ctx, shape, bf16, None);
}

/// A fixed-shape plan: [`plan_decode_fixed`] with its split count, whose pieces past a
/// range's end are empty, or [`plan_mixed_fixed`] with its two capacities.
#[derive(Debug, Clone, Copy)]
enum Fixed {
    Decode(u32),
    /// Decodes, tiles, splits.
    Mixed(usize, usize, u32),
}

/// As [`check_coverage`], of [`plan`] or a fixed-shape plan.
fn check_plan_coverage(
    q_lens: &[u32],
    ctx: &[u32],
    shape: AttnDims,
    bf16: bool,
    fixed: Option<Fixed>,
) {
    let cu = cu_of(q_lens);
    let mut p = AttnPlan::new();
    match fixed {
        Some(Fixed::Decode(splits)) => assert!(plan_decode_fixed(&cu, ctx, splits, &mut p)),
        Some(Fixed::Mixed(small, large, splits)) => {
            let pad = *cu.last().unwrap_or(&0);
            assert!(plan_mixed_fixed(
                &cu, ctx, small, large, splits, pad, &mut p
            ));
            let pieces = if splits > 1 { splits as usize } else { 1 };
            assert_eq!(p.items(), small * pieces + large);
            assert_eq!(p.combine_rows(), if splits > 1 { small } else { 0 });
        }
        None => plan(&cu, ctx, &mut p),
    }
    let n_items = p.items();
    for c in &WorkCol::ALL[..6] {
        assert_eq!(p.column(*c).len(), n_items, "{c:?}");
    }
    for c in &WorkCol::ALL[6..] {
        assert_eq!(p.column(*c).len(), p.combine_rows(), "{c:?}");
    }
    assert!(p.partial_rows() <= MAX_PARTIAL_ROWS);
    let col = |c: WorkCol, i: usize| p.column(c)[i] as usize;
    for i in 0..n_items {
        let small = i < p.small;
        let qn = col(WorkCol::QCount, i);
        if let Some(Fixed::Mixed(..)) = fixed {
            // Decodes and padding in the small class; padding or longer chunks after.
            assert!(qn <= 1 || !small, "item {i} class");
            if qn == 0 {
                continue;
            }
        } else {
            assert_eq!(qn <= SMALL_Q as usize, small, "item {i} class");
        }
        assert!(
            col(WorkCol::KvFirst, i) < col(WorkCol::KvEnd, i)
                || (fixed.is_some() && col(WorkCol::KvFirst, i) == col(WorkCol::KvEnd, i)),
            "empty piece {i}"
        );
    }

    // Every prefill kernel: the portable one and Hopper's.
    for prefill in PrefillKernel::ALL {
        let launches = launches(&p, shape, bf16, prefill).expect("valid shape");
        let g = (shape.heads / shape.kv_heads) as usize;
        let heads = shape.heads as usize;
        // (token, head) → times written; partial (row, head) → key range written.
        let mut written: HashMap<(usize, usize), u32> = HashMap::new();
        let mut partials: HashMap<(usize, usize), (usize, usize)> = HashMap::new();
        // (token, head) → key ranges that reached its output.
        let mut ranges: HashMap<(usize, usize), Vec<(usize, usize)>> = HashMap::new();
        for l in &launches {
            let (_, entry) = crate::entry(l.entry).expect("declared entry");
            let kinds: Vec<Param> = l.args.iter().map(AttnArg::param).collect();
            assert_eq!(kinds, entry.params, "{} arguments", l.entry);
            let base = match l.args[if entry.params.len() == MAIN.len() {
                16
            } else {
                7
            }] {
                AttnArg::U32(b) => b as usize,
                other => panic!("item base is {other:?}"),
            };
            if entry.params.len() == MAIN.len() {
                let k = KERNELS
                    .iter()
                    .find(|k| k.entry == l.entry)
                    .expect("a main kernel");
                assert_eq!(
                    (l.block, l.smem),
                    ((k.threads, 1, 1), k.smem),
                    "{}",
                    l.entry
                );
                let rows_per_cta = k.rows as usize;
                for x in 0..l.grid.0 as usize {
                    for y in 0..l.grid.1 as usize {
                        let it = base + y;
                        let kvh = x % shape.kv_heads as usize;
                        let rt = x / shape.kv_heads as usize;
                        let s = col(WorkCol::Seq, it);
                        let (qf, qn) = (col(WorkCol::QFirst, it), col(WorkCol::QCount, it));
                        let (kv0, kv1) = (col(WorkCol::KvFirst, it), col(WorkCol::KvEnd, it));
                        let part = p.column(WorkCol::Part)[it];
                        for r in rt * rows_per_cta..(qn * g).min(rt * rows_per_cta + rows_per_cta) {
                            let i = qf + r / g;
                            let h = kvh * g + r % g;
                            let tok = cu[s] as usize + i;
                            let range = (kv0, kv1.min(ctx[s] as usize + i + 1));
                            if part == NO_PART {
                                *written.entry((tok, h)).or_default() += 1;
                                ranges.entry((tok, h)).or_default().push(range);
                            } else {
                                let row = part as usize + r / g;
                                assert!(row < p.partial_rows() as usize);
                                let prev = partials.insert((row, h), range);
                                assert!(prev.is_none(), "partial ({row}, {h}) written twice");
                            }
                        }
                    }
                }
            } else {
                assert_eq!((l.grid.0, l.block, l.smem), (shape.heads, (128, 1, 1), 0));
                for y in 0..l.grid.1 as usize {
                    let c = base + y;
                    let tok = col(WorkCol::CombToken, c);
                    if col(WorkCol::CombSplits, c) == 0 {
                        // A padding decode's row: zeros to the padding token.
                        assert!(matches!(fixed, Some(Fixed::Mixed(..))));
                        assert!(tok >= *cu.last().unwrap_or(&0) as usize);
                        continue;
                    }
                    let (first, stride) = (col(WorkCol::CombPart, c), col(WorkCol::CombStride, c));
                    for h in 0..heads {
                        *written.entry((tok, h)).or_default() += 1;
                        for j in 0..col(WorkCol::CombSplits, c) {
                            let range = partials
                                .remove(&(first + j * stride, h))
                                .expect("combine reads a written partial");
                            ranges.entry((tok, h)).or_default().push(range);
                        }
                    }
                }
            }
        }
        assert!(partials.is_empty(), "partials never combined");
        let tokens = *cu.last().unwrap_or(&0) as usize;
        assert_eq!(written.len(), tokens * heads, "every (token, head) written");
        assert!(written.values().all(|&n| n == 1), "written once");
        for (s, &q) in q_lens.iter().enumerate() {
            for i in 0..q as usize {
                for h in 0..heads {
                    let tok = cu[s] as usize + i;
                    let mut r = ranges.remove(&(tok, h)).unwrap_or_default();
                    r.retain(|&(a, b)| a < b);
                    r.sort_unstable();
                    let mut next = 0;
                    for (a, b) in r {
                        assert_eq!(a, next, "token {tok} head {h}: gap or overlap at {a}");
                        next = b;
                    }
                    assert_eq!(
                        next,
                        ctx[s] as usize + i + 1,
                        "token {tok} head {h}: range end"
                    );
                }
            }
        }
    }
}

#[test]
fn a_fixed_decode_plan_has_the_same_shape_for_any_context() {
    let shape = dims(32, 8, 128, 4);
    let mut shapes = Vec::new();
    for ctx in [[0u32, 5, 70, 3000], [40_000, 1, 1, 1], [63, 64, 65, 128]] {
        for splits in [1u32, 4, 16] {
            let mut p = AttnPlan::new();
            assert!(plan_decode_fixed(&[0, 1, 2, 3, 4], &ctx, splits, &mut p));
            assert_eq!(p.items(), 4 * splits as usize);
            assert_eq!(p.combine_rows(), if splits > 1 { 4 } else { 0 });
            let l = launches(&p, shape, true, PrefillKernel::Wgmma).expect("shape");
            let grids: Vec<_> = l.iter().map(|l| (l.entry, l.grid, l.smem)).collect();
            shapes.push((splits, grids));
            check_plan_coverage(
                &[1, 1, 1, 1],
                &ctx,
                shape,
                true,
                Some(Fixed::Decode(splits)),
            );
            check_plan_coverage(
                &[1, 1, 1, 1],
                &ctx,
                shape,
                false,
                Some(Fixed::Decode(splits)),
            );
        }
    }
    // Same split count, same launches, whatever the contexts.
    for (splits, grids) in &shapes {
        let first = shapes.iter().find(|(s, _)| s == splits).expect("seen");
        assert_eq!(&first.1, grids, "splits {splits}");
    }
    // Pieces are at least MIN_SPLIT keys, as the eager plan's: 2049 keys in 64 splits are
    // 17 pieces (16 of 128 and the last key), the other 47 empty.
    let mut p = AttnPlan::new();
    assert!(plan_decode_fixed(&[0, 1], &[2048], 64, &mut p));
    let (first, end) = (p.column(WorkCol::KvFirst), p.column(WorkCol::KvEnd));
    let lens: Vec<u32> = first.iter().zip(end).map(|(a, b)| b - a).collect();
    assert_eq!(lens.iter().filter(|&&l| l == MIN_SPLIT).count(), 16);
    assert_eq!(lens.iter().filter(|&&l| l == 1).count(), 1);
    assert_eq!(lens.iter().filter(|&&l| l == 0).count(), 47);
    // Not decodes, or too many partial rows: refused.
    assert!(!plan_decode_fixed(&[0, 2], &[5], 4, &mut p));
    let many: Vec<u32> = (0..=300).collect();
    assert!(!plan_decode_fixed(&many, &[9; 300], 16, &mut p));
    assert_eq!(p.items(), 0);
}

#[test]
fn a_prefill_is_tiled_long_tiles_first_and_not_split() {
    let mut p = AttnPlan::new();
    plan(&[0, 8192], &[0], &mut p);
    assert_eq!(p.items(), 64);
    assert_eq!(p.combine_rows(), 0);
    assert_eq!(p.column(WorkCol::QFirst)[0], 8192 - 128);
    assert_eq!(p.column(WorkCol::KvEnd)[0], 8192);
    assert!(p.column(WorkCol::Part).iter().all(|&x| x == NO_PART));
    let l = launches(&p, dims(32, 8, 128, 1), true, PrefillKernel::MmaSync).expect("shape");
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].entry, "attn_prefill_d128_bf16");
    // 128 tokens × 4 heads per item = 2 row tiles of 256 per kv head.
    assert_eq!(
        (l[0].grid, l[0].block, l[0].smem),
        ((8 * 2, 64, 1), (256, 1, 1), 98816)
    );
    // On Hopper: 4 row tiles of 128 (two warpgroups of 64 rows) per kv head.
    for (prefill, entry) in [
        (PrefillKernel::Wgmma, "attn_prefill_wgmma_d128_bf16"),
        (
            PrefillKernel::WgmmaPingPong,
            "attn_prefill_wgmma_pp_d128_bf16",
        ),
    ] {
        let l = launches(&p, dims(32, 8, 128, 1), true, prefill).expect("shape");
        assert_eq!(l.len(), 1);
        assert_eq!(l[0].entry, entry);
        assert_eq!(prefill.entry(), entry);
        assert_eq!(
            (l[0].grid, l[0].block, l[0].smem),
            ((8 * 4, 64, 1), (256, 1, 1), 230448)
        );
    }
    check_coverage(&[8192], &[0], dims(32, 8, 128, 1), true);
}

/// Over an FP8 cache every main launch is its kernel's `_kvfp8` twin with the same grid and
/// shared memory, the `mma.sync` prefill kernel stands in for the warpgroup-MMA ones, every
/// entry exists, and the twins whose shared memory needs the limit raised are listed.
#[test]
fn an_fp8_cache_runs_each_kernels_fp8_twin() {
    let cases: [(&[u32], &[u32], u32, bool); 5] = [
        (&[8192], &[0], 128, true),         // prefill tiles
        (&[1; 64], &[2048; 64], 128, true), // decodes
        (&[1], &[39_999], 64, true),        // a split decode
        (&[40, 1], &[100, 7], 256, true),   // small chunks, d = 256
        (&[5, 1], &[3, 9], 128, false),     // f32: SIMT
    ];
    let opt_in: Vec<(&str, u32)> = smem_opt_in().collect();
    for (q, ctx, head_dim, bf16) in cases {
        let mut p = AttnPlan::new();
        plan(&cu_of(q), ctx, &mut p);
        let plain = dims(32, 8, head_dim, q.len());
        let fp8 = AttnDims {
            kv_fp8: true,
            ..plain
        };
        for prefill in PrefillKernel::ALL {
            let a = launches(&p, plain, bf16, PrefillKernel::MmaSync).expect("shape");
            let b = launches(&p, fp8, bf16, prefill).expect("shape");
            assert_eq!(a.len(), b.len());
            for (a, b) in a.iter().zip(&b) {
                if a.entry.starts_with("attn_combine") {
                    assert_eq!(a, b, "the combine reads f32 partials either way");
                    continue;
                }
                assert_eq!(b.entry, format!("{}_kvfp8", a.entry));
                assert_eq!((a.grid, a.block, a.smem), (b.grid, b.block, b.smem));
                assert!(ENTRIES.iter().any(|e| e.name == b.entry), "{}", b.entry);
                assert_eq!(
                    &b.args[b.args.len() - 2..],
                    [AttnArg::KScale, AttnArg::VScale]
                );
                if b.smem > DEFAULT_SMEM_LIMIT {
                    assert!(opt_in.contains(&(b.entry, b.smem)), "{}", b.entry);
                }
            }
        }
    }
}

#[test]
fn a_lone_long_decode_is_split_and_combined() {
    let mut p = AttnPlan::new();
    plan(&[0, 1], &[39_999], &mut p);
    let n = p.items();
    assert!(n > 16, "{n} pieces");
    assert_eq!(p.combine_rows(), 1);
    assert_eq!(p.column(WorkCol::CombSplits)[0] as usize, n);
    assert_eq!(p.partial_rows() as usize, n);
    assert!(
        p.column(WorkCol::KvFirst)
            .iter()
            .all(|&x| x % SPLIT_ALIGN == 0)
    );
    let l = launches(&p, dims(32, 8, 128, 1), true, PrefillKernel::WgmmaPingPong).expect("shape");
    assert_eq!(
        l.iter().map(|l| l.entry).collect::<Vec<_>>(),
        ["attn_decode_d128_bf16", "attn_combine_bf16"]
    );
    // One row tile: the 4 query heads of a group share a CTA.
    assert_eq!(l[0].grid, (8, n as u32, 1));
    assert_eq!(
        scratch_bytes(&p, dims(32, 8, 128, 1)),
        [n * 32 * 128 * 4, n * 32 * 2 * 4]
    );
    check_coverage(&[1], &[39_999], dims(32, 8, 128, 1), true);
}

#[test]
fn a_large_decode_batch_is_not_split() {
    let q = vec![1; 256];
    let ctx = vec![2048; 256];
    let mut p = AttnPlan::new();
    plan(&cu_of(&q), &ctx, &mut p);
    assert_eq!(p.items(), 256);
    assert_eq!(p.partial_rows(), 0);
    let l = launches(
        &p,
        dims(32, 8, 128, 256),
        true,
        PrefillKernel::WgmmaPingPong,
    )
    .expect("shape");
    assert_eq!(l.len(), 1);
    assert_eq!(scratch_bytes(&p, dims(32, 8, 128, 256)), [0, 0]);
}

#[test]
fn a_long_prefill_chunk_is_not_split() {
    let q = vec![4096];
    let ctx = vec![0];
    let mut p = AttnPlan::new();
    plan(&cu_of(&q), &ctx, &mut p);
    assert_eq!(p.partial_rows(), 0);
    assert_eq!(p.items(), 4096 / Q_TILE as usize);
}

#[test]
fn a_mid_size_decode_batch_is_split_to_fill_the_gpu() {
    // 64 decodes of 2048 keys unsplit are 512 CTAs at 8 KV heads, one wave and a bit.
    let q = vec![1; 64];
    let ctx = vec![2048; 64];
    let mut p = AttnPlan::new();
    plan(&cu_of(&q), &ctx, &mut p);
    assert_eq!(p.items(), 64 * 4);
    assert_eq!(p.partial_rows(), 64 * 4);
    check_coverage(&q, &ctx, dims(32, 8, 128, 64), true);
}

#[test]
fn a_mixed_batch_covers_every_query_once() {
    // Decodes, a fresh prefill, a chunk over a non-aligned cached prefix, a small chunk.
    let q = [1, 1, 131, 33, 7, 1000, 1];
    let ctx = [1327, 36, 0, 462, 5000, 17, 32_000];
    for (h, kvh) in [(32, 8), (8, 2), (4, 1), (4, 4)] {
        for d in [8, 12, 24, 64, 128, 256] {
            for bf16 in [false, true] {
                check_coverage(&q, &ctx, dims(h, kvh, d, q.len()), bf16);
            }
        }
    }
}

#[test]
fn the_kernel_follows_dtype_head_dim_and_rows() {
    let entry = |d, bf16, rows| kernel(&dims(8, 8, d, 1), bf16, rows, PrefillKernel::MmaSync).entry;
    assert_eq!(entry(128, false, 512), "attn_simt_f32");
    assert_eq!(entry(24, true, 512), "attn_simt_bf16");
    assert_eq!(entry(64, true, 16), "attn_decode_d64_bf16");
    assert_eq!(entry(64, true, 17), "attn_mma_d64_bf16");
    assert_eq!(entry(128, true, 4), "attn_decode_d128_bf16");
    assert_eq!(entry(128, true, 255), "attn_mma_d128_bf16");
    assert_eq!(entry(128, true, 256), "attn_prefill_d128_bf16");
    assert_eq!(entry(256, true, 4), "attn_mma_d256_bf16");
    // With Hopper's wgmma kernel: d = 128 tiles that fill one of its 128-row CTAs; f32,
    // decodes and other head dims as before.
    let hopper = |d, bf16, rows| kernel(&dims(8, 8, d, 1), bf16, rows, PrefillKernel::Wgmma).entry;
    assert_eq!(hopper(128, true, 16), "attn_decode_d128_bf16");
    assert_eq!(hopper(128, true, 127), "attn_mma_d128_bf16");
    assert_eq!(hopper(128, true, 128), "attn_prefill_wgmma_d128_bf16");
    assert_eq!(hopper(128, true, 512), "attn_prefill_wgmma_d128_bf16");
    assert_eq!(hopper(128, false, 512), "attn_simt_f32");
    assert_eq!(hopper(64, true, 512), "attn_mma_d64_bf16");
    assert_eq!(hopper(256, true, 512), "attn_mma_d256_bf16");
    assert_eq!(
        kernel(&dims(8, 8, 128, 1), true, 200, PrefillKernel::WgmmaPingPong).entry,
        "attn_prefill_wgmma_pp_d128_bf16"
    );
    // Shared memory as attention.cu's MmaShape lays it out (the kernels trap on less).
    let smem: Vec<(&str, u32, u32, u32)> = KERNELS
        .iter()
        .map(|k| (k.entry, k.rows, k.threads, k.smem))
        .collect();
    assert_eq!(
        smem,
        [
            ("attn_simt_f32", 16, 128, 0),
            ("attn_simt_bf16", 16, 128, 0),
            ("attn_decode_d64_bf16", 16, 128, 32768 + 512),
            ("attn_decode_d128_bf16", 16, 128, 65536 + 512),
            ("attn_mma_d64_bf16", 64, 128, 16384 + 512),
            ("attn_mma_d128_bf16", 64, 128, 32768 + 512),
            ("attn_mma_d256_bf16", 64, 128, 32768 + 128),
            ("attn_prefill_d128_bf16", 256, 256, 32768 + 65536 + 512),
            // attention_sm90.cu's SMEM: alignment, Q, 3 × (K + V), 6 mbarriers; within
            // the 227 KiB a Hopper block may opt in to.
            (
                "attn_prefill_wgmma_d128_bf16",
                128,
                256,
                1024 + 32768 + 3 * 65536 + 48
            ),
            (
                "attn_prefill_wgmma_pp_d128_bf16",
                128,
                256,
                1024 + 32768 + 3 * 65536 + 48
            ),
        ]
    );
    const { assert!(WGMMA_D128.smem <= 227 * 1024) };
    assert_eq!(
        smem_opt_in().collect::<Vec<_>>(),
        [
            ("attn_decode_d128_bf16", 66048),
            ("attn_decode_d128_bf16_kvfp8", 66048),
            ("attn_prefill_d128_bf16", 98816),
            ("attn_prefill_d128_bf16_kvfp8", 98816),
            ("attn_prefill_wgmma_d128_bf16", 230448),
            ("attn_prefill_wgmma_pp_d128_bf16", 230448)
        ]
    );
}

/// A CPU model of `attention_sm90.cu`'s shared-memory tiles against the addresses wgmma
/// reads through its descriptors (PTX ISA, "Shared Memory Matrix Layout": the canonical
/// 128-byte-swizzle layouts in units of bf16 elements, T = 8 of them per 16 bytes):
/// K-major `((8,m),(T,2k)):((8T,SBO),(1,T))` for Q and K, MN-major
/// `((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))` for V, then `Swizzle<3,4,3>` on the byte
/// address (bits 4–6 XOR bits 7–9). Every element an instruction reads must be the one the
/// kernel's gather wrote there.
#[test]
fn the_wgmma_tiles_match_the_canonical_swizzled_layouts() {
    // attention_sm90.cu: sw128 (chunk c of row r in a [rows × 128] tile) and desc128.
    let sw128 =
        |rows: u32, r: u32, c: u32| (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
    // Where the kernel stores element (row, col) of a tile at `base`.
    let stored =
        |base: u32, rows: u32, r: u32, col: u32| base + sw128(rows, r, col / 8) + (col % 8) * 2;
    let swizzle = |addr: u32| addr ^ (((addr >> 7) & 7) << 4);
    // Descriptor fields as encoded (>> 4) and decoded again: what the hardware sees.
    let field = |x: u32| ((x & 0x3FFFF) >> 4) << 4;
    // K-major: element (mn, k) of an m64/n128 × k16 operand.
    let k_major = |start: u32, sbo: u32, mn: u32, k: u32| {
        swizzle(field(start) + (mn % 8) * 128 + (mn / 8) * field(sbo) + (k % 8) * 2 + (k / 8) * 16)
    };
    // MN-major: element (n, k) of a k16 × n128 operand.
    let mn_major = |start: u32, lbo: u32, sbo: u32, n: u32, k: u32| {
        swizzle(
            field(start)
                + (n % 64) * 2
                + (n / 64) * field(lbo)
                + (k % 8) * 128
                + (k / 8) * field(sbo),
        )
    };
    let (bm, bn) = (128u32, 128u32);
    let s_q = 3 * 1024; // any 1024-byte-aligned base
    let s_k = s_q + bm * 128 * 2;
    let s_v = s_k + bn * 128 * 2;
    for ks in 0..8u32 {
        let col = (ks & 3) * 32;
        for wrow in [0u32, 64] {
            let start = s_q + (ks >> 2) * (bm * 128) + wrow * 128 + col;
            for m in 0..64 {
                for k in 0..16 {
                    let want = stored(s_q, bm, wrow + m, 16 * ks + k);
                    assert_eq!(
                        k_major(start, 1024, m, k),
                        want,
                        "Q ks {ks} row {} k {k}",
                        wrow + m
                    );
                }
            }
        }
        let start = s_k + (ks >> 2) * (bn * 128) + col;
        for n in 0..bn {
            for k in 0..16 {
                assert_eq!(
                    k_major(start, 1024, n, k),
                    stored(s_k, bn, n, 16 * ks + k),
                    "K ks {ks} key {n}"
                );
            }
        }
    }
    for kk in 0..bn / 16 {
        let start = s_v + kk * 2048;
        for n in 0..128 {
            for k in 0..16 {
                let want = stored(s_v, bn, 16 * kk + k, n);
                assert_eq!(
                    mn_major(start, bn * 128, 1024, n, k),
                    want,
                    "V kk {kk} d {n} key {k}"
                );
            }
        }
    }
    // The gather writes each 16-byte chunk of a tile exactly once, inside the tile.
    let mut seen = std::collections::HashSet::new();
    for r in 0..bn {
        for c in 0..16 {
            let off = sw128(bn, r, c);
            assert!(off % 16 == 0 && off < bn * 256 && seen.insert(off));
        }
    }
}

/// One synchronisation step of a warpgroup in `attention_sm90.cu` (128 threads acting
/// together): an arrival on a stage's full (a gather of `tile`) or empty mbarrier, a
/// parity wait on one, a read of the tile a stage holds, a named barrier sync or arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
enum SyncOp {
    ArriveFull { stage: usize, tile: usize },
    ArriveEmpty(usize),
    WaitFull(usize, usize),
    WaitEmpty(usize, usize),
    Use(usize),
    BarSync(usize),
    BarArrive(usize),
}

const SM90_STAGES: usize = 3;

/// Warpgroup `wg`'s steps in `prefill_d128<PLAIN>` (`pingpong` false, `lead` 2) or
/// `<PINGPONG>` (true, 1) for a CTA of `ntiles` KV tiles of which it computes the first
/// `jn`; mirrors the kernel's loops.
fn sm90_program(wg: usize, ntiles: usize, jn: usize, pingpong: bool, lead: usize) -> Vec<SyncOp> {
    use SyncOp::*;
    const STAGES: usize = SM90_STAGES;
    let mut ops = Vec::new();
    let fill = |tile: usize| ArriveFull {
        stage: tile % STAGES,
        tile,
    };
    // The kernel's refill_wait and refill_copy.
    let refill_wait = |ops: &mut Vec<SyncOp>, j: usize| {
        let ahead = j + lead;
        if ahead < ntiles && ahead >= STAGES {
            let prev = ahead - STAGES;
            ops.push(WaitEmpty(prev % STAGES, (prev / STAGES) & 1));
        }
    };
    let refill_copy = |ops: &mut Vec<SyncOp>, j: usize| {
        if j + lead < ntiles {
            ops.push(fill(j + lead));
        }
    };
    ops.extend((0..lead.min(ntiles)).map(fill));
    let wait_full = |j: usize| WaitFull(j % STAGES, (j / STAGES) & 1);
    // The MMAs read their tiles from issue to wait: the next tile's copies, issued in
    // between, must go elsewhere (Use before and after them).
    if !pingpong {
        for j in 0..ntiles {
            refill_wait(&mut ops, j);
            if j < jn {
                ops.extend([wait_full(j), Use(j)]);
                refill_copy(&mut ops, j);
                ops.push(Use(j));
            } else {
                refill_copy(&mut ops, j);
            }
            ops.push(ArriveEmpty(j % STAGES));
        }
        return ops;
    }
    // Ping-pong: stages hold groups (K(g), V(g − 1)), g = 0..=ntiles; warpgroup batch g
    // reads group g alone; group j + lead is gathered (into the stage of group
    // j + lead − STAGES, once released) while batch j runs.
    let (mine, other) = (1 + wg, 2 - wg);
    let refill = |ops: &mut Vec<SyncOp>, j: usize| {
        let g = j + lead;
        if g <= ntiles {
            if g >= STAGES {
                ops.push(WaitEmpty(
                    (g - STAGES) % STAGES,
                    ((g - STAGES) / STAGES) & 1,
                ));
            }
            ops.push(fill(g));
        }
    };
    if wg == 1 && ntiles > 0 {
        ops.push(BarArrive(1));
    }
    let mut j0 = 0;
    if jn > 0 {
        for j in 0..=jn {
            ops.extend([wait_full(j), BarSync(mine), Use(j), BarArrive(other)]);
            refill(&mut ops, j);
            ops.extend([Use(j), ArriveEmpty(j % STAGES)]);
        }
        j0 = jn + 1;
    }
    if ntiles > 0 {
        for j in j0..=ntiles {
            refill(&mut ops, j);
            ops.extend([BarSync(mine), BarArrive(other), ArriveEmpty(j % STAGES)]);
        }
    }
    if wg == 0 && ntiles > 0 {
        ops.push(BarSync(mine));
    }
    ops
}

/// Every interleaving of the two warpgroups' steps: none deadlocks, a tile is read only
/// while its stage holds it, a stage receives its tiles in order, and no named barrier is
/// left with arrivals. mbarriers complete a phase at 256 arrivals (both warpgroups) and a
/// parity wait passes once the phase of that parity has completed, as in PTX.
fn check_sm90_sync(progs: &[Vec<SyncOp>; 2]) {
    use SyncOp::*;
    const STAGES: usize = SM90_STAGES;
    // (pcs, blocked at a named barrier, mbarrier (pending, completed) full then empty,
    // named barrier counts, tile held by each stage)
    type State = ([usize; 2], [bool; 2], [(u32, u32); 6], [u32; 3], [i64; 3]);
    let init: State = ([0; 2], [false; 2], [(256, 0); 6], [0; 3], [-1; 3]);
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![init];
    while let Some(st) = stack.pop() {
        if !seen.insert(st) {
            continue;
        }
        let (pcs, blocked, mb, nb, held) = st;
        if (0..2).all(|w| pcs[w] == progs[w].len()) {
            assert_eq!(nb, [0; 3], "named barrier left with arrivals");
            continue;
        }
        let mut moved = false;
        for w in 0..2 {
            if pcs[w] == progs[w].len() || blocked[w] {
                continue;
            }
            let (mut pcs2, mut bl2, mut mb2, mut nb2, mut held2) = (pcs, blocked, mb, nb, held);
            let arrive = |mb2: &mut [(u32, u32); 6], i: usize| {
                mb2[i].0 -= 128;
                if mb2[i].0 == 0 {
                    mb2[i] = (256, mb2[i].1 + 1);
                }
            };
            match progs[w][pcs[w]] {
                ArriveFull { stage, tile } => {
                    let before = if tile >= STAGES {
                        (tile - STAGES) as i64
                    } else {
                        -1
                    };
                    assert!(
                        held2[stage] == tile as i64 || held2[stage] == before,
                        "stage {stage} skipped to tile {tile}"
                    );
                    held2[stage] = tile as i64;
                    arrive(&mut mb2, stage);
                    pcs2[w] += 1;
                }
                ArriveEmpty(stage) => {
                    arrive(&mut mb2, STAGES + stage);
                    pcs2[w] += 1;
                }
                op @ (WaitFull(stage, parity) | WaitEmpty(stage, parity)) => {
                    let i = if matches!(op, WaitFull(..)) {
                        stage
                    } else {
                        STAGES + stage
                    };
                    if mb[i].1 as usize % 2 == parity {
                        continue; // that phase has not completed
                    }
                    pcs2[w] += 1;
                }
                Use(tile) => {
                    assert_eq!(
                        held[tile % STAGES],
                        tile as i64,
                        "tile {tile} overwritten before use"
                    );
                    pcs2[w] += 1;
                }
                op @ (BarSync(id) | BarArrive(id)) => {
                    nb2[id] += 128;
                    if matches!(op, BarSync(_)) {
                        bl2[w] = true;
                    } else {
                        pcs2[w] += 1;
                    }
                    if nb2[id] == 256 {
                        nb2[id] = 0;
                        for v in 0..2 {
                            if bl2[v] && progs[v][pcs2[v]] == BarSync(id) {
                                bl2[v] = false;
                                pcs2[v] += 1;
                            }
                        }
                    }
                }
            }
            stack.push((pcs2, bl2, mb2, nb2, held2));
            moved = true;
        }
        assert!(
            moved,
            "deadlock at {pcs:?}: {:?}",
            [0, 1].map(|w| progs[w].get(pcs[w]))
        );
    }
}

#[test]
fn the_sm90_pipelines_neither_deadlock_nor_overwrite_a_live_stage() {
    for (pingpong, lead) in [(false, 2), (true, 1)] {
        for ntiles in 0..=7 {
            // The CTA's last warpgroup with rows computes every tile; the first may stop
            // earlier (its rows' keys end sooner) or have no rows.
            let mut splits: Vec<[usize; 2]> = (0..=ntiles).map(|jn0| [jn0, ntiles]).collect();
            splits.push([ntiles, 0]);
            for jn in splits {
                let progs = [0, 1].map(|wg| sm90_program(wg, ntiles, jn[wg], pingpong, lead));
                check_sm90_sync(&progs);
            }
        }
    }
    // The check can fail: the ping-pong schedule gathering three groups ahead overwrites
    // the stage its batch reads; without warpgroup 0's last wait a named barrier keeps
    // warpgroup 1's last arrival; a refill that does not wait for the stage to be
    // released overwrites a live one (either schedule).
    let too_far = [0, 1].map(|wg| sm90_program(wg, 5, 5, true, 3));
    let mut unmatched = [0, 1].map(|wg| sm90_program(wg, 5, 5, true, 1));
    assert_eq!(unmatched[0].pop(), Some(SyncOp::BarSync(1)));
    let mut eager = [0, 1].map(|wg| sm90_program(wg, 6, 6, false, 2));
    // (In ping-pong a computing warpgroup's refill follows its turn, which already
    // orders it after the other's release; a warpgroup with no tiles left refills before
    // its turn and relies on the wait.)
    let mut eager_pp = [0, 1].map(|wg| sm90_program(wg, 6, [3, 6][wg], true, 1));
    for p in eager.iter_mut().chain(eager_pp.iter_mut()) {
        p.retain(|op| !matches!(op, SyncOp::WaitEmpty(..)));
    }
    for progs in [too_far, unmatched, eager, eager_pp] {
        let caught = std::panic::catch_unwind(|| check_sm90_sync(&progs));
        assert!(caught.is_err(), "a broken schedule passed");
    }
}

#[test]
fn bad_shapes_are_refused() {
    let mut p = AttnPlan::new();
    plan(&[0, 1], &[0], &mut p);
    let ok = dims(8, 2, 64, 1);
    assert!(launches(&p, ok, true, PrefillKernel::Wgmma).is_ok());
    let bad = [
        (
            AttnDims { kv_heads: 3, ..ok },
            AttnError::Heads {
                heads: 8,
                kv_heads: 3,
            },
        ),
        (
            AttnDims { kv_heads: 0, ..ok },
            AttnError::Heads {
                heads: 8,
                kv_heads: 0,
            },
        ),
        (
            AttnDims {
                head_dim: 257,
                ..ok
            },
            AttnError::HeadDim(257),
        ),
        (
            AttnDims {
                block_size: 0,
                ..ok
            },
            AttnError::BlockSize,
        ),
        (
            AttnDims { num_seqs: 2, ..ok },
            AttnError::Seqs { plan: 1, shape: 2 },
        ),
    ];
    for (shape, err) in bad {
        assert_eq!(launches(&p, shape, true, PrefillKernel::Wgmma), Err(err));
    }
}

#[test]
fn an_empty_step_launches_nothing() {
    let mut p = AttnPlan::new();
    plan(&[0, 0, 0], &[5, 0], &mut p);
    assert_eq!(p.items(), 0);
    assert_eq!(
        launches(&p, dims(4, 4, 8, 2), false, PrefillKernel::Wgmma),
        Ok(vec![])
    );
}

#[test]
fn a_warm_plan_does_not_allocate() {
    let q = [1, 1, 300, 5];
    let ctx = [30_000, 77, 0, 9000];
    let cu = cu_of(&q);
    let mut p = AttnPlan::new();
    plan(&cu, &ctx, &mut p);
    let before: Vec<(*const u32, usize)> =
        p.cols.iter().map(|c| (c.as_ptr(), c.capacity())).collect();
    let first = p.clone();
    plan(&cu, &ctx, &mut p);
    let after: Vec<(*const u32, usize)> =
        p.cols.iter().map(|c| (c.as_ptr(), c.capacity())).collect();
    assert_eq!(before, after);
    assert_eq!(first.cols, p.cols);
}

fn chunk() -> impl Strategy<Value = (u32, u32)> {
    prop_oneof![
        (0u32..40_000).prop_map(|c| (1, c)),                 // decode
        (1u32..300).prop_map(|q| (q, 0)),                    // fresh prefill
        (1u32..200, 1u32..5000).prop_map(|(q, c)| (q, c)),   // chunk over a cached prefix
        (2u32..=16, 0u32..40_000).prop_map(|(q, c)| (q, c)), // small chunk, long context
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_mixes_cover_every_query_once(
        chunks in prop::collection::vec(chunk(), 1..10),
        shape in prop::sample::select(vec![(32u32, 8u32), (8, 2), (4, 1), (4, 4)]),
        head_dim in prop::sample::select(vec![8u32, 12, 24, 64, 128, 256]),
        block_size in prop::sample::select(vec![16u32, 32]),
        bf16 in any::<bool>(),
    ) {
        let q: Vec<u32> = chunks.iter().map(|c| c.0).collect();
        let ctx: Vec<u32> = chunks.iter().map(|c| c.1).collect();
        let d = AttnDims { block_size, ..dims(shape.0, shape.1, head_dim, q.len()) };
        check_coverage(&q, &ctx, d, bf16);
        // The fixed mixed shape with room to spare, then with none, then one too few.
        let decodes = q.iter().filter(|&&l| l == 1).count();
        let tiles: usize = q
            .iter()
            .filter(|&&l| l > 1)
            .map(|&l| if l <= SMALL_Q { 1 } else { l.div_ceil(Q_TILE) as usize })
            .sum();
        for (small, large) in [(decodes + 3, tiles + 2), (decodes, tiles)] {
            for splits in [1, 4] {
                let f = Fixed::Mixed(small, large, splits);
                check_plan_coverage(&q, &ctx, d, bf16, Some(f));
            }
        }
        let mut p = AttnPlan::new();
        let cu = cu_of(&q);
        if decodes > 0 {
            prop_assert!(!plan_mixed_fixed(&cu, &ctx, decodes - 1, tiles, 4, 0, &mut p));
            prop_assert_eq!(p.items(), 0);
        }
        if tiles > 0 {
            prop_assert!(!plan_mixed_fixed(&cu, &ctx, decodes, tiles - 1, 1, 0, &mut p));
        }
    }
}

#[test]
fn a_fixed_mixed_plan_has_the_same_launches_for_any_mix_that_fits() {
    let shape = dims(32, 8, 128, 6);
    let mixes: [([u32; 6], [u32; 6]); 4] = [
        ([1, 1, 1, 300, 1, 5], [10, 2000, 0, 0, 7, 40]),
        ([128, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]),
        ([1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6]),
        ([16, 2, 129, 1, 0, 1], [9000, 3, 0, 1, 0, 5]),
    ];
    let mut seen = HashMap::new();
    for (q, ctx) in mixes {
        for splits in [1u32, 16] {
            let mut p = AttnPlan::new();
            let pad = cu_of(&q)[6];
            assert!(
                plan_mixed_fixed(&cu_of(&q), &ctx, 8, 6, splits, pad, &mut p),
                "{q:?}"
            );
            assert_eq!(p.partial_rows(), if splits > 1 { 8 * splits } else { 0 });
            for bf16 in [true, false] {
                check_plan_coverage(&q, &ctx, shape, bf16, Some(Fixed::Mixed(8, 6, splits)));
            }
            let l = launches(&p, shape, true, PrefillKernel::WgmmaPingPong).expect("shape");
            let grids: Vec<_> = l.iter().map(|l| (l.entry, l.grid, l.smem)).collect();
            let mut want = vec!["attn_decode_d128_bf16", "attn_prefill_wgmma_pp_d128_bf16"];
            if splits > 1 {
                want.push("attn_combine_bf16");
            }
            assert_eq!(grids.iter().map(|g| g.0).collect::<Vec<_>>(), want);
            assert_eq!(seen.entry(splits).or_insert(grids.clone()), &grids, "{q:?}");
        }
    }
    // Too many pieces for the partial rows: refused.
    let mut p = AttnPlan::new();
    assert!(!plan_mixed_fixed(&[0, 1], &[5], 300, 0, 16, 1, &mut p));
}
