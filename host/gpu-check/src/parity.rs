//! The `parity` suite: the Llama fixtures end to end on the GPU against the CPU reference.
//!
//! In f32 mode: full-forward logits (worst max|Δlogit| over the logits' scale ≤ 1e-4, as the
//! CPU-vs-transformers parity test measures), a 32-step greedy continuation identical to the
//! CPU's, chunked prefill equal to one shot, a batch equal to each sequence alone, and the
//! engine with prefix caching on equal to off. In bf16 mode the logits of the same prompts are
//! written to `--dump` for `tests/gpu/hf_bf16.py`, which sets them against transformers' own
//! bf16 error on the same GPU, and greedy agreement with the CPU is reported.

use std::collections::BTreeMap;
use std::path::Path;

use tokio::sync::mpsc::unbounded_channel;

use super::{GpuCheckArgs, Report};
use chimera::backend::cpu::CpuBackend;
use chimera::backend::cuda::CudaBackend;
use chimera::backend::{StepBackend, StepPlan};
use chimera::cache::{ByteSize, CacheConfig};
use chimera::engine::api::{EngineEvent, GenerateRequest, SamplingParams};
use chimera::engine::{Engine, EngineConfig, EngineSetup, ModelRunner, Policies};
use chimera::model::{self, LogitsMode, Model};

const BLOCK: usize = 16;
const SUITE: &str = "parity";

fn scale(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).fold(1e-6, f32::max)
}

/// max |a − b| over the reference's largest magnitude (NaN anywhere: infinite).
pub(super) fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.iter().any(|x| x.is_nan()) {
        return f64::INFINITY;
    }
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    f64::from(d / scale(b))
}

/// Logits of every position of `tokens` in one chunk.
pub(super) fn full<B: StepBackend>(
    m: &Model<B>,
    b: &B,
    tokens: &[u32],
) -> anyhow::Result<Vec<f32>> {
    let blocks = tokens.len().div_ceil(BLOCK);
    let mut caches = m.new_caches(b, blocks, BLOCK, 1)?;
    let mut plan = StepPlan::new(BLOCK);
    let table: Vec<u32> = (0..blocks as u32).collect();
    plan.push(tokens, 0, &table, 0, true);
    Ok(m.forward_host(b, &mut plan, &mut caches, LogitsMode::All)?)
}

/// The last position's logits after prefilling `tokens` in chunks of `chunk`.
fn chunked_last<B: StepBackend>(
    m: &Model<B>,
    b: &B,
    tokens: &[u32],
    chunk: usize,
) -> anyhow::Result<Vec<f32>> {
    let blocks = tokens.len().div_ceil(BLOCK);
    let mut caches = m.new_caches(b, blocks, BLOCK, 1)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut plan = StepPlan::new(BLOCK);
    let mut out = Vec::new();
    for (i, c) in tokens.chunks(chunk).enumerate() {
        plan.clear(BLOCK);
        plan.push(c, i * chunk, &table, 0, true);
        out = m.forward_host(b, &mut plan, &mut caches, LogitsMode::Last)?;
    }
    Ok(out)
}

/// The last logits of every prompt, run as one batch (each sequence with its own blocks and
/// its own zeroed SSM slot).
fn batched_last<B: StepBackend>(
    m: &Model<B>,
    b: &B,
    prompts: &[Vec<u32>],
) -> anyhow::Result<Vec<f32>> {
    let blocks: Vec<usize> = prompts.iter().map(|p| p.len().div_ceil(BLOCK)).collect();
    let total: usize = blocks.iter().sum();
    let mut caches = m.new_caches(b, total, BLOCK, prompts.len())?;
    let mut plan = StepPlan::new(BLOCK);
    let mut next = 0u32;
    for (i, (p, &nb)) in prompts.iter().zip(&blocks).enumerate() {
        let table: Vec<u32> = (next..next + nb as u32).collect();
        next += nb as u32;
        plan.push(p, 0, &table, i as u32, true);
        plan.slot_ops
            .push(chimera::backend::SlotOp::Zero { slot: i as u32 });
    }
    Ok(m.forward_host(b, &mut plan, &mut caches, LogitsMode::Last)?)
}

pub(super) fn prompts(dir: &Path) -> anyhow::Result<Vec<Vec<u32>>> {
    let bytes = std::fs::read(dir.join("reference.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)?;
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
    let lens = meta["prompt_lengths"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("reference.json: no prompt_lengths"))?;
    lens.iter()
        .map(|l| {
            let len = l.as_u64().unwrap_or(0);
            let t = st.tensor(&format!("prompt_{len}"))?;
            Ok(t.data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
                .collect())
        })
        .collect()
}

pub fn run(
    report: &mut Report,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    args: &GpuCheckArgs,
) {
    // The hybrid fixtures run in the `hybrid` suite.
    run_fixtures(report, f32_gpu, bf16_gpu, args, &["llama"]);
}

/// Every fixture the `parity` and `hybrid` suites run end to end (the Llama fixtures and the
/// Mamba2 hybrids the CUDA backend serves), with nothing else of those suites: the f32 rows and
/// the bf16 logits dumped for `tests/gpu/hf_bf16.py` (`--suite fixtures`).
pub(super) fn run_all_fixtures(
    report: &mut Report,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    args: &GpuCheckArgs,
) {
    run_fixtures(
        report,
        f32_gpu,
        bf16_gpu,
        args,
        &[
            "llama",
            "mamba2-",
            "nemotronh-",
            "bamba-",
            "granite-",
            "falconh1-",
            "qwen3next-",
            "qwen35",
        ],
    );
}

/// Runs [`fixture`] on every fixture folder whose name starts with one of `prefixes` (and that
/// has a `reference.json`), in name order.
pub(super) fn run_fixtures(
    report: &mut Report,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    args: &GpuCheckArgs,
    prefixes: &[&str],
) {
    let mut dirs: Vec<_> = match std::fs::read_dir(&args.fixtures) {
        Ok(d) => d.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(e) => {
            report.failed(SUITE, format!("fixtures in {}", args.fixtures.display()), e);
            return;
        }
    };
    dirs.sort();
    for dir in dirs {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let covered = prefixes.iter().any(|p| name.starts_with(p));
        if !covered || !dir.join("reference.json").exists() {
            continue;
        }
        if let Err(e) = fixture(report, &dir, &name, f32_gpu, bf16_gpu, args) {
            report.failed(SUITE, name.clone(), format!("{e:#}"));
        }
    }
}

pub(super) fn fixture(
    report: &mut Report,
    dir: &Path,
    name: &str,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    args: &GpuCheckArgs,
) -> anyhow::Result<()> {
    let cpu = CpuBackend::default();
    let mc = model::load(dir, &cpu)?;
    let mg = model::load(dir, f32_gpu)?;
    let mb = model::load(dir, bf16_gpu)?;
    let prompts = prompts(dir)?;
    let mut worst = 0.0f64;
    let mut greedy_same = true;
    let mut bf16_agree = (0usize, 0usize);
    for p in &prompts {
        let c = full(&mc, &cpu, p)?;
        let g = full(&mg, f32_gpu, p)?;
        worst = worst.max(max_rel(&g, &c));
        let gc = model::greedy_generate(&mc, &cpu, p, 32, &[], 512)?;
        let gg = model::greedy_generate(&mg, f32_gpu, p, 32, &[], 512)?;
        greedy_same &= gc == gg;
        let gb = model::greedy_generate(&mb, bf16_gpu, p, 32, &[], 512)?;
        bf16_agree.0 += gb.iter().zip(&gc).take_while(|(a, b)| a == b).count();
        bf16_agree.1 += gc.len();
        if let Some(dump) = &args.dump {
            let b = full(&mb, bf16_gpu, p)?;
            std::fs::create_dir_all(dump)?;
            let bytes: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(dump.join(format!("{name}_{}.f32", p.len())), bytes)?;
        }
    }
    report.err(
        SUITE,
        format!("{name} f32 logits vs CPU (max|Δ|/scale)"),
        worst,
        1e-4,
    );
    report.push(
        SUITE,
        format!("{name} f32 32-step greedy vs CPU"),
        if greedy_same { 1.0 } else { 0.0 },
        if greedy_same {
            "identical".into()
        } else {
            "DIFFER".into()
        },
        "identical".into(),
        greedy_same,
    );
    let agree = bf16_agree.0 as f64 / bf16_agree.1.max(1) as f64;
    report.push(
        SUITE,
        format!("{name} bf16 greedy agreement with CPU f32 (reported)"),
        agree,
        format!("{:.0}% of tokens", 100.0 * agree),
        "reported".into(),
        true,
    );
    // Chunked prefill equals one shot; a batch equals each sequence alone.
    let longest = prompts
        .iter()
        .max_by_key(|p| p.len())
        .cloned()
        .unwrap_or_default();
    let one = chunked_last(&mg, f32_gpu, &longest, 4096)?;
    let chunked = chunked_last(&mg, f32_gpu, &longest, 7)?;
    report.err(
        SUITE,
        format!("{name} f32 chunked(7) = one shot"),
        max_rel(&chunked, &one),
        1e-4,
    );
    let batch = batched_last(&mg, f32_gpu, &prompts)?;
    let mut alone = Vec::with_capacity(batch.len());
    for p in &prompts {
        alone.extend(chunked_last(&mg, f32_gpu, p, 4096)?);
    }
    report.err(
        SUITE,
        format!("{name} f32 batch = alone"),
        max_rel(&batch, &alone),
        1e-4,
    );
    prefix_caching(report, name, f32_gpu, mg, &longest)?;
    Ok(())
}

/// Eight requests sharing a prefix through the real engine on the GPU: outputs with prefix
/// caching on equal those with it off, and the cache served prompt tokens.
fn prefix_caching(
    report: &mut Report,
    name: &str,
    gpu: &CudaBackend,
    model: Model<CudaBackend>,
    base: &[u32],
) -> anyhow::Result<()> {
    let model = std::sync::Arc::new(model);
    let prefix: Vec<u32> = base.iter().copied().cycle().take(48).collect();
    let requests: Vec<Vec<u32>> = (0..8u32)
        .map(|i| {
            let mut p = prefix.clone();
            p.extend((0..5 + i).map(|j| (j * 7 + i * 13) % 400 + 1));
            p
        })
        .collect();
    let off = drive_engine(gpu.replica()?, model.clone(), &requests, false, 16)?;
    let on = drive_engine(gpu.replica()?, model, &requests, true, 16)?;
    let cached = on.1.prompt_tokens_cached;
    let same = off.0 == on.0;
    report.push(
        SUITE,
        format!("{name} f32 engine: prefix caching on = off ({cached} cached tokens)"),
        cached as f64,
        if same {
            "identical".into()
        } else {
            "DIFFER".into()
        },
        "identical, cached > 0".into(),
        same && cached > 0 && off.1.prompt_tokens_cached == 0,
    );
    Ok(())
}

/// Runs `requests` (greedy, `max_tokens` each, EOS ignored) through a real engine over
/// `backend`: the first alone for 8 steps (so it fills the cache), the rest after it. Returns
/// every request's tokens and the engine's final statistics; the cache invariants must hold.
pub(super) fn drive_engine<B: StepBackend>(
    backend: B,
    model: std::sync::Arc<Model<B>>,
    requests: &[Vec<u32>],
    caching: bool,
    max_tokens: u32,
) -> anyhow::Result<(BTreeMap<u64, Vec<u32>>, chimera::engine::api::EngineStats)> {
    drive_engine_with(backend, model, requests, caching, max_tokens, 64 << 20, 4)
}

/// [`drive_engine`] with a cache budget in bytes and a running-request limit.
pub(super) fn drive_engine_with<B: StepBackend>(
    backend: B,
    model: std::sync::Arc<Model<B>>,
    requests: &[Vec<u32>],
    caching: bool,
    max_tokens: u32,
    budget: u64,
    max_running: usize,
) -> anyhow::Result<(BTreeMap<u64, Vec<u32>>, chimera::engine::api::EngineStats)> {
    let setup = EngineSetup {
        engine: EngineConfig {
            max_batched_tokens: 64,
            max_running,
            ..Default::default()
        },
        cache: CacheConfig {
            memory_budget: Some(ByteSize(budget)),
            block_size: BLOCK,
            prefix_caching: caching,
            ..Default::default()
        },
        hash_salt: "gpu-check".into(),
        speculative: Default::default(),
    };
    let mut engine = Engine::new(setup, ModelRunner::new(backend, model), Policies::builtin())?;
    let mut rx = BTreeMap::new();
    for (i, p) in requests.iter().enumerate() {
        let (tx, r) = unbounded_channel();
        engine.add(
            GenerateRequest {
                id: i as u64,
                prompt: p.clone(),
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
            },
            tx,
        );
        rx.insert(i as u64, r);
        if i == 0 {
            for _ in 0..8 {
                engine.step();
            }
        }
    }
    let mut tokens: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut done = 0;
    for _ in 0..100_000 {
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
        if done == requests.len() {
            break;
        }
    }
    anyhow::ensure!(
        done == requests.len(),
        "the engine did not finish every request"
    );
    engine
        .cache()
        .check_invariants()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    engine.refresh_stats();
    Ok((tokens, engine.stats().clone()))
}
