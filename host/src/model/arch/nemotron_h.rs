//! `NemotronHForCausalLM`: a hybrid stack where every layer is one pre-norm residual block of
//! one kind, given by the pattern (`M` Mamba2, `*` attention without positional encoding,
//! `-` relu² MLP, `E` mixture of experts), as `hybrid_override_pattern` (real checkpoints) or
//! `layers_block_type` (what transformers 5 writes). Tensors live under `backbone.` on disk.

use super::{Assembly, bool_any, ssm_shape, usize_any};
use crate::backend::{Activation, LayerOps};
use crate::model::config::HfConfig;
use crate::model::layers::attention::AttentionSpec;
use crate::model::layers::mamba2::Mamba2Spec;
use crate::model::layers::moe::MoeSpec;
use crate::model::layers::{Attention, Loader, Mamba2Mixer, Mixer, Mlp, Moe, Sublayer};
use crate::model::{Model, ModelError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Mamba,
    Attention,
    Mlp,
    Moe,
}

/// The layer kinds, from either pattern form.
pub fn layer_kinds(c: &HfConfig) -> Result<Vec<Kind>, ModelError> {
    if let Some(p) = c.get("hybrid_override_pattern").and_then(|v| v.as_str()) {
        return p
            .chars()
            .map(|ch| match ch {
                'M' => Ok(Kind::Mamba),
                '*' => Ok(Kind::Attention),
                '-' => Ok(Kind::Mlp),
                'E' => Ok(Kind::Moe),
                other => Err(c.error(format!(
                    "hybrid_override_pattern letter `{other}` (allowed: M * - E)"
                ))),
            })
            .collect();
    }
    let list = c
        .get("layers_block_type")
        .or_else(|| c.get("layer_types"))
        .and_then(|v| v.as_array())
        .ok_or_else(|| c.error("missing `hybrid_override_pattern` or `layers_block_type`"))?;
    list.iter()
        .map(|v| match v.as_str() {
            Some("mamba" | "linear_attention") => Ok(Kind::Mamba),
            Some("attention" | "full_attention") => Ok(Kind::Attention),
            Some("mlp") => Ok(Kind::Mlp),
            Some("moe") => Ok(Kind::Moe),
            _ => Err(c.error(format!("unknown layer type {v} in layers_block_type"))),
        })
        .collect()
}

pub fn build<B: LayerOps>(c: &HfConfig, l: &Loader<'_, B>) -> Result<Model<B>, ModelError> {
    let hidden = c.usize("hidden_size")?;
    let vocab = c.usize("vocab_size")?;
    let kinds = layer_kinds(c)?;
    let eps = c.f64_or("layer_norm_epsilon", 1e-5)?;
    let root = if l.store.has("backbone.embeddings.weight") {
        "backbone"
    } else {
        "model"
    };

    let heads = c.usize_or("num_attention_heads", 0)?;
    let kv_heads = usize_any(c, &["num_key_value_heads"], Some(heads))?;
    let head_dim = usize_any(
        c,
        &["head_dim", "attention_head_dim"],
        Some(hidden / heads.max(1)),
    )?;
    let attn_bias = c.bool_or("attention_bias", false)?;
    let mlp_bias = c.bool_or("mlp_bias", false)?;
    let mlp_act_name = c.str_or("mlp_hidden_act", "relu2")?;
    let mlp_act = Activation::from_hf(mlp_act_name)
        .ok_or_else(|| c.error(format!("unsupported mlp_hidden_act `{mlp_act_name}`")))?;
    if c.str_or("mamba_hidden_act", "silu")? != "silu" {
        return Err(c.error("only mamba_hidden_act = silu is supported"));
    }
    if c.get("moe_latent_size").is_some() {
        return Err(ModelError::Unsupported("NemotronH moe_latent_size".into()));
    }

    let m_heads = usize_any(c, &["mamba_num_heads"], Some(0))?;
    let mamba = if kinds.contains(&Kind::Mamba) {
        let shape = ssm_shape(
            c,
            m_heads,
            usize_any(c, &["mamba_head_dim"], None)?,
            usize_any(c, &["n_groups", "mamba_n_groups"], Some(8))?,
            usize_any(c, &["ssm_state_size"], Some(128))?,
            usize_any(c, &["chunk_size", "mamba_chunk_size"], Some(128))?,
        )?;
        Some(Mamba2Spec {
            hidden,
            shape,
            conv_kernel: usize_any(c, &["conv_kernel", "mamba_d_conv"], Some(4))?,
            conv_bias: bool_any(c, &["use_conv_bias", "mamba_conv_bias"], true)?,
            proj_bias: bool_any(c, &["use_bias", "mamba_proj_bias"], false)?,
            eps,
            cache: 0,
        })
    } else {
        None
    };

    let (mut n_attn, mut n_ssm) = (0, 0);
    let mut subs = Vec::with_capacity(kinds.len());
    for (i, kind) in kinds.iter().enumerate() {
        let p = format!("{root}.layers.{i}");
        let mixer_prefix = format!("{p}.mixer");
        let mixer = match kind {
            Kind::Mamba => {
                let spec = mamba.ok_or_else(|| c.error("no Mamba2 settings"))?;
                n_ssm += 1;
                Mixer::Mamba2(Mamba2Mixer::load(
                    l,
                    &mixer_prefix,
                    Mamba2Spec {
                        cache: n_ssm - 1,
                        ..spec
                    },
                )?)
            }
            Kind::Attention => {
                n_attn += 1;
                Mixer::Attention(Attention::load(
                    l,
                    &mixer_prefix,
                    AttentionSpec {
                        hidden,
                        heads,
                        kv_heads,
                        head_dim,
                        bias: attn_bias,
                        out_bias: attn_bias,
                        rope: None,
                        cache: n_attn - 1,
                    },
                )?)
            }
            Kind::Mlp => Mixer::Mlp(Mlp::load_plain(
                l,
                &mixer_prefix,
                hidden,
                c.usize("intermediate_size")?,
                mlp_bias,
                mlp_act,
            )?),
            Kind::Moe => Mixer::Moe(Moe::load(
                l,
                &mixer_prefix,
                MoeSpec {
                    hidden,
                    experts: usize_any(c, &["n_routed_experts", "num_local_experts"], None)?,
                    expert_inter: c.usize("moe_intermediate_size")?,
                    shared_inter: match c.usize_or("n_shared_experts", 1)? {
                        0 => 0,
                        _ => c.usize("moe_shared_expert_intermediate_size")?,
                    },
                    top_k: c.usize("num_experts_per_tok")?,
                    n_group: c.usize_or("n_group", 1)?,
                    topk_group: c.usize_or("topk_group", 1)?,
                    norm_topk_prob: c.bool_or("norm_topk_prob", true)?,
                    scaling: c.f64_or("routed_scaling_factor", 1.0)?,
                    bias: mlp_bias,
                    act: mlp_act,
                },
            )?),
        };
        subs.push(Sublayer {
            norm: l.rms_norm(&format!("{p}.norm.weight"), hidden, eps)?,
            mixer,
        });
    }
    Assembly {
        arch: c.architecture()?,
        vocab,
        hidden,
        max_positions: c.usize_or("max_position_embeddings", 4096)?,
        embed: l.tensor(&format!("{root}.embeddings.weight"), &[vocab, hidden])?,
        layers: subs,
        final_norm: l.rms_norm(&format!("{root}.norm_f.weight"), hidden, eps)?,
        tie: bool_any(c, &["tie_word_embeddings"], false)?,
        lm_head_name: "lm_head.weight",
        kv: if n_attn > 0 {
            (kv_heads, head_dim)
        } else {
            (0, 0)
        },
        attn_layers: n_attn,
        mamba,
        ssm_layers: n_ssm,
    }
    .finish(c, l)
}
