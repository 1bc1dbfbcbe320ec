//! MTP-head speculation (`speculative.method = "mtp"`) on the Gated DeltaNet fixtures that
//! carry a head (`tests/fixtures/models/*-mtp`, made by `tests/parity/make_mtp_fixtures.py`).
//!
//! The head's drafts are compared with its float64 NumPy reference (`mtp-reference.json`):
//! every proposal the scheduler received, at whatever token count the request had reached,
//! is the reference chain at that count. That holds only if the MTP pass wrote the head's K/V
//! for every position with the right next token — through chunked prefill, verify steps that
//! rejected drafts, batching and a prefix served from the cache. The output is the target's
//! greedy continuation either way.

use std::path::{Path, PathBuf};

use chimera::backend::cpu::CpuBackend;
use chimera::cache::config::{ByteSize, CacheConfig, CacheLayout};
use chimera::engine::api::{EngineEvent, GenerateRequest};
use chimera::engine::speculative::SpeculativeConfig;
use chimera::engine::{Engine, EngineConfig, EngineError, EngineSetup, ModelRunner, Policies};
use chimera::model::{self, LoadOptions, Model};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

fn model_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

fn load(name: &str, mtp: bool) -> Model<CpuBackend> {
    let options = LoadOptions {
        mtp,
        ..Default::default()
    };
    model::load_with(&model_dir(name), &CpuBackend::default(), options).expect("fixture model")
}

struct Case {
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    /// Drafts by the token count they follow.
    drafts: std::collections::HashMap<usize, Vec<u32>>,
}

fn reference(name: &str) -> (usize, Vec<Case>) {
    let text = std::fs::read_to_string(model_dir(name).join("mtp-reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    let cases = v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            prompt: ids(&c["prompt"]),
            greedy: ids(&c["greedy"]),
            drafts: c["drafts"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(len, d)| (len.parse().unwrap(), ids(d)))
                .collect(),
        })
        .collect();
    (v["k"].as_u64().unwrap() as usize, cases)
}

fn engine(
    m: Model<CpuBackend>,
    k: usize,
    max_batched_tokens: usize,
    prefix_caching: bool,
) -> Result<Engine<ModelRunner<CpuBackend>>, EngineError> {
    engine_with_budget(m, k, max_batched_tokens, prefix_caching, 32 << 20)
}

fn engine_with_budget(
    m: Model<CpuBackend>,
    k: usize,
    max_batched_tokens: usize,
    prefix_caching: bool,
    budget: u64,
) -> Result<Engine<ModelRunner<CpuBackend>>, EngineError> {
    engine_with(m, k, max_batched_tokens, prefix_caching, budget, 4)
}

fn engine_with(
    m: Model<CpuBackend>,
    k: usize,
    max_batched_tokens: usize,
    prefix_caching: bool,
    budget: u64,
    max_batch: usize,
) -> Result<Engine<ModelRunner<CpuBackend>>, EngineError> {
    let setup = EngineSetup {
        engine: EngineConfig {
            max_batched_tokens,
            max_running: 4,
            ..EngineConfig::default()
        },
        cache: CacheConfig {
            memory_budget: Some(ByteSize(budget)),
            block_size: 16,
            prefix_caching,
            ..CacheConfig::default()
        },
        hash_salt: "test".into(),
        speculative: SpeculativeConfig {
            method: "mtp".into(),
            num_tokens: k,
            max_batch,
            ..SpeculativeConfig::default()
        },
    };
    Engine::new(
        setup,
        ModelRunner::new(CpuBackend::default(), m),
        Policies::builtin(),
    )
}

fn run(
    e: &mut Engine<ModelRunner<CpuBackend>>,
    requests: &[(u64, &[u32], usize)],
) -> Vec<Vec<u32>> {
    let mut rxs: Vec<UnboundedReceiver<EngineEvent>> = Vec::new();
    for &(id, prompt, n) in requests {
        let (tx, rx) = unbounded_channel();
        e.add(GenerateRequest::greedy(id, prompt.to_vec(), n as u32), tx);
        rxs.push(rx);
    }
    let mut steps = 0;
    while e.step() {
        steps += 1;
        assert!(steps < 10_000, "engine did not finish");
    }
    rxs.iter_mut()
        .map(|rx| {
            let mut out = Vec::new();
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    EngineEvent::Tokens { tokens, .. } => out.extend(tokens),
                    EngineEvent::Failed { message, .. } => panic!("request failed: {message}"),
                    _ => {}
                }
            }
            out
        })
        .collect()
}

/// Every recorded proposal is the reference chain at the request's token count; returns how
/// many drafts were checked.
fn check_proposals(
    label: &str,
    log: &[(u64, usize, Vec<u32>)],
    cases: &[Case],
    case_of: impl Fn(u64) -> usize,
) -> usize {
    let mut checked = 0;
    for (id, len, drafts) in log {
        let case = &cases[case_of(*id)];
        let want = case
            .drafts
            .get(len)
            .unwrap_or_else(|| panic!("{label}: request {id} drafted at {len} tokens"));
        assert!(
            !drafts.is_empty() && drafts.len() <= want.len(),
            "{label}: request {id} at {len}: {drafts:?}"
        );
        assert_eq!(
            drafts[..],
            want[..drafts.len()],
            "{label}: request {id}: the MTP drafts after {len} tokens"
        );
        checked += drafts.len();
    }
    checked
}

#[test]
fn mtp_drafts_are_the_heads_reference_and_the_output_is_the_greedy_one() {
    for name in ["qwen35-a-mtp", "qwen3next-a-mtp"] {
        let (k, cases) = reference(name);
        let n = cases[0].greedy.len();
        // (label, token budget: 24 cuts the 33-token prompt into chunks, prefix caching)
        for (label, budget, caching) in [
            ("one chunk each", 256, false),
            ("chunked prefill", 24, true),
        ] {
            let label = format!("{name} [{label}]");
            let mut e = engine(load(name, true), k, budget, caching).expect("engine");
            e.record_drafts(true);
            let requests: Vec<(u64, &[u32], usize)> = cases
                .iter()
                .enumerate()
                .map(|(i, c)| (i as u64, &c.prompt[..], n))
                .collect();
            let got = run(&mut e, &requests);
            for (i, (g, c)) in got.iter().zip(&cases).enumerate() {
                assert_eq!(g, &c.greedy, "{label}: request {i}");
            }
            let log = e.take_draft_log();
            let checked = check_proposals(&label, &log, &cases, |id| id as usize);
            // Each request drafts after its first token and after every verify step that
            // leaves it more than one token to go.
            assert!(checked >= 2 * k, "{label}: only {checked} drafts checked");
            let st = e.stats().clone();
            assert!(st.spec_draft_tokens > 0, "{label}: no verify step ran");
            if caching {
                // The same prompt again: its prefix (K/V of the target and of the head) comes
                // from the cache, and the head drafts as it did.
                let got = run(&mut e, &[(10, &cases[1].prompt[..], n)]);
                assert_eq!(got[0], cases[1].greedy, "{label}: cached repeat");
                let log = e.take_draft_log();
                let checked = check_proposals(&label, &log, &cases, |_| 1);
                assert!(checked > 0, "{label}: the cached repeat drafted nothing");
            }
            assert_eq!(
                e.cache().pool().available(),
                e.cache().total_blocks(),
                "{label}: blocks left held"
            );
            e.cache().check_invariants().expect("cache invariants");
            eprintln!(
                "{label}: {} drafts checked; accepted {}/{}",
                checked, st.spec_accepted_tokens, st.spec_draft_tokens
            );
        }
    }
}

/// A pool of a few blocks: three requests each take a block for their 7-token prompt, all
/// need a second one at 17 tokens, pause, and the newest is evicted and recomputed. The
/// head's K/V of the recomputed positions is written again: its drafts are still the
/// reference's.
#[test]
fn mtp_drafts_survive_preemption() {
    let name = "qwen35-a-mtp";
    let (k, cases) = reference(name);
    let n = cases[0].greedy.len();
    assert!(
        cases[0].prompt.len() + n > 17,
        "the requests must outgrow a block"
    );
    let m = load(name, true);
    // The budget that gives 3 blocks besides the live and draft slots of 4 running requests.
    let spec = m.info.cache.clone();
    let mut budget = 3 * spec.kv_block_bytes(16) as u64;
    loop {
        let cfg = CacheConfig {
            memory_budget: Some(ByteSize(budget)),
            block_size: 16,
            ..CacheConfig::default()
        };
        if let Ok(l) = CacheLayout::plan(&cfg, &spec, 4 + 4 * k) {
            assert!(l.num_blocks <= 3, "no budget gives exactly 3 blocks");
            if l.num_blocks == 3 {
                break;
            }
        }
        budget += 64;
    }
    let mut e = engine_with_budget(m, k, 256, false, budget).expect("engine");
    e.record_drafts(true);
    let requests: Vec<(u64, &[u32], usize)> =
        (0..3).map(|i| (i, &cases[0].prompt[..], n)).collect();
    let got = run(&mut e, &requests);
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g, &cases[0].greedy, "request {i}");
    }
    let checked = check_proposals(name, &e.take_draft_log(), &cases, |_| 0);
    let st = e.stats().clone();
    eprintln!(
        "{name} under preemption: {} preemptions, {checked} drafts checked",
        st.preemptions
    );
    assert!(
        st.preemptions > 0,
        "the pool was not tight: no request was evicted"
    );
    assert!(checked > 0);
    assert_eq!(e.cache().pool().available(), 3, "blocks leaked");
    e.cache().check_invariants().expect("cache invariants");
}

/// More requests than `max_batch`: speculation is off and steps are scheduled ahead, so the
/// head cannot follow them; their requests stop drafting (a draft from K/V with holes would
/// differ from the reference), and a request admitted afterwards drafts as usual.
#[test]
fn mtp_stops_drafting_for_requests_computed_while_speculation_was_off() {
    let name = "qwen35-a-mtp";
    let (k, cases) = reference(name);
    let n = cases[0].greedy.len();
    let mut e = engine_with(load(name, true), k, 256, false, 32 << 20, 1).expect("engine");
    e.record_drafts(true);
    let submit = |e: &mut Engine<ModelRunner<CpuBackend>>, id: u64, case: usize| {
        let (tx, rx) = unbounded_channel();
        let c: &Case = &cases[case];
        e.add(GenerateRequest::greedy(id, c.prompt.clone(), n as u32), tx);
        rx
    };
    // Request 0 alone drafts; request 1 joins it and speculation goes off for both.
    let mut rxs = vec![submit(&mut e, 0, 0)];
    for _ in 0..4 {
        e.step();
    }
    let alone = e.take_draft_log();
    assert!(!alone.is_empty(), "request 0 drafted nothing while alone");
    rxs.push(submit(&mut e, 1, 1));
    while e.step() {}
    let together = e.take_draft_log();
    // Request 2 comes after both: its head K/V is whole.
    rxs.push(submit(&mut e, 2, 1));
    while e.step() {}
    let after = e.take_draft_log();
    for (i, rx) in rxs.iter_mut().enumerate() {
        let mut out = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            if let EngineEvent::Tokens { tokens, .. } = ev {
                out.extend(tokens);
            }
        }
        assert_eq!(out, cases[i.min(1)].greedy, "request {i}");
    }
    let case_of = |id: u64| (id as usize).min(1);
    check_proposals(name, &alone, &cases, case_of);
    check_proposals(name, &together, &cases, case_of);
    assert!(
        together.iter().all(|(id, _, _)| *id == 0),
        "request 1 drafted though its head K/V has holes: {together:?}"
    );
    assert!(
        check_proposals(name, &after, &cases, case_of) > 0,
        "request 2 drafted nothing"
    );
    e.cache().check_invariants().expect("cache invariants");
}

#[test]
fn mtp_without_a_head_is_a_clear_error() {
    // A checkpoint without mtp.* tensors, and one whose head was not asked to be loaded.
    for (name, with_head) in [("qwen3next-a", true), ("qwen35-a-mtp", false)] {
        let m = load(name, with_head);
        assert!(m.mtp.is_none(), "{name}");
        match engine(m, 3, 256, true) {
            Err(e @ EngineError::NoMtpHead) => {
                assert!(e.to_string().contains("mtp.*"), "{e}")
            }
            Err(e) => panic!("{name}: {e}"),
            Ok(_) => panic!("{name}: an MTP engine without a head"),
        }
    }
    // Loaded with its head, a fixture's KV cache has one more attention layer.
    let plain = load("qwen35-a-mtp", false);
    let with = load("qwen35-a-mtp", true);
    assert_eq!(
        with.info.cache.attn_layers,
        plain.info.cache.attn_layers + 1
    );
}
