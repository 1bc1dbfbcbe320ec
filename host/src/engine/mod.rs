//! The engine: one synchronous loop per replica (drain commands → schedule → forward → sample
//! → update), DESIGN.md §2.
//!
//! - [`api`]: what the server and router exchange with a replica (handle, commands, events).
//! - [`config`]: the `[engine]` section.
//! - [`scheduler`]: continuous batching with chunked prefill; plain-data output.
//! - [`request`]: per-request token bookkeeping.
//! - [`sampling`]: penalties, top-K candidates, the sampler policy call, logprobs.
//! - [`executor`]: the [`StepExecutor`] seam a model implements; [`mock`] is a model-free one.
//! - [`core`]: [`Engine`], one replica over an executor; [`pipeline`]: its steps, as values
//!   moving through two slots (launched, ahead); [`timings`]: where a step's time goes;
//!   [`thread`]: [`spawn_engine`], the loop that drives the pipeline.
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
mod mtp;
mod opening;
pub mod outbox;
pub mod pipeline;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod speculative;
pub mod step_plan;
pub mod thread;
pub mod timings;

pub use config::{EngineConfig, EngineSetup};
pub use core::{Engine, EngineError, Policies, Publisher};
pub use executor::{CacheAllocation, ExecutorError, Logits, MtpSource, StepExecutor, StepKinds};
pub use mock::{MockConfig, MockExecutor};
pub use model_runner::ModelRunner;
pub use pipeline::{Step, StepClock};
pub use thread::{KvEventReceiver, spawn_engine};
pub use timings::StepTimings;
