//! The OpenAI-compatible HTTP server (axum on tokio).
//!
//! Owns: the HTTP surface (`/v1/completions`, `/v1/chat/completions`, their `/render` twins,
//! `/v1/models`, `/tokenize`, `/detokenize`, `/health`, `/metrics`, `/admin/*`), request admission (a bounded number of engine requests in flight,
//! a bounded body size), tokenization off the event loop, the replica [`router`], and graceful
//! shutdown. It talks to engines only through `EngineHandle`s behind the router; it never
//! touches caches, schedulers or models.
//!
//! Wiring: build an [`AppState`] from [`AppParts`] (config, model facts, tokenizer, replicas,
//! routing policy) inside a tokio runtime, then [`serve`] it on a bound listener. The replicas
//! are engine threads (`engine::spawn_engine`); tests run them over the model-free
//! `engine::MockExecutor`, so the server is always tested against the real engine.
//!
//! Decisions: unknown JSON fields are ignored with a warning in the log (OpenAI's SDKs send
//! fields newer than any server), but known fields this server does not implement (`tools`,
//! `logit_bias`, `suffix`, non-text `response_format`, non-text content parts) are rejected
//! with 400 `unsupported`. Overload (admission limit or a full engine queue) is 503 with
//! `Retry-After`; the `openai` SDK retries it like 429. `model` may be omitted; a name that is
//! not one of the served names is 404 (the message lists them). `max_tokens` omitted means 16
//! on `/v1/completions` (OpenAI's and vLLM's default) and the rest of the context on chat.
//! With `server.api_key` set, `/v1/*` needs it as a bearer token (401 otherwise).
//!
//! Module map: [`config`] (`[server]`), [`error`] (the one error → HTTP mapping), [`protocol`]
//! (OpenAI shapes), [`params`] (validation), [`text`] (tokenizer, chat template), [`detok`]
//! (incremental detokenizer, stop strings), [`pipeline`] (one engine request → chunks),
//! [`respond`] (JSON / SSE bodies), [`openai`] (handlers), [`ops`] (health, metrics, admin),
//! [`router`] + [`prefix_mirror`] (replica choice), [`metrics`], and [`mock_tokenizer`] (a
//! small tokenizer for tests).

pub mod agent;
pub mod config;
pub mod detok;
pub mod error;
pub mod metrics;
pub mod mock_tokenizer;
pub mod openai;
pub mod ops;
pub mod output;
pub mod params;
pub mod pipeline;
pub mod prefix_mirror;
pub mod protocol;
pub mod respond;
pub mod router;
pub mod stats_log;
pub mod text;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router as HttpRouter;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

pub use config::{ConfigError, ServerConfig};
pub use error::AppError;
pub use router::{Replica, RouterHandle};
pub use text::TextCodec;

use metrics::{CacheInfo, Metrics};
use params::Limits;

/// Facts about the served model the server needs.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The model's id: what responses carry unless `server.served_model_name` says otherwise.
    pub name: String,
    /// Other ids the API accepts for it (e.g. the short name of `builtin:tiny-hybrid`).
    pub aliases: Vec<String>,
    /// Longest prompt + output, in tokens.
    pub max_model_len: u32,
    /// KV block size, for prefix hashing and `cache_config_info`.
    pub block_size: u32,
    /// Salt of the cache's block hashes (the model id; must match the engines').
    pub cache_salt: String,
    pub num_blocks: u32,
    pub prefix_caching: bool,
    /// The engines admit by `priority` (`engine.scheduling_policy = "priority"`).
    pub priority_scheduling: bool,
}

/// Hooks the admin endpoints call; the binary supplies them.
pub trait AdminHooks: Send + Sync {
    /// Reloads the policy plugins configured as `.wasm` files from their paths (only the one
    /// of kind `only` when given: `router`, `evictor` or `sampler`); returns a short summary.
    fn reload_plugins(&self, only: Option<&str>) -> Result<String, ReloadError>;
}

/// Why a plugin reload failed; the old plugins keep serving either way.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReloadError {
    /// The request or the plugin it reloads is at fault: an unknown or built-in plugin kind,
    /// a file that cannot be read or is not a usable plugin (not Wasm, wrong kind or ABI), a
    /// configuration the plugin rejects. Answered 400.
    #[error("{0}")]
    BadRequest(String),
    /// The server failed (the plugin runtime, a worker thread). Answered 500.
    #[error("{0}")]
    Internal(String),
}

/// Everything needed to start serving.
pub struct AppParts {
    pub config: ServerConfig,
    pub model: ModelInfo,
    pub codec: TextCodec,
    pub replicas: Vec<Replica>,
    pub policy: Box<dyn crate::policy::Router>,
    pub admin_hooks: Option<Arc<dyn AdminHooks>>,
    /// Makes parser plugin instances (one per output pass, one for the request path); `None`:
    /// responses are never parsed and requests that need a parser get 400.
    pub parsers: Option<ParserFactory>,
    /// A constraint plugin instance that checks requests' grammars before they reach an
    /// engine, and its mask words per position; `None`: grammars are checked by the engines
    /// only.
    pub grammar_check: Option<(Box<dyn crate::policy::Constrainer>, usize)>,
}

impl AppParts {
    /// Whether the model keeps recurrent state (its replicas hold SSM slots): what decides
    /// how cache blocks are announced to external prefix routers.
    pub fn is_hybrid(&self) -> bool {
        self.replicas
            .first()
            .is_some_and(|r| r.handle.stats().ssm_slots_total > 0)
    }
}

/// Makes a parser plugin instance.
pub type ParserFactory = Arc<dyn Fn() -> Box<dyn crate::policy::OutputParser> + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("the server needs at least one engine replica")]
    NoReplicas,
    #[error("server I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Shared, immutable server state (plus atomics); cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub config: ServerConfig,
    pub model: ModelInfo,
    /// Ids accepted in `model`; the first is the one responses carry.
    pub served_names: Vec<String>,
    /// How many of `served_names` `/v1/models` lists: all that `served_model_name` gave, or
    /// only the model path when they are the defaults (its short name is an accepted alias,
    /// not a second model).
    pub listed_names: usize,
    pub codec: Arc<TextCodec>,
    pub router: RouterHandle,
    /// The output pass of each replica, by replica index.
    pub outputs: Vec<output::OutputPass>,
    pub metrics: Arc<Metrics>,
    pub admission: Arc<Semaphore>,
    pub limits: Limits,
    pub created: u64,
    pub admin_hooks: Option<Arc<dyn AdminHooks>>,
    /// The tool-call and reasoning formats responses are parsed in.
    pub formats: agent::Formats,
    /// A parser plugin instance for the request path (forced tool calls' grammars).
    pub request_parser: Option<std::sync::Mutex<Box<dyn crate::policy::OutputParser>>>,
    /// Compiles each request's grammar once before it is submitted (see `agent::check`).
    pub grammar_check: Option<Arc<std::sync::Mutex<Box<dyn crate::policy::Constrainer>>>>,
    /// Mask words per position of `grammar_check`.
    pub constraint_words: usize,
    next_id: AtomicU64,
    /// Random per process: response ids (`cmpl-…`) never repeat across restarts.
    id_key: u64,
    shutting_down: AtomicBool,
    abort_tx: watch::Sender<bool>,
}

/// 64 random bits from the OS, through the standard library's randomly keyed hasher.
fn random_key() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// SplitMix64's finaliser: a bijection on u64 that scatters consecutive inputs.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The names the model is served under, and how many of them `/v1/models` lists: the
/// configured `served_model_name`s, else the model's name and its aliases (only the name
/// listed).
fn served_names(config: &ServerConfig, model: &ModelInfo) -> (Vec<String>, usize) {
    if let Some(names) = &config.served_model_name {
        let names = names.names();
        let listed = names.len();
        return (names, listed);
    }
    let mut names = vec![model.name.clone()];
    for alias in &model.aliases {
        if !names.contains(alias) {
            names.push(alias.clone());
        }
    }
    (names, 1)
}

impl AppState {
    /// Validates the config and starts the router actor (needs a tokio runtime).
    pub fn new(parts: AppParts) -> Result<Self, ServeError> {
        parts.config.validate()?;
        if parts.replicas.is_empty() {
            return Err(ServeError::NoReplicas);
        }
        let metrics = Arc::new(Metrics::new(parts.replicas.len()));
        let outputs = (0..parts.replicas.len())
            .map(|r| output::OutputPass::spawn(r, parts.parsers.as_ref().map(|make| make())))
            .collect::<Result<Vec<_>, _>>()?;
        let formats = agent::Formats::resolve(
            parts.config.tool_call_parser.as_deref(),
            parts.config.reasoning_parser.as_deref(),
            parts.codec.chat_template(),
        );
        let request_parser = parts
            .parsers
            .as_ref()
            .map(|make| std::sync::Mutex::new(make()));
        let router = RouterHandle::spawn(
            parts.replicas,
            parts.policy,
            metrics.clone(),
            parts.model.block_size,
            parts.config.router_mirror_max_blocks as usize,
        );
        let limits = Limits {
            max_n: parts.config.max_choices_per_request,
            max_stop_strings: parts.config.max_stop_strings as usize,
            max_stop_len: parts.config.max_stop_len as usize,
            max_logprobs: parts.config.max_logprobs,
            vocab_size: parts.codec.vocab_size(),
            max_model_len: parts.model.max_model_len,
            priority_scheduling: parts.model.priority_scheduling,
        };
        let (served_names, listed_names) = served_names(&parts.config, &parts.model);
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let (abort_tx, _) = watch::channel(false);
        Ok(Self {
            inner: Arc::new(Inner {
                admission: Arc::new(Semaphore::new(parts.config.max_queued_requests as usize)),
                config: parts.config,
                model: parts.model,
                served_names,
                listed_names,
                codec: Arc::new(parts.codec),
                router,
                outputs,
                metrics,
                limits,
                created,
                admin_hooks: parts.admin_hooks,
                formats,
                request_parser,
                constraint_words: parts.grammar_check.as_ref().map_or(0, |c| c.1),
                grammar_check: parts
                    .grammar_check
                    .map(|(c, _)| Arc::new(std::sync::Mutex::new(c))),
                next_id: AtomicU64::new(1),
                id_key: random_key(),
                shutting_down: AtomicBool::new(false),
                abort_tx,
            }),
        })
    }

    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// The model id responses carry (the first served name).
    pub fn model_id(&self) -> &str {
        self.inner
            .served_names
            .first()
            .map_or(self.inner.model.name.as_str(), String::as_str)
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    pub fn router(&self) -> &RouterHandle {
        &self.inner.router
    }

    pub fn config(&self) -> &ServerConfig {
        &self.inner.config
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.inner.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// A response id, `{prefix}-` and 32 hex digits: the process's random key and a counter
    /// mixed through a bijection, so ids are unique within a process and, with overwhelming
    /// probability, across restarts and replicas of the server (as vLLM's random ids).
    pub(crate) fn response_id(&self, prefix: &str) -> String {
        let n = self.next_id();
        let key = self.inner.id_key;
        format!(
            "{prefix}-{:016x}{:016x}",
            mix64(key ^ n),
            mix64(n.wrapping_add(key.rotate_left(17)))
        )
    }

    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutting_down.load(Ordering::SeqCst)
    }

    pub(crate) fn abort_rx(&self) -> watch::Receiver<bool> {
        self.inner.abort_tx.subscribe()
    }

    /// Stops admitting work (new requests get 503).
    pub fn begin_shutdown(&self) {
        self.inner.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Cancels every request still running (they end with finish_reason "abort").
    pub fn abort_in_flight(&self) {
        self.inner.abort_tx.send_replace(true);
    }

    pub(crate) fn cache_info(&self) -> CacheInfo {
        CacheInfo {
            block_size: self.inner.model.block_size,
            num_gpu_blocks: self.inner.model.num_blocks,
            prefix_caching: self.inner.model.prefix_caching,
        }
    }
}

/// The axum router with every endpoint, the body limit and JSON fallbacks.
pub fn build_router(state: AppState) -> HttpRouter {
    let limit = state.inner.config.max_body_bytes;
    HttpRouter::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/completions/render", post(openai::render_completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/chat/completions/render", post(openai::render_chat))
        .route("/v1/models", get(openai::models))
        .route("/version", get(ops::version))
        .route("/tokenize", post(openai::tokenize))
        .route("/detokenize", post(openai::detokenize))
        .route("/health", get(ops::health))
        .route("/metrics", get(ops::metrics))
        .route("/admin/reset_prefix_cache", post(ops::reset_prefix_cache))
        .route("/admin/reload_plugins", post(ops::reload_plugins))
        .fallback(ops::not_found)
        .method_not_allowed_fallback(ops::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            ops::require_api_key,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            ops::count_errors,
        ))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Serves until Ctrl-C / SIGTERM, then shuts down gracefully.
pub async fn serve(state: AppState, listener: TcpListener) -> Result<(), ServeError> {
    serve_with_shutdown(state, listener, shutdown_signal()).await
}

/// Serves until `signal` completes; accepted connections set `TCP_NODELAY`. Then: new requests get 503, in-flight requests get
/// `shutdown_grace_secs` to finish, the rest are cancelled (finish_reason "abort"), and the
/// function returns once every connection is closed.
pub async fn serve_with_shutdown(
    state: AppState,
    listener: TcpListener,
    signal: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let app = build_router(state.clone());
    stats_log::spawn(
        state.router().clone(),
        Duration::from_secs(u64::from(state.inner.config.stats_log_interval_secs)),
    );
    let grace = Duration::from_secs(u64::from(state.inner.config.shutdown_grace_secs));
    let on_signal = {
        let state = state.clone();
        async move {
            signal.await;
            tracing::info!("shutting down: draining in-flight requests");
            state.begin_shutdown();
            let state = state.clone();
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                state.abort_in_flight();
            });
        }
    };
    // Streamed events are small writes: with Nagle's algorithm each would wait for the
    // client's delayed ACK (~40 ms) on a reused connection.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("cannot set TCP_NODELAY on an accepted connection: {e}");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(on_signal)
        .await?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
