//! The real model behind the engine: [`ModelRunner`] implements [`StepExecutor`] for any
//! [`Model`] on any [`Backend`]. It owns the model's device caches and the backend's step
//! object: each step's plan is uploaded once, the forward pass reads only the uploaded step,
//! and the step ends on the backend with the sampling tail, whose candidate columns are the
//! one device-to-host copy (plus full rows on steps that score prompt tokens). The weights are shared (`Arc`):
//! replicas on one device read the same copy, each with its own caches.

use std::sync::Arc;

use super::executor::{CacheAllocation, ExecutorError, StepExecutor, StepOutput};
use crate::backend::{Backend, StepPlan};
use crate::model::{CacheSpec, Model, ModelCaches};

pub struct ModelRunner<B: Backend> {
    backend: B,
    model: Arc<Model<B>>,
    caches: Option<ModelCaches<B>>,
    step: Option<B::Step>,
}

impl<B: Backend> ModelRunner<B> {
    /// A runner over `model` (a `Model` or an `Arc` of one shared with other replicas).
    pub fn new(backend: B, model: impl Into<Arc<Model<B>>>) -> Self {
        Self {
            backend,
            model: model.into(),
            caches: None,
            step: None,
        }
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }
}

impl<B: Backend> StepExecutor for ModelRunner<B> {
    fn cache_spec(&self) -> CacheSpec {
        self.model.info.cache.clone()
    }

    fn vocab_size(&self) -> usize {
        self.model.info.vocab_size
    }

    fn eos_token_ids(&self) -> &[u32] {
        &self.model.info.eos_token_ids
    }

    fn allocate(&mut self, alloc: CacheAllocation) -> Result<(), ExecutorError> {
        let caches = self
            .model
            .new_caches_with_state(
                &self.backend,
                alloc.num_blocks,
                alloc.block_size,
                alloc.num_ssm_slots,
                alloc.ssm_state_dtype,
            )
            .map_err(|e| ExecutorError::Allocation(e.to_string()))?;
        self.caches = Some(caches);
        self.step = Some(
            self.backend
                .new_step(alloc.max_tokens)
                .map_err(|e| ExecutorError::Allocation(e.to_string()))?,
        );
        Ok(())
    }

    fn execute(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        self.run_step(plan, out).map_err(|e| {
            if self.backend.is_lost() {
                ExecutorError::DeviceLost(e.to_string())
            } else {
                e
            }
        })
    }
}

impl<B: Backend> ModelRunner<B> {
    fn run_step(&mut self, plan: &StepPlan, out: &mut StepOutput) -> Result<(), ExecutorError> {
        let vocab = self.model.info.vocab_size;
        let (Some(caches), Some(step)) = (self.caches.as_mut(), self.step.as_mut()) else {
            return Err(ExecutorError::Allocation(
                "caches used before allocate()".into(),
            ));
        };
        caches
            .check(plan)
            .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        self.backend
            .upload_step(plan, step)
            .map_err(|e| ExecutorError::InvalidBatch(e.to_string()))?;
        let forward = |e: crate::backend::BackendError| ExecutorError::Forward(e.to_string());
        let mut logits = self
            .model
            .forward(&self.backend, step, caches)
            .map_err(|e| ExecutorError::Forward(e.to_string()))?;
        out.full.vocab = vocab;
        out.full.data.clear();
        if plan.wants_full_rows() {
            out.full.data = self.backend.download(&logits).map_err(forward)?;
        }
        self.backend
            .sample(&mut logits, step, &mut out.cands)
            .map_err(forward)
    }
}
