//! The scheduler: which requests run this step and how many tokens each (continuous batching
//! with chunked prefill, one code path for prefill and decode).
//!
//! Each step, under a token budget and a running-request budget:
//! 1. running requests get their tokens: decodes first (one token each), then prefill chunks,
//!    oldest first; a request whose next tokens need a block that cannot be had is *paused*
//!    (keeps its blocks, skips the step); a paused request *resumes* as soon as its block can
//!    be had;
//! 2. if paused requests exist and nothing at all could run, the newest paused request is
//!    *evicted*: its blocks are released and it goes to the front of the queue to be
//!    recomputed (prompt + generated tokens, re-hashed);
//! 3. only when nothing is paused, waiting requests are admitted in order; a request whose next
//!    uncached prompt block is being computed by another request this step waits one step so it
//!    hits the cache instead (the others go ahead); a request that can never fit fails.
//!
//! Chunk rules: a non-final prefill chunk ends on a block boundary and leaves at least 2
//! prompt tokens, so no 1-token prefill chunk exists; only the first chunk of a request may
//! skip tokens (by the cache manager's match), never a continuation chunk.
//!
//! The output is plain data ([`SchedulerOutput`]); `schedule` and `update_from_output` run
//! without a model. The scheduler never touches block ids or device memory.

use std::collections::{HashMap, HashSet, VecDeque};

use super::api::FailureKind;
use super::config::EngineConfig;
use super::request::{Phase, Request};
use super::speculative::{DraftAsk, Drafter, SpecCounters, SpeculativeConfig, accepted, backoff};
use crate::cache::{BlockHash, CacheError, CacheManager, HashSeed, PrefixMatch, SsmInit};
use crate::model::SsmSnapshot;

/// One request's share of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledSeq {
    pub slot: u32,
    /// Tokens of the request already in the cache (= start of this chunk).
    pub start: usize,
    pub len: usize,
    /// The chunk reaches the end of the known tokens: sample from its last logits.
    pub want_logits: bool,
    /// Logits of every token of the chunk are wanted too (prompt logprobs).
    pub all_logits: bool,
    /// A verify chunk: its last `drafts` tokens are the request's drafts
    /// ([`Request::drafts`]), and every token is a sampled row. 0 for any other chunk.
    pub drafts: usize,
    pub snapshots: Vec<SsmSnapshot>,
}

impl ScheduledSeq {
    /// Sampled rows of this chunk.
    pub fn rows(&self) -> usize {
        if self.want_logits { 1 + self.drafts } else { 0 }
    }
}

/// A request leaving the scheduler because it can never run.
#[derive(Debug)]
pub struct Rejected {
    pub request: Request,
    pub kind: FailureKind,
    pub message: String,
}

/// The plan for one step.
#[derive(Debug, Default)]
pub struct SchedulerOutput {
    pub step: u64,
    pub seqs: Vec<ScheduledSeq>,
    pub num_tokens: usize,
    /// SSM-state setup of newly admitted requests, to run before the forward pass.
    pub ssm_init: Vec<SsmInit>,
    pub admitted: Vec<u64>,
    pub resumed: Vec<u64>,
    pub paused: Vec<u64>,
    pub evicted: Vec<u64>,
    /// Requests that waited a step for a prefix another request is computing.
    pub deferred: Vec<u64>,
    /// Hashes of the uncached prompt blocks this step computes.
    pub computing: HashSet<BlockHash, crate::cache::hash::DigestBuildHasher>,
}

impl SchedulerOutput {
    fn clear(&mut self) {
        self.seqs.clear();
        self.num_tokens = 0;
        self.ssm_init.clear();
        self.admitted.clear();
        self.resumed.clear();
        self.paused.clear();
        self.evicted.clear();
        self.deferred.clear();
        self.computing.clear();
    }
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

/// Why a sampled token ended a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    Stop,
    Length,
}

pub struct Scheduler {
    cfg: EngineConfig,
    block_size: usize,
    seed: HashSeed,
    slots: Vec<Option<Request>>,
    free_slots: Vec<u32>,
    /// Matchers of removed constrained requests, not yet closed.
    closed_matchers: Vec<u32>,
    by_id: HashMap<u64, u32>,
    waiting: VecDeque<u32>,
    /// Running and paused requests in admission order.
    running: Vec<u32>,
    num_paused: usize,
    step: u64,
    /// The launched step not yet applied, and the hashes of the prompt blocks it computes: a
    /// prompt that needs one of them waits for it rather than computing it again.
    launched_step: Option<u64>,
    launched_computing: HashSet<BlockHash, crate::cache::hash::DigestBuildHasher>,
    rejected: Vec<Rejected>,
    pub preemptions: u64,
    pub prefix_waits: u64,
    /// Block hashes this scheduler computed itself (prompts without adopted hashes, checks
    /// of adopted ones, recomputes after preemption).
    pub blocks_hashed: u64,
    /// Speculative decoding: its settings and drafter (`None`: off).
    spec: SpeculativeConfig,
    drafter: Option<Box<dyn Drafter>>,
    vocab: usize,
    pub spec_counters: SpecCounters,
    /// Every proposal the drafter made (of at least one draft), when recording (tests compare
    /// drafters with their references): request id, its token count, the drafts kept.
    draft_log: Option<Vec<(u64, usize, Vec<u32>)>>,
}

impl Scheduler {
    pub fn new(cfg: EngineConfig, block_size: usize, seed: HashSeed) -> Self {
        Self {
            cfg,
            block_size,
            seed,
            slots: Vec::new(),
            free_slots: Vec::new(),
            closed_matchers: Vec::new(),
            by_id: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            num_paused: 0,
            step: 0,
            launched_step: None,
            launched_computing: HashSet::default(),
            rejected: Vec::new(),
            preemptions: 0,
            prefix_waits: 0,
            blocks_hashed: 0,
            spec: SpeculativeConfig::default(),
            drafter: None,
            vocab: 0,
            spec_counters: SpecCounters::default(),
            draft_log: None,
        }
    }

    /// Turns speculative decoding on with `drafter` (`spec` says how far) for a model of
    /// `vocab` tokens (drafts from the first one outside it on are dropped).
    pub fn set_speculation(
        &mut self,
        spec: SpeculativeConfig,
        drafter: Box<dyn Drafter>,
        vocab: usize,
    ) {
        self.spec = spec;
        self.drafter = Some(drafter);
        self.vocab = vocab;
    }

    /// Starts (or stops) recording the drafter's proposals ([`Self::take_draft_log`]).
    pub fn record_drafts(&mut self, on: bool) {
        self.draft_log = on.then(Vec::new);
    }

    /// The proposals recorded since the last call: request id, the request's token count
    /// when asked, the drafts (after the vocabulary check).
    pub fn take_draft_log(&mut self) -> Vec<(u64, usize, Vec<u32>)> {
        self.draft_log
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Whether the next step may carry verify chunks: speculation is on and few enough
    /// requests run. The engine then schedules each step after the one before it is applied
    /// (a request's drafts follow its last accepted token).
    pub fn speculation_active(&self) -> bool {
        self.drafter.is_some() && self.num_running() <= self.spec.max_batch
    }

    /// Drafts for every running request that may speculate this step, asked of the drafter
    /// in one batch and left in [`Request::drafts`] (at most `num_tokens`, and one fewer than
    /// the tokens the request may still emit; the step's token budget trims them when the
    /// request is scheduled). A request backing off counts one decode down instead.
    fn draft_all(&mut self) {
        let Some(drafter) = self.drafter.as_mut() else {
            return;
        };
        let mut asks = Vec::new();
        for &slot in &self.running {
            let Some(r) = self.slots[slot as usize].as_mut() else {
                continue;
            };
            if r.phase != Phase::Running
                || !r.speculative
                || r.constraint.is_some()
                || r.in_flight > 0
                || r.is_prefill()
                || r.computed + 1 != r.tokens.len()
            {
                continue;
            }
            if r.spec_backoff > 0 {
                r.spec_backoff -= 1;
                continue;
            }
            let left = r.max_tokens.saturating_sub(r.generated());
            let k = self.spec.num_tokens.min(left.saturating_sub(1));
            if k > 0 {
                asks.push((slot, k));
            }
        }
        if asks.is_empty() {
            return;
        }
        let requests: Vec<DraftAsk<'_>> = asks
            .iter()
            .filter_map(|&(slot, k)| {
                let r = self.slots[slot as usize].as_ref()?;
                Some(DraftAsk {
                    id: r.id,
                    tokens: &r.tokens,
                    k,
                })
            })
            .collect();
        let mut drafts = vec![Vec::new(); requests.len()];
        drafter.propose_many(&requests, &mut drafts);
        drop(requests);
        for ((slot, k), mut d) in asks.into_iter().zip(drafts) {
            let valid = d
                .iter()
                .take(k)
                .take_while(|&&t| (t as usize) < self.vocab)
                .count();
            if valid < d.len().min(k) {
                static WARNED: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(
                        vocab = self.vocab,
                        "the drafter proposed a token outside the vocabulary; drafts from it on are dropped (said once)"
                    );
                }
            }
            d.truncate(valid);
            if let Some(r) = self.slots[slot as usize].as_mut() {
                if let Some(log) = self.draft_log.as_mut()
                    && !d.is_empty()
                {
                    log.push((r.id, r.tokens.len(), d.clone()));
                }
                r.drafts = d;
            }
        }
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len() - self.num_paused
    }
    pub fn num_paused(&self) -> usize {
        self.num_paused
    }
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }
    pub fn contains(&self, id: u64) -> bool {
        self.by_id.contains_key(&id)
    }
    pub fn request(&self, slot: u32) -> Option<&Request> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }
    pub fn request_mut(&mut self, slot: u32) -> Option<&mut Request> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }
    /// Requests rejected by the latest `schedule` (they hold no cache state).
    pub fn take_rejected(&mut self) -> Vec<Rejected> {
        std::mem::take(&mut self.rejected)
    }

    /// Queues a request built by `make` for a fresh slot (the slot becomes its sequence id).
    pub fn add(&mut self, make: impl FnOnce(u32) -> Request) {
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.slots.push(None);
            (self.slots.len() - 1) as u32
        });
        let mut r = make(slot);
        r.slot = slot;
        r.phase = Phase::Waiting;
        self.by_id.insert(r.id, slot);
        self.slots[slot as usize] = Some(r);
        self.enqueue(slot, false);
    }

    /// Puts `slot` in the waiting queue: at the back (a new request) or the front (one that
    /// was running) under "fcfs"; under "priority" among the requests of its priority, after
    /// them (new) or before them (was running), behind every better one.
    fn enqueue(&mut self, slot: u32, front: bool) {
        if !self.cfg.by_priority() {
            if front {
                self.waiting.push_front(slot);
            } else {
                self.waiting.push_back(slot);
            }
            return;
        }
        let p = self.request(slot).map_or(0, |r| r.priority);
        let prio = |s: &u32| self.request(*s).map_or(0, |r| r.priority);
        let at = if front {
            self.waiting.iter().position(|s| prio(s) >= p)
        } else {
            self.waiting.iter().position(|s| prio(s) > p)
        }
        .unwrap_or(self.waiting.len());
        self.waiting.insert(at, slot);
    }

    /// Gives the waiting request `id` the block hashes its sender computed, if they are the
    /// chain this scheduler would compute: one per full prompt block, and the first equal to
    /// this scheduler's hash of the first block (same salt, same block size; this check is the
    /// only hashing an adopted prompt costs). Returns whether they were adopted; if not, the
    /// prompt is hashed at admission as usual.
    pub fn adopt_hashes(&mut self, id: u64, hashes: &[BlockHash]) -> bool {
        let bs = self.block_size;
        let Some(r) = self
            .by_id
            .get(&id)
            .and_then(|&slot| self.slots.get_mut(slot as usize))
            .and_then(Option::as_mut)
        else {
            return false;
        };
        if r.phase != Phase::Waiting || !r.hashes.is_empty() || hashes.len() != r.prompt_len / bs {
            return false;
        }
        if let Some(&first) = hashes.first() {
            self.blocks_hashed += 1;
            if self.seed.block(None, &r.tokens[..bs]) != first {
                return false;
            }
        }
        r.hashes.extend_from_slice(hashes);
        true
    }

    /// Removes a request wherever it is, releasing its cache state at once.
    pub fn remove(&mut self, id: u64, cache: &mut CacheManager) -> Option<Request> {
        let slot = self.by_id.remove(&id)?;
        let r = self.slots.get_mut(slot as usize)?.take()?;
        match r.phase {
            Phase::Waiting => self.waiting.retain(|&s| s != slot),
            Phase::Running | Phase::Paused | Phase::Finished => {
                if r.phase == Phase::Paused {
                    self.num_paused -= 1;
                }
                // A slot is running once: stop at it and shift the rest (a retain over
                // every running request, at each of a step's removals, was 1.6 % of a
                // decode profile at 256 requests).
                if let Some(i) = self.running.iter().position(|&s| s == slot) {
                    self.running.remove(i);
                }
                if let Err(e) = cache.release(slot) {
                    tracing::error!(request = id, error = %e, "releasing cache state failed");
                }
            }
        }
        self.free_slots.push(slot);
        if let Some(c) = &r.constraint {
            self.closed_matchers.push(c.matcher);
        }
        Some(r)
    }

    /// Matchers of constrained requests removed since the last call, for the engine to close.
    pub fn take_closed_matchers(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.closed_matchers)
    }

    /// Ids of every request, in no particular order.
    pub fn ids(&self) -> Vec<u64> {
        self.by_id.keys().copied().collect()
    }

    /// Plans the next step into `out` (cleared first). It may run while the launched step
    /// computes: that step's chunks count as computed, each of its sampled rows as a token to
    /// come, and a request it ends by length is not scheduled again. Every request `out`
    /// schedules counts it as a step holding it until [`Self::release`].
    pub fn schedule(&mut self, cache: &mut CacheManager, out: &mut SchedulerOutput) {
        self.step += 1;
        cache.begin_step(self.step);
        self.mark_wanted(cache);
        out.clear();
        out.step = self.step;
        let mut budget = self.cfg.max_batched_tokens;
        let drafted = self.speculation_active();
        if drafted {
            self.draft_all();
        }
        loop {
            self.schedule_running(cache, out, &mut budget, true);
            self.schedule_running(cache, out, &mut budget, false);
            if !out.seqs.is_empty() || self.num_paused == 0 {
                break;
            }
            if !self.evict_newest_paused(cache, out) {
                break;
            }
        }
        if drafted {
            // Drafts of requests this step did not verify (out of budget) are stale by the
            // next step.
            for &slot in &self.running {
                let verifying = out.seqs.iter().any(|s| s.slot == slot && s.drafts > 0);
                if let Some(r) = self.slots[slot as usize].as_mut()
                    && !verifying
                    && r.in_flight == 0
                {
                    r.drafts.clear();
                }
            }
        }
        if self.num_paused == 0 {
            self.admit_waiting(cache, out, &mut budget);
        }
        out.num_tokens = self.cfg.max_batched_tokens - budget;
    }

    /// Admits requests that arrived after `out`, the newest step, was scheduled into it,
    /// while it is not launched (the step before computes), with what is left of its token
    /// budget, by the rules of [`Self::schedule`]'s admission. Returns how many it admitted;
    /// rebuild the step's plan when any.
    pub fn top_up(&mut self, cache: &mut CacheManager, out: &mut SchedulerOutput) -> usize {
        if self.num_paused > 0 || self.waiting.is_empty() || out.step != self.step {
            return 0;
        }
        let before = out.admitted.len();
        let mut budget = self.cfg.max_batched_tokens - out.num_tokens;
        self.admit_waiting(cache, out, &mut budget);
        out.num_tokens = self.cfg.max_batched_tokens - budget;
        out.admitted.len() - before
    }

    /// `out` was launched: its chunks count as computed and each sampled row as a token to
    /// come, for the steps scheduled before its output is applied.
    pub fn launched(&mut self, out: &SchedulerOutput) {
        for s in &out.seqs {
            if let Some(r) = self.slots[s.slot as usize].as_mut() {
                r.computed = s.start + s.len;
                r.in_flight += usize::from(s.want_logits);
            }
        }
        self.launched_step = Some(out.step);
        self.launched_computing.clear();
        self.launched_computing
            .extend(out.computing.iter().copied());
    }

    /// `step` leaves the pipeline (applied, dropped or failed): each request it scheduled
    /// counts one step fewer holding it, and one that is done ([`Phase::Finished`]) and held
    /// by no step any more is removed with its cache state.
    pub fn release(&mut self, step: &SchedulerOutput, cache: &mut CacheManager) {
        if self.launched_step == Some(step.step) {
            self.launched_step = None;
            self.launched_computing.clear();
        }
        for s in &step.seqs {
            let Some(r) = self.slots[s.slot as usize].as_mut() else {
                continue;
            };
            r.holds = r.holds.saturating_sub(1);
            if r.holds == 0 && r.phase == Phase::Finished {
                let id = r.id;
                self.remove(id, cache);
            }
        }
    }

    /// Drops `out`, scheduled but not launched (the step before it failed): the requests it
    /// admitted go back to the front of the queue, holding no cache state, to be admitted
    /// afresh; the others keep their place. Abort the step's cache plans first.
    pub fn discard(&mut self, cache: &mut CacheManager, out: &mut SchedulerOutput) {
        for &id in out.admitted.iter().rev() {
            let Some(&slot) = self.by_id.get(&id) else {
                continue;
            };
            let Some(r) = self.slots[slot as usize].as_mut() else {
                continue;
            };
            if r.phase != Phase::Running {
                continue;
            }
            r.phase = Phase::Waiting;
            r.computed = 0;
            self.running.retain(|&s| s != slot);
            if let Err(e) = cache.release(slot) {
                tracing::error!(request = id, error = %e, "releasing a discarded admission failed");
            }
            self.enqueue(slot, true);
        }
        for s in &out.seqs {
            if let Some(r) = self.slots[s.slot as usize].as_mut() {
                r.hash_pending = false;
                if s.drafts > 0 {
                    r.drafts.clear();
                }
            }
        }
        self.release(out, cache);
        out.clear();
    }

    /// The slot of request `id`.
    pub fn slot_of(&self, id: u64) -> Option<u32> {
        self.by_id.get(&id).copied()
    }

    /// Marks a request done while a step still holds it (see [`Phase::Finished`]).
    pub fn mark_finished(&mut self, slot: u32) {
        self.set_phase(slot, Phase::Finished);
    }
    /// Length of the next chunk of a prompt with `remaining` tokens left from `ctx`.
    fn chunk_len(&self, ctx: usize, remaining: usize, budget: usize) -> usize {
        chunk_len(
            self.block_size,
            self.cfg.chunked_prefill,
            ctx,
            remaining,
            budget,
        )
    }

    fn schedule_running(
        &mut self,
        cache: &mut CacheManager,
        out: &mut SchedulerOutput,
        budget: &mut usize,
        decodes: bool,
    ) {
        let speculate = decodes && self.speculation_active();
        for i in 0..self.running.len() {
            if *budget == 0 {
                return;
            }
            let slot = self.running[i];
            let Some(r) = self.slots[slot as usize].as_ref() else {
                continue;
            };
            let (start, total, phase) = (r.computed, r.total_len(), r.phase);
            // Done, ended by length by the token the launched step samples, or verifying
            // drafts (its next position is not known yet).
            if phase == Phase::Finished
                || r.in_flight > 0 && r.generated() + r.in_flight >= r.max_tokens
                || r.in_flight > 0 && !r.drafts.is_empty()
            {
                continue;
            }
            if r.is_prefill() == decodes {
                continue;
            }
            let n = if decodes {
                1
            } else {
                self.chunk_len(start, r.prompt_len - start, prefill_budget(r, *budget))
            };
            if decodes && speculate && self.verify(cache, out, slot, budget) {
                continue;
            }
            if n == 0 {
                continue;
            }
            if cache.grow(slot, start + n).is_err() {
                if phase == Phase::Running {
                    self.set_phase(slot, Phase::Paused);
                    out.paused.push(self.id_of(slot));
                }
                continue;
            }
            if phase == Phase::Paused {
                self.set_phase(slot, Phase::Running);
                out.resumed.push(self.id_of(slot));
            }
            self.push_seq(cache, out, slot, start, n, start + n == total);
            *budget -= n;
        }
    }

    /// Schedules running request `slot` as a verify chunk when it has drafts and their
    /// blocks and draft slots can be had; false leaves it to be scheduled as a plain decode.
    fn verify(
        &mut self,
        cache: &mut CacheManager,
        out: &mut SchedulerOutput,
        slot: u32,
        budget: &mut usize,
    ) -> bool {
        let Some(r) = self.slots[slot as usize].as_mut() else {
            return false;
        };
        // Drafted by `draft_all` for this step; the token budget may trim them.
        r.drafts.truncate(budget.saturating_sub(1));
        let k = r.drafts.len();
        let (start, phase) = (r.computed, r.phase);
        if k == 0 || cache.grow(slot, start + 1 + k).is_err() {
            r.drafts.clear();
            return false;
        }
        let mut snapshots = match cache.draft_slots(slot, k) {
            Some(slots) => (slots.iter().enumerate())
                .map(|(j, &slot)| SsmSnapshot { after: j + 1, slot })
                .collect::<Vec<_>>(),
            None => {
                r.drafts.clear();
                return false;
            }
        };
        // A block boundary inside the chunk: the rolling snapshot there (named once the
        // accepted tokens are known; worthless if they stop short of it).
        let bs = self.block_size;
        let end = start + 1 + k;
        let boundary = end / bs * bs;
        if boundary > start && cache.prefix_caching() {
            cache.plan_rolling_snapshot(slot, None, boundary - start, &mut snapshots);
            snapshots.sort_by_key(|s| s.after);
        }
        if phase == Phase::Paused {
            self.set_phase(slot, Phase::Running);
            out.resumed.push(self.id_of(slot));
        }
        self.push_chunk(out, slot, start, 1 + k, true, false, snapshots);
        if let Some(s) = out.seqs.last_mut() {
            s.drafts = k;
        }
        *budget -= 1 + k;
        true
    }

    fn set_phase(&mut self, slot: u32, phase: Phase) {
        if let Some(r) = self.slots[slot as usize].as_mut() {
            match (r.phase, phase) {
                (Phase::Running, Phase::Paused) => self.num_paused += 1,
                (Phase::Paused, Phase::Running | Phase::Waiting | Phase::Finished) => {
                    self.num_paused -= 1
                }
                _ => {}
            }
            r.phase = phase;
        }
    }

    fn id_of(&self, slot: u32) -> u64 {
        self.request(slot).map_or(u64::MAX, |r| r.id)
    }

    /// Adds a chunk to the output, with SSM snapshot points and the hashes it will complete.
    #[allow(clippy::too_many_arguments)]
    fn push_seq(
        &mut self,
        cache: &mut CacheManager,
        out: &mut SchedulerOutput,
        slot: u32,
        start: usize,
        n: usize,
        last: bool,
    ) {
        let mut snapshots = Vec::new();
        let all_logits = self.slots[slot as usize]
            .as_ref()
            .is_some_and(|r| r.prompt_logprobs.is_some() && start < r.orig_prompt_len);
        let bs = self.block_size;
        if let Some(r) = self.slots[slot as usize].as_mut()
            && start >= r.prompt_len
            && (start + n).is_multiple_of(bs)
            && cache.prefix_caching()
        {
            // A decode completes an output block: hash it (it enters the index when this step
            // succeeds) and, on a hybrid, refresh the request's rolling snapshot there. Its
            // last token may still be being sampled: then both wait for it.
            if start + n > r.tokens.len() {
                r.hash_pending = true;
                cache.plan_rolling_snapshot(slot, None, n, &mut snapshots);
                return self.push_chunk(out, slot, start, n, last, all_logits, snapshots);
            }
            let before = r.hashes.len();
            self.seed.extend(&mut r.hashes, &r.tokens[..start + n], bs);
            self.blocks_hashed += (r.hashes.len() - before) as u64;
            if let Some(&h) = r.hashes.get((start + n) / bs - 1) {
                cache.plan_rolling_snapshot(slot, Some(h), n, &mut snapshots);
            }
        }
        if let Some(r) = self.slots[slot as usize].as_ref()
            && start < r.prompt_len
        {
            cache.plan_snapshots(
                slot,
                &r.hashes,
                r.prompt_len,
                r.kv_match,
                &r.checkpoints,
                start,
                n,
                &mut snapshots,
            );
            let end = ((start + n) / bs).min(r.hashes.len());
            for &h in &r.hashes[(start / bs).min(end)..end] {
                if !cache.is_cached(h) {
                    out.computing.insert(h);
                }
            }
        }
        self.push_chunk(out, slot, start, n, last, all_logits, snapshots);
    }

    #[allow(clippy::too_many_arguments)]
    fn push_chunk(
        &mut self,
        out: &mut SchedulerOutput,
        slot: u32,
        start: usize,
        n: usize,
        last: bool,
        all_logits: bool,
        snapshots: Vec<SsmSnapshot>,
    ) {
        if let Some(r) = self.slots[slot as usize].as_mut() {
            r.holds += 1;
        }
        out.seqs.push(ScheduledSeq {
            slot,
            start,
            len: n,
            want_logits: last,
            all_logits,
            drafts: 0,
            snapshots,
        });
    }

    /// Evicts the newest paused request that no step holds (under the priority policy: the
    /// newest of the worst priority); false when there is none.
    fn evict_newest_paused(&mut self, cache: &mut CacheManager, out: &mut SchedulerOutput) -> bool {
        let evictable = |s: u32| {
            self.request(s)
                .filter(|r| r.phase == Phase::Paused && r.holds == 0)
                .map(|r| r.priority)
        };
        let found = if self.cfg.by_priority() {
            (self.running.iter().enumerate())
                .filter_map(|(i, &s)| evictable(s).map(|p| (p, i)))
                .max()
                .map(|(_, i)| i)
        } else {
            self.running.iter().rposition(|&s| evictable(s).is_some())
        };
        let Some(pos) = found else {
            return false;
        };
        let slot = self.running.remove(pos);
        self.set_phase(slot, Phase::Waiting);
        if let Err(e) = cache.release(slot) {
            tracing::error!(slot, error = %e, "releasing an evicted request failed");
        }
        let seed = self.seed;
        let bs = self.block_size;
        if let Some(r) = self.slots[slot as usize].as_mut() {
            r.prompt_len = r.tokens.len();
            r.computed = 0;
            r.mtp_stale = false;
            r.preemptions += 1;
            // Its draft slots went with its cache state; it starts again from the tokens.
            r.drafts.clear();
            let before = r.hashes.len();
            seed.extend(&mut r.hashes, &r.tokens, bs);
            self.blocks_hashed += (r.hashes.len() - before) as u64;
            out.evicted.push(r.id);
        }
        self.preemptions += 1;
        self.enqueue(slot, true);
        true
    }

    fn reject(&mut self, i: usize, kind: FailureKind, message: String) {
        if let Some(slot) = self.waiting.remove(i) {
            if let Some(r) = self.slots[slot as usize].take() {
                self.by_id.remove(&r.id);
                self.rejected.push(Rejected {
                    request: r,
                    kind,
                    message,
                });
            }
            self.free_slots.push(slot);
        }
    }

    /// Why request `r` can never run here, if it cannot: its whole sequence, prompt and every
    /// token it may generate, must fit the cache alone (or it would run, be preempted, and
    /// fail only once it had filled it), and without chunked prefill its prompt must fit a
    /// step.
    fn never_fits(
        cfg: &EngineConfig,
        bs: usize,
        r: &Request,
        cache: &CacheManager,
    ) -> Option<String> {
        let longest = r.orig_prompt_len + r.max_tokens;
        if longest.div_ceil(bs) > cache.total_blocks() {
            return Some(format!(
                "the prompt ({} tokens) and max_tokens ({}) need {} KV blocks but the cache holds {} ({} tokens): lower max_tokens, shorten the prompt, or raise cache.memory_budget",
                r.orig_prompt_len,
                r.max_tokens,
                longest.div_ceil(bs),
                cache.total_blocks(),
                cache.total_blocks() * bs
            ));
        }
        if !cfg.chunked_prefill && r.prompt_len > cfg.max_batched_tokens {
            return Some(format!(
                "the prompt has {} tokens but engine.max_batched_tokens is {} and chunked prefill is off",
                r.prompt_len, cfg.max_batched_tokens
            ));
        }
        None
    }

    /// Tells the cache which snapshots the first [`WANTED_HEAD`] waiting requests will resume
    /// from, so that this step's new snapshots do not take them (a turn that arrived on its
    /// conversation's cached state would otherwise lose it to the running requests' snapshots
    /// while it waits, least recently used as it is). Only while every snapshot slot is taken,
    /// the only time one is given up; otherwise nothing is matched.
    fn mark_wanted(&mut self, cache: &mut CacheManager) {
        if !cache.snapshot_slots_full() {
            cache.set_wanted(Vec::new());
            return;
        }
        let bs = self.block_size;
        let mut wanted = Vec::new();
        for &slot in self.waiting.iter().take(WANTED_HEAD) {
            let Some(r) = self.slots[slot as usize].as_mut() else {
                continue;
            };
            if r.prompt_logprobs.is_some() {
                continue;
            }
            self.blocks_hashed += hash_prompt(&self.seed, r, bs);
            wanted.extend(cache.resume_block(&r.hashes, r.prompt_len));
        }
        cache.set_wanted(wanted);
    }

    fn admit_waiting(
        &mut self,
        cache: &mut CacheManager,
        out: &mut SchedulerOutput,
        budget: &mut usize,
    ) {
        let bs = self.block_size;
        let mut i = 0;
        while i < self.waiting.len() && *budget > 0 && self.running.len() < self.cfg.max_running {
            let slot = self.waiting[i];
            let Some(r) = self.slots[slot as usize].as_mut() else {
                self.waiting.remove(i);
                continue;
            };
            let prompt_len = r.prompt_len;
            if let Some(msg) = Self::never_fits(&self.cfg, bs, r, cache) {
                self.reject(i, FailureKind::PromptTooLong, msg);
                continue;
            }
            self.blocks_hashed += hash_prompt(&self.seed, r, bs);
            let mut m = cache.match_prefix(&r.hashes, prompt_len);
            if r.prompt_logprobs.is_some() {
                // Prompt logprobs need the logits of every prompt position: nothing is
                // skipped. The matched blocks stay pinned, as when an SSM snapshot is missing,
                // so the cache's parent links hold while the prompt is recomputed.
                m.skip_blocks = 0;
            }
            if cache.prefix_caching()
                && r.hashes.get(m.kv_blocks).is_some_and(|h| {
                    out.computing.contains(h) || self.launched_computing.contains(h)
                })
            {
                if !out.deferred.contains(&r.id) {
                    // (Counted once a step, however often the step is topped up.)
                    out.deferred.push(r.id);
                    self.prefix_waits += 1;
                }
                i += 1;
                continue;
            }
            let ctx = m.skip_blocks * bs;
            let n = chunk_len(
                bs,
                self.cfg.chunked_prefill,
                ctx,
                prompt_len - ctx,
                prefill_budget(r, *budget),
            );
            if n == 0 {
                break;
            }
            let init = match cache.admit(slot, &r.hashes, m, ctx + n) {
                Ok(init) => init,
                // Not enough free blocks: it waits, and the requests behind it with it.
                Err(CacheError::NoSpace) => break,
                Err(e) => {
                    self.reject(i, FailureKind::Cache, e.to_string());
                    continue;
                }
            };
            note_admission(r, cache, m, ctx, bs);
            r.phase = Phase::Running;
            out.admitted.push(r.id);
            let last = ctx + n == r.total_len();
            out.ssm_init.push(init);
            self.waiting.remove(i);
            self.running.push(slot);
            self.push_seq(cache, out, slot, ctx, n, last);
            *budget -= n;
        }
    }

    /// Applies the launched step `step` after it succeeded: offers the prompt and output
    /// blocks its chunks completed to the cache and appends the sampled tokens (`sampled`:
    /// every sampled row in chunk order, [`ScheduledSeq::rows`] per chunk); a request the step
    /// reached only ahead of its stop ([`Phase::Finished`]) takes nothing. A verify chunk
    /// appends its accepted drafts and the token after them, up to a stop; its rejected
    /// positions are rolled back (see [`super::speculative`]). `emitted` gets, per chunk with
    /// rows, how many of its rows' tokens were appended. Pushes the requests that stopped,
    /// with the reason. Commit the step's cache plans after this, then [`Self::release`] it.
    pub fn update_from_output(
        &mut self,
        cache: &mut CacheManager,
        step: &SchedulerOutput,
        sampled: &[u32],
        eos: &[u32],
        finished: &mut Vec<(u32, StopReason)>,
        emitted: &mut Vec<u32>,
    ) {
        let bs = self.block_size;
        emitted.clear();
        // One pass: a sequence's commit reads only its own hashes, which the token appended
        // after it does not change.
        let mut row = 0;
        for s in &step.seqs {
            let rows = sampled.get(row..row + s.rows()).unwrap_or(&[]);
            row += s.rows();
            if s.want_logits {
                emitted.push(0);
            }
            let Some(r) = self.slots[s.slot as usize].as_mut() else {
                continue;
            };
            if r.phase == Phase::Finished {
                continue;
            }
            if s.drafts > 0 {
                let n = Self::apply_verify(
                    &self.seed,
                    &mut self.blocks_hashed,
                    cache,
                    r,
                    s,
                    rows,
                    eos,
                    finished,
                );
                self.spec_counters
                    .count(s.drafts, n.saturating_sub(1).min(s.drafts));
                if let Some(e) = emitted.last_mut() {
                    *e = n as u32;
                }
                continue;
            }
            cache.commit_seq(s.slot, &r.hashes, &r.tokens, s.start + s.len);
            if !s.want_logits {
                continue;
            }
            r.in_flight = r.in_flight.saturating_sub(1);
            let Some(&tok) = rows.first() else {
                continue;
            };
            if let Some(e) = emitted.last_mut() {
                *e = 1;
            }
            r.tokens.push(tok);
            if std::mem::take(&mut r.hash_pending) {
                // The step scheduled ahead decodes this token and completes a block with it.
                let before = r.hashes.len();
                self.seed.extend(&mut r.hashes, &r.tokens, bs);
                self.blocks_hashed += (r.hashes.len() - before) as u64;
                if let Some(&h) = r.hashes.get(r.tokens.len() / bs - 1) {
                    cache.set_rolling_hash(s.slot, h);
                }
            }
            if let Some(why) = stop_after(r, tok, eos) {
                finished.push((s.slot, why));
            }
        }
    }

    /// Applies verify chunk `s` of request `r` (`rows`: its sampled tokens): the accepted
    /// drafts and the token after them are appended, up to a stop; the request's computed
    /// tokens end after the last accepted one, blocks past them are released, its block
    /// hashes and commits cover accepted tokens only, its rolling snapshot is named if the
    /// accepted tokens reach it, and where a draft was rejected the draft slot holding the
    /// recurrent state after the last accepted token becomes the live slot. Returns the tokens
    /// appended.
    #[allow(clippy::too_many_arguments)]
    #[cold]
    #[inline(never)]
    fn apply_verify(
        seed: &HashSeed,
        blocks_hashed: &mut u64,
        cache: &mut CacheManager,
        r: &mut Request,
        s: &ScheduledSeq,
        rows: &[u32],
        eos: &[u32],
        finished: &mut Vec<(u32, StopReason)>,
    ) -> usize {
        let bs = cache.block_size();
        r.in_flight = r.in_flight.saturating_sub(1);
        let drafts = std::mem::take(&mut r.drafts);
        let a = accepted(rows, &drafts[..s.drafts.min(drafts.len())]);
        // The chunk's first token and the accepted drafts are computed; the rest is not.
        let computed = s.start + 1 + a;
        r.computed = computed;
        r.spec_misses = if a == 0 { r.spec_misses + 1 } else { 0 };
        r.spec_backoff = backoff(r.spec_misses);
        if a < s.drafts {
            // The live state ran past the last accepted token; draft slot `a` holds the
            // state after the chunk's first `1 + a` tokens and becomes the live slot (no step
            // is scheduled ahead while requests speculate, so none has read the old one).
            if !cache.adopt_draft(s.slot, a) {
                // Cannot happen while the verify chunk holds its draft slots; the live state
                // would run past the accepted tokens, so say so loudly.
                tracing::error!(
                    request = r.id,
                    accepted = a,
                    "no draft slot to roll the recurrent state back to"
                );
            }
        }
        if let Err(e) = cache.shrink(s.slot, computed + 1) {
            tracing::error!(request = r.id, error = %e, "releasing rejected draft blocks failed");
        }
        let mut n = 0;
        for &tok in &rows[..(a + 1).min(rows.len())] {
            r.tokens.push(tok);
            n += 1;
            if let Some(why) = stop_after(r, tok, eos) {
                finished.push((s.slot, why));
                break;
            }
        }
        if cache.prefix_caching() {
            let before = r.hashes.len();
            seed.extend(&mut r.hashes, &r.tokens[..computed], bs);
            *blocks_hashed += (r.hashes.len() - before) as u64;
            cache.commit_seq(s.slot, &r.hashes, &r.tokens, computed);
            // The rolling snapshot planned at the chunk's last block boundary holds that
            // block's end state only if the accepted tokens reach it.
            let boundary = (s.start + s.len) / bs * bs;
            if boundary > s.start
                && computed >= boundary
                && let Some(&h) = r.hashes.get(boundary / bs - 1)
            {
                cache.set_rolling_hash(s.slot, h);
            }
        }
        n
    }
}

/// Why `r` stops after appending `tok`, if it does.
#[inline]
fn stop_after(r: &Request, tok: u32, eos: &[u32]) -> Option<StopReason> {
    let stop = r.generated() >= r.params.min_tokens as usize
        && (r.stop_token_ids.contains(&tok) || (!r.ignore_eos && eos.contains(&tok)));
    if stop {
        Some(StopReason::Stop)
    } else if r.generated() >= r.max_tokens {
        Some(StopReason::Length)
    } else {
        None
    }
}

/// Records an admission from `ctx` (the prefix the cache serves) in the request and the
/// cache's counters; the first admission fixes the request's cache figures.
fn note_admission(
    r: &mut Request,
    cache: &mut CacheManager,
    m: PrefixMatch,
    ctx: usize,
    bs: usize,
) {
    let prompt_len = r.prompt_len;
    cache.count_prefix_query(prompt_len, ctx);
    r.computed = ctx;
    r.kv_match = m.kv_blocks;
    if !r.admitted_once {
        r.admitted_once = true;
        r.cached_tokens = ctx;
        r.cacheable_tokens = cache.cacheable_blocks(prompt_len) * bs;
        r.cache_miss = cache.miss_reason(&r.hashes, prompt_len, m, r.prompt_logprobs.is_some());
        cache.count_miss(r.cache_miss);
    }
}

/// Prompt tokens per step of a request that wants prompt logprobs: every one of them returns
/// a full row of logits, so this bounds that request's rows to this many × vocab per step
/// (with chunked prefill on).
const PROMPT_LOGITS_CHUNK: usize = 128;

/// Waiting requests whose resume snapshots [`Scheduler::mark_wanted`] keeps: the head of the
/// queue, those the next steps admit (bounded so that a long queue costs a step little).
const WANTED_HEAD: usize = 64;

/// Extends `r`'s block hashes over its whole prompt where they fall short (they are computed
/// when first needed); returns how many blocks it hashed.
fn hash_prompt(seed: &HashSeed, r: &mut Request, bs: usize) -> u64 {
    let prompt_len = r.prompt_len;
    if r.hashes.len() >= prompt_len / bs {
        return 0;
    }
    let before = r.hashes.len();
    seed.extend(&mut r.hashes, &r.tokens[..prompt_len], bs);
    (r.hashes.len() - before) as u64
}

/// The token budget `r`'s next prefill chunk may use.
fn prefill_budget(r: &Request, budget: usize) -> usize {
    if r.prompt_logprobs.is_some() {
        budget.min(PROMPT_LOGITS_CHUNK)
    } else {
        budget
    }
}

/// Length of the next prefill chunk from `ctx` with `remaining` prompt tokens left and
/// `budget` tokens available (0: not this step).
fn chunk_len(bs: usize, chunked: bool, ctx: usize, remaining: usize, budget: usize) -> usize {
    if remaining <= budget {
        return remaining;
    }
    if !chunked {
        return 0;
    }

    let mut end = (ctx + budget) / bs * bs;
    while end > ctx && ctx + remaining - end < 2 {
        end -= bs;
    }
    end.saturating_sub(ctx)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "scheduler_tests.rs"]
mod tests;
