//! One small file per architecture: which shared layers, in which order, under which names.

mod bamba;
// ---- wave 2, Mamba2-based (branch gfh) ----
mod falcon_h1;
mod granite_moe_hybrid;
// ---- end gfh ----
mod llama;
mod mamba2;
mod nemotron_h;
// Gated DeltaNet hybrids.
mod qwen3_5;
mod qwen3_next;

use super::config::HfConfig;
use super::layers::mamba2::Mamba2Spec;
use super::layers::{Linear, Loader, RmsNorm, Sublayer};
use super::weights::WeightStore;
use super::{CacheSpec, Model, ModelError, ModelInfo};
use crate::backend::{LayerOps, SsmShape};

/// `architectures` values this build can load.
pub const SUPPORTED: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Mamba2ForCausalLM",
    "NemotronHForCausalLM",
    "BambaForCausalLM",
    // ---- wave 2, Mamba2-based (branch gfh) ----
    "GraniteMoeHybridForCausalLM",
    "FalconH1ForCausalLM",
    // ---- end gfh ----
    // Gated DeltaNet hybrids.
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
];

pub fn build<B: LayerOps>(
    config: &HfConfig,
    store: &WeightStore,
    backend: &B,
    options: super::LoadOptions,
) -> Result<Model<B>, ModelError> {
    let arch = config.architecture()?;
    let l = Loader {
        store,
        backend,
        mtp: options.mtp,
    };
    match arch.as_str() {
        "LlamaForCausalLM" | "MistralForCausalLM" => llama::build(config, &l),
        "Mamba2ForCausalLM" => mamba2::build(config, &l),
        "NemotronHForCausalLM" => nemotron_h::build(config, &l),
        "BambaForCausalLM" => bamba::build(config, &l),
        // ---- wave 2, Mamba2-based (branch gfh) ----
        "GraniteMoeHybridForCausalLM" => granite_moe_hybrid::build(config, &l),
        "FalconH1ForCausalLM" => falcon_h1::build(config, &l),
        // ---- end gfh ----
        // Gated DeltaNet hybrids.
        "Qwen3NextForCausalLM" => qwen3_next::build(config, &l),
        "Qwen3_5ForCausalLM"
        | "Qwen3_5MoeForCausalLM"
        | "Qwen3_5ForConditionalGeneration"
        | "Qwen3_5MoeForConditionalGeneration" => qwen3_5::build(config, &l),
        _ => Err(ModelError::UnsupportedArchitecture(arch)),
    }
}

/// The first of several alternative keys that is present (configs rename keys across
/// versions), as a usize.
pub(super) fn usize_any(
    c: &HfConfig,
    keys: &[&str],
    default: Option<usize>,
) -> Result<usize, ModelError> {
    for k in keys {
        if let Some(v) = c.opt_usize(k)? {
            return Ok(v);
        }
    }
    default.ok_or_else(|| c.error(format!("missing required key `{}`", keys[0])))
}

pub(super) fn bool_any(c: &HfConfig, keys: &[&str], default: bool) -> Result<bool, ModelError> {
    for k in keys {
        if c.get(k).is_some() {
            return c.bool_or(k, default);
        }
    }
    Ok(default)
}

/// The SSM shape of a Mamba2 mixer from config values.
pub(super) fn ssm_shape(
    c: &HfConfig,
    heads: usize,
    head_dim: usize,
    groups: usize,
    state: usize,
    chunk: usize,
) -> Result<SsmShape, ModelError> {
    let (lo, hi) = c.f64_pair_or("time_step_limit", (0.0, f64::INFINITY))?;
    if heads == 0 || head_dim == 0 || groups == 0 || !heads.is_multiple_of(groups) || chunk == 0 {
        return Err(c.error(format!(
            "invalid Mamba2 shape: {heads} heads × {head_dim}, {groups} groups, chunk {chunk}"
        )));
    }
    Ok(SsmShape {
        heads,
        head_dim,
        groups,
        state_size: state,
        chunk_size: chunk,
        dt_min: lo as f32,
        dt_max: hi as f32,
    })
}

/// The Mamba2 mixer of the hybrids whose config keys start with `mamba_` (Bamba,
/// GraniteMoeHybrid, Falcon-H1), of inner width `d_inner`: heads, head dim (`mamba_d_head`, or
/// the width over the heads), groups, state (`default_state` when absent), chunk, conv kernel
/// and biases.
pub(super) fn mamba_keyed_spec(
    c: &HfConfig,
    hidden: usize,
    d_inner: usize,
    default_state: usize,
    eps: f64,
) -> Result<Mamba2Spec, ModelError> {
    let heads = c.usize("mamba_n_heads")?;
    let head_dim = match c.get("mamba_d_head").and_then(|v| v.as_u64()) {
        Some(d) => d as usize,
        None => d_inner / heads.max(1),
    };
    if head_dim * heads != d_inner {
        return Err(c.error(format!(
            "mamba_n_heads {heads} × mamba_d_head {head_dim} ≠ Mamba2 width {d_inner}"
        )));
    }
    let shape = ssm_shape(
        c,
        heads,
        head_dim,
        usize_any(c, &["mamba_n_groups"], Some(1))?,
        usize_any(c, &["mamba_d_state"], Some(default_state))?,
        usize_any(c, &["mamba_chunk_size"], Some(256))?,
    )?;
    Ok(Mamba2Spec {
        hidden,
        shape,
        conv_kernel: usize_any(c, &["mamba_d_conv"], Some(4))?,
        conv_bias: bool_any(c, &["mamba_conv_bias"], true)?,
        proj_bias: bool_any(c, &["mamba_proj_bias"], false)?,
        eps,
        cache: 0,
    })
}

/// The parts every architecture ends with.
pub(super) struct Assembly<B: LayerOps> {
    pub arch: String,
    pub vocab: usize,
    pub hidden: usize,
    pub max_positions: usize,
    pub embed: B::Tensor,
    pub layers: Vec<Sublayer<B>>,
    pub final_norm: RmsNorm<B>,
    pub tie: bool,
    pub lm_head_name: &'static str,
    /// KV heads and head dim of the attention layers (0 if none).
    pub kv: (usize, usize),
    pub attn_layers: usize,
    pub mamba: Option<Mamba2Spec>,
    pub ssm_layers: usize,
}

/// The per-slot, per-layer recurrent state of a model's recurrent layers, whatever their kind:
/// conv state `(channels, kernel − 1)` and the layer's own state as three dims (Mamba2:
/// heads × head_dim × state; Gated DeltaNet: value heads × key dim × value dim). The caches
/// size slots from these numbers and nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RecurrentState {
    pub conv: (usize, usize),
    pub state: (usize, usize, usize),
}

impl<B: LayerOps> Assembly<B> {
    pub fn finish(self, c: &HfConfig, l: &Loader<'_, B>) -> Result<Model<B>, ModelError> {
        if let Some(m) = &self.mamba {
            l.backend.set_ssm_chunk_size(m.shape.chunk_size);
        }
        let state = self.mamba.map(|m| RecurrentState {
            conv: (m.conv_dim(), m.conv_kernel - 1),
            state: (m.shape.heads, m.shape.head_dim, m.shape.state_size),
        });
        self.finish_with_state(c, l, state)
    }

    /// [`Assembly::finish`] for recurrent layers described by their state shape alone (the
    /// `mamba` field is not read).
    pub fn finish_with_state(
        self,
        c: &HfConfig,
        l: &Loader<'_, B>,
        state: Option<RecurrentState>,
    ) -> Result<Model<B>, ModelError> {
        // Dummy weights have no files to look in: the config's tie flag decides.
        let has_head = l.store.has(self.lm_head_name) || (l.store.is_dummy() && !self.tie);
        let lm_head = if self.tie && !has_head {
            None
        } else if !self.tie || has_head {
            match has_head {
                true => Some(Linear {
                    w: l.tensor(self.lm_head_name, &[self.vocab, self.hidden])?,
                    b: None,
                }),
                false => {
                    return Err(ModelError::MissingTensor {
                        tensor: self.lm_head_name.to_string(),
                        files: format!(
                            "{} (tie_word_embeddings is false)",
                            c.path
                                .parent()
                                .map(|p| p.display().to_string())
                                .unwrap_or_default()
                        ),
                    });
                }
            }
        } else {
            None
        };
        let (conv_shape, ssm_shape) = match state {
            Some(s) => (s.conv, s.state),
            None => ((0, 0), (0, 0, 0)),
        };
        let conv_elems = conv_shape.0 * conv_shape.1;
        let ssm_elems = ssm_shape.0 * ssm_shape.1 * ssm_shape.2;
        let mut eos = c.token_ids("eos_token_id");
        eos.dedup();
        Ok(Model {
            info: ModelInfo {
                architecture: self.arch,
                vocab_size: self.vocab,
                hidden_size: self.hidden,
                max_position_embeddings: self.max_positions,
                eos_token_ids: eos,
                cache: CacheSpec {
                    attn_layers: self.attn_layers,
                    kv_heads: self.kv.0,
                    head_dim: self.kv.1,
                    ssm_layers: self.ssm_layers,
                    conv_state_elems: conv_elems,
                    ssm_state_elems: ssm_elems,
                    kv_elem_bytes: 4,
                    conv_elem_bytes: 4,
                    ssm_elem_bytes: 4,
                },
            },
            embed: self.embed,
            layers: self.layers,
            final_norm: self.final_norm,
            lm_head,
            conv_shape,
            ssm_shape,
            embed_scale: 1.0,
            logits_scale: 1.0,
            mtp: None,
        })
    }
}
