//! Qwen3.5, dense (`Qwen3_5ForCausalLM`) and MoE (`Qwen3_5MoeForCausalLM`): the Qwen3-Next
//! layer stack with separate Gated DeltaNet projections and multimodal RoPE, which for text
//! (the same position on every axis) is plain partial RoPE.
//!
//! The published checkpoints are the multimodal classes (`Qwen3_5ForConditionalGeneration`,
//! `Qwen3_5MoeForConditionalGeneration`): the text settings sit in a nested `text_config` and
//! the text model's tensors under `model.language_model.`; the vision tower (`model.visual.`)
//! is not loaded, and only text is served.

use serde_json::Value;

use super::qwen3_next::{FeedForward, build_stack};
use crate::backend::LayerOps;
use crate::model::config::HfConfig;
use crate::model::layers::Loader;
use crate::model::{Model, ModelError};

pub fn build<B: LayerOps>(c: &HfConfig, l: &Loader<'_, B>) -> Result<Model<B>, ModelError> {
    let arch = c.architecture()?;
    let ffn = if arch.starts_with("Qwen3_5Moe") {
        FeedForward::Moe
    } else {
        FeedForward::Dense
    };
    let text = text_config(c)?;
    let root = if l.store.has("model.language_model.embed_tokens.weight")
        || (l.store.is_dummy() && c.get("text_config").is_some())
    {
        "model.language_model"
    } else {
        "model"
    };
    build_stack(&text, l, root, ffn)
}

/// The text model's settings: `text_config`'s keys over the top level (which keeps
/// `architectures` and whatever the text config leaves out, such as `tie_word_embeddings` in
/// some releases); the config itself when there is no `text_config`.
fn text_config(c: &HfConfig) -> Result<HfConfig, ModelError> {
    let Some(nested) = c.get("text_config") else {
        return Ok(c.clone());
    };
    let Value::Object(inner) = nested else {
        return Err(c.error("`text_config` must be an object"));
    };
    let mut merged = c.json.clone();
    if let Value::Object(top) = &mut merged {
        top.remove("text_config");
        top.remove("vision_config");
        for (k, v) in inner {
            top.insert(k.clone(), v.clone());
        }
    }
    Ok(HfConfig {
        path: c.path.clone(),
        json: merged,
    })
}
