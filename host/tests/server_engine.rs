//! The server in front of the real engine: two replicas of a tiny hybrid fixture model
//! (NemotronH: Mamba2 + attention) on the CPU, with the fixture tokenizer and chat template.
//! Checks the contract end to end: streaming equals non-streaming, prefix-cache hits are
//! reported and routed to the replica holding the prefix (from the real cache's KvEvents), and
//! a client that hangs up stops generation early.

use crate::server_support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use chimera::backend::cpu::CpuBackend;
use chimera::cache::config::{ByteSize, CacheConfig};
use chimera::engine::api::EngineHandle;
use chimera::engine::{EngineConfig, EngineSetup, ModelRunner, Policies, spawn_engine};
use chimera::policy::native::least_loaded;
use chimera::policy::{Decision, ReplicaColumns, RouteRequest, Router};
use chimera::server::{
    AppParts, AppState, ModelInfo, Replica, ServerConfig, TextCodec, serve_with_shutdown,
};
use serde_json::json;
use server_support::*;

const SALT: &str = "nemotronh-a";
const BLOCK: u32 = 16;

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/nemotronh-a")
}

/// Deepest prefix hit wins; otherwise least-loaded.
struct PrefixAware;

impl Router for PrefixAware {
    fn route(&mut self, _r: &RouteRequest, cols: &ReplicaColumns) -> Decision<u32> {
        let best =
            (0..cols.len()).max_by_key(|&i| (cols.prefix_hit_blocks[i], std::cmp::Reverse(i)));
        match best {
            Some(i) if cols.prefix_hit_blocks[i] > 0 => Decision::Use(i as u32),
            _ => Decision::Use(least_loaded(cols) as u32),
        }
    }
}

struct Live {
    addr: std::net::SocketAddr,
    state: AppState,
    /// Per replica: the engine thread's handle (its stats are the engine's truth).
    engines: Vec<EngineHandle>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start() -> Live {
    let mut replicas = Vec::new();
    let mut engines = Vec::new();
    for _ in 0..2 {
        let m = chimera::model::load(&model_dir(), &CpuBackend::default()).expect("fixture model");
        let setup = EngineSetup {
            engine: EngineConfig {
                max_running: 8,
                ..EngineConfig::default()
            },
            cache: CacheConfig {
                memory_budget: Some(ByteSize(64 << 20)),
                block_size: BLOCK as usize,
                prefix_caching: true,
                ..CacheConfig::default()
            },
            hash_salt: SALT.into(),
            speculative: Default::default(),
        };
        let (handle, _join, kv) = spawn_engine(
            setup,
            ModelRunner::new(CpuBackend::default(), m),
            Policies::builtin(),
        )
        .expect("engine");
        engines.push(handle.clone());
        replicas.push(Replica {
            handle,
            kv_events: Some(kv),
        });
    }
    let parts = AppParts {
        config: ServerConfig {
            port: 0,
            ..ServerConfig::default()
        },
        model: ModelInfo {
            name: "nemotronh-a".into(),
            aliases: Vec::new(),
            max_model_len: 1024,
            block_size: BLOCK,
            cache_salt: SALT.into(),
            num_blocks: 0,
            prefix_caching: true,
            priority_scheduling: false,
        },
        codec: TextCodec::from_dir(&model_dir()).expect("tokenizer"),
        replicas,
        policy: Box::new(PrefixAware),
        admin_hooks: None,
        parsers: None,
        grammar_check: None,
    };
    let state = AppState::new(parts).expect("state");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with_shutdown(state.clone(), listener, async move {
        let _ = rx.await;
    }));
    Live {
        addr,
        state,
        engines,
        _stop: tx,
    }
}

async fn metric(addr: std::net::SocketAddr, prefix: &str) -> f64 {
    parse_metric(
        &request(addr, "GET", "/metrics", &[], b"").await.text(),
        prefix,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_engine_behind_the_server() {
    let s = start().await;
    // Streaming and non-streaming agree (greedy), for completions and chat.
    let body = json!({"prompt": "hello world, the cat", "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let full = post(s.addr, "/v1/completions", &body).await;
    assert_eq!(full.status, 200, "{}", full.text());
    let v = full.json();
    assert_eq!(v["usage"]["completion_tokens"], 24);
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let st = post(s.addr, "/v1/completions", &sb).await;
    assert_eq!(join_stream(&st.sse())[0].0, texts(&v)[0]);
    let chat = json!({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8, "temperature": 0});
    let c = post(s.addr, "/v1/chat/completions", &chat).await;
    assert_eq!(c.status, 200, "{}", c.text());
    let mut cs = chat.clone();
    cs["stream"] = json!(true);
    let cst = post(s.addr, "/v1/chat/completions", &cs).await;
    assert_eq!(join_stream(&cst.sse())[0].0, texts(&c.json())[0]);

    // A long shared prefix: the second request hits the cache on the replica that holds it.
    // Everything so far ran on replica 0 (idle replicas tie, ties go to replica 0), so the
    // prefix is placed on replica 1 while a long request keeps replica 0 busy; once both are
    // idle again, only the prefix can draw the second request to replica 1.
    let routed =
        |s: &Live| -> Vec<u64> { (0..2).map(|i| s.state.metrics().routed_count(i)).collect() };
    let busy = json!({"prompt": "count", "max_tokens": 900, "temperature": 0, "ignore_eos": true, "stream": true});
    let hold = post_and_hold(s.addr, "/v1/completions", &busy).await;
    wait_for("replica 0 to run", Duration::from_secs(10), async || {
        s.engines[0].stats().running == 1
    })
    .await;
    let before = routed(&s);
    let prefix = "the quick brown fox jumps over the lazy dog. ".repeat(8);
    let a = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": format!("{prefix}first"), "max_tokens": 2, "temperature": 0}),
    )
    .await
    .json();
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let prefix_tokens = a["usage"]["prompt_tokens"].as_u64().unwrap();
    let after_a = routed(&s);
    assert_eq!(
        (after_a[0] - before[0], after_a[1] - before[1]),
        (0, 1),
        "the first prefix request goes to the idle replica 1"
    );
    drop(hold);
    wait_for("both replicas idle", Duration::from_secs(10), async || {
        s.engines.iter().all(|e| e.stats().running == 0)
            && metric(s.addr, "chimera:server_requests_in_flight").await == 0.0
    })
    .await;
    wait_for(
        "the prefix in replica 1's cache",
        Duration::from_secs(5),
        async || u64::from(s.engines[1].stats().cached_blocks) >= prefix_tokens / u64::from(BLOCK),
    )
    .await;
    let b = post(
        s.addr,
        "/v1/completions",
        &json!({"prompt": format!("{prefix}second"), "max_tokens": 2, "temperature": 0}),
    )
    .await
    .json();
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= u64::from(BLOCK), "cached {cached}");
    let after_b = routed(&s);
    assert_eq!(
        (after_b[0] - after_a[0], after_b[1] - after_a[1]),
        (0, 1),
        "the second prefix request follows the prefix to replica 1"
    );

    // A client that hangs up stops generation early: far fewer than 900 tokens are generated.
    let gen_before = metric(s.addr, "chimera:generation_tokens_total").await;
    let left_before = metric(s.addr, "chimera:client_disconnects_total").await;
    let long = json!({"prompt": "count", "max_tokens": 900, "temperature": 0, "ignore_eos": true, "stream": true});
    post_and_hang_up(s.addr, "/v1/completions", &long, 300).await;
    wait_for(
        "the request to stop after the client left",
        Duration::from_secs(5),
        async || {
            metric(s.addr, "chimera:num_requests_running").await
                + metric(s.addr, "chimera:server_requests_in_flight").await
                == 0.0
        },
    )
    .await;
    let generated = metric(s.addr, "chimera:generation_tokens_total").await - gen_before;
    assert!(
        generated < 900.0,
        "generated {generated} tokens for a client that left"
    );
    assert_eq!(
        metric(s.addr, "chimera:client_disconnects_total").await - left_before,
        1.0
    );
}
