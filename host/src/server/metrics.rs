//! Prometheus metrics: every name the server exports, the server-side recorders, and the text
//! exposition at `/metrics`.
//!
//! Owns: the metric names (vLLM's where one exists, with `chimera:` in place of `vllm:`, so
//! dashboards and endpoint pickers written for vLLM can scrape chimera), lock-free histograms
//! and counters recorded by the request pipeline and router, and rendering. Engine-side numbers
//! (running, waiting, KV usage, prefix-cache counters, preemptions, token counts) are read from
//! each replica's `EngineStats` at scrape time, never copied. Other parts add series through
//! [`MetricsSource`] (the hook for engine-side plugin counters). Nothing here blocks for long:
//! the only lock guards a small map and is never held across `.await`.

use std::collections::BTreeMap;
use std::fmt::{Display, Write};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use crate::histogram::{Histogram, PLUGIN_BUCKETS};

use crate::engine::api::{EngineStats, MissReason};

/// Metric names, in one place.
pub mod names {
    pub const NUM_REQUESTS_RUNNING: &str = "chimera:num_requests_running";
    pub const NUM_REQUESTS_WAITING: &str = "chimera:num_requests_waiting";
    pub const KV_CACHE_USAGE_PERC: &str = "chimera:kv_cache_usage_perc";
    pub const PREFIX_CACHE_QUERIES: &str = "chimera:prefix_cache_queries_total";
    pub const PREFIX_CACHE_HITS: &str = "chimera:prefix_cache_hits_total";
    pub const NUM_PREEMPTIONS: &str = "chimera:num_preemptions_total";
    pub const PROMPT_TOKENS: &str = "chimera:prompt_tokens_total";
    pub const GENERATION_TOKENS: &str = "chimera:generation_tokens_total";
    pub const CACHE_CONFIG_INFO: &str = "chimera:cache_config_info";
    pub const TIME_TO_FIRST_TOKEN: &str = "chimera:time_to_first_token_seconds";
    pub const INTER_TOKEN_LATENCY: &str = "chimera:inter_token_latency_seconds";
    pub const E2E_REQUEST_LATENCY: &str = "chimera:e2e_request_latency_seconds";
    pub const REQUEST_SUCCESS: &str = "chimera:request_success_total";
    // chimera's own.
    pub const SSM_SNAPSHOT_HITS: &str = "chimera:ssm_snapshot_hits_total";
    /// Requests served less than their cacheable prompt prefix, by `reason`.
    pub const PREFIX_CACHE_MISSES: &str = "chimera:prefix_cache_misses_total";
    /// SSM-state copies into snapshot slots, by `kind` (prompt, rolling, checkpoint).
    pub const SSM_SNAPSHOT_COPIES: &str = "chimera:ssm_snapshot_copies_total";
    pub const SSM_SNAPSHOT_COPY_BYTES: &str = "chimera:ssm_snapshot_copy_bytes_total";
    pub const SSM_SNAPSHOTS_SKIPPED: &str = "chimera:ssm_snapshots_skipped_total";
    pub const SSM_ROLLING_KEPT: &str = "chimera:ssm_rolling_snapshots_kept_total";
    pub const CACHE_CHECKPOINTS: &str = "chimera:cache_checkpoints_requested_total";
    // Speculative decoding, as vLLM's `spec_decode_*` (counters: `_total`).
    pub const SPEC_DECODE_DRAFTS: &str = "chimera:spec_decode_num_drafts_total";
    pub const SPEC_DECODE_DRAFT_TOKENS: &str = "chimera:spec_decode_num_draft_tokens_total";
    pub const SPEC_DECODE_ACCEPTED_TOKENS: &str = "chimera:spec_decode_num_accepted_tokens_total";
    /// Accepted drafts by `position` in their verify step (0: the first draft).
    pub const SPEC_DECODE_ACCEPTED_PER_POS: &str =
        "chimera:spec_decode_num_accepted_tokens_per_pos_total";
    pub const ROUTED_REQUESTS: &str = "chimera:router_requests_total";
    /// Time the router policy (a plugin with its native fallback, or a native policy) took to
    /// choose a replica. The plugins' own call latencies, calls and fallbacks, by plugin and
    /// kind, are `chimera:plugin_call_latency_seconds`, `chimera:plugin_calls_total` and
    /// `chimera:plugin_fallbacks_total` (named in `plugins::metrics`).
    pub const ROUTER_DECISION_LATENCY: &str = "chimera:router_decision_latency_seconds";
    /// Last-resort placements, after the router policy (plugin or its native twin) gave an
    /// unusable answer; per-plugin fallbacks are `chimera:plugin_fallbacks_total{plugin,reason}`.
    pub const PLACEMENT_FALLBACKS: &str = "chimera:router_placement_fallbacks_total";
    pub const REQUEST_ERRORS: &str = "chimera:request_errors_total";
    pub const CLIENT_DISCONNECTS: &str = "chimera:client_disconnects_total";
    /// Tool calls the parser could not read (returned to the client as text).
    pub const TOOL_CALL_PARSE_FAILURES: &str = "chimera:tool_call_parse_failures_total";
    pub const SERVER_IN_FLIGHT: &str = "chimera:server_requests_in_flight";
    /// Device time on steps, and device time idle between back-to-back steps (host overhead).
    pub const DEVICE_BUSY: &str = "chimera:device_busy_seconds_total";
    pub const DEVICE_IDLE: &str = "chimera:device_idle_between_steps_seconds_total";
    /// Of the idle time, the device waiting for constrained rows' masks.
    pub const DEVICE_MASK_WAIT: &str = "chimera:device_mask_wait_seconds_total";
    /// Engine steps that ran a batch, and the host's time in them by `phase` (schedule,
    /// inputs, update).
    pub const ENGINE_STEPS: &str = "chimera:engine_steps_total";
    pub const ENGINE_HOST_TIME: &str = "chimera:engine_host_seconds_total";
    /// Requests admitted into a step scheduled ahead after it was scheduled (they arrived
    /// while the step before computed).
    pub const LATE_ADMISSIONS: &str = "chimera:engine_late_admissions_total";
    /// Token masks of constrained rows computed while the forward pass of their step ran
    /// (the step scheduled ahead, launched before the tokens its masks need were known).
    pub const LATE_MASKS: &str = "chimera:engine_late_masks_total";
    /// Steps the model runner ran, by `kind`: eager, decode_graph, mixed_graph.
    pub const ENGINE_STEPS_BY_KIND: &str = "chimera:engine_steps_by_kind_total";
}

/// The families whose names are vLLM's with `chimera:` for `vllm:`: under
/// `server.metrics_names = "vllm"` they are exported as `vllm:...` (what llm-d's endpoint
/// picker, Ray Serve and Dynamo's planner scrape); chimera's own families keep their prefix.
pub const VLLM_FAMILIES: &[&str] = &[
    names::NUM_REQUESTS_RUNNING,
    names::NUM_REQUESTS_WAITING,
    names::KV_CACHE_USAGE_PERC,
    names::PREFIX_CACHE_QUERIES,
    names::PREFIX_CACHE_HITS,
    names::NUM_PREEMPTIONS,
    names::PROMPT_TOKENS,
    names::GENERATION_TOKENS,
    names::CACHE_CONFIG_INFO,
    names::TIME_TO_FIRST_TOKEN,
    names::INTER_TOKEN_LATENCY,
    names::E2E_REQUEST_LATENCY,
    names::REQUEST_SUCCESS,
    names::SPEC_DECODE_DRAFTS,
    names::SPEC_DECODE_DRAFT_TOKENS,
    names::SPEC_DECODE_ACCEPTED_TOKENS,
    names::SPEC_DECODE_ACCEPTED_PER_POS,
];

/// Which names `/metrics` uses for the families vLLM also exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricNames {
    /// `chimera:...` throughout.
    #[default]
    Chimera,
    /// vLLM's `vllm:...` for [`VLLM_FAMILIES`], `chimera:...` for the rest.
    Vllm,
}

/// Renames the [`VLLM_FAMILIES`] series of an exposition text to `vllm:` (comments, samples,
/// and histogram `_bucket` / `_sum` / `_count` series alike).
pub fn with_vllm_names(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let (lead, rest) = match line
            .strip_prefix("# HELP ")
            .map(|r| ("# HELP ", r))
            .or_else(|| line.strip_prefix("# TYPE ").map(|r| ("# TYPE ", r)))
        {
            Some(x) => x,
            None => ("", line),
        };
        let end = rest.find(['{', ' ']).unwrap_or(rest.len());
        let name = &rest[..end];
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|sfx| name.strip_suffix(sfx))
            .filter(|f| VLLM_FAMILIES.contains(f))
            .unwrap_or(name);
        match VLLM_FAMILIES.contains(&family) {
            true => {
                out.push_str(lead);
                out.push_str("vllm:");
                out.push_str(&rest["chimera:".len()..]);
            }
            false => out.push_str(line),
        }
    }
    out
}

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.01, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
];

/// Adds series to `/metrics` (e.g. the engine's plugin call counters).
pub trait MetricsSource: Send + Sync {
    fn render(&self, out: &mut String);
}

/// Static facts shown in `cache_config_info`.
#[derive(Debug, Clone, Default)]
pub struct CacheInfo {
    pub block_size: u32,
    pub num_gpu_blocks: u32,
    pub prefix_caching: bool,
}

/// Finish reasons counted in `request_success_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    Stop,
    Length,
    Abort,
}

impl Finished {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// Server-side recorders.
pub struct Metrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub router_latency: Histogram,
    finished: [AtomicU64; 3],
    errors: Mutex<BTreeMap<&'static str, u64>>,
    routed: Vec<AtomicU64>,
    router_fallbacks: AtomicU64,
    client_disconnects: AtomicU64,
    parse_failures: AtomicU64,
    in_flight: AtomicI64,
    sources: Mutex<Vec<Arc<dyn MetricsSource>>>,
}

impl Metrics {
    pub fn new(replicas: usize) -> Self {
        Self {
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            router_latency: Histogram::new(PLUGIN_BUCKETS),
            finished: Default::default(),
            errors: Mutex::new(BTreeMap::new()),
            routed: (0..replicas).map(|_| AtomicU64::new(0)).collect(),
            router_fallbacks: AtomicU64::new(0),
            client_disconnects: AtomicU64::new(0),
            parse_failures: AtomicU64::new(0),
            in_flight: AtomicI64::new(0),
            sources: Mutex::new(Vec::new()),
        }
    }

    pub fn add_source(&self, source: Arc<dyn MetricsSource>) {
        if let Ok(mut s) = self.sources.lock() {
            s.push(source);
        }
    }

    pub fn finished(&self, how: Finished) {
        self.finished[how as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn error(&self, kind: &'static str) {
        if let Ok(mut e) = self.errors.lock() {
            *e.entry(kind).or_insert(0) += 1;
        }
    }

    pub fn routed(&self, replica: usize) {
        if let Some(c) = self.routed.get(replica) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn routed_count(&self, replica: usize) -> u64 {
        self.routed
            .get(replica)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    pub fn router_fallback(&self) {
        self.router_fallbacks.fetch_add(1, Ordering::Relaxed);
    }

    pub fn client_disconnect(&self) {
        self.client_disconnects.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts tool calls the parser returned as text.
    pub fn parse_failures(&self, n: u32) {
        self.parse_failures
            .fetch_add(u64::from(n), Ordering::Relaxed);
    }

    pub fn parse_failure_count(&self) -> u64 {
        self.parse_failures.load(Ordering::Relaxed)
    }

    pub fn in_flight_add(&self, d: i64) {
        self.in_flight.fetch_add(d, Ordering::Relaxed);
    }

    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The whole exposition text: the engines' families (read from each replica's stats), the
    /// cache configuration, then the server's own histograms and counters, then the sources'.
    pub fn render(&self, model: &str, stats: &[EngineStats], cache: &CacheInfo) -> String {
        let mut out = String::with_capacity(8 * 1024);
        let m = escape(model);
        let engines = EngineFamilies { model: &m, stats };
        engines.render_load(&mut out);
        engines.render_tokens(&mut out);
        engines.render_steps(&mut out);
        engines.render_cache_reuse(&mut out);
        engines.render_speculation(&mut out);
        render_cache_config(&mut out, stats, cache);
        let labels = format!("model_name=\"{m}\"");
        self.render_latencies(&mut out, &labels);
        self.render_requests(&mut out, &labels);
        let sources = self.sources.lock().map(|s| s.clone()).unwrap_or_default();
        for s in sources {
            s.render(&mut out);
        }
        out
    }

    fn render_latencies(&self, out: &mut String, labels: &str) {
        use names::*;
        self.ttft.render(
            out,
            TIME_TO_FIRST_TOKEN,
            labels,
            "Time to first token in seconds.",
        );
        self.itl.render(
            out,
            INTER_TOKEN_LATENCY,
            labels,
            "Time between output tokens in seconds.",
        );
        self.e2e.render(
            out,
            E2E_REQUEST_LATENCY,
            labels,
            "End-to-end request latency in seconds.",
        );
        self.router_latency.render(
            out,
            ROUTER_DECISION_LATENCY,
            "",
            "Time the router policy took to choose a replica, in seconds.",
        );
    }

    /// The server's request counters: outcomes, routing, errors, disconnects, in flight.
    fn render_requests(&self, out: &mut String, labels: &str) {
        use names::*;
        header(
            out,
            REQUEST_SUCCESS,
            "counter",
            "Finished requests by reason.",
        );
        for how in [Finished::Stop, Finished::Length, Finished::Abort] {
            let v = self.finished[how as usize].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{REQUEST_SUCCESS}{{{labels},finished_reason=\"{}\"}} {v}",
                how.as_str()
            );
        }
        header(
            out,
            ROUTED_REQUESTS,
            "counter",
            "Requests routed per replica.",
        );
        for (i, c) in self.routed.iter().enumerate() {
            let _ = writeln!(
                out,
                "{ROUTED_REQUESTS}{{engine=\"{i}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        single(
            out,
            PLACEMENT_FALLBACKS,
            "counter",
            "Requests placed by least-loaded because the router policy answered out of range or panicked.",
            self.router_fallbacks.load(Ordering::Relaxed),
        );
        header(
            out,
            REQUEST_ERRORS,
            "counter",
            "Requests answered with an error, by kind.",
        );
        if let Ok(errors) = self.errors.lock() {
            for (kind, v) in errors.iter() {
                let _ = writeln!(out, "{REQUEST_ERRORS}{{kind=\"{kind}\"}} {v}");
            }
        }
        single(
            out,
            CLIENT_DISCONNECTS,
            "counter",
            "Engine requests cancelled because the client went away.",
            self.client_disconnects.load(Ordering::Relaxed),
        );
        single(
            out,
            TOOL_CALL_PARSE_FAILURES,
            "counter",
            "Tool calls the parser could not read; their text went to the client as content.",
            self.parse_failures.load(Ordering::Relaxed),
        );
        single(
            out,
            SERVER_IN_FLIGHT,
            "gauge",
            "Engine requests the server is waiting on.",
            self.in_flight(),
        );
    }
}

/// A per-replica family: its name, help, and its value in one replica's stats.
type PerEngine = (&'static str, &'static str, fn(&EngineStats) -> f64);

/// The engine-side families, one sample per replica (`model_name`, `engine` labels), read from
/// each replica's stats at scrape time.
struct EngineFamilies<'a> {
    /// The escaped model name.
    model: &'a str,
    stats: &'a [EngineStats],
}

impl EngineFamilies<'_> {
    /// Requests running and waiting, and KV-cache usage.
    fn render_load(&self, out: &mut String) {
        use names::*;
        self.per_engine(
            out,
            "gauge",
            &[
                (
                    NUM_REQUESTS_RUNNING,
                    "Requests in model execution batches.",
                    |s| f64::from(s.running),
                ),
                (
                    NUM_REQUESTS_WAITING,
                    "Requests waiting to be processed.",
                    |s| f64::from(s.waiting + s.paused),
                ),
                (
                    KV_CACHE_USAGE_PERC,
                    "KV-cache usage, 1 means 100 percent.",
                    |s| {
                        if s.total_blocks == 0 {
                            0.0
                        } else {
                            f64::from(s.total_blocks.saturating_sub(s.free_blocks))
                                / f64::from(s.total_blocks)
                        }
                    },
                ),
            ],
        );
    }

    /// Prefix-cache queries and hits, preemptions, prompt and generation tokens.
    fn render_tokens(&self, out: &mut String) {
        use names::*;
        self.per_engine(
            out,
            "counter",
            &[
                (
                    PREFIX_CACHE_QUERIES,
                    "Prefix-cache queries, in tokens.",
                    |s| s.prefix_cache_queries as f64,
                ),
                (PREFIX_CACHE_HITS, "Prefix-cache hits, in tokens.", |s| {
                    s.prefix_cache_hits as f64
                }),
                (NUM_PREEMPTIONS, "Cumulative preemptions.", |s| {
                    s.preemptions as f64
                }),
                (
                    PROMPT_TOKENS,
                    "Prefill tokens processed (computed plus cached).",
                    |s| (s.prompt_tokens_computed + s.prompt_tokens_cached) as f64,
                ),
                (GENERATION_TOKENS, "Generation tokens processed.", |s| {
                    s.generation_tokens as f64
                }),
            ],
        );
    }

    /// Device busy and idle time, steps, late admissions, host time by phase, steps by kind.
    fn render_steps(&self, out: &mut String) {
        use names::*;
        self.per_engine(
            out,
            "counter",
            &[
                (
                    DEVICE_BUSY,
                    "Device time spent on engine steps (CUDA events; 0 on the CPU).",
                    |s| s.device_busy_seconds,
                ),
                (
                    DEVICE_IDLE,
                    "Device time idle between back-to-back engine steps, waiting for the host.",
                    |s| s.device_idle_seconds,
                ),
                (
                    DEVICE_MASK_WAIT,
                    "Of the device's idle time between steps, the time it waited inside a step for the masks of constrained rows, computed on the host while the step's forward pass ran.",
                    |s| s.device_mask_wait_seconds,
                ),
                (ENGINE_STEPS, "Engine steps that ran a batch.", |s| {
                    s.engine_steps as f64
                }),
                (
                    LATE_ADMISSIONS,
                    "Requests admitted into a step scheduled ahead after it was scheduled (they arrived while the step before computed).",
                    |s| s.late_admissions as f64,
                ),
                (
                    LATE_MASKS,
                    "Token masks of constrained rows computed while the forward pass of their step ran.",
                    |s| s.late_masks as f64,
                ),
            ],
        );
        self.per_engine_by(
            out,
            ENGINE_HOST_TIME,
            "Host time in engine steps, by phase: schedule (scheduling and cache bookkeeping), inputs (building the step plan), update (sampling, committing, queueing events), between (the engine loop between back-to-back steps), launch (uploading the step and enqueueing its work), overlap (host work while the device computes the step: handing the previous step's request and block events on, publishing its figures and cache events), top_up (admitting requests that arrived while the device computed into the step scheduled ahead).",
            "phase",
            |s| {
                [
                    ("schedule", s.host_schedule_seconds),
                    ("inputs", s.host_inputs_seconds),
                    ("update", s.host_update_seconds),
                    ("between", s.host_between_seconds),
                    ("launch", s.host_launch_seconds),
                    ("overlap", s.host_overlap_seconds),
                    ("top_up", s.host_top_up_seconds),
                ]
            },
        );
        self.per_engine_by(
            out,
            ENGINE_STEPS_BY_KIND,
            "Steps the model runner ran, by kind: eager (every kernel launched from the host), decode_graph and mixed_graph (replayed from a CUDA graph of a decode-only or a mixed bucket).",
            "kind",
            |s| {
                [
                    ("eager", s.steps_eager),
                    ("decode_graph", s.steps_decode_graph),
                    ("mixed_graph", s.steps_mixed_graph),
                ]
            },
        );
    }

    /// SSM-snapshot restores, prefix-cache misses by reason, snapshot copies by kind and in
    /// bytes, skipped and kept snapshots, checkpoints asked for.
    fn render_cache_reuse(&self, out: &mut String) {
        use names::*;
        self.per_engine(
            out,
            "counter",
            &[(
                SSM_SNAPSHOT_HITS,
                "Requests restored from an SSM-state snapshot.",
                |s| s.ssm_restores as f64,
            )],
        );
        self.per_engine_by(
            out,
            PREFIX_CACHE_MISSES,
            "Requests served less than their cacheable prompt prefix, by reason.",
            "reason",
            |s| MissReason::ALL.map(|r| (r.as_str(), s.cache_misses[r.index()])),
        );
        self.per_engine_by(
            out,
            SSM_SNAPSHOT_COPIES,
            "SSM-state copies into snapshot slots, by kind.",
            "kind",
            |s| {
                let prompt = s
                    .ssm_snapshot_copies
                    .saturating_sub(s.ssm_rolling_copies + s.ssm_checkpoint_copies);
                [
                    ("prompt", prompt),
                    ("rolling", s.ssm_rolling_copies),
                    ("checkpoint", s.ssm_checkpoint_copies),
                ]
            },
        );
        self.per_engine(
            out,
            "counter",
            &[
                (
                    SSM_SNAPSHOT_COPY_BYTES,
                    "Bytes copied into SSM snapshot slots.",
                    |s| (s.ssm_snapshot_copies * s.ssm_slot_bytes) as f64,
                ),
                (
                    SSM_SNAPSHOTS_SKIPPED,
                    "SSM snapshots not taken because every snapshot slot was in use.",
                    |s| s.ssm_snapshots_skipped as f64,
                ),
                (
                    SSM_ROLLING_KEPT,
                    "Rolling SSM snapshots kept as durable snapshots when their request ended.",
                    |s| s.ssm_rolling_kept as f64,
                ),
                (
                    CACHE_CHECKPOINTS,
                    "SSM checkpoints requests asked for (offsets past the first block).",
                    |s| s.checkpoints_requested as f64,
                ),
            ],
        );
    }

    /// Speculative decoding: verify steps with drafts, drafts proposed and accepted, and
    /// accepted drafts by position (a sample per position any replica has seen).
    fn render_speculation(&self, out: &mut String) {
        use names::*;
        self.per_engine(
            out,
            "counter",
            &[
                (
                    SPEC_DECODE_DRAFTS,
                    "Verify steps of a request that carried drafts.",
                    |s| s.spec_drafts as f64,
                ),
                (SPEC_DECODE_DRAFT_TOKENS, "Draft tokens verified.", |s| {
                    s.spec_draft_tokens as f64
                }),
                (SPEC_DECODE_ACCEPTED_TOKENS, "Draft tokens accepted.", |s| {
                    s.spec_accepted_tokens as f64
                }),
            ],
        );
        let name = SPEC_DECODE_ACCEPTED_PER_POS;
        header(
            out,
            name,
            "counter",
            "Accepted draft tokens by position in their verify step (0: the first draft).",
        );
        for (i, s) in self.stats.iter().enumerate() {
            for (pos, n) in s.spec_accepted_per_pos.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{name}{{model_name=\"{}\",engine=\"{i}\",position=\"{pos}\"}} {n}",
                    self.model
                );
            }
        }
    }

    /// Families of one sample per replica, each of `kind`, in the order given.
    fn per_engine(&self, out: &mut String, kind: &str, families: &[PerEngine]) {
        for &(name, help, value) in families {
            header(out, name, kind, help);
            for (i, s) in self.stats.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{name}{{model_name=\"{}\",engine=\"{i}\"}} {}",
                    self.model,
                    value(s)
                );
            }
        }
    }

    /// A counter with one sample per replica and value of `label` (`values` gives them in
    /// order, with the sample's value).
    fn per_engine_by<T: Display, const N: usize>(
        &self,
        out: &mut String,
        name: &str,
        help: &str,
        label: &str,
        values: impl Fn(&EngineStats) -> [(&'static str, T); N],
    ) {
        header(out, name, "counter", help);
        for (i, s) in self.stats.iter().enumerate() {
            for (v, x) in values(s) {
                let _ = writeln!(
                    out,
                    "{name}{{model_name=\"{}\",engine=\"{i}\",{label}=\"{v}\"}} {x}",
                    self.model
                );
            }
        }
    }
}

/// `cache_config_info`: the static cache facts as labels of a constant 1. SSM facts come from
/// the first replica (every replica has the same layout).
fn render_cache_config(out: &mut String, stats: &[EngineStats], cache: &CacheInfo) {
    use names::CACHE_CONFIG_INFO;
    header(out, CACHE_CONFIG_INFO, "gauge", "Cache configuration.");
    let first = stats.first().cloned().unwrap_or_default();
    let _ = writeln!(
        out,
        "{CACHE_CONFIG_INFO}{{block_size=\"{}\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"{}\",ssm_snapshot_slots=\"{}\",ssm_state_bytes_per_slot=\"{}\",min_cacheable_prefix_tokens=\"{}\"}} 1",
        cache.block_size,
        cache.num_gpu_blocks,
        cache.prefix_caching,
        first.ssm_snapshot_slots,
        first.ssm_slot_bytes,
        cache.block_size
    );
}

/// A family's `# HELP` and `# TYPE` lines.
fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A family of one unlabelled sample.
fn single(out: &mut String, name: &str, kind: &str, help: &str, value: impl Display) {
    header(out, name, kind, help);
    let _ = writeln!(out, "{name} {value}");
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_names_rename_vllm_families_only() {
        let m = Metrics::new(1);
        m.routed(0);
        let s = [EngineStats {
            running: 2,
            ..Default::default()
        }];
        let chimera = m.render("m", &s, &CacheInfo::default());
        let vllm = with_vllm_names(&chimera);
        assert!(vllm.contains("vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 2"));
        assert!(vllm.contains("# TYPE vllm:time_to_first_token_seconds histogram"));
        assert!(vllm.contains("vllm:time_to_first_token_seconds_bucket{"));
        assert!(vllm.contains("vllm:time_to_first_token_seconds_count{"));
        assert!(vllm.contains("vllm:cache_config_info{"));
        // chimera's own families keep their names; no vLLM family is left under chimera:.
        assert!(vllm.contains("chimera:router_requests_total{engine=\"0\"} 1"));
        for f in VLLM_FAMILIES {
            let rest = &f["chimera:".len()..];
            assert!(!vllm.contains(&format!("chimera:{rest}{{")), "{f}");
            assert!(!vllm.contains(&format!("chimera:{rest} ")), "{f}");
        }
        assert_eq!(vllm.lines().count(), chimera.lines().count());
    }

    #[test]
    fn renders_engine_gauges_per_replica() {
        let m = Metrics::new(2);
        m.routed(1);
        m.error("overloaded");
        let s = [
            EngineStats {
                running: 3,
                total_blocks: 10,
                free_blocks: 5,
                ..Default::default()
            },
            EngineStats {
                waiting: 2,
                steps_eager: 4,
                steps_mixed_graph: 7,
                ..Default::default()
            },
        ];
        let out = m.render("tiny\"m", &s, &CacheInfo::default());
        assert!(
            out.contains("chimera:num_requests_running{model_name=\"tiny\\\"m\",engine=\"0\"} 3")
        );
        assert!(
            out.contains("chimera:kv_cache_usage_perc{model_name=\"tiny\\\"m\",engine=\"0\"} 0.5")
        );
        assert!(
            out.contains("chimera:num_requests_waiting{model_name=\"tiny\\\"m\",engine=\"1\"} 2")
        );
        assert!(out.contains("chimera:router_requests_total{engine=\"1\"} 1"));
        for (kind, n) in [("eager", 4), ("decode_graph", 0), ("mixed_graph", 7)] {
            let line = format!(
                "chimera:engine_steps_by_kind_total{{model_name=\"tiny\\\"m\",engine=\"1\",kind=\"{kind}\"}} {n}"
            );
            assert!(out.contains(&line), "{line}");
        }
        assert!(out.contains("chimera:request_errors_total{kind=\"overloaded\"} 1"));
    }
}
