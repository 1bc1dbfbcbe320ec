//! The Mamba2 mixer: in_proj → (gate z | xBC | dt) → causal conv on xBC → selective scan →
//! gated RMSNorm with z → out_proj. Used by Mamba2, NemotronH, Bamba, Granite 4.0 and
//! Falcon-H1 (whose output norm may be absent, or come before the gate: [`OutNorm`]). The
//! middle (conv, scan, norm) is one backend operation, [`LayerOps::mamba2_mix`], so a device
//! reads the projection's column ranges in place instead of copying them out.

use super::{Linear, Loader, StepCtx};
use crate::backend::{LayerOps, Mamba2Mix, SsmOutNorm, SsmShape};
use crate::model::ModelError;

pub struct Mamba2Mixer<B: LayerOps> {
    pub in_proj: Linear<B>,
    pub conv_w: B::Tensor,
    pub conv_b: Option<B::Tensor>,
    pub dt_bias: B::Tensor,
    pub a_log: B::Tensor,
    pub d: B::Tensor,
    pub norm: OutNorm<B::Tensor>,
    pub out_proj: Linear<B>,
    pub shape: SsmShape,
    pub conv_kernel: usize,
    pub eps: f32,
    /// Index of this layer among the model's SSM layers (its state slots).
    pub cache: usize,
}

/// How the scan output `y` meets the gate `z` before `out_proj` (the backend's
/// [`SsmOutNorm`]).
pub type OutNorm<T> = SsmOutNorm<T>;

/// Which [`OutNorm`] a mixer loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutNormKind {
    GateThenNorm,
    NormThenGate,
    GateOnly,
}

/// What an architecture file states about one Mamba2 mixer.
#[derive(Debug, Clone, Copy)]
pub struct Mamba2Spec {
    pub hidden: usize,
    pub shape: SsmShape,
    pub conv_kernel: usize,
    pub conv_bias: bool,
    pub proj_bias: bool,
    pub eps: f64,
    pub cache: usize,
}

impl Mamba2Spec {
    pub fn conv_dim(&self) -> usize {
        self.shape.d_inner() + 2 * self.shape.groups * self.shape.state_size
    }

    /// f32 elements of conv state per slot.
    pub fn conv_state_elems(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1)
    }
}

impl<B: LayerOps> Mamba2Mixer<B> {
    pub fn load(l: &Loader<'_, B>, prefix: &str, s: Mamba2Spec) -> Result<Self, ModelError> {
        Self::load_with_norm(l, prefix, s, OutNormKind::GateThenNorm)
    }

    pub fn load_with_norm(
        l: &Loader<'_, B>,
        prefix: &str,
        s: Mamba2Spec,
        norm: OutNormKind,
    ) -> Result<Self, ModelError> {
        let sh = s.shape;
        if sh.groups == 0 || !sh.heads.is_multiple_of(sh.groups) || s.conv_kernel < 2 {
            return Err(ModelError::Unsupported(format!(
                "Mamba2 with {} heads, {} groups, conv kernel {}",
                sh.heads, sh.groups, s.conv_kernel
            )));
        }
        let d_inner = sh.d_inner();
        let conv_dim = s.conv_dim();
        let proj = d_inner + conv_dim + sh.heads;
        let p = |n: &str| format!("{prefix}.{n}");
        Ok(Self {
            in_proj: l.linear(&p("in_proj"), proj, s.hidden, s.proj_bias)?,
            conv_w: l.tensor(&p("conv1d.weight"), &[conv_dim, 1, s.conv_kernel])?,
            conv_b: if s.conv_bias {
                Some(l.tensor(&p("conv1d.bias"), &[conv_dim])?)
            } else {
                None
            },
            dt_bias: l.tensor(&p("dt_bias"), &[sh.heads])?,
            a_log: l.tensor(&p("A_log"), &[sh.heads])?,
            d: l.tensor(&p("D"), &[sh.heads])?,
            norm: match norm {
                OutNormKind::GateThenNorm => {
                    OutNorm::GateThenNorm(l.tensor(&p("norm.weight"), &[d_inner])?)
                }
                OutNormKind::NormThenGate => {
                    OutNorm::NormThenGate(l.tensor(&p("norm.weight"), &[d_inner])?)
                }
                OutNormKind::GateOnly => OutNorm::GateOnly,
            },
            out_proj: l.linear(&p("out_proj"), s.hidden, d_inner, s.proj_bias)?,
            shape: sh,
            conv_kernel: s.conv_kernel,
            eps: s.eps as f32,
            cache: s.cache,
        })
    }

    pub fn forward(
        &self,
        b: &B,
        x: &B::Tensor,
        ctx: &mut StepCtx<'_, B>,
    ) -> Result<B::Tensor, ModelError> {
        let zxbcdt = self.in_proj.forward(b, x)?;
        let pools = ctx
            .ssm
            .as_deref_mut()
            .ok_or_else(|| ModelError::Backend(format!("no SSM state for layer {}", self.cache)))?;
        let mix = Mamba2Mix {
            conv_w: &self.conv_w,
            conv_b: self.conv_b.as_ref(),
            a_log: &self.a_log,
            d: &self.d,
            dt_bias: &self.dt_bias,
            norm: &self.norm,
            shape: self.shape,
            eps: self.eps,
        };
        let y = b.mamba2_mix(&zxbcdt, &mix, pools, self.cache, ctx.step)?;
        self.out_proj.forward(b, &y)
    }
}
