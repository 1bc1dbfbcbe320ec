//! The step's way to the device: the step object, and packing a [`StepPlan`] into it (eager,
//! ahead of the device, or padded to a graph bucket) then the step's one host-to-device copy.
//! The layouts themselves are [`super::step`]'s; this file picks one and times the copy (a
//! timed step's clock starts at it).

use std::sync::atomic::Ordering;

use super::CudaBackend;
use super::step::{self, CudaStep};
use crate::backend::{GraphBucket, Result, StepPlan};

impl CudaBackend {
    pub(super) fn new_step_object(&self, max_tokens: usize) -> Result<CudaStep> {
        self.inner
            .arena
            .max_rows
            .fetch_max(max_tokens.max(1), Ordering::Relaxed);
        let mut step = CudaStep::new();
        step.ssm_chunk = self.inner.device.ssm_chunk.load(Ordering::Relaxed);
        // Allocated now: a replica whose first steps all replay graphs would otherwise make
        // the first allocation of its eager step object long into serving.
        step.reserve(self.dev(), &self.inner.stats, step::MIN_STEP_BYTES)?;
        Ok(step)
    }

    pub(super) fn store_ssm_chunk(&self, chunk: usize) {
        self.inner
            .device
            .ssm_chunk
            .store(chunk as u32, Ordering::Relaxed);
    }

    pub(super) fn upload_eager(&self, plan: &StepPlan, step: &mut CudaStep) -> Result<()> {
        self.pack_for(plan, step, None, 0, false)?;
        self.send(step)
    }

    pub(super) fn upload_for_graph(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        bucket: GraphBucket,
        max_blocks: usize,
    ) -> Result<bool> {
        match bucket {
            GraphBucket::Decode { seqs } => self.upload_graph_shaped(
                plan,
                step,
                seqs,
                step::GraphShape::splits_for(seqs),
                max_blocks,
            ),
            GraphBucket::Mixed { .. } => {
                if !self.pack_for(plan, step, Some(bucket), max_blocks, false)? {
                    return Ok(false);
                }
                self.send(step)?;
                Ok(true)
            }
        }
    }

    /// Uploads a decode-only step as a graph step of `plan`'s own batch with `splits` split-KV
    /// pieces a sequence (the benches compare split counts; serving picks
    /// [`step::GraphShape::splits_for`]). `Ok(false)` when the plan does not fit that shape.
    pub fn upload_decode_step_with_splits(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        splits: u32,
        max_blocks: usize,
    ) -> Result<bool> {
        self.upload_graph_shaped(plan, step, plan.seqs.len(), splits, max_blocks)
    }

    /// Packs and uploads a graph step of `bucket` rows with `splits` split-KV pieces a
    /// sequence; a timed step's clock starts at its upload copy.
    fn upload_graph_shaped(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        bucket: usize,
        splits: u32,
        max_blocks: usize,
    ) -> Result<bool> {
        self.dev().bind()?;
        let shape = step::GraphShape {
            bucket,
            splits,
            table_cap: bucket * max_blocks + 1,
        };
        self.upload_graph_shape(plan, step, shape)
    }

    /// Packs `plan` on the host in the layout of `bucket` (the eager one for `None`);
    /// `Ok(false)` when it does not fit the bucket. No device work.
    /// `ahead`: the device may still be computing with `step`'s buffers, which must not be
    /// replaced: `Ok(false)` where an eager step needs them larger. (A graph step's buffers
    /// never change once a graph holds them.)
    pub(super) fn pack_for(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        bucket: Option<GraphBucket>,
        max_blocks: usize,
        ahead: bool,
    ) -> Result<bool> {
        self.dev().bind()?;
        match bucket {
            None => {
                plan.validate()?;
                step.pack(self.dev(), &self.inner.stats, plan, !ahead)
            }
            Some(GraphBucket::Decode { seqs }) => {
                let shape = step::GraphShape {
                    bucket: seqs,
                    splits: step::GraphShape::splits_for(seqs),
                    table_cap: seqs * max_blocks + 1,
                };
                step.pack_graph(self.dev(), &self.inner.stats, plan, shape)
            }
            Some(GraphBucket::Mixed {
                tokens,
                decodes,
                prompts,
            }) => {
                let m = step::MixedShape {
                    tokens,
                    decodes,
                    prompts,
                    table_cap: (decodes + prompts) * max_blocks + 1,
                };
                step.pack_mixed(self.dev(), &self.inner.stats, plan, m)
            }
        }
    }

    /// The packed step's upload: the step clock's start, then the one copy.
    pub(super) fn send(&self, step: &mut CudaStep) -> Result<()> {
        self.dev().bind()?;
        self.mark_step_start()?;
        step.copy(self.dev(), self.stream())
    }

    /// Sends the masks of the step on the device (see [`crate::backend::StepBackend::send_masks`]),
    /// with the step clock's marks of the device's wait for them.
    pub(super) fn send_late_masks(&self, plan: &StepPlan, step: &mut CudaStep) -> Result<()> {
        self.dev().bind()?;
        self.mark_masks_sent()?;
        step.copy_masks(self.dev(), self.stream(), plan)
    }

    /// Packs `plan` as a graph step of `shape` and copies it, the step clock's start recorded
    /// between the two. `Ok(false)`, nothing copied, when the plan does not fit.
    fn upload_graph_shape(
        &self,
        plan: &StepPlan,
        step: &mut CudaStep,
        shape: step::GraphShape,
    ) -> Result<bool> {
        if !step.pack_graph(self.dev(), &self.inner.stats, plan, shape)? {
            return Ok(false);
        }
        self.mark_step_start()?;
        step.copy(self.dev(), self.stream())?;
        Ok(true)
    }
}
