//! Mamba2 state-space kernels (`ssm.cu`): their entry table, the host-side planner that turns
//! a step's chunk layout and snapshot targets into work columns, and the launches of the
//! causal conv1d, the selective scan and the SSM slot restores/zeros.
//!
//! **Plan once per step, launch per layer.** [`plan`] reads only the step's `cu_seqlens`,
//! each chunk's live slot, the snapshot targets, the slot ops and a chunk size; its columns
//! are independent of the layer's shape and dtype, so the backend uploads the [`WorkCol`]
//! columns once per step and every SSM layer reuses them. The launch functions then give one
//! layer's kernels with symbolic arguments ([`SsmArg`]) the backend maps in one `match`.
//!
//! **The work columns.**
//! - *Sequence entries* (`Seq*`, one per chunk of the step with at least one token): the
//!   one-token chunks first ([`SsmPlan::decodes`]: they take the recurrent step, as the CPU
//!   reference does for any one-token segment), then the others ("prompts").
//! - *SSD chunks* (`Ck*`): each prompt is cut at every snapshot offset and then every
//!   `chunk_size` tokens from each cut, exactly the segments and chunks the CPU reference
//!   scans, so the state at every snapshot is a chunk-end state. A chunk whose end carries
//!   snapshots lists their slots (`CkSnap`, `CkSnaps` into `SnapSlot`).
//! - *Snapshot slots* (`SnapSlot`): grouped by sequence entry, then by offset.
//! - *Slot ops* (`OpFrom`, `OpTo`; `OpFrom` = [`ZERO_OP`] zeroes): in step order, cut into
//!   waves ([`SsmPlan::waves`]) so that no op of a wave reads or writes a slot another op of
//!   the same wave writes; one launch per wave keeps the sequential semantics.
//!
//! **Invariants** (checked by the tests below, including a proptest over random mixes that
//! replays the kernels' grid decomposition): every token is in exactly one decode entry or
//! one chunk; chunks are at most the plan's chunk size and end at every snapshot offset;
//! every (token, head) output and every (token, channel) conv output is written exactly once;
//! each snapshot slot is written once per layer and pool; the live slot of every entry is
//! updated once per layer and pool; all columns of a group have one length.
//!
//! **Kernels** (see `ssm.cu` for the algorithm): conv `ssm_conv_chunks` (prompt chunks, and
//! their snapshot conv states) then `ssm_conv_update` (every entry's new live conv state; the
//! decodes' outputs and snapshots); scan `ssm_decode` (decodes), then `ssd_dt` and, for
//! bf16 with head_dim 64 and state 64 or 128, the tensor-core `ssd_chunk_pass_mma` (chunk
//! states and state passing in one walk: entering states, live and snapshot states) and
//! `ssd_scan_group_mma` (`ssd_scan_mma` for chunks over 128 tokens); other shapes and f32
//! take the SIMT `ssd_states_simt`, `ssd_pass` and `ssd_scan_simt`.
//!
//! **Measured** on one H200 (a CuPy harness running exactly these launches from
//! `tests::dump_gpu_cases` against a float64 transcription of the CPU semantics; outputs
//! and scratch NaN-poisoned; compute-sanitizer memcheck clean): every output, live state
//! and snapshot within tolerance on mixed batches (decodes with snapshots, block-boundary
//! snapshots of a 131-token chunk, prompts shorter than the conv window, chunk sizes 8, 29,
//! 128, 256, head_dim 24/32/64, state 16/64/128): f32 scan ≤ 4.2e-7 relative, conv ≤ 6.8e-8,
//! states ≤ 1.9e-6 (one snapshot 1.5e-5 against f64, which the CPU's own f32 algorithm also
//! shows); bf16 ≤ 1.8e-3; untouched slots and layers bit-identical; slot ops sequential.
//! Times (bf16, 128 heads × 64, 8 groups, state 128, chunk 128): scan T = 8192 2.17 ms
//! (dt 0.03, chunk states 0.32, state passing 1.05, chunk scan 0.83), conv 0.30 ms; decode
//! batch 256 0.66 ms (3.24 TB/s of f32 state), conv update 0.06 ms. f32 (SIMT): scan 7.97 ms.
//! (Measured at commit c5d5f8d.) The tensor-core SSD of the `bench-kernels` suite (same shape,
//! T = 8192, device time per kernel): the per-head chunk scan, chunk states and state passing
//! 0.952 ms (scan 559, states 235, passing 141, dt 17 µs); the fused chunk pass and the group
//! scan 0.643 ms (chunk pass 285, group scan 341, dt 17 µs; 0.671 ms end to end), the
//! `kernels` and `hybrid` suites passing with them.
//!
//! **What the backend must do.** Build the plan once per step with the chunk size of the
//! model's SSM layers (every Mamba2 layer of one model shares it; a layer with another chunk
//! size still gets correct results, cut at the plan's size), upload every column, and run
//! each layer's launches in order on one stream. Scratch buffers of [`scratch_bytes`] are
//! needed only while one layer's scan runs. The kernels never touch a slot ≥ the pool's
//! slots (padding entries are skipped; a skipped decode's outputs are zeros). Grid sizes
//! follow the plan, so a captured CUDA graph is valid only for the plan it was captured with,
//! or for any plan padded to the same capacities ([`SsmPlan::pad_to`]).
//!
//! This module knows nothing of CUDA: it must not allocate device memory or launch.

use crate::{Entry, Launch, Param};

use Param::{F32, Ptr, U32, U64};

/// `OpFrom` of a slot op that zeroes its destination.
pub const ZERO_OP: u32 = u32::MAX;
/// Largest chunk the plan cuts (a larger `chunk_size` is clamped; results are the same up to
/// rounding).
pub const MAX_CHUNK: u32 = 256;
/// Largest conv kernel width (`ssm.cu` MAXK).
pub const MAX_CONV_KERNEL: u32 = 8;

// Geometry mirrored from ssm.cu.
const CONV_THREADS: u32 = 128;
const CONV_ROWS: u32 = 32;
const DEC_THREADS: u32 = 128;
const DEC_VECS: u32 = 8;
const DT_THREADS: u32 = 256;
const DT_HEADS: u32 = 32;
const SIMT_THREADS: u32 = 256;
const SIMT_TM: u32 = 32;
const SIMT_TN: u32 = 64;
const PASS_THREADS: u32 = 256;
const PASS_PER: u32 = 8;
const SCAN_THREADS: u32 = 256;
const SCAN_ROWS: u32 = 128;
const CHUNK_PASS_SPLIT: u32 = 2;
/// Grids of the group scan below this many CTAs take fewer heads a CTA.
const GROUP_SCAN_CTAS: u64 = 512;
const OPS_THREADS: u32 = 256;
const MAX_OPS_BLOCKS: u64 = 1024;
const MAX_GRID_Y: usize = 65535;
const MAX_GRID_X: u64 = i32::MAX as u64;

const SLOT_OPS: &[Param] = &[Ptr, Ptr, Ptr, Ptr, U32, U32, U64, U64];
/// `x, weight, bias, out, conv_pool, seq_tok, seq_slot, ck_tok, ck_len, ck_seq, ck_snap,
/// ck_snaps, snap_slot, channels, kernel, x_ld, out_ld, layer, layers, slots, ch_blocks,
/// row_blocks`.
const CONV_CHUNKS: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32,
    U32, U32, U32,
];
/// `x, weight, bias, out, conv_pool, seq_tok, seq_len, seq_slot, seq_snap, seq_snaps,
/// snap_slot, dec_count, channels, kernel, x_ld, out_ld, layer, layers, slots, ch_blocks`.
const CONV_UPDATE: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32, U32, U32,
    U32,
];
/// `x, b, c, dt, a_log, d, dt_bias, out, ssm_pool, seq_tok, seq_slot, seq_snap, seq_snaps,
/// snap_slot, heads, head_dim, groups, state, x_ld, bc_ld, dt_ld, out_ld, layer, layers,
/// slots, slice_rows, dt_min, dt_max`.
const DECODE: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32,
    U32, U32, U32, U32, U32, U32, U32, F32, F32,
];
/// `dt, dt_bias, a_log, dtv, acum, ck_a, ck_dt, ck_tok, ck_len, heads, dt_ld, head_blocks,
/// rec_rows, dt_min, dt_max`.
const DT: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, F32, F32,
];
/// `x, b, dtv, acum, states, ck_tok, ck_len, heads, head_dim, groups, state, x_ld, bc_ld,
/// p_tiles, n_tiles`.
const STATES: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32, U32, U32,
];
/// `states, acum, ssm_pool, seq_slot, seq_chunk, seq_chunks, ck_tok, ck_len, ck_snap,
/// ck_snaps, snap_slot, seq_base, heads, pn, layer, layers, slots, tiles`.
const PASS: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32, U32,
];
/// `x, b, ck_dt, ck_a, hc, ssm_pool, seq_slot, seq_chunk, seq_chunks, ck_tok, ck_len, ck_snap,
/// ck_snaps, snap_slot, seq_base, heads, groups, x_ld, bc_ld, layer, layers, slots, rec_rows`.
const CHUNK_PASS: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32,
    U32, U32, U32, U32,
];
/// `x, b, c, d, ck_dt, ck_a, hc, out, ck_tok, ck_len, heads, groups, x_ld, bc_ld, out_ld,
/// head_block, head_blocks, rec_rows`.
const GROUP_SCAN: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32, U32, U32,
];
/// `x, b, c, d, dtv, acum, states, out, ck_tok, ck_len, heads, head_dim, groups, state, x_ld,
/// bc_ld, out_ld, l_tiles, p_tiles`.
const SCAN: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32, U32, U32, U32,
];

const fn e(name: &'static str, params: &'static [Param]) -> Entry {
    Entry { name, params }
}

pub const ENTRIES: &[Entry] = &[
    e("ssm_slot_ops", SLOT_OPS),
    e("ssm_slot_ops_v4", SLOT_OPS),
    e("ssm_conv_chunks_f32", CONV_CHUNKS),
    e("ssm_conv_chunks_bf16", CONV_CHUNKS),
    e("ssm_conv_update_f32", CONV_UPDATE),
    e("ssm_conv_update_bf16", CONV_UPDATE),
    e("ssm_decode_f32", DECODE),
    e("ssm_decode_bf16", DECODE),
    e("ssm_decode_f32_sbf16", DECODE),
    e("ssm_decode_bf16_sbf16", DECODE),
    e("ssd_dt_f32", DT),
    e("ssd_dt_bf16", DT),
    e("ssd_states_simt_f32", STATES),
    e("ssd_states_simt_bf16", STATES),
    e("ssd_pass", PASS),
    e("ssd_pass_sbf16", PASS),
    e("ssd_chunk_pass_mma_p64n64_bf16", CHUNK_PASS),
    e("ssd_chunk_pass_mma_p64n128_bf16", CHUNK_PASS),
    e("ssd_chunk_pass_mma_p64n64_bf16_sbf16", CHUNK_PASS),
    e("ssd_chunk_pass_mma_p64n128_bf16_sbf16", CHUNK_PASS),
    e("ssd_scan_simt_f32", SCAN),
    e("ssd_scan_simt_bf16", SCAN),
    e("ssd_scan_mma_p64n64_bf16", SCAN),
    e("ssd_scan_mma_p64n128_bf16", SCAN),
    e("ssd_scan_group_mma_p64n64_bf16", GROUP_SCAN),
    e("ssd_scan_group_mma_p64n128_bf16", GROUP_SCAN),
];

/// The uploaded work columns (all `u32`). `Seq*` columns have [`SsmPlan::seqs`] entries,
/// `Ck*` [`SsmPlan::chunks`], `SnapSlot` [`SsmPlan::snapshots`], `Op*` [`SsmPlan::ops`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkCol {
    /// Entry: first token row.
    SeqTok,
    /// Entry: tokens (1 for the decodes `[0, decodes)`).
    SeqLen,
    /// Entry: live slot.
    SeqSlot,
    /// Entry: first SSD chunk (prompts; 0 for decodes).
    SeqChunk,
    /// Entry: SSD chunks (prompts; 0 for decodes).
    SeqChunks,
    /// Entry: first of its snapshot slots in `SnapSlot`.
    SeqSnap,
    /// Entry: number of its snapshot slots (written by the decode kernels for decodes; by the
    /// chunk kernels, through `CkSnap*`, for prompts).
    SeqSnaps,
    /// Chunk: first token row.
    CkTok,
    /// Chunk: tokens (1..=chunk size).
    CkLen,
    /// Chunk: its sequence entry.
    CkSeq,
    /// Chunk: first snapshot slot taking the state at the chunk's end.
    CkSnap,
    /// Chunk: number of those slots.
    CkSnaps,
    /// Snapshot destination slots.
    SnapSlot,
    /// Slot op: source slot, or [`ZERO_OP`].
    OpFrom,
    /// Slot op: destination slot.
    OpTo,
}

impl WorkCol {
    pub const ALL: [WorkCol; 15] = [
        WorkCol::SeqTok,
        WorkCol::SeqLen,
        WorkCol::SeqSlot,
        WorkCol::SeqChunk,
        WorkCol::SeqChunks,
        WorkCol::SeqSnap,
        WorkCol::SeqSnaps,
        WorkCol::CkTok,
        WorkCol::CkLen,
        WorkCol::CkSeq,
        WorkCol::CkSnap,
        WorkCol::CkSnaps,
        WorkCol::SnapSlot,
        WorkCol::OpFrom,
        WorkCol::OpTo,
    ];
}

/// "After `after` tokens of chunk `seq`, write the state into `slot`" (the step's snapshot
/// targets, in any order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub seq: u32,
    /// In `1 ..= len` of the chunk.
    pub after: u32,
    pub slot: u32,
}

/// A slot restore or zero, applied to both pools and every layer, in step order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotOp {
    Copy { from: u32, to: u32 },
    Zero { slot: u32 },
}

/// What [`plan`] reads: plain slices of the step.
#[derive(Debug, Clone, Copy)]
pub struct SsmStepInputs<'a> {
    /// Chunk boundaries in the step's token rows (`chunks + 1` entries, non-decreasing).
    pub cu_seqlens: &'a [u32],
    /// Each chunk's live SSM slot.
    pub slots: &'a [u32],
    pub snapshots: &'a [Snapshot],
    pub slot_ops: &'a [SlotOp],
    /// The SSD chunk size (the model's; clamped to 1..=[`MAX_CHUNK`]).
    pub chunk_size: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SsmError {
    #[error("ssm plan: {slots} live slots for {chunks} chunks")]
    Slots { chunks: usize, slots: usize },
    #[error("ssm plan: cu_seqlens decrease at chunk {0}")]
    CuSeqlens(usize),
    #[error("ssm plan: snapshot after {after} tokens of the {len}-token chunk {seq}")]
    Snapshot { seq: u32, after: u32, len: u32 },
    #[error("ssm: {heads} heads in {groups} groups (head_dim {head_dim}, state {state})")]
    Shape {
        heads: u32,
        groups: u32,
        head_dim: u32,
        state: u32,
    },
    #[error("ssm conv: kernel width {kernel} outside 2..={MAX_CONV_KERNEL} or no channels")]
    Conv { kernel: u32, channels: u32 },
    #[error("ssm: a grid of {0} blocks is too large")]
    Grid(u64),
}

/// The step's work columns. Built by [`plan`]; reused across steps without allocating once
/// its buffers have grown to the step sizes seen.
#[derive(Debug, Clone, Default)]
pub struct SsmPlan {
    cols: [Vec<u32>; 15],
    decodes: usize,
    chunk_size: u32,
    tokens: u32,
    /// SSD chunks the group scan's CTA shape is chosen for: the plan's own, or for a padded
    /// plan those of its token rows in one prompt (most of its chunks are padding).
    scan_chunks: usize,
    waves: Vec<(usize, usize)>,
    // Planning scratch (kept for reuse).
    order: Vec<(u32, u32, u32)>,
    wave_reads: Vec<u32>,
    wave_writes: Vec<u32>,
}

impl SsmPlan {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn column(&self, c: WorkCol) -> &[u32] {
        &self.cols[c as usize]
    }

    /// Sequence entries (decodes first).
    pub fn seqs(&self) -> usize {
        self.cols[WorkCol::SeqTok as usize].len()
    }

    /// One-token entries `[0, decodes)`.
    pub fn decodes(&self) -> usize {
        self.decodes
    }

    /// Entries `[decodes, seqs)`, scanned in SSD chunks.
    pub fn prompts(&self) -> usize {
        self.seqs() - self.decodes
    }

    pub fn chunks(&self) -> usize {
        self.cols[WorkCol::CkTok as usize].len()
    }

    pub fn snapshots(&self) -> usize {
        self.cols[WorkCol::SnapSlot as usize].len()
    }

    pub fn ops(&self) -> usize {
        self.cols[WorkCol::OpTo as usize].len()
    }

    /// Op ranges `[start, end)` launched one after another.
    pub fn waves(&self) -> &[(usize, usize)] {
        &self.waves
    }

    /// The chunk size the plan was cut with.
    pub fn chunk_size(&self) -> u32 {
        self.chunk_size
    }

    /// Token rows of the step (`cu_seqlens`' last value).
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    fn col(&mut self, c: WorkCol) -> &mut Vec<u32> {
        &mut self.cols[c as usize]
    }

    fn push_seq(&mut self, v: [u32; 7]) {
        for (col, x) in self.cols[..7].iter_mut().zip(v) {
            col.push(x);
        }
    }

    fn push_chunk(&mut self, v: [u32; 5]) {
        for (col, x) in self.cols[7..12].iter_mut().zip(v) {
            col.push(x);
        }
    }

    fn push_snaps(&mut self, range: std::ops::Range<usize>, snapshots: &[Snapshot]) {
        for i in range {
            let slot = snapshots[self.order[i].2 as usize].slot;
            self.cols[WorkCol::SnapSlot as usize].push(slot);
        }
    }
}

/// Builds the step's work columns into `out` (its buffers are reused).
pub fn plan(inp: SsmStepInputs<'_>, out: &mut SsmPlan) -> Result<(), SsmError> {
    for c in &mut out.cols {
        c.clear();
    }
    out.waves.clear();
    out.order.clear();
    out.decodes = 0;
    let cu = inp.cu_seqlens;
    let n = cu.len().saturating_sub(1);
    if inp.slots.len() != n {
        return Err(SsmError::Slots {
            chunks: n,
            slots: inp.slots.len(),
        });
    }
    if let Some(i) = (0..n).find(|&i| cu[i + 1] < cu[i]) {
        return Err(SsmError::CuSeqlens(i));
    }
    let len = |s: usize| cu[s + 1] - cu[s];
    out.chunk_size = inp.chunk_size.clamp(1, MAX_CHUNK);
    out.tokens = cu.last().copied().unwrap_or(0);
    for (i, s) in inp.snapshots.iter().enumerate() {
        let l = if (s.seq as usize) < n {
            len(s.seq as usize)
        } else {
            0
        };
        if s.after == 0 || s.after > l {
            return Err(SsmError::Snapshot {
                seq: s.seq,
                after: s.after,
                len: l,
            });
        }
        out.order.push((s.seq, s.after, i as u32));
    }
    out.order.sort_unstable();
    let range_of = |order: &[(u32, u32, u32)], s: usize| {
        let a = order.partition_point(|o| (o.0 as usize) < s);
        let b = order.partition_point(|o| (o.0 as usize) <= s);
        a..b
    };

    for s in (0..n).filter(|&s| len(s) == 1) {
        let r = range_of(&out.order, s);
        let snap = out.snapshots() as u32;
        out.push_seq([cu[s], 1, inp.slots[s], 0, 0, snap, r.len() as u32]);
        out.push_snaps(r, inp.snapshots);
    }
    out.decodes = out.seqs();
    for s in (0..n).filter(|&s| len(s) > 1) {
        let (tok, l) = (cu[s], len(s));
        let r = range_of(&out.order, s);
        let entry = out.seqs() as u32;
        let (first_chunk, first_snap) = (out.chunks() as u32, out.snapshots() as u32);
        let (mut from, mut i) = (0u32, r.start);
        while from < l {
            // The next segment end: the next snapshot offset, else the chunk's end.
            let end = if i < r.end { out.order[i].1 } else { l };
            let mut j = i;
            while j < r.end && out.order[j].1 == end {
                j += 1;
            }
            while from < end {
                let to = (from + out.chunk_size).min(end);
                let snaps = if to == end { (j - i) as u32 } else { 0 };
                let at = out.snapshots() as u32;
                out.push_chunk([tok + from, to - from, entry, at, snaps]);
                from = to;
            }
            out.push_snaps(i..j, inp.snapshots);
            i = j;
        }
        let chunks = out.chunks() as u32 - first_chunk;
        out.push_seq([
            tok,
            l,
            inp.slots[s],
            first_chunk,
            chunks,
            first_snap,
            r.len() as u32,
        ]);
    }
    plan_slot_ops(inp.slot_ops, out);
    out.scan_chunks = out.chunks();
    Ok(())
}

/// Slot of padding entries and padding snapshots: past every pool, so the kernels skip it.
pub const PAD_SLOT: u32 = u32::MAX;

/// Capacities of a fixed-shape plan ([`SsmPlan::pad_to`]), for CUDA graphs of mixed steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedCaps {
    /// One-token entries.
    pub decodes: usize,
    /// Longer entries.
    pub prompts: usize,
    pub chunks: usize,
    pub snapshots: usize,
    /// Token rows of the padded step: rows from the plan's [`SsmPlan::tokens`] on are
    /// padding, and the padding decodes write zeros to them (one at least is needed when
    /// there are padding decodes; several padding decodes may share one).
    pub rows: u32,
}

impl SsmPlan {
    /// Pads the plan to `caps`, so that its launches (grids and arguments) depend only on
    /// `caps` and the layer: padding decodes (after the real ones) spread over the padding
    /// rows, padding prompts and snapshots on [`PAD_SLOT`], padding chunks of no tokens. The
    /// kernels skip all of them, but for the padding decodes' zero outputs on their rows.
    /// Slot ops are kept as planned (a graph step runs them before its replay). Returns
    /// `false`, the plan unchanged, when it exceeds a capacity or the padding rows are
    /// too few.
    pub fn pad_to(&mut self, caps: FixedCaps) -> bool {
        let (d, p) = (self.decodes, self.prompts());
        let spare = caps.rows.saturating_sub(self.tokens) as usize;
        if d > caps.decodes
            || p > caps.prompts
            || self.chunks() > caps.chunks
            || self.snapshots() > caps.snapshots
            || (caps.decodes > d && spare == 0)
        {
            return false;
        }
        let shift = (caps.decodes - d) as u32;
        let (tokens, last) = (self.tokens, caps.rows.saturating_sub(1));
        // Entry columns, in `push_seq` order: padding decodes, then padding prompts.
        let pad_decode = |i: u32| [tokens + i % spare as u32, 1, PAD_SLOT, 0, 0, 0, 0];
        let pad_prompt = [last, 0, PAD_SLOT, 0, 0, 0, 0];
        for (c, col) in self.cols[..7].iter_mut().enumerate() {
            col.splice(d..d, (0..shift).map(|i| pad_decode(i)[c]));
            col.resize(caps.decodes + caps.prompts, pad_prompt[c]);
        }
        for e in &mut self.cols[WorkCol::CkSeq as usize] {
            *e += shift;
        }
        let pad_chunk = [last, 0, caps.decodes as u32, 0, 0];
        for (c, col) in self.cols[7..12].iter_mut().enumerate() {
            col.resize(caps.chunks, pad_chunk[c]);
        }
        self.col(WorkCol::SnapSlot).resize(caps.snapshots, PAD_SLOT);
        self.decodes = caps.decodes;
        self.tokens = caps.rows;
        self.scan_chunks = caps.rows.div_ceil(self.chunk_size.max(1)).max(1) as usize;
        true
    }
}

/// Slot ops in step order, cut into conflict-free waves.
fn plan_slot_ops(ops: &[SlotOp], out: &mut SsmPlan) {
    out.wave_reads.clear();
    out.wave_writes.clear();
    let mut start = 0;
    for op in ops {
        let (from, to) = match *op {
            SlotOp::Copy { from, to } if from == to => continue,
            SlotOp::Copy { from, to } => (from, to),
            SlotOp::Zero { slot } => (ZERO_OP, slot),
        };
        let conflict = out.wave_writes.contains(&to)
            || out.wave_reads.contains(&to)
            || (from != ZERO_OP && out.wave_writes.contains(&from));
        if conflict {
            out.waves.push((start, out.ops()));
            start = out.ops();
            out.wave_reads.clear();
            out.wave_writes.clear();
        }
        out.col(WorkCol::OpFrom).push(from);
        out.col(WorkCol::OpTo).push(to);
        out.wave_writes.push(to);
        if from != ZERO_OP {
            out.wave_reads.push(from);
        }
    }
    if out.ops() > start {
        out.waves.push((start, out.ops()));
    }
}

/// A symbolic kernel argument. The backend passes, for each:
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SsmArg {
    /// Conv: the input `[tokens, channels]` (row stride `x_ld`). Scan: `x`,
    /// `[tokens, heads·head_dim]` (row stride `x_ld`). f32 or bf16, as the launch's dtype;
    /// the tensor-core kernels need it 16-byte aligned.
    X,
    /// Scan: `B`, `[tokens, groups·state]` (row stride `bc_ld`).
    B,
    /// Scan: `C`, same layout as `B`.
    C,
    /// Scan: the raw `dt`, `[tokens, heads]` (row stride `dt_ld`; bias and softplus applied in
    /// the kernels).
    Dt,
    /// Scan: `A_log`, `[heads]`.
    ALog,
    /// Scan: `D`, `[heads]`.
    D,
    /// Scan: `dt_bias`, `[heads]`.
    DtBias,
    /// Conv: the weights `[channels, kernel]` (HF's `[channels, 1, kernel]`).
    Weight,
    /// Conv: the bias `[channels]`, or a null pointer (0) when the layer has none.
    Bias,
    /// The output (conv: `[tokens, channels]`, row stride `out_ld`; scan: `[tokens,
    /// heads·head_dim]`, row stride `out_ld`); every row of the step is written.
    Out,
    /// The f32 conv pool `[slots, layers, channels, kernel − 1]`.
    ConvPool,
    /// The f32 SSM pool `[slots, layers, heads, head_dim, state]`.
    SsmPool,
    /// The uploaded column [`SsmPlan::column`] of the plan these launches came from.
    Work(WorkCol),
    /// f32 scratch buffer `i`, of [`scratch_bytes`]`[i]` bytes, uninitialised.
    Scratch(usize),
    U32(u32),
    U64(u64),
    F32(f32),
}

impl SsmArg {
    /// How the kernel receives this argument.
    pub fn param(&self) -> Param {
        match self {
            SsmArg::U32(_) => Param::U32,
            SsmArg::U64(_) => Param::U64,
            SsmArg::F32(_) => Param::F32,
            _ => Param::Ptr,
        }
    }
}

/// 4-byte words per slot of each pool (all layers: `layers · per-layer elements`, halved for a
/// pool stored as bf16). The slot ops copy raw words, whatever the element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolDims {
    pub slots: u32,
    pub conv_per_slot: u64,
    pub ssm_per_slot: u64,
}

/// One conv layer's shape and its place in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvDims {
    pub channels: u32,
    /// Kernel width (2..=[`MAX_CONV_KERNEL`]).
    pub kernel: u32,
    /// This layer's index among the pool's SSM layers, and their count.
    pub layer: u32,
    pub layers: u32,
    pub slots: u32,
    /// Row strides (elements) of the input and the output: `channels` when contiguous.
    pub x_ld: u32,
    pub out_ld: u32,
}

/// One scan layer's shape and constants, and its place in the pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScanDims {
    pub heads: u32,
    pub head_dim: u32,
    pub groups: u32,
    pub state: u32,
    pub layer: u32,
    pub layers: u32,
    pub slots: u32,
    /// Row strides (elements): `x` (`heads·head_dim` when contiguous), `B` and `C`
    /// (`groups·state`), `dt` (`heads`), the output (`heads·head_dim`).
    pub x_ld: u32,
    pub bc_ld: u32,
    pub dt_ld: u32,
    pub out_ld: u32,
    /// dt is clamped to `[dt_min, dt_max]` after the softplus.
    pub dt_min: f32,
    pub dt_max: f32,
    /// The SSM pool stores bf16 (`cache.ssm_state_dtype = "bfloat16"`): the kernels read and
    /// write it as bf16 and keep every update in f32, so the state is rounded once per step
    /// (and at each snapshot), never inside a step.
    pub state_bf16: bool,
    /// `x`, `B` and `C` start on 16-byte boundaries. The tensor-core kernels read them with
    /// 16-byte vector loads, so they are only picked when this holds (as it does for separate
    /// arena tensors; column ranges of a wider matrix need not).
    pub aligned16: bool,
    /// Heads one `ssd_scan_group_mma` CTA walks (a tuning knob; 0: the planner's choice, see
    /// `group_scan_heads`; clamped to the heads of a group).
    pub group_scan_heads: u32,
}

impl ScanDims {
    /// Contiguous tensors; `layer`, `layers`, `slots` zero and dt unclamped (set them).
    pub fn packed(heads: u32, head_dim: u32, groups: u32, state: u32) -> Self {
        Self {
            heads,
            head_dim,
            groups,
            state,
            layer: 0,
            layers: 0,
            slots: 0,
            x_ld: heads * head_dim,
            bc_ld: groups * state,
            dt_ld: heads,
            out_ld: heads * head_dim,
            dt_min: 0.0,
            dt_max: f32::INFINITY,
            state_bf16: false,
            aligned16: true,
            group_scan_heads: 0,
        }
    }

    fn check(&self) -> Result<(), SsmError> {
        let ok = self.heads > 0
            && self.groups > 0
            && self.heads.is_multiple_of(self.groups)
            && self.head_dim > 0
            && self.state > 0;
        if ok {
            Ok(())
        } else {
            Err(SsmError::Shape {
                heads: self.heads,
                groups: self.groups,
                head_dim: self.head_dim,
                state: self.state,
            })
        }
    }

    /// The tensor-core kernels' `(P, N)` suffix, when they fit this shape.
    fn mma(&self, bf16: bool) -> Option<&'static str> {
        if !bf16
            || !self.aligned16
            || self.head_dim != 64
            || !self.x_ld.is_multiple_of(8)
            || !self.bc_ld.is_multiple_of(8)
            || !self.out_ld.is_multiple_of(8)
        {
            return None;
        }
        match self.state {
            64 => Some("p64n64"),
            128 => Some("p64n128"),
            _ => None,
        }
    }
}

fn suffix(bf16: bool) -> &'static str {
    if bf16 { "bf16" } else { "f32" }
}

/// The entry-name suffix of kernels that touch the SSM pool, by its storage type.
fn state_suffix(bf16: bool) -> &'static str {
    if bf16 { "_sbf16" } else { "" }
}

/// `entry` as a `&'static str` from the table (names are built from parts).
fn entry_name(name: &str) -> &'static str {
    ENTRIES
        .iter()
        .find(|e| e.name == name)
        .map_or("", |e| e.name)
}

fn grid(blocks: u64) -> Result<(u32, u32, u32), SsmError> {
    if blocks == 0 || blocks > MAX_GRID_X {
        return Err(SsmError::Grid(blocks));
    }
    Ok((blocks as u32, 1, 1))
}

/// The slot ops: one launch per wave (more only past 65535 ops). `ssm_slot_ops_v4` when both
/// per-slot counts are multiples of 4 (the pools must then be 16-byte aligned).
pub fn launches_slot_ops(plan: &SsmPlan, pools: PoolDims) -> Vec<Launch<SsmArg>> {
    use SsmArg::*;
    let v4 = pools.conv_per_slot.is_multiple_of(4) && pools.ssm_per_slot.is_multiple_of(4);
    let units = (pools.conv_per_slot + pools.ssm_per_slot) / if v4 { 4 } else { 1 };
    let bx = units
        .div_ceil(u64::from(OPS_THREADS) * 4)
        .clamp(1, MAX_OPS_BLOCKS) as u32;
    let entry = if v4 {
        "ssm_slot_ops_v4"
    } else {
        "ssm_slot_ops"
    };
    let mut out = Vec::new();
    if units == 0 {
        return out;
    }
    for &(start, end) in &plan.waves {
        let mut base = start;
        while base < end {
            let count = (end - base).min(MAX_GRID_Y);
            out.push(Launch {
                entry,
                grid: (bx, count as u32, 1),
                block: (OPS_THREADS, 1, 1),
                smem: 0,
                args: vec![
                    ConvPool,
                    SsmPool,
                    Work(WorkCol::OpFrom),
                    Work(WorkCol::OpTo),
                    U32(base as u32),
                    U32(pools.slots),
                    U64(pools.conv_per_slot),
                    U64(pools.ssm_per_slot),
                ],
            });
            base += count;
        }
    }
    out
}

/// One conv layer: `ssm_conv_chunks` over the prompt chunks, then `ssm_conv_update` over
/// every entry (it replaces the live states the first launch reads).
pub fn launches_conv(
    plan: &SsmPlan,
    dims: ConvDims,
    bf16: bool,
) -> Result<Vec<Launch<SsmArg>>, SsmError> {
    use SsmArg::*;
    if !(2..=MAX_CONV_KERNEL).contains(&dims.kernel) || dims.channels == 0 {
        return Err(SsmError::Conv {
            kernel: dims.kernel,
            channels: dims.channels,
        });
    }
    let ch_blocks = dims.channels.div_ceil(CONV_THREADS);
    let shape = [
        U32(dims.channels),
        U32(dims.kernel),
        U32(dims.x_ld),
        U32(dims.out_ld),
        U32(dims.layer),
        U32(dims.layers),
        U32(dims.slots),
        U32(ch_blocks),
    ];
    let mut out = Vec::new();
    if plan.chunks() > 0 {
        let row_blocks = plan.chunk_size.div_ceil(CONV_ROWS);
        let blocks = plan.chunks() as u64 * u64::from(row_blocks) * u64::from(ch_blocks);
        let mut args = vec![X, Weight, Bias, Out, ConvPool];
        args.extend(
            [
                WorkCol::SeqTok,
                WorkCol::SeqSlot,
                WorkCol::CkTok,
                WorkCol::CkLen,
                WorkCol::CkSeq,
                WorkCol::CkSnap,
                WorkCol::CkSnaps,
                WorkCol::SnapSlot,
            ]
            .map(Work),
        );
        args.extend(shape);
        args.push(U32(row_blocks));
        out.push(Launch {
            entry: entry_name(&format!("ssm_conv_chunks_{}", suffix(bf16))),
            grid: grid(blocks)?,
            block: (CONV_THREADS, 1, 1),
            smem: 0,
            args,
        });
    }
    if plan.seqs() > 0 {
        // conv_update takes `conv_update_channels` channels a thread.
        let ch_blocks = dims
            .channels
            .div_ceil(CONV_THREADS * conv_update_channels(dims.kernel, dims.channels));
        let mut shape = shape;
        shape[7] = U32(ch_blocks);
        let blocks = plan.seqs() as u64 * u64::from(ch_blocks);
        let mut args = vec![X, Weight, Bias, Out, ConvPool];
        args.extend(
            [
                WorkCol::SeqTok,
                WorkCol::SeqLen,
                WorkCol::SeqSlot,
                WorkCol::SeqSnap,
                WorkCol::SeqSnaps,
                WorkCol::SnapSlot,
            ]
            .map(Work),
        );
        args.push(U32(plan.decodes as u32));
        args.extend(shape);
        out.push(Launch {
            entry: entry_name(&format!("ssm_conv_update_{}", suffix(bf16))),
            grid: grid(blocks)?,
            block: (CONV_THREADS, 1, 1),
            smem: 0,
            args,
        });
    }
    Ok(out)
}

/// Channels one `ssm_conv_update` thread takes (`ssm.cu` conv_update_cpt): four when the
/// conv is 4 wide and they divide the channels, else one.
fn conv_update_channels(kernel: u32, channels: u32) -> u32 {
    if kernel == 4 && channels.is_multiple_of(4) {
        4
    } else {
        1
    }
}

/// Bytes of each scratch buffer ([`SsmArg::Scratch`]) of one scan layer (`bf16`: the
/// launches' dtype): dt and the cumulative dA `[tokens, heads]` (f32) each, the chunk states
/// `[chunks, heads, head_dim, state]` (f32; bf16 entering states on the tensor-core path),
/// then the cumulative dA and dt again, chunk-major `[chunks, heads, rec_rows]` (f32,
/// [`rec_rows`]). All zero when the plan has no prompt chunks.
pub fn scratch_bytes(plan: &SsmPlan, dims: ScanDims, bf16: bool) -> Vec<usize> {
    if plan.chunks() == 0 {
        return vec![0; 5];
    }
    let th = plan.tokens as usize * dims.heads as usize * 4;
    let elem = if dims.mma(bf16).is_some() { 2 } else { 4 };
    let states =
        plan.chunks() * dims.heads as usize * dims.head_dim as usize * dims.state as usize * elem;
    let recs = plan.chunks() * dims.heads as usize * rec_rows(plan) as usize * 4;
    vec![th, th, states, recs, recs]
}

/// Rows of a (chunk, head) record of the chunk-major dA and dt copies: the plan's chunk size,
/// rounded up to 16-byte pieces.
pub fn rec_rows(plan: &SsmPlan) -> u32 {
    plan.chunk_size.next_multiple_of(4)
}

/// One scan layer: `ssm_decode` over the decodes, then the SSD pipeline over the prompt
/// chunks (`ssd_dt`, then `launches_ssd_mma` or `launches_ssd_simt`), in this order.
pub fn launches_scan(
    plan: &SsmPlan,
    dims: ScanDims,
    bf16: bool,
) -> Result<Vec<Launch<SsmArg>>, SsmError> {
    use SsmArg::*;
    dims.check()?;
    let ty = suffix(bf16);
    let heads = u64::from(dims.heads);
    let mut out = Vec::new();
    if plan.decodes > 0 {
        // Small CTAs: a slice of the head's rows, DEC_VECS 16-byte state vectors a thread.
        let vec = if dims.state_bf16 { 8 } else { 4 };
        let slice_rows = (DEC_THREADS * DEC_VECS * vec / dims.state).clamp(1, dims.head_dim);
        let slices = dims.head_dim.div_ceil(slice_rows);
        let mut args = vec![X, B, C, Dt, ALog, D, DtBias, Out, SsmPool];
        args.extend(
            [
                WorkCol::SeqTok,
                WorkCol::SeqSlot,
                WorkCol::SeqSnap,
                WorkCol::SeqSnaps,
                WorkCol::SnapSlot,
            ]
            .map(Work),
        );
        args.extend([
            U32(dims.heads),
            U32(dims.head_dim),
            U32(dims.groups),
            U32(dims.state),
            U32(dims.x_ld),
            U32(dims.bc_ld),
            U32(dims.dt_ld),
            U32(dims.out_ld),
            U32(dims.layer),
            U32(dims.layers),
            U32(dims.slots),
            U32(slice_rows),
            F32(dims.dt_min),
            F32(dims.dt_max),
        ]);
        out.push(Launch {
            entry: entry_name(&format!("ssm_decode_{ty}{}", state_suffix(dims.state_bf16))),
            grid: grid(plan.decodes as u64 * heads * u64::from(slices))?,
            block: (DEC_THREADS, 1, 1),
            smem: 0,
            args,
        });
    }
    if plan.chunks() == 0 {
        return Ok(out);
    }
    let chunks = plan.chunks() as u64;
    let head_blocks = dims.heads.div_ceil(DT_HEADS);
    let mut dt_args = vec![
        Dt,
        DtBias,
        ALog,
        Scratch(0),
        Scratch(1),
        Scratch(3),
        Scratch(4),
        Work(WorkCol::CkTok),
        Work(WorkCol::CkLen),
    ];
    dt_args.extend([
        U32(dims.heads),
        U32(dims.dt_ld),
        U32(head_blocks),
        U32(rec_rows(plan)),
        F32(dims.dt_min),
        F32(dims.dt_max),
    ]);
    out.push(Launch {
        entry: entry_name(&format!("ssd_dt_{ty}")),
        grid: grid(chunks * u64::from(head_blocks))?,
        block: (DT_THREADS, 1, 1),
        smem: 0,
        args: dt_args,
    });

    let shape = [
        U32(dims.heads),
        U32(dims.head_dim),
        U32(dims.groups),
        U32(dims.state),
        U32(dims.x_ld),
        U32(dims.bc_ld),
    ];
    match dims.mma(bf16) {
        Some(pn) => launches_ssd_mma(plan, dims, pn, &mut out)?,
        None => launches_ssd_simt(plan, dims, ty, shape, &mut out)?,
    }
    Ok(out)
}

/// The work columns of the state-passing kernels (`ssd_pass`, `ssd_chunk_pass_mma`), in their
/// parameter order.
const PASS_COLS: [WorkCol; 8] = [
    WorkCol::SeqSlot,
    WorkCol::SeqChunk,
    WorkCol::SeqChunks,
    WorkCol::CkTok,
    WorkCol::CkLen,
    WorkCol::CkSnap,
    WorkCol::CkSnaps,
    WorkCol::SnapSlot,
];

/// The chunk scans' leading arguments: x, B, C, D, dt and dA (scratch buffers `dt`, `da`),
/// the entering states, the output and the chunk columns.
fn scan_args(dt: usize, da: usize) -> Vec<SsmArg> {
    use SsmArg::*;
    vec![
        X,
        B,
        C,
        D,
        Scratch(dt),
        Scratch(da),
        Scratch(2),
        Out,
        Work(WorkCol::CkTok),
        Work(WorkCol::CkLen),
    ]
}

/// The SSD pipeline's tensor-core kernels after `ssd_dt`: `ssd_chunk_pass_mma` (chunk
/// states and state passing; bf16 entering states into scratch 2), then the chunk scan:
/// `ssd_scan_group_mma` (scores once per group) for chunks of at most 128 tokens, else
/// `ssd_scan_mma`.
fn launches_ssd_mma(
    plan: &SsmPlan,
    dims: ScanDims,
    pn: &'static str,
    out: &mut Vec<Launch<SsmArg>>,
) -> Result<(), SsmError> {
    use SsmArg::*;
    let (p, n) = (dims.head_dim, dims.state);
    let (chunks, heads) = (plan.chunks() as u64, u64::from(dims.heads));
    let mut args = vec![X, B, Scratch(4), Scratch(3), Scratch(2), SsmPool];
    args.extend(PASS_COLS.map(Work));
    args.extend([
        U32(plan.decodes as u32),
        U32(dims.heads),
        U32(dims.groups),
        U32(dims.x_ld),
        U32(dims.bc_ld),
        U32(dims.layer),
        U32(dims.layers),
        U32(dims.slots),
        U32(rec_rows(plan)),
    ]);
    out.push(Launch {
        entry: entry_name(&format!(
            "ssd_chunk_pass_mma_{pn}_bf16{}",
            state_suffix(dims.state_bf16)
        )),
        grid: grid(plan.prompts() as u64 * heads * u64::from(CHUNK_PASS_SPLIT))?,
        block: (SCAN_THREADS, 1, 1),
        smem: chunk_pass_smem_bytes(p, n),
        args,
    });

    let group = plan.chunk_size <= SCAN_ROWS;
    // The group scan reads dt and dA chunk-major (scratch 4, 3), the per-head one token-major.
    let mut args = if group {
        scan_args(4, 3)
    } else {
        scan_args(0, 1)
    };
    if group {
        let per_group = dims.heads / dims.groups;
        let head_block = match dims.group_scan_heads {
            0 => group_scan_heads(plan.scan_chunks as u64 * u64::from(dims.groups), per_group),
            k => k.min(per_group),
        };
        let head_blocks = per_group.div_ceil(head_block);
        args.extend([
            U32(dims.heads),
            U32(dims.groups),
            U32(dims.x_ld),
            U32(dims.bc_ld),
            U32(dims.out_ld),
            U32(head_block),
            U32(head_blocks),
            U32(rec_rows(plan)),
        ]);
        out.push(Launch {
            entry: entry_name(&format!("ssd_scan_group_mma_{pn}_bf16")),
            grid: grid(chunks * u64::from(dims.groups) * u64::from(head_blocks))?,
            block: (SCAN_THREADS, 1, 1),
            smem: group_scan_smem_bytes(p, n),
            args,
        });
    } else {
        let l_blocks = plan.chunk_size.div_ceil(SCAN_ROWS);
        args.extend([
            U32(dims.heads),
            U32(dims.head_dim),
            U32(dims.groups),
            U32(dims.state),
            U32(dims.x_ld),
            U32(dims.bc_ld),
            U32(dims.out_ld),
            U32(l_blocks),
            U32(1),
        ]);
        out.push(Launch {
            entry: entry_name(&format!("ssd_scan_mma_{pn}_bf16")),
            grid: grid(chunks * heads * u64::from(l_blocks))?,
            block: (SCAN_THREADS, 1, 1),
            smem: scan_smem_bytes(p, n),
            args,
        });
    }
    Ok(())
}

/// Heads one `ssd_scan_group_mma` CTA walks: all of its group's (the score tiles are then
/// computed once per (chunk, group)), halved while the grid of `chunk_groups` (chunk, group)
/// pairs has fewer than [`GROUP_SCAN_CTAS`] CTAs (short prompts would leave SMs idle).
fn group_scan_heads(chunk_groups: u64, per_group: u32) -> u32 {
    let mut block = per_group.max(1);
    while block > 1 && chunk_groups * u64::from(per_group.div_ceil(block)) < GROUP_SCAN_CTAS {
        block = block.div_ceil(2);
    }
    block
}

/// The SSD pipeline's SIMT kernels after `ssd_dt` (f32, and bf16 shapes the tensor-core
/// kernels do not take): `ssd_states_simt` (f32 chunk states into scratch 2), `ssd_pass`
/// (replaces them in place by the entering states) and `ssd_scan_simt`.
fn launches_ssd_simt(
    plan: &SsmPlan,
    dims: ScanDims,
    ty: &str,
    shape: [SsmArg; 6],
    out: &mut Vec<Launch<SsmArg>>,
) -> Result<(), SsmError> {
    use SsmArg::*;
    let (p, n) = (dims.head_dim, dims.state);
    let (chunks, heads) = (plan.chunks() as u64, u64::from(dims.heads));
    let (p_tiles, n_tiles) = (p.div_ceil(SIMT_TM), n.div_ceil(SIMT_TN));
    let mut args = vec![
        X,
        B,
        Scratch(0),
        Scratch(1),
        Scratch(2),
        Work(WorkCol::CkTok),
        Work(WorkCol::CkLen),
    ];
    args.extend(shape);
    args.extend([U32(p_tiles), U32(n_tiles)]);
    out.push(Launch {
        entry: entry_name(&format!("ssd_states_simt_{ty}")),
        grid: grid(chunks * heads * u64::from(p_tiles) * u64::from(n_tiles))?,
        block: (SIMT_THREADS, 1, 1),
        smem: 0,
        args,
    });

    let pn = p * n;
    let pass_tiles = pn.div_ceil(PASS_THREADS * PASS_PER);
    let mut args = vec![Scratch(2), Scratch(1), SsmPool];
    args.extend(PASS_COLS.map(Work));
    args.extend([
        U32(plan.decodes as u32),
        U32(dims.heads),
        U32(pn),
        U32(dims.layer),
        U32(dims.layers),
        U32(dims.slots),
        U32(pass_tiles),
    ]);
    out.push(Launch {
        entry: entry_name(&format!("ssd_pass{}", state_suffix(dims.state_bf16))),
        grid: grid(plan.prompts() as u64 * heads * u64::from(pass_tiles))?,
        block: (PASS_THREADS, 1, 1),
        smem: 0,
        args,
    });

    let (l_tiles, p_tiles) = (plan.chunk_size.div_ceil(SIMT_TM), p.div_ceil(SIMT_TN));
    let mut args = scan_args(0, 1);
    args.extend(shape);
    args.extend([U32(dims.out_ld), U32(l_tiles), U32(p_tiles)]);
    out.push(Launch {
        entry: entry_name(&format!("ssd_scan_simt_{ty}")),
        grid: grid(chunks * heads * u64::from(l_tiles) * u64::from(p_tiles))?,
        block: (SIMT_THREADS, 1, 1),
        smem: 0,
        args,
    });
    Ok(())
}

/// Dynamic shared memory of `ssd_scan_mma` for head dim `p` and state `n` (`ssm.cu`
/// ScanLayout): C rows, B rows and x rows of a 128-token tile and h_c, each bf16 row padded
/// by 8 elements, then three f32 arrays of decays.
fn scan_smem_bytes(p: u32, n: u32) -> u32 {
    let (ldn, ldp) = (n + 8, p + 8);
    (SCAN_ROWS * ldn + p * ldn + SCAN_ROWS * ldn + SCAN_ROWS * ldp) * 2 + 3 * SCAN_ROWS * 4
}

/// Dynamic shared memory of `ssd_chunk_pass_mma` (`ssm.cu` ChunkPassLayout): three tile
/// stages of x rows and the CTA's half of the B rows (bf16, rows padded by 8 elements), each
/// stage's f32 A_s, dt_s and A_end (padded to 4), the f32 weights of one tile, then each
/// stage's tile record (8 words).
fn chunk_pass_smem_bytes(p: u32, n: u32) -> u32 {
    const STAGES: u32 = 3;
    let stage = SCAN_ROWS * (p + 8) + SCAN_ROWS * (n / CHUNK_PASS_SPLIT + 8);
    STAGES * stage * 2 + (STAGES * (2 * SCAN_ROWS + 4) + SCAN_ROWS + STAGES * 8) * 4
}

/// Dynamic shared memory of `ssd_scan_group_mma` (`ssm.cu` GroupScanLayout): the C rows,
/// two head stages (x rows, h_c, f32 A_s and dt_s; B rows borrow the second), the 36
/// lower-triangle 16×16 score tiles in f32, then one head's decayed scores in bf16.
fn group_scan_smem_bytes(p: u32, n: u32) -> u32 {
    const STAGES: u32 = 2;
    let tiles = (SCAN_ROWS / 16) * (SCAN_ROWS / 16 + 1) / 2;
    let stage = SCAN_ROWS * (p + 8) + p * (n + 8) + 2 * SCAN_ROWS * 2;
    (SCAN_ROWS * (n + 8) + STAGES * stage) * 2 + tiles * 256 * 4 + tiles * 256 * 2
}

/// Kernels that launch with more than the default 48 KiB of dynamic shared memory, and how
/// much they need (the device raises their limit once at load).
pub fn smem_opt_in() -> impl Iterator<Item = (&'static str, u32)> {
    [64, 128]
        .into_iter()
        .flat_map(|n| {
            [
                (format!("ssd_scan_mma_p64n{n}_bf16"), scan_smem_bytes(64, n)),
                (
                    format!("ssd_scan_group_mma_p64n{n}_bf16"),
                    group_scan_smem_bytes(64, n),
                ),
                (
                    format!("ssd_chunk_pass_mma_p64n{n}_bf16"),
                    chunk_pass_smem_bytes(64, n),
                ),
                (
                    format!("ssd_chunk_pass_mma_p64n{n}_bf16_sbf16"),
                    chunk_pass_smem_bytes(64, n),
                ),
            ]
        })
        .filter(|(_, bytes)| *bytes > crate::attention::DEFAULT_SMEM_LIMIT)
        .map(|(name, bytes)| (entry_name(&name), bytes))
}

#[cfg(test)]
mod tests;
