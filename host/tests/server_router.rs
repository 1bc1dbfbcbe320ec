//! Data-parallel routing over two replicas (real engine threads over the hybrid mock executor):
//! a prefix-aware policy sends shared-prefix requests to the replica that holds the prefix (as
//! seen through the KvEvent mirror), bad policy answers fall back to least-loaded, and the
//! block hashes the server computes to route are the ones the engine uses.

#![allow(clippy::unwrap_used)]

use crate::server_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chimera::cache::BlockHash;
use chimera::engine::api::{GenerateRequest, KvEvent, SamplingParams};
use chimera::engine::{Engine, MockExecutor};
use chimera::policy::{Decision, ReplicaColumns, RouteRequest, Router};
use chimera::server::prefix_mirror::prompt_block_hashes;
use serde_json::json;
use server_support::*;

/// Test policy: deepest KV prefix hit wins; without any hit, round-robin (so prefixes spread).
struct PrefixThenRoundRobin {
    next: u32,
    seen: Arc<Mutex<Vec<ReplicaColumns>>>,
}

impl Router for PrefixThenRoundRobin {
    fn route(&mut self, _request: &RouteRequest, cols: &ReplicaColumns) -> Decision<u32> {
        if let Ok(mut s) = self.seen.lock() {
            s.push(cols.clone());
        }
        let best =
            (0..cols.len()).max_by_key(|&i| (cols.prefix_hit_blocks[i], std::cmp::Reverse(i)));
        match best {
            Some(i) if cols.prefix_hit_blocks[i] > 0 => Decision::Use(i as u32),
            _ => {
                let i = self.next % cols.len() as u32;
                self.next += 1;
                Decision::Use(i)
            }
        }
    }
}

const PREFIXES: [&str; 4] = [
    "the cat sat on the mat and the dog ran on the mat and the cat sat here and",
    "hello world hello world the dog ran and the cat ran and hello world again",
    "a dog a cat a mat a dog a cat a mat stop here the end and a dog ran",
    "END END the mat sat on the cat and the world ran here and there and so on",
];

fn added(s: &TestServer) -> Vec<u64> {
    s.recorders.iter().map(|c| c.get(&c.added)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefixes_follow_the_replica_that_holds_them() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut opts = Options {
        replicas: 2,
        policy: Some(Box::new(PrefixThenRoundRobin {
            next: 0,
            seen: seen.clone(),
        })),
        ..Options::default()
    };
    opts.mock.ssm_layers = 2;
    let block_size = opts.block_size;
    let s = TestServer::start(opts).await;
    let tok = tokenizer();
    let mut home = Vec::new();
    for p in PREFIXES {
        let before = added(&s);
        let r = post(
            s.addr,
            "/v1/completions",
            &json!({"prompt": format!("{p} q0"), "max_tokens": 2}),
        )
        .await;
        assert_eq!(r.status, 200);
        let after = added(&s);
        home.push(
            (0..2)
                .find(|&i| after[i] > before[i])
                .expect("some replica ran it"),
        );
    }
    assert_eq!(home, vec![0, 1, 0, 1], "first requests spread round-robin");
    // Each replica has stored (and announced in KvEvents) the full blocks of the first
    // prompts it ran; the router's mirrors receive those events on their way.
    let mut want = [0u64; 2];
    for (k, p) in PREFIXES.iter().enumerate() {
        let n = tok.encode(format!("{p} q0"), true).unwrap().get_ids().len();
        want[home[k]] += (n / block_size) as u64;
    }
    wait_for(
        "the first prompts' blocks stored",
        Duration::from_secs(5),
        async || (0..2).all(|i| u64::from(s.engines[i].stats().cached_blocks) >= want[i]),
    )
    .await;
    for round in 1..=3 {
        for (k, p) in PREFIXES.iter().enumerate() {
            let before = added(&s);
            let prompt = format!("{p} q{round} and more");
            let r = post(
                s.addr,
                "/v1/completions",
                &json!({"prompt": prompt, "max_tokens": 2}),
            )
            .await;
            assert_eq!(r.status, 200);
            let after = added(&s);
            assert!(
                after[home[k]] > before[home[k]],
                "prefix {k} left its replica {}",
                home[k]
            );
            // The policy saw the prefix depth the cache really holds. The engine snapshots SSM
            // state at the last two block boundaries of a prompt and where its cached prefix
            // ends; the prompts of one prefix differ only after its first prompt's second-last
            // block boundary, so a snapshot sits exactly at the end of the shared blocks.
            let cols = seen.lock().unwrap().last().unwrap().clone();
            let a = tok
                .encode(format!("{p} q0"), true)
                .unwrap()
                .get_ids()
                .to_vec();
            let b = tok
                .encode(prompt.as_str(), true)
                .unwrap()
                .get_ids()
                .to_vec();
            let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count() as u32;
            let block = 4;
            let full_blocks_of_first = a.len() as u32 / block;
            let expect = (common / block).min(full_blocks_of_first);
            assert_eq!(cols.prefix_hit_blocks[home[k]], expect, "prefix {k}");
            assert_eq!(cols.ssm_hit_blocks[home[k]], expect, "prefix {k}");
            assert_eq!(cols.prefix_hit_blocks[1 - home[k]], 0);
        }
    }
    // Routed counts agree with what each replica ran.
    for (i, a) in added(&s).iter().enumerate() {
        let routed = s
            .metric_sum(&format!("chimera:router_requests_total{{engine=\"{i}\""))
            .await;
        assert_eq!(routed, *a as f64, "replica {i}");
        assert_eq!(s.state.metrics().routed_count(i), *a);
    }
    assert_eq!(
        s.metric_sum("chimera:router_placement_fallbacks_total")
            .await,
        0.0
    );
}

/// A policy that answers out of range, then panics, then declines.
struct Misbehaving(u32);

impl Router for Misbehaving {
    fn route(&mut self, _request: &RouteRequest, _cols: &ReplicaColumns) -> Decision<u32> {
        self.0 += 1;
        match self.0 % 3 {
            1 => Decision::Use(7),
            2 => panic!("policy bug"),
            _ => Decision::UseDefault,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_policy_answers_fall_back_to_least_loaded() {
    let opts = Options {
        replicas: 2,
        policy: Some(Box::new(Misbehaving(0))),
        ..Options::default()
    };
    let s = TestServer::start(opts).await;
    for i in 0..6 {
        let r = post(
            s.addr,
            "/v1/completions",
            &json!({"prompt": format!("hello {i}"), "max_tokens": 2}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // Out-of-range and panic count as fallbacks; "use default" does not.
    assert_eq!(
        s.metric_sum("chimera:router_placement_fallbacks_total")
            .await,
        4.0
    );
    assert_eq!(added(&s).iter().sum::<u64>(), 6);
    assert!(
        s.metric_sum("chimera:router_decision_latency_seconds_count")
            .await
            >= 6.0
    );
}

/// Runs a request with `given` block hashes on a fresh engine; returns how many block hashes
/// the engine computed itself and the hashes its cache announced.
fn run_with_hashes(prompt: &[u32], given: Option<Vec<BlockHash>>) -> (u64, Vec<u64>) {
    let opts = Options::default();
    let exec = MockExecutor::new(opts.mock.clone());
    let mut e = Engine::new(opts.setup(), exec, Options::policies()).expect("engine");
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let request = GenerateRequest {
        id: 1,
        prompt: prompt.to_vec(),
        params: SamplingParams::default(),
        max_tokens: 1,
        stop_token_ids: vec![],
        ignore_eos: true,
        prompt_logprobs: None,
        block_hashes: given.map(Into::into),
        checkpoints: Vec::new(),
        priority: 0,
        constraint: None,
        speculative: true,
    };
    e.add(request, tx);
    while !e.is_idle() {
        e.step();
    }
    let mut events = Vec::new();
    e.take_kv_events(&mut events);
    let stored = events
        .into_iter()
        .flat_map(|ev| match ev {
            KvEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.hash).collect(),
            _ => Vec::new(),
        })
        .collect();
    (e.scheduler().blocks_hashed, stored)
}

#[test]
fn the_engine_adopts_the_block_hashes_the_server_computed() {
    let prompt: Vec<u32> = (1..=42).collect();
    let server = prompt_block_hashes(SALT, &prompt, 4);
    assert_eq!(server.len(), 10);
    let short: Vec<u64> = server.iter().map(|h| h.short()).collect();
    // Left alone, the engine computes the very same chain (same salt, same block size).
    assert_eq!(run_with_hashes(&prompt, None), (10, short.clone()));
    // Given the server's, it hashes only the first block, to check them.
    assert_eq!(run_with_hashes(&prompt, Some(server)), (1, short.clone()));
    // Hashes under another salt are refused and computed again: the index stays the engine's.
    let foreign = prompt_block_hashes("another-model", &prompt, 4);
    assert_eq!(run_with_hashes(&prompt, Some(foreign)), (11, short));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_sends_its_routing_hashes_with_the_request() {
    let s = TestServer::start(Options::default()).await;
    let prompt = "the cat sat on the mat and the dog ran on the mat";
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2, "n": 2}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let ids = tokenizer().encode(prompt, true).unwrap().get_ids().to_vec();
    let want = prompt_block_hashes(SALT, &ids, 4);
    assert!(want.len() >= 3);
    let sent = s.recorders[0].recent_requests();
    assert_eq!(sent.len(), 2);
    for req in &sent {
        assert_eq!(req.prompt, ids);
        assert_eq!(req.block_hashes.as_deref(), Some(&want[..]));
    }
    // Both choices share one computation.
    let (a, b) = (&sent[0].block_hashes, &sent[1].block_hashes);
    assert!(Arc::ptr_eq(a.as_ref().unwrap(), b.as_ref().unwrap()));
}
