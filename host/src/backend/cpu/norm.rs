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
        Ok(self.normalized(x, group, w, eps))
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
        normalize_segments(&mut out.data, group, &w.data, eps);
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
        Ok(self.normalized(x, head_dim, w, eps))
    }

    /// `x` with every `segment`-wide slice of each row RMS-normalised, times `w` (one
    /// `segment`-wide weight for every slice, or one `[cols]` weight for the row).
    fn normalized(&self, x: &CpuTensor, segment: usize, w: &CpuTensor, eps: f32) -> CpuTensor {
        let mut out = self.tmp(&x.shape);
        out.data.copy_from_slice(&x.data);
        normalize_segments(&mut out.data, segment, &w.data, eps);
        out
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

/// RMS-normalises every `seg`-wide slice of `data` in place and scales it by its slice of `w`:
/// `w` is one weight per column of a row (`seg` dividing its length, each slice its own part of
/// it) or, `seg` long, the same weight for every slice (per-head norms).
fn normalize_segments(data: &mut [f32], seg: usize, w: &[f32], eps: f32) {
    data.par_chunks_mut(seg)
        .with_min_len(min_rows(seg))
        .enumerate()
        .for_each(|(i, slice)| {
            let ms = slice.iter().map(|v| v * v).sum::<f32>() / seg as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            let base = (i * seg) % w.len();
            for (v, wv) in slice.iter_mut().zip(&w[base..base + seg]) {
                *v = wv * (*v * inv);
            }
        });
}
