//! The step's SSM work columns ([`SsmPlan`]): built once per step by [`plan`] from the
//! step's chunk layout, live slots, snapshot targets and slot ops, padded to fixed
//! capacities for CUDA graphs ([`SsmPlan::pad_to`]); every stage's launches read them (the
//! column layout and the invariants: the module docs of `ssm`). Knows nothing of kernels.

use super::SsmError;

/// `OpFrom` of a slot op that zeroes its destination.
pub const ZERO_OP: u32 = u32::MAX;
/// Largest chunk the plan cuts (a larger `chunk_size` is clamped; results are the same up to
/// rounding).
pub const MAX_CHUNK: u32 = 256;

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

/// The step's work columns. Built by [`plan`]; reused across steps without allocating once
/// its buffers have grown to the step sizes seen.
#[derive(Debug, Clone, Default)]
pub struct SsmPlan {
    pub(super) cols: [Vec<u32>; 15],
    pub(super) decodes: usize,
    pub(super) chunk_size: u32,
    pub(super) tokens: u32,
    /// SSD chunks the group scan's CTA shape is chosen for: the plan's own, or for a padded
    /// plan those of its token rows in one prompt (most of its chunks are padding).
    pub(super) scan_chunks: usize,
    /// Tokens of the longest prompt entry (`u32::MAX` once padded: [`super::recurrent_prompts`]).
    pub(super) longest_prompt: u32,
    pub(super) waves: Vec<(usize, usize)>,
    // Planning scratch (kept for reuse).
    pub(super) order: Vec<(u32, u32, u32)>,
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
    out.longest_prompt = 0;
    for s in (0..n).filter(|&s| len(s) > 1) {
        let (tok, l) = (cu[s], len(s));
        out.longest_prompt = out.longest_prompt.max(l);
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
        self.longest_prompt = u32::MAX;
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
