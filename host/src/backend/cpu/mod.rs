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

mod attention;
mod gdn;
mod matmul;
pub mod moe;
pub mod sample;
mod ssm;

pub use gdn::{gdn_chunked_head, gdn_recurrent_head};
pub use ssm::{ssm_chunked_head, ssm_recurrent_head};

pub(crate) use matmul::gemm_nt;
use matmul::{Product, gemm_nt_shared};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use super::{
    Activation, ArenaStats, AttnShape, Backend, BackendError, DType, DeviceStepTime, GdnShape,
    GraphBucket, HostTensor, KvLayer, LayerOps, Mamba2Mix, MoeRouting, MoeScoring, Result, Rope,
    SampleOut, SlotOp, SsmPools, SsmShape, StackedExperts, StepBackend, StepPlan, composed,
};

/// A dense f32 tensor in host memory.
#[derive(Debug, Default)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub shape: Vec<usize>,
    /// Where the memory goes back when the tensor is dropped (temporaries only).
    arena: Option<Arc<Arena>>,
}

impl Clone for CpuTensor {
    fn clone(&self) -> Self {
        Self {
            data: self.data.clone(),
            shape: self.shape.clone(),
            arena: None,
        }
    }
}

impl PartialEq for CpuTensor {
    fn eq(&self, other: &Self) -> bool {
        self.shape == other.shape && self.data == other.data
    }
}

impl Drop for CpuTensor {
    fn drop(&mut self) {
        if let Some(arena) = self.arena.take() {
            arena.give(
                std::mem::take(&mut self.data),
                std::mem::take(&mut self.shape),
            );
        }
    }
}

impl CpuTensor {
    pub fn new(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(BackendError::Invalid(format!(
                "{} values do not fill shape {shape:?}",
                data.len()
            )));
        }
        Ok(Self {
            data,
            shape: shape.to_vec(),
            arena: None,
        })
    }

    /// `(rows, cols)` treating every leading dim as rows.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        let rows = self.data.len().checked_div(cols).unwrap_or(0);
        (rows, cols)
    }

    pub fn row(&self, r: usize) -> &[f32] {
        let (_, c) = self.rows_cols();
        &self.data[r * c..(r + 1) * c]
    }
}

/// Recycled buffers for the tensors kernels create, kept per row width. Every buffer holds
/// `max_rows` rows of its width, so any later temporary of that width fits whatever the
/// step's token count: after the first step of a model, the arena grows only if more
/// temporaries of one width are alive at once than ever before.
/// A recycled tensor buffer: its values and its shape vector.
type FreeBuffer = (Vec<f32>, Vec<usize>);

#[derive(Debug, Default)]
pub struct Arena {
    free: Mutex<HashMap<usize, Vec<FreeBuffer>>>,
    max_rows: AtomicUsize,
    grown: AtomicU64,
    bytes: AtomicU64,
}

impl Arena {
    /// A tensor of `shape` on a recycled buffer of its width: zeroed when `zero`, otherwise
    /// holding stale values for a kernel that writes every element.
    fn take(self: &Arc<Self>, shape: &[usize], zero: bool) -> CpuTensor {
        let len: usize = shape.iter().product();
        let cols = shape.last().copied().unwrap_or(1).max(1);
        let rows = len / cols;
        let (mut data, mut dims) = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.get_mut(&cols).and_then(Vec::pop).unwrap_or_default()
        };
        if data.capacity() < len {
            let want = rows.max(self.max_rows.load(Ordering::Relaxed)) * cols;
            self.grown.fetch_add(1, Ordering::Relaxed);
            self.bytes
                .fetch_add(((want - data.capacity()) * 4) as u64, Ordering::Relaxed);
            data.reserve_exact(want - data.len());
        }
        if zero {
            data.clear();
        } else {
            data.truncate(len);
        }
        data.resize(len, 0.0);
        dims.clear();
        dims.extend_from_slice(shape);
        CpuTensor {
            data,
            shape: dims,
            arena: Some(self.clone()),
        }
    }

    fn give(&self, data: Vec<f32>, shape: Vec<usize>) {
        let cols = shape.last().copied().unwrap_or(1).max(1);
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        free.entry(cols).or_default().push((data, shape));
    }
}

/// The CPU backend: stateless kernels plus the arena its temporaries come from. Clones share
/// the arena; replicas get their own backend (and arena).
#[derive(Debug, Clone, Default)]
pub struct CpuBackend {
    arena: Arc<Arena>,
    /// Bytes of the tensors uploaded to this backend (the weights it holds).
    uploaded: Arc<AtomicU64>,
}

/// The CPU's step object: its own copy of the plan.
#[derive(Debug, Default)]
pub struct CpuStep {
    pub plan: StepPlan,
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

impl CpuBackend {
    /// A step temporary the kernel overwrites completely (not zeroed).
    fn tmp(&self, shape: &[usize]) -> CpuTensor {
        self.arena.take(shape, false)
    }

    /// Fills every free arena buffer with NaN, so a test can show that no kernel reads a
    /// temporary it did not write (stale values would surface in its outputs).
    pub fn poison_arena(&self) {
        let mut free = self.arena.free.lock().unwrap_or_else(|p| p.into_inner());
        for (data, _) in free.values_mut().flatten() {
            let cap = data.capacity();
            data.clear();
            data.resize(cap, f32::NAN);
        }
    }

    /// `x · w_sᵀ (+ b_s)` for `N` weights sharing `x`, as one dispatch of the product kernel.
    fn linears<const N: usize>(
        &self,
        x: &CpuTensor,
        weights: [(&CpuTensor, Option<&CpuTensor>); N],
    ) -> Result<[CpuTensor; N]> {
        let (n, k) = x.rows_cols();
        for (w, bias) in weights {
            let (m, wk) = w.rows_cols();
            if wk != k {
                return Err(BackendError::Shape {
                    what: "linear weight".into(),
                    got: w.shape.clone(),
                    expected: vec![m, k],
                });
            }
            if let Some(b) = bias
                && b.data.len() != m
            {
                return Err(BackendError::Shape {
                    what: "linear bias".into(),
                    got: b.shape.clone(),
                    expected: vec![m],
                });
            }
        }
        let mut outs = weights.map(|(w, _)| self.tmp(&[n, w.rows_cols().0]));
        let mut products: Vec<Product<'_>> = outs
            .iter_mut()
            .zip(&weights)
            .map(|(out, (w, _))| Product {
                w: &w.data,
                out: &mut out.data,
            })
            .collect();
        gemm_nt_shared(&x.data, n, k, &mut products);
        for (out, (w, bias)) in outs.iter_mut().zip(&weights) {
            if let Some(b) = bias {
                for row in out.data.chunks_mut(w.rows_cols().0.max(1)) {
                    for (o, bv) in row.iter_mut().zip(&b.data) {
                        *o += bv;
                    }
                }
            }
        }
        Ok(outs)
    }

    /// Bytes of the tensors uploaded so far (a model's weights, as f32), shared by clones.
    pub fn weight_bytes(&self) -> u64 {
        self.uploaded.load(Ordering::Relaxed)
    }

    /// A zeroed step temporary (for kernels that accumulate into it).
    fn tmp_zeroed(&self, shape: &[usize]) -> CpuTensor {
        self.arena.take(shape, true)
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
        host.check()?;
        let t = CpuTensor::new(host.to_f32(), host.shape)?;
        self.uploaded
            .fetch_add((t.data.len() * 4) as u64, Ordering::Relaxed);
        Ok(t)
    }

    fn download(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.data.clone())
    }

    fn copy_into(&self, src: &CpuTensor, dst: &mut CpuTensor) -> Result<()> {
        if src.shape != dst.shape {
            return Err(BackendError::Shape {
                what: "copy_into".into(),
                got: src.shape.clone(),
                expected: dst.shape.clone(),
            });
        }
        dst.data.copy_from_slice(&src.data);
        Ok(())
    }

    fn shape<'a>(&self, t: &'a CpuTensor) -> &'a [usize] {
        &t.shape
    }

    fn dtype(&self, _t: &CpuTensor) -> DType {
        DType::F32
    }

    fn zeros(&self, shape: &[usize], _dtype: DType) -> Result<CpuTensor> {
        let n = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| BackendError::OutOfMemory(format!("shape {shape:?} overflows")))?;
        let mut data = Vec::new();
        data.try_reserve_exact(n)
            .map_err(|e| BackendError::OutOfMemory(format!("{n} f32 for {shape:?}: {e}")))?;
        data.resize(n, 0.0);
        CpuTensor::new(data, shape)
    }

    fn fill_dummy(&self, t: &mut CpuTensor, seed: u64, std: f32, mean: f32) -> Result<()> {
        for (i, v) in t.data.iter_mut().enumerate() {
            *v = if std == 0.0 {
                mean
            } else {
                super::dummy_value(seed, i as u64, std)
            };
        }
        Ok(())
    }
}

impl LayerOps for CpuBackend {
    type Step = CpuStep;

    /// The CPU cuts no scan chunks ahead: its scan reads the plan.
    fn set_ssm_chunk_size(&self, _chunk: usize) {}

    fn zeros_like(&self, x: &CpuTensor) -> Result<CpuTensor> {
        Ok(self.tmp_zeroed(&x.shape))
    }

    fn embedding(&self, table: &CpuTensor, step: &CpuStep) -> Result<CpuTensor> {
        let (rows, cols) = table.rows_cols();
        let ids = &step.plan.tokens;
        let mut out = self.tmp(&[ids.len(), cols]);
        for (o, &id) in out.data.chunks_mut(cols.max(1)).zip(ids) {
            let id = id as usize;
            if id >= rows {
                return Err(BackendError::Invalid(format!(
                    "token id {id} is outside the vocabulary of {rows}"
                )));
            }
            o.copy_from_slice(table.row(id));
        }
        Ok(out)
    }

    fn linear(&self, x: &CpuTensor, w: &CpuTensor, bias: Option<&CpuTensor>) -> Result<CpuTensor> {
        let [out] = self.linears(x, [(w, bias)])?;
        Ok(out)
    }

    fn linear_shared(
        &self,
        x: &CpuTensor,
        weights: &[(&CpuTensor, Option<&CpuTensor>)],
    ) -> Result<Vec<CpuTensor>> {
        match *weights {
            [a, b] => Ok(self.linears(x, [a, b])?.into()),
            [a, b, c] => Ok(self.linears(x, [a, b, c])?.into()),
            _ => weights.iter().map(|(w, b)| self.linear(x, w, *b)).collect(),
        }
    }

    fn gated_linear(
        &self,
        x: &CpuTensor,
        gate: (&CpuTensor, Option<&CpuTensor>),
        up: (&CpuTensor, Option<&CpuTensor>),
        act: Activation,
    ) -> Result<CpuTensor> {
        composed::gated_linear(self, x, gate, up, act)
    }

    fn linear_activated(
        &self,
        x: &CpuTensor,
        w: &CpuTensor,
        bias: Option<&CpuTensor>,
        act: Activation,
    ) -> Result<CpuTensor> {
        composed::linear_activated(self, x, w, bias, act)
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        same_shape("add", x, y)?;
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
        Ok(())
    }

    fn scale_assign(&self, x: &mut CpuTensor, s: f32) -> Result<()> {
        for a in &mut x.data {
            *a *= s;
        }
        Ok(())
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        let (_, cols) = x.rows_cols();
        if w.data.len() != cols {
            return Err(BackendError::Shape {
                what: "rms_norm weight".into(),
                got: w.shape.clone(),
                expected: vec![cols],
            });
        }
        let mut out = self.tmp(&x.shape);
        out.data.copy_from_slice(&x.data);
        out.data
            .par_chunks_mut(cols.max(1))
            .with_min_len(min_rows(cols))
            .for_each(|row| {
                let ms = row.iter().map(|v| v * v).sum::<f32>() / cols as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                for (v, wv) in row.iter_mut().zip(&w.data) {
                    *v = wv * (*v * inv);
                }
            });
        Ok(out)
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
        same_shape("gated_rms_norm gate", x, gate)?;
        let (_, cols) = x.rows_cols();
        if w.data.len() != cols || group == 0 || cols % group != 0 {
            return Err(BackendError::Invalid(format!(
                "gated_rms_norm: width {cols}, weight {:?}, group {group}",
                w.shape
            )));
        }
        let mut out = self.tmp(&x.shape);
        for ((o, v), g) in out.data.iter_mut().zip(&x.data).zip(&gate.data) {
            *o = v * silu(*g);
        }
        out.data
            .par_chunks_mut(group)
            .with_min_len(min_rows(group))
            .enumerate()
            .for_each(|(i, seg)| {
                let ms = seg.iter().map(|v| v * v).sum::<f32>() / group as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                let base = (i * group) % cols;
                for (j, v) in seg.iter_mut().enumerate() {
                    *v = w.data[base + j] * (*v * inv);
                }
            });
        Ok(out)
    }

    fn activate(&self, x: &mut CpuTensor, act: Activation) -> Result<()> {
        x.data
            .par_iter_mut()
            .with_min_len(PAR_MIN_ELEMS)
            .for_each(|v| *v = apply_act(*v, act));
        Ok(())
    }

    fn gated_activation(
        &self,
        gate: &CpuTensor,
        up: &CpuTensor,
        act: Activation,
    ) -> Result<CpuTensor> {
        same_shape("gated_activation", gate, up)?;
        let mut out = self.tmp(&gate.shape);
        out.data
            .par_iter_mut()
            .zip(gate.data.par_iter().zip(&up.data))
            .with_min_len(PAR_MIN_ELEMS)
            .for_each(|(o, (g, u))| *o = apply_act(*g, act) * u);
        Ok(out)
    }

    fn split_cols<const N: usize>(
        &self,
        x: &CpuTensor,
        widths: [usize; N],
    ) -> Result<[CpuTensor; N]> {
        let (rows, cols) = x.rows_cols();
        if widths.iter().sum::<usize>() != cols {
            return Err(BackendError::Invalid(format!(
                "split widths {widths:?} do not sum to {cols} columns"
            )));
        }
        let mut parts: [CpuTensor; N] = std::array::from_fn(|i| self.tmp(&[rows, widths[i]]));
        for r in 0..rows {
            let row = x.row(r);
            let mut start = 0;
            for (p, &w) in parts.iter_mut().zip(&widths) {
                p.data[r * w..(r + 1) * w].copy_from_slice(&row[start..start + w]);
                start += w;
            }
        }
        Ok(parts)
    }

    fn gather_logit_rows(&self, x: &CpuTensor, step: &CpuStep) -> Result<CpuTensor> {
        let (n, cols) = x.rows_cols();
        let rows = &step.plan.logit_rows;
        let mut out = self.tmp(&[rows.len(), cols]);
        for (o, &r) in out.data.chunks_mut(cols.max(1)).zip(rows) {
            if r as usize >= n {
                return Err(BackendError::Invalid(format!("row {r} out of {n}")));
            }
            o.copy_from_slice(x.row(r as usize));
        }
        Ok(out)
    }

    fn apply_rope(
        &self,
        x: &mut CpuTensor,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        step: &CpuStep,
    ) -> Result<()> {
        let positions = &step.plan.positions;
        let (n, cols) = x.rows_cols();
        if cols != heads * head_dim || n != positions.len() || rope.rotary_dim > head_dim {
            return Err(BackendError::Invalid(format!(
                "rope: x {:?}, {heads} heads × {head_dim}, {} positions",
                x.shape,
                positions.len()
            )));
        }
        let half = rope.rotary_dim / 2;
        x.data
            .par_chunks_mut(cols.max(1))
            .zip(positions.par_iter())
            .with_min_len(min_rows(cols))
            .for_each(|(row, &pos)| {
                let p = pos as f32;
                for i in 0..half {
                    let angle = rope.inv_freq[i] * p;
                    let (s, c) = angle.sin_cos();
                    let (s, c) = (s * rope.attention_scaling, c * rope.attention_scaling);
                    for h in 0..heads {
                        let base = h * head_dim;
                        let x1 = row[base + i];
                        let x2 = row[base + i + half];
                        row[base + i] = x1 * c - x2 * s;
                        row[base + i + half] = x2 * c + x1 * s;
                    }
                }
            });
        Ok(())
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
        let mut out = self.tmp_zeroed(&q.shape);
        attention::paged_attention(q, k, v, cache, shape, &step.plan, &mut out)?;
        Ok(out)
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
        for pool in [&mut pools.conv, &mut pools.ssm] {
            let per = slot_elems(pool);
            let slots = pool.shape.first().copied().unwrap_or(0);
            for op in &step.plan.slot_ops {
                match *op {
                    SlotOp::Copy { from, to } => {
                        let (from, to) = (from as usize, to as usize);
                        if from >= slots || to >= slots {
                            return Err(BackendError::Invalid(format!(
                                "state slot {from} or {to} out of {slots}"
                            )));
                        }
                        if from != to {
                            pool.data
                                .copy_within(from * per..(from + 1) * per, to * per);
                        }
                    }
                    SlotOp::Zero { slot } => {
                        let slot = slot as usize;
                        if slot >= slots {
                            return Err(BackendError::Invalid(format!(
                                "state slot {slot} out of {slots}"
                            )));
                        }
                        pool.data[slot * per..(slot + 1) * per].fill(0.0);
                    }
                }
            }
        }
        Ok(())
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
        let mut out = self.tmp(&x.shape);
        let state = ssm::LayerState::new(&mut pools.conv, layer)?;
        ssm::causal_conv1d(x, weight, bias, state, &step.plan, &mut out)?;
        Ok(out)
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
        let mut out = self.tmp(&x.shape);
        let state = ssm::LayerState::new(&mut pools.ssm, layer)?;
        ssm::ssm_scan(
            x, b, c, dt, a_log, d, dt_bias, shape, state, &step.plan, &mut out,
        )?;
        Ok(out)
    }

    fn mamba2_mix(
        &self,
        zxbcdt: &CpuTensor,
        m: &Mamba2Mix<'_, CpuTensor>,
        pools: &mut SsmPools<CpuTensor>,
        layer: usize,
        step: &CpuStep,
    ) -> Result<CpuTensor> {
        composed::mamba2_mix(self, zxbcdt, m, pools, layer, step)
    }

    fn head_rms_norm(
        &self,
        x: &CpuTensor,
        w: &CpuTensor,
        head_dim: usize,
        eps: f32,
    ) -> Result<CpuTensor> {
        let (_, cols) = x.rows_cols();
        if head_dim == 0 || cols % head_dim != 0 || w.data.len() != head_dim {
            return Err(BackendError::Invalid(format!(
                "head_rms_norm: width {cols}, head_dim {head_dim}, weight {:?}",
                w.shape
            )));
        }
        let mut out = self.tmp(&x.shape);
        out.data.copy_from_slice(&x.data);
        out.data
            .par_chunks_mut(head_dim)
            .with_min_len(min_rows(head_dim))
            .for_each(|seg| {
                let ms = seg.iter().map(|v| v * v).sum::<f32>() / head_dim as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                for (v, wv) in seg.iter_mut().zip(&w.data) {
                    *v = wv * (*v * inv);
                }
            });
        Ok(out)
    }

    fn sigmoid_gate(&self, x: &mut CpuTensor, gate: &CpuTensor) -> Result<()> {
        let (rows, cols) = x.rows_cols();
        let (grows, gcols) = gate.rows_cols();
        if grows != rows || (gcols != cols && gcols != 1) {
            return Err(BackendError::Shape {
                what: "sigmoid_gate gate".into(),
                got: gate.shape.clone(),
                expected: vec![rows, cols],
            });
        }
        let sig = |g: f32| 1.0 / (1.0 + (-g).exp());
        x.data
            .par_chunks_mut(cols.max(1))
            .zip(gate.data.par_chunks(gcols.max(1)))
            .with_min_len(min_rows(cols))
            .for_each(|(row, g)| {
                if gcols == 1 {
                    let s = sig(g[0]);
                    row.iter_mut().for_each(|v| *v *= s);
                } else {
                    row.iter_mut().zip(g).for_each(|(v, &gv)| *v *= sig(gv));
                }
            });
        Ok(())
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
        let rows = q.rows_cols().0;
        let mut out = self.tmp(&[rows, shape.value_dim()]);
        let state = ssm::LayerState::new(&mut pools.ssm, layer)?;
        let inputs = gdn::GdnInputs {
            q,
            k,
            v,
            a,
            b,
            a_log,
            dt_bias,
        };
        gdn::gated_delta_rule(&inputs, shape, state, &step.plan, &mut out)?;
        Ok(out)
    }

    fn moe(
        &self,
        x: &CpuTensor,
        router_logits: &CpuTensor,
        routing: &MoeRouting<CpuTensor>,
        experts: &StackedExperts<CpuTensor>,
        out: &mut CpuTensor,
    ) -> Result<()> {
        moe_forward(x, router_logits, routing, experts, out)
    }
}

impl StepBackend for CpuBackend {
    fn new_step(&self, max_tokens: usize) -> Result<CpuStep> {
        self.arena.max_rows.fetch_max(max_tokens, Ordering::Relaxed);
        Ok(CpuStep::default())
    }

    fn upload_step(&self, plan: &StepPlan, step: &mut CpuStep) -> Result<()> {
        plan.validate()?;
        step.plan.copy_from(plan);
        Ok(())
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
        _max_blocks: usize,
    ) -> Result<bool> {
        if bucket.is_some() {
            return Ok(false);
        }
        self.upload_step(plan, step)?;
        Ok(true)
    }

    fn repack_tokens(&self, plan: &StepPlan, step: &mut CpuStep) -> Result<()> {
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

    fn send_step(&self, _step: &mut CpuStep) -> Result<()> {
        Ok(())
    }

    fn arena_stats(&self) -> ArenaStats {
        ArenaStats {
            grown: self.arena.grown.load(Ordering::Relaxed),
            bytes: self.arena.bytes.load(Ordering::Relaxed),
        }
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
        let plan = &step.plan;
        let (rows, vocab) = logits.rows_cols();
        if plan.sampling.len() != plan.sample_rows.len() {
            return Err(BackendError::Invalid(format!(
                "{} sampling rows for {} sampled logits rows",
                plan.sampling.len(),
                plan.sample_rows.len()
            )));
        }
        if plan.sample_rows.len() == rows {
            return sample::sample_tail(&mut logits.data, vocab, &plan.sampling, out);
        }
        // Prompt-logprob rows are interleaved: sample a gathered copy of the sampled rows.
        let mut picked = self.tmp(&[plan.sample_rows.len(), vocab]);
        for (dst, &r) in picked.data.chunks_mut(vocab.max(1)).zip(&plan.sample_rows) {
            if r as usize >= rows {
                return Err(BackendError::Invalid(format!(
                    "logits row {r} out of {rows}"
                )));
            }
            dst.copy_from_slice(logits.row(r as usize));
        }
        sample::sample_tail(&mut picked.data, vocab, &plan.sampling, out)
    }

    /// The device is the host: the whole tail runs here and the finish has nothing left.
    fn sample_start(
        &self,
        logits: &mut CpuTensor,
        step: &CpuStep,
        out: &mut SampleOut,
    ) -> Result<()> {
        self.sample(logits, step, out)
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

/// Routing then expert compute over stacked weights (see [`moe`]).
fn moe_forward(
    x: &CpuTensor,
    router_logits: &CpuTensor,
    routing: &MoeRouting<CpuTensor>,
    experts: &StackedExperts<CpuTensor>,
    out: &mut CpuTensor,
) -> Result<()> {
    let (tokens, hidden) = x.rows_cols();
    let (_, n_experts) = router_logits.rows_cols();
    same_shape("moe output", x, out)?;
    if experts.up.shape.len() != 3
        || experts
            .gate
            .as_ref()
            .is_some_and(|g| g.shape != experts.up.shape)
    {
        return Err(BackendError::Invalid(format!(
            "moe: stacked experts up {:?}, gate {:?}",
            experts.up.shape,
            experts.gate.as_ref().map(|g| &g.shape)
        )));
    }
    let inter = experts.up.shape[1];
    let r = moe::MoeRouting {
        experts: n_experts,
        n_group: routing.n_group,
        topk_group: routing.topk_group,
        top_k: routing.top_k,
        norm_topk_prob: routing.norm_topk_prob,
        scaling: routing.scaling,
        softmax: routing.scoring == MoeScoring::Softmax,
    };
    let n = tokens * routing.top_k;
    let (mut ids, mut weights) = (vec![0u32; n], vec![0f32; n]);
    match routing.scoring {
        MoeScoring::Sigmoid => moe::moe_route(
            &router_logits.data,
            tokens,
            &r,
            &routing.correction_bias.data,
            &mut ids,
            &mut weights,
        )?,
        MoeScoring::Softmax => {
            moe::moe_route_softmax(&router_logits.data, tokens, &r, &mut ids, &mut weights)?
        }
    }
    let shape = moe::ExpertShape {
        experts: n_experts,
        hidden,
        inter,
        top_k: routing.top_k,
        act: experts.act,
    };
    moe::moe_experts_gated(
        &x.data,
        &ids,
        &weights,
        experts.gate.as_ref().map(|g| g.data.as_slice()),
        &experts.up.data,
        &experts.down.data,
        &shape,
        &mut out.data,
    )
}
