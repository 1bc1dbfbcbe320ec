//! The CPU reference backend: f32 everywhere, row-major `Vec<f32>` tensors.
//!
//! It is the oracle the accelerated backends are checked against, so clarity beats speed, but
//! it is threaded where it pays: GEMMs go through `matrixmultiply` (multi-threaded), attention
//! parallelises over query tokens and the SSM scan over heads (rayon).

mod attention;
pub mod moe;
pub mod sample;
mod ssm;

pub use ssm::{ssm_chunked_head, ssm_recurrent_head};

use rayon::prelude::*;

use super::{Activation, AttnShape, Backend, BackendError, KvLayer, Result, Rope, SsmShape};
use crate::model::SeqChunk;

/// A dense f32 tensor in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub shape: Vec<usize>,
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
        })
    }

    /// `(rows, cols)` treating every leading dim as rows.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = self.shape.last().copied().unwrap_or(1);
        let rows = if cols == 0 { 0 } else { self.data.len() / cols };
        (rows, cols)
    }

    pub fn row(&self, r: usize) -> &[f32] {
        let (_, c) = self.rows_cols();
        &self.data[r * c..(r + 1) * c]
    }
}

/// The CPU backend. Stateless: every kernel is a function of its arguments.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

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

/// `c[m, n] = a[m, k] · b[n, k]ᵀ` (row-major), single-precision GEMM.
pub(crate) fn gemm_nt(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the slices hold m*k, n*k and m*n elements (checked by the callers) and the
    // strides below address exactly those ranges; `c` does not alias `a` or `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            1,
            k as isize,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn from_host(&self, data: Vec<f32>, shape: &[usize]) -> Result<CpuTensor> {
        CpuTensor::new(data, shape)
    }

    fn to_host(&self, t: &CpuTensor) -> Vec<f32> {
        t.data.clone()
    }

    fn shape<'a>(&self, t: &'a CpuTensor) -> &'a [usize] {
        &t.shape
    }

    fn zeros(&self, shape: &[usize]) -> CpuTensor {
        CpuTensor {
            data: vec![0.0; shape.iter().product()],
            shape: shape.to_vec(),
        }
    }

    fn embedding(&self, table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
        let (rows, cols) = table.rows_cols();
        let mut out = Vec::with_capacity(ids.len() * cols);
        for &id in ids {
            let id = id as usize;
            if id >= rows {
                return Err(BackendError::Invalid(format!(
                    "token id {id} is outside the vocabulary of {rows}"
                )));
            }
            out.extend_from_slice(table.row(id));
        }
        CpuTensor::new(out, &[ids.len(), cols])
    }

    fn linear(&self, x: &CpuTensor, w: &CpuTensor, bias: Option<&CpuTensor>) -> Result<CpuTensor> {
        let (n, k) = x.rows_cols();
        let (m, wk) = w.rows_cols();
        if wk != k {
            return Err(BackendError::Shape {
                what: "linear weight".into(),
                got: w.shape.clone(),
                expected: vec![m, k],
            });
        }
        let mut out = vec![0.0f32; n * m];
        gemm_nt(&x.data, &w.data, &mut out, n, k, m);
        if let Some(b) = bias {
            if b.data.len() != m {
                return Err(BackendError::Shape {
                    what: "linear bias".into(),
                    got: b.shape.clone(),
                    expected: vec![m],
                });
            }
            for row in out.chunks_mut(m) {
                for (o, bv) in row.iter_mut().zip(&b.data) {
                    *o += bv;
                }
            }
        }
        CpuTensor::new(out, &[n, m])
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        same_shape("add", x, y)?;
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
        Ok(())
    }

    fn scale_assign(&self, x: &mut CpuTensor, s: f32) {
        for a in &mut x.data {
            *a *= s;
        }
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
        let mut out = x.data.clone();
        out.par_chunks_mut(cols.max(1)).for_each(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / cols as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for (v, wv) in row.iter_mut().zip(&w.data) {
                *v = wv * (*v * inv);
            }
        });
        CpuTensor::new(out, &x.shape)
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
        let mut out: Vec<f32> = x
            .data
            .iter()
            .zip(&gate.data)
            .map(|(v, g)| v * silu(*g))
            .collect();
        out.par_chunks_mut(group).enumerate().for_each(|(i, seg)| {
            let ms = seg.iter().map(|v| v * v).sum::<f32>() / group as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            let base = (i * group) % cols;
            for (j, v) in seg.iter_mut().enumerate() {
                *v = w.data[base + j] * (*v * inv);
            }
        });
        CpuTensor::new(out, &x.shape)
    }

    fn activate(&self, x: &mut CpuTensor, act: Activation) {
        x.data.par_iter_mut().for_each(|v| *v = apply_act(*v, act));
    }

    fn gated_activation(
        &self,
        gate: &CpuTensor,
        up: &CpuTensor,
        act: Activation,
    ) -> Result<CpuTensor> {
        same_shape("gated_activation", gate, up)?;
        let out = gate
            .data
            .par_iter()
            .zip(&up.data)
            .map(|(g, u)| apply_act(*g, act) * u)
            .collect();
        CpuTensor::new(out, &gate.shape)
    }

    fn split_cols(&self, x: &CpuTensor, widths: &[usize]) -> Result<Vec<CpuTensor>> {
        let (rows, cols) = x.rows_cols();
        if widths.iter().sum::<usize>() != cols {
            return Err(BackendError::Invalid(format!(
                "split widths {widths:?} do not sum to {cols} columns"
            )));
        }
        let mut parts: Vec<Vec<f32>> = widths
            .iter()
            .map(|w| Vec::with_capacity(rows * w))
            .collect();
        for r in 0..rows {
            let row = x.row(r);
            let mut start = 0;
            for (p, w) in parts.iter_mut().zip(widths) {
                p.extend_from_slice(&row[start..start + w]);
                start += w;
            }
        }
        parts
            .into_iter()
            .zip(widths)
            .map(|(p, w)| CpuTensor::new(p, &[rows, *w]))
            .collect()
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[u32]) -> Result<CpuTensor> {
        let (n, cols) = x.rows_cols();
        let mut out = Vec::with_capacity(rows.len() * cols);
        for &r in rows {
            if r as usize >= n {
                return Err(BackendError::Invalid(format!("row {r} out of {n}")));
            }
            out.extend_from_slice(x.row(r as usize));
        }
        CpuTensor::new(out, &[rows.len(), cols])
    }

    fn scatter_add_rows(
        &self,
        dst: &mut CpuTensor,
        src: &CpuTensor,
        rows: &[u32],
        weights: &[f32],
    ) -> Result<()> {
        let (n, cols) = dst.rows_cols();
        let (sn, scols) = src.rows_cols();
        if scols != cols || sn != rows.len() || weights.len() != rows.len() {
            return Err(BackendError::Invalid(
                "scatter_add_rows: shapes disagree".into(),
            ));
        }
        for (i, (&r, &wt)) in rows.iter().zip(weights).enumerate() {
            let r = r as usize;
            if r >= n {
                return Err(BackendError::Invalid(format!("row {r} out of {n}")));
            }
            let s = &src.data[i * cols..(i + 1) * cols];
            for (d, v) in dst.data[r * cols..(r + 1) * cols].iter_mut().zip(s) {
                *d += wt * v;
            }
        }
        Ok(())
    }

    fn apply_rope(
        &self,
        x: &mut CpuTensor,
        heads: usize,
        head_dim: usize,
        rope: &Rope,
        positions: &[u32],
    ) -> Result<()> {
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
        block_size: usize,
        shape: AttnShape,
        seqs: &[SeqChunk],
    ) -> Result<CpuTensor> {
        attention::paged_attention(q, k, v, cache, block_size, shape, seqs)
    }

    fn causal_conv1d(
        &self,
        x: &CpuTensor,
        weight: &CpuTensor,
        bias: Option<&CpuTensor>,
        state: &mut CpuTensor,
        seqs: &[SeqChunk],
    ) -> Result<CpuTensor> {
        ssm::causal_conv1d(x, weight, bias, state, seqs)
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
        state: &mut CpuTensor,
        seqs: &[SeqChunk],
    ) -> Result<CpuTensor> {
        ssm::ssm_scan(x, b, c, dt, a_log, d, dt_bias, shape, state, seqs)
    }

    fn copy_slot(&self, t: &mut CpuTensor, src: u32, dst: u32) -> Result<()> {
        let per = slot_elems(t);
        let slots = t.shape.first().copied().unwrap_or(0);
        let (src, dst) = (src as usize, dst as usize);
        if src >= slots || dst >= slots {
            return Err(BackendError::Invalid(format!(
                "state slot {src} or {dst} out of {slots}"
            )));
        }
        if src != dst {
            t.data.copy_within(src * per..(src + 1) * per, dst * per);
        }
        Ok(())
    }

    fn zero_slot(&self, t: &mut CpuTensor, slot: u32) -> Result<()> {
        let per = slot_elems(t);
        let slots = t.shape.first().copied().unwrap_or(0);
        let slot = slot as usize;
        if slot >= slots {
            return Err(BackendError::Invalid(format!(
                "state slot {slot} out of {slots}"
            )));
        }
        t.data[slot * per..(slot + 1) * per].fill(0.0);
        Ok(())
    }
}

pub(crate) fn slot_elems(t: &CpuTensor) -> usize {
    t.shape.iter().skip(1).product()
}
