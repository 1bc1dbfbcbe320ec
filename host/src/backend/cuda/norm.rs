//! RMS norms on the CUDA backend: one block a row, the residual add fused into the norm that
//! follows it, the grouped gated norm of the Mamba2 output (through the column-range kernel of
//! [`super::mamba`], over whole tensors here), the per-head norm (q/k norms, the Gated DeltaNet
//! output norm: the row kernel over `head_dim`-wide rows) and the sigmoid gate.

use super::device::Arg;
use super::mamba::{Cols, GateNorm};
use super::{CudaBackend, CudaTensor, grid_for, shape_err};
use crate::backend::{BackendError, Result};

impl CudaBackend {
    pub(super) fn rms_norm_rows(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        let (rows, cols) = x.rows_cols();
        if w.len() != cols {
            return Err(shape_err("rms_norm weight", &w.shape, vec![cols]));
        }
        let out = self.tmp(&x.shape, x.dtype)?;
        self.launch(
            "rms_norm",
            x.dtype,
            rows as u32,
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(x.ptr),
                Arg::Ptr(w.ptr),
                Arg::U32(cols as u32),
                Arg::F32(eps),
            ],
        )?;
        Ok(out)
    }

    pub(super) fn add_rms_norm_rows(
        &self,
        residual: &mut CudaTensor,
        delta: &CudaTensor,
        w: &CudaTensor,
        eps: f32,
    ) -> Result<CudaTensor> {
        let (rows, cols) = residual.rows_cols();
        if delta.shape != residual.shape || w.len() != cols {
            return Err(shape_err(
                "add_rms_norm",
                &delta.shape,
                residual.shape.clone(),
            ));
        }
        let out = self.tmp(&residual.shape, residual.dtype)?;
        self.launch(
            "add_rms_norm",
            residual.dtype,
            rows as u32,
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(residual.ptr),
                Arg::Ptr(delta.ptr),
                Arg::Ptr(w.ptr),
                Arg::U32(cols as u32),
                Arg::F32(eps),
            ],
        )?;
        Ok(out)
    }

    pub(super) fn gated_rms_norm_dense(
        &self,
        x: &CudaTensor,
        gate: &CudaTensor,
        w: &CudaTensor,
        group: usize,
        eps: f32,
    ) -> Result<CudaTensor> {
        if gate.shape != x.shape {
            return Err(shape_err(
                "gated_rms_norm gate",
                &gate.shape,
                x.shape.clone(),
            ));
        }
        let out = self.gate_norm_cols(
            Cols::all(x),
            Cols::all(gate),
            Some(w),
            group,
            eps,
            GateNorm::GateThenNorm,
        )?;
        Ok(out.reshaped(&x.shape))
    }

    /// RMS norm of every `head_dim`-wide slice of each row with one `[head_dim]` weight: the
    /// row kernel over the tensor seen as `[rows · heads, head_dim]`.
    pub(super) fn head_rms_norm_rows(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        head_dim: usize,
        eps: f32,
    ) -> Result<CudaTensor> {
        let (rows, cols) = x.rows_cols();
        if head_dim == 0 || cols % head_dim != 0 || w.len() != head_dim || w.dtype != x.dtype {
            return Err(BackendError::Invalid(format!(
                "head_rms_norm: width {cols}, head_dim {head_dim}, weight {:?} {:?}",
                w.dtype, w.shape
            )));
        }
        let out = self.tmp(&x.shape, x.dtype)?;
        let slices = rows * (cols / head_dim);
        if slices == 0 {
            return Ok(out);
        }
        self.launch(
            "rms_norm",
            x.dtype,
            slices as u32,
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(x.ptr),
                Arg::Ptr(w.ptr),
                Arg::U32(head_dim as u32),
                Arg::F32(eps),
            ],
        )?;
        Ok(out)
    }

    /// `x *= sigmoid(gate)`, `gate` of `x`'s shape or one column broadcast over the row.
    pub(super) fn sigmoid_gate_rows(&self, x: &mut CudaTensor, gate: &CudaTensor) -> Result<()> {
        let (rows, cols) = x.rows_cols();
        let (grows, gcols) = gate.rows_cols();
        if grows != rows || (gcols != cols && gcols != 1) || gate.dtype != x.dtype {
            return Err(shape_err(
                "sigmoid_gate gate",
                &gate.shape,
                vec![rows, cols],
            ));
        }
        let n = x.len() as u64;
        if n == 0 {
            return Ok(());
        }
        self.launch(
            "sigmoid_gate",
            x.dtype,
            grid_for(n, self.sm_count()),
            &[
                Arg::Ptr(x.ptr),
                Arg::Ptr(gate.ptr),
                Arg::U64(n),
                Arg::U32(cols as u32),
                Arg::U32(gcols as u32),
            ],
        )
    }
}
