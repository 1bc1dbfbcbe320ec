//! The engine thread through its handle: submit, stream, cancel, stats, cache events,
//! reset and shutdown, the way the server drives it.

#![allow(clippy::unwrap_used)]

use crate::engine_common;

use std::time::{Duration, Instant};

use chimera::engine::api::{Command, EngineEvent, FinishReason, KvEvent, SubmitError};
use chimera::engine::{EngineError, MockExecutor, Policies, spawn_engine};
use engine_common::*;
use tokio::sync::mpsc::UnboundedReceiver;

/// Waits for a request's events until it ends.
fn wait(rx: &mut UnboundedReceiver<EngineEvent>) -> (Vec<u32>, EngineEvent) {
    let mut tokens = Vec::new();
    loop {
        match rx.blocking_recv().expect("channel closed before the end") {
            EngineEvent::Tokens { tokens: t, .. } => tokens.extend(t),
            end => return (tokens, end),
        }
    }
}

/// Room for a 100k-token request (one that could never fit the cache is refused at once).
fn roomy() -> Knobs {
    Knobs {
        blocks: 65_536,
        ..Knobs::default()
    }
}

#[test]
fn serves_streams_cancels_and_shuts_down() {
    let exec = MockExecutor::hybrid();
    let s = setup(&exec, roomy());
    let (handle, join, mut kv) = spawn_engine(s, exec, Policies::builtin()).expect("spawn");
    let prompt = Tokens::new(1).take(10, 64);
    let mut a = handle.submit(request(1, prompt.clone(), 4)).unwrap();
    let (tokens, end) = wait(&mut a);
    assert!(!tokens.is_empty() && tokens.len() <= 4);
    let EngineEvent::Finished { usage, .. } = end else {
        panic!("{end:?}")
    };
    assert_eq!(usage.prompt_tokens, 10);
    // The same prompt again hits the cache (8 tokens: two blocks with a snapshot at 8).
    let mut b = handle.submit(request(2, prompt, 4)).unwrap();
    let (tokens_b, end) = wait(&mut b);
    assert_eq!(tokens_b, tokens);
    assert!(matches!(end, EngineEvent::Finished { usage, .. } if usage.cached_tokens == 8));
    // A long request is cancelled while running; its blocks come back.
    let mut long = request(3, Tokens::new(2).take(6, 64), 100_000);
    long.ignore_eos = true;
    let mut c = handle.submit(long).unwrap();
    assert!(matches!(
        c.blocking_recv(),
        Some(EngineEvent::Tokens { .. })
    ));
    handle.cancel(3);
    let (_, end) = wait(&mut c);
    assert!(matches!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Cancelled,
            ..
        }
    ));
    // Stats are published after each step.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = handle.stats();
        if st.running == 0 && st.free_blocks == st.total_blocks {
            assert!(st.requests_finished >= 3);
            assert!(st.prefix_cache_hits >= 2);
            break;
        }
        assert!(Instant::now() < deadline, "stats never settled: {st:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Cache events arrived: stored blocks first.
    let first = kv.blocking_recv().expect("a batch of kv events");
    assert!(
        matches!(first.first(), Some(KvEvent::Stored { .. })),
        "{first:?}"
    );
    handle.control(Command::ResetPrefixCache).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match kv.try_recv() {
            Ok(batch) if batch.iter().any(|e| matches!(e, KvEvent::Cleared)) => break,
            Ok(_) => {}
            Err(_) => {
                assert!(Instant::now() < deadline, "no Cleared event");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
    handle.control(Command::Shutdown).unwrap();
    join.join().unwrap();
    assert!(matches!(
        handle.submit(request(9, vec![1, 2], 1)),
        Err(SubmitError::ShuttingDown)
    ));
}

#[test]
fn shutdown_cancels_what_is_in_flight() {
    let exec = MockExecutor::transformer();
    let s = setup(&exec, roomy());
    let (handle, join, _kv) = spawn_engine(s, exec, Policies::builtin()).expect("spawn");
    let mut long = request(1, vec![3, 4, 5], 100_000);
    long.ignore_eos = true;
    let mut rx = handle.submit(long).unwrap();
    assert!(matches!(
        rx.blocking_recv(),
        Some(EngineEvent::Tokens { .. })
    ));
    handle.control(Command::Shutdown).unwrap();
    let (_, end) = wait(&mut rx);
    assert!(matches!(
        end,
        EngineEvent::Finished {
            reason: FinishReason::Cancelled,
            ..
        }
    ));
    join.join().unwrap();
}

#[test]
fn an_impossible_budget_is_a_startup_error() {
    let exec = MockExecutor::hybrid();
    let mut s = setup(&exec, Knobs::default());
    s.cache.memory_budget = Some(chimera::cache::ByteSize(1000));
    let err = spawn_engine(s, exec, Policies::builtin())
        .err()
        .expect("must fail");
    assert!(matches!(err, EngineError::Config(_)), "{err}");
    assert!(err.to_string().contains("cache.memory_budget"), "{err}");
}
