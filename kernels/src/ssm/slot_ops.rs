//! The SSM slot restores and zeros (`slot_ops.cu`): their entry table and launches, one
//! per wave of the plan's slot ops ([`SsmPlan::waves`]).

use super::{SsmArg, SsmPlan, WorkCol, e};
use crate::{Entry, Launch, Param};

use Param::{Ptr, U32, U64};

const OPS_THREADS: u32 = 256;
const MAX_OPS_BLOCKS: u64 = 1024;
const MAX_GRID_Y: usize = 65535;

const SLOT_OPS: &[Param] = &[Ptr, Ptr, Ptr, Ptr, U32, U32, U64, U64];

/// The entry points of `slot_ops.cu`.
pub const ENTRIES: &[Entry] = &[e("ssm_slot_ops", SLOT_OPS), e("ssm_slot_ops_v4", SLOT_OPS)];

/// 4-byte words per slot of each pool (all layers: `layers · per-layer elements`, halved for a
/// pool stored as bf16). The slot ops copy raw words, whatever the element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolDims {
    pub slots: u32,
    pub conv_per_slot: u64,
    pub ssm_per_slot: u64,
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
