//! `Engine`: one replica — its scheduler, caches, sampling stage and policy instances over a
//! [`StepExecutor`] — and what arrives from outside a step: requests added and checked,
//! cancels, a prefix-cache reset, the figures and cache events published.
//!
//! The step itself moves through the pipeline of [`super::pipeline`] (launch → schedule the
//! next step while the device computes → take in arrivals → complete → apply); the thread loop
//! around it lives in [`super::thread`]. The executor only sees the step's
//! [`crate::backend::StepPlan`]. Every request's events go out in order through the engine's
//! [`Outbox`]: `Tokens`…, then exactly one `Finished` or `Failed`; each public method hands
//! its events on before it returns, except that with a threaded outbox a step's events go to
//! the delivery thread early in the next step, once that step is launched on the executor, so
//! the hand-over overlaps the device's work (a step after which nothing runs hands them on
//! itself). An idle step changes nothing.

use std::sync::Arc;

use super::api::{
    EngineEvent, EngineStats, EventSender, FailureKind, FinishReason, GenerateRequest, KvEvent,
    Usage,
};
use super::config::{ConfigError, EngineSetup};
use super::executor::{CacheAllocation, ExecutorError, StepExecutor};
use super::opening::{Openings, Pending};
use super::outbox::Outbox;
use super::pipeline::Pipeline;
use super::request::{ActiveConstraint, Phase, Request};
use super::sampling::SamplingStage;
use super::scheduler::Scheduler;
use super::speculative::{Drafter, SpeculativeConfig};
use super::timings::StepTimings;
use crate::cache::{BlockHash, CacheLayout, CacheManager, HashSeed};
use crate::model::{CacheDtypes, CacheSpec};
use crate::policy::native::DefaultSampler;
use crate::policy::{Constrainer, Evictor, Sampler};

/// The policy instances of one replica.
pub struct Policies {
    /// The configured sampler (a Wasm plugin or a native one).
    pub sampler: Box<dyn Sampler>,
    /// The built-in sampler used when `sampler` answers `UseDefault` or something invalid.
    pub fallback_sampler: Box<dyn Sampler>,
    /// The configured eviction policy; `None` uses the cache's native LRU order.
    pub evictor: Option<Box<dyn Evictor>>,
    /// The constraint plugin's instance for this engine; `None` refuses constrained requests.
    pub constrainer: Option<Box<dyn Constrainer>>,
    /// A drafter built by the caller (a draft model's); `None` takes the one `[speculative]`
    /// names.
    pub drafter: Option<Box<dyn Drafter>>,
}

impl Policies {
    /// The built-in policies with no plugin: the native default sampler (greedy for greedy
    /// requests, seeded sampling otherwise) and native LRU eviction.
    pub fn builtin() -> Self {
        Self {
            sampler: Box::new(DefaultSampler::default()),
            fallback_sampler: Box::new(DefaultSampler::default()),
            evictor: None,
            constrainer: None,
            drafter: None,
        }
    }
}

/// Where the engine's figures and cache events go (the engine thread's `watch` and channel):
/// called with the current [`EngineStats`] and the cache events not yet handed on, which it
/// may take. See [`Engine::set_publisher`].
pub type Publisher = Box<dyn FnMut(&EngineStats, &mut Vec<KvEvent>) + Send>;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(
        "engine.max_batched_tokens = {tokens} is too small: with engine.max_running = {running} decoding requests a prefill chunk needs at least cache.block_size + 1 = {need} more tokens; raise engine.max_batched_tokens or lower engine.max_running"
    )]
    BudgetTooSmall {
        tokens: usize,
        running: usize,
        need: usize,
    },
    #[error("the executor could not allocate the caches: {0}")]
    Executor(#[from] ExecutorError),
    #[error(
        "speculative.method = \"mtp\": the model has no MTP head (a Qwen3.5 or Qwen3-Next checkpoint with mtp.* tensors, loaded with the method set)"
    )]
    NoMtpHead,
}

pub struct Engine<E: StepExecutor> {
    pub(super) setup: EngineSetup,
    pub(super) executor: E,
    pub(super) layout: CacheLayout,
    pub(super) cache: CacheManager,
    pub(super) sched: Scheduler,
    pub(super) sampling: SamplingStage,
    pub(super) policies: Policies,
    pub(super) eos: Vec<u32>,
    pub(super) vocab: usize,
    /// The launched step, the step scheduled ahead, and the spent ones.
    pub(super) pipeline: Pipeline,
    /// Requests whose stream was found closed, to cancel.
    pub(super) closed: Vec<u64>,
    pub(super) kv_events: Vec<KvEvent>,
    /// Constrained requests waiting for their grammar to compile.
    pub(super) openings: Openings,
    /// Where requests' events go (inline unless [`Self::set_outbox`] says otherwise).
    pub(super) outbox: Outbox,
    pub(super) stats: EngineStats,
    pub(super) timings: StepTimings,
    /// Set when a step failed with [`ExecutorError::DeviceLost`].
    pub(super) lost: bool,
    /// The MTP pass's state (`speculative.method = "mtp"`).
    pub(super) mtp: Option<super::mtp::MtpState>,
    publisher: Option<Publisher>,
    /// The figures of a publication deferred to the next step (see
    /// [`Self::defer_publication`]).
    deferred: Option<EngineStats>,
}

impl<E: StepExecutor> Engine<E> {
    /// Sizes the caches from the memory budget and lets the executor allocate them.
    pub fn new(
        setup: EngineSetup,
        mut executor: E,
        mut policies: Policies,
    ) -> Result<Self, EngineError> {
        let cfg = &setup.engine;
        let spec = executor.cache_spec();
        let (layout, draft_slots) = plan_layout(&setup, &spec)?;
        executor.allocate(CacheAllocation {
            num_blocks: layout.num_blocks,
            block_size: layout.block_size,
            num_ssm_slots: layout.ssm_slots(),
            max_tokens: cfg.max_batched_tokens,
            dtypes: CacheDtypes {
                kv: setup.cache.kv_dtype,
                ssm_state: setup.cache.ssm_state_dtype,
            },
            max_running: cfg.max_running,
        })?;
        let cache = CacheManager::new(
            &layout,
            setup.cache.prefix_caching,
            spec.is_hybrid(),
            policies.evictor.take(),
        )
        .with_snapshot_interval(setup.cache.ssm_snapshot_interval / layout.block_size.max(1));
        let mut cache = cache;
        cache.set_draft_slots(draft_slots);
        let mut sched = Scheduler::new(
            cfg.clone(),
            layout.block_size,
            HashSeed::new(&setup.hash_salt),
        );
        let mtp = speculation(&setup, &executor, &mut policies, &mut sched)?;
        let stats = EngineStats {
            total_blocks: layout.num_blocks as u32,
            free_blocks: layout.num_blocks as u32,
            ssm_slots_total: layout.ssm_slots() as u32,
            ssm_snapshot_slots: layout.durable_slots as u32,
            ssm_slot_bytes: layout
                .ssm_bytes
                .checked_div(layout.ssm_slots() as u64)
                .unwrap_or(0),
            ..Default::default()
        };
        Ok(Self {
            lost: false,
            mtp,
            sampling: SamplingStage::new(cfg.sampler_candidates),
            eos: executor.eos_token_ids().to_vec(),
            vocab: executor.vocab_size(),
            setup,
            executor,
            layout,
            cache,
            sched,
            policies,
            pipeline: Pipeline::default(),
            closed: Vec::new(),
            kv_events: Vec::new(),
            openings: Openings::default(),
            outbox: Outbox::inline(),
            stats,
            timings: StepTimings::default(),
            publisher: None,
            deferred: None,
        })
    }

    pub fn layout(&self) -> &CacheLayout {
        &self.layout
    }
    pub fn cache(&self) -> &CacheManager {
        &self.cache
    }
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }
    pub fn executor(&self) -> &E {
        &self.executor
    }
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }
    pub fn is_idle(&self) -> bool {
        self.sched.is_idle() && self.openings.is_empty()
    }

    /// Replaces the drafter (speculation on with `spec`, whatever `[speculative]` said); before
    /// the first request. Tests and benchmarks use it to verify chosen drafts; a hybrid needs
    /// the draft slots `spec` implies, planned at construction.
    pub fn set_drafter(&mut self, spec: SpeculativeConfig, drafter: Box<dyn Drafter>) {
        self.sched.set_speculation(spec, drafter, self.vocab);
    }

    /// Whether the executor's device was lost: the engine must stop (its thread exits, the
    /// router stops sending it work and `/health` reports the replica dead).
    /// Records the drafter's proposals from now on (see [`Scheduler::take_draft_log`]).
    pub fn record_drafts(&mut self, on: bool) {
        self.sched.record_drafts(on);
    }

    /// The proposals recorded since the last call: request id, its token count, the drafts.
    pub fn take_draft_log(&mut self) -> Vec<(u64, usize, Vec<u32>)> {
        self.sched.take_draft_log()
    }

    pub fn is_lost(&self) -> bool {
        self.lost
    }
    pub fn timings(&self) -> &StepTimings {
        &self.timings
    }
    /// Replaces how requests' events are delivered (the engine thread uses
    /// [`Outbox::threaded`]); before the first request, since requests are opened in the
    /// outbox that admits them. Returns false, changing nothing, once requests are in.
    pub fn set_outbox(&mut self, outbox: Outbox) -> bool {
        if !self.sched.ids().is_empty() {
            return false;
        }
        self.outbox = outbox;
        true
    }

    /// Cache events of the steps since the last call (only from steps that succeeded).
    pub fn take_kv_events(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.kv_events);
    }

    /// Sets where [`Self::publish`] sends the figures and cache events (the engine thread's
    /// watch and channel).
    pub fn set_publisher(&mut self, publisher: Publisher) {
        self.publisher = Some(publisher);
    }

    /// Hands the current figures and the cache events not yet taken to the publisher (nothing
    /// without one). Call [`Self::refresh_stats`] first for up-to-date figures.
    pub fn publish(&mut self) {
        self.deferred = None;
        if let Some(p) = self.publisher.as_mut() {
            p(&self.stats, &mut self.kv_events);
        }
    }

    /// Leaves the publication of the step that just ran to the next step, which publishes
    /// while the device computes (between the executor's launch and finish), so that waking
    /// the figures' and events' readers does not keep the device waiting. It publishes the
    /// figures as they are now (refresh them first) and the cache events not yet taken then.
    /// Whoever defers must [`Self::publish`] before waiting for work or stopping, where no
    /// step follows; a step that runs no batch does not publish.
    pub fn defer_publication(&mut self) {
        self.deferred = Some(self.stats.clone());
    }

    /// Sends a deferred publication, if one is due (while the device computes a step).
    pub(super) fn publish_deferred(&mut self) {
        if let Some(stats) = self.deferred.take()
            && let Some(p) = self.publisher.as_mut()
        {
            p(&stats, &mut self.kv_events);
        }
    }

    /// Whether a deferred publication is still due.
    pub fn publication_due(&self) -> bool {
        self.deferred.is_some()
    }

    /// Queues a request; bad input is answered with `Failed` on its own channel. Block hashes
    /// the sender computed are adopted rather than computed again.
    pub fn add(&mut self, mut req: GenerateRequest, events: impl Into<EventSender>) {
        let events = events.into();
        if let Err((kind, message)) = self.check(&req) {
            self.outbox
                .reject(req.id, &events, EngineEvent::Failed { kind, message });
            return self.outbox.flush();
        }
        let (id, hashes) = (req.id, req.block_hashes.take());
        let bs = self.layout.block_size as u32;
        self.stats.checkpoints_requested +=
            req.checkpoints.iter().filter(|&&o| o >= bs).count() as u64;
        self.outbox.open(id, &events);
        let min_ban = if req.params.min_tokens > 0 {
            let mut ban = req.stop_token_ids.clone();
            if !req.ignore_eos {
                ban.extend(&self.eos);
            }
            ban.sort_unstable();
            ban.dedup();
            ban
        } else {
            Vec::new()
        };
        if let Some(grammar) = req.constraint.take() {
            if let Err(message) = self.can_constrain() {
                let failed = EngineEvent::Failed {
                    kind: FailureKind::InvalidRequest,
                    message,
                };
                self.outbox.reject(id, &events, failed);
                return self.outbox.flush();
            }
            self.openings
                .push(Pending::new(req, events, min_ban, hashes, grammar));
            // With a step on the device, compilations start after its masks (`pump_opens`).
            if !self.pipeline.is_launched() {
                self.pump_opens(true);
            }
            return;
        }
        self.admit(req, events, min_ban, hashes, None);
    }

    /// Queues a request whose matcher (if it has a grammar) is open.
    fn admit(
        &mut self,
        req: GenerateRequest,
        events: EventSender,
        min_ban: Vec<u32>,
        hashes: Option<Arc<[BlockHash]>>,
        constraint: Option<ActiveConstraint>,
    ) {
        let id = req.id;
        self.sched.add(|slot| {
            let mut r = Request::new(req, slot, events);
            r.min_ban = min_ban;
            r.constraint = constraint;
            r
        });
        if let Some(h) = hashes
            && !self.sched.adopt_hashes(id, &h)
        {
            // A server whose cache salt or block size differs from the engine's: said once.
            static WARNED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    request = id,
                    "sent block hashes differ from the engine's (salt or block size); rehashing"
                );
            }
        }
    }

    /// Takes in the grammars that compiled (their requests join the queue, or fail if the
    /// plugin refused the grammar) and, with `start`, starts compiling those waiting.
    pub(super) fn pump_opens(&mut self, start: bool) {
        if self.openings.is_empty() {
            return;
        }
        let Some(c) = self.policies.constrainer.as_deref_mut() else {
            return;
        };
        for (p, r) in self.openings.pump(c, start) {
            match r {
                Ok(matcher) => {
                    let constraint = ActiveConstraint {
                        matcher,
                        fed: std::cell::Cell::new(0),
                    };
                    self.admit(p.req, p.events, p.min_ban, p.hashes, Some(constraint));
                }
                Err(e) => {
                    // The server checks grammars before submitting; one refused here got past it.
                    let kind = &p.grammar.kind;
                    tracing::warn!(request = p.req.id, kind = %kind, error = %e, "a grammar was refused at admission");
                    let message = format!("the {kind} grammar: {e}");
                    let failed = EngineEvent::Failed {
                        kind: FailureKind::InvalidRequest,
                        message,
                    };
                    self.outbox.send(p.req.id, &p.events, failed);
                }
            }
        }
    }

    /// Why a request cannot be queued, if it cannot.
    fn check(&self, req: &GenerateRequest) -> Result<(), (FailureKind, String)> {
        use FailureKind::{InvalidRequest, QueueFull};
        if req.prompt.is_empty() {
            return Err((InvalidRequest, "the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err((InvalidRequest, "max_tokens must be at least 1".into()));
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err((
                InvalidRequest,
                format!("token id {t} is outside the vocabulary ({})", self.vocab),
            ));
        }
        if let Some(&o) =
            (req.checkpoints.iter()).find(|&&o| o == 0 || o as usize > req.prompt.len())
        {
            return Err((
                InvalidRequest,
                format!(
                    "checkpoint offset {o} is outside the prompt (1 ..= {})",
                    req.prompt.len()
                ),
            ));
        }
        if self.sched.contains(req.id) {
            return Err((
                InvalidRequest,
                format!("request id {} is already in use", req.id),
            ));
        }
        if self.sched.num_waiting() >= self.setup.engine.max_waiting {
            return Err((
                QueueFull,
                format!("{} requests are already waiting", self.sched.num_waiting()),
            ));
        }
        Ok(())
    }

    /// Cancels a request wherever it is; its blocks return to the pool at once, or once the
    /// launched step that holds it is applied.
    pub fn cancel(&mut self, id: u64) {
        if let Some((req, events)) = self.openings.cancel(id) {
            // Its grammar is compiling: it never reached the scheduler.
            let usage = Usage {
                prompt_tokens: req.prompt.len() as u32,
                ..Usage::default()
            };
            let reason = FinishReason::Cancelled;
            self.outbox
                .send(id, &events, EngineEvent::Finished { reason, usage });
            self.stats.requests_finished += 1;
        }
        self.retire(id, Some(FinishReason::Cancelled));
        self.close_constraints();
        self.outbox.flush();
        self.refresh_stats();
    }

    /// Ends request `id`: sends `Finished` with `reason` (unless it finished before) and
    /// removes it with its cache state, or, while a step of the pipeline holds it, marks it
    /// `Finished`, to be removed once no step does.
    pub(super) fn retire(&mut self, id: u64, reason: Option<FinishReason>) {
        let Some(slot) = self.sched.slot_of(id) else {
            return;
        };
        let Some(r) = self.sched.request(slot) else {
            return;
        };
        let (phase, holds) = (r.phase, r.holds);
        if phase != Phase::Finished
            && let Some(reason) = reason
        {
            Self::send_finished(&mut self.outbox, &mut self.stats, r, reason);
        }
        if holds > 0 {
            self.sched.mark_finished(slot);
        } else {
            self.sched.remove(id, &mut self.cache);
        }
    }

    /// Cancels everything in flight (shutdown).
    pub fn cancel_all(&mut self) {
        for id in self.openings.ids() {
            self.cancel(id);
        }
        for id in self.sched.ids() {
            self.cancel(id);
        }
    }

    /// Drops every cached block and snapshot; running requests keep theirs.
    pub fn reset_prefix_cache(&mut self) {
        self.cache.reset_prefix_cache();
        self.cache.take_events(&mut self.kv_events);
        self.refresh_stats();
    }

    fn send_finished(
        outbox: &mut Outbox,
        stats: &mut EngineStats,
        r: &Request,
        reason: FinishReason,
    ) {
        let usage = Usage {
            prompt_tokens: r.orig_prompt_len as u32,
            completion_tokens: r.generated() as u32,
            cached_tokens: r.cached_tokens as u32,
            cacheable_tokens: r.cacheable_tokens as u32,
            cache_miss: r.cache_miss,
        };
        outbox.send(r.id, &r.events, EngineEvent::Finished { reason, usage });
        stats.requests_finished += 1;
    }

    /// Why this engine cannot take a constrained request, if it cannot.
    fn can_constrain(&self) -> Result<(), String> {
        if !self.executor.applies_token_masks() {
            return Err(
                "constrained responses (response_format, structured_outputs, forced tool calls) \
                 are not supported on this backend yet; serve on the CPU backend for them"
                    .into(),
            );
        }
        if self.policies.constrainer.is_none() {
            return Err("this server has no constraint plugin for constrained responses".into());
        }
        Ok(())
    }

    /// Closes the matchers of requests that left the scheduler.
    pub(super) fn close_constraints(&mut self) {
        let closed = self.sched.take_closed_matchers();
        if let Some(c) = self.policies.constrainer.as_mut() {
            for m in closed {
                c.close(m);
            }
        }
    }

    pub(super) fn fail(&mut self, r: Request, kind: FailureKind, message: String) {
        (self.outbox).send(r.id, &r.events, EngineEvent::Failed { kind, message });
    }

    /// Brings the load and cache figures of [`Self::stats`] up to date (done after every step;
    /// call it after commands to publish their effect).
    /// The engine thread is about to block waiting for requests: the device's next idle gap
    /// is not host overhead.
    pub fn note_wait(&mut self) {
        self.pipeline.note_wait();
    }

    pub fn refresh_stats(&mut self) {
        let s = &mut self.stats;
        self.timings.fill(s);
        let kinds = self.executor.step_kinds();
        s.steps_eager = kinds.eager;
        s.steps_decode_graph = kinds.decode_graph;
        s.steps_mixed_graph = kinds.mixed_graph;
        let pool = self.cache.pool();
        let c = self.cache.counters;
        s.running = self.sched.num_running() as u32;
        s.waiting = (self.sched.num_waiting() + self.openings.len()) as u32;
        s.paused = self.sched.num_paused() as u32;
        s.free_blocks = pool.available() as u32;
        s.cached_blocks = pool.indexed() as u32;
        s.ssm_snapshots_used = self.cache.ssm().snapshots() as u32;
        s.prompt_tokens_cached = c.prefix_hits;
        s.prefix_cache_queries = c.prefix_queries;
        s.prefix_cache_hits = c.prefix_hits;
        s.ssm_restores = c.ssm_restores;
        s.cache_misses = c.misses;
        s.ssm_snapshot_copies = c.snapshot_copies + c.rolling_copies;
        s.ssm_rolling_copies = c.rolling_copies;
        s.ssm_checkpoint_copies = c.checkpoint_copies;
        s.ssm_snapshots_skipped = c.snapshots_skipped + c.rolling_skipped;
        s.ssm_rolling_kept = c.rolling_kept;
        let spec = &self.sched.spec_counters;
        s.spec_drafts = spec.drafts;
        s.spec_draft_tokens = spec.draft_tokens;
        s.spec_accepted_tokens = spec.accepted_tokens;
        if s.spec_accepted_per_pos != spec.accepted_per_pos {
            s.spec_accepted_per_pos.clone_from(&spec.accepted_per_pos);
        }
    }
}

/// The cache layout for `setup` over a model of `spec`, and the slots a hybrid sets aside for
/// speculative drafts; the configuration checked first (a chunked-prefill budget must fit a
/// decode of every running request beside one block of prompt).
/// Turns speculative decoding on in `sched` as `[speculative]` says, with the caller's
/// drafter where it built one; for the "mtp" method, the MTP pass's state (the executor must
/// have the head).
fn speculation<E: StepExecutor>(
    setup: &EngineSetup,
    executor: &E,
    policies: &mut Policies,
    sched: &mut Scheduler,
) -> Result<Option<super::mtp::MtpState>, EngineError> {
    let spec = &setup.speculative;
    if spec.method == "mtp" {
        if !executor.has_mtp() {
            return Err(EngineError::NoMtpHead);
        }
        let (state, drafter) = super::mtp::MtpState::new();
        sched.set_speculation(spec.clone(), Box::new(drafter), executor.vocab_size());
        return Ok(Some(state));
    }
    if let Some(drafter) = policies.drafter.take().or_else(|| spec.drafter()) {
        sched.set_speculation(spec.clone(), drafter, executor.vocab_size());
    }
    Ok(None)
}

fn plan_layout(setup: &EngineSetup, spec: &CacheSpec) -> Result<(CacheLayout, usize), EngineError> {
    let cfg = &setup.engine;
    cfg.validate()?;
    setup
        .speculative
        .validate()
        .map_err(ConfigError::Speculative)?;
    // A hybrid's draft slots are planned as live slots, then set aside.
    let draft_slots = if spec.is_hybrid() {
        setup.speculative.draft_slots(cfg.max_running)
    } else {
        0
    };
    let layout = CacheLayout::plan(&setup.cache, spec, cfg.max_running + draft_slots)
        .map_err(ConfigError::from)?;
    let need = layout.block_size + 1;
    if cfg.chunked_prefill && cfg.max_batched_tokens < cfg.max_running - 1 + need {
        return Err(EngineError::BudgetTooSmall {
            tokens: cfg.max_batched_tokens,
            running: cfg.max_running,
            need,
        });
    }
    Ok((layout, draft_slots))
}
