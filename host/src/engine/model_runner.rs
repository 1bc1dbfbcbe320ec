//! The real model behind the engine: [`ModelRunner`] implements [`StepExecutor`] for any
//! [`Model`] on any [`Backend`], owning the model's device caches. The weights are shared
//! (`Arc`): replicas on one device read the same copy, each with its own caches.

use std::sync::Arc;

use super::executor::{CacheAllocation, ExecutorError, Logits, StepExecutor};
use crate::backend::Backend;
use crate::model::{BatchInputs, CacheSpec, LogitsMode, Model, ModelCaches};

pub struct ModelRunner<B: Backend> {
    backend: B,
    model: Arc<Model<B>>,
    caches: Option<ModelCaches<B>>,
}

impl<B: Backend> ModelRunner<B> {
    /// A runner over `model` (a `Model` or an `Arc` of one shared with other replicas).
    pub fn new(backend: B, model: impl Into<Arc<Model<B>>>) -> Self {
        Self {
            backend,
            model: model.into(),
            caches: None,
        }
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
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
        self.caches = Some(self.model.new_caches(
            &self.backend,
            alloc.num_blocks,
            alloc.block_size,
            alloc.num_ssm_slots,
        ));
        Ok(())
    }

    fn execute(&mut self, inputs: &BatchInputs, logits: &mut Logits) -> Result<(), ExecutorError> {
        let vocab = self.model.info.vocab_size;
        let caches = self
            .caches
            .as_mut()
            .ok_or_else(|| ExecutorError::Allocation("caches used before allocate()".into()))?;
        let rows = self
            .model
            .forward(&self.backend, inputs, caches, LogitsMode::Last)
            .map_err(|e| ExecutorError::Forward(e.to_string()))?;
        logits.vocab = vocab;
        logits.data = rows;
        Ok(())
    }

    fn copy_ssm_slot(&mut self, src: u32, dst: u32) -> Result<(), ExecutorError> {
        let Self {
            backend, caches, ..
        } = self;
        let caches = caches
            .as_mut()
            .ok_or_else(|| ExecutorError::Allocation("caches used before allocate()".into()))?;
        if src as usize >= caches.num_slots || dst as usize >= caches.num_slots {
            return Err(ExecutorError::BadSlot(src.max(dst)));
        }
        caches
            .copy_ssm_slot(backend, src, dst)
            .map_err(|e| ExecutorError::Forward(e.to_string()))
    }

    fn zero_ssm_slot(&mut self, slot: u32) -> Result<(), ExecutorError> {
        let Self {
            backend, caches, ..
        } = self;
        let caches = caches
            .as_mut()
            .ok_or_else(|| ExecutorError::Allocation("caches used before allocate()".into()))?;
        if slot as usize >= caches.num_slots {
            return Err(ExecutorError::BadSlot(slot));
        }
        caches
            .zero_ssm_slot(backend, slot)
            .map_err(|e| ExecutorError::Forward(e.to_string()))
    }
}
