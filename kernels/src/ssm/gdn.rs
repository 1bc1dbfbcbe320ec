//! The gated delta rule of Gated DeltaNet layers (`gdn.cu`): its entry table and one layer's
//! launches over an SSM plan (the same plan, columns and pools as the Mamba2 scan: the plan's
//! chunks end at every snapshot offset, so every snapshot is a chunk-end state).

use super::{SsmArg, SsmError, SsmPlan, WorkCol, e, entry_name, grid, state_suffix, suffix};
use crate::{Entry, Launch, Param};

use Param::{Ptr, U32};

// Geometry mirrored from gdn.cu.
pub(super) const GDN_THREADS: u32 = 128;
/// Columns of the state one warp holds: decodes, prompts.
const DECODE_COLS: u32 = 8;
const PROMPT_COLS: u32 = 2;
/// Largest key head dim (32 rows a lane at most 8).
pub const MAX_GDN_KEY_DIM: u32 = 256;
/// Largest key head dim of `gdn_prompt` (4 row lanes of at most 32 rows); `gdn_scan` takes
/// the prompts of larger ones.
const MAX_STAGED_KEY_DIM: u32 = 128;
/// Below this many CTAs at two columns a lane, `gdn_prompt` takes one column a lane (twice
/// the CTAs: a long prompt alone on a card of 132 SMs is one entry × heads × column blocks).
/// Key dims over 64 always take one (two would not fit the registers).
const WIDE_GRID_CTAS: u64 = 128;

/// `q, k, a, b, a_log, dt_bias, qn, kn, qk, g, beta, k_heads, dk, v_heads, q_ld, ab_ld`.
const PREP: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32,
];
/// `qn, kn, qk, g, beta, v, out, pool, seq_tok, seq_slot, seq_snap, seq_snaps, snap_slot,
/// k_heads, v_heads, dk, dv, v_ld, out_ld, layer, layers, slots`.
const DECODE: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32,
    U32, U32, U32,
];
/// `gdn_scan` and `gdn_prompt`: `qn, kn, qk, g, beta, v, out, pool, seq_tok, seq_len, seq_slot,
/// seq_chunk, seq_chunks, seq_snap, seq_snaps, ck_tok, ck_len, ck_snap, ck_snaps, snap_slot, e0
/// (the first entry), decodes, k_heads, v_heads, dk, dv, v_ld, out_ld, layer, layers, slots`.
const SCAN: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr,
    Ptr, U32, U32, U32, U32, U32, U32, U32, U32, U32, U32, U32,
];

macro_rules! scans {
    ($(($r:literal, $c:literal)),*; $(($pr:literal, $pc:literal)),*; $($d:literal),*) => {
        &[
            e("gdn_prep_f32", PREP),
            e("gdn_prep_bf16", PREP),
            $(
                e(concat!("gdn_scan_r", $r, "_c", $c, "_f32"), SCAN),
                e(concat!("gdn_scan_r", $r, "_c", $c, "_bf16"), SCAN),
                e(concat!("gdn_scan_r", $r, "_c", $c, "_f32_sbf16"), SCAN),
                e(concat!("gdn_scan_r", $r, "_c", $c, "_bf16_sbf16"), SCAN),
            )*
            $(
                e(concat!("gdn_prompt_r", $pr, "_c", $pc, "_f32"), SCAN),
                e(concat!("gdn_prompt_r", $pr, "_c", $pc, "_bf16"), SCAN),
                e(concat!("gdn_prompt_r", $pr, "_c", $pc, "_f32_sbf16"), SCAN),
                e(concat!("gdn_prompt_r", $pr, "_c", $pc, "_bf16_sbf16"), SCAN),
            )*
            $(
                e(concat!("gdn_decode_r", $d, "_f32"), DECODE),
                e(concat!("gdn_decode_r", $d, "_bf16"), DECODE),
                e(concat!("gdn_decode_r", $d, "_f32_sbf16"), DECODE),
                e(concat!("gdn_decode_r", $d, "_bf16_sbf16"), DECODE),
            )*
        ]
    };
}

/// The entry points of `gdn.cu`.
pub const ENTRIES: &[Entry] = scans!(
    (1, 8),
    (2, 8),
    (4, 8),
    (8, 8),
    (1, 2),
    (2, 2),
    (4, 2),
    (8, 2);
    (4, 1),
    (8, 1),
    (16, 1),
    (32, 1),
    (4, 2),
    (8, 2),
    (16, 2);
    2,
    4,
    8,
    16
);

/// One Gated DeltaNet layer's shape and its place in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnDims {
    pub k_heads: u32,
    pub v_heads: u32,
    /// Key and value head dims.
    pub dk: u32,
    pub dv: u32,
    pub layer: u32,
    pub layers: u32,
    pub slots: u32,
    /// Row strides (elements): `q` and `k` (`k_heads·dk` when contiguous), `a` and `b`
    /// (`v_heads`), `v` (`v_heads·dv`), the output (`v_heads·dv`).
    pub q_ld: u32,
    pub ab_ld: u32,
    pub v_ld: u32,
    pub out_ld: u32,
    /// The SSM pool stores bf16.
    pub state_bf16: bool,
    /// Prompts in `gdn_prompt` where the key dim allows (else `gdn_scan`, the first kernel,
    /// kept to compare against).
    pub staged_prompts: bool,
}

impl GdnDims {
    /// Contiguous tensors; `layer`, `layers`, `slots` zero (set them).
    pub fn packed(k_heads: u32, v_heads: u32, dk: u32, dv: u32) -> Self {
        Self {
            k_heads,
            v_heads,
            dk,
            dv,
            layer: 0,
            layers: 0,
            slots: 0,
            q_ld: k_heads * dk,
            ab_ld: v_heads,
            v_ld: v_heads * dv,
            out_ld: v_heads * dv,
            state_bf16: false,
            staged_prompts: true,
        }
    }
}

/// One Gated DeltaNet layer's launches: `gdn_prep` over the step's tokens, then `gdn_scan`
/// over the decodes and over the prompts, with the five f32 scratch buffers of [`gdn_scratch_lens`]. The symbolic
/// tensors: `X` = q, `B` = k, `C` = v, `Dt` = a (the decay input), `D` = b (the β input),
/// `ALog`, `DtBias`, `Out`, `SsmPool`.
pub fn launches_gdn(
    plan: &SsmPlan,
    d: GdnDims,
    bf16: bool,
) -> Result<Vec<Launch<SsmArg>>, SsmError> {
    use SsmArg::*;
    let shape_ok = d.k_heads > 0
        && d.v_heads.is_multiple_of(d.k_heads)
        && d.dk > 0
        && d.dk <= MAX_GDN_KEY_DIM
        && d.dv > 0;
    if !shape_ok {
        return Err(SsmError::Shape {
            heads: d.v_heads,
            groups: d.k_heads,
            head_dim: d.dk,
            state: d.dv,
        });
    }
    let tokens = u64::from(plan.tokens());
    let mut out = Vec::new();
    if tokens == 0 || plan.seqs() == 0 {
        return Ok(out);
    }
    let ty = suffix(bf16);
    out.push(Launch {
        entry: entry_name(&format!("gdn_prep_{ty}")),
        grid: grid(tokens)?,
        block: (GDN_THREADS, 1, 1),
        smem: 0,
        args: vec![
            X,
            B,
            Dt,
            D,
            ALog,
            DtBias,
            Scratch(0),
            Scratch(1),
            Scratch(2),
            Scratch(3),
            Scratch(4),
            U32(d.k_heads),
            U32(d.dk),
            U32(d.v_heads),
            U32(d.q_ld),
            U32(d.ab_ld),
        ],
    });
    // Decodes, then prompts: one launch each. Decodes whose value dim splits into the state's
    // 16-byte vectors take gdn_decode, the others gdn_scan at DECODE_COLS; prompts take
    // gdn_prompt (staged tokens) up to MAX_STAGED_KEY_DIM, gdn_scan at PROMPT_COLS above.
    let vec = if d.state_bf16 { 8 } else { 4 };
    let mut groups = vec![(plan.decodes(), plan.prompts(), Some(PROMPT_COLS))];
    if plan.decodes() > 0 && d.dv.is_multiple_of(vec) {
        out.push(decode_launch(plan.decodes(), d, ty, vec)?);
    } else {
        groups.insert(0, (0, plan.decodes(), Some(DECODE_COLS)));
    }
    if d.staged_prompts && d.dk <= MAX_STAGED_KEY_DIM {
        groups.last_mut().expect("the prompts' group").2 = None;
    }
    for (e0, count, scan_cols) in groups {
        if count == 0 {
            continue;
        }
        let mut args = operands();
        args.extend(
            [
                WorkCol::SeqTok,
                WorkCol::SeqLen,
                WorkCol::SeqSlot,
                WorkCol::SeqChunk,
                WorkCol::SeqChunks,
                WorkCol::SeqSnap,
                WorkCol::SeqSnaps,
                WorkCol::CkTok,
                WorkCol::CkLen,
                WorkCol::CkSnap,
                WorkCol::CkSnaps,
                WorkCol::SnapSlot,
            ]
            .map(Work),
        );
        args.extend([
            U32(e0 as u32),
            U32(plan.decodes() as u32),
            U32(d.k_heads),
            U32(d.v_heads),
            U32(d.dk),
            U32(d.dv),
            U32(d.v_ld),
            U32(d.out_ld),
            U32(d.layer),
            U32(d.layers),
            U32(d.slots),
        ]);
        let heads = count as u64 * u64::from(d.v_heads);
        let (entry, ctas) = match scan_cols {
            Some(cols) => {
                let rows = d.dk.div_ceil(32).next_power_of_two();
                let name = format!(
                    "gdn_scan_r{rows}_c{cols}_{ty}{}",
                    state_suffix(d.state_bf16)
                );
                (name, heads * u64::from(d.dv.div_ceil(4 * cols)))
            }
            None => {
                // 4 warps of 8 column lanes, `cols` columns a lane; 4 row lanes of `rows`.
                let rows = d.dk.div_ceil(4).next_power_of_two().max(4);
                let blocks = |cols: u32| heads * u64::from(d.dv.div_ceil(32 * cols));
                let cols = if rows <= 16 && blocks(2) >= WIDE_GRID_CTAS {
                    2
                } else {
                    1
                };
                let name = format!(
                    "gdn_prompt_r{rows}_c{cols}_{ty}{}",
                    state_suffix(d.state_bf16)
                );
                (name, blocks(cols))
            }
        };
        out.push(Launch {
            entry: entry_name(&entry),
            grid: grid(ctas)?,
            block: (GDN_THREADS, 1, 1),
            smem: 0,
            args,
        });
    }
    Ok(out)
}

/// The arguments `gdn_scan` and `gdn_decode` start with: the prep's five scratch buffers, `v`,
/// the output and the state pool.
fn operands() -> Vec<SsmArg> {
    use SsmArg::*;
    vec![
        Scratch(0),
        Scratch(1),
        Scratch(2),
        Scratch(3),
        Scratch(4),
        C,
        Out,
        SsmPool,
    ]
}

/// `gdn_decode` over the first `decodes` entries: `vec` state columns a lane, 8 lanes across.
fn decode_launch(
    decodes: usize,
    d: GdnDims,
    ty: &str,
    vec: u32,
) -> Result<Launch<SsmArg>, SsmError> {
    use SsmArg::*;
    let warps = decode_warps(d.state_bf16);
    let rows = d.dk.div_ceil(4 * warps).next_power_of_two().max(2);
    let mut args = operands();
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
        U32(d.k_heads),
        U32(d.v_heads),
        U32(d.dk),
        U32(d.dv),
        U32(d.v_ld),
        U32(d.out_ld),
        U32(d.layer),
        U32(d.layers),
        U32(d.slots),
    ]);
    let col_blocks = u64::from(d.dv.div_ceil(8 * vec));
    Ok(Launch {
        entry: entry_name(&format!(
            "gdn_decode_r{rows}_{ty}{}",
            state_suffix(d.state_bf16)
        )),
        grid: grid(decodes as u64 * u64::from(d.v_heads) * col_blocks)?,
        block: (32 * warps, 1, 1),
        smem: 0,
        args,
    })
}

/// Warps of a `gdn_decode` CTA (gdn.cu `GDN_DECODES`): 8 for a bf16 state, 4 for f32.
fn decode_warps(state_bf16: bool) -> u32 {
    if state_bf16 { 8 } else { 4 }
}

/// The f32 lengths of [`launches_gdn`]'s five scratch buffers for `tokens` tokens: the
/// normalised q and k `[tokens, k_heads·dk]`, k·q `[tokens, k_heads]`, g and β `[tokens,
/// v_heads]`.
pub fn gdn_scratch_lens(d: &GdnDims, tokens: usize) -> [usize; 5] {
    let key = tokens * (d.k_heads * d.dk) as usize;
    let kh = tokens * d.k_heads as usize;
    let vh = tokens * d.v_heads as usize;
    [key, key, kh, vh, vh]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scan_the_planner_names_is_in_the_table() {
        for dk in [8, 16, 32, 33, 64, 128, 129, 256] {
            let rows = (dk as u32).div_ceil(32).next_power_of_two();
            for cols in [DECODE_COLS, PROMPT_COLS] {
                for (ty, st) in [
                    ("f32", ""),
                    ("bf16", ""),
                    ("f32", "_sbf16"),
                    ("bf16", "_sbf16"),
                ] {
                    let name = format!("gdn_scan_r{rows}_c{cols}_{ty}{st}");
                    assert_eq!(entry_name(&name), name, "dk {dk}");
                }
            }
            for (ty, st) in [
                ("f32", ""),
                ("bf16", ""),
                ("f32", "_sbf16"),
                ("bf16", "_sbf16"),
            ] {
                let warps = decode_warps(!st.is_empty());
                let rows = (dk as u32).div_ceil(4 * warps).next_power_of_two().max(2);
                let name = format!("gdn_decode_r{rows}_{ty}{st}");
                assert_eq!(entry_name(&name), name, "dk {dk}");
            }
        }
    }
}
