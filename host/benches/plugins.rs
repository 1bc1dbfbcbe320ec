//! Per-call cost of the built-in Wasm plugins against their native twins, measured in one run.
//!
//! `cargo bench -p chimera --bench plugins` prints a table: median and p90 per call for each
//! policy through its Wasm adapter (marshalling, the deadline, validation and the adapter's
//! bookkeeping included) and through the native twin, and the ratio. Shapes: router over 8
//! replicas; sampler over 256 requests × 64 candidates; evictor over a full cache of 20k blocks,
//! asked for 8 victims per engine step, which then leave the cache (fed back as `Removed`
//! events, with as many new blocks and some hits: 64 events a step). The agreement of the two
//! builds is checked in tests/plugins.rs; this run exits non-zero if any plugin call fell back
//! to the native default, if a victim was not a cached block, or if the cache did not stay at
//! its size. An argument
//! (`cargo bench -p chimera --bench plugins -- sampler`) runs only the rows whose name
//! contains it.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use chimera::plugins::{PluginMetrics, PluginsConfig, PolicyConfig, PolicyPlugins};
use chimera::policy::native::{DefaultSampler, LeastLoadedRouter, LruEvictor, PrefixAwareRouter};
use chimera::policy::{
    CacheEvents, Decision, EventKind, Evictor, ReplicaColumns, RouteRequest, Router, Sampler,
    SamplerBatch,
};
use chimera_policy_core::rng::Rng;

/// Median and p90 of `runs` timings of `iters` calls each, in microseconds per call.
fn measure(runs: usize, iters: usize, mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..iters.min(100) {
        f();
    }
    let mut per_call: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() * 1e6 / iters as f64
        })
        .collect();
    per_call.sort_by(f64::total_cmp);
    (per_call[runs / 2], per_call[(runs * 9) / 10])
}

fn replicas(rng: &mut Rng, n: usize) -> ReplicaColumns {
    let mut c = ReplicaColumns::default();
    for _ in 0..n {
        let total = 4096;
        let free = rng.next_below(total);
        c.waiting.push(rng.next_below(16));
        c.running.push(rng.next_below(64));
        c.free_blocks.push(free);
        c.total_blocks.push(total);
        c.kv_usage.push(1.0 - free as f32 / total as f32);
        c.prefix_hit_blocks.push(rng.next_below(32));
        c.ssm_hit_blocks.push(0);
    }
    c
}

fn batch(rng: &mut Rng, n: usize, k: usize) -> SamplerBatch {
    let mut b = SamplerBatch {
        k: k as u32,
        ..SamplerBatch::default()
    };
    for i in 0..n {
        b.temperature.push(if i % 8 == 0 { 0.0 } else { 0.7 });
        b.top_k.push(if i % 3 == 0 { 40 } else { 0 });
        b.top_p.push(if i % 2 == 0 { 0.9 } else { 1.0 });
        b.min_p.push(if i % 5 == 0 { 0.05 } else { 0.0 });
        b.seed.push(i as u64);
        b.counter.push(0);
        let mut logit = 10.0f32;
        for j in 0..k {
            b.cand_tokens.push((i * 1000 + j) as u32);
            b.cand_logits.push(logit);
            logit -= rng.next_f32() * 0.5;
        }
    }
    b
}

/// A bounded cache: `capacity` blocks in chains of 16, all released; then per step, the
/// victims the evictor chose leave (`Removed`), as many new blocks are stored and released in
/// one chain, and random cached blocks are hit and released. The cache never grows, so the
/// evictor's view stays the size of a full cache of `capacity` blocks.
#[derive(Clone)]
struct CacheSim {
    next: u32,
    step: u64,
    /// Cached blocks, and where each sits in `live`.
    live: Vec<u32>,
    slot: HashMap<u32, usize>,
    /// Victims that were not cached blocks (the evictor's answer was wrong).
    unknown_victims: u64,
    /// Steps whose victim list was shorter than asked.
    short_steps: u64,
}

impl CacheSim {
    fn warm(capacity: u32) -> (Self, CacheEvents) {
        let mut ev = CacheEvents::default();
        let mut sim = Self {
            next: 0,
            step: 1,
            live: Vec::new(),
            slot: HashMap::new(),
            unknown_victims: 0,
            short_steps: 0,
        };
        while sim.next < capacity {
            sim.store_chain(&mut ev, 16);
            sim.step += 1;
        }
        (sim, ev)
    }

    fn store_chain(&mut self, ev: &mut CacheEvents, len: usize) {
        let mut parent = u32::MAX;
        for _ in 0..len {
            ev.push(EventKind::Stored, self.next, parent, self.step);
            ev.push(EventKind::Released, self.next, 0, self.step);
            self.slot.insert(self.next, self.live.len());
            self.live.push(self.next);
            parent = self.next;
            self.next += 1;
        }
    }

    fn remove(&mut self, block: u32) -> bool {
        let Some(i) = self.slot.remove(&block) else {
            return false;
        };
        self.live.swap_remove(i);
        if let Some(&moved) = self.live.get(i) {
            self.slot.insert(moved, i);
        }
        true
    }

    /// One engine step that needed `wanted` blocks and got `victims` evicted for them
    /// (`victims.len() + 2 × (victims.len() + hits)` events).
    fn step(
        &mut self,
        rng: &mut Rng,
        ev: &mut CacheEvents,
        wanted: u32,
        victims: &[u32],
        hits: u32,
    ) {
        ev.clear();
        self.step += 1;
        if victims.len() < wanted as usize {
            self.short_steps += 1;
        }
        for &v in victims {
            if self.remove(v) {
                ev.push(EventKind::Removed, v, 0, self.step);
            } else {
                self.unknown_victims += 1;
            }
        }
        self.store_chain(ev, victims.len());
        for _ in 0..hits {
            let b = self.live[rng.next_below(self.live.len() as u32) as usize];
            ev.push(EventKind::Hit, b, 0, self.step);
            ev.push(EventKind::Released, b, 0, self.step);
        }
    }

    /// What went wrong over the run, if anything.
    fn problems(&self, name: &str, capacity: u32) -> Vec<String> {
        let mut out = Vec::new();
        if self.unknown_victims > 0 {
            out.push(format!(
                "{name}: {} victims were not cached blocks",
                self.unknown_victims
            ));
        }
        if self.short_steps > 0 {
            out.push(format!(
                "{name}: {} steps got fewer victims than asked",
                self.short_steps
            ));
        }
        if self.live.len() != capacity as usize {
            out.push(format!(
                "{name}: the cache holds {} blocks, not {capacity}",
                self.live.len()
            ));
        }
        out
    }
}

/// The victims of a decision; the native order is not part of the measured policy, so
/// "use the default" counts as no victims (and fails the run).
fn victims_of(d: Decision<Vec<u32>>) -> Vec<u32> {
    match d {
        Decision::Use(v) => v,
        Decision::UseDefault => Vec::new(),
    }
}

fn row(name: &str, wasm: (f64, f64), native: (f64, f64), target: &str) {
    println!(
        "{name:<34} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>7.2}x   {target}",
        wasm.0,
        wasm.1,
        native.0,
        native.1,
        wasm.0 / native.0
    );
}

fn main() {
    // `cargo bench` passes `--bench`; the first other argument filters rows.
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_default();
    let wanted = |name: &str| name.contains(filter.as_str());
    let metrics = PluginMetrics::new();
    let policies = match PolicyPlugins::new(
        &PolicyConfig::default(),
        &PluginsConfig::default(),
        Arc::clone(&metrics),
    ) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("cannot load the built-in plugins: {e}");
            std::process::exit(1);
        }
    };
    let mut rng = Rng::new(2024, 0);
    // What makes the run fail, reported after the table.
    let mut problems: Vec<String> = Vec::new();
    println!(
        "{:<34} {:>10} {:>10} {:>10} {:>10} {:>8}   target",
        "call (µs per call)", "wasm p50", "wasm p90", "native p50", "native p90", "ratio"
    );

    // Router: prefix-aware (the default) and least-loaded over 8 replicas.
    let cols = replicas(&mut rng, 8);
    let req = RouteRequest {
        prompt_tokens: 512,
        prompt_blocks: 32,
        tenant: "bench".into(),
    };
    if wanted("router prefix-aware") {
        let mut wasm_router = policies.router();
        let mut native_router = PrefixAwareRouter::default();
        let w = measure(15, 20_000, || {
            black_box(wasm_router.route(black_box(&req), black_box(&cols)));
        });
        let n = measure(15, 20_000, || {
            black_box(native_router.route(black_box(&req), black_box(&cols)));
        });
        row("router prefix-aware, 8 replicas", w, n, "< 5 µs");
    }

    let mut ll_policy = PolicyConfig::default();
    ll_policy.router.plugin = "builtin:least-loaded".into();
    // The default router's keys (`alpha` …) are not least-loaded's.
    ll_policy.router.config.clear();
    let least_loaded = wanted("router least-loaded")
        .then(|| PolicyPlugins::new(&ll_policy, &PluginsConfig::default(), Arc::clone(&metrics)));
    if let Some(Err(e)) = &least_loaded {
        problems.push(format!("cannot load builtin:least-loaded: {e}"));
    }
    if let Some(Ok(p)) = least_loaded {
        let mut wasm_ll = p.router();
        let mut native_ll = LeastLoadedRouter;
        let w = measure(15, 20_000, || {
            black_box(wasm_ll.route(black_box(&req), black_box(&cols)));
        });
        let n = measure(15, 20_000, || {
            black_box(native_ll.route(black_box(&req), black_box(&cols)));
        });
        row("router least-loaded, 8 replicas", w, n, "< 5 µs");
    }

    // Sampler: 256 requests × 64 candidates.
    if wanted("sampler default") {
        let b = batch(&mut rng, 256, 64);
        let mut wasm_sampler = policies.sampler();
        let mut native_sampler = DefaultSampler::default();
        let w = measure(15, 200, || {
            black_box(wasm_sampler.sample(black_box(&b)));
        });
        let n = measure(15, 200, || {
            black_box(native_sampler.sample(black_box(&b)));
        });
        row("sampler default, 256 × 64", w, n, "< 150 µs/step");
    }

    // Evictor: a full cache of 20k blocks; per step the evictor chooses victims, they leave,
    // as many new blocks arrive, and random blocks are hit.
    const CAPACITY: u32 = 20_000;
    for (label, hits, victims) in [
        ("evictor lru, 64 events + choose 8", 20, 8),
        ("evictor lru, 16 events + choose 2", 5, 2),
    ] {
        if !wanted(label) {
            continue;
        }
        let (mut sim_w, warm) = CacheSim::warm(CAPACITY);
        let mut wasm_evictor = policies.evictor();
        let mut native_evictor = LruEvictor::new();
        wasm_evictor.on_events(&warm);
        native_evictor.on_events(&warm);
        let mut sim_n = sim_w.clone();
        let (mut rng_w, mut rng_n) = (Rng::new(7, 0), Rng::new(7, 0));
        let mut ev = CacheEvents::default();
        let w = measure(15, 500, || {
            let v = victims_of(wasm_evictor.choose_victims(victims, sim_w.step));
            sim_w.step(&mut rng_w, &mut ev, victims, &v, hits);
            wasm_evictor.on_events(&ev);
        });
        let n = measure(15, 500, || {
            let v = victims_of(native_evictor.choose_victims(victims, sim_n.step));
            sim_n.step(&mut rng_n, &mut ev, victims, &v, hits);
            native_evictor.on_events(&ev);
        });
        row(label, w, n, "< 20 µs/step");
        problems.extend(sim_w.problems(&format!("{label} (wasm)"), CAPACITY));
        problems.extend(sim_n.problems(&format!("{label} (native)"), CAPACITY));
    }

    let fallbacks: u64 = metrics.fallback_samples().iter().map(|s| s.value).sum();
    println!("fallbacks during the run: {fallbacks}");
    if fallbacks != 0 {
        problems.push(format!(
            "{fallbacks} plugin calls fell back to the native default"
        ));
    }
    if !problems.is_empty() {
        for p in &problems {
            eprintln!("error: {p}");
        }
        std::process::exit(1);
    }
}
