//! Assembling a serving process from a [`Config`]: load the model and tokenizer, compile the
//! policy plugins, start one engine thread per replica, and hand everything to the HTTP server.
//!
//! This is the binary's edge: it reports errors with `anyhow` context. It owns no serving
//! logic of its own.

use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;

use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::config::Config;
use crate::engine::{EngineSetup, ModelRunner, Policies, spawn_engine};
use crate::model::{self, Model, builtin};
use crate::plugins::{PluginKind, PluginMetrics, PolicyPlugins};
use crate::policy::native::DefaultSampler;
use crate::server::metrics::MetricsSource;
use crate::server::router::Replica;
use crate::server::{AdminHooks, AppParts, AppState, ModelInfo, TextCodec};

/// The tokenizer and a loader for the configured model (called once per replica).
pub struct LoadedModel {
    pub name: String,
    pub codec: TextCodec,
    pub dir: Option<std::path::PathBuf>,
}

impl LoadedModel {
    pub fn open(path: &str) -> anyhow::Result<Self> {
        if path == builtin::NAME {
            let codec = TextCodec::embedded()?;
            return Ok(Self {
                name: "tiny-hybrid".into(),
                codec,
                dir: None,
            });
        }
        let dir = std::path::PathBuf::from(path);
        let codec = TextCodec::from_dir(&dir)
            .with_context(|| format!("loading the tokenizer in {path}"))?;
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.to_string());
        Ok(Self {
            name,
            codec,
            dir: Some(dir),
        })
    }

    /// Loads the weights onto `backend` (replicas on one device share this copy).
    pub fn model<B: Backend>(&self, backend: &B) -> anyhow::Result<Model<B>> {
        match &self.dir {
            None => {
                let eos = self.codec.eos_token_ids().first().copied().unwrap_or(0);
                Ok(builtin::load(
                    backend,
                    self.codec.vocab_size() as usize,
                    eos,
                    1,
                )?)
            }
            Some(dir) => model::load(dir, backend)
                .with_context(|| format!("loading the model in {}", dir.display())),
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

impl AdminHooks for ReloadHook {
    fn reload_plugins(&self) -> Result<String, String> {
        let mut done = Vec::new();
        for kind in PluginKind::ALL {
            let spec = self.config.policy.spec(kind);
            let path = format!("policy.{}", kind.section());
            let source = spec.source(kind, &path).map_err(|e| e.to_string())?;
            let crate::plugins::PluginSource::File(file) = &source else {
                continue;
            };
            let wasm = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
            let config = spec.flat_config(&path).map_err(|e| e.to_string())?;
            let grants = spec.grants(&path).map_err(|e| e.to_string())?;
            let plugin = self
                .plugins
                .reload(kind, &source.to_string(), &wasm, &config, grants)
                .map_err(|e| e.to_string())?;
            done.push(format!("{kind}: {} (ABI {})", plugin.name, plugin.abi));
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

/// Builds the whole serving stack (engine threads started) from a validated config.
pub fn build(config: &Config) -> anyhow::Result<Stack> {
    let loaded = LoadedModel::open(&config.model.path)?;
    let plugin_metrics = PluginMetrics::new();
    let plugins = Arc::new(
        PolicyPlugins::new(&config.policy, &config.plugins, plugin_metrics.clone())
            .context("loading policy plugins")?,
    );
    let salt = format!("{}:{}", config.model.path, loaded.name);
    let mut replicas = Vec::with_capacity(config.engine.replicas);
    let mut info = None;
    // One copy of the weights, read by every replica (each has its own caches).
    // `engine.backend` is validated at load; "cpu" is the one backend built so far.
    let backend = match config.engine.backend.as_str() {
        "cpu" => CpuBackend::default(),
        other => anyhow::bail!("engine.backend = {other:?} is not available in this build"),
    };
    let model = Arc::new(loaded.model(&backend)?);
    for r in 0..config.engine.replicas {
        let model = Arc::clone(&model);
        let max_len = model.info.max_position_embeddings.min(u32::MAX as usize) as u32;
        let setup = EngineSetup {
            engine: config.engine.clone(),
            cache: config.cache.clone(),
            hash_salt: salt.clone(),
        };
        let policies = Policies {
            sampler: plugins.sampler(),
            fallback_sampler: Box::new(DefaultSampler::default()),
            evictor: Some(plugins.evictor()),
        };
        let (handle, _join, kv) =
            // Each replica gets its own backend handle (stream and step arena on a device).
            spawn_engine(setup, ModelRunner::new(CpuBackend::default(), model), policies)
                .with_context(|| format!("starting engine replica {r}"))?;
        let stats = handle.stats();
        info.get_or_insert(ModelInfo {
            name: loaded.name.clone(),
            max_model_len: max_len,
            block_size: config.cache.block_size as u32,
            cache_salt: salt.clone(),
            num_blocks: stats.total_blocks,
            prefix_caching: config.cache.prefix_caching,
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
    };
    Ok(Stack {
        parts,
        plugin_metrics,
    })
}

/// Starts serving on the configured address until Ctrl-C / SIGTERM.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    let state = build(&config)?.into_state()?;
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
