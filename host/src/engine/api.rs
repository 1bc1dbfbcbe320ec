//! The engine's public face: what the server and router send to a replica and get back.
//!
//! An engine replica is a plain OS thread that owns its scheduler, caches, model runner and
//! policy instances. The async side talks to it only through an [`EngineHandle`]: bounded
//! command channel in, each request's events out ([`EventSender`]: a channel of its own, or a
//! stream shared by many requests that carries a step's events in one batch), and a `watch`
//! of load statistics.
//! Nothing here depends on how the engine schedules or caches.

use std::fmt;
use std::sync::{Arc, mpsc};

use tokio::sync::{mpsc as tmpsc, watch};

use crate::cache::BlockHash;
pub use crate::cache::MissReason;

/// Per-request sampling parameters (OpenAI semantics; 0 / 1 disables as noted).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: u32,
    /// 0 disables.
    pub min_p: f32,
    /// Seed for reproducible sampling; the engine derives one from the request id when unset.
    pub seed: Option<u64>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 1 disables.
    pub repetition_penalty: f32,
    /// Return this many top alternatives' logprobs per generated token (None: no logprobs).
    pub logprobs: Option<u32>,
    /// Generated tokens before a stop token (or EOS) may end the request: until then they are
    /// masked out of sampling (vLLM's `min_tokens`). 0 disables.
    pub min_tokens: u32,
    /// Added to the logit of each token before penalties' results are ranked (OpenAI's
    /// `logit_bias`), sorted by token id, one entry per token; -inf bans the token.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logprobs: None,
            min_tokens: 0,
            logit_bias: Vec::new(),
        }
    }
}

/// A request as the engine sees it: token ids in, token ids out.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Unique per server; used to cancel.
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: u32,
    /// Generation stops after any of these tokens (EOS is added unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Also return the prompt tokens' logprobs, with this many top alternatives each (`echo`
    /// with `logprobs`, or vLLM's `prompt_logprobs`). The whole prompt is then computed:
    /// cached prefixes have no logits to give.
    pub prompt_logprobs: Option<u32>,
    /// The prompt's chained block hashes (`cache::hash`, one per full block), when the sender
    /// already computed them (the server does, to route). The engine adopts them instead of
    /// hashing the prompt again, after checking their count and first block against its own
    /// salt and block size; `None` (or a mismatch) makes the engine hash the prompt itself.
    pub block_hashes: Option<Arc<[BlockHash]>>,
    /// Prompt token offsets (each in `1 ..= prompt.len()`) where the client wants the SSM
    /// state kept as a snapshot, if the snapshot budget allows: each is rounded down to a block
    /// boundary (an offset inside the first block asks for nothing). Ignored by models without
    /// SSM layers and with prefix caching off.
    pub checkpoints: Vec<u32>,
    /// Admission order under `engine.scheduling_policy = "priority"`: lower first (vLLM's
    /// `priority`); ignored under "fcfs".
    pub priority: i32,
    /// A grammar the response must follow (structured outputs, forced tool calls): the
    /// engine's constraint plugin masks every sampled position with it.
    pub constraint: Option<Grammar>,
    /// Whether the engine may decode this request speculatively (`[speculative]`); false opts
    /// out. The output is the same either way.
    pub speculative: bool,
}

/// A grammar for the constraint plugin (ABI `constraining.open`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grammar {
    /// `json-schema`, `regex`, `choice` or `lark`.
    pub kind: String,
    pub text: String,
}

impl GenerateRequest {
    /// A request for `max_tokens` greedy tokens after `prompt`, EOS ignored, nothing else
    /// asked (benchmarks, drafters, tests).
    pub fn greedy(id: u64, prompt: Vec<u32>, max_tokens: u32) -> Self {
        Self {
            id,
            prompt,
            params: SamplingParams::default(),
            max_tokens,
            stop_token_ids: vec![],
            ignore_eos: true,
            prompt_logprobs: None,
            block_hashes: None,
            checkpoints: Vec::new(),
            priority: 0,
            constraint: None,
            speculative: true,
        }
    }

    /// A unit test's request ([`Self::greedy`]).
    #[cfg(test)]
    pub(crate) fn for_test(id: u64, prompt: Vec<u32>, max_tokens: u32) -> Self {
        Self::greedy(id, prompt, max_tokens)
    }
}

/// Logprob of one generated token and of its top alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// (token, logprob), best first.
    pub top: Vec<(u32, f32)>,
    /// The token's rank in its whole distribution (1: the most likely), where it was computed
    /// over the full row (prompt logprobs); `None` for sampled tokens.
    pub rank: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token was produced.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by the client (or the server, e.g. after a stop string matched).
    Cancelled,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens whose computation was skipped thanks to the prefix cache.
    pub cached_tokens: u32,
    /// The most prompt tokens the cache could serve this prompt (its whole blocks, leaving
    /// at least two tokens to compute).
    pub cacheable_tokens: u32,
    /// Why fewer than `cacheable_tokens` were served (`None` when all were).
    pub cache_miss: Option<MissReason>,
}

/// What a request's output channel carries, in order: one `PromptLogprobs` when they were
/// asked for, any number of `Tokens`, then exactly one `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// One entry per prompt token; the first is `None` (nothing precedes it). Each has the
    /// request's `logprobs` count of top alternatives.
    PromptLogprobs {
        logprobs: Vec<Option<TokenLogprob>>,
    },
    Tokens {
        tokens: Vec<u32>,
        /// One entry per token when logprobs were asked for.
        logprobs: Option<Vec<TokenLogprob>>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Failed {
        kind: FailureKind,
        message: String,
    },
}

/// Why the engine failed a request. The server maps each kind to an HTTP status in one place
/// (`server::error`); [`FailureKind::as_str`] is its stable kind string (error code, metric
/// label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The request itself is malformed: an empty prompt, `max_tokens` 0, a prompt token id
    /// outside the model's vocabulary, or an id already in use.
    InvalidRequest,
    /// The replica's waiting queue (`engine.max_waiting`) is full; a later retry can succeed.
    QueueFull,
    /// The prompt can never run on this replica: it needs more KV blocks than the cache holds,
    /// or more tokens than one step takes with chunked prefill off.
    PromptTooLong,
    /// The executor failed the step the request was in (forward pass, SSM slot setup, or
    /// logits of the wrong shape).
    Executor,
    /// The cache refused a state change the scheduler planned (an engine bug).
    Cache,
    /// The response's constraint could not go on (the plugin failed, or no token is allowed).
    Constraint,
}

impl FailureKind {
    pub const ALL: [FailureKind; 6] = [
        Self::InvalidRequest,
        Self::QueueFull,
        Self::PromptTooLong,
        Self::Executor,
        Self::Cache,
        Self::Constraint,
    ];

    /// Stable kind string: the error code and metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request",
            Self::QueueFull => "queue_full",
            Self::PromptTooLong => "prompt_too_long",
            Self::Executor => "executor_failed",
            Self::Cache => "cache_error",
            Self::Constraint => "constraint_failed",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Events of many requests, tagged with the request's id, in batches (one per engine step
/// where the engine delivers from its delivery thread).
pub type EventBatch = Vec<(u64, EngineEvent)>;

/// The sending end of a stream of [`EventBatch`]es shared by many requests (a server's
/// output pass of one replica reads it).
#[derive(Debug, Clone)]
pub struct SharedEvents(Arc<mpsc::Sender<EventBatch>>);

impl SharedEvents {
    /// A new shared stream and its receiving end.
    pub fn channel() -> (Self, mpsc::Receiver<EventBatch>) {
        let (tx, rx) = mpsc::channel();
        (Self(Arc::new(tx)), rx)
    }

    /// Whether `other` sends to the same stream.
    pub fn same(&self, other: &SharedEvents) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Sends one batch; false when the reader has gone.
    pub fn send(&self, batch: EventBatch) -> bool {
        self.0.send(batch).is_ok()
    }
}

/// Where one request's events go.
#[derive(Debug, Clone)]
pub enum EventSender {
    /// A channel of the request's own.
    Own(tmpsc::UnboundedSender<EngineEvent>),
    /// A stream shared with other requests.
    Shared(SharedEvents),
}

impl EventSender {
    /// Sends one event of request `id` on its own (not batched); false when the reader has
    /// gone.
    pub fn send(&self, id: u64, event: EngineEvent) -> bool {
        match self {
            Self::Own(tx) => tx.send(event).is_ok(),
            Self::Shared(s) => s.send(vec![(id, event)]),
        }
    }
}

impl From<tmpsc::UnboundedSender<EngineEvent>> for EventSender {
    fn from(tx: tmpsc::UnboundedSender<EngineEvent>) -> Self {
        Self::Own(tx)
    }
}

/// Commands into the engine thread.
#[derive(Debug)]
pub enum Command {
    Add {
        request: Box<GenerateRequest>,
        events: EventSender,
    },
    Cancel {
        id: u64,
    },
    /// Drop every cached (unreferenced) block and snapshot; running requests are unaffected.
    ResetPrefixCache,
    /// Finish: cancel everything in flight and stop the loop.
    Shutdown,
}

/// Load and cache statistics, published by the engine after every step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub step: u64,
    pub running: u32,
    pub waiting: u32,
    pub paused: u32,
    pub total_blocks: u32,
    pub free_blocks: u32,
    pub cached_blocks: u32,
    pub ssm_slots_total: u32,
    /// Durable slots (snapshots, rolling snapshots) among `ssm_slots_total`.
    pub ssm_snapshot_slots: u32,
    /// Bytes of one SSM slot (every SSM layer's conv and recurrent state).
    pub ssm_slot_bytes: u64,
    pub ssm_snapshots_used: u32,
    pub prompt_tokens_computed: u64,
    pub prompt_tokens_cached: u64,
    pub generation_tokens: u64,
    /// Prompt tokens looked up in the prefix cache (every admission's whole prompt).
    pub prefix_cache_queries: u64,
    /// Prompt tokens whose computation the prefix cache saved.
    pub prefix_cache_hits: u64,
    pub ssm_restores: u64,
    pub preemptions: u64,
    pub requests_finished: u64,
    /// Requests served less than their cacheable prefix, by [`MissReason::index`].
    pub cache_misses: [u64; MissReason::ALL.len()],
    /// SSM-state copies into snapshot slots: at prompt boundaries, rolling (decode) and at
    /// client checkpoints. Each moves one slot (`cache_config_info`'s state bytes per slot).
    pub ssm_snapshot_copies: u64,
    pub ssm_rolling_copies: u64,
    pub ssm_checkpoint_copies: u64,
    /// Snapshots (of any kind) not taken because every durable slot was in use.
    pub ssm_snapshots_skipped: u64,
    /// Rolling snapshots kept as durable snapshots when their request ended.
    pub ssm_rolling_kept: u64,
    /// Checkpoints requests asked for (offsets past the first block).
    pub checkpoints_requested: u64,
    /// Speculative decoding: verify chunks with drafts, drafts verified, drafts accepted, and
    /// accepted drafts by position in their chunk (vLLM's `spec_decode_*`).
    pub spec_drafts: u64,
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub spec_accepted_per_pos: Vec<u64>,
    /// Device time spent on steps, and device time idle between back-to-back steps (waiting
    /// for the host), from CUDA events; 0 on the CPU.
    pub device_busy_seconds: f64,
    pub device_idle_seconds: f64,
    /// Of `device_idle_seconds`, the device waiting for masks of constrained rows computed
    /// while their forward pass ran.
    pub device_mask_wait_seconds: f64,
    /// Steps that ran a batch, and the host's time in each phase of them: scheduling and
    /// cache bookkeeping, building the step plan, and sampling/committing/sending events.
    pub engine_steps: u64,
    pub host_schedule_seconds: f64,
    pub host_inputs_seconds: f64,
    pub host_update_seconds: f64,
    /// Host time between back-to-back steps, outside them (the engine loop).
    pub host_between_seconds: f64,
    /// Host time launching steps on the executor (uploading and enqueueing them).
    pub host_launch_seconds: f64,
    /// Host work done while the device computes a step (not time the device waits).
    pub host_overlap_seconds: f64,
    /// Host time taking requests that arrived while a step computed into the step scheduled
    /// ahead (not time the device waits), and how many joined it that way.
    pub host_top_up_seconds: f64,
    pub late_admissions: u64,
    /// Token masks of constrained rows computed while their step's forward pass ran.
    pub late_masks: u64,
    /// Steps the model runner ran eagerly, and replayed from decode and mixed CUDA graphs.
    pub steps_eager: u64,
    pub steps_decode_graph: u64,
    pub steps_mixed_graph: u64,
}

/// Block-level cache events live with the cache; re-exported for the server and router.
pub use crate::cache::KvEvent;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum SubmitError {
    #[error("the engine's queue is full")]
    QueueFull,
    #[error("the engine is shutting down")]
    ShuttingDown,
}

/// The async side's handle to one engine replica. Cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    pub(crate) commands: mpsc::SyncSender<Command>,
    /// Cancels never wait behind a full queue: they have their own unbounded channel.
    pub(crate) cancels: mpsc::Sender<u64>,
    pub(crate) stats: watch::Receiver<EngineStats>,
}

impl EngineHandle {
    pub fn new(
        commands: mpsc::SyncSender<Command>,
        cancels: mpsc::Sender<u64>,
        stats: watch::Receiver<EngineStats>,
    ) -> Self {
        Self {
            commands,
            cancels,
            stats,
        }
    }

    /// Submits a request without blocking; its events arrive on the returned receiver.
    pub fn submit(
        &self,
        request: GenerateRequest,
    ) -> Result<tmpsc::UnboundedReceiver<EngineEvent>, SubmitError> {
        let (events, rx) = tmpsc::unbounded_channel();
        self.submit_to(request, EventSender::Own(events))?;
        Ok(rx)
    }

    /// Submits a request without blocking; its events go to `events`.
    pub fn submit_to(
        &self,
        request: GenerateRequest,
        events: EventSender,
    ) -> Result<(), SubmitError> {
        let request = Box::new(request);
        match self.commands.try_send(Command::Add { request, events }) {
            Ok(()) => Ok(()),
            Err(mpsc::TrySendError::Full(_)) => Err(SubmitError::QueueFull),
            Err(mpsc::TrySendError::Disconnected(_)) => Err(SubmitError::ShuttingDown),
        }
    }

    /// Cancels a request; a no-op if it already finished.
    pub fn cancel(&self, id: u64) {
        let _ = self.cancels.send(id);
    }

    /// Sends a control command (reset, shutdown), waiting for room in the queue.
    pub fn control(&self, command: Command) -> Result<(), SubmitError> {
        self.commands
            .send(command)
            .map_err(|_| SubmitError::ShuttingDown)
    }

    pub fn stats(&self) -> EngineStats {
        self.stats.borrow().clone()
    }

    pub fn stats_watch(&self) -> watch::Receiver<EngineStats> {
        self.stats.clone()
    }

    /// Whether the replica's engine thread is still running (it exits on shutdown and when
    /// its device is lost).
    pub fn is_alive(&self) -> bool {
        self.stats.has_changed().is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_kind_strings_are_distinct_snake_case() {
        let mut seen = std::collections::HashSet::new();
        for k in FailureKind::ALL {
            let s = k.as_str();
            assert!(seen.insert(s), "{s} twice");
            assert!(
                s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{s}"
            );
            assert_eq!(k.to_string(), s);
        }
    }
}
