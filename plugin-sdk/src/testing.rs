//! Owned column builders for testing a plugin natively, without wasmtime.
//!
//! Build a [`Replicas`], [`Events`] or [`SamplerInput`], call `.view()`, and pass the view to
//! your trait implementation exactly as the guest glue would in the Wasm build.

use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::{EventsView, ReplicaView, SamplerBatchView, event_kind};

/// Replica columns; `push` adds one replica.
#[derive(Debug, Clone, Default)]
pub struct Replicas {
    pub waiting: Vec<u32>,
    pub running: Vec<u32>,
    pub free_blocks: Vec<u32>,
    pub total_blocks: Vec<u32>,
    pub kv_usage: Vec<f32>,
    pub prefix_hit_blocks: Vec<u32>,
    pub ssm_hit_blocks: Vec<u32>,
}

impl Replicas {
    /// Adds a replica with `waiting`/`running` requests, `free` of `total` blocks free and
    /// `prefix_hits` leading prompt blocks cached (KV usage derived from free/total).
    pub fn push(
        &mut self,
        waiting: u32,
        running: u32,
        free: u32,
        total: u32,
        prefix_hits: u32,
    ) -> &mut Self {
        self.waiting.push(waiting);
        self.running.push(running);
        self.free_blocks.push(free);
        self.total_blocks.push(total);
        let usage = if total == 0 {
            0.0
        } else {
            1.0 - free as f32 / total as f32
        };
        self.kv_usage.push(usage);
        self.prefix_hit_blocks.push(prefix_hits);
        self.ssm_hit_blocks.push(0);
        self
    }

    pub fn view(&self) -> ReplicaView<'_> {
        ReplicaView {
            waiting: &self.waiting,
            running: &self.running,
            free_blocks: &self.free_blocks,
            total_blocks: &self.total_blocks,
            kv_usage: &self.kv_usage,
            prefix_hit_blocks: &self.prefix_hit_blocks,
            ssm_hit_blocks: &self.ssm_hit_blocks,
        }
    }
}

/// Cache event columns.
#[derive(Debug, Clone, Default)]
pub struct Events {
    pub kinds: Vec<u8>,
    pub blocks: Vec<u32>,
    pub parents: Vec<u32>,
    pub steps: Vec<u64>,
}

impl Events {
    pub fn push(&mut self, kind: u8, block: u32, parent: u32, step: u64) -> &mut Self {
        self.kinds.push(kind);
        self.blocks.push(block);
        self.parents.push(parent);
        self.steps.push(step);
        self
    }

    pub fn stored(&mut self, block: u32, parent: u32, step: u64) -> &mut Self {
        self.push(event_kind::STORED, block, parent, step)
    }

    pub fn released(&mut self, block: u32, step: u64) -> &mut Self {
        self.push(event_kind::RELEASED, block, crate::NO_PARENT, step)
    }

    pub fn view(&self) -> EventsView<'_> {
        EventsView {
            kinds: &self.kinds,
            blocks: &self.blocks,
            parents: &self.parents,
            steps: &self.steps,
        }
    }
}

/// A sampling batch; `push` adds one request with its candidates (best first).
#[derive(Debug, Clone, Default)]
pub struct SamplerInput {
    pub k: u32,
    pub temperature: Vec<f32>,
    pub top_k: Vec<u32>,
    pub top_p: Vec<f32>,
    pub min_p: Vec<f32>,
    pub seed: Vec<u64>,
    pub counter: Vec<u64>,
    pub cand_tokens: Vec<u32>,
    pub cand_logits: Vec<f32>,
}

impl SamplerInput {
    pub fn new(k: u32) -> Self {
        Self {
            k,
            ..Self::default()
        }
    }

    /// Adds a request; `candidates` must hold `k` (token, logit) pairs.
    pub fn push(&mut self, temperature: f32, seed: u64, candidates: &[(u32, f32)]) -> &mut Self {
        self.temperature.push(temperature);
        self.top_k.push(0);
        self.top_p.push(1.0);
        self.min_p.push(0.0);
        self.seed.push(seed);
        self.counter.push(0);
        for &(t, l) in candidates {
            self.cand_tokens.push(t);
            self.cand_logits.push(l);
        }
        self
    }

    pub fn view(&self) -> SamplerBatchView<'_> {
        SamplerBatchView {
            k: self.k,
            temperature: &self.temperature,
            top_k: &self.top_k,
            top_p: &self.top_p,
            min_p: &self.min_p,
            seed: &self.seed,
            counter: &self.counter,
            cand_tokens: &self.cand_tokens,
            cand_logits: &self.cand_logits,
        }
    }
}

static NOW_NS: AtomicU64 = AtomicU64::new(0);

/// Sets what [`crate::host::now_ns`] returns in native builds.
pub fn set_now_ns(ns: u64) {
    NOW_NS.store(ns, Ordering::Relaxed);
}

#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn now_ns() -> u64 {
    NOW_NS.load(Ordering::Relaxed)
}
