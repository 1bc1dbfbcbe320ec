//! Element-wise and row operations on the CUDA backend: the embedding and logit-row gathers
//! (indices read from the step object), in-place adds, scales and activations, the gated
//! activation product, and column splits into dense copies.

use super::device::Arg;
use super::{CudaBackend, CudaStep, CudaTensor, act_code, grid_for, shape_err};
use crate::backend::{Activation, BackendError, Result, check_split};

impl CudaBackend {
    pub(super) fn embed_rows(&self, table: &CudaTensor, step: &CudaStep) -> Result<CudaTensor> {
        self.step_ready(step)?;
        self.gather_rows(table, step.col(step.cols.tokens), step.dims.tokens)
    }

    pub(super) fn gather_logits(&self, x: &CudaTensor, step: &CudaStep) -> Result<CudaTensor> {
        self.step_ready(step)?;
        self.gather_rows(x, step.col(step.cols.logit_rows), step.dims.logit_rows)
    }

    /// `out[r] = x[rows[r]]` for the `n` row indices at device address `rows` (a step
    /// column); an index outside `x` gives a NaN row, never a silent wrong one.
    pub(super) fn gather_rows(&self, x: &CudaTensor, rows: u64, n: usize) -> Result<CudaTensor> {
        let (n_in, cols) = x.rows_cols();
        let out = self.tmp(&[n, cols], x.dtype)?;
        self.launch(
            "gather_rows",
            x.dtype,
            n as u32,
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(x.ptr),
                Arg::Ptr(rows),
                Arg::U32(n as u32),
                Arg::U32(cols as u32),
                Arg::U32(n_in as u32),
            ],
        )?;
        Ok(out)
    }

    pub(super) fn add_in_place(&self, x: &mut CudaTensor, y: &CudaTensor) -> Result<()> {
        if x.shape != y.shape || x.dtype != y.dtype {
            return Err(shape_err("add", &y.shape, x.shape.clone()));
        }
        let n = x.len() as u64;
        self.launch(
            "add_assign",
            x.dtype,
            grid_for(n, self.sm_count()),
            &[Arg::Ptr(x.ptr), Arg::Ptr(y.ptr), Arg::U64(n)],
        )
    }

    pub(super) fn scale_in_place(&self, x: &mut CudaTensor, s: f32) -> Result<()> {
        let n = x.len() as u64;
        self.launch(
            "scale_assign",
            x.dtype,
            grid_for(n, self.sm_count()),
            &[Arg::Ptr(x.ptr), Arg::U64(n), Arg::F32(s)],
        )
    }

    pub(super) fn activate_in_place(&self, x: &mut CudaTensor, act: Activation) -> Result<()> {
        let n = x.len() as u64;
        self.launch(
            "activate",
            x.dtype,
            grid_for(n, self.sm_count()),
            &[Arg::Ptr(x.ptr), Arg::U64(n), Arg::U32(act_code(act))],
        )
    }

    pub(super) fn act_mul(
        &self,
        gate: &CudaTensor,
        up: &CudaTensor,
        act: Activation,
    ) -> Result<CudaTensor> {
        if gate.shape != up.shape {
            return Err(shape_err("gated_activation", &up.shape, gate.shape.clone()));
        }
        let out = self.tmp(&gate.shape, gate.dtype)?;
        let n = out.len() as u64;
        self.launch(
            "act_mul",
            gate.dtype,
            grid_for(n, self.sm_count()),
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(gate.ptr),
                Arg::Ptr(up.ptr),
                Arg::U64(n),
                Arg::U32(act_code(act)),
            ],
        )?;
        Ok(out)
    }

    pub(super) fn copy_col_ranges<const N: usize>(
        &self,
        x: &CudaTensor,
        widths: [usize; N],
    ) -> Result<[CudaTensor; N]> {
        let (rows, cols) = x.rows_cols();
        check_split(&widths, cols)?;
        let mut parts = Vec::with_capacity(N);
        let mut start = 0;
        for &w in &widths {
            let p = self.tmp(&[rows, w], x.dtype)?;
            let n = (rows * w) as u64;
            self.launch(
                "copy_cols",
                x.dtype,
                grid_for(n, self.sm_count()),
                &[
                    Arg::Ptr(p.ptr),
                    Arg::Ptr(x.ptr),
                    Arg::U32(rows as u32),
                    Arg::U32(w as u32),
                    Arg::U32(cols as u32),
                    Arg::U32(start as u32),
                ],
            )?;
            start += w;
            parts.push(p);
        }
        parts
            .try_into()
            .map_err(|_| BackendError::Invalid("split_cols arity".into()))
    }
}
