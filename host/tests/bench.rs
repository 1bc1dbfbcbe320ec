//! `chimera bench` against a scripted mock server on 127.0.0.1.
//!
//! The mock streams OpenAI-style SSE with known timings (first token after `FIRST_MS`, then one
//! token every `ITL_MS`), reports `usage` from a whitespace word count, and simulates a prefix
//! cache (the first `prefix_words` words of a prompt are "cached" once seen). Expected values
//! are derived from that script: counts and cache hits exactly, latencies within bounds that
//! allow for scheduling delay on a busy machine (a sleep never ends early, so lower bounds are
//! exact).

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chimera::bench::arrivals::Arrivals;
use chimera::bench::{BenchArgs, BenchReport, run};
use clap::Parser;
use serde_json::{Value, json};

const FIRST_MS: u64 = 50;
const ITL_MS: u64 = 10;

#[derive(Clone, Default)]
struct Script {
    /// Every n-th request (1-based) gets HTTP 500.
    fail_every: Option<usize>,
    /// Every n-th request (not already failed) stops after two tokens with an error event.
    break_every: Option<usize>,
    /// Words of the prompt that form the cacheable prefix (0: no cache simulation).
    prefix_words: usize,
    count: Arc<AtomicUsize>,
    seen: Arc<Mutex<HashSet<String>>>,
    /// Prompts received, in arrival order (text joined for chat).
    prompts: Arc<Mutex<Vec<String>>>,
    models: Arc<Mutex<Vec<String>>>,
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

async fn generate(State(s): State<Script>, chat: bool, body: Value) -> Response {
    let n = s.count.fetch_add(1, Ordering::SeqCst) + 1;
    if s.fail_every.is_some_and(|k| n % k == 0) {
        let err = json!({"error": {"message": "scripted failure", "type": "server_error"}});
        return (StatusCode::INTERNAL_SERVER_ERROR, axum::Json(err)).into_response();
    }
    let broken = s.break_every.is_some_and(|k| n % k == 0);
    let prompt = if chat {
        body["messages"]
            .as_array()
            .map(|m| {
                m.iter()
                    .filter_map(|x| x["content"].as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default()
    } else {
        body["prompt"].as_str().unwrap_or_default().to_string()
    };
    s.prompts.lock().unwrap().push(prompt.clone());
    s.models
        .lock()
        .unwrap()
        .push(body["model"].as_str().unwrap_or_default().to_string());
    let words: Vec<&str> = prompt.split_whitespace().collect();
    let cached = if s.prefix_words > 0 && words.len() >= s.prefix_words {
        let key = words[..s.prefix_words].join(" ");
        if s.seen.lock().unwrap().insert(key) {
            0
        } else {
            s.prefix_words
        }
    } else {
        0
    };
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(16) as usize;
    let prompt_tokens = words.len();
    // State: next token index; None once finished.
    let stream = futures_util::stream::unfold(Some(0usize), move |st| async move {
        let i = st?;
        if broken && i == 2 {
            let e = json!({"error": {"message": "engine died"}});
            return Some((Ok::<Bytes, Infallible>(sse(&e)), None));
        }
        if i < max_tokens {
            let wait = if i == 0 { FIRST_MS } else { ITL_MS };
            tokio::time::sleep(Duration::from_millis(wait)).await;
            let text = format!(" tok{i}");
            let last = i + 1 == max_tokens;
            let finish = if last { json!("length") } else { Value::Null };
            let chunk = if chat {
                json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})
            } else {
                json!({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})
            };
            return Some((Ok(sse(&chunk)), Some(i + 1)));
        }
        let usage = json!({"choices": [], "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": max_tokens,
            "total_tokens": prompt_tokens + max_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}});
        let mut tail = sse(&usage).to_vec();
        tail.extend_from_slice(b"data: [DONE]\n\n");
        Some((Ok(Bytes::from(tail)), None))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

async fn spawn_mock(script: Script) -> String {
    let app = Router::new()
        .route(
            "/v1/completions",
            post(|s: State<Script>, axum::Json(b): axum::Json<Value>| generate(s, false, b)),
        )
        .route(
            "/v1/chat/completions",
            post(|s: State<Script>, axum::Json(b): axum::Json<Value>| generate(s, true, b)),
        )
        .route(
            "/v1/models",
            get(|| async { axum::Json(json!({"data": [{"id": "mock-model"}]})) }),
        )
        .with_state(script);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

fn args(url: &str, rest: &[&str]) -> BenchArgs {
    let argv = ["bench", "--url", url, "--no-progress", "--quiet"]
        .into_iter()
        .chain(rest.iter().copied());
    Cli::try_parse_from(argv).unwrap().args
}

/// Writes a word-level tokenizer.json (one whitespace word = one token) and returns its path.
fn word_tokenizer_file(name: &str) -> std::path::PathBuf {
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    let mut vocab = std::collections::HashMap::new();
    vocab.insert("<unk>".to_string(), 0u32);
    for a in ["ka", "lo", "mi", "nu", "pe", "ru", "sa", "ti"] {
        for b in ["ba", "de", "fo", "gu", "ha", "je", "ko", "li"] {
            let id = vocab.len() as u32;
            vocab.insert(format!("{a}{b}"), id);
        }
    }
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("<unk>".into())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(WhitespaceSplit));
    let dir = std::env::temp_dir().join(format!("chimera-bench-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    tok.save(&path, false).unwrap();
    path
}

fn assert_json_close(a: &Value, b: &Value) {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!((x - y).abs() <= 1e-12 * x.abs().max(y.abs()), "{x} vs {y}");
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).for_each(|(x, y)| assert_json_close(x, y));
        }
        (Value::Object(x), Value::Object(y)) => {
            assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
            x.iter().for_each(|(k, v)| assert_json_close(v, &y[k]));
        }
        _ => assert_eq!(a, b),
    }
}

fn in_range(x: f64, lo: f64, hi: f64) -> bool {
    (lo..=hi).contains(&x)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_latencies_and_counts_follow_the_script() {
    let url = spawn_mock(Script::default()).await;
    let report = run(args(
        &url,
        &[
            "--model",
            "m",
            "--tokenizer",
            "words",
            "--workload",
            "random",
            "--input-len",
            "20",
            "--output-len",
            "8",
            "--num-requests",
            "10",
            "--concurrency",
            "2",
            "--save-requests",
        ],
    ))
    .await
    .unwrap();
    assert_eq!(report.points.len(), 1);
    let p = &report.points[0].summary;
    assert_eq!(
        (p.requests.sent, p.requests.completed, p.requests.failed),
        (10, 10, 0)
    );
    assert!(p.errors.is_empty());
    assert_eq!(
        (p.tokens.prompt, p.tokens.completion, p.tokens.cached),
        (200, 80, 0)
    );
    assert_eq!(p.cache_hit_ratio, Some(0.0));
    let l = &p.latency_ms;
    let ttft = l.ttft.as_ref().unwrap();
    let e2e = l.e2e.as_ref().unwrap();
    let itl = l.itl.as_ref().unwrap();
    let tpot = l.tpot.as_ref().unwrap();
    // Script: TTFT 50 ms, 7 gaps of 10 ms, so E2E 120 ms and TPOT 10 ms.
    assert_eq!(ttft.count, 10);
    assert!(ttft.min >= 50.0, "ttft min {}", ttft.min);
    assert!(in_range(ttft.p50, 50.0, 65.0), "ttft p50 {}", ttft.p50);
    assert!(e2e.min >= 120.0, "e2e min {}", e2e.min);
    assert!(in_range(e2e.p50, 120.0, 150.0), "e2e p50 {}", e2e.p50);
    assert!(in_range(itl.p50, 9.0, 15.0), "itl p50 {}", itl.p50);
    assert!(in_range(tpot.p50, 10.0, 14.0), "tpot p50 {}", tpot.p50);
    // ITL samples: 7 per request unless two chunks arrived in one read.
    assert!(
        in_range(itl.count as f64, 60.0, 70.0),
        "itl count {}",
        itl.count
    );
    // Two clients, five requests each back to back: at least 5 x 120 ms.
    assert!(
        in_range(p.duration_s, 0.6, 0.9),
        "duration {}",
        p.duration_s
    );
    let rps = p.throughput.requests_per_s;
    assert!((rps - 10.0 / p.duration_s).abs() < 1e-9);
    assert!((p.throughput.output_tokens_per_s - 80.0 / p.duration_s).abs() < 1e-9);
    assert!(
        in_range(p.mean_in_flight, 1.6, 2.0),
        "in flight {}",
        p.mean_in_flight
    );
    // Per-request records are kept and consistent with the summary.
    let recs = report.points[0].records.as_ref().unwrap();
    assert_eq!(recs.len(), 10);
    assert!(
        recs.iter()
            .all(|r| r.completion_tokens == Some(8) && r.prompt_tokens == Some(20))
    );
    assert!(recs.windows(2).all(|w| w[0].start_s <= w[1].start_s));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefix_cache_hits_are_exact_with_a_tokenizer_file() {
    let tok = word_tokenizer_file("prefix");
    let script = Script {
        prefix_words: 32,
        ..Default::default()
    };
    let url = spawn_mock(script.clone()).await;
    let report = run(args(
        &url,
        &[
            "--tokenizer",
            tok.to_str().unwrap(),
            "--groups",
            "3",
            "--prompts-per-group",
            "4",
            "--prefix-len",
            "32",
            "--question-len",
            "8",
            "--output-len",
            "4",
            "--concurrency",
            "3",
            "--label",
            "prefix-on",
            "--metadata",
            "prefix_caching=on",
        ],
    ))
    .await
    .unwrap();
    assert_eq!(report.server.model, "mock-model");
    assert!(
        script
            .models
            .lock()
            .unwrap()
            .iter()
            .all(|m| m == "mock-model")
    );
    assert_eq!(report.label.as_deref(), Some("prefix-on"));
    assert_eq!(
        report.metadata.get("prefix_caching").map(String::as_str),
        Some("on")
    );
    assert_eq!(report.workload.requests_per_pass, 12);
    let p = &report.points[0].summary;
    assert_eq!(p.requests.completed, 12);
    // Every prompt is 32 + 8 tokens; the first prompt of each group misses, the other three
    // hit all 32 prefix tokens.
    assert_eq!(p.tokens.prompt, 12 * 40);
    assert_eq!(p.tokens.cached, 3 * 3 * 32);
    assert_eq!(p.cache_hit_ratio, Some(288.0 / 480.0));
    // Prompts of a group really share their first 32 words and nothing else repeats.
    let prompts = script.prompts.lock().unwrap().clone();
    let prefixes: HashSet<String> = prompts
        .iter()
        .map(|p| p.split_whitespace().take(32).collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(prefixes.len(), 3);
    assert!(prompts.iter().all(|p| p.split_whitespace().count() == 40));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_by_kind_and_never_dropped() {
    let url = spawn_mock(Script {
        fail_every: Some(3),
        break_every: Some(5),
        ..Default::default()
    })
    .await;
    let report = run(args(
        &url,
        &[
            "--model",
            "m",
            "--tokenizer",
            "words",
            "--workload",
            "random",
            "--input-len",
            "5",
            "--output-len",
            "4",
            "--num-requests",
            "15",
            "--concurrency",
            "1",
        ],
    ))
    .await
    .unwrap();
    let p = &report.points[0].summary;
    // Requests 3, 6, 9, 12, 15 get HTTP 500; 5 and 10 break mid-stream.
    assert_eq!(p.requests.sent, 15);
    assert_eq!(p.requests.failed, 7);
    assert_eq!(p.requests.completed, 8);
    assert_eq!(p.errors.get("http_500"), Some(&5));
    assert_eq!(p.errors.get("server_error"), Some(&2));
    assert_eq!(p.tokens.completion, 8 * 4);
    assert_eq!(p.latency_ms.e2e.as_ref().unwrap().count, 8);
    assert!((p.throughput.requests_per_s - 8.0 / p.duration_s).abs() < 1e-9);

    // Nothing listening: every request is a connect failure.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let report = run(args(
        &format!("http://{closed}"),
        &[
            "--model",
            "m",
            "--tokenizer",
            "words",
            "--workload",
            "random",
            "--input-len",
            "5",
            "--output-len",
            "4",
            "--num-requests",
            "6",
            "--concurrency",
            "2",
        ],
    ))
    .await
    .unwrap();
    let p = &report.points[0].summary;
    assert_eq!((p.requests.sent, p.requests.failed), (6, 6));
    assert_eq!(p.errors.get("connect"), Some(&6));
    assert!(p.latency_ms.ttft.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisson_arrivals_follow_the_seeded_schedule() {
    let url = spawn_mock(Script::default()).await;
    let report = run(args(
        &url,
        &[
            "--model",
            "m",
            "--tokenizer",
            "words",
            "--workload",
            "random",
            "--input-len",
            "5",
            "--output-len",
            "2",
            "--num-requests",
            "20",
            "--request-rate",
            "40",
            "--seed",
            "7",
            "--save-requests",
        ],
    ))
    .await
    .unwrap();
    let recs = report.points[0].records.as_ref().unwrap();
    assert_eq!(recs.len(), 20);
    // The runner seeds arrivals with the point's seed (seed + point index for fresh prompts).
    let mut a = Arrivals::new(40.0, 1.0, 7);
    let expected: Vec<f64> = (0..20).map(|_| a.next_offset()).collect();
    let mut lags = Vec::new();
    for (r, want) in recs.iter().zip(&expected) {
        assert!(
            r.start_s + 1e-3 >= *want,
            "sent at {} before {}",
            r.start_s,
            want
        );
        lags.push(r.start_s - want);
    }
    lags.sort_by(f64::total_cmp);
    assert!(lags[10] < 0.01, "median lag {}", lags[10]);
    let l = &report.points[0].summary.load;
    assert_eq!(
        (l.mode.as_str(), l.value, l.burstiness),
        ("request_rate", Some(40.0), Some(1.0))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_turns_extend_the_conversation() {
    for endpoint in ["completions", "chat"] {
        let script = Script::default();
        let url = spawn_mock(script.clone()).await;
        let report = run(args(
            &url,
            &[
                "--model",
                "m",
                "--tokenizer",
                "words",
                "--workload",
                "multi-turn",
                "--conversations",
                "2",
                "--turns",
                "3",
                "--prefix-len",
                "6",
                "--question-len",
                "4",
                "--output-len",
                "3",
                "--concurrency",
                "2",
                "--endpoint",
                endpoint,
            ],
        ))
        .await
        .unwrap();
        let p = &report.points[0].summary;
        assert_eq!(
            (p.requests.sent, p.requests.completed),
            (6, 6),
            "{endpoint}"
        );
        let prompts = script.prompts.lock().unwrap().clone();
        let words: Vec<usize> = prompts
            .iter()
            .map(|p| p.split_whitespace().count())
            .collect();
        // Turn k carries 6 + 4 (k + 1) + 3 k words: 10, 17, 24 for each conversation.
        let mut sorted = words.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [10, 10, 17, 17, 24, 24], "{endpoint}");
        // Each later turn's prompt is an earlier turn's prompt, its answer, then a new question.
        let norm = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
        for long in prompts.iter().filter(|p| p.split_whitespace().count() > 10) {
            let long = norm(long);
            let found = prompts
                .iter()
                .map(|q| norm(q))
                .any(|q| long.starts_with(&format!("{q} tok0 tok1 tok2 ")));
            assert!(found, "{endpoint}: no earlier turn prefixes {long}");
        }
        assert_eq!(p.tokens.prompt, 2 * (10 + 17 + 24));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_writes_json_and_svg_and_duration_bounds_sending() {
    let url = spawn_mock(Script::default()).await;
    let dir = std::env::temp_dir().join(format!("chimera-bench-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("sweep.json");
    let report = run(args(
        &url,
        &[
            "--model",
            "m",
            "--tokenizer",
            "words",
            "--workload",
            "random",
            "--input-len",
            "5",
            "--output-len",
            "3",
            "--num-requests",
            "4",
            "--concurrency",
            "1,2",
            "--output",
            out.to_str().unwrap(),
        ],
    ))
    .await
    .unwrap();
    assert_eq!(report.points.len(), 2);
    let loads: Vec<Option<f64>> = report.points.iter().map(|p| p.summary.load.value).collect();
    assert_eq!(loads, [Some(1.0), Some(2.0)]);
    // Round trip: same document (floats to the last few ulps: JSON text is decimal).
    let back = BenchReport::read_json(&out).unwrap();
    assert_json_close(
        &serde_json::to_value(&back).unwrap(),
        &serde_json::to_value(&report).unwrap(),
    );
    let raw: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(raw["schema"], "chimera-bench/1");
    assert_eq!(raw["points"][1]["requests"]["completed"], 4);
    assert!(raw["points"][0]["latency_ms"]["ttft"]["p99"].is_number());
    let svg = std::fs::read_to_string(dir.join("sweep.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("time to first token"));

    // Duration bound: no request starts after 0.3 s; each takes ~70 ms, two clients.
    let report = run(args(
        &url,
        &[
            "--model",
            "m",
            "--tokenizer",
            "words",
            "--workload",
            "random",
            "--input-len",
            "5",
            "--output-len",
            "3",
            "--duration",
            "0.3",
            "--concurrency",
            "2",
            "--save-requests",
        ],
    ))
    .await
    .unwrap();
    let recs = report.points[0].records.as_ref().unwrap();
    assert!(
        recs.len() >= 2 && recs.len() <= 10,
        "{} requests",
        recs.len()
    );
    assert!(recs.iter().all(|r| r.start_s < 0.3 && r.error.is_none()));

    // Warm-up requests are sent but kept out of the statistics; a baseline file is accepted.
    let script = Script::default();
    let url = spawn_mock(script.clone()).await;
    let report = run(args(
        &url,
        &[
            "--model",
            "m",
            "--tokenizer",
            "words",
            "--workload",
            "random",
            "--input-len",
            "5",
            "--output-len",
            "2",
            "--num-requests",
            "4",
            "--concurrency",
            "1,2",
            "--warmup",
            "3",
            "--baseline",
            out.to_str().unwrap(),
        ],
    ))
    .await
    .unwrap();
    assert_eq!(script.count.load(Ordering::SeqCst), 3 + 4 + 4);
    assert_eq!(
        (report.run.warmup_requests, report.run.warmup_failed),
        (3, 0)
    );
    assert!(report.points.iter().all(|p| p.summary.requests.sent == 4));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_are_clear_errors() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cases: [(&[&str], &str); 6] = [
        (&["--workload", "file"], "--prompts-file"),
        (&["--extra-body", "[1]"], "JSON object"),
        (
            &["--prompt-format", "token-ids", "--endpoint", "chat"],
            "completions",
        ),
        (
            &["--request-rate", "inf", "--duration", "5"],
            "--num-requests",
        ),
        (
            &["--tokenizer", "/nonexistent/tok.json"],
            "--tokenizer words",
        ),
        (&["--baseline", "/nonexistent/base.json"], "base.json"),
    ];
    for (extra, needle) in cases {
        let mut a = vec!["--model", "m"];
        a.extend_from_slice(extra);
        let err = rt
            .block_on(run(args("http://127.0.0.1:9", &a)))
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
    assert!(Cli::try_parse_from(["bench", "--url", "x", "--prefix-len", "9:3"]).is_err());
    assert!(
        Cli::try_parse_from([
            "bench",
            "--url",
            "x",
            "--concurrency",
            "2",
            "--request-rate",
            "3"
        ])
        .is_err()
    );
}
