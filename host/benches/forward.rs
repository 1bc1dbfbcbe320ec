//! Forward-pass time of the tiny models on the CPU backend: one prefill of 128 tokens, one
//! decode step at batch 1 and at batch 32 (each sequence with 128 tokens of context).

use criterion::{Criterion, criterion_group, criterion_main};

use chimera::backend::StepPlan;
use chimera::backend::cpu::CpuBackend;
use chimera::model::{self, LogitsMode, Model, builtin};

const BLOCK: usize = 16;

fn models() -> Vec<(String, Model<CpuBackend>)> {
    let mut out = vec![(
        "builtin-tiny-hybrid".to_string(),
        builtin::load(&CpuBackend::default(), 512, 2, 1).expect("builtin"),
    )];
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models");
    for name in ["llama-gqa", "mamba2-g2", "nemotronh-a", "bamba-b"] {
        out.push((
            name.to_string(),
            model::load(&dir.join(name), &CpuBackend::default()).expect("fixture"),
        ));
    }
    out
}

fn bench(c: &mut Criterion) {
    for (name, m) in models() {
        let prompt: Vec<u32> = (0..128).map(|i| 5 + (i * 37) % 500).collect();
        let blocks = (prompt.len() + 1).div_ceil(BLOCK);
        c.bench_function(&format!("{name}/prefill-128"), |b| {
            let mut caches = m
                .new_caches(&CpuBackend::default(), blocks, BLOCK, 1)
                .expect("caches");
            let mut batch = StepPlan::new(BLOCK);
            batch.push(
                &prompt,
                0,
                &(0..blocks as u32).collect::<Vec<u32>>(),
                0,
                true,
            );
            b.iter(|| {
                m.forward_host(
                    &CpuBackend::default(),
                    &mut batch,
                    &mut caches,
                    LogitsMode::Last,
                )
                .expect("forward")
            })
        });
        for batch_size in [1usize, 32] {
            let mut caches = m
                .new_caches(
                    &CpuBackend::default(),
                    blocks * batch_size,
                    BLOCK,
                    batch_size,
                )
                .expect("caches");
            let mut prefill = StepPlan::new(BLOCK);
            let mut step = StepPlan::new(BLOCK);
            for s in 0..batch_size {
                let table: Vec<u32> = ((s * blocks) as u32..((s + 1) * blocks) as u32).collect();
                prefill.push(&prompt, 0, &table, s as u32, true);
                step.push(&[7], prompt.len(), &table, s as u32, true);
            }
            m.forward_host(
                &CpuBackend::default(),
                &mut prefill,
                &mut caches,
                LogitsMode::Last,
            )
            .expect("prefill");
            c.bench_function(&format!("{name}/decode-batch-{batch_size}"), |b| {
                b.iter(|| {
                    m.forward_host(
                        &CpuBackend::default(),
                        &mut step,
                        &mut caches,
                        LogitsMode::Last,
                    )
                    .expect("decode")
                })
            });
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
