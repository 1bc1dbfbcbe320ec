//! Grouped mixture-of-experts expert compute (`moe.cu`): its entry table, the geometry the
//! kernels assume, and the launches of one MoE layer after routing.
//!
//! **Device-resident and capturable.** Once `moe_route` (dense.cu) has written the expert ids
//! and weights of every token, [`launches`] gives the sort, the up (or fused gate-and-up)
//! GEMM, the down GEMM and the combine. Every grid size follows from [`MoeDims`] alone (token
//! count, top-k, experts, widths) — never from the routing — so nothing is read back and a
//! captured CUDA graph stays valid for any routing of the same dims. The GEMM grids cover
//! [`max_tiles`] row tiles, an upper bound on the tiles any routing needs; CTAs past the real
//! count (written by the sort on the device) exit at once.
//!
//! **Buffers.** One u32 index buffer laid out by [`IndexLayout`] (sorted entries, expert
//! offsets, tile list, tile count), `mid [entries, inter]` and `y [entries, hidden]` in the
//! activation dtype. The sort writes every index word the GEMMs read; `mid` rows and `y` rows
//! of entries routed to a valid expert are written once each, and the combine reads only
//! those. The result is deterministic: no float atomics anywhere.
//!
//! **Measured** on one H200 (`chimera-gpu-check --suite moe`, bf16, NemotronH shape: hidden
//! 2688, expert ffn 1856, 128 experts top-6 in 8 groups, relu², routing included): T = 1
//! 0.246 ms, 64 0.934 ms, 512 1.024 ms, 4096 2.327 ms (211 TFLOP/s), against the former
//! per-expert path (host read-back, cuBLASLt per expert) at 0.355 / 4.030 / 4.499 / 5.404 ms.
//! A K step of 32 with 64-byte row segments was 0.266 / 1.340 / 1.448 / 2.856 ms. Small T is
//! bound by reading the routed experts' weights (weights of 6 experts at T = 1, nearly all
//! 128 at T = 64); there is room left (split-K or more stages for the few-token tiles).
//!
//! This module knows nothing of CUDA: it must not allocate device memory or launch.

use crate::{Entry, Launch, Param};

use Param::{Ptr, U32};

/// Rows of one GEMM tile (`moe.cu` MOE_BM): each expert's rows are cut into tiles this tall.
pub const TILE_ROWS: usize = 64;
/// Largest top-k the combine accepts (`moe.cu` MAX_TOP_K).
pub const MAX_TOP_K: usize = 32;
/// Warps of the sort's single CTA (`moe.cu` SORT_WARPS).
const SORT_WARPS: usize = 16;
/// Largest expert count: the sort keeps `experts × SORT_WARPS` counters in 48 KiB of shared
/// memory.
pub const MAX_EXPERTS: usize = 48 * 1024 / 4 / SORT_WARPS;

// GEMM geometry mirrored from moe.cu.
const MMA_THREADS: u32 = 128;
const MMA_COLS: usize = 128;
/// Dynamic shared memory of the tensor-core GEMMs (`moe.cu` G_SMEM: 3 stages of a 64 × 64
/// A tile and a 128 × 64 B tile, bf16), above the default 48 KiB.
pub const MMA_SMEM: u32 = 3 * (64 + 128) * 64 * 2;
const SIMT_THREADS: u32 = 256;
const SIMT_COLS: usize = 64;
const COMBINE_THREADS: u32 = 256;

/// `c, a, b, gate, w, sorted, offsets, tile_e, tile_m, n_tiles, K, N, top_k, act`.
const GEMM: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32,
];
/// `c, a, b, gate, b_scales, gate_scales, w, sorted, offsets, tile_e, tile_m, n_tiles, K, N,
/// top_k, act` (FP8 experts: `b` and `gate` e4m3 codes, one f32 scale per expert row).
const FP8_GEMM: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32,
];
/// `out, y, ids, top_k, hidden, experts`.
const COMBINE: &[Param] = &[Ptr, Ptr, Ptr, U32, U32, U32];

pub const ENTRIES: &[Entry] = &[
    Entry {
        name: "moe_sort",
        // sorted, offsets, tile_e, tile_m, n_tiles, ids, n, experts, max_tiles
        params: &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32],
    },
    Entry {
        name: "moe_up_bf16",
        params: GEMM,
    },
    Entry {
        name: "moe_up_gated_bf16",
        params: GEMM,
    },
    Entry {
        name: "moe_down_bf16",
        params: GEMM,
    },
    Entry {
        name: "moe_up_f32",
        params: GEMM,
    },
    Entry {
        name: "moe_up_gated_f32",
        params: GEMM,
    },
    Entry {
        name: "moe_down_f32",
        params: GEMM,
    },
    Entry {
        name: "moe_up_fp8_bf16",
        params: FP8_GEMM,
    },
    Entry {
        name: "moe_up_gated_fp8_bf16",
        params: FP8_GEMM,
    },
    Entry {
        name: "moe_down_fp8_bf16",
        params: FP8_GEMM,
    },
    Entry {
        name: "moe_up_fp8_f32",
        params: FP8_GEMM,
    },
    Entry {
        name: "moe_up_gated_fp8_f32",
        params: FP8_GEMM,
    },
    Entry {
        name: "moe_down_fp8_f32",
        params: FP8_GEMM,
    },
    Entry {
        name: "moe_combine_f32",
        params: COMBINE,
    },
    Entry {
        name: "moe_combine_bf16",
        params: COMBINE,
    },
];

/// One MoE layer's sizes. Experts are `up [experts, inter, hidden]`, optional `gate` of the
/// same shape, `down [experts, hidden, inter]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeDims {
    pub tokens: usize,
    pub hidden: usize,
    pub inter: usize,
    pub experts: usize,
    pub top_k: usize,
    pub gated: bool,
    /// The host's activation code (`moe.cu` moe_act: 0 silu, 1 relu², 2 gelu-tanh).
    pub act: u32,
}

impl MoeDims {
    /// Routed (token, expert) entries: `tokens × top_k`.
    pub fn entries(&self) -> usize {
        self.tokens * self.top_k
    }

    /// Why the kernels cannot run these dims, if they cannot. bf16 needs widths that are
    /// multiples of 8 (16-byte copies).
    pub fn check(&self, bf16: bool) -> Result<(), String> {
        if self.top_k == 0 || self.top_k > MAX_TOP_K || self.top_k > self.experts {
            return Err(format!(
                "top-{} of {} experts (1..={MAX_TOP_K} and at most the experts)",
                self.top_k, self.experts
            ));
        }
        if self.experts > MAX_EXPERTS {
            return Err(format!("{} experts (at most {MAX_EXPERTS})", self.experts));
        }
        if self.hidden == 0 || self.inter == 0 {
            return Err(format!("hidden {} / inter {}", self.hidden, self.inter));
        }
        if bf16 && (!self.hidden.is_multiple_of(8) || !self.inter.is_multiple_of(8)) {
            return Err(format!(
                "bf16 experts need hidden and inter multiples of 8 (hidden {}, inter {})",
                self.hidden, self.inter
            ));
        }
        let too_big = [
            self.entries(),
            self.entries().saturating_mul(self.hidden.max(self.inter)),
        ];
        if too_big.iter().any(|&v| v > u32::MAX as usize) {
            return Err(format!(
                "{} entries × width {} overflow 32-bit indices",
                self.entries(),
                self.hidden.max(self.inter)
            ));
        }
        Ok(())
    }
}

/// Row tiles the GEMM grids cover: every expert with `c` rows needs `ceil(c / TILE_ROWS)`
/// tiles, which sums to at most `ceil(n / TILE_ROWS) + experts` over all experts, and each
/// tile has a row, so also at most `n`.
pub fn max_tiles(entries: usize, experts: usize) -> usize {
    entries.min(entries.div_ceil(TILE_ROWS) + experts)
}

/// Kernels that launch with more than the default 48 KiB of dynamic shared memory, and how
/// much (the backend raises their limit once at load).
pub fn smem_opt_in() -> impl Iterator<Item = (&'static str, u32)> {
    [
        "moe_up_bf16",
        "moe_up_gated_bf16",
        "moe_down_bf16",
        "moe_up_fp8_bf16",
        "moe_up_gated_fp8_bf16",
        "moe_down_fp8_bf16",
    ]
    .into_iter()
    .map(|name| (name, MMA_SMEM))
}

/// Word offsets of the sort's outputs in the one u32 index buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexLayout {
    /// `[entries]`: entry indices `t * top_k + k`, by expert then entry.
    pub sorted: usize,
    /// `[experts + 1]`: first sorted row of each expert, then the routed total.
    pub offsets: usize,
    /// `[max_tiles]`: each tile's expert.
    pub tile_e: usize,
    /// `[max_tiles]`: each tile's first row within its expert.
    pub tile_m: usize,
    /// `[1]`: the tiles the sort wrote.
    pub n_tiles: usize,
    /// Words in all.
    pub words: usize,
}

impl IndexLayout {
    pub fn new(d: &MoeDims) -> Self {
        let (n, tiles) = (d.entries(), max_tiles(d.entries(), d.experts));
        let offsets = n;
        let tile_e = offsets + d.experts + 1;
        let tile_m = tile_e + tiles;
        let n_tiles = tile_m + tiles;
        Self {
            sorted: 0,
            offsets,
            tile_e,
            tile_m,
            n_tiles,
            words: n_tiles + 1,
        }
    }
}

/// What a launch argument refers to; the backend maps each to a pointer or value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeArg {
    /// The layer input `[tokens, hidden]`.
    X,
    /// The output `[tokens, hidden]`, added to.
    Out,
    Up,
    /// The gate weights (a null pointer for plain experts: never read).
    Gate,
    Down,
    /// Routing columns `[tokens, top_k]` from `moe_route`.
    Ids,
    Weights,
    /// A word offset into the index buffer ([`IndexLayout`]).
    Index(usize),
    /// `[entries, inter]`, activation dtype.
    Mid,
    /// `[entries, hidden]`, activation dtype.
    Y,
    /// FP8 experts: the scales of `Up`, `Gate` and `Down` (one f32 per expert row).
    UpScales,
    GateScales,
    DownScales,
    /// A null pointer (a parameter the launch's kernel never reads).
    Null,
    U32(u32),
}

/// [`launches`] for FP8 experts (e4m3 codes with one scale per expert row; `hidden` and
/// `inter` multiples of 16): the GEMMs' `_fp8` entries, with the scales after the gate.
pub fn fp8_launches(d: &MoeDims, bf16: bool) -> Vec<Launch<MoeArg>> {
    use MoeArg as A;
    let mut ls = launches(d, bf16);
    for l in &mut ls {
        let (entry, scales) = match l.entry {
            "moe_up_bf16" => ("moe_up_fp8_bf16", [A::UpScales, A::Null]),
            "moe_up_gated_bf16" => ("moe_up_gated_fp8_bf16", [A::UpScales, A::GateScales]),
            "moe_down_bf16" => ("moe_down_fp8_bf16", [A::DownScales, A::Null]),
            "moe_up_f32" => ("moe_up_fp8_f32", [A::UpScales, A::Null]),
            "moe_up_gated_f32" => ("moe_up_gated_fp8_f32", [A::UpScales, A::GateScales]),
            "moe_down_f32" => ("moe_down_fp8_f32", [A::DownScales, A::Null]),
            _ => continue,
        };
        l.entry = entry;
        l.args.splice(4..4, scales);
    }
    ls
}

/// The sort, up, down and combine launches of one layer (after `moe_route`), for the bf16
/// (tensor-core) or the f32 kernels. Call [`MoeDims::check`] first; a layer with no tokens
/// has no launches.
pub fn launches(d: &MoeDims, bf16: bool) -> Vec<Launch<MoeArg>> {
    use MoeArg as A;
    if d.tokens == 0 {
        return Vec::new();
    }
    let ix = IndexLayout::new(d);
    let n = d.entries();
    let tiles = max_tiles(n, d.experts) as u32;
    let (threads, cols) = if bf16 {
        (MMA_THREADS, MMA_COLS)
    } else {
        (SIMT_THREADS, SIMT_COLS)
    };
    // A gated CTA spends its B tile on the gate and up rows of half as many output columns
    // (bf16); the f32 kernel keeps a separate gate tile.
    let up_cols = if d.gated && bf16 { cols / 2 } else { cols };
    let index = [ix.sorted, ix.offsets, ix.tile_e, ix.tile_m, ix.n_tiles].map(A::Index);
    let gemm = |entry: &'static str, c, a, b, gate, w, k: usize, nn: usize, per: usize| {
        let mut args = vec![c, a, b, gate, w];
        args.extend(index);
        args.extend([
            A::U32(k as u32),
            A::U32(nn as u32),
            A::U32(d.top_k as u32),
            A::U32(d.act),
        ]);
        Launch {
            entry,
            grid: (tiles, nn.div_ceil(per) as u32, 1),
            block: (threads, 1, 1),
            smem: if bf16 { MMA_SMEM } else { 0 },
            args,
        }
    };
    let up_entry = match (d.gated, bf16) {
        (false, true) => "moe_up_bf16",
        (true, true) => "moe_up_gated_bf16",
        (false, false) => "moe_up_f32",
        (true, false) => "moe_up_gated_f32",
    };
    vec![
        Launch {
            entry: "moe_sort",
            grid: (1, 1, 1),
            block: (32 * SORT_WARPS as u32, 1, 1),
            smem: (4 * SORT_WARPS * d.experts) as u32,
            args: vec![
                index[0],
                index[1],
                index[2],
                index[3],
                index[4],
                A::Ids,
                A::U32(n as u32),
                A::U32(d.experts as u32),
                A::U32(tiles),
            ],
        },
        gemm(
            up_entry,
            A::Mid,
            A::X,
            A::Up,
            if d.gated { A::Gate } else { A::Null },
            A::Weights,
            d.hidden,
            d.inter,
            up_cols,
        ),
        gemm(
            if bf16 {
                "moe_down_bf16"
            } else {
                "moe_down_f32"
            },
            A::Y,
            A::Mid,
            A::Down,
            A::Null,
            A::Weights,
            d.inter,
            d.hidden,
            cols,
        ),
        Launch {
            entry: if bf16 {
                "moe_combine_bf16"
            } else {
                "moe_combine_f32"
            },
            grid: (d.tokens as u32, 1, 1),
            block: (COMBINE_THREADS, 1, 1),
            smem: 0,
            args: vec![
                A::Out,
                A::Y,
                A::Ids,
                A::U32(d.top_k as u32),
                A::U32(d.hidden as u32),
                A::U32(d.experts as u32),
            ],
        },
    ]
}

#[cfg(test)]
#[path = "moe/tests.rs"]
mod tests;
