//! The step plan: everything one forward pass needs to know about the batch, as plain columns.
//!
//! The engine's model runner builds one [`StepPlan`] per step with [`StepPlan::push`] (one call
//! per sequence chunk) and [`StepPlan::finish`] (the derived columns), then hands it to the
//! backend in **one** call ([`super::StepBackend::upload_step`]); kernels read the backend's step
//! object, never host slices. Every column is flat (CSR-style where a sequence owns several
//! entries), so a device backend uploads it as a handful of contiguous copies.
//!
//! Invariants after `finish` (checked by [`StepPlan::validate`]): chunks are contiguous and
//! cover `tokens`; `positions[t]` continues each chunk's context; `slot_mapping[t]` is the KV
//! cache row of token `t` (`block * block_size + pos % block_size`); `cu_seqlens` are the chunk
//! boundaries; every token is in exactly one of the decode/prefill chunk lists; snapshot targets
//! lie strictly inside or at the end of their chunk; `logit_rows` lists, in chunk order, every
//! token of an `all_logits` or `sample_all` chunk and the last token of any other
//! `want_logits` chunk; `sample_rows` every row of a `sample_all` chunk and the last row of
//! any other `want_logits` chunk.
//!
//! Nothing here knows what a request is or why a block was chosen.

use super::sample::SampleRows;

/// "After `after` tokens of chunk `seq`, copy the live SSM state (all layers) into `slot`."
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotTarget {
    pub seq: u32,
    /// In `1 ..= len` of the chunk.
    pub after: u32,
    pub slot: u32,
}

/// One sequence's share of the step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeqChunk {
    /// Start of this chunk in [`StepPlan::tokens`].
    pub offset: usize,
    /// Number of tokens computed this step (≥ 1).
    pub len: usize,
    /// Tokens of this sequence whose K/V are already in the paged cache (and whose effect is
    /// already folded into the live SSM slot) before this chunk.
    pub context_len: usize,
    /// This chunk's blocks are `block_tables[blocks.0 .. blocks.0 + blocks.1]`.
    pub blocks: (u32, u32),
    /// The live SSM-state slot of this sequence (ignored by models without SSM layers).
    pub ssm_slot: u32,
    /// This chunk's snapshot targets are `snapshots[snaps.0 .. snaps.0 + snaps.1]`.
    pub snaps: (u32, u32),
    /// Whether the logits of the chunk's last token are wanted.
    pub want_logits: bool,
    /// Whether the logits of every token of the chunk are wanted (prompt logprobs).
    pub all_logits: bool,
    /// Every token of the chunk is a sampled row (a speculative verify chunk: a decode of
    /// several positions); implies `want_logits`.
    pub sample_all: bool,
}

/// SSM slot set-up done before the step's layers run: all restores and zeros in one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotOp {
    /// Copy every layer's state of `from` into `to`.
    Copy {
        from: u32,
        to: u32,
    },
    Zero {
        slot: u32,
    },
}

/// One engine step, as the backend sees it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub block_size: usize,
    /// Token ids of every chunk, concatenated in chunk order.
    pub tokens: Vec<u32>,
    /// Absolute position of each token in its sequence.
    pub positions: Vec<u32>,
    /// Chunk index of each token.
    pub token_seq: Vec<u32>,
    /// KV cache row of each token (`block * block_size + pos % block_size`).
    pub slot_mapping: Vec<u32>,
    pub seqs: Vec<SeqChunk>,
    /// Every chunk's block table, concatenated (see [`SeqChunk::blocks`]).
    pub block_tables: Vec<u32>,
    /// Chunk boundaries in `tokens`: `cu_seqlens[i] .. cu_seqlens[i + 1]` (varlen kernels).
    pub cu_seqlens: Vec<u32>,
    /// Chunks of one token that continue a sequence (decodes) and the others (prefill chunks).
    pub decode_seqs: Vec<u32>,
    pub prefill_seqs: Vec<u32>,
    /// Snapshot targets of every chunk, concatenated (see [`SeqChunk::snaps`]).
    pub snapshots: Vec<SnapshotTarget>,
    /// Restores and zeros of SSM slots, applied before the layers run.
    pub slot_ops: Vec<SlotOp>,
    /// Rows of the hidden states whose logits are computed, in output order.
    pub logit_rows: Vec<u32>,
    /// Rows of the logits (indices into `logit_rows`) that are sampled: the last row of every
    /// `want_logits` chunk and every row of a `sample_all` chunk, in chunk order.
    pub sample_rows: Vec<u32>,
    /// Per-row sampling inputs (penalties, token history, K) for `sample_rows`, filled by the
    /// engine's sampling stage.
    pub sampling: SampleRows,
}

/// A plan that breaks an invariant (a bug in whoever built it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid step plan: {0}")]
pub struct PlanError(pub String);

impl StepPlan {
    /// An empty plan for caches of `block_size`-token blocks.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            ..Self::default()
        }
    }

    /// Empties the plan, keeping every buffer's capacity (the persistent batch).
    pub fn clear(&mut self, block_size: usize) {
        self.block_size = block_size;
        self.tokens.clear();
        self.positions.clear();
        self.token_seq.clear();
        self.slot_mapping.clear();
        self.seqs.clear();
        self.block_tables.clear();
        self.cu_seqlens.clear();
        self.decode_seqs.clear();
        self.prefill_seqs.clear();
        self.snapshots.clear();
        self.slot_ops.clear();
        self.logit_rows.clear();
        self.sample_rows.clear();
        let k = self.sampling.k;
        self.sampling.clear(k);
    }

    /// Becomes a copy of `src`, reusing this plan's buffers (a backend's host-side staging
    /// copy; no allocation once warm — a derived `clone_from` would reallocate every column).
    pub fn copy_from(&mut self, src: &StepPlan) {
        self.block_size = src.block_size;
        self.tokens.clone_from(&src.tokens);
        self.positions.clone_from(&src.positions);
        self.token_seq.clone_from(&src.token_seq);
        self.slot_mapping.clone_from(&src.slot_mapping);
        self.seqs.clone_from(&src.seqs);
        self.block_tables.clone_from(&src.block_tables);
        self.cu_seqlens.clone_from(&src.cu_seqlens);
        self.decode_seqs.clone_from(&src.decode_seqs);
        self.prefill_seqs.clone_from(&src.prefill_seqs);
        self.snapshots.clone_from(&src.snapshots);
        self.slot_ops.clone_from(&src.slot_ops);
        self.logit_rows.clone_from(&src.logit_rows);
        self.sample_rows.clone_from(&src.sample_rows);
        self.sampling.copy_from(&src.sampling);
    }

    /// Adds a chunk: `tokens` at positions `context_len ..`, the sequence's block table and
    /// live SSM slot. Returns the chunk for further settings (snapshots, `all_logits`).
    pub fn push(
        &mut self,
        tokens: &[u32],
        context_len: usize,
        block_table: &[u32],
        ssm_slot: u32,
        want_logits: bool,
    ) -> &mut SeqChunk {
        let offset = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.positions
            .extend((context_len..context_len + tokens.len()).map(|p| p as u32));
        let blocks = (self.block_tables.len() as u32, block_table.len() as u32);
        self.block_tables.extend_from_slice(block_table);
        self.seqs.push(SeqChunk {
            offset,
            len: tokens.len(),
            context_len,
            blocks,
            ssm_slot,
            snaps: (self.snapshots.len() as u32, 0),
            want_logits,
            all_logits: false,
            sample_all: false,
        });
        let last = self.seqs.len() - 1;
        &mut self.seqs[last]
    }

    /// Appends `tokens` to the chunk added last (positions continuing it).
    pub fn extend_last(&mut self, tokens: &[u32]) {
        let Some(s) = self.seqs.last_mut() else {
            return;
        };
        let from = s.context_len + s.len;
        s.len += tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.positions
            .extend((from..from + tokens.len()).map(|p| p as u32));
    }

    /// Asks for a snapshot after `after` tokens of the chunk added last.
    pub fn snapshot(&mut self, after: usize, slot: u32) {
        let seq = self.seqs.len().saturating_sub(1);
        if let Some(s) = self.seqs.last_mut() {
            s.snaps.1 += 1;
        }
        self.snapshots.push(SnapshotTarget {
            seq: seq as u32,
            after: after as u32,
            slot,
        });
    }

    /// Fills the derived columns (slot mapping, chunk boundaries, decode/prefill lists, logit
    /// rows) and checks the invariants.
    pub fn finish(&mut self) -> Result<(), PlanError> {
        let bs = self.block_size.max(1);
        self.token_seq.clear();
        self.slot_mapping.clear();
        self.cu_seqlens.clear();
        self.decode_seqs.clear();
        self.prefill_seqs.clear();
        self.logit_rows.clear();
        self.sample_rows.clear();
        self.cu_seqlens.push(0);
        for (i, s) in self.seqs.iter().enumerate() {
            let table = &self.block_tables[s.blocks.0 as usize..(s.blocks.0 + s.blocks.1) as usize];
            // Walk the table instead of dividing per token.
            let (mut block, mut row) = (s.context_len / bs, s.context_len % bs);
            for _ in 0..s.len {
                // A table too short is caught by `check_caches`; map past its reach here.
                let id = table.get(block).copied().unwrap_or(u32::MAX);
                self.slot_mapping
                    .push(id.saturating_mul(bs as u32).saturating_add(row as u32));
                self.token_seq.push(i as u32);
                row += 1;
                if row == bs {
                    (block, row) = (block + 1, 0);
                }
            }
            self.cu_seqlens.push((s.offset + s.len) as u32);
            if s.len == 1 && s.context_len > 0 {
                self.decode_seqs.push(i as u32);
            } else {
                self.prefill_seqs.push(i as u32);
            }
            let end = (s.offset + s.len) as u32;
            if s.sample_all {
                for t in s.offset as u32..end {
                    self.logit_rows.push(t);
                    self.sample_rows.push(self.logit_rows.len() as u32 - 1);
                }
                continue;
            }
            if s.all_logits {
                self.logit_rows.extend(s.offset as u32..end);
            } else if s.want_logits {
                self.logit_rows.push(end - 1);
            }
            if s.want_logits {
                self.sample_rows.push(self.logit_rows.len() as u32 - 1);
            }
        }
        self.validate()
    }

    /// Checks the invariants listed in the module docs.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |m: String| Err(PlanError(m));
        if self.positions.len() != self.tokens.len() {
            return bad("positions and tokens differ in length".into());
        }
        let mut next = 0;
        for (i, s) in self.seqs.iter().enumerate() {
            if s.offset != next || s.len == 0 {
                return bad(format!(
                    "chunk {i} at {} of {} tokens is not contiguous",
                    s.offset, s.len
                ));
            }
            next += s.len;
            if (s.blocks.0 + s.blocks.1) as usize > self.block_tables.len()
                || (s.snaps.0 + s.snaps.1) as usize > self.snapshots.len()
            {
                return bad(format!(
                    "chunk {i} points past the block tables or snapshots"
                ));
            }
            for t in &self.snapshots[s.snaps.0 as usize..(s.snaps.0 + s.snaps.1) as usize] {
                if t.seq as usize != i || t.after == 0 || t.after as usize > s.len {
                    return bad(format!(
                        "snapshot after {} tokens of the {}-token chunk {i}",
                        t.after, s.len
                    ));
                }
            }
        }
        if next != self.tokens.len() {
            return bad("chunks do not cover the tokens".into());
        }
        if self.slot_mapping.len() != self.tokens.len()
            || self.cu_seqlens.len() != self.seqs.len() + 1
        {
            return bad("derived columns are stale: call finish()".into());
        }
        Ok(())
    }

    /// Checks that every chunk's block table covers its positions and that block ids and
    /// slots are inside the caches.
    pub fn check_caches(
        &self,
        num_blocks: usize,
        has_kv: bool,
        num_slots: usize,
        has_ssm: bool,
    ) -> Result<(), PlanError> {
        let bs = self.block_size.max(1);
        for (i, s) in self.seqs.iter().enumerate() {
            if has_kv {
                let needed = (s.context_len + s.len).div_ceil(bs);
                if (s.blocks.1 as usize) < needed {
                    return Err(PlanError(format!(
                        "block table of chunk {i} has {} blocks, {needed} needed",
                        s.blocks.1
                    )));
                }
                if let Some(b) = self
                    .block_table(i)
                    .iter()
                    .find(|&&b| b as usize >= num_blocks)
                {
                    return Err(PlanError(format!("block id {b} out of {num_blocks}")));
                }
            }
            if has_ssm {
                let slots =
                    std::iter::once(s.ssm_slot).chain(self.snapshots_of(i).iter().map(|t| t.slot));
                for slot in slots {
                    if slot as usize >= num_slots {
                        return Err(PlanError(format!("SSM slot {slot} out of {num_slots}")));
                    }
                }
            }
        }
        if has_ssm {
            for op in &self.slot_ops {
                let (a, b) = match *op {
                    SlotOp::Copy { from, to } => (from, to),
                    SlotOp::Zero { slot } => (slot, slot),
                };
                if a.max(b) as usize >= num_slots {
                    return Err(PlanError(format!(
                        "SSM slot {} out of {num_slots}",
                        a.max(b)
                    )));
                }
            }
        }
        Ok(())
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn block_table(&self, seq: usize) -> &[u32] {
        let (start, len) = self.seqs[seq].blocks;
        &self.block_tables[start as usize..(start + len) as usize]
    }

    pub fn snapshots_of(&self, seq: usize) -> &[SnapshotTarget] {
        let (start, len) = self.seqs[seq].snaps;
        &self.snapshots[start as usize..(start + len) as usize]
    }

    /// Whether any chunk asks for every token's logits (prompt logprobs): those steps read
    /// full rows back besides the sampling candidates.
    pub fn wants_full_rows(&self) -> bool {
        self.seqs.iter().any(|s| s.all_logits)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn plan(block_size: usize) -> StepPlan {
        let mut p = StepPlan::default();
        p.clear(block_size);
        p
    }

    #[test]
    fn slot_mapping_follows_block_tables() {
        let mut p = plan(4);
        p.push(&[1, 2, 3], 5, &[7, 2], 0, true);
        p.push(&[9], 0, &[3], 1, true);
        p.finish().unwrap();
        // Positions 5, 6, 7 live in block 2 (table index 1) rows 1..=3; position 0 in block 3.
        assert_eq!(p.slot_mapping, vec![9, 10, 11, 12]);
        assert_eq!(p.positions, vec![5, 6, 7, 0]);
        assert_eq!(p.token_seq, vec![0, 0, 0, 1]);
        assert_eq!(p.cu_seqlens, vec![0, 3, 4]);
        // A one-token chunk at position 0 is a prefill (no context), not a decode.
        assert_eq!(p.prefill_seqs, vec![0, 1]);
        assert!(p.decode_seqs.is_empty());
        assert_eq!(p.logit_rows, vec![2, 3]);
    }

    #[test]
    fn logit_rows_and_sampled_rows() {
        let mut p = plan(16);
        p.push(&[1, 2, 3], 0, &[0], 0, false);
        p.push(&[4], 9, &[1], 1, true);
        p.push(&[5, 6], 0, &[2], 2, true).all_logits = true;
        p.push(&[7, 8], 3, &[3], 3, true);
        p.finish().unwrap();
        assert_eq!(p.logit_rows, vec![3, 4, 5, 7]);
        assert_eq!(p.sample_rows, vec![0, 2, 3]);
        assert_eq!(p.decode_seqs, vec![1]);
        assert_eq!(p.prefill_seqs, vec![0, 2, 3]);
    }

    #[test]
    fn snapshots_are_checked() {
        let mut p = plan(4);
        p.push(&[1; 8], 0, &[0, 1], 0, true);
        p.snapshot(4, 3);
        p.snapshot(8, 4);
        p.push(&[1], 8, &[0, 1, 2], 1, true);
        p.finish().unwrap();
        assert_eq!(p.snapshots_of(0).len(), 2);
        assert_eq!(p.snapshots_of(1).len(), 0);
        assert!(p.check_caches(3, true, 5, true).is_ok());
        assert!(p.check_caches(3, true, 4, true).is_err(), "slot 4 of 4");
        assert!(p.check_caches(2, true, 5, true).is_err(), "block 2 of 2");
        let mut bad = plan(4);
        bad.push(&[1; 3], 0, &[0], 0, true);
        bad.snapshot(4, 1);
        assert!(bad.finish().is_err(), "a snapshot past the chunk end");
        let mut short = plan(4);
        short.push(&[1; 5], 0, &[0], 0, true);
        short.finish().unwrap();
        assert!(
            short.check_caches(8, true, 1, false).is_err(),
            "5 tokens need 2 blocks"
        );
        assert!(
            short.check_caches(8, false, 1, false).is_ok(),
            "no KV layers: no tables needed"
        );
    }

    #[test]
    fn copy_from_copies_every_column() {
        let mut a = plan(4);
        a.push(&[1, 2, 3, 4, 5], 3, &[6, 7], 2, true).all_logits = true;
        a.snapshot(1, 9);
        a.slot_ops.push(SlotOp::Copy { from: 9, to: 2 });
        a.finish().unwrap();
        let mut b = plan(16);
        b.push(&[9; 40], 0, &[1, 2, 3], 0, true);
        b.copy_from(&a);
        assert_eq!(b, a);
    }

    #[test]
    fn clear_keeps_capacity() {
        let mut p = plan(16);
        p.push(&[1; 100], 0, &[0; 7], 0, true);
        p.finish().unwrap();
        let cap = (p.tokens.capacity(), p.slot_mapping.capacity());
        p.clear(16);
        assert!(p.tokens.is_empty() && p.seqs.is_empty());
        assert_eq!((p.tokens.capacity(), p.slot_mapping.capacity()), cap);
    }

    proptest! {
        /// Random batches: the derived columns agree with a direct per-token computation.
        #[test]
        fn derived_columns_match_definition(
            chunks in prop::collection::vec((1usize..40, 0usize..70, any::<bool>(), any::<bool>()), 1..8),
            bs in prop::sample::select(vec![1usize, 4, 16]),
        ) {
            let mut p = plan(bs);
            let mut next_block = 0u32;
            for (len, ctx, want, all) in &chunks {
                let nblocks = (ctx + len).div_ceil(bs);
                let table: Vec<u32> = (next_block..next_block + nblocks as u32).rev().collect();
                next_block += nblocks as u32;
                p.push(&vec![3; *len], *ctx, &table, 0, *want || *all).all_logits = *all;
                for cut in (1..=*len).filter(|c| (ctx + c) % bs == 0) {
                    p.snapshot(cut, 1);
                }
            }
            p.finish().unwrap();
            prop_assert!(p.check_caches(next_block as usize, true, 2, true).is_ok());
            let mut t = 0;
            let mut rows = Vec::new();
            for (i, (len, ctx, want, all)) in chunks.iter().enumerate() {
                prop_assert_eq!(p.cu_seqlens[i] as usize, t);
                let table = p.block_table(i);
                for j in 0..*len {
                    let pos = ctx + j;
                    prop_assert_eq!(p.positions[t] as usize, pos);
                    prop_assert_eq!(p.slot_mapping[t], table[pos / bs] * bs as u32 + (pos % bs) as u32);
                    prop_assert_eq!(p.token_seq[t] as usize, i);
                    if *all || (*want && j + 1 == *len) {
                        rows.push(t as u32);
                    }
                    t += 1;
                }
                for s in p.snapshots_of(i) {
                    prop_assert_eq!((ctx + s.after as usize) % bs, 0, "cuts on block boundaries");
                }
                let decode = *len == 1 && *ctx > 0;
                prop_assert_eq!(p.decode_seqs.contains(&(i as u32)), decode);
                prop_assert_eq!(p.prefill_seqs.contains(&(i as u32)), !decode);
            }
            prop_assert_eq!(p.logit_rows, rows);
            // Every KV row is used once: distinct blocks per sequence.
            let mut seen = p.slot_mapping.clone();
            seen.sort_unstable();
            seen.dedup();
            prop_assert_eq!(seen.len(), t);
        }
    }
}
