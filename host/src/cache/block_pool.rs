//! `BlockPool`: the paged-KV block ids, their reference counts, the free list, the prefix index
//! (block hash → block id) and eviction of cached blocks.
//!
//! Every block is in exactly one state:
//! - **free**: no user, no hash, on the free list;
//! - **used**: `refs > 0` (hashed or not);
//! - **cached**: `refs == 0` with a hash in the index: reusable by a later request until evicted.
//!
//! Invariants: `used + free + cached == total`; a hashed block's parent (the block holding the
//! previous hash of its chain) is hashed too, so a parent is never evicted before its children;
//! victims are cached leaves only. Eviction order comes from an optional [`Evictor`] policy, fed
//! every cache event; its victims are validated one by one and the native LRU order (oldest
//! `last_access` first, then lowest id, leaves only) takes over at the first invalid one.
//! `last_access` is the step of the block's latest Stored / Hit / Released event.
//!
//! The pool knows nothing of requests, SSM state or models; the cache manager drains
//! [`BlockPool::take_removed`] to drop what hangs off a removed block.

use std::collections::{BTreeSet, HashMap};

use super::hash::{BlockHash, DigestBuildHasher};
use crate::policy::{CacheEvents, Decision, EventKind, Evictor};

/// Parent id of a root block in events and metadata.
pub const NO_PARENT: u32 = u32::MAX;

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum PoolError {
    #[error("need {need} blocks but only {available} can be freed")]
    NoSpace { need: usize, available: usize },
    #[error("block {0} released more often than it was acquired")]
    DoubleFree(u32),
    #[error("block {0} does not exist")]
    BadBlock(u32),
}

#[derive(Debug, Clone)]
struct Meta {
    refs: u32,
    hash: Option<BlockHash>,
    parent: u32,
    /// Hashed blocks whose parent is this block.
    children: u32,
    last_access: u64,
}

pub struct BlockPool {
    meta: Vec<Meta>,
    free: Vec<u32>,
    index: HashMap<BlockHash, u32, DigestBuildHasher>,
    /// Cached blocks (hashed, `refs == 0`).
    cached: usize,
    /// Cached leaves in native eviction order: (last_access, id).
    lru: BTreeSet<(u64, u32)>,
    evictor: Option<Box<dyn Evictor>>,
    /// Events not yet delivered to the evictor.
    events: CacheEvents,
    /// Blocks unhashed since the last `take_removed`, with the hash they had.
    removed: Vec<(u32, BlockHash)>,
    evictor_fallbacks: u64,
    /// Counts the changes to the number of users of indexed blocks (and to the index as a
    /// whole on a clear); unindexed blocks, which hold no snapshot, do not count.
    indexed_ref_changes: u64,
}

impl BlockPool {
    pub fn new(num_blocks: u32, evictor: Option<Box<dyn Evictor>>) -> Self {
        let meta = vec![
            Meta {
                refs: 0,
                hash: None,
                parent: NO_PARENT,
                children: 0,
                last_access: 0
            };
            num_blocks as usize
        ];
        // Pop order: block 0 first.
        let free = (0..num_blocks).rev().collect();
        Self {
            meta,
            free,
            index: HashMap::default(),
            cached: 0,
            lru: BTreeSet::new(),
            evictor,
            events: CacheEvents::default(),
            removed: Vec::new(),
            evictor_fallbacks: 0,
            indexed_ref_changes: 0,
        }
    }

    /// Changes so far to the users of indexed blocks (pins, releases, a cleared index): the
    /// user counts of indexed blocks are the same while this number is.
    pub fn indexed_ref_changes(&self) -> u64 {
        self.indexed_ref_changes
    }

    pub fn total(&self) -> usize {
        self.meta.len()
    }
    /// Blocks on the free list (no hash, no user).
    pub fn free_count(&self) -> usize {
        self.free.len()
    }
    /// Cached blocks nobody uses (evictable).
    pub fn cached_unused(&self) -> usize {
        self.cached
    }
    /// Blocks an allocation can obtain: free plus evictable.
    pub fn available(&self) -> usize {
        self.free.len() + self.cached
    }
    /// Blocks that carry a hash (used or not).
    pub fn indexed(&self) -> usize {
        self.index.len()
    }
    pub fn evictor_fallbacks(&self) -> u64 {
        self.evictor_fallbacks
    }
    pub fn refs(&self, block: u32) -> u32 {
        self.meta.get(block as usize).map_or(0, |m| m.refs)
    }
    /// Step of the block's latest Stored / Hit / Released event.
    pub fn last_access(&self, block: u32) -> u64 {
        self.meta.get(block as usize).map_or(0, |m| m.last_access)
    }
    pub fn hash_of(&self, block: u32) -> Option<BlockHash> {
        self.meta.get(block as usize).and_then(|m| m.hash)
    }

    /// The block holding `hash`, trying `likely` first: a sequence's previous block usually
    /// is the one indexed under its hash, and reading its metadata spares a probe of the index
    /// (a block carries a hash exactly when the index maps that hash to it).
    pub fn lookup_likely(&self, hash: BlockHash, likely: u32) -> Option<u32> {
        if self.hash_of(likely) == Some(hash) {
            return Some(likely);
        }
        self.lookup(hash)
    }

    /// The block holding `hash`, if cached or in use.
    pub fn lookup(&self, hash: BlockHash) -> Option<u32> {
        self.index.get(&hash).copied()
    }

    /// Length of the leading run of `hashes` present in the index.
    pub fn match_len(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.index.contains_key(h))
            .count()
    }

    /// Adds a user to an indexed block (a prefix-cache hit); a cached block stops being
    /// evictable.
    pub fn pin(&mut self, block: u32, step: u64) -> Result<(), PoolError> {
        let m = self
            .meta
            .get_mut(block as usize)
            .ok_or(PoolError::BadBlock(block))?;
        if m.refs == 0 {
            if m.hash.is_none() {
                return Err(PoolError::BadBlock(block));
            }
            self.cached -= 1;
            if m.children == 0 {
                self.lru.remove(&(m.last_access, block));
            }
        }
        m.refs += 1;
        m.last_access = step;
        self.indexed_ref_changes += 1;
        self.events.push(EventKind::Hit, block, NO_PARENT, step);
        Ok(())
    }

    /// How many of `blocks` are currently evictable (pinning them shrinks `available`).
    pub fn count_unused(&self, blocks: &[u32]) -> usize {
        blocks.iter().filter(|&&b| self.refs(b) == 0).count()
    }

    /// Takes `n` blocks (ref count 1, no hash), evicting cached blocks when the free list is
    /// short. On error nothing changed.
    pub fn allocate(&mut self, n: usize, step: u64, out: &mut Vec<u32>) -> Result<(), PoolError> {
        if n > self.available() {
            return Err(PoolError::NoSpace {
                need: n,
                available: self.available(),
            });
        }
        if self.free.len() < n {
            self.evict(n - self.free.len(), step);
        }
        for _ in 0..n {
            // `evict` produced enough free blocks: the free list cannot run dry here.
            let Some(b) = self.free.pop() else {
                return Err(PoolError::NoSpace {
                    need: n,
                    available: 0,
                });
            };
            let m = &mut self.meta[b as usize];
            m.refs = 1;
            m.last_access = step;
            out.push(b);
        }
        Ok(())
    }

    /// Drops one user of each block. A block whose last user left becomes cached (if hashed)
    /// or free. Duplicates in `blocks` count once each.
    pub fn release(&mut self, blocks: &[u32], step: u64) -> Result<(), PoolError> {
        for &b in blocks {
            let m = self
                .meta
                .get_mut(b as usize)
                .ok_or(PoolError::BadBlock(b))?;
            if m.refs == 0 {
                return Err(PoolError::DoubleFree(b));
            }
            m.refs -= 1;
            if m.hash.is_some() {
                self.indexed_ref_changes += 1;
            }
            if m.refs > 0 {
                continue;
            }
            if m.hash.is_some() {
                m.last_access = step;
                self.cached += 1;
                if m.children == 0 {
                    self.lru.insert((step, b));
                }
                self.events.push(EventKind::Released, b, NO_PARENT, step);
            } else {
                self.free.push(b);
            }
        }
        Ok(())
    }

    /// Records that `block` (in use) now holds the full block `hash` whose parent hash is held
    /// by `parent` (or [`NO_PARENT`]). Returns false, changing nothing, when the hash is
    /// already indexed (another block holds the same content) or the parent is not indexed.
    pub fn register(&mut self, block: u32, hash: BlockHash, parent: u32, step: u64) -> bool {
        // One probe of the index: the vacant entry is filled once the block qualifies.
        let std::collections::hash_map::Entry::Vacant(slot) = self.index.entry(hash) else {
            return false;
        };
        let Some(m) = self.meta.get(block as usize) else {
            return false;
        };
        if m.hash.is_some() || m.refs == 0 {
            return false;
        }
        if parent != NO_PARENT {
            let Some(p) = self.meta.get_mut(parent as usize) else {
                return false;
            };
            if p.hash.is_none() {
                return false;
            }
            if p.refs == 0 && p.children == 0 {
                self.lru.remove(&(p.last_access, parent));
            }
            p.children += 1;
        }
        let m = &mut self.meta[block as usize];
        m.hash = Some(hash);
        m.parent = parent;
        m.last_access = step;
        slot.insert(block);
        self.events.push(EventKind::Stored, block, parent, step);
        true
    }

    /// Evicts `count` cached leaves (fewer if fewer exist), asking the evictor first.
    pub fn evict(&mut self, count: usize, step: u64) -> usize {
        let mut done = 0;
        if self.evictor.is_some() && count > 0 {
            self.flush_events();
            let choice = match self.evictor.as_mut() {
                Some(e) => e.choose_victims(count as u32, step),
                None => Decision::UseDefault,
            };
            if let Decision::Use(victims) = choice {
                for v in victims.into_iter().take(count) {
                    if !self.is_evictable_leaf(v) {
                        self.evictor_fallbacks += 1;
                        tracing::debug!(block = v, "evictor chose an invalid victim; using LRU");
                        break;
                    }
                    self.evict_block(v, step);
                    done += 1;
                }
            }
        }
        while done < count {
            let Some(&(_, v)) = self.lru.first() else {
                break;
            };
            self.evict_block(v, step);
            done += 1;
        }
        done
    }

    /// Unhashes every indexed block: unused ones go to the free list, used ones stay with
    /// their users and are freed on release. Returns how many blocks were unhashed.
    pub fn clear_index(&mut self, step: u64) -> usize {
        let n = self.index.len();
        self.indexed_ref_changes += 1;
        for (hash, b) in std::mem::take(&mut self.index) {
            let m = &mut self.meta[b as usize];
            m.hash = None;
            m.parent = NO_PARENT;
            m.children = 0;
            if m.refs == 0 {
                self.free.push(b);
            }
            self.events.push(EventKind::Removed, b, NO_PARENT, step);
            self.removed.push((b, hash));
        }
        self.lru.clear();
        self.cached = 0;
        n
    }

    /// Blocks unhashed (evicted or cleared) since the last call.
    pub fn take_removed(&mut self, out: &mut Vec<(u32, BlockHash)>) {
        out.append(&mut self.removed);
    }

    /// Records a snapshot event for the evictor (the SSM pool lives in the cache manager).
    pub fn note_snapshot(&mut self, block: u32, stored: bool, step: u64) {
        let kind = if stored {
            EventKind::SnapshotStored
        } else {
            EventKind::SnapshotRemoved
        };
        self.events.push(kind, block, NO_PARENT, step);
    }

    /// Delivers pending events to the evictor (called before each `choose_victims`, and by the
    /// engine once per step while the device computes).
    pub fn flush_events(&mut self) {
        if let Some(e) = self.evictor.as_mut()
            && !self.events.is_empty()
        {
            e.on_events(&self.events);
        }
        self.events.clear();
    }

    fn is_evictable_leaf(&self, b: u32) -> bool {
        self.meta
            .get(b as usize)
            .is_some_and(|m| m.refs == 0 && m.hash.is_some() && m.children == 0)
    }

    fn evict_block(&mut self, b: u32, step: u64) {
        let m = &mut self.meta[b as usize];
        let Some(hash) = m.hash.take() else { return };
        self.lru.remove(&(m.last_access, b));
        let parent = std::mem::replace(&mut m.parent, NO_PARENT);
        self.index.remove(&hash);
        self.cached -= 1;
        self.free.push(b);
        if parent != NO_PARENT {
            let p = &mut self.meta[parent as usize];
            p.children -= 1;
            if p.children == 0 && p.refs == 0 && p.hash.is_some() {
                self.lru.insert((p.last_access, parent));
            }
        }
        self.events.push(EventKind::Removed, b, NO_PARENT, step);
        self.removed.push((b, hash));
    }

    /// Checks every invariant; for tests and debug assertions.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = vec![false; self.meta.len()];
        for &b in &self.free {
            let m = &self.meta[b as usize];
            if seen[b as usize] {
                return Err(format!("block {b} twice on the free list"));
            }
            seen[b as usize] = true;
            if m.refs != 0 || m.hash.is_some() {
                return Err(format!("free block {b} has refs {} / hash", m.refs));
            }
        }
        let used = self.meta.iter().filter(|m| m.refs > 0).count();
        let cached = self
            .meta
            .iter()
            .filter(|m| m.refs == 0 && m.hash.is_some())
            .count();
        if cached != self.cached || used + cached + self.free.len() != self.meta.len() {
            return Err(format!(
                "used {used} + cached {cached} ({}) + free {} != total {}",
                self.cached,
                self.free.len(),
                self.meta.len()
            ));
        }
        let mut children = vec![0u32; self.meta.len()];
        for (b, m) in self.meta.iter().enumerate() {
            if let Some(h) = m.hash {
                if self.index.get(&h) != Some(&(b as u32)) {
                    return Err(format!("block {b} hashed but not indexed"));
                }
                if m.parent != NO_PARENT {
                    if self.meta[m.parent as usize].hash.is_none() {
                        return Err(format!(
                            "block {b} cached but its parent {} is not",
                            m.parent
                        ));
                    }
                    children[m.parent as usize] += 1;
                }
            }
        }
        for (b, m) in self.meta.iter().enumerate() {
            if m.hash.is_some() && children[b] != m.children {
                return Err(format!(
                    "block {b} child count {} != {}",
                    m.children, children[b]
                ));
            }
            let leaf = m.refs == 0 && m.hash.is_some() && m.children == 0;
            if leaf != self.lru.contains(&(m.last_access, b as u32)) {
                return Err(format!("block {b} LRU membership wrong"));
            }
        }
        if self.lru.len() > self.cached {
            return Err("LRU holds more than the cached blocks".into());
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "block_pool_tests.rs"]
mod tests;
