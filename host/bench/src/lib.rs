//! `chimera bench`: a load generator for chimera or any OpenAI-compatible streaming server.
//!
//! Owns [`run`],
//! which sends the workload at each load point of a sweep and returns (and optionally writes)
//! a [`BenchReport`]. The parts:
//!
//! - [`workload`]: shared-prefix groups, random lengths, multi-turn conversations, or a
//!   prompts file, built reproducibly from a seed;
//! - [`tokens`]: prompt text of an exact token length for the served model's tokenizer;
//! - [`arrivals`]: closed-loop clients or gamma/Poisson arrivals, and the stop bounds;
//! - [`client`] and [`sse`]: one streamed request, timed per chunk;
//! - [`runner`]: the dispatch loops of one load point;
//! - [`stats`]: per-request records, percentiles and the point summary;
//! - [`report`]: JSON (schema in `docs/bench-schema.md`), tables and the sweep plot;
//! - [`cluster`]: a Dynamo cluster on one machine (etcd, NATS, frontend, chimera workers) to
//!   drive (`--dynamo-workers`).
//!
//! Invariants: the same arguments and seed send the same prompts in the same order with the
//! same arrival offsets; every request sent is in the statistics, failed ones as failures.
//! Must not depend on the rest of chimera: it talks to servers only over HTTP.

mod args;
pub mod arrivals;
pub mod client;
pub mod cluster;
pub mod report;
pub mod rng;
mod runner;
pub mod sse;
pub mod stats;
pub mod tokens;
pub mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

pub use args::{BenchArgs, SweepPrompts, WorkloadKind};
pub use arrivals::{Bounds, LoadPoint, Rate};
pub use client::{Endpoint, PromptFormat};
pub use report::{BenchReport, PointReport};
pub use stats::{PointSummary, RequestRecord};
pub use workload::LenRange;

use client::{HttpClient, RequestOptions};
use report::{RunInfo, SCHEMA, ServerInfo};
use runner::PointContext;
use tokens::PromptTokenizer;

/// Mixed into the seed of warm-up prompts so they differ from every measured point's.
const WARMUP_SEED: u64 = 0x5741_524D_5550;

/// Where the benchmark looks for a tokenizer when `--tokenizer` is not given.
pub const DEFAULT_TOKENIZER: &str = "host/assets/tokenizer/tokenizer.json";

/// Errors of the benchmark; each has a stable kind string.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid argument: {0}")]
    InvalidArg(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("workload: {0}")]
    Workload(String),
    #[error("server: {0}")]
    Server(String),
    #[error("report: {0}")]
    Report(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl BenchError {
    pub fn kind(&self) -> &'static str {
        match self {
            BenchError::InvalidArg(_) => "invalid_arg",
            BenchError::Tokenizer(_) => "tokenizer",
            BenchError::Workload(_) => "workload",
            BenchError::Server(_) => "server",
            BenchError::Report(_) => "report",
            BenchError::Io { .. } => "io",
        }
    }
}

/// Asks the server for its first model id.
async fn discover_model(
    client: &HttpClient,
    path: &str,
    timeout: Duration,
) -> Result<String, BenchError> {
    let models_path = match path
        .rsplit_once("/chat/completions")
        .or_else(|| path.rsplit_once("/completions"))
    {
        Some((prefix, "")) => format!("{prefix}/models"),
        _ => "/v1/models".to_string(),
    };
    let v = client.get_json(&models_path, timeout).await.map_err(|f| {
        BenchError::Server(format!(
            "GET {models_path} failed ({}: {}); pass --model NAME",
            f.kind, f.message
        ))
    })?;
    v.pointer("/data/0/id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| {
            BenchError::Server(format!(
                "GET {models_path} listed no model; pass --model NAME"
            ))
        })
}

/// Stops the interrupt watcher however `run` returns.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// First Ctrl-C: stop starting requests, let those in flight finish, and report what was
/// measured. A second Ctrl-C exits at once.
async fn watch_interrupt(stop: Arc<AtomicBool>) {
    if tokio::signal::ctrl_c().await.is_err() {
        return;
    }
    stop.store(true, Ordering::Relaxed);
    eprintln!("interrupted: finishing requests in flight (Ctrl-C again to quit)");
    if tokio::signal::ctrl_c().await.is_ok() {
        std::process::exit(130);
    }
}

fn progress_bar(args: &BenchArgs, len: Option<usize>, what: &str) -> ProgressBar {
    if args.no_progress || args.quiet {
        return ProgressBar::hidden();
    }
    let pb = match len {
        Some(n) => ProgressBar::new(n as u64),
        None => ProgressBar::no_length(),
    };
    let template = if len.is_some() {
        "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} requests"
    } else {
        "{prefix} [{elapsed_precise}] {spinner} {pos} requests"
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        pb.set_style(style);
    }
    pb.set_prefix(what.to_string());
    pb
}

/// Runs the benchmark described by `args`: every load point in turn, printing a table per
/// point (unless `--quiet`) and writing the JSON report and plot when asked.
/// The server's speculative-decoding counters (`None` when `/metrics` cannot be read).
async fn spec_decode(
    client: &HttpClient,
    timeout: std::time::Duration,
) -> Option<report::SpecDecode> {
    let text = client.get_text("/metrics", timeout).await.ok()?;
    Some(report::SpecDecode::parse(&text))
}

pub async fn run(args: BenchArgs) -> anyhow::Result<BenchReport> {
    let plan = args.plan()?;
    let baseline = args
        .baseline
        .as_deref()
        .map(BenchReport::read_json)
        .transpose()?;
    let tokenizer = Arc::new(PromptTokenizer::load(&plan.tokenizer)?);
    let cluster = match args.dynamo_workers {
        Some(n) => {
            let spec = dynamo_spec(&args, n)?;
            let c = tokio::task::spawn_blocking(move || cluster::Cluster::start(spec)).await??;
            if !args.quiet {
                eprintln!(
                    "dynamo cluster: {n} worker(s), router {}, frontend {}",
                    args.dynamo_router, c.url
                );
            }
            Some(c)
        }
        None => None,
    };
    let url = match (&cluster, &args.url) {
        (Some(c), _) => c.url.clone(),
        (None, Some(u)) => u.clone(),
        (None, None) => {
            return Err(
                BenchError::InvalidArg("--url or --dynamo-workers is needed".into()).into(),
            );
        }
    };
    let client = HttpClient::new(&url, args.api_key.clone())?;
    let path = args
        .path
        .clone()
        .unwrap_or_else(|| args.endpoint.default_path().to_string());
    let model = match &args.model {
        Some(m) => m.clone(),
        None => discover_model(&client, &path, plan.timeout).await?,
    };
    let opts = RequestOptions {
        endpoint: args.endpoint,
        model: model.clone(),
        prompt_format: args.prompt_format,
        temperature: args.temperature,
        ignore_eos: args.ignore_eos,
        extra_body: plan.extra_body.clone(),
    };
    let joined = args.endpoint == Endpoint::Completions;
    let stop = Arc::new(AtomicBool::new(false));
    let _watcher = AbortOnDrop(tokio::spawn(watch_interrupt(stop.clone())));
    let started_at_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut report = BenchReport {
        schema: SCHEMA.into(),
        label: args.label.clone(),
        metadata: plan.metadata.clone(),
        started_at_unix_s,
        server: ServerInfo {
            url: url.clone(),
            endpoint: match args.endpoint {
                Endpoint::Completions => "completions".into(),
                Endpoint::Chat => "chat".into(),
            },
            path: path.clone(),
            model,
        },
        workload: args.workload_info(&plan, 0, 0),
        run: RunInfo {
            max_requests: plan.bounds.max_requests,
            duration_s: plan.bounds.duration.map(|d| d.as_secs_f64()),
            timeout_s: plan.timeout.as_secs_f64(),
            temperature: args.temperature,
            ignore_eos: args.ignore_eos,
            extra_body: Value::Object(plan.extra_body.clone()),
            warmup_requests: 0,
            warmup_failed: 0,
            interrupted: false,
        },
        points: Vec::new(),
    };
    if !args.quiet {
        println!("{}", report.header());
    }
    if args.warmup > 0 {
        let first = plan
            .points
            .first()
            .copied()
            .unwrap_or(LoadPoint::Concurrency(1));
        let clients = match first {
            LoadPoint::Concurrency(c) => c,
            LoadPoint::Rate {
                max_concurrency, ..
            } => max_concurrency.unwrap_or(1),
        };
        let workload = workload::build(&plan.spec, &tokenizer, args.seed ^ WARMUP_SEED, joined)?;
        let progress = progress_bar(&args, Some(args.warmup), "warm-up");
        let ctx = Arc::new(PointContext {
            client: client.clone(),
            path: path.clone(),
            opts: opts.clone(),
            workload,
            tokenizer: tokenizer.clone(),
            timeout: plan.timeout,
            progress: progress.clone(),
            stop: stop.clone(),
        });
        let bounds = Bounds {
            max_requests: Some(args.warmup),
            duration: None,
        };
        let point = LoadPoint::Concurrency(clients.clamp(1, args.warmup));
        let out = runner::run_point(ctx, point, bounds, args.seed).await;
        progress.finish_and_clear();
        report.run.warmup_requests = out.records.len();
        report.run.warmup_failed = out.records.iter().filter(|r| !r.ok()).count();
        if !args.quiet {
            println!(
                "warm-up: {} requests, {} failed",
                report.run.warmup_requests, report.run.warmup_failed
            );
        }
    }
    for (i, point) in plan.points.iter().enumerate() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let seed = match args.sweep_prompts {
            SweepPrompts::Fresh => args.seed.wrapping_add(i as u64),
            SweepPrompts::Same => args.seed,
        };
        let workload = workload::build(&plan.spec, &tokenizer, seed, joined)?;
        if i == 0 {
            report.workload =
                args.workload_info(&plan, workload.sessions.len(), workload.total_requests());
        }
        let bounds = Bounds {
            max_requests: plan.bounds.max_requests.or_else(|| {
                plan.bounds
                    .duration
                    .is_none()
                    .then(|| workload.total_requests())
            }),
            duration: plan.bounds.duration,
        };
        let progress = progress_bar(&args, bounds.max_requests, &point.describe());
        let ctx = Arc::new(PointContext {
            client: client.clone(),
            path: path.clone(),
            opts: opts.clone(),
            workload,
            tokenizer: tokenizer.clone(),
            timeout: plan.timeout,
            progress: progress.clone(),
            stop: stop.clone(),
        });
        let spec_before = spec_decode(&client, plan.timeout).await;
        let out = runner::run_point(ctx, *point, bounds, seed).await;
        progress.finish_and_clear();
        let summary = PointSummary::compute(point, &out.records, out.duration_s, out.skipped_turns);
        let spec = match (spec_before, spec_decode(&client, plan.timeout).await) {
            (Some(b), Some(a)) => a.since(b),
            _ => None,
        };
        if !args.quiet {
            print!("{}", report::point_table(&summary));
            if let Some(s) = &spec {
                print!("{}", s.line());
            }
        }
        report.points.push(PointReport {
            summary,
            spec_decode: spec,
            records: args.save_requests.then_some(out.records),
        });
    }
    report.run.interrupted = stop.load(Ordering::Relaxed);
    if report.run.interrupted && !args.quiet {
        println!("interrupted: the last point is partial and later points were not run");
    }
    if let Some(c) = &cluster {
        report
            .metadata
            .insert("dynamo.router".into(), args.dynamo_router.clone());
        for (key, name) in DYNAMO_COUNTERS {
            let v = c.worker_counter(name);
            report.metadata.insert(key.into(), format!("{v}"));
        }
        if !args.quiet {
            let line: Vec<String> = DYNAMO_COUNTERS
                .iter()
                .map(|(k, _)| format!("{k}={}", report.metadata[*k]))
                .collect();
            println!("workers: {}", line.join("  "));
        }
    }
    if !args.quiet && report.points.len() > 1 {
        print!("\n{}", report.sweep_table());
    }
    if let (Some(base), false) = (&baseline, args.quiet) {
        print!("\n{}", report::comparison_table(base, &report));
    }
    if let Some(out) = &args.output {
        report.write_json(out)?;
        if !args.quiet {
            println!("wrote {}", out.display());
        }
    }
    let plot = args.plot.clone().or_else(|| {
        (report.points.len() > 1)
            .then(|| args.output.as_ref().map(|o| o.with_extension("svg")))
            .flatten()
    });
    if let Some(p) = plot {
        report::write_plot(&report, &p)?;
        if !args.quiet {
            println!("wrote {}", p.display());
        }
    }
    if let Some(c) = cluster {
        // Stopping waits for the processes: off the async threads.
        let _ = tokio::task::spawn_blocking(move || drop(c)).await;
    }
    Ok(report)
}

/// The workers' routing counters a `--dynamo-workers` run records in the report's metadata.
const DYNAMO_COUNTERS: [(&str, &str); 6] = [
    ("dynamo.requests", "chimera_dynamo_requests_total"),
    (
        "dynamo.routed_on_overlap",
        "chimera_dynamo_routed_on_overlap_total",
    ),
    (
        "dynamo.routed_without_state",
        "chimera_dynamo_routed_without_state_total",
    ),
    (
        "dynamo.routed_state_evicted",
        "chimera_dynamo_routed_state_evicted_total",
    ),
    (
        "dynamo.reused_prompt_tokens",
        "chimera_dynamo_reused_prompt_tokens_total",
    ),
    ("dynamo.prompt_tokens", "chimera_dynamo_prompt_tokens_total"),
];

/// The cluster `--dynamo-workers` asks for.
fn dynamo_spec(args: &BenchArgs, workers: usize) -> anyhow::Result<cluster::ClusterSpec> {
    let bin = match &args.dynamo_worker {
        Some(p) => p.clone(),
        None => {
            let beside = std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(|d| d.join("chimera-dynamo")));
            match beside {
                Some(p) if p.exists() => p,
                _ => PathBuf::from("chimera-dynamo"),
            }
        }
    };
    let mut spec = cluster::ClusterSpec::new(workers, &args.dynamo_router, bin);
    spec.worker_args = args
        .dynamo_worker_args
        .split_whitespace()
        .map(str::to_string)
        .collect();
    spec.frontend_args = args
        .dynamo_frontend_args
        .split_whitespace()
        .map(str::to_string)
        .collect();
    spec.block_size = args.dynamo_block_size;
    Ok(spec)
}
