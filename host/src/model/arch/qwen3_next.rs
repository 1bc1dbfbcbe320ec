//! `Qwen3NextForCausalLM`, and the layer stack Qwen3.5 shares with it: every layer is a token
//! mixer — Gated DeltaNet (`linear_attention`) or gated attention (`full_attention`), from
//! `layer_types` or every `full_attention_interval`-th layer — then a channel mixer (gated SiLU
//! MLP, or a softmax-routed MoE with a sigmoid-gated shared expert), each pre-norm residual.
//! Every RMS norm outside the Gated DeltaNet stores `w − 1` (zero-centred).

use super::{Assembly, RecurrentState, bool_any, usize_any};
use crate::backend::{Activation, GdnShape, LayerOps};
use crate::model::config::HfConfig;
use crate::model::layers::gated_attention::{GatedAttention, GatedAttentionSpec};
use crate::model::layers::gated_delta_net::{GDN_CHUNK, GatedDeltaNet, GdnSpec};
use crate::model::layers::moe::SoftmaxMoeSpec;
use crate::model::layers::{Loader, Mixer, Mlp, Moe, Sublayer, rope};
use crate::model::mtp::MtpHead;
use crate::model::{Model, ModelError};

/// Which layers get the MoE block instead of the dense MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FeedForward {
    /// Every layer dense (Qwen3.5).
    Dense,
    /// Every layer MoE, weights always renormalised (Qwen3.5 MoE).
    Moe,
    /// Qwen3-Next's rule: MoE when `num_experts > 0`, `(i + 1) % decoder_sparse_step == 0`
    /// and `i` is not in `mlp_only_layers`; renormalisation from `norm_topk_prob`.
    Sparse,
}

pub fn build<B: LayerOps>(c: &HfConfig, l: &Loader<'_, B>) -> Result<Model<B>, ModelError> {
    build_stack(c, l, "model", FeedForward::Sparse)
}

/// Whether each layer is full attention (else Gated DeltaNet).
fn full_attention_layers(c: &HfConfig, layers: usize) -> Result<Vec<bool>, ModelError> {
    if let Some(list) = c.get("layer_types").and_then(|v| v.as_array()) {
        if list.len() != layers {
            return Err(c.error(format!(
                "`layer_types` has {} entries for {layers} layers",
                list.len()
            )));
        }
        return list
            .iter()
            .map(|v| match v.as_str() {
                Some("full_attention") => Ok(true),
                Some("linear_attention") => Ok(false),
                _ => Err(c.error(format!(
                    "unknown layer type {v} in `layer_types` (allowed: linear_attention, \
                     full_attention)"
                ))),
            })
            .collect();
    }
    let interval = c.usize_or("full_attention_interval", 4)?;
    if interval == 0 {
        return Err(c.error("`full_attention_interval` must be at least 1"));
    }
    Ok((0..layers)
        .map(|i| (i + 1).is_multiple_of(interval))
        .collect())
}

/// The stack under `root` (`model` or `model.language_model`).
pub(super) fn build_stack<B: LayerOps>(
    c: &HfConfig,
    l: &Loader<'_, B>,
    root: &str,
    ffn: FeedForward,
) -> Result<Model<B>, ModelError> {
    let hidden = c.usize("hidden_size")?;
    let vocab = c.usize("vocab_size")?;
    let layers = c.usize("num_hidden_layers")?;
    let eps = c.f64_or("rms_norm_eps", 1e-6)?;
    let heads = c.usize("num_attention_heads")?;
    let kv_heads = usize_any(c, &["num_key_value_heads"], Some(heads))?;
    let head_dim = usize_any(c, &["head_dim"], Some(hidden / heads.max(1)))?;
    let act_name = c.str_or("hidden_act", "silu")?;
    if Activation::from_hf(act_name) != Some(Activation::Silu) {
        return Err(c.error(format!(
            "hidden_act `{act_name}`: Gated DeltaNet models need silu"
        )));
    }
    let kinds = full_attention_layers(c, layers)?;
    let mut rope_settings = c.rope_settings()?;
    let has_partial = c
        .get("rope_parameters")
        .and_then(|p| p.get("partial_rotary_factor"))
        .or_else(|| c.get("partial_rotary_factor"))
        .is_some();
    if !has_partial {
        rope_settings.partial_rotary_factor = 0.25; // transformers' default for these models
    }
    let rope = rope::build(&rope_settings, head_dim)?;
    let gdn = GdnSpec {
        hidden,
        shape: GdnShape {
            k_heads: c.usize_or("linear_num_key_heads", 16)?,
            v_heads: c.usize_or("linear_num_value_heads", 32)?,
            k_dim: c.usize_or("linear_key_head_dim", 128)?,
            v_dim: c.usize_or("linear_value_head_dim", 128)?,
            chunk_size: GDN_CHUNK,
        },
        conv_kernel: c.usize_or("linear_conv_kernel_dim", 4)?,
        eps,
        cache: 0,
    };
    let mlp_only: Vec<usize> = c
        .get("mlp_only_layers")
        .and_then(|v| v.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as usize)
                .collect()
        })
        .unwrap_or_default();
    let sparse_step = c.usize_or("decoder_sparse_step", 1)?.max(1);
    let n_experts = c.usize_or("num_experts", 0)?;
    let is_moe = |i: usize| match ffn {
        FeedForward::Dense => false,
        FeedForward::Moe => true,
        FeedForward::Sparse => {
            n_experts > 0 && (i + 1).is_multiple_of(sparse_step) && !mlp_only.contains(&i)
        }
    };

    // The channel mixer of a layer: the MoE block or the gated SiLU MLP.
    let channel_mixer = |prefix: &str, moe: bool| -> Result<Mixer<B>, ModelError> {
        Ok(if moe {
            Mixer::Moe(Moe::load_softmax(
                l,
                prefix,
                SoftmaxMoeSpec {
                    hidden,
                    experts: c.usize("num_experts")?,
                    expert_inter: c.usize("moe_intermediate_size")?,
                    shared_inter: c.usize_or("shared_expert_intermediate_size", 0)?,
                    top_k: c.usize("num_experts_per_tok")?,
                    norm_topk_prob: ffn == FeedForward::Moe || c.bool_or("norm_topk_prob", true)?,
                    act: Activation::Silu,
                },
            )?)
        } else {
            Mixer::Mlp(Mlp::load_gated(
                l,
                prefix,
                hidden,
                c.usize("intermediate_size")?,
                false,
                Activation::Silu,
            )?)
        })
    };
    let attention = |prefix: &str, cache: usize| -> Result<Mixer<B>, ModelError> {
        Ok(Mixer::GatedAttention(GatedAttention::load(
            l,
            prefix,
            GatedAttentionSpec {
                hidden,
                heads,
                kv_heads,
                head_dim,
                bias: c.bool_or("attention_bias", false)?,
                eps,
                rope: rope.clone(),
                cache,
            },
        )?))
    };

    let (mut n_attn, mut n_gdn) = (0, 0);
    let mut subs = Vec::with_capacity(2 * layers);
    for (i, &full) in kinds.iter().enumerate() {
        let p = format!("{root}.layers.{i}");
        let mixer = if full {
            n_attn += 1;
            attention(&format!("{p}.self_attn"), n_attn - 1)?
        } else {
            n_gdn += 1;
            Mixer::GatedDeltaNet(GatedDeltaNet::load(
                l,
                &format!("{p}.linear_attn"),
                GdnSpec {
                    cache: n_gdn - 1,
                    ..gdn
                },
            )?)
        };
        subs.push(Sublayer {
            norm: l.rms_norm_centred(&format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer,
        });
        let ff = channel_mixer(&format!("{p}.mlp"), is_moe(i))?;
        subs.push(Sublayer {
            norm: l.rms_norm_centred(
                &format!("{p}.post_attention_layernorm.weight"),
                hidden,
                eps,
            )?,
            mixer: ff,
        });
    }
    let sh = gdn.shape;
    if n_gdn > 0 {
        // The step plan cuts prompts into chunks of this many tokens (and at every snapshot
        // offset) for the delta rule, as it does for a Mamba2 scan.
        l.backend.set_ssm_chunk_size(GDN_CHUNK);
    }
    // The MTP head: one more decoder layer (gated full attention, the channel mixer the
    // checkpoint has) whose KV is the last attention layer of the cache.
    let mtp_layers = crate::model::mtp::declared_layers(c)?;
    let mtp = if l.mtp && (mtp_layers > 0 || l.store.has("mtp.fc.weight")) {
        if mtp_layers > 1 {
            return Err(c.error(format!(
                "{mtp_layers} MTP layers: chimera drafts with one (every published Qwen3.5 and \
                 Qwen3-Next checkpoint has one)"
            )));
        }
        let p = "mtp.layers.0";
        let moe = l.store.has(&format!("{p}.mlp.gate.weight"))
            || (l.store.is_dummy() && ffn != FeedForward::Dense && n_experts > 0);
        let layers = vec![
            Sublayer {
                norm: l.rms_norm_centred(&format!("{p}.input_layernorm.weight"), hidden, eps)?,
                mixer: attention(&format!("{p}.self_attn"), n_attn)?,
            },
            Sublayer {
                norm: l.rms_norm_centred(
                    &format!("{p}.post_attention_layernorm.weight"),
                    hidden,
                    eps,
                )?,
                mixer: channel_mixer(&format!("{p}.mlp"), moe)?,
            },
        ];
        Some(MtpHead::load(l, "mtp", hidden, eps, layers)?)
    } else {
        None
    };
    let mut model = Assembly {
        arch: c.architecture()?,
        vocab,
        hidden,
        max_positions: c.usize_or("max_position_embeddings", 4096)?,
        embed: l.tensor(&format!("{root}.embed_tokens.weight"), &[vocab, hidden])?,
        layers: subs,
        final_norm: l.rms_norm_centred(&format!("{root}.norm.weight"), hidden, eps)?,
        tie: bool_any(c, &["tie_word_embeddings"], false)?,
        lm_head_name: "lm_head.weight",
        kv: if n_attn > 0 {
            (kv_heads, head_dim)
        } else {
            (0, 0)
        },
        attn_layers: n_attn,
        mamba: None,
        ssm_layers: n_gdn,
    }
    .finish_with_state(
        c,
        l,
        (n_gdn > 0).then_some(RecurrentState {
            conv: (sh.conv_dim(), gdn.conv_kernel - 1),
            state: (sh.v_heads, sh.k_dim, sh.v_dim),
        }),
    )?;
    if mtp.is_some() {
        model.info.cache.attn_layers += 1;
        if model.info.cache.kv_heads == 0 {
            (model.info.cache.kv_heads, model.info.cache.head_dim) = (kv_heads, head_dim);
        }
    }
    model.mtp = mtp;
    Ok(model)
}
