//! `SsmPool`: ids of the SSM-state slots of a hybrid model and which of them hold what.
//!
//! Slots `0 .. live` are *live* slots: one per running request, holding its current recurrent
//! state; with speculative decoding the last of them are carved out as *draft* slots
//! ([`SsmPool::carve_drafts`]), a request's states after each draft position of its verify
//! chunk. Slots `live .. live + durable` are *durable* snapshot slots: each holds the state of
//! some sequence at the end of one cached KV block (keyed by that block's id; the block's hash
//! identifies the prefix). A snapshot exists only while its block is in the prefix index: the
//! cache manager drops it when the block is evicted or the index is cleared.
//!
//! A durable slot is *reserved* while the step that fills it runs and *attached* to a block
//! once that step succeeded; a failed step frees its reservations. The pool only tracks ids:
//! the device memory belongs to the executor.
//!
//! Each snapshot also remembers whether a prompt was ever restored from it (*proven*) and the
//! step of its latest restore. The cache manager's reclaim order reads both (see
//! [`SsmPool::victim`]): snapshots nobody has used yet go before those of blocks in use, which
//! go before proven ones, so a shared prefix's state outlives the stream of one-off
//! end-of-prompt and periodic snapshots.

use std::collections::HashMap;

/// At most this share of the durable slots is kept for proven snapshots when a slot must be
/// given up: the rest stays open to new snapshots, which must get a chance to be used once.
pub const PROVEN_SHARE: f64 = 0.75;

#[derive(Debug, Clone, Copy)]
struct Snapshot {
    slot: u32,
    /// A prompt was restored from this snapshot at least once.
    proven: bool,
    /// Step of the latest restore (`u64::MAX`: never).
    restored_at: u64,
}

#[derive(Debug)]
pub struct SsmPool {
    live_total: u32,
    durable_total: u32,
    live_free: Vec<u32>,
    durable_free: Vec<u32>,
    /// Draft slots not lent to a request.
    draft_free: Vec<u32>,
    draft_total: u32,
    /// Cached block id → the durable slot holding the state after that block.
    by_block: HashMap<u32, Snapshot>,
    proven: u32,
    /// Counts the changes to the snapshots and their proven/restored marks: what
    /// [`Self::victim`] reads of this pool is the same while this number is.
    changes: u64,
}

impl SsmPool {
    pub fn new(live: u32, durable: u32) -> Self {
        Self {
            live_total: live,
            durable_total: durable,
            live_free: (0..live).rev().collect(),
            durable_free: (live..live + durable).rev().collect(),
            draft_free: Vec::new(),
            draft_total: 0,
            by_block: HashMap::new(),
            proven: 0,
            changes: 0,
        }
    }

    /// Changes so far to what [`Self::victim`] reads of this pool (see `changes`).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    pub fn total_slots(&self) -> u32 {
        self.live_total + self.durable_total
    }
    pub fn durable_total(&self) -> u32 {
        self.durable_total
    }
    /// Durable slots attached to a block or reserved by the running step.
    pub fn durable_used(&self) -> u32 {
        self.durable_total - self.durable_free.len() as u32
    }
    pub fn snapshots(&self) -> usize {
        self.by_block.len()
    }
    pub fn live_free(&self) -> usize {
        self.live_free.len()
    }

    /// Turns the last `n` live slots (none of them in use yet) into draft slots; returns how
    /// many it could.
    pub fn carve_drafts(&mut self, n: u32) -> u32 {
        let n = n.min(self.live_free.len() as u32);
        // `live_free` is in descending id order with the lowest id last: the highest ids lead.
        self.live_free.sort_unstable_by(|a, b| b.cmp(a));
        self.draft_free.extend(self.live_free.drain(..n as usize));
        self.draft_total += n;
        n
    }

    /// Draft slots not lent.
    pub fn draft_free(&self) -> usize {
        self.draft_free.len()
    }

    /// Draft slots in all.
    pub fn draft_total(&self) -> u32 {
        self.draft_total
    }

    /// Lends `k` draft slots (all or none).
    pub fn alloc_drafts(&mut self, k: usize, out: &mut Vec<u32>) -> bool {
        if self.draft_free.len() < k {
            return false;
        }
        let at = self.draft_free.len() - k;
        out.extend(self.draft_free.drain(at..));
        true
    }

    pub fn free_drafts(&mut self, slots: &[u32]) {
        self.draft_free.extend_from_slice(slots);
    }

    pub fn alloc_live(&mut self) -> Option<u32> {
        self.live_free.pop()
    }

    pub fn free_live(&mut self, slot: u32) {
        debug_assert!(slot < self.live_total && !self.live_free.contains(&slot));
        self.live_free.push(slot);
    }

    /// Reserves a durable slot for a snapshot taken during the coming step.
    pub fn reserve(&mut self) -> Option<u32> {
        self.durable_free.pop()
    }

    /// Returns an unattached reservation.
    pub fn unreserve(&mut self, slot: u32) {
        debug_assert!(slot >= self.live_total && !self.durable_free.contains(&slot));
        self.durable_free.push(slot);
    }

    /// Attaches a filled reservation to `block`. Returns false (and frees the slot) when the
    /// block already has a snapshot.
    pub fn attach(&mut self, block: u32, slot: u32) -> bool {
        if self.by_block.contains_key(&block) {
            self.unreserve(slot);
            return false;
        }
        self.changes += 1;
        self.by_block.insert(
            block,
            Snapshot {
                slot,
                proven: false,
                restored_at: u64::MAX,
            },
        );
        true
    }

    pub fn snapshot_of(&self, block: u32) -> Option<u32> {
        self.by_block.get(&block).map(|s| s.slot)
    }

    /// Notes that a prompt restores its state from `block`'s snapshot in step `step`.
    pub fn note_restore(&mut self, block: u32, step: u64) {
        if let Some(s) = self.by_block.get_mut(&block) {
            self.changes += 1;
            if !s.proven {
                s.proven = true;
                self.proven += 1;
            }
            s.restored_at = step;
        }
    }

    /// Snapshots a prompt was restored from at least once.
    pub fn proven(&self) -> u32 {
        self.proven
    }

    /// The snapshot to give up for a new one of class `newcomer` when every durable slot is
    /// taken, or None (the new snapshot is then skipped). `info(block)` gives the number of
    /// running sequences using the block and its last access step. Classes, lowest given up
    /// first and never for a newcomer of a lower class:
    /// - 0: no prompt was restored from it and no running sequence uses its block;
    /// - 1: as 0, but one running sequence uses the block (a request's own end of prompt);
    /// - 2: as 0, but two or more running sequences share the block (a prefix in use);
    /// - 3: proven (a prompt was restored from it), while proven snapshots hold at most
    ///   [`PROVEN_SHARE`] of the slots; beyond that they fall back to classes 0–2, so that new
    ///   snapshots keep room to be tried.
    ///
    /// Within a class the least recently accessed goes first. A snapshot restored from in
    /// step `step` is kept (its copy runs in that step).
    pub fn victim(&self, step: u64, newcomer: u8, info: impl Fn(u32) -> (u32, u64)) -> Option<u32> {
        let cap = (f64::from(self.durable_total) * PROVEN_SHARE) as u32;
        let proven_counts = self.proven <= cap;
        self.by_block
            .iter()
            .filter(|(_, s)| s.restored_at != step)
            .map(|(&b, s)| {
                let (refs, last) = info(b);
                let class = if s.proven && proven_counts {
                    3
                } else {
                    refs.min(2) as u8
                };
                (class, last, b)
            })
            .filter(|&(class, _, _)| class <= newcomer)
            .min()
            .map(|(_, _, b)| b)
    }

    /// Drops the snapshot of a block leaving the index; true if there was one.
    pub fn drop_block(&mut self, block: u32) -> bool {
        match self.by_block.remove(&block) {
            Some(s) => {
                self.changes += 1;
                self.proven -= u32::from(s.proven);
                self.durable_free.push(s.slot);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn live_and_durable_ids_are_disjoint() {
        let mut p = SsmPool::new(2, 3);
        let live: Vec<u32> = std::iter::from_fn(|| p.alloc_live()).collect();
        let durable: Vec<u32> = std::iter::from_fn(|| p.reserve()).collect();
        assert_eq!(live, vec![0, 1]);
        assert_eq!(durable, vec![2, 3, 4]);
        assert_eq!(p.total_slots(), 5);
        assert_eq!(p.durable_used(), 3);
    }

    #[test]
    fn attach_is_once_per_block_and_drop_frees() {
        let mut p = SsmPool::new(1, 2);
        let a = p.reserve().unwrap();
        let b = p.reserve().unwrap();
        assert!(p.attach(7, a));
        assert!(
            !p.attach(7, b),
            "second snapshot of the same block is refused"
        );
        assert_eq!(p.durable_used(), 1);
        assert_eq!(p.snapshot_of(7), Some(a));
        assert!(p.drop_block(7));
        assert!(!p.drop_block(7));
        assert_eq!(p.durable_used(), 0);
        assert_eq!(p.snapshot_of(7), None);
    }

    #[test]
    fn victims_go_by_class_then_age_and_never_above_the_newcomer() {
        // Four durable slots: the proven share is three of them.
        let mut p = SsmPool::new(0, 4);
        for b in 0..4 {
            let s = p.reserve().unwrap();
            assert!(p.attach(b, s));
        }
        // Access order (oldest first): 0, 1, 2, 3. Block 1 is used by one running sequence,
        // block 3 by two.
        let info = |b: u32| {
            (
                if b == 1 {
                    1
                } else if b == 3 {
                    2
                } else {
                    0
                },
                u64::from(b),
            )
        };
        assert_eq!(p.victim(9, 0, info), Some(0));
        p.note_restore(0, 5);
        assert_eq!(p.proven(), 1);
        assert_eq!(
            p.victim(9, 0, info),
            Some(2),
            "the oldest unused unproven one"
        );
        p.note_restore(2, 9);
        // Left below class 3: block 1 (class 1) and block 3 (class 2).
        assert_eq!(p.victim(9, 0, info), None);
        assert_eq!(p.victim(9, 1, info), Some(1));
        assert_eq!(p.victim(9, 2, info), Some(1));
        p.note_restore(1, 7);
        assert_eq!(p.victim(9, 1, info), None);
        assert_eq!(p.victim(9, 2, info), Some(3));
        p.note_restore(3, 6);
        // Four proven > three: they fall back to their use class, the least recently accessed
        // first, unless it is being restored in this very step.
        assert_eq!(p.victim(9, 0, info), Some(0));
        assert_eq!(p.victim(5, 0, info), Some(2));
        assert!(p.drop_block(0));
        assert_eq!(p.proven(), 3);
        assert_eq!(p.victim(9, 2, info), None);
        // Nothing to give up when every snapshot is restored in this step.
        let mut q = SsmPool::new(0, 1);
        let s = q.reserve().unwrap();
        assert!(q.attach(7, s));
        q.note_restore(7, 3);
        assert_eq!(q.victim(3, 0, |_| (0, 0)), None);
        assert_eq!(q.victim(4, 0, |_| (0, 0)), Some(7));
    }

    #[test]
    fn full_pool_refuses_reservations() {
        let mut p = SsmPool::new(1, 1);
        assert!(p.reserve().is_some());
        assert!(p.reserve().is_none());
        assert!(p.alloc_live().is_some());
        assert!(p.alloc_live().is_none());
    }
}
