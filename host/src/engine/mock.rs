//! `MockExecutor`: a deterministic, model-free [`StepExecutor`] for tests and benchmarks.
//!
//! It behaves like a tiny causal model whose "KV cache" stores the token id written at each
//! (block, offset) and whose "SSM state" per slot is a running hash of every token it has
//! consumed. The logits of a sequence are a pseudo-random function of
//! - (with `verify_kv`) every token id read back *through the block table* for positions
//!   `0 ..= last`, so a wrong table, a stale or overwritten block, or a wrong skip changes them;
//! - (for a hybrid spec) the live SSM state, so a missing or wrong snapshot restore changes them.
//!
//! Hence a correct engine produces identical outputs with prefix caching, chunking, budgets and
//! preemption on or off, and a broken one does not. It also rejects malformed batches (slots
//! and blocks out of range, reading KV never written, using an uninitialised SSM slot, restoring
//! from an empty snapshot slot). Without `verify_kv` the logits depend only on the last token
//! and its position (constant cost per row, for benchmarks).
//!
//! To stand in for a model behind the HTTP server it can also shape its output: `units`
//! restricts the sampled tokens to whole words and whole UTF-8 characters (a character split
//! over byte tokens is always completed), `eos_one_in` makes EOS likely now and then,
//! `step_delay` makes it slow, and `fail_on_token` fails any step that reads a given token.

use std::time::{Duration, Instant};

use super::executor::{CacheAllocation, ExecutorError, Logits, StepExecutor, StepOutput};
use crate::backend::cpu::sample::sample_tail;
use crate::backend::{SlotOp, SnapshotTarget, StepPlan};
use crate::model::CacheSpec;

const UNWRITTEN: u32 = u32::MAX;
const SSM_INIT: u64 = 0x9e37_79b9_7f4a_7c15;
/// Subtracted from the logit of a token `units` rule out (finite, so penalties and
/// temperatures stay well defined; its probability is below e^-60).
const RULED_OUT: f32 = 64.0;
/// The logit EOS gets when `eos_one_in` draws it (every other logit is below 4).
const EOS_LOGIT: f32 = 8.0;
const EOS_DRAW: u64 = 0xe05;

#[derive(Debug, Clone)]
pub struct MockConfig {
    pub vocab: usize,
    pub eos: Vec<u32>,
    /// Number of fake SSM layers (0: a plain transformer).
    pub ssm_layers: usize,
    /// Read the whole context back through the block table for every logits row.
    pub verify_kv: bool,
    /// Fail the `execute` call with this 0-based index (to test failure handling).
    pub fail_at_call: Option<u64>,
    /// Fail every `execute` call whose batch holds this token id (a request that always fails).
    pub fail_on_token: Option<u32>,
    /// Lose the device (an unrecoverable error: the replica stops) on the first batch that
    /// holds this token id.
    pub lose_device_on_token: Option<u32>,
    /// Output units (token sequences). When non-empty, a sampling row rules out every token
    /// except the next one of the unit the context ends inside of (the longest match), or, at
    /// a unit boundary, the first tokens of all units; so output is whole units, e.g. whole
    /// UTF-8 characters over byte tokens. Empty: every token is possible.
    pub units: Vec<Vec<u32>>,
    /// With `units`: at a unit boundary, EOS (`eos[0]`) is the most likely token for about one
    /// context in this many (a pure function of the context), and ruled out otherwise.
    /// 0: EOS is always ruled out.
    pub eos_one_in: u32,
    /// Every step takes at least this long (a slow model): slept in `finish`, after `launch`
    /// has computed the step, as a device computes while the host goes on.
    pub step_delay: Duration,
    /// Split launches into the forward pass and the sampling tail
    /// ([`StepExecutor::splits_tail`]), as the model runner does.
    pub split_tail: bool,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            vocab: 64,
            eos: vec![0],
            ssm_layers: 0,
            verify_kv: true,
            fail_at_call: None,
            fail_on_token: None,
            lose_device_on_token: None,
            units: Vec::new(),
            eos_one_in: 0,
            step_delay: Duration::ZERO,
            split_tail: true,
        }
    }
}

/// The output rule of [`MockConfig::units`].
#[derive(Debug, Default)]
struct Grammar {
    units: Vec<Vec<u32>>,
    /// Per token id: it starts a unit.
    starts: Vec<bool>,
    /// Longest unit, in tokens.
    longest: usize,
}

impl Grammar {
    fn new(units: &[Vec<u32>], vocab: usize) -> Self {
        let units: Vec<Vec<u32>> = units
            .iter()
            .filter(|u| !u.is_empty() && u.iter().all(|&t| (t as usize) < vocab))
            .cloned()
            .collect();
        let mut starts = vec![false; if units.is_empty() { 0 } else { vocab }];
        for u in &units {
            starts[u[0] as usize] = true;
        }
        let longest = units.iter().map(Vec::len).max().unwrap_or(0);
        Self {
            units,
            starts,
            longest,
        }
    }

    fn is_active(&self) -> bool {
        !self.units.is_empty()
    }

    /// The token that continues the unit `tail` (the context's last tokens) ends inside of.
    fn continuation(&self, tail: &[u32]) -> Option<u32> {
        let mut best: Option<(usize, u32)> = None;
        for u in &self.units {
            for j in (1..u.len()).rev() {
                if best.is_some_and(|(b, _)| b >= j) {
                    break;
                }
                if tail.ends_with(&u[..j]) {
                    best = Some((j, u[j]));
                    break;
                }
            }
        }
        best.map(|(_, t)| t)
    }
}

/// What the mock has seen, for assertions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MockCounters {
    pub calls: u64,
    pub tokens: u64,
    pub rows: u64,
    pub restores: u64,
    pub zeros: u64,
    pub snapshots: u64,
}

pub struct MockExecutor {
    cfg: MockConfig,
    grammar: Grammar,
    block_size: usize,
    kv: Vec<u32>,
    ssm: Vec<Option<u64>>,
    /// The sampled rows gathered for the sampling tail.
    sampled: Vec<f32>,
    /// When the launched step's `step_delay` (its device time) ends; `finish` waits for it.
    busy_until: Option<Instant>,
    /// Scratch: a chunk's SSM state after each of its tokens.
    states: Vec<u64>,
    pub counters: MockCounters,
}

impl MockExecutor {
    pub fn new(cfg: MockConfig) -> Self {
        Self {
            grammar: Grammar::new(&cfg.units, cfg.vocab),
            cfg,
            block_size: 0,
            kv: Vec::new(),
            ssm: Vec::new(),
            sampled: Vec::new(),
            busy_until: None,
            states: Vec::new(),
            counters: MockCounters::default(),
        }
    }

    pub fn transformer() -> Self {
        Self::new(MockConfig::default())
    }

    pub fn hybrid() -> Self {
        Self::new(MockConfig {
            ssm_layers: 2,
            ..MockConfig::default()
        })
    }

    /// This mock with every step taking at least `delay` (see [`MockConfig::step_delay`]).
    pub fn with_step_delay(mut self, delay: Duration) -> Self {
        self.cfg.step_delay = delay;
        self
    }

    fn slot(&mut self, slot: u32) -> Result<&mut Option<u64>, ExecutorError> {
        self.ssm
            .get_mut(slot as usize)
            .ok_or(ExecutorError::BadSlot(slot))
    }

    fn kv_index(&self, table: &[u32], pos: usize) -> Result<usize, ExecutorError> {
        let bs = self.block_size;
        let block = *table
            .get(pos / bs)
            .ok_or_else(|| ExecutorError::InvalidBatch(format!("position {pos} outside table")))?;
        let i = block as usize * bs + pos % bs;
        if i >= self.kv.len() {
            return Err(ExecutorError::InvalidBatch(format!(
                "block {block} out of range"
            )));
        }
        Ok(i)
    }

    /// Applies `units` and `eos_one_in` to the sampling row of a context ending at `last`.
    fn shape_row(
        &self,
        row: &mut [f32],
        table: &[u32],
        last: usize,
        seed: u64,
    ) -> Result<(), ExecutorError> {
        let g = &self.grammar;
        let from = (last + 1).saturating_sub(g.longest.saturating_sub(1));
        let tail = (from..=last)
            .map(|pos| self.kv_index(table, pos).map(|k| self.kv[k]))
            .collect::<Result<Vec<u32>, _>>()?;
        if let Some(next) = g.continuation(&tail) {
            for (v, x) in row.iter_mut().enumerate() {
                if v != next as usize {
                    *x -= RULED_OUT;
                }
            }
            return Ok(());
        }
        for (x, &start) in row.iter_mut().zip(&g.starts) {
            if !start {
                *x -= RULED_OUT;
            }
        }
        if let Some(&eos) = self.cfg.eos.first()
            && self.cfg.eos_one_in > 0
            && mix(seed, EOS_DRAW).is_multiple_of(u64::from(self.cfg.eos_one_in))
            && let Some(x) = row.get_mut(eos as usize)
        {
            *x = EOS_LOGIT;
        }
        Ok(())
    }
}

fn mix(h: u64, x: u64) -> u64 {
    let mut z = (h ^ x).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl StepExecutor for MockExecutor {
    fn cache_spec(&self) -> CacheSpec {
        CacheSpec {
            attn_layers: 2,
            kv_heads: 1,
            head_dim: 8,
            ssm_layers: self.cfg.ssm_layers,
            conv_state_elems: 16,
            ssm_state_elems: 48,
            kv_elem_bytes: 4,
            conv_elem_bytes: 4,
            ssm_elem_bytes: 4,
        }
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }

    fn eos_token_ids(&self) -> &[u32] {
        &self.cfg.eos
    }

    fn allocate(&mut self, alloc: CacheAllocation) -> Result<(), ExecutorError> {
        self.block_size = alloc.block_size;
        self.kv = vec![UNWRITTEN; alloc.num_blocks * alloc.block_size];
        self.ssm = vec![None; alloc.num_ssm_slots];
        Ok(())
    }

    fn execute(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        self.launch(plan, out)?;
        self.finish(out)
    }

    /// Computes the step; its `step_delay` (the device's time) passes in `finish`, as a
    /// device computes while the host goes on.
    fn launch(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        self.launch_forward(plan, out)?;
        self.launch_tail(plan, out)
    }

    fn splits_tail(&self) -> bool {
        self.cfg.split_tail
    }

    /// The logits now, the device's time from now.
    fn launch_forward(
        &mut self,
        plan: &StepPlan,
        out: &mut StepOutput,
    ) -> Result<(), ExecutorError> {
        self.busy_until =
            (!self.cfg.step_delay.is_zero()).then(|| Instant::now() + self.cfg.step_delay);
        self.logits_rows(plan, &mut out.full)
    }

    /// The sampling tail over the logits of `launch_forward`, with `plan`'s masks as they are
    /// now.
    fn launch_tail(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        if plan.sampling.is_empty() {
            out.cands.reshape(0, 1);
            return Ok(());
        }
        // The sampling tail over the sampled rows, with the CPU backend's kernel.
        let vocab = out.full.vocab;
        self.sampled.clear();
        for &r in &plan.sample_rows {
            self.sampled.extend_from_slice(out.full.row(r as usize));
        }
        sample_tail(&mut self.sampled, vocab, &plan.sampling, &mut out.cands)
            .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))
    }

    /// Waits out the step's device time as a CUDA context does by default on a host with
    /// more cores than GPUs (`CU_CTX_SCHED_AUTO` spins): spinning, so that the host's caches
    /// and clock stay as warm as they do behind a real device.
    fn finish(&mut self, _out: &mut StepOutput) -> Result<(), ExecutorError> {
        if let Some(end) = self.busy_until.take() {
            while Instant::now() < end {
                std::hint::spin_loop();
            }
        }
        Ok(())
    }

    fn output_ready(&mut self) -> bool {
        self.busy_until.is_none_or(|end| Instant::now() >= end)
    }
}

impl MockExecutor {
    /// Every logits row of the plan (`logit_rows` order), unpenalised.
    fn logits_rows(&mut self, inputs: &StepPlan, logits: &mut Logits) -> Result<(), ExecutorError> {
        self.injected_failure(inputs)?;
        inputs
            .validate()
            .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        for op in &inputs.slot_ops {
            match *op {
                SlotOp::Copy { from, to } => self.copy_ssm_slot(from, to)?,
                SlotOp::Zero { slot } => self.zero_ssm_slot(slot)?,
            }
        }
        if inputs.tokens.len() != inputs.positions.len() {
            return Err(ExecutorError::InvalidBatch(
                "tokens and positions differ".into(),
            ));
        }
        let rows = inputs
            .seqs
            .iter()
            .map(|s| match (s.all_logits || s.sample_all, s.want_logits) {
                (true, _) => s.len,
                (false, want) => usize::from(want),
            })
            .sum();
        logits.reset(rows, self.cfg.vocab);
        let mut row = 0;
        for si in 0..inputs.seqs.len() {
            row = self.chunk_logits(inputs, si, logits, row)?;
        }
        Ok(())
    }

    /// Counts the call, then fails it as `fail_at_call`, `lose_device_on_token` or
    /// `fail_on_token` say.
    fn injected_failure(&mut self, inputs: &StepPlan) -> Result<(), ExecutorError> {
        let call = self.counters.calls;
        self.counters.calls += 1;
        if self.cfg.fail_at_call == Some(call) {
            return Err(ExecutorError::Forward("injected failure".into()));
        }
        if let Some(t) = self.cfg.lose_device_on_token
            && inputs.tokens.contains(&t)
        {
            return Err(ExecutorError::DeviceLost(format!(
                "injected: an illegal address in a batch holding token {t}"
            )));
        }
        if let Some(t) = self.cfg.fail_on_token
            && inputs.tokens.contains(&t)
        {
            return Err(ExecutorError::Forward(format!(
                "injected failure: the batch holds token {t}"
            )));
        }
        Ok(())
    }

    /// Chunk `si`: writes its tokens into the KV cache, advances its SSM state, and fills its
    /// logits rows from `row` on (its prompt rows, then its sampling row). Returns the next row.
    fn chunk_logits(
        &mut self,
        inputs: &StepPlan,
        si: usize,
        logits: &mut Logits,
        mut row: usize,
    ) -> Result<usize, ExecutorError> {
        let s = &inputs.seqs[si];
        let block_table = inputs.block_table(si);
        if s.len == 0 || s.offset + s.len > inputs.tokens.len() {
            return Err(ExecutorError::InvalidBatch("chunk out of range".into()));
        }
        let toks = &inputs.tokens[s.offset..s.offset + s.len];
        for (i, &t) in toks.iter().enumerate() {
            let pos = s.context_len + i;
            if inputs.positions[s.offset + i] as usize != pos {
                return Err(ExecutorError::InvalidBatch(
                    "positions do not continue".into(),
                ));
            }
            let k = self.kv_index(block_table, pos)?;
            self.kv[k] = t;
        }
        let mut states = std::mem::take(&mut self.states);
        states.clear();
        let state = if self.cfg.ssm_layers > 0 {
            self.advance_ssm(s.ssm_slot, toks, inputs.snapshots_of(si), &mut states)?
        } else {
            0
        };
        self.counters.tokens += s.len as u64;
        if s.sample_all {
            // A verify chunk: every position is sampled, from the state after it.
            for (i, &t) in toks.iter().enumerate() {
                let st = states.get(i).copied().unwrap_or(0);
                let pos = s.context_len + i;
                let seed = self.sampling_seed(block_table, st, pos, t)?;
                fill_row(logits.row_mut(row), seed);
                if self.grammar.is_active() {
                    self.shape_row(logits.row_mut(row), block_table, pos, seed)?;
                }
                row += 1;
                self.counters.rows += 1;
            }
            self.states = states;
            return Ok(row);
        }
        self.states = states;
        if s.all_logits {
            // Prompt positions: a pure function of position and token. The last token of
            // a final chunk gets the sampling row below.
            let upto = if s.want_logits { s.len - 1 } else { s.len };
            for (i, &t) in toks[..upto].iter().enumerate() {
                let seed = mix(mix(0x5eed, (s.context_len + i) as u64), u64::from(t));
                fill_row(logits.row_mut(row), seed);
                row += 1;
                self.counters.rows += 1;
            }
        }
        if !s.want_logits {
            return Ok(row);
        }
        let last = s.context_len + s.len - 1;
        let seed = self.sampling_seed(block_table, state, last, toks[s.len - 1])?;
        fill_row(logits.row_mut(row), seed);
        if self.grammar.is_active() {
            self.shape_row(logits.row_mut(row), block_table, last, seed)?;
        }
        self.counters.rows += 1;
        Ok(row + 1)
    }

    /// Runs the live SSM state of `slot` over `toks`, copying it into each snapshot slot at its
    /// point on the way; returns the state after the chunk.
    fn advance_ssm(
        &mut self,
        slot: u32,
        toks: &[u32],
        snapshots: &[SnapshotTarget],
        states: &mut Vec<u64>,
    ) -> Result<u64, ExecutorError> {
        let mut st = self
            .slot(slot)?
            .ok_or_else(|| ExecutorError::InvalidBatch("live SSM slot uninitialised".into()))?;
        let mut snaps = snapshots.iter().peekable();
        for (i, &t) in toks.iter().enumerate() {
            st = mix(st, u64::from(t));
            states.push(st);
            while let Some(sn) = snaps.next_if(|sn| sn.after as usize == i + 1) {
                if sn.slot == slot {
                    return Err(ExecutorError::InvalidBatch(
                        "snapshot into live slot".into(),
                    ));
                }
                *self.slot(sn.slot)? = Some(st);
                self.counters.snapshots += 1;
            }
        }
        if snaps.next().is_some() {
            return Err(ExecutorError::InvalidBatch(
                "snapshot point outside chunk".into(),
            ));
        }
        *self.slot(slot)? = Some(st);
        Ok(st)
    }

    /// The seed of the sampling row of a context ending at `last` (token `last_token`): the SSM
    /// `state` and, with `verify_kv`, every token read back through the block table (else just
    /// the last one).
    fn sampling_seed(
        &self,
        block_table: &[u32],
        state: u64,
        last: usize,
        last_token: u32,
    ) -> Result<u64, ExecutorError> {
        let mut seed = mix(state, last as u64);
        if !self.cfg.verify_kv {
            return Ok(mix(seed, u64::from(last_token)));
        }
        for pos in 0..=last {
            let t = self.kv[self.kv_index(block_table, pos)?];
            if t == UNWRITTEN {
                return Err(ExecutorError::InvalidBatch(format!(
                    "KV at {pos} never written"
                )));
            }
            seed = mix(seed, u64::from(t));
        }
        Ok(seed)
    }

    fn copy_ssm_slot(&mut self, src: u32, dst: u32) -> Result<(), ExecutorError> {
        let v = self.slot(src)?.ok_or_else(|| {
            ExecutorError::InvalidBatch(format!("restore from empty SSM slot {src}"))
        })?;
        *self.slot(dst)? = Some(v);
        self.counters.restores += 1;
        Ok(())
    }

    fn zero_ssm_slot(&mut self, slot: u32) -> Result<(), ExecutorError> {
        *self.slot(slot)? = Some(SSM_INIT);
        self.counters.zeros += 1;
        Ok(())
    }
}

/// Deterministic logits in [-4, 4) from `seed`.
fn fill_row(row: &mut [f32], seed: u64) {
    for (v, out) in row.iter_mut().enumerate() {
        let r = mix(seed, v as u64);
        *out = (r >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn plan() -> StepPlan {
        let mut p = StepPlan::default();
        p.clear(4);
        p
    }

    /// Executes `inp` on `m`: its output.
    fn run(m: &mut MockExecutor, inp: &StepPlan) -> StepOutput {
        let mut out = StepOutput::default();
        m.execute(inp, &mut out).unwrap();
        out
    }

    fn alloc(m: &mut MockExecutor) {
        m.allocate(CacheAllocation {
            num_blocks: 8,
            block_size: 4,
            num_ssm_slots: 3,
            max_tokens: 64,
            dtypes: Default::default(),
            max_running: 4,
        })
        .unwrap();
    }

    #[test]
    fn chunked_and_whole_prefill_agree_and_snapshots_restore() {
        let toks: Vec<u32> = (1..=10).collect();
        // Whole prompt in one chunk, snapshot after 8 tokens into slot 2.
        let mut a = MockExecutor::hybrid();
        alloc(&mut a);
        let mut inp = plan();
        inp.slot_ops.push(SlotOp::Zero { slot: 0 });
        inp.push(&toks, 0, &[0, 1, 2], 0, true);
        inp.snapshot(8, 2);
        inp.finish().unwrap();
        let la = run(&mut a, &inp);
        // Restore the snapshot into slot 1, reuse blocks 0-1, compute the last 2 tokens.
        let mut inp = plan();
        inp.slot_ops.push(SlotOp::Copy { from: 2, to: 1 });
        inp.push(&toks[8..], 8, &[0, 1, 5], 1, true);
        inp.finish().unwrap();
        let lb = run(&mut a, &inp);
        assert_eq!(la.full.data, lb.full.data);
        // Restoring from a zeroed slot instead gives different logits.
        inp.slot_ops = vec![SlotOp::Zero { slot: 1 }];
        let lc = run(&mut a, &inp);
        assert_ne!(la.full.data, lc.full.data);
    }

    #[test]
    fn wrong_block_table_changes_logits_or_errors() {
        let toks: Vec<u32> = (1..=6).collect();
        let mut m = MockExecutor::transformer();
        alloc(&mut m);
        let mut inp = plan();
        inp.push(&toks, 0, &[3, 4], 0, true);
        inp.finish().unwrap();
        run(&mut m, &inp);
        let mut inp = plan();
        inp.push(&toks[4..], 4, &[5, 4], 0, true);
        inp.finish().unwrap();
        assert!(
            m.execute(&inp, &mut StepOutput::default()).is_err(),
            "block 5 never written"
        );
    }

    /// Greedy decoding, one token per call, from `prompt` (8 blocks of 4: up to 32 tokens).
    fn greedy(m: &mut MockExecutor, prompt: &[u32], n: usize) -> Vec<u32> {
        let table: Vec<u32> = (0..8).collect();
        let mut toks = prompt.to_vec();
        let mut chunk = (0, prompt.to_vec());
        for _ in 0..n {
            let mut inp = plan();
            inp.push(&chunk.1, chunk.0, &table, 0, true);
            inp.finish().unwrap();
            let l = run(m, &inp);
            let row = l.full.row(0);
            let best = (0..row.len())
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap();
            chunk = (toks.len(), vec![best as u32]);
            toks.push(best as u32);
        }
        toks.split_off(prompt.len())
    }

    #[test]
    fn units_shape_the_output_into_whole_units_and_eos() {
        let units = vec![vec![3], vec![5, 6, 7], vec![9, 10], vec![2, 99]];
        let mut m = MockExecutor::new(MockConfig {
            vocab: 16,
            eos: vec![0],
            units: units.clone(),
            eos_one_in: 3,
            ..MockConfig::default()
        });
        alloc(&mut m);
        // The prompt ends inside unit [5, 6, 7]: the output completes it first.
        let out = greedy(&mut m, &[1, 5, 6], 28);
        assert_eq!(out[0], 7);
        let (mut i, mut eos) = (1, 0);
        while i < out.len() {
            if out[i] == 0 {
                eos += 1;
                i += 1;
                continue;
            }
            // [2, 99] has a token outside the vocabulary: it is never used.
            let u = units[..3]
                .iter()
                .find(|u| u[0] == out[i])
                .unwrap_or_else(|| panic!("{out:?}: {} starts no unit", out[i]));
            let end = (i + u.len()).min(out.len());
            assert_eq!(out[i..end], u[..end - i], "{out:?}");
            i = end;
        }
        assert!(eos > 0 && eos < 14, "EOS about one boundary in 3: {out:?}");
        // Without eos_one_in, EOS never comes.
        m.cfg.eos_one_in = 0;
        assert!(!greedy(&mut m, &[1, 5, 6], 28).contains(&0));
    }

    #[test]
    fn fail_on_token_fails_the_batch_that_holds_it() {
        let mut m = MockExecutor::new(MockConfig {
            fail_on_token: Some(7),
            ..MockConfig::default()
        });
        alloc(&mut m);
        let mut inp = plan();
        inp.push(&[1, 2], 0, &[0], 0, true);
        inp.finish().unwrap();
        assert!(m.execute(&inp, &mut StepOutput::default()).is_ok());
        inp.push(&[7], 0, &[1], 0, true);
        inp.finish().unwrap();
        assert!(matches!(
            m.execute(&inp, &mut StepOutput::default()),
            Err(ExecutorError::Forward(_))
        ));
    }

    #[test]
    fn restore_from_empty_slot_fails() {
        let mut m = MockExecutor::hybrid();
        alloc(&mut m);
        assert!(m.copy_ssm_slot(2, 0).is_err());
        assert_eq!(m.zero_ssm_slot(9), Err(ExecutorError::BadSlot(9)));
    }
}
