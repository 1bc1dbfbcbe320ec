//! The CPU's step object: its own copy of the plan, validated when it is uploaded. Packing
//! ahead is the same copy (it keeps the CPU on the path a device takes); graph buckets are
//! refused, the CPU has no graphs.

use std::sync::atomic::Ordering;

use super::CpuBackend;
use crate::backend::{BackendError, GraphBucket, Result, StepPlan};

/// The CPU's step object: its own copy of the plan.
#[derive(Debug, Default)]
pub struct CpuStep {
    pub plan: StepPlan,
}

impl CpuBackend {
    pub(super) fn new_step_object(&self, max_tokens: usize) -> Result<CpuStep> {
        self.arena.max_rows.fetch_max(max_tokens, Ordering::Relaxed);
        Ok(CpuStep::default())
    }

    pub(super) fn upload_plan(&self, plan: &StepPlan, step: &mut CpuStep) -> Result<()> {
        plan.validate()?;
        step.plan.copy_from(plan);
        Ok(())
    }

    pub(super) fn pack_eager_only(
        &self,
        plan: &StepPlan,
        step: &mut CpuStep,
        bucket: Option<GraphBucket>,
        _max_blocks: usize,
    ) -> Result<bool> {
        if bucket.is_some() {
            return Ok(false);
        }
        self.upload_plan(plan, step)?;
        Ok(true)
    }

    pub(super) fn repack_plan_tokens(&self, plan: &StepPlan, step: &mut CpuStep) -> Result<()> {
        if plan.tokens.len() != step.plan.tokens.len() {
            return Err(BackendError::Invalid(format!(
                "{} tokens written over a packed step of {}",
                plan.tokens.len(),
                step.plan.tokens.len()
            )));
        }
        step.plan.tokens.copy_from_slice(&plan.tokens);
        Ok(())
    }

    /// The host is the device: the masks are copied into the step the tail reads.
    pub(super) fn repack_plan_masks(&self, plan: &StepPlan, step: &mut CpuStep) -> Result<()> {
        let (from, to) = (&plan.sampling.masks, &mut step.plan.sampling.masks);
        if from.len() != to.len() {
            return Err(BackendError::Invalid(format!(
                "{} mask words written over a step of {}",
                from.len(),
                to.len()
            )));
        }
        to.copy_from_slice(from);
        Ok(())
    }
}
