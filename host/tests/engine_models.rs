//! The engine with real models: continuous batching, chunked prefill, prefix caching (KV and
//! SSM snapshots) and eviction pressure must never change what a request generates.
//!
//! Every request's greedy output is compared with the model-level reference
//! (`model::greedy_generate`, one sequence, private caches), for tiny fixture models of every
//! architecture (`tests/fixtures/models/`).

use std::path::{Path, PathBuf};

use chimera::backend::StepPlan;
use chimera::backend::cpu::CpuBackend;
use chimera::cache::KvCacheDtype;
use chimera::cache::config::{ByteSize, CacheConfig, CacheLayout};
use chimera::engine::api::{
    EngineEvent, FailureKind, FinishReason, GenerateRequest, MissReason, SamplingParams, Usage,
};
use chimera::engine::speculative::SpeculativeConfig;
use chimera::engine::{Engine, EngineConfig, EngineSetup, ModelRunner, Policies};
use chimera::model::{self, CacheDtypes, LogitsMode, Model};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

const MODELS: &[&str] = &[
    "llama-gqa",
    "mamba2-g2",
    "nemotronh-a",
    "bamba-b",
    // Wave 2: Granite 4.0 (MoE) and Falcon-H1 (Mamba2 ‖ attention).
    "granite-moe",
    "falconh1-b",
    // Gated DeltaNet hybrids: Qwen3-Next with MoE; Qwen3.5 dense in the multimodal layout
    // (bf16) and Qwen3.5 MoE.
    "qwen3next-a",
    "qwen35-vl-b",
    "qwen35moe-a",
];

fn model_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

fn load(name: &str) -> Model<CpuBackend> {
    model::load(&model_dir(name), &CpuBackend::default()).expect("fixture model")
}

/// Deterministic pseudo-random prompt tokens in the fixtures' non-special range.
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            5 + (s % 500) as u32
        })
        .collect()
}

#[derive(Clone)]
struct Setup {
    prefix_caching: bool,
    chunked: bool,
    max_batched_tokens: usize,
    budget: u64,
    speculative: SpeculativeConfig,
    kv_dtype: KvCacheDtype,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            prefix_caching: true,
            chunked: true,
            max_batched_tokens: 2048,
            budget: 64 << 20,
            speculative: SpeculativeConfig::default(),
            kv_dtype: KvCacheDtype::Auto,
        }
    }
}

fn engine(m: Model<CpuBackend>, s: &Setup) -> Engine<ModelRunner<CpuBackend>> {
    let setup = EngineSetup {
        engine: EngineConfig {
            max_batched_tokens: s.max_batched_tokens,
            max_running: 8,
            chunked_prefill: s.chunked,
            ..EngineConfig::default()
        },
        cache: CacheConfig {
            memory_budget: Some(ByteSize(s.budget)),
            block_size: 16,
            prefix_caching: s.prefix_caching,
            kv_dtype: s.kv_dtype,
            ..CacheConfig::default()
        },
        hash_salt: "test".into(),
        speculative: s.speculative.clone(),
    };
    Engine::new(
        setup,
        ModelRunner::new(CpuBackend::default(), m),
        Policies::builtin(),
    )
    .expect("engine")
}

struct Outcome {
    tokens: Vec<u32>,
    usage: Usage,
    reason: FinishReason,
}

fn submit(
    e: &mut Engine<ModelRunner<CpuBackend>>,
    id: u64,
    prompt: &[u32],
    max_tokens: u32,
) -> UnboundedReceiver<EngineEvent> {
    let (tx, rx) = unbounded_channel();
    e.add(GenerateRequest::greedy(id, prompt.to_vec(), max_tokens), tx);
    rx
}

fn collect(rx: &mut UnboundedReceiver<EngineEvent>) -> Option<Outcome> {
    let mut tokens = Vec::new();
    while let Ok(ev) = rx.try_recv() {
        match ev {
            EngineEvent::Tokens { tokens: t, .. } => tokens.extend(t),
            EngineEvent::Finished { reason, usage } => {
                return Some(Outcome {
                    tokens,
                    usage,
                    reason,
                });
            }
            EngineEvent::Failed { kind, message } => panic!("request failed: {kind}: {message}"),
            EngineEvent::PromptLogprobs { .. } => {}
        }
    }
    None
}

/// Runs the engine until it is idle and returns each request's outcome.
fn run_all(
    e: &mut Engine<ModelRunner<CpuBackend>>,
    mut rxs: Vec<UnboundedReceiver<EngineEvent>>,
) -> Vec<Outcome> {
    let mut steps = 0;
    while e.step() {
        steps += 1;
        assert!(steps < 10_000, "engine did not finish");
    }
    rxs.iter_mut()
        .map(|rx| {
            let mut all = Vec::new();
            let mut last = None;
            while let Some(o) = collect(rx) {
                all.extend(o.tokens.clone());
                last = Some(o);
            }
            let mut o = last.expect("request finished");
            o.tokens = all;
            o
        })
        .collect()
}

fn reference(m: &Model<CpuBackend>, prompt: &[u32], n: usize) -> Vec<u32> {
    model::greedy_generate(m, &CpuBackend::default(), prompt, n, &[], 512).expect("reference")
}

#[test]
fn outputs_do_not_depend_on_batching_or_caching() {
    let variants = [
        ("default", Setup::default()),
        (
            "no prefix caching",
            Setup {
                prefix_caching: false,
                ..Setup::default()
            },
        ),
        (
            "no chunked prefill",
            Setup {
                chunked: false,
                ..Setup::default()
            },
        ),
        (
            "token budget 40",
            Setup {
                max_batched_tokens: 40,
                ..Setup::default()
            },
        ),
        // A pool of a few blocks: requests pause, get evicted and recompute.
        (
            "eviction pressure",
            Setup {
                budget: 0,
                max_batched_tokens: 40,
                ..Setup::default()
            },
        ),
    ];
    for name in MODELS {
        let m = load(name);
        // Requests sharing prefixes, of different lengths, in one batch.
        let base = tokens(7, 70);
        let mut prompts: Vec<Vec<u32>> = vec![base.clone(), tokens(8, 5), tokens(9, 33)];
        prompts.push([&base[..48], &tokens(10, 20)[..]].concat());
        prompts.push([&base[..], &tokens(11, 9)[..]].concat());
        let want: Vec<Vec<u32>> = prompts.iter().map(|p| reference(&m, p, 12)).collect();
        for (label, setup) in &variants {
            let mut setup = setup.clone();
            if setup.budget == 0 {
                setup.budget = tight_budget(&m, 9);
            }
            let mut e = engine(load(name), &setup);
            let rxs = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| submit(&mut e, i as u64, p, 12))
                .collect();
            let got = run_all(&mut e, rxs);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(&g.tokens, w, "{name} [{label}] request {i}");
                assert_eq!(g.reason, FinishReason::Length);
            }
            let stats = e.stats();
            assert_eq!(stats.running, 0, "{name} [{label}]");

            assert_eq!(
                e.cache().pool().available(),
                e.cache().total_blocks(),
                "{name} [{label}]: blocks still held after every request finished"
            );
            e.cache().check_invariants().expect("cache invariants");
        }
    }
}

/// `cache.kv_dtype = "fp8_e4m3"` on every fixture with attention layers: the engine's greedy
/// output is the FP8-cache reference's whatever the batching, chunking, prefix caching or
/// eviction (a cached block holds the same rounded values as a recomputed one), and the FP8
/// cache is not a no-op (some fixture's output differs from the f32 cache's).
#[test]
fn an_fp8_kv_cache_gives_its_reference_output_under_batching_and_caching() {
    let variants = [
        ("default", Setup::default()),
        (
            "no prefix caching, token budget 40",
            Setup {
                prefix_caching: false,
                max_batched_tokens: 40,
                ..Setup::default()
            },
        ),
        (
            "eviction pressure",
            Setup {
                budget: 0,
                max_batched_tokens: 40,
                ..Setup::default()
            },
        ),
    ];
    let mut moved = 0;
    for name in MODELS {
        let m = load(name);
        if m.info.cache.attn_layers == 0 {
            continue;
        }
        let base = tokens(17, 70);
        let prompts: Vec<Vec<u32>> = vec![
            base.clone(),
            tokens(18, 9),
            [&base[..48], &tokens(19, 20)[..]].concat(),
        ];
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let dtypes = CacheDtypes {
                    kv: KvCacheDtype::Fp8E4M3,
                    ..Default::default()
                };
                let b = CpuBackend::default();
                model::greedy_generate_cached(&m, &b, p, (12, &[]), usize::MAX, dtypes).unwrap()
            })
            .collect();
        moved += prompts
            .iter()
            .zip(&want)
            .filter(|(p, w)| reference(&m, p, 12) != **w)
            .count();
        for (label, setup) in &variants {
            let mut setup = Setup {
                kv_dtype: KvCacheDtype::Fp8E4M3,
                ..setup.clone()
            };
            if setup.budget == 0 {
                setup.budget = tight_budget_with(&m, 9, KvCacheDtype::Fp8E4M3);
            }
            let mut e = engine(load(name), &setup);
            let rxs = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| submit(&mut e, i as u64, p, 12))
                .collect();
            let got = run_all(&mut e, rxs);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(&g.tokens, w, "{name} [{label}] request {i}");
            }
            assert_eq!(
                e.cache().pool().available(),
                e.cache().total_blocks(),
                "{name} [{label}]"
            );
        }
    }
    assert!(moved > 0, "no fixture's output moved with an FP8 KV cache");
}

/// Prompt-lookup speculation on every fixture: the greedy output is the model-level reference
/// token for token, with prefix caching, chunked prefill, a tight token budget and eviction
/// pressure, and a follow-up turn served from the cache; drafts are accepted on the way.
#[test]
fn ngram_speculation_keeps_every_fixtures_greedy_output() {
    let spec = SpeculativeConfig {
        method: "ngram".into(),
        num_tokens: 4,
        max_batch: 8,
        prompt_lookup_min: 1,
        prompt_lookup_max: 3,
        ..Default::default()
    };
    let variants = [
        ("default", Setup::default()),
        (
            "no prefix caching, no chunking",
            Setup {
                prefix_caching: false,
                chunked: false,
                ..Setup::default()
            },
        ),
        (
            "token budget 24",
            Setup {
                max_batched_tokens: 24,
                ..Setup::default()
            },
        ),
        (
            "eviction pressure",
            Setup {
                budget: 0,
                max_batched_tokens: 40,
                ..Setup::default()
            },
        ),
    ];
    let mut report = Vec::new();
    for name in MODELS {
        let m = load(name);
        // Repetitive prompts give the lookup something to find; tiny random models also
        // repeat themselves.
        let unit = tokens(21, 7);
        let rep: Vec<u32> = unit.iter().cycle().take(40).copied().collect();
        let prompts: Vec<Vec<u32>> = vec![
            rep.clone(),
            tokens(8, 5),
            [&tokens(9, 20)[..], &rep[..19]].concat(),
        ];
        let n = 24;
        let want: Vec<Vec<u32>> = prompts.iter().map(|p| reference(&m, p, n)).collect();
        let (mut drafted, mut accepted) = (0, 0);
        for (label, setup) in &variants {
            let mut setup = Setup {
                speculative: spec.clone(),
                ..setup.clone()
            };
            if setup.budget == 0 {
                let draft = spec.draft_slots(8) as u64;
                let slot = m.info.cache.ssm_slot_bytes() as u64;
                setup.budget = tight_budget(&m, 9)
                    + if m.info.cache.is_hybrid() {
                        draft * slot
                    } else {
                        0
                    };
            }
            let mut e = engine(load(name), &setup);
            let rxs = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| submit(&mut e, i as u64, p, n as u32))
                .collect();
            let got = run_all(&mut e, rxs);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(&g.tokens, w, "{name} [{label}] request {i}");
            }
            // The next turn: the first conversation continued, its prefix from the cache.
            let turn: Vec<u32> = [&prompts[0][..], &want[0][..], &tokens(30, 6)[..]].concat();
            let want_turn = reference(&m, &turn, n);
            let rx = submit(&mut e, 9, &turn, n as u32);
            let got = run_all(&mut e, vec![rx]);
            assert_eq!(got[0].tokens, want_turn, "{name} [{label}] second turn");
            if setup.prefix_caching && label == &"default" {
                assert!(
                    got[0].usage.cached_tokens > 0,
                    "{name}: the second turn missed the cache"
                );
            }
            let st = e.stats();
            drafted += st.spec_draft_tokens;
            accepted += st.spec_accepted_tokens;
            assert_eq!(
                e.cache().pool().available(),
                e.cache().total_blocks(),
                "{name} [{label}]"
            );
            e.cache().check_invariants().expect("cache invariants");
        }
        assert!(drafted > 0, "{name}: nothing drafted");
        report.push(format!("{name}: {accepted}/{drafted}"));
    }
    eprintln!("accepted/drafted: {}", report.join(", "));
}

/// Draft-model speculation: a draft engine over a second fixture of the same vocabulary
/// proposes the drafts. Every greedy output is the model-level reference; a draft model that
/// is the target itself gets nearly every draft accepted.
#[test]
fn draft_model_speculation_keeps_the_greedy_output() {
    use chimera::engine::speculative::{DraftModelDrafter, draft_setup};
    let pairs = [
        ("llama-gqa", "llama-gqa"),
        ("nemotronh-a", "nemotronh-a"),
        ("qwen35-vl-b", "qwen35-vl-b"),
        ("bamba-b", "mamba2-g2"),
        ("qwen3next-a", "llama-gqa"),
    ];
    let prompts: Vec<Vec<u32>> = vec![tokens(8, 5), tokens(9, 33), tokens(12, 70)];
    let n = 20;
    for (target, draft) in pairs {
        let m = load(target);
        let want: Vec<Vec<u32>> = prompts.iter().map(|p| reference(&m, p, n)).collect();
        let spec = SpeculativeConfig {
            method: "draft_model".into(),
            num_tokens: 4,
            max_batch: 8,
            draft_model: draft.into(),
            ..SpeculativeConfig::default()
        };
        let draft_engine = Engine::new(
            draft_setup(ByteSize(32 << 20), 16, 8),
            ModelRunner::new(CpuBackend::default(), load(draft)),
            Policies::builtin(),
        )
        .expect("draft engine");
        let setup = EngineSetup {
            engine: EngineConfig {
                max_batched_tokens: 256,
                max_running: 8,
                ..EngineConfig::default()
            },
            cache: CacheConfig {
                memory_budget: Some(ByteSize(64 << 20)),
                block_size: 16,
                prefix_caching: true,
                ..CacheConfig::default()
            },
            hash_salt: "test".into(),
            speculative: spec,
        };
        let policies = Policies {
            drafter: Some(Box::new(DraftModelDrafter::new(draft_engine))),
            ..Policies::builtin()
        };
        let mut e = Engine::new(setup, ModelRunner::new(CpuBackend::default(), m), policies)
            .expect("engine");
        let rxs = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| submit(&mut e, i as u64, p, n as u32))
            .collect();
        let got = run_all(&mut e, rxs);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(&g.tokens, w, "{target} drafted by {draft}: request {i}");
        }
        let st = e.stats();
        assert!(
            st.spec_draft_tokens > 0,
            "{target}/{draft}: nothing drafted"
        );
        if target == draft {
            assert!(
                st.spec_accepted_tokens * 10 >= st.spec_draft_tokens * 9,
                "{target} drafting for itself: {} of {} accepted",
                st.spec_accepted_tokens,
                st.spec_draft_tokens
            );
        }
        assert_eq!(e.cache().pool().available(), e.cache().total_blocks());
    }
}

/// The smallest memory budget whose planned layout has exactly `blocks` KV blocks.
fn tight_budget(m: &Model<CpuBackend>, blocks: usize) -> u64 {
    tight_budget_with(m, blocks, KvCacheDtype::Auto)
}

/// [`tight_budget`] with K and V stored as `kv_dtype`.
fn tight_budget_with(m: &Model<CpuBackend>, blocks: usize, kv_dtype: KvCacheDtype) -> u64 {
    let kv = m
        .info
        .cache
        .with_kv_dtype(kv_dtype)
        .kv_block_bytes(16)
        .max(1) as u64;
    let mut budget = kv * blocks as u64;
    loop {
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(budget)),
            block_size: 16,
            kv_dtype,
            ..CacheConfig::default()
        };
        if let Ok(l) = CacheLayout::plan(&cfg, &m.info.cache, 8) {
            assert!(
                l.num_blocks <= blocks,
                "no budget gives exactly {blocks} blocks"
            );
            if l.num_blocks == blocks {
                return budget;
            }
        }
        budget += kv / 8 + 1;
    }
}

#[test]
fn requests_that_all_need_a_block_are_evicted_and_recomputed() {
    for name in ["llama-gqa", "bamba-b", "qwen3next-b"] {
        let m = load(name);
        // Three 48-token prompts fill 9 blocks exactly; their first decode token needs a
        // tenth block, so every request pauses and the newest is evicted to the queue.
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| tokens(40 + i, 48)).collect();
        let setup = Setup {
            budget: tight_budget(&m, 9),
            ..Setup::default()
        };
        let mut e = engine(load(name), &setup);
        assert_eq!(
            e.cache().total_blocks(),
            9,
            "{name}: test assumes a 9-block pool"
        );
        let rxs = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| submit(&mut e, i as u64, p, 12))
            .collect();
        let got = run_all(&mut e, rxs);
        for (i, (g, p)) in got.iter().zip(&prompts).enumerate() {
            assert_eq!(g.tokens, reference(&m, p, 12), "{name} request {i}");
        }
        assert!(e.stats().preemptions > 0, "{name}: no request was evicted");
        assert_eq!(e.cache().pool().available(), 9, "{name}: blocks leaked");
        e.cache().check_invariants().expect("cache invariants");
    }
}

#[test]
fn staged_shared_prefixes_skip_exactly_the_cached_blocks() {
    for name in MODELS {
        let m = load(name);
        let hybrid = m.info.cache.is_hybrid();
        let x = tokens(21, 131);
        let a = x.clone();
        // Extends A: reuses A's 8 full blocks (A snapshotted its last boundary, 128).
        let b = [&x[..], &tokens(22, 20)[..]].concat();
        // Diverges from A after 3 blocks. Attention-only: reuses 48 tokens. Hybrid: A has no
        // snapshot at 48, so nothing is reused, but C snapshots at its divergence point...
        let c = [&x[..48], &tokens(23, 30)[..]].concat();
        // ...so D, diverging at the same point, restores there.
        let d = [&x[..48], &tokens(24, 30)[..]].concat();
        let expected_cached = [0, 128, if hybrid { 0 } else { 48 }, 48];
        let mut e = engine(load(name), &Setup::default());
        for (i, (p, want_cached)) in [a, b, c, d].iter().zip(expected_cached).enumerate() {
            let rx = submit(&mut e, i as u64, p, 8);
            let before = e.stats().ssm_restores;
            let out = run_all(&mut e, vec![rx]).pop().expect("outcome");
            assert_eq!(out.tokens, reference(&m, p, 8), "{name} request {i}");
            assert_eq!(
                out.usage.cached_tokens, want_cached,
                "{name} request {i}: cached tokens"
            );
            let restored = e.stats().ssm_restores - before;
            let want_restores = u64::from(hybrid && want_cached > 0);
            assert_eq!(restored, want_restores, "{name} request {i}: SSM restores");
        }
    }
}

#[test]
fn evicting_a_prefix_drops_kv_and_snapshot_then_recomputes_correctly() {
    for name in MODELS {
        let m = load(name);
        let x = tokens(31, 64);
        let mut e = engine(load(name), &Setup::default());
        let rx = submit(&mut e, 1, &x, 6);
        let first = run_all(&mut e, vec![rx]).pop().expect("first");
        let cached_blocks = e.stats().cached_blocks;
        assert!(
            cached_blocks > 0,
            "{name}: nothing cached after the first request"
        );
        // Dropping the cache removes every block and snapshot...
        e.reset_prefix_cache();
        assert_eq!(e.stats().cached_blocks, 0, "{name}");
        assert_eq!(
            e.cache().ssm().durable_used(),
            0,
            "{name}: snapshots survived"
        );
        // ...and the same prompt is recomputed from scratch, with the same output.
        let rx = submit(&mut e, 2, &x, 6);
        let again = run_all(&mut e, vec![rx]).pop().expect("again");
        assert_eq!(again.usage.cached_tokens, 0, "{name}");
        assert_eq!(again.tokens, first.tokens, "{name}");
        assert_eq!(again.tokens, reference(&m, &x, 6), "{name}");
    }
}

/// Logprob of each prompt token given the ones before it, from one full forward pass.
fn reference_prompt_logprobs(m: &Model<CpuBackend>, prompt: &[u32]) -> Vec<f32> {
    let blocks = prompt.len().div_ceil(16);
    let mut caches = m
        .new_caches(&CpuBackend::default(), blocks, 16, 1)
        .expect("caches");
    let mut batch = StepPlan::new(16);
    batch.push(
        prompt,
        0,
        &(0..blocks as u32).collect::<Vec<u32>>(),
        0,
        true,
    );
    let logits = m
        .forward_host(
            &CpuBackend::default(),
            &mut batch,
            &mut caches,
            LogitsMode::All,
        )
        .expect("forward");
    let vocab = m.info.vocab_size;
    (1..prompt.len())
        .map(|p| {
            let row = &logits[(p - 1) * vocab..p * vocab];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
            row[prompt[p] as usize] - lse
        })
        .collect()
}

#[test]
fn prompt_logprobs_match_the_full_forward_pass_despite_chunks_and_cache() {
    for name in MODELS {
        let m = load(name);
        let reference_model = load(name);
        let prompt = tokens(41, 75);
        let want = reference_prompt_logprobs(&reference_model, &prompt);
        // Small chunks, and the same prompt already in the prefix cache: prompt logprobs
        // must still come from computing every position.
        let setup = Setup {
            max_batched_tokens: 24,
            ..Setup::default()
        };
        let mut e = engine(m, &setup);
        let warm = submit(&mut e, 1, &prompt, 2);
        let _ = run_all(&mut e, vec![warm]);
        let (tx, mut rx) = unbounded_channel();
        e.add(
            GenerateRequest {
                id: 2,
                prompt: prompt.clone(),
                params: SamplingParams {
                    logprobs: Some(3),
                    ..SamplingParams::default()
                },
                max_tokens: 4,
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                prompt_logprobs: Some(3),
                block_hashes: None,
                checkpoints: Vec::new(),
                priority: 0,
                constraint: None,
                speculative: true,
            },
            tx,
        );
        // A plain request in the same batches, whose rows sit between the prompt rows.
        let other = submit(&mut e, 3, &tokens(43, 50), 6);
        let outcomes_other = run_all(&mut e, vec![other]);
        assert_eq!(
            outcomes_other[0].tokens,
            reference(&reference_model, &tokens(43, 50), 6),
            "{name}: the neighbour's output"
        );
        let mut events = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            events.push(ev);
        }
        let Some(EngineEvent::PromptLogprobs { logprobs }) = events.first() else {
            panic!(
                "{name}: first event is not PromptLogprobs: {:?}",
                events.first()
            );
        };
        assert_eq!(logprobs.len(), prompt.len());
        assert!(logprobs[0].is_none(), "the first token has no logprob");
        for (p, lp) in logprobs.iter().enumerate().skip(1) {
            let lp = lp.as_ref().expect("every later prompt token is scored");
            assert_eq!(lp.token, prompt[p]);
            assert!(
                (lp.logprob - want[p - 1]).abs() < 1e-4,
                "{name} position {p}: {} vs {}",
                lp.logprob,
                want[p - 1]
            );
            assert_eq!(lp.top.len(), 3);
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
            assert!(lp.top[0].1 >= lp.logprob - 1e-6);
        }
        let generated: Vec<u32> = events
            .iter()
            .filter_map(|ev| match ev {
                EngineEvent::Tokens { tokens, .. } => Some(tokens.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(generated, reference(&reference_model, &prompt, 4), "{name}");
        let Some(EngineEvent::Finished { usage, .. }) = events.last() else {
            panic!("{name}: not finished");
        };
        assert_eq!(usage.cached_tokens, 0, "{name}: nothing may be skipped");
        assert_eq!(
            usage.cache_miss,
            Some(MissReason::PromptLogprobs),
            "{name}: the miss says why"
        );
    }
}

/// The device-step contract on every architecture, through the real engine: each step that
/// runs a batch uploads its plan exactly once and reads exactly one thing back (the sampling
/// candidates) — no per-layer host reads — and once the largest step shapes have run, the
/// backend's step arena stops growing. The steps mix prefill chunks over a cached prefix,
/// decodes, SSM snapshots and restores.
#[test]
fn each_step_uploads_once_and_reads_once() {
    use chimera::backend::StepBackend;
    use chimera::backend::counting::Counting;

    for name in MODELS {
        let backend = Counting::new(CpuBackend::default());
        let traffic = backend.traffic.clone();
        let m = model::load(&model_dir(name), &backend).expect("fixture model");
        let s = Setup {
            max_batched_tokens: 40,
            ..Setup::default()
        };
        let setup = EngineSetup {
            engine: EngineConfig {
                max_batched_tokens: s.max_batched_tokens,
                max_running: 8,
                ..EngineConfig::default()
            },
            cache: CacheConfig {
                memory_budget: Some(ByteSize(s.budget)),
                block_size: 16,
                ..CacheConfig::default()
            },
            hash_salt: "test".into(),
            speculative: Default::default(),
        };
        let mut e = Engine::new(
            setup,
            ModelRunner::new(backend.clone(), m),
            Policies::builtin(),
        )
        .expect("engine");
        let base = tokens(3, 50);
        let prompts = |seed: u64| -> Vec<Vec<u32>> {
            (0..4)
                .map(|i| [&base[..], &tokens(seed + i, 9 + 7 * i as usize)[..]].concat())
                .collect()
        };
        let mut steps = 0;
        let mut round =
            |e: &mut Engine<ModelRunner<Counting<CpuBackend>>>, first_id: u64, ps: &[Vec<u32>]| {
                let mut rxs = Vec::new();
                for (i, p) in ps.iter().enumerate() {
                    let (tx, rx) = unbounded_channel();
                    rxs.push(rx);
                    e.add(
                        GenerateRequest {
                            id: first_id + i as u64,
                            prompt: p.clone(),
                            params: SamplingParams::default(),
                            max_tokens: 5,
                            stop_token_ids: Vec::new(),
                            ignore_eos: true,
                            prompt_logprobs: None,
                            block_hashes: None,
                            checkpoints: Vec::new(),
                            priority: 0,
                            constraint: None,
                            speculative: true,
                        },
                        tx,
                    );
                }
                let start = traffic.counts();
                let applied = e.timings().steps;
                loop {
                    let before = traffic.counts();
                    if !e.step() {
                        break;
                    }
                    let after = traffic.counts();
                    // A call applies one step; it launches it first when none computes, and
                    // the step scheduled ahead after it.
                    assert!(
                        (0..=2).contains(&(after.step_uploads - before.step_uploads)),
                        "{name}: uploads"
                    );
                    assert!(
                        (0..=2).contains(&(after.candidate_reads - before.candidate_reads)),
                        "{name}: reads"
                    );
                    assert_eq!(after.downloads, before.downloads, "{name}: host reads");
                    assert_eq!(after.uploads, before.uploads, "{name}: weight uploads");
                    assert!(
                        after.kernels > before.kernels || after.step_uploads == before.step_uploads,
                        "{name}: a launched step ran kernels"
                    );
                    steps += 1;
                }
                let end = traffic.counts();
                assert_eq!(
                    end.step_uploads - start.step_uploads,
                    end.candidate_reads - start.candidate_reads,
                    "{name}: every step uploaded once is read back once"
                );
                assert_eq!(
                    end.step_uploads - start.step_uploads,
                    e.timings().steps - applied,
                    "{name}: one upload a step"
                );
                for rx in &mut rxs {
                    let o = collect(rx).expect("finished");
                    assert_eq!(
                        (o.reason, o.tokens.len()),
                        (FinishReason::Length, 5),
                        "{name}"
                    );
                }
            };
        // Warm-up: the largest shapes (full 40-token chunks, the widest decode batch).
        round(&mut e, 0, &prompts(100));
        let warm = backend.arena_stats();
        assert!(warm.grown > 0, "{name}: the arena was used");
        // The same shapes with other tokens, then the first prompts again (prefix hits, and
        // SSM restores on the hybrids): no growth.
        round(&mut e, 10, &prompts(200));
        round(&mut e, 20, &prompts(100));
        assert_eq!(
            backend.arena_stats(),
            warm,
            "{name}: the arena grew after warm-up"
        );
        assert!(steps > 20, "{name}: {steps} steps");
        let stats = e.stats();
        assert!(stats.prefix_cache_hits > 0, "{name}: prefix hits");
        if *name != "llama-gqa" {
            assert!(stats.ssm_restores > 0, "{name}: SSM restores");
        }
    }
}

/// Step temporaries are recycled without zeroing where the kernel writes every element: with
/// every free buffer poisoned with NaN, a pass over a mixed batch gives bit-identical logits
/// on all four architectures.
#[test]
fn recycled_temporaries_are_fully_written() {
    for name in MODELS {
        let backend = CpuBackend::default();
        let m = model::load(&model_dir(name), &backend).expect("fixture model");
        let run = |backend: &CpuBackend| {
            let mut caches = m.new_caches(backend, 16, 16, 3).expect("caches");
            let mut plan = StepPlan::new(16);
            plan.push(&tokens(1, 37), 0, &[0, 1, 2], 0, true);
            plan.snapshot(32, 2);
            plan.push(&tokens(2, 5), 0, &[3], 1, true);
            m.forward_host(backend, &mut plan, &mut caches, LogitsMode::All)
                .expect("forward")
        };
        let clean = run(&backend);
        backend.poison_arena();
        let again = run(&backend);
        assert!(again.iter().all(|x| x.is_finite()), "{name}: NaN leaked");
        assert_eq!(
            clean.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            again.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{name}"
        );
    }
}

/// A three-turn conversation in token ids, each turn the previous prompt, the model's own reply
/// and a new message: from turn 2 on the cache serves everything up to at most one block
/// before where the previous turn ended (its output blocks were indexed, and on hybrids the
/// rolling snapshot became durable), the restores are counted, and every turn's output equals
/// a cold run's; with caching off the tokens are the same and nothing is served.
#[test]
fn multi_turn_conversation_is_served_from_cache_through_each_reply() {
    for name in MODELS {
        let m = load(name);
        let hybrid = m.info.cache.is_hybrid();
        for caching in [true, false] {
            let setup = Setup {
                prefix_caching: caching,
                ..Setup::default()
            };
            let mut e = engine(load(name), &setup);
            let mut prompt = tokens(61, 37);
            let mut ended_at = 0;
            let mut misses = 0;
            for turn in 0..3u64 {
                let restores = e.stats().ssm_restores;
                let rx = submit(&mut e, turn, &prompt, 20);
                let out = run_all(&mut e, vec![rx]).pop().expect("outcome");
                let label = format!("{name} caching {caching} turn {}", turn + 1);
                assert_eq!(out.tokens, reference(&m, &prompt, 20), "{label}: output");
                let u = out.usage;
                assert_eq!(u.cacheable_tokens as usize, (prompt.len() - 2) / 16 * 16);
                misses += u32::from(u.cache_miss.is_some());
                if !caching {
                    assert_eq!(u.cached_tokens, 0, "{label}");
                    assert_eq!(u.cache_miss, Some(MissReason::CachingOff), "{label}");
                } else if turn == 0 {
                    assert_eq!(u.cached_tokens, 0, "{label}");
                    assert_eq!(u.cache_miss, Some(MissReason::NoKvMatch), "{label}");
                } else {
                    // The previous turn computed all but its last sampled token.
                    let cached = u.cached_tokens as usize;
                    assert!(
                        cached + 16 >= ended_at && cached < ended_at,
                        "{label}: cached {cached}, previous turn ended at {ended_at}"
                    );
                    assert_eq!(cached % 16, 0, "{label}");
                    // Short of the cacheable prefix only where the new message starts:
                    // everything the cache held was served, so no miss is reported.
                    assert_eq!(u.cache_miss, None, "{label}");
                    let restored = e.stats().ssm_restores - restores;
                    assert_eq!(restored, u64::from(hybrid), "{label}: restores");
                }
                prompt.extend(&out.tokens);
                ended_at = prompt.len();
                prompt.extend(tokens(70 + turn, 9));
            }
            let s = e.stats();
            if caching && hybrid {
                assert!(s.ssm_rolling_copies > 0, "{name}: no rolling snapshot");
                assert!(
                    s.ssm_rolling_kept >= 2,
                    "{name}: rolling snapshots not kept"
                );
                assert!(s.ssm_snapshot_copies >= s.ssm_rolling_copies);
            } else {
                assert_eq!(s.ssm_rolling_copies, 0, "{name} caching {caching}");
            }
            assert!(misses >= 1, "{name}: the first turn misses");
            assert_eq!(
                s.cache_misses.iter().sum::<u64>(),
                u64::from(misses),
                "{name}: misses counted"
            );
            e.cache().check_invariants().expect("cache invariants");
            assert_eq!(e.cache().pool().available(), e.cache().total_blocks());
        }
    }
}

fn submit_checkpoints(
    e: &mut Engine<ModelRunner<CpuBackend>>,
    id: u64,
    prompt: &[u32],
    checkpoints: Vec<u32>,
) -> UnboundedReceiver<EngineEvent> {
    let (tx, rx) = unbounded_channel();
    e.add(
        GenerateRequest {
            id,
            prompt: prompt.to_vec(),
            params: SamplingParams::default(),
            max_tokens: 4,
            stop_token_ids: Vec::new(),
            ignore_eos: true,
            prompt_logprobs: None,
            block_hashes: None,
            checkpoints,
            priority: 0,
            constraint: None,
            speculative: true,
        },
        tx,
    );
    rx
}

/// A client checkpoint keeps the SSM state where the prompt's later requests diverge: without
/// it a hybrid cannot restore there (and says so), with it the next request restores exactly
/// at the checkpoint's block; offsets outside the prompt are refused.
#[test]
fn client_checkpoints_make_a_divergence_point_restorable() {
    for name in ["nemotronh-a", "bamba-b"] {
        let m = load(name);
        let x = tokens(81, 100);
        let follow = [&x[..53], &tokens(82, 20)[..]].concat();
        for with in [false, true] {
            let mut e = engine(load(name), &Setup::default());
            let marks = if with { vec![53, 100] } else { Vec::new() };
            let rx = submit_checkpoints(&mut e, 1, &x, marks);
            run_all(&mut e, vec![rx]);
            let rx = submit_checkpoints(&mut e, 2, &follow, Vec::new());
            let out = run_all(&mut e, vec![rx]).pop().expect("outcome");
            assert_eq!(out.tokens, reference(&m, &follow, 4), "{name} {with}");
            let s = e.stats();
            if with {
                assert_eq!(out.usage.cached_tokens, 48, "{name}");
                // Served through the checkpoint, then new tokens: no miss.
                assert_eq!(out.usage.cache_miss, None, "{name}");
                assert_eq!(s.checkpoints_requested, 2, "{name}");
                assert_eq!(s.ssm_checkpoint_copies, 1, "{name}: 96 was planned anyway");
            } else {
                assert_eq!(out.usage.cached_tokens, 0, "{name}");
                assert_eq!(out.usage.cache_miss, Some(MissReason::NoSnapshot), "{name}");
                assert_eq!(s.ssm_checkpoint_copies, 0, "{name}");
            }
        }
        let mut e = engine(load(name), &Setup::default());
        for bad in [0, 101] {
            let mut rx = submit_checkpoints(&mut e, 9, &x, vec![16, bad]);
            match rx.try_recv() {
                Ok(EngineEvent::Failed { kind, message }) => {
                    assert_eq!(kind, FailureKind::InvalidRequest);
                    assert!(message.contains(&format!("offset {bad}")), "{message}");
                }
                other => panic!("{name}: offset {bad} accepted: {other:?}"),
            }
        }
    }
}
