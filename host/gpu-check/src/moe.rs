//! MoE expert compute on the GPU: the grouped path against the CPU reference (plain and gated
//! experts; one token; experts left without tokens; experts with several row tiles; ragged
//! widths; the NemotronH and Qwen MoE shapes with fewer experts), bit-identical repeats, and a
//! CUDA-graph capture replayed with a new routing. The bench times the grouped layer against
//! the former per-expert path on the NemotronH shape.
//!
//! Run by the `hybrid` suite (checks), the `bench` suite (timings) and the `moe` suite (both).

use std::time::Instant;

use super::rng::Rng;
use super::{Report, bf16_round, rel_err, round_if_bf16};
use chimera::backend::cpu::CpuBackend;
use chimera::backend::cuda::CudaBackend;
use chimera::backend::{
    Activation, Backend, DType, HostTensor, LayerOps, MoeRouting, MoeScoring, StackedExperts,
    StepBackend,
};

type R<T> = anyhow::Result<T>;

/// One MoE layer's sizes and routing.
#[derive(Debug, Clone, Copy)]
struct Case {
    tokens: usize,
    hidden: usize,
    inter: usize,
    experts: usize,
    n_group: usize,
    topk_group: usize,
    top_k: usize,
    gated: bool,
    act: Activation,
}

impl Case {
    fn label(&self, tag: &str) -> String {
        format!(
            "{tag} moe experts T={} h{} i{} {} experts top-{}{}",
            self.tokens,
            self.hidden,
            self.inter,
            self.experts,
            self.top_k,
            if self.gated {
                format!(" gated {:?}", self.act)
            } else {
                format!(" {:?}", self.act)
            }
        )
    }
}

const fn case(
    tokens: usize,
    (hidden, inter): (usize, usize),
    (experts, n_group, topk_group, top_k): (usize, usize, usize, usize),
    gated: bool,
    act: Activation,
) -> Case {
    Case {
        tokens,
        hidden,
        inter,
        experts,
        n_group,
        topk_group,
        top_k,
        gated,
        act,
    }
}

const CASES: &[Case] = &[
    case(77, (64, 96), (16, 4, 2, 4), false, Activation::Relu2),
    // One token: 12 of 16 experts get none.
    case(1, (64, 96), (16, 4, 2, 4), false, Activation::Relu2),
    // ~75 rows an expert (two row tiles), K not a multiple of 32, N not of 64 or 128.
    case(300, (136, 200), (8, 1, 1, 2), false, Activation::Relu2),
    case(50, (64, 96), (32, 1, 1, 8), true, Activation::Silu),
    case(1, (128, 64), (64, 1, 1, 8), true, Activation::Silu),
    // NemotronH widths (8 of its 128 experts), Qwen MoE widths (16 experts).
    case(33, (2688, 1856), (8, 1, 1, 6), false, Activation::Relu2),
    case(40, (2048, 768), (16, 1, 1, 8), true, Activation::Silu),
    // The nemotronh-b fixture's widths (hidden 32, experts 16 wide, top-3 of 8 in 4 groups).
    case(131, (32, 16), (8, 4, 2, 3), false, Activation::Relu2),
    case(1, (32, 16), (8, 4, 2, 3), false, Activation::Relu2),
];

/// Host inputs of one case, rounded to bf16 when the GPU runs bf16 (both sides see the same
/// values).
struct Inputs {
    x: Vec<f32>,
    logits: Vec<f32>,
    up: Vec<f32>,
    gate: Vec<f32>,
    down: Vec<f32>,
    base: Vec<f32>,
}

impl Inputs {
    fn new(c: &Case, rng: &mut Rng, bf16: bool) -> Self {
        let round = |v: Vec<f32>| round_if_bf16(v, bf16);
        let (t, h, i, e) = (c.tokens, c.hidden, c.inter, c.experts);
        let (su, sd) = ((3.0 / h as f32).sqrt(), (3.0 / i as f32).sqrt());
        Self {
            x: round(rng.vec(t * h, 1.0)),
            logits: round(rng.vec(t * e, 2.0)),
            up: round(rng.vec(e * i * h, su)),
            gate: if c.gated {
                round(rng.vec(e * i * h, su))
            } else {
                Vec::new()
            },
            down: round(rng.vec(e * h * i, sd)),
            base: round(rng.vec(t * h, 1.0)),
        }
    }
}

/// A layer's tensors on one backend.
struct Layer<B: StepBackend> {
    x: B::Tensor,
    logits: B::Tensor,
    routing: MoeRouting<B::Tensor>,
    experts: StackedExperts<B::Tensor>,
}

fn layer<B: StepBackend>(b: &B, c: &Case, inp: &Inputs) -> R<Layer<B>> {
    let (t, h, i, e) = (c.tokens, c.hidden, c.inter, c.experts);
    Ok(Layer {
        x: b.upload(HostTensor::f32(&inp.x, &[t, h]))?,
        logits: b.upload(HostTensor::f32(&inp.logits, &[t, e]))?,
        routing: MoeRouting {
            scoring: MoeScoring::Sigmoid,
            correction_bias: b.upload(HostTensor::f32(&vec![0.0; e], &[e]))?,
            top_k: c.top_k,
            n_group: c.n_group,
            topk_group: c.topk_group,
            norm_topk_prob: true,
            scaling: 1.5,
        },
        experts: StackedExperts {
            up: b.upload(HostTensor::f32(&inp.up, &[e, i, h]))?,
            down: b.upload(HostTensor::f32(&inp.down, &[e, h, i]))?,
            gate: if c.gated {
                Some(b.upload(HostTensor::f32(&inp.gate, &[e, i, h]))?)
            } else {
                None
            },
            act: c.act,
        },
    })
}

/// `base + moe(x)` on one backend.
fn forward<B: StepBackend>(b: &B, l: &Layer<B>, base: &[f32], shape: &[usize]) -> R<Vec<f32>> {
    let mut out = b.upload(HostTensor::f32(base, shape))?;
    b.moe(&l.x, &l.logits, &l.routing, &l.experts, &mut out)?;
    Ok(b.download(&out)?)
}

/// Every case on both GPU modes against the CPU; then determinism and graph capture (bf16).
pub fn checks(
    report: &mut Report,
    suite: &str,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    rng: &mut Rng,
) {
    let cpu = CpuBackend::default();
    for gpu in [f32_gpu, bf16_gpu] {
        let bf16 = gpu.dtype() == DType::BF16;
        let (tag, tol) = if bf16 { ("bf16", 1e-2) } else { ("f32", 1e-4) };
        for c in CASES {
            let label = c.label(tag);
            let inp = Inputs::new(c, rng, bf16);
            let run = || -> R<f64> {
                let shape = [c.tokens, c.hidden];
                let g = forward(gpu, &layer(gpu, c, &inp)?, &inp.base, &shape)?;
                let want = forward(&cpu, &layer(&cpu, c, &inp)?, &inp.base, &shape)?;
                Ok(rel_err(&g, &want))
            };
            match run() {
                Ok(err) => report.err(suite, label, err, tol),
                Err(e) => report.failed(suite, label, format!("{e:#}")),
            }
        }
    }
    let c = &CASES[3];
    let label =
        "bf16 moe gated T=50: two runs bit-identical; graph replay = eager, new routing = CPU";
    match capture_case(bf16_gpu, &cpu, c, rng) {
        Ok((same, err)) => {
            let pass = same && err.is_finite() && err <= 1e-2;
            report.push(
                suite,
                label,
                err,
                format!("{} / {err:.2e}", if same { "identical" } else { "DIFFER" }),
                "identical / ≤ 1e-2".into(),
                pass,
            );
        }
        Err(e) => report.failed(suite, label, format!("{e:#}")),
    }
}

/// Every case whose widths are multiples of 16 with FP8 experts (each backend quantizes the
/// same bf16-exact weights per expert row, so both hold the same codes and scales), on both
/// GPU modes against the CPU, with the float cases' bounds.
pub fn fp8_checks(
    report: &mut Report,
    suite: &str,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    rng: &mut Rng,
) {
    fn fp8_layer<B: StepBackend>(b: &B, c: &Case, inp: &Inputs) -> R<Layer<B>> {
        let mut l = layer(b, c, inp)?;
        let e = &l.experts;
        l.experts = StackedExperts {
            up: b.quantize_fp8(&e.up)?,
            down: b.quantize_fp8(&e.down)?,
            gate: e.gate.as_ref().map(|g| b.quantize_fp8(g)).transpose()?,
            act: e.act,
        };
        Ok(l)
    }
    let cpu = CpuBackend::default();
    for gpu in [f32_gpu, bf16_gpu] {
        let bf16 = gpu.dtype() == DType::BF16;
        let (tag, tol) = if bf16 { ("bf16", 1e-2) } else { ("f32", 1e-4) };
        for c in CASES
            .iter()
            .filter(|c| c.hidden % 16 == 0 && c.inter % 16 == 0)
        {
            let label = format!("{} (FP8 experts)", c.label(tag));
            // Rounded to bf16 on both modes: the same codes on every backend.
            let inp = Inputs::new(c, rng, true);
            let run = || -> R<f64> {
                let shape = [c.tokens, c.hidden];
                let g = forward(gpu, &fp8_layer(gpu, c, &inp)?, &inp.base, &shape)?;
                let want = forward(&cpu, &fp8_layer(&cpu, c, &inp)?, &inp.base, &shape)?;
                Ok(rel_err(&g, &want))
            };
            match run() {
                Ok(err) => report.err(suite, label, err, tol),
                Err(e) => report.failed(suite, label, format!("{e:#}")),
            }
        }
    }
}

/// Eager twice (bit-identical), then a captured graph that copies the logits from a source
/// buffer, resets `out` and runs the layer: replayed, it must equal the eager result bit for
/// bit; with new logits in the source, it must match the CPU for those. Returns (identical,
/// error of the second replay against the CPU).
fn capture_case(gpu: &CudaBackend, cpu: &CpuBackend, c: &Case, rng: &mut Rng) -> R<(bool, f64)> {
    let inp = Inputs::new(c, rng, true);
    let shape = [c.tokens, c.hidden];
    let l = layer(gpu, c, &inp)?;
    let eager = forward(gpu, &l, &inp.base, &shape)?;
    let again = forward(gpu, &l, &inp.base, &shape)?;
    let base = gpu.upload(HostTensor::f32(&inp.base, &shape))?;
    let mut src = gpu.upload(HostTensor::f32(&inp.logits, &[c.tokens, c.experts]))?;
    let mut logits = gpu.upload(HostTensor::f32(&inp.logits, &[c.tokens, c.experts]))?;
    let mut out = gpu.upload(HostTensor::f32(&inp.base, &shape))?;
    let graph = gpu.capture_graph(&mut || {
        gpu.scale_assign(&mut logits, 0.0)?;
        gpu.add_assign(&mut logits, &src)?;
        gpu.scale_assign(&mut out, 0.0)?;
        gpu.add_assign(&mut out, &base)?;
        gpu.moe(&l.x, &logits, &l.routing, &l.experts, &mut out)
    })?;
    gpu.replay_graph(graph)?;
    let replayed = gpu.download(&out)?;
    // A new routing through the same graph.
    let new_logits: Vec<f32> = rng
        .vec(c.tokens * c.experts, 2.0)
        .into_iter()
        .map(bf16_round)
        .collect();
    let fresh = gpu.upload(HostTensor::f32(&new_logits, &[c.tokens, c.experts]))?;
    gpu.scale_assign(&mut src, 0.0)?;
    gpu.add_assign(&mut src, &fresh)?;
    gpu.replay_graph(graph)?;
    let second = gpu.download(&out)?;
    let mut cpu_inp = inp;
    cpu_inp.logits = new_logits;
    let want = forward(cpu, &layer(cpu, c, &cpu_inp)?, &cpu_inp.base, &shape)?;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let same = bits(&eager) == bits(&again) && bits(&eager) == bits(&replayed);
    if !same {
        eprintln!("      eager runs or the graph replay differ in bits");
    }
    Ok((same, rel_err(&second, &want)))
}

/// The grouped layer (eager and graph-replayed) against the former per-expert path on the
/// NemotronH shape (hidden 2688, expert ffn 1856, 128 experts top-6 in 8 groups, relu²), bf16,
/// timed, and their outputs compared.
pub fn bench(report: &mut Report, suite: &str, gpu: &CudaBackend) {
    if let Err(e) = bench_inner(report, suite, gpu) {
        report.failed(suite, "moe NemotronH layer timings", format!("{e:#}"));
    }
}

fn bench_inner(report: &mut Report, suite: &str, gpu: &CudaBackend) -> R<()> {
    let (h, i, e, top_k) = (2688usize, 1856usize, 128usize, 6usize);
    let dt = gpu.dtype();
    let mut up = gpu.zeros(&[e, i, h], dt)?;
    let mut down = gpu.zeros(&[e, h, i], dt)?;
    gpu.fill_dummy(&mut up, 1, (1.0 / h as f32).sqrt(), 0.0)?;
    gpu.fill_dummy(&mut down, 2, (1.0 / i as f32).sqrt(), 0.0)?;
    let experts = StackedExperts {
        up,
        down,
        gate: None,
        act: Activation::Relu2,
    };
    let routing = MoeRouting {
        scoring: MoeScoring::Sigmoid,
        correction_bias: gpu.upload(HostTensor::f32(&vec![0.0; e], &[e]))?,
        top_k,
        n_group: 8,
        topk_group: 4,
        norm_topk_prob: true,
        scaling: 2.5,
    };
    let mut rng = Rng::new(11);
    for t in [1usize, 64, 512, 4096] {
        let x = gpu.upload(HostTensor::f32(&rng.vec(t * h, 1.0), &[t, h]))?;
        let logits = gpu.upload(HostTensor::f32(&rng.vec(t * e, 2.0), &[t, e]))?;
        let mut out = gpu.zeros(&[t, h], dt)?;
        let reps = if t >= 512 { 10 } else { 30 };
        let time = |f: &mut dyn FnMut() -> R<()>| -> R<f64> {
            for _ in 0..2 {
                f()?;
            }
            gpu.synchronize()?;
            let t0 = Instant::now();
            for _ in 0..reps {
                f()?;
            }
            gpu.synchronize()?;
            Ok(t0.elapsed().as_secs_f64() * 1e3 / reps as f64)
        };
        let grouped = time(&mut || Ok(gpu.moe(&x, &logits, &routing, &experts, &mut out)?))?;
        let old = time(&mut || Ok(gpu.moe_per_expert(&x, &logits, &routing, &experts, &mut out)?))?;
        let graph =
            gpu.capture_graph(&mut || gpu.moe(&x, &logits, &routing, &experts, &mut out))?;
        let graphed = time(&mut || Ok(gpu.replay_graph(graph)?))?;
        let flops = 2.0 * 2.0 * (t * top_k * h * i) as f64;
        // The per-expert path is timed above; its output must be the grouped one's too.
        let mut grouped_out = gpu.zeros(&[t, h], dt)?;
        gpu.moe(&x, &logits, &routing, &experts, &mut grouped_out)?;
        let mut per_expert_out = gpu.zeros(&[t, h], dt)?;
        gpu.moe_per_expert(&x, &logits, &routing, &experts, &mut per_expert_out)?;
        let err = rel_err(
            &gpu.download(&per_expert_out)?,
            &gpu.download(&grouped_out)?,
        );
        report.err(
            suite,
            format!("moe NemotronH layer T={t} bf16: per-expert path = grouped path"),
            err,
            1e-2,
        );
        report.push(
            suite,
            format!(
                "moe NemotronH layer T={t}: grouped vs per-expert ms, graph {graphed:.3} ms ({:.0} TFLOP/s)",
                flops / grouped / 1e9
            ),
            grouped,
            format!("{grouped:.3} / {old:.3} ({:.1}×)", old / grouped),
            "reported".into(),
            true,
        );
    }
    Ok(())
}
