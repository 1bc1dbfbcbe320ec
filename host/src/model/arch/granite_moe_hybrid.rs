//! `GraniteMoeHybridForCausalLM` (IBM Granite 4.0): every layer is a token mixer (Mamba2, or
//! attention with optional RoPE) then a channel mixer (a gated shared MLP, plus softmax top-k
//! SwiGLU experts when `num_local_experts > 0`), each pre-norm residual. Layer types are
//! `mamba`/`attention` (the published configs) or `linear_attention`/`full_attention` (what
//! transformers 5 writes). The µP-style multipliers act as transformers applies them:
//! embeddings × `embedding_multiplier`, attention scores × `attention_multiplier` (instead of
//! 1/√d), every sublayer's output × `residual_multiplier` (folded into its output projections),
//! logits ÷ `logits_scaling`. Experts load from the published fused layout
//! (`block_sparse_moe.input_linear` = gate ‖ up, `output_linear`, `router.layer`), the one
//! transformers 5 writes (`experts.gate_up_proj`, `experts.down_proj`, `router.weight`), or
//! one expert at a time (`experts.{j}.{gate,up,down}_proj`).

use super::nemotron_h::{Kind, layer_kinds};
use super::{Assembly, bool_any, mamba_keyed_spec, usize_any};
use crate::backend::{Activation, LayerOps, MoeRouting, MoeScoring, StackedExperts};
use crate::model::config::HfConfig;
use crate::model::layers::attention::AttentionSpec;
use crate::model::layers::mamba2::Mamba2Spec;
use crate::model::layers::{
    Attention, Linear, Loader, Mamba2Mixer, Mixer, Mlp, Moe, Sublayer, moe, rope,
};
use crate::model::{Model, ModelError};

pub fn build<B: LayerOps>(c: &HfConfig, l: &Loader<'_, B>) -> Result<Model<B>, ModelError> {
    let hidden = c.usize("hidden_size")?;
    let vocab = c.usize("vocab_size")?;
    let eps = c.f64_or("rms_norm_eps", 1e-6)?;
    let heads = c.usize("num_attention_heads")?;
    let kv_heads = usize_any(c, &["num_key_value_heads"], Some(heads))?;
    let head_dim = usize_any(c, &["head_dim"], Some(hidden / heads.max(1)))?;
    let attn_bias = c.bool_or("attention_bias", false)?;
    let act_name = c.str_or("hidden_act", "silu")?;
    if act_name != "silu" {
        return Err(c.error(format!(
            "hidden_act `{act_name}`: Granite's Mamba2 mixer needs silu"
        )));
    }
    let residual = c.f64_or("residual_multiplier", 1.0)? as f32;
    let attention_multiplier = c.f64_or("attention_multiplier", 1.0)? as f32;
    let kinds = layer_kinds(c)?;
    if let Some(k) = kinds
        .iter()
        .find(|k| !matches!(k, Kind::Mamba | Kind::Attention))
    {
        return Err(c.error(format!(
            "layer type {k:?} in a Granite layer list (mamba or attention only)"
        )));
    }
    if let Some(n) = c.opt_usize("num_hidden_layers")?
        && n != kinds.len()
    {
        return Err(c.error(format!(
            "num_hidden_layers is {n} but the layer type list has {}",
            kinds.len()
        )));
    }
    let rope = match c.get("position_embedding_type").and_then(|v| v.as_str()) {
        Some("rope") => Some(rope::build(&c.rope_settings()?, head_dim)?),
        None | Some("nope") => None,
        Some(other) => {
            return Err(c.error(format!(
                "position_embedding_type `{other}` (supported: rope, nope, null)"
            )));
        }
    };

    let d_inner = (c.f64_or("mamba_expand", 2.0)? * hidden as f64) as usize;
    let mamba = mamba_keyed_spec(c, hidden, d_inner, 256, eps)?;
    let experts = c.usize_or("num_local_experts", 0)?;
    let shared_inter = c.usize("shared_intermediate_size")?;

    let (mut n_attn, mut n_ssm) = (0, 0);
    let mut subs = Vec::with_capacity(2 * kinds.len());
    for (i, kind) in kinds.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let mixer = if *kind == Kind::Attention {
            n_attn += 1;
            let mut a = Attention::load(
                l,
                &format!("{p}.self_attn"),
                AttentionSpec {
                    hidden,
                    heads,
                    kv_heads,
                    head_dim,
                    bias: attn_bias,
                    out_bias: attn_bias,
                    rope: rope.clone(),
                    cache: n_attn - 1,
                },
            )?;
            a.shape.scale = attention_multiplier;
            a.o = a.o.scaled(l, 1.0, |_| residual)?;
            Mixer::Attention(a)
        } else {
            n_ssm += 1;
            let mut m = Mamba2Mixer::load(
                l,
                &format!("{p}.mamba"),
                Mamba2Spec {
                    cache: n_ssm - 1,
                    ..mamba
                },
            )?;
            m.out_proj = m.out_proj.scaled(l, 1.0, |_| residual)?;
            Mixer::Mamba2(m)
        };
        subs.push(Sublayer {
            norm: l.rms_norm(&format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer,
        });
        let shared = shared_mlp(
            l,
            &format!("{p}.shared_mlp"),
            hidden,
            shared_inter,
            residual,
        )?;
        let ffn = if experts > 0 {
            let moe_prefix = format!("{p}.block_sparse_moe");
            Mixer::Moe(load_moe(
                l,
                c,
                &moe_prefix,
                hidden,
                experts,
                shared,
                residual,
            )?)
        } else {
            Mixer::Mlp(shared)
        };
        subs.push(Sublayer {
            norm: l.rms_norm(&format!("{p}.post_attention_layernorm.weight"), hidden, eps)?,
            mixer: ffn,
        });
    }
    let mut model = Assembly {
        arch: c.architecture()?,
        vocab,
        hidden,
        max_positions: c.usize_or("max_position_embeddings", 4096)?,
        embed: l.tensor("model.embed_tokens.weight", &[vocab, hidden])?,
        layers: subs,
        final_norm: l.rms_norm("model.norm.weight", hidden, eps)?,
        tie: bool_any(c, &["tie_word_embeddings"], false)?,
        lm_head_name: "lm_head.weight",
        kv: if n_attn > 0 {
            (kv_heads, head_dim)
        } else {
            (0, 0)
        },
        attn_layers: n_attn,
        mamba: if n_ssm > 0 { Some(mamba) } else { None },
        ssm_layers: n_ssm,
    }
    .finish(c, l)?;
    model.embed_scale = c.f64_or("embedding_multiplier", 1.0)? as f32;
    let logits_scaling = c.f64_or("logits_scaling", 1.0)?;
    if logits_scaling == 0.0 {
        return Err(c.error("logits_scaling must not be 0"));
    }
    model.logits_scale = (1.0 / logits_scaling) as f32;
    Ok(model)
}

/// The shared MLP: `input_linear` `[2I, H]` holds the gate rows then the up rows.
fn shared_mlp<B: LayerOps>(
    l: &Loader<'_, B>,
    prefix: &str,
    hidden: usize,
    inter: usize,
    residual: f32,
) -> Result<Mlp<B>, ModelError> {
    let fused = l.host_f32(
        &format!("{prefix}.input_linear.weight"),
        &[2 * inter, hidden],
    )?;
    let (gate, up) = fused.split_at(inter * hidden);
    let down = l.linear(&format!("{prefix}.output_linear"), hidden, inter, false)?;
    Ok(Mlp {
        gate: Some(Linear {
            w: l.upload_f32(gate, &[inter, hidden])?,
            b: None,
        }),
        up: Linear {
            w: l.upload_f32(up, &[inter, hidden])?,
            b: None,
        },
        down: down.scaled(l, 1.0, |_| residual)?,
        act: Activation::Silu,
    })
}

/// Softmax top-k routing over SwiGLU experts, plus the shared MLP (added unweighted).
fn load_moe<B: LayerOps>(
    l: &Loader<'_, B>,
    c: &HfConfig,
    prefix: &str,
    hidden: usize,
    experts: usize,
    shared: Mlp<B>,
    residual: f32,
) -> Result<Moe<B>, ModelError> {
    let (e, i, h) = (experts, c.usize("intermediate_size")?, hidden);
    let top_k = c.usize("num_experts_per_tok")?;
    if top_k == 0 || top_k > e {
        return Err(c.error(format!("num_experts_per_tok {top_k} with {e} experts")));
    }
    let p = |n: &str| format!("{prefix}.{n}");
    let router_name = [p("router.layer.weight"), p("router.weight")]
        .into_iter()
        .find(|n| l.store.has(n))
        .unwrap_or_else(|| p("router.layer.weight"));
    let router = l.tensor(&router_name, &[e, h])?;
    let fused_name = [p("input_linear.weight"), p("experts.gate_up_proj")]
        .into_iter()
        .find(|n| l.store.has(n));
    let (gate, up, down) = match fused_name {
        Some(fused_name) => {
            let fused = l.host_f32(&fused_name, &[e, 2 * i, h])?;
            let (mut gate, mut up) = (Vec::with_capacity(e * i * h), Vec::with_capacity(e * i * h));
            for expert in fused.chunks_exact(2 * i * h) {
                let (g, u) = expert.split_at(i * h);
                gate.extend_from_slice(g);
                up.extend_from_slice(u);
            }
            let down_name = [p("output_linear.weight"), p("experts.down_proj")]
                .into_iter()
                .find(|n| l.store.has(n))
                .unwrap_or_else(|| p("output_linear.weight"));
            let down = l.host_f32(&down_name, &[e, h, i])?;
            (gate, up, down)
        }
        None => (
            moe::stack_f32(l, prefix, "gate_proj", [e, i, h])?,
            moe::stack_f32(l, prefix, "up_proj", [e, i, h])?,
            moe::stack_f32(l, prefix, "down_proj", [e, h, i])?,
        ),
    };
    let down: Vec<f32> = down.into_iter().map(|v| v * residual).collect();
    let zeros = vec![0.0f32; e];
    Ok(Moe {
        router,
        routing: MoeRouting {
            scoring: MoeScoring::Softmax,
            correction_bias: l.upload_f32(&zeros, &[e])?,
            top_k,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: true,
            scaling: 1.0,
        },
        experts: moe::fp8_experts(
            l,
            prefix,
            StackedExperts {
                up: l.upload_f32(&up, &[e, i, h])?,
                down: l.upload_f32(&down, &[e, h, i])?,
                gate: Some(l.upload_f32(&gate, &[e, i, h])?),
                act: Activation::Silu,
            },
        )?,
        shared: Some(shared),
        shared_gate: None,
    })
}
