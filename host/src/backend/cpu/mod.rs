//! The CPU reference backend: f32 everywhere, row-major `Vec<f32>` tensors.
//!
//! It is the oracle the accelerated backends are checked against, so clarity beats speed, but
//! it is threaded where it pays: linear layers go through [`matmul`] (a GEMV-shaped kernel over
//! the weight rows for decode-sized steps, `matrixmultiply` for prefill), attention
//! parallelises over query tokens and the SSM scan over heads (rayon); elementwise kernels
//! stay on the calling thread for small steps. Weights of any dtype
//! are widened to f32 on upload; cache dtypes are f32 too. Temporaries come from an [`Arena`]
//! of recycled buffers: a tensor made by a kernel returns its memory to the arena when dropped,
//! so once the largest step shapes have been seen, kernels stop asking the allocator for
//! tensor memory. (Scratch inside a kernel — rayon's per-head vectors, matrixmultiply's
//! packing buffers — is not drawn from the arena.)
//!
//! The trait impls below are tables: each method is one call into the file that owns its
//! concern (an inherent `impl CpuBackend` block, or a function of [`composed`] where the CPU
//! runs a fused operation as its parts) — storage and temporaries `tensor`, `dense`
//! operations, `norm`s, `attention`, the Mamba2 conv, scan and slot operations `ssm`,
//! the gated delta rule `gdn`, `moe`, the step object `step`, the `sample` tail.

mod attention;
mod dense;
mod gdn;
mod matmul;
pub mod moe;
mod norm;
pub mod sample;
mod ssm;
mod step;
mod tensor;

/// The kernels' tests' pseudo-random numbers.
#[cfg(test)]
pub(crate) mod test_rng {
    /// A linear congruential step of `seed`, as a float uniform in [-0.5, 0.5).
    pub fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }
}

pub use gdn::{GdnHeadSeq, gdn_chunked_head, gdn_recurrent_head};
pub use ssm::{HeadSeq, ssm_chunked_head, ssm_recurrent_head};
pub use step::CpuStep;
pub use tensor::{Arena, CpuTensor};

pub(crate) use matmul::gemm_nt;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use super::forward::forward;
use super::{
    Activation, Backend, BackendError, DType, DeviceStepTime, GraphBucket, LayerOps, Mamba2Mix,
    MoeRouting, Result, SampleOut, SsmOutNorm, SsmPools, StackedExperts, StepBackend, StepPlan,
    composed,
};

/// The CPU backend: stateless kernels plus the arena its temporaries come from. Clones share
/// the arena; replicas get their own backend (and arena).
#[derive(Debug, Clone, Default)]
pub struct CpuBackend {
    arena: Arc<Arena>,
    /// Bytes of the tensors uploaded to this backend (the weights it holds).
    uploaded: Arc<AtomicU64>,
}

fn same_shape(what: &str, a: &CpuTensor, b: &CpuTensor) -> Result<()> {
    if a.shape != b.shape {
        return Err(BackendError::Shape {
            what: what.to_string(),
            got: b.shape.clone(),
            expected: a.shape.clone(),
        });
    }
    Ok(())
}

/// Below this many values an elementwise kernel stays on the calling thread: handing a
/// decode step's few rows to rayon's threads (a wake-up and a wait) costs more than the work.
const PAR_MIN_ELEMS: usize = 1 << 14;

/// The fewest rows of `cols` values a rayon task takes (see [`PAR_MIN_ELEMS`]).
fn min_rows(cols: usize) -> usize {
    PAR_MIN_ELEMS.div_ceil(cols.max(1))
}

#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh())
}

#[inline]
fn apply_act(x: f32, act: Activation) -> f32 {
    match act {
        Activation::Silu => silu(x),
        Activation::Relu2 => {
            let r = x.max(0.0);
            r * r
        }
        Activation::Gelu => gelu(x),
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;

    fn name(&self) -> &'static str {
        "cpu"
    }
    fn act_dtype(&self) -> DType {
        DType::F32
    }
    fn is_lost(&self) -> bool {
        false
    }
    /// The recurrent-state pool stays f32 (`cache.ssm_state_dtype` only sizes its slots).
    fn bf16_ssm_state(&self) -> bool {
        false
    }
    fn shape<'a>(&self, t: &'a CpuTensor) -> &'a [usize] {
        &t.shape
    }
    fn dtype(&self, _t: &CpuTensor) -> DType {
        DType::F32
    }
    forward! { self =>
        upload -> upload_host,
        upload_fp8 -> upload_dequantized,
        quantize_fp8 -> quantize_dequantized,
        download -> download_f32,
        zeros -> zeros_persistent,
        copy_into -> copy_values,
        fill_dummy -> fill_dummy_values,
    }
}

impl LayerOps for CpuBackend {
    type Step = CpuStep;

    /// The CPU cuts no scan chunks ahead: its scan reads the plan.
    fn set_ssm_chunk_size(&self, _chunk: usize) {}
    forward! { self =>
        zeros_like -> zeros_tmp,
        embedding -> embed_rows,
        linear -> project,
        linear_shared -> project_shared,
        add_assign -> add_in_place,
        scale_assign -> scale_in_place,
        rms_norm -> rms_norm_rows,
        gated_rms_norm -> gated_rms_norm_groups,
        activate -> activate_in_place,
        gated_activation -> act_mul,
        split_cols -> copy_col_ranges,
        gather_logit_rows -> gather_logits,
        apply_rope -> rope_in_place,
        paged_attention -> write_kv_and_attend,
        ssm_slot_ops -> run_slot_ops,
        causal_conv1d -> conv_layer,
        ssm_scan -> scan_layer,
        head_rms_norm -> head_rms_norm_rows,
        sigmoid_gate -> sigmoid_gate_rows,
        gated_delta_rule -> delta_rule_layer,
    }
    // The fused operations, as their parts.
    forward! { composed(self) =>
        gated_linear, linear_activated, add_rms_norm, rope_paged_attention,
    }
    fn mamba2_mix(
        &self,
        zxbcdt: &CpuTensor,
        m: &Mamba2Mix<'_, CpuTensor>,
        pools: &mut SsmPools<CpuTensor>,
        layer: usize,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        match m.norm {
            SsmOutNorm::NormThenGate(w) if m.shape.groups > 1 => {
                let (z, y) = composed::mamba2_scan(self, zxbcdt, m, pools, layer, step)?;
                let group = m.shape.d_inner() / m.shape.groups;
                let y = self.rms_norm_groups(&y, w, group, m.eps)?;
                self.act_mul(&z, &y, Activation::Silu)
            }
            _ => composed::mamba2_mix(self, zxbcdt, m, pools, layer, step),
        }
    }
    fn moe(
        &self,
        x: &CpuTensor,
        router_logits: &CpuTensor,
        routing: &MoeRouting<CpuTensor>,
        experts: &StackedExperts<CpuTensor>,
        out: &mut CpuTensor,
    ) -> Result<()> {
        moe::moe_forward(x, router_logits, routing, experts, out)
    }
}

impl StepBackend for CpuBackend {
    /// The CPU tail applies the plan's token masks.
    fn applies_token_masks(&self) -> bool {
        true
    }

    forward! { self =>
        new_step -> new_step_object,
        upload_step -> upload_plan,
        arena_stats -> arena_growth,
        pack_step -> pack_eager_only,
        repack_tokens -> repack_plan_tokens,
        send_masks -> repack_plan_masks,
        sample -> sample_rows,
        // The device is the host: the whole tail runs here and the finish has nothing left.
        sample_start -> sample_rows,
    }
    // Packing ahead is the same copy: it keeps the CPU on the path a device takes.
    fn packs_ahead(&self) -> bool {
        true
    }
    fn send_step(&self, _step: &mut CpuStep) -> Result<()> {
        Ok(())
    }
    /// No device clock: nothing waits.
    fn hold_tail(&self) -> Result<()> {
        Ok(())
    }
    fn graph_buckets(&self, _max_batch: usize, _max_tokens: usize) -> Vec<GraphBucket> {
        Vec::new()
    }
    fn upload_graph_step(
        &self,
        _plan: &StepPlan,
        _step: &mut CpuStep,
        _bucket: GraphBucket,
        _max_blocks: usize,
    ) -> Result<bool> {
        Ok(false)
    }
    fn capture_graph(&self, _run: &mut dyn FnMut() -> Result<()>) -> Result<usize> {
        Err(no_graphs())
    }
    fn replay_graph(&self, _id: usize) -> Result<()> {
        Err(no_graphs())
    }
    fn step_clock_start(&self) -> Result<()> {
        Ok(())
    }
    /// No device clock: the host's own timings are the step's.
    fn step_clock_end(&self) -> Result<Option<DeviceStepTime>> {
        Ok(None)
    }
    fn sample_finish(&self, _out: &mut SampleOut) -> Result<()> {
        Ok(())
    }
    fn sample_ready(&self) -> bool {
        true
    }
}

/// The error of a graph call: the CPU replays no graphs (it has no graph buckets).
fn no_graphs() -> BackendError {
    BackendError::Invalid("this backend has no device graphs".into())
}

pub(crate) fn slot_elems(t: &CpuTensor) -> usize {
    t.shape.iter().skip(1).product()
}
