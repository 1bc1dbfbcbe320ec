//! Test binary: the engine and the models (parity with transformers, the engine over real
//! models and the mock executor, its thread, cache memory, model sources: hub and GGUF).
//!
//! The integration tests are grouped into a few binaries (`autotests = false` in Cargo.toml):
//! each test binary links the whole crate and its dependencies, so twenty of them cost
//! gigabytes of disk and link time. Each file keeps its own helpers (`mod engine_common;` …)
//! and runs as a module here; `cargo test -p chimera --test suite_engine parity::` runs one.

#[path = "cache_memory.rs"]
mod cache_memory;
#[path = "engine_behaviour.rs"]
mod engine_behaviour;
#[path = "engine_models.rs"]
mod engine_models;
#[path = "engine_thread.rs"]
mod engine_thread;
#[path = "model_sources.rs"]
mod model_sources;
#[path = "parity.rs"]
mod parity;
