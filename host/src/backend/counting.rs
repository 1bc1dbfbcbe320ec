//! [`Counting`]: a backend wrapper that counts the traffic a device backend would pay for —
//! step uploads, device-to-host reads — so tests can hold the step contract: exactly one
//! upload and one read per step, and no host reads inside the layers.
//!
//! It implements every method of [`Backend`], [`LayerOps`] and [`StepBackend`] by calling the
//! same method of the backend it wraps ([`forward!`]: after a count where the method is
//! traffic), so it computes exactly what that backend computes (its fused operations
//! included). The traits have no default bodies, so the compiler demands each method here; a
//! test in `backend` checks that each one is listed once, forwarded to its own name.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::forward::forward;
use super::{Backend, LayerOps, StepBackend};

/// Counts shared by every clone of a [`Counting`] backend.
#[derive(Debug, Default)]
pub struct Traffic {
    /// [`StepBackend::upload_step`] calls.
    pub step_uploads: AtomicU64,
    /// [`Backend::download`] calls.
    pub downloads: AtomicU64,
    /// [`StepBackend::sample`] calls (the step's candidate read).
    pub candidate_reads: AtomicU64,
    /// [`Backend::upload`] calls (weights, at load).
    pub uploads: AtomicU64,
    /// Kernel launches between uploads (any operation that takes a tensor).
    pub kernels: AtomicU64,
}

/// A snapshot of [`Traffic`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrafficCounts {
    pub step_uploads: u64,
    pub downloads: u64,
    pub candidate_reads: u64,
    pub uploads: u64,
    pub kernels: u64,
}

impl Traffic {
    pub fn counts(&self) -> TrafficCounts {
        TrafficCounts {
            step_uploads: self.step_uploads.load(Ordering::Relaxed),
            downloads: self.downloads.load(Ordering::Relaxed),
            candidate_reads: self.candidate_reads.load(Ordering::Relaxed),
            uploads: self.uploads.load(Ordering::Relaxed),
            kernels: self.kernels.load(Ordering::Relaxed),
        }
    }
}

/// Wraps a backend and counts its traffic; computes exactly what the inner backend computes.
#[derive(Debug, Clone)]
pub struct Counting<B> {
    pub inner: B,
    pub traffic: Arc<Traffic>,
}

impl<B> Counting<B> {
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            traffic: Arc::default(),
        }
    }

    fn kernel(&self) {
        self.traffic.kernels.fetch_add(1, Ordering::Relaxed);
    }
}

impl<B: Backend> Backend for Counting<B> {
    type Tensor = B::Tensor;

    forward! { self.inner =>
        name, act_dtype, is_lost, bf16_ssm_state, shape, dtype, zeros,
    }
    forward! { self.inner, first self.traffic.uploads.fetch_add(1, Ordering::Relaxed) =>
        upload, upload_fp8,
    }
    forward! { self.inner, first self.traffic.downloads.fetch_add(1, Ordering::Relaxed) => download }
    forward! { self.inner, first self.kernel() => copy_into, fill_dummy, quantize_fp8 }
}

impl<B: LayerOps> LayerOps for Counting<B> {
    type Step = B::Step;

    forward! { self.inner => set_ssm_chunk_size }
    forward! { self.inner, first self.kernel() =>
        zeros_like, embedding, linear, linear_shared, gated_linear, linear_activated,
        add_assign, scale_assign, rms_norm, add_rms_norm, gated_rms_norm, activate,
        gated_activation, split_cols, gather_logit_rows,
        apply_rope, paged_attention, rope_paged_attention,
        ssm_slot_ops, causal_conv1d, ssm_scan, mamba2_mix,
        head_rms_norm, sigmoid_gate, gated_delta_rule,
        moe,
    }
}

impl<B: StepBackend> StepBackend for Counting<B> {
    forward! { self.inner =>
        new_step, arena_stats, applies_token_masks, packs_ahead, pack_step, repack_tokens,
        graph_buckets, upload_graph_step, capture_graph, replay_graph,
        step_clock_start, step_clock_end, sample_finish, sample_ready, hold_tail,
        send_masks,
    }
    forward! { self.inner, first self.traffic.step_uploads.fetch_add(1, Ordering::Relaxed) =>
        upload_step, send_step,
    }
    forward! { self.inner, first self.traffic.candidate_reads.fetch_add(1, Ordering::Relaxed) =>
        sample, sample_start,
    }
}
