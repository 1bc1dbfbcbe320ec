//! Command-line flags shared by the binaries that run engines (`chimera serve`, the Dynamo
//! worker `chimera-dynamo`): the configuration file and the model, engine and cache keys a
//! flag may override.

use std::path::PathBuf;

use crate::config::Overrides;

/// The configuration file and the overrides of the model, engine, cache and speculation keys.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EngineArgs {
    /// A TOML configuration file (default: the built-in configs/default.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Overrides `model.path`: `builtin:tiny-hybrid`, a Hugging Face model folder, a `.gguf`
    /// file, or a hub model id `org/name` (downloaded into the Hugging Face cache;
    /// `org/name:Q4_K_M` picks one file of a repo of GGUF files).
    #[arg(long)]
    pub model: Option<String>,
    /// Overrides `model.revision`: the hub branch, tag or commit of a hub model id.
    #[arg(long)]
    pub revision: Option<String>,
    /// Overrides `server.served_model_name`: the model ids the API accepts (the first is the
    /// one responses carry). Default: the `--model` value, then the model's short name.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Option<Vec<String>>,
    /// Overrides `server.tool_call_parser`: the tool-call format of the model's responses
    /// (`hermes`, `qwen3_coder`, `llama3_json`, `granite`).
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// Overrides `server.reasoning_parser`: the reasoning format (`qwen3`, `deepseek_r1`).
    #[arg(long)]
    pub reasoning_parser: Option<String>,
    /// Overrides `engine.replicas`.
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Overrides `engine.backend`: cpu, cuda or auto.
    #[arg(long)]
    pub backend: Option<String>,
    /// Overrides `engine.devices` (comma-separated CUDA device ordinals).
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
    /// Overrides `model.dtype`: auto, bfloat16 or float32.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Overrides `model.load_format`: auto or dummy (seeded random weights).
    #[arg(long)]
    pub load_format: Option<String>,
    /// Overrides `model.quantization`: none, or fp8 (quantize a bf16 checkpoint's projections
    /// to FP8 e4m3 at load, one scale per output row).
    #[arg(long)]
    pub quantization: Option<String>,
    /// Overrides `model.max_model_len`: the longest context (prompt + output tokens) a
    /// request may have. Default: the model's `max_position_embeddings`.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Overrides `cache.gpu_memory_utilization`: the share of each GPU's memory this process
    /// may hold (weights, cache and activations), in (0, 1]; the cache gets what the weights
    /// leave of it (`cache.memory_budget = "auto"`, the default).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Overrides `cache.kv_dtype`: auto (the dtype the model computes in) or fp8_e4m3 (also
    /// fp8): K and V stored as FP8 with per-layer scales, half a bf16 cache's bytes.
    #[arg(long)]
    pub kv_cache_dtype: Option<String>,
    /// Overrides `speculative.method`: off, ngram (drafts looked up in the context),
    /// draft_model (drafts from `--draft-model`) or mtp (the checkpoint's MTP head).
    #[arg(long)]
    pub speculative_method: Option<String>,
    /// Overrides `speculative.draft_model`: a smaller model with the same tokenizer (a folder,
    /// a .gguf file or a hub id).
    #[arg(long)]
    pub draft_model: Option<String>,
    /// Overrides `speculative.num_tokens`: drafts verified per step.
    #[arg(long)]
    pub num_speculative_tokens: Option<usize>,
}

impl EngineArgs {
    /// The overrides these flags give (the server's own keys left unset).
    pub fn overrides(&self) -> Overrides {
        let a = self.clone();
        Overrides {
            model: a.model,
            revision: a.revision,
            served_model_name: a.served_model_name,
            api_key: None,
            tool_call_parser: a.tool_call_parser,
            reasoning_parser: a.reasoning_parser,
            host: None,
            port: None,
            replicas: a.replicas,
            backend: a.backend,
            devices: a.devices,
            dtype: a.dtype,
            load_format: a.load_format,
            quantization: a.quantization,
            max_model_len: a.max_model_len,
            gpu_memory_utilization: a.gpu_memory_utilization,
            kv_cache_dtype: a.kv_cache_dtype,
            speculative_method: a.speculative_method,
            num_speculative_tokens: a.num_speculative_tokens,
            draft_model: a.draft_model,
        }
    }

    /// The configuration: the file (or the built-in default) with these overrides.
    pub fn config(&self) -> anyhow::Result<crate::config::Config> {
        Ok(
            crate::config::Config::load(self.config.as_deref())?
                .with_overrides(self.overrides())?,
        )
    }
}
