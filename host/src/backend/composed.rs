//! The fused operations of [`LayerOps`] written as the operations they fuse: what the CPU
//! reference runs for them, and so the definition a device's fused kernel is checked against.
//!
//! These are not defaults: no trait method falls back to them. A backend that has no fused
//! form of an operation calls the function here by name, in its own table, where a reader
//! (and a wrapper) can see it.

use super::{
    Activation, AttnShape, BackendError, KvLayer, LayerOps, Mamba2Mix, Result, Rope, SsmOperands,
    SsmOutNorm, SsmPools,
};

/// [`LayerOps::gated_linear`] as [`LayerOps::linear_shared`] then
/// [`LayerOps::gated_activation`].
pub fn gated_linear<B: LayerOps>(
    b: &B,
    x: &B::Tensor,
    gate: (&B::Tensor, Option<&B::Tensor>),
    up: (&B::Tensor, Option<&B::Tensor>),
    act: Activation,
) -> Result<B::Tensor> {
    let outs = b.linear_shared(x, &[gate, up])?;
    let [g, u] = <[B::Tensor; 2]>::try_from(outs)
        .map_err(|_| BackendError::Invalid("linear_shared: not two outputs".into()))?;
    b.gated_activation(&g, &u, act)
}

/// [`LayerOps::linear_activated`] as [`LayerOps::linear`] then [`LayerOps::activate`].
pub fn linear_activated<B: LayerOps>(
    b: &B,
    x: &B::Tensor,
    w: &B::Tensor,
    bias: Option<&B::Tensor>,
    act: Activation,
) -> Result<B::Tensor> {
    let mut y = b.linear(x, w, bias)?;
    b.activate(&mut y, act)?;
    Ok(y)
}

/// [`LayerOps::add_rms_norm`] as [`LayerOps::add_assign`] then [`LayerOps::rms_norm`].
pub fn add_rms_norm<B: LayerOps>(
    b: &B,
    residual: &mut B::Tensor,
    delta: &B::Tensor,
    w: &B::Tensor,
    eps: f32,
) -> Result<B::Tensor> {
    b.add_assign(residual, delta)?;
    b.rms_norm(residual, w, eps)
}

/// [`LayerOps::rope_paged_attention`] as [`LayerOps::apply_rope`] on `q` and on `k`, then
/// [`LayerOps::paged_attention`].
#[allow(clippy::too_many_arguments)]
pub fn rope_paged_attention<B: LayerOps>(
    b: &B,
    mut q: B::Tensor,
    mut k: B::Tensor,
    v: &B::Tensor,
    cache: &mut KvLayer<B::Tensor>,
    shape: AttnShape,
    rope: &Rope,
    step: &B::Step,
) -> Result<B::Tensor> {
    b.apply_rope(&mut q, shape.heads, shape.head_dim, rope, step)?;
    b.apply_rope(&mut k, shape.kv_heads, shape.head_dim, rope, step)?;
    b.paged_attention(&q, &k, v, cache, shape, step)
}

/// [`LayerOps::mamba2_mix`] on copied column ranges: [`mamba2_scan`], then the output norm
/// with `z` ([`SsmOutNorm`]; a norm before the gate over one group: a backend with several
/// groups normalises each with its own slice of the weight itself).
pub fn mamba2_mix<B: LayerOps>(
    b: &B,
    zxbcdt: &B::Tensor,
    m: &Mamba2Mix<'_, B::Tensor>,
    pools: &mut SsmPools<B::Tensor>,
    layer: usize,
    step: &B::Step,
) -> Result<B::Tensor> {
    let sh = m.shape;
    let d_inner = sh.d_inner();
    let (z, y) = mamba2_scan(b, zxbcdt, m, pools, layer, step)?;
    match m.norm {
        SsmOutNorm::GateThenNorm(w) => {
            b.gated_rms_norm(&y, &z, w, d_inner / sh.groups.max(1), m.eps)
        }
        SsmOutNorm::NormThenGate(w) if sh.groups <= 1 => {
            let y = b.rms_norm(&y, w, m.eps)?;
            b.gated_activation(&z, &y, Activation::Silu)
        }
        SsmOutNorm::NormThenGate(_) => Err(crate::backend::BackendError::Invalid(format!(
            "mamba2_mix: the composed form normalises before the gate over one group, not {}",
            sh.groups
        ))),
        SsmOutNorm::GateOnly => b.gated_activation(&z, &y, Activation::Silu),
    }
}

/// The part of [`LayerOps::mamba2_mix`] before the output norm: [`LayerOps::split_cols`],
/// [`LayerOps::causal_conv1d`] on `x | B | C`, [`LayerOps::ssm_scan`] on the result and `dt`.
/// Returns the gate `z` and the scan output `y`.
pub fn mamba2_scan<B: LayerOps>(
    b: &B,
    zxbcdt: &B::Tensor,
    m: &Mamba2Mix<'_, B::Tensor>,
    pools: &mut SsmPools<B::Tensor>,
    layer: usize,
    step: &B::Step,
) -> Result<(B::Tensor, B::Tensor)> {
    let sh = m.shape;
    let d_inner = sh.d_inner();
    let bc = sh.groups * sh.state_size;
    let [z, xbc, dt] = b.split_cols(zxbcdt, [d_inner, m.conv_dim(), sh.heads])?;
    let xbc = b.causal_conv1d(&xbc, m.conv_w, m.conv_b, pools, layer, step)?;
    let [xs, bm, cm] = b.split_cols(&xbc, [d_inner, bc, bc])?;
    let ops = SsmOperands {
        x: &xs,
        b: &bm,
        c: &cm,
        dt: &dt,
        a_log: m.a_log,
        d: m.d,
        dt_bias: m.dt_bias,
    };
    let y = b.ssm_scan(&ops, sh, pools, layer, step)?;
    Ok((z, y))
}
