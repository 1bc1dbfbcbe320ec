//! llama.cpp GGUF checkpoints: one file holding the config (as metadata), the tokenizer and
//! the weights, often quantized.
//!
//! [`GgufModel::open`] reads the file; [`GgufModel::load`] turns it into the Hugging Face shape
//! the architecture files already read: a `config.json` made from the `{arch}.*` metadata and
//! the tensors under their transformers names, dequantized to f32 on the host (the backend
//! then keeps its own dtype). Two things differ from a transformers checkpoint and are undone
//! here: llama.cpp's converter permutes the rows of `attn_q` / `attn_k` so that RoPE pairs
//! are adjacent (GPT-J style) where transformers rotates halves, and a tied LM head is simply
//! absent. [`vocab`] rebuilds the tokenizer and chat template from `tokenizer.ggml.*`.
//!
//! Architectures: `llama` (Llama, Mistral, SmolLM and other Llama-shaped models) and the
//! Mamba2 family in [`mamba`] (`mamba2`, and the hybrids `nemotron_h`, `nemotron_h_moe` and
//! `granitehybrid`) and Qwen3.5 in [`qwen35`], whose converter changes some tensors' layout.

pub mod file;
pub mod mamba;
pub mod quant;
pub mod qwen35;
pub mod vocab;

use std::collections::HashMap;
use std::path::Path;

use rayon::prelude::*;
use serde_json::{Value as Json, json};

pub use file::{GgufFile, Value};
pub use quant::GgmlType;

use super::config::HfConfig;
use super::weights::WeightStore;
use super::{Model, ModelError, arch};
use crate::backend::LayerOps;

/// A host tensor: f32 values and a row-major shape.
pub type HostF32 = (Vec<f32>, Vec<usize>);

/// GGUF architectures this loader maps, with the transformers class each becomes.
pub const SUPPORTED: &[(&str, &str)] = &[
    ("llama", "LlamaForCausalLM"),
    ("mamba2", "Mamba2ForCausalLM"),
    ("nemotron_h", "NemotronHForCausalLM"),
    ("nemotron_h_moe", "NemotronHForCausalLM"),
    ("granitehybrid", "GraniteMoeHybridForCausalLM"),
    ("qwen35", "Qwen3_5ForCausalLM"),
];

/// Tensors that are configuration, read by [`GgufModel::hf_config`], not weights.
const CONFIG_TENSORS: &[&str] = &["rope_freqs.weight"];

/// An open GGUF file with the facts the loader reads.
pub struct GgufModel {
    pub file: GgufFile,
    /// `general.architecture`.
    pub arch: String,
}

impl GgufModel {
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = GgufFile::open(path)?;
        let arch = file
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::Config {
                path: path.to_path_buf(),
                message: "GGUF metadata lacks `general.architecture`".into(),
            })?
            .to_string();
        if !SUPPORTED.iter().any(|(a, _)| *a == arch) {
            return Err(ModelError::Unsupported(format!(
                "{}: GGUF architecture `{arch}` (supported: {})",
                path.display(),
                SUPPORTED
                    .iter()
                    .map(|(a, _)| *a)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok(Self { file, arch })
    }

    fn err(&self, message: String) -> ModelError {
        ModelError::Config {
            path: self.file.path.clone(),
            message,
        }
    }

    fn meta(&self, key: &str) -> Option<&Value> {
        self.file.get(&format!("{}.{key}", self.arch))
    }

    fn meta_u64(&self, key: &str) -> Result<u64, ModelError> {
        self.meta(key).and_then(Value::as_u64).ok_or_else(|| {
            self.err(format!(
                "GGUF metadata lacks `{}.{key}` (or it is not an integer)",
                self.arch
            ))
        })
    }

    /// The `config.json` transformers would build from this file's metadata.
    pub fn hf_config(&self) -> Result<HfConfig, ModelError> {
        let mut c = match self.arch.as_str() {
            "mamba2" => mamba::mamba2_config(self)?,
            "nemotron_h" | "nemotron_h_moe" => mamba::nemotron_h_config(self)?,
            "granitehybrid" => mamba::granite_config(self)?,
            "qwen35" => qwen35::config(self)?,
            _ => self.llama_config()?,
        };
        for (key, name) in [("bos_token_id", "bos"), ("eos_token_id", "eos")] {
            if let Some(id) = self
                .file
                .get(&format!("tokenizer.ggml.{name}_token_id"))
                .and_then(Value::as_u64)
            {
                c[key] = json!(id);
            }
        }
        HfConfig::parse(
            &c.to_string(),
            self.file.path.join("<config from GGUF metadata>"),
        )
    }

    /// The vocabulary size: stated, else the token list's length, else the embedding's rows.
    fn vocab_size(&self) -> Result<u64, ModelError> {
        if let Some(v) = self.meta("vocab_size").and_then(Value::as_u64) {
            return Ok(v);
        }
        if let Some(tokens) = self
            .file
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
        {
            return Ok(tokens.len() as u64);
        }
        self.file
            .tensor("token_embd.weight")
            .map(|t| t.dims.last().copied().unwrap_or(0))
            .ok_or_else(|| self.err("no vocabulary size in the file".into()))
    }

    /// `llama`: the Llama config.
    fn llama_config(&self) -> Result<Json, ModelError> {
        let hidden = self.meta_u64("embedding_length")?;
        let heads = self.meta_u64("attention.head_count")?;
        let kv_heads = match self.meta("attention.head_count_kv") {
            Some(v) => v.as_u64().ok_or_else(|| {
                self.err(
                    "`attention.head_count_kv` must be one integer (per-layer lists do not load)"
                        .into(),
                )
            })?,
            None => heads,
        };
        let head_dim = match self.meta("attention.key_length") {
            Some(v) => v
                .as_u64()
                .ok_or_else(|| self.err("`attention.key_length` must be an integer".into()))?,
            None => hidden / heads.max(1),
        };
        let vocab = self.vocab_size()?;
        let rope = self.rope_parameters()?;
        let mut c = json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": hidden,
            "intermediate_size": self.meta_u64("feed_forward_length")?,
            "num_hidden_layers": self.meta_u64("block_count")?,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "vocab_size": vocab,
            "max_position_embeddings": self.meta_u64("context_length").unwrap_or(4096),
            "rms_norm_eps": self
                .meta("attention.layer_norm_rms_epsilon")
                .and_then(Value::as_f64)
                .unwrap_or(1e-5),
            "rope_theta": self.meta("rope.freq_base").and_then(Value::as_f64).unwrap_or(10000.0),
            "rope_parameters": rope,
            "tie_word_embeddings": self.file.tensor("output.weight").is_none(),
            "hidden_act": "silu",
        });
        if let Some(dims) = self.meta("rope.dimension_count").and_then(Value::as_u64)
            && dims != head_dim
        {
            c["partial_rotary_factor"] = json!(dims as f64 / head_dim as f64);
        }
        Ok(c)
    }

    /// `rope_parameters` from `{arch}.rope.scaling.*` and the `rope_freqs` tensor. llama.cpp
    /// stores Llama 3.1 scaling as that tensor: one divisor per rotary frequency, which is
    /// what the `llama3` rule computes from its four parameters, so it is applied as given.
    fn rope_parameters(&self) -> Result<Json, ModelError> {
        let theta = self
            .meta("rope.freq_base")
            .and_then(Value::as_f64)
            .unwrap_or(10000.0);
        let mut rope = json!({ "rope_type": "default", "rope_theta": theta });
        match self.meta("rope.scaling.type").and_then(Value::as_str) {
            None | Some("none") => {}
            Some("linear") => {
                let factor = self
                    .meta("rope.scaling.factor")
                    .and_then(Value::as_f64)
                    .ok_or_else(|| {
                        self.err(format!(
                            "linear RoPE scaling without `{}.rope.scaling.factor`",
                            self.arch
                        ))
                    })?;
                rope["rope_type"] = json!("linear");
                rope["factor"] = json!(factor);
            }
            Some(kind) => {
                return Err(ModelError::Unsupported(format!(
                    "{}: GGUF RoPE scaling `{kind}` (supported: none, linear, and Llama 3.1 \
                     frequency factors)",
                    self.file.path.display()
                )));
            }
        }
        if let Some(t) = self.file.tensor("rope_freqs.weight") {
            let factors =
                quant::dequantize(t.ty, self.file.data(t)).map_err(|m| ModelError::Weights {
                    path: self.file.path.clone(),
                    message: format!("tensor `rope_freqs.weight`: {m}"),
                })?;
            if factors.iter().any(|f| !f.is_finite() || *f <= 0.0) {
                return Err(self.err(
                    "`rope_freqs.weight` holds a divisor that is not a positive number".into(),
                ));
            }
            rope["freq_factors"] = json!(factors);
        }
        Ok(rope)
    }

    /// Every tensor dequantized to f32 under its transformers name, q/k rows un-permuted.
    pub fn tensors(&self, config: &HfConfig) -> Result<HashMap<String, HostF32>, ModelError> {
        let heads = self.rope_heads(config)?;
        let mut tensors: HashMap<String, HostF32> = self
            .file
            .tensors
            .par_iter()
            .filter(|t| !CONFIG_TENSORS.contains(&t.name.as_str()))
            .map(|t| self.dequantize(t, heads))
            .collect::<Result<_, _>>()?;
        if self.arch == "granitehybrid" {
            mamba::fuse_gate_up(&mut tensors).map_err(|m| self.err(m))?;
        }
        Ok(tensors)
    }

    /// One tensor by its transformers name, as [`GgufModel::tensors`] gives it.
    pub fn hf_tensor(&self, config: &HfConfig, name: &str) -> Result<HostF32, ModelError> {
        let heads = self.rope_heads(config)?;
        let t = self
            .file
            .tensors
            .iter()
            .find(|t| self.hf_name(&t.name).as_deref() == Some(name))
            .ok_or_else(|| ModelError::MissingTensor {
                tensor: name.into(),
                files: self.file.path.display().to_string(),
            })?;
        Ok(self.dequantize(t, heads)?.1)
    }

    /// Query and key heads, for undoing the q/k row permutation (llama.cpp's converter
    /// permutes Llama's, and NemotronH's and Granite's through the same code path; not
    /// Mamba2's, which has no attention, nor Qwen's, which rotates halves as llama.cpp does).
    fn rope_heads(&self, config: &HfConfig) -> Result<Option<(usize, usize)>, ModelError> {
        if matches!(self.arch.as_str(), "mamba2" | "qwen35") {
            return Ok(None);
        }
        Ok(Some((
            config.usize("num_attention_heads")?,
            config.usize("num_key_value_heads")?,
        )))
    }

    /// The transformers name of one of this file's tensors.
    pub fn hf_name(&self, gguf: &str) -> Option<String> {
        match self.arch.as_str() {
            "mamba2" | "nemotron_h" | "nemotron_h_moe" | "granitehybrid" => {
                mamba::hf_name(&self.arch, gguf)
            }
            "qwen35" => qwen35::hf_name(gguf),
            _ => hf_name(gguf),
        }
    }

    fn dequantize(
        &self,
        t: &file::TensorInfo,
        heads: Option<(usize, usize)>,
    ) -> Result<(String, HostF32), ModelError> {
        let name = self.hf_name(&t.name).ok_or_else(|| {
            self.err(format!(
                "tensor `{}` has no transformers counterpart",
                t.name
            ))
        })?;
        let shape = t.shape();
        let mut values =
            quant::dequantize(t.ty, self.file.data(t)).map_err(|m| ModelError::Weights {
                path: self.file.path.clone(),
                message: format!("tensor `{}`: {m}", t.name),
            })?;
        let mut shape = shape;
        if let Some((heads, kv_heads)) = heads {
            if t.name.ends_with("attn_q.weight") || t.name.ends_with("attn_q.bias") {
                values = unpermute_rows(&values, &shape, heads).map_err(|m| self.err(m))?;
            } else if t.name.ends_with("attn_k.weight") || t.name.ends_with("attn_k.bias") {
                values = unpermute_rows(&values, &shape, kv_heads).map_err(|m| self.err(m))?;
            }
        }
        let restored = match self.arch.as_str() {
            "llama" => Ok(shape),
            "qwen35" => qwen35::restore(&t.name, &mut values, shape, qwen35::Heads::of(self)?),
            _ => mamba::restore(&t.name, &mut values, shape),
        };
        shape = restored.map_err(|m| self.err(format!("tensor `{}`: {m}", t.name)))?;
        Ok((name, (values, shape)))
    }

    /// Builds the model on `backend`.
    pub fn load<B: LayerOps>(&self, backend: &B) -> Result<Model<B>, ModelError> {
        self.load_with(backend, super::LoadOptions::default())
    }

    /// [`GgufModel::load`] with options (online FP8 quantization of the dequantized weights).
    pub fn load_with<B: LayerOps>(
        &self,
        backend: &B,
        options: super::LoadOptions,
    ) -> Result<Model<B>, ModelError> {
        let config = self.hf_config()?;
        let tensors = self.tensors(&config)?;
        let f32_bytes: usize = tensors.values().map(|(v, _)| v.len() * 4).sum();
        // Each host tensor is freed as the backend takes it: the host and backend copies of the
        // model never coexist.
        let mut store = WeightStore::from_memory_once(tensors);
        store.set_quantization(super::quant::Quantization::from_config(
            &config,
            options.fp8,
        )?);
        let model = arch::build(&config, &store, backend, options)?;
        drop(store);
        super::weights::release_free_memory();
        let rss = super::weights::process_memory().map(|(rss, _)| rss);
        tracing::info!(
            file = %self.file.path.display(),
            file_mib = self.file.data_bytes() as f64 / (1 << 20) as f64,
            dequantized_f32_mib = f32_bytes as f64 / (1 << 20) as f64,
            process_rss_mib = rss.map(|r| r as f64 / (1 << 20) as f64),
            "GGUF weights loaded (dequantized to f32 on the host, then handed to the backend)"
        );
        Ok(model)
    }
}

/// Loads the GGUF file at `path` onto `backend`.
pub fn load<B: LayerOps>(path: &Path, backend: &B) -> Result<Model<B>, ModelError> {
    GgufModel::open(path)?.load(backend)
}

/// [`load`] with options.
pub fn load_with<B: LayerOps>(
    path: &Path,
    backend: &B,
    options: super::LoadOptions,
) -> Result<Model<B>, ModelError> {
    GgufModel::open(path)?.load_with(backend, options)
}

/// The transformers name of a llama.cpp tensor name.
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
    let (part, kind) = tail.rsplit_once('.')?;
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// Undoes llama.cpp's q/k permutation. Within each head of `head_dim` rows, the converter
/// put transformers' row `i·(head_dim/2) + j` (half `i`, pair `j`) at row `2j + i`.
/// Works on a weight `[heads·head_dim, in]` and on a bias `[heads·head_dim]` alike.
pub fn unpermute_rows(values: &[f32], shape: &[usize], heads: usize) -> Result<Vec<f32>, String> {
    let rows = shape.first().copied().unwrap_or(0);
    let cols: usize = shape.iter().skip(1).product();
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(format!(
            "a q/k tensor of {rows} rows does not split into {heads} heads of even size"
        ));
    }
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..half {
                let dst = h * head_dim + i * half + j;
                let src = h * head_dim + 2 * j + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&values[src * cols..(src + 1) * cols]);
            }
        }
    }
    Ok(out)
}

/// The inverse of [`unpermute_rows`], as llama.cpp's converter applies it (for writing test
/// files from transformers checkpoints).
pub fn permute_rows(values: &[f32], shape: &[usize], heads: usize) -> Vec<f32> {
    let rows = shape.first().copied().unwrap_or(0);
    let cols: usize = shape.iter().skip(1).product();
    let head_dim = rows / heads.max(1);
    let half = head_dim / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..half {
                let src = h * head_dim + i * half + j;
                let dst = h * head_dim + 2 * j + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&values[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// JSON of a metadata value (for `tokenizer_config.json`-style reading in tests and tools).
pub fn to_json(v: &Value) -> Json {
    match v {
        Value::Str(s) => json!(s),
        Value::Bool(b) => json!(b),
        Value::Array(a) => Json::Array(a.iter().map(to_json).collect()),
        Value::F32(_) | Value::F64(_) => json!(v.as_f64()),
        _ => v.as_i64().map_or(Json::Null, |i| json!(i)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_transformers() {
        assert_eq!(
            hf_name("blk.12.attn_q.weight").unwrap(),
            "model.layers.12.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.ffn_down.weight").unwrap(),
            "model.layers.0.mlp.down_proj.weight"
        );
        assert_eq!(hf_name("output.weight").unwrap(), "lm_head.weight");
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(hf_name("blk.1.ssm_conv1d.weight"), None);
    }

    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        // 2 heads of head_dim 4, 3 columns: row r holds r*10 + column.
        let shape = [8, 3];
        let hf: Vec<f32> = (0..8)
            .flat_map(|r| (0..3).map(move |c| (r * 10 + c) as f32))
            .collect();
        let gguf = permute_rows(&hf, &shape, 2);
        // Head 0: transformers rows [0,1 | 2,3] (halves) become [0,2,1,3] (pairs adjacent).
        let first_col: Vec<f32> = gguf.chunks(3).map(|r| r[0]).collect();
        assert_eq!(first_col, [0.0, 20.0, 10.0, 30.0, 40.0, 60.0, 50.0, 70.0]);
        assert_eq!(unpermute_rows(&gguf, &shape, 2).unwrap(), hf);
        assert!(unpermute_rows(&gguf, &shape, 3).is_err());
    }
}
