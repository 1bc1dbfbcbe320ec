//! Bounded load over loopback, in front of two real engine threads over the mock executor: 512
//! requests from 32 concurrent clients, about 10% of which hang up mid-request. Every answer
//! must match its single-request baseline (batching changes no output), every engine request
//! must end (finished or cancelled), and the server must be idle and healthy afterwards.

#![allow(clippy::unwrap_used)]

use crate::server_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chimera::server::ServerConfig;
use serde_json::json;
use server_support::*;

const PROMPTS: [&str; 8] = [
    "the cat",
    "a dog ran",
    "hello world",
    "the mat",
    "stop here",
    "and the",
    "cat sat on",
    "world END",
];
const TOTAL: u64 = 512;
const CLIENTS: u64 = 32;

fn body(p: usize, stream: bool) -> serde_json::Value {
    json!({"model": MODEL, "prompt": PROMPTS[p], "max_tokens": 6 + 3 * p, "temperature": 0, "stream": stream})
}

/// Deterministic pseudo-random numbers (no test flakiness from a global RNG).
fn lcg(x: &mut u64) -> u64 {
    *x = x
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *x >> 33
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_with_random_disconnects() {
    let mut o = Options {
        replicas: 2,
        ..Options::default()
    };
    o.server = ServerConfig {
        port: 0,
        max_queued_requests: 256,
        ..ServerConfig::default()
    };
    let s = TestServer::start(o).await;
    let mut baseline = Vec::new();
    for p in 0..PROMPTS.len() {
        let r = post(s.addr, "/v1/completions", &body(p, false)).await;
        assert_eq!(r.status, 200);
        baseline.push(texts(&r.json())[0].clone());
    }
    let base_added = s.counter(|c| c.get(&c.added));
    let baseline = Arc::new(baseline);
    let next = Arc::new(AtomicU64::new(0));
    let (ok, hung_up, wrong) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let started = Instant::now();
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (addr, baseline, next) = (s.addr, baseline.clone(), next.clone());
        let (ok, hung_up, wrong) = (ok.clone(), hung_up.clone(), wrong.clone());
        clients.push(tokio::spawn(async move {
            let mut rng = 0x5EED + c;
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= TOTAL {
                    break;
                }
                let p = (lcg(&mut rng) % PROMPTS.len() as u64) as usize;
                let stream = lcg(&mut rng).is_multiple_of(2);
                if lcg(&mut rng).is_multiple_of(10) {
                    let min_bytes = (lcg(&mut rng) % 400) as usize;
                    post_and_hang_up(addr, "/v1/completions", &body(p, stream), min_bytes).await;
                    hung_up.fetch_add(1, Ordering::SeqCst);
                    continue;
                }
                let r = post(addr, "/v1/completions", &body(p, stream)).await;
                let good = r.status == 200 && {
                    let (text, finish) = if stream {
                        join_stream(&r.sse()).remove(0)
                    } else {
                        let v = r.json();
                        (
                            texts(&v)[0].clone(),
                            v["choices"][0]["finish_reason"].as_str().map(String::from),
                        )
                    };
                    text == baseline[p] && finish.as_deref() == Some("length")
                };
                if good {
                    ok.fetch_add(1, Ordering::SeqCst);
                } else {
                    eprintln!("mis-answered request {i}: status {} {}", r.status, r.text());
                    wrong.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    let all = async {
        for c in clients {
            c.await.expect("client task");
        }
    };
    tokio::time::timeout(Duration::from_secs(180), all)
        .await
        .expect("load test ran past its time bound");
    let elapsed = started.elapsed();
    let (ok, hung_up, wrong) = (
        ok.load(Ordering::SeqCst),
        hung_up.load(Ordering::SeqCst),
        wrong.load(Ordering::SeqCst),
    );
    println!(
        "load: {TOTAL} requests, {CLIENTS} clients, {ok} ok, {hung_up} hung up, {wrong} wrong, {:.2}s",
        elapsed.as_secs_f64()
    );
    assert_eq!(wrong, 0);
    assert_eq!(ok + hung_up, TOTAL);
    assert!(
        hung_up > TOTAL / 20 && hung_up < TOTAL / 5,
        "about 10% hang up: {hung_up}"
    );

    // Every engine request is accounted for: each one the engines were sent ended there
    // (finished or cancelled), nothing is left running, and every request abandoned in flight
    // got a cancel from the server instead of running on. The idle gauges alone can read 0
    // while the last hang-ups' cancels are still on their way to the engines (and before an
    // engine has stepped a request it was just sent), so first wait until the accounts agree:
    // no guard left (it drops the in-flight count last), every disconnect's cancel forwarded,
    // every request the engines were sent ended. A broken cancel path never gets there, and
    // the assertions below say which account is off.
    let settled = eventually(Duration::from_secs(10), async || {
        s.metric_sum("chimera:server_requests_in_flight").await == 0.0
            && s.metric_sum("chimera:client_disconnects_total").await
                == s.counter(|c| c.get(&c.cancels)) as f64
            && s.engine_sum(|e| e.requests_finished) == s.counter(|c| c.get(&c.added))
    })
    .await;
    assert!(
        s.wait_idle(Duration::from_secs(10)).await,
        "requests left running"
    );
    let added = s.counter(|c| c.get(&c.added)) - base_added;
    let ended = s.engine_sum(|e| e.requests_finished) - base_added;
    let cancels = s.counter(|c| c.get(&c.cancels));
    let by_length = s
        .metric_sum(
            "chimera:request_success_total{model_name=\"tiny-mock\",finished_reason=\"length\"",
        )
        .await as u64
        - base_added;
    println!(
        "engine: {added} added, {ended} ended, {cancels} cancels sent, {by_length} finished by length (settled: {settled})"
    );
    assert_eq!(ended, added, "every engine request must end in its engine");
    assert!(added >= ok && added <= TOTAL);
    assert!(by_length >= ok && by_length <= ok + hung_up);
    assert!(cancels <= hung_up);
    assert_eq!(
        s.metric_sum("chimera:client_disconnects_total").await,
        cancels as f64,
        "every abandoned request must be cancelled, not left to run"
    );
    assert_eq!(s.metric_sum("chimera:server_requests_in_flight").await, 0.0);
    // Both replicas took load, and the server still answers.
    for (i, c) in s.recorders.iter().enumerate() {
        assert!(c.get(&c.added) > 0, "replica {i} got nothing");
    }
    assert_eq!(
        request(s.addr, "GET", "/health", &[], b"").await.status,
        200
    );
    let r = post(s.addr, "/v1/completions", &body(0, false)).await;
    assert_eq!(texts(&r.json())[0], baseline[0]);
}
