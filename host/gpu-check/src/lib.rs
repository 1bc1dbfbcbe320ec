//! `chimera-gpu-check`: the GPU test and measurement suites, run on a machine with a GPU by a
//! binary built without one (`tests/gpu/run.sh`). A crate of its own above the `chimera`
//! library: it drives the backends, models and engine through their public faces, and nothing
//! in the host depends on it.
//!
//! Every check compares the CUDA backend with the CPU reference (or measures it against a
//! ceiling measured in the same run) and becomes one row of a table: check | measured | bound
//! | pass. The table is printed last and written as JSON; the command fails if any row fails.
//!
//! Suites: `kernels` (each kernel against the CPU on fresh random inputs, outputs poisoned
//! first), `hybrid` (MoE routing and experts, SSM slot operations), `moe` (the MoE rows of
//! `hybrid` and `bench` alone), `parity` (the Llama fixtures end to end, f32 mode against the CPU; bf16 logits are
//! written for the transformers comparison), `bench` (Llama-3-8B-shaped dummy model: load time,
//! eager decode against the memory floor, driver allocations in the step loop; causal
//! attention at 8192 tokens), `graphs` (decode steps replayed from CUDA graphs against the same
//! steps run eagerly).

mod bench;
mod bench_mixed;
mod fp8;
mod gdn;
mod gemv;
mod graphs;
mod hybrid;
mod kernels;
mod kv_fp8;
mod mamba_mix;
mod model_d128;
mod moe;
mod parity;
pub mod rng;
mod spec;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use serde::Serialize;

use chimera::backend::DType;
use chimera::backend::cuda::{CudaBackend, CudaOptions};

#[derive(Debug, clap::Args)]
pub struct GpuCheckArgs {
    /// kernels, attention (the attention rows of kernels), hybrid, parity, model (the d = 128
    /// Llama-shaped model of parity), archs (the Gated DeltaNet rows and the Granite 4.0,
    /// Falcon-H1 and Gated DeltaNet fixtures end to end), fixtures (every fixture end to end,
    /// with the bf16 logits dumped), graphs, bench, bench-archs (the delta rule's timings and
    /// the Qwen3.5 decodes), moe (the MoE rows of hybrid and bench), spec (speculative
    /// decoding: every fixture with drafts, GPU = CPU), bench-spec (verify-step cost and
    /// speed-ups on the 8B shapes), fp8 (FP8 weights and the FP8 KV cache against the CPU),
    /// bench-fp8 (their timings), bench-fp8-short (the FP8 GEMV variants, the
    /// batched FP8 linear layers and the FP8 KV cache's timings alone), kv-fp8 (the FP8 KV
    /// cache's checks and timings, then the FP8 linear layers' timings) or all.
    #[arg(long, default_value = "all")]
    pub suite: String,
    /// The committed model fixtures (`tests/fixtures/models`).
    #[arg(long, default_value = "tests/fixtures/models")]
    pub fixtures: PathBuf,
    /// Where to write the rows as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Folder for logits dumps (the bf16-vs-transformers comparison reads them).
    #[arg(long)]
    pub dump: Option<PathBuf>,
    /// A `config.json` of a full-size model for the bench suite (dummy weights).
    #[arg(long, default_value = "tests/gpu/configs/llama-3-8b")]
    pub bench_model: PathBuf,
    /// A `config.json` of a full-size hybrid model for the hybrid suite's stress run (dummy
    /// weights).
    #[arg(long, default_value = "tests/gpu/configs/nemotron-h-8b")]
    pub hybrid_model: PathBuf,
    /// `config.json` folders of the full-size models the bench-archs suite decodes (dummy
    /// weights).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "tests/gpu/configs/qwen3.5-27b,tests/gpu/configs/qwen3.5-35b-a3b,tests/gpu/configs/qwen3-next-80b-a3b-32l,tests/gpu/configs/granite-4.0-h-small"
    )]
    pub arch_models: Vec<PathBuf>,
    /// CUDA device.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Seed for the random inputs (default: from the clock, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Decode steps timed per batch size in the bench suite.
    #[arg(long, default_value_t = 1000)]
    pub steps: usize,
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub suite: String,
    pub check: String,
    pub measured: String,
    pub bound: String,
    pub pass: bool,
    /// The measured number (NaN when the check failed before measuring).
    pub value: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub device: String,
    pub seed: u64,
    pub rows: Vec<Row>,
}

impl Report {
    fn push(
        &mut self,
        suite: &str,
        check: impl Into<String>,
        value: f64,
        measured: String,
        bound: String,
        pass: bool,
    ) {
        let row = Row {
            suite: suite.into(),
            check: check.into(),
            measured,
            bound,
            pass,
            value,
        };
        eprintln!(
            "{} {:<60} {:>14} {:>14}",
            if row.pass { "  ok " } else { "FAIL " },
            row.check,
            row.measured,
            row.bound
        );
        self.rows.push(row);
    }

    /// A relative error against a maximum.
    fn err(&mut self, suite: &str, check: impl Into<String>, err: f64, max: f64) {
        let pass = err.is_finite() && err <= max;
        self.push(
            suite,
            check,
            err,
            format!("{err:.2e}"),
            format!("≤ {max:.0e}"),
            pass,
        );
    }

    /// A check that errored before it could measure.
    fn failed(&mut self, suite: &str, check: impl Into<String>, why: impl std::fmt::Display) {
        let why = why.to_string();
        let short: String = why.chars().take(60).collect();
        eprintln!("      error: {why}");
        self.push(
            suite,
            check,
            f64::NAN,
            format!("error: {short}"),
            "-".into(),
            false,
        );
    }

    pub fn failures(&self) -> usize {
        self.rows.iter().filter(|r| !r.pass).count()
    }

    /// The table, one row per check.
    pub fn table(&self) -> String {
        let w = self
            .rows
            .iter()
            .map(|r| r.check.len())
            .max()
            .unwrap_or(5)
            .max(5);
        let mut out = format!(
            "{:<8} | {:<w$} | {:>16} | {:>16} | pass\n",
            "suite", "check", "measured", "bound"
        );
        out.push_str(&format!("{}\n", "-".repeat(w + 54)));
        for r in &self.rows {
            out.push_str(&format!(
                "{:<8} | {:<w$} | {:>16} | {:>16} | {}\n",
                r.suite,
                r.check,
                r.measured,
                r.bound,
                if r.pass { "yes" } else { "NO" }
            ));
        }
        out.push_str(&format!(
            "{} checks, {} failed ({}, seed {})\n",
            self.rows.len(),
            self.failures(),
            self.device,
            self.seed
        ));
        out
    }
}

/// `v` rounded to bf16 (what a bf16 tensor holds), as f32.
pub(crate) fn bf16_round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// Host inputs as the backend will hold them: rounded to bf16 when `bf16`, else unchanged.
pub(crate) fn round_if_bf16(v: Vec<f32>, bf16: bool) -> Vec<f32> {
    if bf16 {
        v.into_iter().map(bf16_round).collect()
    } else {
        v
    }
}

/// `‖a − b‖ / ‖b‖` in f64; infinite when `a` holds a NaN or the lengths differ.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.iter().any(|x| x.is_nan()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = f64::from(x) - f64::from(y);
        num += d * d;
        den += f64::from(y) * f64::from(y);
    }
    if den == 0.0 {
        return if num == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (num / den).sqrt()
}

/// The worst row: max over rows of `row` values of (max |a − b| in the row / max |b| in the
/// row), in f64. A wrong row among many right ones shows at its own size, where a norm over the
/// whole tensor divides it by the number of rows. Infinite when `a` holds a NaN, the lengths
/// differ or do not split into rows, or a row whose reference is all zero is not zero.
pub fn row_max_rel(a: &[f32], b: &[f32], row: usize) -> f64 {
    if row == 0
        || a.len() != b.len()
        || !a.len().is_multiple_of(row)
        || a.iter().any(|x| x.is_nan())
    {
        return f64::INFINITY;
    }
    let mut worst = 0.0f64;
    for (ra, rb) in a.chunks_exact(row).zip(b.chunks_exact(row)) {
        let (mut d, mut m) = (0.0f64, 0.0f64);
        for (&x, &y) in ra.iter().zip(rb) {
            d = d.max((f64::from(x) - f64::from(y)).abs());
            m = m.max(f64::from(y).abs());
        }
        let e = if m > 0.0 {
            d / m
        } else if d == 0.0 {
            0.0
        } else {
            f64::INFINITY
        };
        worst = worst.max(e);
    }
    worst
}

/// How many elements differ in their bit patterns (a NaN always differs; a length mismatch
/// counts every element of the longer one).
pub fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    if a.len() != b.len() {
        return a.len().max(b.len());
    }
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.is_nan() || x.to_bits() != y.to_bits())
        .count()
}

/// Runs the suites and returns the report (the caller prints it and sets the exit code).
pub fn run(args: &GpuCheckArgs) -> anyhow::Result<Report> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let started = Instant::now();
    let f32_gpu = CudaBackend::new(CudaOptions {
        device: args.device,
        dtype: DType::F32,
    })
    .context("opening the GPU in f32 mode")?;
    let bf16_gpu = f32_gpu.with_dtype(DType::BF16)?;
    let mut report = Report {
        device: format!("{} ({})", f32_gpu.device().name, f32_gpu.device().arch),
        seed,
        rows: Vec::new(),
    };
    eprintln!(
        "{}: kernels ready in {:.1?}, seed {seed}",
        report.device,
        started.elapsed()
    );
    let all = args.suite == "all";
    let mut ran = false;
    if all || args.suite == "kernels" {
        ran = true;
        kernels::run(&mut report, &f32_gpu, &bf16_gpu, seed);
    }
    if all || args.suite == "hybrid" {
        ran = true;
        hybrid::run(&mut report, &f32_gpu, &bf16_gpu, args, seed);
    }
    if args.suite == "attention" {
        ran = true;
        kernels::run_attention(&mut report, &f32_gpu, &bf16_gpu, seed);
    }
    if all || args.suite == "parity" {
        ran = true;
        parity::run(&mut report, &f32_gpu, &bf16_gpu, args);
    }
    if all || args.suite == "parity" || args.suite == "model" {
        ran = true;
        model_d128::run(&mut report, &f32_gpu, &bf16_gpu);
    }
    if all || args.suite == "archs" {
        // Every architecture beyond Llama and the Mamba2 hybrids: the delta-rule rows, then
        // the Granite 4.0, Falcon-H1 and Gated DeltaNet fixtures end to end.
        ran = true;
        let mut rng = rng::Rng::new(seed ^ 0x6764_6e00);
        gdn::checks(&mut report, "archs", &f32_gpu, &mut rng);
        gdn::checks(&mut report, "archs", &bf16_gpu, &mut rng);
        parity::run_fixtures(
            &mut report,
            &f32_gpu,
            &bf16_gpu,
            args,
            &["granite-", "falconh1-", "qwen3next-", "qwen35"],
        );
    }
    if args.suite == "spec" {
        ran = true;
        spec::checks(&mut report, &f32_gpu, &bf16_gpu, args);
    }
    if args.suite == "bench-spec" {
        ran = true;
        spec::bench(&mut report, &bf16_gpu, args);
    }
    if args.suite == "bench-archs" {
        ran = true;
        bench::archs(&mut report, &bf16_gpu, args);
    }
    if args.suite == "fixtures" {
        ran = true;
        parity::run_all_fixtures(&mut report, &f32_gpu, &bf16_gpu, args);
    }
    if all || args.suite == "graphs" {
        ran = true;
        graphs::run(&mut report, &f32_gpu, &bf16_gpu, args);
    }
    if all || args.suite == "bench" {
        ran = true;
        bench::run(&mut report, &bf16_gpu, args);
    }
    if args.suite == "bench-mixed" {
        ran = true;
        bench_mixed::run(&mut report, &bf16_gpu, args);
    }
    if args.suite == "bench-kernels" {
        ran = true;
        bench::kernels(&mut report, &bf16_gpu);
    }
    if args.suite == "fp8" {
        ran = true;
        fp8::checks(&mut report, &f32_gpu, &bf16_gpu, args, seed);
        kv_fp8::checks(&mut report, &f32_gpu, &bf16_gpu, args, seed);
    }
    if args.suite == "bench-fp8" {
        ran = true;
        fp8::bench(&mut report, &bf16_gpu, args);
        kv_fp8::bench(&mut report, &bf16_gpu, args);
    }
    if args.suite == "kv-fp8" {
        // The FP8 KV cache's checks and timings, then the FP8 linear layers' timings: the
        // newest FP8 code first, for a short GPU call.
        ran = true;
        kv_fp8::checks(&mut report, &f32_gpu, &bf16_gpu, args, seed);
        kv_fp8::bench(&mut report, &bf16_gpu, args);
        if let Some(bw) = bench::copy_bandwidth(&mut report, &bf16_gpu) {
            fp8::gemv_bench(&mut report, &bf16_gpu, bw);
        }
        fp8::batched_bench(&mut report, &bf16_gpu);
    }
    if args.suite == "bench-fp8-short" {
        // The FP8 GEMV variants and the FP8 KV cache against bf16, without the model decodes.
        ran = true;
        if let Some(bw) = bench::copy_bandwidth(&mut report, &bf16_gpu) {
            fp8::gemv_bench(&mut report, &bf16_gpu, bw);
        }
        fp8::batched_bench(&mut report, &bf16_gpu);
        kv_fp8::bench(&mut report, &bf16_gpu, args);
    }
    if args.suite == "moe" {
        // The MoE rows of `hybrid` and `bench` alone.
        ran = true;
        let mut rng = rng::Rng::new(seed ^ 0x4d6f_4521);
        moe::checks(&mut report, "moe", &f32_gpu, &bf16_gpu, &mut rng);
        moe::bench(&mut report, "moe", &bf16_gpu);
    }
    anyhow::ensure!(
        ran,
        "unknown suite {:?} (kernels, attention, hybrid, parity, model, archs, fixtures, graphs, bench, bench-kernels, bench-archs, bench-mixed, moe, fp8, bench-fp8, bench-fp8-short, kv-fp8, all)",
        args.suite
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_max_rel_sees_one_wrong_row_among_many() {
        // 1000 rows of 4, one of them 10 % off: the norm over the whole tensor shows about
        // 0.3 %, the worst row 10 %.
        let want: Vec<f32> = (0..4000).map(|i| ((i % 7) as f32) - 3.0 + 0.5).collect();
        let mut got = want.clone();
        for x in &mut got[400..404] {
            *x *= 1.1;
        }
        assert!(rel_err(&got, &want) < 5e-3);
        let r = row_max_rel(&got, &want, 4);
        assert!((r - 0.1).abs() < 1e-6, "{r}");
        assert_eq!(row_max_rel(&want, &want, 4), 0.0);
    }

    #[test]
    fn row_max_rel_fails_nan_zero_rows_and_bad_lengths() {
        assert!(row_max_rel(&[f32::NAN, 1.0], &[1.0, 1.0], 2).is_infinite());
        assert!(row_max_rel(&[0.1, 0.0], &[0.0, 0.0], 2).is_infinite());
        assert_eq!(row_max_rel(&[0.0, 0.0], &[0.0, 0.0], 2), 0.0);
        assert!(row_max_rel(&[1.0, 1.0, 1.0], &[1.0, 1.0, 1.0], 2).is_infinite());
        assert!(row_max_rel(&[1.0], &[1.0, 1.0], 1).is_infinite());
    }

    #[test]
    fn bits_differ_counts_every_changed_bit_pattern() {
        let a = [1.0f32, 2.0, 3.0, 0.0];
        assert_eq!(bits_differ(&a, &a), 0);
        // One ulp is a difference; so is a NaN, even against a NaN.
        let b = [1.0f32, f32::from_bits(2.0f32.to_bits() + 1), f32::NAN, 0.0];
        assert_eq!(bits_differ(&b, &a), 2);
        assert_eq!(bits_differ(&[f32::NAN], &[f32::NAN]), 1);
        assert_eq!(bits_differ(&a[..3], &a), 4);
    }
}
