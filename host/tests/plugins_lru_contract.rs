//! The LRU contract between the cache and the evictor policies: the cache's own fallback order
//! (`BlockPool` with no evictor), the native `LruEvictor` and the built-in Wasm `lru` plugin
//! must make the same eviction choices on the same history, and the cache must never reject
//! a victim the evictors chose.

use chimera::cache::{BlockHash, BlockPool, NO_PARENT};
use chimera::plugins::{PluginMetrics, PluginsConfig, PolicyConfig, PolicyPlugins};
use chimera::policy::native::LruEvictor;
use chimera_policy_core::rng::Rng;

const BLOCKS: u32 = 64;

struct Request {
    blocks: Vec<u32>,
}

#[test]
fn cache_fallback_native_twin_and_wasm_plugin_evict_alike() {
    let metrics = PluginMetrics::new();
    let policies = PolicyPlugins::new(
        &PolicyConfig::default(),
        &PluginsConfig::default(),
        metrics.clone(),
    )
    .expect("built-in plugins load");
    let mut pools = [
        BlockPool::new(BLOCKS, None),
        BlockPool::new(BLOCKS, Some(Box::new(LruEvictor::new()))),
        BlockPool::new(BLOCKS, Some(policies.evictor())),
    ];
    let mut rng = Rng::new(2026, 0);
    let mut running: Vec<Request> = Vec::new();
    let mut next_hash: u128 = 1;
    let mut evictions = 0usize;
    // Parent of each registered block (a prefix hit pins the whole path from the root).
    let mut parent_of = std::collections::HashMap::new();
    for step in 1..3000u64 {
        match rng.next_below(6) {
            // A new request: maybe extend a cached block (a prefix hit), then new blocks.
            0..=2 => {
                let len = 1 + rng.next_below(5) as usize;
                let mut blocks = Vec::new();
                let mut parent = NO_PARENT;
                let indexed: Vec<u32> = (0..BLOCKS)
                    .filter(|&b| pools[0].hash_of(b).is_some())
                    .collect();
                if !indexed.is_empty() && rng.next_below(2) == 0 {
                    let hit = indexed[rng.next_below(indexed.len() as u32) as usize];
                    let mut path = vec![hit];
                    while let Some(&p) = parent_of.get(path.last().unwrap()) {
                        if p == NO_PARENT {
                            break;
                        }
                        path.push(p);
                    }
                    path.reverse();
                    if pools[0].available() < len + path.len() {
                        continue;
                    }
                    for &b in &path {
                        for pool in pools.iter_mut() {
                            pool.pin(b, step).expect("pin an indexed block");
                        }
                    }
                    blocks.extend(&path);
                    parent = hit;
                }
                if pools[0].available() < len {
                    // Only reachable without a hit; nothing was pinned.
                    continue;
                }
                let mut got: Vec<Vec<u32>> = Vec::new();
                for pool in pools.iter_mut() {
                    let mut out = Vec::new();
                    pool.allocate(len, step, &mut out).expect("allocate");
                    got.push(out);
                }
                assert_eq!(
                    got[0], got[1],
                    "step {step}: native twin chose other victims than the cache"
                );
                assert_eq!(
                    got[0], got[2],
                    "step {step}: Wasm plugin chose other victims than the cache"
                );
                for &b in &got[0] {
                    let hash = BlockHash(next_hash);
                    next_hash += 1;
                    for pool in pools.iter_mut() {
                        assert!(pool.register(b, hash, parent, step));
                    }
                    parent_of.insert(b, parent);
                    parent = b;
                }
                blocks.extend(&got[0]);
                running.push(Request { blocks });
            }
            // A request finishes.
            3 | 4 if !running.is_empty() => {
                let r = running.swap_remove(rng.next_below(running.len() as u32) as usize);
                for pool in pools.iter_mut() {
                    pool.release(&r.blocks, step).expect("release");
                }
            }
            // Memory pressure: evict a few.
            _ => {
                let n = 1 + rng.next_below(4) as usize;
                let done: Vec<usize> = pools.iter_mut().map(|p| p.evict(n, step)).collect();
                assert!(done.iter().all(|d| *d == done[0]), "step {step}: {done:?}");
                evictions += done[0];
            }
        }
        for pool in pools.iter_mut() {
            pool.flush_events();
        }
        for b in 0..BLOCKS {
            let h = pools[0].hash_of(b);
            assert_eq!(h, pools[1].hash_of(b), "step {step} block {b}");
            assert_eq!(h, pools[2].hash_of(b), "step {step} block {b}");
        }
    }
    assert!(
        evictions > 100,
        "the history evicted only {evictions} blocks explicitly"
    );
    assert_eq!(
        pools[1].evictor_fallbacks(),
        0,
        "cache rejected a native twin victim"
    );
    assert_eq!(
        pools[2].evictor_fallbacks(),
        0,
        "cache rejected a Wasm plugin victim"
    );
    assert_eq!(
        metrics
            .fallback_samples()
            .iter()
            .map(|s| s.value)
            .sum::<u64>(),
        0
    );
}
