//! The engine's MTP pass (`speculative.method = "mtp"`): after every step, the model's
//! multi-token-prediction head ([`crate::model::mtp`]) runs over the rows the step kept, each
//! fed the token after it, so that its own K/V covers every computed position; from the last
//! row of each request that will speculate it then drafts a chain of `num_tokens` tokens,
//! which [`MtpDrafter`] hands to the scheduler when the request's next step is planned.
//!
//! Rows a step did not keep (drafts it rejected) are left out; so are requests the step
//! finished. While speculation is off (more than `max_batch` requests) steps are scheduled
//! ahead as without the head, which then cannot run (the step ahead replaces the hidden states
//! it reads): the requests of such a step stop drafting (`Request::mtp_stale`) until they
//! are recomputed, and requests admitted later draft as usual. The chain's own positions (past the last computed one) get blocks now — the
//! verify step that follows needs them anyway — and their head K/V is written over by the
//! pass after that step.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::Engine;
use super::executor::{MtpSource, StepExecutor};
use super::pipeline::Step;
use super::request::Phase;
use super::speculative::Drafter;
use crate::backend::StepPlan;

/// Drafts the MTP pass made, by request id: the request's token count they follow, and the
/// tokens.
type Made = Arc<Mutex<HashMap<u64, (usize, Vec<u32>)>>>;

/// The drafter of `speculative.method = "mtp"`: it proposes what the engine's last MTP pass
/// drafted for a request, when they follow its tokens as they are now (and nothing else).
pub struct MtpDrafter {
    made: Made,
}

impl Drafter for MtpDrafter {
    fn propose(&mut self, id: u64, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        let Ok(mut made) = self.made.lock() else {
            return;
        };
        if let Some((len, drafts)) = made.remove(&id)
            && len == tokens.len()
        {
            out.extend(drafts.iter().take(k));
        }
    }
}

/// One request's drafts being made.
struct Chain {
    slot: u32,
    id: u64,
    /// The request's token count the drafts follow.
    len: usize,
    /// Drafts wanted.
    k: usize,
    drafts: Vec<u32>,
}

/// The engine's side of the MTP pass: its plans and buffers, and the drafts it made.
#[derive(Default)]
pub struct MtpState {
    made: Made,
    plan: StepPlan,
    rows: Vec<u32>,
    chains: Vec<Chain>,
    drafts: Vec<u32>,
    warned: bool,
}

impl MtpState {
    /// The state and the drafter that reads what it drafts.
    pub fn new() -> (Self, MtpDrafter) {
        let state = Self::default();
        let drafter = MtpDrafter {
            made: state.made.clone(),
        };
        (state, drafter)
    }
}

impl<E: StepExecutor> Engine<E> {
    /// The MTP pass after `step` was applied (see the module doc). A failure leaves the
    /// requests without drafts (they decode plainly) and is logged once.
    pub(super) fn mtp_pass(&mut self, step: &Step, ahead: bool) {
        let Some(mut st) = self.mtp.take() else {
            return;
        };
        if ahead {
            // Speculation is off (a big batch) and steps overlap: the head's K/V misses these
            // rows, so their requests draft no more (until recomputed).
            for w in &step.work.seqs {
                if let Some(r) = self.sched.request_mut(w.slot) {
                    r.mtp_stale = true;
                }
            }
            self.mtp = Some(st);
            return;
        }
        if let Err(e) = self.run_mtp(step, &mut st) {
            if !std::mem::replace(&mut st.warned, true) {
                tracing::warn!(error = %e, "the MTP head could not draft (said once)");
            }
            if let Ok(mut made) = st.made.lock() {
                made.clear();
            }
        }
        self.mtp = Some(st);
    }

    fn run_mtp(&mut self, step: &Step, st: &mut MtpState) -> Result<(), super::ExecutorError> {
        st.chains.clear();
        if self.fill_pass(step, st)? {
            self.chain_passes(st)?;
        }
        if let Ok(mut made) = st.made.lock() {
            made.clear();
            for c in st.chains.drain(..) {
                made.insert(c.id, (c.len, c.drafts));
            }
        }
        Ok(())
    }

    /// The head over every row `step` kept, each fed the token after it; the first draft of
    /// each request that will speculate (its chain). False when the step kept no row.
    fn fill_pass(&mut self, step: &Step, st: &mut MtpState) -> Result<bool, super::ExecutorError> {
        let k_max = self.setup.speculative.num_tokens;
        let speculate = self.sched.speculation_active();
        st.plan.clear(self.layout.block_size);
        st.rows.clear();
        for (s, w) in step.plan.seqs.iter().zip(&step.work.seqs) {
            let Some(r) = self.sched.request(w.slot) else {
                continue;
            };
            if r.phase == Phase::Finished || r.mtp_stale || r.computed <= s.context_len {
                continue;
            }
            // The rows kept: those now computed (a verify chunk's accepted prefix).
            let kept = (r.computed - s.context_len).min(s.len);
            let (start, end) = (s.context_len, s.context_len + kept);
            if r.tokens.len() <= end {
                continue;
            }
            let left = r.max_tokens.saturating_sub(r.generated());
            let k = k_max.min(left.saturating_sub(1));
            let chain = speculate
                && k > 0
                && r.speculative
                && r.constraint.is_none()
                && r.spec_backoff == 0
                && r.phase == Phase::Running
                && r.computed + 1 == r.tokens.len();
            st.plan.push(
                &r.tokens[start + 1..=end],
                start,
                self.cache.block_table(w.slot),
                self.cache.live_slot(w.slot),
                chain,
            );
            st.rows
                .extend((s.offset..s.offset + kept).map(|i| i as u32));
            if chain {
                st.chains.push(Chain {
                    slot: w.slot,
                    id: r.id,
                    len: r.tokens.len(),
                    k,
                    drafts: Vec::with_capacity(k),
                });
            }
        }
        if st.plan.seqs.is_empty() {
            return Ok(false);
        }
        st.plan
            .finish()
            .map_err(|e| super::ExecutorError::InvalidBatch(e.to_string()))?;
        st.drafts.clear();
        self.executor
            .mtp_draft(&st.plan, MtpSource::Step, &st.rows, &mut st.drafts)?;
        for (c, &d) in st.chains.iter_mut().zip(&st.drafts) {
            c.drafts.push(d);
        }
        Ok(true)
    }

    /// Each further draft of the chains: one row per chain still going, at the position after
    /// its last draft's, fed that draft and the head's output for it. A chain whose position
    /// cannot get a block stops there.
    fn chain_passes(&mut self, st: &mut MtpState) -> Result<(), super::ExecutorError> {
        let mut going: Vec<usize> = (0..st.chains.len()).collect();
        for j in 1..self.setup.speculative.num_tokens {
            let mut next = Vec::with_capacity(going.len());
            st.plan.clear(self.layout.block_size);
            st.rows.clear();
            for (row, &i) in going.iter().enumerate() {
                let c = &st.chains[i];
                if c.drafts.len() >= c.k {
                    continue;
                }
                // The last computed position is `len - 2` (token `len - 1` was just sampled).
                let pos = c.len - 2 + j;
                if self.cache.grow(c.slot, pos + 1).is_err() {
                    continue;
                }
                st.plan.push(
                    &c.drafts[j - 1..j],
                    pos,
                    self.cache.block_table(c.slot),
                    self.cache.live_slot(c.slot),
                    true,
                );
                st.rows.push(row as u32);
                next.push(i);
            }
            if next.is_empty() {
                break;
            }
            st.plan
                .finish()
                .map_err(|e| super::ExecutorError::InvalidBatch(e.to_string()))?;
            st.drafts.clear();
            self.executor
                .mtp_draft(&st.plan, MtpSource::Chain, &st.rows, &mut st.drafts)?;
            for (&i, &d) in next.iter().zip(&st.drafts) {
                st.chains[i].drafts.push(d);
            }
            going = next;
        }
        Ok(())
    }
}
