//! Why a prompt was served less from the cache than it could have been.
//!
//! Owns: [`MissReason`] (the closed list of reasons, with stable strings for responses and
//! metric labels) and [`MissMemory`], the cache manager's short memory of what it lost under
//! pressure — block hashes evicted from the index, and block hashes whose SSM snapshot was not
//! taken or was given up because every durable slot was in use. Both sets are bounded (oldest
//! entries are forgotten first), so a reason derived from them is "evicted" only while the
//! eviction is recent; older losses read as a plain miss.
//!
//! It decides nothing: the cache manager asks it and reports.

use std::collections::{HashMap, VecDeque};

use super::hash::{BlockHash, DigestBuildHasher};

/// Why fewer prompt tokens came from the cache than the prompt's cacheable prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MissReason {
    /// Prefix caching is off (`cache.prefix_caching = false`).
    CachingOff,
    /// The request asked for prompt logprobs: every prompt position is computed.
    PromptLogprobs,
    /// The prompt has no full block that leaves at least two tokens to compute.
    PromptTooShort,
    /// No block of the prompt is in the index (never computed, or forgotten). A prompt that
    /// matches a cached prefix and then goes on with blocks nobody computed (a follow-up
    /// turn's new message) was served all the cache held: that is no miss.
    NoKvMatch,
    /// The KV of the next block is cached, but no SSM snapshot exists at that boundary
    /// (hybrid models only).
    NoSnapshot,
    /// The next block was in the index but was evicted to make room.
    Evicted,
    /// The KV is cached but the snapshot at that boundary was skipped or given up because
    /// every durable SSM slot was in use (or the budget has no durable slot at all).
    SnapshotBudgetFull,
}

impl MissReason {
    pub const ALL: [MissReason; 7] = [
        Self::CachingOff,
        Self::PromptLogprobs,
        Self::PromptTooShort,
        Self::NoKvMatch,
        Self::NoSnapshot,
        Self::Evicted,
        Self::SnapshotBudgetFull,
    ];

    /// Stable string: the response field's value and the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CachingOff => "caching_disabled",
            Self::PromptLogprobs => "prompt_logprobs",
            Self::PromptTooShort => "prompt_too_short",
            Self::NoKvMatch => "no_kv_match",
            Self::NoSnapshot => "no_ssm_snapshot",
            Self::Evicted => "evicted",
            Self::SnapshotBudgetFull => "snapshot_budget_full",
        }
    }

    /// Position in [`Self::ALL`] (index of per-reason counters).
    pub fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for MissReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A set of hashes that forgets its oldest entries beyond a capacity. Removal is O(1): the
/// queue keeps a stale entry, recognised by its insertion number when it comes up.
#[derive(Debug, Default)]
struct BoundedSet {
    set: HashMap<BlockHash, u64, DigestBuildHasher>,
    order: VecDeque<(BlockHash, u64)>,
    next: u64,
    cap: usize,
}

impl BoundedSet {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            ..Self::default()
        }
    }

    fn insert(&mut self, h: BlockHash) {
        if self.cap == 0 || self.set.contains_key(&h) {
            return;
        }
        self.next += 1;
        self.set.insert(h, self.next);
        self.order.push_back((h, self.next));
        while self.order.len() > self.cap {
            if let Some((old, n)) = self.order.pop_front()
                && self.set.get(&old) == Some(&n)
            {
                self.set.remove(&old);
            }
        }
    }

    fn remove(&mut self, h: BlockHash) {
        self.set.remove(&h);
    }

    fn contains(&self, h: BlockHash) -> bool {
        self.set.contains_key(&h)
    }

    fn clear(&mut self) {
        self.set.clear();
        self.order.clear();
    }
}

/// What the cache lost under pressure, remembered for a while to explain later misses.
#[derive(Debug, Default)]
pub struct MissMemory {
    evicted: BoundedSet,
    snapshot_lost: BoundedSet,
}

impl MissMemory {
    /// Remembers up to `cap` hashes of each kind.
    pub fn new(cap: usize) -> Self {
        Self {
            evicted: BoundedSet::new(cap),
            snapshot_lost: BoundedSet::new(cap),
        }
    }

    /// A block left the index to make room.
    pub fn evicted(&mut self, h: BlockHash) {
        self.snapshot_lost.remove(h);
        self.evicted.insert(h);
    }

    /// A block entered the index again.
    pub fn indexed(&mut self, h: BlockHash) {
        self.evicted.remove(h);
    }

    /// The snapshot at the end of block `h` was skipped or dropped for want of a durable slot.
    pub fn snapshot_lost(&mut self, h: BlockHash) {
        self.snapshot_lost.insert(h);
    }

    /// A snapshot at the end of block `h` now exists.
    pub fn snapshot_taken(&mut self, h: BlockHash) {
        self.snapshot_lost.remove(h);
    }

    pub fn was_evicted(&self, h: BlockHash) -> bool {
        self.evicted.contains(h)
    }

    pub fn lost_snapshot(&self, h: BlockHash) -> bool {
        self.snapshot_lost.contains(h)
    }

    /// Forgets everything (the index was cleared on purpose: later misses are plain misses).
    pub fn clear(&mut self) {
        self.evicted.clear();
        self.snapshot_lost.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_strings_are_distinct_and_indexed_in_order() {
        let mut seen = std::collections::HashSet::new();
        for (i, r) in MissReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
            assert!(seen.insert(r.as_str()), "{r} twice");
            assert!(
                r.as_str()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_')
            );
        }
    }

    #[test]
    fn memory_is_bounded_and_forgets_oldest_first() {
        let mut m = MissMemory::new(2);
        m.evicted(BlockHash(1));
        m.evicted(BlockHash(2));
        m.evicted(BlockHash(3));
        assert!(!m.was_evicted(BlockHash(1)));
        assert!(m.was_evicted(BlockHash(2)) && m.was_evicted(BlockHash(3)));
        m.indexed(BlockHash(2));
        assert!(!m.was_evicted(BlockHash(2)));
        m.evicted(BlockHash(4));
        assert!(m.was_evicted(BlockHash(3)) && m.was_evicted(BlockHash(4)));
    }

    #[test]
    fn a_taken_or_evicted_snapshot_is_no_longer_lost() {
        let mut m = MissMemory::new(4);
        m.snapshot_lost(BlockHash(7));
        assert!(m.lost_snapshot(BlockHash(7)));
        m.snapshot_taken(BlockHash(7));
        assert!(!m.lost_snapshot(BlockHash(7)));
        m.snapshot_lost(BlockHash(8));
        m.evicted(BlockHash(8));
        assert!(!m.lost_snapshot(BlockHash(8)));
        assert!(m.was_evicted(BlockHash(8)));
        m.clear();
        assert!(!m.was_evicted(BlockHash(8)));
    }
}
