//! Paged attention over a mixed batch (`attention.cu`): its entry table, the host-side
//! planner that turns a step's chunk layout into a work list, and the launches that run it.
//!
//! **Plan once per step, launch per layer.** [`plan`] reads only the step's `cu_seqlens` and
//! `ctx_lens`; its work list is independent of head counts, head dim and dtype, so the
//! backend uploads the [`WorkCol`] columns once with the step's other metadata and every
//! attention layer reuses them. [`launches`] then gives the kernels of one layer, with
//! symbolic arguments ([`AttnArg`]) the backend maps to pointers and values in one `match`.
//!
//! **The work list.** A chunk's query tokens are cut into tiles of at most [`Q_TILE`] tokens
//! (one tile when the chunk has at most [`SMALL_Q`] tokens: decodes). A tile whose KV range
//! is long compared with the step's total work is split into pieces (flash-decoding); each
//! piece is a work item writing f32 partials, and a combine row per token merges them.
//! Items with at most [`SMALL_Q`] tokens come first, so they can run with fewer row tiles.
//!
//! **Invariants** (checked by the tests below, including a proptest over random chunk mixes
//! that replays the kernels' grid decomposition): every (query token, head) is written
//! exactly once, by a main kernel or by the combine; the pieces of a split tile cover each
//! of its queries' causal KV ranges exactly once, without gaps; all item columns have one
//! length and all combine columns another; partial rows are written once and read once.
//!
//! **Kernels** (bf16 picks by head dim and the packed (token, head) rows of the launch's
//! items): decodes (≤ 16 rows) run `attn_decode_d{64,128}`, prefill tiles of d = 128 run
//! one of `attention_sm90.cu`'s warpgroup-MMA kernels on Hopper (when the device compiled
//! them, `sm_90a`, and the backend asks for one: [`PrefillKernel`]) and `attn_prefill_d128`
//! elsewhere, other tiles `attn_mma_d{64,128,256}`; f32 and other head dims run
//! `attn_simt`. Measured on one H200 (32q/8kv, d = 128, block 16, including the KV write):
//! causal prefill T = 8192 in 1.26 ms (436 TFLOP/s) with the ping-pong wgmma kernel, 1.96 ms
//! (281 TFLOP/s) with `mma.sync`; decode batch 64 × 2048 in 0.168 ms (3.19 TB/s of KV),
//! 256 × 2048 in 0.53 ms (4.03 TB/s), 1 × 32768 in 0.058 ms.
//!
//! **What the backend must do.** Run the launches in order on one stream (the combine reads
//! the partials of the main launches). Pass the arguments as [`AttnArg`] documents, scratch
//! buffers of [`scratch_bytes`] (at most [`max_scratch_bytes`]). Raise
//! `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` once for the entries of
//! [`smem_opt_in`] (their `Launch::smem` exceeds the default 48 KiB). The kernels trap when
//! the block size or dynamic shared memory differs from what they were built for. Grid sizes
//! follow the plan's item counts, so a captured CUDA graph is valid only for the plan it
//! was captured with, or for fixed-shape plans of the same capacities ([`plan_decode_fixed`],
//! [`plan_mixed_fixed`]).
//!
//! This module knows nothing of CUDA: it must not allocate device memory or launch.

use crate::{Entry, Launch, Param};

use Param::{F32, Ptr, U32};

/// Every main kernel: `q, k_cache, v_cache, out, cu_seqlens, ctx_lens, bt_offsets,
/// block_tables, w_seq, w_q_first, w_q_count, w_kv_first, w_kv_end, w_part, part_o, part_ml,
/// item_base, heads, kv_heads, head_dim, block_size, scale, k_scale, v_scale`.
const MAIN: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32,
    U32, U32, F32, F32, F32,
];
/// `out, part_o, part_ml, c_token, c_part, c_stride, c_splits, item_base, heads, head_dim`.
const COMBINE: &[Param] = &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32];

const fn e(name: &'static str, params: &'static [Param]) -> Entry {
    Entry { name, params }
}

pub const ENTRIES: &[Entry] = &[
    e("attn_simt_f32", MAIN),
    e("attn_simt_bf16", MAIN),
    e("attn_decode_d64_bf16", MAIN),
    e("attn_decode_d128_bf16", MAIN),
    e("attn_mma_d64_bf16", MAIN),
    e("attn_mma_d128_bf16", MAIN),
    e("attn_mma_d256_bf16", MAIN),
    e("attn_prefill_d128_bf16", MAIN),
    e("attn_simt_f32_kvfp8", MAIN),
    e("attn_simt_bf16_kvfp8", MAIN),
    e("attn_decode_d64_bf16_kvfp8", MAIN),
    e("attn_decode_d128_bf16_kvfp8", MAIN),
    e("attn_mma_d64_bf16_kvfp8", MAIN),
    e("attn_mma_d128_bf16_kvfp8", MAIN),
    e("attn_mma_d256_bf16_kvfp8", MAIN),
    e("attn_prefill_d128_bf16_kvfp8", MAIN),
    e("attn_combine_f32", COMBINE),
    e("attn_combine_bf16", COMBINE),
];

/// `attention_sm90.cu`, built for `sm_90a` only (Hopper's `wgmma`).
pub const SM90_ENTRIES: &[Entry] = &[
    e("attn_prefill_wgmma_d128_bf16", MAIN),
    e("attn_prefill_wgmma_pp_d128_bf16", MAIN),
];

/// The kernel that runs bf16 prefill tiles of head dim 128 ([`launches`]); the backend picks
/// one its device has built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillKernel {
    /// `attn_prefill_d128_bf16`: `mma.sync`, any sm_80+ GPU.
    MmaSync,
    /// `attn_prefill_wgmma_d128_bf16`: warpgroup MMA (Hopper, `sm_90a`), each tile's
    /// softmax between its two MMAs.
    Wgmma,
    /// `attn_prefill_wgmma_pp_d128_bf16`: as [`PrefillKernel::Wgmma`], with the two
    /// warpgroups taking turns on the tensor cores, one's softmax running while the other's
    /// S = Q·Kᵀ and previous P·V are (FlashAttention-3's ping-pong schedule).
    WgmmaPingPong,
}

impl PrefillKernel {
    pub const ALL: [PrefillKernel; 3] = [
        PrefillKernel::WgmmaPingPong,
        PrefillKernel::Wgmma,
        PrefillKernel::MmaSync,
    ];

    /// The kernel's entry point.
    pub fn entry(self) -> &'static str {
        self.kernel().entry
    }

    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            PrefillKernel::MmaSync => "mma.sync",
            PrefillKernel::Wgmma => "wgmma",
            PrefillKernel::WgmmaPingPong => "wgmma, ping-pong warpgroups",
        }
    }

    fn kernel(self) -> Kernel {
        match self {
            PrefillKernel::MmaSync => PREFILL_D128,
            PrefillKernel::Wgmma => WGMMA_D128,
            PrefillKernel::WgmmaPingPong => WGMMA_PP_D128,
        }
    }
}

/// Most query tokens in one work item.
pub const Q_TILE: u32 = 128;
/// Chunks of at most this many tokens are one item; such items are launched first.
pub const SMALL_Q: u32 = 16;
/// Largest head dim the kernels take.
pub const MAX_HEAD_DIM: u32 = 256;
/// `w_part` of an item that writes `out` directly.
pub const NO_PART: u32 = u32::MAX;
/// Upper bound of [`AttnPlan::partial_rows`]: the scratch buffers never need more rows.
pub const MAX_PARTIAL_ROWS: u32 = 4096;

/// Dynamic shared memory above this needs the function's limit raised (see [`launches`]).
pub const DEFAULT_SMEM_LIMIT: u32 = 48 * 1024;
const MAX_GRID_Y: usize = 65535;

/// Split-KV: piece boundaries are multiples of this (the tensor-core KV tile), pieces are at
/// least `MIN_SPLIT` keys, and the split length aims at `TARGET_PIECES` pieces of work.
const SPLIT_ALIGN: u32 = 64;
const MIN_SPLIT: u32 = 128;
/// About two waves of the decode kernel's CTAs on a 132-SM GPU at 8 KV heads: one wave and a
/// bit (64 decodes of 2048 keys unsplit) left most SMs idle for the second.
const TARGET_PIECES: u64 = 256;
/// Steps with at least this many 16-row query tiles already fill the GPU: nothing is split
/// (a 4096-token prefill chunk split into pieces paid a combine pass for nothing).
const NO_SPLIT_TILES: u64 = 128;

/// The uploaded work columns (all `u32`). Item columns have [`AttnPlan::items`] entries;
/// combine columns [`AttnPlan::combine_rows`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkCol {
    /// Item: chunk index `s` (into `cu_seqlens`, `ctx_lens`, `bt_offsets`).
    Seq,
    /// Item: first query token, counted within the chunk.
    QFirst,
    /// Item: query tokens (1..=[`Q_TILE`]).
    QCount,
    /// Item: first KV position of the item's piece (0 unless split).
    KvFirst,
    /// Item: end of the piece (exclusive); a token sees `< min(KvEnd, ctx + i + 1)`.
    KvEnd,
    /// Item: first partial row (the item's token `i` writes row `Part + i`), or [`NO_PART`].
    Part,
    /// Combine: the token's global index (row of `out`).
    CombToken,
    /// Combine: the token's partial row in the first piece.
    CombPart,
    /// Combine: partial rows from one piece to the next.
    CombStride,
    /// Combine: number of pieces.
    CombSplits,
}

impl WorkCol {
    pub const ALL: [WorkCol; 10] = [
        WorkCol::Seq,
        WorkCol::QFirst,
        WorkCol::QCount,
        WorkCol::KvFirst,
        WorkCol::KvEnd,
        WorkCol::Part,
        WorkCol::CombToken,
        WorkCol::CombPart,
        WorkCol::CombStride,
        WorkCol::CombSplits,
    ];
}

/// The step's work list. Built by [`plan`]; reused across steps without allocating once its
/// columns have grown to the step sizes seen.
#[derive(Debug, Clone, Default)]
pub struct AttnPlan {
    cols: [Vec<u32>; 10],
    num_seqs: usize,
    /// Items `[0, small)` have at most [`SMALL_Q`] tokens.
    small: usize,
    max_q_small: u32,
    max_q_large: u32,
    partial_rows: u32,
    split_len: u32,
}

impl AttnPlan {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn column(&self, c: WorkCol) -> &[u32] {
        &self.cols[c as usize]
    }

    /// Work items (CTA rows of the main launches).
    pub fn items(&self) -> usize {
        self.cols[WorkCol::Seq as usize].len()
    }

    /// Tokens whose KV range was split (rows of the combine launch).
    pub fn combine_rows(&self) -> usize {
        self.cols[WorkCol::CombToken as usize].len()
    }

    /// Rows of the partial buffers (each row holds every head).
    pub fn partial_rows(&self) -> u32 {
        self.partial_rows
    }

    /// KV length above which a tile was split (the step's heuristic choice).
    pub fn split_len(&self) -> u32 {
        self.split_len
    }

    /// Empties the plan for a step of `num_seqs` chunks whose classes have at most
    /// `max_q_small` and `max_q_large` query tokens an item (buffers kept).
    fn reset(&mut self, num_seqs: usize, max_q_small: u32, max_q_large: u32) {
        for c in &mut self.cols {
            c.clear();
        }
        self.num_seqs = num_seqs;
        self.small = 0;
        self.max_q_small = max_q_small;
        self.max_q_large = max_q_large;
        self.partial_rows = 0;
        self.split_len = 0;
    }

    fn push_item(&mut self, v: [u32; 6]) {
        for (col, x) in self.cols[..6].iter_mut().zip(v) {
            col.push(x);
        }
    }

    fn push_combine(&mut self, v: [u32; 4]) {
        for (col, x) in self.cols[6..].iter_mut().zip(v) {
            col.push(x);
        }
    }
}

/// Query tiles of every chunk: `f(seq, q_first, q_count, kv_end)`. Long chunks are cut from
/// the end, so the tiles with the most keys come first.
fn for_each_tile(cu: &[u32], ctx: &[u32], mut f: impl FnMut(u32, u32, u32, u32)) {
    let n = ctx.len().min(cu.len().saturating_sub(1));
    for s in 0..n {
        let qlen = cu[s + 1].saturating_sub(cu[s]);
        if qlen == 0 {
            continue;
        }
        if qlen <= SMALL_Q {
            f(s as u32, 0, qlen, ctx[s] + qlen);
            continue;
        }
        for t in (0..qlen.div_ceil(Q_TILE)).rev() {
            let q_first = t * Q_TILE;
            let q_count = Q_TILE.min(qlen - q_first);
            f(s as u32, q_first, q_count, ctx[s] + q_first + q_count);
        }
    }
}

/// `(pieces, piece length)` of a tile with `kv_end` keys under `split_len`.
fn pieces(kv_end: u32, split_len: u32) -> (u32, u32) {
    if kv_end <= split_len {
        return (1, kv_end);
    }
    let n = kv_end.div_ceil(split_len);
    let len = kv_end.div_ceil(n).next_multiple_of(SPLIT_ALIGN);
    (kv_end.div_ceil(len), len)
}

/// The split length: no split when the step has [`NO_SPLIT_TILES`] 16-row query tiles or
/// more; else
/// the step's work (keys × query tiles of 16 tokens, summed over tiles) divided into about
/// [`TARGET_PIECES`] pieces, at least [`MIN_SPLIT`], and doubled until
/// the partial rows fit [`MAX_PARTIAL_ROWS`].
fn choose_split_len(cu: &[u32], ctx: &[u32]) -> u32 {
    let mut work = 0u64;
    let mut longest = 0u32;
    let mut row_tiles = 0u64;
    for_each_tile(cu, ctx, |_, _, q_count, kv_end| {
        work += u64::from(kv_end) * u64::from(q_count.div_ceil(16));
        longest = longest.max(kv_end);
        row_tiles += u64::from(q_count.div_ceil(16));
    });
    if row_tiles >= NO_SPLIT_TILES {
        return longest.max(MIN_SPLIT);
    }
    let target = work
        .div_ceil(TARGET_PIECES)
        .next_multiple_of(u64::from(SPLIT_ALIGN));
    let mut split_len = u32::try_from(target).unwrap_or(u32::MAX).max(MIN_SPLIT);
    while split_len < longest {
        let mut rows = 0u64;
        for_each_tile(cu, ctx, |_, _, q_count, kv_end| {
            let (n, _) = pieces(kv_end, split_len);
            if n > 1 {
                rows += u64::from(n) * u64::from(q_count);
            }
        });
        if rows <= u64::from(MAX_PARTIAL_ROWS) {
            break;
        }
        split_len = split_len.saturating_mul(2);
    }
    split_len
}

/// Builds the step's work list into `out` (its buffers are reused).
///
/// `cu_seqlens[s]..cu_seqlens[s + 1]` are chunk `s`'s query tokens (non-decreasing,
/// `len = ctx_lens.len() + 1`); `ctx_lens[s]` its tokens cached before the chunk.
pub fn plan(cu_seqlens: &[u32], ctx_lens: &[u32], out: &mut AttnPlan) {
    out.reset(ctx_lens.len(), 0, 0);
    out.split_len = choose_split_len(cu_seqlens, ctx_lens);
    let split_len = out.split_len;
    let emit = |out: &mut AttnPlan, s: u32, q_first: u32, q_count: u32, kv_end: u32| {
        let (n, len) = pieces(kv_end, split_len);
        if n == 1 {
            out.push_item([s, q_first, q_count, 0, kv_end, NO_PART]);
            return;
        }
        let base = out.partial_rows;
        for j in 0..n {
            let kv_first = j * len;
            let end = kv_end.min(kv_first + len);
            out.push_item([s, q_first, q_count, kv_first, end, base + j * q_count]);
        }
        for i in 0..q_count {
            out.push_combine([cu_seqlens[s as usize] + q_first + i, base + i, q_count, n]);
        }
        out.partial_rows += n * q_count;
    };
    for_each_tile(cu_seqlens, ctx_lens, |s, q_first, q_count, kv_end| {
        if q_count <= SMALL_Q {
            out.max_q_small = out.max_q_small.max(q_count);
            emit(out, s, q_first, q_count, kv_end);
        }
    });
    out.small = out.items();
    for_each_tile(cu_seqlens, ctx_lens, |s, q_first, q_count, kv_end| {
        if q_count > SMALL_Q {
            out.max_q_large = out.max_q_large.max(q_count);
            emit(out, s, q_first, q_count, kv_end);
        }
    });
}

/// A decode-only work list whose shape depends only on the number of chunks and `splits`, for
/// CUDA graphs: the captured grids stay valid for every step with that many decodes, whatever
/// their context lengths. Every chunk must be one query token; each becomes `splits` pieces
/// of its KV range (boundaries on [`SPLIT_ALIGN`] multiples, at least [`MIN_SPLIT`] keys;
/// pieces past the end are empty and the combine skips them), or one unsplit item when `splits` is 1. Returns `false` (and
/// leaves `out` empty) when a chunk is not a single token or the partial rows would exceed
/// [`MAX_PARTIAL_ROWS`].
pub fn plan_decode_fixed(
    cu_seqlens: &[u32],
    ctx_lens: &[u32],
    splits: u32,
    out: &mut AttnPlan,
) -> bool {
    let n = ctx_lens.len();
    out.reset(n, 1, 0);
    let splits = splits.max(1);
    let single = cu_seqlens.len() == n + 1 && cu_seqlens.windows(2).all(|w| w[1] == w[0] + 1);
    if !single || (splits > 1 && n as u64 * u64::from(splits) > u64::from(MAX_PARTIAL_ROWS)) {
        out.reset(0, 1, 0);
        return false;
    }
    for (s, &ctx) in ctx_lens.iter().enumerate() {
        push_fixed_decode(out, Some(s as u32), cu_seqlens[s], ctx, splits);
    }
    out.small = out.items();
    true
}

/// One decode of chunk `s` (query token `tok`, `ctx` keys before it) in a fixed-shape plan:
/// `splits` pieces of its KV range (boundaries on [`SPLIT_ALIGN`] multiples, at least
/// [`MIN_SPLIT`] keys; pieces past the end are empty and the combine skips them) and one
/// combine row, or one unsplit item when `splits` is 1. `None` for `s`: a padding decode,
/// whose pieces have no query token and whose combine row (no pieces) writes zeros to `tok`.
fn push_fixed_decode(out: &mut AttnPlan, s: Option<u32>, tok: u32, ctx: u32, splits: u32) {
    let kv_end = ctx + 1;
    let q = u32::from(s.is_some());
    let (s, kv_end) = (s.unwrap_or(0), if q == 0 { 0 } else { kv_end });
    if splits == 1 {
        out.push_item([s, 0, q, 0, kv_end, NO_PART]);
        return;
    }
    // Pieces of at least MIN_SPLIT keys, as the eager plan makes them: at short contexts
    // the trailing pieces are empty (their CTAs return at once) rather than short.
    let len = kv_end
        .div_ceil(splits)
        .next_multiple_of(SPLIT_ALIGN)
        .max(MIN_SPLIT);
    let base = out.partial_rows;
    for j in 0..splits {
        let first = kv_end.min(j * len);
        let end = kv_end.min(first.saturating_add(len));
        out.push_item([s, 0, q, first, end, base + j]);
    }
    out.push_combine([tok, base, 1, splits * q]);
    out.partial_rows += splits;
}

/// A mixed work list of fixed shape, for CUDA graphs of steps with prefill chunks: the
/// one-token chunks (decodes) are the small items, each cut into `splits` pieces as
/// [`plan_decode_fixed`] cuts them, padded to `small_cap` decodes; every other chunk's query
/// tiles, as [`plan`] cuts them, are the large items, unsplit, padded to `large_cap`.
/// Padding items have no query tokens (`QCount` 0), so every CTA of theirs returns at once
/// (`attention.cuh` `tile_of`); a padding decode's combine row has no pieces and writes
/// zeros to the token row `pad_token`, which must be a padding row when the step has fewer
/// decodes than `small_cap`. The launches depend only on the capacities and `splits`: the
/// small class always runs the decode kernel, the large class the prefill kernel of
/// [`Q_TILE`] tokens. Returns `false` (and leaves `out` empty) when the step has more
/// decodes or tiles than the capacities, or the pieces more partial rows than
/// [`MAX_PARTIAL_ROWS`].
pub fn plan_mixed_fixed(
    cu_seqlens: &[u32],
    ctx_lens: &[u32],
    small_cap: usize,
    large_cap: usize,
    splits: u32,
    pad_token: u32,
    out: &mut AttnPlan,
) -> bool {
    out.reset(ctx_lens.len(), 1, Q_TILE);
    let splits = splits.max(1);
    // A decode is a one-token chunk (the last tile of a longer chunk can be one token too).
    let (mut small, mut large) = (0usize, 0usize);
    let n = ctx_lens.len().min(cu_seqlens.len().saturating_sub(1));
    let qlen = |s: usize| cu_seqlens[s + 1].saturating_sub(cu_seqlens[s]);
    for s in 0..n {
        match qlen(s) {
            0 => {}
            1 => small += 1,
            q if q <= SMALL_Q => large += 1,
            q => large += q.div_ceil(Q_TILE) as usize,
        }
    }
    let pieces = if splits > 1 {
        small_cap as u64 * u64::from(splits)
    } else {
        0
    };
    if small > small_cap || large > large_cap || pieces > u64::from(MAX_PARTIAL_ROWS) {
        out.reset(0, 1, Q_TILE);
        return false;
    }
    for s in (0..n).filter(|&s| qlen(s) == 1) {
        push_fixed_decode(out, Some(s as u32), cu_seqlens[s], ctx_lens[s], splits);
    }
    for _ in small..small_cap {
        push_fixed_decode(out, None, pad_token, 0, splits);
    }
    out.small = out.items();
    for_each_tile(cu_seqlens, ctx_lens, |s, q_first, q_count, kv_end| {
        if qlen(s as usize) > 1 {
            out.push_item([s, q_first, q_count, 0, kv_end, NO_PART]);
        }
    });
    for _ in large..large_cap {
        out.push_item([0, 0, 0, 0, 0, NO_PART]);
    }
    true
}

/// One attention layer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnDims {
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Tokens per KV-cache block (any value ≥ 1).
    pub block_size: u32,
    /// Chunks in the step (`ctx_lens.len()`); checked against the plan.
    pub num_seqs: u32,
    /// The cache holds FP8 e4m3 codes (`u8`) with per-layer K and V scales
    /// ([`AttnArg::KScale`], [`AttnArg::VScale`]) rather than the launch's dtype.
    pub kv_fp8: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttnError {
    #[error("attention: heads {heads} is not a positive multiple of kv_heads {kv_heads}")]
    Heads { heads: u32, kv_heads: u32 },
    #[error("attention: head_dim {0} is outside 1..={MAX_HEAD_DIM}")]
    HeadDim(u32),
    #[error("attention: block_size must be at least 1")]
    BlockSize,
    #[error("attention: the plan has {plan} chunks, the shape says {shape}")]
    Seqs { plan: usize, shape: u32 },
}

impl AttnDims {
    pub fn check(&self) -> Result<(), AttnError> {
        if self.kv_heads == 0 || self.heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(AttnError::Heads {
                heads: self.heads,
                kv_heads: self.kv_heads,
            });
        }
        if self.head_dim == 0 || self.head_dim > MAX_HEAD_DIM {
            return Err(AttnError::HeadDim(self.head_dim));
        }
        if self.block_size == 0 {
            return Err(AttnError::BlockSize);
        }
        Ok(())
    }
}

/// A symbolic kernel argument. The backend passes, for each:
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttnArg {
    /// Queries, `[tokens, heads * head_dim]`, contiguous, RoPE applied (f32 or bf16, as the
    /// launch's dtype). bf16 tensor-core kernels need 16-byte-aligned `q`, caches and `out`.
    Q,
    /// This layer's K cache, `[num_blocks, block_size, kv_heads, head_dim]`, holding this
    /// step's keys already.
    KCache,
    /// This layer's V cache, same layout.
    VCache,
    /// The output, `[tokens, heads * head_dim]`; every element is written.
    Out,
    /// The step's `cu_seqlens` (`u32`, `num_seqs + 1`).
    CuSeqlens,
    /// The step's `ctx_lens` (`u32`, `num_seqs`).
    CtxLens,
    /// The step's `bt_offsets` (`u32`, `num_seqs`).
    BtOffsets,
    /// The step's block tables (`u32` block ids).
    BlockTables,
    /// The uploaded column [`AttnPlan::column`] of the plan these launches came from.
    Work(WorkCol),
    /// f32 scratch buffer `i`, of [`scratch_bytes`]`[i]` bytes, uninitialised; may be any
    /// pointer (null too) when that size is 0.
    Scratch(usize),
    /// This `u32` value.
    U32(u32),
    /// The softmax scale (`f32`, > 0) that multiplies q·k.
    F32Scale,
    /// The FP8 cache's K scale (a cached key is its code times this); 1.0 for other caches.
    KScale,
    /// The FP8 cache's V scale; 1.0 for other caches.
    VScale,
}

impl AttnArg {
    /// How the kernel receives this argument.
    pub fn param(&self) -> Param {
        match self {
            AttnArg::U32(_) => Param::U32,
            AttnArg::F32Scale | AttnArg::KScale | AttnArg::VScale => Param::F32,
            _ => Param::Ptr,
        }
    }
}

/// A main kernel: its entry, its twin over an FP8 cache (the same shape and shared memory;
/// empty for kernels without one), packed (token, head) rows per CTA, threads per CTA and
/// dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kernel {
    entry: &'static str,
    kvfp8: &'static str,
    rows: u32,
    threads: u32,
    smem: u32,
}

impl Kernel {
    const fn with_kvfp8(self, kvfp8: &'static str) -> Kernel {
        Kernel { kvfp8, ..self }
    }
}

/// The SIMT kernel: 16 rows, static shared memory (attention.cu `S_ROWS`).
const fn simt(entry: &'static str, kvfp8: &'static str) -> Kernel {
    Kernel {
        entry,
        kvfp8,
        rows: 16,
        threads: 128,
        smem: 0,
    }
}

/// A tensor-core kernel (attention.cu `mma<D, BN, MT, Q_SMEM, NW, STAGES, WS>` and its
/// `MmaShape`): `warps` warps of `m_tiles` × 16 rows (16 rows in all when they split the keys,
/// `ws`), `stages` K+V tiles of `bn` keys, Q kept in shared memory or staged over the tiles,
/// plus two tables of `bn` cache rows.
#[allow(clippy::too_many_arguments)]
const fn mma(
    entry: &'static str,
    d: u32,
    bn: u32,
    m_tiles: u32,
    q_smem: bool,
    warps: u32,
    stages: u32,
    ws: bool,
) -> Kernel {
    let rows = if ws { 16 } else { 16 * m_tiles * warps };
    let kv = 2 * stages * bn * d * 2;
    let q = rows * d * 2;
    let tiles = if q_smem {
        kv + q
    } else if kv > q {
        kv
    } else {
        q
    };
    Kernel {
        entry,
        kvfp8: "",
        rows,
        threads: 32 * warps,
        smem: tiles + 2 * bn * 4,
    }
}

const DECODE_D64: Kernel = mma("attn_decode_d64_bf16", 64, 64, 1, false, 4, 2, true)
    .with_kvfp8("attn_decode_d64_bf16_kvfp8");
const DECODE_D128: Kernel = mma("attn_decode_d128_bf16", 128, 64, 1, false, 4, 2, true)
    .with_kvfp8("attn_decode_d128_bf16_kvfp8");
const MMA_D64: Kernel =
    mma("attn_mma_d64_bf16", 64, 64, 1, false, 4, 1, false).with_kvfp8("attn_mma_d64_bf16_kvfp8");
const MMA_D128: Kernel = mma("attn_mma_d128_bf16", 128, 64, 1, false, 4, 1, false)
    .with_kvfp8("attn_mma_d128_bf16_kvfp8");
const MMA_D256: Kernel = mma("attn_mma_d256_bf16", 256, 16, 1, false, 4, 1, false)
    .with_kvfp8("attn_mma_d256_bf16_kvfp8");
const PREFILL_D128: Kernel = mma("attn_prefill_d128_bf16", 128, 64, 2, true, 8, 1, false)
    .with_kvfp8("attn_prefill_d128_bf16_kvfp8");
const SIMT_F32: Kernel = simt("attn_simt_f32", "attn_simt_f32_kvfp8");
const SIMT_BF16: Kernel = simt("attn_simt_bf16", "attn_simt_bf16_kvfp8");
/// `attention_sm90.cu`: two warpgroups of 64 rows, Q [128 × 128] and 3 stages of K + V tiles
/// of 128 keys (bf16), 3 × 2 mbarriers, and 1024 bytes to align the tiles to the 128-byte
/// swizzle's 1024-byte period.
const WGMMA_D128: Kernel = Kernel {
    entry: "attn_prefill_wgmma_d128_bf16",
    kvfp8: "",
    rows: 128,
    threads: 256,
    smem: 1024 + 128 * 128 * 2 + 3 * 2 * 128 * 128 * 2 + 2 * 3 * 8,
};
const WGMMA_PP_D128: Kernel = Kernel {
    entry: "attn_prefill_wgmma_pp_d128_bf16",
    ..WGMMA_D128
};
const KERNELS: &[Kernel] = &[
    SIMT_F32,
    SIMT_BF16,
    DECODE_D64,
    DECODE_D128,
    MMA_D64,
    MMA_D128,
    MMA_D256,
    PREFILL_D128,
    WGMMA_D128,
    WGMMA_PP_D128,
];

/// Entries whose dynamic shared memory exceeds [`DEFAULT_SMEM_LIMIT`], with the bytes they
/// launch with: the backend raises `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` to
/// that value once per function (e.g. when it loads the module).
pub fn smem_opt_in() -> impl Iterator<Item = (&'static str, u32)> {
    KERNELS
        .iter()
        .filter(|k| k.smem > DEFAULT_SMEM_LIMIT)
        .flat_map(|k| [(k.entry, k.smem), (k.kvfp8, k.smem)])
        .filter(|(entry, _)| !entry.is_empty())
}

/// The kernel for a launch whose items have at most `max_rows` packed rows: in bf16, the
/// warp-split decode kernel when they fit its 16 rows, the `prefill` kernel (d = 128) when
/// they fill one of its CTAs, else the one-m-tile tensor-core kernel; SIMT in f32 and for
/// other head dims. Over an FP8 cache each kernel's `_kvfp8` twin, the `mma.sync` prefill
/// kernel standing in for the warpgroup-MMA ones (which have no twin).
fn kernel(shape: &AttnDims, bf16: bool, max_rows: u32, prefill: PrefillKernel) -> Kernel {
    let k = if !bf16 {
        SIMT_F32
    } else {
        let prefill = match shape.kv_fp8 {
            true => PREFILL_D128,
            false => prefill.kernel(),
        };
        match shape.head_dim {
            64 if max_rows <= DECODE_D64.rows => DECODE_D64,
            64 => MMA_D64,
            128 if max_rows <= DECODE_D128.rows => DECODE_D128,
            128 if max_rows >= prefill.rows => prefill,
            128 => MMA_D128,
            256 => MMA_D256,
            _ => SIMT_BF16,
        }
    };
    match shape.kv_fp8 {
        true => Kernel {
            entry: k.kvfp8,
            ..k
        },
        false => k,
    }
}

/// Bytes of each f32 scratch buffer ([`AttnArg::Scratch`]): partial outputs
/// `[partial_rows, heads, head_dim]` and partial (max, sum) `[partial_rows, heads, 2]`.
pub fn scratch_bytes(plan: &AttnPlan, shape: AttnDims) -> Vec<usize> {
    scratch_for_rows(plan.partial_rows, shape)
}

/// The most [`scratch_bytes`] can ask for with this shape (for sizing an arena).
pub fn max_scratch_bytes(shape: AttnDims) -> Vec<usize> {
    scratch_for_rows(MAX_PARTIAL_ROWS, shape)
}

fn scratch_for_rows(rows: u32, shape: AttnDims) -> Vec<usize> {
    let per_row = shape.heads as usize * 4;
    vec![
        rows as usize * per_row * shape.head_dim as usize,
        rows as usize * per_row * 2,
    ]
}

/// The launches of one attention layer, in stream order: the main kernel (one launch for
/// the small items, one for the others, more only past 65535 items), then the combine when
/// the plan split any tile. `prefill`: the d = 128 prefill kernel, one the device has built
/// (the Hopper ones exist only for `sm_90a`).
pub fn launches(
    plan: &AttnPlan,
    shape: AttnDims,
    bf16: bool,
    prefill: PrefillKernel,
) -> Result<Vec<Launch<AttnArg>>, AttnError> {
    shape.check()?;
    if plan.num_seqs != shape.num_seqs as usize {
        return Err(AttnError::Seqs {
            plan: plan.num_seqs,
            shape: shape.num_seqs,
        });
    }
    let group = shape.heads / shape.kv_heads;
    let mut out = Vec::new();
    let classes = [
        (0..plan.small, plan.max_q_small),
        (plan.small..plan.items(), plan.max_q_large),
    ];
    for (range, max_q) in classes {
        let k = kernel(&shape, bf16, max_q * group, prefill);
        let row_tiles = (max_q * group).div_ceil(k.rows);
        let mut base = range.start;
        while base < range.end {
            let count = (range.end - base).min(MAX_GRID_Y);
            out.push(Launch {
                entry: k.entry,
                grid: (shape.kv_heads * row_tiles, count as u32, 1),
                block: (k.threads, 1, 1),
                smem: k.smem,
                args: main_args(base as u32, shape),
            });
            base += count;
        }
    }
    let combine = if bf16 {
        "attn_combine_bf16"
    } else {
        "attn_combine_f32"
    };
    let mut base = 0;
    while base < plan.combine_rows() {
        let count = (plan.combine_rows() - base).min(MAX_GRID_Y);
        out.push(Launch {
            entry: combine,
            grid: (shape.heads, count as u32, 1),
            block: (128, 1, 1),
            smem: 0,
            args: vec![
                AttnArg::Out,
                AttnArg::Scratch(0),
                AttnArg::Scratch(1),
                AttnArg::Work(WorkCol::CombToken),
                AttnArg::Work(WorkCol::CombPart),
                AttnArg::Work(WorkCol::CombStride),
                AttnArg::Work(WorkCol::CombSplits),
                AttnArg::U32(base as u32),
                AttnArg::U32(shape.heads),
                AttnArg::U32(shape.head_dim),
            ],
        });
        base += count;
    }
    Ok(out)
}

fn main_args(item_base: u32, shape: AttnDims) -> Vec<AttnArg> {
    use AttnArg::*;
    vec![
        Q,
        KCache,
        VCache,
        Out,
        CuSeqlens,
        CtxLens,
        BtOffsets,
        BlockTables,
        Work(WorkCol::Seq),
        Work(WorkCol::QFirst),
        Work(WorkCol::QCount),
        Work(WorkCol::KvFirst),
        Work(WorkCol::KvEnd),
        Work(WorkCol::Part),
        Scratch(0),
        Scratch(1),
        U32(item_base),
        U32(shape.heads),
        U32(shape.kv_heads),
        U32(shape.head_dim),
        U32(shape.block_size),
        F32Scale,
        KScale,
        VScale,
    ]
}

#[cfg(test)]
mod tests;
