//! FP8 weights on the GPU.
//!
//! `fp8` (correctness): the FP8 fixtures end to end (f32 mode against the CPU oracle, which
//! dequantizes exactly; bf16 mode against its bound), then FP8 linear layers on random weights
//! with row and 128 × 128 block scales at 1, 2, 3 and 64 rows (the GEMV, cuBLASLt's FP8 GEMM
//! and the dequantizing path) against the CPU's exact product, and online quantization on the
//! device against the host's codes.
//!
//! `bench-fp8` (bf16 serving mode, one run): the copy bandwidth; the FP8 GEMV against the bf16
//! GEMV on the decode shapes of Llama-3-8B and NemotronH-8B (bandwidth of the bytes each reads);
//! decode at batch 1 / 64 / 256 and an 8192-token prefill of both models with bf16 and with
//! FP8 dummy weights, each against its own memory floor, and the prefill-rate ratio.

use super::rng::Rng;
use super::{GpuCheckArgs, Report};
use chimera::backend::cpu::CpuBackend;
use chimera::backend::cuda::{CudaBackend, CudaTensor, FP8_GEMV_AUTO};
use chimera::backend::fp8::{self, Fp8Scales, Fp8Weight};
use chimera::backend::{Activation, Backend, DType, HostTensor, LayerOps};
use chimera::model::LoadOptions;
use chimera_kernels::fp8 as k8;

const SUITE: &str = "fp8";
const BENCH: &str = "bench-fp8";

use super::parity::max_rel;

/// Random FP8 weight: codes of N(0, 1)-ish values, scales in [0.5, 1.5) / 448.
fn random_weight(rng: &mut Rng, m: usize, k: usize, block: Option<usize>) -> Fp8Weight<'static> {
    let codes: Vec<u8> = (0..m * k)
        .map(|_| fp8::f32_to_e4m3(rng.sym(300.0)))
        .collect();
    let scales = match block {
        None => Fp8Scales::Rows((0..m).map(|_| (0.5 + rng.unit()) / 448.0).collect()),
        Some(b) => Fp8Scales::Blocks {
            block: [b, b],
            scales: (0..m.div_ceil(b) * k.div_ceil(b))
                .map(|_| (0.5 + rng.unit()) / 448.0)
                .collect(),
        },
    };
    Fp8Weight {
        shape: vec![m, k],
        codes: codes.into(),
        scales,
    }
}

pub fn checks(
    report: &mut Report,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    args: &GpuCheckArgs,
    seed: u64,
) {
    super::parity::run_fixtures(
        report,
        f32_gpu,
        bf16_gpu,
        args,
        &["llama-gqa-fp8", "nemotronh-a-fp8", "qwen3next-a-fp8"],
    );
    let cpu = CpuBackend::default();
    // Online quantization end to end on fixtures with FP8 experts (routed and shared), FP8
    // Gated DeltaNet projections and FP8 Mamba2 projections: CUDA against the CPU, each
    // quantizing the same float weights (f32 mode: the same codes, so the logits agree to
    // rounding; bf16 mode rounds the weights to bf16 before quantizing: reported).
    for name in ["nemotronh-a", "qwen3next-a", "qwen35moe-a", "granite-moe"] {
        let dir = args.fixtures.join(name);
        let run = || -> anyhow::Result<(f64, f64, f64)> {
            let opts = LoadOptions {
                fp8: true,
                ..Default::default()
            };
            let prompt = super::parity::prompts(&dir)?
                .into_iter()
                .max_by_key(Vec::len)
                .ok_or_else(|| anyhow::anyhow!("no prompts"))?;
            let want = {
                let m = chimera::model::load_with(&dir, &cpu, opts)?;
                super::parity::full(&m, &cpu, &prompt)?
            };
            let got32 = {
                let m = chimera::model::load_with(&dir, f32_gpu, opts)?;
                super::parity::full(&m, f32_gpu, &prompt)?
            };
            let got16 = {
                let m = chimera::model::load_with(&dir, bf16_gpu, opts)?;
                super::parity::full(&m, bf16_gpu, &prompt)?
            };
            let vocab = want.len() / prompt.len();
            let argmax = |v: &[f32]| -> Vec<u32> {
                v.chunks_exact(vocab).map(chimera::model::argmax).collect()
            };
            let (a, b) = (argmax(&want), argmax(&got16));
            let agree = a.iter().zip(&b).filter(|(x, y)| x == y).count() as f64 / a.len() as f64;
            Ok((max_rel(&got32, &want), max_rel(&got16, &want), agree))
        };
        let check = format!("{name} online FP8 (experts, projections): CUDA vs CPU logits");
        match run() {
            Ok((e32, e16, agree)) => {
                report.push(
                    SUITE,
                    format!("f32 {check}"),
                    e32,
                    format!("{e32:.2e}"),
                    "≤ 1e-4".into(),
                    e32 <= 1e-4,
                );
                report.push(
                    SUITE,
                    format!("bf16 {check} (max rel; argmax agreement; reported)"),
                    e16,
                    format!("{e16:.2e}; {:.0} %", 100.0 * agree),
                    "reported".into(),
                    true,
                );
            }
            Err(e) => report.failed(SUITE, check, format!("{e:#}")),
        }
    }
    let mut rng = Rng::new(seed ^ 0xf8f8);
    super::moe::fp8_checks(report, SUITE, f32_gpu, bf16_gpu, &mut rng);
    for (m, k) in [(256usize, 512usize), (1024, 4096), (4096, 1024)] {
        for block in [None, Some(128)] {
            let w = random_weight(&mut rng, m, k, block);
            let bias: Vec<f32> = (0..m).map(|_| rng.sym(0.2)).collect();
            let scheme = if block.is_some() {
                "128×128 blocks"
            } else {
                "rows"
            };
            for n in [1usize, 2, 3, 64] {
                let x: Vec<f32> = rng.vec(n * k, 1.0);
                for (gpu, mode, bound) in [(f32_gpu, "f32", 1e-5), (bf16_gpu, "bf16", 4e-2)] {
                    let check = format!("{mode} FP8 linear {n}×{k}·{m}ᵀ + bias, {scheme}");
                    let run = || -> anyhow::Result<f64> {
                        let want = {
                            let wc = cpu.upload_fp8(w.clone())?;
                            let b = cpu.upload(HostTensor::f32(&bias, &[m]))?;
                            let xc = cpu.upload(HostTensor::f32(&x, &[n, k]))?;
                            cpu.download(&cpu.linear(&xc, &wc, Some(&b))?)?
                        };
                        let wg = gpu.upload_fp8(w.clone())?;
                        let b = gpu.upload(HostTensor::f32(&bias, &[m]))?;
                        let xg = gpu.upload(HostTensor::f32(&x, &[n, k]))?;
                        let got = gpu.download(&gpu.linear(&xg, &wg, Some(&b))?)?;
                        gpu.synchronize()?;
                        Ok(max_rel(&got, &want))
                    };
                    match run() {
                        Ok(e) => report.err(SUITE, check, e, bound),
                        Err(e) => report.failed(SUITE, check, format!("{e:#}")),
                    }
                }
            }
        }
    }
    // Gate and up in one launch (the fused GEMV at 1 and 2 rows; the separate projections and
    // product otherwise) against the CPU's composition.
    for block in [None, Some(128)] {
        let (m, k) = (1024usize, 2048usize);
        let gate = random_weight(&mut rng, m, k, block);
        let up = random_weight(&mut rng, m, k, block);
        let scheme = if block.is_some() {
            "128×128 blocks"
        } else {
            "rows"
        };
        for n in [1usize, 2, 5] {
            let x = rng.vec(n * k, 1.0);
            for (gpu, mode, bound) in [(f32_gpu, "f32", 1e-5), (bf16_gpu, "bf16", 4e-2)] {
                let check = format!(
                    "{mode} FP8 gated MLP input silu({n}×{k}·gateᵀ)·up, {m} features, {scheme}"
                );
                let run = || -> anyhow::Result<f64> {
                    let want = {
                        let (g, u) = (cpu.upload_fp8(gate.clone())?, cpu.upload_fp8(up.clone())?);
                        let xc = cpu.upload(HostTensor::f32(&x, &[n, k]))?;
                        let y = cpu.gated_linear(&xc, (&g, None), (&u, None), Activation::Silu)?;
                        cpu.download(&y)?
                    };
                    let (g, u) = (gpu.upload_fp8(gate.clone())?, gpu.upload_fp8(up.clone())?);
                    let xg = gpu.upload(HostTensor::f32(&x, &[n, k]))?;
                    let y = gpu.gated_linear(&xg, (&g, None), (&u, None), Activation::Silu)?;
                    let got = gpu.download(&y)?;
                    Ok(max_rel(&got, &want))
                };
                match run() {
                    Ok(e) => report.err(SUITE, check, e, bound),
                    Err(e) => report.failed(SUITE, check, format!("{e:#}")),
                }
            }
        }
    }
    // Every other variant of the one-row bf16 GEMV (bench-fp8 times them) on plain and gated
    // products, row and block scales, against the CPU.
    for (v, (entry, _)) in k8::GEMV_N1_BF16.iter().enumerate() {
        bf16_gpu.set_fp8_gemv_variant(v);
        for block in [None, Some(128)] {
            let (m, k) = (1024usize, 4096usize);
            let (w, up) = (
                random_weight(&mut rng, m, k, block),
                random_weight(&mut rng, m, k, block),
            );
            let x = rng.vec(k, 1.0);
            let scheme = if block.is_some() { "blocks" } else { "rows" };
            let check = format!("bf16 FP8 GEMV {entry}: 1×{k}·{m}ᵀ and silu(gate)·up, {scheme}");
            let run = || -> anyhow::Result<f64> {
                let xc = cpu.upload(HostTensor::f32(&x, &[1, k]))?;
                let xg = bf16_gpu.upload(HostTensor::f32(&x, &[1, k]))?;
                let (wc, uc) = (cpu.upload_fp8(w.clone())?, cpu.upload_fp8(up.clone())?);
                let (wg, ug) = (
                    bf16_gpu.upload_fp8(w.clone())?,
                    bf16_gpu.upload_fp8(up.clone())?,
                );
                let plain = max_rel(
                    &bf16_gpu.download(&bf16_gpu.linear(&xg, &wg, None)?)?,
                    &cpu.download(&cpu.linear(&xc, &wc, None)?)?,
                );
                let act = Activation::Silu;
                let gated = max_rel(
                    &bf16_gpu.download(&bf16_gpu.gated_linear(
                        &xg,
                        (&wg, None),
                        (&ug, None),
                        act,
                    )?)?,
                    &cpu.download(&cpu.gated_linear(&xc, (&wc, None), (&uc, None), act)?)?,
                );
                Ok(plain.max(gated))
            };
            match run() {
                Ok(e) => report.err(SUITE, check, e, 4e-2),
                Err(e) => report.failed(SUITE, check, format!("{e:#}")),
            }
        }
    }
    bf16_gpu.set_fp8_gemv_variant(FP8_GEMV_AUTO);
    // Online quantization on the device makes the host's codes and scales (f32 weights: the
    // same division and rounding).
    let (m, k) = (512usize, 1024usize);
    let w: Vec<f32> = rng.vec(m * k, 0.05);
    let check = format!("f32 online quantization of a {m}×{k} weight on the device = the host's");
    let run = || -> anyhow::Result<f64> {
        let t = f32_gpu.upload(HostTensor::f32(&w, &[m, k]))?;
        let q = f32_gpu.quantize_fp8(&t)?;
        let got = f32_gpu.download(&q)?;
        let want = fp8::quantize_rows(&w, &[m, k]).dequantize();
        Ok(got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max) as f64)
    };
    match run() {
        Ok(e) => report.push(
            SUITE,
            check,
            e,
            format!("max |Δ| {e:.1e}"),
            "= 0".into(),
            e == 0.0,
        ),
        Err(e) => report.failed(SUITE, check, format!("{e:#}")),
    }
}

/// (label, m, k): the single projections of the decode shapes.
const SHAPES: &[(&str, usize, usize)] = &[
    ("Llama-3-8B q_proj", 4096, 4096),
    ("Llama-3-8B k_proj", 1024, 4096),
    ("Llama-3-8B gate_proj", 14336, 4096),
    ("Llama-3-8B down_proj", 4096, 14336),
    ("NemotronH-8B mamba in_proj", 18560, 4096),
    ("NemotronH-8B mamba out_proj", 4096, 8192),
    ("NemotronH-8B mlp up", 21504, 4096),
    ("NemotronH-8B mlp down", 4096, 21504),
];

const CALLS: usize = 20;

/// Seconds per call of `x[n, k] · wᵀ` with weights in rotation (≥ 256 MiB, past the L2),
/// timed from a graph of CALLS calls.
fn time_linear(
    gpu: &CudaBackend,
    n: usize,
    weights: &[CudaTensor],
    k: usize,
) -> anyhow::Result<f64> {
    let x = gpu.zeros(&[n, k], DType::BF16)?;
    super::gemv::graph_seconds_per_call(gpu, CALLS, &mut || {
        for c in 0..CALLS {
            drop(gpu.linear(&x, &weights[c % weights.len()], None)?);
        }
        Ok(())
    })
}

pub fn bench(report: &mut Report, gpu: &CudaBackend, args: &GpuCheckArgs) {
    let Some(bw) = super::bench::copy_bandwidth(report, gpu) else {
        return;
    };
    gemv_bench(report, gpu, bw);
    batched_bench(report, gpu);
    models_bench(report, gpu, args, bw);
}

/// The FP8 GEMV and its variants against the bf16 GEMV on the decode shapes, as shares of the
/// copy bandwidth `bw` (`--suite bench-fp8-gemv` alone).
pub fn gemv_bench(report: &mut Report, gpu: &CudaBackend, bw: f64) {
    for &(label, m, k) in SHAPES {
        let check = format!(
            "linear n=1 {label} {m}×{k}: FP8 GEMV, picked by shape (bf16 GEMV in the same run)"
        );
        let run = || -> anyhow::Result<(f64, f64, Vec<f64>)> {
            let bf16_bytes = m * k * 2;
            let copies = (256usize << 20).div_ceil(bf16_bytes).clamp(1, CALLS);
            let bf16: Vec<CudaTensor> = (0..copies)
                .map(|_| gpu.zeros(&[m, k], DType::BF16))
                .collect::<Result<_, _>>()?;
            let bf16_s = time_linear(gpu, 1, &bf16, k)?;
            let fp8_copies = (256usize << 20).div_ceil(m * k).clamp(1, CALLS);
            let fp8: Vec<CudaTensor> = (0..fp8_copies)
                .map(|_| {
                    gpu.zeros(&[m, k], DType::BF16)
                        .and_then(|t| gpu.quantize_fp8(&t))
                })
                .collect::<Result<_, _>>()?;
            drop(bf16);
            let fp8_bytes = (m * k + 4 * m) as f64;
            // Every variant of the one-row kernel, then the default (picked by shape).
            let mut variants = Vec::new();
            for v in 0..k8::GEMV_N1_BF16.len() {
                gpu.set_fp8_gemv_variant(v);
                variants.push(fp8_bytes / time_linear(gpu, 1, &fp8, k)?);
            }
            gpu.set_fp8_gemv_variant(FP8_GEMV_AUTO);
            let picked = fp8_bytes / time_linear(gpu, 1, &fp8, k)?;
            Ok((bf16_bytes as f64 / bf16_s, picked, variants))
        };
        match run() {
            Ok((bf16_bw, fp8_bw, variants)) => {
                for (v, vbw) in variants.iter().enumerate() {
                    report.push(
                        BENCH,
                        format!(
                            "linear n=1 {label} {m}×{k}: FP8 GEMV variant {} (reported)",
                            k8::GEMV_N1_BF16[v].0
                        ),
                        *vbw,
                        format!("{:.2} TB/s ({:.0} % of copy)", vbw / 1e12, 100.0 * vbw / bw),
                        "reported".into(),
                        true,
                    );
                }
                report.push(
                    BENCH,
                    format!("{check}: bf16 {:.2} TB/s", bf16_bw / 1e12),
                    fp8_bw,
                    format!(
                        "{:.2} TB/s ({:.0} % of copy)",
                        fp8_bw / 1e12,
                        100.0 * fp8_bw / bw
                    ),
                    // The target holds where the bf16 GEMV reaches 85 % of the copy bandwidth.
                    if bf16_bw >= 0.85 * bw {
                        format!("≥ {:.2} TB/s", 0.85 * bw / 1e12)
                    } else {
                        "reported (bf16 below 85 %)".into()
                    },
                    bf16_bw < 0.85 * bw || fp8_bw >= 0.85 * bw,
                )
            }
            Err(e) => report.failed(BENCH, check, format!("{e:#}")),
        }
    }
}

/// FP8 linear layers at more rows than the GEMV takes (a decode batch, a prefill chunk):
/// cuBLASLt's FP8 GEMM after the per-token quantization, and the dequantize-then-bf16-GEMM
/// fallback, each timed against the bf16 GEMM of the shape in the same run (reported: where
/// FP8 loses to bf16 at a batch size, this row says by how much and on which path).
pub fn batched_bench(report: &mut Report, gpu: &CudaBackend) {
    const BATCHED: &[(&str, usize, usize)] = &[
        ("Llama-3-8B gate_proj", 14336, 4096),
        ("Llama-3-8B down_proj", 4096, 14336),
    ];
    for &(label, m, k) in BATCHED {
        for n in [8usize, 64, 256, 2048] {
            let check = format!("linear n={n} {label} {m}×{k}: FP8 / bf16 time");
            let run = || -> anyhow::Result<(f64, f64, f64)> {
                let copies = (256usize << 20).div_ceil(m * k * 2).clamp(1, CALLS);
                let bf16: Vec<CudaTensor> = (0..copies)
                    .map(|_| gpu.zeros(&[m, k], DType::BF16))
                    .collect::<Result<_, _>>()?;
                let bf16_s = time_linear(gpu, n, &bf16, k)?;
                let fp8: Vec<CudaTensor> = bf16
                    .iter()
                    .map(|t| gpu.quantize_fp8(t))
                    .collect::<Result<_, _>>()?;
                drop(bf16);
                let gemm_s = time_linear(gpu, n, &fp8, k)?;
                gpu.set_fp8_gemm(false);
                let dequant_s = time_linear(gpu, n, &fp8, k);
                gpu.set_fp8_gemm(true);
                Ok((bf16_s, gemm_s, dequant_s?))
            };
            match run() {
                Ok((bf16_s, gemm_s, dequant_s)) => report.push(
                    BENCH,
                    check,
                    gemm_s / bf16_s,
                    format!(
                        "{:.3}× ({:.1} µs FP8 GEMM, {:.1} µs dequantized, {:.1} µs bf16)",
                        gemm_s / bf16_s,
                        gemm_s * 1e6,
                        dequant_s * 1e6,
                        bf16_s * 1e6
                    ),
                    "reported".into(),
                    true,
                ),
                Err(e) => report.failed(BENCH, check, format!("{e:#}")),
            }
        }
    }
}

/// Decode and prefill of the 8B shapes with bf16 and FP8 weights, and Qwen3-Next-80B-A3B in
/// FP8 where the card holds it.
fn models_bench(report: &mut Report, gpu: &CudaBackend, args: &GpuCheckArgs, bw: f64) {
    for dir in [&args.bench_model, &args.hybrid_model] {
        let mut prefill = [0.0f64; 2];
        for (i, fp8) in [false, true].into_iter().enumerate() {
            match super::bench::decode(
                report,
                gpu,
                dir,
                bw,
                args.steps.min(200),
                LoadOptions {
                    fp8,
                    ..Default::default()
                },
            ) {
                Ok(s) => prefill[i] = s,
                Err(e) => report.failed(
                    BENCH,
                    format!("dummy {} decode (fp8 {fp8})", dir.display()),
                    format!("{e:#}"),
                ),
            }
        }
        if prefill.iter().all(|&s| s > 0.0) {
            let ratio = prefill[0] / prefill[1];
            report.push(
                BENCH,
                format!(
                    "{} 8192-token prefill rate, FP8 / bf16 (same run)",
                    dir.file_name()
                        .map(|n| n.to_string_lossy())
                        .unwrap_or_default()
                ),
                ratio,
                format!("{ratio:.2}×"),
                "≥ 1.5×".into(),
                ratio >= 1.5,
            );
        }
    }
    // Qwen3-Next-80B-A3B whole, in FP8 (the release's config, dummy weights): about 80 GB,
    // so one H200 (on an 80 GB card: a row saying so).
    let big = std::path::Path::new("tests/gpu/configs/qwen3-next-80b-a3b-fp8");
    match gpu.mem_info() {
        Ok((_, total)) if total > 100 << 30 => {
            if let Err(e) = super::bench::decode(
                report,
                gpu,
                big,
                bw,
                args.steps.min(100),
                LoadOptions::default(),
            ) {
                report.failed(
                    BENCH,
                    format!("dummy {} decode", big.display()),
                    format!("{e:#}"),
                );
            }
        }
        Ok((_, total)) => report.push(
            BENCH,
            format!(
                "dummy {} decode: needs more than {:.0} GiB (reported)",
                big.display(),
                total as f64 / (1u64 << 30) as f64
            ),
            f64::NAN,
            "skipped".into(),
            "reported".into(),
            true,
        ),
        Err(e) => report.failed(BENCH, "device memory", format!("{e:#}")),
    }
}
