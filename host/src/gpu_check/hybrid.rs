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
    Activation, Backend, DType, HostTensor, MoeRouting, MoeScoring, SlotOp, SsmPools,
    StackedExperts, StepPlan,
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
                "ids+order identical, weights ≤ 1e-6".into(),
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
    // Mamba2 layers: SSD chunk sizes 8, 29, 128, 256 (lengths not multiples of the chunk),
    // varlen batches of 5+ sequences mixing decodes and prompts, starting states, snapshots at
    // every 16-token block boundary of a 131-token chunk.
    let sh = |heads, head_dim, groups, state, chunk| crate::backend::SsmShape {
        heads,
        head_dim,
        groups,
        state_size: state,
        chunk_size: chunk,
        dt_min: 0.001,
        dt_max: 100.0,
    };
    for gpu in [f32_gpu, bf16_gpu] {
        ssm_layer_case(
            report,
            gpu,
            &mut rng,
            sh(8, 16, 2, 16, 8),
            &[131, 1, 40, 1, 7, 1],
            16,
        );
        ssm_layer_case(
            report,
            gpu,
            &mut rng,
            sh(4, 32, 1, 32, 29),
            &[131, 1, 100, 3],
            16,
        );
        ssm_layer_case(
            report,
            gpu,
            &mut rng,
            sh(16, 64, 4, 64, 128),
            &[131, 1, 1, 300, 1],
            16,
        );
        ssm_layer_case(
            report,
            gpu,
            &mut rng,
            sh(8, 64, 2, 128, 256),
            &[131, 1, 517, 1, 1],
            16,
        );
        ssm_layer_case(
            report,
            gpu,
            &mut rng,
            sh(128, 64, 8, 128, 128),
            &[1000, 1, 1, 1, 1],
            0,
        );
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
    let label =
        "nemotronh-a f32 engine, 64 requests in 8 prefix groups: GPU = CPU, caching on = off";
    if let Err(e) = prefix_groups(report, &dir, f32_gpu) {
        report.failed(SUITE, label, format!("{e:#}"));
    }
    stress(report, f32_gpu, &dir, seed);
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
        if same {
            "identical".into()
        } else {
            "DIFFER".into()
        },
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
        scoring: MoeScoring::Sigmoid,
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
        softmax: false,
    };
    let (mut ci, mut cw) = (vec![0u32; tokens * top_k], vec![0f32; tokens * top_k]);
    cpu_moe::moe_route(&logits, tokens, &r, &bias, &mut ci, &mut cw)?;
    // The sigmoid's exp may differ from the CPU's in the last bit: weights agree to rounding.
    let w_err = rel_err(&gw, &cw);
    if gi != ci || w_err > 1e-6 {
        let at = gi.iter().zip(&ci).position(|(a, b)| a != b);
        eprintln!(
            "      routing differs: first id mismatch at {at:?}, weights rel err {w_err:.2e}"
        );
    }
    Ok(gi == ci && w_err <= 1e-6)
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
            scoring: MoeScoring::Sigmoid,
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

/// One Mamba2 layer (conv + scan) on both backends over a varlen batch whose chunks continue
/// from random states, with snapshot targets: outputs, live states and snapshot slots compared,
/// and every snapshot checked against the CPU state of a separate run of that many tokens.
pub(super) fn ssm_layer_case(
    report: &mut Report,
    gpu: &CudaBackend,
    rng: &mut Rng,
    shape: crate::backend::SsmShape,
    chunks: &[usize],
    snapshot_every: usize,
) {
    let tag = if gpu.dtype() == DType::F32 {
        "f32"
    } else {
        "bf16"
    };
    let label = format!(
        "{tag} mamba2 conv+scan {}h×{} g{} n{} chunk {} seqs {chunks:?}, snapshots every {snapshot_every}",
        shape.heads, shape.head_dim, shape.groups, shape.state_size, shape.chunk_size
    );
    match ssm_layer(gpu, rng, shape, chunks, snapshot_every) {
        Ok((out_err, state_err, snap_err, snaps)) => {
            let (tol, state_tol) = if gpu.dtype() == DType::F32 {
                (1e-4, 1e-4)
            } else {
                (1e-2, 1e-2)
            };
            report.err(SUITE, format!("{label}: y"), out_err, tol);
            report.err(
                SUITE,
                format!("{label}: live + snapshot states"),
                state_err,
                state_tol,
            );
            if gpu.dtype() == DType::F32 {
                report.err(
                    SUITE,
                    format!("{label}: {snaps} snapshots = separate runs"),
                    snap_err,
                    1e-5,
                );
            }
        }
        Err(e) => report.failed(SUITE, label, format!("{e:#}")),
    }
}

type LayerErrs = (f64, f64, f64, usize);

fn ssm_layer(
    gpu: &CudaBackend,
    rng: &mut Rng,
    shape: crate::backend::SsmShape,
    chunks: &[usize],
    snapshot_every: usize,
) -> R<LayerErrs> {
    let cpu = CpuBackend::default();
    gpu.set_ssm_chunk_size(shape.chunk_size);
    let bf16 = gpu.dtype() == DType::BF16;
    let round = |v: Vec<f32>| -> Vec<f32> {
        if bf16 {
            v.into_iter()
                .map(|x| half::bf16::from_f32(x).to_f32())
                .collect()
        } else {
            v
        }
    };
    let (h, p, g, n) = (shape.heads, shape.head_dim, shape.groups, shape.state_size);
    let d_inner = h * p;
    let conv_dim = d_inner + 2 * g * n;
    let kernel = 4;
    let layers = 2;
    let layer = 1;
    // Live slots 0..seqs, snapshot slots after them.
    let mut plan = StepPlan::new(16);
    let table: Vec<u32> = (0..4096).collect();
    let mut targets = Vec::new();
    let mut next_slot = chunks.len() as u32;
    for (i, &len) in chunks.iter().enumerate() {
        let tokens: Vec<u32> = (0..len).map(|t| (t % 100) as u32 + 1).collect();
        plan.push(&tokens, 7, &table, i as u32, true);
        if len > 1 && snapshot_every > 0 {
            let mut after = snapshot_every;
            while after <= len {
                plan.snapshot(after, next_slot);
                targets.push((i, after, next_slot));
                next_slot += 1;
                after += snapshot_every;
            }
        }
    }
    plan.finish()?;
    let slots = next_slot as usize;
    let tokens = plan.num_tokens();
    let conv0 = rng.vec(slots * layers * conv_dim * (kernel - 1), 1.0);
    let ssm0 = rng.vec(slots * layers * h * p * n, 1.0);
    let x = round(rng.vec(tokens * conv_dim, 1.0));
    let w = round(rng.vec(conv_dim * kernel, 0.5));
    let cb = round(rng.vec(conv_dim, 0.1));
    let dt = round(rng.vec(tokens * h, 1.0));
    let a_log = round((0..h).map(|_| rng.unit() * 2.0).collect());
    let d = round(rng.vec(h, 1.0));
    let dt_bias = round(rng.vec(h, 0.5));
    #[allow(clippy::too_many_arguments)]
    fn layer_on<B: Backend>(
        b: &B,
        plan: &StepPlan,
        pools0: (&[f32], &[f32]),
        dims: (usize, usize, usize, usize, usize),
        inputs: [&[f32]; 7],
        shape: crate::backend::SsmShape,
    ) -> R<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (slots, layers, conv_dim, kernel, layer) = dims;
        let [x, w, cb, dt, a_log, d, dt_bias] = inputs;
        let (h, p, g, n) = (shape.heads, shape.head_dim, shape.groups, shape.state_size);
        // SSM pools are f32 in every mode; a bf16 backend uploads in bf16, so there the
        // states start at zero (random starting states are checked in f32 mode).
        let (conv_shape, ssm_shape) = (
            [slots, layers, conv_dim, kernel - 1],
            [slots, layers, h, p, n],
        );
        let mut pools = if b.act_dtype() == DType::F32 {
            SsmPools {
                conv: b.upload(HostTensor::f32(pools0.0, &conv_shape))?,
                ssm: b.upload(HostTensor::f32(pools0.1, &ssm_shape))?,
                slots,
                layers,
            }
        } else {
            SsmPools {
                conv: b.zeros(&conv_shape, DType::F32)?,
                ssm: b.zeros(&ssm_shape, DType::F32)?,
                slots,
                layers,
            }
        };
        let t = plan.num_tokens();
        let xt = b.upload(HostTensor::f32(x, &[t, conv_dim]))?;
        let wt = b.upload(HostTensor::f32(w, &[conv_dim, 1, kernel]))?;
        let bt = b.upload(HostTensor::f32(cb, &[conv_dim]))?;
        let dtt = b.upload(HostTensor::f32(dt, &[t, h]))?;
        let al = b.upload(HostTensor::f32(a_log, &[h]))?;
        let dd = b.upload(HostTensor::f32(d, &[h]))?;
        let db = b.upload(HostTensor::f32(dt_bias, &[h]))?;
        let mut step = b.new_step(t)?;
        b.upload_step(plan, &mut step)?;
        let conv = b.causal_conv1d(&xt, &wt, Some(&bt), &mut pools, layer, &step)?;
        let [xs, bm, cm] = b.split_cols(&conv, [h * p, g * n, g * n])?;
        let y = b.ssm_scan(
            &xs, &bm, &cm, &dtt, &al, &dd, &db, shape, &mut pools, layer, &step,
        )?;
        let mut out = b.download(&conv)?;
        out.extend(b.download(&y)?);
        Ok((out, b.download(&pools.conv)?, b.download(&pools.ssm)?))
    }
    let dims = (slots, layers, conv_dim, kernel, layer);
    let inputs = [
        &x[..],
        &w[..],
        &cb[..],
        &dt[..],
        &a_log[..],
        &d[..],
        &dt_bias[..],
    ];
    // In bf16 mode both backends start from zero states (see `layer_on`).
    let (conv0, ssm0) = if bf16 {
        (vec![0.0; conv0.len()], vec![0.0; ssm0.len()])
    } else {
        (conv0, ssm0)
    };
    let (go, gconv, gssm) = layer_on(gpu, &plan, (&conv0, &ssm0), dims, inputs, shape)?;
    let (co, cconv, cssm) = layer_on(&cpu, &plan, (&conv0, &ssm0), dims, inputs, shape)?;
    let out_err = rel_err(&go, &co);
    let mut gs = gconv.clone();
    gs.extend(&gssm);
    let mut cs = cconv.clone();
    cs.extend(&cssm);
    let state_err = rel_err(&gs, &cs);
    // Each snapshot against the CPU's state after a separate run of that many tokens.
    let per_ssm = layers * h * p * n;
    let per_conv = layers * conv_dim * (kernel - 1);
    let mut snap_err = 0.0f64;
    for &(seq, after, slot) in &targets {
        let s = &plan.seqs[seq];
        let mut alone = StepPlan::new(16);
        let toks: Vec<u32> = (0..after).map(|t| (t % 100) as u32 + 1).collect();
        alone.push(&toks, 7, &table, seq as u32, true);
        alone.finish()?;
        let rows = s.offset..s.offset + after;
        let xs: Vec<f32> = x[rows.start * conv_dim..rows.end * conv_dim].to_vec();
        let dts: Vec<f32> = dt[rows.start * h..rows.end * h].to_vec();
        let inputs = [
            &xs[..],
            &w[..],
            &cb[..],
            &dts[..],
            &a_log[..],
            &d[..],
            &dt_bias[..],
        ];
        let (_, aconv, assm) = layer_on(&cpu, &alone, (&conv0, &ssm0), dims, inputs, shape)?;
        let live = seq;
        let want_ssm = &assm[live * per_ssm..(live + 1) * per_ssm];
        let got_ssm = &gssm[slot as usize * per_ssm..(slot as usize + 1) * per_ssm];
        let want_conv = &aconv[live * per_conv..(live + 1) * per_conv];
        let got_conv = &gconv[slot as usize * per_conv..(slot as usize + 1) * per_conv];
        // Only this layer's share of the slot is written by this layer's kernels.
        let lw =
            |v: &[f32], per_layer: usize| v[layer * per_layer..(layer + 1) * per_layer].to_vec();
        snap_err = snap_err
            .max(rel_err(&lw(got_ssm, h * p * n), &lw(want_ssm, h * p * n)))
            .max(rel_err(
                &lw(got_conv, conv_dim * (kernel - 1)),
                &lw(want_conv, conv_dim * (kernel - 1)),
            ));
    }
    Ok((out_err, state_err, snap_err, targets.len()))
}

/// 500 requests with random prompt and output lengths over 8 shared prefixes, a tenth of them
/// cancelled mid-flight, through the real engine on a hybrid fixture on the GPU: every request
/// ends, no device error, and once the prefix cache is reset every block and state slot is
/// free. Driver allocations after the first 50 steps are reported.
pub(super) fn stress(report: &mut Report, gpu: &CudaBackend, dir: &std::path::Path, seed: u64) {
    let label = "nemotronh-a f32 engine stress: 500 requests, 10% cancelled";
    match stress_run(gpu, dir, seed) {
        Ok((ended, free, allocs)) => {
            report.push(
                SUITE,
                format!("{label}: all ended, all blocks and slots free"),
                f64::from(u8::from(ended && free)),
                format!("ended {ended}, free {free}"),
                "both".into(),
                ended && free && !gpu.is_broken(),
            );
            report.push(
                SUITE,
                format!("{label}: driver allocations after step 50 (reported)"),
                allocs as f64,
                allocs.to_string(),
                "reported".into(),
                true,
            );
        }
        Err(e) => report.failed(SUITE, label, format!("{e:#}")),
    }
}

fn stress_run(gpu: &CudaBackend, dir: &std::path::Path, seed: u64) -> R<(bool, bool, u64)> {
    use crate::cache::{ByteSize, CacheConfig};
    use crate::engine::api::{EngineEvent, GenerateRequest, SamplingParams};
    use crate::engine::{Engine, EngineConfig, EngineSetup, ModelRunner, Policies};
    let backend = gpu.replica()?;
    let model = std::sync::Arc::new(crate::model::load(dir, &backend)?);
    let setup = EngineSetup {
        engine: EngineConfig {
            max_batched_tokens: 256,
            max_running: 16,
            ..Default::default()
        },
        cache: CacheConfig {
            memory_budget: ByteSize(32 << 20),
            block_size: 16,
            prefix_caching: true,
            ..Default::default()
        },
        hash_salt: "stress".into(),
    };
    let mut engine = Engine::new(
        setup,
        ModelRunner::new(backend.clone(), model),
        Policies::greedy(),
    )?;
    let mut rng = Rng::new(seed ^ 0x5354_5245);
    let mut rx = Vec::new();
    let mut cancel_at = std::collections::BTreeMap::new();
    let total = 500u64;
    let (mut added, mut ended) = (0u64, 0u64);
    let mut allocs_at_50 = None;
    for step in 0..200_000u64 {
        for _ in 0..4 {
            if added == total {
                break;
            }
            let group = rng.below(8) as u32;
            let len = 1 + rng.below(200);
            let prompt: Vec<u32> = (0..len as u32)
                .map(|j| {
                    if j < 48 {
                        (group * 31 + j * 7) % 500 + 1
                    } else {
                        rng.below(500) as u32 + 1
                    }
                })
                .collect();
            let (tx, r) = tokio::sync::mpsc::unbounded_channel();
            engine.add(
                GenerateRequest {
                    id: added,
                    prompt,
                    params: SamplingParams::default(),
                    max_tokens: 1 + rng.below(32) as u32,
                    stop_token_ids: vec![],
                    ignore_eos: true,
                    prompt_logprobs: false,
                    block_hashes: None,
                },
                tx,
            );
            if rng.below(10) == 0 {
                cancel_at.insert(step + 1 + rng.below(20) as u64, added);
            }
            rx.push((added, r, false));
            added += 1;
        }
        while let Some((&at, &id)) = cancel_at.first_key_value() {
            if at > step {
                break;
            }
            cancel_at.remove(&at);
            engine.cancel(id);
        }
        engine.step();
        if step == 50 {
            allocs_at_50 = Some(backend.driver_allocations());
        }
        for (_, r, done) in rx.iter_mut().filter(|x| !x.2) {
            while let Ok(ev) = r.try_recv() {
                if matches!(
                    ev,
                    EngineEvent::Finished { .. } | EngineEvent::Failed { .. }
                ) {
                    *done = true;
                }
            }
            // A cancelled request's channel closes without an event.
            if !*done && r.is_closed() && r.is_empty() {
                *done = true;
            }
        }
        ended = rx.iter().filter(|x| x.2).count() as u64;
        if added == total && ended == total && engine.is_idle() {
            break;
        }
        anyhow::ensure!(!backend.is_broken(), "the device was lost at step {step}");
    }
    engine.reset_prefix_cache();
    engine.refresh_stats();
    engine
        .cache()
        .check_invariants()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let s = engine.stats();
    let free = s.free_blocks == s.total_blocks && s.ssm_snapshots_used == 0 && s.running == 0;
    let allocs = backend.driver_allocations() - allocs_at_50.unwrap_or(0);
    Ok((ended == total, free, allocs))
}
