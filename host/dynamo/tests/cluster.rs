//! chimera workers behind a real Dynamo frontend: etcd, NATS, `python -m dynamo.frontend` and
//! N `chimera-dynamo` workers on this machine (the bench crate's `Cluster`), driven with the
//! official `openai` client (`tests/dynamo/drive.py`).
//!
//! Needs `etcd`, `nats-server` and a Python with `ai-dynamo` and `openai`
//! (`$CHIMERA_DYNAMO_PYTHON`, default `python3`). Without them the tests print `skipped:`;
//! under `CHIMERA_REQUIRE_DYNAMO=1` (CI) they fail instead.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chimera::bench::cluster::{Cluster, ClusterSpec};
use serde_json::Value;

/// One cluster at a time: they share the machine's two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn python() -> PathBuf {
    std::env::var_os("CHIMERA_DYNAMO_PYTHON").map_or_else(|| "python3".into(), PathBuf::from)
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Whether the cluster's parts are installed; `skipped:` (or a failure under
/// `CHIMERA_REQUIRE_DYNAMO=1`) when not.
fn available(test: &str) -> bool {
    let ok = |cmd: &mut Command| {
        cmd.stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let mut missing = Vec::new();
    if !ok(Command::new("etcd").arg("--version")) {
        missing.push("etcd");
    }
    if !ok(Command::new("nats-server").arg("--version")) {
        missing.push("nats-server");
    }
    if !ok(Command::new(python()).args(["-c", "import dynamo.frontend, openai"])) {
        missing.push("a Python with ai-dynamo and openai ($CHIMERA_DYNAMO_PYTHON)");
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!("{test}: missing {}", missing.join(", "));
    assert!(
        std::env::var_os("CHIMERA_REQUIRE_DYNAMO").is_none(),
        "CHIMERA_REQUIRE_DYNAMO is set but {msg}"
    );
    println!("skipped: {msg}");
    false
}

fn spec(workers: usize, router: &str, extra: &[&str]) -> ClusterSpec {
    let mut s = ClusterSpec::new(workers, router, env!("CARGO_BIN_EXE_chimera-dynamo"));
    s.python = python();
    s.worker_args = ["--model", "builtin:tiny-hybrid", "--replicas", "1"]
        .iter()
        .chain(extra)
        .map(|a| a.to_string())
        .collect();
    s
}

/// Runs `drive.py URL ARGS...` and returns its JSON.
fn drive(cluster: &Cluster, args: &[&str]) -> Value {
    let out = Command::new(python())
        .arg(repo().join("tests/dynamo/drive.py"))
        .arg(&cluster.url)
        .args(args)
        .output()
        .expect("running drive.py");
    assert!(
        out.status.success(),
        "drive.py {args:?} failed: {}\nfrontend log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        cluster.log("frontend")
    );
    serde_json::from_slice(&out.stdout).expect("drive.py prints JSON")
}

/// What a multi-turn run reused, summed over the workers' counters.
struct Reuse {
    /// Requests each worker finished.
    per_worker: Vec<f64>,
    reused: f64,
    prompt: f64,
    requests: f64,
    routed_on_overlap: f64,
    routed_without_state: f64,
}

fn multi_turn(cluster: &Cluster) -> Reuse {
    let r = drive(
        cluster,
        &[
            "multi-turn",
            "--conversations",
            "6",
            "--turns",
            "4",
            "--max-tokens",
            "16",
        ],
    );
    let errors = r["errors"].as_array().expect("errors");
    assert!(errors.is_empty(), "requests failed: {errors:?}");
    let turns: usize = r["conversations"]
        .as_array()
        .expect("conversations")
        .iter()
        .map(|c| c.as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(turns, 24, "every turn answered: {r}");
    let c = |name: &str| cluster.worker_counter(name);
    let per_worker = (0..cluster.worker_ports.len())
        .map(|i| {
            cluster.worker_metrics(i).map_or(0.0, |m| {
                chimera::bench::cluster::counter(&m, "chimera_dynamo_requests_total")
            })
        })
        .collect();
    Reuse {
        per_worker,
        reused: c("chimera_dynamo_reused_prompt_tokens_total"),
        prompt: c("chimera_dynamo_prompt_tokens_total"),
        requests: c("chimera_dynamo_requests_total"),
        routed_on_overlap: c("chimera_dynamo_routed_on_overlap_total"),
        routed_without_state: c("chimera_dynamo_routed_without_state_total"),
    }
}

/// The KV router's weighing of locality against load for this workload. Its cost for a worker
/// is the prompt blocks it would compute there (scaled by this) plus the blocks its running
/// requests hold. A follow-up turn here is ~28 blocks of prompt, ~25 of them cached on its
/// worker, and 1 block of answer: the prefill is what a turn costs. At the default scale 1, a
/// worker running two other turns' ~56 blocks looks dearer than recomputing ~25 blocks on an
/// idle one, so a burst of turns spreads over the workers and the KV router's share of one
/// worker's reuse varied 66–93 % over runs on this machine (docs/benchmarks.md). At 4 a turn
/// leaves its state only for a worker ~100 blocks (four running turns) less loaded.
const KV_ROUTER_ARGS: [&str; 2] = ["--router-prefill-load-scale", "4"];

/// Three workers on the embedded hybrid model: the KV router, fed chimera's events under the
/// hybrid rule, reuses at least 80 % of what one worker holding every conversation reuses;
/// round robin is measured in the same run for comparison; no turn is routed to a worker on
/// a KV match without the recurrent state. The conversations share no block with each other
/// (see `drive.py`): a prefix shared across conversations is announced wherever a snapshot
/// lies past it on some conversation's chain, and a new conversation sent there on that
/// match finds no state at the branch point until the engine snapshots it (docs/cluster.md).
#[test]
fn kv_router_reuses_what_one_worker_would_on_a_hybrid() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !available("kv_router_reuses_what_one_worker_would_on_a_hybrid") {
        return;
    }
    let single = {
        let c = Cluster::start(spec(1, "kv", &[])).expect("one-worker cluster");
        multi_turn(&c)
    };
    let kv = {
        let mut s = spec(3, "kv", &[]);
        s.frontend_args = KV_ROUTER_ARGS.iter().map(|a| a.to_string()).collect();
        let c = Cluster::start(s).expect("three workers, KV router");
        multi_turn(&c)
    };
    let rr = {
        let c = Cluster::start(spec(3, "round-robin", &[])).expect("three workers, round robin");
        multi_turn(&c)
    };
    let ratio = |r: &Reuse| r.reused / single.reused.max(1.0);
    println!(
        "reused prompt tokens: one worker {:.0} of {:.0}; KV router {:.0} of {:.0} ({:.1} %); \
         round robin {:.0} of {:.0} ({:.1} %)",
        single.reused,
        single.prompt,
        kv.reused,
        kv.prompt,
        100.0 * ratio(&kv),
        rr.reused,
        rr.prompt,
        100.0 * ratio(&rr),
    );
    println!(
        "KV router: {:.0} requests, {:.0} arrived where blocks of their prompt were announced, \
         {:.0} of those without the state; requests per worker: KV {:?}, round robin {:?}",
        kv.requests, kv.routed_on_overlap, kv.routed_without_state, kv.per_worker, rr.per_worker
    );
    assert_eq!(single.requests, 24.0);
    assert!(
        single.reused > 0.0,
        "one worker reuses the earlier turns (else the comparison says nothing)"
    );
    assert!(
        ratio(&kv) >= 0.8,
        "the KV router reused {:.1} % of one worker's reuse",
        100.0 * ratio(&kv)
    );
    assert!(
        kv.routed_on_overlap > 0.0,
        "the router matched announced blocks"
    );
    assert_eq!(
        kv.routed_without_state, 0.0,
        "a turn went where its KV blocks were announced but no recurrent state was"
    );
}

/// A worker killed mid-stream: its requests end (with an error, or finished elsewhere), none
/// hangs, the others finish; restarted, it registers again and serves.
#[test]
fn a_killed_worker_fails_its_requests_and_rejoins() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !available("a_killed_worker_fails_its_requests_and_rejoins") {
        return;
    }
    let mut cluster = Cluster::start(spec(3, "kv", &[])).expect("three workers");
    let mut child = Command::new(python())
        .arg(repo().join("tests/dynamo/drive.py"))
        .arg(&cluster.url)
        .args([
            "--timeout",
            "60",
            "stream",
            "--requests",
            "9",
            "--max-tokens",
            "3000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("drive.py stream");
    // Let every stream start, then kill worker 1.
    std::thread::sleep(Duration::from_secs(3));
    let killed_at = Instant::now();
    cluster.kill_worker(1);
    let deadline = Instant::now() + Duration::from_secs(150);
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for drive.py") {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "requests hung after the worker was killed"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = child.wait_with_output().expect("drive.py output");
    assert!(
        status.success(),
        "drive.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let reqs = r["requests"].as_array().expect("requests");
    let ok = reqs.iter().filter(|q| q["outcome"] == "ok").count();
    let failed = reqs.len() - ok;
    println!(
        "after killing a worker {:.1} s in: {ok} requests finished, {failed} ended with an error \
         ({:?})",
        killed_at.elapsed().as_secs_f64(),
        reqs.iter()
            .filter(|q| q["outcome"] == "error")
            .map(|q| q["error"].as_str().unwrap_or(""))
            .collect::<Vec<_>>()
    );
    assert_eq!(reqs.len(), 9);
    assert!(ok >= 1, "the other workers' requests finish: {r}");
    for q in reqs.iter().filter(|q| q["outcome"] == "ok") {
        assert!(
            q["finish_reason"] == "length",
            "a finished stream ran to max_tokens: {q}"
        );
    }
    // Back in: three instances again, and every new request is answered.
    cluster.restart_worker(1).expect("restart");
    cluster.wait_workers(3).expect("three instances again");
    let r = drive(
        &cluster,
        &["stream", "--requests", "6", "--max-tokens", "32"],
    );
    let reqs = r["requests"].as_array().expect("requests");
    assert!(
        reqs.iter().all(|q| q["outcome"] == "ok"),
        "after the restart every request is answered: {r}"
    );
    let served: f64 = (0..3)
        .filter_map(|i| cluster.worker_metrics(i).ok())
        .map(|m| chimera::bench::cluster::counter(&m, "chimera_dynamo_requests_total"))
        .sum();
    assert!(served >= 6.0, "{served}");
}
