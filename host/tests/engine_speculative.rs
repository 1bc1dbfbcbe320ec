//! Speculative decoding with the model-free mock executor, whose logits hash the whole context
//! read back through the block tables and the live SSM state: a verify step that rolls back
//! wrongly (a stale recurrent state, a rejected position's KV read as context, a block hash
//! over a rejected token) changes every later token. With any drafts the output must be the
//! same tokens and logprobs as without speculation, greedy and seeded sampling alike.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use crate::engine_common;

use chimera::engine::api::{FinishReason, GenerateRequest};
use chimera::engine::speculative::{Drafter, NgramDrafter, SpeculativeConfig};
use chimera::engine::{Engine, MockExecutor, Policies, StepExecutor};
use engine_common::*;

const VOCAB: u32 = 64;

/// Proposes each request's known continuation (from a run without speculation), with about
/// one draft in `1 / wrong` replaced by another token, and sometimes fewer drafts than asked.
struct Oracle {
    answers: BTreeMap<u64, Vec<u32>>,
    prompts: BTreeMap<u64, usize>,
    wrong: u64,
    calls: u64,
}

impl Drafter for Oracle {
    fn propose(&mut self, id: u64, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        self.calls += 1;
        let (Some(answer), Some(&prompt)) = (self.answers.get(&id), self.prompts.get(&id)) else {
            return;
        };
        // After a preemption the output is part of the prompt: positions still line up.
        let at = tokens.len() - prompt;
        let mut x = mix(id, tokens.len() as u64);
        let k = if x.is_multiple_of(5) {
            k.min(1 + (x as usize >> 8) % k)
        } else {
            k
        };
        for j in 0..k {
            let Some(&t) = answer.get(at + j) else {
                return;
            };
            x = mix(x, j as u64);
            out.push(if x.is_multiple_of(self.wrong) {
                (t + 1 + (x >> 20) as u32 % (VOCAB - 1)) % VOCAB
            } else {
                t
            });
        }
    }
}

fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn spec(k: usize, max_batch: usize) -> SpeculativeConfig {
    SpeculativeConfig {
        method: "ngram".into(),
        num_tokens: k,
        max_batch,
        ..Default::default()
    }
}

/// An engine with speculation `s` over `exec`: sized as `knobs` says, with the draft slots a
/// hybrid needs on top.
fn spec_engine(exec: MockExecutor, knobs: Knobs, s: &SpeculativeConfig) -> Engine<MockExecutor> {
    let hybrid = exec.cache_spec().is_hybrid();
    let draft = if hybrid {
        s.draft_slots(knobs.max_running)
    } else {
        0
    };
    let mut setup = setup(
        &exec,
        Knobs {
            max_running: knobs.max_running + draft,
            max_batched_tokens: knobs.max_batched_tokens.max(knobs.max_running + draft),
            ..knobs
        },
    );
    setup.engine.max_running = knobs.max_running;
    setup.engine.max_batched_tokens = knobs.max_batched_tokens;
    setup.speculative = s.clone();
    let e = Engine::new(setup, exec, Policies::builtin()).expect("engine");
    assert_eq!(e.layout().num_blocks, knobs.blocks);
    e
}

/// Mixed requests: greedy and seeded sampling, penalties, logprobs, stop tokens under
/// `min_tokens`, long enough for many verify steps.
fn workload(seed: u64, n: usize) -> Vec<(u64, GenerateRequest)> {
    let mut work = shared_prefix_workload(seed, n, VOCAB);
    for (_, r) in work.iter_mut() {
        r.max_tokens = 12 + (r.id as u32 * 7) % 20;
        r.ignore_eos = r.id % 4 != 0;
        match r.id % 5 {
            0 => {}
            1 => {
                r.params.temperature = 0.9;
                r.params.seed = Some(r.id * 31);
            }
            2 => {
                r.params.temperature = 1.0;
                r.params.top_p = 0.9;
                r.params.repetition_penalty = 1.3;
                r.params.frequency_penalty = 0.4;
                r.params.logprobs = Some(2);
            }
            3 => {
                r.params.presence_penalty = 0.5;
                r.params.logprobs = Some(1);
                r.stop_token_ids = vec![5, 9];
                r.params.min_tokens = 3;
            }
            _ => {
                r.params.temperature = 0.7;
                r.params.seed = Some(7);
                r.params.min_tokens = 2;
            }
        }
    }
    work
}

fn knob_sets() -> Vec<(&'static str, Knobs)> {
    let base = Knobs::default();
    vec![
        ("roomy", base),
        (
            "small token budget",
            Knobs {
                max_batched_tokens: 12,
                max_running: 4,
                ..base
            },
        ),
        (
            "few blocks (preemption)",
            Knobs {
                blocks: 16,
                max_batched_tokens: 16,
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
        (
            "no prefix caching",
            Knobs {
                prefix_caching: false,
                ..base
            },
        ),
    ]
}

fn same_output_with_drafts(make: fn() -> MockExecutor) {
    let work = workload(11, 20);
    let prompts: BTreeMap<u64, usize> = work.iter().map(|(_, r)| (r.id, r.prompt.len())).collect();
    for (name, k) in knob_sets() {
        let mut base = engine(make(), k);
        let baseline = drive(&mut base, work.clone());
        assert!(
            baseline.outcomes.values().all(|o| o.failed.is_none()),
            "{name}"
        );
        let answers: BTreeMap<u64, Vec<u32>> = baseline.tokens();
        for (drafts, wrong) in [(1, 3), (3, 4), (5, 2)] {
            let s = spec(drafts, 8);
            let mut e = spec_engine(make(), k, &s);
            e.set_drafter(
                s.clone(),
                Box::new(Oracle {
                    answers: answers.clone(),
                    prompts: BTreeMap::clone(&prompts),
                    wrong,
                    calls: 0,
                }),
            );
            let run = drive(&mut e, work.clone());
            for (id, o) in &run.outcomes {
                let b = &baseline.outcomes[id];
                assert!(
                    o.failed.is_none(),
                    "{name}, k={drafts}: {id} failed: {:?}",
                    o.failed
                );
                assert_eq!(o.tokens, b.tokens, "{name}, k={drafts}: tokens of {id}");
                assert_eq!(o.finish, b.finish, "{name}, k={drafts}: finish of {id}");
                assert_eq!(
                    o.logprobs, b.logprobs,
                    "{name}, k={drafts}: logprobs of {id}"
                );
                assert_eq!(o.usage.completion_tokens, b.usage.completion_tokens);
            }
            let st = e.stats();
            assert_eq!(
                st.free_blocks, st.total_blocks,
                "{name}: blocks left in use"
            );
            assert!(
                st.spec_drafts > 0,
                "{name}, k={drafts}: nothing was verified"
            );
            assert!(
                st.spec_accepted_tokens > 0 && st.spec_accepted_tokens < st.spec_draft_tokens,
                "{name}, k={drafts}: {} of {} drafts accepted: the test needs both outcomes",
                st.spec_accepted_tokens,
                st.spec_draft_tokens
            );
            // Fewer steps: drafts were accepted in bulk (with a token budget of a few
            // tokens, drafts take room from prompts instead).
            assert!(
                k.max_batched_tokens < 64 || run.steps < baseline.steps,
                "{name}, k={drafts}: {} vs {} steps",
                run.steps,
                baseline.steps
            );
        }
    }
}

#[test]
fn transformer_output_is_the_same_with_drafts() {
    same_output_with_drafts(MockExecutor::transformer);
}

#[test]
fn hybrid_output_is_the_same_with_drafts() {
    same_output_with_drafts(MockExecutor::hybrid);
}

/// Prompt lookup (1- to 3-grams: the mock's output is random, longer n-grams seldom recur):
/// the output is unchanged, the counters add up, and a request that opts out is never
/// verified.
#[test]
fn ngram_drafts_on_repetitive_text() {
    for make in [
        MockExecutor::transformer as fn() -> MockExecutor,
        MockExecutor::hybrid,
    ] {
        let mut work = Vec::new();
        for i in 0..6u64 {
            let unit: Vec<u32> = (0..5).map(|j| ((i * 7 + j * 3) % 60 + 1) as u32).collect();
            let prompt: Vec<u32> = unit.iter().cycle().take(23).copied().collect();
            let mut r = request(i, prompt, 24);
            r.ignore_eos = true;
            r.speculative = i != 5;
            work.push((i, r));
        }
        let mut base = engine(make(), Knobs::default());
        let baseline = drive(&mut base, work.clone());
        let s = spec(4, 8);
        let mut e = spec_engine(make(), Knobs::default(), &s);
        e.set_drafter(s.clone(), Box::new(NgramDrafter { min: 1, max: 3 }));
        let run = drive(&mut e, work.clone());
        assert_eq!(run.tokens(), baseline.tokens());
        let st = e.stats();
        assert!(st.spec_drafts > 0);
        let per_pos: u64 = st.spec_accepted_per_pos.iter().sum();
        assert_eq!(per_pos, st.spec_accepted_tokens);
        assert!(
            st.spec_accepted_per_pos.windows(2).all(|w| w[0] >= w[1]),
            "a draft is accepted only after the ones before it: {:?}",
            st.spec_accepted_per_pos
        );
        // Every request's tokens are counted once.
        let total: u64 = run.outcomes.values().map(|o| o.tokens.len() as u64).sum();
        assert_eq!(st.generation_tokens, total);
    }
}

/// Cancellations at random steps, mid-verify included: every block and slot comes back.
#[test]
fn cancelling_mid_speculation_leaves_nothing_behind() {
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
        let s = spec(3, 8);
        let mut e = spec_engine(make(), k, &s);
        e.set_drafter(s.clone(), Box::new(NgramDrafter { min: 1, max: 2 }));
        let mut work = shared_prefix_workload(5, 64, VOCAB);
        for (_, r) in &mut work {
            r.max_tokens = 40;
            r.ignore_eos = true;
        }
        let mut x = 99u64;
        let run = drive_with(&mut e, work, |e, _| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            if (x >> 33).is_multiple_of(3) {
                e.cancel((x >> 40) % 64);
            }
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
        let st = e.stats();
        assert!(st.spec_drafts > 0, "nothing was verified");
        assert_eq!((st.running, st.waiting, st.paused), (0, 0, 0));
        assert_eq!(st.free_blocks, st.total_blocks);
        assert_eq!(e.cache().pool().available(), e.cache().pool().total());
        let hybrid = make().cache_spec().is_hybrid();
        assert_eq!(e.cache().ssm().live_free(), if hybrid { 6 } else { 0 });
        assert_eq!(
            e.cache().ssm().draft_free(),
            e.cache().ssm().draft_total() as usize,
            "draft slots left lent"
        );
    }
}
