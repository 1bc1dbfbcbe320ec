//! The CUDA step object: every column of a [`StepPlan`] that kernels read, packed into one
//! pinned staging buffer and copied to one device buffer with a single host-to-device copy.
//!
//! Columns are u32 words (f32 columns as their bits) at fixed offsets recorded in
//! [`Columns`]; the device buffer only grows (a step larger than any before), so after warm-up
//! a step costs one `cuMemcpyHtoDAsync` and no allocation.

use std::sync::Arc;

use chimera_kernels::attention::{AttnPlan, WorkCol};
use chimera_kernels::ssm::{self, SsmPlan};

use super::device::Device;
use super::memory::{DevAlloc, MemStats, Pinned, htod};
use crate::backend::{Result, StepPlan};

/// Word offsets of each column in the step buffer.
#[derive(Debug, Clone, Default)]
pub struct Columns {
    pub tokens: usize,
    pub positions: usize,
    pub slot_mapping: usize,
    pub cu_seqlens: usize,
    pub ctx_lens: usize,
    pub bt_offsets: usize,
    pub block_tables: usize,
    pub logit_rows: usize,
    pub sample_rows: usize,
    pub repetition: usize,
    pub presence: usize,
    pub frequency: usize,
    pub want_lse: usize,
    pub hist_offsets: usize,
    pub hist_tokens: usize,
    pub hist_counts: usize,
    pub hist_bias: usize,
    /// Token masks of constrained rows (`SampleRows::mask_of`, `SampleRows::masks`).
    pub mask_of: usize,
    pub masks: usize,
    /// The attention planner's work columns, in [`WorkCol::ALL`] order.
    pub attn: [usize; WorkCol::ALL.len()],
    /// The SSM planner's work columns, in [`ssm::WorkCol::ALL`] order.
    pub ssm: [usize; ssm::WorkCol::ALL.len()],
}

/// Host-side facts about the uploaded step that launches need (sizes, not data).
#[derive(Debug, Clone, Default)]
pub struct StepDims {
    pub tokens: usize,
    pub seqs: usize,
    pub block_size: usize,
    pub logit_rows: usize,
    pub sample_rows: usize,
    pub k: usize,
    /// Some sampled row has a token mask: the tail launches the mask kernel first.
    pub masks: bool,
    /// Words of the mask column (`SampleRows::masks`), which [`CudaStep::copy_masks`] rewrites.
    pub mask_words: usize,
}

pub struct CudaStep {
    pub(super) cols: Columns,
    pub(super) dims: StepDims,
    pub(super) attn: AttnPlan,
    pub(super) ssm: SsmPlan,
    /// The SSD chunk size the scan chunks are cut with (0: the model has no SSM layers).
    pub(super) ssm_chunk: u32,
    ctx_lens: Vec<u32>,
    seq_slots: Vec<u32>,
    snaps: Vec<ssm::Snapshot>,
    ops: Vec<ssm::SlotOp>,
    staging: Vec<u32>,
    pinned: Option<Pinned>,
    buf: Option<DevAlloc>,
    /// Set by a successful upload; kernels refuse a step that was never uploaded.
    pub(super) uploaded: bool,
    /// A captured graph holds this step's device addresses: its buffer must not move.
    pub(super) frozen: bool,
    pad_tables: Vec<u32>,
    pad_cu: Vec<u32>,
}

/// The padded, fixed layout of a decode step replayed by a CUDA graph: `bucket` one-token
/// chunks (the real ones first, then padding rows on the PAD slot), every column the graph
/// reads at an offset that depends only on the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphShape {
    pub bucket: usize,
    /// Split-KV pieces per decode ([`chimera_kernels::attention::plan_decode_fixed`]).
    pub splits: u32,
    /// Block-table words the step can hold (the padding rows' one block included).
    pub table_cap: usize,
}

/// Padding rows' KV slot: the KV writes skip it.
const PAD: u32 = u32::MAX;

impl GraphShape {
    /// Split-KV pieces for `bucket` decodes: enough CTAs to fill the GPU several times over
    /// (64 decodes unsplit are one wave and a bit of the decode kernel, the second wave
    /// mostly idle), as the eager planner's `TARGET_PIECES` does.
    pub fn splits_for(bucket: usize) -> u32 {
        if bucket >= 128 {
            return 1;
        }
        (256 / bucket.max(1)).clamp(1, 64) as u32
    }

    /// Most snapshot targets a graph step takes (a decode crosses one block boundary).
    fn snap_cap(&self) -> usize {
        self.bucket
    }
}

/// The padded, fixed layout of a step with prefill chunks replayed by a CUDA graph: at most
/// `tokens` tokens in at most `decodes` one-token chunks and `prompts` longer ones. The real
/// chunks come first, then chunks of no tokens, on `tokens` token rows; a step with fewer
/// decodes than the shape needs one padding row at least, for the SSM plan's padding
/// decodes ([`ssm::SsmPlan::pad_to`]). Every column the graph reads has a capacity fixed by
/// the shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedShape {
    pub tokens: usize,
    pub decodes: usize,
    pub prompts: usize,
    /// Block-table words the step can hold (the padding chunks' one word included).
    pub table_cap: usize,
}

impl MixedShape {
    /// Token rows of the layout.
    pub fn rows(&self) -> usize {
        self.tokens
    }

    /// Chunks of the layout (and logit rows: one a chunk at most).
    pub fn chunks(&self) -> usize {
        self.decodes + self.prompts
    }

    /// Attention query tiles of the longer chunks: a chunk of `l` tokens takes
    /// `ceil(l / Q_TILE)` (one when `l` ≤ 16), so `tokens / Q_TILE + prompts` bound them.
    fn attn_tiles(&self) -> usize {
        self.tokens
            .div_ceil(chimera_kernels::attention::Q_TILE as usize)
            + self.prompts
    }

    /// Snapshot targets: one a decode (it crosses one block boundary), four a prompt chunk
    /// (the cache manager's snapshot points).
    fn snapshots(&self) -> usize {
        self.decodes + 4 * self.prompts
    }

    /// SSD chunks of `chunk` tokens: each prompt chunk's last piece and a cut at a snapshot
    /// inside it add two to `tokens / chunk` (a step with more cuts takes a larger bucket or
    /// runs eagerly). Every padding chunk is a CTA row of the SSD kernels that returns at once,
    /// so the capacity is kept tight.
    fn ssd_chunks(&self, chunk: u32) -> usize {
        self.tokens.div_ceil(chunk.max(1) as usize) + 2 * self.prompts
    }
}

/// The smallest buffers an eager step object has: most steps' packed columns fit.
pub(crate) const MIN_STEP_BYTES: usize = 64 << 10;

impl CudaStep {
    pub fn new() -> Self {
        Self {
            cols: Columns::default(),
            dims: StepDims::default(),
            attn: AttnPlan::default(),
            ssm: SsmPlan::default(),
            ssm_chunk: 0,
            ctx_lens: Vec::new(),
            seq_slots: Vec::new(),
            snaps: Vec::new(),
            ops: Vec::new(),
            staging: Vec::new(),
            pinned: None,
            buf: None,
            uploaded: false,
            frozen: false,
            pad_tables: Vec::new(),
            pad_cu: Vec::new(),
        }
    }

    /// Device address of the SSM work column `c`.
    pub fn ssm_col(&self, c: ssm::WorkCol) -> u64 {
        let i = ssm::WorkCol::ALL.iter().position(|x| *x == c).unwrap_or(0);
        self.col(self.cols.ssm[i])
    }

    /// Device address of the attention work column `c`.
    pub fn attn_col(&self, c: WorkCol) -> u64 {
        let i = WorkCol::ALL.iter().position(|x| *x == c).unwrap_or(0);
        self.col(self.cols.attn[i])
    }

    /// Device address of the column at word offset `off`.
    pub fn col(&self, off: usize) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr) + 4 * off as u64
    }

    fn push(staging: &mut Vec<u32>, words: impl IntoIterator<Item = u32>) -> usize {
        let at = staging.len();
        staging.extend(words);
        // Keep every column 16-byte aligned for vector loads.
        while !staging.len().is_multiple_of(4) {
            staging.push(0);
        }
        at
    }

    /// The sampling tail's columns: its rows, penalties and token histories.
    fn push_sampling_columns(s: &mut Vec<u32>, c: &mut Columns, plan: &StepPlan) {
        c.sample_rows = Self::push(s, plan.sample_rows.iter().copied());
        let r = &plan.sampling;
        c.repetition = Self::push(s, r.repetition.iter().map(|v| v.to_bits()));
        c.presence = Self::push(s, r.presence.iter().map(|v| v.to_bits()));
        c.frequency = Self::push(s, r.frequency.iter().map(|v| v.to_bits()));
        c.want_lse = Self::push(s, r.want_lse.iter().map(|&w| u32::from(w)));
        c.hist_offsets = Self::push(s, r.hist_offsets.iter().copied());
        c.hist_tokens = Self::push(s, r.hist_tokens.iter().copied());
        c.hist_counts = Self::push(s, r.hist_counts.iter().copied());
        c.hist_bias = Self::push(s, r.hist_bias.iter().map(|v| v.to_bits()));
        c.mask_of = Self::push(s, r.mask_of.iter().copied());
        c.masks = Self::push(s, r.masks.iter().copied());
    }

    /// As [`Self::push`], padded with zeros to `cap` words (a fixed layout); `None` when the
    /// column is longer.
    fn push_cap(
        staging: &mut Vec<u32>,
        words: impl IntoIterator<Item = u32>,
        cap: usize,
    ) -> Option<usize> {
        let at = staging.len();
        staging.extend(words);
        if staging.len() - at > cap {
            return None;
        }
        staging.resize(at + cap, 0);
        Self::push(staging, []);
        Some(at)
    }

    /// Packs a decode-only `plan` padded to `g.bucket` chunks in the graph layout, for
    /// [`Self::copy`]. `Ok(false)` (nothing packed) when the plan does not fit the graph: a
    /// chunk that is not one decode token, prompt logprobs, slot operations, more chunks,
    /// block-table words or snapshots than the shape holds, or (once frozen) a buffer too small.
    ///
    /// The block tables are the last fixed column, with room for `g.table_cap` words, but only
    /// the words in use are packed and copied: the graph reads no table word past them (each
    /// chunk's table and the padding rows' one word), so the sampling columns, which run
    /// outside the graph, follow right after them. A batch of 256 would otherwise pack and
    /// copy the whole capacity (half a MiB at 8192 positions) every step.
    pub(crate) fn pack_graph(
        &mut self,
        device: &Arc<Device>,
        stats: &MemStats,
        plan: &StepPlan,
        g: GraphShape,
    ) -> Result<bool> {
        self.uploaded = false;
        let n = plan.seqs.len();
        let fits = n <= g.bucket
            && plan
                .seqs
                .iter()
                .all(|q| q.len == 1 && !q.all_logits && q.want_logits)
            && plan.slot_ops.is_empty()
            && plan.block_tables.len() < g.table_cap
            && plan.snapshots.len() <= g.snap_cap();
        if !fits {
            return Ok(false);
        }
        // Padding rows read one key from a real block (the first of the tables, else 0) and
        // write nothing.
        let pad_at = plan.block_tables.len() as u32;
        if !self.plan_graph_attention(plan, g) {
            return Ok(false);
        }
        if self.ssm_chunk > 0 {
            self.plan_graph_ssm(plan, g)?;
        } else {
            self.ssm = SsmPlan::default();
        }
        if self.push_graph_columns(plan, g, pad_at).is_none() {
            return Ok(false);
        }
        self.cols.block_tables = Self::push(&mut self.staging, self.pad_tables.iter().copied());
        let b = g.bucket;
        self.finish_graph_layout(device, stats, plan, (b, b), g.table_cap)
    }

    /// A decode graph's padded block tables, sequence offsets and context lengths, and its
    /// attention plan; `false` when the plan does not fit the shape.
    fn plan_graph_attention(&mut self, plan: &StepPlan, g: GraphShape) -> bool {
        self.pad_tables_and_ctx_lens(plan, g.bucket);
        self.pad_cu.clear();
        self.pad_cu.extend(0..=g.bucket as u32);
        chimera_kernels::attention::plan_decode_fixed(
            &self.pad_cu,
            &self.ctx_lens,
            g.splits,
            &mut self.attn,
        )
    }

    /// A graph layout's block tables (the plan's, then the padding chunks' one word: the
    /// first of the tables, else 0) and its context lengths, padded with zeros to `chunks`.
    fn pad_tables_and_ctx_lens(&mut self, plan: &StepPlan, chunks: usize) {
        self.pad_tables.clear();
        self.pad_tables.extend_from_slice(&plan.block_tables);
        self.pad_tables
            .push(plan.block_tables.first().copied().unwrap_or(0));
        self.ctx_lens.clear();
        self.ctx_lens
            .extend(plan.seqs.iter().map(|q| q.context_len as u32));
        self.ctx_lens.resize(chunks, 0);
    }

    /// A decode graph's SSM plan: each row's slot (padding rows on the PAD slot) and the
    /// step's snapshot targets, no slot operations.
    fn plan_graph_ssm(&mut self, plan: &StepPlan, g: GraphShape) -> Result<()> {
        self.slots_and_snapshots(plan);
        self.seq_slots.resize(g.bucket, PAD);
        self.ops.clear();
        ssm::plan(
            ssm::SsmStepInputs {
                cu_seqlens: &self.pad_cu,
                slots: &self.seq_slots,
                snapshots: &self.snaps,
                slot_ops: &self.ops,
                chunk_size: self.ssm_chunk,
            },
            &mut self.ssm,
        )
        .map_err(|e| crate::backend::BackendError::Invalid(e.to_string()))
    }

    /// The columns a decode graph reads, at offsets fixed by the bucket (padding rows' block
    /// table at word `pad_at`); `None` when one is longer than its room.
    fn push_graph_columns(&mut self, plan: &StepPlan, g: GraphShape, pad_at: u32) -> Option<()> {
        let b = g.bucket;
        self.push_fixed_columns(plan, (b, b), pad_at, 0..b as u32)?;
        let s = &mut self.staging;
        let c = &mut self.cols;
        for (at, col) in c.ssm.iter_mut().zip(ssm::WorkCol::ALL) {
            let words = self.ssm.column(col);
            let cap = if col == ssm::WorkCol::SnapSlot {
                g.snap_cap()
            } else {
                words.len()
            };
            *at = Self::push_cap(s, words.iter().copied(), cap)?;
        }
        Some(())
    }

    /// The fixed columns every graph layout starts with, from an empty staging buffer: the
    /// token columns padded to `rows`, the chunk columns padded to `chunks` (padding chunks'
    /// block table at word `pad_at`), `logit_rows` and the attention plan; `None` when one is
    /// longer than its room. The SSM columns follow, as the layout places them.
    fn push_fixed_columns(
        &mut self,
        plan: &StepPlan,
        (rows, chunks): (usize, usize),
        pad_at: u32,
        logit_rows: impl IntoIterator<Item = u32>,
    ) -> Option<()> {
        let s = &mut self.staging;
        s.clear();
        let c = &mut self.cols;
        let z = |k: usize| std::iter::repeat_n(0u32, k);
        let pad_rows = rows - plan.tokens.len();
        let pad_chunks = chunks - plan.seqs.len();
        c.tokens = Self::push_cap(s, plan.tokens.iter().copied().chain(z(pad_rows)), rows)?;
        c.positions = Self::push_cap(s, plan.positions.iter().copied().chain(z(pad_rows)), rows)?;
        c.slot_mapping = Self::push_cap(
            s,
            plan.slot_mapping
                .iter()
                .copied()
                .chain(std::iter::repeat_n(PAD, pad_rows)),
            rows,
        )?;
        c.cu_seqlens = Self::push_cap(s, self.pad_cu.iter().copied(), chunks + 1)?;
        c.ctx_lens = Self::push_cap(s, self.ctx_lens.iter().copied(), chunks)?;
        c.bt_offsets = Self::push_cap(
            s,
            plan.seqs
                .iter()
                .map(|q| q.blocks.0)
                .chain(std::iter::repeat_n(pad_at, pad_chunks)),
            chunks,
        )?;
        c.logit_rows = Self::push_cap(s, logit_rows, chunks)?;
        for (at, col) in c.attn.iter_mut().zip(WorkCol::ALL) {
            let words = self.attn.column(col);
            *at = Self::push_cap(s, words.iter().copied(), words.len())?;
        }
        Some(())
    }

    /// After a graph layout's fixed columns and block tables (room for `table_cap` words):
    /// the step's dims (`rows` tokens in `chunks` chunks, a logit row each), the columns that
    /// run outside the graph (slot ops before the replay, sampling after it), which may vary,
    /// then the buffers, sized once for the layout and frozen (`Ok(false)` when frozen and too
    /// small).
    fn finish_graph_layout(
        &mut self,
        device: &Arc<Device>,
        stats: &MemStats,
        plan: &StepPlan,
        (rows, chunks): (usize, usize),
        table_cap: usize,
    ) -> Result<bool> {
        // The whole layout: every fixed column at its full capacity.
        let layout_bytes = 4 * (self.cols.block_tables + table_cap);
        self.dims = StepDims {
            tokens: rows,
            seqs: chunks,
            block_size: plan.block_size,
            logit_rows: chunks,
            sample_rows: plan.sample_rows.len(),
            k: plan.sampling.k,
            masks: plan.sampling.has_masks(),
            mask_words: plan.sampling.masks.len(),
        };
        let s = &mut self.staging;
        let c = &mut self.cols;
        for (at, col) in c.ssm.iter_mut().zip(ssm::WorkCol::ALL) {
            if matches!(col, ssm::WorkCol::OpFrom | ssm::WorkCol::OpTo) {
                *at = Self::push(s, self.ssm.column(col).iter().copied());
            }
        }
        Self::push_sampling_columns(s, c, plan);
        let bytes = (4 * s.len()).max(layout_bytes);
        if self.pinned.as_ref().is_none_or(|p| p.bytes < bytes) {
            if self.frozen {
                return Ok(false);
            }
            // Room for the sampling columns of long histories too.
            let cap = (bytes * 2).max(4 << 20);
            self.pinned = Some(Pinned::new(device, cap)?);
            self.buf = Some(DevAlloc::new(device, cap, stats)?);
        }
        // Graphs captured from here on hold this buffer's addresses.
        self.frozen = true;
        Ok(true)
    }

    /// Packs a `plan` with prefill chunks padded to the mixed layout `m`, for
    /// [`Self::copy`]. `Ok(false)` (nothing packed) when the plan does not fit: more tokens,
    /// decodes, prompts, attention tiles, SSD chunks, snapshots or block-table words than
    /// the shape holds, prompt logprobs, or (once frozen) a buffer too small. Slot ops are
    /// planned and packed outside the fixed layout: the caller runs them before the replay.
    pub(crate) fn pack_mixed(
        &mut self,
        device: &Arc<Device>,
        stats: &MemStats,
        plan: &StepPlan,
        m: MixedShape,
    ) -> Result<bool> {
        self.uploaded = false;
        let n = plan.seqs.len();
        let decodes = plan.seqs.iter().filter(|q| q.len == 1).count();
        // Padding decodes write zeros to a padding row.
        let pad_row = usize::from(decodes < m.decodes);
        let fits = plan.tokens.len() + pad_row <= m.tokens
            && decodes <= m.decodes
            && n - decodes <= m.prompts
            && plan.seqs.iter().all(|q| !q.all_logits)
            && plan.logit_rows.len() <= m.chunks()
            && plan.block_tables.len() < m.table_cap
            && plan.snapshots.len() <= m.snapshots();
        if !fits {
            return Ok(false);
        }
        let (rows, chunks) = (m.rows(), m.chunks());
        // Padding chunks hold no tokens and read one table word (the first of the tables).
        let pad_at = plan.block_tables.len() as u32;
        if !self.plan_mixed_attention(plan, m) {
            return Ok(false);
        }
        let caps = ssm::FixedCaps {
            decodes: m.decodes,
            prompts: m.prompts,
            chunks: m.ssd_chunks(self.ssm_chunk),
            snapshots: m.snapshots(),
            rows: rows as u32,
        };
        if self.ssm_chunk > 0 {
            self.plan_ssm(plan)?;
            if !self.ssm.pad_to(caps) {
                return Ok(false);
            }
        } else if !plan.slot_ops.is_empty() {
            self.plan_ssm(plan)?;
        } else {
            self.ssm = SsmPlan::default();
        }
        let ssm_fixed = self.ssm_chunk > 0;
        if self.push_mixed_columns(plan, m, caps, pad_at).is_none() {
            return Ok(false);
        }
        let s = &mut self.staging;
        let c = &mut self.cols;
        c.block_tables = Self::push(s, self.pad_tables.iter().copied());
        if !ssm_fixed {
            // No SSM layers read them: any place outside the fixed columns.
            for (at, col) in c.ssm.iter_mut().zip(ssm::WorkCol::ALL) {
                if !matches!(col, ssm::WorkCol::OpFrom | ssm::WorkCol::OpTo) {
                    *at = Self::push(s, self.ssm.column(col).iter().copied());
                }
            }
        }
        self.finish_graph_layout(device, stats, plan, (rows, chunks), m.table_cap)
    }

    /// A mixed graph's padded block tables, sequence offsets and context lengths, and its
    /// attention plan; `false` when the plan does not fit the shape.
    fn plan_mixed_attention(&mut self, plan: &StepPlan, m: MixedShape) -> bool {
        let (chunks, real) = (m.chunks(), plan.tokens.len());
        self.pad_tables_and_ctx_lens(plan, chunks);
        self.pad_cu.clear();
        self.pad_cu.extend_from_slice(&plan.cu_seqlens);
        self.pad_cu.resize(chunks + 1, real as u32);
        // Decodes split as in a decode graph of as many rows: the decode launch runs before
        // the prefill tiles' and must fill the GPU on its own.
        chimera_kernels::attention::plan_mixed_fixed(
            &self.pad_cu,
            &self.ctx_lens,
            m.decodes,
            m.attn_tiles(),
            GraphShape::splits_for(m.decodes),
            real as u32,
            &mut self.attn,
        )
    }

    /// The columns a mixed graph reads, at offsets fixed by the shape (padding chunks' block
    /// table at word `pad_at`; the SSM columns at `caps` when the model has SSM layers);
    /// `None` when one is longer than its room.
    fn push_mixed_columns(
        &mut self,
        plan: &StepPlan,
        m: MixedShape,
        caps: ssm::FixedCaps,
        pad_at: u32,
    ) -> Option<()> {
        let (rows, chunks) = (m.rows(), m.chunks());
        // Padding logit rows read the last padding row; sampling reads the real ones.
        let logit_rows = plan.logit_rows.iter().copied().chain(std::iter::repeat_n(
            rows as u32 - 1,
            chunks - plan.logit_rows.len(),
        ));
        self.push_fixed_columns(plan, (rows, chunks), pad_at, logit_rows)?;
        let s = &mut self.staging;
        let c = &mut self.cols;
        if self.ssm_chunk > 0 {
            for (at, col) in c.ssm.iter_mut().zip(ssm::WorkCol::ALL) {
                use ssm::WorkCol as W;
                let cap = match col {
                    W::OpFrom | W::OpTo => continue,
                    W::CkTok | W::CkLen | W::CkSeq | W::CkSnap | W::CkSnaps => caps.chunks,
                    W::SnapSlot => caps.snapshots,
                    _ => chunks,
                };
                *at = Self::push_cap(s, self.ssm.column(col).iter().copied(), cap)?;
            }
        }
        Some(())
    }

    /// Copies the packed step to the device buffer through the pinned buffer, on `stream`:
    /// the step's one host-to-device copy (after [`Self::pack`] or [`Self::pack_graph`]).
    pub(crate) fn copy(
        &mut self,
        device: &Arc<Device>,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let bytes = 4 * self.staging.len();
        let (Some(pinned), Some(buf)) = (self.pinned.as_mut(), self.buf.as_ref()) else {
            return Err(crate::backend::BackendError::Invalid(
                "a step copied before it was packed".into(),
            ));
        };
        if bytes > pinned.bytes {
            return Err(crate::backend::BackendError::Invalid(format!(
                "a step of {bytes} bytes copied through a buffer of {}",
                pinned.bytes
            )));
        }
        // The previous step's copy out of this staging buffer finished: every step ends with
        // a synchronising read-back.
        let dst = pinned.as_mut_slice();
        for (d, w) in dst.chunks_exact_mut(4).zip(self.staging.iter()) {
            d.copy_from_slice(&w.to_le_bytes());
        }
        // SAFETY: the device buffer holds at least `bytes`; the pinned source is not touched
        // again before the next step, which starts after this one's synchronisation.
        unsafe { htod(device, stream, buf.ptr, &pinned.as_slice()[..bytes])? };
        self.uploaded = true;
        Ok(())
    }

    /// Writes `plan`'s token masks over the mask column of the uploaded step and copies that
    /// column to the device on `stream`, ordered after the step's upload and its forward pass
    /// (which reads no mask) and before the sampling tail enqueued next.
    pub(crate) fn copy_masks(
        &mut self,
        device: &Arc<Device>,
        stream: cudarc::driver::sys::CUstream,
        plan: &StepPlan,
    ) -> Result<()> {
        let masks = &plan.sampling.masks;
        let (at, n) = (self.cols.masks, masks.len());
        if !self.uploaded || n != self.dims.mask_words || at + n > self.staging.len() {
            return Err(crate::backend::BackendError::Invalid(format!(
                "{n} mask words sent over a step of {} (uploaded: {})",
                self.dims.mask_words, self.uploaded
            )));
        }
        self.staging[at..at + n].copy_from_slice(masks);
        let (Some(pinned), Some(buf)) = (self.pinned.as_mut(), self.buf.as_ref()) else {
            return Err(crate::backend::BackendError::Invalid(
                "masks sent before their step was packed".into(),
            ));
        };
        let bytes = 4 * at..4 * (at + n);
        for (d, w) in pinned.as_mut_slice()[bytes.clone()]
            .chunks_exact_mut(4)
            .zip(masks)
        {
            d.copy_from_slice(&w.to_le_bytes());
        }
        // SAFETY: the device buffer holds the packed step, this range included. The step's
        // own copy may still read the same pinned bytes: it then takes these masks or the
        // placeholders before them, and this copy, ordered after it, writes these either way.
        unsafe {
            htod(
                device,
                stream,
                buf.ptr + bytes.start as u64,
                &pinned.as_slice()[bytes],
            )
        }
    }

    /// Writes `plan`'s tokens over the token column of the packed step (the plan packed last,
    /// whose placeholder tokens are now known): the same number of tokens, at the column's
    /// head, before padding.
    pub(crate) fn repack_tokens(&mut self, plan: &StepPlan) -> Result<()> {
        let at = self.cols.tokens;
        let n = plan.tokens.len();
        if n > self.dims.tokens || at + n > self.staging.len() {
            return Err(crate::backend::BackendError::Invalid(format!(
                "{n} tokens written over a packed step of {}",
                self.dims.tokens
            )));
        }
        self.staging[at..at + n].copy_from_slice(&plan.tokens);
        self.uploaded = false;
        Ok(())
    }

    /// Gives the step buffers of at least `bytes` now (none yet, or smaller), so that its
    /// first steps need no driver allocation.
    pub(crate) fn reserve(
        &mut self,
        device: &Arc<Device>,
        stats: &MemStats,
        bytes: usize,
    ) -> Result<()> {
        if self.frozen || self.pinned.as_ref().is_some_and(|p| p.bytes >= bytes) {
            return Ok(());
        }
        self.pinned = Some(Pinned::new(device, bytes)?);
        self.buf = Some(DevAlloc::new(device, bytes, stats)?);
        Ok(())
    }

    /// Packs `plan` for [`Self::copy`]. With `grow` false (a step packed while the device
    /// may still read this step's buffers), `Ok(false)` where the buffers are too small for it
    /// (pack it again with `grow` once the device is done).
    pub(crate) fn pack(
        &mut self,
        device: &Arc<Device>,
        stats: &MemStats,
        plan: &StepPlan,
        grow: bool,
    ) -> Result<bool> {
        self.uploaded = false;
        self.ctx_lens.clear();
        self.ctx_lens
            .extend(plan.seqs.iter().map(|q| q.context_len as u32));
        chimera_kernels::attention::plan(&plan.cu_seqlens, &self.ctx_lens, &mut self.attn);
        // SSM models plan their scan chunks; slot operations are planned whatever the model.
        if self.ssm_chunk > 0 || !plan.slot_ops.is_empty() {
            self.plan_ssm(plan)?;
        } else {
            self.ssm = SsmPlan::default();
        }
        let s = &mut self.staging;
        s.clear();
        let seqs = &plan.seqs;
        let c = &mut self.cols;
        c.tokens = Self::push(s, plan.tokens.iter().copied());
        c.positions = Self::push(s, plan.positions.iter().copied());
        c.slot_mapping = Self::push(s, plan.slot_mapping.iter().copied());
        c.cu_seqlens = Self::push(s, plan.cu_seqlens.iter().copied());
        c.ctx_lens = Self::push(s, self.ctx_lens.iter().copied());
        c.bt_offsets = Self::push(s, seqs.iter().map(|q| q.blocks.0));
        c.block_tables = Self::push(s, plan.block_tables.iter().copied());
        c.logit_rows = Self::push(s, plan.logit_rows.iter().copied());
        Self::push_sampling_columns(s, c, plan);
        for (at, col) in c.attn.iter_mut().zip(WorkCol::ALL) {
            *at = Self::push(s, self.attn.column(col).iter().copied());
        }
        for (at, col) in c.ssm.iter_mut().zip(ssm::WorkCol::ALL) {
            *at = Self::push(s, self.ssm.column(col).iter().copied());
        }
        self.dims = StepDims {
            tokens: plan.tokens.len(),
            seqs: seqs.len(),
            block_size: plan.block_size,
            logit_rows: plan.logit_rows.len(),
            sample_rows: plan.sample_rows.len(),
            k: plan.sampling.k,
            masks: plan.sampling.has_masks(),
            mask_words: plan.sampling.masks.len(),
        };
        let bytes = 4 * s.len();
        if self.pinned.as_ref().is_none_or(|p| p.bytes < bytes) {
            if self.frozen {
                return Err(crate::backend::BackendError::Invalid(
                    "a step object that a CUDA graph uses cannot grow".into(),
                ));
            }
            if !grow {
                return Ok(false);
            }
            // Grow with headroom so a slowly growing batch does not re-pin every step.
            let cap = (bytes * 3 / 2).max(MIN_STEP_BYTES);
            self.pinned = Some(Pinned::new(device, cap)?);
            self.buf = Some(DevAlloc::new(device, cap, stats)?);
        }
        Ok(true)
    }
}

impl CudaStep {
    /// Cuts the step's SSD chunks (also at every snapshot offset) and lists its decodes,
    /// snapshot slots and slot operations for the SSM kernels.
    fn plan_ssm(&mut self, plan: &StepPlan) -> Result<()> {
        self.slots_and_snapshots(plan);
        self.ops.clear();
        self.ops.extend(plan.slot_ops.iter().map(|op| match *op {
            crate::backend::SlotOp::Copy { from, to } => ssm::SlotOp::Copy { from, to },
            crate::backend::SlotOp::Zero { slot } => ssm::SlotOp::Zero { slot },
        }));
        ssm::plan(
            ssm::SsmStepInputs {
                cu_seqlens: &plan.cu_seqlens,
                slots: &self.seq_slots,
                snapshots: &self.snaps,
                slot_ops: &self.ops,
                chunk_size: self.ssm_chunk.max(1),
            },
            &mut self.ssm,
        )
        .map_err(|e| crate::backend::BackendError::Invalid(e.to_string()))
    }

    /// Each sequence's SSM slot and the step's snapshot targets, as the SSM planner takes them.
    fn slots_and_snapshots(&mut self, plan: &StepPlan) {
        self.seq_slots.clear();
        self.seq_slots.extend(plan.seqs.iter().map(|q| q.ssm_slot));
        self.snaps.clear();
        self.snaps
            .extend(plan.snapshots.iter().map(|t| ssm::Snapshot {
                seq: t.seq,
                after: t.after,
                slot: t.slot,
            }));
    }
}

impl Default for CudaStep {
    fn default() -> Self {
        Self::new()
    }
}
