//! The replica router: an actor that places each request on one engine replica.
//!
//! Owns: the routing policy (`Box<dyn policy::Router>`, a native default or a Wasm plugin
//! adapter) and one [`PrefixMirror`] per replica, fed from that replica's `KvEvent` stream.
//! Per query it builds `policy::ReplicaColumns` from each replica's latest `EngineStats` and the
//! mirrors, asks the policy, validates the answer and falls back to least-loaded when the
//! policy declines, answers out of range, or panics (counted as a fallback). Invariants: the
//! policy and mirrors are touched only by the actor task (no locks); every answer names a
//! replica that exists. It must not submit requests or know about HTTP.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::error::AppError;
use super::metrics::Metrics;
use super::prefix_mirror::{PrefixHit, PrefixMirror};
use crate::cache::BlockHash;
use crate::engine::api::{EngineHandle, EngineStats, KvEvent};
use crate::policy::native::least_loaded;
use crate::policy::{self, Decision, ReplicaColumns, RouteRequest};

/// One engine replica as the server sees it.
pub struct Replica {
    pub handle: EngineHandle,
    /// The replica's cache events, a batch per engine step; `None` if it publishes none
    /// (routing then sees no hits).
    pub kv_events: Option<mpsc::UnboundedReceiver<Vec<KvEvent>>>,
}

/// Where a request goes and what it will reuse there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub replica: usize,
    pub hit: PrefixHit,
    pub fallback: bool,
}

struct Query {
    hashes: Arc<[BlockHash]>,
    prompt_tokens: u32,
    tenant: String,
    reply: oneshot::Sender<Placement>,
}

enum Msg {
    Route(Query),
    SetPolicy(Box<dyn policy::Router>),
}

/// Cloneable handle to the router actor.
#[derive(Clone)]
pub struct RouterHandle {
    tx: mpsc::Sender<Msg>,
    replicas: Arc<Vec<EngineHandle>>,
}

impl RouterHandle {
    /// Starts the actor on the current tokio runtime.
    pub fn spawn(
        replicas: Vec<Replica>,
        policy: Box<dyn policy::Router>,
        metrics: Arc<Metrics>,
        block_size: u32,
        mirror_max_blocks: usize,
    ) -> Self {
        let (tx, rx) = mpsc::channel(1024);
        let (kv_tx, kv_rx) = mpsc::channel(4096);
        let mut handles = Vec::with_capacity(replicas.len());
        for (i, r) in replicas.into_iter().enumerate() {
            handles.push(r.handle);
            if let Some(mut events) = r.kv_events {
                let kv_tx = kv_tx.clone();
                tokio::spawn(async move {
                    'forward: while let Some(batch) = events.recv().await {
                        for ev in batch {
                            if kv_tx.send((i, ev)).await.is_err() {
                                break 'forward;
                            }
                        }
                    }
                });
            }
        }
        drop(kv_tx);
        let handles = Arc::new(handles);
        let actor = Actor {
            replicas: handles.clone(),
            mirrors: (0..handles.len())
                .map(|_| PrefixMirror::new(mirror_max_blocks))
                .collect(),
            policy,
            metrics,
            block_size,
        };
        tokio::spawn(actor.run(rx, kv_rx));
        Self {
            tx,
            replicas: handles,
        }
    }

    pub fn replicas(&self) -> &[EngineHandle] {
        &self.replicas
    }

    pub fn stats(&self) -> Vec<EngineStats> {
        self.replicas.iter().map(EngineHandle::stats).collect()
    }

    /// Places a prompt given its block hashes (`prefix_mirror::prompt_block_hashes`).
    pub async fn route(
        &self,
        hashes: Arc<[BlockHash]>,
        prompt_tokens: u32,
        tenant: String,
    ) -> Result<Placement, AppError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Msg::Route(Query {
                hashes,
                prompt_tokens,
                tenant,
                reply,
            }))
            .await
            .map_err(|_| AppError::ShuttingDown)?;
        rx.await
            .map_err(|_| AppError::Internal("the router stopped".into()))
    }

    /// Swaps the routing policy (e.g. after a plugin reload); queries in flight finish first.
    pub async fn set_policy(&self, policy: Box<dyn policy::Router>) -> Result<(), AppError> {
        self.tx
            .send(Msg::SetPolicy(policy))
            .await
            .map_err(|_| AppError::ShuttingDown)
    }
}

struct Actor {
    replicas: Arc<Vec<EngineHandle>>,
    mirrors: Vec<PrefixMirror>,
    policy: Box<dyn policy::Router>,
    metrics: Arc<Metrics>,
    block_size: u32,
}

impl Actor {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Msg>,
        mut kv_rx: mpsc::Receiver<(usize, KvEvent)>,
    ) {
        let mut kv_open = true;
        loop {
            tokio::select! {
                biased;
                ev = kv_rx.recv(), if kv_open => match ev {
                    Some((i, ev)) => {
                        if let Some(m) = self.mirrors.get_mut(i) {
                            m.apply(&ev);
                        }
                    }
                    None => kv_open = false,
                },
                msg = rx.recv() => match msg {
                    Some(Msg::Route(q)) => {
                        let placement = self.place(&q);
                        let _ = q.reply.send(placement);
                    }
                    Some(Msg::SetPolicy(p)) => self.policy = p,
                    None => return,
                },
            }
        }
    }

    fn place(&mut self, q: &Query) -> Placement {
        let n = self.replicas.len();
        let mut cols = ReplicaColumns::default();
        let mut hits = Vec::with_capacity(n);
        let alive: Vec<bool> = self.replicas.iter().map(EngineHandle::is_alive).collect();
        for (i, h) in self.replicas.iter().enumerate() {
            let mut s = h.stats();
            if !alive[i] {
                // Out of service (its device was lost): as loaded and as full as can be, so
                // no policy prefers it.
                s.running = u32::MAX / 4;
                s.waiting = u32::MAX / 4;
                s.free_blocks = 0;
            }
            let hit = self
                .mirrors
                .get(i)
                .map(|m| m.hit(&q.hashes))
                .unwrap_or_default();
            cols.waiting.push(s.waiting + s.paused);
            cols.running.push(s.running);
            cols.free_blocks.push(s.free_blocks);
            cols.total_blocks.push(s.total_blocks);
            cols.kv_usage.push(if s.total_blocks == 0 {
                0.0
            } else {
                s.total_blocks.saturating_sub(s.free_blocks) as f32 / s.total_blocks as f32
            });
            cols.prefix_hit_blocks.push(hit.kv_blocks);
            cols.ssm_hit_blocks.push(hit.ssm_blocks);
            hits.push(hit);
        }
        let request = RouteRequest {
            prompt_tokens: q.prompt_tokens,
            prompt_blocks: q.prompt_tokens / self.block_size.max(1),
            tenant: q.tenant.clone(),
        };
        let start = Instant::now();
        let policy = &mut self.policy;
        let decision = catch_unwind(AssertUnwindSafe(|| policy.route(&request, &cols)));
        self.metrics
            .router_latency
            .observe(start.elapsed().as_secs_f64());
        let (replica, fallback) = match decision {
            Ok(Decision::Use(i)) if (i as usize) < n => (i as usize, false),
            Ok(Decision::UseDefault) => (least_loaded(&cols), false),
            Ok(Decision::Use(i)) => {
                tracing::warn!(
                    index = i,
                    replicas = n,
                    "router policy answered out of range"
                );
                self.metrics.router_fallback();
                (least_loaded(&cols), true)
            }
            Err(_) => {
                tracing::warn!("router policy panicked; using least-loaded");
                self.metrics.router_fallback();
                (least_loaded(&cols), true)
            }
        };
        // A policy that picks a dead replica gets the least-loaded live one instead.
        let (replica, fallback) = if alive.get(replica).copied().unwrap_or(false) {
            (replica, fallback)
        } else {
            (least_loaded(&cols), true)
        };
        self.metrics.routed(replica);
        Placement {
            replica,
            hit: hits.get(replica).copied().unwrap_or_default(),
            fallback,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_loaded_prefers_idle_then_free_blocks() {
        let cols = ReplicaColumns {
            waiting: vec![2, 0, 0],
            running: vec![0, 1, 1],
            free_blocks: vec![9, 3, 5],
            total_blocks: vec![10; 3],
            kv_usage: vec![0.1, 0.7, 0.5],
            prefix_hit_blocks: vec![0; 3],
            ssm_hit_blocks: vec![0; 3],
        };
        assert_eq!(least_loaded(&cols), 2);
    }
}
