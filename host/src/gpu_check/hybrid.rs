//! The `hybrid` suite: the operations hybrid models add, on the GPU against the CPU — MoE
//! routing (expert ids and order identical in f32 mode, ties included) and the routed experts,
//! SSM slot restores and zeros, the Mamba2 conv and scan with snapshots — then the hybrid
//! fixtures end to end (see `parity`).

use super::rng::Rng;
use super::{GpuCheckArgs, Report, rel_err};
use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::moe as cpu_moe;
use crate::backend::cuda::CudaBackend;
use crate::backend::{
    Activation, Backend, DType, HostTensor, MoeRouting, SlotOp, SsmPools, StackedExperts, StepPlan,
};

const SUITE: &str = "hybrid";
type R<T> = anyhow::Result<T>;

pub fn run(
    report: &mut Report,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    args: &GpuCheckArgs,
    seed: u64,
) {
    let mut rng = Rng::new(seed ^ 0x4859_4252);
    for &(tokens, experts, n_group, topk_group, top_k, norm) in &[
        (37usize, 16usize, 4usize, 2usize, 4usize, true),
        (300, 128, 8, 4, 6, true),
        (5, 8, 1, 1, 2, false),
    ] {
        let label = format!(
            "f32 moe routing {tokens} tokens, {experts} experts in {n_group} groups, top-{top_k} (ties)"
        );
        match routing_case(
            f32_gpu,
            &mut rng,
            tokens,
            experts,
            (n_group, topk_group, top_k, norm),
        ) {
            Ok(same) => report.push(
                SUITE,
                label,
                if same { 1.0 } else { 0.0 },
                if same {
                    "identical".into()
                } else {
                    "DIFFER".into()
                },
                "identical ids, order, weights".into(),
                same,
            ),
            Err(e) => report.failed(SUITE, label, format!("{e:#}")),
        }
    }
    for gpu in [f32_gpu, bf16_gpu] {
        let tag = if gpu.dtype() == DType::F32 {
            "f32"
        } else {
            "bf16"
        };
        let tol = if gpu.dtype() == DType::F32 {
            1e-5
        } else {
            1e-2
        };
        let label = format!("{tag} moe experts 77 tokens, 16 experts top-4, relu²");
        match experts_case(gpu, &mut rng) {
            Ok((g, c)) => report.err(SUITE, label, rel_err(&g, &c), tol),
            Err(e) => report.failed(SUITE, label, format!("{e:#}")),
        }
    }
    let label = "f32 SSM slot restores and zeros (conv + ssm pools, 3 layers)";
    match slot_ops_case(f32_gpu, &mut rng) {
        Ok((g, c)) => report.err(SUITE, label, rel_err(&g, &c), 0.0),
        Err(e) => report.failed(SUITE, label, format!("{e:#}")),
    }
    // The hybrid fixtures end to end, as the Llama ones in `parity`.
    let mut dirs: Vec<_> = std::fs::read_dir(&args.fixtures)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    dirs.sort();
    for dir in dirs {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.starts_with("llama") || !dir.join("reference.json").exists() {
            continue;
        }
        if let Err(e) = super::parity::fixture(report, &dir, &name, f32_gpu, bf16_gpu, args) {
            report.failed(SUITE, name.clone(), format!("{e:#}"));
        }
    }
    let dir = args.fixtures.join("nemotronh-a");
    let label = "nemotronh-a f32 engine, 64 requests in 8 prefix groups: GPU = CPU, caching on = off";
    if let Err(e) = prefix_groups(report, &dir, f32_gpu) {
        report.failed(SUITE, label, format!("{e:#}"));
    }
}

/// 64 requests in 8 groups sharing a 4-block prefix, submitted in a fixed order, through the
/// real engine on the CPU and on the GPU (f32): identical tokens, caching on = off on the GPU,
/// and the same prefix hits and SSM restores as the CPU (more than none).
fn prefix_groups(report: &mut Report, dir: &std::path::Path, gpu: &CudaBackend) -> R<()> {
    use super::parity::drive_engine;
    use std::sync::Arc;
    let cpu = CpuBackend::default();
    let mc = Arc::new(crate::model::load(dir, &cpu)?);
    let mg = Arc::new(crate::model::load(dir, gpu)?);
    let requests: Vec<Vec<u32>> = (0..64u32)
        .map(|i| {
            let g = i % 8;
            let mut p: Vec<u32> = (0..64).map(|j| (g * 37 + j * 11) % 500 + 1).collect();
            p.extend((0..3 + i % 5).map(|j| (i * 7 + j * 3) % 500 + 1));
            p
        })
        .collect();
    let c = drive_engine(cpu, mc, &requests, true, 8)?;
    let g = drive_engine(gpu.replica()?, mg.clone(), &requests, true, 8)?;
    let g_off = drive_engine(gpu.replica()?, mg, &requests, false, 8)?;
    let same = c.0 == g.0 && g.0 == g_off.0;
    report.push(
        SUITE,
        "nemotronh-a f32 engine, 64 requests in 8 prefix groups: tokens GPU = CPU, on = off",
        if same { 1.0 } else { 0.0 },
        if same { "identical".into() } else { "DIFFER".into() },
        "identical".into(),
        same,
    );
    let (cs, gs) = (&c.1, &g.1);
    let counts_same = cs.ssm_restores == gs.ssm_restores
        && cs.prefix_cache_hits == gs.prefix_cache_hits
        && gs.ssm_restores > 0;
    report.push(
        SUITE,
        format!(
            "nemotronh-a SSM restores / prefix hits on the GPU = CPU ({} / {})",
            gs.ssm_restores, gs.prefix_cache_hits
        ),
        gs.ssm_restores as f64,
        format!("{} / {}", gs.ssm_restores, gs.prefix_cache_hits),
        format!("{} / {}, > 0", cs.ssm_restores, cs.prefix_cache_hits),
        counts_same,
    );
    Ok(())
}

/// Router logits on a coarse grid (many ties) through both routers.
fn routing_case(
    gpu: &CudaBackend,
    rng: &mut Rng,
    tokens: usize,
    experts: usize,
    (n_group, topk_group, top_k, norm): (usize, usize, usize, bool),
) -> R<bool> {
    let logits: Vec<f32> = (0..tokens * experts)
        .map(|_| (rng.sym(3.0) * 2.0).round() / 2.0)
        .collect();
    let bias: Vec<f32> = (0..experts)
        .map(|_| (rng.sym(0.5) * 4.0).round() / 4.0)
        .collect();
    let lg = gpu.upload(HostTensor::f32(&logits, &[tokens, experts]))?;
    let routing = MoeRouting {
        correction_bias: gpu.upload(HostTensor::f32(&bias, &[experts]))?,
        top_k,
        n_group,
        topk_group,
        norm_topk_prob: norm,
        scaling: 2.5,
    };
    let (gi, gw) = gpu.moe_route(&lg, &routing)?;
    let r = cpu_moe::MoeRouting {
        experts,
        n_group,
        topk_group,
        top_k,
        norm_topk_prob: norm,
        scaling: 2.5,
    };
    let (mut ci, mut cw) = (vec![0u32; tokens * top_k], vec![0f32; tokens * top_k]);
    cpu_moe::moe_route(&logits, tokens, &r, &bias, &mut ci, &mut cw)?;
    let same_w = gw.iter().zip(&cw).all(|(a, b)| a.to_bits() == b.to_bits());
    if gi != ci || !same_w {
        let at = gi.iter().zip(&ci).position(|(a, b)| a != b);
        eprintln!("      routing differs: first id mismatch at {at:?}, weights bit-equal {same_w}");
    }
    Ok(gi == ci && same_w)
}

fn experts_case(gpu: &CudaBackend, rng: &mut Rng) -> R<(Vec<f32>, Vec<f32>)> {
    let cpu = CpuBackend::default();
    let (tokens, hidden, inter, experts) = (77usize, 64usize, 96usize, 16usize);
    let round = |v: Vec<f32>| -> Vec<f32> {
        if gpu.dtype() == DType::BF16 {
            v.into_iter()
                .map(|x| half::bf16::from_f32(x).to_f32())
                .collect()
        } else {
            v
        }
    };
    let x = round(rng.vec(tokens * hidden, 1.0));
    let logits = round(rng.vec(tokens * experts, 2.0));
    let up = round(rng.vec(experts * inter * hidden, 0.1));
    let down = round(rng.vec(experts * hidden * inter, 0.1));
    let base = round(rng.vec(tokens * hidden, 1.0));
    let bias = vec![0.0f32; experts];
    /// The layer's host inputs: x, router logits, up, down, the output's starting values, bias.
    type Inputs<'a> = [&'a [f32]; 6];
    fn both<B: Backend>(
        b: &B,
        [x, logits, up, down, base, bias]: Inputs<'_>,
        (tokens, hidden, inter, experts): (usize, usize, usize, usize),
    ) -> R<Vec<f32>> {
        let xt = b.upload(HostTensor::f32(x, &[tokens, hidden]))?;
        let lt = b.upload(HostTensor::f32(logits, &[tokens, experts]))?;
        let mut out = b.upload(HostTensor::f32(base, &[tokens, hidden]))?;
        let routing = MoeRouting {
            correction_bias: b.upload(HostTensor::f32(bias, &[experts]))?,
            top_k: 4,
            n_group: 4,
            topk_group: 2,
            norm_topk_prob: true,
            scaling: 1.5,
        };
        let stacked = StackedExperts {
            up: b.upload(HostTensor::f32(up, &[experts, inter, hidden]))?,
            down: b.upload(HostTensor::f32(down, &[experts, hidden, inter]))?,
            gate: None,
            act: Activation::Relu2,
        };
        b.moe(&xt, &lt, &routing, &stacked, &mut out)?;
        Ok(b.download(&out)?)
    }
    let data = [
        &x[..],
        &logits[..],
        &up[..],
        &down[..],
        &base[..],
        &bias[..],
    ];
    let dims = (tokens, hidden, inter, experts);
    Ok((both(gpu, data, dims)?, both(&cpu, data, dims)?))
}

/// Random pools, a plan of restores and zeros (including a self-copy), applied on both.
fn slot_ops_case(gpu: &CudaBackend, rng: &mut Rng) -> R<(Vec<f32>, Vec<f32>)> {
    let cpu = CpuBackend::default();
    let (slots, layers) = (9usize, 3usize);
    let conv = rng.vec(slots * layers * 40 * 3, 1.0);
    let ssm = rng.vec(slots * layers * 4 * 8 * 16, 1.0);
    let mut plan = StepPlan::new(16);
    plan.push(&[1], 0, &[0], 0, true);
    plan.slot_ops = vec![
        SlotOp::Copy { from: 2, to: 5 },
        SlotOp::Zero { slot: 7 },
        SlotOp::Copy { from: 3, to: 3 },
        SlotOp::Copy { from: 5, to: 0 },
    ];
    plan.finish()?;
    fn apply<B: Backend>(
        b: &B,
        plan: &StepPlan,
        conv: &[f32],
        ssm: &[f32],
        slots: usize,
        layers: usize,
    ) -> R<Vec<f32>> {
        let mut pools = SsmPools {
            conv: b.upload(HostTensor::f32(conv, &[slots, layers, 40, 3]))?,
            ssm: b.upload(HostTensor::f32(ssm, &[slots, layers, 4, 8, 16]))?,
            slots,
            layers,
        };
        let mut step = b.new_step(plan.num_tokens())?;
        b.upload_step(plan, &mut step)?;
        b.ssm_slot_ops(&mut pools, &step)?;
        let mut out = b.download(&pools.conv)?;
        out.extend(b.download(&pools.ssm)?);
        Ok(out)
    }
    Ok((
        apply(gpu, &plan, &conv, &ssm, slots, layers)?,
        apply(&cpu, &plan, &conv, &ssm, slots, layers)?,
    ))
}
