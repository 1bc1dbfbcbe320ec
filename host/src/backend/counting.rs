//! [`Counting`]: a backend wrapper that counts the traffic a device backend would pay for —
//! step uploads, device-to-host reads — so tests can hold the step contract: exactly one
//! upload and one read per step, and no host reads inside the layers.
//!
//! It implements every method of [`Backend`], [`LayerOps`] and [`StepBackend`] by calling the
//! same method of the backend it wraps, so it computes exactly what that backend computes
//! (its fused operations included). The traits have no default bodies, so the compiler
//! demands each method here; a test in `backend` checks that each one forwards.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{
    Activation, ArenaStats, AttnShape, Backend, DType, DeviceStepTime, GdnShape, GraphBucket,
    HostTensor, KvLayer, LayerOps, Mamba2Mix, MoeRouting, Result, Rope, SampleOut, SsmPools,
    SsmShape, StackedExperts, StepBackend, StepPlan,
};

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

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn upload(&self, host: HostTensor<'_>) -> Result<Self::Tensor> {
        self.traffic.uploads.fetch_add(1, Ordering::Relaxed);
        self.inner.upload(host)
    }

    fn download(&self, t: &Self::Tensor) -> Result<Vec<f32>> {
        self.traffic.downloads.fetch_add(1, Ordering::Relaxed);
        self.inner.download(t)
    }

    fn copy_into(&self, src: &Self::Tensor, dst: &mut Self::Tensor) -> Result<()> {
        self.traffic.kernels.fetch_add(1, Ordering::Relaxed);
        self.inner.copy_into(src, dst)
    }

    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize] {
        self.inner.shape(t)
    }

    fn dtype(&self, t: &Self::Tensor) -> DType {
        self.inner.dtype(t)
    }

    fn act_dtype(&self) -> DType {
        self.inner.act_dtype()
    }

    fn is_lost(&self) -> bool {
        self.inner.is_lost()
    }

    fn bf16_ssm_state(&self) -> bool {
        self.inner.bf16_ssm_state()
    }

    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Self::Tensor> {
        self.inner.zeros(shape, dtype)
    }

    fn fill_dummy(&self, t: &mut Self::Tensor, seed: u64, std: f32, mean: f32) -> Result<()> {
        self.kernel();
        self.inner.fill_dummy(t, seed, std, mean)
    }
}

impl<B: LayerOps> LayerOps for Counting<B> {
    type Step = B::Step;

    fn set_ssm_chunk_size(&self, chunk: usize) {
        self.inner.set_ssm_chunk_size(chunk);
    }

    fn zeros_like(&self, x: &Self::Tensor) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.zeros_like(x)
    }

    fn embedding(&self, table: &Self::Tensor, step: &Self::Step) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.embedding(table, step)
    }

    fn linear(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        bias: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.linear(x, w, bias)
    }
    fn linear_shared(
        &self,
        x: &Self::Tensor,
        weights: &[(&Self::Tensor, Option<&Self::Tensor>)],
    ) -> Result<Vec<Self::Tensor>> {
        self.kernel();
        self.inner.linear_shared(x, weights)
    }
    fn gated_linear(
        &self,
        x: &Self::Tensor,
        gate: (&Self::Tensor, Option<&Self::Tensor>),
        up: (&Self::Tensor, Option<&Self::Tensor>),
        act: Activation,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.gated_linear(x, gate, up, act)
    }
    fn linear_activated(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        act: Activation,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.linear_activated(x, w, bias, act)
    }

    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()> {
        self.kernel();
        self.inner.add_assign(x, y)
    }

    fn scale_assign(&self, x: &mut Self::Tensor, s: f32) -> Result<()> {
        self.kernel();
        self.inner.scale_assign(x, s)
    }

    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f32) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.rms_norm(x, w, eps)
    }

    fn add_rms_norm(
        &self,
        residual: &mut Self::Tensor,
        delta: &Self::Tensor,
        w: &Self::Tensor,
        eps: f32,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.add_rms_norm(residual, delta, w, eps)
    }

    fn gated_rms_norm(
        &self,
        x: &Self::Tensor,
        gate: &Self::Tensor,
        w: &Self::Tensor,
        group: usize,
        eps: f32,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.gated_rms_norm(x, gate, w, group, eps)
    }

    fn activate(&self, x: &mut Self::Tensor, act: Activation) -> Result<()> {
        self.kernel();
        self.inner.activate(x, act)
    }

    fn gated_activation(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        act: Activation,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.gated_activation(gate, up, act)
    }

    fn split_cols<const N: usize>(
        &self,
        x: &Self::Tensor,
        widths: [usize; N],
    ) -> Result<[Self::Tensor; N]> {
        self.kernel();
        self.inner.split_cols(x, widths)
    }

    fn gather_logit_rows(&self, x: &Self::Tensor, step: &Self::Step) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.gather_logit_rows(x, step)
    }

    fn apply_rope(
        &self,
        x: &mut Self::Tensor,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        step: &Self::Step,
    ) -> Result<()> {
        self.kernel();
        self.inner.apply_rope(x, heads, head_dim, rope, step)
    }

    fn rope_paged_attention(
        &self,
        q: Self::Tensor,
        k: Self::Tensor,
        v: &Self::Tensor,
        cache: &mut KvLayer<Self::Tensor>,
        shape: AttnShape,
        rope: &Rope,
        step: &Self::Step,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner
            .rope_paged_attention(q, k, v, cache, shape, rope, step)
    }

    fn paged_attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        cache: &mut KvLayer<Self::Tensor>,
        shape: AttnShape,
        step: &Self::Step,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.paged_attention(q, k, v, cache, shape, step)
    }

    fn ssm_slot_ops(&self, pools: &mut SsmPools<Self::Tensor>, step: &Self::Step) -> Result<()> {
        self.kernel();
        self.inner.ssm_slot_ops(pools, step)
    }

    fn causal_conv1d(
        &self,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        pools: &mut SsmPools<Self::Tensor>,
        layer: usize,
        step: &Self::Step,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner
            .causal_conv1d(x, weight, bias, pools, layer, step)
    }

    fn ssm_scan(
        &self,
        x: &Self::Tensor,
        b: &Self::Tensor,
        c: &Self::Tensor,
        dt: &Self::Tensor,
        a_log: &Self::Tensor,
        d: &Self::Tensor,
        dt_bias: &Self::Tensor,
        shape: SsmShape,
        pools: &mut SsmPools<Self::Tensor>,
        layer: usize,
        step: &Self::Step,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner
            .ssm_scan(x, b, c, dt, a_log, d, dt_bias, shape, pools, layer, step)
    }

    fn mamba2_mix(
        &self,
        zxbcdt: &Self::Tensor,
        m: &Mamba2Mix<'_, Self::Tensor>,
        pools: &mut SsmPools<Self::Tensor>,
        layer: usize,
        step: &Self::Step,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.mamba2_mix(zxbcdt, m, pools, layer, step)
    }

    fn head_rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        head_dim: usize,
        eps: f32,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner.head_rms_norm(x, w, head_dim, eps)
    }

    fn sigmoid_gate(&self, x: &mut Self::Tensor, gate: &Self::Tensor) -> Result<()> {
        self.kernel();
        self.inner.sigmoid_gate(x, gate)
    }

    fn gated_delta_rule(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        a: &Self::Tensor,
        b: &Self::Tensor,
        a_log: &Self::Tensor,
        dt_bias: &Self::Tensor,
        shape: GdnShape,
        pools: &mut SsmPools<Self::Tensor>,
        layer: usize,
        step: &Self::Step,
    ) -> Result<Self::Tensor> {
        self.kernel();
        self.inner
            .gated_delta_rule(q, k, v, a, b, a_log, dt_bias, shape, pools, layer, step)
    }

    fn moe(
        &self,
        x: &Self::Tensor,
        router_logits: &Self::Tensor,
        routing: &MoeRouting<Self::Tensor>,
        experts: &StackedExperts<Self::Tensor>,
        out: &mut Self::Tensor,
    ) -> Result<()> {
        self.kernel();
        self.inner.moe(x, router_logits, routing, experts, out)
    }
}

impl<B: StepBackend> StepBackend for Counting<B> {
    fn graph_buckets(&self, max_batch: usize, max_tokens: usize) -> Vec<GraphBucket> {
        self.inner.graph_buckets(max_batch, max_tokens)
    }

    fn upload_graph_step(
        &self,
        plan: &StepPlan,
        step: &mut Self::Step,
        bucket: GraphBucket,
        max_blocks: usize,
    ) -> Result<bool> {
        self.inner.upload_graph_step(plan, step, bucket, max_blocks)
    }

    fn capture_graph(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<usize> {
        self.inner.capture_graph(run)
    }

    fn replay_graph(&self, id: usize) -> Result<()> {
        self.inner.replay_graph(id)
    }

    fn new_step(&self, max_tokens: usize) -> Result<Self::Step> {
        self.inner.new_step(max_tokens)
    }

    fn upload_step(&self, plan: &StepPlan, step: &mut Self::Step) -> Result<()> {
        self.traffic.step_uploads.fetch_add(1, Ordering::Relaxed);
        self.inner.upload_step(plan, step)
    }

    fn packs_ahead(&self) -> bool {
        self.inner.packs_ahead()
    }

    fn pack_step(
        &self,
        plan: &StepPlan,
        step: &mut Self::Step,
        bucket: Option<GraphBucket>,
        max_blocks: usize,
    ) -> Result<bool> {
        self.inner.pack_step(plan, step, bucket, max_blocks)
    }

    fn repack_tokens(&self, plan: &StepPlan, step: &mut Self::Step) -> Result<()> {
        self.inner.repack_tokens(plan, step)
    }

    fn send_step(&self, step: &mut Self::Step) -> Result<()> {
        self.traffic.step_uploads.fetch_add(1, Ordering::Relaxed);
        self.inner.send_step(step)
    }
    fn step_clock_start(&self) -> Result<()> {
        self.inner.step_clock_start()
    }
    fn step_clock_end(&self) -> Result<Option<DeviceStepTime>> {
        self.inner.step_clock_end()
    }

    fn arena_stats(&self) -> ArenaStats {
        self.inner.arena_stats()
    }

    fn sample(
        &self,
        logits: &mut Self::Tensor,
        step: &Self::Step,
        out: &mut SampleOut,
    ) -> Result<()> {
        self.traffic.candidate_reads.fetch_add(1, Ordering::Relaxed);
        self.inner.sample(logits, step, out)
    }

    fn sample_start(
        &self,
        logits: &mut Self::Tensor,
        step: &Self::Step,
        out: &mut SampleOut,
    ) -> Result<()> {
        self.traffic.candidate_reads.fetch_add(1, Ordering::Relaxed);
        self.inner.sample_start(logits, step, out)
    }

    fn sample_finish(&self, out: &mut SampleOut) -> Result<()> {
        self.inner.sample_finish(out)
    }

    fn sample_ready(&self) -> bool {
        self.inner.sample_ready()
    }
}
