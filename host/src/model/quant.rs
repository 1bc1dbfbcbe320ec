//! Quantized checkpoints and online quantization: which weights are FP8 and how their scales
//! are laid out.
//!
//! A checkpoint says it is quantized in `config.json`'s `quantization_config`. Three FP8 forms
//! load, each with e4m3 weights (`F8_E4M3` tensors) beside f32/bf16 scales:
//! - `quant_method = "fp8"` (transformers' fine-grained FP8; DeepSeek, Qwen3.5 / Qwen3-Next FP8
//!   releases): `weight_block_size = [128, 128]` and `{name}_scale_inv` of
//!   `[ceil(out / 128), ceil(in / 128)]`, or without a block size a per-tensor `weight_scale`;
//!   `modules_to_not_convert` lists what stayed in bf16.
//! - `quant_method = "compressed-tensors"` with `float-quantized` 8-bit float weights (strategy
//!   `tensor`, `channel` or `block`): `weight_scale`; `ignore` lists what stayed in bf16.
//! - `quant_method = "modelopt"` with `quant_algo = "FP8"` (NVIDIA's FP8 checkpoints):
//!   per-tensor `weight_scale`; `exclude_modules` lists what stayed in bf16.
//!
//! In all three the scale's shape says its layout (one value: per tensor; one per output row:
//! per channel; a grid: blocks), and the real weight is `code · scale`. Static activation
//! scales (`input_scale`) are not used: activations are quantized per token at run time where
//! a GEMM needs FP8 inputs, which is at least as accurate. Every other scheme (AWQ, GPTQ,
//! bitsandbytes, NVFP4, MXFP4, int8 …) is refused at load with its name.
//!
//! `model.quantization = "fp8"` quantizes a bf16 checkpoint at load with one scale per output
//! row. What is quantized: the big projections — attention q/k/v/o, MLP gate/up/down, Mamba2
//! in/out projections, Gated DeltaNet projections — which are the layers loaded as
//! [`super::layers::Linear`]. Norms, convolutions, the small gates (`in_proj_ba`, a shared
//! expert's gate), routers, the embedding and the LM head stay in the checkpoint's dtype.

use serde_json::Value;

use super::ModelError;
use super::config::HfConfig;

/// How the weights of a model are quantized.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Quantization {
    /// The checkpoint's own FP8 scheme (from `quantization_config`).
    pub checkpoint: Option<CheckpointFp8>,
    /// `model.quantization = "fp8"`: bf16 projections are quantized at load.
    pub online: bool,
}

/// A published FP8 checkpoint's scheme.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointFp8 {
    /// `fp8`, `compressed-tensors` or `modelopt`.
    pub method: String,
    /// The weight block size where scales are per block (`[128, 128]`).
    pub block: Option<[usize; 2]>,
    /// Module names (or `re:` regular expressions, compressed-tensors' form) the checkpoint
    /// left unquantized.
    pub keep: Vec<String>,
}

/// What `model.quantization` may say.
pub const ONLINE_SCHEMES: &[&str] = &["none", "fp8"];

impl Quantization {
    /// Reads `quantization_config` from the model's config; `online` is
    /// `model.quantization = "fp8"`.
    pub fn from_config(config: &HfConfig, online: bool) -> Result<Self, ModelError> {
        let checkpoint = match config.get("quantization_config") {
            None | Some(Value::Null) => None,
            Some(q) => Some(parse(q).map_err(|m| config.error(m))?),
        };
        if online && checkpoint.is_some() {
            // A published FP8 checkpoint is already what online quantization would make.
            tracing::info!(
                "model.quantization = \"fp8\": the checkpoint is FP8 already; its own scales are used"
            );
        }
        Ok(Self { checkpoint, online })
    }

    /// Whether a projection named `module` (`model.layers.0.mlp.down_proj`) should be FP8 when
    /// the checkpoint stores it in a float dtype: only under online quantization, and never for
    /// a module the checkpoint kept unquantized.
    pub fn quantize_online(&self, module: &str) -> bool {
        self.online && !self.keeps(module)
    }

    /// Whether a made-up (dummy) weight of `module` is FP8: where either scheme would make it
    /// so — a published FP8 config.json run with dummy weights is FP8 like its checkpoint.
    pub fn dummy_fp8(&self, module: &str) -> bool {
        (self.online || self.checkpoint.is_some()) && !self.keeps(module)
    }

    /// Whether the checkpoint lists `module` as left unquantized.
    fn keeps(&self, module: &str) -> bool {
        self.checkpoint
            .as_ref()
            .is_some_and(|c| c.keep.iter().any(|k| module_matches(k, module)))
    }
}

fn parse(q: &Value) -> Result<CheckpointFp8, String> {
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .ok_or("`quantization_config` has no `quant_method`")?
        .to_ascii_lowercase();
    let strings = |key: &str| -> Vec<String> {
        q.get(key)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let unsupported = |scheme: &str| {
        format!(
            "quantization scheme `{scheme}` (quantization_config) is not supported: chimera loads \
             FP8 e4m3 checkpoints (quant_method \"fp8\", FP8 \"compressed-tensors\", \"modelopt\" \
             FP8) and quantizes bf16 checkpoints itself with model.quantization = \"fp8\""
        )
    };
    match method.as_str() {
        "fp8" => {
            let fmt = q.get("fmt").and_then(Value::as_str).unwrap_or("e4m3");
            if fmt != "e4m3" {
                return Err(unsupported(&format!("fp8 ({fmt})")));
            }
            let block = match q.get("weight_block_size") {
                None | Some(Value::Null) => None,
                Some(b) => Some(block_size(b)?),
            };
            Ok(CheckpointFp8 {
                method,
                block,
                keep: strings("modules_to_not_convert"),
            })
        }
        "compressed-tensors" => {
            let groups = q
                .get("config_groups")
                .and_then(Value::as_object)
                .ok_or("compressed-tensors `quantization_config` has no `config_groups`")?;
            let mut block = None;
            for (name, g) in groups {
                let w = g.get("weights").ok_or_else(|| {
                    format!("compressed-tensors group `{name}` has no `weights` scheme")
                })?;
                let bits = w.get("num_bits").and_then(Value::as_u64).unwrap_or(0);
                let ty = w.get("type").and_then(Value::as_str).unwrap_or("?");
                let strategy = w.get("strategy").and_then(Value::as_str).unwrap_or("?");
                if bits != 8 || ty != "float" {
                    return Err(unsupported(&format!(
                        "compressed-tensors {bits}-bit {ty} weights"
                    )));
                }
                match strategy {
                    "tensor" | "channel" => {}
                    "block" => {
                        block = Some(block_size(w.get("block_structure").ok_or(
                            "compressed-tensors block strategy without `block_structure`",
                        )?)?)
                    }
                    s => {
                        return Err(unsupported(&format!(
                            "compressed-tensors FP8 with `{s}` weight scales"
                        )));
                    }
                }
            }
            Ok(CheckpointFp8 {
                method,
                block,
                keep: strings("ignore"),
            })
        }
        "modelopt" => {
            let algo = q
                .get("quant_algo")
                .and_then(Value::as_str)
                .or_else(|| {
                    q.get("quantization")
                        .and_then(|x| x.get("quant_algo"))
                        .and_then(Value::as_str)
                })
                .unwrap_or("?");
            match algo {
                "FP8" | "FP8_PER_CHANNEL_PER_TOKEN" => Ok(CheckpointFp8 {
                    method,
                    block: None,
                    keep: strings("exclude_modules"),
                }),
                other => Err(unsupported(&format!("modelopt {other}"))),
            }
        }
        other => Err(unsupported(other)),
    }
}

fn block_size(v: &Value) -> Result<[usize; 2], String> {
    let sizes: Option<Vec<u64>> = v
        .as_array()
        .and_then(|a| a.iter().map(Value::as_u64).collect());
    match sizes.as_deref() {
        Some(&[r, c]) if r > 0 && c > 0 => Ok([r as usize, c as usize]),
        _ => Err(format!(
            "weight block size {v} is not two positive integers"
        )),
    }
}

/// Whether an entry of a checkpoint's keep-list names `module`: an exact name, a suffix at a
/// `.` boundary (`lm_head`, `mlp.gate`), a name the module lies under, or a `re:` expression
/// (compressed-tensors) matched against the whole name.
pub fn module_matches(pattern: &str, module: &str) -> bool {
    if let Some(re) = pattern.strip_prefix("re:") {
        return regex::Regex::new(&format!("^(?:{re})$")).is_ok_and(|r| r.is_match(module));
    }
    if pattern.contains('*') {
        // modelopt's glob form (`*.mlp.gate`).
        let re = regex::escape(pattern).replace(r"\*", ".*");
        return regex::Regex::new(&format!("^{re}$")).is_ok_and(|r| r.is_match(module));
    }
    module == pattern
        || module.ends_with(&format!(".{pattern}"))
        || module.starts_with(&format!("{pattern}."))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn config(q: &str) -> HfConfig {
        HfConfig::parse(
            &format!("{{\"architectures\": [\"LlamaForCausalLM\"], \"quantization_config\": {q}}}"),
            PathBuf::from("config.json"),
        )
        .unwrap()
    }

    #[test]
    fn the_three_fp8_forms_parse_with_their_keep_lists() {
        let q = Quantization::from_config(
            &config(
                r#"{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128],
                    "modules_to_not_convert": ["lm_head", "model.layers.0.linear_attn.in_proj_ba"]}"#,
            ),
            true,
        )
        .unwrap();
        let c = q.checkpoint.clone().unwrap();
        assert_eq!(c.block, Some([128, 128]));
        assert!(!q.quantize_online("model.layers.0.linear_attn.in_proj_ba"));
        assert!(q.quantize_online("model.layers.1.linear_attn.in_proj_ba"));
        assert!(!q.quantize_online("lm_head"));
        let ct = Quantization::from_config(
            &config(
                r#"{"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {"targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}},
                    "ignore": ["lm_head", "re:.*mlp.gate$"]}"#,
            ),
            false,
        )
        .unwrap();
        assert_eq!(ct.checkpoint.as_ref().unwrap().block, None);
        let keep = &ct.checkpoint.unwrap().keep;
        assert!(module_matches(&keep[1], "model.layers.3.mlp.gate"));
        assert!(!module_matches(&keep[1], "model.layers.3.mlp.gate_proj"));
        let mo = Quantization::from_config(
            &config(r#"{"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["*.mlp.gate"]}"#),
            false,
        )
        .unwrap();
        assert!(module_matches(
            &mo.checkpoint.unwrap().keep[0],
            "model.layers.7.mlp.gate"
        ));
    }

    #[test]
    fn other_schemes_are_refused_by_name() {
        for (q, name) in [
            (r#"{"quant_method": "awq", "bits": 4}"#, "`awq`"),
            (r#"{"quant_method": "gptq", "bits": 4}"#, "`gptq`"),
            (r#"{"quant_method": "bitsandbytes"}"#, "`bitsandbytes`"),
            (r#"{"quant_method": "mxfp4"}"#, "`mxfp4`"),
            (
                r#"{"quant_method": "modelopt", "quant_algo": "NVFP4"}"#,
                "`modelopt NVFP4`",
            ),
            (
                r#"{"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}"#,
                "4-bit int",
            ),
            (r#"{"quant_method": "fp8", "fmt": "e5m2"}"#, "fp8 (e5m2)"),
        ] {
            let e = Quantization::from_config(&config(q), false)
                .unwrap_err()
                .to_string();
            assert!(e.contains(name) && e.contains("not supported"), "{q}: {e}");
        }
    }
}
