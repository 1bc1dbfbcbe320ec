//! Mamba2 state-space kernels, one file per stage as mamba_ssm splits them, each beside its
//! entry table and launches: the SSM slot restores/zeros (`slot_ops.rs`, `slot_ops.cu`), the
//! causal conv1d (`conv.rs`, `conv.cu`), the recurrent step of one-token entries
//! (`state_update.rs`, `state_update.cu`) and the chunked SSD (`ssd.rs`; `ssd_state.cu`,
//! `ssd_scan.cu`, `ssd.cuh`); `ssm.cuh` holds what every kernel reads. The host-side
//! planner that turns a step's chunk layout and snapshot targets into work columns is
//! `plan.rs`. This module holds what the stages share (the symbolic arguments, the errors,
//! one scan layer's shape), every stage's entries ([`ENTRIES`]) and [`launches_scan`],
//! which orders a scan layer's stages. The stage modules are private: their public items
//! are re-exported here, so every path is `ssm::Item`.
//!
//! **Plan once per step, launch per layer.** [`plan()`] reads only the step's `cu_seqlens`,
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
//! **Invariants** (checked by `tests/`, including a proptest over random mixes that
//! replays the kernels' grid decomposition): every token is in exactly one decode entry or
//! one chunk; chunks are at most the plan's chunk size and end at every snapshot offset;
//! every (token, head) output and every (token, channel) conv output is written exactly once;
//! each snapshot slot is written once per layer and pool; the live slot of every entry is
//! updated once per layer and pool; all columns of a group have one length.
//!
//! **Kernels** (the algorithms: the headers of the `.cu` files): conv `ssm_conv_chunks`
//! (prompt chunks, and their snapshot conv states) then `ssm_conv_update` (every entry's new
//! live conv state; the decodes' outputs and snapshots), or `ssm_conv_recurrent` over the
//! prompts when all are short ([`short_prompts`]) and `ssm_conv_update` over the decodes; scan `ssm_decode` (decodes), then,
//! when every prompt of the step is short (a verify step), `ssm_recurrent` over the prompts
//! token by token ([`recurrent_prompts`]), else
//! `ssd_dt` and, for bf16 with head_dim 64 and state 64 or 128, the tensor-core
//! `ssd_chunk_pass_mma` (chunk states and state passing in one walk: entering states, live
//! and snapshot states) and `ssd_scan_group_mma` (`ssd_scan_mma` for chunks over 128
//! tokens); other shapes and f32 take the SIMT `ssd_states_simt`, `ssd_pass` and
//! `ssd_scan_simt`.
//!
//! **Measured** on one H200 (a CuPy harness running exactly these launches from
//! `tests::gpu_cases::dump_gpu_cases` against a float64 transcription of the CPU semantics; outputs
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

pub(crate) mod conv;
pub(crate) mod gdn;
mod plan;
pub(crate) mod slot_ops;
pub(crate) mod ssd;
pub(crate) mod state_update;

use crate::{Entry, Launch, Param};

pub use conv::{ConvDims, MAX_CONV_KERNEL, launches_conv};
pub use gdn::{GdnDims, MAX_GDN_KEY_DIM, gdn_scratch_lens, launches_gdn};
pub use plan::{
    FixedCaps, MAX_CHUNK, PAD_SLOT, SlotOp, Snapshot, SsmPlan, SsmStepInputs, WorkCol, ZERO_OP,
    plan,
};
pub use slot_ops::{PoolDims, launches_slot_ops};
pub use ssd::{rec_rows, scratch_bytes, smem_opt_in};

/// The work columns of the kernels that walk a prompt entry's chunks in order (`ssd_pass`,
/// `ssd_chunk_pass_mma`, `ssm_recurrent`, `ssm_conv_recurrent`), in their parameter order: the
/// entry's live slot and chunk range, each chunk's rows and snapshots, the snapshot slots.
const ENTRY_CHUNK_COLS: [WorkCol; 8] = [
    WorkCol::SeqSlot,
    WorkCol::SeqChunk,
    WorkCol::SeqChunks,
    WorkCol::CkTok,
    WorkCol::CkLen,
    WorkCol::CkSnap,
    WorkCol::CkSnaps,
    WorkCol::SnapSlot,
];

/// The stages' entry tables, in the order of their sources in [`crate::sources`].
const STAGES: [&[Entry]; 6] = [
    slot_ops::ENTRIES,
    conv::ENTRIES,
    state_update::ENTRIES,
    ssd::STATE_ENTRIES,
    ssd::SCAN_ENTRIES,
    gdn::ENTRIES,
];

const fn e(name: &'static str, params: &'static [Param]) -> Entry {
    Entry { name, params }
}

/// Every SSM entry: the stages' tables, concatenated in source order.
pub const ENTRIES: &[Entry] = &ALL_ENTRIES;

const ENTRY_COUNT: usize = {
    let mut n = 0;
    let mut i = 0;
    while i < STAGES.len() {
        n += STAGES[i].len();
        i += 1;
    }
    n
};

const ALL_ENTRIES: [Entry; ENTRY_COUNT] = {
    let mut all = [e("", &[]); ENTRY_COUNT];
    let (mut i, mut k) = (0, 0);
    while i < STAGES.len() {
        let mut j = 0;
        while j < STAGES[i].len() {
            all[k] = STAGES[i][j];
            k += 1;
            j += 1;
        }
        i += 1;
    }
    all
};

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
    /// Steps whose prompts are all at most this long scan them token by token
    /// ([`recurrent_prompts`]); 0: never ([`RECURRENT_TOKENS`] by default).
    pub recurrent_tokens: u32,
}

/// The default [`ScanDims::recurrent_tokens`]: verify steps of up to 15 drafts. Measured on one
/// H100 (NemotronH-8B layer shape, bf16): see `docs/benchmarks.md`.
pub const RECURRENT_TOKENS: u32 = 16;

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
            recurrent_tokens: RECURRENT_TOKENS,
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

const MAX_GRID_X: u64 = i32::MAX as u64;

fn grid(blocks: u64) -> Result<(u32, u32, u32), SsmError> {
    if blocks == 0 || blocks > MAX_GRID_X {
        return Err(SsmError::Grid(blocks));
    }
    Ok((blocks as u32, 1, 1))
}

/// One scan layer: `ssm_decode` over the decodes, then the SSD pipeline over the prompt
/// chunks (`ssd_dt`, then the tensor-core or the SIMT kernels; see `ssd.rs`), in this order;
/// or `ssm_recurrent` over the prompts instead of the SSD when they are all short
/// ([`recurrent_prompts`]).
pub fn launches_scan(
    plan: &SsmPlan,
    dims: ScanDims,
    bf16: bool,
) -> Result<Vec<Launch<SsmArg>>, SsmError> {
    dims.check()?;
    let mut out = Vec::new();
    state_update::launches(plan, dims, bf16, &mut out)?;
    if recurrent_prompts(plan, dims) {
        state_update::launches_recurrent(plan, dims, bf16, &mut out)?;
    } else {
        ssd::launches(plan, dims, bf16, &mut out)?;
    }
    Ok(out)
}

/// Whether the prompts of `plan` take the recurrent step token by token (`ssm_recurrent`)
/// rather than the chunked SSD: every prompt is at most `dims.recurrent_tokens` long (a verify
/// step's k + 1 tokens, cut at every draft position, where the SSD's four kernels run on
/// one-token chunks) and the state fits the kernel. Never for a padded plan, whose launches
/// must depend only on its capacities.
pub fn recurrent_prompts(plan: &SsmPlan, dims: ScanDims) -> bool {
    short_prompts(plan, dims.recurrent_tokens) && dims.state <= state_update::REC_MAX_STATE
}

/// Whether `plan` has prompts and all of them are at most `tokens` long (never for a padded
/// plan): the conv's and the scan's test for their token-by-token kernels.
pub fn short_prompts(plan: &SsmPlan, tokens: u32) -> bool {
    plan.prompts() > 0 && plan.longest_prompt <= tokens
}

#[cfg(test)]
mod tests;
