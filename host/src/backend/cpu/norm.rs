//! RMS norms and gates on the CPU: over whole rows, over `group`-wide slices after a SiLU gate
//! (the Mamba2 output norm), over each head's slice (q/k norms, the Gated DeltaNet output
//! norm), and the sigmoid gate with a per-row broadcast.

use rayon::prelude::*;

use super::{CpuBackend, CpuTensor, min_rows, same_shape, silu};
use crate::backend::{BackendError, Result};

impl CpuBackend {
    pub(super) fn rms_norm_rows(
        &self,
        x: &CpuTensor,
        w: &CpuTensor,
        eps: f32,
    ) -> Result<CpuTensor> {
        let (_, cols) = x.rows_cols();
        if w.data.len() != cols {
            return Err(BackendError::Shape {
                what: "rms_norm weight".into(),
                got: w.shape.clone(),
                expected: vec![cols],
            });
        }
        self.rms_norm_groups(x, w, cols, eps)
    }

    /// RMS norm of every `group`-wide slice of each row, times its own slice of `w [cols]`
    /// (Falcon-H1's Mamba2 output norm before the gate, per group; `group = cols`: a row norm).
    pub(super) fn rms_norm_groups(
        &self,
        x: &CpuTensor,
        w: &CpuTensor,
        group: usize,
        eps: f32,
    ) -> Result<CpuTensor> {
        let (_, cols) = x.rows_cols();
        if w.data.len() != cols || group == 0 || cols % group != 0 {
            return Err(BackendError::Invalid(format!(
                "rms_norm: width {cols}, weight {:?}, group {group}",
                w.shape
            )));
        }
        let mut out = self.tmp(&x.shape);
        out.data.copy_from_slice(&x.data);
        out.data
            .par_chunks_mut(group)
            .with_min_len(min_rows(group))
            .enumerate()
            .for_each(|(i, seg)| {
                let ms = seg.iter().map(|v| v * v).sum::<f32>() / group as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                let base = (i * group) % cols;
                for (v, wv) in seg.iter_mut().zip(&w.data[base..base + group]) {
                    *v = wv * (*v * inv);
                }
            });
        Ok(out)
    }

    pub(super) fn gated_rms_norm_groups(
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

    pub(super) fn head_rms_norm_rows(
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

    pub(super) fn sigmoid_gate_rows(&self, x: &mut CpuTensor, gate: &CpuTensor) -> Result<()> {
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
}
