//! The Mamba2 family in GGUF (`mamba2`, and the hybrids NemotronH as `nemotron_h` /
//! `nemotron_h_moe` and Granite 4.0 as `granitehybrid`): the config from `{arch}.ssm.*`, `{arch}.attention.*` and
//! `{arch}.expert_*` metadata, llama.cpp's tensor names, and the layouts its converter changes,
//! put back:
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
//! safetensors it was converted from. NemotronH adds attention (`attn_q` …, rows permuted as
//! for Llama, undone by the caller), relu² MLPs (`ffn_up` / `ffn_down`) and experts: the
//! router `ffn_gate_inp`, its bias `exp_probs_b.bias`, the routed experts stacked as
//! `ffn_up_exps` `[experts, inter, hidden]` / `ffn_down_exps` (transformers' stacked
//! `experts.up_proj` / `experts.down_proj`) and the shared expert `ffn_*_shexp`. The layer
//! pattern (`M`, `*`, `-`, `E`) is read from which tensors each block has. Granite keeps
//! transformers' `model.layers.N.{mamba,self_attn,shared_mlp,block_sparse_moe}` layout; its
//! converter split each fused `input_linear` (gate rows, then up rows) into `ffn_gate*` and
//! `ffn_up*`, joined again by [`fuse_gate_up`], and stored the µP multipliers as
//! `attention.scale`, `embedding_scale`, `residual_scale` and `logit_scale`.

use std::collections::HashMap;

use serde_json::{Value as Json, json};

use super::{GgufModel, HostF32, Value};
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

/// `nemotron_h` / `nemotron_h_moe`: the `NemotronHForCausalLM` config.
pub fn nemotron_h_config(g: &GgufModel) -> Result<Json, ModelError> {
    let layers = g.meta_u64("block_count")? as usize;
    let has = |i: usize, t: &str| g.file.tensor(&format!("blk.{i}.{t}")).is_some();
    let mut pattern = String::with_capacity(layers);
    for i in 0..layers {
        pattern.push(if has(i, "ssm_in.weight") {
            'M'
        } else if has(i, "attn_q.weight") {
            '*'
        } else if has(i, "ffn_up_exps.weight") {
            'E'
        } else if has(i, "ffn_up.weight") {
            '-'
        } else {
            return Err(g.err(format!(
                "block {i} has no Mamba2, attention, MLP or expert tensors"
            )));
        });
    }
    // A per-layer list (0 where a layer has none) or one number.
    let most = |key: &str| -> Option<u64> {
        match g.meta(key)? {
            Value::Array(a) => a.iter().filter_map(Value::as_u64).max(),
            v => v.as_u64(),
        }
    };
    let heads = most("attention.head_count").unwrap_or(0);
    let m_heads = g.meta_u64("ssm.time_step_rank")?;
    let inner = g.meta_u64("ssm.inner_size")?;
    if m_heads == 0 || !inner.is_multiple_of(m_heads) {
        return Err(g.err(format!(
            "`{0}.ssm.inner_size` = {inner} does not split into `{0}.ssm.time_step_rank` = \
             {m_heads} heads",
            g.arch
        )));
    }
    let hidden = g.meta_u64("embedding_length")?;
    let eps = g
        .meta("attention.layer_norm_rms_epsilon")
        .or_else(|| g.meta("attention.layer_norm_epsilon"))
        .and_then(Value::as_f64)
        .unwrap_or(1e-5);
    let mut c = json!({
        "architectures": ["NemotronHForCausalLM"],
        "hybrid_override_pattern": pattern,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "vocab_size": g.vocab_size()?,
        "max_position_embeddings": g.meta("context_length").and_then(Value::as_u64).unwrap_or(4096),
        "layer_norm_epsilon": eps,
        "num_attention_heads": heads,
        "num_key_value_heads": most("attention.head_count_kv").unwrap_or(heads),
        "head_dim": g
            .meta("attention.key_length")
            .and_then(Value::as_u64)
            .unwrap_or(hidden / heads.max(1)),
        "attention_bias": g.file.tensors.iter().any(|t| t.name.ends_with("attn_q.bias")),
        "mamba_num_heads": m_heads,
        "mamba_head_dim": inner / m_heads,
        "n_groups": g.meta("ssm.group_count").and_then(Value::as_u64).unwrap_or(1),
        "ssm_state_size": g.meta_u64("ssm.state_size")?,
        "conv_kernel": g.meta_u64("ssm.conv_kernel")?,
        "use_conv_bias": g.file.tensors.iter().any(|t| t.name.ends_with("ssm_conv1d.bias")),
        "mamba_proj_bias": g.file.tensors.iter().any(|t| t.name.ends_with("ssm_in.bias")),
        "mlp_bias": g.file.tensors.iter().any(|t| t.name.ends_with("ffn_up.bias")),
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "tie_word_embeddings": g.file.tensor("output.weight").is_none(),
    });
    // A dense MLP's width: from its tensor (the MoE variant lists only expert widths).
    if let Some(up) = g
        .file
        .tensors
        .iter()
        .find(|t| t.name.starts_with("blk.") && t.name.ends_with(".ffn_up.weight"))
    {
        c["intermediate_size"] = json!(up.shape().first().copied().unwrap_or(0));
    }
    if pattern.contains('E') {
        let n_group = g
            .meta("expert_group_count")
            .and_then(Value::as_u64)
            .unwrap_or(1);
        c["n_routed_experts"] = json!(g.meta_u64("expert_count")?);
        c["num_experts_per_tok"] = json!(g.meta_u64("expert_used_count")?);
        c["moe_intermediate_size"] = json!(g.meta_u64("expert_feed_forward_length")?);
        let shared = g
            .meta("expert_shared_count")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        c["n_shared_experts"] = json!(shared);
        if shared > 0 {
            c["moe_shared_expert_intermediate_size"] =
                json!(g.meta_u64("expert_shared_feed_forward_length")?);
        }
        c["norm_topk_prob"] = json!(
            g.meta("expert_weights_norm")
                .and_then(Value::as_bool)
                .unwrap_or(false)
        );
        c["routed_scaling_factor"] = json!(
            g.meta("expert_weights_scale")
                .and_then(Value::as_f64)
                .unwrap_or(1.0)
        );
        c["n_group"] = json!(n_group);
        // Without a stated count every group stays eligible.
        c["topk_group"] = json!(
            g.meta("expert_group_used_count")
                .and_then(Value::as_u64)
                .unwrap_or(n_group)
        );
    }
    Ok(c)
}

/// The transformers name of a `mamba2`, `nemotron_h(_moe)` or `granitehybrid` tensor. Granite's
/// gate and up halves get interim names (`….input_linear.gate` / `.up`) that
/// [`fuse_gate_up`] joins.
pub fn hf_name(arch: &str, gguf: &str) -> Option<String> {
    let nemotron = matches!(arch, "nemotron_h" | "nemotron_h_moe");
    let granite = arch == "granitehybrid";
    if arch != "mamba2" && !nemotron && !granite {
        return None;
    }
    let root = if granite { "model" } else { "backbone" };
    let fixed = match gguf {
        "token_embd.weight" if granite => Some("model.embed_tokens.weight"),
        "output_norm.weight" if granite => Some("model.norm.weight"),
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
    // Where each kind of sublayer lives in the transformers layout.
    let (ssm, attn) = if granite {
        ("mamba", "self_attn")
    } else {
        ("mixer", "mixer")
    };
    let hf = match tail {
        "attn_norm.weight" if granite => "input_layernorm.weight".to_string(),
        "ffn_norm.weight" if granite => "post_attention_layernorm.weight".to_string(),
        "attn_norm.weight" => "norm.weight".to_string(),
        "ssm_a" => format!("{ssm}.A_log"),
        "ssm_d" => format!("{ssm}.D"),
        "ssm_dt.bias" => format!("{ssm}.dt_bias"),
        "ssm_norm.weight" => format!("{ssm}.norm.weight"),
        "ffn_up_exps.weight" if nemotron => "mixer.experts.up_proj".into(),
        "ffn_down_exps.weight" if nemotron => "mixer.experts.down_proj".into(),
        "exp_probs_b.bias" if nemotron => "mixer.gate.e_score_correction_bias".into(),
        "ffn_gate_exps.weight" if granite => "block_sparse_moe.input_linear.gate".into(),
        "ffn_up_exps.weight" if granite => "block_sparse_moe.input_linear.up".into(),
        "ffn_down_exps.weight" if granite => "block_sparse_moe.output_linear.weight".into(),
        "ffn_gate_inp.weight" if granite => "block_sparse_moe.router.layer.weight".into(),
        "ffn_gate.weight" | "ffn_gate_shexp.weight" if granite => {
            "shared_mlp.input_linear.gate".into()
        }
        "ffn_up.weight" | "ffn_up_shexp.weight" if granite => "shared_mlp.input_linear.up".into(),
        "ffn_down.weight" | "ffn_down_shexp.weight" if granite => {
            "shared_mlp.output_linear.weight".into()
        }
        _ => {
            let (part, kind) = tail.rsplit_once('.')?;
            let part = match part {
                "ssm_in" => format!("{ssm}.in_proj"),
                "ssm_conv1d" => format!("{ssm}.conv1d"),
                "ssm_out" => format!("{ssm}.out_proj"),
                "attn_q" if !arch.starts_with("mamba") => format!("{attn}.q_proj"),
                "attn_k" if !arch.starts_with("mamba") => format!("{attn}.k_proj"),
                "attn_v" if !arch.starts_with("mamba") => format!("{attn}.v_proj"),
                "attn_output" if !arch.starts_with("mamba") => format!("{attn}.o_proj"),
                "ffn_up" if nemotron => "mixer.up_proj".into(),
                "ffn_down" if nemotron => "mixer.down_proj".into(),
                "ffn_gate_inp" if nemotron => "mixer.gate".into(),
                "ffn_up_shexp" if nemotron => "mixer.shared_experts.up_proj".into(),
                "ffn_down_shexp" if nemotron => "mixer.shared_experts.down_proj".into(),
                _ => return None,
            };
            format!("{part}.{kind}")
        }
    };
    Some(format!("{root}.layers.{layer}.{hf}"))
}

/// Joins Granite's gate and up halves back into the fused `input_linear.weight` transformers
/// stores (per expert: the gate rows, then the up rows).
pub fn fuse_gate_up(tensors: &mut HashMap<String, HostF32>) -> Result<(), String> {
    let gates: Vec<String> = tensors
        .keys()
        .filter(|k| k.ends_with(".input_linear.gate"))
        .cloned()
        .collect();
    for gate_name in gates {
        let stem = gate_name.trim_end_matches(".gate");
        let up_name = format!("{stem}.up");
        let (Some((gate, shape)), Some((up, up_shape))) =
            (tensors.remove(&gate_name), tensors.remove(&up_name))
        else {
            return Err(format!("{stem}: a gate half without its up half"));
        };
        if shape != up_shape || shape.len() < 2 {
            return Err(format!(
                "{stem}: gate {shape:?} and up {up_shape:?} halves differ"
            ));
        }
        let block: usize = shape[shape.len() - 2..].iter().product();
        let mut fused = Vec::with_capacity(2 * gate.len());
        for (g, u) in gate.chunks_exact(block).zip(up.chunks_exact(block)) {
            fused.extend_from_slice(g);
            fused.extend_from_slice(u);
        }
        let mut fused_shape = shape;
        let rows = fused_shape.len() - 2;
        fused_shape[rows] *= 2;
        tensors.insert(format!("{stem}.weight"), (fused, fused_shape));
    }
    if let Some(up) = tensors.keys().find(|k| k.ends_with(".input_linear.up")) {
        return Err(format!("{up}: an up half without its gate half"));
    }
    Ok(())
}

/// `granitehybrid`: the `GraniteMoeHybridForCausalLM` config (Granite 4.0).
pub fn granite_config(g: &GgufModel) -> Result<Json, ModelError> {
    let layers = g.meta_u64("block_count")? as usize;
    let has = |i: usize, t: &str| g.file.tensor(&format!("blk.{i}.{t}")).is_some();
    let kinds = (0..layers)
        .map(|i| {
            if has(i, "ssm_in.weight") {
                Ok("mamba")
            } else if has(i, "attn_q.weight") {
                Ok("attention")
            } else {
                Err(g.err(format!(
                    "block {i} has neither Mamba2 nor attention tensors"
                )))
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let most = |key: &str| -> Option<u64> {
        match g.meta(key)? {
            Value::Array(a) => a.iter().filter_map(Value::as_u64).max(),
            v => v.as_u64(),
        }
    };
    let hidden = g.meta_u64("embedding_length")?;
    let heads = most("attention.head_count").unwrap_or(0);
    let m_heads = g.meta_u64("ssm.time_step_rank")?;
    let inner = g.meta_u64("ssm.inner_size")?;
    if m_heads == 0 || !inner.is_multiple_of(m_heads) || hidden == 0 {
        return Err(g.err(format!(
            "`{0}.ssm.inner_size` = {inner} does not split into `{0}.ssm.time_step_rank` = \
             {m_heads} heads",
            g.arch
        )));
    }
    let scale = |key: &str| g.meta(key).and_then(Value::as_f64).unwrap_or(1.0);
    // The shared MLP's width: stated, else the rows of its gate half.
    let shared = match g
        .meta("expert_shared_feed_forward_length")
        .and_then(Value::as_u64)
    {
        Some(n) => n,
        None => g
            .file
            .tensors
            .iter()
            .find(|t| {
                t.name.ends_with(".ffn_gate.weight") || t.name.ends_with(".ffn_gate_shexp.weight")
            })
            .and_then(|t| t.shape().first().copied())
            .ok_or_else(|| g.err("no shared MLP width and no shared MLP tensor".into()))?
            as u64,
    };
    // llama.cpp reads `rope.scaling.finetuned` as "this hybrid's attention uses RoPE".
    let rope = g
        .meta("rope.scaling.finetuned")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut c = json!({
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "layer_types": kinds,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "vocab_size": g.vocab_size()?,
        "max_position_embeddings": g.meta("context_length").and_then(Value::as_u64).unwrap_or(4096),
        "rms_norm_eps": g
            .meta("attention.layer_norm_rms_epsilon")
            .and_then(Value::as_f64)
            .unwrap_or(1e-5),
        "num_attention_heads": heads,
        "num_key_value_heads": most("attention.head_count_kv").unwrap_or(heads),
        "head_dim": g
            .meta("attention.key_length")
            .and_then(Value::as_u64)
            .unwrap_or(hidden / heads.max(1)),
        "attention_bias": g.file.tensors.iter().any(|t| t.name.ends_with("attn_q.bias")),
        "hidden_act": "silu",
        "position_embedding_type": if rope { json!("rope") } else { Json::Null },
        "rope_parameters": g.rope_parameters()?,
        "attention_multiplier": scale("attention.scale"),
        "embedding_multiplier": scale("embedding_scale"),
        "residual_multiplier": scale("residual_scale"),
        "logits_scaling": scale("logit_scale"),
        "mamba_n_heads": m_heads,
        "mamba_d_head": inner / m_heads,
        "mamba_expand": inner as f64 / hidden as f64,
        "mamba_n_groups": g.meta("ssm.group_count").and_then(Value::as_u64).unwrap_or(1),
        "mamba_d_state": g.meta_u64("ssm.state_size")?,
        "mamba_d_conv": g.meta_u64("ssm.conv_kernel")?,
        "mamba_conv_bias": g.file.tensors.iter().any(|t| t.name.ends_with("ssm_conv1d.bias")),
        "mamba_proj_bias": g.file.tensors.iter().any(|t| t.name.ends_with("ssm_in.bias")),
        "num_local_experts": g.meta("expert_count").and_then(Value::as_u64).unwrap_or(0),
        "shared_intermediate_size": shared,
        "tie_word_embeddings": g.file.tensor("output.weight").is_none(),
    });
    if let Some(n) = most("feed_forward_length") {
        c["intermediate_size"] = json!(n);
    }
    if let Some(k) = g.meta("expert_used_count").and_then(Value::as_u64) {
        c["num_experts_per_tok"] = json!(k);
    }
    Ok(c)
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
        assert_eq!(
            hf_name("nemotron_h_moe", "blk.1.attn_q.weight").unwrap(),
            "backbone.layers.1.mixer.q_proj.weight"
        );
        assert_eq!(
            hf_name("nemotron_h_moe", "blk.3.ffn_up_exps.weight").unwrap(),
            "backbone.layers.3.mixer.experts.up_proj"
        );
        assert_eq!(
            hf_name("nemotron_h", "blk.3.exp_probs_b.bias").unwrap(),
            "backbone.layers.3.mixer.gate.e_score_correction_bias"
        );
        assert_eq!(hf_name("llama", "blk.2.ssm_a"), None);
        assert_eq!(
            hf_name("granitehybrid", "blk.2.ssm_a").unwrap(),
            "model.layers.2.mamba.A_log"
        );
        assert_eq!(
            hf_name("granitehybrid", "blk.1.ffn_norm.weight").unwrap(),
            "model.layers.1.post_attention_layernorm.weight"
        );
        assert_eq!(
            hf_name("granitehybrid", "blk.1.attn_k.weight").unwrap(),
            "model.layers.1.self_attn.k_proj.weight"
        );
        // Experts: per expert, the gate rows then the up rows.
        let mut t = HashMap::new();
        t.insert(
            "x.input_linear.gate".to_string(),
            (vec![1.0, 2.0, 3.0, 4.0], vec![2, 1, 2]),
        );
        t.insert(
            "x.input_linear.up".to_string(),
            (vec![5.0, 6.0, 7.0, 8.0], vec![2, 1, 2]),
        );
        fuse_gate_up(&mut t).unwrap();
        assert_eq!(
            t["x.input_linear.weight"],
            (vec![1.0, 2.0, 5.0, 6.0, 3.0, 4.0, 7.0, 8.0], vec![2, 2, 2])
        );
        t.insert("y.input_linear.up".to_string(), (vec![0.0], vec![1, 1]));
        assert!(fuse_gate_up(&mut t).is_err());
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
