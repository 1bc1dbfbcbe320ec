//! Tests of the MoE launches: every argument matches its entry's parameter kinds, the tile
//! bound holds for any routing, and the GEMM grids (replayed with the tile list the sort
//! builds) write every (routed row, column) of `mid` and `y` exactly once.

use super::*;
use proptest::prelude::*;

fn dims(tokens: usize, experts: usize, top_k: usize, gated: bool) -> MoeDims {
    MoeDims {
        tokens,
        hidden: 2688,
        inter: 1856,
        experts,
        top_k,
        gated,
        act: 1,
    }
}

/// The tile list `moe_sort` writes for these per-expert row counts: (expert, first row).
fn tile_list(counts: &[usize]) -> Vec<(usize, usize)> {
    let mut tiles = Vec::new();
    for (e, &c) in counts.iter().enumerate() {
        tiles.extend((0..c).step_by(TILE_ROWS).map(|m| (e, m)));
    }
    tiles
}

/// Output elements of a grouped GEMM launch (`cols_per_cta` output columns a CTA along y),
/// counted per (sorted row, column); CTAs past the real tile count exit.
fn coverage(l: &Launch<MoeArg>, counts: &[usize], n_cols: usize, cols_per_cta: usize) -> Vec<u32> {
    let offsets: Vec<usize> = std::iter::once(0)
        .chain(counts.iter().scan(0, |s, &c| {
            *s += c;
            Some(*s)
        }))
        .collect();
    let rows = offsets[counts.len()];
    let tiles = tile_list(counts);
    assert!(
        tiles.len() <= l.grid.0 as usize,
        "{} tiles, grid {:?}",
        tiles.len(),
        l.grid
    );
    let mut hits = vec![0u32; rows * n_cols];
    for &(e, m) in &tiles {
        for by in 0..l.grid.1 as usize {
            for r in offsets[e] + m..(offsets[e] + m + TILE_ROWS).min(offsets[e + 1]) {
                for c in by * cols_per_cta..((by + 1) * cols_per_cta).min(n_cols) {
                    hits[r * n_cols + c] += 1;
                }
            }
        }
    }
    hits
}

#[test]
fn every_launch_matches_its_entry_table() {
    for bf16 in [false, true] {
        for gated in [false, true] {
            for l in launches(&dims(37, 16, 4, gated), bf16) {
                let e = ENTRIES
                    .iter()
                    .find(|e| e.name == l.entry)
                    .unwrap_or_else(|| panic!("{} is not in the table", l.entry));
                assert_eq!(l.args.len(), e.params.len(), "{}", l.entry);
                for (i, (a, p)) in l.args.iter().zip(e.params).enumerate() {
                    let scalar = matches!(a, MoeArg::U32(_));
                    assert_eq!(
                        scalar,
                        *p == Param::U32,
                        "{} argument {i}: {a:?} for {p:?}",
                        l.entry
                    );
                }
            }
        }
    }
}

#[test]
fn plain_experts_never_pass_a_gate_and_gated_ones_do() {
    let up = |gated, bf16| launches(&dims(5, 8, 2, gated), bf16).remove(1);
    for bf16 in [false, true] {
        assert_eq!(up(false, bf16).args[3], MoeArg::Null);
        assert_eq!(up(true, bf16).args[3], MoeArg::Gate);
        assert!(up(true, bf16).entry.contains("gated"));
        assert!(!up(false, bf16).entry.contains("gated"));
    }
}

#[test]
fn no_tokens_no_launches_and_bad_dims_are_refused() {
    assert!(launches(&dims(0, 8, 2, false), true).is_empty());
    assert!(dims(4, 8, 2, false).check(true).is_ok());
    let mut d = dims(4, 8, 2, false);
    d.inter = 100;
    assert!(d.check(true).unwrap_err().contains("multiples of 8"));
    assert!(d.check(false).is_ok(), "f32 takes any width");
    assert!(
        dims(4, 8, 9, false).check(false).is_err(),
        "top-k above the experts"
    );
    assert!(
        dims(4, 64, 33, false).check(false).is_err(),
        "top-k above MAX_TOP_K"
    );
    assert!(dims(4, MAX_EXPERTS + 1, 2, false).check(false).is_err());
    assert!(dims(4, MAX_EXPERTS, 2, false).check(false).is_ok());
}

#[test]
fn index_layout_regions_are_disjoint_and_sized() {
    let d = dims(300, 128, 6, false);
    let ix = IndexLayout::new(&d);
    let tiles = max_tiles(1800, 128);
    assert_eq!(tiles, 1800usize.div_ceil(64) + 128);
    assert_eq!(ix.offsets - ix.sorted, 1800);
    assert_eq!(ix.tile_e - ix.offsets, 129);
    assert_eq!(ix.tile_m - ix.tile_e, tiles);
    assert_eq!(ix.n_tiles - ix.tile_m, tiles);
    assert_eq!(ix.words, ix.n_tiles + 1);
    // One token: the bound is the entries themselves, not the expert count.
    assert_eq!(max_tiles(6, 128), 6);
}

#[test]
fn grids_depend_only_on_the_dims() {
    let a = launches(&dims(64, 128, 6, true), true);
    let b = launches(&dims(64, 128, 6, true), true);
    assert_eq!(a, b);
    let geo: Vec<_> = a
        .iter()
        .map(|l| (l.entry, l.grid, l.block, l.smem))
        .collect();
    assert_eq!(geo[0], ("moe_sort", (1, 1, 1), (512, 1, 1), 4 * 16 * 128));
    // 384 entries: 6 + 128 tiles; gated bf16 up: 64 output columns a CTA.
    assert_eq!(geo[1].1, (134, 1856usize.div_ceil(64) as u32, 1));
    assert_eq!(geo[2].1, (134, 2688usize.div_ceil(128) as u32, 1));
    assert_eq!(geo[3].1, (64, 1, 1));
    // The tensor-core GEMMs take the raised shared memory; the f32 ones none.
    assert_eq!((geo[1].3, geo[2].3), (MMA_SMEM, MMA_SMEM));
    let opt_in: Vec<_> = smem_opt_in().collect();
    assert!(opt_in.contains(&(geo[1].0, MMA_SMEM)) && opt_in.contains(&(geo[2].0, MMA_SMEM)));
    let f32_smem: Vec<u32> = launches(&dims(64, 128, 6, true), false)
        .iter()
        .map(|l| l.smem)
        .collect();
    assert_eq!(f32_smem[1..3], [0, 0]);
}

proptest! {
    /// Any routing: the tiles fit the grid, and every routed row's every column of `mid` and
    /// `y` belongs to exactly one CTA.
    #[test]
    fn any_routing_is_covered_once(
        tokens in 1usize..300,
        experts in 1usize..40,
        top_k_seed in 0usize..8,
        skew in 0usize..4,
        gated: bool,
        bf16: bool,
        seed: u64,
    ) {
        let top_k = 1 + top_k_seed % experts;
        let mut d = dims(tokens, experts, top_k, gated);
        d.hidden = 8 * (1 + (seed % 50) as usize);
        d.inter = 8 * (1 + (seed / 50 % 40) as usize);
        // Per token, top_k distinct experts; `skew` piles tokens onto the low experts.
        let mut counts = vec![0usize; experts];
        let mut s = seed | 1;
        for _ in 0..tokens {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let first = if skew > 0 { 0 } else { (s >> 33) as usize % experts };
            for k in 0..top_k {
                counts[(first + k) % experts] += 1;
            }
        }
        let ls = launches(&d, bf16);
        prop_assert_eq!(ls.len(), 4);
        prop_assert!(tile_list(&counts).len() <= max_tiles(d.entries(), experts));
        let per = if bf16 { 128 } else { 64 };
        let up_per = if bf16 && gated { per / 2 } else { per };
        for (l, cols, per) in [(&ls[1], d.inter, up_per), (&ls[2], d.hidden, per)] {
            let hits = coverage(l, &counts, cols, per);
            prop_assert!(hits.iter().all(|&h| h == 1), "{}: not every element once", l.entry);
        }
    }
}

#[test]
fn fp8_launches_take_the_fp8_entries_with_scales_after_the_gate() {
    for gated in [false, true] {
        for bf16 in [false, true] {
            let d = dims(37, 16, 4, gated);
            let plain = launches(&d, bf16);
            let fp8 = fp8_launches(&d, bf16);
            assert_eq!(plain.len(), fp8.len());
            for (p, f) in plain.iter().zip(&fp8) {
                if !p.entry.starts_with("moe_up") && !p.entry.starts_with("moe_down") {
                    assert_eq!(p.entry, f.entry);
                    continue;
                }
                assert!(f.entry.contains("_fp8_"), "{}", f.entry);
                let entry = ENTRIES
                    .iter()
                    .find(|e| e.name == f.entry)
                    .expect("an entry");
                assert_eq!(entry.params.len(), f.args.len(), "{}", f.entry);
                assert_eq!((p.grid, p.block, p.smem), (f.grid, f.block, f.smem));
                let want = if f.entry.contains("down") {
                    MoeArg::DownScales
                } else {
                    MoeArg::UpScales
                };
                assert_eq!(f.args[4], want);
                let gate_scales = f.entry.contains("gated");
                assert_eq!(f.args[5] == MoeArg::GateScales, gate_scales, "{}", f.entry);
            }
        }
    }
}
