//! The recurrent step (`state_update.cu`): of one-token entries (`ssm_decode`, the first launch
//! of a scan layer's, [`super::launches_scan`]) and of short prompts token by token
//! (`ssm_recurrent`, in place of the chunked SSD when every prompt of the step is short): their
//! entry table and launches.

use super::{
    ScanDims, SsmArg, SsmError, SsmPlan, WorkCol, e, entry_name, grid, state_suffix, suffix,
};
use crate::{Entry, Launch, Param};

use Param::{F32, Ptr, U32};

// Geometry mirrored from state_update.cu.
pub(super) const DEC_THREADS: u32 = 128;
const DEC_VECS: u32 = 8;

/// `x, b, c, dt, a_log, d, dt_bias, out, ssm_pool, seq_tok, seq_slot, seq_snap, seq_snaps,
/// snap_slot, heads, head_dim, groups, state, x_ld, bc_ld, dt_ld, out_ld, layer, layers,
/// slots, slice_rows, dt_min, dt_max`.
const DECODE: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32,
    U32, U32, U32, U32, U32, U32, U32, F32, F32,
];

/// Rows of p one `ssm_recurrent` CTA walks (four a warp).
pub(super) const REC_ROWS: u32 = 16;
/// The largest state `ssm_recurrent` holds (eight columns a lane).
pub(super) const REC_MAX_STATE: u32 = 256;

/// `x, b, c, dt, a_log, d, dt_bias, out, ssm_pool, seq_slot, seq_chunk, seq_chunks, ck_tok,
/// ck_len, ck_snap, ck_snaps, snap_slot, seq_base, heads, head_dim, groups, state, x_ld, bc_ld,
/// dt_ld, out_ld, layer, layers, slots, dt_min, dt_max`.
const RECURRENT: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32,
    U32, U32, U32, U32, U32, U32, U32, U32, U32, U32, F32, F32,
];

/// The entry points of `state_update.cu`.
pub const ENTRIES: &[Entry] = &[
    e("ssm_decode_f32", DECODE),
    e("ssm_decode_bf16", DECODE),
    e("ssm_decode_f32_sbf16", DECODE),
    e("ssm_decode_bf16_sbf16", DECODE),
    e("ssm_recurrent_f32", RECURRENT),
    e("ssm_recurrent_bf16", RECURRENT),
    e("ssm_recurrent_f32_sbf16", RECURRENT),
    e("ssm_recurrent_bf16_sbf16", RECURRENT),
];

/// The shape, strides and pool place both recurrent-step kernels take, in their parameter
/// order: `heads, head_dim, groups, state, x_ld, bc_ld, dt_ld, out_ld, layer, layers, slots`.
fn step_scalars(dims: ScanDims) -> [SsmArg; 11] {
    use SsmArg::U32;
    [
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
    ]
}

/// `ssm_decode` over the decodes of `plan`, into `out` (nothing without decodes).
pub(super) fn launches(
    plan: &SsmPlan,
    dims: ScanDims,
    bf16: bool,
    out: &mut Vec<Launch<SsmArg>>,
) -> Result<(), SsmError> {
    use SsmArg::*;
    let ty = suffix(bf16);
    let heads = u64::from(dims.heads);
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
        args.extend(step_scalars(dims));
        args.extend([U32(slice_rows), F32(dims.dt_min), F32(dims.dt_max)]);
        out.push(Launch {
            entry: entry_name(&format!("ssm_decode_{ty}{}", state_suffix(dims.state_bf16))),
            grid: grid(plan.decodes as u64 * heads * u64::from(slices))?,
            block: (DEC_THREADS, 1, 1),
            smem: 0,
            args,
        });
    }
    Ok(())
}

/// `ssm_recurrent` over the prompts of `plan`, into `out` (nothing without prompts): the
/// caller has checked [`super::recurrent_prompts`].
pub(super) fn launches_recurrent(
    plan: &SsmPlan,
    dims: ScanDims,
    bf16: bool,
    out: &mut Vec<Launch<SsmArg>>,
) -> Result<(), SsmError> {
    use SsmArg::*;
    if plan.prompts() == 0 {
        return Ok(());
    }
    let ty = suffix(bf16);
    let slices = u64::from(dims.head_dim.div_ceil(REC_ROWS));
    let mut args = vec![X, B, C, Dt, ALog, D, DtBias, Out, SsmPool];
    args.extend(super::ENTRY_CHUNK_COLS.map(Work));
    args.push(U32(plan.decodes as u32));
    args.extend(step_scalars(dims));
    args.extend([F32(dims.dt_min), F32(dims.dt_max)]);
    out.push(Launch {
        entry: entry_name(&format!(
            "ssm_recurrent_{ty}{}",
            state_suffix(dims.state_bf16)
        )),
        grid: grid(plan.prompts() as u64 * u64::from(dims.heads) * slices)?,
        block: (DEC_THREADS, 1, 1),
        smem: 0,
        args,
    });
    Ok(())
}
