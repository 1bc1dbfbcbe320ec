//! A table of malformed and hostile inputs, each answered with the right status and an OpenAI
//! error body; the server stays healthy afterwards. Every failure kind of the engine reaches the
//! client with the status the error map gives it.

#![allow(clippy::unwrap_used)]

use crate::server_support;

use chimera::server::ServerConfig;
use serde_json::{Value, json};
use server_support::*;

const C: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

struct Case {
    name: &'static str,
    method: &'static str,
    path: &'static str,
    body: Vec<u8>,
    status: u16,
    /// Expected `error.code` (None: only the status is checked).
    code: Option<&'static str>,
}

fn case(
    name: &'static str,
    path: &'static str,
    body: impl Into<Vec<u8>>,
    status: u16,
    code: Option<&'static str>,
) -> Case {
    Case {
        name,
        method: "POST",
        path,
        body: body.into(),
        status,
        code,
    }
}

/// A completions body with one field replaced (or added).
fn cw(field: &str, v: Value) -> Vec<u8> {
    let mut b = json!({"model": MODEL, "prompt": "hello", "max_tokens": 4});
    b[field] = v;
    serde_json::to_vec(&b).unwrap()
}

/// A chat body with one field replaced (or added).
fn chw(field: &str, v: Value) -> Vec<u8> {
    let mut b =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    b[field] = v;
    serde_json::to_vec(&b).unwrap()
}

fn msg(m: Value) -> Vec<u8> {
    chw("messages", json!([m]))
}

const BAD: u16 = 400;
const IJ: Option<&str> = Some("invalid_json");
const IR: Option<&str> = Some("invalid_request");
const CTX: Option<&str> = Some("context_length_exceeded");
const UNS: Option<&str> = Some("unsupported");

fn corpus() -> Vec<Case> {
    let deep = format!("{{\"prompt\": {}1{}}}", "[".repeat(5000), "]".repeat(5000));
    let long_prompt: Vec<u32> = (0..300).map(|i| i % 200).collect();
    let mut v = vec![
        case("empty body", C, "", BAD, IJ),
        case("truncated JSON", C, "{\"prompt\": \"hi\"", BAD, IJ),
        case("JSON null", C, "null", BAD, IR),
        case("JSON array", C, "[]", BAD, IR),
        case("JSON string", C, "\"prompt\"", BAD, IR),
        case("JSON number", C, "123", BAD, IR),
        case(
            "invalid UTF-8",
            C,
            b"{\"prompt\": \"\xff\xfe\"}".to_vec(),
            BAD,
            IJ,
        ),
        case("trailing garbage", C, "{\"prompt\": \"hi\"} xyz", BAD, IJ),
        case("missing prompt", C, "{\"model\": \"tiny-mock\"}", BAD, IR),
        case("prompt number", C, cw("prompt", json!(123)), BAD, IR),
        case("prompt null", C, cw("prompt", Value::Null), BAD, IR),
        case("prompt object", C, cw("prompt", json!({"a": 1})), BAD, IR),
        case("prompt empty list", C, cw("prompt", json!([])), BAD, IR),
        case(
            "prompt empty token list",
            C,
            cw("prompt", json!([[]])),
            BAD,
            IR,
        ),
        case("prompt empty string", C, cw("prompt", json!("")), BAD, IR),
        case("prompt negative id", C, cw("prompt", json!([-1])), BAD, IR),
        case("prompt float id", C, cw("prompt", json!([1.5])), BAD, IR),
        case(
            "prompt id out of vocab",
            C,
            cw("prompt", json!([99_999_999])),
            BAD,
            IR,
        ),
        case(
            "prompt id beyond u32",
            C,
            cw("prompt", json!([4_294_967_296u64])),
            BAD,
            IR,
        ),
        case(
            "prompt mixed list",
            C,
            cw("prompt", json!([[1, 2], "x"])),
            BAD,
            IR,
        ),
        case(
            "prompt longer than context",
            C,
            cw("prompt", json!(long_prompt)),
            BAD,
            CTX,
        ),
        case(
            "prompt plus max_tokens over context",
            C,
            cw("max_tokens", json!(256)),
            BAD,
            CTX,
        ),
        case(
            "unknown model",
            C,
            cw("model", json!("gpt-9")),
            404,
            Some("model_not_found"),
        ),
        case("model wrong type", C, cw("model", json!(5)), BAD, IR),
        case(
            "max_tokens negative",
            C,
            cw("max_tokens", json!(-1)),
            BAD,
            IR,
        ),
        case("max_tokens zero", C, cw("max_tokens", json!(0)), BAD, IR),
        case(
            "max_tokens string",
            C,
            cw("max_tokens", json!("10")),
            BAD,
            IR,
        ),
        case(
            "max_tokens float",
            C,
            cw("max_tokens", json!(1e10)),
            BAD,
            IR,
        ),
        case(
            "temperature negative",
            C,
            cw("temperature", json!(-0.1)),
            BAD,
            IR,
        ),
        case(
            "temperature too high",
            C,
            cw("temperature", json!(3)),
            BAD,
            IR,
        ),
        case(
            "temperature string",
            C,
            cw("temperature", json!("hot")),
            BAD,
            IR,
        ),
        case(
            "number overflow",
            C,
            "{\"prompt\": \"hi\", \"temperature\": 1e400}",
            BAD,
            IJ,
        ),
        case("top_p zero", C, cw("top_p", json!(0)), BAD, IR),
        case("top_p above one", C, cw("top_p", json!(1.5)), BAD, IR),
        case("top_k negative", C, cw("top_k", json!(-5)), BAD, IR),
        case("top_k float", C, cw("top_k", json!(1.5)), BAD, IR),
        case("min_p above one", C, cw("min_p", json!(2)), BAD, IR),
        case(
            "presence_penalty too high",
            C,
            cw("presence_penalty", json!(3)),
            BAD,
            IR,
        ),
        case(
            "frequency_penalty too low",
            C,
            cw("frequency_penalty", json!(-3)),
            BAD,
            IR,
        ),
        case(
            "repetition_penalty zero",
            C,
            cw("repetition_penalty", json!(0)),
            BAD,
            IR,
        ),
        case("n zero", C, cw("n", json!(0)), BAD, IR),
        case("n huge", C, cw("n", json!(1000)), BAD, IR),
        case("n negative", C, cw("n", json!(-1)), BAD, IR),
        case("stop empty string", C, cw("stop", json!("")), BAD, IR),
        case("stop numbers", C, cw("stop", json!([1, 2])), BAD, IR),
        case(
            "too many stop strings",
            C,
            cw("stop", json!(vec!["x"; 17])),
            BAD,
            IR,
        ),
        case(
            "stop string too long",
            C,
            cw("stop", json!("y".repeat(300))),
            BAD,
            IR,
        ),
        case(
            "stop_token_ids negative",
            C,
            cw("stop_token_ids", json!([-1])),
            BAD,
            IR,
        ),
        case(
            "stop_token_ids out of vocab",
            C,
            cw("stop_token_ids", json!([1_000_000])),
            BAD,
            IR,
        ),
        case("logprobs too many", C, cw("logprobs", json!(21)), BAD, IR),
        case("logprobs negative", C, cw("logprobs", json!(-1)), BAD, IR),
        case("stream string", C, cw("stream", json!("yes")), BAD, IR),
        case(
            "stream_options without stream",
            C,
            cw("stream_options", json!({"include_usage": true})),
            BAD,
            IR,
        ),
        case(
            "stream_options wrong type",
            C,
            cw("stream_options", json!(true)),
            BAD,
            IR,
        ),
        case(
            "logit_bias out of range",
            C,
            cw("logit_bias", json!({"1": 500})),
            BAD,
            IR,
        ),
        case(
            "logit_bias key not a token id",
            C,
            cw("logit_bias", json!({"one": 5})),
            BAD,
            IR,
        ),
        case(
            "min_tokens above max_tokens",
            C,
            cw("min_tokens", json!(100)),
            BAD,
            IR,
        ),
        case("priority under fcfs", C, cw("priority", json!(1)), BAD, IR),
        case("suffix", C, cw("suffix", json!("tail")), BAD, UNS),
        case(
            "best_of differs from n",
            C,
            cw("best_of", json!(3)),
            BAD,
            UNS,
        ),
        case("seed string", C, cw("seed", json!("x")), BAD, IR),
        case("seed float", C, cw("seed", json!(1.5)), BAD, IR),
        case("echo string", C, cw("echo", json!("yes")), BAD, IR),
        case("deeply nested JSON", C, deep, BAD, IJ),
        case(
            "body over the limit",
            C,
            format!("{{\"prompt\": \"{}\"}}", "a".repeat(70_000)),
            413,
            Some("payload_too_large"),
        ),
        case(
            "chat messages missing",
            CHAT,
            "{\"model\": \"tiny-mock\"}",
            BAD,
            IR,
        ),
        case(
            "chat messages empty",
            CHAT,
            chw("messages", json!([])),
            BAD,
            IR,
        ),
        case(
            "chat messages string",
            CHAT,
            chw("messages", json!("hi")),
            BAD,
            IR,
        ),
        case(
            "chat unknown role",
            CHAT,
            msg(json!({"role": "wizard", "content": "x"})),
            BAD,
            IR,
        ),
        case(
            "chat role missing",
            CHAT,
            msg(json!({"content": "x"})),
            BAD,
            IR,
        ),
        case(
            "chat content number",
            CHAT,
            msg(json!({"role": "user", "content": 5})),
            BAD,
            IR,
        ),
        case(
            "chat image part",
            CHAT,
            msg(
                json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
            ),
            BAD,
            UNS,
        ),
        case(
            "chat text part without text",
            CHAT,
            msg(json!({"role": "user", "content": [{"type": "text"}]})),
            BAD,
            IR,
        ),
        case(
            "chat tools",
            CHAT,
            chw(
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
            ),
            BAD,
            UNS,
        ),
        case(
            "chat tools not a list",
            CHAT,
            serde_json::to_vec(&json!({"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": {"name": "f"}, "tool_choice": "none"}))
            .unwrap(),
            BAD,
            IR,
        ),
        case(
            "chat tool_calls without a function",
            CHAT,
            msg(json!({"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]})),
            BAD,
            IR,
        ),
        case(
            "chat top_logprobs without logprobs",
            CHAT,
            chw("top_logprobs", json!(2)),
            BAD,
            IR,
        ),
        case(
            "chat logprobs string",
            CHAT,
            chw("logprobs", json!("yes")),
            BAD,
            IR,
        ),
        case(
            "chat response_format of an unknown type",
            CHAT,
            chw("response_format", json!({"type": "xml"})),
            BAD,
            IR,
        ),
        case(
            "chat json_schema without a schema",
            CHAT,
            chw(
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            ),
            BAD,
            IR,
        ),
        case(
            "chat json_object on a server without a constraint vocabulary",
            CHAT,
            chw("response_format", json!({"type": "json_object"})),
            BAD,
            UNS,
        ),
        case(
            "chat structured_outputs with two constraints",
            CHAT,
            chw("structured_outputs", json!({"regex": "a", "choice": ["a"]})),
            BAD,
            IR,
        ),
        case(
            "chat tool_choice naming no tool",
            CHAT,
            chw(
                "tool_choice",
                json!({"type": "function", "function": {"name": "f"}}),
            ),
            BAD,
            IR,
        ),
        case(
            "chat max_completion_tokens negative",
            CHAT,
            chw("max_completion_tokens", json!(-5)),
            BAD,
            IR,
        ),
        case(
            "chat unknown model",
            CHAT,
            chw("model", json!("nope")),
            404,
            Some("model_not_found"),
        ),
        case("chat n zero", CHAT, chw("n", json!(0)), BAD, IR),
        case(
            "admin off without a token",
            "/admin/reset_prefix_cache",
            "",
            404,
            Some("not_found"),
        ),
        case(
            "unknown path",
            "/v1/embeddings",
            "{}",
            404,
            Some("not_found"),
        ),
    ];
    let mut top = serde_json::from_slice::<Value>(&chw("logprobs", json!(true))).unwrap();
    top["top_logprobs"] = json!(50);
    v.push(case(
        "chat top_logprobs too many",
        CHAT,
        serde_json::to_vec(&top).unwrap(),
        BAD,
        IR,
    ));
    for (path, method) in [
        (C, "GET"),
        (CHAT, "GET"),
        ("/v1/models", "POST"),
        ("/health", "DELETE"),
    ] {
        v.push(Case {
            name: "wrong method",
            method,
            path,
            body: Vec::new(),
            status: 405,
            code: Some("method_not_allowed"),
        });
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_inputs_get_the_right_status() {
    let opts = Options {
        max_model_len: 256,
        server: ServerConfig {
            port: 0,
            max_body_bytes: 64 * 1024,
            ..ServerConfig::default()
        },
        ..Options::default()
    };
    let s = TestServer::start(opts).await;
    let cases = corpus();
    assert!(cases.len() >= 50, "corpus has {} cases", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        let r = request(
            s.addr,
            c.method,
            c.path,
            &[("Content-Type", "application/json")],
            &c.body,
        )
        .await;
        if r.status != c.status {
            failures.push(format!(
                "{}: status {} (want {}): {}",
                c.name,
                r.status,
                c.status,
                r.text()
            ));
            continue;
        }
        let v: Value = match serde_json::from_slice(&r.body) {
            Ok(v) => v,
            Err(_) => {
                failures.push(format!("{}: body is not JSON: {}", c.name, r.text()));
                continue;
            }
        };
        let e = &v["error"];
        if !(e["message"].is_string() && e["type"].is_string() && e.get("param").is_some()) {
            failures.push(format!("{}: not an OpenAI error: {v}", c.name));
        }
        if let Some(code) = c.code
            && e["code"] != code
        {
            failures.push(format!("{}: code {} (want {code})", c.name, e["code"]));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );

    // Protocol-level garbage is refused by the HTTP layer without harming the server.
    let garbage = raw(s.addr, b"HELLO THERE\r\n\r\n").await;
    assert!(garbage.is_empty() || parse_response(&garbage).status == 400);
    let huge_header = format!(
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: {}\r\n\r\n",
        "a".repeat(1 << 20)
    );
    let r = raw(s.addr, huge_header.as_bytes()).await;
    assert!(
        r.is_empty() || parse_response(&r).status == 431,
        "{}",
        String::from_utf8_lossy(&r)
    );
    let lying_length = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\nConnection: close\r\n\r\n{}";
    let r = parse_response(&raw(s.addr, lying_length).await);
    assert_eq!(r.status, 413);

    // A context overflow names the field that holds the prompt on each endpoint.
    let over = |b: Vec<u8>| serde_json::from_slice::<Value>(&b).unwrap();
    for (path, body, param) in [
        (C, over(cw("max_tokens", json!(256))), "prompt"),
        (CHAT, over(chw("max_tokens", json!(256))), "messages"),
    ] {
        let r = post(s.addr, path, &body).await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        let v: Value = serde_json::from_slice(&r.body).expect("JSON error");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{path}: {v}");
        assert_eq!(v["error"]["param"], param, "{path}: {v}");
    }

    // Unknown fields are ignored (OpenAI SDKs send newer fields than any server knows).
    let r = post(
        s.addr,
        C,
        &json!({"model": MODEL, "prompt": "hi", "max_tokens": 2, "frobnicate": {"x": 1}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());

    // Still healthy, and the errors were counted by kind.
    assert_eq!(
        request(s.addr, "GET", "/health", &[], b"").await.status,
        200
    );
    let counted = s.metric_sum("chimera:request_errors_total").await;
    assert!(counted >= cases.len() as f64, "counted {counted} errors");
    assert!(s.wait_idle(std::time::Duration::from_secs(5)).await);
}

/// Every failure kind the engine produces, driven through a real engine thread (over the mock
/// executor) up to the HTTP answer. The server's own checks pass these requests (the engine's
/// vocabulary, cache and queue are smaller than what the server knows of), so each answer is
/// the error map's verdict on the engine's `FailureKind`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_failure_kinds_reach_the_client_with_their_status() {
    let mut o = Options {
        // 64 blocks of 4 tokens: a 300-token prompt can never fit.
        blocks: 64,
        server: ServerConfig {
            port: 0,
            retry_after_secs: 3,
            ..ServerConfig::default()
        },
        ..Options::default()
    };
    // The model's vocabulary is the 256 byte tokens; the tokenizer knows more.
    o.mock.vocab = 256;
    o.mock.fail_on_token = Some(200);
    o.mock.step_delay = std::time::Duration::from_millis(20);
    o.engine.max_running = 1;
    o.engine.max_waiting = 1;
    assert!(codec().vocab_size() > 300);
    let s = TestServer::start(o).await;
    let body = |prompt: Value| json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});

    // InvalidRequest: a token id the tokenizer has but the model does not.
    let r = post(s.addr, C, &body(json!([1, 300]))).await;
    assert_eq!(r.status, 400, "{}", r.text());
    let e = &r.json()["error"];
    assert_eq!(e["code"], "invalid_request");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("token id 300 is outside the vocabulary (256)"),
        "not the engine's check: {e}"
    );

    // PromptTooLong: more blocks than the cache holds (the context window allows it).
    let long: Vec<u32> = (0..300).map(|i| 1 + i % 150).collect();
    let r = post(s.addr, C, &body(json!(long))).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "prompt_too_long");

    // Executor: the forward pass fails.
    let r = post(s.addr, C, &body(json!([200, 201]))).await;
    assert_eq!(r.status, 500, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "executor_failed");

    // QueueFull: one request running, one waiting (engine.max_waiting = 1), then a third. The
    // first two fit the cache (203 tokens) and run (4 s) until their clients hang up.
    let long_body = json!({"model": MODEL, "prompt": [10, 11, 12], "max_tokens": 200});
    let within = std::time::Duration::from_secs(3);
    let running = post_and_hold(s.addr, C, &long_body).await;
    wait_for("one running", within, async || {
        s.engines[0].stats().running == 1
    })
    .await;
    let waiting = post_and_hold(s.addr, C, &long_body).await;
    wait_for("one waiting", within, async || {
        s.engines[0].stats().waiting == 1
    })
    .await;
    let r = post(s.addr, C, &body(json!([20, 21]))).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("3"));
    assert_eq!(r.json()["error"]["code"], "queue_full");
    drop((running, waiting));

    // Each kind is counted under its own label, and the server recovers.
    for kind in [
        "invalid_request",
        "prompt_too_long",
        "executor_failed",
        "queue_full",
    ] {
        let label = format!("chimera:request_errors_total{{kind=\"{kind}\"");
        assert_eq!(s.metric_sum(&label).await, 1.0, "{kind}");
    }
    assert!(s.wait_idle(std::time::Duration::from_secs(5)).await);
    let r = post(s.addr, C, &body(json!([20, 21]))).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A replica whose device is lost (a sticky GPU error) fails its batch, stops, shows as dead on
/// `/health`, and the router sends later requests to the live replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_device_takes_its_replica_out_of_service() {
    let mut o = Options {
        replicas: 2,
        server: ServerConfig {
            port: 0,
            ..ServerConfig::default()
        },
        ..Options::default()
    };
    o.mock.lose_device_on_token = Some(200);
    let s = TestServer::start(o).await;
    let body = |prompt: Value| json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});
    // Both replicas are idle: the first goes to replica 0, whose device is lost.
    let r = post(s.addr, C, &body(json!([200, 201]))).await;
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(r.text().contains("device lost"), "{}", r.text());
    wait_for(
        "replica 0 stops",
        std::time::Duration::from_secs(5),
        async || !s.engines[0].is_alive(),
    )
    .await;
    let h = request(s.addr, "GET", "/health", &[], b"").await;
    assert_eq!(h.status, 503, "{}", h.text());
    assert_eq!(h.json()["dead_replicas"], json!([0]));
    // Later requests are served by replica 1.
    for _ in 0..3 {
        let r = post(s.addr, C, &body(json!([20, 21]))).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert!(s.engines[1].is_alive());
}

/// The engine's own checks, for requests the server never lets through: each is failed as
/// `InvalidRequest` (400 through the error map, like the out-of-vocabulary id above).
#[test]
fn the_engine_fails_malformed_requests_as_invalid_request() {
    use chimera::engine::api::{EngineEvent, FailureKind, GenerateRequest, SamplingParams};
    use chimera::engine::{Engine, MockExecutor};

    let o = Options::default();
    let mut e = Engine::new(
        o.setup(),
        MockExecutor::new(o.mock.clone()),
        Options::policies(),
    )
    .expect("engine");
    let req = |id: u64, prompt: Vec<u32>, max_tokens: u32| GenerateRequest {
        id,
        prompt,
        params: SamplingParams::default(),
        max_tokens,
        stop_token_ids: vec![],
        ignore_eos: false,
        prompt_logprobs: None,
        block_hashes: None,
        checkpoints: Vec::new(),
        priority: 0,
        constraint: None,
        speculative: true,
    };
    let vocab = o.mock.vocab as u32;
    let cases = [
        ("empty prompt", req(1, vec![], 4)),
        ("max_tokens 0", req(2, vec![1, 2], 0)),
        ("token outside the vocabulary", req(3, vec![1, vocab], 4)),
        ("id in use", req(4, vec![1, 2], 4)),
    ];
    // Request 4 is queued first, so its second submission reuses a live id.
    let (tx, _keep) = tokio::sync::mpsc::unbounded_channel();
    e.add(req(4, vec![5, 6], 4), tx);
    for (what, r) in cases {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        e.add(r, tx);
        match rx.try_recv() {
            Ok(EngineEvent::Failed { kind, .. }) => {
                assert_eq!(kind, FailureKind::InvalidRequest, "{what}")
            }
            other => panic!("{what}: {other:?}"),
        }
    }
}
