//! The engine's step pipeline: a step is a value ([`Step`]) that moves through two slots,
//! *launched* (on the device, its output not yet applied) and *ahead* (scheduled and built
//! while the launched one computes), then back to a pool of spent steps whose buffers the next
//! step reuses.
//!
//! The engine thread drives it phase by phase (`engine::thread`):
//!
//! 1. [`Engine::begin_step`]: when nothing computes, schedule a step and launch it; then, while
//!    it computes, schedule and build the next one (`engine.schedule_ahead`) and do the host
//!    work that needs no output (hand the previous step's events on, publish its figures).
//! 2. While [`Engine::arrival_window`] is open, the thread waits on its command channel;
//!    requests that arrive join the step ahead through [`Engine::top_up`].
//! 3. [`Engine::complete_step`]: wait for the launched step's output, sample it, launch the
//!    step ahead with the sampled tokens written into its placeholders, and only then apply
//!    the first step (tokens appended, stops found, blocks committed, events queued) while the
//!    device computes the second.
//!
//! The scheduler plans into the step it is handed and applies the output of the step it is
//! handed back; a request counts the steps holding it ([`Request::holds`]) and leaves once it
//! is done and no step holds it. A request that stops runs one wasted row in the step ahead
//! (it is `Finished`: its events are out, it is never scheduled again), and a request the
//! launched step ends by length is not scheduled again. A step that scores prompt tokens is
//! not followed by one scheduled ahead, and a step ahead whose penalised rows need a token
//! still being sampled is built again once it is known. A constrained row's mask needs that
//! token too: where the executor splits a launch ([`StepExecutor::splits_tail`]) the step
//! ahead goes to the device up to its forward pass, the launched step is applied, the masks
//! are computed while the forward pass runs, and the sampling tail follows them; elsewhere
//! the plan is built again like a penalised one. Output is the same as scheduling after each
//! step's update.
//!
//! Cache events of a step are released only after its forward pass succeeded; a failed pass
//! fails the requests in that batch, drops the step ahead (its new admissions go back to the
//! queue) and leaves every other request and the cache intact.
//!
//! [`Request::holds`]: super::request::Request::holds

use std::time::{Duration, Instant};

use super::api::{EngineEvent, FailureKind, FinishReason, TokenLogprob};
use super::core::{Engine, Policies};
use super::executor::{ExecutorError, StepExecutor, StepOutput};
use super::request::Phase;
use super::sampling::{Sampled, token_logprob};
use super::scheduler::{SchedulerOutput, StopReason};
use super::step_plan::{self, Built};
use super::timings::StepTimings;
use crate::backend::{DeviceStepTime, StepPlan};

/// How long the thread waits for arrivals at a time while the device's time for a step is not
/// known yet (the first steps, or an executor that does not time its device): it looks at the
/// output between waits.
const UNTIMED_WAIT: Duration = Duration::from_micros(200);

/// How long before the launched step's expected end the arrival window closes, besides twice
/// the last top-up's cost: a thread woken from a timed wait runs again some tens to hundreds
/// of microseconds after its deadline, and the device must not wait for that. After the
/// window the thread waits on the device itself, which answers at once.
const WAKE_MARGIN: Duration = Duration::from_micros(100);

/// The share of the step before's device time the window may last: a step can be shorter
/// than the one before it (requests finished), and the thread must be waiting on the device,
/// not on its command channel, when it ends.
const WINDOW_SHARE: f64 = 0.9;

/// Every timestamp of one step.
#[derive(Debug, Clone, Copy)]
pub struct StepClock {
    /// Scheduling began.
    pub scheduled: Instant,
    /// Scheduling ended; building the plan began.
    pub building: Instant,
    /// The plan was built (and, ahead, prepared for its launch).
    pub built: Instant,
    /// The launch ended: the step is on the device.
    pub launched: Instant,
    /// Waiting for the output began.
    pub waiting: Instant,
    /// The output was in.
    pub output_in: Instant,
}

impl Default for StepClock {
    fn default() -> Self {
        let now = Instant::now();
        Self {
            scheduled: now,
            building: now,
            built: now,
            launched: now,
            waiting: now,
            output_in: now,
        }
    }
}

/// One engine step: what the scheduler planned, the plan built from it, what came of it.
#[derive(Debug, Default)]
pub struct Step {
    pub work: SchedulerOutput,
    pub plan: StepPlan,
    pub built: Built,
    pub clock: StepClock,
    /// The token chosen for each sampled row, and its logprobs.
    pub sampled: Vec<Sampled>,
    pub tokens: Vec<u32>,
    /// Prompt logprobs completed by this step, by slot, sent with the first token.
    pub prompt_done: Vec<(u32, Vec<Option<TokenLogprob>>)>,
    /// Requests this step ended, with why.
    pub finished: Vec<(u32, StopReason)>,
    /// Tokens appended per chunk with sampled rows (see `Scheduler::update_from_output`).
    pub emitted: Vec<u32>,
}

impl Step {
    /// Empties what a spent step came to (the scheduler clears `work` when it plans).
    fn reset(&mut self) {
        self.sampled.clear();
        self.tokens.clear();
        self.prompt_done.clear();
        self.finished.clear();
        self.emitted.clear();
    }
}

/// What became of the step scheduled ahead.
#[derive(Debug)]
pub enum Ahead {
    /// Nothing to run when it was scheduled; arrivals may still fill it.
    Empty,
    /// Built and prepared, waiting for the launched step's tokens.
    Ready,
    /// Built without a penalty history it needs: built again after the launched step is
    /// applied.
    Late,
    /// Its plan could not be built.
    Failed(ExecutorError),
}

/// The pace of back-to-back steps: what the device's idle gaps and the arrival window are
/// measured from.
#[derive(Debug)]
struct Pace {
    /// The previous step ran a batch and nothing has waited since: the next step's device
    /// idle gap is host overhead.
    back_to_back: bool,
    /// When the last step that ran a batch finished its update.
    last_step_end: Option<Instant>,
    /// When the launch of the launched step began (its device work may start as soon as the
    /// launch enqueues it), and the device time of the last step that computed no prompt
    /// tokens: how long it computes at least (a step with prompt chunks takes longer, and
    /// the step before a decode may have been one).
    launched_at: Instant,
    last_busy_ns: u64,
    /// Host time of the last top-up (admissions and the plan built again).
    top_up_cost_ns: u64,
}

/// The two slots and the spent steps.
#[derive(Debug)]
pub struct Pipeline {
    // Boxed: a step is a few kilobytes of buffer headers, moved between the slots every step.
    launched: Option<Box<Step>>,
    ahead: Option<(Box<Step>, Ahead)>,
    /// Spent steps, their boxes kept to go back into a slot as they are.
    #[allow(clippy::vec_box)]
    spare: Vec<Box<Step>>,
    /// What the executor returns for the launched step.
    output: StepOutput,
    /// Scratch of [`step_plan::fill_placeholders`].
    row_of: Vec<u32>,
    pace: Pace,
}

impl Default for Pipeline {
    fn default() -> Self {
        Self {
            launched: None,
            ahead: None,
            spare: Vec::new(),
            output: StepOutput::default(),
            row_of: Vec::new(),
            pace: Pace {
                back_to_back: false,
                last_step_end: None,
                launched_at: Instant::now(),
                last_busy_ns: 0,
                top_up_cost_ns: 0,
            },
        }
    }
}

impl Pipeline {
    /// A spent step to plan into (its buffers kept), or a new one.
    fn fresh(&mut self) -> Box<Step> {
        let mut step = self.spare.pop().unwrap_or_default();
        step.reset();
        step
    }

    fn recycle(&mut self, step: Box<Step>) {
        self.spare.push(step);
    }

    /// Whether a launched step waits for its output to be applied.
    pub fn is_launched(&self) -> bool {
        self.launched.is_some()
    }

    /// The thread is about to wait for requests: the device's next idle gap is not host
    /// overhead.
    pub fn note_wait(&mut self) {
        self.pace.back_to_back = false;
    }

    /// Counts the device's time of the step whose output just came in (`decode_only`: it
    /// computed no prompt tokens).
    fn note_device(
        &mut self,
        time: Option<DeviceStepTime>,
        decode_only: bool,
        timings: &mut StepTimings,
    ) {
        let Some(t) = time else {
            return;
        };
        let busy = (t.busy_s * 1e9) as u64;
        if decode_only {
            self.pace.last_busy_ns = busy;
        }
        timings.device_busy_ns += busy;
        if self.pace.back_to_back {
            timings.device_idle_ns += (t.idle_before_s * 1e9) as u64;
            timings.device_mask_wait_ns += (t.mask_wait_s * 1e9) as u64;
            timings.device_gaps += 1;
        }
    }

    /// How long the launched step may still compute, less twice the last top-up's host time
    /// (the device would wait for a top-up started later) and the thread's wake-up margin;
    /// `None` once that is past.
    fn window(&self) -> Option<Duration> {
        if self.pace.last_busy_ns == 0 {
            return Some(UNTIMED_WAIT);
        }
        let expected = (self.pace.last_busy_ns as f64 * WINDOW_SHARE) as u128;
        let left = expected.saturating_sub(self.pace.launched_at.elapsed().as_nanos());
        let margin = 2 * u128::from(self.pace.top_up_cost_ns) + WAKE_MARGIN.as_nanos();
        (left > margin).then(|| Duration::from_nanos((left - margin) as u64))
    }
}

impl<E: StepExecutor> Engine<E> {
    /// Runs one whole step with no arrivals while it computes: [`Self::begin_step`], then
    /// [`Self::complete_step`]. Returns false when there was nothing to run.
    pub fn step(&mut self) -> bool {
        if !self.begin_step() {
            return false;
        }
        self.complete_step();
        true
    }

    /// Launches a step when none computes, then, while it computes, schedules and builds the
    /// next one (with `engine.schedule_ahead`) and hands the previous step's events on.
    /// Returns false when there was nothing to run (an idle step: it changes nothing).
    pub fn begin_step(&mut self) -> bool {
        let t0 = Instant::now();
        let pace = &mut self.pipeline.pace;
        if pace.back_to_back
            && let Some(end) = pace.last_step_end
        {
            self.timings.between_ns += (t0 - end).as_nanos() as u64;
        }
        // Requests whose grammar compiled join the queue before it is scheduled.
        self.pump_opens(true);
        if !self.pipeline.is_launched() {
            let mut step = self.pipeline.fresh();
            step.clock.scheduled = t0;
            if !self.schedule_into(&mut step) {
                self.pipeline.recycle(step);
                self.idle_step();
                return false;
            }
            if let Err(e) = self.launch_now(&mut step) {
                self.pipeline.pace.back_to_back = false;
                self.fail_unlaunched(step, e);
                self.end_step(Instant::now(), 0);
                return true;
            }
            self.pipeline.launched = Some(step);
        }
        let scores_prompt =
            (self.pipeline.launched.as_ref()).is_some_and(|s| s.plan.wants_full_rows());
        // Speculating requests draft from their last accepted token: their next step is
        // scheduled once this one is applied.
        if self.setup.engine.schedule_ahead && !scores_prompt && !self.sched.speculation_active() {
            self.schedule_ahead();
        }
        self.overlap();
        true
    }

    /// How long the thread may wait for requests to join the step scheduled ahead before the
    /// launched step's output is due; `None` when none can join any more (no step ahead, its
    /// plan failed, the output is in, or the device would wait for the top-up).
    pub fn arrival_window(&mut self) -> Option<Duration> {
        match &self.pipeline.ahead {
            None | Some((_, Ahead::Failed(_))) => return None,
            Some(_) => {}
        }
        if self.executor.output_ready() {
            return None;
        }
        self.pipeline.window()
    }

    /// Admits requests that arrived while the launched step computes into the step scheduled
    /// ahead, as far as its token budget allows, and builds its plan again. Returns how many
    /// joined (none once the window is closed: they start in the step after).
    pub fn top_up(&mut self) -> usize {
        if self.arrival_window().is_none() {
            return 0;
        }
        let Some((mut next, mut ahead)) = self.pipeline.ahead.take() else {
            return 0;
        };
        let t = Instant::now();
        // Grammars that compiled meanwhile; none starts now, just before the step's masks.
        self.pump_opens(false);
        let admitted = self.sched.top_up(&mut self.cache, &mut next.work);
        self.fail_rejected();
        if admitted > 0 {
            self.timings.late_admissions += admitted as u64;
            // A step built without a history it needs is built after the update anyway.
            if !matches!(ahead, Ahead::Late) {
                ahead = self.plan_ahead(&mut next);
            }
            self.pipeline.pace.top_up_cost_ns = t.elapsed().as_nanos() as u64;
            self.timings.top_up_ns += self.pipeline.pace.top_up_cost_ns;
        }
        self.pipeline.ahead = Some((next, ahead));
        admitted
    }

    /// Waits for the launched step's output, samples it, launches the step scheduled ahead
    /// and applies the first (see the module doc). Nothing when no step is launched.
    pub fn complete_step(&mut self) {
        let Some(mut step) = self.pipeline.launched.take() else {
            return;
        };
        step.clock.waiting = Instant::now();
        let result = self.executor.finish(&mut self.pipeline.output);
        let t3 = Instant::now();
        step.clock.output_in = t3;
        self.timings.execute_ns += (t3 - step.clock.waiting).as_nanos() as u64;
        let time = self.executor.take_device_time();
        let decode_only = step.built.prompt_tokens == 0;
        self.pipeline
            .note_device(time, decode_only, &mut self.timings);
        self.pipeline.pace.back_to_back = result.is_ok();
        if let Err(e) = result.and_then(|()| self.sample(&mut step)) {
            self.pipeline.pace.back_to_back = false;
            self.fail_launched(step, e);
            self.end_step(t3, 0);
            return;
        }
        // The step ahead goes to the device before this one is applied.
        let (next, launch) = match self.pipeline.ahead.take() {
            Some((mut next, Ahead::Ready)) => {
                let r = self.launch_ahead(&mut next, &step, true);
                (Some(next), Some(r))
            }
            Some((next, Ahead::Failed(e))) => (Some(next), Some(Err(e))),
            Some((next, Ahead::Late)) => (Some(next), None),
            Some((next, Ahead::Empty)) => {
                self.pipeline.recycle(next);
                (None, None)
            }
            None => (None, None),
        };
        self.apply(&mut step);
        // The MTP pass reads this step's hidden states, which a step launched ahead of it
        // has replaced.
        self.mtp_pass(&step, next.is_some());
        let launch = match (next, launch) {
            (Some(mut next), None) => {
                // Penalised rows needed this step's tokens: built now that they are known.
                let t = Instant::now();
                let r = self.build(&mut next, true);
                self.timings.inputs_ns += t.elapsed().as_nanos() as u64;
                let r = r.and_then(|()| self.launch_ahead(&mut next, &step, false));
                Some((next, r))
            }
            (Some(next), Some(r)) => Some((next, r)),
            (None, _) => None,
        };
        // Launched up to its forward pass: the masks, then the sampling tail.
        let launch = launch.map(|(mut next, r)| match r {
            Ok(ns) if !next.built.late_masks.is_empty() => {
                let r = self.launch_late_tail(&mut next).map(|masks| ns + masks);
                (next, r)
            }
            r => (next, r),
        });
        self.pipeline.recycle(step);
        let mut launch_ns = 0;
        match launch {
            Some((next, Ok(ns))) => {
                launch_ns = ns;
                self.pipeline.launched = Some(next);
            }
            Some((next, Err(e))) => self.fail_unlaunched(next, e),
            None => {}
        }
        self.end_step(t3, launch_ns);
    }

    /// A step that ran nothing: the cache's step ends, pending events go out.
    fn idle_step(&mut self) {
        self.pipeline.pace.back_to_back = false;
        self.cache.commit_step();
        self.cache.flush_evictor_events();
        self.cache.take_events(&mut self.kv_events);
        self.outbox.flush();
        self.refresh_stats();
    }

    /// Plans the next step into `step`; false when it runs nothing.
    fn schedule_into(&mut self, step: &mut Step) -> bool {
        self.sched.schedule(&mut self.cache, &mut step.work);
        self.fail_rejected();
        self.stats.step = step.work.step;
        self.stats.preemptions += step.work.evicted.len() as u64;
        !step.work.is_empty()
    }

    fn fail_rejected(&mut self) {
        for rej in self.sched.take_rejected() {
            self.fail(rej.request, rej.kind, rej.message);
        }
    }

    /// Builds `step`'s plan and launches it, nothing computing before it.
    fn launch_now(&mut self, step: &mut Step) -> Result<(), ExecutorError> {
        step.clock.building = Instant::now();
        self.timings.schedule_ns += (step.clock.building - step.clock.scheduled).as_nanos() as u64;
        self.build(step, false)?;
        step.clock.built = Instant::now();
        self.timings.inputs_ns += (step.clock.built - step.clock.building).as_nanos() as u64;
        let r = self.executor.launch(&step.plan, &mut self.pipeline.output);
        step.clock.launched = Instant::now();
        let launch = (step.clock.launched - step.clock.built).as_nanos() as u64;
        self.timings.launch_ns += launch;
        self.timings.execute_ns += launch;
        r?;
        self.stats.prompt_tokens_computed += step.built.prompt_tokens;
        self.sched.launched(&step.work);
        self.pipeline.pace.launched_at = step.clock.built;
        Ok(())
    }

    /// Schedules and builds the step after the launched one while it computes.
    fn schedule_ahead(&mut self) {
        let mut next = self.pipeline.fresh();
        next.clock.scheduled = Instant::now();
        let scheduled = self.schedule_into(&mut next);
        next.clock.building = Instant::now();
        let ahead = if scheduled {
            self.plan_ahead(&mut next)
        } else {
            Ahead::Empty
        };
        next.clock.built = Instant::now();
        self.timings.schedule_ns += (next.clock.building - next.clock.scheduled).as_nanos() as u64;
        self.timings.inputs_ns += (next.clock.built - next.clock.building).as_nanos() as u64;
        self.pipeline.ahead = Some((next, ahead));
    }

    /// While the device computes: a deferred publication goes out (the cache events first, as
    /// they did when published right after their step: a request's `Finished` never overtakes
    /// the blocks it stored), the previous step's events go to the delivery thread and its
    /// block events to the eviction policy.
    fn overlap(&mut self) {
        let t = Instant::now();
        self.publish_deferred();
        self.outbox.flush();
        self.cache.flush_evictor_events();
        self.timings.overlap_ns += t.elapsed().as_nanos() as u64;
    }

    /// Builds the plan of the step scheduled ahead and packs it for its launch; a plan whose
    /// penalised rows lack the launched step's tokens is left to be built after the update.
    fn plan_ahead(&mut self, next: &mut Step) -> Ahead {
        match self.build(next, true) {
            Ok(()) if next.built.history_incomplete => Ahead::Late,
            Ok(()) => {
                self.executor.prepare(&next.plan);
                Ahead::Ready
            }
            Err(e) => Ahead::Failed(e),
        }
    }

    /// Builds `step`'s plan (see [`super::step_plan`]); `ahead`: while the launched step
    /// computes, its sampled tokens as placeholders.
    fn build(&mut self, step: &mut Step, ahead: bool) -> Result<(), ExecutorError> {
        let words = self.executor.vocab_size().div_ceil(32);
        let constraints = self
            .policies
            .constrainer
            .as_deref_mut()
            .map(|c| (c as &mut dyn crate::policy::Constrainer, words));
        step_plan::build(
            &mut step.plan,
            self.layout.block_size,
            &step.work,
            &self.sched,
            &self.cache,
            &self.sampling,
            constraints,
            ahead && self.executor.splits_tail(),
            &mut step.built,
        )
        .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        self.fail_constraints(&mut step.built);
        if !ahead && !step.built.placeholders.is_empty() {
            return Err(ExecutorError::InvalidBatch(
                "a step launched with nothing computing holds tokens not sampled yet".into(),
            ));
        }
        Ok(())
    }

    /// Fills the placeholders of `next` with the tokens `launched` sampled and launches it
    /// (`prepared`: as the executor prepared it). Returns the launch's host time.
    fn launch_ahead(
        &mut self,
        next: &mut Step,
        launched: &Step,
        prepared: bool,
    ) -> Result<u64, ExecutorError> {
        step_plan::fill_placeholders(
            &mut next.plan,
            &next.built.placeholders,
            &launched.work,
            &launched.tokens,
            &mut self.pipeline.row_of,
        )
        .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        let t = Instant::now();
        let output = &mut self.pipeline.output;
        let r = if !next.built.late_masks.is_empty() {
            // Up to the forward pass: the masks follow (see `launch_late_tail`).
            self.executor.launch_forward(&next.plan, output)
        } else if prepared {
            self.executor.launch_prepared(&next.plan, output)
        } else {
            self.executor.launch(&next.plan, output)
        };
        next.clock.launched = Instant::now();
        let ns = (next.clock.launched - t).as_nanos() as u64;
        self.timings.launch_ns += ns;
        self.timings.execute_ns += ns;
        r?;
        self.pipeline.pace.launched_at = t;
        self.stats.prompt_tokens_computed += next.built.prompt_tokens;
        self.sched.launched(&next.work);
        Ok(ns)
    }

    /// The step ahead went to the device up to its forward pass: the masks of its constrained
    /// rows, which needed the tokens just applied, are computed while that pass runs, then its
    /// sampling tail follows them. Returns the host time taken (counted with the plan's
    /// inputs, not the update).
    fn launch_late_tail(&mut self, next: &mut Step) -> Result<u64, ExecutorError> {
        let t = Instant::now();
        let words = self.executor.vocab_size().div_ceil(32);
        match self.policies.constrainer.as_deref_mut() {
            Some(c) => {
                step_plan::fill_late_masks(&mut next.plan, &mut next.built, &self.sched, c, words)
            }
            // Late masks are only left where a constraint plugin is loaded; never unmasked
            // quietly.
            None => {
                for m in &next.built.late_masks {
                    if let Some(r) = self.sched.request(m.slot) {
                        let why = "no constraint plugin to compute the mask".to_string();
                        next.built.constraint_failures.push((r.id, why));
                    }
                }
            }
        }
        self.fail_constraints(&mut next.built);
        let r = self
            .executor
            .launch_tail(&next.plan, &mut self.pipeline.output);
        let ns = t.elapsed().as_nanos() as u64;
        self.timings.inputs_ns += ns;
        self.timings.late_masks += next.built.late_masks.len() as u64;
        r.map(|()| ns)
    }

    /// The common end of a step that ran a batch: the update phase is the time from
    /// `output_in` on, less `launch_ns` (the next step's launch, counted apart).
    fn end_step(&mut self, output_in: Instant, launch_ns: u64) {
        self.close_constraints();
        // The step ahead's masks are out: grammars compile in the lanes until the next ones.
        self.pump_opens(true);
        self.cache.take_events(&mut self.kv_events);
        self.outbox.take_closed(&mut self.closed);
        for id in std::mem::take(&mut self.closed) {
            self.cancel(id);
        }
        // This step's events go out while the next one computes, unless none does.
        if !self.pipeline.is_launched() {
            self.outbox.flush();
            self.cache.flush_evictor_events();
        }
        self.refresh_stats();
        self.timings.steps += 1;
        let end = Instant::now();
        self.timings.update_ns += ((end - output_in).as_nanos() as u64).saturating_sub(launch_ns);
        self.pipeline.pace.last_step_end = Some(end);
    }

    /// Ends the requests whose constraint failed while `built`'s plan was made: each gets
    /// `Failed` now and leaves once no step holds it (its row in the plan runs unmasked).
    fn fail_constraints(&mut self, built: &mut Built) {
        for (id, why) in built.constraint_failures.drain(..) {
            let Some(r) = self.sched.slot_of(id).and_then(|s| self.sched.request(s)) else {
                continue;
            };
            if r.phase == Phase::Finished {
                continue;
            }
            tracing::warn!(request = id, error = %why, "a response's constraint failed; the response ends");
            let message = format!("the response's constraint failed: {why}");
            self.outbox.send(
                id,
                &r.events,
                EngineEvent::Failed {
                    kind: FailureKind::Constraint,
                    message,
                },
            );
            self.retire(id, None);
        }
    }

    /// Samples the launched step's rows (and takes its prompt rows) into `step.sampled` and
    /// `step.tokens`.
    fn sample(&mut self, step: &mut Step) -> Result<(), ExecutorError> {
        self.take_prompt_rows(step)?;
        let Policies {
            sampler,
            fallback_sampler,
            ..
        } = &mut self.policies;
        let t = Instant::now();
        self.sampling
            .sample_candidates(
                &mut self.pipeline.output.cands,
                step_plan::sampled_rows(&self.sched, &step.work),
                sampler.as_mut(),
                fallback_sampler.as_mut(),
                &mut step.sampled,
            )
            .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        self.timings.sample_ns += t.elapsed().as_nanos() as u64;
        step.tokens.clear();
        step.tokens.extend(step.sampled.iter().map(|s| s.token));
        Ok(())
    }

    /// Applies the launched step, sampled: its tokens, stops, cache commits and events; then
    /// it leaves the pipeline, and the requests done that no other step holds leave with it.
    fn apply(&mut self, step: &mut Step) {
        step.finished.clear();
        let eos = &self.eos;
        self.sched.update_from_output(
            &mut self.cache,
            &step.work,
            &step.tokens,
            eos,
            &mut step.finished,
            &mut step.emitted,
        );
        // The step succeeded: its cache changes (new blocks, snapshots) become visible. The
        // pipeline is the one place that commits (here, and on idle steps) or aborts
        // (`fail_launched`, `fail_unlaunched`) a step.
        self.cache.commit_step_of(step.work.step);
        let mut generated = 0;
        let mut row = 0;
        let seqs = step.work.seqs.iter().filter(|s| s.want_logits);
        for (s, &n) in seqs.zip(&step.emitted) {
            let first = row;
            row += s.rows();
            let Some(r) = self.sched.request(s.slot) else {
                continue;
            };
            if n == 0 || r.phase == Phase::Finished {
                continue;
            }
            generated += u64::from(n);
            if s.all_logits
                && let Some(i) = step
                    .prompt_done
                    .iter()
                    .position(|(slot, _)| *slot == s.slot)
            {
                let (_, logprobs) = step.prompt_done.swap_remove(i);
                let ev = EngineEvent::PromptLogprobs { logprobs };
                if !self.outbox.send(r.id, &r.events, ev) {
                    self.closed.push(r.id);
                }
            }
            for sampled in &mut step.sampled[first..first + n as usize] {
                let logprob = sampled.logprob.take();
                if !(self.outbox).send_token(r.id, &r.events, sampled.token, logprob) {
                    self.closed.push(r.id);
                    break;
                }
            }
        }
        self.stats.generation_tokens += generated;
        for &(slot, why) in &step.finished {
            let Some(id) = self.sched.request(slot).map(|r| r.id) else {
                continue;
            };
            let reason = match why {
                StopReason::Stop => FinishReason::Stop,
                StopReason::Length => FinishReason::Length,
            };
            self.retire(id, Some(reason));
        }
        self.sched.release(&step.work, &mut self.cache);
    }

    /// Turns the full rows of prompt positions (chunks with `all_logits`) into their
    /// requests' prompt logprobs.
    fn take_prompt_rows(&mut self, step: &mut Step) -> Result<(), ExecutorError> {
        step.prompt_done.clear();
        if !step.plan.wants_full_rows() {
            return Ok(());
        }
        let full = &self.pipeline.output.full;
        let expected = step.plan.logit_rows.len();
        if full.rows() != expected || full.vocab != self.vocab {
            return Err(ExecutorError::InvalidBatch(format!(
                "executor returned {} logits rows of {}, expected {expected} of {}",
                full.rows(),
                full.vocab,
                self.vocab,
            )));
        }
        let mut src = 0;
        for (s, c) in step.work.seqs.iter().zip(&step.plan.seqs) {
            let rows = if c.all_logits || c.sample_all {
                c.len
            } else {
                usize::from(c.want_logits)
            };
            if c.all_logits
                && let Some(r) = self.sched.request_mut(s.slot)
            {
                let top = r.prompt_top;
                let (tokens, prompt_len) = (&r.tokens, r.orig_prompt_len);
                if let Some(acc) = r.prompt_logprobs.as_mut() {
                    // Row j holds the distribution of the token at position start + j + 1.
                    for j in 0..c.len {
                        let pos = s.start + j + 1;
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
                    step.prompt_done.push((s.slot, done));
                }
            }
            src += rows;
        }
        Ok(())
    }

    /// The launched step failed (its forward pass, or its output): its requests fail and
    /// nothing of it is cached; the step scheduled ahead, not launched, is dropped, its new
    /// admissions going back to the queue.
    fn fail_launched(&mut self, step: Box<Step>, e: ExecutorError) {
        self.note_failure(&e);
        self.cache.abort_step_of(step.work.step);
        let ids = self.ids_of(&step.work);
        if let Some((mut next, _)) = self.pipeline.ahead.take() {
            self.sched.discard(&mut self.cache, &mut next.work);
            self.pipeline.recycle(next);
        }
        self.sched.release(&step.work, &mut self.cache);
        self.fail_all(ids, &e);
        self.pipeline.recycle(step);
    }

    /// `step`, scheduled but not launched, could not be launched (its plan or its upload
    /// failed): its requests fail and its cache plans are dropped.
    fn fail_unlaunched(&mut self, step: Box<Step>, e: ExecutorError) {
        self.note_failure(&e);
        self.cache.abort_step_of(step.work.step);
        let ids = self.ids_of(&step.work);
        self.sched.release(&step.work, &mut self.cache);
        self.fail_all(ids, &e);
        self.pipeline.recycle(step);
    }

    /// Logs a failed step; a lost device takes the replica out of service.
    fn note_failure(&mut self, e: &ExecutorError) {
        tracing::error!(error = %e, "step failed");
        if matches!(e, ExecutorError::DeviceLost(_)) {
            self.lost = true;
        }
    }

    fn ids_of(&self, out: &SchedulerOutput) -> Vec<u64> {
        (out.seqs.iter())
            .filter_map(|s| self.sched.request(s.slot).map(|r| r.id))
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
    }
}
