//! `LlamaForCausalLM` (and Mistral's identical layout): GQA attention with RoPE (incl. partial
//! rotary and llama3 scaling) and a gated SiLU MLP, tied or untied embeddings.

use super::{Assembly, bool_any, usize_any};
use crate::backend::{Activation, LayerOps};
use crate::model::config::HfConfig;
use crate::model::layers::attention::AttentionSpec;
use crate::model::layers::{Attention, Loader, Mixer, Mlp, Sublayer, rope};
use crate::model::{Model, ModelError};

pub fn build<B: LayerOps>(c: &HfConfig, l: &Loader<'_, B>) -> Result<Model<B>, ModelError> {
    let hidden = c.usize("hidden_size")?;
    let vocab = c.usize("vocab_size")?;
    let layers = c.usize("num_hidden_layers")?;
    let heads = c.usize("num_attention_heads")?;
    let kv_heads = usize_any(c, &["num_key_value_heads"], Some(heads))?;
    let head_dim = usize_any(c, &["head_dim"], Some(hidden / heads.max(1)))?;
    let inter = c.usize("intermediate_size")?;
    let eps = c.f64_or("rms_norm_eps", 1e-6)?;
    let attn_bias = c.bool_or("attention_bias", false)?;
    let mlp_bias = c.bool_or("mlp_bias", false)?;
    let act_name = c.str_or("hidden_act", "silu")?;
    let act = Activation::from_hf(act_name)
        .ok_or_else(|| c.error(format!("unsupported hidden_act `{act_name}`")))?;
    let rope = rope::build(&c.rope_settings()?, head_dim)?;

    let mut subs = Vec::with_capacity(2 * layers);
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        subs.push(Sublayer {
            norm: l.rms_norm(&format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer: Mixer::Attention(Attention::load(
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
                    cache: i,
                },
            )?),
        });
        subs.push(Sublayer {
            norm: l.rms_norm(&format!("{p}.post_attention_layernorm.weight"), hidden, eps)?,
            mixer: Mixer::Mlp(Mlp::load_gated(
                l,
                &format!("{p}.mlp"),
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
        final_norm: l.rms_norm("model.norm.weight", hidden, eps)?,
        tie: bool_any(c, &["tie_word_embeddings"], false)?,
        lm_head_name: "lm_head.weight",
        kv: (kv_heads, head_dim),
        attn_layers: layers,
        mamba: None,
        ssm_layers: 0,
    }
    .finish(c, l)
}
