//! Placeholder until the sampling kernels land: the planner API the backend glue expects.
use super::{Entry, Launch};
pub const ENTRIES: &[Entry] = &[];
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SampleArg { Logits, SampleRows, Repetition, Presence, Frequency, WantLse, HistOffsets, HistTokens, HistCounts, CandTokens, CandLogits, Lse, Scratch(usize), U32(u32) }
pub fn scratch_bytes(_n: usize, _vocab: usize, _k: usize) -> Vec<usize> { Vec::new() }
pub fn launches(_n: usize, _vocab: usize, _k: usize) -> Vec<Launch<SampleArg>> { Vec::new() }
