//! The `hybrid` suite: the operations hybrid models add, on the GPU against the CPU — MoE
//! routing (expert ids and order identical in f32 mode, ties included) and the routed experts
//! (`super::moe`),
//! SSM slot restores and zeros, the Mamba2 conv and scan with snapshots, the Mamba2 mixer's
//! middle read in place (`super::mamba_mix`) — then the hybrid fixtures end to end (see
//! `parity`).

use super::rng::Rng;
use super::{GpuCheckArgs, Report, rel_err, round_if_bf16};
use chimera::backend::cpu::CpuBackend;
use chimera::backend::cpu::moe as cpu_moe;
use chimera::backend::cuda::CudaBackend;
use chimera::backend::{
    Backend, DType, HostTensor, LayerOps, MoeRouting, MoeScoring, SlotOp, SsmOperands, SsmPools,
    StepBackend, StepPlan,
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
                    format!("DIFFER (seed {seed})")
                },
                "ids+order identical, weights ≤ 1e-6".into(),
                same,
            ),
            Err(e) => report.failed(SUITE, label, format!("{e:#}")),
        }
    }
    super::moe::checks(report, SUITE, f32_gpu, bf16_gpu, &mut rng);
    let label = "f32 SSM slot restores and zeros (conv + ssm pools, 3 layers)";
    match slot_ops_case(f32_gpu, &mut rng) {
        Ok((g, c)) => report.err(SUITE, label, rel_err(&g, &c), 0.0),
        Err(e) => report.failed(SUITE, label, format!("{e:#}")),
    }
    // Mamba2 layers: SSD chunk sizes 8, 29, 128, 256 (lengths not multiples of the chunk),
    // varlen batches of 5+ sequences mixing decodes and prompts, starting states, snapshots at
    // every 16-token block boundary of a 131-token chunk.
    let sh = |heads, head_dim, groups, state, chunk| chimera::backend::SsmShape {
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
            None,
            &mut rng,
            sh(8, 16, 2, 16, 8),
            &[131, 1, 40, 1, 7, 1],
            16,
        );
        ssm_layer_case(
            report,
            gpu,
            None,
            &mut rng,
            sh(4, 32, 1, 32, 29),
            &[131, 1, 100, 3],
            16,
        );
        ssm_layer_case(
            report,
            gpu,
            None,
            &mut rng,
            sh(16, 64, 4, 64, 128),
            &[131, 1, 1, 300, 1],
            16,
        );
        ssm_layer_case(
            report,
            gpu,
            None,
            &mut rng,
            sh(8, 64, 2, 128, 256),
            &[131, 1, 517, 1, 1],
            16,
        );
        ssm_layer_case(
            report,
            gpu,
            None,
            &mut rng,
            sh(128, 64, 8, 128, 128),
            &[1000, 1, 1, 1, 1],
            0,
        );
    }
    // The whole mixer middle as the model runs it (`LayerOps::mamba2_mix`: conv, scan and norm
    // reading in_proj's output in place), decode batches and mixed steps, no column copies.
    for gpu in [f32_gpu, bf16_gpu] {
        super::mamba_mix::checks(report, SUITE, gpu, &mut rng);
    }
    // The opt-in bf16 state pool (cache.ssm_state_dtype = "bfloat16"), SIMT and tensor-core
    // paths, with random starting states.
    for gpu in [f32_gpu, bf16_gpu] {
        for (shape, chunks) in [
            (sh(8, 16, 2, 16, 8), &[131usize, 1, 40, 1, 7, 1][..]),
            (sh(16, 64, 4, 64, 128), &[131, 1, 1, 300, 1][..]),
        ] {
            ssm_layer_case(report, gpu, Some(bf16_gpu), &mut rng, shape, chunks, 16);
        }
    }
    // Verify steps: decodes and requests of k + 1 tokens with a state after every position,
    // every prompt short, so the prompts take `ssm_recurrent` (token by token) instead of the
    // SSD; odd shapes (rows not a multiple of 16, a state narrower than a warp), the bf16 pool.
    for gpu in [f32_gpu, bf16_gpu] {
        for (shape, state) in [
            (sh(128, 64, 8, 128, 128), None),
            (sh(6, 24, 3, 16, 8), None),
            (sh(4, 32, 1, 32, 29), None),
            (sh(16, 64, 4, 64, 128), Some(bf16_gpu)),
        ] {
            ssm_layer_case(report, gpu, state, &mut rng, shape, &[1, 5, 2, 1, 9], 1);
        }
    }
    // Decoding a sequence one token at a time leaves the same state as one prompt chunk.
    for (shape, len) in [(sh(8, 16, 2, 16, 8), 37usize), (sh(8, 64, 2, 128, 256), 40)] {
        let label = format!(
            "f32 mamba2 {}h×{} n{}: {len} single-token decodes = one {len}-token chunk",
            shape.heads, shape.head_dim, shape.state_size
        );
        match decode_steps_case(f32_gpu, &mut rng, shape, len) {
            Ok((y, state)) => {
                report.err(SUITE, format!("{label}: y"), y, 1e-4);
                report.err(SUITE, format!("{label}: conv + ssm state"), state, 1e-4);
            }
            Err(e) => report.failed(SUITE, label, format!("{e:#}")),
        }
    }
    // The hybrid fixtures end to end, as the Llama ones in `parity`: the Mamba2 hybrids (the
    // wave-2 architectures, Granite 4.0, Falcon-H1 and the Gated DeltaNet models, run in the
    // `archs` suite).
    super::parity::run_fixtures(
        report,
        f32_gpu,
        bf16_gpu,
        args,
        &["mamba2-", "nemotronh-", "bamba-"],
    );
    let fixture = args.fixtures.join("nemotronh-a");
    let dir = fixture.clone();
    let label =
        "nemotronh-a f32 engine, 64 requests in 8 prefix groups: GPU = CPU, caching on = off";
    if let Err(e) = prefix_groups(report, &dir, f32_gpu) {
        report.failed(SUITE, label, format!("{e:#}"));
    }
    let label = "nemotronh-a f32 engine under cache pressure (pause, evict, resume)";
    if let Err(e) = pressure(report, &dir, f32_gpu, label) {
        report.failed(SUITE, label, format!("{e:#}"));
    }
    for gpu in [f32_gpu, bf16_gpu] {
        let tag = if gpu.dtype() == DType::F32 {
            "f32"
        } else {
            "bf16"
        };
        let label = format!(
            "nemotronh-a {tag}: bf16 vs f32 SSM state, 2048-token prompt + 256 decodes (reported)"
        );
        let f32_state = chimera::model::CacheDtypes::default();
        let bf16_state = chimera::model::CacheDtypes {
            ssm_state: chimera::cache::SsmStateDtype::Bfloat16,
            ..f32_state
        };
        if let Err(e) = drift(report, SUITE, &dir, gpu, &label, f32_state, bf16_state) {
            report.failed(SUITE, label, format!("{e:#}"));
        }
    }
    stress(report, f32_gpu, "nemotronh-a", &fixture, seed);
    for gpu in [f32_gpu, bf16_gpu] {
        ahead(report, gpu, "nemotronh-a", &fixture);
        constrained(report, gpu, "nemotronh-a", &fixture);
    }
    // The same on a full-size NemotronH-8B shape (dummy weights) in the serving mode.
    stress(
        report,
        bf16_gpu,
        "NemotronH-8B (dummy)",
        &args.hybrid_model,
        seed,
    );
}

/// A prompt prefilled in 512-token chunks, then `decodes` greedy steps (or, with `forced`,
/// those tokens fed instead of the argmax), with the caches stored as `dtypes`. Returns the
/// argmax of every step's logits and the logits.
fn decode_run(
    m: &chimera::model::Model<CudaBackend>,
    b: &CudaBackend,
    prompt: &[u32],
    decodes: usize,
    forced: Option<&[u32]>,
    dtypes: chimera::model::CacheDtypes,
) -> R<(Vec<u32>, Vec<Vec<f32>>)> {
    use chimera::model::LogitsMode;
    const BLOCK: usize = 16;
    let blocks = (prompt.len() + decodes).div_ceil(BLOCK);
    let mut caches = m.new_caches_with(b, blocks, BLOCK, 1, dtypes)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut plan = StepPlan::new(BLOCK);
    let mut logits = Vec::new();
    let mut done = 0;
    for chunk in prompt.chunks(512) {
        plan.clear(BLOCK);
        if done == 0 {
            plan.slot_ops.push(SlotOp::Zero { slot: 0 });
        }
        plan.push(chunk, done, &table, 0, done + chunk.len() == prompt.len());
        logits = m.forward_host(b, &mut plan, &mut caches, LogitsMode::Last)?;
        done += chunk.len();
    }
    let (mut picks, mut all) = (Vec::new(), Vec::new());
    for i in 0..decodes {
        let pick = chimera::model::argmax(&logits);
        picks.push(pick);
        all.push(std::mem::take(&mut logits));
        let next = forced.map_or(pick, |f| f[i]);
        plan.clear(BLOCK);
        plan.push(&[next], done, &table, 0, true);
        logits = m.forward_host(b, &mut plan, &mut caches, LogitsMode::Last)?;
        done += 1;
    }
    Ok((picks, all))
}

/// The drift report of an opt-in narrower cache (the bf16 SSM state, the FP8 KV cache): the
/// `base` run's greedy tokens are fed to an `other` run (teacher forcing), and every step's
/// logits compared; a free-running `other` run says how long its greedy output stays
/// identical. 2048 random prompt tokens, 256 decodes.
pub(super) fn drift(
    report: &mut Report,
    suite: &str,
    dir: &std::path::Path,
    gpu: &CudaBackend,
    label: &str,
    base: chimera::model::CacheDtypes,
    other: chimera::model::CacheDtypes,
) -> R<()> {
    let m = chimera::model::load(dir, gpu)?;
    let mut rng = Rng::new(0x4452_4946);
    let vocab = m.info.vocab_size;
    let prompt: Vec<u32> = (0..2048).map(|_| 5 + rng.below(vocab - 5) as u32).collect();
    let (want, ref_logits) = decode_run(&m, gpu, &prompt, 256, None, base)?;
    let (picks, logits) = decode_run(&m, gpu, &prompt, 256, Some(&want), other)?;
    let (free, _) = decode_run(&m, gpu, &prompt, 256, None, other)?;
    // Per step: max |Δlogit| over the step's largest reference logit.
    let mut steps: Vec<f64> = logits
        .iter()
        .zip(&ref_logits)
        .map(|(a, b)| {
            let scale = b.iter().fold(1e-6f32, |s, v| s.max(v.abs()));
            let d = a
                .iter()
                .zip(b)
                .fold(0.0f32, |s, (x, y)| s.max((x - y).abs()));
            f64::from(d / scale)
        })
        .collect();
    let first = steps.first().copied().unwrap_or(f64::NAN);
    steps.sort_by(f64::total_cmp);
    let worst = steps.last().copied().unwrap_or(f64::NAN);
    let median = steps.get(steps.len() / 2).copied().unwrap_or(f64::NAN);
    let agree = picks.iter().zip(&want).filter(|(a, b)| a == b).count();
    let same_prefix = free.iter().zip(&want).take_while(|(a, b)| a == b).count();
    report.push(
        suite,
        label.to_string(),
        worst,
        format!(
            "Δlogit/scale after the prompt {first:.1e}, median {median:.1e}, max {worst:.1e}; \
             greedy {agree}/256 forced, free-running identical for {same_prefix}"
        ),
        "reported".into(),
        worst.is_finite(),
    );
    Ok(())
}

/// 64 requests in 8 groups sharing a 4-block prefix, submitted in a fixed order, through the
/// real engine on the CPU and on the GPU (f32): identical tokens, caching on = off on the GPU,
/// and the same prefix hits and SSM restores as the CPU (more than none).
fn prefix_groups(report: &mut Report, dir: &std::path::Path, gpu: &CudaBackend) -> R<()> {
    use super::parity::drive_engine;
    use std::sync::Arc;
    let cpu = CpuBackend::default();
    let mc = Arc::new(chimera::model::load(dir, &cpu)?);
    let mg = Arc::new(chimera::model::load(dir, gpu)?);
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
            "nemotronh-a SSM restores / prefix-hit tokens on the GPU = CPU ({} / {})",
            gs.ssm_restores, gs.prefix_cache_hits
        ),
        gs.ssm_restores as f64,
        format!("{} / {}", gs.ssm_restores, gs.prefix_cache_hits),
        format!("{} / {}, > 0", cs.ssm_restores, cs.prefix_cache_hits),
        counts_same,
    );
    Ok(())
}

/// The prefix-group workload with 16 running requests on a pool too small for them: requests
/// pause, the newest are evicted and recomputed. The tokens equal an unpressured run's, and the
/// GPU preempts exactly as often as the CPU (the same schedule).
fn pressure(report: &mut Report, dir: &std::path::Path, gpu: &CudaBackend, label: &str) -> R<()> {
    use super::parity::drive_engine_with;
    use chimera::cache::{ByteSize, CacheConfig, CacheLayout};
    use std::sync::Arc;
    let cpu = CpuBackend::default();
    let mc = Arc::new(chimera::model::load(dir, &cpu)?);
    let mg = Arc::new(chimera::model::load(dir, gpu)?);
    // The smallest budget that plans a pool of 20 blocks: five 64-token prompts fill it
    // exactly, and each one's first decode needs a fifth block of its own.
    let spec = mg.info.cache.clone();
    let step = (spec.kv_block_bytes(16) as u64 / 8).max(1);
    let mut budget = step;
    let blocks = loop {
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(budget)),
            block_size: 16,
            ..CacheConfig::default()
        };
        if let Ok(l) = CacheLayout::plan(&cfg, &spec, 16)
            && l.num_blocks >= 20
        {
            break l.num_blocks;
        }
        anyhow::ensure!(budget < 1 << 30, "no budget plans 20 blocks");
        budget += step;
    };
    let requests: Vec<Vec<u32>> = (0..12u32)
        .map(|i| {
            (0..64)
                .map(|j| (i * 37 + j * 11 + j * j) % 500 + 1)
                .collect()
        })
        .collect();
    let free = drive_engine_with(
        gpu.replica()?,
        mg.clone(),
        &requests,
        true,
        24,
        64 << 20,
        16,
    )?;
    let tight = drive_engine_with(gpu.replica()?, mg, &requests, true, 24, budget, 16)?;
    let cpu_tight = drive_engine_with(cpu, mc, &requests, true, 24, budget, 16)?;
    let (p, cp) = (tight.1.preemptions, cpu_tight.1.preemptions);
    let ok = tight.0 == free.0 && tight.0 == cpu_tight.0 && p > 0 && p == cp;
    report.push(
        SUITE,
        format!("{label}: {blocks}-block pool, tokens = unpressured = CPU"),
        p as f64,
        format!(
            "{}, {p} preemptions",
            if tight.0 == free.0 && tight.0 == cpu_tight.0 {
                "identical"
            } else {
                "DIFFER"
            }
        ),
        format!("identical, {cp} preemptions (CPU), > 0"),
        ok,
    );
    Ok(())
}

/// Router logits on a coarse grid (many ties) through both routers.
///
/// Every tie must be between scores computed from the same inputs, so both devices see it as a
/// tie: the logits are non-negative (`sigmoid(x) + sigmoid(-x) = 1` would make group scores of
/// different logits equal on paper and an ulp apart on one device, the GPU's `expf` not being
/// the CPU's `exp`), and the correction bias is one value per group (with two biases in a group,
/// `(s(a) + 0) + (s(c) + 0.25)` and `(s(a) + 0.25) + (s(c) + 0)` round differently). With
/// `x = k / 2, k ≥ 0` the sigmoids `1 / (1 + e^(-k/2))` are independent over the rationals, so
/// no two different sets of inputs give equal scores.
fn routing_case(
    gpu: &CudaBackend,
    rng: &mut Rng,
    tokens: usize,
    experts: usize,
    (n_group, topk_group, top_k, norm): (usize, usize, usize, bool),
) -> R<bool> {
    let logits: Vec<f32> = (0..tokens * experts)
        .map(|_| (rng.sym(3.0).abs() * 2.0).round() / 2.0)
        .collect();
    let group_bias: Vec<f32> = (0..n_group)
        .map(|_| (rng.sym(0.5) * 4.0).round() / 4.0)
        .collect();
    let bias: Vec<f32> = (0..experts)
        .map(|e| group_bias[e / (experts / n_group)])
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
    fn apply<B: StepBackend>(
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
    state_bf16: Option<&CudaBackend>,
    rng: &mut Rng,
    shape: chimera::backend::SsmShape,
    chunks: &[usize],
    snapshot_every: usize,
) {
    let f32_mode = gpu.dtype() == DType::F32;
    let tag = match (f32_mode, state_bf16.is_some()) {
        (true, false) => "f32",
        (false, false) => "bf16",
        (true, true) => "f32 (bf16 state)",
        (false, true) => "bf16 (bf16 state)",
    };
    let label = format!(
        "{tag} mamba2 conv+scan {}h×{} g{} n{} chunk {} seqs {chunks:?}, snapshots every {snapshot_every}",
        shape.heads, shape.head_dim, shape.groups, shape.state_size, shape.chunk_size
    );
    match ssm_layer(gpu, state_bf16, rng, shape, chunks, snapshot_every) {
        Ok((out_err, state_err, snap_err, snaps)) => {
            // A bf16 state pool rounds the stored states only (the update runs in f32 from
            // the same starting values), so the outputs keep the mode's tolerance.
            let tol = if f32_mode { 1e-4 } else { 1e-2 };
            let state_tol = if f32_mode && state_bf16.is_none() {
                1e-4
            } else {
                1e-2
            };
            report.err(SUITE, format!("{label}: y"), out_err, tol);
            report.err(
                SUITE,
                format!("{label}: live + snapshot states"),
                state_err,
                state_tol,
            );
            if f32_mode {
                report.err(
                    SUITE,
                    format!("{label}: {snaps} snapshots = separate runs"),
                    snap_err,
                    if state_bf16.is_some() { 1e-2 } else { 1e-5 },
                );
            }
        }
        Err(e) => report.failed(SUITE, label, format!("{e:#}")),
    }
}

type LayerErrs = (f64, f64, f64, usize);

/// One Mamba2 layer (conv, split, scan) of `plan` on `b` from `pools`: the conv and scan outputs
/// (concatenated) and both pools after the step.
fn layer_on<B: StepBackend>(
    b: &B,
    plan: &StepPlan,
    mut pools: SsmPools<B::Tensor>,
    dims: (usize, usize, usize, usize, usize),
    inputs: [&[f32]; 7],
    shape: chimera::backend::SsmShape,
) -> R<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (_, _, conv_dim, kernel, layer) = dims;
    let [x, w, cb, dt, a_log, d, dt_bias] = inputs;
    let (h, p, g, n) = (shape.heads, shape.head_dim, shape.groups, shape.state_size);
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
    let ops = SsmOperands {
        x: &xs,
        b: &bm,
        c: &cm,
        dt: &dtt,
        a_log: &al,
        d: &dd,
        dt_bias: &db,
    };
    let y = b.ssm_scan(&ops, shape, &mut pools, layer, &step)?;
    let mut out = b.download(&conv)?;
    out.extend(b.download(&y)?);
    Ok((out, b.download(&pools.conv)?, b.download(&pools.ssm)?))
}

/// One sequence of `len` tokens through a Mamba2 layer on the GPU (f32): as one prompt chunk,
/// and as `len` single-token decode steps from the same starting state. Returns the worst
/// relative difference of the outputs and of the final conv + SSM states.
fn decode_steps_case(
    gpu: &CudaBackend,
    rng: &mut Rng,
    shape: chimera::backend::SsmShape,
    len: usize,
) -> R<(f64, f64)> {
    gpu.set_ssm_chunk_size(shape.chunk_size);
    let (h, p, g, n) = (shape.heads, shape.head_dim, shape.groups, shape.state_size);
    let conv_dim = h * p + 2 * g * n;
    let (kernel, layers, layer) = (4, 2, 1);
    let dims = (1, layers, conv_dim, kernel, layer);
    let conv_shape = [1, layers, conv_dim, kernel - 1];
    let ssm_shape = [1, layers, h, p, n];
    let conv0 = rng.vec(layers * conv_dim * (kernel - 1), 1.0);
    let ssm0 = rng.vec(layers * h * p * n, 1.0);
    let x = rng.vec(len * conv_dim, 1.0);
    let w = rng.vec(conv_dim * kernel, 0.5);
    let cb = rng.vec(conv_dim, 0.1);
    let dt = rng.vec(len * h, 1.0);
    let a_log: Vec<f32> = (0..h).map(|_| rng.unit() * 2.0).collect();
    let d = rng.vec(h, 1.0);
    let dt_bias = rng.vec(h, 0.5);
    let table: Vec<u32> = (0..64).collect();
    let tokens: Vec<u32> = (0..len as u32).map(|t| t % 100 + 1).collect();
    let pools = |conv: &[f32], ssm: &[f32]| -> R<SsmPools<_>> {
        Ok(SsmPools {
            conv: gpu.upload(HostTensor::f32(conv, &conv_shape))?,
            ssm: gpu.upload(HostTensor::f32(ssm, &ssm_shape))?,
            slots: 1,
            layers,
        })
    };
    let mut plan = StepPlan::new(16);
    plan.push(&tokens, 7, &table, 0, true);
    plan.finish()?;
    let inputs = [
        &x[..],
        &w[..],
        &cb[..],
        &dt[..],
        &a_log[..],
        &d[..],
        &dt_bias[..],
    ];
    let (one, conv1, ssm1) = layer_on(gpu, &plan, pools(&conv0, &ssm0)?, dims, inputs, shape)?;
    // The chunk's output rows: conv (len × conv_dim) then y (len × h·p).
    let (one_conv, one_y) = one.split_at(len * conv_dim);
    let (mut conv, mut ssm) = (conv0, ssm0);
    let (mut steps_conv, mut steps_y) = (Vec::new(), Vec::new());
    for (i, &t) in tokens.iter().enumerate() {
        let mut plan = StepPlan::new(16);
        plan.push(&[t], 7 + i, &table, 0, true);
        plan.finish()?;
        let xi = &x[i * conv_dim..(i + 1) * conv_dim];
        let dti = &dt[i * h..(i + 1) * h];
        let inputs = [xi, &w[..], &cb[..], dti, &a_log[..], &d[..], &dt_bias[..]];
        // (Offset 7: the sequence continues a history, as in `ssm_layer`.)
        let (out, c, s) = layer_on(gpu, &plan, pools(&conv, &ssm)?, dims, inputs, shape)?;
        steps_conv.extend_from_slice(&out[..conv_dim]);
        steps_y.extend_from_slice(&out[conv_dim..]);
        (conv, ssm) = (c, s);
    }
    let y_err = rel_err(&steps_y, one_y).max(rel_err(&steps_conv, one_conv));
    let mut a = conv.clone();
    a.extend(&ssm);
    let mut b = conv1;
    b.extend(&ssm1);
    Ok((y_err, rel_err(&a, &b)))
}

fn ssm_layer(
    gpu: &CudaBackend,
    state_bf16: Option<&CudaBackend>,
    rng: &mut Rng,
    shape: chimera::backend::SsmShape,
    chunks: &[usize],
    snapshot_every: usize,
) -> R<LayerErrs> {
    let cpu = CpuBackend::default();
    gpu.set_ssm_chunk_size(shape.chunk_size);
    let bf16 = gpu.dtype() == DType::BF16;
    let round = |v: Vec<f32>| round_if_bf16(v, bf16);
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
    let dims = (slots, layers, conv_dim, kernel, layer);
    let (conv_shape, ssm_shape) = (
        [slots, layers, conv_dim, kernel - 1],
        [slots, layers, h, p, n],
    );
    // The conv pool is f32 in every mode; a bf16 backend uploads in bf16, so there it starts
    // at zero. The recurrent pool is f32 (random starting states in f32 mode, zeros in bf16
    // mode) or, with `state_bf16`, bf16 uploaded through that bf16 backend (random starting
    // states rounded to bf16, which the CPU then starts from too).
    let conv0 = if bf16 { vec![0.0; conv0.len()] } else { conv0 };
    let ssm0 = match state_bf16 {
        Some(_) => ssm0
            .into_iter()
            .map(|v| half::bf16::from_f32(v).to_f32())
            .collect(),
        None if bf16 => vec![0.0; ssm0.len()],
        None => ssm0,
    };
    let cpu_pools = |conv0: &[f32], ssm0: &[f32]| -> R<SsmPools<_>> {
        Ok(SsmPools {
            conv: cpu.upload(HostTensor::f32(conv0, &conv_shape))?,
            ssm: cpu.upload(HostTensor::f32(ssm0, &ssm_shape))?,
            slots,
            layers,
        })
    };
    let gpu_pools = SsmPools {
        conv: if bf16 {
            gpu.zeros(&conv_shape, DType::F32)?
        } else {
            gpu.upload(HostTensor::f32(&conv0, &conv_shape))?
        },
        ssm: match state_bf16 {
            Some(b) => b.upload(HostTensor::f32(&ssm0, &ssm_shape))?,
            None if bf16 => gpu.zeros(&ssm_shape, DType::F32)?,
            None => gpu.upload(HostTensor::f32(&ssm0, &ssm_shape))?,
        },
        slots,
        layers,
    };
    let inputs = [
        &x[..],
        &w[..],
        &cb[..],
        &dt[..],
        &a_log[..],
        &d[..],
        &dt_bias[..],
    ];
    let (go, gconv, gssm) = layer_on(gpu, &plan, gpu_pools, dims, inputs, shape)?;
    let (co, cconv, cssm) = layer_on(&cpu, &plan, cpu_pools(&conv0, &ssm0)?, dims, inputs, shape)?;
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
        let (_, aconv, assm) =
            layer_on(&cpu, &alone, cpu_pools(&conv0, &ssm0)?, dims, inputs, shape)?;
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
pub(super) fn stress(
    report: &mut Report,
    gpu: &CudaBackend,
    model: &str,
    dir: &std::path::Path,
    seed: u64,
) {
    let dummy = !dir.join("reference.json").exists();
    let tag = if gpu.dtype() == DType::F32 {
        "f32"
    } else {
        "bf16"
    };
    let label = format!("{model} {tag} engine stress: 500 requests, 10% cancelled");
    match stress_run(gpu, dir, dummy, seed) {
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
                format!("{label}: driver allocations after step 50"),
                allocs as f64,
                allocs.to_string(),
                "0".into(),
                allocs == 0,
            );
        }
        Err(e) => report.failed(SUITE, label, format!("{e:#}")),
    }
}

/// Scheduling ahead on the GPU gives the tokens of scheduling after each update: 24 greedy
/// requests over 3 shared prefixes, all arriving at once with the same output length (so both
/// runs batch alike), prefilled in 256-token steps beside decodes, with graphs on — the steps
/// scheduled ahead carry placeholder tokens into decode and mixed graphs and eager steps.
fn ahead(report: &mut Report, gpu: &CudaBackend, model: &str, dir: &std::path::Path) {
    let tag = if gpu.dtype() == DType::F32 {
        "f32"
    } else {
        "bf16"
    };
    let label = format!("{model} {tag} engine: scheduling ahead = after each update");
    let run = |ahead: bool| ahead_run(gpu, dir, ahead);
    match run(false).and_then(|a| run(true).map(|b| (a, b))) {
        Ok(((after, _), (ahead, kinds))) => {
            let same = (after.iter().zip(&ahead))
                .filter(|(a, b)| a == b && !a.is_empty())
                .count();
            report.push(
                SUITE,
                format!(
                    "{label}: requests with identical tokens (steps ahead: {} eager, {} decode graph, {} mixed graph)",
                    kinds.eager, kinds.decode_graph, kinds.mixed_graph
                ),
                same as f64,
                format!("{same}/{}", after.len()),
                format!("{}/{}", after.len(), after.len()),
                same == after.len() && ahead.len() == after.len(),
            );
        }
        Err(e) => report.failed(SUITE, label, format!("{e:#}")),
    }
}

/// Constrained responses on the device (the token masks applied by `sample_apply_masks`, the
/// native llguidance twin over a synthetic byte vocabulary): every constrained response is
/// what its grammar allows and ends with EOS. How many unconstrained requests beside them get
/// the tokens they get alone is reported, not required: the batches differ, and the device's
/// kernels may round differently at another batch size.
fn constrained(report: &mut Report, gpu: &CudaBackend, model: &str, dir: &std::path::Path) {
    let tag = if gpu.dtype() == DType::F32 {
        "f32"
    } else {
        "bf16"
    };
    let label = format!(
        "{model} {tag} engine: 12 constrained responses (regex, choice, JSON schema) follow their grammar"
    );
    let result = constrained_run(gpu, dir, false)
        .and_then(|alone| constrained_run(gpu, dir, true).map(|mixed| (alone, mixed)));
    match result {
        Ok(((free_alone, _), (free_mixed, bad))) => {
            let same = free_alone
                .iter()
                .zip(&free_mixed)
                .filter(|(a, b)| a == b)
                .count();
            for b in &bad {
                eprintln!("      {b}");
            }
            report.push(
                SUITE,
                label,
                bad.len() as f64,
                format!(
                    "{} off-grammar ({same}/{} free requests identical to their run alone)",
                    bad.len(),
                    free_alone.len()
                ),
                "0 off-grammar".into(),
                bad.is_empty(),
            );
        }
        Err(e) => report.failed(SUITE, label, format!("{e:#}")),
    }
}

/// The free requests' tokens, and what went wrong with the constrained ones (with them only
/// when `with_constrained`).
fn constrained_run(
    gpu: &CudaBackend,
    dir: &std::path::Path,
    with_constrained: bool,
) -> R<(Vec<Vec<u32>>, Vec<String>)> {
    use chimera::cache::{ByteSize, CacheConfig};
    use chimera::engine::api::{EngineEvent, FinishReason, Grammar};
    use chimera::engine::{Engine, EngineConfig, EngineSetup, ModelRunner, Policies};
    use chimera::plugins::Vocabulary;
    let backend = gpu.replica()?;
    let model = std::sync::Arc::new(chimera::model::load(dir, &backend)?);
    let vocab = model.info.vocab_size;
    let eos = *model
        .info
        .eos_token_ids
        .first()
        .filter(|&&e| (e as usize) < vocab)
        .ok_or_else(|| anyhow::anyhow!("the fixture has no EOS inside its vocabulary"))?;
    // Tokens below 256 are bytes, the rest `t<id>`; EOS is special.
    let texts: Vec<Vec<u8>> = (0..vocab)
        .map(|i| match i {
            _ if i == eos as usize => b"<|eos|>".to_vec(),
            0..256 => vec![i as u8],
            _ => format!("t{i}").into_bytes(),
        })
        .collect();
    let vocabulary = std::sync::Arc::new(Vocabulary::from_tokens(
        texts
            .iter()
            .enumerate()
            .map(|(i, t)| (&t[..], i == eos as usize)),
        eos,
    ));
    let setup = EngineSetup {
        engine: EngineConfig {
            max_batched_tokens: 256,
            max_running: 32,
            ..Default::default()
        },
        cache: CacheConfig {
            memory_budget: Some(ByteSize(64 << 20)),
            block_size: 16,
            prefix_caching: true,
            ..Default::default()
        },
        hash_salt: "constrained".into(),
        speculative: Default::default(),
    };
    let policies = Policies {
        constrainer: Some(chimera::policy::native::constrainer(
            &Default::default(),
            &vocabulary,
        )),
        ..Policies::builtin()
    };
    let mut engine = Engine::new(setup, ModelRunner::new(backend, model), policies)?;
    let schema = r#"{"type":"object","properties":{"ok":{"type":"boolean"},"n":{"enum":[1,2,3]}},"required":["ok","n"],"additionalProperties":false}"#;
    let grammars = [
        ("regex", "(ab|cd){4}x"),
        ("choice", r#"["alpha", "beta", "gamma"]"#),
        ("json-schema", schema),
    ];
    let mut rng = Rng::new(0x434f_4e53);
    let mut free = Vec::new();
    let mut constrained = Vec::new();
    for id in 0..24u64 {
        let prompt: Vec<u32> = (0..1 + rng.below(60) as u32)
            .map(|_| rng.below(vocab.min(400) - 1) as u32 + 1)
            .collect();
        let (tx, r) = tokio::sync::mpsc::unbounded_channel();
        let mut req = greedy_request(id, prompt, 20);
        if id % 2 == 1 {
            if !with_constrained {
                continue;
            }
            let (kind, text) = grammars[(id / 2) as usize % grammars.len()];
            req.constraint = Some(Grammar {
                kind: kind.into(),
                text: text.into(),
            });
            req.ignore_eos = false;
            req.max_tokens = 200;
            constrained.push((kind, r));
        } else {
            free.push(r);
        }
        engine.add(req, tx);
    }
    let mut steps = 0;
    while !engine.is_idle() {
        engine.step();
        steps += 1;
        anyhow::ensure!(steps < 20_000, "the engine made no progress");
    }
    let drain = |r: &mut tokio::sync::mpsc::UnboundedReceiver<EngineEvent>| {
        let (mut tokens, mut end) = (Vec::new(), None);
        while let Ok(ev) = r.try_recv() {
            match ev {
                EngineEvent::Tokens { tokens: t, .. } => tokens.extend(t),
                EngineEvent::Finished { reason, .. } => end = Some(Ok(reason)),
                EngineEvent::Failed { message, .. } => end = Some(Err(message)),
                _ => {}
            }
        }
        (tokens, end)
    };
    let mut free_tokens = Vec::new();
    for r in &mut free {
        let (t, end) = drain(r);
        if let Some(Err(m)) = end {
            anyhow::bail!("a free request failed: {m}");
        }
        free_tokens.push(t);
    }
    let mut bad = Vec::new();
    for (kind, r) in &mut constrained {
        let (tokens, end) = drain(r);
        let text: Vec<u8> = tokens
            .iter()
            .filter(|&&t| t != eos)
            .flat_map(|&t| texts[t as usize].clone())
            .collect();
        let text = String::from_utf8_lossy(&text).into_owned();
        let ok = end == Some(Ok(FinishReason::Stop))
            && tokens.last() == Some(&eos)
            && match *kind {
                "regex" => {
                    text.len() == 9
                        && text.ends_with('x')
                        && text.as_bytes()[..8]
                            .chunks(2)
                            .all(|p| p == b"ab" || p == b"cd")
                }
                "choice" => ["alpha", "beta", "gamma"].contains(&text.as_str()),
                _ => serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|v| {
                    v["ok"].is_boolean() && [1, 2, 3].contains(&v["n"].as_i64().unwrap_or(0))
                }),
            };
        if !ok {
            bad.push(format!("{kind}: {text:?} ended {end:?}"));
        }
    }
    Ok((free_tokens, bad))
}

/// A greedy request that ignores EOS: `max_tokens` tokens exactly.
fn greedy_request(
    id: u64,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> chimera::engine::api::GenerateRequest {
    chimera::engine::api::GenerateRequest {
        id,
        prompt,
        params: chimera::engine::api::SamplingParams::default(),
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

/// The tokens of each request of [`ahead`]'s workload, and how the steps ran.
fn ahead_run(
    gpu: &CudaBackend,
    dir: &std::path::Path,
    schedule_ahead: bool,
) -> R<(Vec<Vec<u32>>, chimera::engine::StepKinds)> {
    use chimera::cache::{ByteSize, CacheConfig};
    use chimera::engine::api::EngineEvent;
    use chimera::engine::{Engine, EngineConfig, EngineSetup, ModelRunner, Policies, StepExecutor};
    let backend = gpu.replica()?;
    let model = std::sync::Arc::new(chimera::model::load(dir, &backend)?);
    let vocab = model.info.vocab_size;
    let setup = EngineSetup {
        engine: EngineConfig {
            max_batched_tokens: 256,
            max_running: 32,
            schedule_ahead,
            ..Default::default()
        },
        cache: CacheConfig {
            memory_budget: Some(ByteSize(64 << 20)),
            block_size: 16,
            prefix_caching: true,
            ..Default::default()
        },
        hash_salt: "ahead".into(),
        speculative: Default::default(),
    };
    let mut engine = Engine::new(setup, ModelRunner::new(backend, model), Policies::builtin())?;
    let mut rng = Rng::new(0x4148_4541);
    let mut rx = Vec::new();
    for id in 0..24u64 {
        let len = 1 + rng.below(180);
        let prompt: Vec<u32> = (0..len as u32)
            .map(|j| {
                if j < 40 {
                    ((id % 3) as u32 * 37 + j * 11) % 400 + 1
                } else {
                    rng.below(vocab.min(400) - 1) as u32 + 1
                }
            })
            .collect();
        let (tx, r) = tokio::sync::mpsc::unbounded_channel();
        engine.add(greedy_request(id, prompt, 20), tx);
        rx.push(r);
    }
    let mut steps = 0;
    while !engine.is_idle() {
        engine.step();
        steps += 1;
        anyhow::ensure!(steps < 10_000, "the engine made no progress");
    }
    let mut tokens = vec![Vec::new(); rx.len()];
    for (t, r) in tokens.iter_mut().zip(rx.iter_mut()) {
        while let Ok(ev) = r.try_recv() {
            match ev {
                EngineEvent::Tokens { tokens, .. } => t.extend(tokens),
                EngineEvent::Failed { message, .. } => anyhow::bail!("a request failed: {message}"),
                _ => {}
            }
        }
    }
    Ok((tokens, engine.executor().step_kinds()))
}

fn stress_run(
    gpu: &CudaBackend,
    dir: &std::path::Path,
    dummy: bool,
    seed: u64,
) -> R<(bool, bool, u64)> {
    use chimera::cache::{ByteSize, CacheConfig};
    use chimera::engine::api::EngineEvent;
    use chimera::engine::{Engine, EngineConfig, EngineSetup, ModelRunner, Policies};
    let backend = gpu.replica()?;
    let model = std::sync::Arc::new(if dummy {
        chimera::model::load_dummy(dir, &backend, seed)?
    } else {
        chimera::model::load(dir, &backend)?
    });
    let vocab = model.info.vocab_size;
    // A full-size model's state is ~100 MB a slot: give it room for snapshots too.
    let budget = if dummy { 24u64 << 30 } else { 32 << 20 };
    let setup = EngineSetup {
        engine: EngineConfig {
            max_batched_tokens: 256,
            max_running: 16,
            ..Default::default()
        },
        cache: CacheConfig {
            memory_budget: Some(ByteSize(budget)),
            block_size: 16,
            prefix_caching: true,
            ..Default::default()
        },
        hash_salt: "stress".into(),
        speculative: Default::default(),
    };
    let mut engine = Engine::new(
        setup,
        ModelRunner::new(backend.clone(), model),
        Policies::builtin(),
    )?;
    let mut rng = Rng::new(seed ^ 0x5354_5245);
    let mut rx = Vec::new();
    let mut cancel_at = std::collections::BTreeMap::new();
    let total = 500u64;
    let (mut added, mut ended) = (0u64, 0u64);
    let mut allocs_at_50 = None;
    let mut late = Vec::new();
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
                        rng.below(vocab.min(500) - 1) as u32 + 1
                    }
                })
                .collect();
            let (tx, r) = tokio::sync::mpsc::unbounded_channel();
            engine.add(greedy_request(added, prompt, 1 + rng.below(32) as u32), tx);
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
        let (n, bytes) = (backend.driver_allocations(), backend.allocated_bytes());
        engine.step();
        if step == 50 {
            allocs_at_50 = Some(backend.driver_allocations());
        } else if step > 50 && backend.driver_allocations() > n {
            // Where the late allocations happen, and what the step held, for the report.
            let t = engine.stats();
            late.push(format!(
                "step {step}: {} allocation(s), {} KiB, {} running, {} waiting",
                backend.driver_allocations() - n,
                (backend.allocated_bytes() - bytes) >> 10,
                t.running,
                t.waiting
            ));
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
    if !late.is_empty() {
        tracing::warn!(allocations = ?late, "driver allocations after step 50");
    }
    Ok((ended == total, free, allocs))
}
