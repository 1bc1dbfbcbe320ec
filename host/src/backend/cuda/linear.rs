//! Linear layers on the CUDA backend: bf16 projections of one to eight rows go to the one-pass
//! GEMV (`gemv.cu`: up to three weights sharing the input in one launch, with an activation
//! or a gated MLP's product in its epilogue); everything else to cuBLASLt ([`super::gemm`]).
//! A shape the GEMV does not take falls back to cuBLASLt and the separate element-wise
//! kernel, with the same result to rounding.

use std::sync::atomic::Ordering;

use super::device::Arg;
use super::{CudaBackend, CudaTensor, act_code, shape_err, tuning_knob};
use crate::backend::{Activation, BackendError, DType, LayerOps, Result};

use chimera_kernels::gemv::Mode as GemvMode;

/// Resident GEMV blocks an SM when the grid is capped (`CHIMERA_GEMV_BLOCKS_PER_SM`, a tuning
/// knob for kernel work; the blocks loop over row groups). 0, the default, launches a block per
/// row group.
fn gemv_blocks_per_sm() -> u32 {
    static V: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *V.get_or_init(|| tuning_knob("CHIMERA_GEMV_BLOCKS_PER_SM"))
}

/// The most rows a GEMV launch takes (`CHIMERA_GEMV_MAX_ROWS`, a tuning knob for kernel work:
/// 2 keeps three to eight rows on cuBLASLt, as before the tensor-core GEMV); 0, the default,
/// is [`chimera_kernels::gemv::MAX_ROWS`].
fn gemv_max_rows() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| match tuning_knob("CHIMERA_GEMV_MAX_ROWS") {
        0 => chimera_kernels::gemv::MAX_ROWS,
        n => n as usize,
    })
}

impl CudaBackend {
    pub(super) fn project(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        bias: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        if w.fp8.is_some() {
            return self.project_fp8(x, w, bias);
        }
        let (n, k) = x.rows_cols();
        let (m, wk) = w.rows_cols();
        if wk != k {
            return Err(shape_err("linear weight", &w.shape, vec![m, k]));
        }
        if let Some(b) = bias
            && b.len() != m
        {
            return Err(shape_err("linear bias", &b.shape, vec![m]));
        }
        self.check_dtype("linear input", x)?;
        self.check_dtype("linear weight", w)?;
        if let Some(mut outs) = self.try_gemv(x, &[(w, bias)], GemvMode::Plain, Activation::Silu)? {
            return Ok(outs.pop().expect("one segment"));
        }
        let out = self.tmp(&[n, m], x.dtype)?;
        self.inner.gemm.linear(
            self.stream(),
            x.dtype,
            x.ptr,
            w.ptr,
            bias.map(|b| b.ptr),
            out.ptr,
            (n, k, m),
        )?;
        Ok(out)
    }

    pub(super) fn project_shared(
        &self,
        x: &CudaTensor,
        weights: &[(&CudaTensor, Option<&CudaTensor>)],
    ) -> Result<Vec<CudaTensor>> {
        if self.gemv_inputs_fit(x, weights)
            && let Some(outs) = self.try_gemv(x, weights, GemvMode::Plain, Activation::Silu)?
        {
            return Ok(outs);
        }
        weights.iter().map(|(w, b)| self.linear(x, w, *b)).collect()
    }

    pub(super) fn project_gated(
        &self,
        x: &CudaTensor,
        gate: (&CudaTensor, Option<&CudaTensor>),
        up: (&CudaTensor, Option<&CudaTensor>),
        act: Activation,
    ) -> Result<CudaTensor> {
        if let Some(out) = self.project_gated_fp8(x, gate, up, act)? {
            return Ok(out);
        }
        let weights = [gate, up];
        if self.gemv_inputs_fit(x, &weights)
            && let Some(mut outs) = self.try_gemv(x, &weights, GemvMode::Gated, act)?
        {
            return Ok(outs.pop().expect("one output"));
        }
        let [g, u] = <[CudaTensor; 2]>::try_from(self.linear_shared(x, &weights)?)
            .map_err(|_| BackendError::Invalid("linear_shared: not two outputs".into()))?;
        self.gated_activation(&g, &u, act)
    }

    pub(super) fn project_activated(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        bias: Option<&CudaTensor>,
        act: Activation,
    ) -> Result<CudaTensor> {
        if self.gemv_inputs_fit(x, &[(w, bias)])
            && let Some(mut outs) = self.try_gemv(x, &[(w, bias)], GemvMode::Activated, act)?
        {
            return Ok(outs.pop().expect("one output"));
        }
        let mut y = self.linear(x, w, bias)?;
        self.activate(&mut y, act)?;
        Ok(y)
    }

    /// `y_s = x · w_sᵀ (+ b_s)` for up to three weights sharing `x` in one GEMV launch, with
    /// the epilogue `mode` (an activation, or a gated MLP's product: then one output), when
    /// the shapes allow it (bf16, one to eight rows, `k` a multiple of 8, every `m` a multiple of
    /// the variant's features per block, or of half of it for a gate and up of equal shape);
    /// `None` leaves the work to cuBLASLt.
    fn try_gemv(
        &self,
        x: &CudaTensor,
        segments: &[(&CudaTensor, Option<&CudaTensor>)],
        mode: GemvMode,
        act: Activation,
    ) -> Result<Option<Vec<CudaTensor>>> {
        let (n, k) = x.rows_cols();
        if n > gemv_max_rows() {
            return Ok(None);
        }
        let Some((entry, per_block)) = chimera_kernels::gemv::variant(n, k) else {
            return Ok(None);
        };
        let gated = mode == GemvMode::Gated;
        let row_multiple = if gated { per_block / 2 } else { per_block } as usize;
        if x.dtype != DType::BF16
            || !self.inner.small_m_gemv.load(Ordering::Relaxed)
            || !k.is_multiple_of(8)
            || segments.is_empty()
            || segments.len() > 3
            || (gated
                && (segments.len() != 2 || segments[0].0.rows_cols() != segments[1].0.rows_cols()))
            || segments
                .iter()
                .any(|(w, _)| !w.rows_cols().0.is_multiple_of(row_multiple))
        {
            return Ok(None);
        }
        let mut outs = Vec::with_capacity(segments.len());
        // x, n, k, then (weight, bias, output, m) for three segments (unused ones null with
        // m = 0), then the epilogue's mode and activation.
        let mut args = [Arg::Ptr(0); 17];
        args[..3].copy_from_slice(&[Arg::Ptr(x.ptr), Arg::U32(n as u32), Arg::U32(k as u32)]);
        let mut rows = 0usize;
        for (i, (w, b)) in segments.iter().enumerate() {
            let m = w.rows_cols().0;
            // A gated launch writes act(gate) * up into the first output only.
            let out = if i == 0 || !gated {
                let out = self.tmp(&[n, m], DType::BF16)?;
                let ptr = out.ptr;
                outs.push(out);
                ptr
            } else {
                0
            };
            args[3 + 4 * i..7 + 4 * i].copy_from_slice(&[
                Arg::Ptr(w.ptr),
                Arg::Ptr(b.map_or(0, |b| b.ptr)),
                Arg::Ptr(out),
                Arg::U32(m as u32),
            ]);
            rows += m;
        }
        for i in segments.len()..3 {
            args[6 + 4 * i] = Arg::U32(0);
        }
        args[15] = Arg::U32(mode as u32);
        args[16] = Arg::U32(act_code(act));
        let groups = (rows / per_block as usize) as u32;
        let grid = match gemv_blocks_per_sm() {
            0 => groups,
            b => groups.min(b * self.sm_count()),
        };
        self.launch_exact(
            entry,
            (grid, 1, 1),
            (chimera_kernels::gemv::WARPS * 32, 1, 1),
            0,
            &args,
        )?;
        Ok(Some(outs))
    }

    /// Whether bf16 linear layers of `x` with these weights may go to the GEMV (shapes and
    /// dtypes agree; the GEMV itself checks the rest).
    fn gemv_inputs_fit(
        &self,
        x: &CudaTensor,
        weights: &[(&CudaTensor, Option<&CudaTensor>)],
    ) -> bool {
        let k = x.rows_cols().1;
        x.dtype == self.inner.dtype
            && weights.iter().all(|(w, b)| {
                w.rows_cols().1 == k
                    && w.dtype == x.dtype
                    && b.is_none_or(|b| b.len() == w.rows_cols().0 && b.dtype == x.dtype)
            })
    }
}
