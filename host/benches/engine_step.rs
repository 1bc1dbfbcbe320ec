//! Per-step cost of the engine itself (scheduling, cache bookkeeping, input building, sampling
//! and updates) with the model-free mock executor, at 1, 64 and 256 decoding requests and with
//! 100k cached blocks in the prefix index (so every new block evicts one).
//!
//! The `serving` rows stand in for `chimera serve`'s engine thread without a model: the
//! built-in Wasm sampler and evictor (as the server loads them), 64 sampler candidates per row,
//! greedy requests (what `chimera bench` sends), and every request's events read by its own
//! task on a tokio runtime, as the HTTP streams read them — so sending an event pays for waking
//! its reader — and a forward pass that sleeps 2 ms (the readers go idle in between, as they do
//! while a GPU computes). Events go out through the delivery thread `chimera serve` uses; the
//! `events inline` row sends them from the engine thread, for comparison in the same run. The
//! `churn` row keeps 256 requests of 128 prompt and 256 output tokens in flight, about one
//! finishing and one admitted a step, so most steps mix decodes with a new prompt's prefill, as
//! in `tests/gpu/run.sh serving-idle` at concurrency 256. These
//! rows report the host time per step by phase, the figures behind
//! `chimera:engine_host_seconds_total{phase}`; the mock forward pass is not part of them, nor
//! is the `overlap` column: host work done between the executor's launch and finish, while a
//! device would compute the step (the mock sleeps there).
//!
//! Run: `cargo bench -p chimera --bench engine_step` (add `-- serving` to run only the rows
//! whose name contains it). Prints a table; ratios are against the 1-request case measured in
//! the same run.

#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use chimera::cache::{ByteSize, CacheConfig};
use chimera::engine::api::{EngineEvent, GenerateRequest, SamplingParams};
use chimera::engine::outbox::Outbox;
use chimera::engine::{
    Engine, EngineConfig, EngineSetup, MockConfig, MockExecutor, Policies, StepExecutor,
    StepTimings,
};
use chimera::plugins::{PluginMetrics, PluginsConfig, PolicyConfig, PolicyPlugins};
use chimera::policy::native::DefaultSampler;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

const BS: usize = 16;
const VOCAB: usize = 32;
/// The serving rows' vocabulary: large enough for the default 64 sampler candidates.
const SERVING_VOCAB: usize = 256;
/// The serving rows' forward pass sleeps this long, as the engine thread waits for a device:
/// long enough for the stream tasks to go idle between steps, as they do in serving.
const SERVING_STEP: Duration = Duration::from_millis(2);

struct Case {
    name: &'static str,
    running: usize,
    cached_blocks: usize,
    /// Wasm policies, 64 candidates and events read by tokio tasks (see the module doc).
    serving: bool,
    /// Serving rows: the engine thread sends the events itself instead of its delivery thread.
    events_inline: bool,
    /// A hybrid model's caches (SSM slots, rolling snapshots at completed blocks), as
    /// NemotronH has.
    hybrid: bool,
    /// Serving rows: requests of 128 prompt tokens and at most 256 output tokens, the first ones
    /// staggered so about one finishes a step and a new one takes its place (its prompt is the
    /// next step's prefill chunk): the mixed steps of `tests/gpu/run.sh serving-idle`.
    churn: bool,
}

/// Prompt and output lengths of the churn rows (the GPU idle workload's).
const CHURN_PROMPT: usize = 128;
const CHURN_OUTPUT: u32 = 256;

/// The policies `chimera serve` gives a replica with the default configuration.
fn serving_policies() -> Policies {
    let plugins = PolicyPlugins::new(
        &PolicyConfig::default(),
        &PluginsConfig::default(),
        PluginMetrics::new(),
    )
    .expect("the built-in plugins load");
    Policies {
        sampler: plugins.sampler(),
        fallback_sampler: Box::new(DefaultSampler::default()),
        evictor: Some(plugins.evictor()),
        constrainer: None,
        drafter: None,
    }
}

fn make_engine(
    blocks: usize,
    max_running: usize,
    serving: bool,
    hybrid: bool,
) -> Engine<MockExecutor> {
    let exec = MockExecutor::new(MockConfig {
        vocab: if serving { SERVING_VOCAB } else { VOCAB },
        ssm_layers: if hybrid { 2 } else { 0 },
        verify_kv: false,
        step_delay: if serving {
            SERVING_STEP
        } else {
            Duration::ZERO
        },
        ..MockConfig::default()
    });
    let spec = exec.cache_spec();
    let block_bytes = spec.kv_block_bytes(BS) as u64;
    // A hybrid's slots: one live per request and as many durable ones for snapshots.
    let ssm_bytes = (2 * max_running * spec.ssm_slot_bytes()) as u64;
    let setup = EngineSetup {
        engine: EngineConfig {
            max_batched_tokens: 16384,
            max_running,
            ..Default::default()
        },
        cache: CacheConfig {
            memory_budget: Some(ByteSize(block_bytes * blocks as u64 + ssm_bytes)),
            block_size: BS,
            prefix_caching: true,
            ssm_share: hybrid.then(|| {
                let all = (block_bytes * blocks as u64 + ssm_bytes) as f64;
                (ssm_bytes as f64 + spec.ssm_slot_bytes() as f64 / 2.0) / all
            }),
            ..CacheConfig::default()
        },
        hash_salt: "bench".into(),
        speculative: Default::default(),
    };
    let policies = if serving {
        serving_policies()
    } else {
        Policies::builtin()
    };
    Engine::new(setup, exec, policies).expect("engine")
}

fn request(id: u64, prompt_len: usize, max_tokens: u32) -> GenerateRequest {
    // Distinct prompts: no prefix sharing between requests.
    let prompt = (0..prompt_len)
        .map(|i| 1 + ((id as usize * 7919 + i * 31) % (VOCAB - 1)) as u32)
        .collect::<Vec<_>>();
    let mut prompt = prompt;
    prompt[0] = 1 + (id % 31) as u32;
    prompt[1] = 1 + ((id / 31) % 31) as u32;
    prompt[2] = 1 + ((id / 961) % 31) as u32;
    prompt[3] = 1 + ((id / 29791) % 31) as u32;
    GenerateRequest {
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

fn drain(rx: &mut [UnboundedReceiver<EngineEvent>]) {
    for r in rx {
        while r.try_recv().is_ok() {}
    }
}

/// Hands each receiver to its own task on `rt`, which reads events until the channel closes
/// (the way an HTTP stream waits for its request's next event).
fn read_in_tasks(rt: &tokio::runtime::Runtime, rx: Vec<UnboundedReceiver<EngineEvent>>) {
    for mut r in rx {
        rt.spawn(async move {
            let mut events = 0u64;
            while let Some(ev) = r.recv().await {
                events += 1;
                black_box(&ev);
            }
            black_box(events);
        });
    }
}

/// Returns (µs per step, timings of the measured steps).
fn run(case: &Case) -> (f64, StepTimings) {
    let prompt = if case.churn { CHURN_PROMPT } else { 64 };
    let steps = if case.serving {
        300
    } else {
        4000 / case.running.max(1) + 200
    };
    // Room for every decoder to grow through the measured steps without preemption.
    let blocks = case.cached_blocks + case.running * ((prompt + 8 + steps) / BS + 2) + 64;
    let mut e = make_engine(blocks, case.running.max(8), case.serving, case.hybrid);
    if case.serving && !case.events_inline {
        // As `spawn_engine` sets it up.
        e.set_outbox(Outbox::threaded().expect("event delivery thread"));
    }
    // Fill the prefix index with `cached_blocks` blocks of finished requests.
    let fillers = case.cached_blocks / (prompt / BS);
    let mut id = 1_000_000u64;
    let mut rx = Vec::new();
    let mut queued = 0;
    while queued < fillers {
        for _ in 0..128.min(fillers - queued) {
            let (tx, r) = unbounded_channel();
            e.add(request(id, prompt, 1), tx);
            rx.push(r);
            id += 1;
            queued += 1;
        }
        while !e.is_idle() {
            e.step();
        }
        rx.clear();
    }
    assert!(
        e.cache().pool().indexed() >= case.cached_blocks,
        "cache not filled"
    );
    // Start the decoders and run until every one is decoding.
    let mut rx = Vec::new();
    for i in 0..case.running {
        let (tx, r) = unbounded_channel();
        let max_tokens = if case.churn {
            // Finishing one after another: about one a step once the measured steps begin.
            8 + (i * CHURN_OUTPUT as usize / case.running) as u32
        } else {
            // Decoding through the warm-up and every measured step (a request that can never
            // fit the pool is refused at admission).
            (steps + 8) as u32
        };
        e.add(request(i as u64, prompt, max_tokens), tx);
        rx.push(r);
    }
    for _ in 0..4 {
        e.step();
    }
    if e.stats().running as usize != case.running {
        let ev = rx[0].try_recv();
        panic!("decoders not running: {:?}, first event {ev:?}", e.stats());
    }
    drain(&mut rx);
    // One worker: on the GPU host the streams have cores of their own; here the engine
    // thread keeps the other one.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .expect("tokio runtime");
    if case.serving {
        read_in_tasks(&rt, std::mem::take(&mut rx));
    }
    // The cache events of the filling and warm-up steps.
    e.take_kv_events(&mut Vec::new());
    let before = *e.timings();
    let mut next_id = case.running as u64;
    let mut admitted = 0usize;
    let t = Instant::now();
    let mut kv_events = Vec::new();
    for s in 0..steps {
        black_box(e.step());
        // Handed on as `chimera serve`'s engine thread hands them to its router, outside
        // the step's phases (otherwise they pile up for the whole run).
        e.take_kv_events(&mut kv_events);
        kv_events.clear();
        if s % 64 == 0 {
            drain(&mut rx);
        }
        // Churn: a new request for every one that finished, read by a task of its own.
        // (The figures are refreshed by every step, not by `add`: count once.)
        if case.churn {
            let in_flight = (e.stats().running + e.stats().waiting) as usize;
            for _ in in_flight..case.running {
                let (tx, r) = unbounded_channel();
                e.add(request(next_id, prompt, CHURN_OUTPUT), tx);
                read_in_tasks(&rt, vec![r]);
                next_id += 1;
                admitted += 1;
            }
        }
    }
    let per_step = t.elapsed().as_secs_f64() * 1e6 / steps as f64;
    let after = *e.timings();
    if case.churn {
        // The staggered start finishes about one request a step.
        assert!(
            admitted >= steps / 2,
            "{admitted} requests admitted in {steps} steps"
        );
    } else {
        assert_eq!(e.stats().running as usize, case.running);
    }
    let d = after.since(&before);
    (per_step, d)
}

fn main() {
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_default();
    let case = |name, running, cached_blocks, serving| Case {
        name,
        running,
        cached_blocks,
        serving,
        events_inline: false,
        hybrid: false,
        churn: false,
    };
    let cases = [
        case("decode, 1 running", 1, 0, false),
        case("decode, 64 running", 64, 0, false),
        case("decode, 256 running", 256, 0, false),
        case("decode, 256 running, 100k cached", 256, 100_000, false),
        case("serving, 1 running", 1, 0, true),
        case("serving, 64 running", 64, 0, true),
        case("serving, 256 running", 256, 0, true),
        Case {
            events_inline: true,
            ..case("serving, 256 running, events inline", 256, 0, true)
        },
        Case {
            hybrid: true,
            ..case("serving, 256 running, hybrid", 256, 0, true)
        },
        Case {
            hybrid: true,
            churn: true,
            ..case("serving, 256 running, hybrid, churn", 256, 0, true)
        },
    ];
    println!(
        "{:<34} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>7} {:>8}",
        "scenario",
        "step",
        "sched",
        "inputs",
        "mock",
        "sample",
        "update",
        "host",
        "bookkeep",
        "ratio",
        "overlap"
    );
    let mut base = None;
    for c in cases.iter().filter(|c| c.name.contains(filter.as_str())) {
        // This machine is shared and noisy: keep the fastest of three runs.
        let (per_step, t) = (0..3)
            .map(|_| run(c))
            .min_by_key(|(_, t)| (t.schedule_ns + t.inputs_ns + t.update_ns) / t.steps.max(1))
            .expect("three runs");
        let us = |ns: u64| ns as f64 / 1e3 / t.steps.max(1) as f64;
        let update = t.update_ns - t.sample_ns;
        let bookkeeping = us(t.schedule_ns + t.inputs_ns + update);
        let b = *base.get_or_insert(bookkeeping);
        println!(
            "{:<34} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>10.2} {:>6.1}x {:>8.2}",
            c.name,
            per_step,
            us(t.schedule_ns),
            us(t.inputs_ns),
            us(t.execute_ns),
            us(t.sample_ns),
            us(update),
            us(t.schedule_ns + t.inputs_ns + t.update_ns),
            bookkeeping,
            bookkeeping / b,
            us(t.overlap_ns)
        );
    }
    println!("µs per step. update = the update phase without sampling: committing the step to the");
    println!(
        "cache and sending one event per request. host = sched + inputs + sample + update: the"
    );
    println!("engine's time between two forward passes (the metric's three phases together).");
    println!(
        "overlap = host work while the device computes (the previous step's events handed on)."
    );
    println!(
        "bookkeep = host without sampling. decode rows: native greedy policies, a {VOCAB}-token"
    );
    println!("vocabulary, events drained in the loop. serving rows: the built-in Wasm sampler and");
    println!(
        "evictor, 64 candidates of a {SERVING_VOCAB}-token vocabulary, events read by tokio tasks."
    );
    println!(
        "ratio = bookkeep against the first row of this run; each row is the fastest of 3 runs."
    );
}
