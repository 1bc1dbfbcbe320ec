//! Counters the cache manager keeps for engine statistics and metrics.
//!
//! Plain monotonically increasing numbers; the engine copies them into `EngineStats` after each
//! step. Units: tokens for prefix queries and hits (vLLM's: every admission queries its whole
//! prompt; the hits are the prompt tokens whose computation was skipped), events for the rest.

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Prompt tokens looked up in the prefix index at admission.
    pub prefix_queries: u64,
    /// Of those, tokens whose computation was skipped.
    pub prefix_hits: u64,
    /// Admissions that restored SSM state from a snapshot.
    pub ssm_restores: u64,
    /// Snapshots attached to blocks.
    pub snapshots_taken: u64,
    /// Planned snapshots skipped because every durable slot was in use.
    pub snapshots_skipped: u64,
    /// Snapshots dropped because their block left the cache.
    pub snapshots_dropped: u64,
    /// Snapshots planned at prompt boundaries and checkpoints (one SSM-state copy each).
    pub snapshot_copies: u64,
    /// Rolling snapshots written (one SSM-state copy each, planned into a decode step).
    pub rolling_copies: u64,
    /// Rolling snapshots skipped because no durable slot could be had.
    pub rolling_skipped: u64,
    /// Rolling snapshots kept as durable snapshots when their sequence ended.
    pub rolling_kept: u64,
    /// Snapshots planned at a client's checkpoint offsets.
    pub checkpoint_copies: u64,
    /// Checkpoint snapshots skipped because no durable slot could be had.
    pub checkpoints_skipped: u64,
    /// Searches for a snapshot to give up (a failed search is not repeated while nothing it
    /// read changed).
    pub reclaim_searches: u64,
    /// Admissions served less than their cacheable prefix, by [`super::MissReason::index`].
    pub misses: [u64; super::MissReason::ALL.len()],
}
