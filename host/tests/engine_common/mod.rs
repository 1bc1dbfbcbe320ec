//! Shared helpers for the engine behaviour tests: build an engine over any executor, feed it
//! requests at given steps, step it to completion and collect what each request received.
//! Everything is generic over `StepExecutor`, so a real model runs the same scenarios.

#![allow(dead_code)]

use std::collections::BTreeMap;

use chimera::cache::{ByteSize, CacheConfig};
use chimera::engine::api::{
    EngineEvent, FailureKind, FinishReason, GenerateRequest, KvEvent, SamplingParams, TokenLogprob,
    Usage,
};
use chimera::engine::{Engine, EngineConfig, EngineSetup, Policies, StepExecutor};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

/// The knobs the scenarios vary.
#[derive(Debug, Clone, Copy)]
pub struct Knobs {
    pub block_size: usize,
    pub blocks: usize,
    /// Durable SSM snapshot slots (hybrid executors only).
    pub snapshots: usize,
    pub max_running: usize,
    pub max_batched_tokens: usize,
    pub prefix_caching: bool,
    pub chunked_prefill: bool,
    /// `engine.schedule_ahead`.
    pub schedule_ahead: bool,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            block_size: 4,
            blocks: 256,
            snapshots: 64,
            max_running: 8,
            max_batched_tokens: 256,
            prefix_caching: true,
            chunked_prefill: true,
            schedule_ahead: true,
        }
    }
}

/// A setup whose memory budget gives exactly `k.blocks` KV blocks and `k.snapshots` durable
/// slots for `exec`'s cache spec.
pub fn setup<E: StepExecutor>(exec: &E, k: Knobs) -> EngineSetup {
    let spec = exec.cache_spec();
    let kv = (spec.kv_block_bytes(k.block_size) * k.blocks) as u64;
    let (ssm, share) = if spec.is_hybrid() {
        let slot = spec.ssm_slot_bytes() as u64;
        let slots = (k.max_running + if k.prefix_caching { k.snapshots } else { 0 }) as u64;
        let ssm = slots * slot;
        // Half a slot of slack so the share's rounding lands on exactly `slots`.
        (
            ssm,
            Some((ssm as f64 + slot as f64 / 2.0) / (kv + ssm) as f64),
        )
    } else {
        (0, None)
    };
    EngineSetup {
        engine: EngineConfig {
            max_batched_tokens: k.max_batched_tokens,
            max_running: k.max_running,
            chunked_prefill: k.chunked_prefill,
            schedule_ahead: k.schedule_ahead,
            ..Default::default()
        },
        cache: CacheConfig {
            memory_budget: Some(ByteSize(kv + ssm)),
            block_size: k.block_size,
            prefix_caching: k.prefix_caching,
            ssm_share: share,
            ..CacheConfig::default()
        },
        hash_salt: "test-model".into(),
        speculative: Default::default(),
    }
}

pub fn engine<E: StepExecutor>(exec: E, k: Knobs) -> Engine<E> {
    let s = setup(&exec, k);
    let e = Engine::new(s, exec, Policies::builtin()).expect("engine");
    assert_eq!(e.layout().num_blocks, k.blocks);
    e
}

pub fn request(id: u64, prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        id,
        prompt,
        params: SamplingParams::default(),
        max_tokens,
        stop_token_ids: vec![],
        ignore_eos: false,
        prompt_logprobs: None,
        block_hashes: None,
        checkpoints: Vec::new(),
        priority: 0,
        constraint: None,
        speculative: true,
    }
}

/// What one request received.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub finish: Option<FinishReason>,
    pub usage: Usage,
    pub failed: Option<(FailureKind, String)>,
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    /// The generated tokens' logprobs, where asked for.
    pub logprobs: Vec<TokenLogprob>,
}

#[derive(Debug, Default)]
pub struct Run {
    pub outcomes: BTreeMap<u64, Outcome>,
    pub kv_events: Vec<KvEvent>,
    pub steps: u64,
}

impl Run {
    pub fn tokens(&self) -> BTreeMap<u64, Vec<u32>> {
        self.outcomes
            .iter()
            .map(|(&id, o)| (id, o.tokens.clone()))
            .collect()
    }
}

/// Submits each request at its step (relative to the start of this call), steps until every
/// request ended, and checks the cache invariants after every step.
pub fn drive<E: StepExecutor>(
    engine: &mut Engine<E>,
    arrivals: Vec<(u64, GenerateRequest)>,
) -> Run {
    drive_with(engine, arrivals, |_, _| {})
}

/// Like [`drive`], calling `each_step(engine, step)` after every step (e.g. to cancel).
pub fn drive_with<E: StepExecutor>(
    engine: &mut Engine<E>,
    arrivals: Vec<(u64, GenerateRequest)>,
    each_step: impl FnMut(&mut Engine<E>, u64),
) -> Run {
    drive_inner(engine, arrivals, false, each_step)
}

/// Like [`drive`], but a request due at step `k` arrives while step `k - 1` computes: it is
/// handed to the engine between [`Engine::begin_step`] and [`Engine::complete_step`] and
/// offered to the step scheduled ahead ([`Engine::top_up`]), as the engine thread does; it
/// joins that step when its window is still open (the output not in yet), else step `k`.
pub fn drive_arriving<E: StepExecutor>(
    engine: &mut Engine<E>,
    arrivals: Vec<(u64, GenerateRequest)>,
) -> Run {
    drive_inner(engine, arrivals, true, |_, _| {})
}

fn drive_inner<E: StepExecutor>(
    engine: &mut Engine<E>,
    mut arrivals: Vec<(u64, GenerateRequest)>,
    mid_step: bool,
    mut each_step: impl FnMut(&mut Engine<E>, u64),
) -> Run {
    arrivals.sort_by_key(|a| a.0);
    let mut arrivals = arrivals.into_iter().peekable();
    let mut rx: BTreeMap<u64, UnboundedReceiver<EngineEvent>> = BTreeMap::new();
    let mut run = Run::default();
    let mut step = 0u64;
    type Streams = BTreeMap<u64, UnboundedReceiver<EngineEvent>>;
    fn add<E: StepExecutor>(
        e: &mut Engine<E>,
        run: &mut Run,
        rx: &mut Streams,
        r: GenerateRequest,
    ) {
        let (tx, events) = unbounded_channel();
        run.outcomes.insert(r.id, Outcome::default());
        rx.insert(r.id, events);
        e.add(r, tx);
    }
    loop {
        // Due now; with `mid_step`, also those due at the next step, to arrive during this one.
        let ahead = u64::from(mid_step);
        let mut later = Vec::new();
        while let Some((at, req)) = arrivals.next_if(|a| a.0 <= step + ahead) {
            if at <= step {
                add(engine, &mut run, &mut rx, req);
            } else {
                later.push(req);
            }
        }
        // As the engine thread does: arrivals taken in while the step computes join the step
        // scheduled ahead when its window is open.
        if engine.begin_step() {
            for req in later.drain(..) {
                add(engine, &mut run, &mut rx, req);
            }
            engine.top_up();
            engine.complete_step();
        }
        for req in later {
            add(engine, &mut run, &mut rx, req);
        }
        engine.cache().check_invariants().expect("cache invariants");
        each_step(engine, step);
        engine.take_kv_events(&mut run.kv_events);
        step += 1;
        collect(&mut rx, &mut run);
        if arrivals.peek().is_none() && rx.is_empty() {
            // A request's last event can go out before a step scheduled ahead that still
            // held it is applied: run that step too, so the engine holds nothing after.
            while !engine.is_idle() {
                assert!(engine.step(), "requests left that never run");
                engine.cache().check_invariants().expect("cache invariants");
                step += 1;
            }
            break;
        }
        assert!(step < 100_000, "the engine made no progress");
    }
    run.steps = step;
    run
}

fn collect(rx: &mut BTreeMap<u64, UnboundedReceiver<EngineEvent>>, run: &mut Run) {
    let mut done = Vec::new();
    for (&id, r) in rx.iter_mut() {
        let o = run.outcomes.entry(id).or_default();
        while let Ok(ev) = r.try_recv() {
            match ev {
                EngineEvent::Tokens { tokens, logprobs } => {
                    o.tokens.extend(tokens);
                    o.logprobs.extend(logprobs.into_iter().flatten());
                }
                EngineEvent::PromptLogprobs { logprobs } => o.prompt_logprobs = Some(logprobs),
                EngineEvent::Finished { reason, usage } => {
                    o.finish = Some(reason);
                    o.usage = usage;
                    done.push(id);
                }
                EngineEvent::Failed { kind, message } => {
                    o.failed = Some((kind, message));
                    done.push(id);
                }
            }
        }
    }
    for id in done {
        rx.remove(&id);
    }
}

/// A deterministic token stream (xorshift) for building prompts.
pub struct Tokens(u64);

impl Tokens {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self, vocab: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        // Token 0 is the mock's EOS: keep it out of prompts.
        1 + (self.0 % u64::from(vocab - 1)) as u32
    }
    pub fn take(&mut self, n: usize, vocab: u32) -> Vec<u32> {
        (0..n).map(|_| self.next(vocab)).collect()
    }
}

/// A workload of requests sharing prefixes at several depths, arriving over time.
pub fn shared_prefix_workload(seed: u64, n: usize, vocab: u32) -> Vec<(u64, GenerateRequest)> {
    let mut t = Tokens::new(seed);
    let roots: Vec<Vec<u32>> = (0..3).map(|_| t.take(13, vocab)).collect();
    (0..n as u64)
        .map(|i| {
            let root = &roots[(i % 3) as usize];
            let keep = [4, 9, 13, 6][(i % 4) as usize];
            let tail = (i as usize * 7) % 9;
            let mut prompt = root[..keep].to_vec();
            prompt.extend(t.take(tail, vocab));
            if prompt.len() < 2 {
                prompt.push(t.next(vocab));
            }
            let max_tokens = 1 + (i as u32 * 5) % 9;
            (i / 2 * 3, request(i, prompt, max_tokens))
        })
        .collect()
}
