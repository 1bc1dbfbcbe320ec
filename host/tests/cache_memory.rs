//! The cache's memory budget holds for real: the engine over an attention-free model (pure
//! Mamba2, whose KV blocks hold no data) at the shipped default configuration keeps its
//! resident memory near `cache.memory_budget`, and still serves.
//!
//! One test per binary on purpose (its own `[[test]]` in Cargo.toml): it measures this
//! process's resident set, so no other test may allocate beside it.

#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used)]

use std::path::Path;

use chimera::backend::cpu::CpuBackend;
use chimera::cache::config::{ATTENTION_FREE_TOKENS_PER_SLOT, BLOCK_BOOKKEEPING_BYTES};
use chimera::config::Config;
use chimera::engine::api::{EngineEvent, FinishReason, GenerateRequest, SamplingParams};
use chimera::engine::{Engine, EngineSetup, ModelRunner, Policies};
use chimera::model;
use tokio::sync::mpsc::unbounded_channel;

/// Resident set size of this process in bytes (`VmRSS` of /proc/self/status).
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/self/status");
    let kib: u64 = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kib << 10
}

#[test]
fn attention_free_engine_stays_near_its_budget() {
    let mut config = Config::load(None).unwrap();
    let budget = 256u64 << 20;
    config.cache.memory_budget = Some(chimera::cache::ByteSize(budget));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/models/mamba2-g1");
    let m = model::load(&dir, &CpuBackend::default()).unwrap();
    assert_eq!(
        m.info.cache.kv_block_bytes(16),
        0,
        "mamba2-g1 has no attention"
    );
    let setup = EngineSetup {
        engine: config.engine.clone(),
        cache: config.cache.clone(),
        hash_salt: "test".into(),
        speculative: Default::default(),
    };

    let before = resident_bytes();
    let mut e = Engine::new(
        setup,
        ModelRunner::new(CpuBackend::default(), m),
        Policies::builtin(),
    )
    .unwrap();
    let grown = resident_bytes().saturating_sub(before);

    let l = e.layout().clone();
    let useful = l.ssm_slots() * ATTENTION_FREE_TOKENS_PER_SLOT.div_ceil(l.block_size);
    let bookkeeping = ((budget - l.ssm_bytes) / BLOCK_BOOKKEEPING_BYTES) as usize;
    assert_eq!(l.num_blocks, useful.min(bookkeeping));
    assert_eq!(l.kv_bytes, 0);
    eprintln!(
        "mamba2-g1 at {} MiB: {} blocks, {} live + {} durable slots, resident +{} MiB",
        budget >> 20,
        l.num_blocks,
        l.live_slots,
        l.durable_slots,
        grown >> 20
    );
    assert!(
        grown < budget + (200 << 20),
        "engine construction grew the resident set by {} MiB at a {} MiB budget ({} blocks)",
        grown >> 20,
        budget >> 20,
        l.num_blocks
    );

    // The bounded pool still serves: a prompt of a few blocks runs to its length.
    let (tx, mut rx) = unbounded_channel();
    e.add(
        GenerateRequest {
            id: 1,
            prompt: (5..70).collect(),
            params: SamplingParams::default(),
            max_tokens: 4,
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
    let mut steps = 0;
    while e.step() {
        steps += 1;
        assert!(steps < 100, "engine did not finish");
    }
    let mut generated = 0;
    let mut reason = None;
    while let Ok(ev) = rx.try_recv() {
        match ev {
            EngineEvent::Tokens { tokens, .. } => generated += tokens.len(),
            EngineEvent::Finished { reason: r, .. } => reason = Some(r),
            EngineEvent::Failed { kind, message } => panic!("request failed: {kind}: {message}"),
            EngineEvent::PromptLogprobs { .. } => {}
        }
    }
    assert_eq!((generated, reason), (4, Some(FinishReason::Length)));
}
