//! The `chimera bench` command line: flags, their defaults, and validation into a plan.
//!
//! Owns [`BenchArgs`] (clap) and its checks; every invalid combination becomes a
//! [`BenchError::InvalidArg`] naming the flag and what is allowed. Must not send requests or
//! build prompts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Map, Value};

use super::arrivals::{Bounds, LoadPoint, Rate};
use super::client::{Endpoint, PromptFormat};
use super::report::WorkloadInfo;
use super::workload::{LenRange, WorkloadSpec};
use super::{BenchError, DEFAULT_TOKENIZER};

/// Workload shapes selectable with `--workload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// --groups × --prompts-per-group prompts: a shared --prefix-len prefix per group, then a
    /// --question-len question.
    SharedPrefix,
    /// --num-requests prompts (1000 when unset) of --input-len tokens.
    Random,
    /// --conversations × --turns turns; each turn appends a --question-len message to the
    /// conversation so far (optional --prefix-len system prompt).
    MultiTurn,
    /// Prompts from --prompts-file (JSON array or JSONL).
    File,
}

/// Whether sweep points reuse prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SweepPrompts {
    /// Each point gets its own prompts (seed + point index), so a point does not hit the
    /// prefix cache filled by the previous one.
    Fresh,
    /// Every point sends the same prompts.
    Same,
}

/// `chimera bench`: drive an OpenAI-compatible server with streaming requests and report
/// latency percentiles, throughput and prefix-cache hits.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Server root URL (plain http), e.g. http://127.0.0.1:8000; not with --dynamo-workers,
    /// which starts the server.
    #[arg(
        long,
        required_unless_present = "dynamo_workers",
        conflicts_with = "dynamo_workers"
    )]
    pub url: Option<String>,
    /// Start a Dynamo cluster on this machine and drive its frontend: etcd, NATS, Dynamo's
    /// frontend and this many `chimera-dynamo` workers (ports on 127.0.0.1; stopped at the
    /// end). Needs `etcd`, `nats-server` and a Python with `ai-dynamo` ($CHIMERA_DYNAMO_PYTHON).
    #[arg(long)]
    pub dynamo_workers: Option<usize>,
    /// --dynamo-workers: the frontend's router (`kv`, `round-robin`, `random`, ...).
    #[arg(long, default_value = "kv")]
    pub dynamo_router: String,
    /// --dynamo-workers: the worker binary (default: `chimera-dynamo` beside this program,
    /// else on PATH).
    #[arg(long)]
    pub dynamo_worker: Option<PathBuf>,
    /// --dynamo-workers: arguments for every worker, space-separated (e.g. "--model
    /// builtin:tiny-hybrid --replicas 1").
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub dynamo_worker_args: String,
    /// --dynamo-workers: more arguments for Dynamo's frontend, space-separated (e.g.
    /// "--router-prefill-load-scale 4").
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub dynamo_frontend_args: String,
    /// --dynamo-workers: the workers' KV block size (what the frontend's router hashes with).
    #[arg(long, default_value_t = 16)]
    pub dynamo_block_size: u32,
    /// Model name sent in requests; default: the first id listed by GET /v1/models.
    #[arg(long)]
    pub model: Option<String>,
    /// API to call.
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    /// Request path, overriding the endpoint's default (/v1/completions, /v1/chat/completions).
    #[arg(long)]
    pub path: Option<String>,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// tokenizer.json of the served model (lengths are counted with it), or `words` to count
    /// whitespace-separated words instead.
    #[arg(long, default_value = DEFAULT_TOKENIZER)]
    pub tokenizer: String,
    /// Send completions prompts as text or as token ids.
    #[arg(long, value_enum, default_value_t = PromptFormat::Text)]
    pub prompt_format: PromptFormat,

    /// Workload shape.
    #[arg(long, value_enum, default_value_t = WorkloadKind::SharedPrefix)]
    pub workload: WorkloadKind,
    /// shared-prefix: number of distinct prefixes.
    #[arg(long, default_value_t = 64)]
    pub groups: usize,
    /// shared-prefix: prompts per prefix.
    #[arg(long, default_value_t = 16)]
    pub prompts_per_group: usize,
    /// Shared prefix (shared-prefix; default 2048) or system prompt (multi-turn; default 0)
    /// length in tokens: N or MIN:MAX.
    #[arg(long)]
    pub prefix_len: Option<LenRange>,
    /// shared-prefix and multi-turn: question length per prompt or turn.
    #[arg(long, default_value = "128")]
    pub question_len: LenRange,
    /// random: prompt length.
    #[arg(long, default_value = "512")]
    pub input_len: LenRange,
    /// Output tokens requested (max_tokens) per request.
    #[arg(long, default_value = "256")]
    pub output_len: LenRange,
    /// multi-turn: number of conversations.
    #[arg(long, default_value_t = 16)]
    pub conversations: usize,
    /// multi-turn: turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// file: prompts file (JSON array or JSONL; see docs/bench-schema.md).
    #[arg(long)]
    pub prompts_file: Option<PathBuf>,
    /// shared-prefix: send group by group instead of shuffled.
    #[arg(long)]
    pub no_shuffle: bool,

    /// Requests per load point (default: one pass over the workload, unless --duration).
    #[arg(long)]
    pub num_requests: Option<usize>,
    /// Seconds per load point after which no new request starts.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Closed loop: number of concurrent clients; a comma list sweeps (default 1).
    #[arg(long, value_delimiter = ',', conflicts_with = "request_rate")]
    pub concurrency: Vec<usize>,
    /// Open loop: session arrivals per second (`inf`: all at once); a comma list sweeps.
    #[arg(long, value_delimiter = ',')]
    pub request_rate: Vec<Rate>,
    /// Gamma shape of inter-arrival times: 1 is Poisson, <1 burstier, >1 more regular.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Open loop: at most this many requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Seed of prompts and arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sweeps: fresh prompts per point, or the same prompts at every point.
    #[arg(long, value_enum, default_value_t = SweepPrompts::Fresh)]
    pub sweep_prompts: SweepPrompts,

    /// Sampling temperature sent with every request.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Send `ignore_eos: true` so every request generates its full output length.
    #[arg(long)]
    pub ignore_eos: bool,
    /// JSON object merged into every request body, e.g. '{"top_k": 20}'.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,

    /// Name of this run in the table and the JSON (e.g. prefix-cache-on).
    #[arg(long)]
    pub label: Option<String>,
    /// KEY=VALUE stored in the JSON's metadata (repeatable).
    #[arg(long = "metadata", value_name = "KEY=VALUE")]
    pub metadata: Vec<String>,
    /// Write the JSON report here.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Write an SVG plot against offered load here (default with a sweep and --output: the
    /// output path with an .svg extension).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Requests sent before the first point and left out of the statistics (to warm up the
    /// server); their prompts use a different seed, so they do not pre-fill measured prefixes.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// A JSON report of an earlier run: print this run's ratios against it, point by point.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// Also store every request's record (timings, ITLs, token counts) in the JSON.
    #[arg(long)]
    pub save_requests: bool,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Print nothing to stdout (the report is still returned and written).
    #[arg(long)]
    pub quiet: bool,
}

pub(super) fn invalid(msg: impl Into<String>) -> BenchError {
    BenchError::InvalidArg(msg.into())
}

/// The validated plan of a run.
pub(super) struct Plan {
    pub(super) spec: WorkloadSpec,
    pub(super) points: Vec<LoadPoint>,
    pub(super) bounds: Bounds,
    pub(super) extra_body: Map<String, Value>,
    pub(super) metadata: BTreeMap<String, String>,
    pub(super) timeout: Duration,
    pub(super) tokenizer: String,
}

impl BenchArgs {
    pub(super) fn plan(&self) -> Result<Plan, BenchError> {
        let spec = match self.workload {
            WorkloadKind::SharedPrefix => {
                if self.groups == 0 || self.prompts_per_group == 0 {
                    return Err(invalid(
                        "--groups and --prompts-per-group must be at least 1",
                    ));
                }
                WorkloadSpec::SharedPrefix {
                    groups: self.groups,
                    prompts_per_group: self.prompts_per_group,
                    prefix_len: self.prefix_len.unwrap_or(LenRange::fixed(2048)),
                    question_len: self.question_len,
                    output_len: self.output_len,
                    shuffle: !self.no_shuffle,
                }
            }
            WorkloadKind::Random => WorkloadSpec::Random {
                requests: self.num_requests.unwrap_or(1000),
                input_len: self.input_len,
                output_len: self.output_len,
            },
            WorkloadKind::MultiTurn => {
                if self.conversations == 0 || self.turns == 0 {
                    return Err(invalid("--conversations and --turns must be at least 1"));
                }
                WorkloadSpec::MultiTurn {
                    conversations: self.conversations,
                    turns: self.turns,
                    prefix_len: self.prefix_len.unwrap_or(LenRange::fixed(0)),
                    question_len: self.question_len,
                    output_len: self.output_len,
                }
            }
            WorkloadKind::File => WorkloadSpec::File {
                path: self
                    .prompts_file
                    .clone()
                    .ok_or_else(|| invalid("--workload file needs --prompts-file PATH"))?,
                output_len: self.output_len,
            },
        };
        if self.output_len.min == 0 {
            return Err(invalid("--output-len must be at least 1"));
        }
        if !(self.burstiness > 0.0 && self.burstiness.is_finite()) {
            return Err(invalid("--burstiness must be a positive number"));
        }
        if !(self.timeout > 0.0 && self.timeout.is_finite()) {
            return Err(invalid("--timeout must be a positive number of seconds"));
        }
        let duration = match self.duration {
            Some(d) if d > 0.0 && d.is_finite() => Some(Duration::from_secs_f64(d)),
            Some(_) => return Err(invalid("--duration must be a positive number of seconds")),
            None => None,
        };
        if self.num_requests == Some(0) {
            return Err(invalid("--num-requests must be at least 1"));
        }
        if self.max_concurrency == Some(0) {
            return Err(invalid("--max-concurrency must be at least 1"));
        }
        let points: Vec<LoadPoint> = if !self.request_rate.is_empty() {
            self.request_rate
                .iter()
                .map(|r| LoadPoint::Rate {
                    rate: r.0,
                    burstiness: self.burstiness,
                    max_concurrency: self.max_concurrency,
                })
                .collect()
        } else if self.concurrency.is_empty() {
            vec![LoadPoint::Concurrency(1)]
        } else {
            if self.concurrency.contains(&0) {
                return Err(invalid("--concurrency values must be at least 1"));
            }
            self.concurrency
                .iter()
                .map(|&c| LoadPoint::Concurrency(c))
                .collect()
        };
        let any_inf = self.request_rate.iter().any(|r| r.0.is_infinite());
        if any_inf && duration.is_some() && self.num_requests.is_none() {
            return Err(invalid(
                "--request-rate inf with --duration needs --num-requests (it would start sessions without end)",
            ));
        }
        if self.prompt_format == PromptFormat::TokenIds {
            if self.endpoint != Endpoint::Completions {
                return Err(invalid(
                    "--prompt-format token-ids works only with --endpoint completions",
                ));
            }
            if self.tokenizer == "words" {
                return Err(invalid(
                    "--prompt-format token-ids needs a real --tokenizer",
                ));
            }
            if self.workload == WorkloadKind::MultiTurn && self.turns > 1 {
                return Err(invalid(
                    "--prompt-format token-ids cannot continue multi-turn conversations (the answers are text); use text",
                ));
            }
        }
        let extra_body = match &self.extra_body {
            None => Map::new(),
            Some(s) => match serde_json::from_str::<Value>(s) {
                Ok(Value::Object(m)) => m,
                _ => return Err(invalid(format!("--extra-body `{s}` is not a JSON object"))),
            },
        };
        let mut metadata = BTreeMap::new();
        for kv in &self.metadata {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| invalid(format!("--metadata `{kv}`: use KEY=VALUE")))?;
            metadata.insert(k.trim().to_string(), v.to_string());
        }
        let tokenizer =
            if self.tokenizer == DEFAULT_TOKENIZER && !Path::new(DEFAULT_TOKENIZER).exists() {
                let beside_crate = concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../assets/tokenizer/tokenizer.json"
                );
                if Path::new(beside_crate).exists() {
                    beside_crate.to_string()
                } else {
                    self.tokenizer.clone()
                }
            } else {
                self.tokenizer.clone()
            };
        Ok(Plan {
            spec,
            points,
            bounds: Bounds {
                max_requests: self.num_requests,
                duration,
            },
            extra_body,
            metadata,
            timeout: Duration::from_secs_f64(self.timeout),
            tokenizer,
        })
    }

    pub(super) fn workload_info(
        &self,
        plan: &Plan,
        sessions: usize,
        requests: usize,
    ) -> WorkloadInfo {
        let mut w = WorkloadInfo {
            kind: String::new(),
            seed: self.seed,
            sweep_prompts: match self.sweep_prompts {
                SweepPrompts::Fresh => "fresh".into(),
                SweepPrompts::Same => "same".into(),
            },
            tokenizer: plan.tokenizer.clone(),
            prompt_format: match self.prompt_format {
                PromptFormat::Text => "text".into(),
                PromptFormat::TokenIds => "token-ids".into(),
            },
            groups: None,
            prompts_per_group: None,
            prefix_len: None,
            question_len: None,
            input_len: None,
            output_len: Some(self.output_len),
            conversations: None,
            turns: None,
            prompts_file: None,
            shuffle: None,
            sessions_per_pass: sessions,
            requests_per_pass: requests,
        };
        match &plan.spec {
            WorkloadSpec::SharedPrefix {
                groups,
                prompts_per_group,
                prefix_len,
                question_len,
                shuffle,
                ..
            } => {
                w.kind = "shared-prefix".into();
                w.groups = Some(*groups);
                w.prompts_per_group = Some(*prompts_per_group);
                w.prefix_len = Some(*prefix_len);
                w.question_len = Some(*question_len);
                w.shuffle = Some(*shuffle);
            }
            WorkloadSpec::Random { input_len, .. } => {
                w.kind = "random".into();
                w.input_len = Some(*input_len);
            }
            WorkloadSpec::MultiTurn {
                conversations,
                turns,
                prefix_len,
                question_len,
                ..
            } => {
                w.kind = "multi-turn".into();
                w.conversations = Some(*conversations);
                w.turns = Some(*turns);
                w.prefix_len = Some(*prefix_len);
                w.question_len = Some(*question_len);
            }
            WorkloadSpec::File { path, .. } => {
                w.kind = "file".into();
                w.prompts_file = Some(path.clone());
            }
        }
        w
    }
}
