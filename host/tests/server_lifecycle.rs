//! Cancellation, admission, admin and shutdown over real loopback HTTP, in front of real engine
//! threads over the mock executor.

#![allow(clippy::unwrap_used)]

use crate::server_support;

use std::time::Duration;

use chimera::server::ServerConfig;
use serde_json::json;
use server_support::*;

fn slow() -> Options {
    let mut o = Options::default();
    o.mock.step_delay = Duration::from_millis(10);
    o
}

fn long_request(stream: bool) -> serde_json::Value {
    json!({"model": MODEL, "prompt": "the cat", "max_tokens": 2000, "temperature": 0, "stream": stream})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_engine_request() {
    let s = TestServer::start(slow()).await;
    for (round, stream) in [(1, true), (2, false)] {
        // The request is running in the engine when the client leaves.
        if stream {
            // Read the headers and a few chunks (generated tokens), then hang up.
            let got = post_and_hang_up(s.addr, "/v1/completions", &long_request(true), 400).await;
            assert!(
                got >= 400,
                "round {round}: {got} bytes before the stream ended"
            );
        } else {
            // Hang up without reading anything once the engine has run a step of it. The
            // recorder's `added` is not enough: it counts the request on its way to the
            // engine, and the client could then leave before the engine ever ran it.
            let held = post_and_hold(s.addr, "/v1/completions", &long_request(false)).await;
            wait_for("the request to run", Duration::from_secs(10), async || {
                s.engine_sum(|e| u64::from(e.running)) == 1
            })
            .await;
            drop(held);
        }
        // The guard cancels: the server sent exactly one cancel per request, the engine ended
        // the request long before its 2000 tokens (20 s) would have finished, and it generated
        // far fewer tokens than were asked for. The wait is for those two events, not for the
        // idle gauges, which can read 0 while the cancel is on its way to the engine; nor for
        // the engine's end alone: an engine also ends a request whose event receiver is gone
        // (at its next token), possibly before the server's cancel arrives.
        wait_for(
            &format!("round {round}: the server's cancel and the engine's end of the request"),
            Duration::from_secs(10),
            async || {
                s.counter(|c| c.get(&c.cancels)) >= round
                    && s.engine_sum(|e| e.requests_finished) >= round
            },
        )
        .await;
        assert!(
            s.wait_idle(Duration::from_secs(10)).await,
            "round {round}: still running"
        );
        assert_eq!(s.counter(|c| c.get(&c.cancels)), round, "round {round}");
        assert_eq!(
            s.engine_sum(|e| e.requests_finished),
            round,
            "round {round}"
        );
        let generated = s.engine_sum(|e| e.generation_tokens);
        assert!(
            generated < 1000,
            "round {round}: {generated} tokens generated"
        );
    }
    assert_eq!(s.metric_sum("chimera:client_disconnects_total").await, 2.0);
    assert_eq!(
        s.metric_sum(
            "chimera:request_success_total{model_name=\"tiny-mock\",finished_reason=\"abort\""
        )
        .await,
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_with_retry_after() {
    let mut o = slow();
    o.server = ServerConfig {
        port: 0,
        max_queued_requests: 2,
        retry_after_secs: 3,
        ..ServerConfig::default()
    };
    let s = TestServer::start(o).await;
    let addr = s.addr;
    let a = tokio::spawn(async move {
        post(
            addr,
            "/v1/completions",
            &json!({"prompt": "a", "max_tokens": 60}),
        )
        .await
    });
    let b = tokio::spawn(async move {
        post(
            addr,
            "/v1/completions",
            &json!({"prompt": "b", "max_tokens": 60}),
        )
        .await
    });
    wait_for("two admitted", Duration::from_secs(5), async || {
        s.counter(|c| c.get(&c.added)) == 2
    })
    .await;
    let r = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": "c", "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("3"));
    assert_eq!(r.json()["error"]["code"], "overloaded");
    // n counts against the same budget.
    assert_eq!(
        post(
            s.addr,
            "/v1/completions",
            &json!({"prompt": "c", "max_tokens": 2, "n": 3})
        )
        .await
        .status,
        503
    );
    assert_eq!(a.await.unwrap().status, 200);
    assert_eq!(b.await.unwrap().status, 200);
    // Capacity is back once they finish.
    assert_eq!(
        post(
            s.addr,
            "/v1/completions",
            &json!({"prompt": "c", "max_tokens": 2})
        )
        .await
        .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_queue_full_is_503() {
    let mut o = slow();
    o.engine.max_waiting = 1;
    o.engine.max_running = 1;
    let s = TestServer::start(o).await;
    // One request occupies the only running slot for about 1.5 s (150 steps of 10 ms).
    let addr = s.addr;
    let occupant = tokio::spawn(async move {
        post(
            addr,
            "/v1/completions",
            &json!({"prompt": "occupant", "max_tokens": 150, "ignore_eos": true}),
        )
        .await
    });
    wait_for("the occupant to run", Duration::from_secs(5), async || {
        s.engine_sum(|e| u64::from(e.running)) == 1
    })
    .await;
    // Meanwhile 11 more arrive at once. Ahead of the engine there is room for at most 4 of
    // them: the engine's waiting queue (max_waiting = 1), its command channel (capacity
    // max_waiting), and the test recorder's channel plus the one command it holds while
    // forwarding. Every other one must be refused with 503, at submit ("overloaded") or by the
    // engine ("queue_full"), and every admitted one must run to the end.
    const BURST: usize = 11;
    const ROOM: usize = 4;
    let mut tasks = Vec::new();
    for i in 0..BURST {
        tasks.push(tokio::spawn(async move {
            post(
                addr,
                "/v1/completions",
                &json!({"prompt": format!("p{i}"), "max_tokens": 20, "ignore_eos": true}),
            )
            .await
        }));
    }
    let retry = ServerConfig::default().retry_after_secs.to_string();
    let (mut served, mut refused) = (0, 0);
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            503 => {
                assert_eq!(r.header("retry-after"), Some(retry.as_str()));
                let code = r.json()["error"]["code"].clone();
                assert!(code == "overloaded" || code == "queue_full", "{code}");
                refused += 1;
            }
            200 => {
                assert_eq!(r.json()["usage"]["completion_tokens"], 20, "{}", r.text());
                served += 1;
            }
            other => panic!("status {other}: {}", r.text()),
        }
    }
    assert!(
        refused >= BURST - ROOM,
        "{refused} of {BURST} refused, {served} served"
    );
    assert!(
        served >= 1,
        "the waiting slot was free, yet nothing was served"
    );
    let occupant = occupant.await.unwrap();
    assert_eq!(occupant.status, 200, "{}", occupant.text());
    assert_eq!(occupant.json()["usage"]["completion_tokens"], 150);
    assert!(s.wait_idle(Duration::from_secs(10)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_need_the_token() {
    let o = Options {
        server: ServerConfig {
            port: 0,
            admin_token: Some("s3cret-token".into()),
            ..ServerConfig::default()
        },
        ..Options::default()
    };
    let s = TestServer::start(o).await;
    let path = "/admin/reset_prefix_cache";
    assert_eq!(request(s.addr, "POST", path, &[], b"").await.status, 401);
    assert_eq!(
        request(
            s.addr,
            "POST",
            path,
            &[("Authorization", "Bearer wrong-token")],
            b""
        )
        .await
        .status,
        401
    );
    assert_eq!(
        request(
            s.addr,
            "POST",
            path,
            &[("Authorization", "s3cret-token")],
            b""
        )
        .await
        .status,
        401
    );
    // Fill the prefix cache, reset it, and see the next identical prompt miss.
    let body = json!({"prompt": "the cat sat on the mat and the dog ran", "max_tokens": 1});
    post(s.addr, "/v1/completions", &body).await;
    let hit = post(s.addr, "/v1/completions", &body).await.json();
    assert!(
        hit["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let r = request(
        s.addr,
        "POST",
        path,
        &[("Authorization", "Bearer s3cret-token")],
        b"",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // The reset reached the engine; it is queued before any later request.
    wait_for("the reset", Duration::from_secs(5), async || {
        s.counter(|c| c.get(&c.resets)) == 1
    })
    .await;
    let miss = post(s.addr, "/v1/completions", &body).await.json();
    assert_eq!(miss["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Plugin reload exists but this server has no reload hook.
    let r = request(
        s.addr,
        "POST",
        "/admin/reload_plugins",
        &[("Authorization", "Bearer s3cret-token")],
        b"",
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "unsupported");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_or_cancels_in_flight_work() {
    let mut o = slow();
    o.server = ServerConfig {
        port: 0,
        shutdown_grace_secs: 1,
        ..ServerConfig::default()
    };
    let mut s = TestServer::start(o).await;
    let addr = s.addr;
    // One request that finishes within the grace period, one that cannot.
    let short = tokio::spawn(async move {
        post(
            addr,
            "/v1/completions",
            &json!({"prompt": "a", "max_tokens": 20}),
        )
        .await
    });
    let long =
        tokio::spawn(async move { post(addr, "/v1/completions", &long_request(true)).await });
    wait_for("both running", Duration::from_secs(5), async || {
        s.counter(|c| c.get(&c.added)) == 2
    })
    .await;
    s.shutdown();
    let short = short.await.unwrap();
    assert_eq!(short.status, 200);
    assert_eq!(short.json()["choices"][0]["finish_reason"], "length");
    let long = long.await.unwrap();
    let ev = long.sse();
    assert_eq!(join_stream(&ev)[0].1.as_deref(), Some("abort"));
    let served = tokio::time::timeout(Duration::from_secs(10), s.task.take().unwrap()).await;
    assert!(
        matches!(served, Ok(Ok(Ok(())))),
        "serve did not return cleanly"
    );
    // Only the long one was cancelled.
    assert_eq!(s.counter(|c| c.get(&c.cancels)), 1);
    // The listener is closed.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
