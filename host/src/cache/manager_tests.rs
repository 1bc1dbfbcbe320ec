use super::*;

const BS: usize = 4;

fn layout(blocks: usize, live: usize, durable: usize) -> CacheLayout {
    CacheLayout {
        block_size: BS,
        num_blocks: blocks,
        live_slots: live,
        durable_slots: durable,
        kv_bytes: 0,
        ssm_bytes: 0,
    }
}

fn hashes(tokens: &[u32]) -> Vec<BlockHash> {
    let mut h = Vec::new();
    HashSeed::new("test").extend(&mut h, tokens, BS);
    h
}

/// Admits, "computes" the whole prompt in one step (with planned snapshots) and commits.
fn run_prompt(cm: &mut CacheManager, seq: u32, tokens: &[u32]) -> (PrefixMatch, SsmInit) {
    let h = hashes(tokens);
    let m = cm.match_prefix(&h, tokens.len());
    let init = cm.admit(seq, &h, m, tokens.len()).unwrap();
    let ctx = m.skip_blocks * BS;
    cm.count_prefix_query(tokens.len(), ctx);
    let mut snaps = Vec::new();
    cm.plan_snapshots(
        seq,
        &h,
        tokens.len(),
        m.kv_blocks,
        &[],
        ctx,
        tokens.len() - ctx,
        &mut snaps,
    );
    cm.commit_seq(seq, &h, tokens, tokens.len());
    cm.commit_step();
    (m, init)
}

#[test]
fn second_request_skips_the_cached_prefix() {
    let mut cm = CacheManager::new(&layout(16, 0, 0), true, false, None);
    let a: Vec<u32> = (0..10).collect();
    let (m, _) = run_prompt(&mut cm, 0, &a);
    assert_eq!(m, PrefixMatch::default());
    cm.release(0).unwrap();
    assert_eq!(cm.pool().cached_unused(), 2, "two full blocks stay cached");
    let mut b = a.clone();
    b.extend([77, 78, 79]);
    let (m, _) = run_prompt(&mut cm, 1, &b);
    assert_eq!(
        m,
        PrefixMatch {
            kv_blocks: 2,
            skip_blocks: 2
        }
    );
    // In tokens: two prompts of 10 and 13 queried, two blocks of 4 served from the cache.
    assert_eq!(cm.counters.prefix_hits, 8);
    assert_eq!(cm.counters.prefix_queries, 23);
    // The table starts with the cached blocks.
    let first = cm.pool().lookup(hashes(&a)[0]).unwrap();
    assert_eq!(cm.block_table(1)[0], first);
    cm.release(1).unwrap();
    assert_eq!(cm.available_blocks(), 16);
    cm.check_invariants().unwrap();
}

#[test]
fn skip_leaves_at_least_two_tokens() {
    let mut cm = CacheManager::new(&layout(16, 0, 0), true, false, None);
    let a: Vec<u32> = (0..8).collect();
    run_prompt(&mut cm, 0, &a);
    cm.release(0).unwrap();
    // Fully cached, block-aligned: recompute the last block.
    assert_eq!(
        cm.match_prefix(&hashes(&a), 8),
        PrefixMatch {
            kv_blocks: 2,
            skip_blocks: 1
        }
    );
    // One token past the cache: skipping 2 blocks would leave 1 token, so back off.
    let b: Vec<u32> = (0..9).collect();
    assert_eq!(
        cm.match_prefix(&hashes(&b), 9),
        PrefixMatch {
            kv_blocks: 2,
            skip_blocks: 1
        }
    );
    let c: Vec<u32> = (0..10).collect();
    assert_eq!(
        cm.match_prefix(&hashes(&c), 10),
        PrefixMatch {
            kv_blocks: 2,
            skip_blocks: 2
        }
    );
}

#[test]
fn fully_cached_prompt_keeps_its_matched_tail_pinned() {
    let mut cm = CacheManager::new(&layout(4, 0, 0), true, false, None);
    let a: Vec<u32> = (0..8).collect();
    run_prompt(&mut cm, 0, &a);
    cm.release(0).unwrap();
    let (m, _) = run_prompt(&mut cm, 1, &a);
    assert_eq!(m.skip_blocks, 1);
    // Block 1 is recomputed into a fresh block but the cached copy stays pinned and indexed.
    let cached = cm.pool().lookup(hashes(&a)[1]).unwrap();
    assert_ne!(cm.block_table(1)[1], cached);
    assert_eq!(cm.pool().refs(cached), 1);
    cm.release(1).unwrap();
    assert_eq!(cm.available_blocks(), 4);
    cm.check_invariants().unwrap();
}

#[test]
fn hybrid_restores_only_where_a_snapshot_exists() {
    let mut cm = CacheManager::new(&layout(32, 2, 8), true, true, None);
    // 14 tokens: blocks 0..3 full; snapshots planned at 8 (last - 1) and 12 (last boundary).
    let a: Vec<u32> = (0..14).collect();
    let (_, init) = run_prompt(&mut cm, 0, &a);
    assert_eq!(init, SsmInit::Zero { live: 0 });
    assert_eq!(cm.ssm().snapshots(), 2);
    cm.release(0).unwrap();
    // A longer prompt shares 3 blocks: KV for all 3, snapshot at block 3 → restore there.
    let mut b = a[..12].to_vec();
    b.extend([90, 91, 92, 93, 94, 95]);
    let h = hashes(&b);
    let m = cm.match_prefix(&h, b.len());
    assert_eq!(
        m,
        PrefixMatch {
            kv_blocks: 3,
            skip_blocks: 3
        }
    );
    let init = cm.admit(1, &h, m, b.len()).unwrap();
    let snap = cm
        .ssm()
        .snapshot_of(cm.pool().lookup(h[2]).unwrap())
        .unwrap();
    assert!(matches!(init, SsmInit::Restore { from, .. } if from == snap));
    cm.release(1).unwrap();
    // A prompt sharing only 1 block: KV matches 1 block but there is no snapshot at 4.
    let mut c = a[..4].to_vec();
    c.extend([50, 51, 52, 53, 54, 55]);
    let m = cm.match_prefix(&hashes(&c), c.len());
    assert_eq!(
        m,
        PrefixMatch {
            kv_blocks: 1,
            skip_blocks: 0
        }
    );
    // ...and computing it snapshots the divergence point (block 1), usable next time.
    run_prompt(&mut cm, 2, &c);
    cm.release(2).unwrap();
    let m = cm.match_prefix(&hashes(&c), c.len());
    assert_eq!(
        m,
        PrefixMatch {
            kv_blocks: 2,
            skip_blocks: 2
        }
    );
    assert_eq!(cm.counters.ssm_restores, 1);
    cm.check_invariants().unwrap();
}

#[test]
fn evicting_a_block_drops_its_snapshot() {
    let mut cm = CacheManager::new(&layout(4, 1, 4), true, true, None);
    let a: Vec<u32> = (0..9).collect();
    run_prompt(&mut cm, 0, &a);
    cm.release(0).unwrap();
    assert_eq!(cm.ssm().snapshots(), 2);
    let mut ev = Vec::new();
    cm.take_events(&mut ev);
    let KvEvent::Stored { blocks, tokens } = &ev[0] else {
        panic!("{ev:?}")
    };
    assert_eq!(blocks.len(), 2);
    assert!(blocks.iter().all(|b| b.snapshot), "{blocks:?}");
    assert_eq!(blocks[0].parent, None);
    assert_eq!(blocks[1].parent, Some(blocks[0].hash));
    // The tokens of both full blocks, in order; the trailing partial block is not stored.
    assert_eq!(tokens, &a[..8]);
    assert_eq!(ev[0].block_tokens(1), &a[4..8]);
    // An unrelated 16-token prompt needs all 4 blocks: both cached blocks are evicted.
    let b: Vec<u32> = (100..116).collect();
    run_prompt(&mut cm, 0, &b);
    let m = cm.match_prefix(&hashes(&a), 9);
    assert_eq!(m.kv_blocks, 0);
    assert_eq!(cm.counters.snapshots_dropped, 2);
    // The miss says the blocks were evicted, until the cache is dropped on purpose.
    assert_eq!(
        cm.miss_reason(&hashes(&a), 9, m, false),
        Some(MissReason::Evicted)
    );
    ev.clear();
    cm.take_events(&mut ev);
    let removed: Vec<u64> = hashes(&a).iter().map(|h| h.short()).collect();
    assert!(ev.iter().any(|e| matches!(e, KvEvent::Removed { hashes }
        if { let mut x = hashes.clone(); x.sort(); let mut y = removed.clone(); y.sort(); x == y })));
    cm.check_invariants().unwrap();
}

#[test]
fn aborted_step_indexes_nothing_and_frees_reservations() {
    let mut cm = CacheManager::new(&layout(8, 1, 4), true, true, None);
    let a: Vec<u32> = (0..9).collect();
    let h = hashes(&a);
    let m = cm.match_prefix(&h, 9);
    cm.admit(0, &h, m, 9).unwrap();
    let mut snaps = Vec::new();
    cm.plan_snapshots(0, &h, 9, 0, &[], 0, 9, &mut snaps);
    assert_eq!(snaps.len(), 2);
    assert_eq!(cm.ssm().durable_used(), 2);
    cm.abort_step();
    assert_eq!(cm.ssm().durable_used(), 0);
    cm.release(0).unwrap();
    assert_eq!(cm.pool().indexed(), 0);
    let mut ev = Vec::new();
    cm.take_events(&mut ev);
    assert!(ev.is_empty());
    cm.check_invariants().unwrap();
}

#[test]
fn reset_drops_cache_but_not_running_blocks() {
    let mut cm = CacheManager::new(&layout(8, 0, 0), true, false, None);
    let a: Vec<u32> = (0..8).collect();
    run_prompt(&mut cm, 0, &a);
    run_prompt(&mut cm, 1, &(20..28).collect::<Vec<u32>>());
    cm.release(1).unwrap();
    cm.reset_prefix_cache();
    assert_eq!(cm.pool().indexed(), 0);
    assert_eq!(cm.block_table(0).len(), 2);
    assert_eq!(cm.available_blocks(), 6);
    let mut ev = Vec::new();
    cm.take_events(&mut ev);
    assert_eq!(ev, vec![KvEvent::Cleared]);
    cm.release(0).unwrap();
    assert_eq!(cm.pool().free_count(), 8);
    cm.check_invariants().unwrap();
}

#[test]
fn admission_is_all_or_nothing() {
    let mut cm = CacheManager::new(&layout(3, 0, 0), true, false, None);
    let a: Vec<u32> = (0..8).collect();
    run_prompt(&mut cm, 0, &a);
    cm.release(0).unwrap();
    let mut b = a.clone();
    b.extend(0..8);
    let h = hashes(&b);
    let m = cm.match_prefix(&h, b.len());
    assert_eq!(m.skip_blocks, 2);
    // Needs 2 more blocks; only 1 is free once the matched 2 are pinned.
    assert_eq!(cm.admit(1, &h, m, b.len()), Err(CacheError::NoSpace));
    assert_eq!(cm.pool().cached_unused(), 2);
    cm.check_invariants().unwrap();
}

#[test]
fn full_snapshot_slots_reclaim_the_least_recently_used_unused_one() {
    // Two durable slots; each 9-token prompt wants two snapshots (at 4 and 8).
    let mut cm = CacheManager::new(&layout(32, 2, 2), true, true, None);
    let a: Vec<u32> = (0..9).collect();
    run_prompt(&mut cm, 0, &a);
    cm.release(0).unwrap();
    assert_eq!(cm.ssm().snapshots(), 2);
    cm.begin_step(5);
    let b: Vec<u32> = (100..109).collect();
    run_prompt(&mut cm, 0, &b);
    // A's blocks were unused: their snapshots made room for B's; A's KV stays cached.
    assert_eq!(cm.ssm().snapshots(), 2);
    assert_eq!(
        cm.match_prefix(&hashes(&a), 9),
        PrefixMatch {
            kv_blocks: 2,
            skip_blocks: 0
        }
    );
    assert_eq!(cm.match_prefix(&hashes(&b), 9).skip_blocks, 1);
    let mut ev = Vec::new();
    cm.take_events(&mut ev);
    assert!(
        ev.iter()
            .any(|e| matches!(e, KvEvent::SnapshotRemoved { hashes } if hashes.len() == 2)),
        "{ev:?}"
    );
    // While B runs, its snapshots cannot be taken: a third prompt goes without.
    let c: Vec<u32> = (200..209).collect();
    run_prompt(&mut cm, 1, &c);
    assert_eq!(cm.counters.snapshots_skipped, 2);
    cm.release(0).unwrap();
    cm.release(1).unwrap();
    assert_eq!(
        cm.match_prefix(&hashes(&c), 9),
        PrefixMatch {
            kv_blocks: 2,
            skip_blocks: 0
        }
    );
    assert_eq!(cm.match_prefix(&hashes(&b), 9).skip_blocks, 1);
    // C's KV is cached but its snapshots were skipped for want of a slot; A's were given up.
    for p in [&c, &a] {
        let m = cm.match_prefix(&hashes(p), 9);
        assert_eq!(
            cm.miss_reason(&hashes(p), 9, m, false),
            Some(MissReason::SnapshotBudgetFull)
        );
    }
    cm.check_invariants().unwrap();
}

/// Each miss reason, staged: the reason reported is exactly the one staged.
#[test]
fn a_restored_snapshot_outlives_snapshots_nobody_used() {
    // Three durable slots; the shared prefix is two blocks.
    let mut cm = CacheManager::new(&layout(64, 2, 3), true, true, None);
    let prefix: Vec<u32> = (0..8).collect();
    let ask = |q: u32| {
        let mut p = prefix.clone();
        p.extend([1000 + q, 2000 + q, 3000 + q]);
        p
    };
    run_prompt(&mut cm, 0, &ask(0));
    cm.release(0).unwrap();
    cm.begin_step(1);
    let (m, init) = run_prompt(&mut cm, 0, &ask(1));
    assert_eq!(m.skip_blocks, 2);
    assert!(matches!(init, SsmInit::Restore { .. }));
    cm.release(0).unwrap();
    assert_eq!(cm.ssm().proven(), 1);
    // One-off prompts, each wanting two snapshots: six of them pass through three slots.
    for k in 0..3u32 {
        cm.begin_step(2 + u64::from(k));
        let one_off: Vec<u32> = (0..9).map(|t| 10_000 * (k + 1) + t).collect();
        run_prompt(&mut cm, 0, &one_off);
        cm.release(0).unwrap();
    }
    cm.begin_step(10);
    let (m, init) = run_prompt(&mut cm, 0, &ask(2));
    assert_eq!(m.skip_blocks, 2, "the shared prefix's state survived");
    assert!(matches!(init, SsmInit::Restore { .. }));
    cm.release(0).unwrap();
    cm.check_invariants().unwrap();
}

/// Each miss reason, staged: the reason reported is exactly the one staged.
#[test]
fn every_miss_has_its_reason() {
    let reason = |cm: &CacheManager, p: &[u32], logprobs: bool| {
        let h = hashes(p);
        let m = cm.match_prefix(&h, p.len());
        cm.miss_reason(&h, p.len(), m, logprobs)
    };
    let a: Vec<u32> = (0..14).collect();
    // Caching off: whatever the prompt.
    let off = CacheManager::new(&layout(16, 0, 0), false, false, None);
    assert_eq!(reason(&off, &a, false), Some(MissReason::CachingOff));
    let mut cm = CacheManager::new(&layout(32, 2, 8), true, true, None);
    // 5 tokens: a skip of one block would leave one token, so nothing is cacheable.
    assert_eq!(cm.cacheable_blocks(5), 0);
    assert_eq!(
        reason(&cm, &a[..5], false),
        Some(MissReason::PromptTooShort)
    );
    assert_eq!(reason(&cm, &a, false), Some(MissReason::NoKvMatch));
    run_prompt(&mut cm, 0, &a);
    cm.release(0).unwrap();
    // Cached at 8 and 12 with snapshots: a longer prompt is served in full...
    let mut b = a[..12].to_vec();
    b.extend([90, 91, 92]);
    assert_eq!(reason(&cm, &b, false), None);
    // ...unless it asks for prompt logprobs.
    assert_eq!(reason(&cm, &b, true), Some(MissReason::PromptLogprobs));
    // Shares one block, whose end has no snapshot.
    let mut c = a[..4].to_vec();
    c.extend([50, 51, 52, 53, 54, 55]);
    assert_eq!(reason(&cm, &c, false), Some(MissReason::NoSnapshot));
    // Reaches past the cache into new tokens: the 3 cached blocks are served and block 4 was
    // never computed, so nothing was missed (a follow-up turn's shape).
    let mut d = a[..12].to_vec();
    d.extend(60..70);
    assert_eq!(reason(&cm, &d, false), None);
    // Nothing of the prompt cached: a cold prompt is a miss.
    let e: Vec<u32> = (200..214).collect();
    assert_eq!(reason(&cm, &e, false), Some(MissReason::NoKvMatch));
    // A miss is counted per reason.
    cm.count_miss(Some(MissReason::NoKvMatch));
    cm.count_miss(None);
    assert_eq!(cm.counters.misses[MissReason::NoKvMatch.index()], 1);
    assert_eq!(cm.counters.misses.iter().sum::<u64>(), 1);
}

/// Decodes `tokens[start]` of sequence `seq` (one-token chunk): grows the table, plans the
/// rolling snapshot when it completes a block, commits the step.
fn decode(cm: &mut CacheManager, seq: u32, tokens: &[u32], start: usize) -> Vec<SsmSnapshot> {
    cm.grow(seq, start + 1).unwrap();
    let h = hashes(&tokens[..start + 1]);
    let mut snaps = Vec::new();
    if (start + 1).is_multiple_of(BS) {
        cm.plan_rolling_snapshot(seq, Some(h[(start + 1) / BS - 1]), 1, &mut snaps);
    }
    cm.commit_seq(seq, &h, &tokens[..start + 1], start + 1);
    snaps
}

#[test]
fn rolling_snapshot_follows_decoding_and_is_kept_at_release() {
    let mut cm = CacheManager::new(&layout(32, 2, 4), true, true, None);
    // A 6-token prompt (snapshot at 4), then 8 decoded tokens crossing 8 and 12.
    let t: Vec<u32> = (0..14).collect();
    run_prompt(&mut cm, 0, &t[..6]);
    assert_eq!(cm.ssm().durable_used(), 1);
    let mut slots = Vec::new();
    for start in 6..13 {
        let snaps = decode(&mut cm, 0, &t, start);
        slots.extend(snaps.iter().map(|s| (start, s.after, s.slot)));
        cm.commit_step();
        cm.check_invariants().unwrap();
    }
    // One rolling slot, written at both boundaries; output blocks entered the index.
    assert_eq!(slots.len(), 2);
    assert_eq!((slots[0].0, slots[0].1), (7, 1));
    assert_eq!((slots[1].0, slots[1].2), (11, slots[0].2));
    assert_eq!(cm.ssm().durable_used(), 2);
    assert_eq!(cm.counters.rolling_copies, 2);
    let h = hashes(&t);
    assert!(
        cm.is_cached(h[2]),
        "the block completed by decoding is indexed"
    );
    cm.release(0).unwrap();
    // The rolling slot became the snapshot at 12: a follow-up turn restores there.
    assert_eq!(cm.counters.rolling_kept, 1);
    assert_eq!(
        cm.ssm().snapshot_of(cm.pool().lookup(h[2]).unwrap()),
        Some(slots[1].2)
    );
    let mut next = t[..13].to_vec();
    next.extend([70, 71, 72]);
    let m = cm.match_prefix(&hashes(&next), next.len());
    assert_eq!(m.skip_blocks, 3);
    let mut ev = Vec::new();
    cm.commit_step();
    cm.take_events(&mut ev);
    // Indexed while decoding (no snapshot yet), then the kept rolling slot's snapshot.
    assert!(
        ev.iter()
            .any(|e| matches!(e, KvEvent::Stored { blocks, tokens }
            if blocks.len() == 1 && blocks[0].hash == h[2].short() && !blocks[0].snapshot
                && blocks[0].parent == Some(h[1].short()) && tokens[..] == t[8..12])),
        "{ev:?}"
    );
    assert_eq!(
        ev.last(),
        Some(&KvEvent::SnapshotStored {
            hashes: vec![h[2].short()]
        })
    );
    cm.check_invariants().unwrap();
}

#[test]
fn rolling_snapshot_of_a_failed_step_is_not_kept_and_a_full_budget_skips() {
    let mut cm = CacheManager::new(&layout(32, 2, 1), true, true, None);
    let t: Vec<u32> = (0..9).collect();
    // The 6-token prompt takes the only durable slot (its snapshot at 4, block in use).
    run_prompt(&mut cm, 0, &t[..6]);
    assert!(decode(&mut cm, 0, &t, 6).is_empty());
    cm.commit_step();
    // Crossing 8: no slot can be had (the snapshot's block is in use): skipped, counted.
    assert!(decode(&mut cm, 0, &t, 7).is_empty());
    cm.commit_step();
    assert_eq!(cm.counters.rolling_skipped, 1);
    let h = hashes(&t[..8]);
    let mut next = t[..8].to_vec();
    next.extend([40, 41, 42]);
    cm.release(0).unwrap();
    let m = cm.match_prefix(&hashes(&next), next.len());
    assert_eq!((m.kv_blocks, m.skip_blocks), (2, 1));
    assert_eq!(
        cm.miss_reason(&hashes(&next), next.len(), m, false),
        Some(MissReason::SnapshotBudgetFull)
    );
    // A step that fails after writing the rolling slot leaves nothing behind.
    let cm = prompt_then_failed_rolling_step(4, &t);
    assert_eq!(cm.counters.rolling_kept, 0);
    assert_eq!(
        cm.ssm().durable_used(),
        1,
        "only the prompt's snapshot remains"
    );
    assert!(
        cm.ssm()
            .snapshot_of(cm.pool().lookup(h[0]).unwrap())
            .is_some()
    );
    cm.check_invariants().unwrap();
}

/// A cache with `durable` snapshot slots after sequence 0 ran `t[..6]` as a prompt (snapshot
/// at 4), decoded `t[6]`, and failed the step that decoded `t[7]` and wrote the rolling
/// snapshot at 8; the sequence is released.
fn prompt_then_failed_rolling_step(durable: usize, t: &[u32]) -> CacheManager {
    let mut cm = CacheManager::new(&layout(32, 2, durable), true, true, None);
    run_prompt(&mut cm, 0, &t[..6]);
    decode(&mut cm, 0, t, 6);
    cm.commit_step();
    assert_eq!(decode(&mut cm, 0, t, 7).len(), 1);
    cm.abort_step();
    cm.release(0).unwrap();
    cm
}

#[test]
fn a_snapshot_given_up_below_the_deepest_cached_block_is_a_budget_miss() {
    // Two durable slots. A: a 6-token prompt (snapshot at 4), then a decode whose step
    // writing the rolling snapshot at 8 fails: block 2's KV is cached, its end never had a
    // snapshot.
    let t: Vec<u32> = (0..9).collect();
    let mut cm = prompt_then_failed_rolling_step(2, &t);
    let mut next = t[..8].to_vec();
    next.extend([40, 41, 42]);
    let m = cm.match_prefix(&hashes(&next), next.len());
    assert_eq!((m.kv_blocks, m.skip_blocks), (2, 1));
    // B's two snapshots take the free slot and A's (unused, least recently used).
    cm.begin_step(5);
    run_prompt(&mut cm, 1, &(100..109).collect::<Vec<u32>>());
    assert_eq!(cm.counters.snapshots_dropped, 1);
    let m = cm.match_prefix(&hashes(&next), next.len());
    assert_eq!((m.kv_blocks, m.skip_blocks), (2, 0));
    // The deepest cached boundary never had a snapshot; the one below it was given up.
    assert_eq!(
        cm.miss_reason(&hashes(&next), next.len(), m, false),
        Some(MissReason::SnapshotBudgetFull)
    );
    cm.check_invariants().unwrap();
}

#[test]
fn a_snapshot_a_waiting_request_will_resume_from_is_kept_while_it_waits() {
    // Two durable slots, both taken by A's snapshots (at 4 and 8); A is done.
    let mut cm = CacheManager::new(&layout(32, 2, 2), true, true, None);
    let a: Vec<u32> = (0..9).collect();
    run_prompt(&mut cm, 0, &a);
    cm.release(0).unwrap();
    assert!(cm.snapshot_slots_full());
    // A's follow-up waits: it would resume from A's block 2.
    let mut follow = a[..8].to_vec();
    follow.extend([40, 41, 42]);
    let wanted = cm.resume_block(&hashes(&follow), follow.len());
    assert_eq!(wanted, cm.pool().lookup(hashes(&a)[1]));
    cm.set_wanted(wanted.into_iter().collect());
    // B's two snapshots may take only the slot nobody waits for.
    cm.begin_step(5);
    run_prompt(&mut cm, 1, &(100..109).collect::<Vec<u32>>());
    assert_eq!(
        (cm.counters.snapshots_dropped, cm.counters.snapshots_skipped),
        (1, 1)
    );
    assert_eq!(
        cm.match_prefix(&hashes(&follow), follow.len()).skip_blocks,
        2
    );
    cm.release(1).unwrap();
    // Admitted (nothing waits any more): it may go like any other.
    cm.set_wanted(Vec::new());
    cm.begin_step(6);
    run_prompt(&mut cm, 2, &(200..205).collect::<Vec<u32>>());
    assert_eq!(cm.counters.snapshots_dropped, 2);
    assert_eq!(
        cm.match_prefix(&hashes(&follow), follow.len()).skip_blocks,
        0
    );
    cm.check_invariants().unwrap();
}

/// A search for a snapshot to give up that found none is not repeated while nothing it read
/// changed (other sequences completing blocks in the same step get the same answer without
/// a search), and is repeated once something did: a release frees the block of the only
/// snapshot, and the next rolling snapshot takes its slot.
#[test]
fn a_failed_reclaim_is_searched_again_only_after_a_change() {
    let mut cm = CacheManager::new(&layout(32, 3, 1), true, true, None);
    let t: Vec<u32> = (0..6).collect();
    let u: Vec<u32> = (50..60).collect();
    let w: Vec<u32> = (80..90).collect();
    // The 6-token prompt takes the only durable slot (snapshot at 4, its block in use); the
    // two 3-token prompts complete no block.
    run_prompt(&mut cm, 0, &t);
    run_prompt(&mut cm, 1, &u[..3]);
    run_prompt(&mut cm, 2, &w[..3]);
    assert_eq!(cm.ssm().snapshots(), 1);
    // Both decoders complete a block: nothing can be given up, searched once.
    assert!(decode(&mut cm, 1, &u, 3).is_empty());
    assert!(decode(&mut cm, 2, &w, 3).is_empty());
    assert_eq!(cm.counters.rolling_skipped, 2);
    assert_eq!(cm.counters.reclaim_searches, 1);
    // A later step searches again (a restore of the earlier step no longer protects).
    cm.begin_step(1);
    assert!(decode(&mut cm, 2, &w, 4).is_empty());
    assert!(decode(&mut cm, 2, &w, 7).is_empty());
    assert_eq!(cm.counters.reclaim_searches, 2);
    // The prompt's sequence ends in the same step: its snapshot's block is unused now.
    cm.release(0).unwrap();
    assert_eq!(
        decode(&mut cm, 1, &u, 7).len(),
        1,
        "the freed slot is taken"
    );
    assert_eq!(cm.counters.reclaim_searches, 3);
    assert_eq!(cm.counters.rolling_skipped, 3);
    assert_eq!(cm.ssm().snapshots(), 0, "the unused snapshot was given up");
    cm.commit_step();
    cm.check_invariants().unwrap();
}

#[test]
fn checkpoints_add_snapshot_points_rounded_down_to_blocks() {
    let mut cm = CacheManager::new(&layout(32, 2, 8), true, true, None);
    let t: Vec<u32> = (0..22).collect();
    let h = hashes(&t);
    let m = cm.match_prefix(&h, t.len());
    cm.admit(0, &h, m, t.len()).unwrap();
    let mut snaps = Vec::new();
    // Fixed points 16 and 20; checkpoint 9 → 8; checkpoint 3 is inside the first block.
    cm.plan_snapshots(0, &h, t.len(), 0, &[9, 3, 17], 0, t.len(), &mut snaps);
    let after: Vec<usize> = snaps.iter().map(|s| s.after).collect();
    assert_eq!(after, vec![8, 16, 20]);
    assert_eq!(
        cm.counters.checkpoint_copies, 1,
        "17 rounds to 16, already planned"
    );
    assert_eq!(cm.counters.snapshot_copies, 3);
    cm.commit_seq(0, &h, &t, t.len());
    cm.commit_step();
    cm.release(0).unwrap();
    let mut b = t[..9].to_vec();
    b.extend([80, 81, 82]);
    assert_eq!(cm.match_prefix(&hashes(&b), b.len()).skip_blocks, 2);
    cm.check_invariants().unwrap();
}

/// `cache.ssm_snapshot_interval`: a hybrid prompt also leaves snapshots every N blocks, so the
/// second prompt of a new shared prefix resumes at the last such boundary inside the prefix
/// instead of recomputing it (without the interval: it finds the KV blocks but no state).
#[test]
fn snapshot_interval_lets_the_second_prompt_of_a_prefix_resume() {
    // 8-block shared prefix, then 3 distinct blocks: 44 tokens per prompt.
    let prompt = |tail: u32| -> Vec<u32> { (0..32).chain(tail * 100..tail * 100 + 12).collect() };
    for (every, resumed) in [(0usize, 0usize), (4, 8), (3, 6)] {
        let mut cm =
            CacheManager::new(&layout(64, 2, 16), true, true, None).with_snapshot_interval(every);
        run_prompt(&mut cm, 0, &prompt(1));
        cm.release(0).unwrap();
        let h = hashes(&prompt(2));
        let m = cm.match_prefix(&h, 44);
        assert_eq!(
            m.kv_blocks, 8,
            "every {every}: the shared KV blocks are cached"
        );
        assert_eq!(
            m.skip_blocks, resumed,
            "every {every}: resumes at the last snapshot inside the prefix"
        );
        cm.check_invariants().unwrap();
    }
}

/// Periodic snapshots fall only on boundaries inside the chunk being computed, never past the
/// prompt's last full block.
#[test]
fn snapshot_interval_points_stay_inside_the_chunk() {
    let mut cm = CacheManager::new(&layout(64, 2, 32), true, true, None).with_snapshot_interval(2);
    let tokens: Vec<u32> = (0..37).collect();
    let h = hashes(&tokens);
    let m = cm.match_prefix(&h, 37);
    cm.admit(0, &h, m, 37).unwrap();
    let mut snaps = Vec::new();
    // Tokens 8..24 of the prompt: boundaries at blocks 3..=6 (tokens 12..=24).
    cm.plan_snapshots(0, &h, 37, 0, &[], 8, 16, &mut snaps);
    let at: Vec<usize> = snaps.iter().map(|s| s.after + 8).collect();
    assert_eq!(at, vec![16, 24]);
    cm.abort_step();
    cm.check_invariants().unwrap();
}

/// A verify chunk's rejected positions: `shrink` gives back the blocks past the accepted
/// tokens (never one already in the index), and draft slots are lent once per sequence, come
/// from their own range, and return when the sequence is released.
#[test]
fn rejected_draft_blocks_and_draft_slots_come_back() {
    let mut cm = CacheManager::new(&layout(16, 4, 2), true, true, None);
    assert_eq!(
        cm.set_draft_slots(2),
        2,
        "two of the four live slots set aside"
    );
    let a: Vec<u32> = (0..10).collect();
    run_prompt(&mut cm, 0, &a);
    let free = cm.available_blocks();
    // A verify chunk of 1 + 5 tokens from position 10 needs blocks up to position 15.
    cm.grow(0, 16).unwrap();
    assert_eq!(cm.available_blocks(), free - 1);
    let drafts = cm.draft_slots(0, 2).unwrap().to_vec();
    assert_eq!(drafts.len(), 2);
    assert!(
        drafts.iter().all(|s| (2..4).contains(s)),
        "draft slots {drafts:?}"
    );
    assert_eq!(cm.draft_slots(0, 2).unwrap(), &drafts[..], "lent once");
    assert_eq!(cm.draft_slot(0, 1), Some(drafts[1]));
    // Nothing is left for a second sequence.
    let b: Vec<u32> = (50..55).collect();
    run_prompt(&mut cm, 1, &b);
    assert!(cm.draft_slots(1, 1).is_none());
    // One draft accepted: 12 tokens computed and position 12 next need the same four blocks
    // (sequence 1 holds two more now).
    cm.shrink(0, 13).unwrap();
    assert_eq!(cm.available_blocks(), free - 1 - 2);
    // The sequence grows to 24 tokens, then only 14 are accepted: two blocks come back.
    cm.grow(0, 24).unwrap();
    let before = cm.available_blocks();
    cm.shrink(0, 14).unwrap();
    assert_eq!(cm.available_blocks(), before + 2);
    assert_eq!(cm.block_table(0).len(), 4);
    // Committed blocks are never given back.
    cm.shrink(0, 1).unwrap();
    assert_eq!(
        cm.block_table(0).len(),
        2,
        "the two indexed prompt blocks stay"
    );
    // A rollback to draft position 1: that draft slot becomes the live slot and the old live
    // slot a draft slot, nothing copied.
    let live = cm.live_slot(0);
    assert!(cm.adopt_draft(0, 1));
    assert_eq!(cm.live_slot(0), drafts[1]);
    assert_eq!(cm.draft_slot(0, 1), Some(live));
    assert_eq!(cm.draft_slot(0, 0), Some(drafts[0]));
    assert!(!cm.adopt_draft(0, 2), "no third draft slot");
    assert!(!cm.adopt_draft(7, 0), "no such sequence");
    cm.release(0).unwrap();
    // Both came back, each to the other pool: sequence 1's draft slots are the first draft
    // slot and the old live slot, and a new sequence's live slot is the adopted one.
    let mut lent = cm
        .draft_slots(1, 2)
        .expect("released with sequence 0")
        .to_vec();
    lent.sort_unstable();
    let mut want = vec![drafts[0], live];
    want.sort_unstable();
    assert_eq!(lent, want);
    let c: Vec<u32> = (80..85).collect();
    run_prompt(&mut cm, 2, &c);
    assert_eq!(cm.live_slot(2), drafts[1]);
    cm.check_invariants().unwrap();
}
