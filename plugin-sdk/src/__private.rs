//! Guest glue behind the export macros (Wasm builds only; not part of the public API).
//!
//! Owns the generated WIT bindings of the five worlds, the single plugin instance of a
//! module ([`PluginCell`]) and the conversions from the lists the canonical ABI hands over to
//! the borrowed column views the traits take. Lists arrive as owned `Vec`s that the ABI
//! allocated in our memory, so building a view copies nothing.

pub mod alloc {
    pub use ::alloc::{string, vec};
}
pub use wit_bindgen;

use alloc::string::String;
use alloc::vec::Vec;
use core::cell::UnsafeCell;

use crate::{
    Config, ConfigValue, ConstraintPlugin, EventsView, EvictorPlugin, ParseRequestView, Parsed,
    ParserPlugin, ReplicaView, RouteRequestView, RouterPlugin, SamplerBatchView, SamplerPlugin,
    VocabularyView,
};

pub mod router {
    wit_bindgen::generate!({
        path: "wit/v0.2.0",
        world: "router",
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "chimera_plugin_sdk::__private::router",
        runtime_path: "chimera_plugin_sdk::__private::wit_bindgen::rt",
    });
}

pub mod evictor {
    wit_bindgen::generate!({
        path: "wit/v0.2.0",
        world: "evictor",
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "chimera_plugin_sdk::__private::evictor",
        runtime_path: "chimera_plugin_sdk::__private::wit_bindgen::rt",
    });
}

pub mod sampler {
    wit_bindgen::generate!({
        path: "wit/v0.2.0",
        world: "sampler",
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "chimera_plugin_sdk::__private::sampler",
        runtime_path: "chimera_plugin_sdk::__private::wit_bindgen::rt",
    });
}

pub mod constraint {
    wit_bindgen::generate!({
        path: "wit/v0.2.0",
        world: "constraint",
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "chimera_plugin_sdk::__private::constraint",
        runtime_path: "chimera_plugin_sdk::__private::wit_bindgen::rt",
    });
}

pub mod parser {
    wit_bindgen::generate!({
        path: "wit/v0.2.0",
        world: "parser",
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "chimera_plugin_sdk::__private::parser",
        runtime_path: "chimera_plugin_sdk::__private::wit_bindgen::rt",
    });
}

use constraint::exports::chimera::plugin::constraining as cn;
use evictor::exports::chimera::plugin::eviction as ev;
use parser::exports::chimera::plugin::parsing as ps;
use router::exports::chimera::plugin::routing as rt;
use sampler::exports::chimera::plugin::sampling as sm;

/// The module's one plugin instance, created by `init`.
pub struct PluginCell<T>(UnsafeCell<Option<T>>);

// SAFETY: a `wasm32-unknown-unknown` plugin runs on one thread and its imports (clock, log)
// never call back into it, so an export can never be re-entered while another runs; the cell
// is never shared across threads.
unsafe impl<T> Sync for PluginCell<T> {}

impl<T> PluginCell<T> {
    pub const fn new() -> Self {
        Self(UnsafeCell::new(None))
    }

    fn set(&self, value: T) {
        // SAFETY: single-threaded and non-reentrant (see the `Sync` impl); no reference into
        // the cell outlives this call.
        unsafe { *self.0.get() = Some(value) }
    }

    fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        // SAFETY: as in `set`; the `&mut` lives only for this call.
        unsafe { (*self.0.get()).as_mut().map(f) }
    }
}

impl<T> Default for PluginCell<T> {
    fn default() -> Self {
        Self::new()
    }
}

macro_rules! config_from {
    ($module:ident, $entries:expr) => {
        Config::new(
            $entries
                .into_iter()
                .map(|e| {
                    let v = match e.value {
                        $module::ConfigValue::Boolean(b) => ConfigValue::Boolean(b),
                        $module::ConfigValue::Integer(i) => ConfigValue::Integer(i),
                        $module::ConfigValue::Float(f) => ConfigValue::Float(f),
                        $module::ConfigValue::Text(s) => ConfigValue::Text(s),
                    };
                    (e.key, v)
                })
                .collect(),
        )
    };
}

pub fn router_init<P: RouterPlugin>(
    cell: &PluginCell<P>,
    config: Vec<rt::ConfigEntry>,
) -> Result<(), String> {
    cell.set(P::init(&config_from!(rt, config))?);
    Ok(())
}

pub fn router_route<P: RouterPlugin>(
    cell: &PluginCell<P>,
    request: rt::RouteRequest,
    r: rt::ReplicaColumns,
) -> Option<u32> {
    let request = RouteRequestView {
        prompt_tokens: request.prompt_tokens,
        prompt_blocks: request.prompt_blocks,
        tenant: &request.tenant,
    };
    let replicas = ReplicaView {
        waiting: &r.waiting,
        running: &r.running,
        free_blocks: &r.free_blocks,
        total_blocks: &r.total_blocks,
        kv_usage: &r.kv_usage,
        prefix_hit_blocks: &r.prefix_hit_blocks,
        ssm_hit_blocks: &r.ssm_hit_blocks,
    };
    cell.with(|p| p.route(&request, &replicas)).flatten()
}

pub fn evictor_init<P: EvictorPlugin>(
    cell: &PluginCell<P>,
    config: Vec<ev::ConfigEntry>,
) -> Result<(), String> {
    cell.set(P::init(&config_from!(ev, config))?);
    Ok(())
}

pub fn evictor_on_events<P: EvictorPlugin>(cell: &PluginCell<P>, e: ev::CacheEvents) {
    let events = EventsView {
        kinds: &e.kinds,
        blocks: &e.blocks,
        parents: &e.parents,
        steps: &e.steps,
    };
    cell.with(|p| p.on_events(&events));
}

pub fn evictor_choose<P: EvictorPlugin>(
    cell: &PluginCell<P>,
    count: u32,
    step: u64,
) -> Option<Vec<u32>> {
    cell.with(|p| p.choose_victims(count, step)).flatten()
}

pub fn sampler_init<P: SamplerPlugin>(
    cell: &PluginCell<P>,
    config: Vec<sm::ConfigEntry>,
) -> Result<(), String> {
    cell.set(P::init(&config_from!(sm, config))?);
    Ok(())
}

pub fn sampler_sample<P: SamplerPlugin>(
    cell: &PluginCell<P>,
    b: sm::SamplerBatch,
) -> Option<Vec<u32>> {
    let batch = SamplerBatchView {
        k: b.k,
        temperature: &b.temperature,
        top_k: &b.top_k,
        top_p: &b.top_p,
        min_p: &b.min_p,
        seed: &b.seed,
        counter: &b.counter,
        cand_tokens: &b.cand_tokens,
        cand_logits: &b.cand_logits,
    };
    cell.with(|p| p.sample(&batch)).flatten()
}

/// A call into a plugin whose `init` has not run (or failed): the host never makes one.
const NOT_INITIALISED: &str = "the plugin was not initialised";

pub fn constraint_init<P: ConstraintPlugin>(
    cell: &PluginCell<P>,
    config: Vec<cn::ConfigEntry>,
    v: cn::Vocabulary,
) -> Result<(), String> {
    let vocabulary = VocabularyView {
        bytes: &v.bytes,
        ends: &v.ends,
        special: &v.special,
        eos: v.eos,
    };
    cell.set(P::init(&config_from!(cn, config), &vocabulary)?);
    Ok(())
}

pub fn constraint_open<P: ConstraintPlugin>(
    cell: &PluginCell<P>,
    kind: String,
    grammar: String,
) -> Result<u32, String> {
    cell.with(|p| p.open(&kind, &grammar))
        .unwrap_or_else(|| Err(NOT_INITIALISED.into()))
}

pub fn constraint_next<P: ConstraintPlugin>(
    cell: &PluginCell<P>,
    matcher: u32,
    tokens: Vec<u32>,
) -> Result<Vec<u32>, String> {
    cell.with(|p| p.next(matcher, &tokens))
        .unwrap_or_else(|| Err(NOT_INITIALISED.into()))
}

pub fn constraint_rollback<P: ConstraintPlugin>(
    cell: &PluginCell<P>,
    matcher: u32,
    count: u32,
) -> Result<(), String> {
    cell.with(|p| p.rollback(matcher, count))
        .unwrap_or_else(|| Err(NOT_INITIALISED.into()))
}

pub fn constraint_close<P: ConstraintPlugin>(cell: &PluginCell<P>, matcher: u32) {
    cell.with(|p| p.close(matcher));
}

pub fn parser_init<P: ParserPlugin>(
    cell: &PluginCell<P>,
    config: Vec<ps::ConfigEntry>,
) -> Result<(), String> {
    cell.set(P::init(&config_from!(ps, config))?);
    Ok(())
}

pub fn parser_formats<P: ParserPlugin>(cell: &PluginCell<P>) -> (Vec<String>, Vec<String>) {
    cell.with(|p| p.formats()).unwrap_or_default()
}

pub fn parser_open<P: ParserPlugin>(
    cell: &PluginCell<P>,
    r: ps::ParseRequest,
) -> Result<u32, String> {
    let request = ParseRequestView {
        tool_format: &r.tool_format,
        reasoning_format: &r.reasoning_format,
        reasoning_open: r.reasoning_open,
        tools: &r.tools,
    };
    cell.with(|p| p.open(&request))
        .unwrap_or_else(|| Err(NOT_INITIALISED.into()))
}

fn parsed_out(p: Parsed) -> ps::Parsed {
    ps::Parsed {
        kinds: p.kinds,
        calls: p.calls,
        texts: p.texts,
    }
}

pub fn parser_feed<P: ParserPlugin>(cell: &PluginCell<P>, parser: u32, text: String) -> ps::Parsed {
    parsed_out(cell.with(|p| p.feed(parser, &text)).unwrap_or_default())
}

pub fn parser_finish<P: ParserPlugin>(cell: &PluginCell<P>, parser: u32) -> ps::Parsed {
    parsed_out(cell.with(|p| p.finish(parser)).unwrap_or_default())
}

pub fn parser_call_grammar<P: ParserPlugin>(
    cell: &PluginCell<P>,
    format: String,
    tools: String,
    choice: String,
    parallel: bool,
) -> Result<String, String> {
    cell.with(|p| p.call_grammar(&format, &tools, &choice, parallel))
        .unwrap_or_else(|| Err(NOT_INITIALISED.into()))
}
