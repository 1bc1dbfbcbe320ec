//! LRU eviction over a tree of cached blocks, kept up to date from cache events.
//!
//! Semantics (the contract the cache's own fallback follows too):
//! - a block is *evictable* when it is cached and has no current user: after `Stored` and then
//!   `Released`, and not `Hit` again since;
//! - a victim must be a *leaf*: no cached child left;
//! - candidates are ordered by `(last_access_step, block id)` ascending, where last access is
//!   the step of the block's latest `Stored`, `Hit` or `Released` event;
//! - evicting a leaf can make its parent a leaf; the parent then competes by its own last
//!   access, within the same `choose_victims` call.
//!
//! `choose_victims` does not change the state: the cache reports what it really evicted with
//! `Removed` events. A node's `children` counts its cached children.
//!
//! The candidates live in a min-heap with lazy deletion: a block is pushed with its key each
//! time it becomes an evictable leaf or is touched, and entries that no longer match a
//! candidate's current key are dropped when they reach the top. Touching a block is then O(1)
//! (a new key is the largest, so the push stops at once), and only choosing victims pays
//! O(log n) per victim. Stale entries are swept out when they outnumber the live ones.

use alloc::collections::{BTreeMap, BinaryHeap};
use alloc::vec::Vec;
use core::cmp::Reverse;

use crate::columns::{EventsView, NO_PARENT, event_kind};

#[derive(Debug, Clone)]
struct Node {
    parent: u32,
    children: u32,
    last_access: u64,
    evictable: bool,
    has_snapshot: bool,
    /// Taken by the eviction being simulated right now.
    taken: bool,
    hits: u32,
}

/// Why a proposed victim list is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VictimError {
    /// The block is not cached (or was already named earlier in the list).
    NotCached { block: u32 },
    /// The block is cached but in use.
    InUse { block: u32 },
    /// The block still has a cached child at that point of the list.
    NotLeaf { block: u32 },
}

/// Block ids below this are stored in a dense table (the block pool hands out small dense ids);
/// larger ids go to an ordered map.
const DENSE_LIMIT: u32 = 1 << 22;

/// Nodes by block id.
#[derive(Debug, Clone, Default)]
struct Nodes {
    dense: Vec<Option<Node>>,
    sparse: BTreeMap<u32, Node>,
    len: usize,
}

impl Nodes {
    fn get(&self, id: u32) -> Option<&Node> {
        if id < DENSE_LIMIT {
            self.dense.get(id as usize).and_then(Option::as_ref)
        } else {
            self.sparse.get(&id)
        }
    }

    fn get_mut(&mut self, id: u32) -> Option<&mut Node> {
        if id < DENSE_LIMIT {
            self.dense.get_mut(id as usize).and_then(Option::as_mut)
        } else {
            self.sparse.get_mut(&id)
        }
    }

    fn contains_key(&self, id: &u32) -> bool {
        self.get(*id).is_some()
    }

    fn insert(&mut self, id: u32, node: Node) {
        let old = if id < DENSE_LIMIT {
            let i = id as usize;
            if i >= self.dense.len() {
                self.dense.resize(i + 1, None);
            }
            self.dense[i].replace(node)
        } else {
            self.sparse.insert(id, node)
        };
        if old.is_none() {
            self.len += 1;
        }
    }

    fn remove(&mut self, id: &u32) -> Option<Node> {
        let old = if *id < DENSE_LIMIT {
            self.dense.get_mut(*id as usize).and_then(Option::take)
        } else {
            self.sparse.remove(id)
        };
        if old.is_some() {
            self.len -= 1;
        }
        old
    }

    fn len(&self) -> usize {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// All nodes in ascending id order.
    fn iter(&self) -> impl Iterator<Item = (u32, &Node)> {
        let dense = self
            .dense
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.as_ref().map(|n| (i as u32, n)));
        dense.chain(self.sparse.iter().map(|(id, n)| (*id, n)))
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut Node> {
        self.dense
            .iter_mut()
            .filter_map(Option::as_mut)
            .chain(self.sparse.values_mut())
    }
}

/// A heap entry: `(last_access, block)`, smallest first.
type Key = Reverse<(u64, u32)>;

/// Heap entries allowed beyond twice the live candidates before a sweep.
const STALE_SLACK: usize = 1024;

/// The evictor's view of the cache.
#[derive(Debug, Clone, Default)]
pub struct LruState {
    nodes: Nodes,
    /// Every evictable leaf under its current key, plus stale entries.
    heap: BinaryHeap<Key>,
    /// Evictable leaves right now.
    candidates: usize,
}

impl LruState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Cached blocks known.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Evictable leaves right now.
    pub fn evictable_leaves(&self) -> usize {
        self.candidates
    }

    /// Applies events in order. Events about unknown blocks are ignored; inconsistent columns
    /// are applied up to the shortest column.
    pub fn apply(&mut self, events: &EventsView<'_>) {
        let n = events
            .kinds
            .len()
            .min(events.blocks.len())
            .min(events.parents.len())
            .min(events.steps.len());
        for i in 0..n {
            let (block, step) = (events.blocks[i], events.steps[i]);
            match events.kinds[i] {
                event_kind::STORED => self.stored(block, events.parents[i], step),
                event_kind::HIT => self.touch(block, step, false),
                event_kind::RELEASED => self.touch(block, step, true),
                event_kind::REMOVED => self.removed(block),
                event_kind::SNAPSHOT_STORED => self.set_snapshot(block, true),
                event_kind::SNAPSHOT_REMOVED => self.set_snapshot(block, false),
                _ => {}
            }
        }
        if self.heap.len() > 2 * self.candidates + STALE_SLACK {
            self.sweep();
        }
    }

    fn is_candidate(node: &Node) -> bool {
        node.evictable && node.children == 0 && !node.taken
    }

    /// Records that `block` went from candidate key `was` to whatever it is now, pushing its
    /// key when it is a candidate under a new key.
    fn changed(&mut self, block: u32, was: Option<u64>) {
        match (was, self.candidate_key(block)) {
            (None, Some(t)) => {
                self.candidates += 1;
                self.heap.push(Reverse((t, block)));
            }
            (Some(_), None) => self.candidates -= 1,
            (Some(a), Some(b)) if a != b => self.heap.push(Reverse((b, block))),
            _ => {}
        }
    }

    /// The key of `block` if it is a candidate.
    fn candidate_key(&self, block: u32) -> Option<u64> {
        self.nodes
            .get(block)
            .filter(|n| Self::is_candidate(n))
            .map(|n| n.last_access)
    }

    fn stored(&mut self, block: u32, parent: u32, step: u64) {
        if self.nodes.contains_key(&block) {
            self.removed(block);
        }
        let parent = if parent != block && self.nodes.contains_key(&parent) {
            parent
        } else {
            NO_PARENT
        };
        let was = self.candidate_key(parent);
        if let Some(p) = self.nodes.get_mut(parent) {
            p.children += 1;
            self.changed(parent, was);
        }
        let node = Node {
            parent,
            children: 0,
            last_access: step,
            evictable: false,
            has_snapshot: false,
            taken: false,
            hits: 0,
        };
        self.nodes.insert(block, node);
    }

    fn touch(&mut self, block: u32, step: u64, released: bool) {
        let was = self.candidate_key(block);
        let Some(node) = self.nodes.get_mut(block) else {
            return;
        };
        node.last_access = step;
        node.evictable = released;
        if !released {
            node.hits = node.hits.saturating_add(1);
        }
        self.changed(block, was);
    }

    fn removed(&mut self, block: u32) {
        let was = self.candidate_key(block);
        let Some(node) = self.nodes.remove(&block) else {
            return;
        };
        // Its heap entries are stale now: nothing matches them.
        self.changed(block, was);
        if node.children > 0 {
            // Only a wholesale clear removes a parent first; detach its children so a later
            // reuse of this id is not mistaken for their parent.
            for child in self.nodes.values_mut() {
                if child.parent == block {
                    child.parent = NO_PARENT;
                }
            }
        }
        let was = self.candidate_key(node.parent);
        if let Some(p) = self.nodes.get_mut(node.parent) {
            p.children = p.children.saturating_sub(1);
            self.changed(node.parent, was);
        }
    }

    fn set_snapshot(&mut self, block: u32, present: bool) {
        if let Some(node) = self.nodes.get_mut(block) {
            node.has_snapshot = present;
        }
    }

    /// Whether heap entry `key` names a candidate under its current key.
    fn is_live(&self, Reverse((t, block)): Key) -> bool {
        self.candidate_key(block) == Some(t)
    }

    /// Rebuilds the heap from the candidates, dropping stale entries.
    fn sweep(&mut self) {
        let mut keys = core::mem::take(&mut self.heap).into_vec();
        keys.clear();
        keys.extend(
            self.nodes
                .iter()
                .filter(|(_, n)| Self::is_candidate(n))
                .map(|(id, n)| Reverse((n.last_access, id))),
        );
        self.heap = BinaryHeap::from(keys);
    }

    /// Up to `count` victims in eviction order (fewer when fewer blocks are evictable).
    pub fn choose_victims(&mut self, count: u32) -> Vec<u32> {
        let mut sim = Simulation::default();
        let mut victims = Vec::with_capacity((count as usize).min(self.candidates));
        while victims.len() < count as usize {
            let Some(key) = self.heap.pop() else {
                break;
            };
            if !self.is_live(key) {
                // Stale (or a duplicate of a block already taken): gone for good.
                continue;
            }
            sim.popped.push(key);
            let block = key.0.1;
            victims.push(block);
            if let Some(parent) = self.take(&mut sim, block) {
                self.heap.push(Reverse((parent.1, parent.0)));
            }
        }
        self.undo(sim);
        victims
    }

    /// Checks that evicting `victims` in order is allowed, without changing the state.
    pub fn validate_victims(&mut self, victims: &[u32]) -> Result<(), VictimError> {
        let mut sim = Simulation::default();
        let mut result = Ok(());
        for &block in victims {
            let verdict = match self.nodes.get(block) {
                None => Err(VictimError::NotCached { block }),
                Some(n) if n.taken => Err(VictimError::NotCached { block }),
                Some(n) if !n.evictable => Err(VictimError::InUse { block }),
                Some(n) if n.children > 0 => Err(VictimError::NotLeaf { block }),
                Some(_) => Ok(()),
            };
            if let Err(e) = verdict {
                result = Err(e);
                break;
            }
            self.take(&mut sim, block);
        }
        self.undo(sim);
        result
    }

    /// Marks candidate `block` as evicted in `sim`. Returns its parent `(id, last_access)` when
    /// that made the parent a candidate.
    fn take(&mut self, sim: &mut Simulation, block: u32) -> Option<(u32, u64)> {
        let node = self.nodes.get_mut(block)?;
        node.taken = true;
        let parent = node.parent;
        sim.taken.push(block);
        let p = self.nodes.get_mut(parent)?;
        p.children -= 1;
        sim.decremented.push(parent);
        Self::is_candidate(p).then_some((parent, p.last_access))
    }

    fn undo(&mut self, sim: Simulation) {
        for block in sim.taken {
            if let Some(n) = self.nodes.get_mut(block) {
                n.taken = false;
            }
        }
        for parent in sim.decremented {
            if let Some(p) = self.nodes.get_mut(parent) {
                p.children += 1;
            }
        }
        // Entries pushed for promoted parents are stale again; the victims go back.
        self.heap.extend(sim.popped);
    }

    /// Events that rebuild this state from empty (parents before children), e.g. for a fresh
    /// plugin instance that lost its memory. Hit counts are not carried over.
    pub fn replay_events(&self, out: &mut ReplayEvents) {
        let mut kids: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        let mut stack = Vec::new();
        for (id, n) in self.nodes.iter() {
            if self.nodes.contains_key(&n.parent) {
                kids.entry(n.parent).or_default().push(id);
            } else {
                stack.push(id);
            }
        }
        stack.reverse();
        while let Some(block) = stack.pop() {
            let Some(n) = self.nodes.get(block) else {
                continue;
            };
            out.push(event_kind::STORED, block, n.parent, n.last_access);
            if n.evictable {
                out.push(event_kind::RELEASED, block, NO_PARENT, n.last_access);
            }
            if n.has_snapshot {
                out.push(event_kind::SNAPSHOT_STORED, block, NO_PARENT, n.last_access);
            }
            if let Some(children) = kids.get(&block) {
                stack.extend(children.iter().rev());
            }
        }
    }
}

/// Changes made while simulating evictions, undone afterwards.
#[derive(Default)]
struct Simulation {
    taken: Vec<u32>,
    decremented: Vec<u32>,
    /// Heap entries of the victims, pushed back afterwards.
    popped: Vec<Key>,
}

/// Owned event columns produced by [`LruState::replay_events`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayEvents {
    pub kinds: Vec<u8>,
    pub blocks: Vec<u32>,
    pub parents: Vec<u32>,
    pub steps: Vec<u64>,
}

impl ReplayEvents {
    pub fn push(&mut self, kind: u8, block: u32, parent: u32, step: u64) {
        self.kinds.push(kind);
        self.blocks.push(block);
        self.parents.push(parent);
        self.steps.push(step);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use alloc::collections::BTreeMap;
    use alloc::vec;
    use proptest::prelude::*;

    /// A straightforward model of the cache used as the oracle.
    #[derive(Clone, Default)]
    struct Model {
        // block -> (parent, last_access, users)
        blocks: BTreeMap<u32, (u32, u64, u32)>,
        next_id: u32,
        freed: Vec<u32>,
    }

    impl Model {
        fn children(&self, b: u32) -> usize {
            self.blocks.values().filter(|(p, _, _)| *p == b).count()
        }
        fn evictable_leaves(&self) -> Vec<(u64, u32)> {
            let mut v: Vec<(u64, u32)> = self
                .blocks
                .iter()
                .filter(|(b, (_, _, users))| *users == 0 && self.children(**b) == 0)
                .map(|(b, (_, t, _))| (*t, *b))
                .collect();
            v.sort_unstable();
            v
        }
        fn lru_order(&self, count: usize) -> Vec<u32> {
            let mut m = self.clone();
            let mut out = Vec::new();
            while out.len() < count {
                let Some(&(_, b)) = m.evictable_leaves().first() else {
                    break;
                };
                m.blocks.remove(&b);
                out.push(b);
            }
            out
        }
    }

    /// Drives a random but valid cache history, feeding events to `state` and `model`.
    fn run_history(seed: u64, ops: usize) -> (LruState, Model) {
        let mut rng = Rng::new(seed, 0);
        let mut state = LruState::new();
        let mut model = Model::default();
        let mut ev = ReplayEvents::default();
        for step in 0..ops as u64 {
            ev = ReplayEvents {
                ..Default::default()
            };
            let ids: Vec<u32> = model.blocks.keys().copied().collect();
            match rng.next_below(4) {
                0 => {
                    let parent = if ids.is_empty() || rng.next_below(3) == 0 {
                        NO_PARENT
                    } else {
                        ids[rng.next_below(ids.len() as u32) as usize]
                    };
                    // Freed ids come back, as the block pool reuses them.
                    let id = match model.freed.pop() {
                        Some(id) if rng.next_below(2) == 0 => id,
                        other => {
                            model.freed.extend(other);
                            model.next_id += 1;
                            model.next_id - 1
                        }
                    };
                    model.blocks.insert(id, (parent, step, 1));
                    ev.push(event_kind::STORED, id, parent, step);
                }
                1 if !ids.is_empty() => {
                    let b = ids[rng.next_below(ids.len() as u32) as usize];
                    let e = model.blocks.get_mut(&b).unwrap();
                    e.1 = step;
                    e.2 += 1;
                    ev.push(event_kind::HIT, b, NO_PARENT, step);
                }
                2 => {
                    let used: Vec<u32> = model
                        .blocks
                        .iter()
                        .filter(|(_, v)| v.2 > 0)
                        .map(|(b, _)| *b)
                        .collect();
                    if let Some(&b) = used.get(rng.next_below(used.len().max(1) as u32) as usize) {
                        let e = model.blocks.get_mut(&b).unwrap();
                        e.2 -= 1;
                        if e.2 == 0 {
                            e.1 = step;
                            ev.push(event_kind::RELEASED, b, NO_PARENT, step);
                        }
                    }
                }
                _ => {
                    let leaves = model.evictable_leaves();
                    if !leaves.is_empty() {
                        let (_, b) = leaves[rng.next_below(leaves.len() as u32) as usize];
                        model.blocks.remove(&b);
                        model.freed.push(b);
                        ev.push(event_kind::REMOVED, b, NO_PARENT, step);
                    }
                }
            }
            state.apply(&ev.view());
            // Choosing in between must neither disturb the state nor go stale.
            if rng.next_below(5) == 0 {
                let count = rng.next_below(6) as usize;
                assert_eq!(
                    state.choose_victims(count as u32),
                    model.lru_order(count),
                    "step {step}"
                );
            }
        }
        let _ = ev;
        (state, model)
    }

    #[test]
    fn parent_becomes_candidate_after_child_in_same_call() {
        let mut s = LruState::new();
        let mut ev = ReplayEvents::default();
        ev.push(event_kind::STORED, 1, NO_PARENT, 1);
        ev.push(event_kind::STORED, 2, 1, 2);
        ev.push(event_kind::STORED, 3, NO_PARENT, 5);
        ev.push(event_kind::RELEASED, 2, NO_PARENT, 6);
        ev.push(event_kind::RELEASED, 1, NO_PARENT, 6);
        ev.push(event_kind::RELEASED, 3, NO_PARENT, 7);
        s.apply(&ev.view());
        // Block 1 is older than 3 only once 2 is gone; ties on step 6 go to the lower id.
        assert_eq!(s.choose_victims(3), vec![2, 1, 3]);
        // choose_victims changed nothing.
        assert_eq!(s.choose_victims(1), vec![2]);
        assert_eq!(
            s.validate_victims(&[1]),
            Err(VictimError::NotLeaf { block: 1 })
        );
        assert_eq!(
            s.validate_victims(&[2, 2]),
            Err(VictimError::NotCached { block: 2 })
        );
        assert!(s.validate_victims(&[3, 2, 1]).is_ok());
        // A hit pins the block again.
        let mut hit = ReplayEvents::default();
        hit.push(event_kind::HIT, 3, NO_PARENT, 8);
        s.apply(&hit.view());
        assert_eq!(s.choose_victims(5), vec![2, 1]);
        assert_eq!(
            s.validate_victims(&[3]),
            Err(VictimError::InUse { block: 3 })
        );
    }

    #[test]
    fn stale_entries_are_swept() {
        let mut s = LruState::new();
        let mut ev = ReplayEvents::default();
        for b in 0..10 {
            ev.push(event_kind::STORED, b, NO_PARENT, 0);
            ev.push(event_kind::RELEASED, b, NO_PARENT, 0);
        }
        s.apply(&ev.view());
        // Each hit + release leaves one stale entry behind.
        for step in 1..5_000u64 {
            let b = (step * 7 % 10) as u32;
            let mut ev = ReplayEvents::default();
            ev.push(event_kind::HIT, b, NO_PARENT, step);
            ev.push(event_kind::RELEASED, b, NO_PARENT, step);
            s.apply(&ev.view());
            assert!(s.heap.len() <= 2 * 10 + STALE_SLACK + 2);
        }
        assert_eq!(s.evictable_leaves(), 10);
        // Block b was last touched at the last step ≡ 3b (mod 10) below 5000.
        let mut want: Vec<(u64, u32)> = (0..10u32)
            .map(|b| (4990 + (3 * b as u64) % 10, b))
            .map(|(t, b)| (if t >= 5000 { t - 10 } else { t }, b))
            .collect();
        want.sort_unstable();
        let want: Vec<u32> = want.into_iter().map(|(_, b)| b).collect();
        assert_eq!(s.choose_victims(10), want);
    }

    #[test]
    fn removed_parent_detaches_children() {
        let mut s = LruState::new();
        let mut ev = ReplayEvents::default();
        ev.push(event_kind::STORED, 1, NO_PARENT, 1);
        ev.push(event_kind::STORED, 2, 1, 1);
        ev.push(event_kind::REMOVED, 1, NO_PARENT, 2);
        // id 1 reused for an unrelated block
        ev.push(event_kind::STORED, 1, NO_PARENT, 3);
        ev.push(event_kind::RELEASED, 1, NO_PARENT, 3);
        ev.push(event_kind::RELEASED, 2, NO_PARENT, 4);
        ev.push(event_kind::REMOVED, 2, NO_PARENT, 5);
        s.apply(&ev.view());
        assert_eq!(s.choose_victims(2), vec![1]);
    }

    proptest! {
        #[test]
        fn matches_the_model(seed in any::<u64>(), ops in 1usize..300, count in 0u32..40) {
            let (mut state, model) = run_history(seed, ops);
            let want = model.lru_order(count as usize);
            let got = state.choose_victims(count);
            prop_assert_eq!(&got, &want);
            prop_assert!(state.validate_victims(&got).is_ok());
            prop_assert_eq!(state.evictable_leaves(), model.evictable_leaves().len());
            // Parent never before child: each victim has no child left among cached blocks
            // not yet evicted.
            let mut m = model.clone();
            for v in &got {
                prop_assert_eq!(m.children(*v), 0);
                m.blocks.remove(v);
            }
        }

        #[test]
        fn replay_rebuilds_the_same_order(seed in any::<u64>(), ops in 1usize..200) {
            let (mut state, _) = run_history(seed, ops);
            let mut replay = ReplayEvents::default();
            state.replay_events(&mut replay);
            let mut rebuilt = LruState::new();
            rebuilt.apply(&replay.view());
            prop_assert_eq!(rebuilt.len(), state.len());
            prop_assert_eq!(rebuilt.choose_victims(1000), state.choose_victims(1000));
        }
    }
}
