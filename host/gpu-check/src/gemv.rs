//! Small-batch linear layers on the decode shapes of Llama-3-8B and NemotronH-8B (bf16): the
//! one-pass GEMV (`gemv.cu`, the backend's default up to eight rows: FMAs at one and two, tensor
//! cores from three, a verify step's token and drafts) against cuBLASLt, timed from
//! CUDA graphs of 20 calls so launch gaps do not count. Each call reads a different copy of
//! the weights (at least 256 MiB in rotation, five times the L2 cache), so the bandwidth is
//! DRAM's, not the cache's.

use std::time::Instant;

use super::Report;
use chimera::backend::cuda::{CudaBackend, CudaTensor};
use chimera::backend::{Backend, DType, LayerOps, StepBackend};

/// (label, output features of each weight sharing the input, k).
const SHAPES: &[(&str, &[usize], usize)] = &[
    ("Llama-3-8B q|k|v", &[4096, 1024, 1024], 4096),
    ("Llama-3-8B o_proj", &[4096], 4096),
    ("Llama-3-8B gate|up", &[14336, 14336], 4096),
    ("Llama-3-8B down_proj", &[4096], 14336),
    ("Llama-3-8B lm_head", &[128256], 4096),
    ("NemotronH-8B mamba in_proj", &[18560], 4096),
    ("NemotronH-8B mamba out_proj", &[4096], 8192),
    ("NemotronH-8B mlp up", &[21504], 4096),
    ("NemotronH-8B mlp down", &[4096], 21504),
];

const CALLS: usize = 20;

pub fn bench(report: &mut Report, suite: &str, gpu: &CudaBackend, bw: f64) {
    for &(label, ms, k) in SHAPES {
        for n in [1usize, 2, 3, 5, 8] {
            let check = format!(
                "linear n={n} {label} {}×{k}",
                ms.iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join("|")
            );
            match time_shape(gpu, n, ms, k) {
                Ok((gemv_s, cublas_s, bytes)) => {
                    let (gemv_bw, cublas_bw) = (bytes / gemv_s, bytes / cublas_s);
                    // The target is at M = 1; more rows are reported.
                    let pass = n != 1 || gemv_bw >= 0.85 * bw;
                    report.push(
                        suite,
                        format!(
                            "{check}: one-pass GEMV (cuBLASLt {:.1} µs, {:.2} TB/s)",
                            cublas_s * 1e6,
                            cublas_bw / 1e12
                        ),
                        gemv_bw,
                        format!("{:.1} µs {:.2} TB/s", gemv_s * 1e6, gemv_bw / 1e12),
                        if n == 1 {
                            format!("≥ {:.2} TB/s", 0.85 * bw / 1e12)
                        } else {
                            "reported".into()
                        },
                        pass,
                    );
                }
                Err(e) => report.failed(suite, check, format!("{e:#}")),
            }
        }
    }
    gpu.set_small_m_gemv(true);
}

/// Seconds per call with the GEMV and with cuBLASLt, and the weight bytes one call reads.
fn time_shape(
    gpu: &CudaBackend,
    n: usize,
    ms: &[usize],
    k: usize,
) -> anyhow::Result<(f64, f64, f64)> {
    let bytes = ms.iter().sum::<usize>() * k * DType::BF16.size();
    let copies = (256usize << 20).div_ceil(bytes).clamp(1, CALLS);
    let weights: Vec<Vec<CudaTensor>> = (0..copies)
        .map(|_| {
            ms.iter()
                .map(|&m| gpu.zeros(&[m, k], DType::BF16))
                .collect::<Result<_, _>>()
        })
        .collect::<Result<_, _>>()?;
    let x = gpu.zeros(&[n, k], DType::BF16)?;
    let mut per_call = [0.0f64; 2];
    for (i, on) in [true, false].into_iter().enumerate() {
        gpu.set_small_m_gemv(on);
        per_call[i] = graph_seconds_per_call(gpu, CALLS, &mut || {
            for c in 0..CALLS {
                let ws: Vec<_> = weights[c % copies].iter().map(|w| (w, None)).collect();
                drop(gpu.linear_shared(&x, &ws)?);
            }
            Ok(())
        })?;
    }
    gpu.set_small_m_gemv(true);
    Ok((per_call[0], per_call[1], bytes as f64))
}

/// Seconds per call of `run`, which makes `calls` calls: run once eagerly (warm-up), captured
/// as a graph, then the graph replayed five times and timed (launch gaps do not count).
pub(super) fn graph_seconds_per_call(
    gpu: &CudaBackend,
    calls: usize,
    run: &mut dyn FnMut() -> chimera::backend::Result<()>,
) -> anyhow::Result<f64> {
    run()?;
    let id = gpu.capture_graph(run)?;
    gpu.replay_graph(id)?;
    gpu.synchronize()?;
    let reps = 5;
    let t0 = Instant::now();
    for _ in 0..reps {
        gpu.replay_graph(id)?;
    }
    gpu.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / (reps * calls) as f64)
}
