//! chimera: a serving platform for hybrid Transformer/SSM language models.
//!
//! The crate is both the `chimera` binary and a library so that integration tests and
//! benchmarks can drive each part directly. Module map (see DESIGN.md):
//!
//! - [`model`]: Hugging Face model loading and the architectures, written once over the
//!   [`backend::Backend`] seam; the forward pass takes batch inputs and caches as arguments.
//! - [`backend`]: tensor storage and kernels (`cpu` reference backend, `cuda` on NVIDIA
//!   GPUs with the kernels of the `chimera-kernels` crate).
//! - [`cache`]: the KV block pool, prefix index and SSM-state pool of one replica.
//! - [`cluster`]: what chimera tells cluster routers (Dynamo, llm-d) about its caches.
//! - [`server`]: the OpenAI-compatible HTTP server, replica router and metrics.
//! - [`tokenizer`]: the embedded model's tokenizer files.
//! - [`config`]: the TOML configuration; [`cli`]: the engine flags the binaries share; [`app`]: assembling a serving process from it;
//!   [`logging`]: the binary's log output (text or JSON, filter, colour); [`histogram`]: the
//!   lock-free histogram behind the latency metrics.
//! - [`plugins`]: WebAssembly policy plugins (load, sandbox, fall back, reload) behind the
//!   [`policy`] traits, whose native twins live in `policy::native`.
//! - [`bench`]: `chimera bench`, a load generator for OpenAI-compatible streaming servers.
//!
//! The GPU suites (kernels and models against the CPU, speed against ceilings measured in the
//! same run) are the `chimera-gpu-check` crate and binary (`host/gpu-check`), built on this
//! library.

pub mod app;
pub mod backend;
/// `chimera bench` lives in its own crate (it talks to servers only over HTTP).
pub use chimera_bench as bench;
pub mod cache;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod engine;
pub mod histogram;
pub mod logging;
pub mod model;
pub mod plugins;
pub mod policy;
pub mod server;
mod slab;
pub mod tokenizer;
