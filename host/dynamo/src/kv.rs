//! KV events for Dynamo's router: the worker's replicas' cache events, through the hybrid rule
//! ([`Announcer`]), as Dynamo `KvCacheEvent`s with monotonic ids; and the reuse accounting that
//! says whether the router was ever told of blocks a request could not resume from.
//!
//! Dynamo's router matches a prompt by the hash of each block's tokens (`tokens_hash`, which it
//! computes itself from the prompt) and links blocks by the worker's own `block_hash`; chimera
//! sends its cache's short block hashes as `block_hash` and the tokens' hash as Dynamo computes
//! it (`compute_block_hash_for_seq`), parents before children.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use dynamo_backend_common::KvEventPublisher;
use dynamo_llm::kv_router::protocols::{
    BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, compute_block_hash_for_seq,
};

use chimera::cache::{KvEvent, MissReason};
use chimera::cluster::{Announcement, Announcer};

/// Which cached blocks the router is told of.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnnounceRule {
    /// A block once a recurrent state can resume from it (attention-only models: at once).
    Hybrid,
    /// Every KV block, as attention-only engines announce.
    All,
}

/// Per-worker counts of what the router was told against what requests reused.
#[derive(Debug, Default)]
pub struct ReuseCounters {
    /// Requests that arrived with at least one of their prompt's blocks announced here.
    pub routed_on_overlap: AtomicU64,
    /// Of those, requests that reused no prompt token at all: the router matched blocks here
    /// but this worker had no state to resume from (what attention-only events cause on a
    /// hybrid).
    pub routed_without_state: AtomicU64,
    /// Of those, requests whose state was here when they arrived and was evicted before their
    /// admission (the cache's miss reason `evicted` or `snapshot_budget_full`): the
    /// announcement was true, memory pressure took it back. Not in `routed_without_state`.
    pub routed_state_evicted: AtomicU64,
    /// Prompt tokens in announced blocks at arrival (capped at what the cache could serve the
    /// prompt), and prompt tokens reused, summed over requests.
    pub announced_tokens: AtomicU64,
    pub reused_tokens: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub requests: AtomicU64,
}

/// The announcer, the publisher once Dynamo hands it over, and the event id counter.
pub struct KvState {
    announcer: Mutex<Announcer>,
    block_size: u32,
    publisher: OnceLock<Arc<KvEventPublisher>>,
    next_event_id: AtomicU64,
    pub counters: ReuseCounters,
}

impl KvState {
    pub fn new(replicas: usize, hybrid: bool, rule: AnnounceRule, block_size: u32) -> Self {
        Self {
            announcer: Mutex::new(Announcer::new(
                replicas,
                hybrid && rule == AnnounceRule::Hybrid,
            )),
            block_size,
            publisher: OnceLock::new(),
            next_event_id: AtomicU64::new(0),
            counters: ReuseCounters::default(),
        }
    }

    /// Dynamo's publisher for this worker (rank 0); events before it are announced from the
    /// state kept since (none: no request runs before registration).
    pub fn set_publisher(&self, publisher: Arc<KvEventPublisher>) {
        let _ = self.publisher.set(publisher);
    }

    /// How many leading blocks of a prompt (short hashes) the router was told of.
    pub fn announced_prefix(&self, hashes: &[u64]) -> usize {
        self.announcer
            .lock()
            .map(|a| a.announced_prefix(hashes))
            .unwrap_or(0)
    }

    /// Applies one engine step's events of `replica` and publishes what changed.
    pub fn apply(&self, replica: usize, events: &[KvEvent]) {
        let mut out = Vec::new();
        {
            let Ok(mut a) = self.announcer.lock() else {
                tracing::error!(
                    "the KV announcer panicked earlier; cache events are not announced"
                );
                return;
            };
            for ev in events {
                let before = out.len();
                a.apply(replica, ev, &mut out);
                for ann in &out[before..] {
                    if let Announcement::Removed { hashes } = ann {
                        tracing::debug!(
                            replica,
                            blocks = hashes.len(),
                            cause = ev.kind(),
                            "blocks withdrawn from the router"
                        );
                    }
                }
            }
        }
        if out.is_empty() {
            return;
        }
        let Some(publisher) = self.publisher.get() else {
            // Only before registration, when no request has run yet.
            tracing::debug!(
                announcements = out.len(),
                "KV announcements before Dynamo handed over its publisher: not sent"
            );
            return;
        };
        let batch: Vec<KvCacheEvent> = out
            .into_iter()
            .map(|a| KvCacheEvent {
                event_id: self.next_event_id.fetch_add(1, Ordering::Relaxed),
                data: to_dynamo(a, self.block_size),
                dp_rank: 0,
            })
            .collect();
        if let Err(e) = publisher.publish_batch(batch) {
            tracing::warn!(error = %e, "the KV event publisher has stopped; events dropped");
        }
    }

    /// Records one finished request: `announced` leading prompt blocks were announced here when
    /// it arrived; it reused `reused` prompt tokens of at most `cacheable`, `miss` saying why
    /// not all.
    pub fn record(
        &self,
        prompt: u32,
        announced: u32,
        reused: u32,
        cacheable: u32,
        miss: Option<MissReason>,
    ) {
        let c = &self.counters;
        c.requests.fetch_add(1, Ordering::Relaxed);
        c.prompt_tokens
            .fetch_add(u64::from(prompt), Ordering::Relaxed);
        c.reused_tokens
            .fetch_add(u64::from(reused), Ordering::Relaxed);
        // The cache serves whole blocks and leaves at least one token to compute: what an
        // announcement can promise is bounded by what the cache could serve this prompt.
        let promised = (announced * self.block_size).min(cacheable);
        c.announced_tokens
            .fetch_add(u64::from(promised), Ordering::Relaxed);
        if promised > 0 {
            c.routed_on_overlap.fetch_add(1, Ordering::Relaxed);
            let evicted = matches!(
                miss,
                Some(MissReason::Evicted | MissReason::SnapshotBudgetFull)
            );
            if reused == 0 && evicted {
                c.routed_state_evicted.fetch_add(1, Ordering::Relaxed);
            } else if reused == 0 {
                c.routed_without_state.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The counters in Prometheus text (bridged into the worker's `/metrics`).
    pub fn render(&self) -> String {
        let c = &self.counters;
        let mut out = String::new();
        for (name, help, v) in [
            (
                "chimera_dynamo_requests_total",
                "Requests this worker finished.",
                &c.requests,
            ),
            (
                "chimera_dynamo_routed_on_overlap_total",
                "Requests that arrived with at least one prompt block announced to the router.",
                &c.routed_on_overlap,
            ),
            (
                "chimera_dynamo_routed_without_state_total",
                "Requests that arrived with prompt blocks announced here but reused no prompt token (the router matched KV this worker could not resume from).",
                &c.routed_without_state,
            ),
            (
                "chimera_dynamo_routed_state_evicted_total",
                "Requests that arrived with prompt blocks announced here whose state was evicted before their admission (memory pressure after routing), reusing no prompt token.",
                &c.routed_state_evicted,
            ),
            (
                "chimera_dynamo_announced_prompt_tokens_total",
                "Prompt tokens in blocks announced to the router when their request arrived.",
                &c.announced_tokens,
            ),
            (
                "chimera_dynamo_reused_prompt_tokens_total",
                "Prompt tokens served from the prefix cache.",
                &c.reused_tokens,
            ),
            (
                "chimera_dynamo_prompt_tokens_total",
                "Prompt tokens of finished requests.",
                &c.prompt_tokens,
            ),
        ] {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n",
                v.load(Ordering::Relaxed)
            ));
        }
        out
    }
}

/// One announcement as Dynamo's event data.
fn to_dynamo(a: Announcement, block_size: u32) -> KvCacheEventData {
    match a {
        Announcement::Stored {
            parent,
            blocks,
            tokens,
        } => {
            let local =
                compute_block_hash_for_seq(&tokens, block_size, BlockHashOptions::default());
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: blocks
                    .into_iter()
                    .zip(local)
                    .map(|(h, tokens_hash)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(h),
                        tokens_hash,
                        mm_extra_info: None,
                    })
                    .collect(),
            })
        }
        Announcement::Removed { hashes } => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: hashes.into_iter().map(ExternalSequenceBlockHash).collect(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_chains_carry_dynamo_token_hashes_and_parents() {
        let tokens: Vec<u32> = (0..8).collect();
        let data = to_dynamo(
            Announcement::Stored {
                parent: Some(7),
                blocks: vec![11, 12],
                tokens: tokens.clone(),
            },
            4,
        );
        let KvCacheEventData::Stored(s) = data else {
            panic!("{data:?}")
        };
        assert_eq!(s.parent_hash, Some(ExternalSequenceBlockHash(7)));
        let want = compute_block_hash_for_seq(&tokens, 4, BlockHashOptions::default());
        assert_eq!(s.blocks.len(), 2);
        assert_eq!(s.blocks[0].block_hash, ExternalSequenceBlockHash(11));
        assert_eq!(s.blocks[1].tokens_hash, want[1]);
    }

    /// chimera's vLLM-format batches (`[kv_events]`) decode with the reader Dynamo's ZMQ relay
    /// uses, to the same blocks, parents, tokens and removals.
    #[test]
    fn vllm_format_batches_decode_with_dynamos_relay_reader() {
        use dynamo_kv_router::zmq_wire::{RawKvEvent, decode_event_batch};
        let events = [
            Announcement::Stored {
                parent: Some(5),
                blocks: vec![11, 12],
                tokens: (0..8).collect(),
            },
            Announcement::Removed { hashes: vec![12] },
        ];
        let bytes = chimera::cluster::zmq::encode_batch(2.5, &events, 4, 0);
        let batch = decode_event_batch(&bytes).expect("Dynamo reads the batch");
        assert_eq!(batch.ts, 2.5);
        assert_eq!(batch.data_parallel_rank, Some(0));
        assert_eq!(batch.events.len(), 2);
        match &batch.events[0] {
            RawKvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                ..
            } => {
                let hashes: Vec<u64> = block_hashes.iter().map(|h| h.into_u64()).collect();
                assert_eq!(hashes, vec![11, 12]);
                assert_eq!(parent_block_hash.map(|h| h.into_u64()), Some(5));
                assert_eq!(token_ids, &(0..8).collect::<Vec<u32>>());
                assert_eq!(*block_size, 4);
                assert_eq!(medium.as_deref(), Some("GPU"));
            }
            other => panic!("{other:?}"),
        }
        match &batch.events[1] {
            RawKvEvent::BlockRemoved { block_hashes, .. } => {
                assert_eq!(block_hashes[0].into_u64(), 12);
            }
            other => panic!("{other:?}"),
        }
        let cleared = decode_event_batch(&chimera::cluster::zmq::encode_cleared(1.0, 0))
            .expect("Dynamo reads the cleared batch");
        assert!(matches!(
            cleared.events[..],
            [RawKvEvent::AllBlocksCleared { .. }]
        ));
    }

    #[test]
    fn requests_routed_without_state_are_counted() {
        let kv = KvState::new(1, true, AnnounceRule::Hybrid, 16);
        // Two blocks announced, both reused (up to what the cache could serve).
        kv.record(40, 2, 32, 32, None);
        // Two blocks announced, nothing reused: routed here without the state.
        kv.record(40, 2, 0, 32, Some(MissReason::NoSnapshot));
        // Two blocks announced, their state evicted after the request arrived.
        kv.record(40, 2, 0, 32, Some(MissReason::Evicted));
        kv.record(40, 2, 0, 32, Some(MissReason::SnapshotBudgetFull));
        // Nothing announced: not routed on overlap.
        kv.record(40, 0, 0, 32, Some(MissReason::NoKvMatch));
        let c = &kv.counters;
        assert_eq!(c.routed_on_overlap.load(Ordering::Relaxed), 4);
        assert_eq!(c.routed_without_state.load(Ordering::Relaxed), 1);
        assert_eq!(c.routed_state_evicted.load(Ordering::Relaxed), 2);
        assert_eq!(c.announced_tokens.load(Ordering::Relaxed), 4 * 32);
        assert!(
            kv.render()
                .contains("chimera_dynamo_routed_without_state_total 1")
        );
    }
}
