//! The Gated DeltaNet mixer (Qwen3-Next, Qwen3.5 "linear attention" layers): projections to
//! `q | k | v`, the gate `z` and the per-head `b` (β) and `a` (decay) inputs → short causal
//! conv + SiLU on `q | k | v` → the gated delta rule (L2-normalised q/k) → per-head RMS norm
//! gated by `silu(z)` → out_proj.
//!
//! Its state lives in the model's recurrent-state pools like a Mamba2 layer's: conv state
//! `[conv_dim, kernel − 1]` and delta-rule state `[v_heads, k_dim, v_dim]` per slot.
//!
//! On disk the projections come two ways. Qwen3.5 stores `in_proj_qkv`, `in_proj_z`,
//! `in_proj_b`, `in_proj_a`. Qwen3-Next stores `in_proj_qkvz` and `in_proj_ba`, with rows
//! grouped per key head (`[q_h, k_h, v_h…, z_h…]` and `[b_h…, a_h…]`); those rows are permuted
//! once at load so both layouts run the same code.
//!
//! Under online FP8 quantization the projection is two: `q | k | v | z` in FP8 and the small
//! per-head gates `b | a` left as they are (quantizing β and the decay input costs accuracy
//! and saves almost nothing). A published FP8 checkpoint's values here are dequantized at
//! load and served in float: re-quantizing its regrouped block-scaled rows per row would not
//! be the checkpoint's weights.

use super::{Linear, Loader, StepCtx};
use crate::backend::{Activation, DType, GdnOperands, GdnShape, HostTensor, LayerOps, f32_bytes};
use crate::model::ModelError;
use crate::model::weights::RawTensor;

/// The chunk length of the prompt form of the delta rule (transformers' default).
pub const GDN_CHUNK: usize = 64;

pub struct GatedDeltaNet<B: LayerOps> {
    /// `[q | k | v | z | b | a]` rows (one GEMM for every projection), or `[q | k | v | z]`
    /// when `gates` holds `b | a` apart (online FP8).
    pub in_proj: Linear<B>,
    /// `[b | a]` rows, apart from an FP8 `in_proj`.
    pub gates: Option<Linear<B>>,
    pub conv_w: B::Tensor,
    pub dt_bias: B::Tensor,
    pub a_log: B::Tensor,
    /// Output norm weight `[v_dim]` (plain, not zero-centred).
    pub norm_w: B::Tensor,
    pub out_proj: Linear<B>,
    pub shape: GdnShape,
    pub eps: f32,
    /// Index of this layer among the model's recurrent layers (its state slots).
    pub cache: usize,
}

/// What an architecture file states about one Gated DeltaNet mixer.
#[derive(Debug, Clone, Copy)]
pub struct GdnSpec {
    pub hidden: usize,
    pub shape: GdnShape,
    pub conv_kernel: usize,
    pub eps: f64,
    pub cache: usize,
}

impl GdnSpec {
    /// f32 elements of conv state per slot and layer.
    pub fn conv_state_elems(&self) -> usize {
        self.shape.conv_dim() * (self.conv_kernel - 1)
    }
}

impl<B: LayerOps> GatedDeltaNet<B> {
    pub fn load(l: &Loader<'_, B>, prefix: &str, s: GdnSpec) -> Result<Self, ModelError> {
        let sh = s.shape;
        if sh.k_heads == 0
            || sh.k_dim == 0
            || sh.v_dim == 0
            || !sh.v_heads.is_multiple_of(sh.k_heads)
            || sh.v_heads == 0
            || s.conv_kernel < 2
        {
            return Err(ModelError::Unsupported(format!(
                "Gated DeltaNet with {} key heads × {}, {} value heads × {}, conv kernel {}",
                sh.k_heads, sh.k_dim, sh.v_heads, sh.v_dim, s.conv_kernel
            )));
        }
        let p = |n: &str| format!("{prefix}.{n}");
        let rows = sh.conv_dim() + sh.value_dim() + 2 * sh.v_heads;
        let host = if l.store.has(&p("in_proj_qkvz.weight")) {
            fused_qwen3_next(l, prefix, &sh, s.hidden)?
        } else {
            let parts = [
                (p("in_proj_qkv.weight"), sh.conv_dim()),
                (p("in_proj_z.weight"), sh.value_dim()),
                (p("in_proj_b.weight"), sh.v_heads),
                (p("in_proj_a.weight"), sh.v_heads),
            ];
            concat_rows(l, &parts, s.hidden)?
        };
        let main_rows = sh.conv_dim() + sh.value_dim();
        let fp8 = l.store.quantization().quantize_online(&p("in_proj"));
        let upload = |dtype, bytes: &[u8], rows: usize| -> Result<B::Tensor, ModelError> {
            Ok(l.backend.upload(HostTensor {
                dtype,
                shape: &[rows, s.hidden],
                bytes,
            })?)
        };
        let quantized =
            |t: B::Tensor| -> Result<B::Tensor, ModelError> { Ok(l.backend.quantize_fp8(&t)?) };
        // Dummy weights have no rows to regroup: made-up tensors stand in.
        let (in_proj, gates) = match (host, fp8) {
            (Some((dtype, bytes)), false) => (upload(dtype, &bytes, rows)?, None),
            (Some((dtype, bytes)), true) => {
                let split = main_rows * s.hidden * dtype.size();
                (
                    quantized(upload(dtype, &bytes[..split], main_rows)?)?,
                    Some(upload(dtype, &bytes[split..], rows - main_rows)?),
                )
            }
            (None, false) => (l.tensor(&p("in_proj.weight"), &[rows, s.hidden])?, None),
            (None, true) => (
                quantized(l.tensor(&p("in_proj_qkvz.weight"), &[main_rows, s.hidden])?)?,
                Some(l.tensor(&p("in_proj_ba.weight"), &[rows - main_rows, s.hidden])?),
            ),
        };
        Ok(Self {
            in_proj: Linear {
                w: in_proj,
                b: None,
            },
            gates: gates.map(|w| Linear { w, b: None }),
            conv_w: l.tensor(&p("conv1d.weight"), &[sh.conv_dim(), 1, s.conv_kernel])?,
            dt_bias: l.tensor(&p("dt_bias"), &[sh.v_heads])?,
            a_log: l.tensor(&p("A_log"), &[sh.v_heads])?,
            norm_w: l.tensor(&p("norm.weight"), &[sh.v_dim])?,
            out_proj: l.linear(&p("out_proj"), s.hidden, sh.value_dim(), false)?,
            shape: sh,
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
        let sh = self.shape;
        let [qkv, z, beta, a] = match &self.gates {
            None => b.split_cols(
                &self.in_proj.forward(b, x)?,
                [sh.conv_dim(), sh.value_dim(), sh.v_heads, sh.v_heads],
            )?,
            Some(gates) => {
                let [main, gates] = Linear::forward_shared(b, x, [&self.in_proj, gates])?;
                let [qkv, z] = b.split_cols(&main, [sh.conv_dim(), sh.value_dim()])?;
                let [beta, a] = b.split_cols(&gates, [sh.v_heads, sh.v_heads])?;
                [qkv, z, beta, a]
            }
        };
        let pools = ctx.ssm.as_deref_mut().ok_or_else(|| {
            ModelError::Backend(format!("no recurrent state for layer {}", self.cache))
        })?;
        let qkv = b.causal_conv1d(&qkv, &self.conv_w, None, pools, self.cache, ctx.step)?;
        let [q, k, v] = b.split_cols(&qkv, [sh.key_dim(), sh.key_dim(), sh.value_dim()])?;
        let ops = GdnOperands {
            q: &q,
            k: &k,
            v: &v,
            a: &a,
            b: &beta,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
        };
        let o = b.gated_delta_rule(&ops, sh, pools, self.cache, ctx.step)?;
        let o = b.head_rms_norm(&o, &self.norm_w, sh.v_dim, self.eps)?;
        let o = b.gated_activation(&z, &o, Activation::Silu)?;
        self.out_proj.forward(b, &o)
    }
}

/// The rows of a regrouped projection on the host: their dtype and bytes.
type HostRows = (DType, Vec<u8>);

/// Two stored projections in one dtype: as stored when they agree, else both widened to f32
/// (an FP8 checkpoint's dequantized `in_proj_qkvz` beside its bf16 `in_proj_ba`).
fn same_dtype(a: RawTensor<'_>, b: RawTensor<'_>) -> (DType, Vec<u8>, Vec<u8>) {
    if a.dtype == b.dtype {
        return (a.dtype, a.bytes.into_owned(), b.bytes.into_owned());
    }
    let widen = |t: &RawTensor<'_>| f32_bytes(&t.host().to_f32()).to_vec();
    (DType::F32, widen(&a), widen(&b))
}

/// Qwen3-Next's fused projections, rows regrouped into `[q | k | v | z | b | a]`. `None` for
/// dummy weights (there are no rows to permute; made-up tensors stand in).
fn fused_qwen3_next<B: LayerOps>(
    l: &Loader<'_, B>,
    prefix: &str,
    sh: &GdnShape,
    hidden: usize,
) -> Result<Option<HostRows>, ModelError> {
    if l.store.is_dummy() {
        return Ok(None);
    }
    let r = sh.v_heads / sh.k_heads;
    let (dk, dv, nk) = (sh.k_dim, sh.v_dim, sh.k_heads);
    let per_head = 2 * dk + 2 * r * dv;
    let qkvz = l.store.raw_rows(
        &format!("{prefix}.in_proj_qkvz.weight"),
        nk * per_head,
        hidden,
    )?;
    let ba = l
        .store
        .raw_rows(&format!("{prefix}.in_proj_ba.weight"), nk * 2 * r, hidden)?;
    let (dtype, qkvz, ba) = same_dtype(qkvz, ba);
    // Source row ranges in output order.
    let mut order: Vec<(usize, usize, bool)> = Vec::new();
    let head = |h: usize| h * per_head;
    for h in 0..nk {
        order.push((head(h), dk, true)); // q
    }
    for h in 0..nk {
        order.push((head(h) + dk, dk, true)); // k
    }
    for h in 0..nk {
        order.push((head(h) + 2 * dk, r * dv, true)); // v
    }
    for h in 0..nk {
        order.push((head(h) + 2 * dk + r * dv, r * dv, true)); // z
    }
    for h in 0..nk {
        order.push((h * 2 * r, r, false)); // b
    }
    for h in 0..nk {
        order.push((h * 2 * r + r, r, false)); // a
    }
    let row_bytes = hidden * dtype.size();
    let mut bytes = Vec::with_capacity(qkvz.len() + ba.len());
    for (start, n, from_qkvz) in order {
        let src = if from_qkvz { &qkvz } else { &ba };
        bytes.extend_from_slice(&src[start * row_bytes..(start + n) * row_bytes]);
    }
    Ok(Some((dtype, bytes)))
}

/// Several `[rows_i, hidden]` tensors stacked into one `[Σ rows_i, hidden]` (one host copy at
/// load), in their stored dtype, or all widened to f32 where they differ. `None` for dummy
/// weights.
fn concat_rows<B: LayerOps>(
    l: &Loader<'_, B>,
    parts: &[(String, usize)],
    hidden: usize,
) -> Result<Option<HostRows>, ModelError> {
    if l.store.is_dummy() {
        return Ok(None);
    }
    let raws = parts
        .iter()
        .map(|(name, n)| l.store.raw_rows(name, *n, hidden))
        .collect::<Result<Vec<_>, _>>()?;
    let dtype = raws.first().map_or(DType::F32, |r| r.dtype);
    if raws.iter().all(|r| r.dtype == dtype) {
        return Ok(Some((
            dtype,
            raws.iter().flat_map(|r| r.bytes.iter().copied()).collect(),
        )));
    }
    let values: Vec<f32> = raws.iter().flat_map(|r| r.host().to_f32()).collect();
    Ok(Some((DType::F32, f32_bytes(&values).to_vec())))
}
