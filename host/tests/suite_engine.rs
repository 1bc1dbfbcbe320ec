//! Test binary: the engine and the models (parity with transformers, the engine over real
//! models and the mock executor, its thread, model sources: hub and GGUF).
//!
//! The integration tests are grouped into a few binaries (`autotests = false` in Cargo.toml):
//! each test binary links the whole crate and its dependencies, so twenty of them cost
//! gigabytes of disk and link time. Each file runs as a module here and reaches the shared
//! helpers, declared once below, as `crate::engine_common` …; `cargo test -p chimera --test
//! suite_engine parity::` runs one file's tests.

// The shared helpers are test code, like the files that declared them before.
#![allow(clippy::unwrap_used)]

mod engine_common;
mod sources_support;

#[path = "engine_behaviour.rs"]
mod engine_behaviour;
#[path = "engine_models.rs"]
mod engine_models;
#[path = "engine_mtp.rs"]
mod engine_mtp;
#[path = "engine_speculative.rs"]
mod engine_speculative;
#[path = "engine_thread.rs"]
mod engine_thread;
#[path = "model_fp8.rs"]
mod model_fp8;
#[path = "model_sources.rs"]
mod model_sources;
#[path = "parity.rs"]
mod parity;
