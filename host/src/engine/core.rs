//! `Engine`: one replica's step — schedule → build inputs → forward → sample → update — over
//! a [`StepExecutor`].
//!
//! **Scheduling ahead** (`engine.schedule_ahead`, on by default). While a launched step
//! computes, the next one is scheduled and built: the launched step's chunks count as computed
//! and each of its sampled rows as a token to come, which the next step's decodes take as a
//! placeholder. When the launched step's output is in, it is sampled, the tokens are written
//! into the placeholders, the next step is launched, and only then is the first step applied
//! (tokens appended, stops found, blocks committed, events queued) — while the device computes
//! the second. The device waits for the host only for the read-back, the sampler and the
//! launch. A request that stops runs one wasted row in the step after (it is `Finished`: its
//! events are out, it is never scheduled again, its cache state is released once that step is
//! applied), and a request the launched step ends by length is not scheduled again. Requests
//! that arrive while the launched step computes join the step scheduled ahead
//! ([`Engine::step_with`]), as they would join the next step without scheduling ahead. A step
//! that scores prompt tokens is not followed by one scheduled ahead, and a step whose penalised
//! rows need a token still being sampled is built again once it is known. Output is the same
//! as scheduling after each step's update.
//!
//! The engine owns the scheduler, the cache manager, the sampling stage and its policy
//! instances; the executor only sees the step's [`StepPlan`]. Every request's events go out in
//! order through the engine's [`Outbox`]: `Tokens`…, then exactly one `Finished` or `Failed`;
//! each public method hands its events on before it returns, except that with a threaded
//! outbox a step's events go to the delivery thread early in the next step, once that step is
//! launched on the executor, so the hand-over overlaps the device's work (a step after which
//! nothing runs hands them on itself). Cache events of a step are released
//! only after its forward pass succeeded; a failed pass fails the requests in that batch, rolls
//! back the step's snapshot reservations and leaves every other request and the cache intact.
//! An idle step changes nothing. The thread loop around it lives in `engine::thread`.

use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use super::api::{
    EngineEvent, EngineStats, FailureKind, FinishReason, GenerateRequest, KvEvent, TokenLogprob,
    Usage,
};
use super::config::{ConfigError, EngineSetup};
use super::executor::{CacheAllocation, ExecutorError, StepExecutor, StepOutput};
use super::outbox::Outbox;
use super::request::{Phase, Request};
use super::sampling::{GreedySampler, Sampled, SamplingStage, token_logprob};
use super::scheduler::{Scheduler, StopReason};
use super::step_plan;
use crate::backend::StepPlan;
use crate::cache::{CacheLayout, CacheManager, HashSeed};
use crate::policy::{Evictor, Sampler};

/// The policy instances of one replica.
pub struct Policies {
    /// The configured sampler (a Wasm plugin or a native one).
    pub sampler: Box<dyn Sampler>,
    /// The built-in sampler used when `sampler` answers `UseDefault` or something invalid.
    pub fallback_sampler: Box<dyn Sampler>,
    /// The configured eviction policy; `None` uses the cache's native LRU order.
    pub evictor: Option<Box<dyn Evictor>>,
}

impl Policies {
    /// Greedy sampling and native LRU eviction.
    pub fn greedy() -> Self {
        Self {
            sampler: Box::new(GreedySampler),
            fallback_sampler: Box::new(GreedySampler),
            evictor: None,
        }
    }
}

/// Where the engine's figures and cache events go (the engine thread's `watch` and channel):
/// called with the current [`EngineStats`] and the cache events not yet handed on, which it
/// may take. See [`Engine::set_publisher`].
pub type Publisher = Box<dyn FnMut(&EngineStats, &mut Vec<KvEvent>) + Send>;

/// Cumulative wall time of each phase of the steps that ran a batch (nanoseconds). Scheduling
/// ahead, `schedule_ns` and `inputs_ns` of every step but the first after a wait run while the
/// device computes the step before; the device waits only for the sampling (in `update_ns`)
/// and the launch's part before its upload.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTimings {
    pub steps: u64,
    /// Scheduling, admission and cache bookkeeping.
    pub schedule_ns: u64,
    /// Building the step plan.
    pub inputs_ns: u64,
    /// The executor's forward pass: launching it and waiting for its results.
    pub execute_ns: u64,
    /// Of `execute_ns`, the launch: uploading the step and enqueueing its work (on a device,
    /// the part before the upload's copy keeps the device waiting).
    pub launch_ns: u64,
    /// Host work done while the device computes the step (between the executor's launch and
    /// its finish): handing the previous step's events to the delivery thread and its block
    /// events to the eviction policy, and a deferred publication of figures and cache events
    /// ([`Engine::defer_publication`]). Not part of the time the device waits for the host.
    pub overlap_ns: u64,
    /// Sampling, committing the step to the cache and sending events (includes `sample_ns`,
    /// not the next step's launch).
    pub update_ns: u64,
    /// Between back-to-back steps: from the end of one step's update to the start of the next
    /// step's scheduling (the engine loop: commands, cancels, stats and cache events out).
    pub between_ns: u64,
    /// Penalties, top-K candidates, the sampler call and logprobs.
    pub sample_ns: u64,
    /// Of `execute_ns`, taking in requests that arrived while the device computed and
    /// admitting them into the step scheduled ahead (its plan built again).
    pub top_up_ns: u64,
    /// Requests admitted into a step scheduled ahead after it was scheduled.
    pub late_admissions: u64,
    /// Device time of the executed steps (CUDA events; 0 on the CPU).
    pub device_busy_ns: u64,
    /// Device time idle between back-to-back steps: from one step's read-back to the next
    /// step's first operation, counted only when the engine had work waiting throughout
    /// (not after waiting for requests).
    pub device_idle_ns: u64,
    /// Steps whose idle gap was counted.
    pub device_gaps: u64,
}

impl StepTimings {
    /// What was added since `before` (an earlier reading of the same engine's timings).
    pub fn since(&self, before: &StepTimings) -> StepTimings {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        StepTimings {
            steps: d(self.steps, before.steps),
            schedule_ns: d(self.schedule_ns, before.schedule_ns),
            inputs_ns: d(self.inputs_ns, before.inputs_ns),
            execute_ns: d(self.execute_ns, before.execute_ns),
            launch_ns: d(self.launch_ns, before.launch_ns),
            overlap_ns: d(self.overlap_ns, before.overlap_ns),
            update_ns: d(self.update_ns, before.update_ns),
            between_ns: d(self.between_ns, before.between_ns),
            sample_ns: d(self.sample_ns, before.sample_ns),
            top_up_ns: d(self.top_up_ns, before.top_up_ns),
            late_admissions: d(self.late_admissions, before.late_admissions),
            device_busy_ns: d(self.device_busy_ns, before.device_busy_ns),
            device_idle_ns: d(self.device_idle_ns, before.device_idle_ns),
            device_gaps: d(self.device_gaps, before.device_gaps),
        }
    }
}

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
}

/// What became of the step scheduled ahead by the time the launched one's output is in.
enum Next {
    /// None was scheduled.
    None,
    /// Built, waiting for the launched step's tokens.
    Ready,
    /// Built without a penalty history it needs: built again after the launched step is applied.
    Late,
    /// Its plan could not be built.
    Failed(ExecutorError),
}

pub struct Engine<E: StepExecutor> {
    setup: EngineSetup,
    executor: E,
    layout: CacheLayout,
    cache: CacheManager,
    sched: Scheduler,
    sampling: SamplingStage,
    policies: Policies,
    eos: Vec<u32>,
    vocab: usize,
    /// The plan of the launched step (or of the step being launched).
    inputs: StepPlan,
    /// The plan of the step scheduled ahead, while `inputs`' step computes.
    next_inputs: StepPlan,
    built: step_plan::Built,
    /// Scratch of [`step_plan::fill_placeholders`].
    row_of: Vec<u32>,
    /// Requests done but still part of the launched step (`Phase::Finished`): removed once it
    /// is applied.
    zombies: Vec<u64>,
    output: StepOutput,
    sampled: Vec<Sampled>,
    tokens: Vec<u32>,
    finished: Vec<(u32, StopReason)>,
    closed: Vec<u64>,
    /// Prompt logprobs completed this step, by slot, sent with the first token.
    prompt_done: Vec<(u32, Vec<Option<TokenLogprob>>)>,
    kv_events: Vec<KvEvent>,
    /// Where requests' events go (inline unless [`Self::set_outbox`] says otherwise).
    outbox: Outbox,
    stats: EngineStats,
    timings: StepTimings,
    /// The previous step ran a batch and nothing has waited since: the next step's device
    /// idle gap is host overhead.
    back_to_back: bool,
    /// When the last step that ran a batch finished its update.
    last_step_end: Option<Instant>,
    /// When the launched step was launched, and the device time of the step before it: how
    /// long it may still compute, for [`Self::take_arrivals`].
    launched_at: Instant,
    last_busy_ns: u64,
    /// Host time of the last top-up (a step's admissions and its plan built again).
    top_up_cost_ns: u64,
    /// Set when a step failed with [`ExecutorError::DeviceLost`].
    lost: bool,
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
        cfg.validate()?;
        let spec = executor.cache_spec();
        let layout =
            CacheLayout::plan(&setup.cache, &spec, cfg.max_running).map_err(ConfigError::from)?;
        let need = layout.block_size + 1;
        if cfg.chunked_prefill && cfg.max_batched_tokens < cfg.max_running - 1 + need {
            return Err(EngineError::BudgetTooSmall {
                tokens: cfg.max_batched_tokens,
                running: cfg.max_running,
                need,
            });
        }
        executor.allocate(CacheAllocation {
            num_blocks: layout.num_blocks,
            block_size: layout.block_size,
            num_ssm_slots: layout.ssm_slots(),
            max_tokens: cfg.max_batched_tokens,
            ssm_state_dtype: setup.cache.ssm_state_dtype,
            max_running: cfg.max_running,
        })?;
        let cache = CacheManager::new(
            &layout,
            setup.cache.prefix_caching,
            spec.is_hybrid(),
            policies.evictor.take(),
        )
        .with_snapshot_interval(setup.cache.ssm_snapshot_interval / layout.block_size.max(1));
        let sched = Scheduler::new(
            cfg.clone(),
            layout.block_size,
            HashSeed::new(&setup.hash_salt),
        );
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
            sampling: SamplingStage::new(cfg.sampler_candidates),
            eos: executor.eos_token_ids().to_vec(),
            vocab: executor.vocab_size(),
            setup,
            executor,
            layout,
            cache,
            sched,
            policies,
            inputs: StepPlan::default(),
            next_inputs: StepPlan::default(),
            built: step_plan::Built::default(),
            row_of: Vec::new(),
            zombies: Vec::new(),
            output: StepOutput::default(),
            sampled: Vec::new(),
            tokens: Vec::new(),
            finished: Vec::new(),
            closed: Vec::new(),
            prompt_done: Vec::new(),
            kv_events: Vec::new(),
            outbox: Outbox::inline(),
            stats,
            timings: StepTimings::default(),
            back_to_back: false,
            last_step_end: None,
            launched_at: Instant::now(),
            last_busy_ns: 0,
            top_up_cost_ns: 0,
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
        self.sched.is_idle()
    }

    /// Whether the executor's device was lost: the engine must stop (its thread exits, the
    /// router stops sending it work and `/health` reports the replica dead).
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

    /// Whether a deferred publication is still due.
    pub fn publication_due(&self) -> bool {
        self.deferred.is_some()
    }

    /// Queues a request; bad input is answered with `Failed` on its own channel. Block hashes
    /// the sender computed are adopted rather than computed again.
    pub fn add(&mut self, mut req: GenerateRequest, events: UnboundedSender<EngineEvent>) {
        if let Err((kind, message)) = self.check(&req) {
            self.outbox
                .reject(&events, EngineEvent::Failed { kind, message });
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
        self.sched.add(|slot| {
            let mut r = Request::new(req, slot, events);
            r.min_ban = min_ban;
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
        self.retire(id, Some(FinishReason::Cancelled));
        self.outbox.flush();
        self.refresh_stats();
    }

    /// Ends request `id`: sends `Finished` with `reason` (unless it finished before) and
    /// removes it with its cache state, or, when a launched or scheduled step holds it, marks
    /// it `Finished` to be removed once that step is applied or dropped.
    fn retire(&mut self, id: u64, reason: Option<FinishReason>) {
        let Some((slot, phase)) = (self.sched.slot_of(id))
            .and_then(|slot| self.sched.request(slot).map(|r| (slot, r.phase)))
        else {
            return;
        };
        if phase != Phase::Finished
            && let Some(reason) = reason
            && let Some(r) = self.sched.request(slot)
        {
            Self::send_finished(&mut self.outbox, &mut self.stats, r, reason);
        }
        if self.sched.in_flight(slot) || self.sched.scheduled(slot) {
            if phase != Phase::Finished {
                self.sched.mark_finished(slot);
                self.zombies.push(id);
            }
        } else {
            self.sched.remove(id, &mut self.cache);
        }
    }

    /// Cancels everything in flight (shutdown).
    pub fn cancel_all(&mut self) {
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

    fn fail(&mut self, r: Request, kind: FailureKind, message: String) {
        (self.outbox).send(r.id, &r.events, EngineEvent::Failed { kind, message });
    }

    /// Runs one step: launches a step when none computes, schedules and builds the next one
    /// while it computes (with `engine.schedule_ahead`), waits for the launched step, samples
    /// it, launches the next one and applies the first (see the module doc). Returns false
    /// when there was nothing to run.
    pub fn step(&mut self) -> bool {
        self.step_with(&mut |_| false)
    }

    /// [`Self::step`], calling `intake` over and over while the launched step computes (when
    /// a step is scheduled ahead): it hands the engine the commands that arrived (adds,
    /// cancels) and says whether it added a request. Requests added then join the step
    /// scheduled ahead, as far as its token budget allows and while the device still has
    /// time left on the launched step (by the device time of the step before): a request
    /// that arrives while a step computes starts in the next one, as without scheduling
    /// ahead, instead of one step later.
    pub fn step_with(&mut self, intake: &mut dyn FnMut(&mut Self) -> bool) -> bool {
        let t0 = Instant::now();
        if self.back_to_back
            && let Some(end) = self.last_step_end
        {
            self.timings.between_ns += (t0 - end).as_nanos() as u64;
        }
        if !self.sched.flight_live() {
            // Nothing computes: schedule a step and launch it.
            if !self.schedule() {
                self.back_to_back = false;
                self.cache.commit_step();
                self.cache.flush_evictor_events();
                self.cache.take_events(&mut self.kv_events);
                self.outbox.flush();
                self.refresh_stats();
                return false;
            }
            let t1 = Instant::now();
            self.timings.schedule_ns += (t1 - t0).as_nanos() as u64;
            let launched = self.build(false).and_then(|()| {
                let t2 = Instant::now();
                self.timings.inputs_ns += (t2 - t1).as_nanos() as u64;
                let r = self.executor.launch(&self.inputs, &mut self.output);
                let launch = t2.elapsed().as_nanos() as u64;
                self.timings.launch_ns += launch;
                self.timings.execute_ns += launch;
                r
            });
            if let Err(e) = launched {
                self.back_to_back = false;
                self.fail_scheduled(e);
                return self.end_step(Instant::now(), 0);
            }
            self.stats.prompt_tokens_computed += self.built.prompt_tokens;
            self.sched.launched();
            self.sched.rotate();
            self.launched_at = Instant::now();
        }
        // A step computes. Schedule and build the next one meanwhile.
        let mut next = Next::None;
        let ahead = self.setup.engine.schedule_ahead && !self.inputs.wants_full_rows();
        if ahead {
            let ts = Instant::now();
            let scheduled = self.schedule();
            let ti = Instant::now();
            self.timings.schedule_ns += (ti - ts).as_nanos() as u64;
            if scheduled {
                next = self.plan_ahead();
            }
            self.timings.inputs_ns += ti.elapsed().as_nanos() as u64;
        }
        // Also while the device computes: a deferred publication goes out (the cache events
        // first, as they did when published right after their step: a request's `Finished`
        // never overtakes the blocks it stored), the previous step's events go to the
        // delivery thread and its block events to the eviction policy.
        let tw = Instant::now();
        if let Some(stats) = self.deferred.take()
            && let Some(p) = self.publisher.as_mut()
        {
            p(&stats, &mut self.kv_events);
        }
        self.outbox.flush();
        self.cache.flush_evictor_events();
        let tf = Instant::now();
        self.timings.overlap_ns += (tf - tw).as_nanos() as u64;
        if ahead {
            self.take_arrivals(&mut next, intake);
        }
        let result = self.executor.finish(&mut self.output);
        let t3 = Instant::now();
        self.timings.execute_ns += (t3 - tf).as_nanos() as u64;
        if let Some(t) = self.executor.take_device_time() {
            self.last_busy_ns = (t.busy_s * 1e9) as u64;
            self.timings.device_busy_ns += self.last_busy_ns;
            if self.back_to_back {
                self.timings.device_idle_ns += (t.idle_before_s * 1e9) as u64;
                self.timings.device_gaps += 1;
            }
        }
        self.back_to_back = result.is_ok();
        if let Err(e) = result.and_then(|()| self.sample()) {
            self.back_to_back = false;
            self.fail_flight(e);
            return self.end_step(t3, 0);
        }
        // The next step goes to the device before this one is applied.
        let late = matches!(next, Next::Late);
        let mut launched = match next {
            Next::Ready => Some(self.launch_next(true)),
            Next::Failed(e) => Some(Err(e)),
            Next::Late | Next::None => None,
        };
        self.apply_output();
        if late {
            // Penalised rows needed this step's tokens: built now that they are known.
            let tb = Instant::now();
            let built = self.build(true);
            self.timings.inputs_ns += tb.elapsed().as_nanos() as u64;
            launched = Some(built.and_then(|()| self.launch_next(false)));
        }
        let mut launch_ns = 0;
        match launched {
            Some(Ok(ns)) => {
                launch_ns = ns;
                std::mem::swap(&mut self.inputs, &mut self.next_inputs);
                self.sched.rotate();
            }
            Some(Err(e)) => self.fail_scheduled(e),
            None => {}
        }
        self.end_step(t3, launch_ns)
    }

    /// While the launched step computes: hands `intake` the arrivals and admits the requests
    /// it adds into the step scheduled ahead (`next`), building that step's plan again. Stops
    /// admitting once the launched step's expected end (the device time of the step before)
    /// is nearer than twice the last top-up's host time: the device would wait for it.
    /// `intake` is called at least once, even when the host reaches here after the step
    /// ended (a loaded host): cancels and arrivals are never put off by a step.
    fn take_arrivals(&mut self, next: &mut Next, intake: &mut dyn FnMut(&mut Self) -> bool) {
        loop {
            let done = self.executor.output_ready();
            let arrived = intake(self);
            if done {
                return;
            }
            if !arrived {
                std::hint::spin_loop();
                continue;
            }
            let left =
                (self.last_busy_ns as u128).saturating_sub(self.launched_at.elapsed().as_nanos());
            let late = self.last_busy_ns > 0 && left < 2 * self.top_up_cost_ns as u128;
            if late || matches!(next, Next::Failed(_)) {
                continue;
            }
            let t = Instant::now();
            let admitted = self.sched.top_up(&mut self.cache);
            for rej in self.sched.take_rejected() {
                self.fail(rej.request, rej.kind, rej.message);
            }
            if admitted == 0 {
                continue;
            }
            self.timings.late_admissions += admitted as u64;
            if !matches!(next, Next::Late) {
                // A step built without a history it needs is built after the update anyway.
                *next = self.plan_ahead();
            }
            self.top_up_cost_ns = t.elapsed().as_nanos() as u64;
            self.timings.top_up_ns += self.top_up_cost_ns;
        }
    }

    /// Builds the plan of the step scheduled ahead and packs it for its launch; a plan whose
    /// penalised rows lack the launched step's tokens is left to be built after the update.
    fn plan_ahead(&mut self) -> Next {
        match self.build(true) {
            Ok(()) if self.built.history_incomplete => Next::Late,
            Ok(()) => {
                self.executor.prepare(&self.next_inputs);
                Next::Ready
            }
            Err(e) => Next::Failed(e),
        }
    }

    /// Schedules the newest step; false when it runs nothing.
    fn schedule(&mut self) -> bool {
        self.sched.schedule(&mut self.cache);
        for rej in self.sched.take_rejected() {
            self.fail(rej.request, rej.kind, rej.message);
        }
        let out = self.sched.output();
        self.stats.step = out.step;
        self.stats.preemptions += out.evicted.len() as u64;
        !out.is_empty()
    }

    /// Builds the plan of the newest step: into `inputs` to launch it now, or into
    /// `next_inputs` while the launched step computes (see [`super::step_plan`]).
    fn build(&mut self, ahead: bool) -> Result<(), ExecutorError> {
        let plan = if ahead {
            &mut self.next_inputs
        } else {
            &mut self.inputs
        };
        step_plan::build(
            plan,
            self.layout.block_size,
            &self.sched,
            &self.cache,
            &self.sampling,
            &mut self.built,
        )
        .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        if !ahead && !self.built.placeholders.is_empty() {
            return Err(ExecutorError::InvalidBatch(
                "a step launched with nothing computing holds tokens not sampled yet".into(),
            ));
        }
        Ok(())
    }

    /// Fills the placeholders of the step scheduled ahead with the launched step's tokens
    /// and launches it (`prepared`: as the executor prepared it). Returns the launch's host
    /// time.
    fn launch_next(&mut self, prepared: bool) -> Result<u64, ExecutorError> {
        step_plan::fill_placeholders(
            &mut self.next_inputs,
            &self.built.placeholders,
            &self.sched,
            &self.tokens,
            &mut self.row_of,
        )
        .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        let t = Instant::now();
        let r = if prepared {
            self.executor
                .launch_prepared(&self.next_inputs, &mut self.output)
        } else {
            self.executor.launch(&self.next_inputs, &mut self.output)
        };
        let ns = t.elapsed().as_nanos() as u64;
        self.timings.launch_ns += ns;
        self.timings.execute_ns += ns;
        r?;
        self.launched_at = Instant::now();
        self.stats.prompt_tokens_computed += self.built.prompt_tokens;
        self.sched.launched();
        Ok(ns)
    }

    /// The common end of a step that ran a batch: the update phase is the time from `t3`
    /// (its output was in) on, less `launch_ns` (the next step's launch, counted apart).
    fn end_step(&mut self, t3: Instant, launch_ns: u64) -> bool {
        self.cache.take_events(&mut self.kv_events);
        self.outbox.take_closed(&mut self.closed);
        for id in std::mem::take(&mut self.closed) {
            self.cancel(id);
        }
        // This step's events go out while the next one computes, unless none does.
        if !self.sched.flight_live() {
            self.outbox.flush();
            self.cache.flush_evictor_events();
        }
        self.refresh_stats();
        self.timings.steps += 1;
        let end = Instant::now();
        self.timings.update_ns += ((end - t3).as_nanos() as u64).saturating_sub(launch_ns);
        self.last_step_end = Some(end);
        true
    }

    /// Samples the launched step's rows (and takes its prompt rows) into `sampled`/`tokens`.
    fn sample(&mut self) -> Result<(), ExecutorError> {
        self.take_prompt_rows()?;
        let Policies {
            sampler,
            fallback_sampler,
            ..
        } = &mut self.policies;
        let t = Instant::now();
        self.sampling
            .sample_candidates(
                &mut self.output.cands,
                step_plan::sampled_rows(&self.sched),
                sampler.as_mut(),
                fallback_sampler.as_mut(),
                &mut self.sampled,
            )
            .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        self.timings.sample_ns += t.elapsed().as_nanos() as u64;
        self.tokens.clear();
        self.tokens.extend(self.sampled.iter().map(|s| s.token));
        Ok(())
    }

    /// Applies the launched step, sampled: its tokens, stops, cache commits and events.
    /// Requests done at its end that the step scheduled ahead holds stay until that one is
    /// applied; those the launched step held since an earlier stop leave now, unless the step
    /// scheduled ahead holds them too (cancelled after it was scheduled).
    fn apply_output(&mut self) {
        let step = self.sched.flight().step;
        self.finished.clear();
        self.sched
            .update_from_output(&mut self.cache, &self.tokens, &self.eos, &mut self.finished);
        // The step succeeded: its cache changes (new blocks, snapshots) become visible. The
        // engine is the one place that commits (here, and on idle steps) or aborts
        // (`fail_flight`, `fail_scheduled`) a step.
        self.cache.commit_step_of(step);
        let out = self.sched.flight();
        let mut generated = 0;
        for (row, s) in out.seqs.iter().filter(|s| s.want_logits).enumerate() {
            let sampled = &mut self.sampled[row];
            let Some(r) = self.sched.request(s.slot) else {
                continue;
            };
            if r.phase == Phase::Finished {
                continue;
            }
            generated += 1;
            if s.all_logits
                && let Some(i) = self
                    .prompt_done
                    .iter()
                    .position(|(slot, _)| *slot == s.slot)
            {
                let (_, logprobs) = self.prompt_done.swap_remove(i);
                let ev = EngineEvent::PromptLogprobs { logprobs };
                if !self.outbox.send(r.id, &r.events, ev) {
                    self.closed.push(r.id);
                }
            }
            let logprob = sampled.logprob.take();
            if !(self.outbox).send_token(r.id, &r.events, sampled.token, logprob) {
                self.closed.push(r.id);
            }
        }
        self.stats.generation_tokens += generated;
        let earlier = std::mem::take(&mut self.zombies);
        for (slot, why) in std::mem::take(&mut self.finished) {
            let Some(id) = self.sched.request(slot).map(|r| r.id) else {
                continue;
            };
            let reason = match why {
                StopReason::Stop => FinishReason::Stop,
                StopReason::Length => FinishReason::Length,
            };
            self.retire(id, Some(reason));
        }
        for id in earlier {
            // One cancelled while the step after was scheduled may be part of that step too.
            if self
                .sched
                .slot_of(id)
                .is_some_and(|slot| self.sched.scheduled(slot))
            {
                self.zombies.push(id);
            } else {
                self.sched.remove(id, &mut self.cache);
            }
        }
    }

    /// Turns the full rows of prompt positions (chunks with `all_logits`) into their
    /// requests' prompt logprobs.
    fn take_prompt_rows(&mut self) -> Result<(), ExecutorError> {
        self.prompt_done.clear();
        if !self.inputs.wants_full_rows() {
            return Ok(());
        }
        let full = &self.output.full;
        let expected = self.inputs.logit_rows.len();
        let vocab = self.vocab;
        if full.rows() != expected || full.vocab != vocab {
            return Err(ExecutorError::InvalidBatch(format!(
                "executor returned {} logits rows of {}, expected {expected} of {vocab}",
                full.rows(),
                full.vocab,
            )));
        }
        let starts: Vec<(u32, usize)> = (self.sched.flight().seqs.iter())
            .map(|s| (s.slot, s.start))
            .collect();
        let mut src = 0;
        for (&(slot, start), c) in starts.iter().zip(&self.inputs.seqs) {
            let rows = if c.all_logits {
                c.len
            } else {
                usize::from(c.want_logits)
            };
            if c.all_logits
                && let Some(r) = self.sched.request_mut(slot)
            {
                let top = r.prompt_top;
                let (tokens, prompt_len) = (&r.tokens, r.orig_prompt_len);
                if let Some(acc) = r.prompt_logprobs.as_mut() {
                    // Row j holds the distribution of the token at position start + j + 1.
                    for j in 0..c.len {
                        let pos = start + j + 1;
                        if pos >= prompt_len {
                            break;
                        }
                        acc[pos] = Some(token_logprob(full.row(src + j), tokens[pos], top));
                    }
                }
                // The prompt is complete: hand them over with the first sampled token.
                if c.want_logits
                    && let Some(done) = r.prompt_logprobs.take()
                {
                    self.prompt_done.push((slot, done));
                }
            }
            src += rows;
        }
        Ok(())
    }

    /// The launched step failed (its forward pass, or its output): its requests fail and
    /// nothing of it is cached; the step scheduled after it, not launched, is dropped, its
    /// new admissions going back to the queue.
    fn fail_flight(&mut self, e: ExecutorError) {
        self.note_failure(&e);
        self.cache.abort_step_of(self.sched.flight().step);
        let ids = Self::ids_of(&self.sched, self.sched.flight());
        self.sched.abandon_flight();
        self.sched.discard_scheduled(&mut self.cache);
        self.fail_all(ids, &e);
    }

    /// The newest step, scheduled but not launched, could not be launched (its plan or its
    /// upload failed): its requests fail and its cache plans are dropped.
    fn fail_scheduled(&mut self, e: ExecutorError) {
        self.note_failure(&e);
        self.cache.abort_step_of(self.sched.output().step);
        let ids = Self::ids_of(&self.sched, self.sched.output());
        self.sched.clear_scheduled();
        self.fail_all(ids, &e);
    }

    /// Logs a failed step; a lost device takes the replica out of service.
    fn note_failure(&mut self, e: &ExecutorError) {
        tracing::error!(error = %e, "step failed");
        if matches!(e, ExecutorError::DeviceLost(_)) {
            self.lost = true;
        }
    }

    fn ids_of(sched: &Scheduler, out: &super::scheduler::SchedulerOutput) -> Vec<u64> {
        (out.seqs.iter())
            .filter_map(|s| sched.request(s.slot).map(|r| r.id))
            .collect()
    }

    /// Fails (or, when already finished, just removes) each of `ids` with the step's error.
    fn fail_all(&mut self, ids: Vec<u64>, e: &ExecutorError) {
        for id in ids {
            if let Some(r) = self.sched.remove(id, &mut self.cache)
                && r.phase != Phase::Finished
            {
                self.fail(r, FailureKind::Executor, e.to_string());
            }
        }
        self.zombies.retain(|&id| self.sched.contains(id));
    }

    /// Brings the load and cache figures of [`Self::stats`] up to date (done after every step;
    /// call it after commands to publish their effect).
    /// The engine thread is about to block waiting for requests: the device's next idle gap
    /// is not host overhead.
    pub fn note_wait(&mut self) {
        self.back_to_back = false;
    }

    pub fn refresh_stats(&mut self) {
        let s = &mut self.stats;
        s.device_busy_seconds = self.timings.device_busy_ns as f64 * 1e-9;
        s.device_idle_seconds = self.timings.device_idle_ns as f64 * 1e-9;
        s.engine_steps = self.timings.steps;
        s.host_schedule_seconds = self.timings.schedule_ns as f64 * 1e-9;
        s.host_inputs_seconds = self.timings.inputs_ns as f64 * 1e-9;
        s.host_update_seconds = self.timings.update_ns as f64 * 1e-9;
        s.host_between_seconds = self.timings.between_ns as f64 * 1e-9;
        s.host_launch_seconds = self.timings.launch_ns as f64 * 1e-9;
        let kinds = self.executor.step_kinds();
        s.steps_eager = kinds.eager;
        s.steps_decode_graph = kinds.decode_graph;
        s.steps_mixed_graph = kinds.mixed_graph;
        s.host_overlap_seconds = self.timings.overlap_ns as f64 * 1e-9;
        s.host_top_up_seconds = self.timings.top_up_ns as f64 * 1e-9;
        s.late_admissions = self.timings.late_admissions;
        let pool = self.cache.pool();
        let c = self.cache.counters;
        s.running = self.sched.num_running() as u32;
        s.waiting = self.sched.num_waiting() as u32;
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
    }
}
