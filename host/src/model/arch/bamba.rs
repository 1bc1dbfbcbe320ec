//! `BambaForCausalLM`: every layer is a token mixer (Mamba2, or attention at
//! `attn_layer_indices`, with partial RoPE) followed by a gated SiLU MLP, each pre-norm residual.

use super::{Assembly, bool_any, mamba_keyed_spec, usize_any};
use crate::backend::{Activation, LayerOps};
use crate::model::config::HfConfig;
use crate::model::layers::attention::AttentionSpec;
use crate::model::layers::mamba2::Mamba2Spec;
use crate::model::layers::{Attention, Loader, Mamba2Mixer, Mixer, Mlp, Sublayer, rope};
use crate::model::{Model, ModelError};

pub fn build<B: LayerOps>(c: &HfConfig, l: &Loader<'_, B>) -> Result<Model<B>, ModelError> {
    let hidden = c.usize("hidden_size")?;
    let vocab = c.usize("vocab_size")?;
    let layers = c.usize("num_hidden_layers")?;
    let eps = c.f64_or("rms_norm_eps", 1e-5)?;
    let heads = c.usize("num_attention_heads")?;
    let kv_heads = usize_any(c, &["num_key_value_heads"], Some(heads))?;
    let head_dim = usize_any(c, &["head_dim"], Some(hidden / heads.max(1)))?;
    let inter = c.usize("intermediate_size")?;
    let attn_bias = c.bool_or("attention_bias", false)?;
    let mlp_bias = c.bool_or("mlp_bias", false)?;
    let act_name = c.str_or("hidden_act", "silu")?;
    let act = Activation::from_hf(act_name)
        .ok_or_else(|| c.error(format!("unsupported hidden_act `{act_name}`")))?;
    if act != Activation::Silu {
        return Err(c.error("Bamba's Mamba2 mixer needs hidden_act = silu"));
    }
    let attn_layers: Vec<usize> = c
        .get("attn_layer_indices")
        .and_then(|v| v.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as usize)
                .collect()
        })
        .unwrap_or_default();

    let d_inner = (c.f64_or("mamba_expand", 2.0)? * hidden as f64) as usize;
    let mamba = mamba_keyed_spec(c, hidden, d_inner, 128, eps)?;
    let rope = rope::build(&c.rope_settings()?, head_dim)?;

    let (mut n_attn, mut n_ssm) = (0, 0);
    let mut subs = Vec::with_capacity(2 * layers);
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        let mixer = if attn_layers.contains(&i) {
            n_attn += 1;
            Mixer::Attention(Attention::load(
                l,
                &format!("{p}.self_attn"),
                AttentionSpec {
                    hidden,
                    heads,
                    kv_heads,
                    head_dim,
                    bias: attn_bias,
                    out_bias: attn_bias,
                    rope: Some(rope.clone()),
                    cache: n_attn - 1,
                },
            )?)
        } else {
            n_ssm += 1;
            Mixer::Mamba2(Mamba2Mixer::load(
                l,
                &format!("{p}.mamba"),
                Mamba2Spec {
                    cache: n_ssm - 1,
                    ..mamba
                },
            )?)
        };
        subs.push(Sublayer {
            norm: l.rms_norm(&format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer,
        });
        subs.push(Sublayer {
            norm: l.rms_norm(&format!("{p}.pre_ff_layernorm.weight"), hidden, eps)?,
            mixer: Mixer::Mlp(Mlp::load_gated(
                l,
                &format!("{p}.feed_forward"),
                hidden,
                inter,
                mlp_bias,
                act,
            )?),
        });
    }
    Assembly {
        arch: c.architecture()?,
        vocab,
        hidden,
        max_positions: c.usize_or("max_position_embeddings", 4096)?,
        embed: l.tensor("model.embed_tokens.weight", &[vocab, hidden])?,
        layers: subs,
        final_norm: l.rms_norm("model.final_layernorm.weight", hidden, eps)?,
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
    .finish(c, l)
}
