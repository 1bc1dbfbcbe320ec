//! [`KvEvent`]: the block-level events the cache publishes for routers and metrics.
//!
//! The cache manager collects them during a step and hands them out only after the step that
//! made them succeeded; the engine forwards them unchanged. Hashes are the first 8 bytes of the
//! prefix-index block hashes ([`super::BlockHash::short`]), so a router can mirror each
//! replica's prefix index exactly.

/// A block-level cache event (`Stored` carries, per block, whether an SSM snapshot is attached).
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    Stored {
        hashes: Vec<u64>,
        with_snapshot: Vec<bool>,
    },
    Removed {
        hashes: Vec<u64>,
    },
    SnapshotRemoved {
        hashes: Vec<u64>,
    },
    Cleared,
}
