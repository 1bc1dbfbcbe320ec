//! [`StepTimings`]: where the host's time in engine steps goes, by phase, and the device's
//! busy and idle time between them.

use super::api::EngineStats;

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
    /// ([`super::Engine::defer_publication`]). Not part of the time the device waits for the host.
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
    /// Token masks of constrained rows computed while the forward pass of their step ran.
    pub late_masks: u64,
    /// Device time of the executed steps (CUDA events; 0 on the CPU).
    pub device_busy_ns: u64,
    /// Device time idle between back-to-back steps: from one step's read-back to the next
    /// step's first operation, counted only when the engine had work waiting throughout
    /// (not after waiting for requests).
    pub device_idle_ns: u64,
    /// Of `device_idle_ns`, the device waiting inside steps for constrained rows' masks
    /// computed while their forward pass ran.
    pub device_mask_wait_ns: u64,
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
            late_masks: d(self.late_masks, before.late_masks),
            device_busy_ns: d(self.device_busy_ns, before.device_busy_ns),
            device_idle_ns: d(self.device_idle_ns, before.device_idle_ns),
            device_mask_wait_ns: d(self.device_mask_wait_ns, before.device_mask_wait_ns),
            device_gaps: d(self.device_gaps, before.device_gaps),
        }
    }

    /// Writes these timings into the engine's published figures.
    pub fn fill(&self, s: &mut EngineStats) {
        let secs = |ns: u64| ns as f64 * 1e-9;
        s.device_busy_seconds = secs(self.device_busy_ns);
        s.device_idle_seconds = secs(self.device_idle_ns);
        s.device_mask_wait_seconds = secs(self.device_mask_wait_ns);
        s.engine_steps = self.steps;
        s.host_schedule_seconds = secs(self.schedule_ns);
        s.host_inputs_seconds = secs(self.inputs_ns);
        s.host_update_seconds = secs(self.update_ns);
        s.host_between_seconds = secs(self.between_ns);
        s.host_launch_seconds = secs(self.launch_ns);
        s.host_overlap_seconds = secs(self.overlap_ns);
        s.host_top_up_seconds = secs(self.top_up_ns);
        s.late_admissions = self.late_admissions;
        s.late_masks = self.late_masks;
    }
}
