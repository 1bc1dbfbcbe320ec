//! The `kernels` suite: every CUDA kernel against the CPU reference on fresh random inputs,
//! in f32 mode (relative error ≤ 1e-5, ≤ 1e-4 for reductions over long axes) and bf16 mode
//! (≤ 1e-2; the CPU gets the same inputs rounded to bf16). The GPU's arena is poisoned with NaN
//! before every check, so an output element a kernel did not write fails the check.

use super::rng::Rng;
use super::{Report, bf16_round, bits_differ, rel_err, row_max_rel};
use chimera::backend::cpu::{CpuBackend, CpuTensor};
use chimera::backend::cuda::{CudaBackend, CudaTensor};
use chimera::backend::sample::Penalties;
use chimera::backend::{
    Activation, AttnShape, Backend, DType, HostTensor, KvLayer, LayerOps, Rope, SampleOut,
    StepBackend, StepPlan,
};
use chimera_kernels::attention::PrefillKernel;

type R<T> = anyhow::Result<T>;

struct Ctx<'a> {
    cpu: CpuBackend,
    gpu: &'a CudaBackend,
    mode: DType,
    rng: Rng,
    report: &'a mut Report,
}

impl Ctx<'_> {
    fn tag(&self) -> &'static str {
        if self.mode == DType::F32 {
            "f32"
        } else {
            "bf16"
        }
    }

    fn tol(&self, reduction: bool) -> f64 {
        match (self.mode, reduction) {
            (DType::F32, false) => 1e-5,
            (DType::F32, true) => 1e-4,
            _ => 1e-2,
        }
    }

    /// Random values (rounded to bf16 in bf16 mode, so both backends see the same inputs).
    fn rand(&mut self, n: usize, a: f32) -> Vec<f32> {
        let mut v = self.rng.vec(n, a);
        if self.mode == DType::BF16 {
            v.iter_mut().for_each(|x| *x = bf16_round(*x));
        }
        v
    }

    fn up(&self, v: &[f32], shape: &[usize]) -> R<(CpuTensor, CudaTensor)> {
        let h = HostTensor::f32(v, shape);
        Ok((self.cpu.upload(h)?, self.gpu.upload(h)?))
    }

    fn steps(
        &self,
        plan: &StepPlan,
    ) -> R<(
        <CpuBackend as LayerOps>::Step,
        <CudaBackend as LayerOps>::Step,
    )> {
        let mut c = self.cpu.new_step(plan.num_tokens())?;
        self.cpu.upload_step(plan, &mut c)?;
        let mut g = self.gpu.new_step(plan.num_tokens())?;
        self.gpu.upload_step(plan, &mut g)?;
        Ok((c, g))
    }

    /// Runs one comparison: `f` returns (gpu, cpu) outputs.
    fn check(
        &mut self,
        name: &str,
        reduction: bool,
        f: impl FnOnce(&mut Self) -> R<(Vec<f32>, Vec<f32>)>,
    ) {
        let label = format!("{} {name}", self.tag());
        if let Err(e) = self.gpu.poison_arena() {
            self.report.failed("kernels", label, e);
            return;
        }
        let tol = self.tol(reduction);
        match f(self) {
            Ok((g, c)) => self.report.err("kernels", label, rel_err(&g, &c), tol),
            Err(e) => self.report.failed("kernels", label, e),
        }
    }
}

/// A plan of chunks `(context_len, new tokens)` with random token ids and random distinct
/// block ids out of `num_blocks` (every chunk's table covers context + new tokens).
fn plan_of(
    rng: &mut Rng,
    chunks: &[(usize, usize)],
    block_size: usize,
    num_blocks: usize,
    vocab: usize,
) -> StepPlan {
    let need: usize = chunks
        .iter()
        .map(|&(c, q)| (c + q).div_ceil(block_size))
        .sum();
    let ids = rng.distinct(need, num_blocks);
    let mut plan = StepPlan::new(block_size);
    let mut at = 0;
    for &(ctx, q) in chunks {
        let nb = (ctx + q).div_ceil(block_size);
        let table = &ids[at..at + nb];
        at += nb;
        let tokens: Vec<u32> = (0..q).map(|_| rng.below(vocab) as u32).collect();
        plan.push(&tokens, ctx, table, 0, true);
    }
    plan
}

pub fn run(report: &mut Report, f32_gpu: &CudaBackend, bf16_gpu: &CudaBackend, seed: u64) {
    run_parts(report, f32_gpu, bf16_gpu, seed, false);
}

/// The attention rows of [`run`] alone (`--suite attention`).
pub fn run_attention(
    report: &mut Report,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    seed: u64,
) {
    run_parts(report, f32_gpu, bf16_gpu, seed, true);
}

/// Every kernel check in f32 and bf16, or (`attention_only`) the attention rows alone, with
/// the same seeds either way.
fn run_parts(
    report: &mut Report,
    f32_gpu: &CudaBackend,
    bf16_gpu: &CudaBackend,
    seed: u64,
    attention_only: bool,
) {
    for (i, gpu) in [f32_gpu, bf16_gpu].into_iter().enumerate() {
        let mut c = Ctx {
            cpu: CpuBackend::default(),
            gpu,
            mode: gpu.dtype(),
            rng: Rng::new(seed.wrapping_add(i as u64)),
            report,
        };
        if attention_only {
            attention(&mut c);
            continue;
        }
        dense(&mut c);
        attention(&mut c);
        if c.mode == DType::F32 {
            sampling(&mut c);
        }
    }
}

fn dense(c: &mut Ctx<'_>) {
    // One or two rows in bf16 take the one-pass GEMV (k a multiple of 8; m a multiple of the
    // variant's features per block, 2 at one row and 4 at two), the rest cuBLASLt: shapes on
    // both sides of each rule.
    for &(n, k, m, bias) in &[
        (1usize, 4096usize, 6144usize, false),
        (1, 4104, 1032, true),
        (1, 1024, 1030, true),
        (2, 1024, 1030, true),
        (1, 512, 1031, false),
        (2, 14336, 512, false),
        (2, 1032, 260, true),
        (3, 1032, 260, true),
        (4, 4096, 1030, false),
        (5, 100, 50, true),
        (8, 8192, 520, true),
        (7, 96, 40, true),
        (33, 128, 512, true),
        (131, 4096, 4096, false),
        (1000, 24, 512, false),
    ] {
        c.check(
            &format!("linear {n}×{k}·{m}ᵀ{}", if bias { " +bias" } else { "" }),
            k > 1024,
            |c| {
                let x = c.rand(n * k, 1.0);
                let w = c.rand(m * k, 0.05);
                let b = c.rand(m, 0.5);
                let (xc, xg) = c.up(&x, &[n, k])?;
                let (wc, wg) = c.up(&w, &[m, k])?;
                let (bc, bg) = c.up(&b, &[m])?;
                let g = c.gpu.linear(&xg, &wg, bias.then_some(&bg))?;
                let r = c.cpu.linear(&xc, &wc, bias.then_some(&bc))?;
                Ok((c.gpu.download(&g)?, c.cpu.download(&r)?))
            },
        );
    }
    for &(n, k, ms) in &[
        (1usize, 4096usize, &[1024usize, 256, 256][..]),
        (2, 2048, &[768, 768][..]),
        (1, 520, &[132, 68, 4][..]),
        (4, 2048, &[768, 768][..]),
        (12, 512, &[64, 32, 32][..]),
        // The tensor-core GEMV (3..8 rows): k past the last whole trip (1032, 520), three
        // segments, and a width that is no multiple of its 16 features (cuBLASLt).
        (3, 4096, &[1024, 256, 256][..]),
        (5, 1032, &[272, 16][..]),
        (8, 520, &[128, 64, 32][..]),
        (7, 2048, &[776][..]),
    ] {
        c.check(
            &format!("linear_shared {n}×{k}·{ms:?}ᵀ +bias on the first"),
            k > 1024,
            |c| {
                let x = c.rand(n * k, 1.0);
                let (xc, xg) = c.up(&x, &[n, k])?;
                let mut host = Vec::new();
                for (i, &m) in ms.iter().enumerate() {
                    let w = c.rand(m * k, 0.05);
                    let b = c.rand(m, 0.5);
                    let (wc, wg) = c.up(&w, &[m, k])?;
                    let bias = if i == 0 { Some(c.up(&b, &[m])?) } else { None };
                    host.push((wc, wg, bias));
                }
                let gw: Vec<_> = host
                    .iter()
                    .map(|(_, wg, b)| (wg, b.as_ref().map(|b| &b.1)))
                    .collect();
                let cw: Vec<_> = host
                    .iter()
                    .map(|(wc, _, b)| (wc, b.as_ref().map(|b| &b.0)))
                    .collect();
                let (mut g, mut r) = (Vec::new(), Vec::new());
                for t in c.gpu.linear_shared(&xg, &gw)? {
                    g.extend(c.gpu.download(&t)?);
                }
                for t in c.cpu.linear_shared(&xc, &cw)? {
                    r.extend(c.cpu.download(&t)?);
                }
                Ok((g, r))
            },
        );
    }
    // A gated MLP's input and an activated projection, fused into the GEMV's epilogue at one
    // or two bf16 rows (else the unfused kernels): against the CPU, and against the GPU's own
    // unfused kernels, which they must equal bit for bit.
    for &(n, k, m, bias, act) in &[
        (1usize, 4096usize, 14336usize, false, Activation::Silu),
        (2, 1032, 260, true, Activation::Gelu),
        (1, 2048, 1026, true, Activation::Relu2),
        (3, 512, 256, false, Activation::Silu),
        (5, 1032, 272, true, Activation::Gelu),
        (8, 4096, 1024, false, Activation::Relu2),
    ] {
        let tag = format!("{n}×{k}·{m}ᵀ{} {act:?}", if bias { " +bias" } else { "" });
        let inputs = |c: &mut Ctx<'_>| -> R<_> {
            let x = c.rand(n * k, 1.0);
            let (xc, xg) = c.up(&x, &[n, k])?;
            let mut ws = Vec::new();
            for _ in 0..2 {
                let w = c.rand(m * k, 0.05);
                let b = c.rand(m, 0.5);
                ws.push((c.up(&w, &[m, k])?, c.up(&b, &[m])?));
            }
            Ok((xc, xg, ws))
        };
        c.check(&format!("gated_linear {tag}"), k > 1024, |c| {
            let (xc, xg, ws) = inputs(c)?;
            let bg = |i: usize| bias.then_some(&ws[i].1.1);
            let bc = |i: usize| bias.then_some(&ws[i].1.0);
            let g = c
                .gpu
                .gated_linear(&xg, (&ws[0].0.1, bg(0)), (&ws[1].0.1, bg(1)), act)?;
            let r = c
                .cpu
                .gated_linear(&xc, (&ws[0].0.0, bc(0)), (&ws[1].0.0, bc(1)), act)?;
            let fused = c.gpu.download(&g)?;
            let [gg, ug] = <[CudaTensor; 2]>::try_from(
                c.gpu
                    .linear_shared(&xg, &[(&ws[0].0.1, bg(0)), (&ws[1].0.1, bg(1))])?,
            )
            .map_err(|_| anyhow::anyhow!("two outputs"))?;
            let unfused = c.gpu.download(&c.gpu.gated_activation(&gg, &ug, act)?)?;
            let label = format!("{} gated_linear {tag}: fused = unfused on the GPU", c.tag());
            c.report
                .err("kernels", label, rel_err(&fused, &unfused), 0.0);
            Ok((fused, c.cpu.download(&r)?))
        });
        c.check(&format!("linear_activated {tag}"), k > 1024, |c| {
            let (xc, xg, ws) = inputs(c)?;
            let (bg, bc) = (bias.then_some(&ws[0].1.1), bias.then_some(&ws[0].1.0));
            let g = c.gpu.linear_activated(&xg, &ws[0].0.1, bg, act)?;
            let r = c.cpu.linear_activated(&xc, &ws[0].0.0, bc, act)?;
            let fused = c.gpu.download(&g)?;
            let mut y = c.gpu.linear(&xg, &ws[0].0.1, bg)?;
            c.gpu.activate(&mut y, act)?;
            let unfused = c.gpu.download(&y)?;
            let label = format!(
                "{} linear_activated {tag}: fused = unfused on the GPU",
                c.tag()
            );
            c.report
                .err("kernels", label, rel_err(&fused, &unfused), 0.0);
            Ok((fused, c.cpu.download(&r)?))
        });
    }
    // Widths that take the 16-byte path (multiples of 8, up to 4 pieces a thread in bf16; f32's
    // 8192 falls back) and widths that do not (100, 4100).
    for &(n, cols) in &[
        (1usize, 32usize),
        (7, 4096),
        (1000, 48),
        (33, 8192),
        (3, 100),
        (2, 4100),
    ] {
        c.check(&format!("rms_norm {n}×{cols}"), cols > 1024, |c| {
            let x = c.rand(n * cols, 2.0);
            let w = c.rand(cols, 1.0);
            let (xc, xg) = c.up(&x, &[n, cols])?;
            let (wc, wg) = c.up(&w, &[cols])?;
            Ok((
                c.gpu.download(&c.gpu.rms_norm(&xg, &wg, 1e-5)?)?,
                c.cpu.download(&c.cpu.rms_norm(&xc, &wc, 1e-5)?)?,
            ))
        });
        c.check(
            &format!("add_rms_norm {n}×{cols} (norm and residual)"),
            cols > 1024,
            |c| {
                let x = c.rand(n * cols, 2.0);
                let d = c.rand(n * cols, 2.0);
                let w = c.rand(cols, 1.0);
                let (mut xc, mut xg) = c.up(&x, &[n, cols])?;
                let (dc, dg) = c.up(&d, &[n, cols])?;
                let (wc, wg) = c.up(&w, &[cols])?;
                let mut g = c
                    .gpu
                    .download(&c.gpu.add_rms_norm(&mut xg, &dg, &wg, 1e-6)?)?;
                let mut r = c
                    .cpu
                    .download(&c.cpu.add_rms_norm(&mut xc, &dc, &wc, 1e-6)?)?;
                g.extend(c.gpu.download(&xg)?);
                r.extend(c.cpu.download(&xc)?);
                Ok((g, r))
            },
        );
    }
    for &(n, cols, group) in &[(9usize, 256usize, 64usize), (3, 8192, 1024), (5, 120, 60)] {
        c.check(
            &format!("gated_rms_norm {n}×{cols} group {group}"),
            false,
            |c| {
                let x = c.rand(n * cols, 2.0);
                let z = c.rand(n * cols, 2.0);
                let w = c.rand(cols, 1.0);
                let (xc, xg) = c.up(&x, &[n, cols])?;
                let (zc, zg) = c.up(&z, &[n, cols])?;
                let (wc, wg) = c.up(&w, &[cols])?;
                Ok((
                    c.gpu
                        .download(&c.gpu.gated_rms_norm(&xg, &zg, &wg, group, 1e-5)?)?,
                    c.cpu
                        .download(&c.cpu.gated_rms_norm(&xc, &zc, &wc, group, 1e-5)?)?,
                ))
            },
        );
    }
    // 16-byte pieces (131×1000, 13×4096) and single elements (77×333, 7×333).
    for act in [Activation::Silu, Activation::Relu2, Activation::Gelu] {
        for (rows, cols) in [(77usize, 333usize), (13, 4096)] {
            c.check(&format!("activate {act:?} {rows}×{cols}"), false, |c| {
                let x = c.rand(rows * cols, 4.0);
                let (mut xc, mut xg) = c.up(&x, &[rows, cols])?;
                c.gpu.activate(&mut xg, act)?;
                c.cpu.activate(&mut xc, act)?;
                Ok((c.gpu.download(&xg)?, c.cpu.download(&xc)?))
            });
        }
        for (rows, cols) in [(131usize, 1000usize), (7, 333)] {
            c.check(&format!("act_and_mul {act:?} {rows}×{cols}"), false, |c| {
                let g = c.rand(rows * cols, 4.0);
                let u = c.rand(rows * cols, 2.0);
                let (gc, gg) = c.up(&g, &[rows, cols])?;
                let (uc, ug) = c.up(&u, &[rows, cols])?;
                Ok((
                    c.gpu.download(&c.gpu.gated_activation(&gg, &ug, act)?)?,
                    c.cpu.download(&c.cpu.gated_activation(&gc, &uc, act)?)?,
                ))
            });
        }
    }
    c.check("split_cols 33×(7,100,21)", false, |c| {
        let x = c.rand(33 * 128, 1.0);
        let (xc, xg) = c.up(&x, &[33, 128])?;
        let g = c.gpu.split_cols(&xg, [7, 100, 21])?;
        let r = c.cpu.split_cols(&xc, [7, 100, 21])?;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for (gt, ct) in g.iter().zip(&r) {
            a.extend(c.gpu.download(gt)?);
            b.extend(c.cpu.download(ct)?);
        }
        Ok((a, b))
    });
    // 16-byte pieces: NemotronH's in_proj split at bs 5 (scaled down).
    c.check("split_cols 5×(1024,64,32,16)", false, |c| {
        let x = c.rand(5 * 1136, 1.0);
        let (xc, xg) = c.up(&x, &[5, 1136])?;
        let g = c.gpu.split_cols(&xg, [1024, 64, 32, 16])?;
        let r = c.cpu.split_cols(&xc, [1024, 64, 32, 16])?;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for (gt, ct) in g.iter().zip(&r) {
            a.extend(c.gpu.download(gt)?);
            b.extend(c.cpu.download(ct)?);
        }
        Ok((a, b))
    });
    c.check("add_assign and scale_assign 1000×77", false, |c| {
        let x = c.rand(77_000, 1.0);
        let y = c.rand(77_000, 1.0);
        let (mut xc, mut xg) = c.up(&x, &[1000, 77])?;
        let (yc, yg) = c.up(&y, &[1000, 77])?;
        c.gpu.add_assign(&mut xg, &yg)?;
        c.cpu.add_assign(&mut xc, &yc)?;
        c.gpu.scale_assign(&mut xg, 0.75)?;
        c.cpu.scale_assign(&mut xc, 0.75)?;
        Ok((c.gpu.download(&xg)?, c.cpu.download(&xc)?))
    });
    c.check(
        "embedding + gather_logit_rows (3 chunks, 160 tokens)",
        false,
        |c| {
            let (vocab, cols) = (5000, 96);
            let mut plan = plan_of(&mut c.rng, &[(0, 131), (40, 1), (17, 28)], 16, 64, vocab);
            plan.seqs[0].all_logits = true;
            plan.finish()?;
            let table = c.rand(vocab * cols, 1.0);
            let (tc, tg) = c.up(&table, &[vocab, cols])?;
            let (sc, sg) = c.steps(&plan)?;
            let eg = c.gpu.embedding(&tg, &sg)?;
            let ec = c.cpu.embedding(&tc, &sc)?;
            let mut g = c.gpu.download(&c.gpu.gather_logit_rows(&eg, &sg)?)?;
            let mut r = c.cpu.download(&c.cpu.gather_logit_rows(&ec, &sc)?)?;
            g.extend(c.gpu.download(&eg)?);
            r.extend(c.cpu.download(&ec)?);
            Ok((g, r))
        },
    );
    let ropes = [
        (
            "default θ=10000, d128",
            128usize,
            1.0f64,
            1.0f32,
            10_000.0f32,
        ),
        ("partial 0.5, d64", 64, 0.5, 1.0, 500_000.0),
        ("scaled ×1.2, d24", 24, 1.0, 1.2, 10_000.0),
    ];
    for (label, head_dim, partial, scaling, theta) in ropes {
        c.check(&format!("rope {label}, positions to 40000"), false, |c| {
            let rotary = ((head_dim as f64 * partial) as usize) & !1;
            let rope = Rope {
                inv_freq: (0..rotary / 2)
                    .map(|i| 1.0 / theta.powf((2 * i) as f32 / rotary as f32))
                    .collect(),
                rotary_dim: rotary,
                attention_scaling: scaling,
            };
            let heads = 4;
            let mut plan = plan_of(
                &mut c.rng,
                &[(40_000, 3), (0, 37), (1234, 1)],
                16,
                4096,
                100,
            );
            plan.finish()?;
            let n = plan.num_tokens();
            let x = c.rand(n * heads * head_dim, 1.0);
            let (mut xc, mut xg) = c.up(&x, &[n, heads * head_dim])?;
            let (sc, sg) = c.steps(&plan)?;
            c.gpu.apply_rope(&mut xg, heads, head_dim, &rope, &sg)?;
            c.cpu.apply_rope(&mut xc, heads, head_dim, &rope, &sc)?;
            Ok((c.gpu.download(&xg)?, c.cpu.download(&xc)?))
        });
    }
}

/// One mixed attention batch: `chunks` of `(context, new tokens)`.
fn attention_case(
    c: &mut Ctx<'_>,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    block_size: usize,
    num_blocks: usize,
    chunks: &[(usize, usize)],
) {
    attention_rope_case(
        c,
        (heads, kv_heads, head_dim),
        block_size,
        num_blocks,
        chunks,
        None,
        "",
    );
}

/// One mixed attention batch; with `rope`, Q and K are rotated on their way in
/// (`rope_paged_attention`: fused into the KV write on the GPU, rotate-then-attend on the CPU).
/// `note` ends the label.
///
/// Two rows, measured apart so that neither hides the other: the attention output, as the
/// worst row (one token's one head) of max|Δ| over that row's max|ref|, so a wrong tile, head
/// or decode among thousands of right ones still shows; and the KV cache after the write,
/// compared with the CPU's over the whole cache (a write to a wrong slot shows too). The write
/// is a copy, so it must be bit-exact; only K rotated by a fused RoPE is computed, and those
/// rows get the output's per-row measure against the KV-write rounding bound instead.
fn attention_rope_case(
    c: &mut Ctx<'_>,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    block_size: usize,
    num_blocks: usize,
    chunks: &[(usize, usize)],
    rope: Option<Rope>,
    note: &str,
) {
    let label = format!(
        "{} attention {heads}q/{kv_heads}kv d{head_dim} bs{block_size} {num_blocks} blocks {chunks:?}{}{note}",
        c.tag(),
        match &rope {
            Some(r) => format!(
                " + RoPE on Q and K (rotary {}, ×{})",
                r.rotary_dim, r.attention_scaling
            ),
            None => String::new(),
        }
    );
    if let Err(e) = c.gpu.poison_arena() {
        c.report.failed("kernels", label, e);
        return;
    }
    let shape = (heads, kv_heads, head_dim);
    match attention_measure(c, shape, block_size, num_blocks, chunks, rope.as_ref()) {
        Ok(m) => {
            let bf16 = c.mode == DType::BF16;
            eprintln!(
                "      {label}: the old combined measure (output and written KV rows in one ‖Δ‖/‖ref‖): {:.2e}",
                m.combined
            );
            c.report.err(
                "kernels",
                format!("{label}: output, worst row max|Δ|/max|ref|"),
                m.out_row,
                attention_out_bound(bf16),
            );
            let what = if m.k_rotated.is_some() {
                "V and unwritten K bit-exact"
            } else {
                "bit-exact"
            };
            c.report.push(
                "kernels",
                format!("{label}: KV cache after the write = CPU's ({what})"),
                m.kv_differ as f64,
                format!("{} of {} differ", m.kv_differ, m.kv_total),
                "0 differ".into(),
                m.kv_differ == 0 && m.kv_total > 0,
            );
            if let Some(k) = m.k_rotated {
                c.report.err(
                    "kernels",
                    format!("{label}: rotated K written, worst row max|Δ|/max|ref|"),
                    k,
                    if bf16 { 4e-3 } else { 1e-5 },
                );
            }
        }
        Err(e) => c.report.failed("kernels", label, e),
    }
}

/// The per-row bound of an attention output: f32 accumulates in f32 (errors near 1e-6 of a
/// row's largest value at 16k keys); bf16 rounds the probabilities for the P·V product and
/// the output itself to bf16, 2⁻⁹ of a value each, so a row stays within a few 1e-3.
fn attention_out_bound(bf16: bool) -> f64 {
    if bf16 { 1e-2 } else { 1e-4 }
}

/// What [`attention_measure`] found.
struct AttnMeasure {
    /// Worst row (token × head) of the output: max|Δ| / max|ref|.
    out_row: f64,
    /// Cache elements that differ from the CPU's bit pattern (rotated K rows excluded).
    kv_differ: usize,
    kv_total: usize,
    /// With RoPE fused into the write: the rotated K rows' worst max|Δ| / max|ref|.
    k_rotated: Option<f64>,
    /// The measure this check used before (output and written KV rows as one relative norm),
    /// for the log.
    combined: f64,
}

fn attention_measure(
    c: &mut Ctx<'_>,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    block_size: usize,
    num_blocks: usize,
    chunks: &[(usize, usize)],
    rope: Option<&Rope>,
) -> R<AttnMeasure> {
    let mut plan = plan_of(&mut c.rng, chunks, block_size, num_blocks, 100);
    plan.finish()?;
    let n = plan.num_tokens();
    let kvw = kv_heads * head_dim;
    // The cache holds random K/V in every block a chunk's context uses.
    let rows = num_blocks * block_size;
    let mut kc = vec![0.0f32; rows * kvw];
    let mut vc = vec![0.0f32; rows * kvw];
    for (i, s) in plan.seqs.iter().enumerate() {
        let table = plan.block_table(i).to_vec();
        for p in 0..s.context_len {
            let row = table[p / block_size] as usize * block_size + p % block_size;
            for j in 0..kvw {
                kc[row * kvw + j] = c.rng.sym(1.0);
                vc[row * kvw + j] = c.rng.sym(1.0);
            }
        }
    }
    if c.mode == DType::BF16 {
        kc.iter_mut()
            .chain(vc.iter_mut())
            .for_each(|x| *x = bf16_round(*x));
    }
    let shape = [num_blocks, block_size, kv_heads, head_dim];
    let (kcc, kcg) = c.up(&kc, &shape)?;
    let (vcc, vcg) = c.up(&vc, &shape)?;
    drop((kc, vc));
    let mut cache_c = KvLayer::plain(kcc, vcc);
    let mut cache_g = KvLayer::plain(kcg, vcg);
    let q = c.rand(n * heads * head_dim, 1.0);
    let k = c.rand(n * kvw, 1.0);
    let v = c.rand(n * kvw, 1.0);
    let (qc, qg) = c.up(&q, &[n, heads * head_dim])?;
    let (kc, kg) = c.up(&k, &[n, kvw])?;
    let (vc, vg) = c.up(&v, &[n, kvw])?;
    let (sc, sg) = c.steps(&plan)?;
    let shape = AttnShape {
        heads,
        kv_heads,
        head_dim,
        scale: (head_dim as f32).powf(-0.5),
    };
    let (g, r) = match rope {
        Some(rope) => (
            c.gpu
                .rope_paged_attention(qg, kg, &vg, &mut cache_g, shape, rope, &sg)?,
            c.cpu
                .rope_paged_attention(qc, kc, &vc, &mut cache_c, shape, rope, &sc)?,
        ),
        None => (
            c.gpu
                .paged_attention(&qg, &kg, &vg, &mut cache_g, shape, &sg)?,
            c.cpu
                .paged_attention(&qc, &kc, &vc, &mut cache_c, shape, &sc)?,
        ),
    };
    let out_g = c.gpu.download(&g)?;
    let out_c = c.cpu.download(&r)?;
    let out_row = row_max_rel(&out_g, &out_c, head_dim);
    // The whole caches, K and V; the slots this step wrote are also gathered for the old
    // combined measure and, with RoPE, the rotated K rows.
    let (mut kv_differ, mut kv_total) = (0usize, 0usize);
    let (mut old_g, mut old_c) = (out_g, out_c);
    let mut k_rotated = None;
    let written: Vec<usize> = plan
        .slot_mapping
        .iter()
        .map(|&s| s as usize)
        .filter(|&s| s < rows)
        .collect();
    for (is_k, tg, tc) in [
        (true, &cache_g.k, &cache_c.k),
        (false, &cache_g.v, &cache_c.v),
    ] {
        let mut all_g = c.gpu.download(tg)?;
        let mut all_c = c.cpu.download(tc)?;
        anyhow::ensure!(all_g.len() == all_c.len(), "cache sizes differ");
        let (mut rg, mut rc) = (Vec::new(), Vec::new());
        for &slot in &written {
            let s = slot * kvw;
            rg.extend_from_slice(&all_g[s..s + kvw]);
            rc.extend_from_slice(&all_c[s..s + kvw]);
        }
        if is_k && rope.is_some() {
            k_rotated = Some(row_max_rel(&rg, &rc, head_dim));
            // The rotated rows are measured above; the rest of K must be untouched.
            for &slot in &written {
                let s = slot * kvw;
                all_g[s..s + kvw].fill(0.0);
                all_c[s..s + kvw].fill(0.0);
            }
        }
        old_g.extend(rg);
        old_c.extend(rc);
        kv_differ += bits_differ(&all_g, &all_c);
        kv_total += all_g.len();
    }
    Ok(AttnMeasure {
        out_row,
        kv_differ,
        kv_total,
        k_rotated,
        combined: rel_err(&old_g, &old_c),
    })
}

fn attention(c: &mut Ctx<'_>) {
    // The plan's matrix: decodes over long contexts, fresh prefills, chunks over cached prefixes
    // whose context is not block-aligned; GQA/MQA/MHA; block sizes 16 and 32; large block ids.
    attention_case(
        c,
        (32, 8, 128),
        16,
        2048,
        &[(1327, 1), (0, 131), (463, 129), (36, 1), (0, 7)],
    );
    attention_case(
        c,
        (8, 2, 64),
        32,
        32768,
        &[(2011, 1), (17, 33), (0, 1000), (523, 1)],
    );
    attention_case(
        c,
        (4, 1, 24),
        16,
        2048,
        &[(0, 33), (5, 18), (1, 1), (129, 77)],
    );
    attention_case(c, (4, 4, 12), 16, 512, &[(0, 7), (100, 1), (31, 2)]);
    attention_case(c, (4, 2, 8), 32, 512, &[(0, 131), (65, 1), (66, 1)]);
    attention_case(
        c,
        (8, 2, 128),
        16,
        4096,
        &[(16_000, 1), (9000, 1), (0, 1), (3000, 5)],
    );
    let rope = |rotary: usize, scaling: f32, theta: f32| Rope {
        inv_freq: (0..rotary / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / rotary as f32))
            .collect(),
        rotary_dim: rotary,
        attention_scaling: scaling,
    };
    let mixed = [(1327, 1), (0, 131), (463, 129), (36, 1)];
    attention_rope_case(
        c,
        (32, 8, 128),
        16,
        2048,
        &mixed,
        Some(rope(128, 1.0, 500_000.0)),
        "",
    );
    attention_rope_case(
        c,
        (4, 2, 24),
        32,
        512,
        &[(0, 33), (70, 1)],
        Some(rope(12, 1.2, 10_000.0)),
        "",
    );
    if c.mode == DType::F32 {
        attention_case(c, (8, 2, 64), 16, 1024, &[(0, 4097)]);
    } else {
        attention_case(c, (32, 8, 128), 16, 1024, &[(0, 4097)]);
        attention_prefill_paths(c);
    }
}

/// d = 128 prefill tiles through every bf16 prefill kernel the device has built: Hopper's
/// wgmma ones (sm_90a) and the portable mma.sync one. Fresh prefills; chunks over cached prefixes
/// that end mid-block; GQA groups of 4, 3 (a CTA's 128 rows end mid-token), 8 and 1; lengths
/// that are not multiples of the 128-key tile; tiles whose rows leave a warpgroup partly or
/// wholly empty (44 tokens × 4 heads = 176 rows: the second CTA has 48); and a chunk over a
/// long context that the planner splits (partial outputs and the combine).
fn attention_prefill_paths(c: &mut Ctx<'_>) {
    let default = c.gpu.prefill_kernel();
    // ((heads, kv heads, head dim), block size, blocks, chunks (context, new tokens)).
    type Case = (
        (usize, usize, usize),
        usize,
        usize,
        &'static [(usize, usize)],
    );
    let cases: &[Case] = &[
        (
            (32, 8, 128),
            16,
            4096,
            &[(0, 300), (463, 200), (1327, 1), (5, 44)],
        ),
        ((24, 8, 128), 16, 1024, &[(0, 257), (100, 129)]),
        ((32, 4, 128), 32, 1024, &[(0, 190), (77, 64)]),
        ((8, 8, 128), 16, 1024, &[(0, 1000), (31, 500)]),
        ((8, 2, 128), 16, 2048, &[(20_000, 150)]),
    ];
    for want in PrefillKernel::ALL {
        if c.gpu.set_prefill_kernel(want) != want {
            continue; // not built on this GPU (the Hopper kernels: sm_90a only)
        }
        let note = format!(", {}", want.name());
        for &(shape, block_size, blocks, chunks) in cases {
            attention_rope_case(c, shape, block_size, blocks, chunks, None, &note);
        }
    }
    c.gpu.set_prefill_kernel(default);
}

/// The sampling tail: candidates must equal the CPU's bit for bit in f32 mode (ties, NaN,
/// infinities, penalties, token masks of constrained rows), log-sum-exp within rounding.
fn sampling(c: &mut Ctx<'_>) {
    let cases: &[(usize, usize, usize, &str)] = &[
        (1, 512, 64, "decode"),
        (5, 131_072, 64, "decode"),
        (64, 512, 512, "decode"),
        (3, 32_000, 1, "decode"),
        (8, 50_000, 200, "decode"),
        (4, 2048, 64, "prompt-logprob rows interleaved"),
        (64, 512, 512, "decode, token masks"),
        (5, 131_072, 64, "decode, token masks"),
        (8, 50_001, 200, "decode, token masks"),
    ];
    for &(n, vocab, k, kind) in cases {
        let label = format!("sample n={n} vocab={vocab} k={k} {kind}, ties/NaN/inf/penalties");
        let tag = c.tag();
        if let Err(e) = c.gpu.poison_arena() {
            c.report.failed("kernels", format!("{tag} {label}"), e);
            continue;
        }
        let masked = kind.ends_with("token masks");
        match sample_case(c, n, vocab, k, kind.starts_with("prompt"), masked) {
            Ok((exact, lse_err)) => {
                c.report.push(
                    "kernels",
                    format!("{tag} {label}: candidates identical"),
                    if exact { 1.0 } else { 0.0 },
                    if exact {
                        "identical".into()
                    } else {
                        "DIFFER".into()
                    },
                    "identical".into(),
                    exact,
                );
                c.report.err(
                    "kernels",
                    format!("{tag} {label}: log-sum-exp"),
                    lse_err,
                    1e-5,
                );
            }
            Err(e) => c.report.failed("kernels", format!("{tag} {label}"), e),
        }
    }
}

fn sample_case(
    c: &mut Ctx<'_>,
    n: usize,
    vocab: usize,
    k: usize,
    prompt_rows: bool,
    masked: bool,
) -> R<(bool, f64)> {
    let mut plan = StepPlan::new(16);
    let table: Vec<u32> = (0..8).collect();
    if prompt_rows {
        plan.push(&[1, 2, 3], 0, &table, 0, true).all_logits = true;
    }
    for i in 0..n {
        plan.push(&[(i % 100) as u32], 7, &table, 0, true);
    }
    plan.finish()?;
    let rows = plan.sample_rows.len();
    plan.sampling.clear(k);
    for r in 0..rows {
        let pen = match r % 3 {
            0 => Penalties {
                repetition: 1.0,
                presence: 0.0,
                frequency: 0.0,
            },
            1 => Penalties {
                repetition: 1.3,
                presence: 0.5,
                frequency: 0.25,
            },
            _ => Penalties {
                repetition: 0.8,
                presence: -0.5,
                frequency: 0.0,
            },
        };
        let prompt: Vec<u32> = (0..20).map(|_| c.rng.below(vocab) as u32).collect();
        let output: Vec<u32> = (0..15).map(|_| c.rng.below(vocab.min(64)) as u32).collect();
        plan.sampling.push_row(pen, r % 2 == 0, &prompt, &output);
        // Every fourth row carries a logit bias (some on history tokens, some not) and a
        // banned token, as `logit_bias` and `min_tokens` produce.
        if r % 4 == 1 {
            let mut bias: Vec<(u32, f32)> = (0..6)
                .map(|j| {
                    let t = if j % 2 == 0 {
                        output[j]
                    } else {
                        c.rng.below(vocab) as u32
                    };
                    (t, (c.rng.sym(8.0) * 4.0).round() / 4.0)
                })
                .collect();
            bias.sort_unstable_by_key(|b| b.0);
            bias.dedup_by_key(|b| b.0);
            let banned = [c.rng.below(vocab) as u32];
            plan.sampling.bias_last_row(&bias, &banned);
        }
        // Constrained rows: a sparse mask (a few percent of the tokens), a mask allowing one
        // token, and a mask allowing all but one word; every fourth row has none.
        if masked && r % 4 != 3 {
            let words = vocab.div_ceil(32);
            let mask = plan.sampling.mask_last_row(words);
            match r % 4 {
                0 => {
                    for w in mask.iter_mut() {
                        *w = (0..2).fold(0, |m, _| m | 1 << c.rng.below(32));
                    }
                }
                1 => mask[c.rng.below(vocab) / 32] |= 1,
                _ => {
                    mask.fill(u32::MAX);
                    mask[c.rng.below(words)] = 0;
                }
            }
            if !vocab.is_multiple_of(32) {
                mask[words - 1] &= (1u32 << (vocab % 32)) - 1;
                mask[0] |= 1;
            }
        }
    }
    let lrows = plan.logit_rows.len();
    // Logits on a coarse grid (many ties), with NaN, ±inf and a constant row mixed in.
    let mut logits: Vec<f32> = (0..lrows * vocab)
        .map(|_| (c.rng.sym(8.0) * 4.0).round() / 4.0)
        .collect();
    for r in 0..lrows {
        let row = &mut logits[r * vocab..(r + 1) * vocab];
        match r % 5 {
            1 => {
                for _ in 0..10 {
                    row[c.rng.below(vocab)] = f32::NAN;
                }
            }
            2 => {
                row[c.rng.below(vocab)] = f32::INFINITY;
                row[c.rng.below(vocab)] = f32::NEG_INFINITY;
            }
            3 => row.fill(0.5),
            _ => {}
        }
    }
    let (mut lc, mut lg) = c.up(&logits, &[lrows, vocab])?;
    let (sc, sg) = c.steps(&plan)?;
    let mut og = SampleOut::default();
    let mut oc = SampleOut::default();
    c.gpu.sample(&mut lg, &sg, &mut og)?;
    c.cpu.sample(&mut lc, &sc, &mut oc)?;
    let same_bits = |a: &[f32], b: &[f32]| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    };
    let exact = og.k == oc.k
        && og.cand_tokens == oc.cand_tokens
        && same_bits(&og.cand_logits, &oc.cand_logits);
    if !exact {
        let first = og
            .cand_tokens
            .iter()
            .zip(&oc.cand_tokens)
            .position(|(a, b)| a != b);
        eprintln!(
            "      sample mismatch: k {} vs {}, first differing candidate {first:?}",
            og.k, oc.k
        );
    }
    let lse_err = og
        .lse
        .iter()
        .zip(&oc.lse)
        .map(|(a, b)| {
            if a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()) {
                0.0
            } else {
                f64::from((a - b).abs()) / f64::from(b.abs().max(1e-6))
            }
        })
        .fold(0.0, f64::max);
    Ok((exact, lse_err))
}
