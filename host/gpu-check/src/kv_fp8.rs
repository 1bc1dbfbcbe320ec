//! The FP8 KV cache (`cache.kv_dtype = "fp8_e4m3"`) on the GPU, in the `fp8` and `bench-fp8`
//! suites.
//!
//! Checks: the paged write and every attention kernel's `_kvfp8` twin against the CPU oracle,
//! which rounds the same values through e4m3 at the same scales (a first step writes each
//! chunk's context through the kernels, a second attends over it while writing its own rows),
//! in f32 and bf16 and with RoPE fused into the write; then the fixtures end to end with FP8
//! caches, GPU against CPU in f32 mode. Bench: an FP8 cache against a bf16 one on the
//! Llama-3-8B shape in the same run: bytes per token, graph decode steps at batch 64, and
//! prefill steps over a cached prefix (what time to first token is made of).

use std::time::Instant;

use super::parity::max_rel;
use super::rng::Rng;
use super::{GpuCheckArgs, Report, bf16_round, row_max_rel};
use chimera::backend::cpu::CpuBackend;
use chimera::backend::cuda::CudaBackend;
use chimera::backend::{
    AttnShape, Backend, DType, GraphBucket, HostTensor, KvLayer, KvScales, LayerOps, Rope,
    SampleOut, StepBackend, StepPlan,
};
use chimera::cache::KvCacheDtype;
use chimera::model::{self, CacheDtypes, LogitsMode, Model};

const SUITE: &str = "fp8";
const BENCH: &str = "bench-fp8";
const BLOCK: usize = 16;

type R<T> = anyhow::Result<T>;
/// One layer's caches on the CPU and on the GPU.
type Caches = (
    KvLayer<<CpuBackend as Backend>::Tensor>,
    KvLayer<<CudaBackend as Backend>::Tensor>,
);
/// A head shape `(heads, kv_heads, head_dim)`, chunks `(context, new tokens)`, RoPE or not.
type Case<'a> = (
    (usize, usize, usize),
    &'a [(usize, usize)],
    Option<&'a Rope>,
);

pub fn checks(
    report: &mut Report,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    args: &GpuCheckArgs,
    seed: u64,
) {
    let mut rng = Rng::new(seed ^ 0x4b56_3866);
    // Not powers of two, so a scale applied twice or not at all shows.
    let scales = KvScales { k: 0.37, v: 1.9 };
    let rope = Rope {
        inv_freq: (0..64)
            .map(|i| 1.0 / 500_000f32.powf((2 * i) as f32 / 128.0))
            .collect(),
        rotary_dim: 128,
        attention_scaling: 1.0,
    };
    for gpu in [f32_gpu, bf16_gpu] {
        // Decodes (the warp-split decode kernels), chunks over cached prefixes (the one-tile
        // kernels), a long fresh prompt (the prefill kernel), split decodes over long contexts,
        // head dims without a tensor-core kernel (SIMT).
        let cases: [Case<'_>; 6] = [
            ((32, 8, 128), &[(1327, 1), (200, 1), (36, 1), (0, 1)], None),
            ((32, 8, 128), &[(463, 129), (0, 700), (61, 7)], None),
            (
                (32, 8, 128),
                &[(1327, 1), (0, 131), (463, 129)],
                Some(&rope),
            ),
            ((8, 2, 64), &[(9000, 1), (17, 33), (0, 300)], None),
            ((16, 4, 256), &[(300, 1), (40, 20)], None),
            ((6, 2, 40), &[(129, 1), (5, 18)], None),
        ];
        for (shape, chunks, rope) in cases {
            attention_case(report, gpu, &mut rng, shape, chunks, rope, scales);
        }
    }
    for name in ["llama-gqa", "nemotronh-a", "qwen35-a"] {
        let dir = args.fixtures.join(name);
        if let Err(e) = fixture(report, f32_gpu, bf16_gpu, &dir, name) {
            report.failed(
                SUITE,
                format!("{name} with an FP8 KV cache"),
                format!("{e:#}"),
            );
        }
    }
    // The drift report, as the bf16 SSM state's (`hybrid`): FP8 against a bf16 cache.
    for name in ["llama-gqa", "nemotronh-a"] {
        let label = format!(
            "bf16 {name}: FP8 vs bf16 KV cache, 2048-token prompt + 256 decodes (reported)"
        );
        let plain = CacheDtypes::default();
        let fp8 = CacheDtypes {
            kv: KvCacheDtype::Fp8E4M3,
            ..plain
        };
        let dir = args.fixtures.join(name);
        if let Err(e) = super::hybrid::drift(report, SUITE, &dir, bf16_gpu, &label, plain, fp8) {
            report.failed(SUITE, label, format!("{e:#}"));
        }
    }
}

fn tag(gpu: &CudaBackend) -> &'static str {
    if gpu.dtype() == DType::F32 {
        "f32"
    } else {
        "bf16"
    }
}

/// Random values, rounded to bf16 on a bf16 GPU so that both backends see the same inputs.
fn rand(rng: &mut Rng, gpu: &CudaBackend, n: usize) -> Vec<f32> {
    let mut v = rng.vec(n, 1.0);
    if gpu.dtype() == DType::BF16 {
        v.iter_mut().for_each(|x| *x = bf16_round(*x));
    }
    v
}

/// Empty FP8 caches of `rows` rows on both backends (the CPU's: f32 storage, rounded writes).
fn fp8_caches(cpu: &CpuBackend, gpu: &CudaBackend, shape: &[usize], scales: KvScales) -> R<Caches> {
    let c = KvLayer {
        k: cpu.zeros(shape, DType::F32)?,
        v: cpu.zeros(shape, DType::F32)?,
        fp8: Some(scales),
    };
    let g = KvLayer {
        k: gpu.zeros(shape, DType::F8E4M3)?,
        v: gpu.zeros(shape, DType::F8E4M3)?,
        fp8: Some(scales),
    };
    Ok((c, g))
}

/// One attention step on both backends over the same plan, with fresh random Q, K and V.
#[allow(clippy::too_many_arguments)]
fn attend_both(
    cpu: &CpuBackend,
    gpu: &CudaBackend,
    rng: &mut Rng,
    plan: &StepPlan,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    caches: &mut Caches,
    rope: Option<&Rope>,
) -> R<(Vec<f32>, Vec<f32>)> {
    let n = plan.num_tokens();
    let kvw = kv_heads * head_dim;
    let q = rand(rng, gpu, n * heads * head_dim);
    let k = rand(rng, gpu, n * kvw);
    let v = rand(rng, gpu, n * kvw);
    let up = |x: &[f32], cols: usize| -> R<_> {
        let shape = [n, cols];
        let h = HostTensor::f32(x, &shape);
        Ok((cpu.upload(h)?, gpu.upload(h)?))
    };
    let (qc, qg) = up(&q, heads * head_dim)?;
    let (kc, kg) = up(&k, kvw)?;
    let (vc, vg) = up(&v, kvw)?;
    let mut sc = cpu.new_step(n)?;
    cpu.upload_step(plan, &mut sc)?;
    let mut sg = gpu.new_step(n)?;
    gpu.upload_step(plan, &mut sg)?;
    let shape = AttnShape {
        heads,
        kv_heads,
        head_dim,
        scale: (head_dim as f32).powf(-0.5),
    };
    let (c, g) = match rope {
        Some(r) => (
            cpu.rope_paged_attention(qc, kc, &vc, &mut caches.0, shape, r, &sc)?,
            gpu.rope_paged_attention(qg, kg, &vg, &mut caches.1, shape, r, &sg)?,
        ),
        None => (
            cpu.paged_attention(&qc, &kc, &vc, &mut caches.0, shape, &sc)?,
            gpu.paged_attention(&qg, &kg, &vg, &mut caches.1, shape, &sg)?,
        ),
    };
    Ok((gpu.download(&g)?, cpu.download(&c)?))
}

/// A mixed batch of chunks `(context, new tokens)` over FP8 caches: the contexts written by a
/// first step, then attended over by the measured one. Rows: the output's worst row, and the
/// whole caches (GPU codes × scale against the CPU's rounded values).
fn attention_case(
    report: &mut Report,
    gpu: &CudaBackend,
    rng: &mut Rng,
    shape: (usize, usize, usize),
    chunks: &[(usize, usize)],
    rope: Option<&Rope>,
    scales: KvScales,
) {
    let (heads, kv_heads, head_dim) = shape;
    let label = format!(
        "{} attention over an FP8 cache {heads}q/{kv_heads}kv d{head_dim} {chunks:?}{}",
        tag(gpu),
        if rope.is_some() { " + RoPE" } else { "" }
    );
    let mut run = || -> R<(f64, usize, usize)> {
        gpu.poison_arena()?;
        let cpu = CpuBackend::default();
        let need: usize = chunks.iter().map(|&(c, q)| (c + q).div_ceil(BLOCK)).sum();
        let num_blocks = need * 2 + 8;
        let ids = rng.distinct(need, num_blocks);
        let (mut fill, mut step) = (StepPlan::new(BLOCK), StepPlan::new(BLOCK));
        let mut at = 0;
        for &(ctx, q) in chunks {
            let nb = (ctx + q).div_ceil(BLOCK);
            let table = &ids[at..at + nb];
            at += nb;
            if ctx > 0 {
                fill.push(&vec![1; ctx], 0, table, 0, true);
            }
            step.push(&vec![1; q], ctx, table, 0, true);
        }
        fill.finish()?;
        step.finish()?;
        let cache_shape = [num_blocks, BLOCK, kv_heads, head_dim];
        let mut caches = fp8_caches(&cpu, gpu, &cache_shape, scales)?;
        if fill.num_tokens() > 0 {
            attend_both(&cpu, gpu, rng, &fill, shape, &mut caches, None)?;
        }
        let (out_g, out_c) = attend_both(&cpu, gpu, rng, &step, shape, &mut caches, rope)?;
        let out_row = row_max_rel(&out_g, &out_c, head_dim);
        // The caches: codes × scale on the GPU, rounded values on the CPU. K rows rotated by
        // a fused RoPE may land on the other side of a rounding boundary (sin/cos differ in
        // the last bits); everything else is the same rounding of the same value.
        let (mut differ, mut total) = (0, 0);
        for (g, c, s) in [
            (&caches.1.k, &caches.0.k, scales.k),
            (&caches.1.v, &caches.0.v, scales.v),
        ] {
            let g: Vec<f32> = gpu.download(g)?.into_iter().map(|x| x * s).collect();
            let c = cpu.download(c)?;
            anyhow::ensure!(g.len() == c.len(), "cache sizes differ");
            differ += g
                .iter()
                .zip(&c)
                .filter(|(a, b)| (*a - *b).abs() > 1e-6 * b.abs())
                .count();
            total += g.len();
        }
        Ok((out_row, differ, total))
    };
    match run() {
        Ok((out_row, differ, total)) => {
            // f32: the same maths over the same codes agrees to 1e-4; a code on the other side
            // of a rounding boundary (RoPE's K rows, counted below) moves its element by a whole
            // e4m3 step (1/16 to 1/8 of it), which f32 mode's bound allows for as 1e-3 (one such
            // code measured 1.8e-4 on an H100).
            let bound = match (gpu.dtype(), differ) {
                (DType::BF16, _) => 1e-2,
                (_, 0) => 1e-4,
                _ => 1e-3,
            };
            let flipped = if differ > 0 {
                format!(" ({differ} codes across a rounding boundary)")
            } else {
                String::new()
            };
            report.err(
                SUITE,
                format!("{label}: output, worst row max|Δ|/max|ref|{flipped}"),
                out_row,
                bound,
            );
            // RoPE's K rows: at most one element in a thousand on the other side of a boundary.
            let allowed = if rope.is_some() { total / 1000 } else { 0 };
            report.push(
                SUITE,
                format!("{label}: cached codes × scale = the CPU's rounding"),
                differ as f64,
                format!("{differ} of {total} differ"),
                format!("≤ {allowed}"),
                differ <= allowed && total > 0,
            );
        }
        Err(e) => report.failed(SUITE, label, format!("{e:#}")),
    }
}

/// Logits of every prompt of a fixture, one chunk each, then `decodes` greedy steps, with the
/// caches' dtypes `kv`. Returns every step's logits, in order.
fn run_prompts<B: StepBackend>(
    m: &Model<B>,
    b: &B,
    prompts: &[Vec<u32>],
    kv: KvCacheDtype,
    chunk: usize,
    decodes: usize,
) -> R<Vec<Vec<f32>>> {
    let mut all = Vec::new();
    for p in prompts {
        let blocks = (p.len() + decodes).div_ceil(BLOCK);
        let dtypes = CacheDtypes {
            kv,
            ..Default::default()
        };
        let mut caches = m.new_caches_with(b, blocks, BLOCK, 1, dtypes)?;
        let table: Vec<u32> = (0..blocks as u32).collect();
        let mut plan = StepPlan::new(BLOCK);
        let mut logits = Vec::new();
        let mut done = 0;
        for c in p.chunks(chunk) {
            plan.clear(BLOCK);
            if done == 0 {
                plan.slot_ops
                    .push(chimera::backend::SlotOp::Zero { slot: 0 });
            }
            plan.push(c, done, &table, 0, done + c.len() == p.len());
            logits = m.forward_host(b, &mut plan, &mut caches, LogitsMode::Last)?;
            done += c.len();
        }
        for _ in 0..decodes {
            let next = model::argmax(&logits);
            all.push(std::mem::take(&mut logits));
            plan.clear(BLOCK);
            plan.push(&[next], done, &table, 0, true);
            logits = m.forward_host(b, &mut plan, &mut caches, LogitsMode::Last)?;
            done += 1;
        }
        all.push(logits);
    }
    Ok(all)
}

/// A fixture end to end with FP8 caches: in f32 mode the GPU's logits against the CPU's (each
/// prompt one-shot and in chunks of 7, then 16 greedy decodes); in bf16 mode how far the FP8
/// cache moves the logits from a bf16 cache's (reported).
fn fixture(
    report: &mut Report,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    dir: &std::path::Path,
    name: &str,
) -> R<()> {
    let prompts = super::parity::prompts(dir)?;
    let cpu = CpuBackend::default();
    let mc = model::load(dir, &cpu)?;
    let mg = model::load(dir, f32_gpu)?;
    let fp8 = KvCacheDtype::Fp8E4M3;
    for chunk in [usize::MAX, 7] {
        let c = run_prompts(&mc, &cpu, &prompts, fp8, chunk, 16)?;
        let g = run_prompts(&mg, f32_gpu, &prompts, fp8, chunk, 16)?;
        let worst = c
            .iter()
            .zip(&g)
            .map(|(c, g)| max_rel(g, c))
            .fold(0.0f64, f64::max);
        let how = if chunk == 7 {
            "in chunks of 7"
        } else {
            "one-shot"
        };
        report.err(
            SUITE,
            format!(
                "f32 {name} FP8 KV cache, prompts {how} + 16 greedy decodes: GPU logits vs CPU, max|Δ|/scale"
            ),
            worst,
            1e-4,
        );
    }
    let mb = model::load(dir, bf16_gpu)?;
    let plain = run_prompts(&mb, bf16_gpu, &prompts, KvCacheDtype::Auto, usize::MAX, 16)?;
    let quant = run_prompts(&mb, bf16_gpu, &prompts, fp8, usize::MAX, 16)?;
    let worst = plain
        .iter()
        .zip(&quant)
        .map(|(p, q)| max_rel(q, p))
        .fold(0.0f64, f64::max);
    let same = plain
        .iter()
        .zip(&quant)
        .filter(|(p, q)| model::argmax(p) == model::argmax(q))
        .count();
    report.push(
        SUITE,
        format!("bf16 {name}: FP8 vs bf16 KV cache, prompts + 16 greedy decodes (reported)"),
        worst,
        format!(
            "max|Δ|/scale {worst:.1e}; argmax equal at {same} of {} steps",
            plain.len()
        ),
        "reported".into(),
        worst.is_finite(),
    );
    Ok(())
}

/// An FP8 cache against a bf16 one on the bench model (Llama-3-8B shape, dummy weights), in
/// one run: bytes per token (from the device's memory counter), graph decode steps at batch 64
/// over 2048-token contexts, and prefill steps of 2048 tokens after a cached 2048-token prefix
/// (the prefix's attention reads the cache) and from an empty context.
pub fn bench(report: &mut Report, gpu: &CudaBackend, args: &GpuCheckArgs) {
    if let Err(e) = bench_inner(report, gpu, args) {
        report.failed(BENCH, "FP8 KV cache vs bf16", format!("{e:#}"));
    }
}

fn bench_inner(report: &mut Report, gpu: &CudaBackend, args: &GpuCheckArgs) -> R<()> {
    const BATCH: usize = 64;
    const CONTEXT: usize = 2048;
    const STEPS: usize = 100;
    let m: Model<CudaBackend> =
        model::load_dummy_with(&args.bench_model, gpu, 0, model::LoadOptions::default())?;
    let name = m.info.architecture.clone();
    let per_seq = (2 * CONTEXT).div_ceil(BLOCK) + 1;
    let mut decode_ms = [0.0f64; 2];
    let mut prefill_ms = [[0.0f64; 2]; 2];
    let mut bytes = [0.0f64; 2];
    for (i, kv) in [KvCacheDtype::Auto, KvCacheDtype::Fp8E4M3]
        .into_iter()
        .enumerate()
    {
        gpu.synchronize()?;
        let free = gpu.mem_info()?.0;
        let dtypes = CacheDtypes {
            kv,
            ..Default::default()
        };
        let blocks = per_seq * BATCH;
        let mut caches = m.new_caches_with(gpu, blocks, BLOCK, 1, dtypes)?;
        gpu.synchronize()?;
        bytes[i] = free.saturating_sub(gpu.mem_info()?.0) as f64 / (blocks * BLOCK) as f64;
        // Decode: batch 64 at context 2048, replayed from a graph.
        let mut plan = StepPlan::new(BLOCK);
        for s in 0..BATCH {
            let table: Vec<u32> = ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect();
            plan.push(&[(s % 1000) as u32 + 1], CONTEXT, &table, 0, true);
        }
        plan.finish()?;
        super::bench::plain_sampling(&mut plan, BATCH);
        let mut gstep = gpu.new_step(BATCH)?;
        anyhow::ensure!(
            gpu.upload_graph_step(
                &plan,
                &mut gstep,
                GraphBucket::Decode { seqs: BATCH },
                per_seq
            )?,
            "the decode step does not fit a graph step"
        );
        drop(m.forward(gpu, &gstep, &mut caches)?);
        let timed = super::bench::GraphRun {
            gpu,
            m: &m,
            plan: &plan,
            batch: BATCH,
            per_seq,
            steps: STEPS,
        };
        decode_ms[i] = timed.run(&mut gstep, &mut caches, true)?.1;
        // Prefill: one 2048-token chunk after a cached 2048-token prefix, and one from an
        // empty context (best of 4 each).
        let table: Vec<u32> = (0..per_seq as u32).collect();
        for (j, ctx) in [CONTEXT, 0].into_iter().enumerate() {
            let mut plan = StepPlan::new(BLOCK);
            plan.push(&vec![7; CONTEXT], ctx, &table, 0, true);
            plan.finish()?;
            super::bench::plain_sampling(&mut plan, 1);
            let mut step = gpu.new_step(CONTEXT)?;
            let mut out = SampleOut::default();
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let t0 = Instant::now();
                gpu.upload_step(&plan, &mut step)?;
                let mut logits = m.forward(gpu, &step, &mut caches)?;
                gpu.sample(&mut logits, &step, &mut out)?;
                gpu.synchronize()?;
                best = best.min(t0.elapsed().as_secs_f64() * 1e3);
            }
            prefill_ms[j][i] = best;
        }
    }
    report.push(
        BENCH,
        format!("{name}: KV cache bytes per token, FP8 vs bf16 (device memory allocated)"),
        bytes[1] / bytes[0],
        format!(
            "{:.0} vs {:.0} B ({:.3}×)",
            bytes[1],
            bytes[0],
            bytes[1] / bytes[0]
        ),
        "≤ 0.51×".into(),
        bytes[1] / bytes[0] <= 0.51,
    );
    let r = decode_ms[1] / decode_ms[0];
    report.push(
        BENCH,
        format!("{name} graph decode bs{BATCH} ctx{CONTEXT}: FP8 vs bf16 KV cache"),
        r,
        format!("{:.3} vs {:.3} ms ({r:.3}×)", decode_ms[1], decode_ms[0]),
        "≤ 1.05×".into(),
        r <= 1.05,
    );
    for (j, what) in ["after a cached 2048-token prefix", "from an empty context"]
        .into_iter()
        .enumerate()
    {
        let r = prefill_ms[j][1] / prefill_ms[j][0];
        report.push(
            BENCH,
            format!("{name} prefill 2048 tokens {what}: FP8 vs bf16 KV cache"),
            r,
            format!(
                "{:.2} vs {:.2} ms ({r:.3}×)",
                prefill_ms[j][1], prefill_ms[j][0]
            ),
            "≤ 1.05×".into(),
            r <= 1.05,
        );
    }
    Ok(())
}
