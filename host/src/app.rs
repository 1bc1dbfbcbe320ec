//! Assembling a serving process from a [`Config`]: load the model and tokenizer, compile the
//! policy plugins, start one engine thread per replica, and hand everything to the HTTP server.
//!
//! This is the binary's edge: it reports errors with `anyhow` context. It owns no serving
//! logic of its own.

use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::backend::{DType, LayerOps, StepBackend};
use crate::config::Config;
use crate::engine::{Engine, EngineSetup, ModelRunner, Policies, spawn_engine};
use crate::model::{self, Model, builtin, hub};
use crate::plugins::{PluginError, PluginKind, PluginMetrics, PolicyPlugins, Vocabulary};
use crate::policy::native::DefaultSampler;
use crate::server::metrics::MetricsSource;
use crate::server::router::Replica;
use crate::server::{AdminHooks, AppParts, AppState, ModelInfo, ReloadError, TextCodec};

/// The tokenizer and a loader for the configured model (called once per replica).
pub struct LoadedModel {
    pub name: String,
    pub codec: TextCodec,
    pub source: ModelSource,
}

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// The embedded tiny hybrid model.
    Builtin,
    /// A Hugging Face model folder (local, or a hub snapshot).
    Folder(std::path::PathBuf),
    /// A llama.cpp GGUF file.
    Gguf(std::path::PathBuf),
}

impl LoadedModel {
    /// Opens what `model.path` names: `builtin:tiny-hybrid`, a local model folder, a `.gguf`
    /// file, or a hub model id `org/name` at `revision` (downloaded into the Hugging Face
    /// cache when missing; `org/name:Q4_K_M` picks one GGUF file of a GGUF repo). A local path
    /// that exists wins over a hub id of the same spelling.
    pub fn open(path: &str, revision: &str) -> anyhow::Result<Self> {
        if path == builtin::NAME {
            let codec = TextCodec::embedded()?;
            return Ok(Self {
                name: "tiny-hybrid".into(),
                codec,
                source: ModelSource::Builtin,
            });
        }
        let dir = std::path::PathBuf::from(path);
        if dir
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            if !dir.is_file() {
                anyhow::bail!("model.path = {path:?}: the GGUF file does not exist");
            }
            return Self::from_gguf(dir);
        }
        let hub_name = if dir.exists() {
            None
        } else if hub::is_repo_id(path) {
            Some((path, None))
        } else {
            hub::split_quant_tag(path).map(|(repo, tag)| (repo, Some(tag)))
        };
        if let Some((repo, quant)) = hub_name {
            let settings = hub::HubSettings::from_env();
            tracing::info!(
                model = repo,
                gguf = quant,
                revision,
                cache = %settings.cache_dir.display(),
                offline = settings.offline,
                "resolving a Hugging Face hub model"
            );
            let resolved = hub::resolve_file(repo, revision, quant, &settings)
                .with_context(|| format!("model.path = {path:?} (a Hugging Face hub id)"))?;
            if resolved
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
            {
                return Self::from_gguf(resolved);
            }
            let name = repo.rsplit('/').next().unwrap_or(repo).to_string();
            return Self::from_folder(resolved, name);
        }
        if !dir.is_dir() {
            let what = if dir.exists() {
                "is not a folder"
            } else {
                "does not exist"
            };
            anyhow::bail!(
                "model.path = {path:?}: the folder {what} (give a Hugging Face model folder \
                 with config.json, tokenizer.json and *.safetensors, a hub model id \
                 `org/name`, or `{}`)",
                builtin::NAME
            );
        }
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.to_string());
        Self::from_folder(dir, name)
    }

    fn from_folder(dir: std::path::PathBuf, name: String) -> anyhow::Result<Self> {
        let codec = TextCodec::from_dir(&dir)
            .with_context(|| format!("loading the tokenizer in {}", dir.display()))?;
        Ok(Self {
            name,
            codec,
            source: ModelSource::Folder(dir),
        })
    }

    fn from_gguf(file: std::path::PathBuf) -> anyhow::Result<Self> {
        let gguf = model::gguf::GgufFile::open(&file)?;
        let (tokenizer, config) = model::gguf::vocab::tokenizer_files(&gguf)?;
        let codec = TextCodec::from_parts(&tokenizer, Some(&config), None)
            .with_context(|| format!("building the tokenizer of {}", file.display()))?;
        let name = file
            .file_stem()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Self {
            name,
            codec,
            source: ModelSource::Gguf(file),
        })
    }

    /// Loads the weights onto `backend` (replicas on one device share this copy); with
    /// `dummy`, seeded random weights of the configured shapes instead of the checkpoint.
    /// A Hugging Face-style folder describing this model to other programs (a cluster
    /// frontend that tokenizes and applies the chat template itself): a model folder is its
    /// own; the embedded model's `config.json` and tokenizer files are written under `scratch`.
    /// A GGUF file has no such folder (its tokenizer lives inside the file).
    pub fn card_folder(&self, scratch: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
        match &self.source {
            ModelSource::Folder(dir) => Ok(dir.clone()),
            ModelSource::Builtin => {
                let dir = scratch.join(&self.name);
                std::fs::create_dir_all(&dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                let eos = self.codec.eos_token_ids().first().copied().unwrap_or(0);
                let config = builtin::config_json(self.codec.vocab_size() as usize, eos, 1);
                for (file, bytes) in [
                    ("config.json", config.as_bytes()),
                    ("tokenizer.json", crate::tokenizer::EMBEDDED_TOKENIZER),
                    (
                        "tokenizer_config.json",
                        crate::tokenizer::EMBEDDED_TOKENIZER_CONFIG,
                    ),
                ] {
                    std::fs::write(dir.join(file), bytes)
                        .with_context(|| format!("writing {}", dir.join(file).display()))?;
                }
                Ok(dir)
            }
            ModelSource::Gguf(path) => anyhow::bail!(
                "{}: a GGUF file carries its tokenizer inside; serve the model's Hugging Face \
                 folder (config.json, tokenizer.json) so that the frontend can tokenize",
                path.display()
            ),
        }
    }

    pub fn model<B: LayerOps>(&self, backend: &B, dummy: bool) -> anyhow::Result<Model<B>> {
        self.model_with(backend, dummy, model::LoadOptions::default())
    }

    /// [`LoadedModel::model`] with load options (online FP8 quantization).
    pub fn model_with<B: LayerOps>(
        &self,
        backend: &B,
        dummy: bool,
        options: model::LoadOptions,
    ) -> anyhow::Result<Model<B>> {
        match &self.source {
            ModelSource::Folder(dir) if dummy => model::load_dummy_with(dir, backend, 0, options)
                .with_context(|| format!("building dummy weights for {}", dir.display())),
            ModelSource::Builtin => {
                let eos = self.codec.eos_token_ids().first().copied().unwrap_or(0);
                Ok(builtin::load_with(
                    backend,
                    self.codec.vocab_size() as usize,
                    eos,
                    1,
                    options,
                )?)
            }
            ModelSource::Folder(dir) => model::load_with(dir, backend, options)
                .with_context(|| format!("loading the model in {}", dir.display())),
            ModelSource::Gguf(_) if dummy => {
                anyhow::bail!(
                    "model.load_format = \"dummy\" needs a config.json folder, not a GGUF file"
                )
            }
            ModelSource::Gguf(file) => model::gguf::load_with(file, backend, options)
                .with_context(|| format!("loading the GGUF file {}", file.display())),
        }
    }
}

struct PluginMetricsSource(Arc<PluginMetrics>);

impl MetricsSource for PluginMetricsSource {
    fn render(&self, out: &mut String) {
        self.0.render_prometheus(out);
    }
}

/// `/admin/reload_plugins`: recompiles the configured `.wasm` files and swaps them in.
struct ReloadHook {
    plugins: Arc<PolicyPlugins>,
    config: Config,
}

/// Whether a failed reload is the request's (the plugin file, its config) or the server's.
fn reload_error(e: PluginError) -> ReloadError {
    match e {
        PluginError::Engine(_) => ReloadError::Internal(e.to_string()),
        _ => ReloadError::BadRequest(e.to_string()),
    }
}

impl ReloadHook {
    /// Reloads the plugin of `kind` when it is a `.wasm` file; `None` for a built-in or native
    /// policy.
    fn reload_kind(&self, kind: PluginKind) -> Result<Option<String>, ReloadError> {
        let spec = self.config.policy.spec(kind);
        let path = format!("policy.{}", kind.section());
        let bad = |e: &dyn std::fmt::Display| ReloadError::BadRequest(e.to_string());
        let source = spec.source(kind, &path).map_err(|e| bad(&e))?;
        let crate::plugins::PluginSource::File(file) = &source else {
            return Ok(None);
        };
        let wasm = std::fs::read(file)
            .map_err(|e| bad(&format_args!("{path}.plugin: {}: {e}", file.display())))?;
        let config = spec.flat_config(&path).map_err(|e| bad(&e))?;
        let grants = spec.grants(&path).map_err(|e| bad(&e))?;
        let plugin = self
            .plugins
            .reload(kind, &source.to_string(), &wasm, &config, grants)
            .map_err(reload_error)?;
        Ok(Some(format!(
            "{kind}: {} (ABI {})",
            plugin.name, plugin.abi
        )))
    }
}

impl AdminHooks for ReloadHook {
    fn reload_plugins(&self, only: Option<&str>) -> Result<String, ReloadError> {
        let kinds: Vec<PluginKind> = match only {
            None => PluginKind::ALL.to_vec(),
            Some(name) => {
                let Some(kind) = PluginKind::ALL.into_iter().find(|k| k.section() == name) else {
                    return Err(ReloadError::BadRequest(format!(
                        "unknown plugin kind `{name}` (router, evictor or sampler)"
                    )));
                };
                vec![kind]
            }
        };
        let mut done = Vec::new();
        for kind in kinds {
            match self.reload_kind(kind)? {
                Some(line) => done.push(line),
                None if only.is_some() => {
                    return Err(ReloadError::BadRequest(format!(
                        "policy.{}.plugin is `{}`: only plugins loaded from .wasm files can be reloaded",
                        kind.section(),
                        self.config.policy.spec(kind).plugin
                    )));
                }
                None => {}
            }
        }
        if done.is_empty() {
            Ok("no file-based plugin is configured; built-in plugins need no reload".into())
        } else {
            Ok(format!("reloaded {}", done.join(", ")))
        }
    }
}

/// The serving stack, engine threads started, ready for [`AppState::new`].
pub struct Stack {
    pub parts: AppParts,
    /// Plugin call and fallback counters, to be exported on `/metrics`.
    pub plugin_metrics: Arc<PluginMetrics>,
}

impl Stack {
    /// Starts the router actor and registers the plugin counters with the server metrics.
    pub fn into_state(self) -> anyhow::Result<AppState> {
        let state = AppState::new(self.parts)?;
        state
            .metrics()
            .add_source(Arc::new(PluginMetricsSource(self.plugin_metrics)));
        Ok(state)
    }
}

/// Where the replicas run, resolved from `engine.backend` and `model.dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    Cpu,
    Cuda(DType),
}

impl LoadedModel {
    /// The layers of this model the CUDA backend cannot run, in a phrase (`None`: it runs all
    /// of them), read from its config before any weight is loaded: every architecture runs on
    /// CUDA; what its kernels bound is a Gated DeltaNet key head dim (at most
    /// [`chimera_kernels::ssm::MAX_GDN_KEY_DIM`]) and a recurrent layer's conv width (at most
    /// [`chimera_kernels::ssm::MAX_CONV_KERNEL`]).
    pub fn cuda_gap(&self) -> Option<String> {
        let ModelSource::Folder(dir) = &self.source else {
            // The built-in model and GGUF files: their shapes are within every bound.
            return None;
        };
        let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
        let c: serde_json::Value = serde_json::from_str(&text).ok()?;
        let arch = c["architectures"][0]
            .as_str()
            .unwrap_or("this model")
            .to_string();
        cuda_gap_of(&arch, c.get("text_config").unwrap_or(&c))
    }
}

/// [`LoadedModel::cuda_gap`] of one config (its text part).
fn cuda_gap_of(arch: &str, c: &serde_json::Value) -> Option<String> {
    let n = |k: &str| c[k].as_u64();
    let key_dim = n("linear_key_head_dim").unwrap_or(0);
    if key_dim > u64::from(chimera_kernels::ssm::MAX_GDN_KEY_DIM) {
        return Some(format!(
            "Gated DeltaNet layers with key head dim {key_dim} ({arch}; the CUDA kernels take \
             at most {})",
            chimera_kernels::ssm::MAX_GDN_KEY_DIM
        ));
    }
    let conv = ["linear_conv_kernel_dim", "conv_kernel", "mamba_d_conv"]
        .iter()
        .find_map(|k| n(k))
        .unwrap_or(0);
    if conv > u64::from(chimera_kernels::ssm::MAX_CONV_KERNEL) {
        return Some(format!(
            "recurrent layers with a conv of width {conv} ({arch}; the CUDA kernels take at \
             most {})",
            chimera_kernels::ssm::MAX_CONV_KERNEL
        ));
    }
    None
}

/// Resolves `engine.backend = "auto"` (CUDA when a usable GPU is present and runs every layer
/// of the model, `cuda_gap` being what it cannot run) and the dtype.
pub fn choose_backend(config: &Config, cuda_gap: Option<&str>) -> anyhow::Result<BackendChoice> {
    let first = config.engine.devices.first().copied().unwrap_or(0);
    let model = &config.model.path;
    let cuda = match config.engine.backend.as_str() {
        "cpu" => false,
        "cuda" => {
            if let Some(why) = crate::backend::cuda::device::probe_error(first) {
                anyhow::bail!("engine.backend = \"cuda\": {why}");
            }
            if let Some(gap) = cuda_gap {
                anyhow::bail!(
                    "engine.backend = \"cuda\": the model {model} has {gap}, which the CUDA \
                     backend does not run yet; serve it with engine.backend = \"cpu\" (--backend cpu)"
                );
            }
            true
        }
        _ => match crate::backend::cuda::device::probe_error(first) {
            Some(why) => {
                tracing::info!("engine.backend = \"auto\": serving on the CPU ({why})");
                false
            }
            None => match cuda_gap {
                Some(gap) => {
                    tracing::warn!(
                        "engine.backend = \"auto\": the model {model} has {gap}, which the CUDA \
                         backend does not run yet: serving on the CPU"
                    );
                    false
                }
                None => true,
            },
        },
    };
    Ok(match (cuda, config.model.dtype.as_str()) {
        (false, "bfloat16") => anyhow::bail!(
            "model.dtype = \"bfloat16\" needs a GPU; the CPU backend computes in float32"
        ),
        (false, _) => BackendChoice::Cpu,
        (true, "float32") => BackendChoice::Cuda(DType::F32),
        (true, _) => BackendChoice::Cuda(DType::BF16),
    })
}

/// What the config asks of the model loader beyond the files.
pub fn load_options(config: &Config) -> model::LoadOptions {
    model::LoadOptions {
        fp8: config.model.quantization == "fp8",
        mtp: config.speculative.method == "mtp",
    }
}

/// Builds the whole serving stack (engine threads started) from a validated config.
pub fn build(config: &Config) -> anyhow::Result<Stack> {
    let loaded = LoadedModel::open(&config.model.path, &config.model.revision)?;
    let dummy = config.model.load_format == "dummy";
    match choose_backend(config, loaded.cuda_gap().as_deref())? {
        BackendChoice::Cpu => build_cpu(config, loaded),
        BackendChoice::Cuda(dtype) => {
            let devices = &config.engine.devices;
            let count = config.engine.replicas.max(devices.len());
            let mut replicas = Vec::with_capacity(count);
            let mut max_model_len = usize::MAX;
            for (i, &device) in devices.iter().enumerate() {
                let started = std::time::Instant::now();
                let backend = CudaBackend::new(CudaOptions { device, dtype })
                    .with_context(|| format!("opening CUDA device {device}"))?;
                let model = Arc::new(loaded.model_with(&backend, dummy, load_options(config))?);
                backend.synchronize()?;
                let (free, total) = backend.mem_info()?;
                let on_device = (i..count).step_by(devices.len()).count();
                let gpu = GpuMemory {
                    device,
                    free,
                    total,
                    replicas: on_device,
                };
                let spec = model.cache_spec_on(&backend);
                let (cache, max_len) = size_cache(config, &model.info, &spec, Some(gpu))?;
                tracing::info!(
                    device,
                    gpu = %backend.device().name,
                    arch = %backend.device().arch,
                    dtype = ?dtype,
                    seconds = started.elapsed().as_secs_f64(),
                    "model loaded on the GPU"
                );
                // Replicas r ≡ i (mod devices) run here, each on its own stream.
                for _ in (i..count).step_by(devices.len()) {
                    replicas.push((backend.replica()?, model.clone(), cache.clone()));
                }
                max_model_len = max_model_len.min(max_len);
            }
            start(config, loaded, replicas, max_model_len)
        }
    }
}

fn build_cpu(config: &Config, loaded: LoadedModel) -> anyhow::Result<Stack> {
    // One copy of the weights, read by every replica (each has its own backend handle: its
    // step arena).
    let backend = CpuBackend::default();
    let model = Arc::new(loaded.model_with(
        &backend,
        config.model.load_format == "dummy",
        load_options(config),
    )?);
    let spec = model.cache_spec_on(&backend);
    let (cache, max_model_len) = size_cache(config, &model.info, &spec, None)?;
    let replicas = (0..config.engine.replicas)
        .map(|_| (CpuBackend::default(), model.clone(), cache.clone()))
        .collect();
    start(config, loaded, replicas, max_model_len)
}

/// What the driver said of one device's memory once the weights were loaded.
#[derive(Debug, Clone, Copy)]
pub struct GpuMemory {
    pub device: usize,
    pub free: usize,
    pub total: usize,
    /// Replicas that will share the device (each gets its own cache).
    pub replicas: usize,
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

/// Resolves one replica's cache budget (`cache.memory_budget`, "auto" included) and the
/// longest context a request may have, and refuses what cannot work: a context longer than
/// the model's, or a cache that cannot hold one sequence of that context. `spec` is the
/// model's cache layout on its backend ([`Model::cache_spec_on`]); `gpu` is `None` on the CPU.
pub fn size_cache(
    config: &Config,
    info: &model::ModelInfo,
    spec: &crate::cache::CacheSpec,
    gpu: Option<GpuMemory>,
) -> anyhow::Result<(crate::cache::CacheConfig, usize)> {
    use crate::cache::{ByteSize, CacheLayout, config::CPU_MIN_AUTO_BUDGET};
    let model_len = info.max_position_embeddings.max(1);
    let max_len = match config.model.max_model_len {
        Some(n) if n > model_len => anyhow::bail!(
            "model.max_model_len = {n} is more than the model's max_position_embeddings ({model_len}); \
             leave it unset or lower it"
        ),
        Some(n) => n,
        None => model_len,
    };
    let max_running = config.engine.max_running;
    let mut cache = config.cache.clone();
    let source = match (gpu, cache.memory_fraction, cache.memory_budget) {
        (Some(g), Some(f), _) => {
            let budget = (g.free as f64 * f) as u64 / g.replicas.max(1) as u64;
            cache.memory_budget = Some(ByteSize(budget));
            format!(
                "cache.memory_fraction = {f} of the {:.2} GiB free on device {} after the weights loaded, over {} replica(s)",
                gib(g.free as u64),
                g.device,
                g.replicas
            )
        }
        (_, _, Some(b)) => format!("cache.memory_budget = {b}"),
        (Some(g), None, None) => {
            let u = cache.gpu_memory_utilization;
            let allowed = (g.total as f64 * u) as u64;
            let held = (g.total - g.free.min(g.total)) as u64;
            if allowed <= held {
                anyhow::bail!(
                    "cache.gpu_memory_utilization = {u} allows {:.2} GiB of device {}'s {:.2} GiB, \
                     but {:.2} GiB are already held (the weights, and any other process on the GPU): \
                     raise gpu_memory_utilization (--gpu-memory-utilization) or set cache.memory_budget",
                    gib(allowed),
                    g.device,
                    gib(g.total as u64),
                    gib(held)
                );
            }
            let budget = (allowed - held) / g.replicas.max(1) as u64;
            cache.memory_budget = Some(ByteSize(budget));
            format!(
                "cache.gpu_memory_utilization = {u}: {:.2} GiB of device {}'s {:.2} GiB, less {:.2} GiB held after the weights loaded, over {} replica(s)",
                gib(allowed),
                g.device,
                gib(g.total as u64),
                gib(held),
                g.replicas
            )
        }
        (None, _, None) => {
            let need = CacheLayout::budget_for_tokens(&cache, spec, max_running, max_len)
                .with_context(|| format!("no cache budget holds a sequence of {max_len} tokens"))?;
            let budget = need.0.max(CPU_MIN_AUTO_BUDGET.0);
            if let Some(avail) = available_memory()
                && budget > avail / 2
            {
                anyhow::bail!(
                    "one sequence of model.max_model_len = {max_len} tokens needs a cache of {} \
                     (cache.memory_budget = \"auto\"), more than half of the {} of memory available: \
                     set --max-model-len (model.max_model_len) lower, or cache.memory_budget",
                    ByteSize(budget),
                    ByteSize(avail)
                );
            }
            cache.memory_budget = Some(ByteSize(budget));
            format!(
                "cache.memory_budget = \"auto\": one sequence of {max_len} tokens, at least {CPU_MIN_AUTO_BUDGET}"
            )
        }
    };
    let layout = CacheLayout::plan(&cache, spec, max_running)?;
    let holds = layout.token_capacity();
    if holds < max_len {
        let fix = if config.model.max_model_len.is_some() {
            "lower --max-model-len (model.max_model_len)"
        } else {
            "set --max-model-len (model.max_model_len)"
        };
        let more = if gpu.is_some() {
            "raise --gpu-memory-utilization or cache.memory_budget"
        } else {
            "raise cache.memory_budget (or set it to \"auto\")"
        };
        anyhow::bail!(
            "the longest context, {max_len} tokens (model.max_model_len{}), does not fit in the KV \
             cache, which holds {holds} tokens ({} blocks of {} with {source}): {fix} to {holds} or \
             less, or {more}",
            if config.model.max_model_len.is_some() {
                ""
            } else {
                ", the model's max_position_embeddings"
            },
            layout.num_blocks,
            layout.block_size
        );
    }
    tracing::info!(
        budget = %cache.memory_budget.map_or_else(String::new, |b| b.to_string()),
        kv_tokens = holds,
        kv_blocks = layout.num_blocks,
        kv_dtype = %cache.kv_dtype,
        ssm_slots = layout.ssm_slots(),
        max_model_len = max_len,
        "cache sized from {source}"
    );
    Ok((cache, max_len))
}

/// `MemAvailable` of `/proc/meminfo`, in bytes (`None` where there is no such file).
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line
        .trim_start_matches("MemAvailable:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib << 10)
}

/// Starts one engine thread per `(backend, model, cache config)` and assembles the stack.
/// The vocabulary the constraint plugin masks: one entry per logits column of the model
/// (`model_vocab`), each token's bytes from the tokenizer (empty past its end). `None` for a
/// tokenizer whose token bytes are not known (only byte-level BPE tokenizers are read so far)
/// or without an EOS token: such a server refuses constrained requests, saying why.
pub fn constraint_vocabulary(codec: &TextCodec, model_vocab: usize) -> Option<Vocabulary> {
    let table = codec.byte_table()?;
    let eos = *codec.eos_token_ids().first()?;
    if eos as usize >= model_vocab {
        return None;
    }
    let tokens = (0..model_vocab as u32).map(|id| (table.bytes(id), table.is_special(id)));
    Some(Vocabulary::from_tokens(tokens, eos))
}

fn start<B: StepBackend + Clone>(
    config: &Config,
    loaded: LoadedModel,
    replicas_in: Vec<(B, Arc<Model<B>>, crate::cache::CacheConfig)>,
    max_model_len: usize,
) -> anyhow::Result<Stack> {
    let plugin_metrics = PluginMetrics::new();
    let model_vocab = replicas_in
        .first()
        .map_or(0, |(_, model, _)| model.info.vocab_size);
    let vocabulary = constraint_vocabulary(&loaded.codec, model_vocab).map(Arc::new);
    if vocabulary.is_none() {
        tracing::warn!(
            model = %loaded.name,
            "constrained responses are unavailable: the tokenizer is not byte-level BPE (its tokens' bytes are unknown) or has no EOS inside the model's vocabulary; such requests get 400"
        );
    }
    let plugins = Arc::new(
        PolicyPlugins::with_vocabulary(
            &config.policy,
            &config.plugins,
            plugin_metrics.clone(),
            vocabulary.clone(),
        )
        .context("loading policy plugins")?,
    );
    let salt = format!("{}:{}", config.model.path, loaded.name);
    let draft = DraftSource::open(config)?;
    let mut replicas = Vec::with_capacity(replicas_in.len());
    let mut info = None;
    for (r, (backend, model, cache)) in replicas_in.into_iter().enumerate() {
        let max_len = max_model_len.min(u32::MAX as usize) as u32;
        let setup = EngineSetup {
            engine: config.engine.clone(),
            cache,
            hash_salt: salt.clone(),
            speculative: config.speculative.clone(),
        };
        let drafter = match &draft {
            Some(d) => Some(d.drafter(config, &backend, &model)?),
            None => None,
        };
        let policies = Policies {
            sampler: plugins.sampler(),
            fallback_sampler: Box::new(DefaultSampler::default()),
            evictor: Some(plugins.evictor()),
            constrainer: vocabulary.is_some().then(|| plugins.engine_constrainer()),
            drafter,
        };
        let runner = ModelRunner::new(backend, model).with_graphs(config.engine.cuda_graphs);
        let (handle, _join, kv) = spawn_engine(setup, runner, policies)
            .with_context(|| format!("starting engine replica {r}"))?;
        let stats = handle.stats();
        info.get_or_insert(ModelInfo {
            // vLLM's default: the id is `--model` as given; the short name is accepted too.
            name: config.model.path.clone(),
            aliases: vec![loaded.name.clone()],
            max_model_len: max_len,
            block_size: config.cache.block_size as u32,
            cache_salt: salt.clone(),
            num_blocks: stats.total_blocks,
            prefix_caching: config.cache.prefix_caching,
            priority_scheduling: config.engine.by_priority(),
        });
        tracing::info!(
            replica = r,
            blocks = stats.total_blocks,
            ssm_slots = stats.ssm_slots_total,
            "engine replica started"
        );
        replicas.push(Replica {
            handle,
            kv_events: Some(kv),
        });
    }
    let model = info.context("no replica")?;
    let parts = AppParts {
        config: config.server.clone(),
        model,
        codec: loaded.codec,
        replicas,
        policy: plugins.router(),
        admin_hooks: Some(Arc::new(ReloadHook {
            plugins: plugins.clone(),
            config: config.clone(),
        })),
        parsers: Some({
            let plugins = plugins.clone();
            Arc::new(move || plugins.parser())
        }),
        grammar_check: vocabulary
            .as_ref()
            .map(|v| (plugins.constrainer(), v.mask_words())),
    };
    Ok(Stack {
        parts,
        plugin_metrics,
    })
}

/// The draft model of `speculative.method = "draft_model"`, opened once for every replica.
struct DraftSource {
    loaded: LoadedModel,
    budget: crate::cache::ByteSize,
}

impl DraftSource {
    fn open(config: &Config) -> anyhow::Result<Option<Self>> {
        let spec = &config.speculative;
        if spec.method != "draft_model" {
            return Ok(None);
        }
        let loaded = LoadedModel::open(&spec.draft_model, "main")
            .with_context(|| format!("opening the draft model {:?}", spec.draft_model))?;
        let budget = crate::cache::ByteSize::parse(&spec.draft_memory_budget)
            .map_err(|e| anyhow::anyhow!("speculative.draft_memory_budget: {e}"))?;
        Ok(Some(Self { loaded, budget }))
    }

    /// The draft engine of one replica, on that replica's backend, after checking that the
    /// draft model's vocabulary is the served model's.
    fn drafter<B: StepBackend + Clone>(
        &self,
        config: &Config,
        backend: &B,
        target: &Model<B>,
    ) -> anyhow::Result<Box<dyn crate::engine::speculative::Drafter>> {
        use crate::engine::speculative::{DraftModelDrafter, draft_setup};
        let dummy = config.model.load_format == "dummy";
        let model = Arc::new(
            self.loaded
                .model_with(backend, dummy, load_options(config))?,
        );
        let (dv, tv) = (model.info.vocab_size, target.info.vocab_size);
        anyhow::ensure!(
            dv == tv && model.info.eos_token_ids == target.info.eos_token_ids,
            "the draft model {:?} does not share the served model's tokenizer: vocabulary {dv} vs {tv}, EOS {:?} vs {:?}",
            config.speculative.draft_model,
            model.info.eos_token_ids,
            target.info.eos_token_ids
        );
        let runner = ModelRunner::new(backend.clone(), model);
        let engine = Engine::new(
            draft_setup(
                self.budget,
                config.cache.block_size,
                config.speculative.max_batch.min(config.engine.max_running),
            ),
            runner,
            Policies::builtin(),
        )
        .context("starting the draft model's engine")?;
        tracing::info!(
            draft = %config.speculative.draft_model,
            blocks = engine.stats().total_blocks,
            "draft model loaded"
        );
        Ok(Box::new(DraftModelDrafter::new(engine)))
    }
}

/// Starts serving on the configured address until Ctrl-C / SIGTERM.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    let mut stack = build(&config)?;
    if config.kv_events.publisher == "zmq" {
        stack = publish_kv_events(&config, stack).await?;
    }
    let state = stack.into_state()?;
    let addr = format!("{}:{}", config.server.host, config.server.port);
    let listener = TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(
        "serving {} on http://{} ({} replica(s), router {}, evictor {}, sampler {})",
        config.model.path,
        listener.local_addr()?,
        config.engine.replicas,
        config.policy.router.plugin,
        config.policy.evictor.plugin,
        config.policy.sampler.plugin
    );
    crate::server::serve(state, listener).await?;
    Ok(())
}

/// Starts the `[kv_events]` ZMQ publisher and feeds it every replica's cache events.
async fn publish_kv_events(config: &Config, mut stack: Stack) -> anyhow::Result<Stack> {
    let parts = &mut stack.parts;
    let model = parts.config.served_name(&parts.model.name);
    let topic = match config.kv_events.topic.as_str() {
        "" => format!("kv@{}:{}@{model}", config.server.host, config.server.port),
        t => t.to_string(),
    };
    let hybrid = parts.is_hybrid();
    let publisher = crate::cluster::ZmqPublisher::start(
        &config.kv_events,
        topic,
        parts.replicas.len(),
        hybrid,
        parts.model.block_size,
    )
    .await?;
    let replicas = std::mem::take(&mut parts.replicas);
    parts.replicas = crate::cluster::tee(
        replicas,
        Arc::new(move |replica, events| publisher.send(replica, events)),
    );
    Ok(stack)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_cuda_gap_names_shapes_beyond_the_kernels_bounds() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
        for name in [
            "qwen35-a",
            "qwen35moe-a",
            "qwen3next-a",
            "granite-moe",
            "falconh1-d",
        ] {
            let text = std::fs::read_to_string(dir.join(name).join("config.json")).unwrap();
            let c: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(
                cuda_gap_of(name, c.get("text_config").unwrap_or(&c)),
                None,
                "{name}"
            );
        }
        let wide = serde_json::json!({"linear_key_head_dim": 512, "linear_conv_kernel_dim": 4});
        let gap = cuda_gap_of("Qwen3NextForCausalLM", &wide).unwrap();
        assert!(
            gap.contains("key head dim 512") && gap.contains("Qwen3NextForCausalLM"),
            "{gap}"
        );
        let conv = serde_json::json!({"conv_kernel": 16});
        let gap = cuda_gap_of("NemotronHForCausalLM", &conv).unwrap();
        assert!(gap.contains("width 16"), "{gap}");
    }

    #[test]
    fn reload_failures_of_the_plugin_are_bad_requests_and_of_the_runtime_internal() {
        let not_wasm = PluginError::NotWasm {
            plugin: "p.wasm".into(),
        };
        assert!(
            matches!(reload_error(not_wasm), ReloadError::BadRequest(m) if m.contains("not a WebAssembly"))
        );
        let init = PluginError::Init {
            plugin: "p.wasm".into(),
            message: "unknown key `x`".into(),
        };
        assert!(
            matches!(reload_error(init), ReloadError::BadRequest(m) if m.contains("unknown key `x`"))
        );
        let engine = PluginError::Engine("out of memory".into());
        assert!(
            matches!(reload_error(engine), ReloadError::Internal(m) if m.contains("out of memory"))
        );
    }

    #[test]
    fn a_wrong_model_path_says_the_folder_does_not_exist() {
        let e = LoadedModel::open("/nonexistent/chimera-model", "main")
            .err()
            .unwrap();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("\"/nonexistent/chimera-model\": the folder does not exist"),
            "{msg}"
        );
        let file = std::env::temp_dir().join(format!("chimera-not-a-dir-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let e = LoadedModel::open(file.to_str().unwrap(), "main")
            .err()
            .unwrap();
        std::fs::remove_file(&file).unwrap();
        assert!(format!("{e:#}").contains("is not a folder"), "{e:#}");
    }

    #[test]
    fn gguf_paths_never_go_to_the_hub() {
        // Shaped like a hub id, but a `.gguf` name: a missing file, not a download.
        let e = LoadedModel::open("org/model.Q4_0.gguf", "main")
            .err()
            .unwrap();
        assert!(
            format!("{e:#}").contains("the GGUF file does not exist"),
            "{e:#}"
        );
        // An existing folder is a folder, whatever its name looks like.
        let root = std::env::temp_dir().join(format!("chimera-local-{}", std::process::id()));
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/models/llama-gqa");
        std::fs::create_dir_all(root.join("org/local-llama")).unwrap();
        for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(fixture.join(f), root.join("org/local-llama").join(f)).unwrap();
        }
        let cwd = root.join("org/local-llama");
        let loaded = LoadedModel::open(cwd.to_str().unwrap(), "main").unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(loaded.source, ModelSource::Folder(cwd));
        assert_eq!(loaded.name, "local-llama");
    }

    #[test]
    fn every_fixture_architecture_has_no_cuda_gap() {
        let fixtures =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
        let mut seen = 0;
        for entry in std::fs::read_dir(&fixtures).unwrap() {
            let dir = entry.unwrap().path();
            if !dir.join("config.json").exists() {
                continue;
            }
            let loaded = LoadedModel::open(dir.to_str().unwrap(), "main").unwrap();
            assert_eq!(loaded.cuda_gap(), None, "{}", dir.display());
            seen += 1;
        }
        assert!(seen >= 20, "{seen} fixtures");
    }

    #[test]
    fn cuda_without_a_usable_gpu_is_a_startup_error_that_names_the_fix() {
        let mut c = Config::default();
        c.engine.backend = "cuda".into();
        match crate::backend::cuda::device::probe_error(0) {
            Some(_) => {
                let e = choose_backend(&c, None).unwrap_err().to_string();
                assert!(e.contains("engine.backend = \"cuda\""), "{e}");
                assert!(
                    e.contains("engine.backend = \"cpu\"") || e.contains("engine.devices"),
                    "{e}"
                );
                // "auto" serves on the CPU instead, and bf16 then has nowhere to run.
                c.engine.backend = "auto".into();
                assert_eq!(choose_backend(&c, None).unwrap(), BackendChoice::Cpu);
                c.model.dtype = "bfloat16".into();
                let e = choose_backend(&c, None).unwrap_err().to_string();
                assert!(e.contains("model.dtype"), "{e}");
            }
            None => {
                assert_eq!(
                    choose_backend(&c, None).unwrap(),
                    BackendChoice::Cuda(DType::BF16)
                );
                // A model with layers CUDA cannot run: "cuda" names them, "auto" takes the CPU.
                let e = choose_backend(&c, Some("Gated DeltaNet layers (X)"))
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("Gated DeltaNet layers (X)"), "{e}");
                c.engine.backend = "auto".into();
                assert_eq!(
                    choose_backend(&c, Some("Gated DeltaNet layers (X)")).unwrap(),
                    BackendChoice::Cpu
                );
                c.engine.backend = "cuda".into();
                c.model.dtype = "float32".into();
                assert_eq!(
                    choose_backend(&c, None).unwrap(),
                    BackendChoice::Cuda(DType::F32)
                );
            }
        }
    }
}
