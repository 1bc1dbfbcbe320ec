//! Test binary: the Wasm policy plugins (built-in and the out-of-workspace test plugins)
//! against their native twins, their limits and fallbacks, and the LRU evictor's contract.
//! See `suite_engine.rs` for why the integration tests are grouped.

// The shared helpers are test code, like the files that declared them before.
#![allow(clippy::unwrap_used)]

mod plugins_support;

#[path = "plugins.rs"]
mod plugins;
#[path = "plugins_lru_contract.rs"]
mod plugins_lru_contract;
