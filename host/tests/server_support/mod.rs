//! Shared helpers for the server integration tests: a server on a loopback port in front of
//! real engine threads over the model-free `MockExecutor`, a recorder between the server and
//! each engine (what the engine was sent), and a small raw HTTP/1.1 client (raw so tests can
//! send malformed requests and hang up mid-response).

#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chimera::cache::{ByteSize, CacheConfig};
use chimera::engine::api::{Command, EngineEvent, EngineHandle, EngineStats, GenerateRequest};
use chimera::engine::speculative::SpeculativeConfig;
use chimera::engine::{
    Engine, EngineConfig, EngineSetup, MockConfig, MockExecutor, Policies, StepExecutor,
    spawn_engine,
};
use chimera::policy;
use chimera::policy::native::DefaultSampler;
use chimera::server::{
    AppParts, AppState, ModelInfo, Replica, ServerConfig, TextCodec, mock_tokenizer,
    serve_with_shutdown,
};
use serde_json::Value;
use std::io::{Read, Write};

use tokio::net::TcpListener;

pub const MODEL: &str = "tiny-mock";
/// Salt of the server's and the engines' block hashes.
pub const SALT: &str = "tiny-mock-salt";

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
    /// The executor of every replica. By default: the tokenizer's vocabulary and EOS, output
    /// in whole words and characters (`mock_units`), EOS never, 1 ms per step.
    pub mock: MockConfig,
    /// Batching limits of every replica.
    pub engine: EngineConfig,
    pub block_size: usize,
    /// KV blocks per replica.
    pub blocks: usize,
    /// Durable SSM snapshot slots per replica (hybrid executors only).
    pub snapshots: usize,
    pub server: ServerConfig,
    pub policy: Option<Box<dyn policy::Router>>,
    pub max_model_len: u32,
    /// Other ids the model answers to (`ModelInfo::aliases`).
    pub aliases: Vec<String>,
    /// `[speculative]` of every replica (a hybrid gets its draft slots on top of the rest).
    pub speculative: SpeculativeConfig,
}

impl Default for Options {
    fn default() -> Self {
        let tok = tokenizer();
        let eos = tok.token_to_id(mock_tokenizer::EOS).expect("EOS id");
        Self {
            replicas: 1,
            mock: MockConfig {
                vocab: tok.get_vocab_size(true),
                eos: vec![eos],
                units: mock_tokenizer::mock_units(&tok),
                step_delay: Duration::from_millis(1),
                ..MockConfig::default()
            },
            engine: EngineConfig {
                max_running: 64,
                max_waiting: 256,
                ..EngineConfig::default()
            },
            block_size: 4,
            blocks: 1024,
            snapshots: 64,
            server: ServerConfig {
                port: 0,
                ..ServerConfig::default()
            },
            policy: None,
            max_model_len: 4096,
            aliases: Vec::new(),
            speculative: SpeculativeConfig::default(),
        }
    }
}

impl Options {
    /// The setup of one replica: a memory budget giving exactly `blocks` KV blocks (and, for a
    /// hybrid executor, `max_running` live plus `snapshots` durable SSM slots).
    pub fn setup(&self) -> EngineSetup {
        let spec = MockExecutor::new(self.mock.clone()).cache_spec();
        let kv = (spec.kv_block_bytes(self.block_size) * self.blocks) as u64;
        let (ssm, share) = if spec.is_hybrid() {
            let slot = spec.ssm_slot_bytes() as u64;
            let drafts = self.speculative.draft_slots(self.engine.max_running);
            let ssm = (self.engine.max_running + drafts + self.snapshots) as u64 * slot;
            // Half a slot of slack so the share's rounding lands on exactly that many slots.
            let share = (ssm as f64 + slot as f64 / 2.0) / (kv + ssm) as f64;
            (ssm, Some(share))
        } else {
            (0, None)
        };
        EngineSetup {
            engine: self.engine.clone(),
            cache: CacheConfig {
                memory_budget: Some(ByteSize(kv + ssm)),
                block_size: self.block_size,
                prefix_caching: true,
                ssm_share: share,
                ..CacheConfig::default()
            },
            hash_salt: SALT.into(),
            speculative: self.speculative.clone(),
        }
    }

    /// The replicas' policies: the built-in sampler (seeded temperature sampling, as the binary
    /// configures it), native LRU eviction.
    pub fn policies() -> Policies {
        Policies {
            sampler: Box::new(DefaultSampler::default()),
            fallback_sampler: Box::new(DefaultSampler::default()),
            evictor: None,
            constrainer: None,
            drafter: None,
        }
    }

    /// Runs `request` alone on a fresh engine of this setup (no thread, no server) and returns
    /// its events: what the server's replicas must produce for it.
    pub fn run_direct(&self, request: GenerateRequest) -> Vec<EngineEvent> {
        let exec = MockExecutor::new(self.mock.clone());
        let mut e = Engine::new(self.setup(), exec, Self::policies()).expect("engine");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        e.add(request, tx);
        while !e.is_idle() {
            e.step();
        }
        let mut out = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            out.push(ev);
        }
        out
    }
}

/// What one replica was sent, recorded on the way from the server to its engine thread.
#[derive(Debug, Default)]
pub struct Recorder {
    /// `Add` commands (requests submitted).
    pub added: AtomicU64,
    /// Cancels sent (by request guards, stop strings and shutdown).
    pub cancels: AtomicU64,
    /// `ResetPrefixCache` commands.
    pub resets: AtomicU64,
    recent: Mutex<VecDeque<GenerateRequest>>,
}

impl Recorder {
    pub fn get(&self, c: &AtomicU64) -> u64 {
        c.load(Ordering::SeqCst)
    }

    /// The most recent requests (up to 64), oldest first.
    pub fn recent_requests(&self) -> Vec<GenerateRequest> {
        self.recent
            .lock()
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn record(&self, cmd: &Command) {
        match cmd {
            Command::Add { request, .. } => {
                self.added.fetch_add(1, Ordering::SeqCst);
                if let Ok(mut r) = self.recent.lock() {
                    r.push_back((**request).clone());
                    while r.len() > 64 {
                        r.pop_front();
                    }
                }
            }
            Command::ResetPrefixCache => {
                self.resets.fetch_add(1, Ordering::SeqCst);
            }
            Command::Cancel { .. } | Command::Shutdown => {}
        }
    }
}

/// A handle to `engine` whose commands and cancels pass through a recording thread. That thread
/// keeps the engine thread's ordering guarantee (a cancel sent after its request's `Add` is
/// never applied before it): each round it collects the pending cancels, then forwards every
/// queued command, then those cancels. Its queue has the engine's capacity.
fn recorded(engine: EngineHandle, capacity: usize) -> (EngineHandle, Arc<Recorder>) {
    let (cmd_tx, cmd_rx) = mpsc::sync_channel::<Command>(capacity.max(1));
    let (cancel_tx, cancel_rx) = mpsc::channel::<u64>();
    let rec = Arc::new(Recorder::default());
    let handle = EngineHandle::new(cmd_tx, cancel_tx, engine.stats_watch());
    let r = rec.clone();
    std::thread::Builder::new()
        .name("engine-recorder".into())
        .spawn(move || {
            loop {
                let first = match cmd_rx.recv_timeout(Duration::from_millis(1)) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => break,
                };
                let cancels: Vec<u64> = cancel_rx.try_iter().collect();
                for cmd in first.into_iter().chain(cmd_rx.try_iter()) {
                    r.record(&cmd);
                    if engine.control(cmd).is_err() {
                        return;
                    }
                }
                for id in cancels {
                    r.cancels.fetch_add(1, Ordering::SeqCst);
                    engine.cancel(id);
                }
            }
            for id in cancel_rx.try_iter() {
                r.cancels.fetch_add(1, Ordering::SeqCst);
                engine.cancel(id);
            }
        })
        .expect("recorder thread");
    (handle, rec)
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub state: AppState,
    /// Per replica: what it was sent.
    pub recorders: Vec<Arc<Recorder>>,
    /// Per replica: the engine thread's own handle (its stats are the engine's truth).
    pub engines: Vec<EngineHandle>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<Result<(), chimera::server::ServeError>>>,
}

impl TestServer {
    pub async fn start(opts: Options) -> Self {
        let mut replicas = Vec::new();
        let mut recorders = Vec::new();
        let mut engines = Vec::new();
        let setup = opts.setup();
        let mut num_blocks = 0;
        for _ in 0..opts.replicas {
            let exec = MockExecutor::new(opts.mock.clone());
            let (handle, _join, kv) =
                spawn_engine(setup.clone(), exec, Options::policies()).expect("engine");
            num_blocks = handle.stats().total_blocks;
            let (front, rec) = recorded(handle.clone(), opts.engine.max_waiting);
            recorders.push(rec);
            engines.push(handle);
            replicas.push(Replica {
                handle: front,
                kv_events: Some(kv),
            });
        }
        let parts = AppParts {
            config: opts.server.clone(),
            model: ModelInfo {
                name: MODEL.into(),
                aliases: opts.aliases.clone(),
                max_model_len: opts.max_model_len,
                block_size: opts.block_size as u32,
                cache_salt: SALT.into(),
                num_blocks,
                prefix_caching: true,
                priority_scheduling: opts.engine.scheduling_policy == "priority",
            },
            codec: codec(),
            replicas,
            policy: opts
                .policy
                .unwrap_or_else(|| Box::new(chimera::policy::native::LeastLoadedRouter)),
            admin_hooks: None,
            parsers: None,
            grammar_check: None,
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
            recorders,
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

    /// Sum over replicas of a recorder count.
    pub fn counter(&self, f: impl Fn(&Recorder) -> u64) -> u64 {
        self.recorders.iter().map(|c| f(c)).sum()
    }

    /// Sum over replicas of an engine statistic.
    pub fn engine_sum(&self, f: impl Fn(&EngineStats) -> u64) -> u64 {
        self.engines.iter().map(|e| f(&e.stats())).sum()
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
    ///
    /// These gauges can all read 0 while a cancel is still on its way to its engine: the
    /// server's in-flight count drops as a request guard sends its cancel, and an engine
    /// publishes its gauges only after a step, so a request it was just sent is not yet
    /// counted. A test that then counts cancels or ended requests first waits for those
    /// counts.
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

/// Polls `f` every 10 ms until it holds; panics after `within`.
pub async fn wait_for(what: &str, within: Duration, f: impl AsyncFnMut() -> bool) {
    if !eventually(within, f).await {
        panic!("timed out waiting for {what}");
    }
}

/// Polls `f` every 10 ms until it holds (true) or `within` has passed (false), for a caller
/// that reports what is missing by its own assertions.
pub async fn eventually(within: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
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
    while let Some(pos) = body.windows(2).position(|w| w == b"\r\n") {
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

/// Sends the streaming request `body` to `path` `n` times, one after another, over one
/// keep-alive TCP connection with the client's default socket options (Nagle and delayed ACKs
/// on, as most clients leave them), and returns each request's time from sending it to the
/// first `data:` event.
pub async fn stream_ttfts_on_one_connection(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    n: usize,
) -> Vec<Duration> {
    let b = serde_json::to_vec(body).expect("json");
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        b.len()
    )
    .into_bytes();
    req.extend_from_slice(&b);
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let mut out = Vec::with_capacity(n);
        let mut buf = [0u8; 16 * 1024];
        for _ in 0..n {
            let sent = Instant::now();
            s.write_all(&req).expect("write");
            let mut got: Vec<u8> = Vec::new();
            let mut first = None;
            // The chunked body ends with the zero-size chunk after `data: [DONE]`.
            while !(contains(&got, b"data: [DONE]") && got.ends_with(b"0\r\n\r\n")) {
                let k = s.read(&mut buf).expect("read");
                assert!(k > 0, "the server closed the connection");
                got.extend_from_slice(&buf[..k]);
                if first.is_none() && contains(&got, b"data: {") {
                    first = Some(sent.elapsed());
                }
            }
            out.push(first.expect("a data event"));
        }
        out
    })
    .await
    .expect("client task")
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Log lines of this test binary: a global subscriber (installed on first use) that keeps
/// `chimera` events at debug level in memory, so tests can check what the server logs.
pub fn captured_logs() -> String {
    static LOGS: std::sync::OnceLock<Arc<Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    let buf = LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = LogSink(buf.clone());
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("chimera=debug"))
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
        buf
    });
    String::from_utf8_lossy(&buf.lock().expect("log buffer")).into_owned()
}

#[derive(Clone)]
struct LogSink(Arc<Mutex<Vec<u8>>>);

impl Write for LogSink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut v) = self.0.lock() {
            v.extend_from_slice(b);
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sends a request and returns its open connection unread: the request runs until the caller
/// drops the stream (the server then cancels it) or it finishes.
pub async fn post_and_hold(addr: SocketAddr, path: &str, body: &Value) -> std::net::TcpStream {
    let b = serde_json::to_vec(body).expect("json");
    let req = request_bytes("POST", path, &[("Content-Type", "application/json")], &b);
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.write_all(&req).expect("write");
        s
    })
    .await
    .expect("client task")
}
