//! The Mamba2 mixer's middle on the CUDA backend: the causal conv, the selective scan and the
//! gated output norm reading their inputs as column ranges of wider matrices, in place.
//!
//! `in_proj` writes `zxbcdt = [z | x B C | dt]`; the conv reads `x B C` from it (row stride
//! the projection's width) and writes a contiguous `[n, conv_dim]`; the scan reads `x`, `B`
//! and `C` from that (row stride `conv_dim`) and `dt` from `zxbcdt`; the norm reads `y` and the
//! gate `z` (row stride the projection's width). No column is copied: a decode step's layer
//! is the conv, the scan and the norm (plus the two projections), where copying the ranges
//! out took six more launches.
//!
//! Column ranges ([`Cols`]) exist only inside this module and the operations it backs: no
//! [`CudaTensor`] is ever a strided view, so every other operation keeps reading dense rows.
//! Every address comes from tensors of the step's arena, so a captured graph replays the
//! same addresses.

use std::sync::atomic::Ordering;

use chimera_kernels::ssm;

use super::device::Arg;
use super::ssm::SsmTensors;
use super::{BLOCK, CudaBackend, CudaStep, CudaTensor, tuning_knob};
use crate::backend::{
    BackendError, DType, Mamba2Mix, Result, SsmOperands, SsmOutNorm, SsmPools, SsmShape,
};

/// SSD tuning knob for kernel work: heads one group-scan CTA walks (`CHIMERA_SSD_HEADS`; 0 or
/// unset: the planner's choice).
fn ssd_group_scan_heads() -> u32 {
    static V: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *V.get_or_init(|| tuning_knob("CHIMERA_SSD_HEADS"))
}

/// `rows` rows of `cols` elements from device address `ptr`, `ld` elements apart: a whole
/// dense tensor, or a range of its columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Cols {
    pub ptr: u64,
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
    pub dtype: DType,
}

impl Cols {
    /// All of `t`, every leading dim as rows.
    pub fn all(t: &CudaTensor) -> Self {
        let (rows, cols) = t.rows_cols();
        Self {
            ptr: t.ptr,
            rows,
            cols,
            ld: cols,
            dtype: t.dtype,
        }
    }

    /// Columns `start..start + width` of this range.
    pub fn range(self, start: usize, width: usize) -> Result<Self> {
        if start + width > self.cols {
            return Err(BackendError::Invalid(format!(
                "columns {start}..{} of a {}-column matrix",
                start + width,
                self.cols
            )));
        }
        Ok(Self {
            ptr: self.ptr + (start * self.dtype.size()) as u64,
            cols: width,
            ..self
        })
    }

    fn ld32(&self) -> u32 {
        self.ld as u32
    }
}

/// What the gated norm computes (the kernel's `mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GateNorm {
    /// `norm(x · silu(gate)) · w`.
    GateThenNorm = 0,
    /// `norm(x) · w · silu(gate)`.
    NormThenGate = 1,
    /// `x · silu(gate)`.
    GateOnly = 2,
}

impl CudaBackend {
    /// The depthwise causal conv with SiLU over `x` (a column range), continuing from and
    /// updating SSM layer `layer`'s conv state: [`crate::backend::LayerOps::causal_conv1d`].
    /// Returns a dense `[n, channels]`.
    pub(super) fn conv_cols(
        &self,
        x: Cols,
        weight: &CudaTensor,
        bias: Option<&CudaTensor>,
        pools: &mut SsmPools<CudaTensor>,
        layer: usize,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        self.step_ready(step)?;
        self.check_pools(pools, step, true)?;
        let (n, channels) = (x.rows, x.cols);
        let kernel = weight.shape.last().copied().unwrap_or(0);
        if weight.len() != channels * kernel
            || bias.is_some_and(|b| b.len() != channels)
            || n != step.dims.tokens
            || layer >= pools.layers
        {
            return Err(BackendError::Invalid(format!(
                "causal_conv1d: x [{n}, {channels}], weight {:?}, bias {:?}, layer {layer} of {}, \
                 {} tokens in the step",
                weight.shape,
                bias.map(|b| &b.shape),
                pools.layers,
                step.dims.tokens
            )));
        }
        let out = self.tmp(&[n, channels], x.dtype)?;
        let dims = ssm::ConvDims {
            channels: channels as u32,
            kernel: kernel as u32,
            layer: layer as u32,
            layers: pools.layers as u32,
            slots: pools.slots as u32,
            x_ld: x.ld32(),
            out_ld: channels as u32,
            recurrent_tokens: self.dev().ssm_recurrent_tokens.load(Ordering::Relaxed),
        };
        let launches = ssm::launches_conv(&step.ssm, dims, x.dtype == DType::BF16)
            .map_err(|e| BackendError::Invalid(e.to_string()))?;
        let t = SsmTensors {
            x: x.ptr,
            weight: weight.ptr,
            bias: bias.map_or(0, |b| b.ptr),
            out: out.ptr,
            ..SsmTensors::default()
        };
        self.run_ssm(launches, step, pools, &t, &[])?;
        Ok(out)
    }

    /// Checks a scan's operands against the shape, the step and the pools.
    fn check_scan(
        &self,
        ops: &SsmOperands<'_, CudaTensor, Cols>,
        shape: SsmShape,
        pools: &SsmPools<CudaTensor>,
        layer: usize,
        step: &CudaStep,
    ) -> Result<()> {
        self.step_ready(step)?;
        self.check_pools(pools, step, true)?;
        let n = step.dims.tokens;
        let SsmOperands {
            x,
            b,
            c,
            dt,
            a_log,
            d,
            dt_bias,
        } = *ops;
        let bc = shape.groups * shape.state_size;
        let dtypes_ok = [b.dtype, c.dtype, dt.dtype].iter().all(|&t| t == x.dtype);
        let per_head_ok = [a_log, d, dt_bias].iter().all(|t| t.len() == shape.heads);
        if (x.rows, x.cols) != (n, shape.d_inner())
            || (b.rows, b.cols) != (n, bc)
            || (c.rows, c.cols) != (n, bc)
            || (dt.rows, dt.cols) != (n, shape.heads)
            || b.ld != c.ld
            || !dtypes_ok
            || !per_head_ok
            || layer >= pools.layers
        {
            return Err(BackendError::Invalid(format!(
                "ssm_scan: x {x:?} b {b:?} c {c:?} dt {dt:?} for {shape:?} over {n} tokens"
            )));
        }
        if step.ssm.chunks() > 0 && step.ssm.chunk_size() as usize != shape.chunk_size.min(256) {
            return Err(BackendError::Invalid(format!(
                "ssm_scan: the step was planned with chunk size {}, the layer has {}",
                step.ssm.chunk_size(),
                shape.chunk_size
            )));
        }
        Ok(())
    }

    /// The selective scan over column ranges `x`, `b`, `c` and `dt`:
    /// [`crate::backend::LayerOps::ssm_scan`]. Returns a dense `y [n, heads·head_dim]`.
    pub(super) fn scan_cols(
        &self,
        ops: &SsmOperands<'_, CudaTensor, Cols>,
        shape: SsmShape,
        pools: &mut SsmPools<CudaTensor>,
        layer: usize,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        let SsmOperands {
            x,
            b,
            c,
            dt,
            a_log,
            d,
            dt_bias,
        } = *ops;
        self.check_scan(ops, shape, pools, layer, step)?;
        let n = step.dims.tokens;
        let out = self.tmp(&[n, shape.d_inner()], x.dtype)?;
        let dims = ssm::ScanDims {
            layer: layer as u32,
            layers: pools.layers as u32,
            slots: pools.slots as u32,
            dt_min: shape.dt_min,
            dt_max: shape.dt_max,
            state_bf16: pools.ssm.dtype == DType::BF16,
            x_ld: x.ld32(),
            bc_ld: b.ld32(),
            dt_ld: dt.ld32(),
            aligned16: [x.ptr, b.ptr, c.ptr].iter().all(|p| p % 16 == 0),
            group_scan_heads: ssd_group_scan_heads(),
            recurrent_tokens: self.dev().ssm_recurrent_tokens.load(Ordering::Relaxed),
            ..ssm::ScanDims::packed(
                shape.heads as u32,
                shape.head_dim as u32,
                shape.groups as u32,
                shape.state_size as u32,
            )
        };
        let bf16 = x.dtype == DType::BF16;
        let launches = ssm::launches_scan(&step.ssm, dims, bf16)
            .map_err(|e| BackendError::Invalid(e.to_string()))?;
        let scratch: Vec<CudaTensor> = ssm::scratch_bytes(&step.ssm, dims, bf16)
            .into_iter()
            .map(|bytes| self.tmp(&[bytes.div_ceil(4).max(1)], DType::F32))
            .collect::<Result<_>>()?;
        let t = SsmTensors {
            x: x.ptr,
            b: b.ptr,
            c: c.ptr,
            dt: dt.ptr,
            a_log: a_log.ptr,
            d: d.ptr,
            dt_bias: dt_bias.ptr,
            out: out.ptr,
            ..SsmTensors::default()
        };
        self.run_ssm(launches, step, pools, &t, &scratch)?;
        Ok(out)
    }

    /// `x` (a column range) gated by `gate` (another, same size) and normalised per
    /// `group`-wide slice, as `mode` says; `w` is `[cols]` (unused by [`GateNorm::GateOnly`]).
    /// Returns a dense `[rows, cols]`.
    pub(super) fn gate_norm_cols(
        &self,
        x: Cols,
        gate: Cols,
        w: Option<&CudaTensor>,
        group: usize,
        eps: f32,
        mode: GateNorm,
    ) -> Result<CudaTensor> {
        let (rows, cols) = (x.rows, x.cols);
        let w_ok = match (mode, w) {
            (GateNorm::GateOnly, _) => true,
            (_, Some(w)) => w.len() == cols && w.dtype == x.dtype,
            (_, None) => false,
        };
        if (gate.rows, gate.cols) != (rows, cols)
            || gate.dtype != x.dtype
            || !w_ok
            || group == 0
            || cols % group != 0
        {
            return Err(BackendError::Invalid(format!(
                "gated_rms_norm: x {x:?}, gate {gate:?}, weight {:?}, group {group}, {mode:?}",
                w.map(|w| &w.shape)
            )));
        }
        let out = self.tmp(&[rows, cols], x.dtype)?;
        if rows == 0 {
            return Ok(out);
        }
        self.launch_geo(
            "gated_rms_norm",
            x.dtype,
            (rows as u32, (cols / group) as u32, 1),
            (BLOCK, 1, 1),
            0,
            &[
                Arg::Ptr(out.ptr),
                Arg::Ptr(x.ptr),
                Arg::Ptr(gate.ptr),
                // GateOnly never reads the weight; any valid address will do.
                Arg::Ptr(w.map_or(x.ptr, |w| w.ptr)),
                Arg::U32(cols as u32),
                Arg::U32(group as u32),
                Arg::F32(eps),
                Arg::U32(x.ld32()),
                Arg::U32(gate.ld32()),
                Arg::U32(mode as u32),
            ],
        )?;
        Ok(out)
    }

    /// [`crate::backend::LayerOps::mamba2_mix`]: three operations (the conv, the scan, the
    /// gated norm), each reading its inputs in place from `zxbcdt` and the conv's output.
    pub(super) fn mamba2_mix_in_place(
        &self,
        zxbcdt: &CudaTensor,
        m: &Mamba2Mix<'_, CudaTensor>,
        pools: &mut SsmPools<CudaTensor>,
        layer: usize,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        let sh = m.shape;
        let d_inner = sh.d_inner();
        let bc = sh.groups * sh.state_size;
        let conv_dim = m.conv_dim();
        let all = Cols::all(zxbcdt);
        if all.cols != d_inner + conv_dim + sh.heads || sh.groups == 0 {
            return Err(BackendError::Invalid(format!(
                "mamba2_mix: in_proj output {:?} is not [n, {d_inner} + {conv_dim} + {}] ({sh:?})",
                zxbcdt.shape, sh.heads
            )));
        }
        let z = all.range(0, d_inner)?;
        let xbc = all.range(d_inner, conv_dim)?;
        let dt = all.range(d_inner + conv_dim, sh.heads)?;
        let conv_out = self.conv_cols(xbc, m.conv_w, m.conv_b, pools, layer, step)?;
        let conv = Cols::all(&conv_out);
        let ops = SsmOperands {
            x: conv.range(0, d_inner)?,
            b: conv.range(d_inner, bc)?,
            c: conv.range(d_inner + bc, bc)?,
            dt,
            a_log: m.a_log,
            d: m.d,
            dt_bias: m.dt_bias,
        };
        let y_out = self.scan_cols(&ops, sh, pools, layer, step)?;
        let y = Cols::all(&y_out);
        match m.norm {
            SsmOutNorm::GateThenNorm(w) => self.gate_norm_cols(
                y,
                z,
                Some(w),
                d_inner / sh.groups,
                m.eps,
                GateNorm::GateThenNorm,
            ),
            SsmOutNorm::NormThenGate(w) => self.gate_norm_cols(
                y,
                z,
                Some(w),
                d_inner / sh.groups,
                m.eps,
                GateNorm::NormThenGate,
            ),
            SsmOutNorm::GateOnly => {
                self.gate_norm_cols(y, z, None, d_inner, m.eps, GateNorm::GateOnly)
            }
        }
    }
}

impl CudaBackend {
    pub(super) fn conv_dense(
        &self,
        x: &CudaTensor,
        weight: &CudaTensor,
        bias: Option<&CudaTensor>,
        pools: &mut SsmPools<CudaTensor>,
        layer: usize,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        let out = self.conv_cols(Cols::all(x), weight, bias, pools, layer, step)?;
        Ok(out.reshaped(&x.shape))
    }

    pub(super) fn scan_dense(
        &self,
        x: &SsmOperands<'_, CudaTensor>,
        shape: SsmShape,
        pools: &mut SsmPools<CudaTensor>,
        layer: usize,
        step: &CudaStep,
    ) -> Result<CudaTensor> {
        let ops = SsmOperands {
            x: Cols::all(x.x),
            b: Cols::all(x.b),
            c: Cols::all(x.c),
            dt: Cols::all(x.dt),
            a_log: x.a_log,
            d: x.d,
            dt_bias: x.dt_bias,
        };
        let out = self.scan_cols(&ops, shape, pools, layer, step)?;
        Ok(out.reshaped(&x.x.shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_column_range_moves_the_address_and_keeps_the_stride() {
        let zxbcdt = Cols {
            ptr: 0x1000,
            rows: 3,
            cols: 262,
            ld: 262,
            dtype: DType::BF16,
        };
        let dt = zxbcdt.range(256, 6).expect("in range");
        assert_eq!((dt.ptr, dt.rows, dt.cols, dt.ld), (0x1000 + 512, 3, 6, 262));
        let f32_range = Cols {
            dtype: DType::F32,
            ..zxbcdt
        }
        .range(96, 160)
        .expect("in range");
        assert_eq!((f32_range.ptr, f32_range.cols), (0x1000 + 384, 160));
        assert!(zxbcdt.range(256, 7).is_err());
        assert!(dt.range(1, 6).is_err());
    }
}
