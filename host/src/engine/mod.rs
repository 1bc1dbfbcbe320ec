//! The engine: one synchronous loop per replica (drain commands → schedule → forward → sample
//! → update), DESIGN.md §2.
//!
//! - [`api`]: what the server and router exchange with a replica (handle, commands, events).
//! - [`config`]: the `[engine]` section.
//! - [`scheduler`]: continuous batching with chunked prefill; plain-data output.
//! - [`request`]: per-request token bookkeeping.
//! - [`sampling`]: penalties, top-K candidates, the sampler policy call, logprobs.
//! - [`executor`]: the [`StepExecutor`] seam a model implements; [`mock`] is a model-free one.
//! - [`core`]: [`Engine`], one step over an executor; [`thread`]: [`spawn_engine`].
//! - [`outbox`]: delivery of requests' events, at once or from a delivery thread.
//!
//! The engine owns its caches (through `crate::cache`) and policy instances; it knows no HTTP
//! and no plugin internals, and it holds no lock.

pub mod api;
pub mod config;
pub mod core;
pub mod executor;
pub mod mock;
pub mod model_runner;
pub mod outbox;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod step_plan;
pub mod thread;

pub use config::{EngineConfig, EngineSetup};
pub use core::{Engine, EngineError, Policies, Publisher, StepTimings};
pub use executor::{CacheAllocation, ExecutorError, Logits, StepExecutor, StepKinds};
pub use mock::{MockConfig, MockExecutor};
pub use model_runner::ModelRunner;
pub use sampling::GreedySampler;
pub use thread::{KvEventReceiver, spawn_engine};
