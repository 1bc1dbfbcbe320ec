//! Speculative decoding on the GPU.
//!
//! `spec` (correctness): every fixture architecture through the engine with prompt-lookup
//! drafts on the CUDA backend in f32 mode gives the CPU's tokens and accepts the same drafts
//! (the verify chunk, per-position recurrent states and rollback agree with the oracle); in
//! bf16 the tokens with speculation on are compared with off (reported: a verify chunk runs
//! the prompt path's kernels, a decode the GEMV's, so bf16 rounding differs).
//!
//! `bench-spec` (speed, bf16 serving mode, dummy 8B weights): one request at context 2048
//! decoding through the engine with CUDA graphs, plain and with `k` = 1, 2, 4 drafts of the
//! target's own continuation (a replayed earlier run: [`ReplayDrafter`]; bf16 verify steps
//! round differently from decodes, so each `k` replays its own runs until they agree or four
//! tries pass), for the verify step's cost over a plain decode step (plain steps in the run
//! charged at the plain run's time); then drafts accepted at a rate that gives a mean
//! acceptance length near 2.5, for the tokens per second one user gets; then batches of 64 and
//! 256 with speculation left on (`max_batch` 16 switches it off there) against off.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::unbounded_channel;

use super::{GpuCheckArgs, Report};
use chimera::backend::StepBackend;
use chimera::backend::cpu::CpuBackend;
use chimera::backend::cuda::CudaBackend;
use chimera::cache::{ByteSize, CacheConfig};
use chimera::engine::api::{EngineEvent, EngineStats, GenerateRequest};
use chimera::engine::speculative::{Drafter, ReplayDrafter, SpeculativeConfig};
use chimera::engine::{Engine, EngineConfig, EngineSetup, ModelRunner, Policies};
use chimera::model::{self, Model};

const SUITE: &str = "spec";
const BENCH: &str = "bench-spec";

/// What one engine run produced.
struct Run {
    tokens: BTreeMap<u64, Vec<u32>>,
    stats: EngineStats,
    /// Wall time from the step after which every request had its first token to the end.
    decode_s: f64,
    /// Tokens generated in that time.
    decode_tokens: usize,
}

struct Job<'a> {
    prompts: &'a [Vec<u32>],
    max_tokens: u32,
    spec: SpeculativeConfig,
    drafter: Option<Box<dyn Drafter>>,
    budget: u64,
    max_running: usize,
    graphs: bool,
}

fn drive<B: StepBackend>(backend: B, m: Arc<Model<B>>, job: Job<'_>) -> anyhow::Result<Run> {
    let setup = EngineSetup {
        engine: EngineConfig {
            max_batched_tokens: 4096,
            max_running: job.max_running,
            cuda_graphs: job.graphs,
            ..Default::default()
        },
        cache: CacheConfig {
            memory_budget: Some(ByteSize(job.budget)),
            block_size: 16,
            prefix_caching: true,
            ..Default::default()
        },
        hash_salt: "gpu-check-spec".into(),
        speculative: job.spec.clone(),
    };
    let mut engine = Engine::new(setup, ModelRunner::new(backend, m), Policies::builtin())?;
    if let Some(d) = job.drafter {
        engine.set_drafter(job.spec.clone(), d);
    }
    let mut rx = BTreeMap::new();
    for (i, p) in job.prompts.iter().enumerate() {
        let (tx, r) = unbounded_channel();
        engine.add(
            GenerateRequest::greedy(i as u64, p.clone(), job.max_tokens),
            tx,
        );
        rx.insert(i as u64, r);
    }
    let mut tokens: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let (mut done, mut started, mut at_start) = (0, None, 0);
    for _ in 0..1_000_000 {
        engine.step();
        for (&id, r) in rx.iter_mut() {
            while let Ok(ev) = r.try_recv() {
                match ev {
                    EngineEvent::Tokens { tokens: t, .. } => {
                        tokens.entry(id).or_default().extend(t)
                    }
                    EngineEvent::Finished { .. } => done += 1,
                    EngineEvent::Failed { message, .. } => {
                        anyhow::bail!("request {id} failed: {message}")
                    }
                    EngineEvent::PromptLogprobs { .. } => {}
                }
            }
        }
        if started.is_none() && tokens.len() == job.prompts.len() {
            started = Some(Instant::now());
            at_start = tokens.values().map(Vec::len).sum();
        }
        if done == job.prompts.len() {
            break;
        }
    }
    anyhow::ensure!(done == job.prompts.len(), "the engine did not finish");
    let total: usize = tokens.values().map(Vec::len).sum();
    Ok(Run {
        decode_s: started.map_or(0.0, |t| t.elapsed().as_secs_f64()),
        decode_tokens: total - at_start,
        tokens,
        stats: engine.stats().clone(),
    })
}

/// Eager steps at the plan level, context 2048, batch 1: a plain decode and verify chunks of
/// 1 + k tokens (every position sampled, the recurrent state snapshotted after each draft
/// position on a hybrid), each timed over 50 steps, and where the device time of the plain and
/// the k = 4 step goes (per kernel, five steps profiled).
fn profile_steps(
    report: &mut Report,
    gpu: &CudaBackend,
    m: &Model<CudaBackend>,
    name: &str,
) -> anyhow::Result<()> {
    use chimera::backend::StepPlan;
    use chimera::backend::sample::SampleOut;
    const CONTEXT: usize = 2048;
    const BLOCK: usize = 16;
    let hybrid = m.info.cache.is_hybrid();
    let per_seq = (CONTEXT + 8).div_ceil(BLOCK);
    let mut caches = m.new_caches(gpu, per_seq, BLOCK, if hybrid { 5 } else { 1 })?;
    let table: Vec<u32> = (0..per_seq as u32).collect();
    let plan_of = |k: usize| -> anyhow::Result<StepPlan> {
        let mut plan = StepPlan::new(BLOCK);
        let chunk = plan.push(&[17], CONTEXT, &table, 0, true);
        chunk.sample_all = k > 0;
        let drafts: Vec<u32> = (0..k as u32).map(|j| 100 + j).collect();
        plan.extend_last(&drafts);
        if hybrid {
            for j in 0..k {
                plan.snapshot(j + 1, 1 + j as u32);
            }
        }
        plan.finish()?;
        let rows = plan.sample_rows.len();
        super::bench::plain_sampling(&mut plan, rows);
        Ok(plan)
    };
    let mut step = gpu.new_step(64)?;
    let mut out = SampleOut::default();
    let mut base_ms = 0.0;
    for k in [0usize, 1, 2, 4] {
        let plan = plan_of(k)?;
        let mut one = || -> anyhow::Result<()> {
            gpu.upload_step(&plan, &mut step)?;
            let mut logits = m.forward(gpu, &step, &mut caches)?;
            gpu.sample(&mut logits, &step, &mut out)?;
            Ok(())
        };
        for _ in 0..3 {
            one()?;
        }
        gpu.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..50 {
            one()?;
        }
        gpu.synchronize()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3 / 50.0;
        if k == 0 {
            base_ms = ms;
        }
        report.push(
            BENCH,
            format!(
                "{name} bs1 eager step, plan level: 1 + {k} tokens over a plain decode (reported)"
            ),
            ms / base_ms,
            format!("{:.3}× ({ms:.3} ms)", ms / base_ms),
            "reported".into(),
            true,
        );
        if k == 0 || k == 4 {
            const PROFILED: usize = 5;
            let ops = gpu.profile_ops(|| -> anyhow::Result<()> {
                for _ in 0..PROFILED {
                    one()?;
                }
                Ok(())
            })?;
            let total: f64 = ops.iter().map(|o| o.ms).sum::<f64>() / PROFILED as f64;
            for o in ops.iter().take(10) {
                let us = o.ms * 1e3 / PROFILED as f64;
                report.push(
                    BENCH,
                    format!(
                        "{name} bs1 eager 1+{k} tokens: device time of {} ({} a step; all ops {total:.2} ms; reported)",
                        o.name,
                        o.calls / PROFILED
                    ),
                    us,
                    format!("{us:.0} µs"),
                    "reported".into(),
                    true,
                );
            }
        }
    }
    Ok(())
}

/// How a timed run's steps ran: graph kinds, the device's idle share between steps.
fn report_run(report: &mut Report, name: &str, label: &str, r: &Run) {
    let s = &r.stats;
    let idle = s.device_idle_seconds / s.device_busy_seconds.max(1e-9);
    report.push(
        BENCH,
        format!("{name} bs1 {label}: steps eager / decode graph / mixed graph, device idle over busy (reported)"),
        idle,
        format!(
            "{} / {} / {}, idle {:.1} %",
            s.steps_eager,
            s.steps_decode_graph,
            s.steps_mixed_graph,
            100.0 * idle
        ),
        "reported".into(),
        true,
    );
}

fn ngram(k: usize) -> SpeculativeConfig {
    SpeculativeConfig {
        method: "ngram".into(),
        num_tokens: k,
        max_batch: 8,
        prompt_lookup_min: 1,
        prompt_lookup_max: 3,
        ..Default::default()
    }
}

/// Prompts with repetition (prompt lookup finds drafts) and without.
fn fixture_prompts() -> Vec<Vec<u32>> {
    let unit: Vec<u32> = (0..7).map(|j| (j * 37 + 11) % 400 + 5).collect();
    let rep: Vec<u32> = unit.iter().cycle().take(40).copied().collect();
    let other: Vec<u32> = (0..30).map(|j| (j * 53 + 7) % 400 + 5).collect();
    vec![
        rep.clone(),
        other.clone(),
        [&other[..20], &rep[..19]].concat(),
    ]
}

/// The `spec` suite.
pub fn checks(
    report: &mut Report,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    args: &GpuCheckArgs,
) {
    mtp_checks(report, f32_gpu, args);
    let prompts = fixture_prompts();
    for name in [
        "llama-gqa",
        "mamba2-g2",
        "nemotronh-a",
        "bamba-b",
        "granite-moe",
        "falconh1-b",
        "qwen3next-a",
        "qwen35-vl-b",
        "qwen35moe-a",
    ] {
        let dir = args.fixtures.join(name);
        let label = format!(
            "{name} f32 engine, prompt-lookup drafts (k=4): tokens and accepted drafts GPU = CPU"
        );
        let result = (|| -> anyhow::Result<(Run, Run)> {
            let job = || Job {
                prompts: &prompts,
                max_tokens: 24,
                spec: ngram(4),
                drafter: None,
                budget: 64 << 20,
                max_running: 8,
                graphs: true,
            };
            let cpu = CpuBackend::default();
            let c = drive(cpu.clone(), Arc::new(model::load(&dir, &cpu)?), job())?;
            let g = drive(
                f32_gpu.replica()?,
                Arc::new(model::load(&dir, f32_gpu)?),
                job(),
            )?;
            Ok((c, g))
        })();
        report_same(report, label, result);
        let label = format!("{name} bf16 engine: tokens with drafts = without (reported)");
        let result = (|| -> anyhow::Result<(Run, Run)> {
            let m = Arc::new(model::load(&dir, bf16_gpu)?);
            let job = |spec: SpeculativeConfig| Job {
                prompts: &prompts,
                max_tokens: 24,
                spec,
                drafter: None,
                budget: 64 << 20,
                max_running: 8,
                graphs: true,
            };
            let on = drive(bf16_gpu.replica()?, m.clone(), job(ngram(4)))?;
            let off = drive(bf16_gpu.replica()?, m, job(SpeculativeConfig::default()))?;
            Ok((on, off))
        })();
        match result {
            Ok((on, off)) => {
                let n: usize = off.tokens.values().map(Vec::len).sum();
                let same: usize = off
                    .tokens
                    .iter()
                    .map(|(id, t)| {
                        let o = &on.tokens[id];
                        t.iter().zip(o).take_while(|(a, b)| a == b).count()
                    })
                    .sum();
                report.push(
                    SUITE,
                    label,
                    same as f64,
                    format!("{same}/{n} leading tokens equal"),
                    "reported".into(),
                    true,
                );
            }
            Err(e) => report.failed(SUITE, label, format!("{e:#}")),
        }
    }
}

/// The row of a CPU-against-GPU engine comparison: the same tokens and the same drafts
/// accepted, some drafted.
fn report_same(report: &mut Report, label: String, result: anyhow::Result<(Run, Run)>) {
    match result {
        Ok((c, g)) => {
            let same = c.tokens == g.tokens
                && c.stats.spec_accepted_tokens == g.stats.spec_accepted_tokens
                && c.stats.spec_draft_tokens == g.stats.spec_draft_tokens;
            report.push(
                SUITE,
                label,
                if same { 1.0 } else { 0.0 },
                format!(
                    "{} ({}/{} accepted)",
                    if same { "identical" } else { "DIFFER" },
                    g.stats.spec_accepted_tokens,
                    g.stats.spec_draft_tokens
                ),
                format!(
                    "identical ({}/{})",
                    c.stats.spec_accepted_tokens, c.stats.spec_draft_tokens
                ),
                same && g.stats.spec_draft_tokens > 0,
            );
        }
        Err(e) => report.failed(SUITE, label, format!("{e:#}")),
    }
}

/// MTP-head speculation on the fixtures with a head: the f32 CUDA engine gives the CPU's
/// tokens and drafts (the head's pass over every kept row, its chains, the row gathers).
fn mtp_checks(report: &mut Report, f32_gpu: &CudaBackend, args: &GpuCheckArgs) {
    let prompts = fixture_prompts();
    let spec = SpeculativeConfig {
        method: "mtp".into(),
        num_tokens: 3,
        max_batch: 8,
        ..Default::default()
    };
    let options = model::LoadOptions {
        mtp: true,
        ..Default::default()
    };
    for name in ["qwen35-a-mtp", "qwen3next-a-mtp"] {
        let dir = args.fixtures.join(name);
        let label = format!(
            "{name} f32 engine, MTP-head drafts (k=3): tokens and accepted drafts GPU = CPU"
        );
        let result = (|| -> anyhow::Result<(Run, Run)> {
            let job = || Job {
                prompts: &prompts,
                max_tokens: 24,
                spec: spec.clone(),
                drafter: None,
                budget: 64 << 20,
                max_running: 8,
                graphs: true,
            };
            let cpu = CpuBackend::default();
            let c = drive(
                cpu.clone(),
                Arc::new(model::load_with(&dir, &cpu, options)?),
                job(),
            )?;
            let g = drive(
                f32_gpu.replica()?,
                Arc::new(model::load_with(&dir, f32_gpu, options)?),
                job(),
            )?;
            Ok((c, g))
        })();
        report_same(report, label, result);
    }
}

/// The `bench-spec` suite.
pub fn bench(report: &mut Report, gpu: &CudaBackend, args: &GpuCheckArgs) {
    for dir in [&args.hybrid_model, &args.bench_model] {
        if let Err(e) = bench_model(report, gpu, dir) {
            report.failed(BENCH, format!("{}", dir.display()), format!("{e:#}"));
        }
    }
}

fn bench_model(
    report: &mut Report,
    gpu: &CudaBackend,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    const CONTEXT: usize = 2048;
    const TOKENS: u32 = 160;
    let m = Arc::new(model::load_dummy(dir, gpu, 0)?);
    let name = m.info.architecture.clone();
    let vocab = m.info.vocab_size as u32;
    let prompt: Vec<u32> = (0..CONTEXT as u32)
        .map(|j| (j * 7919 + 13) % (vocab - 10) + 5)
        .collect();
    let prompts = vec![prompt];
    let budget = 8u64 << 30;
    let plain = |prompts: &[Vec<u32>], max_running, budget| -> anyhow::Result<Run> {
        drive(
            gpu.replica()?,
            m.clone(),
            Job {
                prompts,
                max_tokens: TOKENS,
                spec: SpeculativeConfig::default(),
                drafter: None,
                budget,
                max_running,
                graphs: true,
            },
        )
    };
    // Warm-up (graph capture), then the plain decode step.
    plain(&prompts, 4, budget)?;
    let base = plain(&prompts, 4, budget)?;
    let step_ms = base.decode_s * 1e3 / base.decode_tokens as f64;
    report.push(
        BENCH,
        format!("{name} bs1 ctx{CONTEXT}: plain decode step (engine, graphs)"),
        step_ms,
        format!("{step_ms:.3} ms"),
        "reported".into(),
        true,
    );
    let answers: HashMap<u64, Vec<u32>> = base
        .tokens
        .iter()
        .map(|(&id, t)| (id, [&prompts[id as usize][..], &t[..]].concat()))
        .collect();
    let with = |k: usize,
                accept: f64,
                prompts: &[Vec<u32>],
                max_running,
                budget,
                answers: &HashMap<u64, Vec<u32>>|
     -> anyhow::Result<Run> {
        let spec = SpeculativeConfig {
            method: "ngram".into(),
            num_tokens: k,
            max_batch: 16,
            ..Default::default()
        };
        drive(
            gpu.replica()?,
            m.clone(),
            Job {
                prompts,
                max_tokens: TOKENS,
                spec: spec.clone(),
                drafter: Some(Box::new(ReplayDrafter {
                    answers: answers.clone(),
                    accept,
                })),
                budget,
                max_running,
                graphs: true,
            },
        )
    };
    report_run(report, &name, "plain", &base);
    // bf16 verify steps round differently from decode steps, so the plain run's continuation
    // is not always the one a verify run produces: each k replays its own runs' output until
    // every draft is accepted (the target's own continuation under speculation).
    let own = |r: &Run| -> HashMap<u64, Vec<u32>> {
        r.tokens
            .iter()
            .map(|(&id, t)| (id, [&prompts[id as usize][..], &t[..]].concat()))
            .collect()
    };
    // Runs at acceptance `accept` until the output is the continuation the drafter replays
    // (a fixed point: with `accept` < 1 the verify steps fall elsewhere than in a run that
    // accepts every draft, and round differently).
    let settle = |k: usize, accept: f64| -> anyhow::Result<HashMap<u64, Vec<u32>>> {
        let mut answers = answers.clone();
        for _ in 0..4 {
            let r = with(k, accept, &prompts, 4, budget, &answers)?;
            let next = own(&r);
            if next == answers {
                break;
            }
            answers = next;
        }
        Ok(answers)
    };
    // A run mixes verify steps with plain decodes (a draft rejected, or a request backing off):
    // the plain ones are charged at the plain run's step time. (verify over plain, verify ms,
    // plain steps.)
    let verify_cost = |r: &Run| -> (f64, f64, f64) {
        let verify = r.stats.spec_drafts.max(1) as f64;
        let plain_steps = r.stats.engine_steps.saturating_sub(1 + r.stats.spec_drafts) as f64;
        let verify_ms = (r.decode_s * 1e3 - plain_steps * step_ms).max(0.0) / verify;
        (verify_ms / step_ms, verify_ms, plain_steps)
    };
    for (k, bound) in [(1usize, 1.10), (2, 1.15), (4, 1.30)] {
        let answers = settle(k, 1.0)?;
        let r = with(k, 1.0, &prompts, 4, budget, &answers)?;
        report_run(report, &name, &format!("k={k}"), &r);
        let (ratio, verify_ms, plain_steps) = verify_cost(&r);
        report.push(
            BENCH,
            format!("{name} bs1: verify step with k={k} drafts over a plain decode step"),
            ratio,
            format!(
                "{ratio:.3}× ({verify_ms:.3} ms; {} verify + {plain_steps} plain steps, {}/{} accepted)",
                r.stats.spec_drafts, r.stats.spec_accepted_tokens, r.stats.spec_draft_tokens
            ),
            format!("≤ {bound:.2}×"),
            ratio <= bound,
        );
    }
    // Mamba2 layers: the same verify steps with the prompts' scan on the chunked SSD instead of
    // token by token (`ssm_recurrent`), for comparison in the same run.
    if m.info.cache.ssm_layers > 0 {
        gpu.set_ssm_recurrent_tokens(0);
        for k in [1usize, 2, 4] {
            let answers = settle(k, 1.0)?;
            let r = with(k, 1.0, &prompts, 4, budget, &answers)?;
            let (ratio, verify_ms, plain_steps) = verify_cost(&r);
            report.push(
                BENCH,
                format!("{name} bs1: verify step with k={k} drafts over a plain decode step, Mamba2 prompts on the chunked SSD (for comparison)"),
                ratio,
                format!("{ratio:.3}× ({verify_ms:.3} ms; {} verify + {plain_steps} plain steps)", r.stats.spec_drafts),
                "reported".into(),
                true,
            );
        }
        gpu.set_ssm_recurrent_tokens(chimera_kernels::ssm::RECURRENT_TOKENS);
    }
    // A mean acceptance length near 2.5: per-draft acceptance p with 1 + p + … + p^k ≈ 2.5
    // (k = 3: p = 0.69, 2.49; k = 4: p = 0.645, 2.50). The target (≥ 2× the tokens/s of plain
    // decoding at length 2.5) scales with the length the run reached; a run that stays below
    // 2.3 cannot show it and fails as such (it passed by default before).
    for (k, accept) in [(3usize, 0.69), (4, 0.645)] {
        let answers = settle(k, accept)?;
        let r = with(k, accept, &prompts, 4, budget, &answers)?;
        let len = 1.0 + r.stats.spec_accepted_tokens as f64 / r.stats.spec_drafts.max(1) as f64;
        let speedup =
            (r.decode_tokens as f64 / r.decode_s) / (base.decode_tokens as f64 / base.decode_s);
        let want = 2.0 * len / 2.5;
        report.push(
            BENCH,
            format!("{name} bs1: tokens/s with k={k}, acceptance length {len:.2}, over plain"),
            speedup,
            format!("{speedup:.2}×"),
            if len < 2.3 {
                format!("≥ 2× at length 2.5 (length {len:.2} reached: below 2.3, not shown)")
            } else {
                format!("≥ {want:.2}× (2× at length 2.5)")
            },
            len >= 2.3 && speedup >= want,
        );
    }
    profile_steps(report, gpu, &m, &name)?;
    // Serving batches: speculation left on (max_batch 16 turns it off above 16 running).
    for batch in [64usize, 256] {
        let ctx = 512;
        let prompts: Vec<Vec<u32>> = (0..batch as u32)
            .map(|i| {
                (0..ctx as u32)
                    .map(|j| (j * 7919 + i * 104_729 + 13) % (vocab - 10) + 5)
                    .collect()
            })
            .collect();
        let budget = 40u64 << 30;
        let off = plain(&prompts, batch, budget)?;
        let answers: HashMap<u64, Vec<u32>> = off
            .tokens
            .iter()
            .map(|(&id, t)| (id, [&prompts[id as usize][..], &t[..]].concat()))
            .collect();
        let on = with(4, 0.69, &prompts, batch, budget, &answers)?;
        let ratio =
            (on.decode_tokens as f64 / on.decode_s) / (off.decode_tokens as f64 / off.decode_s);
        report.push(
            BENCH,
            format!("{name} bs{batch} ctx{ctx}: throughput with speculation on over off ({} verify steps)", on.stats.spec_drafts),
            ratio,
            format!("{ratio:.3}×"),
            "≥ 0.97×".into(),
            ratio >= 0.97,
        );
    }
    Ok(())
}
