//! Wasm plugin adapters: the policy traits implemented over a plugin instance.
//!
//! Each adapter owns one instance slot (one per replica for the evictor and sampler) and the
//! native twin used as its fallback. Per call it: switches to a reloaded plugin if there is
//! one, calls the plugin under its deadline and memory limit, validates the answer, and on any
//! failure answers with the native twin, counts the fallback by reason and logs the first of
//! each reason. A failed instance is dropped and re-created at the next call. Every call that
//! reaches the plugin is timed into its latency histogram. The adapters
//! always return `Decision::Use` when the twin has an answer, so callers see one concrete
//! answer per call. Must not panic on any plugin behaviour.

use std::sync::Arc;
use std::time::Instant;

use super::abi::{WitCacheEvents, WitReplicaColumns, WitRouteRequest, WitSamplerBatch};
use super::instance::CallError;
use super::metrics::{FallbackReason, PluginCounters};
use super::slot::{PluginHandle, QUARANTINE_AFTER, Slot};
use crate::policy::native::LruEvictor;
use crate::policy::{
    CacheEvents, Decision, Evictor, ReplicaColumns, RouteRequest, Router, Sampler, SamplerBatch,
};

/// Shared bookkeeping of the three adapters.
pub(super) struct Guard {
    pub(super) slot: Slot,
    pub(super) counters: Arc<PluginCounters>,
}

impl Guard {
    pub(super) fn new(handle: Arc<PluginHandle>, counters: Arc<PluginCounters>) -> Self {
        Self {
            slot: Slot::new(handle),
            counters,
        }
    }

    /// Records a failed call: count, log once, drop the instance if it may be poisoned, and
    /// quarantine the plugin after repeated failures.
    pub(super) fn failed(&mut self, e: &CallError) {
        self.counters.record_fallback(e.reason, &e.detail);
        let poisoned = match e.reason {
            FallbackReason::Trap | FallbackReason::Timeout | FallbackReason::Memory => true,
            // Skipped while quarantined, or already counted by the slot.
            FallbackReason::Quarantined | FallbackReason::Unavailable => return,
            FallbackReason::Invalid | FallbackReason::Declined => false,
        };
        self.strike(poisoned);
    }

    /// Records an answer the host cannot use; `Declined` is a legitimate answer, not a failure.
    pub(super) fn rejected(&mut self, reason: FallbackReason, detail: &dyn std::fmt::Display) {
        self.counters.record_fallback(reason, detail);
        if reason == FallbackReason::Declined {
            self.slot.succeeded();
        } else {
            self.strike(false);
        }
    }

    fn strike(&mut self, poisoned: bool) {
        if let Some(length) = self.slot.failed(poisoned) {
            tracing::warn!(
                plugin = %self.counters.plugin(),
                failures = QUARANTINE_AFTER,
                quarantine_ms = length.as_millis() as u64,
                "plugin failed calls in a row; not calling it for a while (the native default answers)"
            );
        }
    }

    /// Records a good answer.
    pub(super) fn ok(&mut self) {
        self.slot.succeeded();
    }
}

/// Runs one call into a plugin instance and records its latency.
pub(super) fn timed<T>(counters: &PluginCounters, call: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = call();
    counters.record_latency(start.elapsed());
    out
}

pub(crate) fn route_args<'a>(
    request: &'a RouteRequest,
    r: &'a ReplicaColumns,
) -> (WitRouteRequest<'a>, WitReplicaColumns<'a>) {
    (
        WitRouteRequest {
            prompt_tokens: request.prompt_tokens,
            prompt_blocks: request.prompt_blocks,
            tenant: &request.tenant,
        },
        WitReplicaColumns {
            waiting: &r.waiting,
            running: &r.running,
            free_blocks: &r.free_blocks,
            total_blocks: &r.total_blocks,
            kv_usage: &r.kv_usage,
            prefix_hit_blocks: &r.prefix_hit_blocks,
            ssm_hit_blocks: &r.ssm_hit_blocks,
        },
    )
}

pub(crate) fn events_arg(e: &CacheEvents) -> WitCacheEvents<'_> {
    WitCacheEvents {
        kinds: &e.kinds,
        blocks: &e.blocks,
        parents: &e.parents,
        steps: &e.steps,
    }
}

pub(crate) fn batch_arg(b: &SamplerBatch) -> WitSamplerBatch<'_> {
    WitSamplerBatch {
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

// ---------------------------------------------------------------------------------------------
// Router
// ---------------------------------------------------------------------------------------------

/// A router plugin with its native fallback.
pub struct WasmRouter {
    guard: Guard,
    native: Box<dyn Router>,
}

impl WasmRouter {
    pub fn new(
        handle: Arc<PluginHandle>,
        counters: Arc<PluginCounters>,
        native: Box<dyn Router>,
    ) -> Self {
        Self {
            guard: Guard::new(handle, counters),
            native,
        }
    }

    fn ask(&mut self, request: &RouteRequest, replicas: &ReplicaColumns) -> Result<u32, ()> {
        let (req, cols) = route_args(request, replicas);
        let counters = &self.guard.counters;
        let answer = match self.guard.slot.ready() {
            Ok(ready) => timed(counters, || ready.instance.route(req, cols)),
            Err(e) => Err(e),
        };
        match answer {
            Ok(Some(i)) if (i as usize) < replicas.len() => {
                self.guard.ok();
                Ok(i)
            }
            Ok(Some(i)) => {
                self.guard.rejected(
                    FallbackReason::Invalid,
                    &format_args!("replica {i} out of range 0..{}", replicas.len()),
                );
                Err(())
            }
            Ok(None) => {
                self.guard
                    .rejected(FallbackReason::Declined, &"plugin declined");
                Err(())
            }
            Err(e) => {
                self.guard.failed(&e);
                Err(())
            }
        }
    }
}

impl Router for WasmRouter {
    fn route(&mut self, request: &RouteRequest, replicas: &ReplicaColumns) -> Decision<u32> {
        self.guard.counters.record_call();
        match self.ask(request, replicas) {
            Ok(i) => Decision::Use(i),
            Err(()) => self.native.route(request, replicas),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Evictor
// ---------------------------------------------------------------------------------------------

/// An evictor plugin with the native LRU as fallback and as the reference for validation.
///
/// The native twin sees every event too, so its answer is always current; it also checks each
/// victim list (evictable, leaf at its turn, no repeats) and rebuilds a fresh plugin
/// instance's view by replaying the cache state as events.
pub struct WasmEvictor {
    guard: Guard,
    native: LruEvictor,
}

impl WasmEvictor {
    pub fn new(
        handle: Arc<PluginHandle>,
        counters: Arc<PluginCounters>,
        native: LruEvictor,
    ) -> Self {
        Self {
            guard: Guard::new(handle, counters),
            native,
        }
    }

    /// Sends `events` (or, to a fresh instance, the whole current state) to the plugin.
    fn feed(&mut self, events: Option<&CacheEvents>) -> Result<(), CallError> {
        let counters = &self.guard.counters;
        let ready = self.guard.slot.ready()?;
        if ready.fresh {
            // The twin already applied `events`, so the replay includes them.
            let replay = self.native.replay();
            return timed(counters, || ready.instance.on_events(events_arg(&replay)));
        }
        match events {
            Some(e) if !e.is_empty() => timed(counters, || ready.instance.on_events(events_arg(e))),
            _ => Ok(()),
        }
    }

    fn ask(&mut self, count: u32, step: u64) -> Result<Vec<u32>, ()> {
        let answer = self.feed(None).and_then(|()| {
            let counters = &self.guard.counters;
            match self.guard.slot.ready() {
                Ok(ready) => timed(counters, || ready.instance.choose_victims(count, step)),
                Err(e) => Err(e),
            }
        });
        match answer {
            Ok(Some(v)) if v.len() > count as usize => {
                self.guard.rejected(
                    FallbackReason::Invalid,
                    &format_args!("{} victims for a request of {count}", v.len()),
                );
                Err(())
            }
            Ok(Some(v)) => match self.native.validate(&v) {
                Ok(()) => {
                    self.guard.ok();
                    Ok(v)
                }
                Err(e) => {
                    self.guard
                        .rejected(FallbackReason::Invalid, &format_args!("{e:?}"));
                    Err(())
                }
            },
            Ok(None) => {
                self.guard
                    .rejected(FallbackReason::Declined, &"plugin declined");
                Err(())
            }
            Err(e) => {
                self.guard.failed(&e);
                Err(())
            }
        }
    }
}

impl Evictor for WasmEvictor {
    fn on_events(&mut self, events: &CacheEvents) {
        self.native.on_events(events);
        match self.feed(Some(events)) {
            Ok(()) => {}
            // No instance to keep current: the next one is sent the whole state.
            Err(e) if e.reason == FallbackReason::Quarantined => {}
            Err(e) => {
                // The plugin's view is now stale; a new instance will be rebuilt from the twin.
                self.guard.failed(&e);
                self.guard.slot.poison();
            }
        }
    }

    fn choose_victims(&mut self, count: u32, step: u64) -> Decision<Vec<u32>> {
        self.guard.counters.record_call();
        match self.ask(count, step) {
            Ok(v) => Decision::Use(v),
            Err(()) => self.native.choose_victims(count, step),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sampler
// ---------------------------------------------------------------------------------------------

/// A sampler plugin with the native default sampler as fallback.
pub struct WasmSampler {
    guard: Guard,
    native: Box<dyn Sampler>,
}

impl WasmSampler {
    pub fn new(
        handle: Arc<PluginHandle>,
        counters: Arc<PluginCounters>,
        native: Box<dyn Sampler>,
    ) -> Self {
        Self {
            guard: Guard::new(handle, counters),
            native,
        }
    }

    fn ask(&mut self, batch: &SamplerBatch) -> Result<Vec<u32>, ()> {
        let counters = &self.guard.counters;
        let answer = match self.guard.slot.ready() {
            Ok(ready) => timed(counters, || ready.instance.sample(batch_arg(batch))),
            Err(e) => Err(e),
        };
        match answer {
            Ok(Some(tokens)) => match check_tokens(batch, &tokens) {
                Ok(()) => {
                    self.guard.ok();
                    Ok(tokens)
                }
                Err(msg) => {
                    self.guard.rejected(FallbackReason::Invalid, &msg);
                    Err(())
                }
            },
            Ok(None) => {
                self.guard
                    .rejected(FallbackReason::Declined, &"plugin declined");
                Err(())
            }
            Err(e) => {
                self.guard.failed(&e);
                Err(())
            }
        }
    }
}

/// One token per request, each among that request's candidates.
fn check_tokens(batch: &SamplerBatch, tokens: &[u32]) -> Result<(), String> {
    if tokens.len() != batch.len() {
        return Err(format!(
            "{} tokens for {} requests",
            tokens.len(),
            batch.len()
        ));
    }
    let k = batch.k as usize;
    for (i, t) in tokens.iter().enumerate() {
        let cands = batch.cand_tokens.get(i * k..(i + 1) * k).unwrap_or(&[]);
        if !cands.contains(t) {
            return Err(format!(
                "token {t} for request {i} is not one of its candidates"
            ));
        }
    }
    Ok(())
}

impl Sampler for WasmSampler {
    fn sample(&mut self, batch: &SamplerBatch) -> Decision<Vec<u32>> {
        self.guard.counters.record_call();
        match self.ask(batch) {
            Ok(t) => Decision::Use(t),
            Err(()) => self.native.sample(batch),
        }
    }
}
