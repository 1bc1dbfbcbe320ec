//! End to end with the real stack: `chimera::app` assembles the embedded tiny hybrid model,
//! real engine threads, the built-in Wasm policies and the HTTP server, exactly as
//! `chimera serve` does, on a loopback port.

use crate::plugins_support;
use crate::server_support;

use std::net::SocketAddr;
use std::time::Duration;

use chimera::config::Config;
use chimera::server::AppState;
use serde_json::{Value, json};
use server_support::{parse_metric, post, post_and_hang_up, request};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

struct Live {
    addr: SocketAddr,
    state: AppState,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Live {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.state.abort_in_flight();
    }
}

/// The default configuration with `n` replicas and a 32 MiB cache budget per replica (3014
/// blocks of the embedded model): each replica's cache is resident from the start, so the
/// default (at least 256 MiB) would cost a test with three replicas most of a gigabyte.
fn default_toml(n: usize) -> String {
    let default = chimera::config::DEFAULT_TOML;
    let budget = "memory_budget = \"auto\"";
    assert!(default.contains(budget), "the default budget moved");
    default
        .replace("replicas = 1", &format!("replicas = {n}"))
        .replace(budget, "memory_budget = \"32MiB\"")
}

/// Starts the default configuration (`default_toml`) with `n` replicas on a loopback port.
async fn start(n: usize) -> Live {
    start_with(&default_toml(n), n).await
}

/// `default_toml(n)` with the `[policy.*]` tables replaced by `policy` (TOML text).
fn config_with_policy(n: usize, policy: &str) -> String {
    let default = default_toml(n);
    let cut = default
        .find("[policy.router]")
        .expect("default has [policy.router]");
    let rest = &default[cut..];
    let plugins = rest.find("[plugins]").expect("default has [plugins]");
    format!("{}{policy}\n{}", &default[..cut], &rest[plugins..])
}

/// TOML string literal of a path.
fn toml_path(p: &std::path::Path) -> String {
    toml::Value::String(p.to_str().expect("utf-8 path").to_string()).to_string()
}

async fn start_with(text: &str, n: usize) -> Live {
    let config = Config::parse(text, "test").expect("config");
    assert_eq!(config.engine.replicas, n);
    let state = tokio::task::spawn_blocking(move || {
        chimera::app::build(&config)
            .expect("stack")
            .into_state()
            .expect("state")
    })
    .await
    .expect("build");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel::<()>();
    let s = state.clone();
    tokio::spawn(async move {
        let _ = chimera::server::serve_with_shutdown(s, listener, async {
            let _ = rx.await;
        })
        .await;
    });
    Live {
        addr,
        state,
        stop: Some(tx),
    }
}

async fn metrics(addr: SocketAddr) -> String {
    request(addr, "GET", "/metrics", &[], b"").await.text()
}

async fn wait_idle(addr: SocketAddr) -> String {
    for _ in 0..500 {
        let m = metrics(addr).await;
        if parse_metric(&m, "chimera:num_requests_running") == 0.0
            && parse_metric(&m, "chimera:num_requests_waiting") == 0.0
        {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the server did not become idle");
}

fn completion_text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().expect("text").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_and_plain_completions_agree_on_the_real_model() {
    let live = start(1).await;
    let body = json!({"model": "tiny-hybrid", "prompt": "def parse(line):", "max_tokens": 12, "temperature": 0});
    let plain = post(live.addr, "/v1/completions", &body).await;
    assert_eq!(plain.status, 200, "{}", plain.text());
    let plain = plain.json();
    assert_eq!(plain["usage"]["completion_tokens"], 12);
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let streamed = post(live.addr, "/v1/completions", &sbody).await;
    let joined: String = streamed
        .sse()
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(joined, completion_text(&plain));
    let chat = post(
        live.addr,
        "/v1/chat/completions",
        &json!({"model": "tiny-hybrid", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
    )
    .await;
    assert_eq!(chat.status, 200, "{}", chat.text());
    assert_eq!(chat.json()["usage"]["completion_tokens"], 5);
}

/// The sample of a per-engine gauge or counter for replica `engine`, whatever its other labels.
fn engine_metric(m: &str, name: &str, engine: usize) -> f64 {
    let label = format!("engine=\"{engine}\"");
    m.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Requests routed to each of `n` replicas so far.
fn routed(m: &str, n: usize) -> Vec<f64> {
    (0..n)
        .map(|e| parse_metric(m, &format!("chimera:router_requests_total{{engine=\"{e}\"")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefix_requests_reuse_the_replica_that_holds_the_prefix() {
    // Two replicas with the prefix-aware router (the default policy). Idle replicas tie, and
    // ties go to replica 0, so the prefix is first placed on replica 1: a long request keeps
    // replica 0 busy while the first shared-prefix request is routed.
    let live = start(2).await;
    let busy = json!({"model": "tiny-hybrid", "prompt": "busy", "max_tokens": 2000,
                      "ignore_eos": true, "stream": true});
    let hold = server_support::post_and_hold(live.addr, "/v1/completions", &busy).await;
    server_support::wait_for("replica 0 to run", Duration::from_secs(10), async || {
        let m = metrics(live.addr).await;
        engine_metric(&m, "chimera:num_requests_running", 0) == 1.0
    })
    .await;
    let shared = "import os\nimport sys\n".repeat(24);
    let ask = |i: usize| json!({"model": "tiny-hybrid", "prompt": format!("{shared}# question {i}\n"), "max_tokens": 2});
    let mut cached = Vec::new();
    let r = post(live.addr, "/v1/completions", &ask(0)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    cached.push(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].clone());
    // The client leaves; the long request is cancelled and both replicas are idle again.
    drop(hold);
    let m = wait_idle(live.addr).await;
    assert_eq!(
        routed(&m, 2),
        vec![1.0, 1.0],
        "the first shared-prefix request goes to the idle replica 1"
    );
    // Now both replicas are idle: only the prefix can draw the next requests to replica 1.
    for i in 1..6 {
        let r = post(live.addr, "/v1/completions", &ask(i)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        cached.push(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].clone());
    }
    assert_eq!(cached[0], 0);
    assert!(
        cached[1..].iter().all(|c| c.as_u64().unwrap_or(0) >= 16),
        "later requests should hit the prefix cache on the replica that holds it: {cached:?}"
    );
    let m = wait_idle(live.addr).await;
    assert_eq!(
        routed(&m, 2),
        vec![1.0, 6.0],
        "every shared-prefix request follows the prefix to replica 1; cached tokens {cached:?}"
    );
}

/// Every metric family and sample on `/metrics` carries the `chimera:` prefix, each family is
/// declared once, and after traffic each plugin kind's call-latency series has observations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_is_prefixed_and_every_plugin_kind_is_timed() {
    let live = start(1).await;
    for i in 0..3 {
        // Long enough to fill blocks, so the evictor plugin is sent cache events.
        let body = json!({"model": "tiny-hybrid", "prompt": format!("{i}: {}", "let x = 1;\n".repeat(12)), "max_tokens": 4});
        let r = post(live.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let m = wait_idle(live.addr).await;
    for kind in ["router", "evictor", "sampler"] {
        let timed = m
            .lines()
            .filter(|l| {
                l.starts_with("chimera:plugin_call_latency_seconds_count{")
                    && l.contains(&format!("kind=\"{kind}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
        assert!(timed > 0.0, "no {kind} plugin call timed:\n{m}");
    }
    // Every step of the CPU model runner is eager (no device graphs), and each is counted.
    let kind = |k: &str| {
        m.lines()
            .filter(|l| {
                l.starts_with("chimera:engine_steps_by_kind_total{")
                    && l.contains(&format!("kind=\"{k}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let steps = parse_metric(&m, "chimera:engine_steps_total");
    assert!(steps > 0.0, "no engine step counted:\n{m}");
    assert_eq!(
        (kind("eager"), kind("decode_graph"), kind("mixed_graph")),
        (steps, 0.0, 0.0),
        "steps by kind against {steps} engine steps"
    );
    let mut families = std::collections::BTreeMap::new();
    for line in m.lines().filter(|l| !l.is_empty()) {
        let name = match line.strip_prefix("# ") {
            Some(meta) => {
                let mut words = meta.split(' ');
                let what = words.next().unwrap_or_default();
                let name = words.next().unwrap_or_default();
                if what == "TYPE" {
                    *families.entry(name.to_string()).or_insert(0) += 1;
                }
                name
            }
            None => line.split(['{', ' ']).next().unwrap_or_default(),
        };
        assert!(
            name.starts_with("chimera:"),
            "metric without the chimera: prefix: {line}"
        );
    }
    let twice: Vec<_> = families.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "metric families declared twice: {twice:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_frees_its_blocks() {
    let live = start(1).await;
    let body = json!({"model": "tiny-hybrid", "prompt": "x = 1\n".repeat(40), "max_tokens": 2000, "stream": true});
    let got = post_and_hang_up(live.addr, "/v1/completions", &body, 200).await;
    assert!(got >= 200, "the stream never started");
    let m = wait_idle(live.addr).await;
    assert_eq!(
        parse_metric(&m, "chimera:kv_cache_usage_perc"),
        0.0,
        "blocks still in use:\n{m}"
    );
    let generated = parse_metric(&m, "chimera:generation_tokens_total");
    assert!(
        generated < 2000.0,
        "the request ran to the end instead of being cancelled ({generated} tokens)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_plugin_built_outside_the_workspace_pins_every_request_from_toml() {
    let Some(test_plugins) = plugins_support::test_plugins_dir() else {
        return;
    };
    let pin = test_plugins.join("pin_router.wasm");
    let policy = format!(
        "[policy.router]\nplugin = {}\nconfig = {{ replica = 2 }}\n",
        toml_path(&pin)
    );
    let live = start_with(&config_with_policy(3, &policy), 3).await;
    for i in 0..6 {
        let body = json!({"model": "tiny-hybrid", "prompt": format!("request {i}: {}", "ab ".repeat(i * 7)), "max_tokens": 2});
        let r = post(live.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let m = wait_idle(live.addr).await;
    assert_eq!(
        routed(&m, 3),
        vec![0.0, 0.0, 6.0],
        "all traffic pinned to replica 2"
    );
}

/// `POST /admin/reload_plugins` as an operator meets it: a reload that cannot work answers 400
/// with the reason (unknown kind, a file that is not Wasm, a config the new plugin rejects, a
/// built-in policy), logs it, and leaves the running plugin serving; a good one answers 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_plugin_reload_answers_400_with_the_reason_and_logs_it() {
    let Some(test_plugins) = plugins_support::test_plugins_dir() else {
        return;
    };
    server_support::captured_logs();
    let dir = std::env::temp_dir().join(format!("chimera-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("router.wasm");
    let misbehave = test_plugins.join("misbehave_router.wasm");
    std::fs::copy(&misbehave, &file).expect("copy plugin");
    let policy = format!(
        "[policy.router]\nplugin = {}\nconfig = {{ replica = 1, reject = false }}\n",
        toml_path(&file)
    );
    let text = config_with_policy(2, &policy).replace(
        "# admin_token = \"change-me-please\"",
        "admin_token = \"reload-token\"",
    );
    let live = start_with(&text, 2).await;
    let reload = async |query: &str| {
        let path = format!("/admin/reload_plugins{query}");
        let auth = [("Authorization", "Bearer reload-token")];
        request(live.addr, "POST", &path, &auth, b"").await
    };
    let ok = reload("").await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert!(
        ok.json()["summary"]
            .as_str()
            .unwrap_or_default()
            .contains("router")
    );

    let unknown = reload("?kind=scheduler").await;
    assert_eq!(unknown.status, 400, "{}", unknown.text());
    let msg = unknown.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(msg.contains("unknown plugin kind `scheduler`"), "{msg}");

    let builtin = reload("?kind=sampler").await;
    assert_eq!(builtin.status, 400, "{}", builtin.text());
    assert!(
        builtin.text().contains("builtin:default"),
        "{}",
        builtin.text()
    );

    std::fs::write(&file, b"not wasm at all").expect("overwrite");
    let garbage = reload("?kind=router").await;
    assert_eq!(garbage.status, 400, "{}", garbage.text());
    let msg = garbage.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        msg.contains("not a WebAssembly module or component"),
        "{msg}"
    );
    assert!(
        server_support::captured_logs().contains("plugin reload failed"),
        "the failure is not logged"
    );

    // The pin router takes only `replica`: the configured `reject` key is refused.
    std::fs::copy(test_plugins.join("pin_router.wasm"), &file).expect("copy plugin");
    let rejected = reload("").await;
    assert_eq!(rejected.status, 400, "{}", rejected.text());
    assert!(
        rejected.text().contains("rejected its config"),
        "{}",
        rejected.text()
    );

    // The running router still answers: every request goes to replica 1.
    for i in 0..3 {
        let body =
            json!({"model": "tiny-hybrid", "prompt": format!("after reload {i}"), "max_tokens": 2});
        let r = post(live.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let m = wait_idle(live.addr).await;
    assert_eq!(
        parse_metric(&m, "chimera:router_requests_total{engine=\"1\""),
        3.0,
        "{m}"
    );
    std::fs::copy(&misbehave, &file).expect("copy plugin");
    let again = reload("?kind=router").await;
    assert_eq!(again.status, 200, "{}", again.text());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Completions of `cases` (prompt, seed, user; seeded sampling) from a server, in order,
/// `pause` apart.
async fn sampled_texts(
    addr: SocketAddr,
    cases: &[(&str, u64, &str)],
    pause: Duration,
) -> Vec<String> {
    let mut out = Vec::new();
    for (prompt, seed, user) in cases {
        tokio::time::sleep(pause).await;
        let body = json!({"model": "tiny-hybrid", "prompt": prompt, "max_tokens": 8,
                          "temperature": 0.9, "seed": seed, "user": user});
        let r = post(addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        out.push(completion_text(&r.json()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_plugins_in_the_server_change_no_output() {
    let Some(test_plugins) = plugins_support::test_plugins_dir() else {
        return;
    };
    let dir = test_plugins;
    // The sampler traps on seed 13 and answers nonsense on 14 and 15; the router traps, loops
    // forever or allocates without end for users "trap", "loop" and "bomb".
    let policy = format!(
        "[policy.router]\nplugin = {}\nconfig = {{ replica = 1 }}\n\n[policy.sampler]\nplugin = {}\n",
        toml_path(&dir.join("misbehave_router.wasm")),
        toml_path(&dir.join("misbehave_sampler.wasm")),
    );
    // Each bad request fails every step, so its plugin gets quarantined (100 ms); the pause
    // lets that end, and the good request in between resets the doubling, so every kind of
    // failure is met by a live plugin.
    let cases = [
        ("def parse(line):", 7, "good"),
        ("def parse(line):", 13, "trap"),
        ("x = [", 7, "good"),
        ("import os\n", 14, "loop"),
        ("for i in", 21, "good"),
        ("class A:", 15, "bomb"),
        ("x = [", 8, "good"),
    ];
    let pause = Duration::from_millis(300);
    // A small memory limit and a roomy deadline, so the allocating plugin meets the limit
    // before the deadline even on a slow machine.
    let text = config_with_policy(2, &policy)
        .replace("deadline_ms = 20", "deadline_ms = 100")
        .replace("memory_bytes = 67108864", "memory_bytes = 8388608");
    assert!(text.contains("memory_bytes = 8388608"));
    let bad = start_with(&text, 2).await;
    let got = sampled_texts(bad.addr, &cases, pause).await;
    let m = wait_idle(bad.addr).await;
    drop(bad);
    // The same requests against the native twins.
    let native = "[policy.router]\nplugin = \"native:prefix-aware\"\n\n[policy.sampler]\nplugin = \"native:default\"\n";
    let reference = start_with(&config_with_policy(2, native), 2).await;
    let want = sampled_texts(reference.addr, &cases, Duration::ZERO).await;
    assert_eq!(
        got, want,
        "fallbacks must answer exactly as the native defaults"
    );
    for reason in ["trap", "timeout", "memory", "invalid"] {
        let n: f64 = m
            .lines()
            .filter(|l| {
                l.starts_with("chimera:plugin_fallbacks_total")
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert!(n >= 1.0, "no {reason} fallback counted:\n{m}");
    }
}

/// `chimera serve` as a user runs it: the real binary, its stderr piped (not a terminal).
struct Binary {
    child: std::process::Child,
    addr: SocketAddr,
    /// stderr lines read so far (more arrive on `lines`).
    log: Vec<String>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Binary {
    /// Starts `chimera serve --port 0 <args>` and waits for the line that names its address.
    fn start(args: &[&str]) -> Binary {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_chimera"))
            .args(["serve", "--port", "0"])
            .args(args)
            .env_remove("RUST_LOG")
            .env_remove("NO_COLOR")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn chimera");
        let stderr = child.stderr.take();
        let (tx, lines) = std::sync::mpsc::channel();
        // Owned by `b` from here on: its drop kills and reaps the process on every path.
        let mut b = Binary {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            log: Vec::new(),
            lines,
        };
        let stderr = stderr.expect("stderr");
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        loop {
            let line = b
                .lines
                .recv_timeout(Duration::from_secs(120))
                .unwrap_or_else(|e| panic!("no address line ({e}); log so far: {:#?}", b.log));
            b.log.push(line.clone());
            if let Some(at) = line.find("on http://") {
                b.addr = line[at + "on http://".len()..]
                    .split([' ', '"'])
                    .next()
                    .expect("address")
                    .parse()
                    .expect("socket address");
                return b;
            }
        }
    }

    /// Every stderr line so far.
    fn log(&mut self) -> &[String] {
        self.log.extend(self.lines.try_iter());
        &self.log
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The README's first command, as a new user meets it: the log has no colour codes when
/// stderr is not a terminal; the model id the log prints is the API's id, and the short
/// name works too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_logs_plain_text_and_serves_the_model_under_the_printed_name() {
    let mut b = Binary::start(&[]);
    assert!(
        b.log()
            .iter()
            .any(|l| l.contains("serving builtin:tiny-hybrid on http://")),
        "{:#?}",
        b.log()
    );
    let models = request(b.addr, "GET", "/v1/models", &[], b"").await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, ["builtin:tiny-hybrid"], "one model, listed once");
    for name in ["builtin:tiny-hybrid", "tiny-hybrid"] {
        let body = json!({"model": name, "prompt": "hi", "max_tokens": 2});
        let r = post(b.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{name}: {}", r.text());
        assert_eq!(r.json()["model"], "builtin:tiny-hybrid");
    }
    let log = b.log().join("\n");
    assert!(
        !log.contains('\u{1b}'),
        "ANSI escape codes in a piped log:\n{log}"
    );
    assert!(log.contains(" INFO "), "{log}");
    // Compiling the plugins' Wasm says nothing at the default level.
    assert!(
        !log.contains("cranelift") && !log.contains("wasmtime"),
        "{log}"
    );
}

/// `--log-format json` writes one JSON object per line; `--served-model-name` and `--api-key`
/// reach the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_writes_json_logs_and_takes_names_and_an_api_key() {
    let mut b = Binary::start(&[
        "--log-format",
        "json",
        "--served-model-name",
        "org/tiny",
        "tiny",
        "--api-key",
        "sk-e2e-key",
    ]);
    let r = request(b.addr, "GET", "/v1/models", &[], b"").await;
    assert_eq!(r.status, 401, "{}", r.text());
    let auth = [("Authorization", "Bearer sk-e2e-key")];
    let models = request(b.addr, "GET", "/v1/models", &auth, b"")
        .await
        .json();
    assert_eq!(models["data"][0]["id"], "org/tiny");
    assert_eq!(models["data"][1]["id"], "tiny");
    assert_eq!(models["data"].as_array().expect("data").len(), 2);
    let lines = b.log().to_vec();
    assert!(lines.len() >= 2, "{lines:#?}");
    for line in &lines {
        let v: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["timestamp"].is_string(), "{line}");
        assert!(v["level"].is_string(), "{line}");
        assert!(v["target"].is_string(), "{line}");
        assert!(v["message"].is_string(), "{line}");
    }
    assert!(
        lines.iter().any(|l| l.contains("\"replica\":0")),
        "fields are JSON fields: {lines:#?}"
    );
}

/// A `--model` that names no folder fails at start with a message that says so.
#[test]
fn a_wrong_model_path_is_named_at_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_chimera"))
        .args(["serve", "--port", "0", "--model", "/no/such/model-folder"])
        .output()
        .expect("run chimera");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("model.path = \"/no/such/model-folder\": the folder does not exist"),
        "{err}"
    );
}

/// The cache must hold one sequence of the longest context: a budget too small for the model's
/// 4096 tokens is a startup error that names both numbers and the flags to change; with
/// `max_model_len` lowered to what it holds the server starts, says so in `/v1/models`, and a
/// request longer than that is refused at once, streamed or not, before any token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_too_small_for_the_context_is_a_startup_error_naming_both_numbers() {
    let small = default_toml(1).replace("memory_budget = \"32MiB\"", "memory_budget = \"4MiB\"");
    let config = Config::parse(&small, "test").expect("config");
    let err = tokio::task::spawn_blocking(move || chimera::app::build(&config).err())
        .await
        .expect("build task")
        .expect("a 4MiB cache cannot hold 4096 tokens")
        .to_string();
    assert!(
        err.contains("the longest context, 4096 tokens (model.max_model_len, the model's max_position_embeddings), does not fit in the KV cache, which holds"),
        "{err}"
    );
    assert!(err.contains("set --max-model-len"), "{err}");
    let holds: u32 = err
        .split("which holds ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no token count in {err}"));
    assert!(holds > 16 && holds < 4096, "{err}");

    let fits = small.replace("[model]\n", &format!("[model]\nmax_model_len = {holds}\n"));
    let b = start_with(&fits, 1).await;
    let models = request(b.addr, "GET", "/v1/models", &[], b"").await.json();
    assert_eq!(models["data"][0]["max_model_len"], holds);
    for stream in [false, true] {
        let body = json!({"prompt": "hi", "max_tokens": holds, "stream": stream});
        let r = post(b.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 400, "stream {stream}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    }
    let body = json!({"prompt": "hi", "max_tokens": 4});
    assert_eq!(post(b.addr, "/v1/completions", &body).await.status, 200);
}
