//! The `bench` suite (bf16 serving mode): a full-size Llama config with dummy weights — load
//! time, eager decode ms/step at batch 1, 64 and 256 with context 2048 against the memory
//! floor recomputed from the copy bandwidth measured first in the same run, and driver
//! allocations over 1000 steps — plus causal GQA attention (32q/8kv, d128) at 8192 tokens.

use std::time::Instant;

use super::rng::Rng;
use super::{GpuCheckArgs, Report};
use crate::backend::cuda::CudaBackend;
use crate::backend::{AttnShape, Backend, HostTensor, KvLayer, SampleOut, StepPlan};
use crate::model::{self, Model};

const SUITE: &str = "bench";
const BLOCK: usize = 16;
const CONTEXT: usize = 2048;

pub fn run(report: &mut Report, gpu: &CudaBackend, args: &GpuCheckArgs) {
    let bw = match gpu.copy_bandwidth(2 << 30) {
        Ok(bw) => {
            report.push(
                SUITE,
                "device-to-device copy bandwidth (read + write)",
                bw,
                format!("{:.2} TB/s", bw / 1e12),
                "measured".into(),
                true,
            );
            bw
        }
        Err(e) => {
            report.failed(SUITE, "copy bandwidth", e);
            return;
        }
    };
    if let Err(e) = attention_8k(report, gpu) {
        report.failed(SUITE, "attention T=8192", format!("{e:#}"));
    }
    if let Err(e) = decode(report, gpu, args, bw) {
        report.failed(SUITE, "dummy 8B decode", format!("{e:#}"));
    }
}

fn attention_8k(report: &mut Report, gpu: &CudaBackend) -> anyhow::Result<()> {
    let (t, heads, kv_heads, d) = (8192usize, 32usize, 8usize, 128usize);
    let mut rng = Rng::new(7);
    let blocks = t / BLOCK;
    let mut plan = StepPlan::new(BLOCK);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let tokens = vec![1u32; t];
    plan.push(&tokens, 0, &table, 0, false);
    plan.finish()?;
    let mut step = gpu.new_step(t)?;
    gpu.upload_step(&plan, &mut step)?;
    let up = |n: usize, shape: &[usize], rng: &mut Rng| -> anyhow::Result<_> {
        let v = rng.vec(n, 1.0);
        Ok(gpu.upload(HostTensor::f32(&v, shape))?)
    };
    let q = up(t * heads * d, &[t, heads * d], &mut rng)?;
    let k = up(t * kv_heads * d, &[t, kv_heads * d], &mut rng)?;
    let v = up(t * kv_heads * d, &[t, kv_heads * d], &mut rng)?;
    let shape = [blocks, BLOCK, kv_heads, d];
    let mut cache = KvLayer {
        k: gpu.zeros(&shape, gpu.dtype())?,
        v: gpu.zeros(&shape, gpu.dtype())?,
    };
    let attn = AttnShape {
        heads,
        kv_heads,
        head_dim: d,
        scale: (d as f32).powf(-0.5),
    };
    for _ in 0..3 {
        drop(gpu.paged_attention(&q, &k, &v, &mut cache, attn, &step)?);
    }
    gpu.synchronize()?;
    let reps = 20;
    let started = Instant::now();
    for _ in 0..reps {
        drop(gpu.paged_attention(&q, &k, &v, &mut cache, attn, &step)?);
    }
    gpu.synchronize()?;
    let ms = started.elapsed().as_secs_f64() * 1e3 / f64::from(reps);
    // Causal: half of the T×T score matrix, QKᵀ and PV, 2 FLOPs per multiply-add.
    let flops = 4.0 * (t * t) as f64 / 2.0 * (heads * d) as f64;
    report.push(
        SUITE,
        format!(
            "causal GQA attention 32q/8kv d128 T=8192 incl. KV write ({:.0} TFLOP/s)",
            flops / ms / 1e9
        ),
        ms,
        format!("{ms:.3} ms"),
        "≤ 2.000 ms".into(),
        ms <= 2.0,
    );
    Ok(())
}

fn decode(
    report: &mut Report,
    gpu: &CudaBackend,
    args: &GpuCheckArgs,
    bw: f64,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let before = gpu.allocated_bytes();
    let m: Model<CudaBackend> = model::load_dummy(&args.bench_model, gpu, 0)?;
    gpu.synchronize()?;
    let weights_total = (gpu.allocated_bytes() - before) as usize;
    let load_s = started.elapsed().as_secs_f64();
    let name = m.info.architecture.clone();
    report.push(
        SUITE,
        format!("{name} dummy weights: load (alloc + fill) time"),
        load_s,
        format!("{load_s:.2} s"),
        "≤ 60 s".into(),
        load_s <= 60.0,
    );
    let spec = m.info.cache.clone();
    let kv_token_bytes =
        (2 * spec.attn_layers * spec.kv_heads * spec.head_dim * gpu.dtype().size()) as f64;
    let weight_bytes = weights_read_per_step(&m, gpu, weights_total) as f64;
    let per_seq = CONTEXT.div_ceil(BLOCK) + 1;
    let max_batch = 256;
    let mut caches = m.new_caches(gpu, per_seq * max_batch, BLOCK, 1)?;
    for (batch, steps) in [
        (1usize, args.steps),
        (64, args.steps.min(200)),
        (256, args.steps.min(100)),
    ] {
        let mut plan = StepPlan::new(BLOCK);
        for s in 0..batch {
            let table: Vec<u32> = ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect();
            plan.push(&[(s % 1000) as u32 + 1], CONTEXT, &table, 0, true);
        }
        plan.finish()?;
        plan.sampling.clear(64);
        for _ in 0..batch {
            plan.sampling.push_row(
                crate::backend::sample::Penalties {
                    repetition: 1.0,
                    presence: 0.0,
                    frequency: 0.0,
                },
                false,
                &[],
                &[],
            );
        }
        let mut step = gpu.new_step(batch)?;
        let mut out = SampleOut::default();
        let mut one = |step: &mut _, out: &mut SampleOut| -> anyhow::Result<()> {
            gpu.upload_step(&plan, step)?;
            let mut logits = m.forward(gpu, step, &mut caches)?;
            gpu.sample(&mut logits, step, out)?;
            Ok(())
        };
        for _ in 0..3 {
            one(&mut step, &mut out)?;
        }
        let allocs = gpu.driver_allocations();
        let t0 = Instant::now();
        for _ in 0..steps {
            one(&mut step, &mut out)?;
        }
        let ms = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
        let grew = gpu.driver_allocations() - allocs;
        let floor_ms = (weight_bytes + (batch * CONTEXT) as f64 * kv_token_bytes) / bw * 1e3;
        report.push(
            SUITE,
            format!(
                "{name} eager decode bs{batch} ctx{CONTEXT} (floor {floor_ms:.2} ms; reported)"
            ),
            ms,
            format!("{ms:.2} ms ({:.2}×)", ms / floor_ms),
            "reported".into(),
            true,
        );
        report.push(
            SUITE,
            format!("{name} driver allocations in {steps} decode steps at bs{batch}"),
            grew as f64,
            grew.to_string(),
            "0".into(),
            grew == 0,
        );
    }
    Ok(())
}

/// Weight bytes a decode step reads: every weight except the embedding table (of which a step
/// reads only its tokens' rows), the LM head included.
fn weights_read_per_step(m: &Model<CudaBackend>, gpu: &CudaBackend, total: usize) -> usize {
    let embed: usize = gpu.shape(&m.embed).iter().product::<usize>() * gpu.dtype().size();
    let tied_head = if m.lm_head.is_none() { embed } else { 0 };
    total - embed + tied_head
}
