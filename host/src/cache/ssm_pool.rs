//! `SsmPool`: ids of the SSM-state slots of a hybrid model and which of them hold what.
//!
//! Slots `0 .. live` are *live* slots: one per running request, holding its current recurrent
//! state. Slots `live .. live + durable` are *durable* snapshot slots: each holds the state of
//! some sequence at the end of one cached KV block (keyed by that block's id; the block's hash
//! identifies the prefix). A snapshot exists only while its block is in the prefix index: the
//! cache manager drops it when the block is evicted or the index is cleared.
//!
//! A durable slot is *reserved* while the step that fills it runs and *attached* to a block
//! once that step succeeded; a failed step frees its reservations. The pool only tracks ids:
//! the device memory belongs to the executor.

use std::collections::HashMap;

#[derive(Debug)]
pub struct SsmPool {
    live_total: u32,
    durable_total: u32,
    live_free: Vec<u32>,
    durable_free: Vec<u32>,
    /// Cached block id → durable slot holding the state after that block.
    by_block: HashMap<u32, u32>,
}

impl SsmPool {
    pub fn new(live: u32, durable: u32) -> Self {
        Self {
            live_total: live,
            durable_total: durable,
            live_free: (0..live).rev().collect(),
            durable_free: (live..live + durable).rev().collect(),
            by_block: HashMap::new(),
        }
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
        self.by_block.insert(block, slot);
        true
    }

    /// Blocks that hold a snapshot, in no particular order.
    pub fn blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.by_block.keys().copied()
    }

    pub fn snapshot_of(&self, block: u32) -> Option<u32> {
        self.by_block.get(&block).copied()
    }

    /// Drops the snapshot of a block leaving the index; true if there was one.
    pub fn drop_block(&mut self, block: u32) -> bool {
        match self.by_block.remove(&block) {
            Some(slot) => {
                self.durable_free.push(slot);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
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
    fn full_pool_refuses_reservations() {
        let mut p = SsmPool::new(1, 1);
        assert!(p.reserve().is_some());
        assert!(p.reserve().is_none());
        assert!(p.alloc_live().is_some());
        assert!(p.alloc_live().is_none());
    }
}
