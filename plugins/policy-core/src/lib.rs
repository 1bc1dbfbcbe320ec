//! The policy algorithms behind chimera's built-in plugins, written once.
//!
//! This crate owns the plain-data column views that mirror the WIT ABI, a deterministic
//! `exp`/`ln`, a seeded RNG, the plugin config accessors, and the four built-in algorithms
//! (least-loaded and prefix-aware routing, LRU eviction, default sampling). It is compiled twice:
//! into each built-in WebAssembly plugin (through `chimera-plugin-sdk`) and into the host as the
//! native twin of that plugin. Because both builds run the same source with the same
//! IEEE-754 single-precision operations (no fused multiply-add, no platform `libm`), the Wasm
//! build and the native twin give bit-identical answers; a host test checks that.
//!
//! Invariants: `no_std` + `alloc`, no I/O, no clock, no global state, no panics on any input
//! (malformed columns yield `None` or an error string).
//! Must not: depend on the host, on wasmtime or on any guest glue.

#![no_std]

extern crate alloc;

pub mod columns;
pub mod config;
pub mod lru;
pub mod math;
pub mod rng;
pub mod router;
pub mod sampler;

pub use columns::{
    EventsView, ParseRequestView, Parsed, ReplicaView, RouteRequestView, SamplerBatchView,
    VocabularyView,
};
pub use config::{Config, ConfigValue};
