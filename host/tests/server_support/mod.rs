//! Shared helpers for the server integration tests: a server on a loopback port in front of
//! mock engines, and a small raw HTTP/1.1 client (raw so tests can send malformed requests and
//! hang up mid-response).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chimera::policy;
use chimera::server::mock_engine::{MockCounters, MockEngine, MockEngineConfig};
use chimera::server::{
    AppParts, AppState, LeastLoaded, ModelInfo, Replica, ServerConfig, TextCodec, mock_tokenizer,
    serve_with_shutdown,
};
use serde_json::Value;
use std::io::{Read, Write};

use tokio::net::TcpListener;

pub const MODEL: &str = "tiny-mock";

pub fn codec() -> TextCodec {
    TextCodec::from_parts(
        mock_tokenizer::tokenizer_json().as_bytes(),
        Some(mock_tokenizer::tokenizer_config_json().as_bytes()),
        None,
    )
    .expect("mock tokenizer")
}

pub fn tokenizer() -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_bytes(mock_tokenizer::tokenizer_json().as_bytes())
        .expect("tokenizer")
}

pub struct Options {
    pub replicas: usize,
    pub engine: MockEngineConfig,
    pub server: ServerConfig,
    pub policy: Option<Box<dyn policy::Router>>,
    pub max_model_len: u32,
}

impl Default for Options {
    fn default() -> Self {
        let tok = tokenizer();
        let eos = tok.token_to_id(mock_tokenizer::EOS);
        Self {
            replicas: 1,
            engine: MockEngineConfig {
                units: mock_tokenizer::mock_units(&tok),
                vocab_size: tok.get_vocab_size(true) as u32,
                eos_token_id: eos,
                token_delay: Duration::from_millis(1),
                ..MockEngineConfig::default()
            },
            server: ServerConfig {
                port: 0,
                ..ServerConfig::default()
            },
            policy: None,
            max_model_len: 4096,
        }
    }
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub state: AppState,
    pub counters: Vec<Arc<MockCounters>>,
    pub engines: Vec<chimera::engine::api::EngineHandle>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<Result<(), chimera::server::ServeError>>>,
}

impl TestServer {
    pub async fn start(opts: Options) -> Self {
        let mut replicas = Vec::new();
        let mut counters = Vec::new();
        let mut engines = Vec::new();
        for _ in 0..opts.replicas {
            let mut cfg = opts.engine.clone();
            cfg.max_model_len = opts.max_model_len;
            let mut e = MockEngine::spawn(cfg).expect("mock engine");
            counters.push(e.counters.clone());
            engines.push(e.handle.clone());
            replicas.push(Replica {
                handle: e.handle.clone(),
                kv_events: e.kv_events.take(),
            });
        }
        let parts = AppParts {
            config: opts.server.clone(),
            model: ModelInfo {
                name: MODEL.into(),
                max_model_len: opts.max_model_len,
                block_size: opts.engine.block_size,
                cache_salt: opts.engine.cache_salt.clone(),
                num_blocks: opts.engine.total_blocks,
                prefix_caching: true,
            },
            codec: codec(),
            replicas,
            policy: opts.policy.unwrap_or_else(|| Box::new(LeastLoaded)),
            admin_hooks: None,
        };
        let state = AppState::new(parts).expect("state");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve_with_shutdown(state.clone(), listener, async move {
            let _ = rx.await;
        }));
        Self {
            addr,
            state,
            counters,
            engines,
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    pub fn shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    pub fn counter(&self, f: impl Fn(&MockCounters) -> u64) -> u64 {
        self.counters.iter().map(|c| f(c)).sum()
    }

    pub async fn metrics(&self) -> String {
        let r = request(self.addr, "GET", "/metrics", &[], b"").await;
        assert_eq!(r.status, 200);
        r.text()
    }

    /// Sum of a metric's samples whose line starts with `prefix` (name plus optional labels).
    pub async fn metric_sum(&self, prefix: &str) -> f64 {
        parse_metric(&self.metrics().await, prefix)
    }

    /// Polls until `running` and `waiting` are 0 on every replica and no request is in flight.
    pub async fn wait_idle(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            let m = self.metrics().await;
            let busy = parse_metric(&m, "chimera:num_requests_running")
                + parse_metric(&m, "chimera:num_requests_waiting")
                + parse_metric(&m, "chimera:server_requests_in_flight");
            if busy == 0.0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown();
        self.state.abort_in_flight();
    }
}

pub fn parse_metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with([' ', '{', ',', '}']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    /// The `data:` payloads of an SSE body, `[DONE]` excluded.
    pub fn sse(&self) -> Vec<Value> {
        let text = self.text();
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "stream not terminated: {text}"
        );
        text.split("\n\n")
            .filter_map(|ev| ev.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("bad SSE JSON {e}: {d}")))
            .collect()
    }
}

fn decode_chunked(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(pos) = body.windows(2).position(|w| w == b"\r\n") else {
            break;
        };
        let size_line = String::from_utf8_lossy(&body[..pos]);
        let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("0").trim(), 16)
            .unwrap_or(0);
        body = &body[pos + 2..];
        if size == 0 || body.len() < size {
            break;
        }
        out.extend_from_slice(&body[..size]);
        body = &body[(size + 2).min(body.len())..];
    }
    out
}

pub fn parse_response(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| {
            panic!(
                "no header end in response: {:?}",
                String::from_utf8_lossy(raw)
            )
        });
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
    {
        body = decode_chunked(&body);
    }
    Resp {
        status,
        headers,
        body,
    }
}

/// Sends raw bytes and reads until the server closes (blocking socket on the blocking pool, so
/// tests need no async I/O features).
pub async fn raw(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let bytes = bytes.to_vec();
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        // The server may answer (e.g. 413) and close before reading everything we send.
        let _ = s.write_all(&bytes);
        let mut out = Vec::new();
        let mut buf = [0u8; 16 * 1024];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
        out
    })
    .await
    .expect("client task")
}

pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    parse_response(&raw(addr, &request_bytes(method, path, headers, body)).await)
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    let b = serde_json::to_vec(body).expect("json");
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        &b,
    )
    .await
}

/// Opens a request, reads until `min_bytes` of response arrived, then hangs up.
pub async fn post_and_hang_up(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    min_bytes: usize,
) -> usize {
    let b = serde_json::to_vec(body).expect("json");
    let req = request_bytes("POST", path, &[("Content-Type", "application/json")], &b);
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(&req).expect("write");
        let mut got = 0;
        let mut buf = [0u8; 4096];
        while got < min_bytes {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        got
    })
    .await
    .expect("client task")
}

/// Sends a request and hangs up after `wait` without reading anything.
pub async fn post_and_leave(addr: SocketAddr, path: &str, body: &Value, wait: Duration) {
    let b = serde_json::to_vec(body).expect("json");
    let req = request_bytes("POST", path, &[("Content-Type", "application/json")], &b);
    let mut s = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.write_all(&req).expect("write");
        s
    })
    .await
    .expect("client task");
    tokio::time::sleep(wait).await;
    let _ = s.flush();
    drop(s);
}

/// Concatenated text of a completions or chat response (streamed or not).
pub fn texts(v: &Value) -> Vec<String> {
    let mut choices: Vec<&Value> = v["choices"].as_array().expect("choices").iter().collect();
    choices.sort_by_key(|c| c["index"].as_u64());
    choices
        .iter()
        .map(|c| {
            c["text"]
                .as_str()
                .or_else(|| c["message"]["content"].as_str())
                .unwrap_or("")
                .to_string()
        })
        .collect()
}

/// Joins a stream's chunks into per-choice (text, finish_reason).
pub fn join_stream(events: &[Value]) -> Vec<(String, Option<String>)> {
    let mut out: Vec<(String, Option<String>)> = Vec::new();
    for ev in events {
        for c in ev["choices"].as_array().expect("choices") {
            let i = c["index"].as_u64().expect("index") as usize;
            if out.len() <= i {
                out.resize(i + 1, (String::new(), None));
            }
            let t = c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str())
                .unwrap_or("");
            out[i].0.push_str(t);
            if let Some(f) = c["finish_reason"].as_str() {
                out[i].1 = Some(f.to_string());
            }
        }
    }
    out
}
