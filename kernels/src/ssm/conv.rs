//! The causal conv1d (`conv.cu`): its entry table and one layer's launches.

use super::{SsmArg, SsmError, SsmPlan, WorkCol, e, entry_name, grid, suffix};
use crate::{Entry, Launch, Param};

use Param::{Ptr, U32};

/// Largest conv kernel width (`conv.cu` MAXK).
pub const MAX_CONV_KERNEL: u32 = 8;

// Geometry mirrored from conv.cu.
pub(super) const CONV_THREADS: u32 = 128;
pub(super) const CONV_ROWS: u32 = 32;

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

/// `x, weight, bias, out, conv_pool, seq_slot, seq_chunk, seq_chunks, ck_tok, ck_len, ck_snap,
/// ck_snaps, snap_slot, seq_base, channels, kernel, x_ld, out_ld, layer, layers, slots,
/// ch_blocks`.
const CONV_RECURRENT: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32,
    U32, U32, U32,
];

/// The entry points of `conv.cu`.
pub const ENTRIES: &[Entry] = &[
    e("ssm_conv_chunks_f32", CONV_CHUNKS),
    e("ssm_conv_chunks_bf16", CONV_CHUNKS),
    e("ssm_conv_update_f32", CONV_UPDATE),
    e("ssm_conv_update_bf16", CONV_UPDATE),
    e("ssm_conv_recurrent_f32", CONV_RECURRENT),
    e("ssm_conv_recurrent_bf16", CONV_RECURRENT),
];

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
    /// Steps whose prompts are all at most this long take them token by token
    /// (`ssm_conv_recurrent`, [`super::short_prompts`]); 0: never. The scan's
    /// [`super::ScanDims::recurrent_tokens`].
    pub recurrent_tokens: u32,
}

/// One conv layer: `ssm_conv_chunks` over the prompt chunks, then `ssm_conv_update` over
/// every entry (it replaces the live states the first launch reads); or, when every prompt is
/// short ([`super::short_prompts`]), `ssm_conv_recurrent` over the prompts and
/// `ssm_conv_update` over the decodes.
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
    let recurrent = super::short_prompts(plan, dims.recurrent_tokens);
    if recurrent {
        let mut args = vec![X, Weight, Bias, Out, ConvPool];
        args.extend(super::ENTRY_CHUNK_COLS.map(Work));
        args.push(U32(plan.decodes as u32));
        args.extend(shape);
        out.push(Launch {
            entry: entry_name(&format!("ssm_conv_recurrent_{}", suffix(bf16))),
            grid: grid(plan.prompts() as u64 * u64::from(ch_blocks))?,
            block: (CONV_THREADS, 1, 1),
            smem: 0,
            args,
        });
    } else if plan.chunks() > 0 {
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
    // conv_update over every entry, or the decodes only after `ssm_conv_recurrent`.
    let entries = if recurrent { plan.decodes } else { plan.seqs() };
    if entries > 0 {
        // conv_update takes `conv_update_channels` channels a thread.
        let ch_blocks = dims
            .channels
            .div_ceil(CONV_THREADS * conv_update_channels(dims.kernel, dims.channels));
        let mut shape = shape;
        shape[7] = U32(ch_blocks);
        let blocks = entries as u64 * u64::from(ch_blocks);
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

/// Channels one `ssm_conv_update` thread takes (`conv.cu` conv_update_cpt): four when the
/// conv is 4 wide and they divide the channels, else one.
fn conv_update_channels(kernel: u32, channels: u32) -> u32 {
    if kernel == 4 && channels.is_multiple_of(4) {
        4
    } else {
        1
    }
}
