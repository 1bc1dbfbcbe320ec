//! Gated DeltaNet models (Qwen3-Next, Qwen3.5) run on the CPU backend for now; on CUDA their
//! three operations fail with [`unsupported_yet`]. What the kernels need: a per-head RMS norm
//! with a `[head_dim]` weight; a sigmoid gate with row broadcast; and the gated delta rule —
//! the recurrent step for decode rows (state `[v_heads, k_dim, v_dim]` per slot in
//! `pools.ssm`, updated in place) and a chunked scan for prompt rows (per chunk: a triangular
//! solve for the deltas, then outputs and the carried state; snapshot targets cut chunks like
//! the Mamba2 scan does), reading the step's sequence offsets, slots and snapshot targets.

use crate::backend::BackendError;

pub(super) const HEAD_RMS_NORM: &str = "head_rms_norm (per-head q/k norms of gated attention)";
pub(super) const SIGMOID_GATE: &str = "sigmoid_gate (gated attention, shared-expert gate)";
pub(super) const GATED_DELTA_RULE: &str =
    "gated_delta_rule (Gated DeltaNet chunked scan and state update)";

/// The error of an operation the CUDA backend does not have yet (the model runs on `cpu`).
pub(super) fn unsupported_yet(what: &str) -> BackendError {
    BackendError::Invalid(format!(
        "{what} is not supported on CUDA yet; run this model with engine.backend = \"cpu\""
    ))
}
