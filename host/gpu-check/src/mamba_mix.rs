//! Rows of the `hybrid` suite: the Mamba2 mixer's middle ([`LayerOps::mamba2_mix`]: conv, scan
//! and output norm reading `in_proj`'s output in place) on the GPU against the CPU, which
//! composes the separate operations over copied columns. Decode batches and mixed steps
//! (prompt chunks with snapshots beside decodes), each output norm, f32 and bf16 mode; the
//! launches are counted, and a `copy_cols` launch fails the row.

use super::rng::Rng;
use super::{Report, rel_err, round_if_bf16};
use chimera::backend::cpu::CpuBackend;
use chimera::backend::cuda::CudaBackend;
use chimera::backend::{
    DType, HostTensor, LayerOps, Mamba2Mix, SsmOutNorm, SsmPools, SsmShape, StepBackend, StepPlan,
};
use chimera::model::layers::mamba2::OutNormKind;

type R<T> = anyhow::Result<T>;

/// The cases the `hybrid` suite runs, for one backend.
pub(super) fn checks(report: &mut Report, suite: &str, gpu: &CudaBackend, rng: &mut Rng) {
    let sh = |heads, head_dim, groups, state, chunk| SsmShape {
        heads,
        head_dim,
        groups,
        state_size: state,
        chunk_size: chunk,
        dt_min: 0.001,
        dt_max: 100.0,
    };
    let cases: [(SsmShape, &[usize], OutNormKind); 6] = [
        // NemotronH-8B's layer: a decode batch of 8, and a 300-token prompt chunk beside
        // decodes (tensor-core scan in bf16 mode, row strides of the 18 560-wide projection).
        (sh(128, 64, 8, 128, 128), &[1; 8], OutNormKind::GateThenNorm),
        (
            sh(128, 64, 8, 128, 128),
            &[1, 300, 1, 1, 45],
            OutNormKind::GateThenNorm,
        ),
        // Odd widths: a 262-wide projection, dt at column 256; SIMT kernels.
        (
            sh(6, 16, 2, 16, 8),
            &[131, 1, 40, 1, 7, 1],
            OutNormKind::GateThenNorm,
        ),
        (sh(6, 16, 2, 16, 8), &[1, 1, 1], OutNormKind::GateOnly),
        // Falcon-H1's other norms (one group).
        (
            sh(4, 32, 1, 32, 29),
            &[131, 1, 100, 3],
            OutNormKind::NormThenGate,
        ),
        (
            sh(4, 32, 1, 32, 29),
            &[1, 1, 1, 1, 1],
            OutNormKind::NormThenGate,
        ),
    ];
    let tag = if gpu.dtype() == DType::F32 {
        "f32"
    } else {
        "bf16"
    };
    for (shape, chunks, norm) in cases {
        let label = format!(
            "{tag} mamba2_mix in place {}h×{} g{} n{} {norm:?}, seqs {chunks:?}",
            shape.heads, shape.head_dim, shape.groups, shape.state_size
        );
        match case(gpu, rng, shape, chunks, norm) {
            Ok(c) => {
                let f32_mode = gpu.dtype() == DType::F32;
                // bf16 mode rounds y once more than the conv + scan rows (after the norm).
                let tol = if f32_mode { 1e-4 } else { 2e-2 };
                report.err(suite, format!("{label}: y = CPU"), c.y_err, tol);
                report.err(
                    suite,
                    format!("{label}: live + snapshot states = CPU"),
                    c.state_err,
                    if f32_mode { 1e-4 } else { 1e-2 },
                );
                let copies = c.calls("copy_cols");
                let launches: usize = c.ops.iter().map(|(_, n)| n).sum();
                let names = c
                    .ops
                    .iter()
                    .map(|(name, n)| format!("{name}×{n}"))
                    .collect::<Vec<_>>()
                    .join(" ");
                // A decode-only step: the conv update, the state update and the norm (it was
                // nine launches with the six column copies).
                let decode_only = chunks.iter().all(|&len| len == 1);
                let (bound, most) = if decode_only {
                    ("no copy_cols, ≤ 3 launches", 3)
                } else {
                    ("no copy_cols", usize::MAX)
                };
                report.push(
                    suite,
                    format!("{label}: launches ({names})"),
                    launches as f64,
                    format!("{launches} launches, {copies} copy_cols"),
                    bound.into(),
                    copies == 0 && launches > 0 && launches <= most,
                );
            }
            Err(e) => report.failed(suite, label, format!("{e:#}")),
        }
    }
}

struct CaseOut {
    y_err: f64,
    state_err: f64,
    /// Kernel launches of the GPU's `mamba2_mix`, by entry name.
    ops: Vec<(&'static str, usize)>,
}

impl CaseOut {
    fn calls(&self, prefix: &str) -> usize {
        self.ops
            .iter()
            .filter(|(name, _)| name.starts_with(prefix))
            .map(|(_, n)| n)
            .sum()
    }
}

/// The weights and inputs of one case, as f32 on the host.
struct Inputs {
    zxbcdt: Vec<f32>,
    conv_w: Vec<f32>,
    conv_b: Vec<f32>,
    a_log: Vec<f32>,
    d: Vec<f32>,
    dt_bias: Vec<f32>,
    norm_w: Vec<f32>,
    conv0: Vec<f32>,
    ssm0: Vec<f32>,
}

const KERNEL: usize = 4;
const LAYERS: usize = 2;
const LAYER: usize = 1;

fn case(
    gpu: &CudaBackend,
    rng: &mut Rng,
    shape: SsmShape,
    chunks: &[usize],
    norm: OutNormKind,
) -> R<CaseOut> {
    let cpu = CpuBackend::default();
    gpu.set_ssm_chunk_size(shape.chunk_size);
    let bf16 = gpu.dtype() == DType::BF16;
    let round = |v: Vec<f32>| round_if_bf16(v, bf16);
    let (h, p, g, n) = (shape.heads, shape.head_dim, shape.groups, shape.state_size);
    let d_inner = h * p;
    let conv_dim = d_inner + 2 * g * n;
    let proj = d_inner + conv_dim + h;
    // Live slots 0..seqs; prompt chunks write snapshots every 16 tokens into slots after them.
    let mut plan = StepPlan::new(16);
    let table: Vec<u32> = (0..4096).collect();
    let mut next_slot = chunks.len() as u32;
    for (i, &len) in chunks.iter().enumerate() {
        let tokens: Vec<u32> = (0..len).map(|t| (t % 100) as u32 + 1).collect();
        plan.push(&tokens, 7, &table, i as u32, true);
        let mut after = 16;
        while len > 1 && after <= len {
            plan.snapshot(after, next_slot);
            next_slot += 1;
            after += 16;
        }
    }
    plan.finish()?;
    let slots = next_slot as usize;
    let tokens = plan.num_tokens();
    // Starting states: random in f32 mode; in bf16 mode the pools start at zero (the
    // bf16 backend would round an upload).
    let conv0 = rng.vec(slots * LAYERS * conv_dim * (KERNEL - 1), 1.0);
    let ssm0 = rng.vec(slots * LAYERS * h * p * n, 1.0);
    let inputs = Inputs {
        zxbcdt: round(rng.vec(tokens * proj, 1.0)),
        conv_w: round(rng.vec(conv_dim * KERNEL, 0.5)),
        conv_b: round(rng.vec(conv_dim, 0.1)),
        a_log: round((0..h).map(|_| rng.unit() * 2.0).collect()),
        d: round(rng.vec(h, 1.0)),
        dt_bias: round(rng.vec(h, 0.5)),
        norm_w: round((0..d_inner).map(|_| 1.0 + rng.sym(0.2)).collect()),
        conv0: if bf16 { vec![0.0; conv0.len()] } else { conv0 },
        ssm0: if bf16 { vec![0.0; ssm0.len()] } else { ssm0 },
    };
    let dims = (slots, tokens, proj, conv_dim);
    let (gy, gstate, ops) = run(gpu, &plan, &inputs, shape, norm, dims, true)?;
    let (cy, cstate, _) = run(&cpu, &plan, &inputs, shape, norm, dims, false)?;
    Ok(CaseOut {
        y_err: rel_err(&gy, &cy),
        state_err: rel_err(&gstate, &cstate),
        ops: ops.unwrap_or_default(),
    })
}

/// One `mamba2_mix` of `plan` on `b`: `y`, both pools after the step (conv then SSM), and
/// (with `profile`, on the GPU) the launches by entry name.
#[allow(clippy::type_complexity)]
fn run<B: StepBackend + ProfileLaunches>(
    b: &B,
    plan: &StepPlan,
    i: &Inputs,
    shape: SsmShape,
    norm: OutNormKind,
    (slots, tokens, proj, conv_dim): (usize, usize, usize, usize),
    profile: bool,
) -> R<(Vec<f32>, Vec<f32>, Option<Vec<(&'static str, usize)>>)> {
    let (h, p, n) = (shape.heads, shape.head_dim, shape.state_size);
    let d_inner = h * p;
    let conv_shape = [slots, LAYERS, conv_dim, KERNEL - 1];
    let ssm_shape = [slots, LAYERS, h, p, n];
    // The pools stay f32 in either mode: zeros, filled from f32 values in f32 mode.
    let pool = |v: &[f32], shape: &[usize]| -> R<B::Tensor> {
        if b.act_dtype() == DType::F32 {
            Ok(b.upload(HostTensor::f32(v, shape))?)
        } else {
            Ok(b.zeros(shape, DType::F32)?)
        }
    };
    let mut pools = SsmPools {
        conv: pool(&i.conv0, &conv_shape)?,
        ssm: pool(&i.ssm0, &ssm_shape)?,
        slots,
        layers: LAYERS,
    };
    let zxbcdt = b.upload(HostTensor::f32(&i.zxbcdt, &[tokens, proj]))?;
    let conv_w = b.upload(HostTensor::f32(&i.conv_w, &[conv_dim, 1, KERNEL]))?;
    let conv_b = b.upload(HostTensor::f32(&i.conv_b, &[conv_dim]))?;
    let a_log = b.upload(HostTensor::f32(&i.a_log, &[h]))?;
    let d = b.upload(HostTensor::f32(&i.d, &[h]))?;
    let dt_bias = b.upload(HostTensor::f32(&i.dt_bias, &[h]))?;
    let norm = match norm {
        OutNormKind::GateThenNorm => {
            SsmOutNorm::GateThenNorm(b.upload(HostTensor::f32(&i.norm_w, &[d_inner]))?)
        }
        OutNormKind::NormThenGate => {
            SsmOutNorm::NormThenGate(b.upload(HostTensor::f32(&i.norm_w, &[d_inner]))?)
        }
        OutNormKind::GateOnly => SsmOutNorm::GateOnly,
    };
    let mix = Mamba2Mix {
        conv_w: &conv_w,
        conv_b: Some(&conv_b),
        a_log: &a_log,
        d: &d,
        dt_bias: &dt_bias,
        norm: &norm,
        shape,
        eps: 1e-5,
    };
    let mut step = b.new_step(tokens)?;
    b.upload_step(plan, &mut step)?;
    let mut y = None;
    let mut go = || -> R<()> {
        y = Some(b.mamba2_mix(&zxbcdt, &mix, &mut pools, LAYER, &step)?);
        Ok(())
    };
    let ops = if profile {
        Some(b.launches(&mut go)?)
    } else {
        go()?;
        None
    };
    let y = y.ok_or_else(|| anyhow::anyhow!("mamba2_mix returned nothing"))?;
    if b.shape(&y) != [tokens, d_inner] {
        anyhow::bail!("y {:?}, expected [{tokens}, {d_inner}]", b.shape(&y));
    }
    let mut state = b.download(&pools.conv)?;
    state.extend(b.download(&pools.ssm)?);
    Ok((b.download(&y)?, state, ops))
}

/// The launches a closure makes, by kernel name (the GPU's profiler; the CPU has none).
trait ProfileLaunches {
    fn launches(&self, run: &mut dyn FnMut() -> R<()>) -> R<Vec<(&'static str, usize)>>;
}

impl ProfileLaunches for CudaBackend {
    fn launches(&self, run: &mut dyn FnMut() -> R<()>) -> R<Vec<(&'static str, usize)>> {
        let ops = self.profile_ops(run)?;
        Ok(ops.into_iter().map(|o| (o.name, o.calls)).collect())
    }
}

impl ProfileLaunches for CpuBackend {
    fn launches(&self, _run: &mut dyn FnMut() -> R<()>) -> R<Vec<(&'static str, usize)>> {
        anyhow::bail!("the CPU backend has no launch profiler")
    }
}
