//! The wasmtime engine shared by all plugins, and loading (compiling) a plugin.
//!
//! Owns the [`wasmtime::Engine`] (epoch interruption on, pooling allocator sized from
//! `[plugins]`, no component-model async), the epoch ticker thread, and [`LoadedPlugin`]: a
//! compiled, checked plugin ready to be instantiated many times. Loading is slow (tens of
//! milliseconds of Cranelift) and must run off the engine threads. A loaded plugin has
//! passed every load-time check: it is a component (a core module is componentized first),
//! imports nothing but the `chimera:plugin/host` functions its TOML section grants, exports
//! exactly one `chimera:plugin` interface with a version the host accepts and the functions
//! that version defines, and a fresh instance accepted its config.
//! Must not decide fallbacks: that is the adapters' job.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use chimera_policy_core::Config;
use wasmtime::component::{
    Component, ComponentExportIndex, InstancePre, Linker, types::ComponentItem,
};
use wasmtime::{Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::abi::{self, ACCEPTED, AbiVersion, Vocabulary};
use super::config::{Grants, PluginsConfig};
use super::instance::{Instance, StoreData, host_log, host_now_ns};
use super::{PluginError, PluginKind};

/// Length of one epoch tick; deadlines are whole ticks.
pub const EPOCH_TICK: Duration = Duration::from_millis(1);

/// The engine and limits every plugin runs under.
#[derive(Clone)]
pub struct PluginRuntime {
    engine: Engine,
    limits: PluginsConfig,
    pooling: bool,
    /// What constraint plugins loaded here are initialised with.
    vocabulary: Arc<Vocabulary>,
}

impl PluginRuntime {
    /// Builds the engine and starts its epoch ticker (which stops when the engine is dropped).
    pub fn new(limits: &PluginsConfig) -> Result<Self, PluginError> {
        limits.validate("plugins").map_err(PluginError::Config)?;
        let (engine, pooling) = match Engine::new(&engine_config(limits, true)) {
            Ok(e) => (e, true),
            Err(pooled) => {
                // The pooling allocator reserves address space up front; some environments
                // refuse that. On-demand allocation only makes instantiation slower.
                tracing::warn!(error = %pooled, "pooling allocator unavailable; plugins use on-demand allocation");
                let engine = Engine::new(&engine_config(limits, false))
                    .map_err(|e| PluginError::Engine(e.to_string()))?;
                (engine, false)
            }
        };
        start_ticker(&engine);
        Ok(Self {
            engine,
            limits: limits.clone(),
            pooling,
            vocabulary: Arc::new(Vocabulary::sample()),
        })
    }

    /// Constraint plugins loaded from now on are initialised with `vocabulary` (the served
    /// model's) instead of the small stand-in used to check them.
    pub fn set_vocabulary(&mut self, vocabulary: Arc<Vocabulary>) {
        self.vocabulary = vocabulary;
    }

    pub fn vocabulary(&self) -> &Arc<Vocabulary> {
        &self.vocabulary
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn limits(&self) -> &PluginsConfig {
        &self.limits
    }

    /// Whether instances come from the pooling allocator.
    pub fn pooling(&self) -> bool {
        self.pooling
    }

    /// Compiles and checks a plugin, then proves a fresh instance accepts `config`.
    /// `name` identifies it in errors, logs and metrics (e.g. `builtin:lru` or a path).
    pub fn load(
        &self,
        name: &str,
        wasm: &[u8],
        expected: Option<PluginKind>,
        config: &Config,
        grants: Grants,
    ) -> Result<Arc<LoadedPlugin>, PluginError> {
        let plugin = Arc::new(self.compile(name, wasm, config, grants)?);
        if let Some(kind) = expected
            && plugin.kind != kind
        {
            return Err(PluginError::WrongKind {
                plugin: name.to_string(),
                expected: kind,
                found: plugin.kind,
            });
        }
        // Instantiating also runs `init`, which rejects a bad config with the plugin's message.
        Instance::new(plugin.clone()).map_err(|e| e.into_load_error(name))?;
        Ok(plugin)
    }

    /// Compiles and inspects without instantiating (used by `load` and `check_plugin`).
    pub(crate) fn compile(
        &self,
        name: &str,
        wasm: &[u8],
        config: &Config,
        grants: Grants,
    ) -> Result<LoadedPlugin, PluginError> {
        let (bytes, componentized) = to_component(name, wasm)?;
        let component = Component::new(&self.engine, &bytes).map_err(|e| PluginError::Compile {
            plugin: name.to_string(),
            message: format!("{e:#}"),
        })?;
        let ty = component.component_type();
        let mut linker: Linker<StoreData> = Linker::new(&self.engine);
        let mut host_functions = Vec::new();
        let mut others = Vec::new();
        for (import, item) in ty.imports(&self.engine) {
            let ComponentItem::ComponentInstance(instance) = item.ty else {
                others.push(import.to_string());
                continue;
            };
            if !abi::parse_host_import(import).is_some_and(|v| ACCEPTED.contains(v)) {
                others.push(import.to_string());
                continue;
            }
            let mut host = linker.instance(import).map_err(|e| PluginError::Compile {
                plugin: name.to_string(),
                message: format!("{e:#}"),
            })?;
            for (function, _) in instance.exports(&self.engine) {
                let Some(grant) = Grants::needed_for(function) else {
                    others.push(format!("{import}#{function}"));
                    continue;
                };
                if !grants.allows(grant) {
                    return Err(PluginError::NotGranted {
                        plugin: name.to_string(),
                        function: function.to_string(),
                        grant,
                    });
                }
                let defined = match function {
                    "now-ns" => host.func_wrap("now-ns", |_, (): ()| Ok((host_now_ns(),))),
                    _ => host.func_wrap("log", |mut cx, (level, message): (u8, String)| {
                        host_log(cx.data_mut(), level, &message);
                        Ok(())
                    }),
                };
                defined.map_err(|e| PluginError::Compile {
                    plugin: name.to_string(),
                    message: format!("{e:#}"),
                })?;
                host_functions.push(function.to_string());
            }
        }
        if !others.is_empty() {
            return Err(PluginError::Imports {
                plugin: name.to_string(),
                imports: others,
            });
        }
        let mut found = None;
        let mut others = Vec::new();
        for (export, item) in ty.exports(&self.engine) {
            match abi::parse_export(export) {
                Some((Some(kind), version))
                    if matches!(item.ty, ComponentItem::ComponentInstance(_)) =>
                {
                    if found.is_some() {
                        return Err(PluginError::Exports {
                            plugin: name.to_string(),
                            message: "exports more than one chimera:plugin interface".into(),
                        });
                    }
                    found = Some((export.to_string(), kind, version));
                }
                _ => others.push(export.to_string()),
            }
        }
        let Some((export, kind, version)) = found else {
            return Err(PluginError::Exports {
                plugin: name.to_string(),
                message: format!(
                    "exports no chimera:plugin interface (routing, eviction, sampling, constraining or parsing); exports: [{}]",
                    others.join(", ")
                ),
            });
        };
        let Some(version) = version else {
            return Err(PluginError::Exports {
                plugin: name.to_string(),
                message: format!("export `{export}` carries no ABI version"),
            });
        };
        if !ACCEPTED.contains(version) {
            return Err(PluginError::AbiVersion {
                plugin: name.to_string(),
                found: version,
                accepted: ACCEPTED,
            });
        }
        if version < abi::introduced(kind) {
            return Err(PluginError::Exports {
                plugin: name.to_string(),
                message: format!(
                    "`{export}`: the {} interface exists from ABI {} on, not in {version}",
                    kind.interface(),
                    abi::introduced(kind)
                ),
            });
        }
        let Some(iface) = component.get_export_index(None, export.as_str()) else {
            return Err(PluginError::Exports {
                plugin: name.to_string(),
                message: format!("`{export}` not found"),
            });
        };
        let mut functions = Vec::new();
        for f in abi::functions(kind) {
            match component.get_export(Some(&iface), f) {
                Some((ComponentItem::ComponentFunc(_), idx)) => functions.push(idx),
                _ => {
                    return Err(PluginError::Exports {
                        plugin: name.to_string(),
                        message: format!("`{export}` lacks function `{f}`"),
                    });
                }
            }
        }
        let pre = linker
            .instantiate_pre(&component)
            .map_err(|e| PluginError::Compile {
                plugin: name.to_string(),
                message: format!("{e:#}"),
            })?;
        Ok(LoadedPlugin {
            name: name.to_string(),
            kind,
            abi: version,
            export,
            componentized,
            size: wasm.len(),
            functions,
            host_functions,
            pre,
            config: config.clone(),
            limits: self.limits.for_kind(kind),
            vocabulary: self.vocabulary.clone(),
        })
    }
}

/// A compiled plugin that passed the load checks; instantiate it with [`Instance::new`].
pub struct LoadedPlugin {
    pub name: String,
    pub kind: PluginKind,
    pub abi: AbiVersion,
    /// The exported interface, e.g. `chimera:plugin/routing@0.1.0`.
    pub export: String,
    /// Whether the file was a core module that the host turned into a component.
    pub componentized: bool,
    /// Size of the file as given, in bytes.
    pub size: usize,
    /// Export indices of [`abi::functions`] for this kind, in that order.
    pub(crate) functions: Vec<ComponentExportIndex>,
    /// The `chimera:plugin/host` functions it calls (each one granted), e.g. `now-ns`.
    pub host_functions: Vec<String>,
    pub(crate) pre: InstancePre<StoreData>,
    pub config: Config,
    pub(crate) limits: PluginsConfig,
    /// `init`'s vocabulary, for a constraint plugin.
    pub(crate) vocabulary: Arc<Vocabulary>,
}

impl std::fmt::Debug for LoadedPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedPlugin")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("abi", &self.abi)
            .field("export", &self.export)
            .finish_non_exhaustive()
    }
}

fn engine_config(limits: &PluginsConfig, pooling: bool) -> wasmtime::Config {
    let mut cfg = wasmtime::Config::new();
    cfg.epoch_interruption(true);
    // Lets `perf` name plugin functions (it reads /tmp/perf-PID.map): for plugin authors
    // profiling their code inside the server.
    if std::env::var_os("CHIMERA_PLUGIN_PERFMAP").is_some() {
        cfg.profiler(wasmtime::ProfilingStrategy::PerfMap);
    }
    cfg.wasm_component_model(true);
    if pooling {
        let n = limits.max_instances;
        let mut pool = PoolingAllocationConfig::default();
        // A component built from one Rust module has one core instance, memory and table;
        // leave room for a few shim modules.
        pool.total_component_instances(n)
            .total_core_instances(n.saturating_mul(4))
            .total_memories(n)
            .total_tables(n.saturating_mul(2))
            // Above the store limit, so the limiter (which records why) refuses first.
            .max_memory_size(limits.largest_memory() as usize + (1 << 20));
        cfg.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    }
    cfg
}

fn start_ticker(engine: &Engine) {
    let weak = engine.weak();
    let spawned = thread::Builder::new()
        .name("plugin-epoch".into())
        .spawn(move || {
            loop {
                thread::sleep(EPOCH_TICK);
                match weak.upgrade() {
                    Some(engine) => engine.increment_epoch(),
                    None => break,
                }
            }
        });
    if let Err(e) = spawned {
        // Without a ticker deadlines never fire; calls still run, so say so loudly.
        tracing::error!(error = %e, "could not start the plugin epoch ticker; plugin deadlines are not enforced");
    }
}

/// Turns a core module into a component (imports nothing, so no adapters are needed); a
/// component is returned as is. Returns the bytes and whether they were converted.
pub fn to_component(name: &str, wasm: &[u8]) -> Result<(Vec<u8>, bool), PluginError> {
    const CORE: [u8; 4] = [1, 0, 0, 0];
    const COMPONENT: [u8; 4] = [0x0d, 0, 1, 0];
    if wasm.len() < 8 || &wasm[..4] != b"\0asm" {
        return Err(PluginError::NotWasm {
            plugin: name.to_string(),
        });
    }
    if wasm[4..8] == COMPONENT {
        return Ok((wasm.to_vec(), false));
    }
    if wasm[4..8] != CORE {
        return Err(PluginError::NotWasm {
            plugin: name.to_string(),
        });
    }
    let encoded = wit_component::ComponentEncoder::default()
        .module(wasm)
        .and_then(|e| e.validate(true).encode())
        .map_err(|e| PluginError::Componentize {
            plugin: name.to_string(),
            message: format!("{e:#}"),
        })?;
    Ok((encoded, true))
}
