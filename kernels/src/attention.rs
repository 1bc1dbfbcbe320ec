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
/// item_base, heads, kv_heads, head_dim, block_size, scale`.
const MAIN: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32,
    U32, U32, F32,
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
}

impl AttnArg {
    /// How the kernel receives this argument.
    pub fn param(&self) -> Param {
        match self {
            AttnArg::U32(_) => Param::U32,
            AttnArg::F32Scale => Param::F32,
            _ => Param::Ptr,
        }
    }
}

/// A main kernel: its entry, packed (token, head) rows per CTA, threads per CTA and
/// dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kernel {
    entry: &'static str,
    rows: u32,
    threads: u32,
    smem: u32,
}

/// The SIMT kernel: 16 rows, static shared memory (attention.cu `S_ROWS`).
const fn simt(entry: &'static str) -> Kernel {
    Kernel {
        entry,
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
        rows,
        threads: 32 * warps,
        smem: tiles + 2 * bn * 4,
    }
}

const DECODE_D64: Kernel = mma("attn_decode_d64_bf16", 64, 64, 1, false, 4, 2, true);
const DECODE_D128: Kernel = mma("attn_decode_d128_bf16", 128, 64, 1, false, 4, 2, true);
const MMA_D64: Kernel = mma("attn_mma_d64_bf16", 64, 64, 1, false, 4, 1, false);
const MMA_D128: Kernel = mma("attn_mma_d128_bf16", 128, 64, 1, false, 4, 1, false);
const MMA_D256: Kernel = mma("attn_mma_d256_bf16", 256, 16, 1, false, 4, 1, false);
const PREFILL_D128: Kernel = mma("attn_prefill_d128_bf16", 128, 64, 2, true, 8, 1, false);
/// `attention_sm90.cu`: two warpgroups of 64 rows, Q [128 × 128] and 3 stages of K + V tiles
/// of 128 keys (bf16), 3 × 2 mbarriers, and 1024 bytes to align the tiles to the 128-byte
/// swizzle's 1024-byte period.
const WGMMA_D128: Kernel = Kernel {
    entry: "attn_prefill_wgmma_d128_bf16",
    rows: 128,
    threads: 256,
    smem: 1024 + 128 * 128 * 2 + 3 * 2 * 128 * 128 * 2 + 2 * 3 * 8,
};
const WGMMA_PP_D128: Kernel = Kernel {
    entry: "attn_prefill_wgmma_pp_d128_bf16",
    ..WGMMA_D128
};
const KERNELS: &[Kernel] = &[
    simt("attn_simt_f32"),
    simt("attn_simt_bf16"),
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
        .map(|k| (k.entry, k.smem))
}

/// The kernel for a launch whose items have at most `max_rows` packed rows: in bf16, the
/// warp-split decode kernel when they fit its 16 rows, the `prefill` kernel (d = 128) when
/// they fill one of its CTAs, else the one-m-tile tensor-core kernel; SIMT in f32 and for
/// other head dims.
fn kernel(head_dim: u32, bf16: bool, max_rows: u32, prefill: PrefillKernel) -> Kernel {
    if !bf16 {
        return KERNELS[0];
    }
    match head_dim {
        64 if max_rows <= DECODE_D64.rows => DECODE_D64,
        64 => MMA_D64,
        128 if max_rows <= DECODE_D128.rows => DECODE_D128,
        128 if max_rows >= prefill.kernel().rows => prefill.kernel(),
        128 => MMA_D128,
        256 => MMA_D256,
        _ => KERNELS[1],
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
        let k = kernel(shape.head_dim, bf16, max_q * group, prefill);
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
    ]
}

#[cfg(test)]
mod tests {
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
                            for r in
                                rt * rows_per_cta..(qn * g).min(rt * rows_per_cta + rows_per_cta)
                            {
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
                        let (first, stride) =
                            (col(WorkCol::CombPart, c), col(WorkCol::CombStride, c));
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
        let l =
            launches(&p, dims(32, 8, 128, 1), true, PrefillKernel::WgmmaPingPong).expect("shape");
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
        let entry = |d, bf16, rows| kernel(d, bf16, rows, PrefillKernel::MmaSync).entry;
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
        let hopper = |d, bf16, rows| kernel(d, bf16, rows, PrefillKernel::Wgmma).entry;
        assert_eq!(hopper(128, true, 16), "attn_decode_d128_bf16");
        assert_eq!(hopper(128, true, 127), "attn_mma_d128_bf16");
        assert_eq!(hopper(128, true, 128), "attn_prefill_wgmma_d128_bf16");
        assert_eq!(hopper(128, true, 512), "attn_prefill_wgmma_d128_bf16");
        assert_eq!(hopper(128, false, 512), "attn_simt_f32");
        assert_eq!(hopper(64, true, 512), "attn_mma_d64_bf16");
        assert_eq!(hopper(256, true, 512), "attn_mma_d256_bf16");
        assert_eq!(
            kernel(128, true, 200, PrefillKernel::WgmmaPingPong).entry,
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
                ("attn_prefill_d128_bf16", 98816),
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
        let sw128 = |rows: u32, r: u32, c: u32| {
            (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4)
        };
        // Where the kernel stores element (row, col) of a tile at `base`.
        let stored =
            |base: u32, rows: u32, r: u32, col: u32| base + sw128(rows, r, col / 8) + (col % 8) * 2;
        let swizzle = |addr: u32| addr ^ (((addr >> 7) & 7) << 4);
        // Descriptor fields as encoded (>> 4) and decoded again: what the hardware sees.
        let field = |x: u32| ((x & 0x3FFFF) >> 4) << 4;
        // K-major: element (mn, k) of an m64/n128 × k16 operand.
        let k_major = |start: u32, sbo: u32, mn: u32, k: u32| {
            swizzle(
                field(start) + (mn % 8) * 128 + (mn / 8) * field(sbo) + (k % 8) * 2 + (k / 8) * 16,
            )
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
    fn sm90_program(
        wg: usize,
        ntiles: usize,
        jn: usize,
        pingpong: bool,
        lead: usize,
    ) -> Vec<SyncOp> {
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
}
