//! Native twins of the built-in policy plugins.
//!
//! Each twin implements its policy trait with the same algorithm source as the built-in Wasm
//! plugin (`chimera-policy-core`), so the two agree bit for bit; a test checks it. Twins are
//! the fallback the Wasm adapters use for any call a plugin cannot answer, and can be chosen
//! directly with `plugin = "native:NAME"`. This module also turns the host's column structs
//! into the borrowed views the algorithms take. Must not depend on wasmtime or plugin glue.

mod agent;
mod lru;
mod router;
mod sampler;

pub use agent::{check_constraint, check_parser, constrainer, parser};

pub use lru::LruEvictor;
pub use router::{LeastLoadedRouter, PrefixAwareRouter, least_loaded};
pub use sampler::DefaultSampler;

use chimera_policy_core::{Config, EventsView, ReplicaView, RouteRequestView, SamplerBatchView};

use super::{CacheEvents, ReplicaColumns, RouteRequest, SamplerBatch};

pub fn replica_view(c: &ReplicaColumns) -> ReplicaView<'_> {
    ReplicaView {
        waiting: &c.waiting,
        running: &c.running,
        free_blocks: &c.free_blocks,
        total_blocks: &c.total_blocks,
        kv_usage: &c.kv_usage,
        prefix_hit_blocks: &c.prefix_hit_blocks,
        ssm_hit_blocks: &c.ssm_hit_blocks,
    }
}

pub fn request_view(r: &RouteRequest) -> RouteRequestView<'_> {
    RouteRequestView {
        prompt_tokens: r.prompt_tokens,
        prompt_blocks: r.prompt_blocks,
        tenant: &r.tenant,
    }
}

pub fn events_view(e: &CacheEvents) -> EventsView<'_> {
    EventsView {
        kinds: &e.kinds,
        blocks: &e.blocks,
        parents: &e.parents,
        steps: &e.steps,
    }
}

pub fn batch_view(b: &SamplerBatch) -> SamplerBatchView<'_> {
    SamplerBatchView {
        k: b.k,
        temperature: &b.temperature,
        top_k: &b.top_k,
        top_p: &b.top_p,
        min_p: &b.min_p,
        seed: &b.seed,
        counter: &b.counter,
        cand_tokens: &b.cand_tokens,
        cand_logits: &b.cand_logits,
    }
}

/// The native router named `name` (`least-loaded`, `prefix-aware`) built from `config`.
pub fn router(name: &str, config: &Config) -> Result<Box<dyn super::Router>, String> {
    match name {
        "least-loaded" => Ok(Box::new(LeastLoadedRouter::from_config(config)?)),
        "prefix-aware" => Ok(Box::new(PrefixAwareRouter::from_config(config)?)),
        other => Err(format!("no native router named `{other}`")),
    }
}

/// The native evictor named `name` (`lru`).
pub fn evictor(name: &str, config: &Config) -> Result<LruEvictor, String> {
    match name {
        "lru" => LruEvictor::from_config(config),
        other => Err(format!("no native evictor named `{other}`")),
    }
}

/// The native sampler named `name` (`default`).
pub fn sampler(name: &str, config: &Config) -> Result<DefaultSampler, String> {
    match name {
        "default" => DefaultSampler::from_config(config),
        other => Err(format!("no native sampler named `{other}`")),
    }
}
