//! Placeholder until the attention kernels land: the planner API the backend glue expects.
use super::{Entry, Launch};
pub const ENTRIES: &[Entry] = &[];
#[derive(Debug, Clone, Default)]
pub struct AttnPlan { cols: Vec<Vec<u32>> }
impl AttnPlan { pub fn columns(&self) -> impl Iterator<Item = &[u32]> { self.cols.iter().map(|c| c.as_slice()) } }
#[derive(Debug, Clone, Copy)]
pub struct AttnDims { pub heads: usize, pub kv_heads: usize, pub head_dim: usize, pub block_size: usize, pub num_seqs: usize }
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttnArg { Q, KCache, VCache, Out, CuSeqlens, CtxLens, BtOffsets, BlockTables, Work(usize), Scratch(usize), U32(u32), Scale }
pub fn plan(_cu: &[u32], _ctx: &[u32], _out: &mut AttnPlan) {}
pub fn scratch_bytes(_p: &AttnPlan, _d: &AttnDims) -> Vec<usize> { Vec::new() }
pub fn launches(_p: &AttnPlan, _d: &AttnDims, _bf16: bool) -> Vec<Launch<AttnArg>> { Vec::new() }
