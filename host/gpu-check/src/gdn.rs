//! The Gated DeltaNet delta rule on the GPU (`gdn_prep`, then `gdn_decode`, `gdn_prompt` and
//! for key dims over 128 `gdn_scan`) against the CPU's
//! chunked form, and its timings: the rows of the `archs` suite (checks) and the
//! `bench-archs` suite (timings).
//!
//! Checks: mixed steps (prompt chunks with a snapshot at every 16-token boundary beside
//! decodes, some decodes with a snapshot of their own), the Qwen3.5 layer
//! (16 key heads, 32 value heads, 128 × 128) and odd shapes (key dim 40: two rows a lane with
//! guards; value dim 20: no vector path; key dim 160: prompts in `gdn_scan`), f32 and bf16
//! activations, f32 and bf16 state. Every
//! output, live state and snapshot state is compared; the untouched slots must stay as they
//! were.
//!
//! Timings (bf16, the Qwen3.5 layer): one 8192-token prompt without snapshots and with a
//! snapshot at every 16-token boundary, and decode at batch 256 as bytes of state read and
//! written per second, against the copy bandwidth measured in the same run.

use std::time::Instant;

use super::rng::Rng;
use super::{Report, rel_err, round_if_bf16};
use chimera::backend::cpu::CpuBackend;
use chimera::backend::cuda::CudaBackend;
use chimera::backend::{
    Backend, DType, GdnOperands, GdnShape, HostTensor, LayerOps, SsmPools, StepBackend, StepPlan,
};

type R<T> = anyhow::Result<T>;

const LAYERS: usize = 2;
const LAYER: usize = 1;
const CHUNK: usize = 64;

fn shape(k_heads: usize, v_heads: usize, k_dim: usize, v_dim: usize) -> GdnShape {
    GdnShape {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        chunk_size: CHUNK,
    }
}

/// The checks, for one backend (its dtype: the activations).
pub(super) fn checks(report: &mut Report, suite: &str, gpu: &CudaBackend, rng: &mut Rng) {
    let qwen = shape(16, 32, 128, 128);
    // Key dims ≤ 128 take gdn_prompt for their prompts; 160 takes gdn_scan.
    let cases: [(GdnShape, &[usize], bool); 7] = [
        (qwen, &[1; 8], false),
        (qwen, &[1, 300, 1, 1, 45], false),
        (qwen, &[1, 300, 1, 1, 45], true),
        (shape(2, 6, 40, 24), &[131, 1, 40, 1, 7, 1], false),
        (shape(1, 3, 8, 20), &[70, 1, 1, 33], false),
        (shape(2, 4, 16, 16), &[1, 1, 1], true),
        (shape(1, 2, 160, 24), &[1, 70, 1, 20], false),
    ];
    let tag = if gpu.dtype() == DType::F32 {
        "f32"
    } else {
        "bf16"
    };
    for (sh, seqs, bf16_state) in cases {
        let label = format!(
            "{tag} gated delta rule {}k×{} {}v×{}, {} state, seqs {seqs:?}",
            sh.k_heads,
            sh.k_dim,
            sh.v_heads,
            sh.v_dim,
            if bf16_state { "bf16" } else { "f32" }
        );
        match case(gpu, rng, sh, seqs, bf16_state) {
            Ok(c) => {
                let exact = gpu.dtype() == DType::F32 && !bf16_state;
                report.err(
                    suite,
                    format!("{label}: o = CPU"),
                    c.out_err,
                    if exact { 1e-4 } else { 2e-2 },
                );
                report.err(
                    suite,
                    format!("{label}: live + snapshot states = CPU"),
                    c.state_err,
                    if exact { 1e-4 } else { 1e-2 },
                );
                report.push(
                    suite,
                    format!("{label}: slots the step does not name are untouched"),
                    c.untouched_changed as f64,
                    format!("{} values changed", c.untouched_changed),
                    "0".into(),
                    c.untouched_changed == 0,
                );
            }
            Err(e) => report.failed(suite, label, format!("{e:#}")),
        }
    }
}

struct CaseOut {
    out_err: f64,
    state_err: f64,
    untouched_changed: usize,
}

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    state0: Vec<f32>,
}

/// A plan of `seqs` chunks (live slots `0..seqs`; prompts snapshot every 16 tokens, every
/// other decode once, into the slots after them) and one spare slot that nothing names.
/// Returns the plan and the slot count.
fn mixed_plan(seqs: &[usize]) -> R<(StepPlan, usize)> {
    let mut plan = StepPlan::new(16);
    let table: Vec<u32> = (0..4096).collect();
    let mut next_slot = seqs.len() as u32;
    for (i, &len) in seqs.iter().enumerate() {
        let tokens: Vec<u32> = (0..len).map(|t| (t % 100) as u32 + 1).collect();
        plan.push(&tokens, 7, &table, i as u32, true);
        if len == 1 && i % 2 == 0 {
            plan.snapshot(1, next_slot);
            next_slot += 1;
        }
        let mut after = 16;
        while len > 1 && after <= len {
            plan.snapshot(after, next_slot);
            next_slot += 1;
            after += 16;
        }
    }
    plan.finish()?;
    // One slot past every named one: it must come back as it went in.
    Ok((plan, next_slot as usize + 1))
}

fn case(
    gpu: &CudaBackend,
    rng: &mut Rng,
    sh: GdnShape,
    seqs: &[usize],
    bf16_state: bool,
) -> R<CaseOut> {
    let cpu = CpuBackend::default();
    gpu.set_ssm_chunk_size(CHUNK);
    let bf16 = gpu.dtype() == DType::BF16;
    let round = |v: Vec<f32>| round_if_bf16(v, bf16);
    let (plan, slots) = mixed_plan(seqs)?;
    let n = plan.num_tokens();
    let state_len = slots * LAYERS * sh.state_elems();
    // Starting states: random where the GPU pool can take them as they are (see `run`).
    let state0 = if bf16 || bf16_state {
        vec![0.0; state_len]
    } else {
        rng.vec(state_len, 0.5)
    };
    let inputs = Inputs {
        q: round(rng.vec(n * sh.key_dim(), 1.0)),
        k: round(rng.vec(n * sh.key_dim(), 1.0)),
        v: round(rng.vec(n * sh.value_dim(), 1.0)),
        a: round(rng.vec(n * sh.v_heads, 1.0)),
        b: round(rng.vec(n * sh.v_heads, 2.0)),
        a_log: round((0..sh.v_heads).map(|_| rng.unit() * 1.5).collect()),
        dt_bias: round(rng.vec(sh.v_heads, 0.5)),
        state0,
    };
    let (go, gs) = run(gpu, &plan, &inputs, sh, slots, bf16_state)?;
    let (co, cs) = run(&cpu, &plan, &inputs, sh, slots, false)?;
    // The spare slot (the last) of every layer, and layer 0 of every slot, are untouched.
    let per = sh.state_elems();
    let mut untouched_changed = 0;
    for s in 0..slots {
        for l in 0..LAYERS {
            if l == LAYER && s + 1 != slots {
                continue;
            }
            let at = (s * LAYERS + l) * per;
            untouched_changed += gs[at..at + per]
                .iter()
                .zip(&inputs.state0[at..at + per])
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
        }
    }
    Ok(CaseOut {
        out_err: rel_err(&go, &co),
        state_err: rel_err(&gs, &cs),
        untouched_changed,
    })
}

/// One `gated_delta_rule` of `plan` on `b`: the output and the SSM pool after the step (as
/// f32).
fn run<B: StepBackend>(
    b: &B,
    plan: &StepPlan,
    i: &Inputs,
    sh: GdnShape,
    slots: usize,
    bf16_state: bool,
) -> R<(Vec<f32>, Vec<f32>)> {
    let n = plan.num_tokens();
    let conv_shape = [slots, LAYERS, 1, 2];
    let ssm_shape = [slots, LAYERS, sh.v_heads, sh.k_dim, sh.v_dim];
    // Random starting states only where the pool can hold them exactly (an f32 pool on the
    // f32 backend: an upload converts to the activation dtype); zeros otherwise.
    let ssm = if bf16_state {
        b.zeros(&ssm_shape, DType::BF16)?
    } else if b.act_dtype() == DType::F32 {
        b.upload(HostTensor::f32(&i.state0, &ssm_shape))?
    } else {
        b.zeros(&ssm_shape, DType::F32)?
    };
    let mut pools = SsmPools {
        conv: b.zeros(&conv_shape, DType::F32)?,
        ssm,
        slots,
        layers: LAYERS,
    };
    let up = |v: &[f32], shape: &[usize]| b.upload(HostTensor::f32(v, shape));
    let q = up(&i.q, &[n, sh.key_dim()])?;
    let k = up(&i.k, &[n, sh.key_dim()])?;
    let v = up(&i.v, &[n, sh.value_dim()])?;
    let a = up(&i.a, &[n, sh.v_heads])?;
    let bb = up(&i.b, &[n, sh.v_heads])?;
    let a_log = up(&i.a_log, &[sh.v_heads])?;
    let dt_bias = up(&i.dt_bias, &[sh.v_heads])?;
    let mut step = b.new_step(n)?;
    b.upload_step(plan, &mut step)?;
    let ops = GdnOperands {
        q: &q,
        k: &k,
        v: &v,
        a: &a,
        b: &bb,
        a_log: &a_log,
        dt_bias: &dt_bias,
    };
    let o = b.gated_delta_rule(&ops, sh, &mut pools, LAYER, &step)?;
    if b.shape(&o) != [n, sh.value_dim()] {
        anyhow::bail!("o {:?}, expected [{n}, {}]", b.shape(&o), sh.value_dim());
    }
    Ok((b.download(&o)?, b.download(&pools.ssm)?))
}

/// The timings of the `bench-archs` suite (bf16 activations). `bw`: the copy bandwidth
/// measured in the same run (bytes read + written per second).
pub(super) fn bench(report: &mut Report, suite: &str, gpu: &CudaBackend, bw: f64) -> R<()> {
    let sh = shape(16, 32, 128, 128);
    gpu.set_ssm_chunk_size(CHUNK);
    let mut rng = Rng::new(17);
    let t: usize = 8192;
    let mut prompt_ms = [0.0f64; 2];
    for (k, snaps) in [false, true].into_iter().enumerate() {
        let mut plan = StepPlan::new(16);
        let table: Vec<u32> = (0..t.div_ceil(16) as u32).collect();
        plan.push(&vec![1u32; t], 0, &table, 0, false);
        let mut slots = 1;
        if snaps {
            for after in (16..=t).step_by(16) {
                plan.snapshot(after, slots as u32);
                slots += 1;
            }
        }
        plan.finish()?;
        let ms = time_layer(gpu, &mut rng, &plan, sh, slots, DType::F32)?;
        prompt_ms[k] = ms;
        let label = if snaps {
            format!(
                "gated delta rule prompt T=8192, snapshot at every 16-token boundary ({} snapshots; without {:.3} ms, {:.2}×; target ≤ 1.10×; reported)",
                slots - 1,
                prompt_ms[0],
                ms / prompt_ms[0]
            )
        } else {
            "gated delta rule prompt T=8192, no snapshots (Qwen3.5 layer 16k×128, 32v×128, f32 state; target ≤ 0.45 ms; reported)".to_string()
        };
        report.push(
            suite,
            label,
            ms,
            format!("{ms:.3} ms"),
            "reported".into(),
            true,
        );
    }
    for state in [DType::F32, DType::BF16] {
        let batch = 256;
        let mut plan = StepPlan::new(16);
        let per = 101usize.div_ceil(16);
        for s in 0..batch {
            let table: Vec<u32> = ((s * per) as u32..((s + 1) * per) as u32).collect();
            plan.push(&[1], 100, &table, s as u32, false);
        }
        plan.finish()?;
        let ms = time_layer(gpu, &mut rng, &plan, sh, batch, state)?;
        let bytes = 2.0 * (batch * sh.state_elems() * state.size()) as f64;
        let rate = bytes / (ms * 1e-3);
        report.push(
            suite,
            format!(
                "gated delta rule decode batch 256, {} state: state read + written per second over the copy bandwidth ({:.3} ms, {:.2} TB/s of {:.2}; target ≥ 85 %)",
                if state == DType::F32 { "f32" } else { "bf16" },
                ms,
                rate / 1e12,
                bw / 1e12
            ),
            rate / bw,
            format!("{:.0} %", 100.0 * rate / bw),
            "≥ 85 % (reported)".into(),
            true,
        );
    }
    Ok(())
}

/// Device time of one layer's launches (prep + scan) over `plan`, averaged over 20 runs.
fn time_layer(
    gpu: &CudaBackend,
    rng: &mut Rng,
    plan: &StepPlan,
    sh: GdnShape,
    slots: usize,
    state: DType,
) -> R<f64> {
    let n = plan.num_tokens();
    let mut step = gpu.new_step(n)?;
    gpu.upload_step(plan, &mut step)?;
    let up = |v: Vec<f32>, shape: &[usize]| gpu.upload(HostTensor::f32(&v, shape));
    let q = up(rng.vec(n * sh.key_dim(), 1.0), &[n, sh.key_dim()])?;
    let k = up(rng.vec(n * sh.key_dim(), 1.0), &[n, sh.key_dim()])?;
    let v = up(rng.vec(n * sh.value_dim(), 1.0), &[n, sh.value_dim()])?;
    let a = up(rng.vec(n * sh.v_heads, 1.0), &[n, sh.v_heads])?;
    let b = up(rng.vec(n * sh.v_heads, 1.0), &[n, sh.v_heads])?;
    let a_log = up(rng.vec(sh.v_heads, 1.0), &[sh.v_heads])?;
    let dt_bias = up(rng.vec(sh.v_heads, 0.5), &[sh.v_heads])?;
    let mut pools = SsmPools {
        conv: gpu.zeros(&[slots, 1, 1, 2], DType::F32)?,
        ssm: gpu.zeros(&[slots, 1, sh.v_heads, sh.k_dim, sh.v_dim], state)?,
        slots,
        layers: 1,
    };
    let ops = GdnOperands {
        q: &q,
        k: &k,
        v: &v,
        a: &a,
        b: &b,
        a_log: &a_log,
        dt_bias: &dt_bias,
    };
    let mut run = || -> R<()> {
        gpu.gated_delta_rule(&ops, sh, &mut pools, 0, &step)?;
        Ok(())
    };
    for _ in 0..3 {
        run()?;
    }
    let reps = 20;
    let started = Instant::now();
    let ops = gpu.profile_ops(|| -> R<()> {
        for _ in 0..reps {
            run()?;
        }
        Ok(())
    })?;
    let _wall = started.elapsed();
    Ok(ops.iter().map(|o| o.ms).sum::<f64>() / f64::from(reps))
}
