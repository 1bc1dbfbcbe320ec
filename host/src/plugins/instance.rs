//! One live plugin instance: its store, limits, deadline and typed calls.
//!
//! Owns a wasmtime `Store` with a memory limiter and the plugin's exported functions. Every
//! call re-arms the epoch deadline and classifies a failure as trap, timeout or memory; a
//! failed instance is poisoned (wasmtime leaves a trapped instance in an undefined state), so
//! its owner must drop it and create a new one. Must not fall back or count: the adapters do.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use wasmtime::component::{ComponentNamedList, Func, Lift, Lower};
use wasmtime::{ResourceLimiter, Store, Trap};

use super::abi::{
    self, WitCacheEvents, WitParseRequest, WitParsed, WitReplicaColumns, WitRouteRequest,
    WitSamplerBatch,
};
use super::metrics::FallbackReason;
use super::runtime::{EPOCH_TICK, LoadedPlugin};
use super::{PluginError, PluginKind};

/// Per-store state: the memory limiter, and what the host functions need.
pub struct StoreData {
    limiter: MemoryLimiter,
    log: LogBudget,
}

/// Log lines a plugin instance may write per second; the rest are counted and reported once
/// the next second starts.
const LOG_LINES_PER_SECOND: u32 = 20;

struct LogBudget {
    plugin: Arc<str>,
    window: Instant,
    written: u32,
    dropped: u32,
}

/// `chimera:plugin/host.now-ns`: nanoseconds since the first call in this process.
pub fn host_now_ns() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// `chimera:plugin/host.log`: a line in the server's log, rate-limited per instance.
pub fn host_log(data: &mut StoreData, level: u8, message: &str) {
    let b = &mut data.log;
    if b.window.elapsed().as_secs() >= 1 {
        if b.dropped > 0 {
            tracing::warn!(plugin = %b.plugin, dropped = b.dropped, "plugin log lines dropped (rate limit)");
        }
        b.window = Instant::now();
        b.written = 0;
        b.dropped = 0;
    }
    if b.written >= LOG_LINES_PER_SECOND {
        b.dropped += 1;
        return;
    }
    b.written += 1;
    // Bounded, and control characters cannot forge extra log lines.
    let text: String = message
        .chars()
        .take(1024)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let plugin = &*b.plugin;
    match level {
        0 => tracing::error!(plugin, "{text}"),
        1 => tracing::warn!(plugin, "{text}"),
        2 => tracing::info!(plugin, "{text}"),
        _ => tracing::debug!(plugin, "{text}"),
    }
}

struct MemoryLimiter {
    max_bytes: usize,
    /// Set when a growth was refused since the last call started.
    denied: bool,
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.max_bytes {
            self.denied = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 20)
    }
}

/// Why a call produced no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallError {
    pub reason: FallbackReason,
    pub detail: String,
}

impl CallError {
    fn unavailable(detail: String) -> Self {
        Self {
            reason: FallbackReason::Unavailable,
            detail,
        }
    }

    /// Load-time view of an instantiation failure.
    pub fn into_load_error(self, plugin: &str) -> PluginError {
        match self.reason {
            FallbackReason::Invalid => PluginError::Init {
                plugin: plugin.to_string(),
                message: self.detail,
            },
            _ => PluginError::Instantiate {
                plugin: plugin.to_string(),
                message: self.detail,
            },
        }
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}

pub struct Instance {
    store: Store<StoreData>,
    funcs: Vec<Func>,
    plugin: Arc<LoadedPlugin>,
    deadline_ticks: u64,
}

impl Instance {
    /// Instantiates `plugin` and calls its `init` with the plugin's config. A config the
    /// plugin rejects is reported with reason `Invalid` and the plugin's message.
    pub fn new(plugin: Arc<LoadedPlugin>) -> Result<Self, CallError> {
        let limiter = MemoryLimiter {
            max_bytes: plugin.limits.memory_bytes as usize,
            denied: false,
        };
        let log = LogBudget {
            plugin: Arc::from(plugin.name.as_str()),
            window: Instant::now(),
            written: 0,
            dropped: 0,
        };
        let mut store = Store::new(plugin.pre.engine(), StoreData { limiter, log });
        store.limiter(|d| &mut d.limiter);
        let deadline_ticks = plugin
            .limits
            .deadline_ms
            .div_ceil(EPOCH_TICK.as_millis() as u64)
            .max(1);
        store.set_epoch_deadline(deadline_ticks);
        store.epoch_deadline_trap();
        let instance = plugin
            .pre
            .instantiate(&mut store)
            .map_err(|e| CallError::unavailable(format!("instantiation failed: {e:#}")))?;
        let mut funcs = Vec::with_capacity(plugin.functions.len());
        for idx in &plugin.functions {
            let f = instance
                .get_func(&mut store, idx)
                .ok_or_else(|| CallError::unavailable("exported function vanished".into()))?;
            funcs.push(f);
        }
        let mut this = Self {
            store,
            funcs,
            plugin,
            deadline_ticks,
        };
        let entries = abi::config_entries(&this.plugin.config);
        let (result,) = if this.plugin.kind == PluginKind::Constraint {
            let vocabulary = this.plugin.vocabulary.clone();
            this.call::<(&[abi::WitConfigEntry], abi::WitVocabulary<'_>), (Result<(), String>,)>(
                0,
                (&entries, vocabulary.arg()),
            )?
        } else {
            this.call::<(&[abi::WitConfigEntry],), (Result<(), String>,)>(0, (&entries,))?
        };
        result.map_err(|message| CallError {
            reason: FallbackReason::Invalid,
            detail: message,
        })?;
        Ok(this)
    }

    /// Calls function `index` of [`abi::functions`] under the deadline and memory limit.
    fn call<P, R>(&mut self, index: usize, params: P) -> Result<R, CallError>
    where
        P: ComponentNamedList + Lower,
        R: ComponentNamedList + Lift,
    {
        let func = self.funcs[index];
        let typed = func.typed::<P, R>(&self.store).map_err(|e| CallError {
            reason: FallbackReason::Invalid,
            detail: format!(
                "function `{}` has an unexpected type: {e:#}",
                abi::functions(self.plugin.kind)[index]
            ),
        })?;
        self.store.data_mut().limiter.denied = false;
        self.store.set_epoch_deadline(self.deadline_ticks);
        typed.call(&mut self.store, params).map_err(|e| {
            let reason = if e.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
                FallbackReason::Timeout
            } else if self.store.data().limiter.denied {
                FallbackReason::Memory
            } else {
                FallbackReason::Trap
            };
            CallError {
                reason,
                detail: format!("{e:#}"),
            }
        })
    }

    pub fn route(
        &mut self,
        request: WitRouteRequest<'_>,
        replicas: WitReplicaColumns<'_>,
    ) -> Result<Option<u32>, CallError> {
        self.call::<_, (Option<u32>,)>(1, (request, replicas))
            .map(|(r,)| r)
    }

    pub fn on_events(&mut self, events: WitCacheEvents<'_>) -> Result<(), CallError> {
        self.call::<_, ()>(1, (events,))
    }

    pub fn choose_victims(&mut self, count: u32, step: u64) -> Result<Option<Vec<u32>>, CallError> {
        self.call::<_, (Option<Vec<u32>>,)>(2, (count, step))
            .map(|(r,)| r)
    }

    pub fn sample(&mut self, batch: WitSamplerBatch<'_>) -> Result<Option<Vec<u32>>, CallError> {
        self.call::<_, (Option<Vec<u32>>,)>(1, (batch,))
            .map(|(r,)| r)
    }
}

/// The `constraining` interface (0.2.0).
impl Instance {
    pub fn open(&mut self, kind: &str, grammar: &str) -> Result<Result<u32, String>, CallError> {
        self.call::<_, (Result<u32, String>,)>(1, (kind, grammar))
            .map(|(r,)| r)
    }

    pub fn next(
        &mut self,
        matcher: u32,
        tokens: &[u32],
    ) -> Result<Result<Vec<u32>, String>, CallError> {
        self.call::<_, (Result<Vec<u32>, String>,)>(2, (matcher, tokens))
            .map(|(r,)| r)
    }

    pub fn rollback(&mut self, matcher: u32, count: u32) -> Result<Result<(), String>, CallError> {
        self.call::<_, (Result<(), String>,)>(3, (matcher, count))
            .map(|(r,)| r)
    }

    pub fn close(&mut self, matcher: u32) -> Result<(), CallError> {
        self.call::<_, ()>(4, (matcher,))
    }
}

/// The `parsing` interface (0.2.0).
impl Instance {
    pub fn formats(&mut self) -> Result<(Vec<String>, Vec<String>), CallError> {
        self.call::<(), ((Vec<String>, Vec<String>),)>(1, ())
            .map(|(r,)| r)
    }

    pub fn open_parser(
        &mut self,
        request: WitParseRequest<'_>,
    ) -> Result<Result<u32, String>, CallError> {
        self.call::<_, (Result<u32, String>,)>(2, (request,))
            .map(|(r,)| r)
    }

    pub fn feed(&mut self, parser: u32, text: &str) -> Result<WitParsed, CallError> {
        self.call::<_, (WitParsed,)>(3, (parser, text))
            .map(|(r,)| r)
    }

    pub fn finish(&mut self, parser: u32) -> Result<WitParsed, CallError> {
        self.call::<_, (WitParsed,)>(4, (parser,)).map(|(r,)| r)
    }

    pub fn call_grammar(
        &mut self,
        format: &str,
        tools: &str,
        choice: &str,
        parallel: bool,
    ) -> Result<Result<String, String>, CallError> {
        self.call::<_, (Result<String, String>,)>(5, (format, tools, choice, parallel))
            .map(|(r,)| r)
    }
}
