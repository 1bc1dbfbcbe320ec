//! The seam between the engine and a model: [`StepExecutor`].
//!
//! The engine owns scheduling and every cache decision; an executor owns the device memory of
//! the caches and runs one forward pass per step over the [`StepPlan`] (token ids, positions,
//! slot mapping, block tables, SSM slot restores/zeros and snapshot targets, logit rows) that
//! the engine built. The executor never decides which blocks or slots to use; it only reads
//! and writes the ones it is given.
//!
//! Call order: `cache_spec` → `allocate` once (sizes from the memory budget) → per step,
//! `execute`, or `launch` then `finish` (the plan's slot operations run first, inside the
//! step). Between `launch` and `finish` the engine does host work that reads nothing of the
//! step's output, while a device computes the step: it schedules and builds the next step and
//! hands its plan to `prepare` (again, when requests that arrive meanwhile join it, while
//! `output_ready` says the step still computes); after `finish` it fills in that plan's
//! placeholder tokens and calls `launch_prepared` — or, where the executor
//! [`splits_tail`](StepExecutor::splits_tail) and constrained rows wait for masks that need
//! those tokens, `launch_forward`, computes the masks, and `launch_tail`.

use crate::backend::{BackendError, SampleOut, StepPlan};
use crate::model::{CacheDtypes, CacheSpec};

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ExecutorError {
    #[error("cache allocation failed: {0}")]
    Allocation(String),
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    #[error("SSM slot {0} out of range")]
    BadSlot(u32),
    #[error("forward pass failed: {0}")]
    Forward(String),
    /// A backend operation of the step failed; the backend's error is kept as it is (shape,
    /// plan, memory or device).
    #[error("forward pass failed: {0}")]
    Backend(#[from] BackendError),
    /// The device had an error its context does not survive: this replica is out of service.
    #[error("device lost, replica out of service: {0}")]
    DeviceLost(String),
}

/// Logits of one step, in batch order: one row of `vocab` f32 per token of each chunk with
/// `all_logits`, and one per other chunk with `want_logits`.
#[derive(Debug, Clone, Default)]
pub struct Logits {
    pub data: Vec<f32>,
    pub vocab: usize,
}

impl Logits {
    /// Empties the buffer (keeping its capacity) for `rows` rows of `vocab`, zero-filled.
    pub fn reset(&mut self, rows: usize, vocab: usize) {
        self.vocab = vocab;
        self.data.clear();
        self.data.resize(rows * vocab, 0.0);
    }
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.vocab).unwrap_or(0)
    }
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// What a step returns to the host.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// The sampling tail's candidate columns: one row per sampled logits row (the plan's
    /// `sample_rows`), computed from the plan's `sampling` inputs.
    pub cands: SampleOut,
    /// Every logits row of the plan's `logit_rows`, unpenalised — filled only on steps whose
    /// plan [`StepPlan::wants_full_rows`] (prompt logprobs).
    pub full: Logits,
}

/// What `allocate` must provide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheAllocation {
    pub num_blocks: usize,
    pub block_size: usize,
    /// SSM-state slots (live and durable together; ids `0..num_ssm_slots`).
    pub num_ssm_slots: usize,
    /// Tokens of the largest step (`engine.max_batched_tokens`): sizes step temporaries.
    pub max_tokens: usize,
    /// Storage types of K and V (`cache.kv_dtype`) and of the SSM recurrent state
    /// (`cache.ssm_state_dtype`).
    pub dtypes: CacheDtypes,
    /// Most sequences in one step (`engine.max_running`).
    pub max_running: usize,
}

/// A model behind the engine: the real model runner, or [`super::mock::MockExecutor`].
pub trait StepExecutor: Send {
    /// Per-block and per-slot cache sizes, used to split the memory budget.
    fn cache_spec(&self) -> CacheSpec;
    fn vocab_size(&self) -> usize;
    /// Tokens that end generation unless a request sets `ignore_eos`.
    fn eos_token_ids(&self) -> &[u32];
    /// Allocates the paged KV cache and the SSM slots; called once before the first step.
    fn allocate(&mut self, alloc: CacheAllocation) -> Result<(), ExecutorError>;
    /// Runs one step: the plan's SSM slot restores and zeros, the forward pass (snapshot
    /// targets are written during it) and the sampling tail, filling `out` as
    /// [`StepOutput`] says.
    fn execute(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError>;
    /// [`Self::execute`] in two halves: this one enqueues the step and may return before its
    /// results are in `out`; [`Self::finish`] waits for them. An executor that computes on
    /// the calling thread runs the whole step here.
    fn launch(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        self.execute(plan, out)
    }
    /// Gets the step of `plan` ready on the host while the device computes the step before
    /// it (packing it for its upload), so that [`Self::launch_prepared`] has only its tokens
    /// to rewrite: the plan's placeholder tokens change before that launch, nothing else.
    /// Best effort: a plan it cannot get ready is handled by the launch, which reports what
    /// is wrong.
    fn prepare(&mut self, _plan: &StepPlan) {}
    /// [`Self::launch`] of the plan last given to [`Self::prepare`], its tokens now filled in.
    fn launch_prepared(
        &mut self,
        plan: &StepPlan,
        out: &mut StepOutput,
    ) -> Result<(), ExecutorError> {
        self.launch(plan, out)
    }
    /// Whether [`Self::launch_forward`] and [`Self::launch_tail`] split a launch, so that
    /// the engine computes the token masks of constrained rows while the forward pass runs.
    fn splits_tail(&self) -> bool {
        false
    }
    /// [`Self::launch_prepared`] up to the forward pass: the step's sampling tail waits for
    /// [`Self::launch_tail`], which must come before [`Self::finish`].
    fn launch_forward(
        &mut self,
        _plan: &StepPlan,
        _out: &mut StepOutput,
    ) -> Result<(), ExecutorError> {
        Err(unsplit())
    }
    /// The sampling tail of the step [`Self::launch_forward`] started, with `plan`'s token
    /// masks as they are now (the same plan otherwise).
    fn launch_tail(
        &mut self,
        _plan: &StepPlan,
        _out: &mut StepOutput,
    ) -> Result<(), ExecutorError> {
        Err(unsplit())
    }
    /// Completes the step [`Self::launch`] started (nothing when it failed or ran to the
    /// end): `out` is filled as [`Self::execute`] says.
    fn finish(&mut self, _out: &mut StepOutput) -> Result<(), ExecutorError> {
        Ok(())
    }
    /// Whether [`Self::finish`] would return without waiting (also when no step is launched,
    /// or when it failed: the finish then says how). The engine polls this to take in new
    /// requests while the device computes.
    fn output_ready(&mut self) -> bool {
        true
    }
    /// The device's timing of the step `execute` just ran, where the backend keeps one.
    fn take_device_time(&mut self) -> Option<crate::backend::DeviceStepTime> {
        None
    }
    /// Steps executed so far, by how they ran (all zero where the executor does not say).
    fn step_kinds(&self) -> StepKinds {
        StepKinds::default()
    }
    /// Whether steps apply the plan's token masks (constrained responses).
    fn applies_token_masks(&self) -> bool {
        true
    }
    /// Whether the model has a multi-token-prediction head ([`Self::mtp_draft`]); such an
    /// executor keeps every step's final hidden states for it.
    fn has_mtp(&self) -> bool {
        false
    }
    /// Runs the MTP head over `plan` ([`crate::model::mtp`]): each token of the plan is the
    /// token *after* its row's position, and `rows[i]` is where token `i`'s hidden state is in
    /// `source`. The head's K/V of every row is written (the plan's slot mapping); the
    /// greedy draft of each of the plan's `logit_rows` is appended to `drafts`.
    fn mtp_draft(
        &mut self,
        _plan: &StepPlan,
        _source: MtpSource,
        _rows: &[u32],
        _drafts: &mut Vec<u32>,
    ) -> Result<(), ExecutorError> {
        Err(ExecutorError::InvalidBatch(
            "this executor has no MTP head".into(),
        ))
    }
}

/// Where the hidden states an MTP pass reads come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MtpSource {
    /// The rows of the step just run (the target's final hidden states).
    Step,
    /// The logit rows of the MTP pass before (a chain of drafts).
    Chain,
}

/// What the split launch of an executor that does not split answers.
fn unsplit() -> ExecutorError {
    ExecutorError::InvalidBatch("this executor does not split a launch".into())
}

/// Steps an executor ran, by how: every kernel launched from the host, or replayed from a
/// captured device graph of a decode-only or a mixed bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepKinds {
    pub eager: u64,
    pub decode_graph: u64,
    pub mixed_graph: u64,
}

impl<E: StepExecutor + ?Sized> StepExecutor for Box<E> {
    fn cache_spec(&self) -> CacheSpec {
        (**self).cache_spec()
    }
    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }
    fn eos_token_ids(&self) -> &[u32] {
        (**self).eos_token_ids()
    }
    fn allocate(&mut self, alloc: CacheAllocation) -> Result<(), ExecutorError> {
        (**self).allocate(alloc)
    }
    fn execute(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        (**self).execute(plan, out)
    }
    fn launch(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        (**self).launch(plan, out)
    }
    fn prepare(&mut self, plan: &StepPlan) {
        (**self).prepare(plan)
    }
    fn launch_prepared(
        &mut self,
        plan: &StepPlan,
        out: &mut StepOutput,
    ) -> Result<(), ExecutorError> {
        (**self).launch_prepared(plan, out)
    }
    fn splits_tail(&self) -> bool {
        (**self).splits_tail()
    }
    fn launch_forward(
        &mut self,
        plan: &StepPlan,
        out: &mut StepOutput,
    ) -> Result<(), ExecutorError> {
        (**self).launch_forward(plan, out)
    }
    fn launch_tail(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        (**self).launch_tail(plan, out)
    }
    fn finish(&mut self, out: &mut StepOutput) -> Result<(), ExecutorError> {
        (**self).finish(out)
    }
    fn output_ready(&mut self) -> bool {
        (**self).output_ready()
    }
    fn take_device_time(&mut self) -> Option<crate::backend::DeviceStepTime> {
        (**self).take_device_time()
    }
    fn step_kinds(&self) -> StepKinds {
        (**self).step_kinds()
    }
    fn applies_token_masks(&self) -> bool {
        (**self).applies_token_masks()
    }
    fn has_mtp(&self) -> bool {
        (**self).has_mtp()
    }
    fn mtp_draft(
        &mut self,
        plan: &StepPlan,
        source: MtpSource,
        rows: &[u32],
        drafts: &mut Vec<u32>,
    ) -> Result<(), ExecutorError> {
        (**self).mtp_draft(plan, source, rows, drafts)
    }
}
