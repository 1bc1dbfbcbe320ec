use proptest::prelude::*;

use super::*;

fn h(x: u128) -> BlockHash {
    BlockHash(x)
}

/// Allocates a chain of `n` registered blocks (hashes `base..base+n`) and releases it.
fn cached_chain(pool: &mut BlockPool, base: u128, n: usize, step: u64) -> Vec<u32> {
    let mut blocks = Vec::new();
    pool.allocate(n, step, &mut blocks).unwrap();
    let mut parent = NO_PARENT;
    for (i, &b) in blocks.iter().enumerate() {
        assert!(pool.register(b, h(base + i as u128), parent, step));
        parent = b;
    }
    pool.release(&blocks, step).unwrap();
    blocks
}

#[test]
fn release_keeps_hash_and_hit_reuses_block() {
    let mut pool = BlockPool::new(4, None);
    let chain = cached_chain(&mut pool, 10, 2, 1);
    assert_eq!(pool.cached_unused(), 2);
    assert_eq!(pool.available(), 4);
    assert_eq!(pool.match_len(&[h(10), h(11), h(12)]), 2);
    assert_eq!(pool.lookup(h(11)), Some(chain[1]));
    pool.pin(chain[0], 2).unwrap();
    assert_eq!(pool.refs(chain[0]), 1);
    assert_eq!(pool.cached_unused(), 1);
    pool.check_invariants().unwrap();
}

#[test]
fn duplicate_hash_is_not_registered_twice() {
    let mut pool = BlockPool::new(4, None);
    let mut a = Vec::new();
    pool.allocate(2, 0, &mut a).unwrap();
    assert!(pool.register(a[0], h(1), NO_PARENT, 0));
    assert!(!pool.register(a[1], h(1), NO_PARENT, 0));
    pool.release(&a, 0).unwrap();
    // The duplicate went straight back to the free list.
    assert_eq!(pool.free_count(), 3);
    pool.check_invariants().unwrap();
}

#[test]
fn lru_evicts_oldest_leaf_first_and_never_a_parent_before_its_child() {
    let mut pool = BlockPool::new(5, None);
    // Chain A (root a0 -> a1 -> a2) released at step 1; chain B (b0 -> b1) at step 2.
    let a = cached_chain(&mut pool, 100, 3, 1);
    let b = cached_chain(&mut pool, 200, 2, 2);
    let mut got = Vec::new();
    pool.allocate(1, 3, &mut got).unwrap();
    // All of A shares step 1; a2 is A's only leaf, so it goes first even though a0 has the
    // lowest id.
    assert_eq!(got, vec![a[2]]);
    pool.allocate(2, 3, &mut got).unwrap();
    // Then the chain is peeled from the leaf inward: a1 before a0; B (newer) is untouched.
    assert_eq!(evicted_order(&mut pool), vec![a[2], a[1], a[0]]);
    assert_eq!(pool.match_len(&[h(200), h(201)]), 2);
    assert_eq!(pool.lookup(h(201)), Some(b[1]));
    pool.check_invariants().unwrap();
}

#[test]
fn lru_order_is_last_access_then_id() {
    let mut pool = BlockPool::new(3, None);
    let x = cached_chain(&mut pool, 1, 1, 5);
    let y = cached_chain(&mut pool, 2, 1, 3);
    let z = cached_chain(&mut pool, 3, 1, 3);
    let mut got = Vec::new();
    pool.allocate(3, 6, &mut got).unwrap();
    let mut tie = vec![y[0], z[0]];
    tie.sort();
    assert_eq!(evicted_order(&mut pool), vec![tie[0], tie[1], x[0]]);
}

fn evicted_order(pool: &mut BlockPool) -> Vec<u32> {
    let mut removed = Vec::new();
    pool.take_removed(&mut removed);
    removed.into_iter().map(|(b, _)| b).collect()
}

#[test]
fn pinned_blocks_are_never_evicted_and_no_space_changes_nothing() {
    let mut pool = BlockPool::new(3, None);
    let c = cached_chain(&mut pool, 1, 2, 1);
    pool.pin(c[0], 2).unwrap();
    pool.pin(c[1], 2).unwrap();
    let mut got = Vec::new();
    let err = pool.allocate(2, 3, &mut got).unwrap_err();
    assert_eq!(
        err,
        PoolError::NoSpace {
            need: 2,
            available: 1
        }
    );
    assert!(got.is_empty());
    assert_eq!(pool.match_len(&[h(1), h(2)]), 2);
    pool.check_invariants().unwrap();
}

#[test]
fn double_free_is_an_error() {
    let mut pool = BlockPool::new(2, None);
    let mut a = Vec::new();
    pool.allocate(1, 0, &mut a).unwrap();
    pool.release(&a, 0).unwrap();
    assert_eq!(pool.release(&a, 0), Err(PoolError::DoubleFree(a[0])));
}

#[test]
fn clear_index_frees_unused_and_unhashes_used() {
    let mut pool = BlockPool::new(4, None);
    let c = cached_chain(&mut pool, 1, 2, 1);
    pool.pin(c[0], 2).unwrap();
    assert_eq!(pool.clear_index(3), 2);
    assert_eq!(pool.indexed(), 0);
    assert_eq!(pool.free_count(), 3);
    pool.release(&[c[0]], 4).unwrap();
    assert_eq!(pool.free_count(), 4);
    let mut removed = Vec::new();
    pool.take_removed(&mut removed);
    assert_eq!(removed.len(), 2);
    pool.check_invariants().unwrap();
}

/// An evictor that answers with a fixed list and records the events it saw.
struct Scripted {
    answer: Vec<u32>,
    seen: Vec<(u8, u32)>,
}

impl Evictor for Scripted {
    fn on_events(&mut self, events: &CacheEvents) {
        for i in 0..events.len() {
            self.seen.push((events.kinds[i], events.blocks[i]));
        }
    }
    fn choose_victims(&mut self, _count: u32, _step: u64) -> Decision<Vec<u32>> {
        Decision::Use(self.answer.clone())
    }
}

#[test]
fn evictor_victims_are_used_when_valid() {
    let mut pool = BlockPool::new(4, None);
    let a = cached_chain(&mut pool, 1, 1, 1);
    let b = cached_chain(&mut pool, 2, 1, 2);
    pool.evictor = Some(Box::new(Scripted {
        answer: vec![b[0]],
        seen: Vec::new(),
    }));
    pool.pin(a[0], 3).unwrap();
    pool.release(&[a[0]], 3).unwrap();
    let mut got = Vec::new();
    // Two free blocks, then one eviction: the evictor prefers b (newer) over LRU's a.
    pool.allocate(3, 4, &mut got).unwrap();
    assert!(got.contains(&b[0]));
    assert_eq!(pool.lookup(h(1)), Some(a[0]));
    assert_eq!(pool.evictor_fallbacks(), 0);
}

#[test]
fn invalid_evictor_victim_falls_back_to_lru() {
    let mut pool = BlockPool::new(3, None);
    let c = cached_chain(&mut pool, 1, 2, 1);
    // c[0] is the parent of c[1]: evicting it first would orphan the child.
    pool.evictor = Some(Box::new(Scripted {
        answer: vec![c[0]],
        seen: Vec::new(),
    }));
    let mut got = Vec::new();
    pool.allocate(2, 2, &mut got).unwrap();
    assert_eq!(pool.evictor_fallbacks(), 1);
    assert_eq!(pool.match_len(&[h(1)]), 1, "parent kept, child evicted");
    assert_eq!(pool.lookup(h(2)), None);
    pool.check_invariants().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    /// Allocate n blocks for a new user; register a prefix of them as a chain rooted at a
    /// previously registered chain or a new root.
    Alloc {
        n: usize,
        register: usize,
        seed: u8,
    },
    /// A new user pins the matched prefix of a known chain and allocates more.
    Hit {
        which: usize,
        extra: usize,
    },
    /// Release a user.
    Release {
        which: usize,
    },
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..5, 0usize..5, 0u8..6).prop_map(|(n, register, seed)| Op::Alloc { n, register, seed }),
        3 => (0usize..8, 0usize..3).prop_map(|(which, extra)| Op::Hit { which, extra }),
        4 => (0usize..8).prop_map(|which| Op::Release { which }),
        1 => Just(Op::Clear),
    ]
}

proptest! {
    #[test]
    fn pool_invariants_hold_under_random_use(ops in proptest::collection::vec(op(), 1..80)) {
        let mut pool = BlockPool::new(12, None);
        // Each user: its blocks and the hashes it registered / matched, in chain order.
        let mut users: Vec<(Vec<u32>, Vec<BlockHash>, u32)> = Vec::new();
        let mut epoch = 0u32;
        let mut chains: Vec<Vec<BlockHash>> = Vec::new();
        for (step, op) in ops.into_iter().enumerate() {
            let step = step as u64;
            match op {
                Op::Alloc { n, register, seed } => {
                    let mut blocks = Vec::new();
                    if pool.allocate(n, step, &mut blocks).is_err() { continue; }
                    let mut hashes = Vec::new();
                    let mut parent = NO_PARENT;
                    for (i, &b) in blocks.iter().take(register).enumerate() {
                        let hash = h(u128::from(seed) << 64 | i as u128);
                        if !pool.register(b, hash, parent, step) { break; }
                        hashes.push(hash);
                        parent = b;
                    }
                    if !hashes.is_empty() { chains.push(hashes.clone()); }
                    users.push((blocks, hashes, epoch));
                }
                Op::Hit { which, extra } => {
                    let Some(chain) = chains.get(which % chains.len().max(1)) else { continue };
                    let m = pool.match_len(chain);
                    let matched: Vec<u32> = chain[..m].iter().filter_map(|&x| pool.lookup(x)).collect();
                    let unused = pool.count_unused(&matched);
                    if pool.available() - unused < extra { continue; }
                    for &b in &matched { pool.pin(b, step).unwrap(); }
                    let mut blocks = matched;
                    pool.allocate(extra, step, &mut blocks).unwrap();
                    // No block may appear twice in one user's table.
                    let mut sorted = blocks.clone();
                    sorted.sort();
                    sorted.dedup();
                    prop_assert_eq!(sorted.len(), blocks.len());
                    users.push((blocks, chain[..m].to_vec(), epoch));
                }
                Op::Release { which } => {
                    if users.is_empty() { continue; }
                    let (blocks, _, _) = users.swap_remove(which % users.len());
                    prop_assert!(pool.release(&blocks, step).is_ok());
                }
                Op::Clear => { pool.clear_index(step); epoch += 1; }
            }
            if let Err(e) = pool.check_invariants() {
                return Err(TestCaseError::fail(e));
            }
            // Every user's matched chain is still intact (pinned blocks are never evicted).
            // (A clear unhashes even used blocks, so only users from after the last clear.)
            for (_, hashes, e) in &users {
                if *e == epoch {
                    for &x in hashes {
                        prop_assert!(pool.lookup(x).is_some(), "pinned hash evicted");
                    }
                }
            }
        }
        // Once every user is gone, nothing is left in use.
        for (blocks, _, _) in users.drain(..) {
            prop_assert!(pool.release(&blocks, 1000).is_ok());
        }
        prop_assert_eq!(pool.available(), pool.total());
        pool.clear_index(1001);
        prop_assert_eq!(pool.free_count(), pool.total());
    }
}
