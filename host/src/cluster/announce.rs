//! What an external prefix router may be told a worker holds: the hybrid rule.
//!
//! Cluster routers (Dynamo's KV router, llm-d's precise prefix scorer, Ray Serve's) mirror each
//! worker's cached blocks from its KV events and send a prompt where the most leading blocks
//! match. On an attention-only model every cached block is reusable. On a hybrid it is not: a
//! request resumes only from a block boundary where an SSM snapshot was kept, so a worker
//! holding a prompt's KV blocks but no snapshot among them recomputes the whole prompt, and a
//! router crediting those blocks sends turns to the wrong worker.
//!
//! [`Announcer`] turns a worker's [`KvEvent`]s (one stream per replica) into the events an
//! external router should see: on a hybrid a block is announced only once a snapshot at or past
//! it, on its own chain, exists (so the chain up to the snapshot is announced, parents first),
//! and withdrawn as soon as no such snapshot is left, its block evicted or the snapshot given
//! up. On an attention-only model every stored block is announced at once. The replicas of one
//! worker are announced as their union: a block is withdrawn when the last replica holding it
//! lets it go.
//!
//! Owns: per replica, a forest of the blocks its cache indexes (parent links, tokens, snapshot
//! flags, the count of snapshots at or below each block) and the union count per hash.
//! Invariants: a block is announced iff some replica holds it attached to a root (every
//! ancestor indexed) with at least one snapshot in its subtree (any block, on attention-only
//! models); an announced block's parent is announced before it; hashes are the cache's short
//! hashes, tokens `block_size` per block.

use std::collections::HashMap;

use crate::cache::KvEvent;

/// One change of what a worker announces. `Stored` is one chain: `blocks[0]`'s parent is
/// `parent` (`None`: a sequence's first block), each next block the child of the one before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Announcement {
    Stored {
        parent: Option<u64>,
        blocks: Vec<u64>,
        /// `block_size` token ids per block, in the order of `blocks`.
        tokens: Vec<u32>,
    },
    /// Blocks withdrawn, children before parents.
    Removed { hashes: Vec<u64> },
}

#[derive(Debug)]
struct Node {
    parent: Option<u64>,
    children: Vec<u64>,
    tokens: Box<[u32]>,
    snapshot: bool,
    /// Snapshots at this block or below it (counting only blocks attached through it).
    below: u32,
    /// Every ancestor is indexed.
    attached: bool,
}

/// One replica's index as the announcer keeps it.
#[derive(Debug, Default)]
struct Forest {
    nodes: HashMap<u64, Node>,
    /// Children of blocks that were removed while they stayed indexed, by the missing parent.
    orphans: HashMap<u64, Vec<u64>>,
}

/// Turns the cache events of a worker's replicas into [`Announcement`]s (see the module
/// documentation).
#[derive(Debug)]
pub struct Announcer {
    hybrid: bool,
    replicas: Vec<Forest>,
    /// How many replicas announce each hash.
    union: HashMap<u64, u32>,
    /// Blocks announced by a replica and not by any before it, in announcement order, and
    /// blocks withdrawn by the last replica holding them (scratch of one event).
    newly: Vec<(u64, Option<u64>)>,
    gone: Vec<u64>,
}

impl Announcer {
    /// An announcer for `replicas` replicas of a model; `hybrid`: whether requests resume from
    /// SSM snapshots (the hybrid rule applies).
    pub fn new(replicas: usize, hybrid: bool) -> Self {
        Self {
            hybrid,
            replicas: (0..replicas.max(1)).map(|_| Forest::default()).collect(),
            union: HashMap::new(),
            newly: Vec::new(),
            gone: Vec::new(),
        }
    }

    /// Blocks announced now (any replica).
    pub fn announced(&self) -> usize {
        self.union.len()
    }

    /// Whether `hash` is announced.
    pub fn is_announced(&self, hash: u64) -> bool {
        self.union.contains_key(&hash)
    }

    /// How many leading blocks of a prompt (its short block hashes) are announced.
    pub fn announced_prefix(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.is_announced(**h)).count()
    }

    /// Applies one event of replica `replica` and appends what changes for the router to `out`.
    pub fn apply(&mut self, replica: usize, event: &KvEvent, out: &mut Vec<Announcement>) {
        let Some(forest) = self.replicas.get_mut(replica) else {
            return;
        };
        let mut up = Vec::new();
        let mut down = Vec::new();
        match event {
            KvEvent::Stored { blocks, .. } => {
                for (i, b) in blocks.iter().enumerate() {
                    let snapshot = b.snapshot || !self.hybrid;
                    forest.store(
                        b.hash,
                        b.parent,
                        event.block_tokens(i),
                        snapshot,
                        &mut up,
                        &mut down,
                    );
                }
            }
            KvEvent::SnapshotStored { hashes } => {
                for &h in hashes {
                    forest.set_snapshot(h, true, &mut up, &mut down);
                }
            }
            KvEvent::SnapshotRemoved { hashes } => {
                if self.hybrid {
                    for &h in hashes {
                        forest.set_snapshot(h, false, &mut up, &mut down);
                    }
                }
            }
            KvEvent::Removed { hashes } => {
                for &h in hashes {
                    forest.remove(h, &mut down);
                }
            }
            KvEvent::Cleared => {
                for (&h, n) in &forest.nodes {
                    if n.attached && n.below > 0 {
                        down.push(h);
                    }
                }
                forest.nodes.clear();
                forest.orphans.clear();
            }
        }
        self.merge(replica, &up, &down, out);
    }

    /// Folds one replica's announced (`up`, parents first) and withdrawn (`down`, children
    /// first) blocks into the union and emits the union's changes.
    fn merge(&mut self, replica: usize, up: &[u64], down: &[u64], out: &mut Vec<Announcement>) {
        self.gone.clear();
        for &h in down {
            if let Some(c) = self.union.get_mut(&h) {
                *c -= 1;
                if *c == 0 {
                    self.union.remove(&h);
                    self.gone.push(h);
                }
            }
        }
        if !self.gone.is_empty() {
            out.push(Announcement::Removed {
                hashes: std::mem::take(&mut self.gone),
            });
        }
        self.newly.clear();
        for &h in up {
            let c = self.union.entry(h).or_insert(0);
            *c += 1;
            if *c == 1 {
                let parent = self.replicas[replica].nodes.get(&h).and_then(|n| n.parent);
                self.newly.push((h, parent));
            }
        }
        // Consecutive blocks that continue one chain become one `Stored`.
        let forest = &self.replicas[replica];
        let mut i = 0;
        while i < self.newly.len() {
            let (first, parent) = self.newly[i];
            let mut blocks = vec![first];
            let mut tokens = forest.tokens(first).to_vec();
            i += 1;
            while i < self.newly.len() && self.newly[i].1 == blocks.last().copied() {
                let h = self.newly[i].0;
                blocks.push(h);
                tokens.extend_from_slice(forest.tokens(h));
                i += 1;
            }
            out.push(Announcement::Stored {
                parent,
                blocks,
                tokens,
            });
        }
    }
}

impl Forest {
    fn tokens(&self, h: u64) -> &[u32] {
        self.nodes.get(&h).map_or(&[], |n| &n.tokens)
    }

    fn store(
        &mut self,
        hash: u64,
        parent: Option<u64>,
        tokens: &[u32],
        snapshot: bool,
        up: &mut Vec<u64>,
        down: &mut Vec<u64>,
    ) {
        if self.nodes.contains_key(&hash) {
            // Indexed already (a repeated event): only the snapshot can be news.
            if snapshot {
                self.set_snapshot(hash, true, up, down);
            }
            return;
        }
        let attached = match parent {
            None => true,
            Some(p) => self.nodes.get(&p).is_some_and(|n| n.attached),
        };
        let children = self.orphans.remove(&hash).unwrap_or_default();
        let below = u32::from(snapshot)
            + children
                .iter()
                .filter_map(|c| self.nodes.get(c))
                .map(|c| c.below)
                .sum::<u32>();
        if let Some(p) = parent {
            match self.nodes.get_mut(&p) {
                Some(n) => n.children.push(hash),
                None => self.orphans.entry(p).or_default().push(hash),
            }
        }
        self.nodes.insert(
            hash,
            Node {
                parent,
                children,
                tokens: tokens.into(),
                snapshot,
                below,
                attached,
            },
        );
        // Ancestors first (announced only if attached), then this block and whatever was
        // waiting below it.
        self.add_below(parent, below, up);
        if attached {
            self.attach_subtree(hash, up);
        }
    }

    /// Adds `delta` snapshots to the counts of `from` and its ancestors; those that had none
    /// become announced (appended parents first).
    fn add_below(&mut self, from: Option<u64>, delta: u32, up: &mut Vec<u64>) {
        if delta == 0 {
            return;
        }
        let start = up.len();
        let mut at = from;
        while let Some(h) = at {
            let Some(n) = self.nodes.get_mut(&h) else {
                break;
            };
            n.below += delta;
            if n.below == delta && n.attached {
                up.push(h);
            }
            at = n.parent;
        }
        up[start..].reverse();
    }

    /// Takes `delta` snapshots from the counts of `from` and its ancestors; those left with
    /// none are withdrawn (appended children first).
    fn sub_below(&mut self, from: Option<u64>, delta: u32, down: &mut Vec<u64>) {
        if delta == 0 {
            return;
        }
        let mut at = from;
        while let Some(h) = at {
            let Some(n) = self.nodes.get_mut(&h) else {
                break;
            };
            let before = n.below;
            n.below = n.below.saturating_sub(delta);
            if before > 0 && n.below == 0 && n.attached {
                down.push(h);
            }
            at = n.parent;
        }
    }

    /// Marks `root`'s subtree attached and announces its blocks that have a snapshot below
    /// (parents first).
    fn attach_subtree(&mut self, root: u64, up: &mut Vec<u64>) {
        let mut stack = vec![root];
        while let Some(h) = stack.pop() {
            let Some(n) = self.nodes.get_mut(&h) else {
                continue;
            };
            n.attached = true;
            if n.below > 0 {
                up.push(h);
                stack.extend(n.children.iter().copied());
            } else {
                // Nothing announced below either, but the subtree is attached all the same.
                let mut quiet: Vec<u64> = n.children.clone();
                while let Some(c) = quiet.pop() {
                    if let Some(cn) = self.nodes.get_mut(&c) {
                        cn.attached = true;
                        quiet.extend(cn.children.iter().copied());
                    }
                }
            }
        }
    }

    fn set_snapshot(&mut self, hash: u64, on: bool, up: &mut Vec<u64>, down: &mut Vec<u64>) {
        let Some(n) = self.nodes.get_mut(&hash) else {
            return;
        };
        if n.snapshot == on {
            return;
        }
        n.snapshot = on;
        // Counts change up to the root of its tree, which announces only if attached.
        if on {
            self.add_below(Some(hash), 1, up);
        } else {
            self.sub_below(Some(hash), 1, down);
        }
    }

    fn remove(&mut self, hash: u64, down: &mut Vec<u64>) {
        let Some(n) = self.nodes.remove(&hash) else {
            return;
        };
        // Its subtree stays indexed but cannot be reached: withdrawn, children first.
        let mut subtree = Vec::new();
        let mut stack = n.children.clone();
        while let Some(c) = stack.pop() {
            if let Some(cn) = self.nodes.get_mut(&c) {
                if cn.attached && cn.below > 0 {
                    subtree.push(c);
                }
                cn.attached = false;
                stack.extend(cn.children.iter().copied());
            }
        }
        down.extend(subtree.into_iter().rev());
        if n.attached && n.below > 0 {
            down.push(hash);
        }
        self.sub_below(n.parent, n.below, down);
        if let Some(p) = n.parent {
            if let Some(pn) = self.nodes.get_mut(&p) {
                pn.children.retain(|&c| c != hash);
            } else if let Some(siblings) = self.orphans.get_mut(&p) {
                siblings.retain(|&c| c != hash);
                if siblings.is_empty() {
                    self.orphans.remove(&p);
                }
            }
        }
        if !n.children.is_empty() {
            self.orphans.insert(hash, n.children);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;
    use crate::cache::StoredBlock;

    const BS: usize = 2;

    fn stored(blocks: &[(u64, Option<u64>, bool)]) -> KvEvent {
        KvEvent::Stored {
            blocks: blocks
                .iter()
                .map(|&(hash, parent, snapshot)| StoredBlock {
                    hash,
                    parent,
                    snapshot,
                })
                .collect(),
            tokens: blocks
                .iter()
                .flat_map(|&(h, _, _)| [h as u32; BS])
                .collect(),
        }
    }

    /// What a router holds after the announcements, checking their order as it goes.
    #[derive(Default)]
    struct Router(HashSet<u64>);

    impl Router {
        fn apply(&mut self, out: &mut Vec<Announcement>) {
            for a in out.drain(..) {
                match a {
                    Announcement::Stored {
                        parent,
                        blocks,
                        tokens,
                    } => {
                        if let Some(p) = parent {
                            assert!(self.0.contains(&p), "parent {p} not announced");
                        }
                        assert_eq!(tokens.len(), blocks.len() * BS);
                        for (i, h) in blocks.iter().enumerate() {
                            assert_eq!(tokens[i * BS], *h as u32, "tokens of {h}");
                            assert!(self.0.insert(*h), "{h} announced twice");
                        }
                    }
                    Announcement::Removed { hashes } => {
                        for h in hashes {
                            assert!(self.0.remove(&h), "{h} withdrawn but not announced");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_hybrid_chain_is_announced_once_a_snapshot_ends_it() {
        let mut a = Announcer::new(1, true);
        let mut out = Vec::new();
        let mut r = Router::default();
        a.apply(
            0,
            &stored(&[(1, None, false), (2, Some(1), false)]),
            &mut out,
        );
        assert!(out.is_empty(), "no snapshot, nothing reusable: {out:?}");
        a.apply(0, &stored(&[(3, Some(2), true)]), &mut out);
        assert_eq!(
            out,
            vec![Announcement::Stored {
                parent: None,
                blocks: vec![1, 2, 3],
                tokens: vec![1, 1, 2, 2, 3, 3],
            }]
        );
        r.apply(&mut out);
        // A block past the snapshot, without one of its own: not reusable.
        a.apply(0, &stored(&[(4, Some(3), false)]), &mut out);
        assert!(out.is_empty());
        a.apply(0, &KvEvent::SnapshotStored { hashes: vec![4] }, &mut out);
        assert_eq!(
            out,
            vec![Announcement::Stored {
                parent: Some(3),
                blocks: vec![4],
                tokens: vec![4, 4],
            }]
        );
        r.apply(&mut out);
        // The deeper snapshot goes: block 4 is withdrawn, the chain to 3 stays.
        a.apply(0, &KvEvent::SnapshotRemoved { hashes: vec![4] }, &mut out);
        assert_eq!(out, vec![Announcement::Removed { hashes: vec![4] }]);
        r.apply(&mut out);
        // The last snapshot goes: the whole chain, children first.
        a.apply(0, &KvEvent::SnapshotRemoved { hashes: vec![3] }, &mut out);
        assert_eq!(
            out,
            vec![Announcement::Removed {
                hashes: vec![3, 2, 1]
            }]
        );
        r.apply(&mut out);
        assert!(r.0.is_empty());
        assert_eq!(a.announced(), 0);
    }

    #[test]
    fn attention_only_blocks_are_announced_at_once_and_replicas_are_a_union() {
        let mut a = Announcer::new(2, false);
        let mut out = Vec::new();
        let mut r = Router::default();
        a.apply(
            0,
            &stored(&[(1, None, false), (2, Some(1), false)]),
            &mut out,
        );
        a.apply(1, &stored(&[(1, None, false)]), &mut out);
        r.apply(&mut out);
        assert_eq!(r.0, HashSet::from([1, 2]));
        // Replica 0 evicts block 1 (and so loses block 2's chain); replica 1 still has 1.
        a.apply(0, &KvEvent::Removed { hashes: vec![1] }, &mut out);
        assert_eq!(out, vec![Announcement::Removed { hashes: vec![2] }]);
        r.apply(&mut out);
        // Block 1 comes back on replica 0: its orphaned child 2 is reachable again.
        a.apply(0, &stored(&[(1, None, false)]), &mut out);
        r.apply(&mut out);
        assert_eq!(r.0, HashSet::from([1, 2]));
        a.apply(1, &KvEvent::Cleared, &mut out);
        r.apply(&mut out);
        assert_eq!(r.0, HashSet::from([1, 2]));
        a.apply(0, &KvEvent::Cleared, &mut out);
        r.apply(&mut out);
        assert!(r.0.is_empty());
    }

    /// The announced set after each event, from scratch: blocks whose chain to a root is
    /// indexed and which have a snapshot (any block on attention-only models) at or below them,
    /// through indexed blocks.
    fn oracle(replicas: &[HashMap<u64, (Option<u64>, bool)>], hybrid: bool) -> HashSet<u64> {
        let mut out = HashSet::new();
        for blocks in replicas {
            let attached = |mut h: u64| loop {
                match blocks.get(&h) {
                    None => return false,
                    Some((None, _)) => return true,
                    Some((Some(p), _)) => h = *p,
                }
            };
            for (&h, &(_, snap)) in blocks {
                if (snap || !hybrid) && attached(h) {
                    let mut at = Some(h);
                    while let Some(x) = at {
                        out.insert(x);
                        at = blocks[&x].0;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn random_event_streams_match_the_oracle() {
        for hybrid in [true, false] {
            for seed in 1..40u64 {
                let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let mut next = |n: u64| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng % n.max(1)
                };
                let mut a = Announcer::new(2, hybrid);
                let mut cache: Vec<HashMap<u64, (Option<u64>, bool)>> = vec![HashMap::new(); 2];
                let mut r = Router::default();
                let mut out = Vec::new();
                let mut fresh = 100u64;
                for _ in 0..300 {
                    let rep = next(2) as usize;
                    let other: Vec<(u64, Option<u64>)> = {
                        let mut v: Vec<(u64, Option<u64>)> =
                            cache[1 - rep].iter().map(|(&h, &(p, _))| (h, p)).collect();
                        v.sort_unstable();
                        v
                    };
                    let c = &mut cache[rep];
                    let keys: Vec<u64> = {
                        let mut k: Vec<u64> = c.keys().copied().collect();
                        k.sort_unstable();
                        k
                    };
                    let pick = |i: u64| keys.get(i as usize).copied();
                    let event = match next(10) {
                        // A block the other replica holds, where its parent is here too (a
                        // shared prefix).
                        0 => match other.get(next(other.len() as u64) as usize) {
                            Some(&(h, p))
                                if !c.contains_key(&h) && p.is_none_or(|p| c.contains_key(&p)) =>
                            {
                                let snap = next(2) == 0;
                                c.insert(h, (p, snap));
                                stored(&[(h, p, snap)])
                            }
                            _ => continue,
                        },
                        // Extend a chain (from a root or an indexed block) by 1-3 blocks.
                        1..=4 => {
                            let mut parent = if next(3) == 0 {
                                None
                            } else {
                                pick(next(keys.len() as u64 + 1))
                            };
                            let mut blocks = Vec::new();
                            for _ in 0..=next(3) {
                                fresh += 1;
                                let h = fresh;
                                let snap = next(3) == 0;
                                blocks.push((h, parent, snap));
                                parent = Some(h);
                            }
                            for &(h, p, s) in &blocks {
                                c.insert(h, (p, s));
                            }
                            stored(&blocks)
                        }
                        5 | 6 => match pick(next(keys.len() as u64)) {
                            Some(h) => {
                                let on = next(2) == 0;
                                c.get_mut(&h).unwrap().1 = on;
                                if on {
                                    KvEvent::SnapshotStored { hashes: vec![h] }
                                } else {
                                    KvEvent::SnapshotRemoved { hashes: vec![h] }
                                }
                            }
                            None => continue,
                        },
                        7 | 8 => match pick(next(keys.len() as u64)) {
                            Some(h) => {
                                c.remove(&h);
                                KvEvent::Removed { hashes: vec![h] }
                            }
                            None => continue,
                        },
                        _ => {
                            if next(4) != 0 {
                                continue;
                            }
                            c.clear();
                            KvEvent::Cleared
                        }
                    };
                    a.apply(rep, &event, &mut out);
                    r.apply(&mut out);
                    let want = oracle(&cache, hybrid);
                    assert_eq!(r.0, want, "seed {seed} hybrid {hybrid} after {event:?}");
                    assert_eq!(a.announced(), want.len());
                }
            }
        }
    }
}
