//! Engine behaviour with the model-free mock executor: outputs must not depend on caching,
//! chunking, budgets or memory pressure; prefix reuse and SSM restores happen exactly where
//! expected; eviction and cancellation leave nothing behind.

#![allow(clippy::unwrap_used)]

use crate::engine_common;

use chimera::engine::api::{FailureKind, FinishReason, KvEvent};
use chimera::engine::{MockConfig, MockExecutor, StepExecutor};
use engine_common::*;

const VOCAB: u32 = 64;

fn configs() -> Vec<(&'static str, Knobs)> {
    let base = Knobs::default();
    vec![
        (
            "prefix caching on",
            Knobs {
                prefix_caching: true,
                ..base
            },
        ),
        (
            "chunked prefill off",
            Knobs {
                chunked_prefill: false,
                max_batched_tokens: 64,
                ..base
            },
        ),
        (
            "small token budget",
            Knobs {
                max_batched_tokens: 12,
                max_running: 4,
                ..base
            },
        ),
        (
            "few blocks",
            Knobs {
                blocks: 10,
                max_batched_tokens: 16,
                ..base
            },
        ),
        (
            "few blocks, no caching",
            Knobs {
                blocks: 10,
                prefix_caching: false,
                ..base
            },
        ),
        (
            "few snapshot slots",
            Knobs {
                snapshots: 2,
                max_batched_tokens: 9,
                max_running: 4,
                ..base
            },
        ),
    ]
}

/// Runs the shared-prefix workload on every config and compares with caching and chunking off.
fn outputs_do_not_depend_on_config(make: impl Fn() -> MockExecutor) {
    let mut work = shared_prefix_workload(7, 24, VOCAB);
    // Every third request also scores its prompt (with two alternatives per token).
    for (_, req) in work.iter_mut() {
        if req.id % 3 == 0 {
            req.prompt_logprobs = Some(2);
            req.params.logprobs = Some(2);
        }
    }
    // The baseline also schedules each step after the previous one's update; every config
    // below schedules ahead.
    let baseline_knobs = Knobs {
        prefix_caching: false,
        chunked_prefill: false,
        schedule_ahead: false,
        ..Knobs::default()
    };
    let mut baseline_engine = engine(make(), baseline_knobs);
    let baseline = drive(&mut baseline_engine, work.clone());
    assert!(
        baseline
            .outcomes
            .values()
            .all(|o| o.failed.is_none() && o.finish.is_some())
    );
    let base_computed = baseline_engine.stats().prompt_tokens_computed;
    for (name, k) in configs() {
        let mut e = engine(make(), k);
        let run = drive(&mut e, work.clone());
        assert_eq!(
            run.tokens(),
            baseline.tokens(),
            "outputs differ with {name}"
        );
        let s = e.stats();
        assert_eq!(s.free_blocks, s.total_blocks, "{name}: blocks left in use");
        if k.prefix_caching && k.blocks > 100 {
            assert!(
                s.prompt_tokens_cached > 0,
                "{name}: the cache was never hit"
            );
            assert!(s.prompt_tokens_computed < base_computed, "{name}");
        }
        if k.blocks < 16 {
            assert!(s.preemptions > 0, "{name}: the pool never ran out");
        }
        for (id, o) in &run.outcomes {
            let prompt_len = work[*id as usize].1.prompt.len();
            assert_eq!(o.usage.prompt_tokens as usize, prompt_len);
            assert_eq!(o.usage.completion_tokens as usize, o.tokens.len());
            // Prompt logprobs: sent once, whole, whatever the chunking, caching or preemption.
            assert_eq!(
                o.prompt_logprobs, baseline.outcomes[id].prompt_logprobs,
                "{name}: prompt logprobs of {id}"
            );
            if id % 3 == 0 {
                let lp = o.prompt_logprobs.as_ref().expect("prompt logprobs sent");
                assert_eq!(lp.len(), prompt_len);
                assert!(
                    lp[0].is_none()
                        && lp[1..]
                            .iter()
                            .all(|x| x.as_ref().is_some_and(|x| x.top.len() == 2))
                );
                assert_eq!(
                    o.usage.cached_tokens, 0,
                    "{name}: {id} skipped prompt tokens"
                );
            }
        }
    }
}

#[test]
fn transformer_outputs_do_not_depend_on_config() {
    outputs_do_not_depend_on_config(MockExecutor::transformer);
}

#[test]
fn hybrid_outputs_do_not_depend_on_config() {
    outputs_do_not_depend_on_config(MockExecutor::hybrid);
}

#[test]
fn staged_shared_prefixes_skip_exactly_the_expected_tokens() {
    let mut t = Tokens::new(3);
    let a = t.take(14, VOCAB);
    let b = [&a[..12], &t.take(6, VOCAB)[..]].concat();
    let c = [&a[..6], &t.take(5, VOCAB)[..]].concat();
    let d = [&a[..4], &t.take(7, VOCAB)[..]].concat();
    let stage = |e: &mut chimera::engine::Engine<MockExecutor>, id, p: &Vec<u32>| {
        drive(e, vec![(0, request(id, p.clone(), 3))]).outcomes[&id]
            .usage
            .cached_tokens
    };
    // Transformer: any cached full block is skipped.
    let mut e = engine(MockExecutor::transformer(), Knobs::default());
    assert_eq!(stage(&mut e, 1, &a), 0);
    assert_eq!(stage(&mut e, 2, &b), 12);
    assert_eq!(stage(&mut e, 3, &c), 4);
    assert_eq!(stage(&mut e, 4, &d), 4);
    // Counted in tokens, as vLLM does: every admission queries its whole prompt; the hits are
    // the skipped tokens.
    assert_eq!(e.stats().prefix_cache_hits, 12 + 4 + 4);
    assert_eq!(e.stats().prefix_cache_queries, 14 + 18 + 11 + 11);

    // Hybrid: only to a boundary with a snapshot. A (14 tokens) snapshots at 8 and 12, and its
    // reply crosses 16, where the rolling snapshot is kept when A finishes.
    let mut e = engine(MockExecutor::hybrid(), Knobs::default());
    assert_eq!(stage(&mut e, 1, &a), 0);
    assert_eq!(e.stats().ssm_snapshots_used, 3);
    // B restores at block 3 (token 12): one restore, 6 tokens computed.
    let before = e.stats().prompt_tokens_computed;
    assert_eq!(stage(&mut e, 2, &b), 12);
    assert_eq!(e.stats().prompt_tokens_computed - before, 6);
    assert_eq!(e.stats().ssm_restores, 1);
    assert_eq!(e.executor().counters.restores, 1);
    // C shares block 0's KV but there is no snapshot at 4: nothing skipped, and C snapshots
    // the divergence point for later.
    assert_eq!(stage(&mut e, 3, &c), 0);
    assert_eq!(e.stats().ssm_restores, 1);
    // D now restores at 4.
    assert_eq!(stage(&mut e, 4, &d), 4);
    assert_eq!(e.stats().ssm_restores, 2);
}

#[test]
fn evicting_a_prefix_drops_kv_and_snapshot_and_the_repeat_recomputes() {
    let k = Knobs {
        blocks: 6,
        max_batched_tokens: 32,
        ..Knobs::default()
    };
    let mut t = Tokens::new(11);
    let a = t.take(9, VOCAB);
    let f = t.take(21, VOCAB);
    let mut e = engine(MockExecutor::hybrid(), k);
    let first = drive(&mut e, vec![(0, request(1, a.clone(), 3))]);
    assert_eq!(e.stats().ssm_snapshots_used, 2);
    assert_eq!(e.stats().cached_blocks, 2);
    // F needs all 6 blocks: A's blocks (and their snapshots) are evicted.
    let run_f = drive(&mut e, vec![(0, request(2, f, 3))]);
    assert!(run_f.outcomes[&2].failed.is_none());
    let removed: usize = run_f
        .kv_events
        .iter()
        .map(|ev| {
            if let KvEvent::Removed { hashes } = ev {
                hashes.len()
            } else {
                0
            }
        })
        .sum();
    assert_eq!(removed, 2);
    let again = drive(&mut e, vec![(0, request(3, a, 3))]);
    assert_eq!(again.outcomes[&3].usage.cached_tokens, 0);
    assert_eq!(again.outcomes[&3].tokens, first.outcomes[&1].tokens);
    assert_eq!(e.stats().ssm_restores, 0);
}

#[test]
fn random_cancellations_leave_every_block_free() {
    for make in [
        MockExecutor::transformer as fn() -> MockExecutor,
        MockExecutor::hybrid,
    ] {
        let k = Knobs {
            blocks: 24,
            max_batched_tokens: 24,
            max_running: 6,
            ..Knobs::default()
        };
        let mut e = engine(make(), k);
        let mut work = shared_prefix_workload(5, 64, VOCAB);
        for (_, r) in &mut work {
            r.max_tokens = 40;
            r.ignore_eos = true;
        }
        let mut x = 99u64;
        let run = drive_with(&mut e, work, |e, step| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            if (x >> 33).is_multiple_of(3) {
                e.cancel((x >> 40) % 64);
            }
            let _ = step;
        });
        let cancelled = run
            .outcomes
            .values()
            .filter(|o| o.finish == Some(FinishReason::Cancelled))
            .count();
        assert!(cancelled > 10, "only {cancelled} cancellations happened");
        assert!(
            run.outcomes
                .values()
                .all(|o| o.finish.is_some() && o.failed.is_none())
        );
        let s = e.stats();
        assert_eq!((s.running, s.waiting, s.paused), (0, 0, 0));
        assert_eq!(s.free_blocks, s.total_blocks);
        assert_eq!(e.cache().pool().available(), e.cache().pool().total());
        assert_eq!(
            e.cache().ssm().live_free() as u32,
            if make().cache_spec().is_hybrid() {
                6
            } else {
                0
            }
        );
    }
}

/// Request 1 prefills at call 0 and decodes at call 1, which fails. Scheduling after each
/// step, request 2 (arriving after call 0) is in that batch and fails with it; scheduling
/// ahead, call 1 was scheduled before request 2 arrived, so request 2 runs in a later step.
#[test]
fn a_failed_step_fails_its_batch_and_caches_nothing() {
    for ahead in [false, true] {
        let exec = MockExecutor::new(MockConfig {
            fail_at_call: Some(1),
            ..MockConfig::default()
        });
        let knobs = Knobs {
            schedule_ahead: ahead,
            ..Knobs::default()
        };
        let mut e = engine(exec, knobs);
        let mut t = Tokens::new(1);
        let p = t.take(10, VOCAB);
        let run = drive(
            &mut e,
            vec![
                (0, request(1, p.clone(), 5)),
                (1, request(2, t.take(9, VOCAB), 5)),
            ],
        );
        assert!(run.outcomes[&1].failed.is_some(), "ahead {ahead}");
        let failed2 = run.outcomes[&2].failed.as_ref().map(|f| f.0);
        if ahead {
            assert_eq!(failed2, None);
            assert_eq!(run.outcomes[&2].tokens.len(), 5);
        } else {
            assert_eq!(failed2, Some(FailureKind::Executor));
        }
        // Request 1's prompt entered the index (its step succeeded); request 2's blocks did
        // only where its steps succeeded.
        let stored: usize = run
            .kv_events
            .iter()
            .map(|ev| {
                if let KvEvent::Stored { blocks, .. } = ev {
                    blocks.len()
                } else {
                    0
                }
            })
            .sum();
        assert_eq!(stored, if ahead { 2 + 3 } else { 2 }, "ahead {ahead}");
        // The engine keeps serving.
        let again = drive(&mut e, vec![(0, request(3, p, 2))]);
        assert_eq!(again.outcomes[&3].usage.cached_tokens, 8);
        assert_eq!(again.outcomes[&3].tokens.len(), 2);
    }
}

#[test]
fn idle_steps_keep_the_prefix_cache() {
    let mut e = engine(MockExecutor::hybrid(), Knobs::default());
    let p = Tokens::new(4).take(12, VOCAB);
    drive(&mut e, vec![(0, request(1, p.clone(), 2))]);
    for _ in 0..5 {
        assert!(!e.step());
    }
    let run = drive(&mut e, vec![(0, request(2, p, 2))]);
    assert_eq!(run.outcomes[&2].usage.cached_tokens, 8);
    e.reset_prefix_cache();
    assert_eq!(e.stats().cached_blocks, 0);
    assert_eq!(e.stats().ssm_snapshots_used, 0);
}

#[test]
fn prompt_longer_than_the_cache_fails_instead_of_waiting() {
    let mut e = engine(
        MockExecutor::transformer(),
        Knobs {
            blocks: 4,
            max_batched_tokens: 64,
            ..Knobs::default()
        },
    );
    let run = drive(
        &mut e,
        vec![(0, request(1, Tokens::new(2).take(17, VOCAB), 2))],
    );
    let (kind, msg) = run.outcomes[&1].failed.clone().expect("failed");
    assert_eq!(kind, FailureKind::PromptTooLong);
    assert!(msg.contains("memory_budget"), "{msg}");
}

/// `logit_bias` and `min_tokens` reach the sampling tail: a large bias takes every greedy pick,
/// a large negative one removes a token, and `min_tokens` masks the stop tokens until that many
/// tokens are out (the run without it stops at the first token). Checked with and without
/// scheduling ahead, which plans the masked rows before the previous token is known.
#[test]
fn logit_bias_and_min_tokens_steer_sampling() {
    for ahead in [false, true] {
        let knobs = Knobs {
            schedule_ahead: ahead,
            ..Knobs::default()
        };
        let run = |r: chimera::engine::api::GenerateRequest| {
            let mut e = engine(MockExecutor::transformer(), knobs);
            drive(&mut e, vec![(0, r)]).outcomes[&1].clone()
        };
        let prompt = Tokens::new(3).take(9, VOCAB);
        let plain = run(request(1, prompt.clone(), 8)).tokens;
        assert_eq!(plain.len(), 8);

        let mut biased = request(1, prompt.clone(), 8);
        let favourite = (0..VOCAB).find(|t| !plain.contains(t) && *t != 0).unwrap();
        biased.params.logit_bias = vec![(favourite, 100.0)];
        assert_eq!(run(biased).tokens, vec![favourite; 8], "ahead {ahead}");

        let mut against = request(1, prompt.clone(), 8);
        against.params.logit_bias = vec![(plain[0], -100.0)];
        let out = run(against).tokens;
        assert_ne!(out[0], plain[0], "ahead {ahead}");
        assert!(!out.contains(&plain[0]), "ahead {ahead}: {out:?}");

        // A stop token that greedy decoding picks first: without min_tokens, one token.
        let mut stop = request(1, prompt.clone(), 8);
        stop.stop_token_ids = vec![plain[0]];
        let early = run(stop.clone());
        assert_eq!(early.tokens, vec![plain[0]], "ahead {ahead}");
        assert_eq!(early.finish, Some(FinishReason::Stop));
        stop.params.min_tokens = 5;
        let late = run(stop);
        assert!(late.tokens.len() >= 5, "ahead {ahead}: {:?}", late.tokens);
        assert!(!late.tokens[..4].contains(&plain[0]), "ahead {ahead}");
        assert!(!late.tokens[..5].contains(&0), "EOS is masked too");
        let stopped_by_token = late.tokens.last() == Some(&plain[0]);
        assert_eq!(
            late.finish,
            Some(if stopped_by_token {
                FinishReason::Stop
            } else {
                FinishReason::Length
            }),
            "ahead {ahead}: {late:?}"
        );
    }
}

#[test]
fn stored_events_carry_the_prefix_hashes_and_tokens() {
    let mut e = engine(MockExecutor::transformer(), Knobs::default());
    let p = Tokens::new(8).take(9, VOCAB);
    let run = drive(&mut e, vec![(0, request(1, p.clone(), 1))]);
    let mut want = Vec::new();
    chimera::cache::HashSeed::new("test-model").extend(&mut want, &p, 4);
    let want: Vec<u64> = want.iter().map(|h| h.short()).collect();
    let mut stored = KvEvent::chain(&want, &[false, false]);
    if let KvEvent::Stored { tokens, .. } = &mut stored {
        *tokens = p[..8].to_vec();
    }
    assert_eq!(run.kv_events, vec![stored]);
}

/// The engine thread's event delivery (a threaded outbox) changes when events arrive, never
/// what they are: every request of the shared-prefix workload, with prompt logprobs on some and
/// a request rejected on arrival, receives exactly what the inline engine sends it.
#[test]
fn threaded_event_delivery_sends_what_inline_delivery_sends() {
    use chimera::engine::outbox::Outbox;
    let mut work = shared_prefix_workload(11, 24, VOCAB);
    for (_, req) in work.iter_mut() {
        if req.id % 3 == 0 {
            req.prompt_logprobs = Some(2);
            req.params.logprobs = Some(2);
        }
    }
    // An empty prompt is rejected on arrival (its one event never opens the request).
    let mut bad = work[0].1.clone();
    bad.id = 10_000;
    bad.prompt.clear();
    work.push((3, bad));
    let make = || {
        MockExecutor::new(MockConfig {
            vocab: VOCAB as usize,
            ..MockConfig::default()
        })
    };
    let mut inline = engine(make(), Knobs::default());
    let expected = drive(&mut inline, work.clone());
    let mut threaded = engine(make(), Knobs::default());
    assert!(threaded.set_outbox(Outbox::threaded().unwrap()));
    // Events arrive a little after their step: once the engine is idle, give the delivery
    // thread time instead of spinning through idle steps.
    let run = drive_with(&mut threaded, work, |e, _| {
        if e.is_idle() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    });
    assert_eq!(run.outcomes, expected.outcomes);
    assert!(expected.outcomes[&10_000].failed.is_some());
    assert!(
        (expected.outcomes.values()).any(|o| o.prompt_logprobs.is_some()),
        "the workload exercises prompt logprobs"
    );
    let s = threaded.stats();
    assert_eq!(s.free_blocks, s.total_blocks);
    // Requests are in: the outbox can no longer be swapped.
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    threaded.add(request(20_000, vec![1, 2, 3], 1_000), tx);
    assert!(!threaded.set_outbox(Outbox::inline()));
}

/// With threaded delivery a step's events go to the delivery thread once the next step is
/// launched (the hand-over overlaps the device's work), and the step after which nothing runs
/// hands its own on: a finished request's stream ends without another step.
#[test]
fn threaded_delivery_hands_a_steps_events_on_during_the_next_one() {
    use chimera::engine::api::EngineEvent;
    use chimera::engine::outbox::Outbox;
    use std::time::{Duration, Instant};
    use tokio::sync::mpsc::error::TryRecvError;
    let mut e = engine(
        MockExecutor::new(MockConfig {
            vocab: VOCAB as usize,
            ..MockConfig::default()
        }),
        Knobs::default(),
    );
    assert!(e.set_outbox(Outbox::threaded().unwrap()));
    let mut req = request(1, (1..=9).collect(), 4);
    req.ignore_eos = true;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    e.add(req, tx);
    // The prompt's step samples the first token; it is handed on only by the next step.
    assert!(e.step());
    std::thread::sleep(Duration::from_millis(50));
    assert!(matches!(rx.try_recv(), Err(TryRecvError::Empty)));
    let mut steps = 1;
    while !e.is_idle() {
        assert!(e.step());
        steps += 1;
    }
    assert_eq!(steps, 4, "one prompt step, then a decode per further token");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut tokens = 0;
    loop {
        match rx.try_recv() {
            Ok(EngineEvent::Tokens { tokens: t, .. }) => tokens += t.len(),
            Ok(EngineEvent::Finished { reason, .. }) => {
                assert_eq!(reason, FinishReason::Length);
                break;
            }
            Ok(other) => panic!("unexpected event {other:?}"),
            Err(TryRecvError::Empty) => {
                assert!(
                    Instant::now() < deadline,
                    "the last step's events were never handed on"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(TryRecvError::Disconnected) => panic!("the stream closed before Finished"),
        }
    }
    assert_eq!(tokens, 4);
    assert!(e.timings().overlap_ns > 0);
}

/// The eviction policy hears of a step's block events while the next step runs (or, when none
/// follows, at the end of the step): once the engine is idle its view holds every cached block.
#[test]
fn the_evictor_hears_every_block_event_by_the_time_the_engine_is_idle() {
    use chimera::engine::Policies;
    use chimera::policy::{CacheEvents, Decision, EventKind, Evictor};
    use std::collections::HashSet;
    use std::sync::{Arc, Mutex};
    /// Keeps the set of blocks the events say are cached.
    struct Recorder(Arc<Mutex<HashSet<u32>>>);
    impl Evictor for Recorder {
        fn on_events(&mut self, ev: &CacheEvents) {
            let mut cached = self.0.lock().unwrap();
            for (&kind, &block) in ev.kinds.iter().zip(&ev.blocks) {
                if kind == EventKind::Stored as u8 {
                    cached.insert(block);
                } else if kind == EventKind::Removed as u8 {
                    cached.remove(&block);
                }
            }
        }
        fn choose_victims(&mut self, _count: u32, _step: u64) -> Decision<Vec<u32>> {
            Decision::UseDefault
        }
    }
    let seen = Arc::new(Mutex::new(HashSet::new()));
    let exec = MockExecutor::new(MockConfig {
        vocab: VOCAB as usize,
        ..MockConfig::default()
    });
    let knobs = Knobs {
        prefix_caching: true,
        ..Knobs::default()
    };
    let policies = Policies {
        evictor: Some(Box::new(Recorder(seen.clone()))),
        ..Policies::builtin()
    };
    let mut e = chimera::engine::Engine::new(setup(&exec, knobs), exec, policies).unwrap();
    let mut rxs = Vec::new();
    for id in 0..3u64 {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut r = request(id, Tokens::new(id + 1).take(40, VOCAB), 21);
        r.ignore_eos = true;
        e.add(r, tx);
        rxs.push(rx);
    }
    while !e.is_idle() {
        e.step();
    }
    let cached = e.cache().pool().indexed();
    assert!(cached > 0, "the workload caches blocks");
    assert_eq!(seen.lock().unwrap().len(), cached);
}

/// With threaded delivery, a request whose reader has gone is found by the delivery thread and
/// cancelled by the engine: its blocks return to the pool while the other request runs on.
#[test]
fn threaded_delivery_cancels_a_request_whose_reader_left() {
    use chimera::engine::outbox::Outbox;
    let mut e = engine(
        MockExecutor::new(MockConfig {
            vocab: VOCAB as usize,
            ..MockConfig::default()
        }),
        // Room for both requests to decode for thousands of steps without a preemption (and
        // for each one's whole 100k tokens: a request that could never fit is refused).
        Knobs {
            blocks: 65_536,
            ..Knobs::default()
        },
    );
    assert!(e.set_outbox(Outbox::threaded().unwrap()));
    let mut req = request(1, (1..=9).collect(), 100_000);
    req.ignore_eos = true;
    let mut kept = req.clone();
    kept.id = 2;
    let (gone_tx, gone_rx) = tokio::sync::mpsc::unbounded_channel();
    let (kept_tx, mut kept_rx) = tokio::sync::mpsc::unbounded_channel();
    e.add(req, gone_tx);
    e.add(kept, kept_tx);
    for _ in 0..3 {
        e.step();
    }
    assert_eq!(e.stats().running, 2);
    drop(gone_rx);
    let start = std::time::Instant::now();
    while e.scheduler().contains(1) {
        assert!(
            start.elapsed().as_secs() < 20,
            "the gone reader was never noticed"
        );
        e.step();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(e.scheduler().contains(2));
    assert_eq!((e.stats().running, e.stats().preemptions), (1, 0));
    // The kept request's stream is intact: tokens only, so far. A step's events are handed on
    // during the next one (and the gone reader may be noticed after a single step), so a few
    // more steps publish the kept request's tokens; the delivery thread may merge several
    // steps' tokens into one event: count tokens, and wait for them (a loaded host delivers
    // late), not forever.
    for _ in 0..3 {
        e.step();
    }
    let mut tokens = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while tokens < 3 && std::time::Instant::now() < deadline {
        match kept_rx.try_recv() {
            Ok(chimera::engine::api::EngineEvent::Tokens { tokens: t, .. }) => tokens += t.len(),
            Ok(other) => panic!("the kept request got {other:?}"),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
        }
    }
    assert!(tokens >= 3, "{tokens}");
}

/// The host phases of a step are timed, and the engine loop between steps counts only between
/// back-to-back steps: not after the engine waited for requests.
#[test]
fn the_loop_between_steps_is_timed_only_back_to_back() {
    let mut e = engine(MockExecutor::transformer(), Knobs::default());
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let mut r = request(1, Tokens::new(5).take(10, VOCAB), 50);
    r.ignore_eos = true;
    e.add(r, tx);
    assert!(e.step());
    let pause = std::time::Duration::from_millis(3);
    std::thread::sleep(pause);
    assert!(e.step());
    let t = *e.timings();
    assert_eq!(t.steps, 2);
    assert!(t.schedule_ns > 0 && t.update_ns > 0);
    assert!(
        t.between_ns >= pause.as_nanos() as u64,
        "the pause between two back-to-back steps: {t:?}"
    );
    // After a wait for requests the gap is not host overhead.
    e.note_wait();
    std::thread::sleep(pause);
    assert!(e.step());
    assert_eq!(e.timings().between_ns, t.between_ns);
    assert!(e.stats().host_between_seconds > 0.0);
    // The executor's launch and the work overlapped with it are timed and published too.
    assert!(t.launch_ns > 0 && t.overlap_ns > 0, "{t:?}");
    assert!(e.stats().host_launch_seconds > 0.0 && e.stats().host_overlap_seconds > 0.0);
}

/// A publication deferred to the next step (as the engine thread defers while steps follow
/// each other) goes out during that step, once, with the figures it was deferred with; a step
/// with nothing due publishes nothing; every cache event is published exactly once and in
/// order: the events an engine read by hand gives for the same workload.
#[test]
fn deferred_publication_goes_out_during_the_next_step() {
    use std::sync::{Arc, Mutex};

    use chimera::engine::api::EngineStats;
    use tokio::sync::mpsc::unbounded_channel;

    type Log = Arc<Mutex<Vec<(EngineStats, Vec<KvEvent>)>>>;
    let work = shared_prefix_workload(5, 16, VOCAB);
    let make = || {
        MockExecutor::new(MockConfig {
            vocab: VOCAB as usize,
            ..MockConfig::default()
        })
    };
    let expected = drive(&mut engine(make(), Knobs::default()), work.clone());
    assert!(!expected.kv_events.is_empty());

    let published: Log = Arc::default();
    let sink = Arc::clone(&published);
    let mut e = engine(make(), Knobs::default());
    e.set_publisher(Box::new(move |s, kv| {
        sink.lock().unwrap().push((s.clone(), std::mem::take(kv)));
    }));
    let mut arrivals = work.into_iter().peekable();
    let mut rx = Vec::new();
    let (mut step, mut deferred, mut deferrals) = (0u64, None, 0);
    while arrivals.peek().is_some() || !e.is_idle() {
        while let Some((_, req)) = arrivals.next_if(|a| a.0 <= step) {
            let (tx, r) = unbounded_channel();
            rx.push(r);
            e.add(req, tx);
        }
        let before = published.lock().unwrap().len();
        let ran = e.step();
        let log = published.lock().unwrap();
        match deferred.take() {
            Some(figures) if ran => {
                assert_eq!(log.len(), before + 1, "step {step}: published once");
                assert_eq!(log[before].0, figures, "step {step}: the deferred figures");
            }
            _ => assert_eq!(log.len(), before, "step {step}: nothing was due"),
        }
        drop(log);
        e.refresh_stats();
        if ran && !e.is_idle() {
            e.defer_publication();
            assert!(e.publication_due());
            deferred = Some(e.stats().clone());
            deferrals += 1;
        } else {
            e.publish();
            assert!(!e.publication_due());
        }
        step += 1;
        assert!(step < 100_000, "the engine made no progress");
    }
    assert!(deferrals > 10, "the workload ran steps back to back");
    let log = published.lock().unwrap();
    let events: Vec<KvEvent> = log.iter().flat_map(|(_, kv)| kv.clone()).collect();
    assert_eq!(events, expected.kv_events);
    assert_eq!(log.last().map(|(s, _)| s), Some(e.stats()));
}

/// Scheduling ahead changes no output: a workload with stop tokens (requests stop a step
/// before the one scheduled ahead of it is applied), length limits, seeded sampling,
/// penalties (whose rows are built again once the tokens are in), prompt logprobs, prefix
/// hits with SSM restores, and a cache small enough to pause and evict, gives the same tokens,
/// finish reasons and usage with the next step scheduled ahead and after each update; and
/// afterwards every block and slot is free.
#[test]
fn scheduling_ahead_changes_no_output() {
    use chimera::engine::{Engine, Policies};
    use chimera::policy::native::DefaultSampler;

    let sampling = || Policies {
        sampler: Box::new(DefaultSampler::default()),
        fallback_sampler: Box::new(DefaultSampler::default()),
        evictor: None,
        constrainer: None,
        drafter: None,
    };
    let mut work = shared_prefix_workload(11, 30, VOCAB);
    for (_, req) in work.iter_mut() {
        match req.id % 5 {
            0 => req.stop_token_ids = vec![3, 17, 29, 41],
            1 => {
                req.params.temperature = 0.8;
                req.params.top_p = 0.9;
                req.params.seed = Some(req.id);
            }
            2 => req.params.repetition_penalty = 1.3,
            3 => {
                req.params.frequency_penalty = 0.4;
                req.params.temperature = 0.7;
            }
            _ => {
                req.prompt_logprobs = (req.id % 2 == 0).then_some(2);
                req.params.logprobs = Some(2);
            }
        }
        req.max_tokens = 3 + (req.id % 7) as u32;
    }
    let dense = || MockExecutor::new(MockConfig::default());
    let makers: [(&str, &dyn Fn() -> MockExecutor, usize); 3] = [
        ("dense", &dense, 256),
        ("hybrid", &MockExecutor::hybrid, 256),
        ("hybrid, few blocks", &MockExecutor::hybrid, 12),
    ];
    for (name, make, blocks) in makers {
        let run = |ahead: bool, exec: MockExecutor, arriving: bool| {
            let k = Knobs {
                blocks,
                snapshots: 6,
                max_batched_tokens: 24,
                schedule_ahead: ahead,
                ..Knobs::default()
            };
            let mut e = Engine::new(setup(&exec, k), exec, sampling()).expect("engine");
            let r = if arriving {
                drive_arriving(&mut e, work.clone())
            } else {
                drive(&mut e, work.clone())
            };
            let s = e.stats().clone();
            assert_eq!(
                s.free_blocks, s.total_blocks,
                "{name}, ahead {ahead}: blocks in use"
            );
            assert_eq!(e.scheduler().num_running(), 0, "{name}, ahead {ahead}");
            (r, s)
        };
        let (after, _) = run(false, make(), false);
        let (ahead, s) = run(true, make(), false);
        assert_eq!(
            ahead.tokens(),
            after.tokens(),
            "{name}: tokens differ (ahead)"
        );
        // Requests arriving while a step computes (a slow device), joining the step scheduled
        // ahead.
        let slow = || make().with_step_delay(std::time::Duration::from_millis(1));
        let (joined, sj) = run(true, slow(), true);
        assert!(
            sj.late_admissions > 0,
            "{name}: no request joined a step late"
        );
        assert_eq!(
            joined.tokens(),
            after.tokens(),
            "{name}: tokens differ (joined)"
        );
        for (id, o) in &after.outcomes {
            let a = &ahead.outcomes[id];
            let j = &joined.outcomes[id];
            assert_eq!(j.finish, o.finish, "{name}: request {id}'s finish (joined)");
            assert_eq!(
                j.usage.completion_tokens, o.usage.completion_tokens,
                "{name}: {id} (joined)"
            );
            assert!(j.failed.is_none(), "{name}: request {id} failed (joined)");
            assert_eq!(a.finish, o.finish, "{name}: request {id}'s finish");
            assert_eq!(
                a.usage.completion_tokens, o.usage.completion_tokens,
                "{name}: {id}"
            );
            assert_eq!(
                a.prompt_logprobs, o.prompt_logprobs,
                "{name}: request {id}'s prompt logprobs"
            );
            assert_eq!(
                j.prompt_logprobs, o.prompt_logprobs,
                "{name}: request {id}'s prompt logprobs (joined)"
            );
            assert!(a.failed.is_none(), "{name}: request {id} failed");
        }
        let stops = after
            .outcomes
            .values()
            .filter(|o| o.finish == Some(FinishReason::Stop))
            .count();
        assert!(stops > 0, "{name}: no request stopped early");
        if name == "hybrid, few blocks" {
            assert!(s.preemptions > 0, "{name}: nothing was evicted");
        }
    }
}

/// A request that arrives while a step computes, with the next step already scheduled
/// ahead, joins that next step: its first token comes with the step after the one it arrived
/// in, as without scheduling ahead, not one step later.
#[test]
fn a_request_arriving_mid_step_joins_the_step_scheduled_ahead() {
    use chimera::engine::api::EngineEvent;
    use std::time::Duration;

    // Steps (counting the one during which request 2 arrives) until its
    // first token is out, and the requests admitted late. `join`: it is handed over while the
    // step computes; else after the step (as the engine thread did before steps took
    // arrivals in).
    let first_token_after = |ahead: bool, join: bool| {
        let exec = MockExecutor::transformer().with_step_delay(Duration::from_millis(20));
        let k = Knobs {
            schedule_ahead: ahead,
            ..Knobs::default()
        };
        let mut e = engine(exec, k);
        let (tx, _rx_a) = tokio::sync::mpsc::unbounded_channel();
        e.add(request(1, vec![5, 6, 7, 8, 9], 40), tx);
        for _ in 0..3 {
            assert!(e.step());
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut late = Some(request(2, vec![9, 8, 7, 6, 5, 4], 4));
        for steps in 1..10 {
            assert!(e.begin_step());
            if let Some(r) = late.take_if(|_| join) {
                e.add(r, tx.clone());
                e.top_up();
            }
            e.complete_step();
            if let Some(r) = late.take() {
                e.add(r, tx.clone());
            }
            while let Ok(ev) = rx.try_recv() {
                if matches!(ev, EngineEvent::Tokens { .. }) {
                    return (steps, e.timings().late_admissions);
                }
            }
        }
        panic!("request 2 got no token");
    };
    // Without scheduling ahead the step after the arrival serves it.
    assert_eq!(first_token_after(false, false), (2, 0));
    assert_eq!(first_token_after(false, true), (2, 0));
    // Scheduling ahead, a request taken in only after the step waits one step more: the
    // step after was scheduled without it.
    assert_eq!(first_token_after(true, false), (3, 0));
    // Taken in while the step computes, it joins the step scheduled ahead.
    assert_eq!(first_token_after(true, true), (2, 1));
}

/// Cancels that arrive while a step computes — of requests in the launched step, in the step
/// scheduled ahead, or in both — end those requests only: every other request gets the tokens
/// it gets without them, nothing fails and every block is free afterwards.
#[test]
fn cancels_arriving_mid_step_end_only_their_requests() {
    use std::time::Duration;

    let work: Vec<_> = (0..12u64)
        .map(|i| {
            (
                i / 3,
                request(i, Tokens::new(i).take(5 + i as usize, VOCAB), 12),
            )
        })
        .collect();
    let run = |cancel: &[(u64, u64)]| {
        let exec = MockExecutor::hybrid().with_step_delay(Duration::from_micros(300));
        let mut e = engine(exec, Knobs::default());
        let mut rx = std::collections::BTreeMap::new();
        let mut outcomes: std::collections::BTreeMap<u64, Vec<u32>> = Default::default();
        let mut cancelled = Vec::new();
        for step in 0..200u64 {
            for (_, req) in work.iter().filter(|a| a.0 == step) {
                let (tx, r) = tokio::sync::mpsc::unbounded_channel();
                rx.insert(req.id, r);
                e.add(req.clone(), tx);
            }
            let mut due: Vec<u64> = (cancel.iter())
                .filter(|c| c.0 == step)
                .map(|c| c.1)
                .collect();
            let ran = e.begin_step();
            for id in due.drain(..) {
                e.cancel(id);
                cancelled.push(id);
            }
            if ran {
                e.complete_step();
            }
            assert!(due.is_empty(), "step {step} gave no chance to cancel");
            e.cache().check_invariants().expect("cache invariants");
            for (&id, r) in rx.iter_mut() {
                while let Ok(ev) = r.try_recv() {
                    match ev {
                        chimera::engine::api::EngineEvent::Tokens { tokens, .. } => {
                            outcomes.entry(id).or_default().extend(tokens)
                        }
                        chimera::engine::api::EngineEvent::Failed { message, .. } => {
                            panic!("request {id} failed: {message}")
                        }
                        _ => {}
                    }
                }
            }
            if step > 4 && e.is_idle() {
                break;
            }
        }
        assert!(e.is_idle(), "requests left");
        let s = e.stats();
        assert_eq!(s.free_blocks, s.total_blocks, "blocks in use");
        (outcomes, cancelled)
    };
    let (all, _) = run(&[]);
    // Request 0 decodes from step 1, so steps 3 and 5 hold it in flight and ahead; 4 is
    // admitted at step 1 and cancelled while its prompt's chunk is scheduled ahead; 7 and 8
    // mid-decode.
    let (some, cancelled) = run(&[(3, 0), (1, 4), (5, 7), (6, 8)]);
    assert_eq!(cancelled, vec![4, 0, 7, 8]);
    for (id, tokens) in &all {
        if cancelled.contains(id) {
            assert!(
                some.get(id)
                    .is_none_or(|t| all[id].starts_with(t) && t.len() < tokens.len()),
                "request {id}: cancelled, yet {:?}",
                some.get(id)
            );
        } else {
            assert_eq!(some.get(id), Some(tokens), "request {id}'s tokens");
        }
    }
}

/// Whether `text` is a whole match of the regex `(ab|cd){3}x` the constrained tests use.
fn matches_ab_cd_x(text: &str) -> bool {
    text.len() == 7
        && text.ends_with('x')
        && text.as_bytes()[..6]
            .chunks(2)
            .all(|p| p == b"ab" || p == b"cd")
}

/// A grammar compiles on the constraint lanes' threads: `add` does not wait for it, the other
/// requests step on meanwhile, and the request joins once its matcher is open, its output
/// following the grammar. A request cancelled while its grammar compiles ends cancelled.
#[test]
fn a_grammar_compiles_off_the_engine_thread_while_other_requests_run() {
    use chimera::engine::Policies;
    use chimera::engine::api::{EngineEvent, Grammar};
    use chimera::plugins::Vocabulary;
    use chimera::policy::{Constrainer, ConstraintError, ConstraintLanes};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    use tokio::sync::mpsc::unbounded_channel;

    /// A constraint whose grammars take 80 ms to compile.
    struct SlowOpen(Box<dyn Constrainer>);
    impl Constrainer for SlowOpen {
        fn open(&mut self, kind: &str, grammar: &str) -> Result<u32, ConstraintError> {
            std::thread::sleep(Duration::from_millis(80));
            self.0.open(kind, grammar)
        }
        fn next(&mut self, m: u32, tokens: &[u32], mask: &mut [u32]) -> Result<(), String> {
            self.0.next(m, tokens, mask)
        }
        fn rollback(&mut self, m: u32, count: u32) -> Result<(), String> {
            self.0.rollback(m, count)
        }
        fn close(&mut self, m: u32) {
            self.0.close(m)
        }
    }

    let eos = 256u32;
    let mut texts: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    texts.push(b"<|end|>".to_vec());
    let vocabulary = Arc::new(Vocabulary::from_tokens(
        texts
            .iter()
            .enumerate()
            .map(|(i, t)| (&t[..], i as u32 == eos)),
        eos,
    ));
    let exec = MockExecutor::new(MockConfig {
        vocab: texts.len(),
        eos: vec![eos],
        ..MockConfig::default()
    });
    let native = chimera::policy::native::constrainer(&Default::default(), &vocabulary);
    let lanes = ConstraintLanes::new(vec![Box::new(SlowOpen(native)) as Box<dyn Constrainer>]);
    let policies = Policies {
        constrainer: Some(Box::new(lanes)),
        ..Policies::builtin()
    };
    let mut e =
        chimera::engine::Engine::new(setup(&exec, Knobs::default()), exec, policies).unwrap();
    let constrained = |id| {
        let mut r = request(id, Tokens::new(id).take(10, 256), 50);
        r.constraint = Some(Grammar {
            kind: "regex".into(),
            text: "(ab|cd){3}x".into(),
        });
        r
    };

    let (free_tx, mut free_rx) = unbounded_channel();
    e.add(request(9, Tokens::new(9).take(12, 256), 16), free_tx);
    assert!(e.step());
    let (tx, mut rx) = unbounded_channel();
    let (gone_tx, mut gone_rx) = unbounded_channel();
    let t = Instant::now();
    e.add(constrained(1), tx);
    e.add(constrained(2), gone_tx);
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(40),
        "add waited {took:?} for the compilation"
    );
    e.cancel(2);
    assert!(e.step());
    assert_eq!(e.stats().waiting, 1, "the request waits for its matcher");

    // Step until all is done, noting when the free request finished and when the
    // constrained one got its first token.
    let (mut free_done, mut first, mut steps) = (None, None, 0u32);
    let (mut text, mut ended) = (Vec::new(), None);
    let start = Instant::now();
    while !e.is_idle() {
        assert!(start.elapsed() < Duration::from_secs(20), "no progress");
        if e.step() {
            steps += 1;
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
        while let Ok(ev) = free_rx.try_recv() {
            if matches!(ev, EngineEvent::Finished { .. }) {
                free_done.get_or_insert(steps);
            }
        }
        while let Ok(ev) = rx.try_recv() {
            match ev {
                EngineEvent::Tokens { tokens, .. } => {
                    first.get_or_insert(steps);
                    text.extend(tokens);
                }
                EngineEvent::Finished { reason, .. } => ended = Some(reason),
                EngineEvent::Failed { message, .. } => panic!("failed: {message}"),
                EngineEvent::PromptLogprobs { .. } => {}
            }
        }
    }
    let (free_done, first) = (free_done.unwrap(), first.unwrap());
    assert!(
        free_done < first,
        "the free request ran while the grammar compiled (it finished at step {free_done}, the \
         constrained one's first token came at step {first})"
    );
    assert_eq!(ended, Some(FinishReason::Stop));
    let body: Vec<u8> = text
        .iter()
        .filter(|&&t| t != eos)
        .map(|&t| t as u8)
        .collect();
    let body = String::from_utf8(body).unwrap();
    assert!(matches_ab_cd_x(&body), "{body:?}");
    let gone: Vec<EngineEvent> = std::iter::from_fn(|| gone_rx.try_recv().ok()).collect();
    assert!(
        matches!(
            gone.as_slice(),
            [EngineEvent::Finished {
                reason: FinishReason::Cancelled,
                ..
            }]
        ),
        "{gone:?}"
    );
}

/// Constrained responses (the native llguidance twin over a byte vocabulary): each response
/// is exactly what its grammar allows and ends with EOS, a bad grammar is refused at once, an
/// unconstrained request beside them gets the very tokens it gets alone, and the pipelined
/// engine (arrivals during a step) gives the same outputs as the step-by-step one. Masks are
/// computed while the forward pass of the step ahead runs where the executor splits its
/// launch, and the plan waits for the tokens where it does not: the same outputs either way.
#[test]
fn constrained_responses_follow_their_grammar_and_leave_others_alone() {
    use chimera::engine::Policies;
    use chimera::engine::api::{GenerateRequest, Grammar};
    use chimera::plugins::Vocabulary;
    use std::sync::Arc;

    // Tokens 0..256 are bytes; 256.. a few words; the last is EOS.
    let words = ["ab", "cd", "\"yes\"", "\"no\"", "true", "false"];
    let mut texts: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    texts.extend(words.iter().map(|w| w.as_bytes().to_vec()));
    let eos = texts.len() as u32;
    texts.push(b"<|end|>".to_vec());
    let vocab = texts.len();
    let vocabulary = Arc::new(Vocabulary::from_tokens(
        texts
            .iter()
            .enumerate()
            .map(|(i, t)| (&t[..], i as u32 == eos)),
        eos,
    ));
    let exec = |split_tail| {
        MockExecutor::new(MockConfig {
            vocab,
            eos: vec![eos],
            split_tail,
            ..MockConfig::default()
        })
    };
    // `lanes` > 1: the constraints spread over that many constrainers, a step's masks
    // computed on as many threads.
    let engine_lanes = |split, lanes: usize| {
        let exec = exec(split);
        let one = || chimera::policy::native::constrainer(&Default::default(), &vocabulary);
        let constrainer = match lanes {
            1 => one(),
            n => Box::new(chimera::policy::ConstraintLanes::new(
                (0..n).map(|_| one()).collect(),
            )) as Box<dyn chimera::policy::Constrainer>,
        };
        let policies = Policies {
            constrainer: Some(constrainer),
            ..Policies::builtin()
        };
        chimera::engine::Engine::new(setup(&exec, Knobs::default()), exec, policies).unwrap()
    };
    let engine_split = |split| engine_lanes(split, 1);
    let engine = || engine_split(true);
    let grammar = |kind: &str, text: &str| {
        Some(Grammar {
            kind: kind.into(),
            text: text.into(),
        })
    };
    let constrained = [
        (1u64, grammar("regex", "(ab|cd){3}x")),
        (
            2,
            grammar(
                "json-schema",
                r#"{"type":"object","properties":{"ok":{"type":"boolean"},"say":{"enum":["yes","no"]}},"required":["ok","say"],"additionalProperties":false}"#,
            ),
        ),
        (3, grammar("choice", r#"["true", "false"]"#)),
        (4, grammar("regex", "(")),
    ];
    let free = || request(9, Tokens::new(9).take(12, 256), 24);
    let requests = || {
        let mut all: Vec<(u64, GenerateRequest)> = constrained
            .iter()
            .map(|(id, g)| {
                let mut r = request(*id, Tokens::new(*id).take(10, 256), 300);
                r.constraint = g.clone();
                (0, r)
            })
            .collect();
        all.push((1, free()));
        all
    };
    let text = |tokens: &[u32]| {
        let bytes: Vec<u8> = tokens
            .iter()
            .filter(|&&t| t != eos)
            .flat_map(|&t| texts[t as usize].clone())
            .collect();
        String::from_utf8(bytes).unwrap()
    };

    let alone = drive(&mut engine(), vec![(0, free())]);
    let mut split = engine();
    let step_by_step = drive(&mut split, requests());
    let late = split.stats().late_masks;
    let pipelined = drive_arriving(&mut engine(), requests());
    let mut unsplit = engine_split(false);
    let waiting = drive(&mut unsplit, requests());
    let mut laned = engine_lanes(true, 3);
    let on_lanes = drive(&mut laned, requests());
    assert!(late > 0, "no mask was computed while a forward pass ran");
    assert_eq!(unsplit.stats().late_masks, 0);
    assert!(laned.stats().late_masks > 0);
    for run in [&step_by_step, &pipelined, &waiting, &on_lanes] {
        let o = &run.outcomes;
        for id in [1, 2, 3] {
            assert_eq!(
                o[&id].finish,
                Some(FinishReason::Stop),
                "{id}: {:?}",
                o[&id]
            );
            assert_eq!(o[&id].tokens.last(), Some(&eos), "{id} ends with EOS");
        }
        let regex = text(&o[&1].tokens);
        assert!(matches_ab_cd_x(&regex), "{regex:?}");
        let json: serde_json::Value = serde_json::from_str(&text(&o[&2].tokens)).unwrap();
        assert!(
            json["ok"].is_boolean() && ["yes", "no"].contains(&json["say"].as_str().unwrap()),
            "{json}"
        );
        assert!(["true", "false"].contains(&text(&o[&3].tokens).as_str()));
        let (kind, message) = o[&4].failed.clone().expect("a bad regex is refused");
        assert_eq!(kind, FailureKind::InvalidRequest);
        assert!(message.contains("regex"), "{message}");
        assert_eq!(
            o[&9].tokens, alone.outcomes[&9].tokens,
            "the free request is untouched"
        );
    }
    assert_eq!(step_by_step.tokens(), pipelined.tokens());
    assert_eq!(step_by_step.tokens(), waiting.tokens());
    assert_eq!(step_by_step.tokens(), on_lanes.tokens());
}
