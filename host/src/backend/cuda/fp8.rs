//! FP8 weights on the CUDA backend: e4m3 codes and f32 scales kept on the device (`fp8.cu`),
//! and the linear layers over them.
//!
//! - One or two input rows (decode): the FP8 GEMV streams the codes once, in f32 or bf16 mode,
//!   with row or block scales.
//! - More rows in bf16 mode with row scales: the input is quantized per token (one e4m3 scale a
//!   row, the same kernel that quantizes weights) and cuBLASLt runs the FP8 GEMM with
//!   outer-vector scaling (weight scale per output feature, input scale per token), bias and
//!   bf16 output in its epilogue.
//! - Otherwise (f32 mode, the oracle; block scales at more than two rows; a cuBLASLt without
//!   the FP8 algorithm): the weight is dequantized into a step temporary and the float GEMM
//!   runs, so every path computes with the exact weight values.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use chimera_kernels::fp8 as k8;

use super::device::Arg;
use super::memory::{DevAlloc, dtoh, htod, sync};
use super::{BLOCK, CudaBackend, CudaTensor, act_code, grid_for, shape_err};
use crate::backend::fp8::{Fp8Scales, Fp8Weight};
use crate::backend::{Activation, BackendError, DType, Result, f32_bytes};

/// [`CudaBackend::set_fp8_gemv_variant`]'s "pick by shape".
pub const FP8_GEMV_AUTO: usize = usize::MAX;

impl CudaBackend {
    pub(super) fn upload_fp8_weight(&self, w: Fp8Weight<'_>) -> Result<CudaTensor> {
        w.check()?;
        let (scales, block) = match &w.scales {
            Fp8Scales::Rows(s) => (s, None),
            Fp8Scales::Blocks { block, scales } => (scales, Some(*block)),
        };
        let dev = self.dev();
        dev.bind()?;
        let codes = Arc::new(DevAlloc::new(dev, w.codes.len(), &self.inner.stats)?);
        let sbuf = Arc::new(DevAlloc::new(dev, scales.len() * 4, &self.inner.stats)?);
        // SAFETY: each allocation holds exactly the bytes copied into it.
        unsafe {
            htod(dev, self.stream(), codes.ptr, &w.codes)?;
            htod(dev, self.stream(), sbuf.ptr, f32_bytes(scales))?;
        }
        sync(dev, self.stream())?;
        Ok(CudaTensor::fp8_weight(codes, sbuf, w.shape.clone(), block))
    }

    /// Online quantization on the device: one scale per row, `max|row| / 448`.
    pub(super) fn quantize_on_device(&self, w: &CudaTensor) -> Result<CudaTensor> {
        if w.fp8.is_some() {
            return Err(BackendError::Invalid(
                "quantize_fp8: the weight is FP8 already".into(),
            ));
        }
        let (rows, cols) = w.rows_cols();
        let dev = self.dev();
        dev.bind()?;
        let codes = Arc::new(DevAlloc::new(dev, rows * cols, &self.inner.stats)?);
        let scales = Arc::new(DevAlloc::new(dev, rows * 4, &self.inner.stats)?);
        self.quantize_rows(w.ptr, w.dtype, codes.ptr, scales.ptr, rows, cols)?;
        sync(dev, self.stream())?;
        Ok(CudaTensor::fp8_weight(codes, scales, w.shape.clone(), None))
    }

    fn quantize_rows(
        &self,
        src: u64,
        dtype: DType,
        codes: u64,
        scales: u64,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.launch_geo(
            "fp8_quantize_rows",
            dtype,
            (rows as u32, 1, 1),
            (BLOCK, 1, 1),
            0,
            &[
                Arg::Ptr(src),
                Arg::Ptr(codes),
                Arg::Ptr(scales),
                Arg::U32(cols as u32),
            ],
        )
    }

    /// An FP8 weight's exact values on the host (load-time rewrites, tests).
    pub(super) fn download_fp8(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        let meta = t.fp8.as_ref().expect("an FP8 tensor");
        let dev = self.dev();
        dev.bind()?;
        let mut codes = vec![0u8; t.len()];
        let (rows, cols) = t.rows_cols();
        let n_scales = match meta.block {
            None => rows,
            Some(b) => {
                let per = t.shape[t.shape.len() - 2];
                (rows / per.max(1)) * per.div_ceil(b[0]) * cols.div_ceil(b[1])
            }
        };
        let mut scale_bytes = vec![0u8; n_scales * 4];
        // SAFETY: the allocations hold these many bytes; `sync` waits for the copies.
        unsafe {
            dtoh(dev, self.stream(), &mut codes, t.ptr)?;
            dtoh(dev, self.stream(), &mut scale_bytes, meta.ptr)?;
        }
        sync(dev, self.stream())?;
        let scales: Vec<f32> = scale_bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let w = Fp8Weight {
            shape: t.shape.clone(),
            codes: codes.into(),
            scales: match meta.block {
                None => Fp8Scales::Rows(scales.into()),
                Some(block) => Fp8Scales::Blocks {
                    block,
                    scales: scales.into(),
                },
            },
        };
        w.check()?;
        Ok(w.dequantize())
    }

    /// `x · wᵀ (+ b)` for an FP8 weight `w` (see the module docs for the paths).
    pub(super) fn project_fp8(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        bias: Option<&CudaTensor>,
    ) -> Result<CudaTensor> {
        let meta = w.fp8.as_ref().expect("an FP8 weight");
        let (n, k) = x.rows_cols();
        let (m, wk) = w.rows_cols();
        if wk != k || w.shape.len() != 2 {
            return Err(shape_err("FP8 linear weight", &w.shape, vec![m, k]));
        }
        if let Some(b) = bias {
            if b.len() != m {
                return Err(shape_err("linear bias", &b.shape, vec![m]));
            }
            self.check_dtype("linear bias", b)?;
        }
        self.check_dtype("linear input", x)?;
        if let Some(out) = self.fp8_gemv(x, (w, bias), None)? {
            return Ok(out);
        }
        if let Some(out) = self.fp8_gemm(x, w, bias)? {
            return Ok(out);
        }
        let (b0, b1) = meta.block.map_or((0, 0), |b| (b[0] as u32, b[1] as u32));
        let wd = self.tmp(&[m, k], x.dtype)?;
        self.launch_geo(
            "fp8_dequantize",
            x.dtype,
            (grid_for((m * k) as u64, self.sm_count()), 1, 1),
            (BLOCK, 1, 1),
            0,
            &[
                Arg::Ptr(w.ptr),
                Arg::Ptr(meta.ptr),
                Arg::Ptr(wd.ptr),
                Arg::U32(m as u32),
                Arg::U32(k as u32),
                Arg::U32(b0),
                Arg::U32(b1),
            ],
        )?;
        let out = self.tmp(&[n, m], x.dtype)?;
        self.inner.gemm.linear(
            self.stream(),
            x.dtype,
            x.ptr,
            wd.ptr,
            bias.map(|b| b.ptr),
            out.ptr,
            (n, k, m),
        )?;
        Ok(out)
    }

    /// cuBLASLt's FP8 GEMM for `x · wᵀ (+ b)`, the input rows quantized per token first:
    /// `None` where it does not apply (f32 mode, block scales, `k` not a multiple of 16, the
    /// path switched off, or no algorithm for the shape in this cuBLASLt), and the caller
    /// dequantizes the weight for a GEMM in the activations' dtype instead.
    fn fp8_gemm(
        &self,
        x: &CudaTensor,
        w: &CudaTensor,
        bias: Option<&CudaTensor>,
    ) -> Result<Option<CudaTensor>> {
        let meta = w.fp8.as_ref().expect("an FP8 weight");
        let (n, k) = x.rows_cols();
        let m = w.rows_cols().0;
        if x.dtype != DType::BF16
            || meta.block.is_some()
            || !k.is_multiple_of(16)
            || !self.inner.fp8_gemm.load(Ordering::Relaxed)
        {
            return Ok(None);
        }
        match self
            .inner
            .gemm
            .prepare_fp8(x.dtype, bias.is_some(), (n, k, m))
        {
            Ok(()) => {}
            // Logged once per shape (later calls of the shape fail fast, quietly).
            Err(BackendError::Device(e)) => {
                tracing::warn!(
                    error = %e,
                    "cuBLASLt has no FP8 GEMM with per-row scales for this shape: its FP8 \
                     weight is dequantized for a bf16 GEMM instead (slower)"
                );
                return Ok(None);
            }
            Err(_) => return Ok(None),
        }
        let out = self.tmp(&[n, m], x.dtype)?;
        let xq = self.tmp(&[n, k], DType::F8E4M3)?;
        let xs = self.tmp(&[n], DType::F32)?;
        self.quantize_rows(x.ptr, x.dtype, xq.ptr, xs.ptr, n, k)?;
        self.inner.gemm.linear_fp8(
            self.stream(),
            x.dtype,
            (xq.ptr, xs.ptr),
            (w.ptr, meta.ptr),
            bias.map(|b| b.ptr),
            out.ptr,
            (n, k, m),
        )?;
        Ok(Some(out))
    }

    /// The FP8 GEMV kernel for `n` rows of `dtype` activations through an `m × k` weight (its
    /// gate-and-up form where `gated`), with the rows its blocks cover; `None` for more than two
    /// rows. One bf16 row takes the variant [`k8::gemv_n1_bf16_pick`] picks for the shape (or
    /// the one [`Self::set_fp8_gemv_variant`] set), the default where that variant's blocks do
    /// not tile `m`.
    fn fp8_gemv_entry(
        &self,
        dtype: DType,
        (n, k, m): (usize, usize, usize),
        gated: bool,
    ) -> Option<(&'static str, usize)> {
        Some(match (dtype, n) {
            (DType::BF16, 1) => {
                let v = match self.inner.fp8_gemv_variant.load(Ordering::Relaxed) {
                    FP8_GEMV_AUTO => {
                        let pick = k8::gemv_n1_bf16_pick(m, k, self.sm_count() as usize);
                        let per_block = k8::GEMV_N1_BF16[pick].1 / (1 + usize::from(gated));
                        if m.is_multiple_of(per_block.max(1)) {
                            pick
                        } else {
                            0
                        }
                    }
                    v => v.min(k8::GEMV_N1_BF16.len() - 1),
                };
                k8::GEMV_N1_BF16[v]
            }
            (DType::BF16, 2) => ("fp8_gemv_bf16_n2", k8::GEMV_ROWS),
            (DType::F32, 1) => ("fp8_gemv_f32_n1", k8::GEMV_ROWS),
            (DType::F32, 2) => ("fp8_gemv_f32_n2", k8::GEMV_ROWS),
            _ => return None,
        })
    }

    /// The FP8 GEMV (`fp8.cu`) for one or two input rows: `x · wᵀ (+ b)`, or with `gated`
    /// (the up projection, its bias and the activation) `act(x · wᵀ + b) · (x · upᵀ + b_up)` in
    /// one launch. `None` where the shapes do not suit it (more rows, `k` not a multiple of 16,
    /// `m` not a multiple of the block's features, blocks narrower than 16 columns, gate and up
    /// of different shapes or scale layouts). The caller has checked shapes and dtypes.
    fn fp8_gemv(
        &self,
        x: &CudaTensor,
        (w, bias): (&CudaTensor, Option<&CudaTensor>),
        gated: Option<(&CudaTensor, Option<&CudaTensor>, Activation)>,
    ) -> Result<Option<CudaTensor>> {
        let Some(meta) = w.fp8.as_ref() else {
            return Ok(None);
        };
        let (n, k) = x.rows_cols();
        let (m, _) = w.rows_cols();
        let (b0, b1) = meta.block.map_or((0, 0), |b| (b[0] as u32, b[1] as u32));
        let Some((entry, rows)) = self.fp8_gemv_entry(x.dtype, (n, k, m), gated.is_some()) else {
            return Ok(None);
        };
        // A gated block computes half its rows' features (the other half are the up rows).
        let per_block = if gated.is_some() { rows / 2 } else { rows };
        let up = match gated {
            None => None,
            Some((up, up_bias, act)) => {
                let Some(up_meta) = up.fp8.as_ref() else {
                    return Ok(None);
                };
                if up.shape != w.shape || up_meta.block != meta.block {
                    return Ok(None);
                }
                Some((
                    up.ptr,
                    up_meta.ptr,
                    up_bias.map_or(0, |b| b.ptr),
                    act_code(act),
                ))
            }
        };
        if per_block == 0
            || !k.is_multiple_of(16)
            || !m.is_multiple_of(per_block)
            || (b0 != 0 && b1 % 16 != 0)
        {
            return Ok(None);
        }
        let out = self.tmp(&[n, m], x.dtype)?;
        let (w2, s2, bias2, act) = up.unwrap_or((0, 0, 0, 0));
        self.launch_exact(
            entry,
            ((m / per_block) as u32, 1, 1),
            (k8::WARPS * 32, 1, 1),
            0,
            &[
                Arg::Ptr(x.ptr),
                Arg::U32(n as u32),
                Arg::U32(k as u32),
                Arg::Ptr(w.ptr),
                Arg::Ptr(meta.ptr),
                Arg::U32(b0),
                Arg::U32(b1),
                Arg::Ptr(bias.map_or(0, |b| b.ptr)),
                Arg::Ptr(out.ptr),
                Arg::U32(m as u32),
                Arg::Ptr(w2),
                Arg::Ptr(s2),
                Arg::Ptr(bias2),
                Arg::U32(act),
            ],
        )?;
        Ok(Some(out))
    }

    /// `act(x · gateᵀ (+ b)) · (x · upᵀ (+ b))` for FP8 gate and up weights through the fused
    /// GEMV; `None` where it does not apply (the caller runs the two projections and the
    /// product).
    pub(super) fn project_gated_fp8(
        &self,
        x: &CudaTensor,
        gate: (&CudaTensor, Option<&CudaTensor>),
        up: (&CudaTensor, Option<&CudaTensor>),
        act: Activation,
    ) -> Result<Option<CudaTensor>> {
        let biases_fit = [gate, up]
            .iter()
            .all(|(w, b)| b.is_none_or(|b| b.len() == w.rows_cols().0 && b.dtype == x.dtype));
        if x.dtype != self.inner.dtype || gate.0.rows_cols().1 != x.rows_cols().1 || !biases_fit {
            return Ok(None);
        }
        self.fp8_gemv(x, gate, Some((up.0, up.1, act)))
    }

    /// Which variant of `chimera_kernels::fp8::GEMV_N1_BF16` one-row FP8 projections use (the
    /// bench times each; out-of-range picks the last): [`FP8_GEMV_AUTO`], the default, picks
    /// by shape (`chimera_kernels::fp8::gemv_n1_bf16_pick`).
    pub fn set_fp8_gemv_variant(&self, variant: usize) {
        self.inner
            .fp8_gemv_variant
            .store(variant, Ordering::Relaxed);
    }

    /// Whether FP8 weights at more than two rows use cuBLASLt's FP8 GEMM (bf16 mode, row
    /// scales) or are dequantized for the float GEMM (the bench times both).
    pub fn set_fp8_gemm(&self, on: bool) {
        self.inner.fp8_gemm.store(on, Ordering::Relaxed);
    }
}
