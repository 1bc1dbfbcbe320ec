//! Counters the cache manager keeps for engine statistics and metrics.
//!
//! Plain monotonically increasing numbers; the engine copies them into `EngineStats` after each
//! step. Units: blocks for prefix queries and hits (a query is one full prompt block looked up
//! at admission; a hit is one whose computation was skipped), events for the rest.

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Full prompt blocks looked up in the prefix index at admission.
    pub prefix_queries: u64,
    /// Of those, blocks whose computation was skipped.
    pub prefix_hits: u64,
    /// Admissions that restored SSM state from a snapshot.
    pub ssm_restores: u64,
    /// Snapshots attached to blocks.
    pub snapshots_taken: u64,
    /// Planned snapshots skipped because every durable slot was in use.
    pub snapshots_skipped: u64,
    /// Snapshots dropped because their block left the cache.
    pub snapshots_dropped: u64,
}
