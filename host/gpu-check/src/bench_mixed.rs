//! Mixed steps (decodes beside a prefill chunk) eager and replayed from a mixed CUDA graph, on
//! a dummy-weight model: what a mixed graph saves per step. Rows of the `bench` suite (after
//! each model's decodes) and of `--suite bench-mixed` alone.
//!
//! Each mix has `decodes` sequences at context 2048 and one fresh prompt chunk with its slot
//! zeroed (a new request's first chunk), timed as the engine runs it: upload, forward (or slot
//! ops and replay), sampling tail with its read-back. Both paths run in the same call, over
//! the same caches, alternating eager and graph blocks of steps so that clock drift hits both.

use std::time::Instant;

use super::{GpuCheckArgs, Report};
use chimera::backend::cuda::CudaBackend;
use chimera::backend::{GraphBucket, SampleOut, SlotOp, StepBackend, StepPlan};
use chimera::model::{self, Model, ModelCaches};

const SUITE: &str = "bench-mixed";
const BLOCK: usize = 16;
const CONTEXT: usize = 2048;
/// `(decodes, prompt chunk tokens)`; each runs in the smallest mixed bucket of the backend
/// that takes it, as the engine picks it.
const MIXES: [(usize, usize); 5] = [(1, 100), (16, 100), (64, 128), (128, 256), (255, 200)];

/// `--suite bench-mixed`: the mixes on both bench models.
pub fn run(report: &mut Report, gpu: &CudaBackend, args: &GpuCheckArgs) {
    for dir in [&args.bench_model, &args.hybrid_model] {
        let ran = model::load_dummy(dir, gpu, 0)
            .map_err(anyhow::Error::from)
            .and_then(|m| {
                let per_seq = CONTEXT.div_ceil(BLOCK) + 1;
                let slots = if m.info.cache.is_hybrid() { 256 } else { 1 };
                let mut caches = m.new_caches(gpu, per_seq * 256, BLOCK, slots)?;
                mixed_steps(report, gpu, &m, &mut caches, per_seq, args.steps.min(50))
            });
        if let Err(e) = ran {
            report.failed(
                SUITE,
                format!("dummy {} mixed steps", dir.display()),
                format!("{e:#}"),
            );
        }
    }
}

/// The mixes on `m` with `caches` (256 sequences of `per_seq` blocks; 256 slots on hybrids),
/// `steps` timed steps a path and mix.
pub fn mixed_steps(
    report: &mut Report,
    gpu: &CudaBackend,
    m: &Model<CudaBackend>,
    caches: &mut ModelCaches<CudaBackend>,
    per_seq: usize,
    steps: usize,
) -> anyhow::Result<()> {
    let name = m.info.architecture.clone();
    let hybrid = m.info.cache.is_hybrid();
    let mut buckets: Vec<GraphBucket> = gpu
        .graph_buckets(256, 2048)
        .into_iter()
        .filter(|b| matches!(b, GraphBucket::Mixed { .. }))
        .collect();
    buckets.sort_by_key(|b| match *b {
        GraphBucket::Mixed {
            tokens,
            decodes,
            prompts,
        } => (tokens, decodes, prompts),
        GraphBucket::Decode { seqs } => (0, seqs, 0),
    });
    for (decodes, chunk) in MIXES {
        let mut plan = StepPlan::new(BLOCK);
        let table =
            |s: usize| -> Vec<u32> { ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect() };
        let slot = |s: usize| if hybrid { s as u32 } else { 0 };
        for s in 0..decodes {
            plan.push(&[(s % 1000) as u32 + 1], CONTEXT, &table(s), slot(s), true);
        }
        let prompt: Vec<u32> = (0..chunk as u32).map(|i| 7 + i % 500).collect();
        plan.push(&prompt, 0, &table(decodes), slot(decodes), true);
        if hybrid {
            plan.slot_ops.push(SlotOp::Zero {
                slot: slot(decodes),
            });
        }
        plan.finish()?;
        // The caches were sized for the largest decode batch that fits beside the weights
        // (an 8B model on an 80 GB card holds 64 sequences, not 256): a mix with more
        // sequences would address blocks past them.
        if let Err(e) = caches.check(&plan) {
            report.push(
                SUITE,
                format!(
                    "{name} mixed step: {decodes} decodes + a {chunk}-token prompt chunk: does not fit the caches on this GPU (reported)"
                ),
                f64::NAN,
                format!("skipped: {e}"),
                "reported".into(),
                true,
            );
            continue;
        }
        plan.sampling.clear(1);
        let none = chimera::backend::sample::Penalties {
            repetition: 1.0,
            presence: 0.0,
            frequency: 0.0,
        };
        for _ in 0..plan.sample_rows.len() {
            plan.sampling.push_row(none, false, &[], &[]);
        }
        let mut step = gpu.new_step(decodes + chunk)?;
        let mut gstep = gpu.new_step(512)?;
        let mut chosen = None;
        for &b in &buckets {
            if b.holds(decodes + chunk, decodes, 1)
                && gpu.upload_graph_step(&plan, &mut gstep, b, per_seq)?
            {
                chosen = Some(b);
                break;
            }
        }
        let Some(bucket) = chosen else {
            anyhow::bail!("{decodes} decodes + {chunk} tokens fit no mixed bucket");
        };
        let GraphBucket::Mixed {
            tokens,
            decodes: bucket_decodes,
            prompts,
        } = bucket
        else {
            anyhow::bail!("not a mixed bucket");
        };
        drop(m.forward(gpu, &gstep, caches)?);
        let mut logits = None;
        let t0 = Instant::now();
        let id = gpu.capture_graph(&mut || {
            logits = Some(
                m.forward(gpu, &gstep, caches)
                    .map_err(|e| chimera::backend::BackendError::Invalid(e.to_string()))?,
            );
            Ok(())
        })?;
        let capture_ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut glogits = logits.ok_or_else(|| anyhow::anyhow!("nothing captured"))?;
        let mut out = SampleOut::default();
        let mut eager =
            |out: &mut SampleOut, caches: &mut ModelCaches<CudaBackend>| -> anyhow::Result<()> {
                gpu.upload_step(&plan, &mut step)?;
                let mut logits = m.forward(gpu, &step, caches)?;
                gpu.sample(&mut logits, &step, out)?;
                Ok(())
            };
        for _ in 0..3 {
            eager(&mut out, caches)?;
        }
        let mut graph =
            |out: &mut SampleOut, caches: &mut ModelCaches<CudaBackend>| -> anyhow::Result<()> {
                anyhow::ensure!(
                    gpu.upload_graph_step(&plan, &mut gstep, bucket, per_seq)?,
                    "refused"
                );
                m.slot_ops(gpu, &gstep, caches)?;
                gpu.replay_graph(id)?;
                gpu.sample(&mut glogits, &gstep, out)?;
                Ok(())
            };
        let (mut eager_s, mut graph_s) = (0.0f64, 0.0f64);
        let block = steps.div_ceil(5).max(1);
        for _ in 0..5 {
            let t0 = Instant::now();
            for _ in 0..block {
                eager(&mut out, caches)?;
            }
            eager_s += t0.elapsed().as_secs_f64();
            let t0 = Instant::now();
            for _ in 0..block {
                graph(&mut out, caches)?;
            }
            graph_s += t0.elapsed().as_secs_f64();
        }
        let n = (5 * block) as f64;
        let (eager_ms, graph_ms) = (eager_s * 1e3 / n, graph_s * 1e3 / n);
        report.push(
            SUITE,
            format!(
                "{name} mixed step: {decodes} decodes at ctx{CONTEXT} + a {chunk}-token prompt chunk, bucket {tokens} tokens × {bucket_decodes} decodes × {prompts} prompts (eager {eager_ms:.2} ms; capture {capture_ms:.0} ms; reported)"
            ),
            graph_ms,
            format!("{graph_ms:.2} ms ({:.2}× eager)", graph_ms / eager_ms),
            "reported".into(),
            true,
        );
    }
    Ok(())
}
