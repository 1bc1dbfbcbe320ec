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

pub use gdn::{gdn_chunked_head, gdn_recurrent_head};
pub use ssm::{ssm_chunked_head, ssm_recurrent_head};
pub use step::CpuStep;
pub use tensor::{Arena, CpuTensor};

pub(crate) use matmul::gemm_nt;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use super::{
    Activation, ArenaStats, AttnShape, Backend, BackendError, DType, DeviceStepTime, GdnShape,
    GraphBucket, HostTensor, KvLayer, LayerOps, Mamba2Mix, MoeRouting, Result, Rope, SampleOut,
    SsmOutNorm, SsmPools, SsmShape, StackedExperts, StepBackend, StepPlan, composed,
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
    fn upload(&self, host: HostTensor<'_>) -> Result<CpuTensor> {
        self.upload_host(host)
    }
    fn download(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        self.download_f32(t)
    }
    fn shape<'a>(&self, t: &'a CpuTensor) -> &'a [usize] {
        &t.shape
    }
    fn dtype(&self, _t: &CpuTensor) -> DType {
        DType::F32
    }
    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<CpuTensor> {
        self.zeros_persistent(shape, dtype)
    }
    fn copy_into(&self, src: &CpuTensor, dst: &mut CpuTensor) -> Result<()> {
        self.copy_values(src, dst)
    }
    fn fill_dummy(&self, t: &mut CpuTensor, seed: u64, std: f32, mean: f32) -> Result<()> {
        self.fill_dummy_values(t, seed, std, mean)
    }
}

impl LayerOps for CpuBackend {
    type Step = CpuStep;

    /// The CPU cuts no scan chunks ahead: its scan reads the plan.
    fn set_ssm_chunk_size(&self, _chunk: usize) {}
    fn zeros_like(&self, x: &CpuTensor) -> Result<CpuTensor> {
        self.zeros_tmp(x)
    }
    fn embedding(&self, table: &CpuTensor, step: &CpuStep) -> Result<CpuTensor> {
        self.embed_rows(table, step)
    }
    fn linear(&self, x: &CpuTensor, w: &CpuTensor, b: Option<&CpuTensor>) -> Result<CpuTensor> {
        self.project(x, w, b)
    }
    fn linear_shared(&self, x: &CpuTensor, ws: &[Weight<'_>]) -> Result<Vec<CpuTensor>> {
        self.project_shared(x, ws)
    }
    fn gated_linear(
        &self,
        x: &CpuTensor,
        gate: Weight<'_>,
        up: Weight<'_>,
        act: Activation,
    ) -> Result<CpuTensor> {
        composed::gated_linear(self, x, gate, up, act)
    }
    fn linear_activated(
        &self,
        x: &CpuTensor,
        w: &CpuTensor,
        b: Option<&CpuTensor>,
        act: Activation,
    ) -> Result<CpuTensor> {
        composed::linear_activated(self, x, w, b, act)
    }
    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        self.add_in_place(x, y)
    }
    fn scale_assign(&self, x: &mut CpuTensor, s: f32) -> Result<()> {
        self.scale_in_place(x, s)
    }
    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        self.rms_norm_rows(x, w, eps)
    }
    fn add_rms_norm(
        &self,
        residual: &mut CpuTensor,
        delta: &CpuTensor,
        w: &CpuTensor,
        eps: f32,
    ) -> Result<CpuTensor> {
        composed::add_rms_norm(self, residual, delta, w, eps)
    }
    fn gated_rms_norm(
        &self,
        x: &CpuTensor,
        gate: &CpuTensor,
        w: &CpuTensor,
        group: usize,
        eps: f32,
    ) -> Result<CpuTensor> {
        self.gated_rms_norm_groups(x, gate, w, group, eps)
    }
    fn activate(&self, x: &mut CpuTensor, act: Activation) -> Result<()> {
        self.activate_in_place(x, act)
    }
    fn gated_activation(&self, g: &CpuTensor, u: &CpuTensor, a: Activation) -> Result<CpuTensor> {
        self.act_mul(g, u, a)
    }
    fn split_cols<const N: usize>(&self, x: &CpuTensor, w: [usize; N]) -> Result<[CpuTensor; N]> {
        self.copy_col_ranges(x, w)
    }
    fn gather_logit_rows(&self, x: &CpuTensor, step: &CpuStep) -> Result<CpuTensor> {
        self.gather_logits(x, step)
    }
    fn apply_rope(
        &self,
        x: &mut CpuTensor,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        step: &CpuStep,
    ) -> Result<()> {
        self.rope_in_place(x, heads, head_dim, rope, step)
    }
    fn paged_attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        cache: &mut KvLayer<CpuTensor>,
        shape: AttnShape,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        self.write_kv_and_attend(q, k, v, cache, shape, step)
    }
    fn rope_paged_attention(
        &self,
        q: CpuTensor,
        k: CpuTensor,
        v: &CpuTensor,
        cache: &mut KvLayer<CpuTensor>,
        shape: AttnShape,
        rope: &Rope,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        composed::rope_paged_attention(self, q, k, v, cache, shape, rope, step)
    }
    fn ssm_slot_ops(&self, pools: &mut SsmPools<CpuTensor>, step: &CpuStep) -> Result<()> {
        self.run_slot_ops(pools, step)
    }
    fn causal_conv1d(
        &self,
        x: &CpuTensor,
        weight: &CpuTensor,
        bias: Option<&CpuTensor>,
        pools: &mut SsmPools<CpuTensor>,
        layer: usize,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        self.conv_layer(x, weight, bias, pools, layer, step)
    }
    fn ssm_scan(
        &self,
        x: &CpuTensor,
        b: &CpuTensor,
        c: &CpuTensor,
        dt: &CpuTensor,
        a_log: &CpuTensor,
        d: &CpuTensor,
        dt_bias: &CpuTensor,
        shape: SsmShape,
        pools: &mut SsmPools<CpuTensor>,
        layer: usize,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        self.scan_layer(x, b, c, dt, a_log, d, dt_bias, shape, pools, layer, step)
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
    fn head_rms_norm(
        &self,
        x: &CpuTensor,
        w: &CpuTensor,
        hd: usize,
        eps: f32,
    ) -> Result<CpuTensor> {
        self.head_rms_norm_rows(x, w, hd, eps)
    }
    fn sigmoid_gate(&self, x: &mut CpuTensor, gate: &CpuTensor) -> Result<()> {
        self.sigmoid_gate_rows(x, gate)
    }
    fn gated_delta_rule(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        a: &CpuTensor,
        b: &CpuTensor,
        a_log: &CpuTensor,
        dt_bias: &CpuTensor,
        shape: GdnShape,
        pools: &mut SsmPools<CpuTensor>,
        layer: usize,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        self.delta_rule_layer(q, k, v, a, b, a_log, dt_bias, shape, pools, layer, step)
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
    fn new_step(&self, max_tokens: usize) -> Result<CpuStep> {
        self.new_step_object(max_tokens)
    }
    fn upload_step(&self, plan: &StepPlan, step: &mut CpuStep) -> Result<()> {
        self.upload_plan(plan, step)
    }
    fn arena_stats(&self) -> ArenaStats {
        self.arena_growth()
    }
    // Packing ahead is the same copy: it keeps the CPU on the path a device takes.
    fn packs_ahead(&self) -> bool {
        true
    }
    fn pack_step(
        &self,
        plan: &StepPlan,
        step: &mut CpuStep,
        bucket: Option<GraphBucket>,
        max_blocks: usize,
    ) -> Result<bool> {
        self.pack_eager_only(plan, step, bucket, max_blocks)
    }
    fn repack_tokens(&self, plan: &StepPlan, step: &mut CpuStep) -> Result<()> {
        self.repack_plan_tokens(plan, step)
    }
    fn send_step(&self, _step: &mut CpuStep) -> Result<()> {
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
    fn sample(&self, logits: &mut CpuTensor, step: &CpuStep, out: &mut SampleOut) -> Result<()> {
        self.sample_rows(logits, step, out)
    }
    /// The device is the host: the whole tail runs here and the finish has nothing left.
    fn sample_start(
        &self,
        logits: &mut CpuTensor,
        step: &CpuStep,
        out: &mut SampleOut,
    ) -> Result<()> {
        self.sample_rows(logits, step, out)
    }
    fn sample_finish(&self, _out: &mut SampleOut) -> Result<()> {
        Ok(())
    }
    fn sample_ready(&self) -> bool {
        true
    }
}

/// A weight and its optional bias, as the linear layers take them.
type Weight<'a> = (&'a CpuTensor, Option<&'a CpuTensor>);

/// The error of a graph call: the CPU replays no graphs (it has no graph buckets).
fn no_graphs() -> BackendError {
    BackendError::Invalid("this backend has no device graphs".into())
}

pub(crate) fn slot_elems(t: &CpuTensor) -> usize {
    t.shape.iter().skip(1).product()
}
