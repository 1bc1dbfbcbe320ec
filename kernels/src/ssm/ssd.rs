//! The chunked SSD of prompt chunks (`ssd_state.cu`: dt, chunk states and state passing;
//! `ssd_scan.cu`: the chunk scan; `ssd.cuh`: the algorithm and the shared tiles): their
//! entry tables, scratch buffers, shared memory and launches, the second part of a scan
//! layer's ([`super::launches_scan`]).

use super::{
    ScanDims, SsmArg, SsmError, SsmPlan, WorkCol, e, entry_name, grid, state_suffix, suffix,
};
use crate::{Entry, Launch, Param};

use Param::{F32, Ptr, U32};

// Geometry mirrored from ssd.cuh, ssd_state.cu and ssd_scan.cu.
const DT_THREADS: u32 = 256;
pub(super) const DT_HEADS: u32 = 32;
const SIMT_THREADS: u32 = 256;
pub(super) const SIMT_TM: u32 = 32;
pub(super) const SIMT_TN: u32 = 64;
pub(super) const PASS_THREADS: u32 = 256;
pub(super) const PASS_PER: u32 = 8;
const SCAN_THREADS: u32 = 256;
pub(super) const SCAN_ROWS: u32 = 128;
pub(super) const CHUNK_PASS_SPLIT: u32 = 2;
/// Grids of the group scan below this many CTAs take fewer heads a CTA.
const GROUP_SCAN_CTAS: u64 = 512;

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

/// `ssd_state.cu`: dt, chunk states, state passing.
pub const STATE_ENTRIES: &[Entry] = &[
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
];

/// `ssd_scan.cu`: the chunk scans.
pub const SCAN_ENTRIES: &[Entry] = &[
    e("ssd_scan_simt_f32", SCAN),
    e("ssd_scan_simt_bf16", SCAN),
    e("ssd_scan_mma_p64n64_bf16", SCAN),
    e("ssd_scan_mma_p64n128_bf16", SCAN),
    e("ssd_scan_group_mma_p64n64_bf16", GROUP_SCAN),
    e("ssd_scan_group_mma_p64n128_bf16", GROUP_SCAN),
];

/// Bytes of each scratch buffer ([`SsmArg::Scratch`]) of one scan layer (`bf16`: the
/// launches' dtype): dt and the cumulative dA `[tokens, heads]` (f32) each, the chunk states
/// `[chunks, heads, head_dim, state]` (f32; bf16 entering states on the tensor-core path),
/// then the cumulative dA and dt again, chunk-major `[chunks, heads, rec_rows]` (f32,
/// [`rec_rows`]). All zero when the plan has no prompt chunks or scans them token by token.
pub fn scratch_bytes(plan: &SsmPlan, dims: ScanDims, bf16: bool) -> Vec<usize> {
    if plan.chunks() == 0 || super::recurrent_prompts(plan, dims) {
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

/// The SSD pipeline over the prompt chunks of `plan`, into `out` (nothing without them):
/// `ssd_dt`, then `launches_ssd_mma` or `launches_ssd_simt`.
pub(super) fn launches(
    plan: &SsmPlan,
    dims: ScanDims,
    bf16: bool,
    out: &mut Vec<Launch<SsmArg>>,
) -> Result<(), SsmError> {
    use SsmArg::*;
    let ty = suffix(bf16);
    if plan.chunks() == 0 {
        return Ok(());
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
        Some(pn) => launches_ssd_mma(plan, dims, pn, out)?,
        None => launches_ssd_simt(plan, dims, ty, shape, out)?,
    }
    Ok(())
}

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
    args.extend(super::ENTRY_CHUNK_COLS.map(Work));
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
    args.extend(super::ENTRY_CHUNK_COLS.map(Work));
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

/// Dynamic shared memory of `ssd_scan_mma` for head dim `p` and state `n` (`ssd_scan.cu`
/// ScanLayout): C rows, B rows and x rows of a 128-token tile and h_c, each bf16 row padded
/// by 8 elements, then three f32 arrays of decays.
fn scan_smem_bytes(p: u32, n: u32) -> u32 {
    let (ldn, ldp) = (n + 8, p + 8);
    (SCAN_ROWS * ldn + p * ldn + SCAN_ROWS * ldn + SCAN_ROWS * ldp) * 2 + 3 * SCAN_ROWS * 4
}

/// Dynamic shared memory of `ssd_chunk_pass_mma` (`ssd_state.cu` ChunkPassLayout): three tile
/// stages of x rows and the CTA's half of the B rows (bf16, rows padded by 8 elements), each
/// stage's f32 A_s, dt_s and A_end (padded to 4), the f32 weights of one tile, then each
/// stage's tile record (8 words).
fn chunk_pass_smem_bytes(p: u32, n: u32) -> u32 {
    const STAGES: u32 = 3;
    let stage = SCAN_ROWS * (p + 8) + SCAN_ROWS * (n / CHUNK_PASS_SPLIT + 8);
    STAGES * stage * 2 + (STAGES * (2 * SCAN_ROWS + 4) + SCAN_ROWS + STAGES * 8) * 4
}

/// Dynamic shared memory of `ssd_scan_group_mma` (`ssd_scan.cu` GroupScanLayout): the C rows,
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
