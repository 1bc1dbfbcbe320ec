//! WebAssembly policy plugins: loading, sandboxing, fallback and reload.
//!
//! Owns everything between a `[policy.*]` config section and a `Box<dyn Router/Evictor/
//! Sampler>` the router or an engine thread calls:
//! - [`config`]: the TOML sections and their validation;
//! - [`runtime`]: the wasmtime engine (epoch deadlines, pooling allocator, memory limits) and
//!   compiling + checking a plugin ([`LoadedPlugin`]);
//! - [`abi`]: accepted ABI versions and the records that cross the boundary;
//! - `instance` / `slot`: one live instance, re-created after a trap, swapped on reload;
//! - `adapters`: the policy traits over a plugin, validating every answer and falling back to
//!   the native twin (`policy::native`) on any failure;
//! - [`metrics`]: `chimera:plugin_fallbacks_total{plugin,kind,reason}`, call counters and call
//!   latencies;
//! - [`builtin`]: the embedded built-in plugins; [`check`]: `chimera plugin check`.
//!
//! Invariants: a plugin can never crash the host or lose a call (every failure has a native
//! answer); plugins import nothing, so no filesystem, network or clock can be granted in ABI
//! 0.1.x; compiling happens in [`PolicyPlugins::new`] / [`PolicyPlugins::reload`], never on a
//! call. Must not: hold a lock across a plugin call, or depend on the SDK's guest glue (the host
//! shares only `chimera-policy-core`, the plain algorithm crate, with the plugins).

pub mod abi;
mod adapters;
pub mod agent;
pub mod builtin;
pub mod check;
pub mod config;
mod instance;
pub mod metrics;
pub mod runtime;
mod slot;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use chimera_policy_core::Config;

pub use adapters::{WasmEvictor, WasmRouter, WasmSampler};
pub use agent::{WasmConstrainer, WasmParser};
pub use check::{CheckReport, check_plugin};
pub use config::{
    ConfigError, Grants, PluginSource, PluginsConfig, PolicyConfig, PolicySpec, parse_plugin_config,
};
pub use metrics::{FallbackReason, PluginCounters, PluginMetrics};
pub use runtime::{LoadedPlugin, PluginRuntime};
pub use slot::PluginHandle;

use crate::policy::native::{self, LruEvictor};
use crate::policy::{Constrainer, ConstraintLanes, Evictor, OutputParser, Router, Sampler};
pub use abi::Vocabulary;

/// The plugin kinds, one WIT world (and interface) each: three policies (0.1.0 on) and the two
/// kinds of agent requests (0.2.0 on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PluginKind {
    Router,
    Evictor,
    Sampler,
    /// Allowed-token masks of constrained responses (grammars, JSON schemas, forced calls).
    Constraint,
    /// Responses' text turned into content, reasoning and tool calls.
    Parser,
}

impl PluginKind {
    pub const ALL: [PluginKind; 5] = [
        PluginKind::Router,
        PluginKind::Evictor,
        PluginKind::Sampler,
        PluginKind::Constraint,
        PluginKind::Parser,
    ];

    /// The exported WIT interface of this kind.
    pub fn interface(self) -> &'static str {
        match self {
            PluginKind::Router => "routing",
            PluginKind::Evictor => "eviction",
            PluginKind::Sampler => "sampling",
            PluginKind::Constraint => "constraining",
            PluginKind::Parser => "parsing",
        }
    }

    /// The `[policy.<section>]` name.
    pub fn section(self) -> &'static str {
        match self {
            PluginKind::Router => "router",
            PluginKind::Evictor => "evictor",
            PluginKind::Sampler => "sampler",
            PluginKind::Constraint => "constraint",
            PluginKind::Parser => "parser",
        }
    }

    /// The native policy used when a custom plugin of this kind cannot answer.
    pub fn default_native(self) -> &'static str {
        match self {
            PluginKind::Router => "prefix-aware",
            PluginKind::Evictor => "lru",
            PluginKind::Sampler => "default",
            PluginKind::Constraint => "llguidance",
            PluginKind::Parser => "tool-parsers",
        }
    }
}

impl fmt::Display for PluginKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.section())
    }
}

/// Why a plugin could not be loaded, checked or reloaded.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot read plugin {}: {message}", path.display())]
    Io { path: PathBuf, message: String },
    #[error("plugin {plugin}: not a WebAssembly module or component")]
    NotWasm { plugin: String },
    #[error(
        "plugin {plugin}: cannot turn the core module into a component (was it built with chimera-plugin-sdk?): {message}"
    )]
    Componentize { plugin: String, message: String },
    #[error("plugin {plugin}: does not compile: {message}")]
    Compile { plugin: String, message: String },
    #[error(
        "plugin {plugin}: imports {imports:?}; the host offers only chimera:plugin/host (clock and log, when granted), never a filesystem or network (was it built for wasm32-unknown-unknown?)"
    )]
    Imports {
        plugin: String,
        imports: Vec<String>,
    },
    #[error(
        "plugin {plugin}: calls host function `{function}`, which its TOML section does not grant: add grants = [\"{grant}\"]"
    )]
    NotGranted {
        plugin: String,
        function: String,
        grant: &'static str,
    },
    #[error("plugin {plugin}: {message}")]
    Exports { plugin: String, message: String },
    #[error(
        "plugin {plugin}: built for chimera:plugin ABI {found}, but this host accepts {accepted}"
    )]
    AbiVersion {
        plugin: String,
        found: AbiVersion,
        accepted: abi::AbiRange,
    },
    #[error("plugin {plugin}: is a {found} plugin, but it is configured as the {expected}")]
    WrongKind {
        plugin: String,
        expected: PluginKind,
        found: PluginKind,
    },
    #[error("plugin {plugin}: rejected its config: {message}")]
    Init { plugin: String, message: String },
    #[error("plugin {plugin}: cannot be instantiated: {message}")]
    Instantiate { plugin: String, message: String },
    #[error("the wasmtime engine could not be created: {0}")]
    Engine(String),
}

use abi::AbiVersion;

/// How one policy is provided.
enum Provider {
    Native {
        name: &'static str,
        config: Config,
    },
    Wasm {
        handle: Arc<PluginHandle>,
        fallback: &'static str,
        fallback_config: Config,
    },
}

/// The configured policies: builds a fresh policy object per caller (per replica for the
/// evictor and sampler, one for the router) and reloads plugins while serving.
pub struct PolicyPlugins {
    runtime: PluginRuntime,
    metrics: Arc<PluginMetrics>,
    providers: [Provider; 5],
}

impl PolicyPlugins {
    /// Loads (compiles and checks) every configured plugin. Slow: run it off the engine
    /// threads. `metrics` receives the fallback counters.
    pub fn new(
        policy: &PolicyConfig,
        limits: &PluginsConfig,
        metrics: Arc<PluginMetrics>,
    ) -> Result<Self, PluginError> {
        Self::with_vocabulary(policy, limits, metrics, None)
    }

    /// As [`PolicyPlugins::new`], with the served model's vocabulary for the constraint plugin
    /// (without one it is checked against a small stand-in and cannot serve requests).
    pub fn with_vocabulary(
        policy: &PolicyConfig,
        limits: &PluginsConfig,
        metrics: Arc<PluginMetrics>,
        vocabulary: Option<Arc<Vocabulary>>,
    ) -> Result<Self, PluginError> {
        policy.validate("policy")?;
        let mut runtime = PluginRuntime::new(limits)?;
        if let Some(v) = vocabulary {
            runtime.set_vocabulary(v);
        }
        let providers = [
            Self::provider(&runtime, PluginKind::Router, &policy.router)?,
            Self::provider(&runtime, PluginKind::Evictor, &policy.evictor)?,
            Self::provider(&runtime, PluginKind::Sampler, &policy.sampler)?,
            Self::provider(&runtime, PluginKind::Constraint, &policy.constraint)?,
            Self::provider(&runtime, PluginKind::Parser, &policy.parser)?,
        ];
        Ok(Self {
            runtime,
            metrics,
            providers,
        })
    }

    fn provider(
        runtime: &PluginRuntime,
        kind: PluginKind,
        spec: &PolicySpec,
    ) -> Result<Provider, PluginError> {
        let path = format!("policy.{}", kind.section());
        let source = spec.source(kind, &path)?;
        let config = spec.flat_config(&path)?;
        let grants = spec.grants(&path)?;
        let (wasm, fallback, fallback_config) = match &source {
            PluginSource::Native(name) => {
                let name = static_name(kind, name);
                check_native(kind, name, &config).map_err(|message| PluginError::Init {
                    plugin: source.to_string(),
                    message,
                })?;
                return Ok(Provider::Native { name, config });
            }
            PluginSource::Builtin(name) => {
                let Some(b) = builtin::find(kind, name) else {
                    return Err(ConfigError {
                        path: format!("{path}.plugin"),
                        message: format!("no built-in {kind} `{name}`"),
                    }
                    .into());
                };
                (b.wasm.to_vec(), b.name, config.clone())
            }
            PluginSource::File(file) => {
                let wasm = std::fs::read(file).map_err(|e| PluginError::Io {
                    path: file.clone(),
                    message: e.to_string(),
                })?;
                (wasm, kind.default_native(), Config::default())
            }
        };
        check_native(kind, fallback, &fallback_config).map_err(|message| PluginError::Init {
            plugin: source.to_string(),
            message,
        })?;
        let plugin = runtime.load(&source.to_string(), &wasm, Some(kind), &config, grants)?;
        Ok(Provider::Wasm {
            handle: PluginHandle::new(plugin),
            fallback,
            fallback_config,
        })
    }

    fn provider_of(&self, kind: PluginKind) -> &Provider {
        &self.providers[kind as usize]
    }

    pub fn metrics(&self) -> &Arc<PluginMetrics> {
        &self.metrics
    }

    pub fn runtime(&self) -> &PluginRuntime {
        &self.runtime
    }

    /// The handle of a Wasm policy (`None` for a native one).
    pub fn handle(&self, kind: PluginKind) -> Option<&Arc<PluginHandle>> {
        match self.provider_of(kind) {
            Provider::Wasm { handle, .. } => Some(handle),
            Provider::Native { .. } => None,
        }
    }

    /// A new router (its own plugin instance).
    pub fn router(&self) -> Box<dyn Router> {
        match self.provider_of(PluginKind::Router) {
            Provider::Native { name, config } => native_router(name, config),
            Provider::Wasm {
                handle,
                fallback,
                fallback_config,
            } => {
                let counters = self
                    .metrics
                    .counters(&handle.current().name, PluginKind::Router);
                Box::new(WasmRouter::new(
                    handle.clone(),
                    counters,
                    native_router(fallback, fallback_config),
                ))
            }
        }
    }

    /// A new evictor (its own plugin instance and native view).
    pub fn evictor(&self) -> Box<dyn Evictor> {
        match self.provider_of(PluginKind::Evictor) {
            Provider::Native { .. } => Box::new(LruEvictor::new()),
            Provider::Wasm { handle, .. } => {
                let counters = self
                    .metrics
                    .counters(&handle.current().name, PluginKind::Evictor);
                Box::new(WasmEvictor::new(
                    handle.clone(),
                    counters,
                    LruEvictor::new(),
                ))
            }
        }
    }

    /// A new sampler (its own plugin instance).
    pub fn sampler(&self) -> Box<dyn Sampler> {
        let native = || -> Box<dyn Sampler> { Box::new(native::DefaultSampler::default()) };
        match self.provider_of(PluginKind::Sampler) {
            Provider::Native { .. } => native(),
            Provider::Wasm { handle, .. } => {
                let counters = self
                    .metrics
                    .counters(&handle.current().name, PluginKind::Sampler);
                Box::new(WasmSampler::new(handle.clone(), counters, native()))
            }
        }
    }

    /// One engine's constraints: `[plugins] constraint_threads` constrainers (each its own
    /// plugin instance) as lanes computing a step's masks at once and compiling grammars off
    /// the engine thread (one lane too).
    pub fn engine_constrainer(&self) -> Box<dyn Constrainer> {
        let n = self.runtime.limits().constraint_threads.max(1);
        Box::new(ConstraintLanes::new(
            (0..n).map(|_| self.constrainer()).collect(),
        ))
    }

    /// A new constraint for one engine (its own plugin instance); `None` when no vocabulary
    /// was given (the plugin only checked).
    pub fn constrainer(&self) -> Box<dyn Constrainer> {
        let words = self.runtime.vocabulary().mask_words();
        match self.provider_of(PluginKind::Constraint) {
            Provider::Native { config, .. } => {
                native::constrainer(config, self.runtime.vocabulary())
            }
            Provider::Wasm { handle, .. } => {
                let counters = self
                    .metrics
                    .counters(&handle.current().name, PluginKind::Constraint);
                Box::new(WasmConstrainer::new(handle.clone(), counters, words))
            }
        }
    }

    /// A new output parser (its own plugin instance).
    pub fn parser(&self) -> Box<dyn OutputParser> {
        match self.provider_of(PluginKind::Parser) {
            Provider::Native { config, .. } => native::parser(config),
            Provider::Wasm { handle, .. } => {
                let counters = self
                    .metrics
                    .counters(&handle.current().name, PluginKind::Parser);
                Box::new(WasmParser::new(handle.clone(), counters))
            }
        }
    }

    /// The vocabulary constraint plugins are initialised with.
    pub fn vocabulary(&self) -> &Arc<Vocabulary> {
        self.runtime.vocabulary()
    }

    /// Replaces the plugin of `kind` while serving: compiles and checks `wasm` with `config`
    /// and `grants` on the calling thread (call it off the engine threads), then swaps it in;
    /// every adapter switches at its next call. On error the running plugin stays.
    pub fn reload(
        &self,
        kind: PluginKind,
        name: &str,
        wasm: &[u8],
        config: &Config,
        grants: Grants,
    ) -> Result<Arc<LoadedPlugin>, PluginError> {
        let Some(handle) = self.handle(kind) else {
            return Err(PluginError::Exports {
                plugin: name.to_string(),
                message: format!("the {kind} policy is native; only Wasm policies can be reloaded"),
            });
        };
        let plugin = self.runtime.load(name, wasm, Some(kind), config, grants)?;
        handle.swap(plugin.clone());
        tracing::info!(plugin = name, %kind, abi = %plugin.abi, "plugin reloaded");
        Ok(plugin)
    }
}

fn static_name(kind: PluginKind, name: &str) -> &'static str {
    config::builtin_names(kind)
        .iter()
        .find(|n| **n == name)
        .copied()
        .unwrap_or(kind.default_native())
}

fn check_native(kind: PluginKind, name: &str, config: &Config) -> Result<(), String> {
    match kind {
        PluginKind::Router => native::router(name, config).map(drop),
        PluginKind::Evictor => native::evictor(name, config).map(drop),
        PluginKind::Sampler => native::sampler(name, config).map(drop),
        PluginKind::Constraint => native::check_constraint(name, config),
        PluginKind::Parser => native::check_parser(name, config),
    }
}

fn native_router(name: &str, config: &Config) -> Box<dyn Router> {
    match native::router(name, config) {
        Ok(r) => r,
        // The config was checked when the provider was built; keep serving regardless.
        Err(_) => Box::new(native::LeastLoadedRouter),
    }
}
