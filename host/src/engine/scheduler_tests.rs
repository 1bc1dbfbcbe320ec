use tokio::sync::mpsc::unbounded_channel;

use super::*;
use crate::cache::CacheLayout;
use crate::engine::api::{FailureKind, GenerateRequest};

const BS: usize = 4;

fn setup(
    blocks: usize,
    budget: usize,
    chunked: bool,
) -> (Scheduler, CacheManager, SchedulerOutput) {
    let cfg = EngineConfig {
        max_batched_tokens: budget,
        max_running: 8,
        chunked_prefill: chunked,
        ..Default::default()
    };
    setup_with(cfg, blocks)
}

fn setup_with(cfg: EngineConfig, blocks: usize) -> (Scheduler, CacheManager, SchedulerOutput) {
    let layout = CacheLayout {
        block_size: BS,
        num_blocks: blocks,
        live_slots: 0,
        durable_slots: 0,
        kv_bytes: 0,
        ssm_bytes: 0,
    };
    (
        Scheduler::new(cfg, BS, HashSeed::new("t")),
        CacheManager::new(&layout, true, false, None),
        SchedulerOutput::default(),
    )
}

fn add(s: &mut Scheduler, id: u64, prompt: Vec<u32>, max_tokens: u32) {
    add_with_priority(s, id, prompt, max_tokens, 0);
}

fn add_with_priority(s: &mut Scheduler, id: u64, prompt: Vec<u32>, max_tokens: u32, priority: i32) {
    let (tx, _rx) = unbounded_channel();
    let req = GenerateRequest {
        priority,
        ..GenerateRequest::for_test(id, prompt, max_tokens)
    };
    s.add(|slot| Request::new(req, slot, tx.into()));
}

/// (request id, start, len) of each scheduled chunk.
fn plan(
    s: &mut Scheduler,
    c: &mut CacheManager,
    o: &mut SchedulerOutput,
) -> Vec<(u64, usize, usize)> {
    s.schedule(c, o);
    let seqs = o.seqs.clone();
    seqs.iter()
        .map(|q| (s.request(q.slot).unwrap().id, q.start, q.len))
        .collect()
}

/// Completes the step, sampling token 7 for every row.
fn finish_step(
    s: &mut Scheduler,
    c: &mut CacheManager,
    o: &mut SchedulerOutput,
) -> Vec<(u32, StopReason)> {
    let rows = o.seqs.iter().filter(|q| q.want_logits).count();
    let mut fin = Vec::new();
    s.launched(o);
    s.update_from_output(c, o, &vec![7; rows], &[], &mut fin, &mut Vec::new());
    c.commit_step();
    s.release(o, c);
    fin
}

#[test]
fn chunks_end_on_block_boundaries_and_never_leave_one_token() {
    let (mut s, mut c, mut o) = setup(64, 10, true);
    add(&mut s, 1, (0..21).collect(), 4);
    // Budget 10 → first chunk ends at 8 (block boundary).
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 0, 8)]);
    finish_step(&mut s, &mut c, &mut o);
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 8, 8)]);
    finish_step(&mut s, &mut c, &mut o);
    // 5 left, all fit: the final chunk.
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 16, 5)]);
    finish_step(&mut s, &mut c, &mut o);
    assert_eq!(
        plan(&mut s, &mut c, &mut o),
        vec![(1, 21, 1)],
        "then decode"
    );
    // 17 tokens with budget 16: 16 would leave 1, so the chunk backs off to 12.
    let (mut s, mut c, mut o) = setup(64, 16, true);
    add(&mut s, 2, (100..117).collect(), 4);
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(2, 0, 12)]);
    finish_step(&mut s, &mut c, &mut o);
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(2, 12, 5)]);
}

#[test]
fn decodes_and_prefill_chunks_share_a_step() {
    let (mut s, mut c, mut o) = setup(64, 12, true);
    add(&mut s, 1, vec![1, 2, 3], 8);
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 0, 3)]);
    finish_step(&mut s, &mut c, &mut o);
    add(&mut s, 2, (10..40).collect(), 8);
    // Decode of 1 first, then 11 tokens of budget: chunk to the boundary at 8.
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 3, 1), (2, 0, 8)]);
}

#[test]
fn without_chunking_a_prompt_runs_whole_or_waits() {
    let (mut s, mut c, mut o) = setup(64, 12, false);
    add(&mut s, 1, (0..10).collect(), 8);
    add(&mut s, 2, (50..58).collect(), 8);
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 0, 10)]);
    finish_step(&mut s, &mut c, &mut o);
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 10, 1), (2, 0, 8)]);
    add(&mut s, 3, (0..13).collect(), 8);
    finish_step(&mut s, &mut c, &mut o);
    s.schedule(&mut c, &mut o);
    let rej = s.take_rejected();
    assert_eq!(rej.len(), 1);
    assert_eq!(rej[0].kind, FailureKind::PromptTooLong);
}

#[test]
fn same_step_shared_prefix_waits_one_step_then_hits() {
    let (mut s, mut c, mut o) = setup(64, 64, true);
    let shared: Vec<u32> = (0..12).collect();
    add(&mut s, 1, [shared.clone(), vec![90, 91]].concat(), 4);
    add(&mut s, 2, [shared.clone(), vec![80, 81, 82]].concat(), 4);
    add(&mut s, 3, vec![5, 5, 5, 5, 5, 5], 4);
    // 2 shares 1's uncached prefix: it waits; 3 is unrelated and goes ahead.
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 0, 14), (3, 0, 6)]);
    assert_eq!(o.deferred, vec![2]);
    finish_step(&mut s, &mut c, &mut o);
    let p = plan(&mut s, &mut c, &mut o);
    assert!(
        p.contains(&(2, 12, 3)),
        "{p:?}: request 2 skips the 12 cached tokens"
    );
    assert_eq!(s.request(o.seqs[2].slot).unwrap().cached_tokens, 12);
}

#[test]
fn pause_then_evict_to_front_when_nothing_can_run() {
    // 4 blocks of 4 tokens. Two requests of 7 tokens take 2 blocks each.
    let (mut s, mut c, mut o) = setup(4, 32, true);
    // 7 + 9 tokens: each fits the 4-block cache alone, not both together.
    add(&mut s, 1, (0..7).collect(), 9);
    add(&mut s, 2, (10..17).collect(), 9);
    assert_eq!(plan(&mut s, &mut c, &mut o).len(), 2);
    finish_step(&mut s, &mut c, &mut o);
    // Both decode the 8th token into their second block: no new block needed.
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 7, 1), (2, 7, 1)]);
    finish_step(&mut s, &mut c, &mut o);
    // Now each needs a third block; none is free: both pause, the newest (2) is evicted and
    // its blocks let 1 resume in the same step.
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 8, 1)]);
    let out = &o;
    assert_eq!(out.evicted, vec![2]);
    assert_eq!(out.resumed, vec![1]);
    assert_eq!(s.num_waiting(), 1);
    assert_eq!(s.preemptions, 1);
    finish_step(&mut s, &mut c, &mut o);
    // While 1 runs, 2 waits at the queue front; its prompt is now 9 tokens (7 + 2 generated).
    let slot2 = s.waiting[0];
    assert_eq!(s.request(slot2).unwrap().prompt_len, 9);
    assert_eq!(s.request(slot2).unwrap().hashes.len(), 2);
    c.check_invariants().unwrap();
}

#[test]
fn prompt_larger_than_the_cache_fails_clearly() {
    let (mut s, mut c, mut o) = setup(4, 64, true);
    add(&mut s, 1, (0..17).collect(), 2);
    assert!(plan(&mut s, &mut c, &mut o).is_empty());
    let rej = s.take_rejected();
    assert_eq!(rej[0].kind, FailureKind::PromptTooLong);
    assert!(
        rej[0].message.contains("cache holds 4"),
        "{}",
        rej[0].message
    );
    assert!(s.is_idle());
}

#[test]
fn a_request_that_could_never_fit_is_refused_before_it_runs() {
    // 5 prompt tokens + 12 to generate = 17 tokens: one more than the 4 blocks of 4 hold, so it
    // is refused at admission instead of running until it has filled the cache.
    let (mut s, mut c, mut o) = setup(4, 64, true);
    add(&mut s, 1, (0..5).collect(), 12);
    add(&mut s, 2, (0..5).collect(), 11);
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(2, 0, 5)]);
    let rej = s.take_rejected();
    assert_eq!(rej.len(), 1);
    assert_eq!(rej[0].request.id, 1);
    assert_eq!(rej[0].kind, FailureKind::PromptTooLong);
    assert!(
        rej[0]
            .message
            .contains("the prompt (5 tokens) and max_tokens (12) need 5 KV blocks but the cache holds 4 (16 tokens)"),
        "{}",
        rej[0].message
    );
}

#[test]
fn the_priority_policy_admits_lower_priorities_first_then_by_arrival() {
    let order = |policy: &str| {
        let cfg = EngineConfig {
            max_batched_tokens: 4,
            max_running: 8,
            chunked_prefill: false,
            scheduling_policy: policy.into(),
            ..Default::default()
        };
        let (mut s, mut c, mut o) = setup_with(cfg, 64);
        for (id, prio) in [(1, 5), (2, 0), (3, 3), (4, 0), (5, -1)] {
            add_with_priority(
                &mut s,
                id,
                (0..4).map(|t| t + 10 * id as u32).collect(),
                1,
                prio,
            );
        }
        let mut admitted = Vec::new();
        while admitted.len() < 5 {
            for (id, start, _) in plan(&mut s, &mut c, &mut o) {
                if start == 0 {
                    admitted.push(id);
                }
            }
            finish_step(&mut s, &mut c, &mut o);
        }
        admitted
    };
    assert_eq!(order("fcfs"), vec![1, 2, 3, 4, 5]);
    assert_eq!(order("priority"), vec![5, 2, 4, 3, 1]);
}

#[test]
fn under_the_priority_policy_the_worst_priority_is_preempted() {
    let cfg = EngineConfig {
        max_batched_tokens: 32,
        max_running: 8,
        scheduling_policy: "priority".into(),
        ..Default::default()
    };
    // As in the FCFS preemption test, but the newer request has the better priority: the
    // older one (priority 2) is evicted, not the newest.
    let (mut s, mut c, mut o) = setup_with(cfg, 4);
    add_with_priority(&mut s, 1, (0..7).collect(), 9, 2);
    add_with_priority(&mut s, 2, (10..17).collect(), 9, 1);
    assert_eq!(plan(&mut s, &mut c, &mut o).len(), 2);
    finish_step(&mut s, &mut c, &mut o);
    assert_eq!(plan(&mut s, &mut c, &mut o).len(), 2);
    finish_step(&mut s, &mut c, &mut o);
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(2, 8, 1)]);
    assert_eq!(o.evicted, vec![1]);
}

#[test]
fn removing_a_request_releases_every_block() {
    let (mut s, mut c, mut o) = setup(16, 64, true);
    add(&mut s, 1, (0..30).collect(), 5);
    plan(&mut s, &mut c, &mut o);
    finish_step(&mut s, &mut c, &mut o);
    assert!(c.available_blocks() < 16);
    let r = s.remove(1, &mut c).unwrap();
    assert_eq!(r.id, 1);
    assert_eq!(c.available_blocks(), 16);
    assert!(s.is_idle());
    c.check_invariants().unwrap();
}

#[test]
fn max_tokens_and_stop_tokens_finish() {
    let (mut s, mut c, mut o) = setup(16, 64, true);
    add(&mut s, 1, vec![1, 2, 3], 2);
    plan(&mut s, &mut c, &mut o);
    assert!(finish_step(&mut s, &mut c, &mut o).is_empty());
    plan(&mut s, &mut c, &mut o);
    assert_eq!(
        finish_step(&mut s, &mut c, &mut o),
        vec![(0, StopReason::Length)]
    );
    let (tx, _rx) = unbounded_channel();
    let req = GenerateRequest {
        stop_token_ids: vec![7],
        ..GenerateRequest::for_test(9, vec![4, 5], 10)
    };
    s.add(|slot| Request::new(req, slot, tx.into()));
    plan(&mut s, &mut c, &mut o);
    let fin = finish_step(&mut s, &mut c, &mut o);
    assert!(fin.iter().any(|&(_, r)| r == StopReason::Stop));
}

#[test]
fn prompt_logprob_requests_take_bounded_chunks_with_every_logit() {
    let (mut s, mut c, mut o) = setup(256, 2048, true);
    let (tx, _rx) = unbounded_channel();
    let req = GenerateRequest {
        prompt_logprobs: Some(0),
        ..GenerateRequest::for_test(1, (0..300).collect(), 2)
    };
    s.add(|slot| Request::new(req, slot, tx.into()));
    add(&mut s, 2, (1000..1300).collect(), 2);
    // The plain request takes its whole prompt; the scoring one at most 128 tokens a step,
    // every chunk asking for all its logits.
    assert_eq!(plan(&mut s, &mut c, &mut o), vec![(1, 0, 128), (2, 0, 300)]);
    let flags: Vec<(bool, bool)> = o
        .seqs
        .iter()
        .map(|q| (q.all_logits, q.want_logits))
        .collect();
    assert_eq!(flags, vec![(true, false), (false, true)]);
    finish_step(&mut s, &mut c, &mut o);
    let first = |p: Vec<(u64, usize, usize)>| p.into_iter().find(|q| q.0 == 1);
    assert_eq!(first(plan(&mut s, &mut c, &mut o)), Some((1, 128, 128)));
    finish_step(&mut s, &mut c, &mut o);
    assert_eq!(first(plan(&mut s, &mut c, &mut o)), Some((1, 256, 44)));
    let last = o.seqs.iter().find(|q| q.start == 256).unwrap();
    assert!(last.all_logits && last.want_logits);
}

#[test]
fn adopted_hashes_replace_hashing_only_when_they_are_this_schedulers_chain() {
    let (mut s, mut c, mut o) = setup(64, 64, true);
    let prompt: Vec<u32> = (0..10).collect();
    let mut chain = Vec::new();
    HashSeed::new("t").extend(&mut chain, &prompt, BS);
    let mut other = Vec::new();
    HashSeed::new("another salt").extend(&mut other, &prompt, BS);
    add(&mut s, 1, prompt.clone(), 4);
    assert!(!s.adopt_hashes(1, &chain[..1]), "one block short");
    assert!(!s.adopt_hashes(1, &other), "another salt");
    assert!(!s.adopt_hashes(9, &chain), "no such request");
    assert_eq!(s.blocks_hashed, 1, "the salt check hashed the first block");
    assert!(s.adopt_hashes(1, &chain));
    assert_eq!(s.blocks_hashed, 2);
    plan(&mut s, &mut c, &mut o);
    assert_eq!(s.blocks_hashed, 2, "admission hashed nothing more");
    assert!(!s.adopt_hashes(1, &chain), "only a waiting request adopts");
    // Without adopted hashes, admission hashes every full block.
    add(&mut s, 2, (20..30).collect(), 4);
    plan(&mut s, &mut c, &mut o);
    assert_eq!(s.blocks_hashed, 4);
}
