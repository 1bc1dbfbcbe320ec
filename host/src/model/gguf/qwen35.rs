//! Qwen3.5 in GGUF (`qwen35`, dense): Gated DeltaNet layers and gated attention every
//! `full_attention_interval` layers. The config comes from `qwen35.*` metadata as transformers
//! reads it; the tensors from llama.cpp's names, with its converter's changes undone:
//!
//! - the zero-centred RMS norms (`attn_norm`, `post_attention_norm`, `attn_q_norm`,
//!   `attn_k_norm`, `output_norm`) are stored as `w + 1`; the Gated DeltaNet's own gated norm
//!   (`ssm_norm`) is not;
//! - `ssm_a` holds `-exp(A_log)`; `ssm_conv1d` is squeezed to `[channels, kernel]`;
//! - value heads are tiled over key heads (`v0k0 v0k1 v1k0 v1k1`) where transformers groups them
//!   by key head (`v0k0 v1k0 v0k1 v1k1`): in the rows of the value block of `attn_qkv` and
//!   `ssm_conv1d`, of `attn_gate` (per value element), of `ssm_alpha`, `ssm_beta`, `ssm_a` and
//!   `ssm_dt.bias` (per value head), and in the columns of `ssm_out`.
//!
//! A file with a multi-token-prediction block (`qwen35.nextn_predict_layers > 0`) is refused.

use serde_json::{Value as Json, json};

use super::{GgufModel, Value};
use crate::model::ModelError;

/// The Gated DeltaNet's head layout, for undoing the value-head tiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub k_heads: usize,
    /// Value heads per key head.
    pub per_k: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

impl Heads {
    pub fn of(g: &GgufModel) -> Result<Self, ModelError> {
        let k_heads = g.meta_u64("ssm.group_count")? as usize;
        let v_heads = g.meta_u64("ssm.time_step_rank")? as usize;
        let inner = g.meta_u64("ssm.inner_size")? as usize;
        if k_heads == 0 || v_heads == 0 || !v_heads.is_multiple_of(k_heads) {
            return Err(g.err(format!(
                "{v_heads} value heads do not group under {k_heads} key heads"
            )));
        }
        if !inner.is_multiple_of(v_heads) {
            return Err(g.err(format!(
                "`qwen35.ssm.inner_size` = {inner} does not split into {v_heads} value heads"
            )));
        }
        Ok(Self {
            k_heads,
            per_k: v_heads / k_heads,
            k_dim: g.meta_u64("ssm.state_size")? as usize,
            v_dim: inner / v_heads,
        })
    }

    /// For each grouped position, the tiled position it was stored at (`dim` elements per
    /// head: 1 for per-head tensors, `v_dim` for per-element ones).
    fn tiled_position(&self, dim: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.k_heads * self.per_k * dim);
        for k in 0..self.k_heads {
            for j in 0..self.per_k {
                for d in 0..dim {
                    out.push((j * self.k_heads + k) * dim + d);
                }
            }
        }
        out
    }
}

/// `qwen35`: the `Qwen3_5ForCausalLM` config.
pub fn config(g: &GgufModel) -> Result<Json, ModelError> {
    let mtp = g
        .meta("nextn_predict_layers")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    if mtp > 0 {
        return Err(ModelError::Unsupported(format!(
            "{}: a Qwen3.5 GGUF with {mtp} multi-token-prediction block(s)",
            g.file.path.display()
        )));
    }
    let heads = Heads::of(g)?;
    let head_dim = g.meta_u64("attention.key_length")?;
    let rotary = g
        .meta("rope.dimension_count")
        .and_then(Value::as_u64)
        .unwrap_or(head_dim);
    let mut c = json!({
        "architectures": ["Qwen3_5ForCausalLM"],
        "hidden_size": g.meta_u64("embedding_length")?,
        "num_hidden_layers": g.meta_u64("block_count")?,
        "num_attention_heads": g.meta_u64("attention.head_count")?,
        "num_key_value_heads": g.meta_u64("attention.head_count_kv")?,
        "head_dim": head_dim,
        "rms_norm_eps": g
            .meta("attention.layer_norm_rms_epsilon")
            .and_then(Value::as_f64)
            .unwrap_or(1e-6),
        "full_attention_interval": g.meta_u64("full_attention_interval")?,
        "linear_conv_kernel_dim": g.meta_u64("ssm.conv_kernel")?,
        "linear_num_key_heads": heads.k_heads,
        "linear_num_value_heads": heads.k_heads * heads.per_k,
        "linear_key_head_dim": heads.k_dim,
        "linear_value_head_dim": heads.v_dim,
        "max_position_embeddings": g.meta("context_length").and_then(Value::as_u64).unwrap_or(4096),
        "vocab_size": g.vocab_size()?,
        "tie_word_embeddings": g.file.tensor("output.weight").is_none(),
        "hidden_act": "silu",
        // Multimodal RoPE is plain partial RoPE for text (one position on every axis).
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": g.meta("rope.freq_base").and_then(Value::as_f64).unwrap_or(10000.0),
            "partial_rotary_factor": rotary as f64 / head_dim.max(1) as f64,
        },
    });
    if let Some(ff) = g.meta("feed_forward_length").and_then(Value::as_u64) {
        c["intermediate_size"] = json!(ff);
    }
    Ok(c)
}

/// The transformers name of a `qwen35` tensor.
pub fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
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
        "ssm_a" => "linear_attn.A_log".to_string(),
        "ssm_dt.bias" => "linear_attn.dt_bias".to_string(),
        _ => {
            let (part, kind) = tail.rsplit_once('.')?;
            let part = match part {
                "attn_norm" => "input_layernorm",
                "post_attention_norm" => "post_attention_layernorm",
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "attn_q_norm" => "self_attn.q_norm",
                "attn_k_norm" => "self_attn.k_norm",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                "attn_qkv" => "linear_attn.in_proj_qkv",
                "attn_gate" => "linear_attn.in_proj_z",
                "ssm_alpha" => "linear_attn.in_proj_a",
                "ssm_beta" => "linear_attn.in_proj_b",
                "ssm_conv1d" => "linear_attn.conv1d",
                "ssm_norm" => "linear_attn.norm",
                "ssm_out" => "linear_attn.out_proj",
                _ => return None,
            };
            format!("{part}.{kind}")
        }
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Reorders whole rows (`cols` values each) from `from_row` on, from tiled to grouped.
fn group_rows(values: &mut [f32], cols: usize, from_row: usize, order: &[usize]) {
    let start = from_row * cols;
    let block = values[start..start + order.len() * cols].to_vec();
    for (dst, src) in order.iter().enumerate() {
        values[start + dst * cols..start + (dst + 1) * cols]
            .copy_from_slice(&block[src * cols..(src + 1) * cols]);
    }
}

/// Puts one tensor back in transformers' layout (see the module docs); returns its shape.
pub fn restore(
    gguf: &str,
    values: &mut [f32],
    shape: Vec<usize>,
    heads: Heads,
) -> Result<Vec<usize>, String> {
    let tail = match gguf.strip_prefix("blk.") {
        Some(rest) => rest.split_once('.').map_or(rest, |(_, t)| t),
        None => gguf,
    };
    let rows = shape.first().copied().unwrap_or(0);
    let cols: usize = shape.iter().skip(1).product::<usize>().max(1);
    let per_head = heads.tiled_position(1);
    let per_value = heads.tiled_position(heads.v_dim);
    let check = |want: usize, what: &str| {
        if want == rows {
            Ok(())
        } else {
            Err(format!("{rows} rows, where {what} needs {want}"))
        }
    };
    match tail {
        "output_norm.weight"
        | "attn_norm.weight"
        | "post_attention_norm.weight"
        | "attn_q_norm.weight"
        | "attn_k_norm.weight" => values.iter_mut().for_each(|v| *v -= 1.0),
        "ssm_a" => {
            check(per_head.len(), "one per value head")?;
            for v in values.iter_mut() {
                if *v >= 0.0 || !v.is_finite() {
                    return Err(format!("A = {v}, where -exp(A_log) is always negative"));
                }
                *v = (-*v).ln();
            }
            group_rows(values, 1, 0, &per_head);
            return Ok(vec![per_head.len()]);
        }
        "ssm_dt.bias" | "ssm_alpha.weight" | "ssm_beta.weight" => {
            check(per_head.len(), "one per value head")?;
            group_rows(values, cols, 0, &per_head);
        }
        "attn_gate.weight" => {
            check(per_value.len(), "one per value element")?;
            group_rows(values, cols, 0, &per_value);
        }
        "attn_qkv.weight" | "ssm_conv1d.weight" => {
            let qk = 2 * heads.k_dim * heads.k_heads;
            check(qk + per_value.len(), "queries, keys, then values")?;
            group_rows(values, cols, qk, &per_value);
            if tail == "ssm_conv1d.weight" {
                return Ok(vec![rows, 1, cols]);
            }
        }
        "ssm_out.weight" => {
            if cols != per_value.len() {
                return Err(format!(
                    "{cols} columns, where one per value element needs {}",
                    per_value.len()
                ));
            }
            for row in values.chunks_exact_mut(cols) {
                group_rows(row, 1, 0, &per_value);
            }
        }
        _ => {}
    }
    Ok(shape)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn value_heads_go_from_tiled_to_grouped() {
        // 2 key heads with 2 value heads each: stored v0k0 v0k1 v1k0 v1k1.
        let heads = Heads {
            k_heads: 2,
            per_k: 2,
            k_dim: 1,
            v_dim: 1,
        };
        assert_eq!(heads.tiled_position(1), [0, 2, 1, 3]);
        let mut dt = vec![10.0, 11.0, 20.0, 21.0];
        restore("blk.0.ssm_dt.bias", &mut dt, vec![4], heads).unwrap();
        assert_eq!(dt, [10.0, 20.0, 11.0, 21.0]);
        // The same on the columns of the output projection.
        let mut out = vec![10.0, 11.0, 20.0, 21.0];
        restore("blk.0.ssm_out.weight", &mut out, vec![1, 4], heads).unwrap();
        assert_eq!(out, [10.0, 20.0, 11.0, 21.0]);
        // q and k rows (2 × k_dim × k_heads = 4) stay; the value rows after them move.
        let mut qkv: Vec<f32> = (0..8).map(|v| v as f32).collect();
        restore("blk.0.attn_qkv.weight", &mut qkv, vec![8, 1], heads).unwrap();
        assert_eq!(qkv, [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        let mut norm = vec![1.5];
        restore("output_norm.weight", &mut norm, vec![1], heads).unwrap();
        assert_eq!(norm, [0.5]);
        assert!(restore("blk.0.ssm_alpha.weight", &mut [0.0; 3], vec![3, 1], heads).is_err());
        assert_eq!(
            hf_name("blk.2.ssm_beta.weight").unwrap(),
            "model.layers.2.linear_attn.in_proj_b.weight"
        );
        assert_eq!(
            hf_name("blk.3.attn_q_norm.weight").unwrap(),
            "model.layers.3.self_attn.q_norm.weight"
        );
    }
}
