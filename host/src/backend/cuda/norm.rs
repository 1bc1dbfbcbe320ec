//! RMS norms on the CUDA backend: one block a row, the residual add fused into the norm that
//! follows it, and the grouped gated norm of the Mamba2 output (through the column-range
//! kernel of [`super::mamba`], over whole tensors here).

use super::device::Arg;
use super::mamba::{Cols, GateNorm};
use super::{CudaBackend, CudaTensor, shape_err};
use crate::backend::Result;

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
}
