//! Write chimera plugins — routing, eviction and sampling policies, constraints and output
//! parsers — as WebAssembly.
//!
//! A plugin is a type implementing one of [`RouterPlugin`], [`EvictorPlugin`],
//! [`SamplerPlugin`], [`ConstraintPlugin`] or [`ParserPlugin`], plus one export macro
//! ([`export_router!`], [`export_evictor!`], [`export_sampler!`], [`export_constraint!`],
//! [`export_parser!`]). Build the crate as a `cdylib` for `wasm32-unknown-unknown`; chimera
//! loads the resulting `.wasm` directly. Natively the same crate compiles without any glue,
//! so the plugin is unit-tested with plain `cargo test` by calling the trait methods on the
//! column views in [`testing`].
//!
//! The ABI is the WIT package `chimera:plugin@0.2.0` in `wit/v0.2.0/` ([`ABI_VERSION`]).
//! Plugins get no filesystem, network or randomness: use [`math`] for a fast deterministic
//! `exp`/`ln` and [`rng`] for seeded draws. [`host`] has a clock and a logger, each usable
//! only where the operator grants it. The built-in policies are in [`algos`] for reuse.
//!
//! This crate depends on nothing in the chimera host.

#![no_std]

extern crate alloc;
// Lets generated code name this crate the same way from inside and from plugin crates.
extern crate self as chimera_plugin_sdk;

use alloc::string::String;
use alloc::vec::Vec;

pub use chimera_policy_core::columns::{NO_PARENT, event_kind, parsed_kind};
pub use chimera_policy_core::{
    Config, ConfigValue, EventsView, ParseRequestView, Parsed, ReplicaView, RouteRequestView,
    SamplerBatchView, VocabularyView, math, rng,
};

/// The built-in algorithms (least-loaded, prefix-aware, LRU, default sampler) for reuse.
pub mod algos {
    pub use chimera_policy_core::{lru, router, sampler};
}

pub mod testing;

#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod __private;

/// The WIT package version this SDK builds plugins against.
pub const ABI_VERSION: &str = "0.2.0";

/// Host functions (since ABI 0.1.1). Calling one makes the plugin import it, and such a plugin
/// loads only where its TOML section grants it (`grants = ["clock"]`, `grants = ["log"]`); a
/// plugin that calls neither imports nothing. Natively (in tests) the clock
/// reads [`testing::set_now_ns`] and `log` does nothing.
pub mod host {
    use alloc::string::String;

    /// Severity for [`log`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Level {
        Error = 0,
        Warn = 1,
        Info = 2,
        Debug = 3,
    }

    /// Nanoseconds on the host's monotonic clock (arbitrary origin). Grant: `clock`.
    pub fn now_ns() -> u64 {
        #[cfg(target_arch = "wasm32")]
        {
            crate::__private::router::chimera::plugin::host::now_ns()
        }
        #[cfg(not(target_arch = "wasm32"))]
        {
            crate::testing::now_ns()
        }
    }

    /// Writes `message` to the server's log under the plugin's name (rate-limited by the
    /// host). Grant: `log`.
    pub fn log(level: Level, message: &str) {
        #[cfg(target_arch = "wasm32")]
        crate::__private::router::chimera::plugin::host::log(level as u8, message);
        #[cfg(not(target_arch = "wasm32"))]
        let _ = (level, message);
    }

    /// [`log`] with `format!` arguments.
    pub fn log_fmt(level: Level, args: core::fmt::Arguments<'_>) {
        let mut s = String::new();
        let _ = core::fmt::write(&mut s, args);
        log(level, &s);
    }
}

/// A routing policy: picks the replica for each new request.
pub trait RouterPlugin: Sized + 'static {
    /// Builds the plugin from its `config` table; an `Err` message is shown to the operator.
    fn init(config: &Config) -> Result<Self, String>;

    /// A replica index in `0..replicas.len()`, or `None` to let the host decide.
    fn route(&mut self, request: &RouteRequestView<'_>, replicas: &ReplicaView<'_>) -> Option<u32>;
}

/// An eviction policy: keeps its own view of the cache from events and orders victims.
pub trait EvictorPlugin: Sized + 'static {
    fn init(config: &Config) -> Result<Self, String>;

    /// Cache events since the last call, in order (see [`event_kind`]).
    fn on_events(&mut self, events: &EventsView<'_>);

    /// Up to `count` evictable leaf blocks in eviction order, or `None` to let the host decide.
    fn choose_victims(&mut self, count: u32, step: u64) -> Option<Vec<u32>>;
}

/// A sampling policy: picks one token per request among its candidates.
pub trait SamplerPlugin: Sized + 'static {
    fn init(config: &Config) -> Result<Self, String>;

    /// One token per request (each among that request's candidates), or `None`.
    fn sample(&mut self, batch: &SamplerBatchView<'_>) -> Option<Vec<u32>>;
}

/// A constraint (ABI 0.2.0): compiles grammars into matchers and answers, per response and
/// step, the tokens allowed next. One value serves every constrained response of an engine.
pub trait ConstraintPlugin: Sized + 'static {
    /// Builds the plugin from its `config` table and the model's vocabulary.
    fn init(config: &Config, vocabulary: &VocabularyView<'_>) -> Result<Self, String>;

    /// Compiles `grammar` (kind `json-schema`, `regex`, `choice` or `lark`) into a matcher.
    fn open(&mut self, kind: &str, grammar: &str) -> Result<u32, String>;

    /// Advances `matcher` by `tokens` and returns the next position's mask (`ceil(n / 32)`
    /// words, bit `t % 32` of word `t / 32` for token `t`).
    fn next(&mut self, matcher: u32, tokens: &[u32]) -> Result<Vec<u32>, String>;

    /// Takes back the last `count` consumed tokens.
    fn rollback(&mut self, matcher: u32, count: u32) -> Result<(), String>;

    /// The response ended.
    fn close(&mut self, matcher: u32);
}

/// An output parser (ABI 0.2.0): turns each response's streamed text into content, reasoning
/// and tool calls.
pub trait ParserPlugin: Sized + 'static {
    fn init(config: &Config) -> Result<Self, String>;

    /// Tool-call formats, then reasoning formats, that [`ParserPlugin::open`] accepts.
    fn formats(&self) -> (Vec<String>, Vec<String>);

    fn open(&mut self, request: &ParseRequestView<'_>) -> Result<u32, String>;

    fn feed(&mut self, parser: u32, text: &str) -> Parsed;

    fn finish(&mut self, parser: u32) -> Parsed;

    /// A Lark grammar forcing tool calls in `format` (see the WIT `call-grammar`).
    fn call_grammar(
        &self,
        format: &str,
        tools: &str,
        choice: &str,
        parallel: bool,
    ) -> Result<String, String>;
}

/// Exports a [`RouterPlugin`] implementation as the plugin's router (Wasm builds only).
#[macro_export]
macro_rules! export_router {
    ($plugin:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            static PLUGIN: $crate::__private::PluginCell<$plugin> =
                $crate::__private::PluginCell::new();
            struct Export;
            impl $crate::__private::router::exports::chimera::plugin::routing::Guest for Export {
                fn init(
                    config: $crate::__private::alloc::vec::Vec<
                        $crate::__private::router::exports::chimera::plugin::routing::ConfigEntry,
                    >,
                ) -> Result<(), $crate::__private::alloc::string::String> {
                    $crate::__private::router_init(&PLUGIN, config)
                }
                fn route(
                    request: $crate::__private::router::exports::chimera::plugin::routing::RouteRequest,
                    replicas: $crate::__private::router::exports::chimera::plugin::routing::ReplicaColumns,
                ) -> Option<u32> {
                    $crate::__private::router_route(&PLUGIN, request, replicas)
                }
            }
            $crate::__private::router::export!(Export with_types_in $crate::__private::router);
        };
    };
}

/// Exports an [`EvictorPlugin`] implementation as the plugin's evictor (Wasm builds only).
#[macro_export]
macro_rules! export_evictor {
    ($plugin:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            static PLUGIN: $crate::__private::PluginCell<$plugin> =
                $crate::__private::PluginCell::new();
            struct Export;
            impl $crate::__private::evictor::exports::chimera::plugin::eviction::Guest for Export {
                fn init(
                    config: $crate::__private::alloc::vec::Vec<
                        $crate::__private::evictor::exports::chimera::plugin::eviction::ConfigEntry,
                    >,
                ) -> Result<(), $crate::__private::alloc::string::String> {
                    $crate::__private::evictor_init(&PLUGIN, config)
                }
                fn on_events(
                    events: $crate::__private::evictor::exports::chimera::plugin::eviction::CacheEvents,
                ) {
                    $crate::__private::evictor_on_events(&PLUGIN, events)
                }
                fn choose_victims(
                    count: u32,
                    step: u64,
                ) -> Option<$crate::__private::alloc::vec::Vec<u32>> {
                    $crate::__private::evictor_choose(&PLUGIN, count, step)
                }
            }
            $crate::__private::evictor::export!(Export with_types_in $crate::__private::evictor);
        };
    };
}

/// Exports a [`SamplerPlugin`] implementation as the plugin's sampler (Wasm builds only).
#[macro_export]
macro_rules! export_sampler {
    ($plugin:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            static PLUGIN: $crate::__private::PluginCell<$plugin> =
                $crate::__private::PluginCell::new();
            struct Export;
            impl $crate::__private::sampler::exports::chimera::plugin::sampling::Guest for Export {
                fn init(
                    config: $crate::__private::alloc::vec::Vec<
                        $crate::__private::sampler::exports::chimera::plugin::sampling::ConfigEntry,
                    >,
                ) -> Result<(), $crate::__private::alloc::string::String> {
                    $crate::__private::sampler_init(&PLUGIN, config)
                }
                fn sample(
                    batch: $crate::__private::sampler::exports::chimera::plugin::sampling::SamplerBatch,
                ) -> Option<$crate::__private::alloc::vec::Vec<u32>> {
                    $crate::__private::sampler_sample(&PLUGIN, batch)
                }
            }
            $crate::__private::sampler::export!(Export with_types_in $crate::__private::sampler);
        };
    };
}

/// Exports a [`ConstraintPlugin`] implementation as the plugin's constraint (Wasm builds only).
#[macro_export]
macro_rules! export_constraint {
    ($plugin:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            static PLUGIN: $crate::__private::PluginCell<$plugin> =
                $crate::__private::PluginCell::new();
            struct Export;
            impl $crate::__private::constraint::exports::chimera::plugin::constraining::Guest
                for Export
            {
                fn init(
                    config: $crate::__private::alloc::vec::Vec<
                        $crate::__private::constraint::exports::chimera::plugin::constraining::ConfigEntry,
                    >,
                    vocabulary: $crate::__private::constraint::exports::chimera::plugin::constraining::Vocabulary,
                ) -> Result<(), $crate::__private::alloc::string::String> {
                    $crate::__private::constraint_init(&PLUGIN, config, vocabulary)
                }
                fn open(
                    kind: $crate::__private::alloc::string::String,
                    grammar: $crate::__private::alloc::string::String,
                ) -> Result<u32, $crate::__private::alloc::string::String> {
                    $crate::__private::constraint_open(&PLUGIN, kind, grammar)
                }
                fn next(
                    matcher: u32,
                    tokens: $crate::__private::alloc::vec::Vec<u32>,
                ) -> Result<
                    $crate::__private::alloc::vec::Vec<u32>,
                    $crate::__private::alloc::string::String,
                > {
                    $crate::__private::constraint_next(&PLUGIN, matcher, tokens)
                }
                fn rollback(
                    matcher: u32,
                    count: u32,
                ) -> Result<(), $crate::__private::alloc::string::String> {
                    $crate::__private::constraint_rollback(&PLUGIN, matcher, count)
                }
                fn close(matcher: u32) {
                    $crate::__private::constraint_close(&PLUGIN, matcher)
                }
            }
            $crate::__private::constraint::export!(Export with_types_in $crate::__private::constraint);
        };
    };
}

/// Exports a [`ParserPlugin`] implementation as the plugin's parser (Wasm builds only).
#[macro_export]
macro_rules! export_parser {
    ($plugin:ty) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            static PLUGIN: $crate::__private::PluginCell<$plugin> =
                $crate::__private::PluginCell::new();
            struct Export;
            impl $crate::__private::parser::exports::chimera::plugin::parsing::Guest for Export {
                fn init(
                    config: $crate::__private::alloc::vec::Vec<
                        $crate::__private::parser::exports::chimera::plugin::parsing::ConfigEntry,
                    >,
                ) -> Result<(), $crate::__private::alloc::string::String> {
                    $crate::__private::parser_init(&PLUGIN, config)
                }
                fn formats() -> (
                    $crate::__private::alloc::vec::Vec<$crate::__private::alloc::string::String>,
                    $crate::__private::alloc::vec::Vec<$crate::__private::alloc::string::String>,
                ) {
                    $crate::__private::parser_formats(&PLUGIN)
                }
                fn open(
                    request: $crate::__private::parser::exports::chimera::plugin::parsing::ParseRequest,
                ) -> Result<u32, $crate::__private::alloc::string::String> {
                    $crate::__private::parser_open(&PLUGIN, request)
                }
                fn feed(
                    parser: u32,
                    text: $crate::__private::alloc::string::String,
                ) -> $crate::__private::parser::exports::chimera::plugin::parsing::Parsed {
                    $crate::__private::parser_feed(&PLUGIN, parser, text)
                }
                fn finish(
                    parser: u32,
                ) -> $crate::__private::parser::exports::chimera::plugin::parsing::Parsed {
                    $crate::__private::parser_finish(&PLUGIN, parser)
                }
                fn call_grammar(
                    format: $crate::__private::alloc::string::String,
                    tools: $crate::__private::alloc::string::String,
                    choice: $crate::__private::alloc::string::String,
                    parallel: bool,
                ) -> Result<
                    $crate::__private::alloc::string::String,
                    $crate::__private::alloc::string::String,
                > {
                    $crate::__private::parser_call_grammar(&PLUGIN, format, tools, choice, parallel)
                }
            }
            $crate::__private::parser::export!(Export with_types_in $crate::__private::parser);
        };
    };
}
