//! A deterministic, model-free engine replica speaking the real `Command` protocol.
//!
//! Owns: one OS thread per mock replica that admits, steps, cancels and finishes requests the
//! way the real engine loop does, so the server, router and their tests run without a model.
//! Output tokens are a pure function of the prompt (and, when `temperature > 0`, of the seed or
//! request id), so a test can predict them by asking twice. It honours `max_tokens`,
//! `stop_token_ids`, EOS, cancellation, `ResetPrefixCache`, `Shutdown`, logprobs, a per-token
//! delay, a bounded running set with a waiting queue, cancels that overtake their `Add` (they
//! travel on a separate channel), and publishes `EngineStats` and
//! `KvEvent`s (prefix blocks hashed with [`prompt_block_hashes`]). It must not be used to serve
//! real traffic; it is not compiled only for tests so integration tests and benches can reuse it.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::{mpsc as tmpsc, watch};

use super::prefix_mirror::prompt_block_hashes;
use crate::engine::api::{
    Command, EngineEvent, EngineHandle, EngineStats, FinishReason, GenerateRequest, KvEvent,
    TokenLogprob, Usage,
};

/// How a mock replica behaves.
#[derive(Debug, Clone)]
pub struct MockEngineConfig {
    /// Bounded command queue (admission beyond it is `QueueFull`).
    pub queue_capacity: usize,
    /// Requests decoded concurrently; the rest wait.
    pub max_running: usize,
    /// Sleep per engine step while anything runs.
    pub token_delay: Duration,
    /// Output is drawn from these units; a unit's tokens are emitted consecutively (so a test can
    /// make multi-token characters or words). Empty means single tokens `0..vocab_size`.
    pub units: Vec<Vec<u32>>,
    pub vocab_size: u32,
    /// Emitted (unless `ignore_eos`) when a draw lands on it; see `eos_one_in`.
    pub eos_token_id: Option<u32>,
    /// Probability 1/n per step of emitting EOS (0: never).
    pub eos_one_in: u32,
    pub block_size: u32,
    pub total_blocks: u32,
    pub cache_salt: String,
    /// Requests whose prompt + max_tokens exceed this fail with `prompt_too_long`.
    pub max_model_len: u32,
    /// A prompt containing this token fails with kind `mock_failure` (to test error paths).
    pub fail_token: Option<u32>,
    /// Keep this many most recent requests for inspection.
    pub record_requests: usize,
}

impl Default for MockEngineConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 256,
            max_running: 64,
            token_delay: Duration::from_millis(1),
            units: Vec::new(),
            vocab_size: 256,
            eos_token_id: None,
            eos_one_in: 0,
            block_size: 4,
            total_blocks: 1024,
            cache_salt: "mock".into(),
            max_model_len: 4096,
            fail_token: None,
            record_requests: 64,
        }
    }
}

/// Counters a test reads to check what the engine saw.
#[derive(Debug, Default)]
pub struct MockCounters {
    pub added: AtomicU64,
    /// Cancels that found a live (waiting or running) request.
    pub cancelled: AtomicU64,
    pub finished: AtomicU64,
    pub failed: AtomicU64,
    /// Requests dropped because their event receiver was gone without a cancel.
    pub orphaned: AtomicU64,
    pub resets: AtomicU64,
    pub recent: Mutex<VecDeque<GenerateRequest>>,
}

impl MockCounters {
    pub fn get(&self, c: &AtomicU64) -> u64 {
        c.load(Ordering::SeqCst)
    }

    /// The most recent requests, oldest first.
    pub fn recent_requests(&self) -> Vec<GenerateRequest> {
        match self.recent.lock() {
            Ok(r) => r.iter().cloned().collect(),
            Err(_) => Vec::new(),
        }
    }
}

/// A running mock replica.
pub struct MockEngine {
    pub handle: EngineHandle,
    /// Take this to feed the router's prefix mirror.
    pub kv_events: Option<tmpsc::UnboundedReceiver<KvEvent>>,
    pub counters: Arc<MockCounters>,
    pub thread: Option<JoinHandle<()>>,
}

impl MockEngine {
    pub fn spawn(config: MockEngineConfig) -> std::io::Result<Self> {
        let (cmd_tx, cmd_rx) = mpsc::sync_channel(config.queue_capacity.max(1));
        let (cancel_tx, cancel_rx) = mpsc::channel();
        let (stats_tx, stats_rx) = watch::channel(EngineStats {
            total_blocks: config.total_blocks,
            free_blocks: config.total_blocks,
            ..EngineStats::default()
        });
        let (kv_tx, kv_rx) = tmpsc::unbounded_channel();
        let counters = Arc::new(MockCounters::default());
        let mut state = MockLoop {
            config,
            commands: cmd_rx,
            cancels: cancel_rx,
            stats_tx,
            kv_tx,
            counters: counters.clone(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            cache: HashSet::new(),
            cache_order: VecDeque::new(),
            early_cancels: HashSet::new(),
            early_order: VecDeque::new(),
            stats: EngineStats::default(),
        };
        let thread = std::thread::Builder::new()
            .name("mock-engine".into())
            .spawn(move || state.run())?;
        Ok(Self {
            handle: EngineHandle::new(cmd_tx, cancel_tx, stats_rx),
            kv_events: Some(kv_rx),
            counters,
            thread: Some(thread),
        })
    }
}

struct Running {
    req: GenerateRequest,
    events: tmpsc::UnboundedSender<EngineEvent>,
    rng: u64,
    pending: VecDeque<u32>,
    generated: u32,
    cached_tokens: u32,
}

struct MockLoop {
    config: MockEngineConfig,
    commands: mpsc::Receiver<Command>,
    cancels: mpsc::Receiver<u64>,
    stats_tx: watch::Sender<EngineStats>,
    kv_tx: tmpsc::UnboundedSender<KvEvent>,
    counters: Arc<MockCounters>,
    waiting: VecDeque<Running>,
    running: Vec<Running>,
    cache: HashSet<u64>,
    cache_order: VecDeque<u64>,
    early_cancels: HashSet<u64>,
    early_order: VecDeque<u64>,
    stats: EngineStats,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl MockLoop {
    fn run(&mut self) {
        loop {
            let idle = self.running.is_empty() && self.waiting.is_empty();
            if idle {
                match self.commands.recv_timeout(Duration::from_millis(20)) {
                    Ok(cmd) => {
                        if !self.handle_command(cmd) {
                            return;
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            loop {
                match self.commands.try_recv() {
                    Ok(cmd) => {
                        if !self.handle_command(cmd) {
                            return;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        if self.running.is_empty() && self.waiting.is_empty() {
                            return;
                        }
                        break;
                    }
                }
            }
            while let Ok(id) = self.cancels.try_recv() {
                self.cancel(id);
            }
            self.admit();
            if !self.running.is_empty() {
                if !self.config.token_delay.is_zero() {
                    std::thread::sleep(self.config.token_delay);
                }
                // Cancels that arrived during the step take effect before its tokens are sent.
                while let Ok(id) = self.cancels.try_recv() {
                    self.cancel(id);
                }
                self.step();
            }
            self.publish();
        }
    }

    /// Returns false when the loop must stop.
    fn handle_command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Add { request, events } => self.add(request, events),
            Command::Cancel { id } => self.cancel(id),
            Command::ResetPrefixCache => {
                self.cache.clear();
                self.cache_order.clear();
                self.counters.resets.fetch_add(1, Ordering::SeqCst);
                let _ = self.kv_tx.send(KvEvent::Cleared);
            }
            Command::Shutdown => {
                for r in self.running.drain(..).chain(self.waiting.drain(..)) {
                    let usage = usage_of(&r);
                    let _ = r.events.send(EngineEvent::Finished {
                        reason: FinishReason::Cancelled,
                        usage,
                    });
                }
                self.publish();
                return false;
            }
        }
        true
    }

    fn add(&mut self, req: GenerateRequest, events: tmpsc::UnboundedSender<EngineEvent>) {
        self.counters.added.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut recent) = self.counters.recent.lock() {
            recent.push_back(req.clone());
            while recent.len() > self.config.record_requests {
                recent.pop_front();
            }
        }
        if self.early_cancels.remove(&req.id) {
            self.counters.cancelled.fetch_add(1, Ordering::SeqCst);
            let usage = Usage {
                prompt_tokens: req.prompt.len() as u32,
                ..Usage::default()
            };
            let _ = events.send(EngineEvent::Finished {
                reason: FinishReason::Cancelled,
                usage,
            });
            return;
        }
        let fail = |kind: &'static str, message: String| {
            let _ = events.send(EngineEvent::Failed { kind, message });
        };
        if req.prompt.is_empty() {
            self.counters.failed.fetch_add(1, Ordering::SeqCst);
            return fail("empty_prompt", "the prompt has no tokens".into());
        }
        let total = req.prompt.len() as u64 + u64::from(req.max_tokens);
        if total > u64::from(self.config.max_model_len) {
            self.counters.failed.fetch_add(1, Ordering::SeqCst);
            return fail(
                "prompt_too_long",
                format!(
                    "prompt + max_tokens = {total} > {}",
                    self.config.max_model_len
                ),
            );
        }
        if let Some(t) = self.config.fail_token
            && req.prompt.contains(&t)
        {
            self.counters.failed.fetch_add(1, Ordering::SeqCst);
            return fail("mock_failure", "the mock engine was asked to fail".into());
        }
        let mut seed = req
            .prompt
            .iter()
            .fold(0x00C0_FFEE_u64, |h, t| splitmix(h ^ u64::from(*t)));
        if req.params.temperature > 0.0 {
            seed = splitmix(seed ^ req.params.seed.unwrap_or(req.id.wrapping_mul(31)));
        }
        self.waiting.push_back(Running {
            req,
            events,
            rng: seed,
            pending: VecDeque::new(),
            generated: 0,
            cached_tokens: 0,
        });
    }

    fn cancel(&mut self, id: u64) {
        if !self.running.iter().any(|r| r.req.id == id)
            && !self.waiting.iter().any(|r| r.req.id == id)
        {
            // Cancels travel on their own channel and can overtake the request's Add: remember
            // them (bounded; a cancel of an already finished request is also kept a while).
            if self.early_cancels.insert(id) {
                self.early_order.push_back(id);
                if self.early_order.len() > 4096
                    && let Some(old) = self.early_order.pop_front()
                {
                    self.early_cancels.remove(&old);
                }
            }
            return;
        }
        let finish = |r: Running, counters: &MockCounters| {
            counters.cancelled.fetch_add(1, Ordering::SeqCst);
            let usage = usage_of(&r);
            let _ = r.events.send(EngineEvent::Finished {
                reason: FinishReason::Cancelled,
                usage,
            });
        };
        if let Some(pos) = self.running.iter().position(|r| r.req.id == id) {
            let r = self.running.swap_remove(pos);
            finish(r, &self.counters);
        } else if let Some(pos) = self.waiting.iter().position(|r| r.req.id == id)
            && let Some(r) = self.waiting.remove(pos)
        {
            finish(r, &self.counters);
        }
    }

    fn admit(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(mut r) = self.waiting.pop_front() else {
                break;
            };
            let hashes = prompt_block_hashes(
                &self.config.cache_salt,
                &r.req.prompt,
                self.config.block_size,
            );
            let hit = hashes.iter().take_while(|h| self.cache.contains(h)).count() as u32;
            let prompt_len = r.req.prompt.len() as u32;
            r.cached_tokens = (hit * self.config.block_size).min(prompt_len.saturating_sub(1));
            self.stats.prefix_cache_queries += u64::from(prompt_len);
            self.stats.prefix_cache_hits += u64::from(r.cached_tokens);
            self.stats.prompt_tokens_cached += u64::from(r.cached_tokens);
            self.stats.prompt_tokens_computed += u64::from(prompt_len - r.cached_tokens);
            let fresh: Vec<u64> = hashes
                .iter()
                .copied()
                .filter(|h| !self.cache.contains(h))
                .collect();
            if !fresh.is_empty() {
                for h in &fresh {
                    self.cache.insert(*h);
                    self.cache_order.push_back(*h);
                }
                let with_snapshot = fresh.iter().map(|_| true).collect();
                let _ = self.kv_tx.send(KvEvent::Stored {
                    hashes: fresh,
                    with_snapshot,
                });
            }
            let mut removed = Vec::new();
            while self.cache.len() > self.config.total_blocks as usize {
                match self.cache_order.pop_front() {
                    Some(h) => {
                        if self.cache.remove(&h) {
                            removed.push(h);
                        }
                    }
                    None => break,
                }
            }
            if !removed.is_empty() {
                let _ = self.kv_tx.send(KvEvent::Removed { hashes: removed });
            }
            self.running.push(r);
        }
    }

    fn next_token(&self, r: &mut Running) -> u32 {
        if let Some(t) = r.pending.pop_front() {
            return t;
        }
        r.rng = splitmix(r.rng);
        if let Some(eos) = self.config.eos_token_id
            && self.config.eos_one_in > 0
            && !r.req.ignore_eos
            && (r.rng >> 40).is_multiple_of(u64::from(self.config.eos_one_in))
        {
            return eos;
        }
        if self.config.units.is_empty() {
            return (r.rng % u64::from(self.config.vocab_size.max(1))) as u32;
        }
        let unit = &self.config.units[(r.rng % self.config.units.len() as u64) as usize];
        r.pending.extend(unit.iter().copied());
        r.pending.pop_front().unwrap_or(0)
    }

    fn step(&mut self) {
        let mut running = std::mem::take(&mut self.running);
        let mut keep = Vec::with_capacity(running.len());
        let mut late_cancels = Vec::new();
        for mut r in running.drain(..) {
            if r.generated == 0 && r.req.prompt_logprobs {
                // Scores the prompt: token p gets -(p mod 7 + 1) / 4, its alternatives below.
                let k = r.req.params.logprobs.unwrap_or(0);
                let logprobs = r
                    .req
                    .prompt
                    .iter()
                    .enumerate()
                    .map(|(p, &t)| {
                        let lp = -((p % 7) as f32 + 1.0) / 4.0;
                        (p > 0).then(|| TokenLogprob {
                            token: t,
                            logprob: lp,
                            top: (0..k).map(|j| (t + j, lp - j as f32)).collect(),
                        })
                    })
                    .collect();
                let _ = r.events.send(EngineEvent::PromptLogprobs { logprobs });
            }
            let token = self.next_token(&mut r);
            r.generated += 1;
            self.stats.generation_tokens += 1;
            let logprobs = r.req.params.logprobs.map(|k| {
                let lp = -(((r.rng >> 16) % 400) as f32) / 100.0 - 0.01;
                let vocab = self.config.vocab_size.max(1);
                let top = (0..k)
                    .map(|j| ((token + j) % vocab, lp - j as f32 * 0.5))
                    .collect();
                vec![TokenLogprob {
                    token,
                    logprob: lp,
                    top,
                }]
            });
            if r.events
                .send(EngineEvent::Tokens {
                    tokens: vec![token],
                    logprobs,
                })
                .is_err()
            {
                // The receiver went away; a cancel sent just before that counts as a cancel.
                late_cancels.extend(self.cancels.try_iter());

                if let Some(pos) = late_cancels.iter().position(|id| *id == r.req.id) {
                    late_cancels.swap_remove(pos);
                    self.counters.cancelled.fetch_add(1, Ordering::SeqCst);
                } else {
                    self.counters.orphaned.fetch_add(1, Ordering::SeqCst);
                }
                continue;
            }
            let is_eos = !r.req.ignore_eos && self.config.eos_token_id == Some(token);
            let reason = if is_eos || r.req.stop_token_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if r.generated >= r.req.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            match reason {
                Some(reason) => {
                    self.counters.finished.fetch_add(1, Ordering::SeqCst);
                    self.stats.requests_finished += 1;
                    let usage = usage_of(&r);
                    let _ = r.events.send(EngineEvent::Finished { reason, usage });
                }
                None => keep.push(r),
            }
        }
        self.running = keep;
        for id in late_cancels {
            self.cancel(id);
        }
    }

    fn publish(&mut self) {
        let bs = self.config.block_size.max(1);
        let in_use: u32 = self
            .running
            .iter()
            .map(|r| (r.req.prompt.len() as u32 + r.generated).div_ceil(bs))
            .sum();
        self.stats.step += 1;
        self.stats.running = self.running.len() as u32;
        self.stats.waiting = self.waiting.len() as u32;
        self.stats.total_blocks = self.config.total_blocks;
        self.stats.free_blocks = self.config.total_blocks.saturating_sub(in_use);
        self.stats.cached_blocks = self.cache.len() as u32;
        let next = self.stats.clone();
        // Skip no-op publications so idle loops do not wake watchers.
        self.stats_tx.send_if_modified(|cur| {
            let mut a = cur.clone();
            a.step = next.step;
            let changed = a != next;
            if changed {
                *cur = next;
            }
            changed
        });
    }
}

fn usage_of(r: &Running) -> Usage {
    Usage {
        prompt_tokens: r.req.prompt.len() as u32,
        completion_tokens: r.generated,
        cached_tokens: r.cached_tokens,
    }
}

/// Server parts in front of `replicas` mock replicas, with the embedded tokenizer: a server that
/// runs without any model (demos, client tests). Returns the replicas' counters too.
pub fn mock_app_parts(
    config: super::ServerConfig,
    replicas: usize,
    engine: MockEngineConfig,
) -> Result<(super::AppParts, Vec<Arc<MockCounters>>), String> {
    let codec = super::TextCodec::embedded().map_err(|e| e.to_string())?;
    let mut parts = Vec::new();
    let mut counters = Vec::new();
    for _ in 0..replicas.max(1) {
        let cfg = MockEngineConfig {
            vocab_size: codec.vocab_size(),
            ..engine.clone()
        };
        let mut e = MockEngine::spawn(cfg).map_err(|e| e.to_string())?;
        counters.push(e.counters.clone());
        parts.push(super::Replica {
            handle: e.handle.clone(),
            kv_events: e.kv_events.take(),
        });
    }
    let model = super::ModelInfo {
        name: "mock".into(),
        max_model_len: engine.max_model_len,
        block_size: engine.block_size,
        cache_salt: engine.cache_salt.clone(),
        num_blocks: engine.total_blocks,
        prefix_caching: true,
    };
    let app = super::AppParts {
        config,
        model,
        codec,
        replicas: parts,
        policy: Box::new(super::LeastLoaded),
        admin_hooks: None,
    };
    Ok((app, counters))
}
