//! The Mamba2 family in GGUF (`mamba2`): the config from `{arch}.ssm.*` metadata, llama.cpp's
//! tensor names, and the layouts its converter changes, put back:
//!
//! | GGUF | transformers | change undone |
//! |---|---|---|
//! | `blk.N.ssm_a` `[heads, 1]` | `mixer.A_log` `[heads]` | stored as `A = -exp(A_log)` |
//! | `blk.N.ssm_d` `[heads, 1]` | `mixer.D` `[heads]` | a trailing axis |
//! | `blk.N.ssm_conv1d.weight` `[channels, kernel]` | `mixer.conv1d.weight` `[channels, 1, kernel]` | squeezed |
//! | `blk.N.ssm_norm.weight` `[groups, d_inner / groups]` | `mixer.norm.weight` `[d_inner]` | split by group |
//! | `blk.N.ssm_dt.bias` | `mixer.dt_bias` | renamed |
//!
//! Everything else is a rename (`ssm_in` → `in_proj`, `ssm_out` → `out_proj`, `attn_norm` →
//! the layer's `norm`). Values are otherwise as stored, so a file loads the same model as the
//! safetensors it was converted from.

use serde_json::{Value as Json, json};

use super::{GgufModel, Value};
use crate::model::ModelError;

/// `mamba2`: the `Mamba2ForCausalLM` config.
pub fn mamba2_config(g: &GgufModel) -> Result<Json, ModelError> {
    let hidden = g.meta_u64("embedding_length")?;
    let inner = g.meta_u64("ssm.inner_size")?;
    let heads = g.meta_u64("ssm.time_step_rank")?;
    if heads == 0 || !inner.is_multiple_of(heads) || hidden == 0 {
        return Err(g.err(format!(
            "`{0}.ssm.inner_size` = {inner} does not split into `{0}.ssm.time_step_rank` = \
             {heads} heads",
            g.arch
        )));
    }
    let expand = inner as f64 / hidden as f64;
    if (expand * hidden as f64) as u64 != inner {
        return Err(g.err(format!(
            "`{}.ssm.inner_size` = {inner} is not a whole multiple of the embedding width \
             {hidden} that a Mamba2 config can state",
            g.arch
        )));
    }
    Ok(json!({
        "architectures": ["Mamba2ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": g.meta_u64("block_count")?,
        "num_heads": heads,
        "head_dim": inner / heads,
        "expand": expand,
        "n_groups": g.meta("ssm.group_count").and_then(Value::as_u64).unwrap_or(1),
        "state_size": g.meta_u64("ssm.state_size")?,
        "conv_kernel": g.meta_u64("ssm.conv_kernel")?,
        "layer_norm_epsilon": g
            .meta("attention.layer_norm_rms_epsilon")
            .and_then(Value::as_f64)
            .unwrap_or(1e-5),
        "vocab_size": g.vocab_size()?,
        "tie_word_embeddings": g.file.tensor("output.weight").is_none(),
        "use_conv_bias": g.file.tensor("blk.0.ssm_conv1d.bias").is_some(),
        "use_bias": g.file.tensor("blk.0.ssm_in.bias").is_some(),
        "hidden_act": "silu",
    }))
}

/// The transformers name of a `mamba2` tensor.
pub fn hf_name(arch: &str, gguf: &str) -> Option<String> {
    if arch != "mamba2" {
        return None;
    }
    let fixed = match gguf {
        "token_embd.weight" => Some("backbone.embeddings.weight"),
        "output_norm.weight" => Some("backbone.norm_f.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.into());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match tail {
        "attn_norm.weight" => "norm.weight",
        "ssm_a" => "mixer.A_log",
        "ssm_d" => "mixer.D",
        "ssm_dt.bias" => "mixer.dt_bias",
        "ssm_norm.weight" => "mixer.norm.weight",
        _ => {
            let (part, kind) = tail.rsplit_once('.')?;
            let part = match part {
                "ssm_in" => "mixer.in_proj",
                "ssm_conv1d" => "mixer.conv1d",
                "ssm_out" => "mixer.out_proj",
                _ => return None,
            };
            return Some(format!("backbone.layers.{layer}.{part}.{kind}"));
        }
    };
    Some(format!("backbone.layers.{layer}.{hf}"))
}

/// Puts one tensor back in transformers' layout (see the module table); returns its shape.
pub fn restore(gguf: &str, values: &mut [f32], shape: Vec<usize>) -> Result<Vec<usize>, String> {
    let tail = gguf.split_once('.').map_or(gguf, |(_, t)| t);
    let tail = tail.split_once('.').map_or(tail, |(_, t)| t);
    let n = values.len();
    Ok(match tail {
        "ssm_a" => {
            for v in values.iter_mut() {
                if *v >= 0.0 || !v.is_finite() {
                    return Err(format!("A = {v}, where -exp(A_log) is always negative"));
                }
                *v = (-*v).ln();
            }
            vec![n]
        }
        "ssm_d" | "ssm_norm.weight" => vec![n],
        "ssm_conv1d.weight" => match shape.as_slice() {
            [channels, kernel] => vec![*channels, 1, *kernel],
            _ => shape,
        },
        _ => shape,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn names_and_layouts_map_back() {
        assert_eq!(
            hf_name("mamba2", "blk.3.ssm_a").unwrap(),
            "backbone.layers.3.mixer.A_log"
        );
        assert_eq!(
            hf_name("mamba2", "blk.0.ssm_conv1d.bias").unwrap(),
            "backbone.layers.0.mixer.conv1d.bias"
        );
        assert_eq!(
            hf_name("mamba2", "blk.0.ssm_dt.bias").unwrap(),
            "backbone.layers.0.mixer.dt_bias"
        );
        assert_eq!(
            hf_name("mamba2", "blk.1.attn_norm.weight").unwrap(),
            "backbone.layers.1.norm.weight"
        );
        assert_eq!(hf_name("mamba2", "blk.1.attn_q.weight"), None);
        let mut a = vec![-1.0, -(2f32.exp())];
        assert_eq!(restore("blk.0.ssm_a", &mut a, vec![2, 1]).unwrap(), [2]);
        assert!(
            (a[0] - 0.0).abs() < 1e-7 && (a[1] - 2.0).abs() < 1e-6,
            "{a:?}"
        );
        assert!(restore("blk.0.ssm_a", &mut [0.5], vec![1, 1]).is_err());
        let mut conv = vec![0.0; 12];
        assert_eq!(
            restore("blk.2.ssm_conv1d.weight", &mut conv, vec![3, 4]).unwrap(),
            [3, 1, 4]
        );
        let mut norm = vec![0.0; 8];
        assert_eq!(
            restore("blk.2.ssm_norm.weight", &mut norm, vec![2, 4]).unwrap(),
            [8]
        );
    }
}
