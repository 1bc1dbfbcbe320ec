//! Mixture of experts with shared experts and sigmoid top-k routing with grouped selection
//! and a score-correction bias (NemotronH; the DeepSeek-V3 routing as transformers runs it).
//!
//! The router projection, the routing and the expert compute all run on the backend
//! ([`LayerOps::moe`]) over expert weights stacked at load time (`up [E, I, H]`, `down [E, H,
//! I]`), whether the checkpoint stores experts one by one or already stacked. Nothing goes
//! back to the host.

use super::{Loader, Mlp};
use crate::backend::{Activation, HostTensor, LayerOps, MoeRouting, MoeScoring, StackedExperts};
use crate::model::ModelError;

pub struct Moe<B: LayerOps> {
    pub router: B::Tensor,
    pub routing: MoeRouting<B::Tensor>,
    pub experts: StackedExperts<B::Tensor>,
    pub shared: Option<Mlp<B>>,
    /// `[1, hidden]`: the shared expert's output is scaled by `sigmoid(x · gᵀ)` (Qwen3-Next,
    /// Qwen3.5 MoE).
    pub shared_gate: Option<B::Tensor>,
}

#[derive(Debug, Clone, Copy)]
pub struct MoeSpec {
    pub hidden: usize,
    pub experts: usize,
    pub expert_inter: usize,
    pub shared_inter: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scaling: f64,
    pub bias: bool,
    pub act: Activation,
}

impl<B: LayerOps> Moe<B> {
    pub fn load(l: &Loader<'_, B>, prefix: &str, s: MoeSpec) -> Result<Self, ModelError> {
        if s.n_group == 0
            || !s.experts.is_multiple_of(s.n_group)
            || s.topk_group > s.n_group
            || s.top_k > s.topk_group * (s.experts / s.n_group)
            || s.top_k == 0
        {
            return Err(ModelError::Unsupported(format!(
                "MoE routing with {} experts, {} groups, top-{} of {} groups",
                s.experts, s.n_group, s.top_k, s.topk_group
            )));
        }
        if s.bias {
            return Err(ModelError::Unsupported(
                "MoE experts with biases".to_string(),
            ));
        }
        let p = |n: &str| format!("{prefix}.{n}");
        let router = l.tensor(&p("gate.weight"), &[s.experts, s.hidden])?;
        let bias_name = p("gate.e_score_correction_bias");
        let correction_bias = if l.store.has(&bias_name) {
            l.tensor(&bias_name, &[s.experts])?
        } else {
            let zeros = vec![0.0f32; s.experts];
            l.backend.upload(HostTensor::f32(&zeros, &[s.experts]))?
        };
        let (e, i, h) = (s.experts, s.expert_inter, s.hidden);
        // Dummy weights come stacked: there are no per-expert tensors to gather.
        let (up, down) = if l.store.has(&p("experts.up_proj")) || l.store.is_dummy() {
            (
                l.tensor(&p("experts.up_proj"), &[e, i, h])?,
                l.tensor(&p("experts.down_proj"), &[e, h, i])?,
            )
        } else {
            (
                stack(l, prefix, "up_proj", [e, i, h])?,
                stack(l, prefix, "down_proj", [e, h, i])?,
            )
        };
        let shared = if s.shared_inter > 0 {
            Some(Mlp::load_plain(
                l,
                &p("shared_experts"),
                s.hidden,
                s.shared_inter,
                s.bias,
                s.act,
            )?)
        } else {
            None
        };
        Ok(Self {
            router,
            routing: MoeRouting {
                scoring: MoeScoring::Sigmoid,
                correction_bias,
                top_k: s.top_k,
                n_group: s.n_group,
                topk_group: s.topk_group,
                norm_topk_prob: s.norm_topk_prob,
                scaling: s.scaling as f32,
            },
            experts: fp8_experts(
                l,
                prefix,
                StackedExperts {
                    up,
                    down,
                    gate: None,
                    act: s.act,
                },
            )?,
            shared,
            shared_gate: None,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor, ModelError> {
        let logits = b.linear(x, &self.router, None)?;
        let mut out = match &self.shared {
            Some(shared) => shared.forward(b, x)?,
            None => b.zeros_like(x)?,
        };
        if let Some(g) = &self.shared_gate {
            b.sigmoid_gate(&mut out, &b.linear(x, g, None)?)?;
        }
        b.moe(x, &logits, &self.routing, &self.experts, &mut out)?;
        Ok(out)
    }
}

// ---- softmax routing, gated experts, gated shared expert (Qwen3-Next, Qwen3.5 MoE) -------

/// What an architecture file states about a Qwen-style sparse MoE block.
#[derive(Debug, Clone, Copy)]
pub struct SoftmaxMoeSpec {
    pub hidden: usize,
    pub experts: usize,
    pub expert_inter: usize,
    /// 0: no shared expert.
    pub shared_inter: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub act: Activation,
}

impl<B: LayerOps> Moe<B> {
    /// Router `gate.weight` (softmax over all experts, top-k, optional renormalisation),
    /// gated experts stored stacked (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj
    /// [E, H, I]`, as transformers writes them) or one by one (`experts.{j}.gate_proj` …, as
    /// the published checkpoints), and a gated SiLU shared expert `shared_expert` scaled by
    /// `sigmoid(shared_expert_gate(x))`.
    pub fn load_softmax(
        l: &Loader<'_, B>,
        prefix: &str,
        s: SoftmaxMoeSpec,
    ) -> Result<Self, ModelError> {
        if s.top_k == 0 || s.top_k > s.experts {
            return Err(ModelError::Unsupported(format!(
                "MoE routing top-{} of {} experts",
                s.top_k, s.experts
            )));
        }
        let p = |n: &str| format!("{prefix}.{n}");
        let (e, i, h) = (s.experts, s.expert_inter, s.hidden);
        let (gate, up, down) = if l.store.has(&p("experts.gate_up_proj")) {
            let (gate, up) = split_gate_up(l, &p("experts.gate_up_proj"), [e, i, h])?;
            (gate, up, l.tensor(&p("experts.down_proj"), &[e, h, i])?)
        } else if l.store.is_dummy() {
            (
                l.tensor(&p("experts.gate_proj"), &[e, i, h])?,
                l.tensor(&p("experts.up_proj"), &[e, i, h])?,
                l.tensor(&p("experts.down_proj"), &[e, h, i])?,
            )
        } else {
            (
                stack(l, prefix, "gate_proj", [e, i, h])?,
                stack(l, prefix, "up_proj", [e, i, h])?,
                stack(l, prefix, "down_proj", [e, h, i])?,
            )
        };
        let (shared, shared_gate) = if s.shared_inter > 0 {
            (
                Some(Mlp::load_gated(
                    l,
                    &p("shared_expert"),
                    h,
                    s.shared_inter,
                    false,
                    s.act,
                )?),
                Some(l.tensor(&p("shared_expert_gate.weight"), &[1, h])?),
            )
        } else {
            (None, None)
        };
        let zeros = vec![0.0f32; e];
        Ok(Self {
            router: l.tensor(&p("gate.weight"), &[e, h])?,
            routing: MoeRouting {
                scoring: MoeScoring::Softmax,
                correction_bias: l.backend.upload(HostTensor::f32(&zeros, &[e]))?,
                top_k: s.top_k,
                n_group: 1,
                topk_group: 1,
                norm_topk_prob: s.norm_topk_prob,
                scaling: 1.0,
            },
            experts: fp8_experts(
                l,
                prefix,
                StackedExperts {
                    up,
                    down,
                    gate: Some(gate),
                    act: s.act,
                },
            )?,
            shared,
            shared_gate,
        })
    }
}

/// The stacked experts of the MoE layer at `prefix`, quantized to FP8 (one scale per expert
/// row) under online quantization, or with made-up weights where the config is FP8 (a
/// published FP8 checkpoint's experts are FP8); else as loaded. A published checkpoint's FP8
/// experts are dequantized at load for now (block scales are not in the expert kernels).
pub fn fp8_experts<B: LayerOps>(
    l: &Loader<'_, B>,
    prefix: &str,
    experts: StackedExperts<B::Tensor>,
) -> Result<StackedExperts<B::Tensor>, ModelError> {
    let q = l.store.quantization();
    let module = format!("{prefix}.experts");
    let fp8 = if l.store.is_dummy() {
        q.dummy_fp8(&module)
    } else {
        q.quantize_online(&module)
    };
    if !fp8 {
        return Ok(experts);
    }
    let quantize =
        |t: &B::Tensor| -> Result<B::Tensor, ModelError> { Ok(l.backend.quantize_fp8(t)?) };
    Ok(StackedExperts {
        up: quantize(&experts.up)?,
        down: quantize(&experts.down)?,
        gate: experts.gate.as_ref().map(quantize).transpose()?,
        act: experts.act,
    })
}

/// `[E, 2I, H]` fused expert weights split into gate `[E, I, H]` (the first `I` rows of each
/// expert) and up `[E, I, H]`, in the checkpoint's dtype (one host copy at load).
fn split_gate_up<B: LayerOps>(
    l: &Loader<'_, B>,
    name: &str,
    [e, i, h]: [usize; 3],
) -> Result<(B::Tensor, B::Tensor), ModelError> {
    let raw = l.store.raw(name)?;
    if raw.shape != [e, 2 * i, h] {
        return Err(ModelError::TensorShape {
            path: l.store.path_of(name),
            tensor: name.to_string(),
            got: raw.shape,
            expected: vec![e, 2 * i, h],
        });
    }
    let half = i * h * raw.dtype.size();
    let (mut gate, mut up) = (Vec::with_capacity(e * half), Vec::with_capacity(e * half));
    for j in 0..e {
        let at = 2 * j * half;
        gate.extend_from_slice(&raw.bytes[at..at + half]);
        up.extend_from_slice(&raw.bytes[at + half..at + 2 * half]);
    }
    let shape = [e, i, h];
    let upload = |bytes: &[u8]| {
        l.backend.upload(HostTensor {
            dtype: raw.dtype,
            shape: &shape,
            bytes,
        })
    };
    Ok((upload(&gate)?, upload(&up)?))
}

/// Stacks per-expert weights `experts.{j}.{name}.weight` (each `[rows, cols]`) into one
/// `[E, rows, cols]` tensor in the checkpoint's dtype (one host copy at load time).
fn stack<B: LayerOps>(
    l: &Loader<'_, B>,
    prefix: &str,
    name: &str,
    [e, rows, cols]: [usize; 3],
) -> Result<B::Tensor, ModelError> {
    let mut bytes = Vec::new();
    let mut dtype = None;
    for j in 0..e {
        let tensor = format!("{prefix}.experts.{j}.{name}.weight");
        let raw = l.store.raw(&tensor)?;
        if raw.shape != [rows, cols] {
            return Err(ModelError::TensorShape {
                path: l.store.path_of(&tensor),
                tensor,
                got: raw.shape,
                expected: vec![rows, cols],
            });
        }
        if *dtype.get_or_insert(raw.dtype) != raw.dtype {
            return Err(ModelError::Unsupported(format!(
                "experts of {prefix} stored in different dtypes"
            )));
        }
        bytes.extend_from_slice(&raw.bytes);
    }
    let host = HostTensor {
        dtype: dtype.unwrap_or(crate::backend::DType::F32),
        shape: &[e, rows, cols],
        bytes: &bytes,
    };
    Ok(l.backend.upload(host)?)
}

/// Per-expert weights `{prefix}.experts.{j}.{name}.weight` (each `[rows, cols]`) stacked into
/// one host `[E, rows, cols]` f32 buffer, for architectures that rewrite expert weights at load
/// (multipliers folded in).
pub fn stack_f32<B: LayerOps>(
    l: &Loader<'_, B>,
    prefix: &str,
    name: &str,
    [e, rows, cols]: [usize; 3],
) -> Result<Vec<f32>, ModelError> {
    let mut out = Vec::with_capacity(e * rows * cols);
    for j in 0..e {
        out.extend(l.host_f32(
            &format!("{prefix}.experts.{j}.{name}.weight"),
            &[rows, cols],
        )?);
    }
    Ok(out)
}
