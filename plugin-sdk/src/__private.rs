//! Guest glue behind the export macros (Wasm builds only; not part of the public API).
//!
//! Owns the generated WIT bindings of the three worlds, the single plugin instance of a
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
    Config, ConfigValue, EventsView, EvictorPlugin, ReplicaView, RouteRequestView, RouterPlugin,
    SamplerBatchView, SamplerPlugin,
};

pub mod router {
    wit_bindgen::generate!({
        path: "wit/v0.1.1",
        world: "router",
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "chimera_plugin_sdk::__private::router",
        runtime_path: "chimera_plugin_sdk::__private::wit_bindgen::rt",
    });
}

pub mod evictor {
    wit_bindgen::generate!({
        path: "wit/v0.1.1",
        world: "evictor",
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "chimera_plugin_sdk::__private::evictor",
        runtime_path: "chimera_plugin_sdk::__private::wit_bindgen::rt",
    });
}

pub mod sampler {
    wit_bindgen::generate!({
        path: "wit/v0.1.1",
        world: "sampler",
        pub_export_macro: true,
        export_macro_name: "export",
        default_bindings_module: "chimera_plugin_sdk::__private::sampler",
        runtime_path: "chimera_plugin_sdk::__private::wit_bindgen::rt",
    });
}

use evictor::exports::chimera::plugin::eviction as ev;
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
