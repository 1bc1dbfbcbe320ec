//! `Mamba2ForCausalLM`: a stack of Mamba2 mixers, each behind an RMSNorm.

use super::{Assembly, bool_any, ssm_shape, usize_any};
use crate::backend::LayerOps;
use crate::model::config::HfConfig;
use crate::model::layers::mamba2::Mamba2Spec;
use crate::model::layers::{Loader, Mamba2Mixer, Mixer, Sublayer};
use crate::model::{Model, ModelError};

pub fn build<B: LayerOps>(c: &HfConfig, l: &Loader<'_, B>) -> Result<Model<B>, ModelError> {
    let hidden = c.usize("hidden_size")?;
    let vocab = c.usize("vocab_size")?;
    let layers = c.usize("num_hidden_layers")?;
    let heads = c.usize("num_heads")?;
    let head_dim = c.usize("head_dim")?;
    let expand = c.f64_or("expand", 2.0)?;
    if (expand * hidden as f64) as usize != heads * head_dim {
        return Err(c.error(format!(
            "expand × hidden_size = {} but num_heads × head_dim = {}",
            (expand * hidden as f64) as usize,
            heads * head_dim
        )));
    }
    let eps = c.f64_or("layer_norm_epsilon", 1e-5)?;
    let shape = ssm_shape(
        c,
        heads,
        head_dim,
        usize_any(c, &["n_groups"], Some(1))?,
        usize_any(c, &["state_size"], Some(128))?,
        usize_any(c, &["chunk_size"], Some(256))?,
    )?;
    let act = c.str_or("hidden_act", "silu")?;
    if act != "silu" {
        return Err(c.error(format!("Mamba2 with hidden_act `{act}` (only silu)")));
    }
    let conv_kernel = usize_any(c, &["conv_kernel"], Some(4))?;
    let conv_bias = bool_any(c, &["use_conv_bias"], true)?;
    let proj_bias = bool_any(c, &["use_bias"], false)?;
    let spec = |cache| Mamba2Spec {
        hidden,
        shape,
        conv_kernel,
        conv_bias,
        proj_bias,
        eps,
        cache,
    };
    let mut subs = Vec::with_capacity(layers);
    for i in 0..layers {
        let p = format!("backbone.layers.{i}");
        subs.push(Sublayer {
            norm: l.rms_norm(&format!("{p}.norm.weight"), hidden, eps)?,
            mixer: Mixer::Mamba2(Mamba2Mixer::load(l, &format!("{p}.mixer"), spec(i))?),
        });
    }
    Assembly {
        arch: c.architecture()?,
        vocab,
        hidden,
        max_positions: usize::MAX,
        embed: l.tensor("backbone.embeddings.weight", &[vocab, hidden])?,
        layers: subs,
        final_norm: l.rms_norm("backbone.norm_f.weight", hidden, eps)?,
        tie: bool_any(c, &["tie_word_embeddings"], false)?,
        lm_head_name: "lm_head.weight",
        kv: (0, 0),
        attn_layers: 0,
        mamba: Some(spec(0)),
        ssm_layers: layers,
    }
    .finish(c, l)
}
