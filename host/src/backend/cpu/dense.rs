//! Dense operations on the CPU: linear layers through [`super::matmul`] (weights sharing an
//! input in one dispatch), the embedding and logit-row gathers, element-wise adds, scales and
//! activations, and column splits into copies.

use rayon::prelude::*;

use super::matmul::{Product, gemm_nt_shared};
use super::{CpuBackend, CpuStep, CpuTensor, PAR_MIN_ELEMS, apply_act, same_shape};
use crate::backend::{Activation, BackendError, Result, check_split};

impl CpuBackend {
    pub(super) fn project(
        &self,
        x: &CpuTensor,
        w: &CpuTensor,
        bias: Option<&CpuTensor>,
    ) -> Result<CpuTensor> {
        let [out] = self.linears(x, [(w, bias)])?;
        Ok(out)
    }

    pub(super) fn project_shared(
        &self,
        x: &CpuTensor,
        weights: &[(&CpuTensor, Option<&CpuTensor>)],
    ) -> Result<Vec<CpuTensor>> {
        match *weights {
            [a, b] => Ok(self.linears(x, [a, b])?.into()),
            [a, b, c] => Ok(self.linears(x, [a, b, c])?.into()),
            _ => weights
                .iter()
                .map(|(w, b)| self.project(x, w, *b))
                .collect(),
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

    pub(super) fn embed_rows(&self, table: &CpuTensor, step: &CpuStep) -> Result<CpuTensor> {
        self.gather_rows(table, &step.plan.tokens, |id, rows| {
            format!("token id {id} is outside the vocabulary of {rows}")
        })
    }

    pub(super) fn gather_logits(&self, x: &CpuTensor, step: &CpuStep) -> Result<CpuTensor> {
        self.gather_rows(x, &step.plan.logit_rows, |r, n| {
            format!("row {r} out of {n}")
        })
    }

    /// Rows `ids` of `x` as a new `[ids.len(), cols]` tensor; an id past the rows is an error
    /// worded by `out_of_range(id, rows)`.
    fn gather_rows(
        &self,
        x: &CpuTensor,
        ids: &[u32],
        out_of_range: impl Fn(usize, usize) -> String,
    ) -> Result<CpuTensor> {
        let (rows, cols) = x.rows_cols();
        let mut out = self.tmp(&[ids.len(), cols]);
        for (o, &id) in out.data.chunks_mut(cols.max(1)).zip(ids) {
            let id = id as usize;
            if id >= rows {
                return Err(BackendError::Invalid(out_of_range(id, rows)));
            }
            o.copy_from_slice(x.row(id));
        }
        Ok(out)
    }

    pub(super) fn add_in_place(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        same_shape("add", x, y)?;
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
        Ok(())
    }

    pub(super) fn scale_in_place(&self, x: &mut CpuTensor, s: f32) -> Result<()> {
        for a in &mut x.data {
            *a *= s;
        }
        Ok(())
    }

    pub(super) fn activate_in_place(&self, x: &mut CpuTensor, act: Activation) -> Result<()> {
        x.data
            .par_iter_mut()
            .with_min_len(PAR_MIN_ELEMS)
            .for_each(|v| *v = apply_act(*v, act));
        Ok(())
    }

    pub(super) fn act_mul(
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

    pub(super) fn copy_col_ranges<const N: usize>(
        &self,
        x: &CpuTensor,
        widths: [usize; N],
    ) -> Result<[CpuTensor; N]> {
        let (rows, cols) = x.rows_cols();
        check_split(&widths, cols)?;
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
}
